"""Elementwise activations (LLVM CPU): one vectorized, parallel pass over memory."""

from __future__ import annotations

from tvm import s_tir, te, tirx

from .conv2d import KERNEL_ATTR

ACTIVATIONS = {
    "relu": lambda v: tirx.max(v, tirx.const(0.0, v.dtype)),
    "relu6": lambda v: tirx.min(tirx.max(v, tirx.const(0.0, v.dtype)), tirx.const(6.0, v.dtype)),
    "sigmoid": tirx.sigmoid,
}


def activation_func(name: str, shape, dtype: str, lanes: int) -> tirx.PrimFunc:
    """Scheduled PrimFunc applying activation `name` to a tensor of `shape`."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; choose from {sorted(ACTIVATIONS)}")
    if dtype != "float32":
        raise ValueError(f"{name}: dtype {dtype} is not supported (float32 only)")
    shape = tuple(int(v) for v in shape)
    size = 1
    for v in shape:
        size *= v
    x = te.placeholder(shape, dtype, name="data")
    y = te.compute(shape, lambda *i: ACTIVATIONS[name](x[i]), name="output")
    sch = s_tir.Schedule(te.create_prim_func([x, y]))
    loops = sch.get_loops(sch.get_sblock("output"))
    i = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    if size >= 4 * lanes:
        outer, inner = sch.split(i, [None, 4 * lanes])
        sch.vectorize(inner)
        sch.parallel(outer)
    return sch.mod["main"].with_attr(KERNEL_ATTR, name)
