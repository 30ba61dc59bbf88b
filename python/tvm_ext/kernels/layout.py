"""Layout changes between NCHW and the blocked NCHW[x]c activation layout (LLVM CPU).

A graph converts layouts only at its edges and around fallbacks; between tvm_ext kernels the
activations stay blocked. These kernels are those edges:

- :func:`pack_nchwc_func` (and :func:`pack_data_func`, a convolution's input): NCHW ->
  N, C/x, H+pads, W+pads, x (the layout change and a zero border in one pass);
- :func:`pad_nchwc_func`: blocked -> blocked with a zero border (the input of a padded
  convolution whose producer is blocked already: contiguous row copies);
- :func:`unpack_nchwc_func`: blocked -> NCHW, dropping the channels that fill the last block.

The NCHW side is a (channel, pixel) transpose: with blocks of 8 channels or more (float32) it
is done in 8x8 register tiles (:mod:`.transpose`), 2.5x faster than element by element; other
blocks and dtypes keep an element-wise TensorIR schedule.
"""

from __future__ import annotations

from collections.abc import Sequence

from tvm import s_tir, te, tirx

from . import script
from .conv2d import KERNEL_ATTR, USER_ALIGNMENT, Conv2dPlan, _accept_user_alignment
from .transpose import TILE, transpose8x8


def _vector_tiles(block: int, dtype: str) -> bool:
    """Whether the (channel, pixel) transpose can use 8x8 float32 register tiles."""
    return dtype == "float32" and block % TILE == 0


_PACK_TEMPLATE = """
@T.prim_func(s_tir=True)
def pack_nchwc(x: T.handle, y: T.handle):
    T.func_attr({{"tirx.noalias": True, "{attr}": "pack_nchwc"}})
    X = T.match_buffer(x, ({N}, {C}, {H}, {W}), "float32", align={align})
    Y = T.match_buffer(y, ({N}, {CB}, {HP}, {WP}, {block}), "float32")
    with T.sblock("root"):
        for row in T.parallel({rows}):
            n: T.let = row // {per_image}
            cb: T.let = row // {HP} % {CB}
            h: T.let = row % {HP}
            if h < {top} or h >= {top_H}:
                for w, c in T.grid({WP}, {vectors}):
                    Y[n, cb, h, w, T.Ramp(c * 8, 1, 8)] = T.Broadcast(T.float32(0), 8)
            else:
                for w, c in T.grid({left}, {vectors}):
                    Y[n, cb, h, w, T.Ramp(c * 8, 1, 8)] = T.Broadcast(T.float32(0), 8)
                for w, c in T.grid({right}, {vectors}):
                    Y[n, cb, h, {left_W} + w, T.Ramp(c * 8, 1, 8)] = T.Broadcast(T.float32(0), 8)
                for c0, w0 in T.grid({vectors}, {W_tiles}):
{tile}
                for c, w in T.grid({block}, {W_tail}):
                    Y[n, cb, h, {left} + {W_body} + w, c] = X[n, cb * {block} + c, h - {top}, {W_body} + w]
"""

_UNPACK_TEMPLATE = """
@T.prim_func(s_tir=True)
def unpack_nchwc(y: T.handle, x: T.handle):
    T.func_attr({{"tirx.noalias": True, "{attr}": "unpack_nchwc"}})
    Y = T.match_buffer(y, ({N}, {CB}, {H}, {W}, {block}), "float32")
    X = T.match_buffer(x, ({N}, {channels}, {H}, {W}), "float32")
    with T.sblock("root"):
        for row in T.parallel({rows}):
            n: T.let = row // {per_image}
            cb: T.let = row // {H} % {CB}
            h: T.let = row % {H}
            for c0 in range({vectors}):
                if cb * {block} + c0 * 8 + 8 <= {channels}:
                    for w0 in range({W_tiles}):
{tile}
                    for c, w in T.grid(8, {W_tail}):
                        X[n, cb * {block} + c0 * 8 + c, h, {W_body} + w] = Y[n, cb, h, {W_body} + w, c0 * 8 + c]
                else:
                    for c, w in T.grid(8, {W}):
                        if cb * {block} + c0 * 8 + c < {channels}:
                            X[n, cb * {block} + c0 * 8 + c, h, w] = Y[n, cb, h, w, c0 * 8 + c]
"""


def pack_nchwc_func(shape: Sequence[int], block: int, padding: Sequence[int] = (0, 0, 0, 0),
                    dtype: str = "float32", user_input: bool = False) -> tirx.PrimFunc:
    """NCHW `shape` -> (N, C/block, H+top+bottom, W+left+right, block), zeros in the border.

    `user_input`: the source may be a NumPy array (16-byte aligned, not 64); see ops.
    """
    N, C, H, W = (int(v) for v in shape)
    if C % block:
        raise ValueError(f"pack_nchwc: {C} channels are not a multiple of the block {block}")
    top, left, bottom, right = (int(p) for p in padding)
    if _vector_tiles(block, dtype):
        HP, WP = H + top + bottom, W + left + right
        tile = transpose8x8(lambda i: f"X[n, cb * {block} + c0 * 8 + {i}, h - {top}, T.Ramp(w0 * 8, 1, 8)]",
                            lambda j, v: f"Y[n, cb, h, {left} + w0 * 8 + {j}, T.Ramp(c0 * 8, 1, 8)] = {v}",
                            indent=" " * 20)
        return script.from_source(_PACK_TEMPLATE.format(
            attr=KERNEL_ATTR, N=N, C=C, H=H, W=W, CB=C // block, HP=HP, WP=WP, block=block,
            align=USER_ALIGNMENT if user_input else 64, rows=N * (C // block) * HP, per_image=(C // block) * HP,
            top=top, top_H=top + H, left=left, right=right, left_W=left + W, vectors=block // TILE,
            W_tiles=W // TILE, W_body=W // TILE * TILE, W_tail=W % TILE, tile=tile))
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
    return sch.mod["main"].with_attr(KERNEL_ATTR, "pack_nchwc")


PADDING_ATTR = "tvm_ext.padding"  # on pad_nchwc kernels: (top, left, bottom, right)


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
    return sch.mod["main"].with_attr(KERNEL_ATTR, "pad_nchwc").with_attr(PADDING_ATTR, [top, left, bottom, right])


def unpack_nchwc_func(blocked_shape: Sequence[int], channels: int, dtype: str = "float32") -> tirx.PrimFunc:
    """(N, CB, H, W, c) -> NCHW with `channels` channels (at most CB * c)."""
    N, CB, H, W, block = (int(v) for v in blocked_shape)
    if not 0 < channels <= CB * block:
        raise ValueError(f"unpack_nchwc: {channels} channels do not fit {CB} blocks of {block}")
    if _vector_tiles(block, dtype):
        tile = transpose8x8(lambda i: f"Y[n, cb, h, w0 * 8 + {i}, T.Ramp(c0 * 8, 1, 8)]",
                            lambda j, v: f"X[n, cb * {block} + c0 * 8 + {j}, h, T.Ramp(w0 * 8, 1, 8)] = {v}",
                            indent=" " * 24)
        return script.from_source(_UNPACK_TEMPLATE.format(
            attr=KERNEL_ATTR, N=N, CB=CB, H=H, W=W, block=block, channels=channels, rows=N * CB * H,
            per_image=CB * H, vectors=block // TILE, W_tiles=W // TILE, W_body=W // TILE * TILE,
            W_tail=W % TILE, tile=tile))
    xb = te.placeholder((N, CB, H, W, block), dtype, name="data_blocked")
    y = te.compute((N, channels, H, W), lambda n, k, h, w: xb[n, k // block, h, w, k % block], name="data")
    sch = s_tir.Schedule(te.create_prim_func([xb, y]))
    n, k, h, w_ = sch.get_loops(sch.get_sblock("data"))
    if channels % block == 0:
        kb, c = sch.split(k, [None, block])
        sch.reorder(kb, h, c, w_)
        sch.parallel(sch.fuse(n, kb, h))
    else:
        sch.parallel(sch.fuse(n, k))
    return sch.mod["main"].with_attr(KERNEL_ATTR, "unpack_nchwc")


def pack_data_func(plan: Conv2dPlan) -> tirx.PrimFunc:
    """A convolution's NCHW input (possibly a user's NumPy array) -> its blocked, padded input."""
    wl = plan.wl
    return pack_nchwc_func((wl.N, wl.C, wl.H, wl.W), plan.ic_bn, wl.padding, wl.dtype, user_input=True)
