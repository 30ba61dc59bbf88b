"""2-D max / average / global pooling on NCHW or blocked NCHW[x]c tensors (LLVM CPU).

Each output row is one task of TVM's thread pool; the window is reduced in registers. Borders
are handled in the index expressions (padding elements are skipped for max and counted or not
for average, as PyTorch does), so no padded copy of the input exists.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

from tvm import s_tir, te, tirx

from .common import KERNEL_ATTR, normalize_padding, pair


def nan_max(a: tirx.PrimExpr, b: tirx.PrimExpr) -> tirx.PrimExpr:
    """The larger of a and b, NaN if either is (PyTorch's max pooling; LLVM's maxnum and a
    plain compare-select drop a NaN in some window positions)."""
    return tirx.Select(tirx.Or(a > b, tirx.isnan(a)), a, b)


def max_identity(dtype: str) -> tirx.PrimExpr:
    """What a window position outside the input counts as: -inf, so that a window of -inf is
    -inf (the lowest finite value would make it -3.4e38); an integer dtype's lowest value."""
    if dtype.startswith(("int", "uint")):
        return tirx.min_value(dtype)
    return tirx.const(float("-inf"), dtype)


# te's reducer of max pooling windows (one reduction per output; see nan_max)
nan_max_reducer = te.comm_reducer(nan_max, max_identity, name="nan_max")


@dataclasses.dataclass(frozen=True)
class Pool2dWorkload:
    N: int
    C: int
    H: int
    W: int
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int, int, int]
    dilation: tuple[int, int]
    ceil_mode: bool
    mode: str  # "max" or "avg"
    count_include_pad: bool = True

    @staticmethod
    def make(shape, mode: str, kernel_size: int | Sequence[int], stride: int | Sequence[int] | None = None,
             padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1, ceil_mode=False,
             count_include_pad=True) -> Pool2dWorkload:
        if mode not in ("max", "avg"):
            raise ValueError(f"pool2d: mode must be 'max' or 'avg', got {mode!r}")
        if len(shape) != 4:
            raise ValueError(f"pool2d: data must be 4-D NCHW, got shape {tuple(shape)}")
        kernel = pair(kernel_size, "kernel_size")
        stride = kernel if stride is None else pair(stride, "stride")
        pads = normalize_padding(padding)
        dil = pair(dilation, "dilation")
        if min(*kernel, *stride, *dil) < 1:
            raise ValueError(f"pool2d: kernel {kernel}, stride {stride}, dilation {dil} must be positive")
        if max(pads[0], pads[2]) * 2 > kernel[0] or max(pads[1], pads[3]) * 2 > kernel[1]:
            raise ValueError(f"pool2d: padding {pads} must be at most half the kernel {kernel}")
        if mode == "avg" and dil != (1, 1):
            raise ValueError("avg_pool2d: dilation is not supported")
        n, c, h, w = (int(v) for v in shape)
        wl = Pool2dWorkload(n, c, h, w, kernel, stride, pads, dil, bool(ceil_mode), mode, bool(count_include_pad))
        if wl.OH < 1 or wl.OW < 1:
            raise ValueError(f"pool2d: kernel {kernel} is larger than the padded input")
        return wl

    def _out(self, size: int, k: int, s: int, p0: int, p1: int, d: int) -> int:
        span = size + p0 + p1 - d * (k - 1) - 1
        out = (math.ceil if self.ceil_mode else math.floor)(span / s) + 1
        if self.ceil_mode and (out - 1) * s >= size + p0:  # a window must start inside the input
            out -= 1
        return out

    @property
    def kernel_name(self) -> str:
        """The "tvm_ext.kernel" attribute of its kernels."""
        return f"{self.mode}_pool2d"

    @property
    def flops(self) -> int:
        """One operation (a max or an add) per window element of every output."""
        return self.N * self.C * self.OH * self.OW * self.kernel[0] * self.kernel[1]

    @property
    def OH(self) -> int:
        return self._out(self.H, self.kernel[0], self.stride[0], self.padding[0], self.padding[2], self.dilation[0])

    @property
    def OW(self) -> int:
        return self._out(self.W, self.kernel[1], self.stride[1], self.padding[1], self.padding[3], self.dilation[1])


def pool2d_func(wl: Pool2dWorkload, dtype: str = "float32", block: int | None = None) -> tirx.PrimFunc:
    """Scheduled PrimFunc for `wl` on NCHW data, or on blocked (N, C/block, H, W, block) data.

    Blocked, the channel block is the vector: every window element is one vector load.
    """
    sch = s_tir.Schedule(pool2d_compute(wl, dtype, block))
    schedule_pool2d(sch, wl, block)
    return sch.mod["main"].with_attr(KERNEL_ATTR, wl.kernel_name)


def pool2d_compute(wl: Pool2dWorkload, dtype: str = "float32", block: int | None = None) -> tirx.PrimFunc:
    """The unscheduled pooling of :func:`pool2d_func` (a tuning task's workload)."""
    if block is not None and wl.C % block:
        raise ValueError(f"pool2d: {wl.C} channels are not a multiple of the block {block}")
    lead = (wl.N, wl.C) if block is None else (wl.N, wl.C // block)
    tail = () if block is None else (block,)
    x = te.placeholder((*lead, wl.H, wl.W, *tail), dtype, name="data")
    (kh_, kw_), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    top, left = wl.padding[0], wl.padding[1]
    if block is None:
        rh = te.reduce_axis((0, kh_), "rh")
        rw = te.reduce_axis((0, kw_), "rw")
        window = [(rh, rw)]
    else:  # the window unrolled, so that the channel vector is a plain spatial loop
        window = [(i, j) for i in range(kh_) for j in range(kw_)]

    def index(n, c, oh, ow, *i, r=(0, 0)):
        ih, iw = oh * sh + r[0] * dh - top, ow * sw + r[1] * dw - left
        inside = tirx.all(ih >= 0, ih < wl.H, iw >= 0, iw < wl.W)
        safe = x[(n, c, tirx.max(tirx.min(ih, wl.H - 1), 0), tirx.max(tirx.min(iw, wl.W - 1), 0), *i)]
        return inside, safe

    def reduce(idx, combine, empty):
        terms = [tirx.if_then_else(*index(*idx, r=r), empty) for r in window]
        if block is None:
            return combine(terms[0], axis=list(window[0]))
        if combine is nan_max and dtype.startswith(("int", "uint")):  # quantized data: no NaN
            return functools.reduce(tirx.max, terms)
        if combine is nan_max:  # a chain of nan_max would read each partial result thrice: the
            # expression would grow as 3^taps. A chain of max, NaN if any term is, grows linearly.
            any_nan = functools.reduce(tirx.Or, [tirx.isnan(term) for term in terms])
            return tirx.Select(any_nan, tirx.const(float("nan"), dtype), functools.reduce(tirx.max, terms))
        return functools.reduce(combine, terms)

    shape = (*lead, wl.OH, wl.OW, *tail)
    if wl.mode == "max":
        y = te.compute(shape, lambda *idx: reduce(idx, nan_max_reducer if block is None else nan_max,
                                                  max_identity(dtype)), name="output")
    else:
        s = te.compute(shape, lambda *idx: reduce(idx, te.sum if block is None else (lambda a, b: a + b),
                                                  tirx.const(0.0, dtype)), name="window_sum")

        def count(size, o, k, st, p0, p1):
            start = o * st - p0
            if wl.count_include_pad:  # the window clipped to the padded input
                end = tirx.min(start + k, size + p1)
            else:
                end = tirx.min(start + k, size)
                start = tirx.max(start, 0)
            return end - start

        def mean(n, c, oh, ow, *i):
            area = (count(wl.H, oh, kh_, sh, top, wl.padding[2])
                    * count(wl.W, ow, kw_, sw, left, wl.padding[3]))
            return s[(n, c, oh, ow, *i)] / tirx.Cast(dtype, area)

        y = te.compute(shape, mean, name="output")
    return te.create_prim_func([x, y])


def schedule_pool2d(sch: s_tir.Schedule, wl: Pool2dWorkload, block: int | None, tunable: bool = False) -> None:
    """One parallel task per block of output rows, the row's pixels in unrolled groups.

    The analytic schedule takes one row per task and no unrolled group; with `tunable` both are
    MetaSchedule decisions (perfect tiles of the row and pixel loops, so every decision gives the
    same loops): rows per task trade the thread pool's per-task cost against balance; an unrolled
    group of pixels gives LLVM the overlapping windows of neighbouring pixels in one block.
    """
    out = sch.get_sblock("output")
    reducer = sch.get_sblock("window_sum") if wl.mode == "avg" else out
    n, c, oh, ow = sch.get_loops(out)[:4]
    if tunable:
        rows, pixels = sch.sample_perfect_tile(oh, n=2), sch.sample_perfect_tile(ow, n=2, max_innermost_factor=8)
    else:
        rows, pixels = [wl.OH, 1], [wl.OW, 1]
    oh_task, oh_row = sch.split(oh, rows, preserve_unit_iters=True)
    ow_group, ow_pixel = sch.split(ow, pixels, preserve_unit_iters=True)
    if wl.mode == "avg":
        sch.compute_at(reducer, ow_pixel)
    if block is not None:
        sch.vectorize(sch.get_loops(out)[-1])
        if wl.mode == "avg":
            sch.vectorize(sch.get_loops(reducer)[-1])
    sch.unroll(ow_pixel)
    sch.parallel(sch.fuse(n, c, oh_task, preserve_unit_iters=True))


def global_avg_pool2d_func(shape, dtype: str = "float32") -> tirx.PrimFunc:
    """Mean over H and W of NCHW data (N, C, 1, 1), or of blocked (N, CB, H, W, c) data (N, CB, 1, 1, c).
    NCHW rows are summed in vectors of the largest power of two up to 16 that divides W, then
    across (one scalar chain of adds is latency-bound: 0.17 ms for 32 x 112 x 112 values, 0.025
    in vectors of 16)."""
    shape = tuple(int(v) for v in shape)
    N, C, H, W = shape[:4]
    tail = shape[4:]
    x = te.placeholder(shape, dtype, name="data")
    rh = te.reduce_axis((0, H), "rh")
    out_shape = (N, C, 1, 1, *tail)
    lanes = 1 if tail else math.gcd(W, 16)  # (a row of odd width: one chain, as short as the row)
    if lanes == 1:
        rw = te.reduce_axis((0, W), "rw")
        s = te.compute(out_shape, lambda n, c, i, j, *v: te.sum(x[(n, c, rh, rw, *v)], axis=[rh, rw]),
                       name="window_sum")
    else:
        rw = te.reduce_axis((0, W // lanes), "rw")
        partial = te.compute((N, C, lanes), lambda n, c, v: te.sum(x[n, c, rh, rw * lanes + v], axis=[rh, rw]),
                             name="lane_sum")
        rl = te.reduce_axis((0, lanes), "rl")
        s = te.compute(out_shape, lambda n, c, i, j: te.sum(partial[n, c, rl], axis=rl), name="window_sum")
    y = te.compute(out_shape, lambda n, c, i, j, *v: s[(n, c, i, j, *v)] / float(H * W), name="output")
    sch = s_tir.Schedule(te.create_prim_func([x, y]))
    n, c, *_ = sch.get_loops(sch.get_sblock("output"))
    fused = sch.fuse(n, c)
    reducer = sch.get_sblock("window_sum")
    sch.compute_at(reducer, fused, preserve_unit_loops=True)  # a 1-pixel row keeps its rh loop
    sch.parallel(fused)
    if tail:
        *_, v, r_h, r_w = sch.get_loops(reducer)
        sch.reorder(r_h, r_w, v)  # contiguous channel vectors innermost (LLVM vectorizes the sum)
        sch.vectorize(sch.get_loops(sch.decompose_reduction(reducer, r_h))[-1])
        sch.vectorize(sch.get_loops(sch.get_sblock("output"))[-1])
    elif lanes > 1:
        lane_sum = sch.get_sblock("lane_sum")
        sch.compute_at(lane_sum, fused, preserve_unit_loops=True)
        *_, v, r_h, r_w = sch.get_loops(lane_sum)
        sch.reorder(r_h, r_w, v)  # `lanes` independent sums of contiguous values (LLVM vectorizes them)
        sch.vectorize(sch.get_loops(sch.decompose_reduction(lane_sum, r_h))[-1])
    return sch.mod["main"].with_attr(KERNEL_ATTR, "global_avg_pool2d")
