"""The gradients tvm_ext gives `relax.transform.Gradient` (registered at level 11, over TVM's
own at 10, when tvm_ext is imported), written so that a build lowers them to tvm_ext's kernels.

conv2d (NCHW data, OIHW weights, static shapes):

- dX: forward convolutions of dY with each group's channels swapped and the filter taps in the
  order of :mod:`tvm_ext.kernels.conv2d_backward_data` (one convolution at stride 1, one per
  stride phase otherwise, interleaved by a stack and a reshape); TVM's is a `conv2d_transpose`,
  which computes on a dY with zeros inserted and has no tvm_ext kernel.
- dW: the conv2d of x and dY in the weight gradient's layouts
  (:data:`tvm_ext.strategy.decide.WEIGHT_GRADIENT_LAYOUTS`) that TVM's gradient also writes, but
  with exactly the filter's taps: x's rows and columns no tap reads are cropped (TVM's computes up
  to stride - 1 more taps and slices them off). A build serves it with the X^T dY kernel; grouped
  convolutions keep TVM's dW.

Anything else (other layouts, symbolic shapes) gets TVM's own gradient.

Activations, with PyTorch's conventions at the kinks (a framework's users compare against it):
relu and leaky_relu pass the gradient where x > 0 (TVM's relu where x >= 0: at x == 0, which a
zero bias on a zero background makes common, the bias gradients differed from PyTorch's by 14%
on an 8x8-digits CNN), clip (relu6; TVM gives it no gradient) where low < x < high, as hardtanh;
GELU (erf form, none in TVM) as 0.5 * (1 + erf(x / sqrt 2)) + x * exp(-x^2 / 2) / sqrt(2 pi).

batch_norm (none in TVM, which needs DecomposeOpsForTraining first): in training mode (batch
statistics) the chain :func:`read_batch_norm_gradient` reads back, which a build runs as one
blocked kernel (:mod:`tvm_ext.kernels.batch_norm`); in inference form dY scaled per channel.
The running statistics get no gradient.

adaptive_avg_pool2d (none in TVM; ResNet's and most classifiers' global pooling): where its
windows tile the image (H and W multiples of the output's), the gradient of the average pooling
with those windows; otherwise a clear error.

concat of one tensor (DenseNet's first layer of each block, `torch.cat([x])`): its gradient as a
tuple of that one gradient. TVM's splits dY at no index, and `Gradient` then fails ("Expected
nested to match tuple"); concatenations of several keep TVM's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax
from tvm.relax.op import _op_gradient
from tvm.relax.op.base import register_gradient
from tvm.relax.op.grad import no_grad

from ..kernels.conv2d import Conv2dWorkload
from ..kernels.conv2d_backward_data import data_gradient_phases
from ..relax_info import dtype, image_shape, prim_value, static_shape

__all__ = ["BatchNormGradient", "PhaseInterleave", "activation_gradient", "adaptive_avg_pool2d_gradient",
           "batch_norm_gradient", "concat_gradient", "conv2d_gradient", "read_batch_norm_gradient",
           "read_phase_interleave", "read_phase_weight", "weight_gradient_as_conv2d", "weight_gradient_input"]

LEVEL = 11  # above TVM's registration (10)


def _data_gradient(dy: relax.Expr, weight: relax.Expr, wl: Conv2dWorkload, bb: relax.BlockBuilder) -> relax.Expr:
    """dX of workload `wl` as forward convolutions of `dy` (module docstring)."""
    op = relax.op
    g, cg, kg = wl.groups, wl.C // wl.groups, wl.K // wl.groups
    # W'[g*Cg + c, j, r, s] = W[g*Kg + j, c, r, s]
    swapped = op.reshape(op.permute_dims(op.reshape(weight, (g, kg, cg, wl.KH, wl.KW)), [0, 2, 1, 3, 4]),
                         (wl.C, kg, wl.KH, wl.KW))
    swapped = bb.emit(swapped)
    phases = data_gradient_phases(wl)
    rows, cols = -(-wl.H // wl.stride[0]), -(-wl.W // wl.stride[1])  # of the tallest and widest phase
    parts = {}
    for phase in phases:
        if phase.zero:  # no tap reaches these pixels
            part = op.zeros((wl.N, wl.C, *phase.shape), "float32")
        else:
            taps = op.take(swapped, relax.const(np.array(phase.taps_h, "int64")), axis=2, mode="clip")
            taps = op.take(taps, relax.const(np.array(phase.taps_w, "int64")), axis=3, mode="clip")
            window = dy
            if (phase.rows, phase.cols) != ((0, wl.OH), (0, wl.OW)):  # a slice, even of all, is a copy
                window = op.strided_slice(dy, axes=[2, 3], begin=[phase.rows[0], phase.cols[0]],
                                          end=[phase.rows[1], phase.cols[1]])
            part = op.nn.conv2d(window, taps, strides=1, padding=phase.padding, dilation=phase.dilation,
                                groups=wl.groups, out_dtype="float32")
        if len(phases) == 1:
            return part
        if phase.shape != (rows, cols):
            part = op.nn.pad(part, [0, 0, 0, 0, 0, rows - phase.shape[0], 0, cols - phase.shape[1]])
        parts[phase.a, phase.b] = bb.emit(part)
    sh, sw = min(wl.stride[0], wl.H), min(wl.stride[1], wl.W)
    # (N, C, rows, sh, cols, sw): pixel (q * sh + a, p * sw + b) is phase (a, b)'s (q, p)
    stacked = op.stack([op.stack([parts[a, b] for b in range(sw)], axis=4) for a in range(sh)], axis=3)
    whole = op.reshape(stacked, (wl.N, wl.C, rows * sh, cols * sw))
    return op.strided_slice(whole, axes=[2, 3], begin=[0, 0], end=[wl.H, wl.W])


def _bound_call(expr: relax.Expr, name: str, value_of: Callable[[relax.Expr], relax.Expr | None]
                ) -> relax.Call | None:
    """`expr` (a call, or the call bound to variable `expr`) if it calls op `name`, else None."""
    value = expr if isinstance(expr, relax.Call) else value_of(expr)
    if value is None or not isinstance(value, relax.Call) or value.op != tvm.ir.Op.get(name):
        return None
    return value


def read_phase_weight(weight: relax.Expr, value_of: Callable[[relax.Expr], relax.Expr | None]
                      ) -> tuple[relax.Expr, tuple[int, ...], tuple[int, ...]] | None:
    """(the forward weights W, taps_h, taps_w) if `weight` is a phase's weights as
    :func:`_data_gradient` writes them for groups=1: take(take(W swapped, taps_h, 2), taps_w, 3)
    with W swapped = reshape(permute_dims(reshape(W, (1, K, C, KH, KW)), [0, 2, 1, 3, 4]),
    (C, K, KH, KW)); None otherwise. `value_of`: the call bound to a variable, else None."""
    def call(expr, name: str) -> relax.Call | None:
        return _bound_call(expr, name, value_of)

    def taps(take: relax.Call, axis: int) -> tuple[int, ...] | None:
        indices = take.args[1]
        if (int(take.attrs.axis) != axis or not isinstance(indices, tvm.ir.expr.GenericConst)
                or indices.value.numpy().ndim != 1):
            return None
        return tuple(int(t) for t in indices.value.numpy())

    cols = call(weight, "relax.take")
    rows = None if cols is None else call(cols.args[0], "relax.take")
    swapped = None if rows is None else call(rows.args[0], "relax.reshape")
    permuted = None if swapped is None else call(swapped.args[0], "relax.permute_dims")
    grouped = None if permuted is None else call(permuted.args[0], "relax.reshape")
    if grouped is None or [int(a) for a in (permuted.attrs.axes or [])] != [0, 2, 1, 3, 4]:  # type: ignore[union-attr]
        return None
    w = grouped.args[0]
    shape = static_shape(w)
    if (shape is None or len(shape) != 4 or static_shape(grouped) != (1, *shape)
            or static_shape(swapped) != (shape[1], shape[0], *shape[2:]) or dtype(w) != "float32"):
        return None
    taps_h, taps_w = taps(rows, 2), taps(cols, 3)  # type: ignore[arg-type]
    return None if taps_h is None or taps_w is None else (w, taps_h, taps_w)


@dataclasses.dataclass(frozen=True)
class PhaseInterleave:
    """A strided convolution's dX as :func:`_data_gradient` writes it, read back from a graph."""

    stride: tuple[int, int]
    parts: list  # row-major over the stride: each phase's value before its pad; None for a zero phase
    calls: list  # every call of the chain: the crop, reshape, stacks, pads and zeros


def read_phase_interleave(crop: relax.Expr, value_of: Callable[[relax.Expr], relax.Expr | None]
                          ) -> PhaseInterleave | None:
    """The stride phases `crop` interleaves, if it ends the chain :func:`_data_gradient` writes
    (stack, stack, reshape, crop) with exactly its layout: parts (N, C, R, Q), pixel
    (r * sh + a, q * sw + b) from part (a, b), every residue inside the crop's H and W.
    `value_of`: the call bound to a variable, else None."""
    def call_of(expr, op: str) -> relax.Call | None:
        value = value_of(expr)
        if value is None or not isinstance(value, relax.Call) or value.op != tvm.ir.Op.get(op):
            return None
        return value

    if not isinstance(crop, relax.Call) or crop.op != tvm.ir.Op.get("relax.strided_slice") or len(crop.args) != 4:
        return None  # (a fifth argument: strides)
    out_shape = image_shape(crop)
    axes, begin = ([int(field.value) for field in arg.fields] for arg in crop.args[1:3])
    whole = call_of(crop.args[0], "relax.reshape")
    stacked = None if whole is None else call_of(whole.args[0], "relax.stack")
    if (out_shape is None or sorted(axes) != [2, 3] or any(begin) or stacked is None
            or int(stacked.attrs.axis) != 3 or not isinstance(stacked.args[0], relax.Tuple)):
        return None
    rows = [call_of(field, "relax.stack") for field in stacked.args[0].fields]
    if any(row is None or int(row.attrs.axis) != 4 or not isinstance(row.args[0], relax.Tuple) for row in rows):
        return None
    fields = [list(row.args[0].fields) for row in rows if row is not None]
    n, channels, h, w = out_shape
    sh, sw = len(fields), len(fields[0])
    part_shapes = {image_shape(part) for row in fields for part in row}
    if any(len(row) != sw for row in fields) or len(part_shapes) != 1 or sh > h or sw > w:
        return None
    part_shape = part_shapes.pop()
    if (part_shape is None or tuple(part_shape[:2]) != (n, channels)
            or image_shape(whole) != (n, channels, part_shape[2] * sh, part_shape[3] * sw)):
        return None
    calls, parts = [crop, whole, stacked, *rows], []
    for part in (part for row in fields for part in row):
        zeros, padded = call_of(part, "relax.zeros"), call_of(part, "relax.nn.pad")
        if zeros is not None:
            calls.append(zeros)
            parts.append(None)
            continue
        if padded is not None:  # zeros after the phase's pixels, to stack it
            widths = [int(v) for v in padded.attrs.pad_width]
            if any(widths[:5]) or widths[6] or float(padded.attrs.pad_value) != 0.0:
                return None
            calls.append(padded)
            part = padded.args[0]
        parts.append(part)
    return PhaseInterleave((sh, sw), parts, calls)


def weight_gradient_input(wl: Conv2dWorkload) -> tuple[tuple[int, int], tuple[int, int, int, int]]:
    """(rows, columns) of x the weight gradient of `wl` reads and the padding it keeps: the
    padded image is cropped to (OH - 1) * stride + (KH - 1) * dilation + 1 rows (and columns
    likewise), from the bottom padding first, then from x."""
    top, left, bottom, right = wl.padding
    keep, pads = [], []
    for size, before, after, out, taps, stride, dilation in ((wl.H, top, bottom, wl.OH, wl.KH, wl.stride[0],
                                                              wl.dilation[0]),
                                                             (wl.W, left, right, wl.OW, wl.KW, wl.stride[1],
                                                              wl.dilation[1])):
        excess = size + before + after - ((out - 1) * stride + (taps - 1) * dilation + 1)
        trimmed = min(after, excess)
        keep.append(size - (excess - trimmed))
        pads.append(after - trimmed)
    return (keep[0], keep[1]), (top, left, pads[0], pads[1])


def weight_gradient_as_conv2d(wl: Conv2dWorkload) -> Conv2dWorkload:
    """The weight gradient of `wl` (groups=1) as the NCHW/OIHW forward convolution its conv2d in
    the weight gradient's layouts is: x^T (x's channels as images, cropped as
    :func:`weight_gradient_input` says) convolved with dY^T (K filters, dY's pixels as taps),
    giving dW with its first two axes swapped; how CUDA's maxDNN tile runs it."""
    (rows, cols), padding = weight_gradient_input(wl)
    return Conv2dWorkload.make((wl.C, wl.N, rows, cols), (wl.K, wl.N, wl.OH, wl.OW), wl.dilation, padding,
                               wl.stride, 1)


def _weight_gradient(x: relax.Expr, dy: relax.Expr, wl: Conv2dWorkload) -> relax.Expr:
    """dW of workload `wl` (groups=1): conv2d(x, dY) in the weight gradient's layouts."""
    (rows, cols), padding = weight_gradient_input(wl)
    if (rows, cols) != (wl.H, wl.W):
        x = relax.op.strided_slice(x, axes=[2, 3], begin=[0, 0], end=[rows, cols])
    return relax.op.nn.conv2d(x, dy, strides=wl.dilation, padding=padding, dilation=wl.stride, groups=1,
                              data_layout="CNHW", kernel_layout="IOHW", out_layout="CNHW", out_dtype="float32")


def conv2d_gradient(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var,
                    ctx: relax.BlockBuilder) -> list[relax.Expr]:
    """[dX, dW] of a conv2d (module docstring); TVM's own where tvm_ext's does not apply."""
    attrs = orig_call.attrs
    data, weight = orig_call.args
    layouts = (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout))
    x_shape, w_shape = static_shape(data), static_shape(weight)
    out_dtype = str(attrs.out_dtype)
    if (layouts != ("NCHW", "OIHW", "NCHW") or x_shape is None or w_shape is None
            or {dtype(data), dtype(weight)} != {"float32"} or out_dtype not in ("", "None", "void", "float32")):
        return _op_gradient.conv2d_grad(orig_var, orig_call, output_grad, ctx)
    wl = Conv2dWorkload.make(x_shape, w_shape, [int(s) for s in attrs.strides], [int(p) for p in attrs.padding],
                             [int(d) for d in attrs.dilation], int(attrs.groups))
    dx = _data_gradient(output_grad, weight, wl, ctx)
    if wl.groups == 1:
        dw = _weight_gradient(data, output_grad, wl)
    else:
        dw = _op_gradient.conv2d_grad(orig_var, orig_call, output_grad, ctx)[1]
    return [dx, dw]


def activation_gradient(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var,
                        ctx: relax.BlockBuilder) -> list[relax.Expr]:
    """[dX] of relu, leaky_relu, clip (relu6) and GELU (module docstring); a clip's bounds must
    be numbers."""
    op = relax.op
    x, y = orig_call.args[0], orig_var
    kind = dtype(x)
    zero, one = relax.const(0.0, kind), relax.const(1.0, kind)
    name = orig_call.op.name
    # relu, leaky_relu (slope > 0) and clip keep the kinks where they are: y > 0 iff x > 0, and
    # low < y < high iff low < x < high. Their masks read y, so x need not outlive the forward
    # pass and a convolution can apply the activation in its epilogue.
    if name == "relax.nn.relu":
        return [op.where(op.greater(y, zero), output_grad, zero)]
    if name == "relax.nn.leakyrelu":
        alpha = float(orig_call.attrs.alpha)
        slope = relax.const(alpha, kind)
        return [op.where(op.greater(y if alpha > 0 else x, zero), output_grad, op.multiply(output_grad, slope))]
    if name == "relax.clip":
        low, high = prim_value(orig_call.args[1]), prim_value(orig_call.args[2])
        if low is None or high is None:
            raise ValueError(f"clip's gradient: bounds {orig_call.args[1]}, {orig_call.args[2]} are not numbers")
        inside = op.logical_and(op.greater(y, relax.const(low, kind)), op.less(y, relax.const(high, kind)))
        return [op.where(inside, output_grad, zero), no_grad(orig_call.args[1]), no_grad(orig_call.args[2])]
    if name == "relax.nn.gelu":
        cdf = op.multiply(relax.const(0.5, kind), op.add(one, op.erf(op.multiply(x, relax.const(2 ** -0.5, kind)))))
        pdf = op.multiply(op.exp(op.multiply(op.multiply(x, x), relax.const(-0.5, kind))),
                          relax.const((2 * np.pi) ** -0.5, kind))
        return [op.multiply(output_grad, op.add(cdf, op.multiply(x, pdf)))]
    raise ValueError(f"activation_gradient: no gradient for {name}")


def adaptive_avg_pool2d_gradient(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var,
                                 ctx: relax.BlockBuilder) -> list[relax.Expr]:
    """[dX] of an NCHW adaptive_avg_pool2d whose windows tile the image (module docstring)."""
    x = orig_call.args[0]
    x_shape, out_shape = static_shape(x), static_shape(orig_var)
    layouts = (str(orig_call.attrs.layout), str(orig_call.attrs.out_layout))
    if x_shape is None or out_shape is None or layouts != ("NCHW", "NCHW"):
        raise ValueError(f"adaptive_avg_pool2d's gradient: static NCHW shapes only, not {x.ty} ({layouts})")
    (h, w), (oh, ow) = x_shape[2:], out_shape[2:]
    if h % oh or w % ow:
        raise ValueError(f"adaptive_avg_pool2d's gradient: windows of a {h}x{w} image pooled to {oh}x{ow} "
                         "overlap or differ in size; only tiling windows are covered")
    window = (h // oh, w // ow)
    return [relax.op.grad.avg_pool2d_backward(output_grad, x, window, window)]


def concat_gradient(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var,
                    ctx: relax.BlockBuilder) -> list[relax.Expr]:
    """[(dX,)] of a concatenation of one tensor; TVM's gradient for more (module docstring)."""
    fields = orig_call.args[0].ty.fields
    if len(fields) == 1:
        return [relax.Tuple([output_grad])]
    return _op_gradient.concat_grad(orig_var, orig_call, output_grad, ctx)


def _reduced_axes(orig_call: relax.Call) -> tuple[list[int], list[int], int]:
    """(the axes a batch norm reduces, the shape broadcasting one value per channel, the count of
    values per channel) of a batch norm of static rank and shape."""
    shape = static_shape(orig_call.args[0])
    if shape is None:
        raise ValueError(f"batch_norm's gradient: a static shape only, not {orig_call.args[0].ty}")
    axis = int(orig_call.attrs.axis) % len(shape)
    axes = [a for a in range(len(shape)) if a != axis]
    return axes, [shape[a] if a == axis else 1 for a in range(len(shape))], int(np.prod([shape[a] for a in axes]))


def batch_norm_gradient(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
                        ctx: relax.BlockBuilder) -> list[relax.Expr]:
    """[dX, dgamma, dbeta, 0, 0] of a batch norm (module docstring): in training mode the chain
    :func:`read_batch_norm_gradient` reads, each step its own binding; in inference form
    dX = dY * gamma * rstd of the running variance."""
    op, attrs = relax.op, orig_call.attrs
    x, gamma, beta, moving_mean, moving_var = orig_call.args
    kind = dtype(x)
    axes, per_channel, count = _reduced_axes(orig_call)
    dy = ctx.emit(relax.TupleGetItem(output_grad, 0)) if isinstance(output_grad.ty, relax.TupleType) else output_grad
    epsilon = relax.const(float(attrs.epsilon), kind)
    if bool(attrs.training):
        mean = ctx.emit(op.mean(x, axes, keepdims=True))
        rstd = ctx.emit(op.rsqrt(ctx.emit(op.add(ctx.emit(op.variance(x, axes, keepdims=True)), epsilon))))
    else:
        mean = ctx.emit(op.reshape(moving_mean, per_channel))
        rstd = ctx.emit(op.reshape(op.rsqrt(op.add(moving_var, epsilon)), per_channel))
    xhat = ctx.emit(op.multiply(ctx.emit(op.subtract(x, mean)), rstd))
    dbeta = ctx.emit(op.sum(dy, axes))
    dgamma = ctx.emit(op.sum(ctx.emit(op.multiply(dy, xhat)), axes))
    scale = ctx.emit(op.multiply(rstd, ctx.emit(op.reshape(gamma, per_channel)))) if bool(attrs.scale) else rstd
    if bool(attrs.training):  # dY - dbeta / M - xhat * dgamma / M
        inverse = relax.const(1.0 / count, kind)
        centred = ctx.emit(op.subtract(dy, ctx.emit(op.multiply(ctx.emit(op.reshape(dbeta, per_channel)), inverse))))
        step = ctx.emit(op.multiply(ctx.emit(op.reshape(dgamma, per_channel)), inverse))
        dy = ctx.emit(op.subtract(centred, ctx.emit(op.multiply(xhat, step))))
    dx = op.multiply(dy, scale)
    return [dx, dgamma if bool(attrs.scale) else op.zeros_like(gamma), dbeta if bool(attrs.center) else
            op.zeros_like(beta), no_grad(moving_mean), no_grad(moving_var)]


@dataclasses.dataclass(frozen=True)
class BatchNormGradient:
    """A training-mode batch norm's gradient as :func:`batch_norm_gradient` writes it, read back
    from a graph (NCHW, static shapes)."""

    x: relax.Expr
    dy: relax.Expr
    gamma: relax.Expr | None  # None: the batch norm does not scale
    epsilon: float
    dgamma: relax.Var  # the bindings of the two sums
    dbeta: relax.Var
    calls: list = dataclasses.field(default_factory=list)  # every call of the chain


def read_batch_norm_gradient(dx: relax.Expr, value_of: Callable[[relax.Expr], relax.Expr | None]
                             ) -> BatchNormGradient | None:
    """The batch norm whose dX `dx` (a call) is, if it ends the training-mode chain
    :func:`batch_norm_gradient` writes for a 4-D float32 NCHW x of static shape, with every step
    as it writes it (axes, the 1 / M constant, the operands); None otherwise. `value_of`: the
    call bound to a variable, else None."""
    calls: list[relax.Call] = []

    def call(expr, name: str, args: int = 2) -> relax.Call | None:
        """The call of op `name` with `args` arguments `expr` is or names, recorded in `calls`."""
        value = _bound_call(expr, name, value_of)
        if value is None or len(value.args) != args:
            return None
        calls.append(value)
        return value

    def constant(expr) -> float | None:
        if not isinstance(expr, tvm.ir.expr.GenericConst):
            return None
        value = expr.value.numpy()
        return float(value) if value.shape == () else None

    def axes_of(reduction: relax.Call) -> list[int] | None:
        return None if reduction.attrs.axis is None else [int(a) for a in reduction.attrs.axis]

    product = call(dx, "relax.multiply")
    if product is None:
        return None
    centred_minus, scale = product.args
    difference = call(centred_minus, "relax.subtract")
    centred = None if difference is None else call(difference.args[0], "relax.subtract")
    by_xhat = None if difference is None else call(difference.args[1], "relax.multiply")
    shape = static_shape(dx)
    if centred is None or by_xhat is None or shape is None or len(shape) != 4 or dtype(dx) != "float32":
        return None
    dy, xhat, gamma = centred.args[0], by_xhat.args[0], None
    rstd = scale
    scaled = call(scale, "relax.multiply")
    if scaled is not None:
        shaped = call(scaled.args[1], "relax.reshape")
        if shaped is None:
            return None
        rstd, gamma = scaled.args[0], shaped.args[0]
    count, per_channel = shape[0] * shape[2] * shape[3], (1, shape[1], 1, 1)

    def sum_over_channels(term) -> tuple[relax.Var, relax.Call] | None:
        """(the variable of sum(term), that sum) where `term` reshapes it to one value per
        channel and divides it by M."""
        mul = call(term, "relax.multiply")
        shaped = None if mul is None else call(mul.args[0], "relax.reshape")
        if (mul is None or shaped is None or constant(mul.args[1]) != float(np.float32(1.0 / count))
                or static_shape(shaped) != per_channel or not isinstance(shaped.args[0], relax.Var)):
            return None
        total = call(shaped.args[0], "relax.sum", 1)
        return (shaped.args[0], total) if total is not None and axes_of(total) == [0, 2, 3] else None

    beta_sum, gamma_sum = sum_over_channels(centred.args[1]), sum_over_channels(by_xhat.args[1])
    if beta_sum is None or gamma_sum is None:
        return None
    (dbeta, beta_total), (dgamma, gamma_total) = beta_sum, gamma_sum
    dgamma_term = call(gamma_total.args[0], "relax.multiply")
    normalized = call(xhat, "relax.multiply")
    shifted = None if normalized is None else call(normalized.args[0], "relax.subtract")
    if (dgamma_term is None or normalized is None or shifted is None
            or not (dgamma_term.args[0].same_as(dy) and dgamma_term.args[1].same_as(xhat))
            or not beta_total.args[0].same_as(dy)
            or not normalized.args[1].same_as(rstd)):
        return None
    x = shifted.args[0]
    mean, root = call(shifted.args[1], "relax.mean", 1), call(rstd, "relax.rsqrt", 1)
    plus = None if root is None else call(root.args[0], "relax.add")
    variance = None if plus is None else call(plus.args[0], "relax.variance", 1)
    epsilon = None if plus is None else constant(plus.args[1])
    if (mean is None or variance is None or epsilon is None or not mean.args[0].same_as(x)
            or not variance.args[0].same_as(x) or axes_of(mean) != [0, 2, 3] or axes_of(variance) != [0, 2, 3]
            or not (bool(mean.attrs.keepdims) and bool(variance.attrs.keepdims))
            or static_shape(x) != shape or static_shape(dy) != shape or dtype(x) != "float32"):
        return None
    if gamma is not None and static_shape(gamma) != (shape[1],):
        return None
    return BatchNormGradient(x, dy, gamma, epsilon, dgamma, dbeta, calls)


register_gradient("relax.nn.batch_norm", batch_norm_gradient, level=LEVEL)
register_gradient("relax.nn.conv2d", conv2d_gradient, level=LEVEL)
register_gradient("relax.nn.adaptive_avg_pool2d", adaptive_avg_pool2d_gradient, level=LEVEL)
register_gradient("relax.concat", concat_gradient, level=LEVEL)
for _name in ("relax.nn.relu", "relax.nn.leakyrelu", "relax.clip", "relax.nn.gelu"):
    register_gradient(_name, activation_gradient, level=LEVEL)
