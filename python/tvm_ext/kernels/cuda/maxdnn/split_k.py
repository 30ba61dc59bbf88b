"""Split-K's second kernel: the sum of the slices' partial sums, with the convolution's epilogue.

A grid too small to fill a GPU splits the convolution's reduction (:func:`~.plan.choose_splits`);
each slice writes raw sums, and this kernel adds them in order (deterministic) and applies the
bias, residual and activation. A TE kernel of its own, apart from the maxDNN generator.
"""

from __future__ import annotations

import math

import tvm

from ...conv2d import activation_expr
from .plan import KERNEL_NAME, MaxDNNPlan

REDUCE_SUFFIX = "_reduce"  # the split-K reduce kernel's symbol: the convolution's + this


def split_reduce_func(plan: MaxDNNPlan, symbol: str = KERNEL_NAME + REDUCE_SUFFIX) -> tvm.tirx.PrimFunc:
    """Split-K's second kernel: y = act(sum of the slices' partial sums + bias + residual), one
    thread per output element (the slices summed in registers, in order: deterministic).
    Parameters as :meth:`MaxDNNPlan.reduce_shapes`."""
    from tvm import te

    from ..memory_bound import bind_threads

    shapes, ep = plan.reduce_shapes(), plan.epilogue
    if not shapes:
        raise ValueError("split_reduce_func: the plan has no split-K")
    partial = te.placeholder(shapes["partial"], "float32", name="partial")
    inputs = [partial]
    bias = residual = None
    if ep.bias:
        bias = te.placeholder(shapes["bias"], "float32", name="bias")
        inputs.append(bias)
    if ep.residual:
        residual = te.placeholder(shapes["residual"], "float32", name="residual")
        inputs.append(residual)
    sp = te.reduce_axis((0, plan.splits), "sp")
    total = te.compute(plan.y_shape, lambda *i: te.sum(partial[(sp, *i)], axis=sp), name="slices")

    def value(*i):
        v = total[i]
        if bias is not None:
            v = v + bias[i[0]]
        if residual is not None:
            v = v + residual[i]
        return activation_expr(ep.activation, v) if ep.activation else v  # the CPU epilogue's definition

    y = te.compute(plan.y_shape, value, name="output")
    func = bind_threads(te.create_prim_func([*inputs, y]), KERNEL_NAME + REDUCE_SUFFIX, reducer="slices")
    return func.with_attr("global_symbol", symbol)


def reduce_launch(plan: MaxDNNPlan) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, block) of :func:`split_reduce_func`'s kernel: one thread per output element."""
    from ..memory_bound import THREADS

    return (-(-math.prod(plan.y_shape) // THREADS), 1, 1), (THREADS, 1, 1)
