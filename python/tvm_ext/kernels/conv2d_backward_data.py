"""The data gradient of a convolution as forward convolutions of dY (oneDNN's and LIBXSMM's
decomposition), never a convolution of a dY with zeros inserted (TOPI's `conv2d_transpose`: 75%
of the multiply-adds on zeros at stride 2).

- stride 1: dX = conv2d(dY, W'), W' the weights with the filter flipped and the input and output
  channels of each group swapped, padded by dilation * (KH - 1) - padding;
- stride s: the s_h x s_w phases of dX (rows a, a + s_h, ...; columns likewise) each read only
  the filter taps r with (a + pad - r * dilation) divisible by s, at consecutive rows of dY: each
  phase is a dense stride-1 convolution of dY with those taps (dilation / gcd(dilation, s)),
  written into every s-th pixel of dX. Phases that no tap reaches are zero.

This module is the arithmetic of that plan (which taps, which window of dY, which padding), for
the eager gradient (:func:`tvm_ext.ops.conv2d_backward_data`) and the graph's
(:mod:`tvm_ext.transform.gradients`), which run the phases on the forward kernels.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence

from tvm import s_tir, te, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from .common import KERNEL_ATTR, accept_user_alignment, param_buffer, with_border
from .conv2d import Conv2dPlan, Conv2dWorkload

__all__ = ["DataGradPhase", "data_gradient_phases", "interleave_phases_func", "pack_phase_weight_func",
           "phase_weight_func"]


@dataclasses.dataclass(frozen=True)
class DataGradPhase:
    """One phase (a, b) of dX: rows a, a + s_h, ...; columns b, b + s_w, ...

    Its pixels are the stride-1 convolution, with `padding` (top, left, bottom, right) and
    `dilation`, of dY[:, :, rows[0]:rows[1], cols[0]:cols[1]] with the swapped weights' taps
    `taps_h` x `taps_w` (in that order); `shape` is its (rows, columns) of dX. Without taps
    (`taps_h` or `taps_w` empty) or without a row of dY to read, the phase is zero.
    """

    a: int
    b: int
    shape: tuple[int, int]
    taps_h: tuple[int, ...]
    taps_w: tuple[int, ...]
    rows: tuple[int, int]  # [start, stop) of dY's rows
    cols: tuple[int, int]
    padding: tuple[int, int, int, int]
    dilation: tuple[int, int]

    @property
    def zero(self) -> bool:
        return not self.taps_h or not self.taps_w or self.rows[1] <= self.rows[0] or self.cols[1] <= self.cols[0]


def _taps(phase: int, pad: int, kernel: int, dilation: int, stride: int) -> tuple[list[int], int, int]:
    """(filter taps, first offset into dY, dilation) of one phase along one axis: the taps r,
    ordered by the row of dY they read, (phase + pad - r * dilation) / stride, which grows by
    dilation / gcd(dilation, stride) from one tap to the next."""
    taps = [r for r in range(kernel) if (phase + pad - r * dilation) % stride == 0]
    taps.sort(key=lambda r: (phase + pad - r * dilation) // stride)
    first = (phase + pad - taps[0] * dilation) // stride if taps else 0
    return taps, first, dilation // math.gcd(dilation, stride)


def _window(outputs: int, first: int, taps: int, step: int, available: int) -> tuple[int, int, int, int]:
    """(rows of dY to skip, rows to keep, zero rows before, after) for a stride-1 convolution of
    `taps` taps `step` apart that makes `outputs` rows, output row i reading dY row i + first +
    j * step for tap j."""
    skip, before = max(first, 0), max(-first, 0)
    needed = outputs - 1 + (taps - 1) * step + 1 - before  # rows of dY from `skip` on
    keep = min(needed, available - skip)
    return skip, keep, before, needed - keep


def data_gradient_phases(wl: Conv2dWorkload) -> list[DataGradPhase]:
    """The phases of dX of workload `wl` (its N is irrelevant): one at stride 1, s_h x s_w at
    stride s (fewer where the image has fewer rows or columns than the stride)."""
    (sh, sw), (dh, dw), (top, left, _, _) = wl.stride, wl.dilation, wl.padding
    phases = []
    for a in range(min(sh, wl.H)):
        taps_h, first_h, step_h = _taps(a, top, wl.KH, dh, sh)
        out_h = -(-(wl.H - a) // sh)
        for b in range(min(sw, wl.W)):
            taps_w, first_w, step_w = _taps(b, left, wl.KW, dw, sw)
            out_w = -(-(wl.W - b) // sw)
            skip_h, keep_h, pad_top, pad_bottom = _window(out_h, first_h, len(taps_h), step_h, wl.OH)
            skip_w, keep_w, pad_left, pad_right = _window(out_w, first_w, len(taps_w), step_w, wl.OW)
            phases.append(DataGradPhase(a, b, (out_h, out_w), tuple(taps_h), tuple(taps_w),
                                        (skip_h, skip_h + keep_h), (skip_w, skip_w + keep_w),
                                        (pad_top, pad_left, pad_bottom, pad_right), (step_h, step_w)))
    return phases



def _tap(index, taps: list[int]):
    """taps[index] as an expression: a select chain (the taps are few)."""
    value = tirx.const(taps[-1], "int32")
    for i in range(len(taps) - 2, -1, -1):
        value = tirx.Select(index == i, tirx.const(taps[i], "int32"), value)
    return value


def pack_phase_weight_func(plan: Conv2dPlan, w_shape: Sequence[int], taps_h: Sequence[int],
                           taps_w: Sequence[int]) -> tirx.PrimFunc:
    """A phase convolution's blocked weights (`plan`'s, groups=1) straight from the forward
    convolution's OIHW weights (K, C, KH, KW): block (ob, ib), tap (r, s) lane (i, o) is
    W[ib * x + i, ob * y + o, taps_h[r], taps_w[s]] (zero past C). In a graph this replaces stock
    TVM's reshape, transpose and two takes and the blocked packing after them: four passes over
    the weights, 45 of a ResNet-50 training step's 1200 ms."""
    k, c, kh, kw = (int(v) for v in w_shape)
    wl = plan.wl
    if wl.groups != 1 or plan.kind in ("depthwise", "grouped") or (wl.K, wl.C) != (c, k):
        raise ValueError(f"pack_phase_weight: a {plan.kind} plan of {wl.C} -> {wl.K} channels does not read "
                         f"OIHW weights {tuple(w_shape)} swapped")
    rows, cols = [int(t) for t in taps_h], [int(t) for t in taps_w]
    if (len(rows), len(cols)) != (wl.KH, wl.KW) or not all(0 <= t < kh for t in rows) or \
            not all(0 <= t < kw for t in cols):
        raise ValueError(f"pack_phase_weight: taps {rows} x {cols} of a {kh}x{kw} filter for {wl.KH}x{wl.KW}")
    w = te.placeholder((k, c, kh, kw), "float32", name="weight")

    def body(ob, ib, r, s, i, o):
        channel = ob * plan.oc_bn + o  # the forward's input channel: this convolution's output channel
        value = w[ib * plan.ic_bn + i, tirx.min(channel, c - 1), _tap(r, rows), _tap(s, cols)]
        return tirx.if_then_else(channel < c, value, tirx.const(0.0, "float32")) if plan.K_pad > c else value

    out = te.compute(plan.weight_shape(), body, name="weight_blocked")
    sch = s_tir.Schedule(accept_user_alignment(te.create_prim_func([w, out]), "weight"))
    ob, ib, r, s, i, o = sch.get_loops(sch.get_sblock("weight_blocked"))
    sch.parallel(sch.fuse(ob, ib))
    return sch.mod["main"].with_attr(KERNEL_ATTR, "pack_phase_weight")


def phase_weight_func(w_shape: Sequence[int], groups: int, taps_h: Sequence[int],
                      taps_w: Sequence[int]) -> tirx.PrimFunc:
    """OIHW weights (K, C/groups, KH, KW) -> a phase's weights (C, K/groups, len(taps_h),
    len(taps_w)): each group's channels in and out swapped, the taps picked in the phase's order.
    In NumPy (a transpose, then fancy indexing) this took 9.5 of a 13.4 ms data gradient of a
    512-channel 3x3 layer at 7x7."""
    k, cg, kh, kw = (int(v) for v in w_shape)
    kg = k // groups
    rows, cols = [int(t) for t in taps_h], [int(t) for t in taps_w]
    w = te.placeholder((k, cg, kh, kw), "float32", name="weight")
    out = te.compute((groups * cg, kg, len(rows), len(cols)),
                     lambda c, j, r, s: w[c // cg * kg + j, c % cg, _tap(r, rows), _tap(s, cols)], name="phase_weight")
    sch = s_tir.Schedule(accept_user_alignment(te.create_prim_func([w, out]), "weight"))
    # Tiles of 32 x 32 (channel in, channel out): both the rows read and the rows written stay in
    # cache (a 1x1 layer's swap is a transpose: row by row it read a column of 2048 rows per row).
    c, j, r, s = sch.get_loops(sch.get_sblock("phase_weight"))
    c_outer, c_inner = sch.split(c, [None, min(32, groups * cg)])
    j_outer, j_inner = sch.split(j, [None, min(32, kg)])
    sch.reorder(c_outer, j_outer, j_inner, c_inner, r, s)
    sch.parallel(c_outer)
    return sch.mod["main"].with_attr(KERNEL_ATTR, "phase_weight")


# The JSON arguments an interleave kernel was generated from, to rebuild it (strategy.borders).
INTERLEAVE_ATTR = "tvm_ext.interleave_phases"


def interleave_phases_func(out_shape: Sequence[int], stride: tuple[int, int],
                           phases: Sequence[Sequence[int] | None], relu_mask: bool = False,
                           mask_pad: Sequence[int] = (0, 0, 0, 0)) -> tirx.PrimFunc:
    """dX (N, C/c, H, W, c) from its phases in blocks: phase (a, b) (row-major over the stride,
    None where it is zero) is (N, C/c, rows, cols, c) and fills pixels (a + s_h * q, b + s_w * p).
    Parameters: the non-zero phases in order, [the activation's output y, with `relu_mask`:
    where(y > 0, dX, 0); with a zero border `mask_pad` (top, left, bottom, right) around it, as the
    padded copy a convolution reads], then dX. One task per image's channel block and phase, the
    block's channels in vectors: each pixel of dX is written once (a zero phase's with zeros)."""
    n, blocks, h, w, block = (int(v) for v in out_shape)
    sh, sw = stride
    top, left = (int(p) for p in mask_pad[:2])
    described = json.dumps({"out_shape": [n, blocks, h, w, block], "stride": [sh, sw],
                            "phases": [None if p is None else [int(v) for v in p] for p in phases]})
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("interleave_phases")
        T.func_attr({"tirx.noalias": True, KERNEL_ATTR: "interleave_phases", INTERLEAVE_ATTR: described})
        inputs = [None if shape is None else param_buffer(f"phase{i}", (n, blocks, shape[2], shape[3], block))
                  for i, shape in enumerate(phases)]
        y = param_buffer("y", with_border(out_shape, mask_pad)) if relu_mask else None
        dx = param_buffer("dx", (n, blocks, h, w, block))
        for index, (source, shape) in enumerate(zip(inputs, phases, strict=True)):
            a, b = index // sw, index % sw
            rows, cols = -(-(h - a) // sh), -(-(w - b) // sw)
            with T.sblock(f"phase{index}" if index else "root"), T.parallel(0, n * blocks) as task:
                image, cb = T.Bind(task // blocks), T.Bind(task % blocks)
                with T.grid(rows, cols) as (q, p), T.vectorized(0, block) as c:
                    row, col = a + q * sh, b + p * sw
                    if source is None or shape is None:
                        value = T.float32(0)
                    else:  # a phase's convolution may cover fewer pixels than its share of dX
                        value = tirx.if_then_else(tirx.all(q < shape[2], p < shape[3]),
                                                  source[image, cb, q, p, c], T.float32(0))
                    if y is not None:
                        value = tirx.Select(y[image, cb, row + top, col + left, c] > T.float32(0), value,
                                            T.float32(0))
                    T.buffer_store(dx, value, [image, cb, row, col, c])
    return builder.get()
