"""Elementwise activations (LLVM CPU): one vectorized, parallel pass over memory.

The activation is the same TVMScript expression a convolution's epilogue applies
(:data:`tvm_ext.kernels.conv2d.ACTIVATIONS`), here over the tensor viewed as one flat vector.
"""

from __future__ import annotations

import math

import tvm
import tvm.script
from tvm import tirx

from .conv2d import ACTIVATIONS, KERNEL_ATTR, activation_text

__all__ = ["ACTIVATIONS", "activation_func"]

_TEMPLATE = """
@T.prim_func(s_tir=True)
def activation(x: T.handle, y: T.handle) -> None:
    X = T.match_buffer(x, {shape}, "float32")
    Y = T.match_buffer(y, {shape}, "float32")
    X_flat = T.decl_buffer(({size},), "float32", data=X.data)
    Y_flat = T.decl_buffer(({size},), "float32", data=Y.data)
    for i in T.parallel({outer}):
        for j in T.vectorized({inner}):
            with T.sblock("output"):
                v = T.axis.spatial({size}, i * {inner} + j)
                T.where(i * {inner} + j < {size})
                Y_flat[v] = {value}
"""


def activation_func(name: str, shape, dtype: str, lanes: int, alpha: float = 0.01) -> tirx.PrimFunc:
    """Scheduled PrimFunc applying activation `name` to a tensor of `shape`."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; choose from {sorted(ACTIVATIONS)}")
    if dtype != "float32":
        raise ValueError(f"{name}: dtype {dtype} is not supported (float32 only)")
    shape = tuple(int(v) for v in shape)
    size = math.prod(shape)
    inner = 4 * lanes if size >= 4 * lanes else 1
    text = _TEMPLATE.format(shape=shape, size=size, inner=inner, outer=-(-size // inner),
                            value=activation_text(name, "X_flat[v]", alpha))
    func = tvm.script.from_source(text)
    return func.with_attr(KERNEL_ATTR, name)
