"""Quantized convolutions in QDQ form lowered to the int8 kernels (LLVM CPU).

An importer of a QDQ model (ONNX Runtime's `quantize_static`, docs/low_precision.md) writes each
quantized convolution as float ops between quantize and dequantize:

    x_f = dequantize(x_q, s_x, z_x)                  x_q uint8 or int8; s_x, z_x scalars
    w_f = dequantize(W_q, s_w, z_w = 0, axis=0)      W_q an int8 constant; s_w per channel or one
    y   = conv2d(x_f, w_f) [+ reshape(dequantize(B_q, s_b, 0))] [-> relu]
    y_q = quantize(y, s_y, z_y)                      uint8 or int8

which is an int8 convolution: the int32 sums of (x_q - z_x) * W_q, + the bias in units of
s_x * s_w (B_q itself where s_b = s_x * s_w, as quantizers write it), times
s_x * s_w / s_y, rounded to nearest even, + z_y, saturated — the int8 kernel's epilogue
(:func:`~tvm_ext.kernels.conv2d.quantized_value`). :func:`lower_quantized_conv2d` replaces each
y_q with that kernel's output, before anything folds the weights' dequantize into float
constants (TVM's FoldConstant does), so it runs first in the pipeline.

The kernel reads uint8: int8 data is packed as x + 128 (zero point + 128), and an int8 output is
written as uint8 with zero point z_y + 128 (saturation the same) and read back through a view
that subtracts 128. The padding holds the zero point, so (x_q - z_x) needs no correction at the
border: the bias carries -z_x * sum(W_q) once. What stays float with stock TVM: everything that
is not a convolution between a dequantize and a quantize, grouped convolutions, asymmetric
weights, a symbolic shape; :func:`quantized_conv2d_reason` says why.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax

from ..kernels import conv2d as _conv
from ..kernels import layout as _layout
from ..kernels import pool2d as _pool
from ..kernels.elementwise import lookup_table_func
from ..kernels.quantized import Quantization, QuantizedSum, quantized_add_func
from ..relax_info import is_call, is_channel_bias, known_shape, per_tensor_quantization, static_shape
from ..target import AVX2, AVX512, VectorISA, amx_permitted, has_amx_int8, has_vnni
from ..tuning.records import conv2d_kernel
from .base import activation_at, add_kernel, called_kernel, field_of, readers_of, scalar_constant
from .quantized_tables import LOOKUP_KERNEL, LOOKUP_ZEROS_ATTR

logger = logging.getLogger("tvm_ext")

__all__ = ["QuantizedAdd", "QuantizedConv2d", "int8_engine", "int8_kernel", "lower_quantized_conv2d",
           "match_float_output_conv2d", "match_quantized_add", "match_quantized_conv2d", "quantized_conv2d_decisions",
           "quantized_conv2d_reason"]

_UNPACK = "tvm_ext_unpack_quantized"
# the NCHW view of float32 blocks, named as the fp32 emitter's own (strategy.cpu), which reads
# the blocks behind a view so named
_FLOAT_UNPACK = "tvm_ext_unpack_nchwc"
FUSED_ADD = "_qadd"  # the name suffix of an int8 convolution that adds a quantized residual (dispatch_report)


@dataclasses.dataclass(frozen=True)
class QuantizedConv2d:
    """A quantized convolution read off the graph (:func:`match_quantized_conv2d`)."""

    data: relax.Expr  # x_q, NCHW uint8 or int8
    data_zero: int  # z_x
    data_scale: float  # s_x
    weight: np.ndarray  # W_q, OIHW int8
    weight_scale: np.ndarray  # s_w, (K,)
    bias: np.ndarray | None  # the bias in float (B_q - z_b) * s_b, (K,)
    conv: relax.Call  # the float conv2d (strides, padding, dilation)
    activation: str | None  # a name of tvm_ext.kernels.conv2d.ACTIVATIONS (no slope)
    out_dtype: str  # uint8 or int8; float32: the float output as it is (match_float_output_conv2d)
    out_zero: int
    out_scale: float
    inside: tuple[relax.Var, ...]  # the float values the kernel computes: read by nothing else
    computing: tuple[relax.Expr, ...]  # the calls that compute them (and the quantize): their reads are its own
    # PT2E's conv + add [+ relu]: the quantized tensor (NCHW, the output's shape) whose
    # dequantized values the convolution's float output is added to, before `activation`
    residual: tuple[relax.Expr, Quantization] | None = None


def _const(expr: relax.Expr) -> np.ndarray | None:
    return expr.value.numpy() if isinstance(expr, tvm.ir.Constant) else None


def _shape(expr: relax.Expr) -> tuple[int, ...]:
    return known_shape(static_shape(expr), "a quantized tensor")


def match_quantized_conv2d(quantize: relax.Call, value_of) -> QuantizedConv2d | str:
    """The quantized convolution `quantize` (a relax.quantize call) ends, or why it is not one
    (`value_of`: a variable's bound value, or None). Checks the form only; see
    :func:`quantized_conv2d_reason` for what the kernels take."""
    out = per_tensor_quantization(quantize)
    if out is None:
        return "not a per-tensor uint8/int8 quantize"
    return _match_conv2d(quantize.args[0], value_of, out, quantize)


def match_float_output_conv2d(var: relax.Var, value_of) -> QuantizedConv2d | str:
    """The quantized convolution (int8 data and weights) whose float output [+ bias] [-> an
    activation] is `var`, read as it is: no quantize after it (PT2E quantizes after a
    concatenation, not the convolution's output), or why it is not one."""
    return _match_conv2d(var, value_of, None)


# The activations an int8 kernel's epilogue applies before the requantization (ACTIVATIONS'
# without a parameter): PT2E's EfficientNets and MobileNet-v3 quantize after SiLU and hardswish.
QUANTIZED_ACTIVATIONS = ("relu", "relu6", "sigmoid", "silu", "hardsigmoid", "hardswish")


def _looking_through(value_of) -> Callable[[relax.Expr], relax.Expr]:
    """`value_of` (a variable's bound value, or None) as :func:`~.base.activation_at` reads: the
    bound value, or the expression itself."""
    def look(expr: relax.Expr) -> relax.Expr:
        bound = value_of(expr) if isinstance(expr, relax.Var) else None
        return expr if bound is None else bound
    return look


def _computed_between(top: relax.Expr, bottom: relax.Expr, value_of) -> tuple[list[relax.Var], list[relax.Expr]]:
    """The bound variables and calls of the expression `top` computes from `bottom` (an
    activation's decomposition: x * sigmoid(x), x * clip(x + 3, 0, 6) / 6), `bottom` excluded."""
    variables, calls = [], []

    def walk(expr: relax.Expr) -> None:
        if isinstance(expr, relax.Var):
            if expr.same_as(bottom) or value_of(expr) is None or expr in variables:
                return
            variables.append(expr)
            expr = value_of(expr)
        if isinstance(expr, relax.Call):
            calls.append(expr)
            for arg in expr.args:
                walk(arg)

    walk(top)
    return variables, calls


def _match_conv2d(output: relax.Expr, value_of, out: Quantization | None,
                  quantize: relax.Call | None = None) -> QuantizedConv2d | str:
    """:func:`match_quantized_conv2d` of the value `output` that `out` quantizes (None: a float output)."""
    inside, computing = [], [] if quantize is None else [quantize]

    def through(expr, computed: bool = False):
        """The value bound to `expr` (`computed`: one the kernel computes in place of the float ops)."""
        if isinstance(expr, relax.Var) and value_of(expr) is not None:
            if computed:
                inside.append(expr)
            computing.append(value_of(expr))
            return value_of(expr)
        return expr

    value = through(output, out is not None)  # (a float output is read by whatever reads it)
    activation = None
    found = activation_at(value, _looking_through(value_of))
    if found is not None:
        activation, x = found[0].name, found[1]
        if activation not in QUANTIZED_ACTIVATIONS:
            return f"{activation} before the quantize (the int8 epilogue applies {', '.join(QUANTIZED_ACTIVATIONS)})"
        # relu6 where the quantization saturates at or below 6 anyway: a relu (which a residual add takes)
        if activation == "relu6" and out is not None and \
                (_conv.QUANTIZED_RANGES[out.dtype][1] - out.zero_point) * out.scale <= 6.0:
            activation = "relu"
        variables, calls = _computed_between(value, x, value_of)
        inside.extend(variables)
        computing.extend(calls)
        value = through(x, True)
    residual = _residual(value, value_of) if out is not None and is_call(value, "relax.add") else None
    if residual is not None:
        if activation not in (None, "relu"):
            return f"a residual add before {activation} (the int8 epilogue adds before a relu only)"
        side, residual = residual
        value = through(side, True)
    bias = None
    bias_operand = None
    if is_call(value, "relax.add"):
        a, b = (through(arg, True) for arg in value.args)
        conv, other = (a, b) if is_call(a, "relax.nn.conv2d") else (b, a)
        bias_operand = value.args[1] if is_call(a, "relax.nn.conv2d") else value.args[0]
        if is_call(other, "relax.reshape"):
            other = through(other.args[0])
        if not is_call(conv, "relax.nn.conv2d"):
            return "the add is not a convolution + a constant bias"
        if is_call(other, "relax.dequantize"):  # ONNX QDQ: int32 values times s_x * s_w
            values, scale, zero = (_const(arg) for arg in other.args)
            if values is None or scale is None or zero is None:
                return "the bias is not a dequantized constant"
            bias = ((values.astype(np.float64) - zero) * scale.astype(np.float64)).reshape(-1)
        else:  # PT2E: a float bias, rounded to the sums' unit by the kernel (_requantization)
            values = _const(other)
            if values is None or values.dtype != np.float32:
                return "the bias is not a float32 or dequantized constant"
            bias = values.astype(np.float64).reshape(-1)
        value = conv
    if not is_call(value, "relax.nn.conv2d"):
        return "no convolution before the quantize"
    conv = value
    data, weight = (through(arg) for arg in conv.args)
    if not (is_call(data, "relax.dequantize") and is_call(weight, "relax.dequantize")):
        return "the convolution's operands are not dequantized"
    data_quantization = per_tensor_quantization(data)
    w, w_scale, w_zero = (_const(arg) for arg in weight.args)
    if data_quantization is None:
        return "the data is not per-tensor uint8/int8"
    if w is None or w_scale is None or w_zero is None or w.dtype != np.int8:
        return "the weights are not a dequantized int8 constant"
    if np.any(w_zero != 0):
        return "asymmetric weights (a zero point other than 0)"
    k = w.shape[0]
    if w_scale.size > 1 and (w_scale.size != k or int(weight.attrs.axis) != 0):
        return f"weight scales along axis {int(weight.attrs.axis)}, not one per output channel"
    if bias is not None and (bias.size not in (1, k) or not is_channel_bias(bias_operand, k)):
        return "the added tensor is not one value per output channel"
    return QuantizedConv2d(
        data=data.args[0], data_zero=data_quantization.zero_point, data_scale=data_quantization.scale, weight=w,
        weight_scale=np.broadcast_to(w_scale.astype(np.float64).reshape(-1), (k,)).copy(),
        bias=None if bias is None else np.broadcast_to(bias, (k,)).copy(), conv=conv, activation=activation,
        out_dtype=out.dtype if out else "float32", out_zero=out.zero_point if out else 0,
        out_scale=out.scale if out else 1.0, inside=tuple(inside), computing=tuple(computing), residual=residual)


def _residual(add: relax.Call, value_of) -> tuple[relax.Expr, tuple[relax.Expr, Quantization]] | None:
    """(the convolution's side, (the quantized tensor, its quantization)) of `add` where it adds a
    dequantized tensor of its own shape (per tensor, not a constant) to a convolution's float output
    [+ bias], in either order: PT2E's conv + add, whose quantizer quantizes only the sum."""
    def value(arg):
        return value_of(arg) if isinstance(arg, relax.Var) and value_of(arg) is not None else arg

    shape = static_shape(add)
    for i in (0, 1):
        dq, side = value(add.args[i]), add.args[1 - i]
        computed = value(side)
        convolution = is_call(computed, "relax.nn.conv2d") or (
            is_call(computed, "relax.add") and any(is_call(value(arg), "relax.nn.conv2d") for arg in computed.args))
        if not (is_call(dq, "relax.dequantize") and convolution) or _const(dq.args[0]) is not None:
            continue
        quantization = per_tensor_quantization(dq)
        if quantization is not None and shape is not None and static_shape(dq.args[0]) == shape == static_shape(side):
            return side, (dq.args[0], quantization)
    return None


@dataclasses.dataclass(frozen=True)
class QuantizedAdd:
    """quantize(dequantize(a) + dequantize(b) [-> relu]) read off the graph (:func:`match_quantized_add`):
    a residual add between quantized convolutions."""

    a: relax.Expr
    a_quantization: Quantization
    b: relax.Expr
    b_quantization: Quantization
    relu: bool
    out_dtype: str
    out_quantization: Quantization
    inside: tuple[relax.Var, ...]


def match_quantized_add(quantize: relax.Call, value_of) -> QuantizedAdd | None:
    """The quantized add `quantize` ends, if it ends one (per-tensor uint8/int8 operands and output)."""
    out = per_tensor_quantization(quantize)
    if out is None:
        return None
    inside = [quantize.args[0]]
    value = value_of(quantize.args[0])
    relu = is_call(value, "relax.nn.relu")
    if relu:
        inside.append(value.args[0])
        value = value_of(value.args[0])
    if not is_call(value, "relax.add"):
        return None
    operands = []
    for arg in value.args:
        dq = value_of(arg) if isinstance(arg, relax.Var) else None
        if not is_call(dq, "relax.dequantize"):
            return None
        quantization = per_tensor_quantization(dq)
        if quantization is None:
            return None
        operands.append((dq.args[0], quantization))
    (a, qa), (b, qb) = operands
    return QuantizedAdd(a, qa, b, qb, relu, out.dtype, out, tuple(v for v in inside if isinstance(v, relax.Var)))


def int8_engine(target: tvm.target.Target) -> tuple[str, VectorISA] | None:
    """The int8 kernels' engine and ISA on `target`: AMX tiles where the CPU has AMX-INT8 and the
    OS grants them, else VNNI on zmm or ymm; None without either."""
    if has_amx_int8(target) and amx_permitted():
        return "amx", AVX512
    if has_vnni(target, 16):
        return "fma", AVX512
    if has_vnni(target, 8):
        return "fma", AVX2
    return None


def quantized_conv2d_reason(found: QuantizedConv2d, target: tvm.target.Target, readers: dict) -> str | None:
    """Why `found` stays with stock TVM (float) on `target`, or None if an int8 kernel runs it."""
    if int8_engine(target) is None:
        return "the CPU has neither AMX-INT8 nor VNNI"
    attrs = found.conv.attrs
    if (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout)) != ("NCHW", "OIHW", "NCHW"):
        return "not NCHW/OIHW"
    if static_shape(found.data) is None:  # (checked first: every other use is of a known shape)
        return "a symbolic shape"
    if found.residual is not None and _float_sums(found):
        return f"{int(attrs.groups)} groups and a residual add (the grouped kernel fuses no add)"
    if found.out_dtype == "float32" and _float_sums(found):
        return f"{int(attrs.groups)} groups and a float output (the grouped kernel writes units)"
    if _float_sums(found):  # summed in float32: exact while every sum stays below 2**24
        _, units_bias, _ = _requantization(found, 0)
        _, group, kh, kw = found.weight.shape
        if 255 * 128 * group * kh * kw + np.abs(units_bias).max(initial=0) >= 2**24:
            return f"{int(attrs.groups)} groups whose sums may pass 2**24 (float32 sums would round)"
    for var in found.inside:
        if any(not any(reader.same_as(call) for call in found.computing) for reader in readers.get(var, [])):
            return f"{var.name} is read outside the quantized convolution"
    return None


def int8_kernel(found: QuantizedConv2d, target: tvm.target.Target) -> str:
    """What runs `found` (for dispatch_report): the int8 convolution on the target's engine, or for
    groups the float32 one (float32 sums of the values in units of their scale: integers, exact)."""
    if _float_sums(found):
        return f"int8_conv2d ({'depthwise' if _depthwise(found) else 'grouped'}, exact float32 sums)"
    engine = _engine(found, (int8_engine(target) or ("none",))[0], target)
    return f"int8_conv2d ({'vnni' if engine == 'fma' else engine})"


def _depthwise(found: QuantizedConv2d) -> bool:
    groups, channels = int(found.conv.attrs.groups), found.weight.shape[0]
    return groups > 1 and found.weight.shape[1] == 1 and groups == channels


def _float_sums(found: QuantizedConv2d) -> bool:
    """Whether `found` runs on the float32 kernels over its values in units of their scale: a
    grouped or depthwise convolution (no int8 microkernel for those; its sums are exact)."""
    return int(found.conv.attrs.groups) > 1


def _workload(found: QuantizedConv2d, channels: int) -> _conv.Conv2dWorkload:
    """The kernel's convolution over `channels` input channels (the data's, or more: the channels
    that fill its blocks or a group of 4, which meet zero weights)."""
    n, _, h, w = _shape(found.data)
    attrs = found.conv.attrs
    k, _, kh, kw = found.weight.shape
    options = ([int(v) for v in attrs.strides], [int(v) for v in attrs.padding], [int(v) for v in attrs.dilation])
    if _depthwise(found):  # in float32, on the values in units of their scale
        return _conv.Conv2dWorkload.make((n, channels, h, w), (channels, 1, kh, kw), *options, groups=channels)
    if _float_sums(found):  # (whole groups: no channels past the data's)
        group = found.weight.shape[1]
        return _conv.Conv2dWorkload.make((n, channels, h, w), (k, group, kh, kw), *options,
                                         groups=channels // group)
    return _conv.Conv2dWorkload.make((n, channels, h, w), (k, channels, kh, kw), *options, dtype="int8")


def _scale_free(found: QuantizedConv2d) -> bool:
    """Whether `found`'s activation commutes with a positive scale (none, relu): the epilogue may
    then apply it to the sums in units of the output's scale. Any other (SiLU, hardswish, relu6)
    is applied to the real value, s_x * s_w times the sums, which is then divided by s_y."""
    return found.activation in (None, "relu")


def _requantization(found: QuantizedConv2d, data_zero: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the weights, the bias in units of the sums minus `data_zero`'s share, the float32 scale)."""
    # float32 as ONNX Runtime's requantization: s_x * s_w / s_y per output channel (the real
    # value's s_x * s_w before an activation that is not scale-free: :func:`_scale_free`)
    out_scale = found.out_scale if _scale_free(found) else 1.0
    scale = np.float32(found.data_scale) * found.weight_scale.astype(np.float32) / np.float32(out_scale)
    sums_unit = np.float64(found.data_scale) * found.weight_scale  # the bias's unit: one step of the sums
    k = found.weight.shape[0]
    bias = np.zeros(k, np.int64) if found.bias is None else np.rint(found.bias / sums_unit).astype(np.int64)
    bias -= data_zero * found.weight.astype(np.int64).sum(axis=(1, 2, 3))
    return found.weight, bias, scale


def _uint8(blocked: relax.Expr | None) -> bool:
    """Whether `blocked` is a blocked uint8 tensor (not float32 units)."""
    return blocked is not None and str(blocked.ty.dtype.dtype) == "uint8"


def _add(bb: relax.BlockBuilder, func: tvm.tirx.PrimFunc, name: str) -> tvm.ir.GlobalVar:
    """`func` as a kernel of the module; private (this runs before TVM's library dispatch, which
    would find every TE kernel's "main" symbol twice)."""
    return add_kernel(bb, func.without_attr("global_symbol"), name)


def _call(bb: relax.BlockBuilder, func: tvm.tirx.PrimFunc, name: str, args: list, shape, dtype: str) -> relax.Var:
    return bb.emit(relax.call_tir(_add(bb, func, name), args, relax.TensorType(tuple(shape), dtype)))


def _name(*parts) -> str:
    return "_".join("x".join(map(str, p)) if isinstance(p, tuple | list) else str(p) for p in parts)


# AMX reduces 64 channels a tile step: a convolution whose whole reduction (C x KH x KW) is no more
# is one step a microkernel call, where the tile configuration, C's stores and the epilogue
# outweigh it; VNNI on vectors was 1.1-2.2x faster there (MobileNet-v2's 16->96, 24->144, 32->192
# 1x1 layers, ResNet's 64-channel 1x1 ones) and AMX 1.0-2.3x faster above it (one core).
AMX_MIN_REDUCTION = 65


def _engine(found: QuantizedConv2d, engine: str, target: tvm.target.Target) -> str:
    """`engine`, or VNNI where AMX's reduction would be one step (:data:`AMX_MIN_REDUCTION`)."""
    _, c, kh, kw = found.weight.shape
    small = -(-c // 4) * 4 * kh * kw < AMX_MIN_REDUCTION
    return "fma" if engine == "amx" and small and has_vnni(target, 16) else engine


def _plan(found: QuantizedConv2d, isa: VectorISA, engine: str, blocked: relax.Expr | None):
    """(the plan, whether it reads `blocked`): the data's blocks where the kernel can read them
    (all of its channels: those past the data's meet zero weights), else its own blocks."""
    c = _shape(found.data)[1]
    if blocked is not None:
        _, blocks, _, _, block = _shape(blocked)
        grouped = _float_sums(found) and not _depthwise(found)
        try:
            if not (grouped and blocks * block != c):
                wl = _workload(found, blocks * block)
                if _float_sums(found):
                    plans = [_conv.plan_conv2d(wl, isa, n_r=block), _conv.plan_conv2d(wl, isa)]
                else:
                    plans = [_conv.plan_conv2d(wl, isa, engine=engine, ic_bn=block)]
                for plan in plans:
                    if plan.in_bn == block:
                        return plan, True
        except ValueError:
            pass
    wl = _workload(found, c if _float_sums(found) else -(-c // 4) * 4)
    return (_conv.plan_conv2d(wl, isa) if _float_sums(found) else _conv.plan_conv2d(wl, isa, engine=engine)), False


def emit_quantized_conv2d(bb: relax.BlockBuilder, found: QuantizedConv2d, target: tvm.target.Target,
                          blocked: relax.Expr | None = None,
                          units_border: tuple[int, int, int, int] | None = None,
                          add: tuple[QuantizedSum, relax.Expr] | None = None,
                          database=None) -> tuple[relax.Expr, relax.Var]:
    """The int8 kernel calls that compute `found`'s quantize: (the NCHW view of the output, the
    blocked uint8 output). The data is read from `blocked` (its blocked uint8 form, written by an
    int8 kernel: its border is padded with the zero point if the convolution has padding) where
    its blocks suit the kernel, else packed from NCHW. A grouped or depthwise convolution runs the
    float32 kernel on the values in units of their scale (q - z: integers) and sums exactly; its
    data may be `blocked` in those units with its border already. With `units_border` the blocked
    output is float32 units with that border, for the grouped or depthwise convolutions that read it.
    With `add` (the terms, the other operand's blocked uint8 form) the kernel adds the output to
    that operand (a fused quantized add) and the outputs are the sum's; ValueError, before
    anything is emitted, where the operand's blocks are not the output's. The operand may be
    NCHW instead (uint8 or int8, the output's shape): it is packed into the output's blocks.
    `found.residual` (PT2E) is such an add of the float output: `add` is its operand. `database`: tuning
    records (a MetaSchedule Database), whose best schedule of the kernel runs if it has one."""
    engine, isa = int8_engine(target) or ("fma", AVX512)
    if blocked is not None and not _uint8(blocked) and not _float_sums(found):
        blocked = None  # (units are for the float32 kernels)
    plan, reads_blocked = _plan(found, isa, _engine(found, engine, target), blocked)
    wl, float_sums = plan.wl, _float_sums(found)
    if (found.residual is None) != (add is None or not add[0].float_own):
        raise ValueError("quantized conv2d: a residual add of the float output needs its operand, and only it")
    other_shape = _shape(add[1]) if add is not None else ()
    nchw_other = len(other_shape) == 4
    if nchw_other and other_shape != (wl.N, found.weight.shape[0], wl.OH, wl.OW):
        raise ValueError(f"a quantized add of {other_shape} cannot fuse into a convolution writing "
                         f"{(wl.N, found.weight.shape[0], wl.OH, wl.OW)}")
    if add is not None and (float_sums or units_border is not None or (
            not nchw_other and other_shape != plan.out_shape())):
        raise ValueError(f"a quantized add on blocks {other_shape} cannot fuse into a convolution writing "
                         f"{plan.out_shape()}")
    data_dtype = str(found.data.ty.dtype.dtype)
    data_zero = found.data_zero + (128 if data_dtype == "int8" else 0)  # uint8's
    out_zero = found.out_zero + (128 if found.out_dtype == "int8" else 0)
    weight, bias, scale = _requantization(found, 0 if float_sums else data_zero)
    if np.abs(bias).max(initial=0) >= 2**31:
        raise ValueError("quantized conv2d: the bias does not fit int32")
    k, c = found.weight.shape[:2]
    padded = np.zeros((wl.K, wl.C // wl.groups, wl.KH, wl.KW), np.float32 if float_sums else np.int8)
    padded[:k, :c] = weight

    def per_channel(values: np.ndarray, dtype) -> relax.Constant:
        out = np.zeros(plan.K_pad, dtype)
        out[:k] = values
        return relax.const(out.reshape(plan.OCB, plan.oc_bn))

    shape = _shape(found.data)
    source = blocked if reads_blocked else None
    if source is not None and not _uint8(source) and _shape(source) != plan.data_shape():
        source = None  # (units with another border: from the NCHW view)
    if float_sums and source is not None and not _uint8(source):
        data = source  # the producer wrote the units with this convolution's border
    elif float_sums:  # blocked uint8, then float32 units with a zero border
        if source is None:
            source = _call(bb, _layout.pack_quantized_func(shape, plan.in_bn, (0, 0, 0, 0), data_zero, data_dtype),
                           _name("tvm_ext_pack_quantized", shape, plan.in_bn, f"z{data_zero}"), [found.data],
                           (wl.N, wl.C // plan.in_bn, wl.H, wl.W, plan.in_bn), "uint8")
        bshape = _shape(source)
        data = _call(bb, _layout.dequantized_units_func(bshape, wl.padding, data_zero),
                     _name("tvm_ext_quantized_units", bshape, f"z{data_zero}"), [source], plan.data_shape(), "float32")
    elif source is None:
        data = _call(bb, _layout.pack_quantized_func(shape, plan.in_bn, wl.padding, data_zero, data_dtype),
                     _name("tvm_ext_pack_quantized", shape, plan.in_bn, f"z{data_zero}"), [found.data],
                     plan.data_shape(), "uint8")
    elif any(wl.padding):
        bshape = _shape(source)
        data = _call(bb, _layout.pad_nchwc_func(bshape, wl.padding, "uint8", data_zero),
                     _name("tvm_ext_pad_quantized", bshape, f"z{data_zero}"), [source], plan.data_shape(), "uint8")
    else:
        data = source
    if add is not None and nchw_other:  # packed: its channels past K hold its zero point (sums to z_out)
        terms, other = add
        quantization = terms.b if terms.own == "a" else terms.a
        other_zero = quantization.zero_point + quantization.offset
        add = terms, _call(bb, _layout.pack_quantized_func(_shape(other), plan.oc_bn, (0, 0, 0, 0), other_zero,
                                                           quantization.dtype),
                           _name("tvm_ext_pack_quantized", _shape(other), plan.oc_bn, f"z{other_zero}"), [other],
                           plan.out_shape(), "uint8")
    float_own = add is not None and add[0].float_own
    float_out = found.out_dtype == "float32"  # (the float output itself: s_x * s_w times the sums)
    divided = not (float_out or _scale_free(found))  # by s_y after the activation (_requantization)
    epilogue = _conv.Epilogue(bias=True, activation=None if float_own else found.activation,
                              out_dtype="float32" if float_out else "uint8",
                              out_scale=float(np.float32(1) / np.float32(found.out_scale)) if divided else 1.0,
                              zero_point=0 if float_out else out_zero, units=units_border is not None,
                              out_pad=units_border or (0, 0, 0, 0), add=add[0] if add is not None else None)
    kernel = conv2d_kernel(plan, epilogue, isa, target, database)
    tag = _name((wl.N, wl.C, wl.H, wl.W, wl.K, wl.KH, wl.KW), f"s{wl.stride[0]}{wl.stride[1]}")
    kind = plan.kind if float_sums else plan.engine
    out = _call(bb, kernel, f"tvm_ext_int8_conv2d_{tag}_{kind}" + (FUSED_ADD if add is not None else ""),
                [data, relax.const(_conv.pack_weight_array(plan, padded)),
                 per_channel(bias, np.float32 if float_sums else np.int32), per_channel(scale, np.float32),
                 *([add[1]] if add is not None else [])],
                epilogue.out_shape(plan), epilogue.buffer_dtype)
    if add is not None:
        return _quantized_view(bb, out, k, add[0].out.dtype), out
    if float_out:
        unpack = _layout.unpack_nchwc_func(plan.out_shape(), k)
        return relax.call_tir(_add(bb, unpack, _name("tvm_ext_unpack", plan.out_shape())), [out],
                              relax.TensorType((wl.N, k, wl.OH, wl.OW), "float32")), out
    if units_border is None:
        return _quantized_view(bb, out, k, found.out_dtype), out
    unpack = _layout.unpack_units_func(epilogue.out_shape(plan), units_border, k, found.out_zero, found.out_dtype)
    view = relax.call_tir(_add(bb, unpack, _name(_UNPACK, plan.out_shape(), found.out_dtype)), [out],
                          relax.TensorType((wl.N, k, wl.OH, wl.OW), found.out_dtype))
    return view, out


def _quantized_view(bb: relax.BlockBuilder, blocked: relax.Expr, channels: int, dtype: str) -> relax.Call:
    """The NCHW `dtype` view of `channels` channels of blocked uint8 `blocked` (for the stock ops
    that read it; dropped where none does)."""
    shape = _shape(blocked)
    n, _, h, w, _ = shape
    return relax.call_tir(_add(bb, _layout.unpack_quantized_func(shape, channels, dtype), _name(_UNPACK, shape, dtype)),
                          [blocked], relax.TensorType((n, channels, h, w), dtype))


def emit_quantized_add(bb: relax.BlockBuilder, found: QuantizedAdd, a: relax.Var, b: relax.Var,
                       channels: int) -> tuple[relax.Expr, relax.Var]:
    """(the NCHW view, the blocked uint8 sum) of `found` on the blocked uint8 forms `a` and `b`."""
    shape = _shape(a)
    func = quantized_add_func(shape, found.a_quantization, found.b_quantization, found.out_quantization, found.relu)
    out = _call(bb, func, _name("tvm_ext_quantized_add", shape), [a, b], shape, "uint8")
    return _quantized_view(bb, out, channels, found.out_dtype), out


def units_borders(decisions: dict, values: dict, readers: dict) -> dict:
    """The quantized convolutions (their quantize's variable) whose every reader is a grouped or
    depthwise one the float32 kernels run (:func:`_float_sums`), each with the same padding ->
    that padding: they write their output in units with that border
    (:attr:`~tvm_ext.kernels.conv2d.Epilogue.units`), which those read as it is. (`values`, `readers`:
    the function's :func:`_bindings` and :func:`~.base.readers_of`.)"""
    var_of = {value: var for var, value in values.items()}
    float_sums = {found.conv: found for found, reason in decisions.values() if reason is None and _float_sums(found)}
    borders = {}
    for var, (found, reason) in decisions.items():
        if reason is not None or _float_sums(found) or found.residual is not None:
            continue
        paddings = set()
        for reader in readers.get(var, []):
            # (units are q - the output's zero point: a reader's dequantize must subtract that one)
            same_zero = is_call(reader, "relax.dequantize") and scalar_constant(reader.args[2]) == found.out_zero
            dq = var_of.get(reader) if same_zero else None
            convs = readers.get(dq, []) if dq is not None else [None]
            for conv in convs:
                reading = float_sums.get(conv)
                paddings.add(tuple(int(p) for p in reading.conv.attrs.padding) if reading is not None else None)
        if len(paddings) == 1 and None not in paddings:
            borders[var] = paddings.pop()
    return borders


def fusable_adds(decisions: dict, values: dict, readers: dict) -> dict:
    """Each int8 convolution (its quantize's variable) whose output only a quantized add reads ->
    (the add's quantize variable, the add, which operand the convolution computes: "a" or "b"),
    for the convolution to fuse the add. Of two such operands the later convolution fuses it:
    the other operand exists by then.
    (`values`, `readers`: the function's :func:`_bindings` and :func:`~.base.readers_of`.)"""
    order = {var: i for i, var in enumerate(values)}
    fusable = {}
    for var, value in values.items():
        found = match_quantized_add(value, values.get) if is_call(value, "relax.quantize") else None
        if found is None or any(len(readers.get(v, [])) > 1 for v in found.inside):
            continue
        dequantized = values[found.inside[-1]].args  # the add's operands: dequantize(a), dequantize(b)
        candidates = []
        for own, operand, dq in (("a", found.a, dequantized[0]), ("b", found.b, dequantized[1])):
            decision = decisions.get(operand)
            if decision is None or decision[1] is not None or _float_sums(decision[0]) or decision[0].residual:
                continue
            if len(readers.get(operand, [])) == 1 and len(readers.get(dq, [])) == 1:
                candidates.append((order[operand], own, operand))
        if candidates:
            _, own, conv = max(candidates)
            fusable[conv] = (var, found, own)
    return fusable


def _bindings(func: relax.Function) -> dict:
    """Each variable `func` binds -> its value."""
    return {b.var: b.value for block in func.body.blocks for b in block.bindings if isinstance(b, relax.VarBinding)}


def quantized_conv2d_decisions(func: relax.Function, target: tvm.target.Target) -> dict:
    """Each quantize binding of `func` that ends a quantized convolution -> the convolution
    (:class:`QuantizedConv2d`) and why stock TVM keeps it (None: an int8 kernel runs it)."""
    return _decisions(_bindings(func), readers_of(func), target)


# What a float output may not be read by to run on an int8 kernel writing float32: the start of
# an activation the fp32 kernels fuse into their epilogue (SiLU as x * sigmoid(x), hardswish as
# x * clip(x + 3, 0, 6) / 6, ...), which would become a pass of its own over the unpacked output
# (PT2E EfficientNet-B0 with its expansion convolutions so: 0.95x, within this host's noise; they
# stay on the fp32 kernels). Before a concatenation they pay: GoogLeNet 1.25-1.51x.
_FUSED_BY_FLOAT_KERNELS = frozenset(f"relax.{op}" for op in (
    "sigmoid", "multiply", "divide", "clip", "tanh", "add", "nn.silu", "nn.gelu", "nn.gelu_tanh", "nn.softplus"))


def _decisions(values: dict, readers: dict, target: tvm.target.Target) -> dict:
    """:func:`quantized_conv2d_decisions` of a function's :func:`_bindings` and their readers:
    those a quantize ends, then the float outputs of the quantized convolutions left (the
    longest chain of conv2d, bias and relu the kernel takes, from the last binding up) that
    start no activation the fp32 kernels would fuse (:data:`_FUSED_BY_FLOAT_KERNELS`)."""
    decisions, claimed = {}, set()
    for var, value in values.items():
        if is_call(value, "relax.quantize"):
            found = match_quantized_conv2d(value, values.get)
            if isinstance(found, QuantizedConv2d):
                decisions[var] = (found, quantized_conv2d_reason(found, target, readers))
                claimed.update(found.inside)
    floats = {}
    for var, value in reversed(values.items()):
        if var in claimed or not (is_call(value, "relax.nn.conv2d") or is_call(value, "relax.add") or
                                  activation_at(value, _looking_through(values.get)) is not None):
            continue
        found = match_float_output_conv2d(var, values.get)
        if not isinstance(found, QuantizedConv2d):
            continue
        # (read by such an activation: the fp32 kernel runs the whole chain, no shorter one is tried)
        fused_reader = any(isinstance(reader, relax.Call) and isinstance(reader.op, tvm.ir.Op) and
                           reader.op.name in _FUSED_BY_FLOAT_KERNELS for reader in readers.get(var, []))
        if fused_reader or quantized_conv2d_reason(found, target, readers) is None:
            if not fused_reader:
                floats[var] = (found, None)
            claimed.update(found.inside)
    order = {var: i for i, var in enumerate(values)}  # (program order: dispatch_report reads them so)
    return dict(sorted({**decisions, **floats}.items(), key=lambda item: order[item[0]]))


def lower_quantized_conv2d(target: tvm.target.Target, database=None) -> tvm.transform.Pass:
    """Replace every quantized convolution of the module's functions (the quantize that ends it)
    with the int8 kernel calls where :func:`quantized_conv2d_reason` finds nothing against it;
    the float ops it leaves unread are dropped. `database`: tuning records (a MetaSchedule
    Database) for the kernels."""

    @relax.expr_functor.mutator
    class _Lower(relax.PyExprMutator):
        def __init__(self, mod: tvm.IRModule):
            super().__init__(mod)
            self.decisions: dict = {}
            # a quantized kernel's NCHW output -> its blocked form (uint8, int8 as uint8 + 128; or
            # float32 units for grouped and depthwise readers)
            self.blocked: dict[relax.Var, relax.Var] = {}
            self.values: dict = {}  # the function's bindings (before lowering)
            self.units_borders: dict = {}  # units_borders of the function
            self.readers: dict = {}  # and their readers (readers_of)
            self.fusable_adds: dict = {}  # fusable_adds of the function
            self.fused: dict = {}  # an add's quantize variable -> the fused kernel's (view, blocked)

        def _add(self, binding: relax.VarBinding) -> bool:
            """Emit the blocked quantized add `binding` ends, if it is one whose operands an int8
            kernel wrote blocked (alike) and whose float values nothing else reads."""
            if binding.var in self.fused:  # computed by the convolution that computes an operand
                self._bind(binding, *self.fused.pop(binding.var))
                return True
            value = binding.value
            found = match_quantized_add(value, self.values.get) if is_call(value, "relax.quantize") else None
            if found is None or any(len(self.readers.get(v, [])) > 1 for v in found.inside):
                return False
            a, b = (self.visit_expr(v) for v in (found.a, found.b))
            blocked_a, blocked_b = self.blocked.get(a), self.blocked.get(b)
            if not (_uint8(blocked_a) and _uint8(blocked_b)) or _shape(blocked_a) != _shape(blocked_b):
                return False
            self._bind(binding, *emit_quantized_add(self.builder_, found, blocked_a, blocked_b, _shape(a)[1]))
            return True

        def _max_pool(self, binding: relax.VarBinding) -> bool:
            """Emit max pooling on the blocked uint8 tensor an int8 kernel wrote, where the graph
            pools its dequantized values and quantizes them alike (quantize(max_pool2d(
            dequantize(x, s, z)), s, z) is max_pool2d(x): the quantization is monotonic)."""
            quantize = binding.value
            if not is_call(quantize, "relax.quantize"):
                return False
            pool = self.values.get(field_of(quantize.args[0], self.values.get))
            if not is_call(pool, "relax.nn.max_pool2d"):
                return False
            dq = self.values.get(pool.args[0])
            quantization = per_tensor_quantization(quantize)
            if not is_call(dq, "relax.dequantize") or quantization is None or \
                    per_tensor_quantization(dq) != quantization:
                return False
            attrs = pool.attrs
            if str(attrs.layout) != "NCHW" or len(self.readers.get(quantize.args[0], [])) > 1:
                return False
            data = self.visit_expr(dq.args[0])
            blocked = self.blocked.get(data)
            if not _uint8(blocked):
                return False
            n, blocks, h, w, block = _shape(blocked)
            wl = _pool.Pool2dWorkload.make((n, blocks * block, h, w), "max", [int(v) for v in attrs.pool_size],
                                           [int(v) for v in attrs.strides], [int(v) for v in attrs.padding],
                                           [int(v) for v in attrs.dilation], bool(attrs.ceil_mode))
            out = _call(self.builder_, _pool.pool2d_func(wl, "uint8", block), f"tvm_ext_quantized_{wl.kernel_name}",
                        [blocked], (n, blocks, wl.OH, wl.OW, block), "uint8")
            self._bind(binding, _quantized_view(self.builder_, out, _shape(data)[1], quantization.dtype), out)
            return True

        def _dequantize(self, binding: relax.VarBinding) -> bool:
            """Emit the dequantize `binding` ends on the blocks of its operand where an int8 kernel
            wrote them: float32 blocks and their NCHW view, which the fp32 kernels after it read
            as blocks (the NCHW uint8 view, the dequantize and the fp32 kernel's pack were three
            passes: PT2E EfficientNet-B0's depthwise layers)."""
            dq = binding.value
            quantization = per_tensor_quantization(dq) if is_call(dq, "relax.dequantize") else None
            if quantization is None or str(dq.attrs.out_dtype) != "float32":
                return False
            data = self.visit_expr(dq.args[0])
            blocked = self.blocked.get(data)
            if not _uint8(blocked):
                return False
            shape, (n, channels, h, w) = _shape(blocked), _shape(data)
            zero = quantization.zero_point + quantization.offset  # (int8 is held as uint8 + 128)
            out = _call(self.builder_, _layout.dequantized_units_func(shape, (0, 0, 0, 0), zero, quantization.scale),
                        _name("tvm_ext_dequantize_blocked", shape, f"z{zero}"), [blocked], shape, "float32")
            unpack = _layout.unpack_nchwc_func(shape, channels)
            view = relax.call_tir(_add(self.builder_, unpack, _name(_FLOAT_UNPACK, shape, channels)), [out],
                                  relax.TensorType((n, channels, h, w), "float32"))
            self.set_var_remap(binding.var, self.builder_.emit(self.builder_.normalize(view), binding.var.name))
            return True

        def _lookup(self, binding: relax.VarBinding) -> bool:
            """Emit a quantized chain's table lookup (strategy.quantized_tables) on the blocks an int8
            kernel wrote, where the table maps the source's zero point to the output's: the blocks'
            padded channels then hold the output's zero point as an int8 kernel's would (ORT's QDQ
            EfficientNet-B0: a SiLU after each convolution, each an unpack and a pack before)."""
            value = binding.value
            kernel = called_kernel(self.builder_.get(), value) if is_call(value, "relax.call_tir") else None
            if kernel is None or LOOKUP_ZEROS_ATTR not in kernel.attrs:
                return False
            source, table = binding.value.args[1].fields
            data = self.visit_expr(source)
            blocked = self.blocked.get(data)
            if not _uint8(blocked) or _shape(blocked)[2:4] != _shape(data)[2:4]:
                return False
            in_dtype, out_dtype = str(data.ty.dtype.dtype), str(binding.var.ty.dtype.dtype)
            zero_in, zero_out = (int(z) for z in kernel.attrs[LOOKUP_ZEROS_ATTR])
            values = table.value.numpy().astype(np.int64)  # (indexed from the dtype's lowest value: as held)
            if values[zero_in - _conv.QUANTIZED_RANGES[in_dtype][0]] != zero_out:
                return False
            held = values + (128 if out_dtype == "int8" else 0)  # (int8 held as uint8 + 128)
            shape = _shape(blocked)
            out = _call(self.builder_, lookup_table_func(shape, "uint8", "uint8", target), _name(LOOKUP_KERNEL, shape),
                        [blocked, relax.const(held.astype(np.uint8))], shape, "uint8")
            self._bind(binding, _quantized_view(self.builder_, out, _shape(data)[1], out_dtype), out)
            return True

        def visit_var_binding_(self, binding: relax.VarBinding) -> None:
            decision = self.decisions.get(binding.var)
            if decision is None:
                if not (self._add(binding) or self._max_pool(binding) or self._dequantize(binding)
                        or self._lookup(binding)):
                    super().visit_var_binding_(binding)
                return None
            found, reason = decision
            if reason is not None:
                logger.info("tvm_ext: a quantized conv2d %s stays with stock TVM: %s", _shape(found.data),
                            reason)
                return super().visit_var_binding_(binding)
            found = dataclasses.replace(found, data=self.visit_expr(found.data))
            if found.residual is not None:
                self._bind(binding, *self._residual_conv2d(found, *found.residual))
                return None
            if self._fused_conv2d(binding, found):
                return None
            view, blocked = emit_quantized_conv2d(self.builder_, found, target, self.blocked.get(found.data),
                                                  self.units_borders.get(binding.var), database=database)
            self._bind(binding, view, None if found.out_dtype == "float32" else blocked)
            return None

        def _fused_conv2d(self, binding: relax.VarBinding, found: QuantizedConv2d) -> bool:
            """Emit `found` with the quantized add it feeds fused (:func:`fusable_adds`) where the
            add's other operand is blocked uint8 of the output's blocks; the add's binding then
            takes the sum, this binding its float ops (read by nothing: dropped)."""
            fusion = self.fusable_adds.get(binding.var)
            if fusion is None:
                return False
            add_var, add, own = fusion
            other = self.blocked.get(self.visit_expr(add.b if own == "a" else add.a))
            if not _uint8(other):
                return False
            terms = QuantizedSum(add.a_quantization, add.b_quantization, add.out_quantization, add.relu, own)
            try:
                self.fused[add_var] = emit_quantized_conv2d(self.builder_, found, target, self.blocked.get(found.data),
                                                            None, (terms, other), database=database)
            except ValueError:
                return False
            super().visit_var_binding_(binding)
            return True

        def _residual_conv2d(self, found: QuantizedConv2d, other: relax.Expr,
                             quantization: Quantization) -> tuple[relax.Expr, relax.Var]:
            """Emit `found` with its residual add (PT2E: `other`, quantized as `quantization`) in
            the epilogue, reading the operand's blocked uint8 form where an int8 kernel wrote it in
            the output's blocks, else packing it."""
            other = self.visit_expr(other)
            terms = QuantizedSum.of_float_output(quantization, Quantization(found.out_scale, found.out_zero,
                                                                            found.out_dtype),
                                                 found.activation == "relu")
            blocked = self.blocked.get(other)
            if _uint8(blocked):
                try:
                    return emit_quantized_conv2d(self.builder_, found, target, self.blocked.get(found.data), None,
                                                 (terms, blocked), database=database)
                except ValueError:
                    pass
            return emit_quantized_conv2d(self.builder_, found, target, self.blocked.get(found.data), None,
                                         (terms, other), database=database)

        def _bind(self, binding: relax.VarBinding, view: relax.Expr, blocked: relax.Var | None) -> None:
            """`binding`'s variable bound to the NCHW `view` of a kernel's `blocked` output, which
            the kernels after it read instead (its channels past the view's hold the zero point;
            None: a float output, which no int8 kernel reads)."""
            var = self.builder_.emit(self.builder_.normalize(view), binding.var.name)
            self.set_var_remap(binding.var, var)
            if blocked is not None:
                self.blocked[var] = blocked

    @tvm.transform.module_pass(opt_level=0, name="tvm_ext.LowerQuantizedConv2d")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if target.kind.name != "llvm":
            return mod
        lowering = _Lower(mod)
        lowered = False
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function) and "Composite" not in (func.attrs or {}):
                lowering.values, lowering.readers = _bindings(func), readers_of(func)
                lowering.decisions = _decisions(lowering.values, lowering.readers, target)
                lowering.units_borders = units_borders(lowering.decisions, lowering.values, lowering.readers)
                lowering.fusable_adds = fusable_adds(lowering.decisions, lowering.values, lowering.readers)
                if any(reason is None for _, reason in lowering.decisions.values()):
                    lowering.builder_.update_func(gvar, lowering.visit_expr(func))
                    lowered = True
        # (a module without quantized convolutions is left as it came)
        return relax.transform.DeadCodeElimination()(lowering.builder_.get()) if lowered else mod

    return _pass
