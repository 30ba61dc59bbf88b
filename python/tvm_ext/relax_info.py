"""What a Relax expression's type says, for the rewrites and the strategy: its static shape, its
dtype, the number in a scalar argument, whether a constant is one value per channel, the operator a
call applies and the per-tensor quantization a quantize or dequantize applies."""

from __future__ import annotations

import dataclasses
from typing import TypeGuard

import numpy as np
import tvm
from tvm import relax

from .errors import UnsupportedError

__all__ = ["static_shape", "image_shape", "known_shape", "symbolic_batch", "same_extent", "shape_text", "dtype",
           "prim_value", "is_channel_bias", "is_call", "op_name", "constant_array", "scalar_array",
           "per_tensor_quantization", "DATA_MOVEMENT_OPS", "Quantization"]


@dataclasses.dataclass(frozen=True)
class Quantization:
    """A per-tensor quantization: scale, zero point, dtype ("uint8", or "int8": held as uint8 + 128
    by the int8 kernels)."""

    scale: float
    zero_point: int
    dtype: str = "uint8"

    @property
    def offset(self) -> int:
        """What the uint8 a tensor is held in adds to its values."""
        return 128 if self.dtype == "int8" else 0


# the ops that only move a tensor's elements (a reshape: a view)
DATA_MOVEMENT_OPS = frozenset({"relax.reshape", "relax.flatten", "relax.permute_dims", "relax.squeeze",
                               "relax.expand_dims"})


def static_shape(expr: relax.Expr) -> tuple[int, ...] | None:
    """The shape as ints, or None if it is unknown or symbolic."""
    ty = expr.ty if hasattr(expr, "ty") else None
    shape = getattr(ty, "shape", None)
    if shape is None:
        return None
    try:
        return tuple(int(v) for v in shape)
    except (TypeError, ValueError):
        return None


def known_shape(shape: tuple[int, ...] | None, what: str) -> tuple[int, ...]:
    """`shape` (from :func:`static_shape` or :func:`image_shape`) where the caller relies on it
    being static, as a decision already checked: an UnsupportedError naming `what` if it is not."""
    if shape is None:
        raise UnsupportedError(f"{what}: the shape is not static")
    return shape


def symbolic_batch(expr: relax.Expr) -> tvm.tirx.PrimExpr | None:
    """The leading extent of a tensor whose other extents are static, if it is symbolic."""
    shape = getattr(getattr(expr, "ty", None), "shape", None)
    if shape is None or not isinstance(shape, (list, tuple, tvm.ir.Array)) or len(shape) == 0:
        shape = getattr(shape, "values", None)  # a ShapeExpr
    if shape is None or len(shape) == 0 or isinstance(shape[0], tvm.tirx.IntImm):
        return None
    return shape[0] if all(isinstance(shape[i], tvm.tirx.IntImm) for i in range(1, len(shape))) else None


def same_extent(a: tvm.tirx.PrimExpr, b: tvm.tirx.PrimExpr) -> bool:
    """Whether two shape extents are provably equal (the same symbolic batch, or equal ints)."""
    from tvm.sym.analyzer import Analyzer

    return Analyzer().can_prove_equal(a, b)


def image_shape(expr: relax.Expr) -> tuple[int, ...] | None:
    """The static shape, or for a symbolic batch (:func:`symbolic_batch`) the shape of one image
    (leading extent 1); None otherwise."""
    shape = static_shape(expr)
    if shape is not None or symbolic_batch(expr) is None:
        return shape
    shape = expr.ty.shape
    return (1, *(int(shape[i]) for i in range(1, len(shape))))


def shape_text(expr: relax.Expr) -> tuple:
    """The shape for people: ints, and the names of symbolic dimensions."""
    shape = getattr(expr.ty, "shape", None)
    if shape is None:
        return ("?",)
    return tuple(int(v) if isinstance(v, tvm.tirx.IntImm) else str(v) for v in shape)


def dtype(expr: relax.Expr) -> str:
    """The tensor's dtype as text (\"\" if it has none)."""
    return str(getattr(expr.ty, "dtype", ""))


def prim_value(expr) -> float | None:
    """The number in a scalar argument (a FloatImm, or a PrimValue wrapping one)."""
    value = getattr(expr, "value", None)
    value = getattr(value, "value", value)
    return float(value) if isinstance(value, (int, float)) else None


def is_channel_bias(bias: relax.Expr, channels: int) -> bool:
    """Whether constant `bias`, added to an NCHW output of `channels` channels, is one value per
    channel (or one for all): shapes (1, K, 1, 1), (K, 1, 1), (1, 1, 1, 1), (1,), () and the like.
    A shape (K,) broadcasts along W, not along the channels."""
    shape = static_shape(bias)
    if shape is None or len(shape) > 4 or dtype(bias) != "float32":
        return False
    aligned = (1,) * (4 - len(shape)) + shape
    return aligned[0] == aligned[2] == aligned[3] == 1 and aligned[1] in (1, channels)


def is_call(expr, op: str) -> TypeGuard[relax.Call]:
    """Whether `expr` calls operator `op` (\"relax.add\")."""
    return op_name(expr) == op


def op_name(expr) -> str | None:
    """The name of the operator `expr` calls (\"relax.add\"), or None if it is no operator call."""
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        return expr.op.name
    return None


def constant_array(expr) -> np.ndarray | None:
    """A tensor constant's data, else None (a constant holding a Python number, a PrimValue or a
    variable is none)."""
    to_numpy = getattr(getattr(expr, "value", None), "numpy", None) if isinstance(expr, tvm.ir.Constant) else None
    return to_numpy() if to_numpy is not None else None


def scalar_array(expr) -> np.ndarray | None:
    """A constant holding one number, as a one-element array of its dtype, else None (a PrimValue
    or a variable is none)."""
    array = constant_array(expr)
    return array.reshape(1) if array is not None and array.size == 1 else None


def per_tensor_quantization(call: relax.Call) -> Quantization | None:
    """The per-tensor uint8/int8 quantization a quantize (of its output) or a dequantize (of its
    input) applies, else None: per-channel, another dtype, parameters that are not constants, or
    a float16 scale (whose arithmetic the kernels, in float32, would not reproduce)."""
    name = op_name(call)
    if name not in ("relax.quantize", "relax.dequantize"):
        return None
    scale, zero = scalar_array(call.args[1]), scalar_array(call.args[2])
    dtype = str(call.attrs.out_dtype) if name == "relax.quantize" else str(call.args[0].ty.dtype.dtype)
    if scale is None or zero is None or scale.dtype != np.float32 or dtype not in ("uint8", "int8"):
        return None
    return Quantization(float(scale[0]), int(zero[0]), dtype)
