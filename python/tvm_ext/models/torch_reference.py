"""Run a Relax network's `main` in PyTorch eager: a reference independent of TVM's lowering, and
the PyTorch (and, exported with torch.onnx, the ONNX Runtime) baseline of the benchmarks.

Each binding is evaluated with the torch op of the same meaning, so one network definition
(:mod:`tvm_ext.models`) serves every runtime with the same weights. PyTorch is a test and bench
extra: importing this module needs it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
import tvm
from tvm import relax

__all__ = ["to_torch", "TorchModule"]


def _ints(values) -> list[int]:
    return [int(v) for v in values]


def _pair(values) -> tuple[int, int]:
    """A Relax attribute of two ints (an adaptive pooling's output size)."""
    first, second = _ints(values)
    return first, second


def _scalar(expr) -> float:
    value = getattr(expr, "value", expr)
    return float(getattr(value, "value", value))


def _pad_then(x: torch.Tensor, padding: list[int]) -> tuple[torch.Tensor, tuple[int, int]]:
    """Relax pads (top, left, bottom, right); torch takes symmetric (h, w): pad the rest first."""
    top, left, bottom, right = padding
    if (top, left) == (bottom, right):
        return x, (top, left)
    return F.pad(x, (left, right, top, bottom)), (0, 0)


def _conv2d(x, w, attrs):
    x, pad = _pad_then(x, _ints(attrs.padding))
    return F.conv2d(x, w, None, _ints(attrs.strides), pad, _ints(attrs.dilation), int(attrs.groups))


def _pool2d(kind: str):
    def run(x, attrs):
        top, left, bottom, right = _ints(attrs.padding)
        kernel, stride = _ints(attrs.pool_size), _ints(attrs.strides)
        if (top, left) != (bottom, right):
            raise NotImplementedError("torch reference: asymmetric pooling padding")
        if kind == "max":
            return F.max_pool2d(x, kernel, stride, (top, left), _ints(attrs.dilation), bool(attrs.ceil_mode))
        return F.avg_pool2d(x, kernel, stride, (top, left), bool(attrs.ceil_mode), bool(attrs.count_include_pad))

    return run


def _mean(x, attrs):
    return x.mean(dim=_ints(attrs.axis), keepdim=bool(attrs.keepdims))


_OPS: dict[str, Callable] = {
    "relax.nn.conv2d": lambda call, x, w: _conv2d(x, w, call.attrs),
    "relax.nn.batch_norm": lambda call, x, g, b, m, v: (
        F.batch_norm(x, m, v, g, b, False, 0.0, float(call.attrs.epsilon)), m, v),
    "relax.nn.relu": lambda call, x: F.relu(x),
    "relax.clip": lambda call, x, lo, hi: torch.clamp(x, _scalar(call.args[1]), _scalar(call.args[2])),
    "relax.sigmoid": lambda call, x: torch.sigmoid(x),
    "relax.nn.silu": lambda call, x: F.silu(x),
    "relax.nn.gelu": lambda call, x: F.gelu(x),
    "relax.nn.leakyrelu": lambda call, x: F.leaky_relu(x, float(call.attrs.alpha)),
    "relax.add": lambda call, a, b: a + b,
    "relax.subtract": lambda call, a, b: a - b,
    "relax.multiply": lambda call, a, b: a * b,
    "relax.divide": lambda call, a, b: a / b,
    "relax.nn.max_pool2d": lambda call, x: _pool2d("max")(x, call.attrs),
    "relax.nn.avg_pool2d": lambda call, x: _pool2d("avg")(x, call.attrs),
    "relax.nn.adaptive_avg_pool2d": lambda call, x: F.adaptive_avg_pool2d(
        x, _pair(call.attrs.output_size) if call.attrs.output_size is not None else x.shape[-2:]),
    "relax.mean": lambda call, x: _mean(x, call.attrs),
    "relax.matmul": lambda call, a, b: a @ b,
    "relax.reshape": lambda call, x, shape: x.reshape(shape),
    "relax.flatten": lambda call, x: x.reshape(-1),
    "relax.permute_dims": lambda call, x: x.permute(*(_ints(call.attrs.axes) if call.attrs.axes is not None
                                                     else range(x.dim() - 1, -1, -1))),
    "relax.nn.softmax": lambda call, x: F.softmax(x, int(call.attrs.axis)),
}


def to_torch(mod: tvm.IRModule, dtype: torch.dtype = torch.float32) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function evaluating `mod["main"]` (one tensor in, one tensor out) with torch ops.

    `dtype` is that of the constants (torch.float64 for a reference; pass inputs of it too).
    """
    func = mod["main"]
    consts: dict[relax.Expr, torch.Tensor] = {}  # keyed by the node (Python wrappers come and go)

    def value(expr, env):
        if isinstance(expr, relax.Var):
            return env[expr]
        if isinstance(expr, tvm.ir.expr.GenericConst):  # a tensor constant
            if expr not in consts:
                consts[expr] = torch.from_numpy(np.ascontiguousarray(expr.value.numpy())).to(dtype)
            return consts[expr]
        if isinstance(expr, relax.ShapeExpr):
            return [int(v) for v in expr.values]
        if isinstance(expr, tvm.ir.expr.Constant):  # a scalar (FloatImm, IntImm)
            return _scalar(expr)
        if isinstance(expr, relax.TupleGetItem):
            fields = value(expr.tuple_value, env)
            if not isinstance(fields, tuple):
                raise NotImplementedError(f"torch reference: cannot index a {type(fields).__name__}")
            return fields[int(expr.index)]
        if isinstance(expr, relax.Tuple):
            return tuple(value(f, env) for f in expr.fields)
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            name = expr.op.name
            if name not in _OPS:
                raise NotImplementedError(f"torch reference: no torch op for {name}")
            return _OPS[name](expr, *(value(a, env) for a in expr.args))
        raise NotImplementedError(f"torch reference: cannot evaluate {type(expr).__name__}")

    def forward(x: torch.Tensor) -> torch.Tensor:
        env: dict[relax.Var, object] = {func.params[0]: x}  # a tensor, shape, scalar or tuple per variable
        body = func.body
        for block in body.blocks:
            for binding in block.bindings:
                env[binding.var] = value(binding.value, env)
        out = value(body.body, env)
        if not isinstance(out, torch.Tensor):
            raise NotImplementedError(f"torch reference: main returns a {type(out).__name__}, not one tensor")
        return out

    return forward


class TorchModule(torch.nn.Module):
    """:func:`to_torch` as an nn.Module (what torch.onnx.export takes)."""

    def __init__(self, mod: tvm.IRModule):
        super().__init__()
        self._forward = to_torch(mod)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)
