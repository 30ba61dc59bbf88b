"""What every part of the strategy shares: the Decision it takes per op, the tables of the ops it
serves, and the small readers of their attributes."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np
import tvm
from tvm import relax

from ..kernels import pool2d as _pool
from ..relax_info import prim_value

# Relax's FuseOps must leave our scheduled kernels alone: kOpaque.
OPAQUE = 8


@dataclasses.dataclass(frozen=True)
class Decision:
    """The dispatch of one op: the tvm_ext kernel serving it, or None and the reason."""

    op: str
    shapes: tuple
    kernel: str | None
    reason: str = ""
    # the convolution's plan: a kernels.conv2d.Conv2dPlan or kernels.winograd plan on CPUs, a
    # kernels.cuda MaxDNNPlan or WinogradPlan on CUDA; None for other ops
    plan: object | None = None


ACTIVATION_OPS = {"relax.nn.relu": "relu", "relax.sigmoid": "sigmoid", "relax.clip": "relu6", "relax.nn.silu": "silu",
                   "relax.nn.gelu": "gelu", "relax.nn.leakyrelu": "leaky_relu"}

DATA_MOVEMENT_OPS = {"relax.reshape", "relax.flatten", "relax.permute_dims", "relax.squeeze", "relax.expand_dims"}

POOLS = {"relax.nn.max_pool2d": "max", "relax.nn.avg_pool2d": "avg", "relax.nn.adaptive_avg_pool2d": "global"}


def alpha(activation: relax.Call | None) -> float:
    """leaky_relu's negative slope (the other activations have none)."""
    if activation is None or activation.op.name != "relax.nn.leakyrelu":
        return 0.01
    return float(activation.attrs.alpha)


def is_relu6(clip: relax.Call) -> bool:
    """Whether a clip is relu6's (0, 6), the one clip the kernels apply."""
    return (prim_value(clip.args[1]), prim_value(clip.args[2])) == (0.0, 6.0)


def pool_workload(call: relax.Call, shape: tuple) -> _pool.Pool2dWorkload:
    """The pooling workload of a max/avg pool call on NCHW data of `shape` (raises ValueError)."""
    attrs = call.attrs
    mode = POOLS[call.op.name]
    return _pool.Pool2dWorkload.make(shape, mode, [int(v) for v in attrs.pool_size], [int(v) for v in attrs.strides],
                                     [int(v) for v in attrs.padding], [int(v) for v in attrs.dilation],
                                     bool(attrs.ceil_mode), bool(attrs.count_include_pad))


def add_kernel(bb: relax.BlockBuilder, func: tvm.tirx.PrimFunc, name: str) -> tvm.ir.GlobalVar:
    """`func` added to the module as an opaque kernel (FuseOps leaves it alone)."""
    return bb.add_func(func.with_attr("op_pattern", OPAQUE), name)


class Emitter(Protocol):
    """What :mod:`.dispatch` asks of a target's emitter (:class:`.cpu.CpuEmitter`,
    :class:`.cuda.CudaEmitter`): the calls that replace one op, given the decision taken for it.
    Each keeps activations in its kernels' layout between them, and hands the rest of the graph
    a view in NCHW."""

    def conv2d(self, call: relax.Call, data: relax.Expr, decision: Decision, bias: np.ndarray | None = None,
               residual: relax.Expr | None = None, activation: relax.Call | None = None,
               suffix: str = "") -> relax.Expr:
        """conv2d (+ bias + residual -> activation) as kernel calls."""

    def pool_or_activation(self, call: relax.Call, decision: Decision) -> relax.Expr:
        """A pooling, global pooling, mean over H and W, or activation as a kernel call."""
