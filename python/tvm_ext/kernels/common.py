"""What every CPU kernel generator shares: the kernel attribute, parameter buffers, the
activations (one definition behind convolution epilogues and the elementwise, concatenation and
Winograd kernels), argument normalization, and declaring a user array's alignment."""

from __future__ import annotations

import math

import tvm.script.tirx
from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from . import script
from .vector_math import ACTIVATION_FUNCTIONS

__all__ = ["ACTIVATIONS", "KERNEL_ATTR", "USER_ALIGNMENT", "accept_user_alignment", "activation_expr",
           "activation_text", "normalize_padding", "pair", "param_buffer", "scratch_buffer", "STACK_BUFFER_CONFIG"]

KERNEL_ATTR = "tvm_ext.kernel"  # every generated PrimFunc carries it: what kind of kernel it is


def pair(v, name: str) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    v = tuple(int(x) for x in v)
    if len(v) != 2:
        raise ValueError(f"conv2d: {name} must be an int or a pair, got {v}")
    return v


def normalize_padding(padding) -> tuple[int, int, int, int]:
    """int, (ph, pw) or (top, left, bottom, right) -> (top, left, bottom, right)."""
    if isinstance(padding, int):
        pads = (padding, padding, padding, padding)
    else:
        pads = tuple(int(p) for p in padding)
        if len(pads) == 2:
            pads = (pads[0], pads[1], pads[0], pads[1])
        elif len(pads) != 4:
            raise ValueError(f"conv2d: padding must be an int, (ph, pw) or (top, left, bottom, right), got {padding}")
    if min(pads) < 0:
        raise ValueError(f"conv2d: negative padding {pads}")
    return pads


def with_border(shape, border) -> tuple[int, ...]:
    """A blocked (N, C/c, H, W, c) shape with a zero border (top, left, bottom, right) around
    its images."""
    n, blocks, h, w, block = (int(v) for v in shape)
    top, left, bottom, right = (int(p) for p in border)
    return (n, blocks, h + top + bottom, w + left + right, block)


# Activations as TVMScript expressions of the value {v} (and {alpha}, leaky_relu's slope): the
# one definition behind convolution epilogues and the elementwise kernels. Comparisons select,
# so a NaN stays a NaN as in PyTorch (LLVM's max/min of a NaN and 0 give 0).
# 1 / (1 + exp(-v)) with the exp of :func:`.vector_math.vector_exp` (T.sigmoid's exp is a scalar expf call per
# lane: 64 calls an iteration of an AVX-512 kernel, 60% of EfficientNet's time in its SiLU
# epilogues). Below -88.38 the exp is clamped: the result, under 4e-39, is 0 (as -inf's is).
_SIGMOID = ("T.Select({v} < T.float32(-88.3762626647949), T.float32(0), "
            "T.float32(1) / (T.float32(1) + _vector_exp(T.float32(0) - {v})))")
_HARDSIGMOID = ("T.Select({v} + T.float32(3) < T.float32(0), T.float32(0), T.Select({v} + T.float32(3) > "
                "T.float32(6), T.float32(6), {v} + T.float32(3))) / T.float32(6)")
ACTIVATIONS = {
    "relu": "T.Select({v} < T.float32(0), T.float32(0), {v})",
    "relu6": "T.Select({v} < T.float32(0), T.float32(0), T.Select({v} > T.float32(6), T.float32(6), {v}))",
    "sigmoid": _SIGMOID,
    "silu": "{v} * " + _SIGMOID,
    "gelu": "{v} * (T.float32(0.5) + _vector_erf({v} * T.float32(0.7071067811865476)) * T.float32(0.5))",
    "leaky_relu": "T.Select({v} < T.float32(0), T.float32({alpha!r}) * {v}, {v})",
    # PyTorch's as its importer writes them (clip(x + 3, 0, 6) / 6): the same rounding
    "hardsigmoid": _HARDSIGMOID,
    "hardswish": "{v} * (" + _HARDSIGMOID + ")",
}


def activation_text(name: str, value: str, alpha: float = 0.01) -> str:
    """Activation `name` applied to the TVMScript expression `value`."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; choose from {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name].format(v=f"({value})", alpha=float(alpha))


def activation_expr(name: str, value: tirx.PrimExpr, alpha: float = 0.01, *,
                    scalar_erf: bool = False) -> tirx.PrimExpr:
    """Activation `name` (:data:`ACTIVATIONS`) applied to the expression `value`, as IR.
    `scalar_erf`: GELU's erf as T.erf (a libm call a lane) instead of the vectorized one, where
    lowering that one costs too much (Winograd's output transform, docs/tvm_0.27_hazards.md)."""
    text = activation_text(name, "v", alpha)
    functions = {**ACTIVATION_FUNCTIONS, "_vector_erf": tirx.erf} if scalar_erf else ACTIVATION_FUNCTIONS
    return eval(text, {"T": tvm.script.tirx, "v": value, **functions})  # noqa: S307


def bf16_bits(value: tirx.Var) -> tirx.PrimExpr:
    """The bits (uint16) of the bfloat16 nearest to float32 `value`, ties to even, as `astype`
    rounds; a NaN stays a quiet NaN (the rounding carry would make some infinite). Integer
    arithmetic: TVM's bf16 legalization refused the Let expressions of an activation inside a
    cast to bfloat16. `value` is read three times: a bound variable."""
    bits = tirx.reinterpret("uint32", value)

    def u32(v: int) -> tirx.PrimExpr:
        return tirx.const(v, "uint32")

    rounded = (bits + u32(0x7FFF) + ((bits >> u32(16)) & u32(1))) >> u32(16)
    nan = (bits | u32(0x00400000)) >> u32(16)
    return tirx.Cast("uint16", tirx.Select((bits & u32(0x7FFFFFFF)) > u32(0x7F800000), nan, rounded))


def bf16_value(bits: tirx.PrimExpr) -> tirx.PrimExpr:
    """The float32 value of a bfloat16 held as its bits (uint16): the top half of the float32,
    exact. Integer arithmetic, as :func:`bf16_bits`, for the same reason."""
    return tirx.reinterpret("float32", tirx.Cast("uint32", bits) << tirx.const(16, "uint32"))


def load_value(buffer: tirx.Buffer, index) -> tirx.PrimExpr:
    """buffer[index]; from a bf16 tensor read through its uint16 alias, widened to float32
    (:func:`bf16_value`)."""
    value = buffer[tuple(index)]
    return bf16_value(value) if buffer.dtype == "uint16" else value


def param_buffer(name: str, shape, align: int = -1, dtype: str = "float32") -> tirx.Buffer:
    """A parameter `name` of the PrimFunc being built and its buffer (named in capitals)."""
    return IRBuilder.name(name.upper(), T.match_buffer(T.arg(name, T.handle()), shape, dtype, align=align))


# A scratch buffer of at most this many bytes lives on the task's stack (TVM puts those of less
# than 1 KiB there; above that each parallel task called TVMBackendAllocWorkspace and its free:
# 0.11 ms of a 0.72 ms ResNet layer with 448 tasks). Threads have megabytes of stack.
STACK_BUFFER_BYTES = 64 * 1024
# TVM's Allocate annotation that keeps an allocation out of TVMBackendAllocWorkspace. TVM's
# StorageRewrite rebuilds allocations without their annotations: it holds only where a kernel is
# compiled without that pass (ops.forward's kernels are; see STACK_BUFFER_CONFIG).
_ON_STACK = "disable_lower_builtin"
STACK_BUFFER_CONFIG = {"tirx.disable_storage_rewrite": True}


def scratch_buffer(name: str, shape, dtype: str = "float32") -> tirx.Buffer:
    """A task-private scratch buffer declared where the task runs: on its stack when it is small
    enough (:data:`STACK_BUFFER_BYTES`) and compiled with :data:`STACK_BUFFER_CONFIG`."""
    nbytes = tvm.DataType(dtype).bits // 8 * math.prod(int(v) for v in shape)
    annotations = {_ON_STACK: True} if nbytes <= STACK_BUFFER_BYTES else None
    return IRBuilder.name(name, T.alloc_buffer(shape, dtype, annotations=annotations))


USER_ALIGNMENT = 16  # what NumPy guarantees for its arrays (large ones sit 16 bytes past a page)


def accept_user_alignment(func: tirx.PrimFunc, param: str) -> tirx.PrimFunc:
    """Declare parameter `param` as only USER_ALIGNMENT-aligned (TVM assumes 64 by default).

    Arrays that come from the user can then be passed without a copy: copying the weights of a
    512x512 3x3 layer on every call cost more than packing them.
    """
    text = func.script()
    head, sep, rest = text.partition(f"{param}: T.Buffer(")
    shape_and_dtype, close, tail = rest.partition(")")  # the shape tuple ends at the first ")"
    dtype_end = tail.index(")")
    text = head + sep + shape_and_dtype + close + tail[:dtype_end] + f", align={USER_ALIGNMENT}" + tail[dtype_end:]
    return script.from_source(text)
