"""Inference batch norms (and per-channel constant scales) after a convolution with constant
weights, folded into those weights at build time; any other inference batch norm becomes one
scale and one shift per channel. For training graphs, inference batch norms with trained scale
and shift folded into the convolution's weights as expressions of those parameters."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ..relax_info import dtype, image_shape, is_channel_bias, static_shape

__all__ = ["fold_batch_norm", "fold_trained_batch_norm"]


def fold_batch_norm() -> tvm.transform.Pass:
    """conv2d(x, W) [+ c] -> batch_norm(gamma, beta, mean, var)[0]
    ==>  conv2d(x, W * s) + (beta - mean * s + c * s), with s = gamma / sqrt(var + eps) per
    output channel, computed once here in float64.

    Only NCHW/OIHW convolutions with constant weights and statistics, a bias `c` that is one
    constant per channel (VGG-BN's convolutions have one), batch norm over axis 1 in inference
    mode; anything else is left to stock legalization. A per-output-channel constant scale after
    a convolution (conv2d(x, W) * s) folds the same way. Every other inference batch norm with
    constant statistics on a float32 tensor (static, or a symbolic batch) becomes x * s + t
    (s, t per channel, computed in float64): one pass instead of stock TVM's normalisation, and
    a scale and shift the channel-affine kernel applies.
    """
    from tvm.relax.dpl import is_const, is_op, is_tuple_get_item, rewrite_call, wildcard

    weight, conv_bias, gamma, beta, mean, var = (is_const() for _ in range(6))
    conv = is_op("relax.nn.conv2d")(wildcard(), weight)
    biased = is_op("relax.add")(conv, conv_bias)  # matched in either operand order
    bn = is_op("relax.nn.batch_norm")(biased | conv, gamma, beta, mean, var)
    pattern = is_tuple_get_item(bn, 0)

    def rewriter(orig: relax.Expr, matched: dict) -> relax.Expr:
        conv_call, bn_call = matched[conv], matched[bn]
        attrs = bn_call.attrs
        layouts = (str(conv_call.attrs.data_layout), str(conv_call.attrs.kernel_layout))
        if int(attrs.axis) != 1 or layouts != ("NCHW", "OIHW") or bool(attrs.training):
            return orig
        values = [matched[p].value.numpy().astype(np.float64) for p in (weight, gamma, beta, mean, var)]
        w, g, b, m, v = values
        scale = (g if bool(attrs.scale) else np.ones_like(g)) / np.sqrt(v + float(attrs.epsilon))
        shift = (b if bool(attrs.center) else np.zeros_like(b)) - m * scale
        if biased in matched:
            c = matched[conv_bias]
            shape = static_shape(c)
            if shape is None or not is_channel_bias(c, w.shape[0]):  # (None: not a channel bias either)
                return orig
            aligned = c.value.numpy().astype(np.float64).reshape((1,) * (4 - len(shape)) + shape)
            shift = shift + np.broadcast_to(aligned, (1, w.shape[0], 1, 1)).reshape(-1) * scale
        folded_w = relax.const((w * scale[:, None, None, None]).astype(np.float32))
        new_conv = relax.Call(conv_call.op, [conv_call.args[0], folded_w], conv_call.attrs)
        return relax.op.add(new_conv, relax.const(shift.astype(np.float32).reshape(1, -1, 1, 1)))

    scale = is_const()
    scaled_conv = is_op("relax.nn.conv2d")(wildcard(), weight)
    scaled = is_op("relax.multiply")(scaled_conv, scale)

    def scale_rewriter(orig: relax.Expr, matched: dict) -> relax.Expr:
        """conv2d(x, W) * s, s per output channel  ==>  conv2d(x, W * s)."""
        conv_call = matched[scaled_conv]
        out_shape = static_shape(conv_call)
        k = out_shape[1] if out_shape else None
        layouts = (str(conv_call.attrs.data_layout), str(conv_call.attrs.kernel_layout))
        if layouts != ("NCHW", "OIHW") or static_shape(matched[scale]) not in ((1, k, 1, 1), (k, 1, 1)):
            return orig
        s = matched[scale].value.numpy().astype(np.float64).reshape(-1)
        w = matched[weight].value.numpy().astype(np.float64)
        folded_w = relax.const((w * s[:, None, None, None]).astype(np.float32))
        return relax.Call(conv_call.op, [conv_call.args[0], folded_w], conv_call.attrs)

    data, gamma_, beta_, mean_, var_ = wildcard(), is_const(), is_const(), is_const(), is_const()
    lone_bn = is_op("relax.nn.batch_norm")(data, gamma_, beta_, mean_, var_)

    def affine_rewriter(orig: relax.Expr, matched: dict) -> relax.Expr:
        """batch_norm(x)[0] that follows no convolution  ==>  x * s + t, s and t per channel
        (DenseNet's batch norms after concatenations: tvm_ext.kernels.channel_affine)."""
        bn_call = matched[lone_bn]
        attrs, shape = bn_call.attrs, image_shape(matched[data])  # static, or a symbolic batch
        if shape is None or bool(attrs.training) or dtype(matched[data]) != "float32":
            return orig
        axis = int(attrs.axis) % len(shape)
        if axis == 0 and static_shape(matched[data]) is None:  # normalising over a symbolic axis
            return orig
        g, b, m, v = (matched[p].value.numpy().astype(np.float64) for p in (gamma_, beta_, mean_, var_))
        scale = (g if bool(attrs.scale) else np.ones_like(g)) / np.sqrt(v + float(attrs.epsilon))
        shift = (b if bool(attrs.center) else np.zeros_like(b)) - m * scale
        channel = [1] * len(shape)
        channel[axis] = shape[axis]
        return relax.op.add(relax.op.multiply(matched[data], relax.const(scale.astype(np.float32).reshape(channel))),
                            relax.const(shift.astype(np.float32).reshape(channel)))

    @tvm.transform.module_pass(opt_level=0, name="tvm_ext.FoldBatchNorm")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = mod.clone()  # the caller's module stays as it was
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                func = rewrite_call(scaled, scale_rewriter, rewrite_call(pattern, rewriter, func))
                mod[gvar] = rewrite_call(is_tuple_get_item(lone_bn, 0), affine_rewriter, func)
        return mod

    return _pass


def fold_trained_batch_norm() -> tvm.transform.Pass:
    """conv2d(x, W) -> batch_norm(gamma, beta, mean, var)[0], inference form, any of W, gamma,
    beta being function parameters
    ==>  conv2d(x, W * s) + (beta - mean * s), with s = gamma / sqrt(var + eps) per output
    channel, as expressions of the parameters.

    For a training graph before `relax.transform.Gradient` (fine-tuning with frozen statistics,
    as a model in eval mode trains): the gradient then flows through the small per-channel and
    per-weight expressions (dW = dW' * s, dgamma = sum(dW' * W) / sqrt(var + eps), dbeta the
    convolution's bias gradient) instead of four passes over every activation forward and five
    backward, and the convolution keeps the batch norm's shift as a bias its kernel adds. Only
    float32 NCHW/OIHW convolutions and batch norms over axis 1 in inference mode; constant
    statistics fold numerically (in float64), others as expressions.
    """
    from tvm.relax.dpl import is_op, is_tuple_get_item, rewrite_call, wildcard

    weight, gamma, beta, mean, var = (wildcard() for _ in range(5))
    conv = is_op("relax.nn.conv2d")(wildcard(), weight)
    bn = is_op("relax.nn.batch_norm")(conv, gamma, beta, mean, var)
    op = relax.op

    def rewriter(orig: relax.Expr, matched: dict) -> relax.Expr:
        conv_call, bn_call = matched[conv], matched[bn]
        attrs, k = bn_call.attrs, static_shape(matched[weight])
        layouts = (str(conv_call.attrs.data_layout), str(conv_call.attrs.kernel_layout),
                   str(conv_call.attrs.out_layout))
        if (int(attrs.axis) != 1 or layouts != ("NCHW", "OIHW", "NCHW") or bool(attrs.training) or k is None
                or {dtype(matched[p]) for p in (weight, gamma, beta, mean, var)} != {"float32"}):
            return orig
        channels, eps = k[0], float(attrs.epsilon)
        if isinstance(matched[var], tvm.ir.Constant):
            inv_std = relax.const((1 / np.sqrt(matched[var].value.numpy().astype(np.float64) + eps)).astype(np.float32))
        else:
            inv_std = op.divide(relax.const(1.0, "float32"), op.sqrt(op.add(matched[var], relax.const(eps, "float32"))))
        scale = op.multiply(matched[gamma], inv_std) if bool(attrs.scale) else inv_std
        shift = op.negative(op.multiply(matched[mean], scale))
        if bool(attrs.center):
            shift = op.add(matched[beta], shift)
        folded_w = op.multiply(matched[weight], op.reshape(scale, (channels, 1, 1, 1)))
        new_conv = relax.Call(conv_call.op, [conv_call.args[0], folded_w], conv_call.attrs)
        return op.add(new_conv, op.reshape(shift, (1, channels, 1, 1)))

    @tvm.transform.module_pass(opt_level=0, name="tvm_ext.FoldTrainedBatchNorm")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = mod.clone()  # the caller's module stays as it was
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                mod[gvar] = rewrite_call(is_tuple_get_item(bn, 0), rewriter, func)
        return mod

    return _pass
