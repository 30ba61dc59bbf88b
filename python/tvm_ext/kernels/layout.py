"""Layout changes between NCHW and the blocked NCHW[x]c activation layout (LLVM CPU).

A graph converts layouts only at its edges and around fallbacks; between tvm_ext kernels the
activations stay blocked. These kernels are those edges:

- :func:`pack_nchwc_func` (and :func:`pack_data_func`, a convolution's input): NCHW ->
  N, C/x, H+pads, W+pads, x (the layout change and a zero border in one pass);
- :func:`pad_nchwc_func`: blocked -> blocked with a zero border (the input of a padded
  convolution whose producer is blocked already: contiguous row copies);
- :func:`unpack_nchwc_func`: blocked -> NCHW, dropping the channels that fill the last block.

The NCHW side is a (channel, pixel) transpose, done in 8x8 unrolled tiles that LLVM turns into
vector loads, shuffles and vector stores (2x faster than element by element).
"""

from __future__ import annotations

from collections.abc import Sequence

from tvm import s_tir, te, tirx

from .conv2d import KERNEL_ATTR, Conv2dPlan, _accept_user_alignment

_TILE = 8


def _transpose_tiles(sch: s_tir.Schedule, channel, pixel, block: int) -> None:
    """Order (channel, pixel) as 8x8 unrolled tiles, when the block allows them."""
    if block % _TILE:
        return
    co, ci = sch.split(channel, [None, _TILE])
    wo, wi = sch.split(pixel, [None, _TILE])
    sch.reorder(co, wo, ci, wi)
    sch.unroll(ci)
    sch.unroll(wi)


def pack_nchwc_func(shape: Sequence[int], block: int, padding: Sequence[int] = (0, 0, 0, 0),
                    dtype: str = "float32", user_input: bool = False) -> tirx.PrimFunc:
    """NCHW `shape` -> (N, C/block, H+top+bottom, W+left+right, block), zeros in the border.

    `user_input`: the source may be a NumPy array (16-byte aligned, not 64); see ops.
    """
    N, C, H, W = (int(v) for v in shape)
    if C % block:
        raise ValueError(f"pack_nchwc: {C} channels are not a multiple of the block {block}")
    top, left, bottom, right = (int(p) for p in padding)
    x = te.placeholder((N, C, H, W), dtype, name="data")

    def body(n, cb, h, w, c):
        ih, iw = h - top, w - left
        inside = tirx.all(ih >= 0, ih < H, iw >= 0, iw < W)
        return tirx.if_then_else(inside, x[n, cb * block + c, ih, iw], tirx.const(0.0, dtype))

    out_shape = (N, C // block, H + top + bottom, W + left + right, block)
    xb = te.compute(out_shape, body, name="data_blocked")
    func = te.create_prim_func([x, xb])
    sch = s_tir.Schedule(_accept_user_alignment(func, "data") if user_input else func)
    n, cb, h, w_, c = sch.get_loops(sch.get_sblock("data_blocked"))
    sch.reorder(c, w_)  # read rows of the source, scatter into an L1-sized destination row
    sch.parallel(sch.fuse(n, cb, h))
    _transpose_tiles(sch, c, w_, block)
    return sch.mod["main"].with_attr(KERNEL_ATTR, "pack_nchwc")


def pad_nchwc_func(blocked_shape: Sequence[int], padding: Sequence[int], dtype: str = "float32") -> tirx.PrimFunc:
    """(N, CB, H, W, c) -> (N, CB, H+top+bottom, W+left+right, c) with a zero border."""
    N, CB, H, W, c = (int(v) for v in blocked_shape)
    top, left, bottom, right = (int(p) for p in padding)
    x = te.placeholder((N, CB, H, W, c), dtype, name="data")

    def body(n, cb, h, w, i):
        ih, iw = h - top, w - left
        inside = tirx.all(ih >= 0, ih < H, iw >= 0, iw < W)
        return tirx.if_then_else(inside, x[n, cb, ih, iw, i], tirx.const(0.0, dtype))

    xp = te.compute((N, CB, H + top + bottom, W + left + right, c), body, name="data_padded")
    sch = s_tir.Schedule(te.create_prim_func([x, xp]))
    n, cb, h, w_, i = sch.get_loops(sch.get_sblock("data_padded"))
    sch.parallel(sch.fuse(n, cb, h))
    sch.vectorize(i)
    return sch.mod["main"].with_attr(KERNEL_ATTR, "pad_nchwc")


def unpack_nchwc_func(blocked_shape: Sequence[int], channels: int, dtype: str = "float32") -> tirx.PrimFunc:
    """(N, CB, H, W, c) -> NCHW with `channels` channels (at most CB * c)."""
    N, CB, H, W, block = (int(v) for v in blocked_shape)
    if not 0 < channels <= CB * block:
        raise ValueError(f"unpack_nchwc: {channels} channels do not fit {CB} blocks of {block}")
    xb = te.placeholder((N, CB, H, W, block), dtype, name="data_blocked")
    y = te.compute((N, channels, H, W), lambda n, k, h, w: xb[n, k // block, h, w, k % block], name="data")
    sch = s_tir.Schedule(te.create_prim_func([xb, y]))
    n, k, h, w_ = sch.get_loops(sch.get_sblock("data"))
    if channels % block == 0:
        kb, c = sch.split(k, [None, block])
        sch.reorder(kb, h, c, w_)
        sch.parallel(sch.fuse(n, kb, h))
        _transpose_tiles(sch, c, w_, block)
    else:
        sch.parallel(sch.fuse(n, k))
    return sch.mod["main"].with_attr(KERNEL_ATTR, "unpack_nchwc")


def pack_data_func(plan: Conv2dPlan) -> tirx.PrimFunc:
    """A convolution's NCHW input (possibly a user's NumPy array) -> its blocked, padded input."""
    wl = plan.wl
    return pack_nchwc_func((wl.N, wl.C, wl.H, wl.W), plan.ic_bn, wl.padding, wl.dtype, user_input=True)
