"""Elementwise activations (LLVM CPU): one vectorized, parallel pass over memory.

The activation is the same TVMScript expression a convolution's epilogue applies
(:data:`tvm_ext.kernels.conv2d.ACTIVATIONS`), here over the tensor viewed as one flat vector.
"""

from __future__ import annotations

import math

from tvm import tirx

from . import script
from .conv2d import ACTIVATIONS, KERNEL_ATTR, activation_text

__all__ = ["ACTIVATIONS", "activation_func", "flat_activation_func"]

_TEMPLATE = """
@T.prim_func(s_tir=True)
def activation(x: T.handle, y: T.handle) -> None:
    X = T.match_buffer(x, {shape}, "float32")
    Y = T.match_buffer(y, {shape}, "float32")
    X_flat = T.decl_buffer(({size},), "float32", data=X.data)
    Y_flat = T.decl_buffer(({size},), "float32", data=Y.data)
    for i in {outer_loop}:
        for j in {inner_loop}:
            with T.sblock("output"):
                v = T.axis.spatial({size}, i * {inner} + j)
                T.where(i * {inner} + j < {size})
                Y_flat[v] = {value}
"""


def activation_func(name: str, shape, dtype: str, lanes: int, alpha: float = 0.01) -> tirx.PrimFunc:
    """Scheduled PrimFunc applying activation `name` to a tensor of `shape`."""
    if dtype != "float32":
        raise ValueError(f"{name}: dtype {dtype} is not supported (float32 only)")
    size = math.prod(int(v) for v in shape)
    inner = 4 * lanes if size >= 4 * lanes else 1
    return flat_activation_func(name, shape, alpha, inner, "T.parallel({})", "T.vectorized({})")


def flat_activation_func(name: str, shape, alpha: float, inner: int, outer_loop: str,
                         inner_loop: str) -> tirx.PrimFunc:
    """Activation `name` over the tensor as one flat vector, in two loops: `outer_loop` and
    `inner_loop` are TVMScript loop kinds with a `{}` for the extent (parallel + vectorized on a
    CPU, blockIdx + threadIdx bindings on a GPU)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; choose from {sorted(ACTIVATIONS)}")
    shape = tuple(int(v) for v in shape)
    size = math.prod(shape)
    outer = -(-size // inner)
    text = _TEMPLATE.format(shape=shape, size=size, inner=inner, outer_loop=outer_loop.format(outer),
                            inner_loop=inner_loop.format(inner), value=activation_text(name, "X_flat[v]", alpha))
    return script.from_source(text).with_attr(KERNEL_ATTR, name)
