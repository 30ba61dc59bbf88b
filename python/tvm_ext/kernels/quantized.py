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

from ..relax_info import Quantization
from .common import KERNEL_ATTR, param_buffer

__all__ = ["Quantization", "QuantizedSum", "quantized_add_func", "quantized_add_terms", "quantized_sum"]


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


@dataclasses.dataclass(frozen=True)
class QuantizedSum:
    """A quantized add, a + b [-> relu] quantized as `out` (ONNX Runtime's QLinearAdd): the add
    kernel's, or a convolution's epilogue's where the convolution computes one operand (`own`).

    `float_own`: the convolution's operand is its float output, not a quantized one (PyTorch
    PT2E's conv + add + relu, whose quantizer quantizes the sum only): that operand's
    quantization is then `out.scale` with zero point 0, the float output in units of the sum's
    scale, which the epilogue adds unrounded."""

    a: Quantization
    b: Quantization
    out: Quantization
    relu: bool = False
    own: str = "a"  # which operand a convolution that fuses the add computes
    float_own: bool = False

    def __post_init__(self):
        if self.own not in ("a", "b"):
            raise ValueError(f"QuantizedSum: own must be 'a' or 'b', got {self.own!r}")
        if self.float_own and (self.own != "a" or self.a.scale != self.out.scale or self.a.zero_point != 0):
            raise ValueError("QuantizedSum: a float operand is a, its quantization the sum's scale with zero point 0")

    @staticmethod
    def of_float_output(other: Quantization, out: Quantization, relu: bool) -> QuantizedSum:
        """The PT2E form: a convolution's float output (operand a) + dequantize(other), quantized as `out`."""
        return QuantizedSum(Quantization(out.scale, 0, out.dtype), other, out, relu, "a", float_own=True)


def quantized_sum(raw_a: tirx.PrimExpr, raw_b: tirx.PrimExpr, terms: QuantizedSum, lanes: int = 1) -> tirx.PrimExpr:
    """The held value (float32, an integer in [0, 255]) of the quantized sum of two raw values
    (q itself, held - offset, in float32): :func:`quantized_add_terms`'s multiply-adds (explicit
    `llvm.fma`: fused whatever LLVM's contraction settings), rounded to nearest even, saturated
    (no value below the zero point after a relu), + the output's offset."""
    ratio_a, ratio_b, fixed = quantized_add_terms(terms.a, terms.b, terms.out)
    low, high = (-128, 127) if terms.out.dtype == "int8" else (0, 255)
    if terms.relu:
        low = max(low, terms.out.zero_point)
    dtype = f"float32x{lanes}" if lanes > 1 else "float32"

    def const(value: float) -> tirx.PrimExpr:
        return T.Broadcast(T.float32(value), lanes) if lanes > 1 else T.float32(value)

    def fma(x, ratio: float, addend) -> tirx.PrimExpr:
        return T.call_llvm_pure_intrin(dtype, "llvm.fma", x, const(ratio), addend)

    total = fma(raw_a, ratio_a, fma(raw_b, ratio_b, const(fixed)))
    rounded = T.call_llvm_pure_intrin(dtype, "llvm.nearbyint", total)
    return T.max(T.min(rounded, const(high)), const(low)) + const(terms.out.offset)


def quantized_add_func(blocked_shape: Sequence[int], a: Quantization, b: Quantization, out: Quantization,
                       relu: bool = False) -> tirx.PrimFunc:
    """The quantized sum of two blocked tensors of `blocked_shape` (N, CB, H, W, c): ONNX Runtime's
    QLinearAdd arithmetic (:func:`quantized_add_terms`), [a relu: no value below the zero point],
    written as `out.dtype` held in uint8 (:func:`quantized_sum`, on explicit vectors)."""
    n, cb, h, w, block = (int(v) for v in blocked_shape)
    lanes = next(v for v in (16, 8, 4, 2, 1) if block % v == 0)
    terms = QuantizedSum(a, b, out, relu)

    def typed(dtype: str) -> str:  # (an odd block, a grouped convolution's 3 channels: scalars)
        return dtype if lanes == 1 else f"{dtype}x{lanes}"

    def raw(buffer, row, at, quantization: Quantization) -> tirx.PrimExpr:
        held = T.Cast(typed("int32"), buffer.vload([row, at], typed("uint8")))
        offset = T.int32(quantization.offset)
        return T.Cast(typed("float32"), held - (offset if lanes == 1 else T.Broadcast(offset, lanes)))

    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("quantized_add")
        T.func_attr({"tirx.noalias": True, KERNEL_ATTR: "quantized_add"})
        x, y, z = (param_buffer(name, (n, cb, h, w, block), dtype="uint8") for name in ("a", "b", "c"))
        flat = [IRBuilder.name(f"{buf.name}_rows", T.decl_buffer((n * cb * h, w * block), "uint8", data=buf.data))
                for buf in (x, y, z)]
        with T.parallel(0, n * cb * h) as row, T.serial(0, w * block // lanes) as v:
            at = v * lanes
            held = quantized_sum(raw(flat[0], row, at, a), raw(flat[1], row, at, b), terms, lanes)
            T.buffer_store(flat[2], T.Cast(typed("uint8"), T.Cast(typed("int32"), held)),
                           [row, at if lanes == 1 else T.Ramp(at, 1, lanes)])
    return builder.get()
