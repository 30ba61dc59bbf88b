"""Element-wise kernels on quantized tensors in the blocked layout (LLVM CPU): the ops a quantized
(QDQ) network runs between its int8 convolutions, on their uint8 outputs as they are.

A tensor is uint8 here whatever its dtype in the graph: an int8 one is held as value + 128 with
its zero point + 128 (:func:`~tvm_ext.kernels.layout.pack_quantized_func`), which leaves every
`q - zero_point` and every saturation the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from .common import KERNEL_ATTR, param_buffer

__all__ = ["Quantization", "quantized_add_func", "quantized_add_terms"]


@dataclasses.dataclass(frozen=True)
class Quantization:
    """A per-tensor quantization: scale, zero point, dtype ("uint8", or "int8": held as uint8 + 128)."""

    scale: float
    zero_point: int
    dtype: str = "uint8"

    @property
    def offset(self) -> int:
        """What the uint8 a tensor is held in adds to its values."""
        return 128 if self.dtype == "int8" else 0


def quantized_add_terms(a: Quantization, b: Quantization, out: Quantization) -> tuple[float, float, float]:
    """(a's ratio, b's ratio, the fixed part) of ONNX Runtime's QLinearAdd on x86 (MLAS): the sum
    is fma(A, s_a / s_c, fma(B, s_b / s_c, fixed)) on the raw values, in float32, with
    fixed = z_c - fma(ratio_a, z_a, ratio_b * z_b), then rounded to nearest even and saturated
    (MLAS's AVX2 kernel, its fixed part as its compiler contracts it: found by matching ORT's
    output on the adds of ResNet-18, ResNet-50 and ResNeXt-50, where the other orders and the
    unfused forms round some ties the other way).
    Matching it bit for bit keeps a network's outputs on ORT's (a tie rounded the other way
    changes every later layer a little)."""
    f32 = np.float32
    ratio_a, ratio_b = f32(f32(a.scale) / f32(out.scale)), f32(f32(b.scale) / f32(out.scale))
    fused = f32(np.float64(ratio_a) * a.zero_point + np.float64(f32(ratio_b * f32(b.zero_point))))
    return float(ratio_a), float(ratio_b), float(f32(f32(out.zero_point) - fused))


def quantized_add_func(blocked_shape: Sequence[int], a: Quantization, b: Quantization, out: Quantization,
                       relu: bool = False) -> tirx.PrimFunc:
    """The quantized sum of two blocked tensors of `blocked_shape` (N, CB, H, W, c): ONNX Runtime's
    QLinearAdd arithmetic (:func:`quantized_add_terms`), [a relu: no value below the zero point],
    written as `out.dtype` held in uint8. Explicit vectors and explicit multiply-adds (`llvm.fma`:
    fused whatever LLVM's contraction settings)."""
    n, cb, h, w, block = (int(v) for v in blocked_shape)
    lanes = next(v for v in (16, 8, 4, 2, 1) if block % v == 0)
    ratio_a, ratio_b, fixed = quantized_add_terms(a, b, out)
    low, high = (-128, 127) if out.dtype == "int8" else (0, 255)
    if relu:
        low = max(low, out.zero_point)
    vec, words = f"float32x{lanes}", f"int32x{lanes}"

    def raw(buffer, row, at, quantization: Quantization) -> tirx.PrimExpr:
        held = T.Cast(words, buffer.vload([row, at], f"uint8x{lanes}"))
        return T.Cast(vec, held - T.Broadcast(T.int32(quantization.offset), lanes))

    def fma(x, ratio: float, addend) -> tirx.PrimExpr:
        return T.call_llvm_pure_intrin(vec, "llvm.fma", x, T.Broadcast(T.float32(ratio), lanes), addend)

    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("quantized_add")
        T.func_attr({"tirx.noalias": True, KERNEL_ATTR: "quantized_add"})
        x, y, z = (param_buffer(name, (n, cb, h, w, block), dtype="uint8") for name in ("a", "b", "c"))
        flat = [IRBuilder.name(f"{buf.name}_rows", T.decl_buffer((n * cb * h, w * block), "uint8", data=buf.data))
                for buf in (x, y, z)]
        with T.parallel(0, n * cb * h) as row, T.serial(0, w * block // lanes) as v:
            at = v * lanes
            total = fma(raw(flat[0], row, at, a), ratio_a,
                        fma(raw(flat[1], row, at, b), ratio_b, T.Broadcast(T.float32(fixed), lanes)))
            rounded = T.call_llvm_pure_intrin(vec, "llvm.nearbyint", total)
            clamped = T.max(T.min(rounded, T.Broadcast(T.float32(high), lanes)), T.Broadcast(T.float32(low), lanes))
            stored = T.Cast(words, clamped) + T.Broadcast(T.int32(out.offset), lanes)
            T.buffer_store(flat[2], T.Cast(f"uint8x{lanes}", stored), [row, T.Ramp(at, 1, lanes)])
    return builder.get()
