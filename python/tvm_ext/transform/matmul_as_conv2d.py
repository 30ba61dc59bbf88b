"""Dense layers as 1x1 convolutions: a GEMM is a batch-reduce of size one."""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax

from ..relax_info import dtype, static_shape

__all__ = ["matmul_as_conv2d"]


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
    from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

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

    @tvm.transform.module_pass(opt_level=0, name="tvm_ext.MatmulAsConv2d")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = mod.clone()  # the caller's module stays as it was
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                mod[gvar] = rewrite_call(pattern, rewriter, func)
        return mod

    return _pass
