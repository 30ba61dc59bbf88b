"""Dense layers as 1x1 convolutions: a GEMM is a batch-reduce of size one."""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax

from ..relax_info import dtype, static_shape
from .rewriting import rewriting_pass

__all__ = ["matmul_as_conv2d", "quantized_matmul_as_conv2d"]


def matmul_as_conv2d() -> tvm.transform.Pass:
    """x (M, K) @ W (K, N) [+ b (N,) [-> relu]]  ==>  conv2d over a 1 x M image of K channels
    (x of more axes, (..., K): its leading axes flattened into the M rows, as a Linear on NHWC).

    The rows of x become the pixels of one image (the microkernel's m_r dimension, so each
    weight vector loaded is reused across rows) and W (constant) a 1x1 filter bank, transposed
    here at build time; the bias becomes the convolution's, so it and a following activation
    fuse into the kernel's epilogue like any convolution's.

    W computed at run time (a training graph's dense layer and its gradients) is read as it
    lies instead, with no transpose: x @ W = (W^T x^T)^T is the 1x1 convolution of the image
    W (K channels, N pixels) with the filter bank x (M filters of K taps), whose output
    (M channels, N pixels) is x @ W in memory. Its bias (along N, the pixels) stays an add.
    """
    from tvm.relax.dpl import is_const, is_op, wildcard

    weight, bias = wildcard(), is_const()
    matmul = is_op("relax.matmul")(wildcard(), weight)
    add = is_op("relax.add")(matmul, bias)
    relu = is_op("relax.nn.relu")(add)
    pattern = relu | add | matmul
    # rewrite_call offers every node the pattern matches (relu, then its add, then its matmul)
    # and keeps the outermost rewrite: transpose each weight once (VGG-16's first dense
    # layer is 411 MB, about 3 s a copy).
    filter_banks: dict[tvm.ir.Constant, tvm.ir.Constant] = {}

    def filter_bank(weight: tvm.ir.Constant) -> tvm.ir.Constant:
        if weight not in filter_banks:  # (K, N) -> (N, K, 1, 1)
            filter_banks[weight] = relax.const(np.ascontiguousarray(weight.value.numpy().T[:, :, None, None]))
        return filter_banks[weight]

    def rewriter(orig: relax.Expr, matched: dict) -> relax.Expr:
        call = matched[matmul]
        x = call.args[0]
        x_shape, w_shape = static_shape(x), static_shape(call.args[1])
        dtypes = {dtype(x), dtype(call.args[1])}
        if x_shape is None or w_shape is None or len(x_shape) < 2 or len(w_shape) != 2 or dtypes != {"float32"}:
            return orig
        k, n = w_shape
        m = math.prod(x_shape[:-1])  # (..., K) @ (K, N): the leading axes are rows (a Linear on NHWC)
        if x_shape[-1] != k or m == 0:
            return orig
        if len(x_shape) > 2:
            x = relax.op.reshape(x, (m, k))
        if not isinstance(call.args[1], tvm.ir.Constant):
            if not orig.same_as(call):  # its add and relu stay (rewrite_call offers the matmul next)
                return orig
            image = relax.op.reshape(call.args[1], (1, k, 1, n))
            y = relax.op.reshape(relax.op.nn.conv2d(image, relax.op.reshape(x, (m, k, 1, 1))), (m, n))
            return y if len(x_shape) == 2 else relax.op.reshape(y, (*x_shape[:-1], n))
        b = matched.get(bias)
        if b is not None and static_shape(b) not in ((n,), (1, n)):
            return orig
        image = relax.op.reshape(relax.op.permute_dims(x, [1, 0]), (1, k, 1, m))
        y = relax.op.nn.conv2d(image, filter_bank(call.args[1]))
        if b is not None:
            y = relax.op.add(y, relax.const(b.value.numpy().reshape(1, n, 1, 1)))
        if relu in matched:
            y = relax.op.nn.relu(y)
        rows = relax.op.permute_dims(relax.op.reshape(y, (n, m)), [1, 0])
        return rows if len(x_shape) == 2 else relax.op.reshape(rows, (*x_shape[:-1], n))

    return rewriting_pass("tvm_ext.MatmulAsConv2d", pattern, rewriter)


def quantized_matmul_as_conv2d() -> tvm.transform.Pass:
    """A quantized dense layer as a quantized 1x1 convolution, which the int8 kernels run
    (:func:`~tvm_ext.strategy.quantized.lower_quantized_conv2d`, which runs after this):

        matmul(dequantize(x_q (M, K)), W) [+ b] [-> relu] [-> quantize (per tensor)]

    with W = dequantize(W_q (K, N), axis=1) (ONNX's QDQ Gemm) or permute_dims(dequantize(W_q
    (N, K), axis=0)) (PT2E's linear), W_q a constant and its scales one or one per output, and b
    a constant or a dequantized one, becomes the same over a 1 x M image of K channels, as
    :func:`matmul_as_conv2d` writes a float one: quantize(conv2d(dequantize(x_q^T as (1, K, 1,
    M)), dequantize(W_q as (N, K, 1, 1), axis=0)) + b), transposed back. A quantize commutes
    with the reshapes (one scale); the bias and activation keep their place before it, so the
    value each step computes is the one it computed. Without this the layer ran in float32 on
    weights dequantized at build time (ResNet-50's classifier: 8 MB read a call, not 2).
    """
    from tvm.relax.dpl import is_const, is_op, wildcard

    data = is_op("relax.dequantize")(wildcard(), is_const(), is_const())
    weight = is_op("relax.dequantize")(is_const(), is_const(), is_const())
    transposed = is_op("relax.permute_dims")(weight)
    matmul = is_op("relax.matmul")(data, weight | transposed)
    float_bias, quantized_bias = is_const(), is_op("relax.dequantize")(is_const(), is_const(), is_const())
    add = is_op("relax.add")(matmul, float_bias | quantized_bias)  # (add is matched in either order)
    relu = is_op("relax.nn.relu")(add | matmul)
    quantize = is_op("relax.quantize")(relu | add | matmul, is_const(), is_const())
    pattern = quantize | relu | add | matmul
    filter_banks: dict[tuple[tvm.ir.Constant, bool], tvm.ir.Constant] = {}

    def filter_bank(w_q: tvm.ir.Constant, transposed: bool) -> tvm.ir.Constant:
        """W_q as (N, K, 1, 1), made once a constant (rewrite_call offers every node matched)."""
        if (w_q, transposed) not in filter_banks:
            values = w_q.value.numpy()
            filter_banks[w_q, transposed] = relax.const(
                np.ascontiguousarray((values if transposed else values.T)[:, :, None, None]))
        return filter_banks[w_q, transposed]

    def scalar(expr: relax.Expr) -> bool:
        return isinstance(expr, tvm.ir.Constant) and expr.value.numpy().size == 1

    def rewriter(orig: relax.Expr, matched: dict) -> relax.Expr:
        dq_x, dq_w = matched[data], matched[weight]
        x_q, w_q = dq_x.args[0], dq_w.args[0]
        x_shape, w_shape = static_shape(x_q), static_shape(w_q)
        if (x_shape is None or len(x_shape) != 2 or w_shape is None or len(w_shape) != 2
                or dtype(x_q) not in ("uint8", "int8") or dtype(w_q) != "int8"
                or not (scalar(dq_x.args[1]) and scalar(dq_x.args[2]))):
            return orig
        m, k = x_shape
        is_transposed = transposed in matched
        axes = matched[transposed].attrs.axes if is_transposed else None  # (None: reversed, for a matrix [1, 0])
        if axes is not None and [int(a) for a in axes] != [1, 0]:
            return orig
        n = w_shape[0] if is_transposed else w_shape[1]
        if (w_shape[1] if is_transposed else w_shape[0]) != k:
            return orig
        scales, zeros = (arg.value.numpy() for arg in dq_w.args[1:])
        per_output = int(dq_w.attrs.axis) % 2 == (0 if is_transposed else 1)
        if any(v.size not in (1, n) or (v.size == n > 1 and not per_output) for v in (scales, zeros)):
            return orig
        image = x_q if m == 1 else relax.op.permute_dims(x_q, [1, 0])
        image = relax.op.dequantize(relax.op.reshape(image, (1, k, 1, m)), dq_x.args[1], dq_x.args[2], axis=1)
        filters = relax.op.dequantize(filter_bank(w_q, is_transposed), dq_w.args[1], dq_w.args[2], axis=0)
        y = relax.op.nn.conv2d(image, filters)
        if add in matched:
            if float_bias in matched:
                b = matched[float_bias].value.numpy()
                if b.size != n or b.dtype != np.float32:
                    return orig
                y = relax.op.add(y, relax.const(b.reshape(1, n, 1, 1)))
            else:
                b_q = matched[quantized_bias]
                if static_shape(b_q.args[0]) != (n,):
                    return orig
                y = relax.op.add(y, relax.op.reshape(b_q, (1, n, 1, 1)))
        if relu in matched:
            y = relax.op.nn.relu(y)
        if quantize in matched:
            q = matched[quantize]
            if not (scalar(q.args[1]) and scalar(q.args[2])):
                return orig
            y = relax.op.quantize(y, q.args[1], q.args[2], axis=1, out_dtype=str(q.attrs.out_dtype))
        return relax.op.reshape(y, (1, n)) if m == 1 else relax.op.permute_dims(relax.op.reshape(y, (n, m)), [1, 0])

    return rewriting_pass("tvm_ext.QuantizedMatmulAsConv2d", pattern, rewriter)
