"""Layout changes between NCHW and the blocked NCHW[x]c activation layout (LLVM CPU).

A graph converts layouts only at its edges and around fallbacks; between tvm_ext kernels the
activations stay blocked. These kernels are those edges:

- :func:`pack_nchwc_func` (and :func:`pack_data_func`, a convolution's input): NCHW ->
  N, C/x, H+pads, W+pads, x (the layout change and a zero border in one pass);
- :func:`pad_nchwc_func`: blocked -> blocked with a zero border (the input of a padded
  convolution whose producer is blocked already: contiguous row copies);
- :func:`unpack_nchwc_func`: blocked -> NCHW, dropping the channels that fill the last block;
- :func:`pack_quantized_func`: NCHW uint8 or int8 -> blocked uint8 (an int8 convolution's input),
  its border and the channels that fill the last block holding the zero point;
  :func:`quantized_blocks_func` writes the same from an fp32 kernel's blocks, quantizing them.

The NCHW side is a (channel, pixel) transpose: with blocks of 8 channels or more (float32) it
is done in 8x8 register tiles (:mod:`.transpose`), 2.5x faster than element by element; other
blocks and dtypes keep an element-wise TensorIR schedule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
from tvm import s_tir, te, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from .common import KERNEL_ATTR, USER_ALIGNMENT, accept_user_alignment, param_buffer
from .conv2d import Conv2dPlan
from .transpose import TILE, transpose8x8


def _vector_tiles(block: int, dtype: str) -> bool:
    """Whether the (channel, pixel) transpose can use 8x8 float32 register tiles."""
    return dtype == "float32" and block % TILE == 0


@contextlib.contextmanager
def _rows(images: int, blocks: int, height: int):
    """The root block and one parallel task per (image, channel block, row): yields (n, cb, h)."""
    with T.sblock("root"), T.parallel(0, images * blocks * height) as row:
        yield T.Bind(row // (blocks * height)), T.Bind(row // height % blocks), T.Bind(row % height)


def _zeros(lanes: int) -> tirx.PrimExpr:
    return T.Broadcast(T.float32(0), lanes)


def _pack_tiled(N: int, C: int, H: int, W: int, block: int, padding: Sequence[int], align: int) -> tirx.PrimFunc:
    """NCHW -> blocked with a zero border: each row's (channel, pixel) tiles in 8x8 register
    transposes, its edges element by element, the border rows and columns as zero vectors."""
    top, left, bottom, right = padding
    CB, HP, WP, vectors = C // block, H + top + bottom, W + left + right, block // TILE
    W_body = W // TILE * TILE
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("pack_nchwc")
        T.func_attr({"tirx.noalias": True, KERNEL_ATTR: "pack_nchwc"})
        x = param_buffer("x", (N, C, H, W), align)
        y = param_buffer("y", (N, CB, HP, WP, block))
        with _rows(N, CB, HP) as (n, cb, h), T.If(tirx.Or(h < top, h >= top + H)):
            with T.Then(), T.grid(WP, vectors) as (w, c):
                T.buffer_store(y, _zeros(8), [n, cb, h, w, T.Ramp(c * 8, 1, 8)])
            with T.Else():
                with T.grid(left, vectors) as (w, c):
                    T.buffer_store(y, _zeros(8), [n, cb, h, w, T.Ramp(c * 8, 1, 8)])
                with T.grid(right, vectors) as (w, c):
                    T.buffer_store(y, _zeros(8), [n, cb, h, left + W + w, T.Ramp(c * 8, 1, 8)])
                with T.grid(vectors, W // TILE) as (c0, w0):
                    transpose8x8(lambda i: x[n, cb * block + c0 * 8 + i, h - top, T.Ramp(w0 * 8, 1, 8)],
                                 lambda j, v: T.buffer_store(y, v, [n, cb, h, left + w0 * 8 + j,
                                                                    T.Ramp(c0 * 8, 1, 8)]))
                with T.grid(block, W % TILE) as (c, w):
                    T.buffer_store(y, x[n, cb * block + c, h - top, W_body + w],
                                   [n, cb, h, left + W_body + w, c])
    return builder.get()


def _unpack_tiled(N: int, CB: int, H: int, W: int, block: int, channels: int) -> tirx.PrimFunc:
    """Blocked -> NCHW: each row's (pixel, channel) tiles in 8x8 register transposes, its last
    pixels and a block's channels past `channels` element by element."""
    W_body = W // TILE * TILE
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("unpack_nchwc")
        T.func_attr({"tirx.noalias": True, KERNEL_ATTR: "unpack_nchwc"})
        y = param_buffer("y", (N, CB, H, W, block))
        x = param_buffer("x", (N, channels, H, W))
        with (_rows(N, CB, H) as (n, cb, h), T.serial(0, block // TILE) as c0,
              T.If(cb * block + c0 * 8 + 8 <= channels)):
            with T.Then():
                with T.serial(0, W // TILE) as w0:
                    transpose8x8(lambda i: y[n, cb, h, w0 * 8 + i, T.Ramp(c0 * 8, 1, 8)],
                                 lambda j, v: T.buffer_store(x, v, [n, cb * block + c0 * 8 + j, h,
                                                                    T.Ramp(w0 * 8, 1, 8)]))
                with T.grid(8, W % TILE) as (c, w):
                    T.buffer_store(x, y[n, cb, h, W_body + w, c0 * 8 + c],
                                   [n, cb * block + c0 * 8 + c, h, W_body + w])
            with T.Else(), T.grid(8, W) as (c, w), T.If(cb * block + c0 * 8 + c < channels), T.Then():
                T.buffer_store(x, y[n, cb, h, w, c0 * 8 + c], [n, cb * block + c0 * 8 + c, h, w])
    return builder.get()


def pack_nchwc_func(shape: Sequence[int], block: int, padding: Sequence[int] = (0, 0, 0, 0),
                    dtype: str = "float32", user_input: bool = False, pad_channels: bool = False) -> tirx.PrimFunc:
    """NCHW `shape` -> (N, ceil(C/block), H+top+bottom, W+left+right, block), zeros in the border.

    `user_input`: the source may be a NumPy array (16-byte aligned, not 64); see ops.
    `pad_channels`: C need not be a multiple of the block; the last block's channels past C are
    zeros.
    """
    N, C, H, W = (int(v) for v in shape)
    if C % block and not pad_channels:
        raise ValueError(f"pack_nchwc: {C} channels are not a multiple of the block {block}")
    top, left, bottom, right = (int(p) for p in padding)
    if _vector_tiles(block, dtype) and C % block == 0:
        return _pack_tiled(N, C, H, W, block, (top, left, bottom, right), USER_ALIGNMENT if user_input else 64)
    x = te.placeholder((N, C, H, W), dtype, name="data")

    def body(n, cb, h, w, c):
        ih, iw = h - top, w - left
        inside = tirx.all(ih >= 0, ih < H, iw >= 0, iw < W, cb * block + c < C)
        channel = tirx.min(cb * block + c, C - 1)  # in bounds where the select drops the value
        return tirx.if_then_else(inside, x[n, channel, ih, iw], tirx.const(0.0, dtype))

    out_shape = (N, -(-C // block), H + top + bottom, W + left + right, block)
    xb = te.compute(out_shape, body, name="data_blocked")
    func = te.create_prim_func([x, xb])
    sch = s_tir.Schedule(accept_user_alignment(func, "data") if user_input else func)
    n, cb, h, w_, c = sch.get_loops(sch.get_sblock("data_blocked"))
    sch.reorder(c, w_)  # read rows of the source, scatter into an L1-sized destination row
    sch.parallel(sch.fuse(n, cb, h))
    return sch.mod["main"].with_attr(KERNEL_ATTR, "pack_nchwc")


PADDING_ATTR = "tvm_ext.padding"  # on pad_nchwc kernels: (top, left, bottom, right)
# on pack_quantized kernels, its border: a rewrite after lowering writes the same input from fp32
# blocks (:func:`quantized_blocks_func`); not PADDING_ATTR, which marks a copy of blocks
PACK_PADDING_ATTR = "tvm_ext.pack_padding"
# on pack_quantized kernels, the zero point their padding holds: a rewrite after lowering packs a
# dense layer's rows instead (:func:`pack_quantized_rows_func`)
PACK_ZERO_ATTR = "tvm_ext.pack_zero_point"
# on dequantized_units kernels: (zero point, scale), for a rewrite that adds a border
DEQUANTIZE_ATTR = "tvm_ext.dequantize"


def pad_nchwc_func(blocked_shape: Sequence[int], padding: Sequence[int], dtype: str = "float32",
                   value: int = 0) -> tirx.PrimFunc:
    """(N, CB, H, W, c) -> (N, CB, H+top+bottom, W+left+right, c) with a border of `value` (a
    quantized tensor's zero point)."""
    N, CB, H, W, c = (int(v) for v in blocked_shape)
    top, left, bottom, right = (int(p) for p in padding)
    x = te.placeholder((N, CB, H, W, c), dtype, name="data")

    def body(n, cb, h, w, i):
        ih, iw = h - top, w - left
        inside = tirx.all(ih >= 0, ih < H, iw >= 0, iw < W)
        return tirx.if_then_else(inside, x[n, cb, ih, iw, i], tirx.const(value, dtype))

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
        return _unpack_tiled(N, CB, H, W, block, channels)
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


def _as_uint8(value: tirx.PrimExpr, dtype: str) -> tirx.PrimExpr:
    """A uint8 or int8 value as the int8 kernels hold it: uint8 as it is, int8 + 128."""
    return value.astype("uint8") if dtype == "uint8" else (value.astype("int32") + 128).astype("uint8")


def pack_quantized_func(shape: Sequence[int], block: int, padding: Sequence[int], zero_point: int,
                        dtype: str = "uint8") -> tirx.PrimFunc:
    """NCHW `shape` of `dtype` (uint8, or int8: + 128, its bits' top one flipped) -> blocked uint8
    (N, ceil(C/block), H+top+bottom, W+left+right, block), the border and the channels past C
    holding `zero_point` (uint8's): an int8 convolution's padding reads the zero point, so the sums
    need no border correction, and the extra channels meet zero weights."""
    N, C, H, W = (int(v) for v in shape)
    if dtype not in ("uint8", "int8"):
        raise ValueError(f"pack_quantized: {dtype} data is not uint8 or int8")
    top, left, bottom, right = (int(p) for p in padding)
    x = te.placeholder((N, C, H, W), dtype, name="data")

    def body(n, cb, h, w, c):
        ih, iw = h - top, w - left
        inside = tirx.all(ih >= 0, ih < H, iw >= 0, iw < W, cb * block + c < C)
        value = x[n, tirx.min(cb * block + c, C - 1), ih, iw]
        return tirx.if_then_else(inside, _as_uint8(value, dtype), tirx.const(zero_point, "uint8"))

    out_shape = (N, -(-C // block), H + top + bottom, W + left + right, block)
    xb = te.compute(out_shape, body, name="data_blocked")
    sch = s_tir.Schedule(te.create_prim_func([x, xb]))
    n, cb, h, w_, c = sch.get_loops(sch.get_sblock("data_blocked"))
    sch.reorder(c, w_)  # read rows of the source, scatter into an L1-sized destination row
    sch.parallel(sch.fuse(n, cb, h))
    return sch.mod["main"].with_attrs({KERNEL_ATTR: "pack_quantized", PACK_PADDING_ATTR: [top, left, bottom, right],
                                      PACK_ZERO_ATTR: int(zero_point)})


def pack_quantized_rows_func(rows: int, channels: int, block: int, zero_point: int,
                             dtype: str = "uint8") -> tirx.PrimFunc:
    """A (rows, channels) matrix of `dtype` -> what :func:`pack_quantized_func` writes for the
    1 x rows image of its transpose, (1, ceil(channels / block), 1, rows, block) uint8, channels
    past `channels` holding `zero_point`: a quantized dense layer's input (its 1x1 convolution's,
    :func:`~tvm_ext.transform.quantized_matmul_as_conv2d`) in one pass of `block`-byte runs,
    not a byte transpose and a pack."""
    if dtype not in ("uint8", "int8"):
        raise ValueError(f"pack_quantized_rows: {dtype} data is not uint8 or int8")
    x = te.placeholder((rows, channels), dtype, name="data")

    def body(n, cb, h, m, c):
        k = cb * block + c
        return tirx.if_then_else(k < channels, _as_uint8(x[m, tirx.min(k, channels - 1)], dtype),
                                 tirx.const(zero_point, "uint8"))

    xb = te.compute((1, -(-channels // block), 1, rows, block), body, name="data_blocked")
    sch = s_tir.Schedule(te.create_prim_func([x, xb]))
    n, cb, h, m, c = sch.get_loops(sch.get_sblock("data_blocked"))
    sch.parallel(sch.fuse(n, cb, h, m))
    sch.vectorize(c)
    return sch.mod["main"].with_attr(KERNEL_ATTR, "pack_quantized_rows")


def quantized_blocks_func(blocked_shape: Sequence[int], channels: int, block: int, padding: Sequence[int],
                          scale: float, zero_point: int, dtype: str = "uint8") -> tirx.PrimFunc:
    """Blocked float32 (N, CB, H, W, c) -> what :func:`pack_quantized_func` writes (blocks of
    `block`, the border and the channels past `channels` holding the zero point) of the NCHW
    view's quantize, in one pass: relax.quantize's arithmetic, clip(round(x / `scale`) +
    `zero_point`) to `dtype`'s range, but rounded to nearest even (ONNX's QuantizeLinear and
    PyTorch's quantize; relax's legalization rounds ties away from zero). The input of an int8
    convolution whose producer is an fp32 kernel (the unpack, quantize and pack were three passes:
    PT2E EfficientNet-B0's projection convolutions after the squeeze-excitation)."""
    n, cb, h, w, c = (int(v) for v in blocked_shape)
    if not 0 < channels <= cb * c:
        raise ValueError(f"quantized_blocks: {channels} channels do not fit {cb} blocks of {c}")
    if dtype not in ("uint8", "int8"):
        raise ValueError(f"quantized_blocks: {dtype} is not uint8 or int8")
    top, left, bottom, right = (int(p) for p in padding)
    low, high = (-128, 127) if dtype == "int8" else (0, 255)
    offset = 128 if dtype == "int8" else 0  # (int8 is held as uint8 + 128)
    x = te.placeholder((n, cb, h, w, c), "float32", name="data")

    def source(ob, o) -> tuple[tirx.PrimExpr, tirx.PrimExpr]:
        """(the input block, the channel in it) of output channel ob * block + o: contiguous in o
        where one block size divides the other (vector loads), else a channel at a time."""
        if block % c == 0:
            return tirx.min(ob * (block // c) + o // c, cb - 1), o % c
        if c % block == 0:
            return ob // (c // block), ob % (c // block) * block + o
        k = tirx.min(ob * block + o, cb * c - 1)
        return k // c, k % c

    def body(b, ob, i, j, o):
        ih, iw = i - top, j - left
        inside = tirx.all(ih >= 0, ih < h, iw >= 0, iw < w, ob * block + o < channels)
        at, channel = source(ob, o)
        value = x[b, at, tirx.max(tirx.min(ih, h - 1), 0), tirx.max(tirx.min(iw, w - 1), 0), channel]
        rounded = tirx.call_llvm_pure_intrin("float32", "llvm.nearbyint", value / tirx.const(scale, "float32"))
        held = tirx.max(tirx.min(rounded + float(zero_point), float(high)), float(low)) + float(offset)
        return tirx.if_then_else(inside, held.astype("int32").astype("uint8"),
                                 tirx.const(zero_point + offset, "uint8"))

    out_shape = (n, -(-channels // block), h + top + bottom, w + left + right, block)
    y = te.compute(out_shape, body, name="quantized")
    sch = s_tir.Schedule(te.create_prim_func([x, y]))
    b, ob, i, j, o = sch.get_loops(sch.get_sblock("quantized"))
    sch.parallel(sch.fuse(b, ob, i))
    if block % c == 0 and block > c:
        o = sch.split(o, [None, c])[1]
    sch.vectorize(o)
    return sch.mod["main"].with_attr(KERNEL_ATTR, "quantized_blocks")


def unpack_quantized_func(blocked_shape: Sequence[int], channels: int, dtype: str = "uint8") -> tirx.PrimFunc:
    """Blocked uint8 (N, CB, H, W, c) -> NCHW `dtype` with `channels` channels: uint8 as it is,
    int8 as the value - 128 (an int8 tensor kept as uint8 + 128: :func:`pack_quantized_func`)."""
    N, CB, H, W, block = (int(v) for v in blocked_shape)
    if not 0 < channels <= CB * block:
        raise ValueError(f"unpack_quantized: {channels} channels do not fit {CB} blocks of {block}")
    if dtype not in ("uint8", "int8"):
        raise ValueError(f"unpack_quantized: {dtype} is not uint8 or int8")
    xb = te.placeholder((N, CB, H, W, block), "uint8", name="data_blocked")

    def body(n, k, h, w):
        value = xb[n, k // block, h, w, k % block]
        return value if dtype == "uint8" else (value.astype("int32") - 128).astype("int8")

    y = te.compute((N, channels, H, W), body, name="data")
    sch = s_tir.Schedule(te.create_prim_func([xb, y]))
    n, k, h, w_ = sch.get_loops(sch.get_sblock("data"))
    sch.parallel(sch.fuse(n, k))
    return sch.mod["main"].with_attr(KERNEL_ATTR, "unpack_quantized")


def unpack_quantized_rows_func(blocked_shape: Sequence[int], channels: int, dtype: str = "uint8") -> tirx.PrimFunc:
    """Blocked uint8 (1, CB, 1, rows, c) -> a (rows, `channels`) matrix of `dtype`: the transpose
    of what :func:`unpack_quantized_func` writes, a quantized dense layer's output as rows (its
    1x1 convolution's output image is 1 x rows) in one pass of block-byte runs."""
    N, CB, H, rows, block = (int(v) for v in blocked_shape)
    if N != 1 or H != 1 or not 0 < channels <= CB * block:
        raise ValueError(f"unpack_quantized_rows: {tuple(blocked_shape)} is not a 1 x rows image of "
                         f"{channels} channels")
    if dtype not in ("uint8", "int8"):
        raise ValueError(f"unpack_quantized_rows: {dtype} is not uint8 or int8")
    xb = te.placeholder((N, CB, H, rows, block), "uint8", name="data_blocked")

    def body(m, k):
        value = xb[0, k // block, 0, m, k % block]
        return value if dtype == "uint8" else (value.astype("int32") - 128).astype("int8")

    y = te.compute((rows, channels), body, name="data")
    sch = s_tir.Schedule(te.create_prim_func([xb, y]))
    m, k = sch.get_loops(sch.get_sblock("data"))
    if channels % block == 0:
        _, c = sch.split(k, [None, block])
        sch.vectorize(c)
    sch.parallel(m)
    return sch.mod["main"].with_attr(KERNEL_ATTR, "unpack_quantized_rows")


def dequantized_units_func(blocked_shape: Sequence[int], padding: Sequence[int], zero_point: int,
                           scale: float = 1.0) -> tirx.PrimFunc:
    """Blocked uint8 (N, CB, H, W, c) -> blocked float32 (N, CB, H+top+bottom, W+left+right, c) of
    q - `zero_point` (the quantized values in units of their scale, exact), zeros in the border:
    the input of an int8 depthwise convolution computed in float32 (its sums are integers). With
    a `scale`, times it (float32, after the subtraction: relax.dequantize's arithmetic): the
    dequantized values, for the fp32 kernels that read them."""
    n, cb, h, w, block = (int(v) for v in blocked_shape)
    top, left, bottom, right = (int(p) for p in padding)
    x = te.placeholder((n, cb, h, w, block), "uint8", name="data")

    def body(b, c, i, j, k):
        ih, iw = i - top, j - left
        inside = tirx.all(ih >= 0, ih < h, iw >= 0, iw < w)
        value = x[b, c, tirx.max(tirx.min(ih, h - 1), 0), tirx.max(tirx.min(iw, w - 1), 0), k]
        units = (value.astype("int32") - zero_point).astype("float32")
        if scale != 1.0:
            units = units * tirx.const(float(np.float32(scale)), "float32")
        return tirx.if_then_else(inside, units, tirx.const(0.0))

    y = te.compute((n, cb, h + top + bottom, w + left + right, block), body, name="units")
    sch = s_tir.Schedule(te.create_prim_func([x, y]))
    b, c, i, j, k = sch.get_loops(sch.get_sblock("units"))
    sch.parallel(sch.fuse(b, c, i))
    sch.vectorize(k)
    return sch.mod["main"].with_attrs({KERNEL_ATTR: "dequantized_units",
                                       DEQUANTIZE_ATTR: [zero_point, float(np.float32(scale))]})


def unpack_units_func(blocked_shape: Sequence[int], border: Sequence[int], channels: int, zero_point: int,
                      dtype: str = "uint8") -> tirx.PrimFunc:
    """Blocked float32 units (N, CB, H + top + bottom, W + left + right, c) of a quantized tensor
    (q - `zero_point`, :attr:`~tvm_ext.kernels.conv2d.Epilogue.units`) -> NCHW `dtype` q, its
    `channels` channels, without the border (top, left, bottom, right)."""
    n, cb, hp, wp, block = (int(v) for v in blocked_shape)
    top, left, bottom, right = (int(p) for p in border)
    h, w = hp - top - bottom, wp - left - right
    x = te.placeholder((n, cb, hp, wp, block), "float32", name="units")
    y = te.compute((n, channels, h, w), lambda b, k, i, j: (
        x[b, k // block, i + top, j + left, k % block].astype("int32") + zero_point).astype(dtype), name="data")
    sch = s_tir.Schedule(te.create_prim_func([x, y]))
    b, k, i, j = sch.get_loops(sch.get_sblock("data"))
    sch.parallel(sch.fuse(b, k))
    return sch.mod["main"].with_attr(KERNEL_ATTR, "unpack_units")


def pack_data_func(plan: Conv2dPlan) -> tirx.PrimFunc:
    """A convolution's NCHW input (possibly a user's NumPy array) -> its blocked, padded input."""
    wl = plan.wl
    return pack_nchwc_func((wl.N, wl.C, wl.H, wl.W), plan.in_bn, wl.padding, wl.dtype, user_input=True)
