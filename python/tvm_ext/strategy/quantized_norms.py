"""Layer norms between a dequantize and a quantize run on the quantized values.

ONNX Runtime's QDQ form leaves a layer norm in float between a dequantize and a quantize
(ConvNeXt's, over the channels of each pixel in channels-last rows). Stock TVM wrote the
dequantized float tensor, read it twice for the statistics and once more for the output:
4.6 of int8 ConvNeXt-T's 36 ms at 224x224. :func:`quantized_layer_norms` replaces each
quantize(layer_norm(dequantize(x_q), gamma, beta, axes=[-1])) with one
:func:`~tvm_ext.kernels.layer_norm.quantized_layer_norm_func` call on x_q; gamma and beta are
constants, or dequantized constants (ORT quantizes them too), read at build time.
"""

from __future__ import annotations

import logging

import numpy as np
import tvm
from tvm import relax

from ..kernels.layer_norm import QUANTIZED_NORM_MAX_CHANNELS, quantized_layer_norm_func
from ..relax_info import is_call, op_name, per_tensor_quantization, static_shape
from .base import readers_of, rebind_each_function

__all__ = ["QUANTIZED_LAYER_NORM_KERNEL", "quantized_layer_norms"]

logger = logging.getLogger("tvm_ext")

QUANTIZED_LAYER_NORM_KERNEL = "tvm_ext_quantized_layer_norm"  # the kernels' name prefix (dispatch_report)


def _constant_values(expr: relax.Expr, values: dict) -> np.ndarray | None:
    """The float32 values of a constant, or of a variable bound to the dequantize of one
    (along its axis, per-tensor or per-channel), else None."""
    expr = values.get(expr, expr) if isinstance(expr, relax.Var) else expr
    if isinstance(expr, tvm.ir.Constant):
        array = expr.value.numpy()
        return array if array.dtype == np.float32 else None
    if op_name(expr) != "relax.dequantize" or str(expr.attrs.out_dtype) != "float32":
        return None
    q, scale, zero = (arg.value.numpy() if isinstance(arg, tvm.ir.Constant) else None for arg in expr.args)
    if q is None or scale is None or zero is None or scale.dtype != np.float32:
        return None
    axis = int(expr.attrs.axis) % max(q.ndim, 1)
    shape = [1] * q.ndim
    if q.ndim:
        shape[axis] = -1
    scale, zero = (v.reshape(shape) if v.size > 1 else v.reshape(()) for v in (scale, zero))
    return ((q.astype(np.float32) - zero.astype(np.float32)) * scale).astype(np.float32)


def _replacements(mod: tvm.IRModule, func: relax.Function) -> dict:
    values = relax.analysis.get_var2val(func)
    readers = readers_of(func)
    calls = {}
    for var, value in values.items():
        norm = values.get(value.args[0]) if is_call(value, "relax.quantize") else None
        if not is_call(norm, "relax.nn.layer_norm") or len(readers.get(value.args[0], [])) != 1:
            continue
        shape, dequantize = static_shape(norm), values.get(norm.args[0])
        axes = [int(a) for a in norm.attrs.axes]
        if shape is None or axes not in ([-1], [len(shape) - 1]) or not is_call(dequantize, "relax.dequantize"):
            continue
        data, out = per_tensor_quantization(dequantize), per_tensor_quantization(value)
        channels = shape[-1]
        gamma = _constant_values(norm.args[1], values) if norm.attrs.scale else np.ones(channels, np.float32)
        beta = _constant_values(norm.args[2], values) if norm.attrs.center else np.zeros(channels, np.float32)
        if data is None or out is None or gamma is None or beta is None or gamma.size != channels or \
                beta.size != channels or channels > QUANTIZED_NORM_MAX_CHANNELS:
            continue
        # (private: this runs before TVM's library dispatch, which finds public symbols twice)
        kernel = quantized_layer_norm_func(shape, data, out, float(norm.attrs.epsilon)).without_attr("global_symbol")
        calls[var] = ([dequantize.args[0], relax.const(gamma.reshape(-1)), relax.const(beta.reshape(-1))], kernel,
                      f"{QUANTIZED_LAYER_NORM_KERNEL}_{'x'.join(map(str, shape))}")
    return calls


def quantized_layer_norms() -> tvm.transform.Pass:
    """Replace each layer norm over the last axis between a per-tensor dequantize and quantize
    with the quantized kernel (see the module's docstring); a float value read elsewhere (the
    norm's) leaves it as it was."""

    @tvm.transform.module_pass(opt_level=0, name="tvm_ext.QuantizedLayerNorms")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rebind_each_function(mod, _replacements, "quantized layer norms")

    return _pass
