"""Elementwise activations (LLVM CPU): one vectorized, parallel pass over memory.

The activation is the same TVMScript expression a convolution's epilogue applies
(:data:`tvm_ext.kernels.conv2d.ACTIVATIONS`), here over the tensor viewed as one flat vector.
:func:`activation_func` is for one shape (a graph's layer); :func:`dynamic_activation_func` takes
the element count at run time, so that the eager API compiles one kernel per activation, not one
per tensor size (each compiled kernel holds about a megabyte).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import numpy as np
from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from ..target import CPU_FEATURES_ATTR, TargetLike, has_avx512_vbmi
from . import script
from .common import ACTIVATIONS, KERNEL_ATTR, activation_text, bf16_bits, param_buffer

__all__ = ["ACTIVATIONS", "activation_func", "bf16_round_func", "check_slope", "dynamic_activation_func",
           "fake_quantize_func", "flat_activation_func", "lookup_table_func"]

_TEMPLATE = """
@T.prim_func(s_tir=True)
def activation(x: T.handle, y: T.handle) -> None:
    X = T.match_buffer(x, {shape}, "float32")
    Y = T.match_buffer(y, {shape}, "float32")
    X_flat = T.decl_buffer(({size},), "float32", data=X.data)
    Y_flat = T.decl_buffer(({size},), "float32", data=Y.data)
    for i in {outer_loop}:
        for j in {inner_loop}:
            with T.sblock("output"):
                v = T.axis.spatial({size}, i * {inner} + j)
                T.where(i * {inner} + j < {size})
                Y_flat[v] = {value}
"""

# The element count `n` is a parameter: whole vectors of `inner` lanes in parallel, with no bounds
# check, then the n % inner elements left one by one.
_DYNAMIC_TEMPLATE = """
@T.prim_func(s_tir=True)
def activation(x: T.handle, y: T.handle) -> None:
    n = T.int32()
    X = T.match_buffer(x, (n,), "float32")
    Y = T.match_buffer(y, (n,), "float32")
    for i in T.parallel(n // {inner}):
        for j in T.vectorized({inner}):
            with T.sblock("output"):
                v = T.axis.spatial(n, i * {inner} + j)
                Y[v] = {value}
    for j in range(n % {inner}):
        with T.sblock("tail"):
            v = T.axis.spatial(n, n // {inner} * {inner} + j)
            Y[v] = {value}
"""


def check_slope(alpha) -> float:
    """leaky_relu's `negative_slope` as a float, or an error naming it: the slope is written into
    the kernel as a float32 literal, which NaN, infinities and non-numbers cannot be."""
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise TypeError(f"leaky_relu: negative_slope must be a real number, got {type(alpha).__name__} {alpha!r}")
    value = float(alpha)
    if not math.isfinite(value) or abs(value) > float(np.finfo(np.float32).max):
        raise ValueError(f"leaky_relu: negative_slope must be a finite float32 (|slope| <= 3.4e38), got {value}")
    return value


def dynamic_activation_func(name: str, dtype: str, lanes: int, alpha: float = 0.01) -> tirx.PrimFunc:
    """Scheduled PrimFunc applying activation `name` to a flat vector whose length is a parameter.

    One kernel serves every tensor size (the eager API's cache holds one per activation). Its
    vector loop compiles to the fixed-size kernel's instructions: on 1x64x56x56 (AVX-512) relu
    took 21.8 us against 21.9, gelu 1987 us against 1988.
    """
    if dtype != "float32":
        raise ValueError(f"{name}: dtype {dtype} is not supported (float32 only)")
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; choose from {sorted(ACTIVATIONS)}")
    text = _DYNAMIC_TEMPLATE.format(inner=4 * lanes, value=activation_text(name, "X[v]", check_slope(float(alpha))))
    return script.from_source(text).with_attr(KERNEL_ATTR, name)


def activation_func(name: str, shape, dtype: str, lanes: int, alpha: float = 0.01) -> tirx.PrimFunc:
    """Scheduled PrimFunc applying activation `name` to a tensor of `shape`."""
    if dtype != "float32":
        raise ValueError(f"{name}: dtype {dtype} is not supported (float32 only)")
    size = math.prod(int(v) for v in shape)
    inner = 4 * lanes if size >= 4 * lanes else 1
    return flat_activation_func(name, shape, alpha, inner, "T.parallel({})", "T.vectorized({})")


def flat_activation_func(name: str, shape, alpha: float, inner: int, outer_loop: str,
                         inner_loop: str) -> tirx.PrimFunc:
    """Activation `name` over the tensor as one flat vector, in two loops: `outer_loop` and
    `inner_loop` are TVMScript loop kinds with a `{}` for the extent (parallel + vectorized on a
    CPU, blockIdx + threadIdx bindings on a GPU)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; choose from {sorted(ACTIVATIONS)}")
    alpha = check_slope(float(alpha))  # a graph's attribute may be a FloatImm
    shape = tuple(int(v) for v in shape)
    size = math.prod(shape)
    outer = -(-size // inner)
    text = _TEMPLATE.format(shape=shape, size=size, inner=inner, outer_loop=outer_loop.format(outer),
                            inner_loop=inner_loop.format(inner), value=activation_text(name, "X_flat[v]", alpha))
    return script.from_source(text).with_attr(KERNEL_ATTR, name)


def _flat_map_func(name: str, shape, lanes: int, value: Callable[[tirx.PrimExpr], tirx.PrimExpr]) -> tirx.PrimFunc:
    """y = value(x) element by element over a float32 tensor of `shape` viewed as one flat
    vector: parallel, vectorized, any layout."""
    shape = tuple(int(v) for v in shape)
    size = math.prod(shape)
    inner = 4 * lanes if size >= 4 * lanes else 1
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name(name)
        x, y = (param_buffer(buffer, shape) for buffer in ("x", "y"))
        x_flat, y_flat = (T.decl_buffer((size,), "float32", data=b.data) for b in (x, y))
        with T.sblock("root"), T.parallel(0, -(-size // inner)) as i, T.vectorized(0, inner) as j:
            with T.sblock("output"):
                v = T.axis.spatial(size, i * inner + j)
                T.where(i * inner + j < size)
                T.buffer_store(y_flat, value(x_flat[v]), [v])
    return builder.get().with_attr(KERNEL_ATTR, name)


def bf16_round_func(shape, lanes: int) -> tirx.PrimFunc:
    """Every element of a float32 tensor of `shape` rounded to bfloat16 (to nearest, ties to
    even, as `astype`), written as float32: the data of an emulated bf16 convolution
    (:data:`~tvm_ext.intrin.cpu.EMULATED_BF16`). The bits of :func:`~.common.bf16_bits` in the
    top half: integer arithmetic, because TVM folds a cast to bfloat16 and back into nothing."""
    def rounded(x: tirx.PrimExpr) -> tirx.PrimExpr:
        return tirx.reinterpret("float32", tirx.Cast("uint32", bf16_bits(T.Bind(x))) << tirx.const(16, "uint32"))

    return _flat_map_func("bf16_round", shape, lanes, rounded)


def fake_quantize_func(shape, lanes: int, scale: float, zero_point: int, dtype: str, out_scale: float,
                       out_zero_point: int) -> tirx.PrimFunc:
    """dequantize(quantize(x, `scale`, `zero_point`, `dtype`), `out_scale`, `out_zero_point`) of a
    float32 tensor of `shape`, in one pass and in any layout (element by element): a float
    tensor's fake quantization, as PT2E's graphs hold it before the float ops that read a
    quantized value (a squeeze-excitation's pooling and gate). relax's arithmetic, x / scale
    rounded to nearest even (ONNX's and PyTorch's rounding; relax's legalization rounds ties away
    from zero), + zero point, saturated to `dtype`; then (q - out zero point) * out scale."""
    if dtype not in ("uint8", "int8"):
        raise ValueError(f"fake_quantize: {dtype} is not uint8 or int8")
    low, high = (-128, 127) if dtype == "int8" else (0, 255)

    def fake_quantized(x: tirx.PrimExpr) -> tirx.PrimExpr:
        rounded = T.call_llvm_pure_intrin("float32", "llvm.nearbyint", x / T.float32(scale))
        q = T.max(T.min(rounded + T.float32(zero_point), T.float32(high)), T.float32(low))
        return (q - T.float32(out_zero_point)) * T.float32(out_scale)

    return _flat_map_func("fake_quantize", shape, lanes, fake_quantized)


def channel_scale_func(shape, lanes: int, channels: int | None = None) -> tirx.PrimFunc:
    """x * s with s one value per image and channel: squeeze-excitation's gate (EfficientNet,
    MobileNet-v3, RegNet-Y). `shape` is x's: NCHW (N, C, H, W), or blocked (N, C/c, H, W, c),
    which it keeps (an NCHW multiply between two blocked convolutions cost two layout copies);
    s is (N, C, 1, 1), C = `channels` (default: all of x's; fewer where x's last block is padded:
    those are scaled by the last channel's gate, finite stays finite). Parallel over images and
    channel blocks (or channels), vectorized along the innermost axis."""
    from tvm import s_tir, te

    shape = tuple(int(v) for v in shape)
    x = te.placeholder(shape, "float32", name="x")
    channels = channels or (shape[1] * shape[4] if len(shape) == 5 else shape[1])
    s = te.placeholder((shape[0], channels, 1, 1), "float32", name="s")
    if len(shape) == 5 and channels < shape[1] * shape[4]:
        # The gates of the padded channels first (the last channel's): a clamped index in the
        # vectorized loop was a gather a lane, 4.5x slower (MobileNet-v3's 120 channels at 28x28).
        gates = te.compute((shape[0], shape[1] * shape[4]), lambda n, c: s[n, tirx.min(c, channels - 1), 0, 0],
                           name="gates")
        out = te.compute(shape, lambda n, cb, h, w, c: x[n, cb, h, w, c] * gates[n, cb * shape[4] + c], name="out")
    elif len(shape) == 5:
        out = te.compute(shape, lambda n, cb, h, w, c: x[n, cb, h, w, c] * s[n, cb * shape[4] + c, 0, 0], name="out")
    else:
        out = te.compute(shape, lambda n, c, h, w: x[n, c, h, w] * s[n, c, 0, 0], name="out")
    sch = s_tir.Schedule(te.create_prim_func([x, s, out]))
    loops = sch.get_loops(sch.get_sblock("out"))
    task = sch.fuse(loops[0], loops[1])
    sch.parallel(task)
    if len(shape) == 5 and channels < shape[1] * shape[4]:
        sch.compute_at(sch.get_sblock("gates"), task)  # a task's block of gates, on its stack
    inner = sch.fuse(*loops[2:])
    extent = math.prod(shape[2:])
    if extent >= lanes:
        _, vector = sch.split(inner, [None, lanes] if extent % lanes == 0 else [None, 1])
        sch.vectorize(vector)
    return sch.mod["main"].with_attr(KERNEL_ATTR, "channel_scale")


def lookup_table_func(shape, in_dtype: str, out_dtype: str, target: TargetLike = None) -> tirx.PrimFunc:
    """y = table[x] element by element, x uint8 or int8 (its 256 values, int8 from -128, index
    the table in order) over a tensor of `shape` in any layout: an element-wise function of a
    quantized tensor, tabulated (:mod:`tvm_ext.strategy.quantized_tables`). On a `target` with
    AVX512-VBMI a byte table is looked up 64 bytes at a time (:func:`_byte_permute_lookup`);
    elsewhere, or with no `target`, one element at a time."""
    if in_dtype not in ("uint8", "int8"):
        raise ValueError(f"lookup_table: {in_dtype} is not uint8 or int8")
    shape = tuple(int(v) for v in shape)
    if out_dtype in ("uint8", "int8") and target is not None and has_avx512_vbmi(target):
        return _byte_permute_lookup(shape, in_dtype, out_dtype)
    size = math.prod(shape)
    inner = 256 if size >= 256 else 1
    offset = 128 if in_dtype == "int8" else 0
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("lookup_table")
        x = param_buffer("x", shape, dtype=in_dtype)
        table = param_buffer("table", (256,), dtype=out_dtype)
        y = param_buffer("y", shape, dtype=out_dtype)
        x_flat = T.decl_buffer((size,), in_dtype, data=x.data)
        y_flat = T.decl_buffer((size,), out_dtype, data=y.data)
        with T.sblock("root"), T.parallel(0, -(-size // inner)) as i, T.serial(0, inner) as j:
            with T.sblock("output"):
                v = T.axis.spatial(size, i * inner + j)
                T.where(i * inner + j < size)
                T.buffer_store(y_flat, table[tirx.Cast("int32", x_flat[v]) + offset], [v])
    return builder.get().with_attr(KERNEL_ATTR, "lookup_table")


_VBMI_PERMUTE = "llvm.x86.avx512.vpermi2var.qi.512"  # 64 bytes, each picked from two zmm by its low 7 bits
_LOOKUPS_PER_TASK = 4096  # bytes a parallel task looks up: 64 vectors


def _byte_permute_lookup(shape: tuple[int, ...], in_dtype: str, out_dtype: str) -> tirx.PrimFunc:
    """:func:`lookup_table_func` with AVX512-VBMI's `vpermi2b`: the 256-byte table held in four
    zmm, each 64 input bytes looked up in its low and its high half (two permutes) and the
    halves selected by the byte's top bit (`vpmovb2m`, a masked move): ~5x the scalar gather.
    The bytes are read raw: an int8 input's non-negative values index the table's upper half."""
    size = math.prod(shape)
    vectors, per_task = size // 64, _LOOKUPS_PER_TASK // 64
    low_half = 128 if in_dtype == "int8" else 0  # where the raw bytes 0..127 index the table
    byte_vector = "uint8x64"
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("lookup_table")
        x = param_buffer("x", shape, dtype=in_dtype)
        table = param_buffer("table", (256,), dtype=out_dtype)
        y = param_buffer("y", shape, dtype=out_dtype)
        x_bytes = T.decl_buffer((size,), "uint8", data=x.data)
        y_bytes = T.decl_buffer((size,), "uint8", data=y.data)
        table_bytes = T.decl_buffer((256,), "uint8", data=table.data)
        with T.parallel(0, -(-vectors // per_task)) as task:
            quarters = [table_bytes[T.Ramp((low_half + 64 * q) % 256, 1, 64)] for q in range(4)]
            with T.serial(0, per_task) as j, T.If(task * per_task + j < vectors), T.Then():
                at = T.Ramp((task * per_task + j) * 64, 1, 64)
                index = x_bytes[at]
                low, high = (T.call_llvm_pure_intrin(byte_vector, _VBMI_PERMUTE, quarters[h], index, quarters[h + 1])
                             for h in (0, 2))
                T.buffer_store(y_bytes, T.Select(index >= T.Broadcast(T.uint8(128), 64), high, low), [at])
        with T.serial(vectors * 64, size) as k:  # the last size % 64
            T.buffer_store(y_bytes, table_bytes[(tirx.Cast("int32", x_bytes[k]) + low_half) % 256], [k])
    return builder.get().with_attr(KERNEL_ATTR, "lookup_table").with_attr(CPU_FEATURES_ATTR, "avx512vbmi,avx512bw")
