"""Element-wise kernels on quantized tensors in the blocked layout (LLVM CPU): the ops a quantized
(QDQ) network runs between its int8 convolutions, on their uint8 outputs as they are.

A tensor is uint8 here whatever its dtype in the graph: an int8 one is held as value + 128 with
its zero point + 128 (:func:`~tvm_ext.kernels.layout.pack_quantized_func`), which leaves every
`q - zero_point` and every saturation the same. The arithmetic is the QDQ ops' own, as TVM
legalizes them (relax's dequantize and quantize): dequantize (q - z) * s in float32, the float op,
quantize round(x / s) + z (ties to even), saturated; so a network built with these kernels
computes what its QDQ graph computes, operation for operation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tvm import s_tir, te, tirx

from .common import KERNEL_ATTR

__all__ = ["Quantization", "quantized_add_func"]


@dataclasses.dataclass(frozen=True)
class Quantization:
    """A per-tensor quantization: scale and zero point (the uint8 one: + 128 for int8)."""

    scale: float
    zero_point: int


def _dequantize(q: tirx.PrimExpr, quantization: Quantization) -> tirx.PrimExpr:
    return (q.astype("int32") - quantization.zero_point).astype("float32") * tirx.const(quantization.scale, "float32")


def _quantize(value: tirx.PrimExpr, quantization: Quantization) -> tirx.PrimExpr:
    rounded = tirx.nearbyint(value / tirx.const(quantization.scale, "float32")) + tirx.const(
        float(quantization.zero_point), "float32")
    return tirx.max(tirx.min(rounded, tirx.const(255.0, "float32")), tirx.const(0.0, "float32")).astype("uint8")


def quantized_add_func(blocked_shape: Sequence[int], a: Quantization, b: Quantization, out: Quantization,
                       relu: bool = False) -> tirx.PrimFunc:
    """quantize(dequantize(A) + dequantize(B) [-> relu]) on blocked uint8 tensors of
    `blocked_shape` (N, CB, H, W, c): a residual add between int8 convolutions."""
    shape = tuple(int(v) for v in blocked_shape)
    x = te.placeholder(shape, "uint8", name="a")
    y = te.placeholder(shape, "uint8", name="b")

    def body(*index):
        value = _dequantize(x[index], a) + _dequantize(y[index], b)
        if relu:
            value = tirx.max(value, tirx.const(0.0, "float32"))
        return _quantize(value, out)

    z = te.compute(shape, body, name="sum")
    sch = s_tir.Schedule(te.create_prim_func([x, y, z]))
    n, cb, h, w, c = sch.get_loops(sch.get_sblock("sum"))
    sch.parallel(sch.fuse(n, cb, h))
    sch.vectorize(c)
    return sch.mod["main"].with_attr(KERNEL_ATTR, "quantized_add").without_attr("global_symbol")
