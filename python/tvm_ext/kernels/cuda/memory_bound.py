"""Memory-bound CUDA kernels of the graph strategy: layout changes, pooling, activations.

Activations travel between tvm_ext's CUDA kernels in CHWN (the maxDNN convolution's layout);
these kernels change layout at the graph's edges and pool or activate in CHWN without leaving it.
Each output element is one thread (the image index innermost, so a warp's loads and stores are
contiguous in CHWN); a pooling window is reduced in registers, borders handled in the index
expressions (no padded copy), as the CPU kernels do.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

from tvm import s_tir, te, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from ..common import param_buffer
from ..conv2d import KERNEL_ATTR
from ..elementwise import flat_activation_func
from ..pool2d import Pool2dWorkload, max_identity, nan_max_reducer
from ..pool2d_backward import window_count

THREADS = 256  # per block: enough warps to hide memory latency, small enough for full occupancy


def bind_threads(func: tirx.PrimFunc, kernel: str, reducer: str | None = None) -> tirx.PrimFunc:
    """One thread per element of the "output" block (its spatial loops fused); a reduction (the
    window) runs inside the thread, `reducer` (a separate reduction block) too, in registers."""
    sch = s_tir.Schedule(func)
    out = sch.get_sblock("output")
    spatial = sum(1 for iv in sch.get(out).iter_vars if iv.iter_type == tirx.IterVar.DataPar)
    fused = sch.fuse(*sch.get_loops(out)[:spatial])  # TE puts the spatial loops first
    bx, tx = sch.split(fused, [None, THREADS])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    if reducer is not None:
        sch.compute_at(sch.get_sblock(reducer), tx)
        sch.set_scope(sch.get_sblock(reducer), 0, "local")
    return sch.mod["main"].with_attr(KERNEL_ATTR, kernel)


def transpose_func(shape, axes, kernel: str = "transpose") -> tirx.PrimFunc:
    """out = permute_dims(x, axes) for a float32 tensor of `shape` (e.g. NCHW -> CHWN)."""
    shape = tuple(int(v) for v in shape)
    x = te.placeholder(shape, "float32", name="data")
    out_shape = tuple(shape[a] for a in axes)

    def value(*idx):
        src = [None] * len(shape)
        for i, a in enumerate(axes):
            src[a] = idx[i]
        return x[tuple(src)]

    y = te.compute(out_shape, value, name="output")
    return bind_threads(te.create_prim_func([x, y]), kernel)


NCHW_TO_CHWN = (1, 2, 3, 0)
CHWN_TO_NCHW = (3, 0, 1, 2)


@contextlib.contextmanager
def thread_per_element(count: int) -> Iterator[tirx.PrimExpr]:
    """The flat index of this thread's element over a grid of :data:`THREADS`-thread blocks (an
    IRBuilder frame); the body runs only for indices below `count`."""
    blocks = -(-count // THREADS)
    with T.thread_binding(0, blocks, thread="blockIdx.x") as bx, \
            T.thread_binding(0, THREADS, thread="threadIdx.x") as tx:
        index = T.Bind(bx * THREADS + tx)
        if blocks * THREADS == count:
            yield index
        else:
            with T.If(index < count), T.Then():
                yield index


def to_coordinates(index: tirx.PrimExpr, extents: tuple[int, ...]) -> list[tirx.PrimExpr]:
    """`index` as coordinates of a row-major grid of `extents` (each bound once)."""
    coords = []
    for i, extent in enumerate(extents):
        inner = math.prod(extents[i + 1:])
        coords.append(T.Bind(index // inner % extent if i else index // inner))
    return coords


def pool2d_chwn_func(wl: Pool2dWorkload) -> tirx.PrimFunc:
    """max/avg pooling of CHWN data (C, H, W, N) -> (C, OH, OW, N); `wl` in NCHW terms."""
    x = te.placeholder((wl.C, wl.H, wl.W, wl.N), "float32", name="data")
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    top, left = wl.padding[0], wl.padding[1]
    rh, rw = te.reduce_axis((0, kh), "rh"), te.reduce_axis((0, kw), "rw")

    def term(c, oh, ow, n, empty):
        ih, iw = oh * sh + rh * dh - top, ow * sw + rw * dw - left
        inside = tirx.all(ih >= 0, ih < wl.H, iw >= 0, iw < wl.W)
        safe = x[c, tirx.max(tirx.min(ih, wl.H - 1), 0), tirx.max(tirx.min(iw, wl.W - 1), 0), n]
        return tirx.if_then_else(inside, safe, empty)

    shape = (wl.C, wl.OH, wl.OW, wl.N)
    if wl.mode == "max":
        y = te.compute(shape, lambda c, oh, ow, n: nan_max_reducer(term(c, oh, ow, n, max_identity("float32")),
                                                                   axis=[rh, rw]), name="output")
        return bind_threads(te.create_prim_func([x, y]), "max_pool2d")
    s = te.compute(shape, lambda c, oh, ow, n: te.sum(term(c, oh, ow, n, tirx.const(0.0, "float32")),
                                                      axis=[rh, rw]), name="window_sum")

    def mean(c, oh, ow, n):
        return s[c, oh, ow, n] / tirx.Cast("float32", window_count(wl, oh, ow))

    y = te.compute(shape, mean, name="output")
    return bind_threads(te.create_prim_func([x, y]), "avg_pool2d", reducer="window_sum")


def pool2d_backward_chwn_func(wl: Pool2dWorkload, relu_mask: bool = False) -> tirx.PrimFunc:
    """dX (C, H, W, N) of the max or average pooling `wl` (NCHW terms) from dY (C, OH, OW, N) and,
    for max, its input X (C, H, W, N): one thread per pixel of dX sums the windows that hold it
    (gathered: no atomics, no zeroing pass). A max window's dY goes to its maximum as PyTorch
    picks it (:mod:`tvm_ext.kernels.pool2d_backward`'s rule, each thread re-scanning its
    windows); `relu_mask` (max): only where that maximum is > 0, relu's gradient of X fused. An
    average window's dY is divided by the count its forward divided by."""
    if relu_mask and wl.mode != "max":
        raise ValueError("pool2d_backward: relu_mask applies to a max pooling's gradient")
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    top, left = wl.padding[0], wl.padding[1]
    zero = tirx.const(0.0, "float32")

    def inside(h, w) -> tirx.PrimExpr:
        return tirx.all(h >= 0, h < wl.H, w >= 0, w < wl.W)

    with IRBuilder() as builder, T.prim_func(s_tir=True):
        kernel = f"{wl.mode}_pool2d_backward"
        T.func_name(kernel)
        T.func_attr({"tirx.noalias": True, KERNEL_ATTR: kernel})
        dy = param_buffer("dy", (wl.C, wl.OH, wl.OW, wl.N))
        x = param_buffer("x", (wl.C, wl.H, wl.W, wl.N)) if wl.mode == "max" else None
        dx = param_buffer("dx", (wl.C, wl.H, wl.W, wl.N))
        with T.sblock("root"), thread_per_element(wl.C * wl.H * wl.W * wl.N) as index:
            c, h, w, n = to_coordinates(index, (wl.C, wl.H, wl.W, wl.N))
            acc = IRBuilder.name("acc", T.alloc_buffer((1,), "float32", scope="local"))
            T.buffer_store(acc, zero, [0])
            with T.serial(0, kh) as i, T.serial(0, kw) as j:  # the taps (i, j) by which windows reach (h, w)
                rows, cols = T.Bind(h + top - i * dh), T.Bind(w + left - j * dw)
                oh, ow = T.Bind(tirx.floordiv(rows, sh)), T.Bind(tirx.floordiv(cols, sw))
                with T.If(tirx.all(rows >= 0, cols >= 0, tirx.floormod(rows, sh) == 0, tirx.floormod(cols, sw) == 0,
                                   oh < wl.OH, ow < wl.OW)), T.Then():
                    if x is None:
                        count = T.Cast("float32", window_count(wl, oh, ow))
                        T.buffer_store(acc, acc[0] + dy[c, oh, ow, n] / count, [0])
                    else:
                        best = IRBuilder.name("best", T.alloc_buffer((1,), "float32", scope="local"))
                        at = IRBuilder.name("at", T.alloc_buffer((1,), "int32", scope="local"))
                        T.buffer_store(at, T.int32(-1), [0])
                        T.buffer_store(best, zero, [0])
                        with T.serial(0, kh) as a, T.serial(0, kw) as b:
                            hh, ww = T.Bind(oh * sh - top + a * dh), T.Bind(ow * sw - left + b * dw)
                            with T.If(inside(hh, ww)), T.Then():
                                value = T.Bind(x[c, hh, ww, n])
                                with T.If(tirx.any(at[0] < 0, value > best[0], tirx.isnan(value))), T.Then():
                                    T.buffer_store(best, value, [0])
                                    T.buffer_store(at, a * kw + b, [0])
                        keep = at[0] == i * kw + j
                        if relu_mask:
                            keep = tirx.all(keep, best[0] > zero)
                        T.buffer_store(acc, acc[0] + tirx.Select(keep, dy[c, oh, ow, n], zero), [0])
            T.buffer_store(dx, acc[0], [c, h, w, n])
    return builder.get()


def interleave_phases_chwn_func(out_shape, stride: tuple[int, int], phases: list) -> tirx.PrimFunc:
    """dX (C, H, W, N) from a strided convolution's stride phases in CHWN: phase (a, b) (row-major
    over the stride; None where it is zero) is (C, rows, cols, N) and fills pixels
    (a + s_h * q, b + s_w * p), zeros past its rows and columns (the CPU's
    :func:`~tvm_ext.kernels.conv2d_backward_data.interleave_phases_func`). Parameters: the non-zero
    phases in order, then dX; one thread per pixel of dX, which reads the one phase it is in."""
    c_, h_, w_, n_ = (int(v) for v in out_shape)
    sh, sw = stride
    zero = tirx.const(0.0, "float32")
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("interleave_phases_chwn")
        T.func_attr({"tirx.noalias": True, KERNEL_ATTR: "interleave_phases"})
        inputs = [None if shape is None else param_buffer(f"phase{i}", tuple(int(v) for v in shape))
                  for i, shape in enumerate(phases)]
        dx = param_buffer("dx", (c_, h_, w_, n_))
        with T.sblock("root"), thread_per_element(c_ * h_ * w_ * n_) as index:
            c, h, w, n = to_coordinates(index, (c_, h_, w_, n_))
            q, p = T.Bind(h // sh), T.Bind(w // sw)
            value = zero
            for i, source in enumerate(inputs):
                if source is not None:
                    rows, cols = int(source.shape[1]), int(source.shape[2])
                    inside = tirx.all(h % sh == i // sw, w % sw == i % sw, q < rows, p < cols)
                    value = tirx.if_then_else(inside, source[c, q, p, n], value)
            T.buffer_store(dx, value, [c, h, w, n])
    return builder.get()


def global_avg_pool2d_chwn_func(shape) -> tirx.PrimFunc:
    """Mean over H and W of CHWN data (C, H, W, N) -> (C, 1, 1, N)."""
    c, h, w, n = (int(v) for v in shape)
    x = te.placeholder((c, h, w, n), "float32", name="data")
    rh, rw = te.reduce_axis((0, h), "rh"), te.reduce_axis((0, w), "rw")
    s = te.compute((c, 1, 1, n), lambda i, a, b, j: te.sum(x[i, rh, rw, j], axis=[rh, rw]), name="window_sum")
    y = te.compute((c, 1, 1, n), lambda i, a, b, j: s[i, a, b, j] / float(h * w), name="output")
    return bind_threads(te.create_prim_func([x, y]), "global_avg_pool2d", reducer="window_sum")


def bf16_pairs_func(shape) -> tirx.PrimFunc:
    """float32 values (`shape`, its last axis even) rounded to bf16 by CUDA's conversion (nearest
    even; NaN 0x7FFF) and packed in pairs along the last axis, the first of each pair in the low
    half, as float32 words: the wgmma bf16 kernel's weights where they are graph inputs (NumPy's
    :func:`~tvm_ext.kernels.cuda.maxdnn.bf16_pairs` for constants)."""
    shape = tuple(int(v) for v in shape)
    if shape[-1] % 2:
        raise ValueError(f"bf16_pairs_func: the last axis has {shape[-1]} values, not pairs")
    x = te.placeholder(shape, "float32", name="data")

    def bits(value):
        return tirx.Cast("uint32", tirx.reinterpret("uint16", tirx.Cast("bfloat16", value)))

    def pair(*idx):
        *lead, i = idx
        low, high = bits(x[(*lead, 2 * i)]), bits(x[(*lead, 2 * i + 1)])
        return tirx.reinterpret("float32", low | (high << tirx.const(16, "uint32")))

    y = te.compute((*shape[:-1], shape[-1] // 2), pair, name="output")
    return bind_threads(te.create_prim_func([x, y]), "bf16_pairs")


def activation_func(name: str, shape, alpha: float = 0.01) -> tirx.PrimFunc:
    """Activation `name` over a float32 tensor of any shape (layout does not matter)."""
    return flat_activation_func(name, shape, alpha, THREADS, 'T.thread_binding({}, thread="blockIdx.x")',
                                'T.thread_binding({}, thread="threadIdx.x")')
