"""cuDNN-like eager primitives on NumPy arrays: NCHW data, OIHW weights, NCHW results.

Each call compiles its kernel once per signature (shapes, options, target) and reuses it, so a
network evaluated op by op pays compilation only on its first pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import tvm

from .kernels import conv2d as _conv
from .kernels import elementwise as _elementwise
from .kernels import pool2d as _pool
from .target import TargetLike, resolve_target, vector_isa

logger = logging.getLogger("tvm_ext")


def _check_array(name: str, arr, ndim: int | None = None) -> np.ndarray:
    arr = np.asarray(arr)
    if arr.dtype != np.float32:
        raise ValueError(f"{name}: dtype {arr.dtype} is not supported (float32 only)")
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array, got shape {arr.shape}")
    return np.ascontiguousarray(arr)


_CACHE: dict[tuple, tvm.runtime.Module] = {}


def _compiled(key: tuple, make: Callable[[], tvm.tirx.PrimFunc], target: tvm.target.Target):
    """Compile `make()` for `target` once per key; returns the callable function."""
    full_key = (key, str(target))
    if full_key not in _CACHE:
        func = make()
        name = "tvm_ext_" + str(func.attrs[_conv.KERNEL_ATTR])
        mod = tvm.IRModule({name: func.with_attr("global_symbol", name)})
        _CACHE[full_key] = tvm.compile(mod, target)[name]
    return _CACHE[full_key]


def cache_size() -> int:
    """Number of compiled kernels the eager API holds."""
    return len(_CACHE)


def _run(key: tuple, make, target, inputs: list[np.ndarray], out_shape) -> np.ndarray:
    target = resolve_target(target)
    fn = _compiled(key, make, target)
    dev = tvm.cpu()
    out = tvm.runtime.empty(tuple(int(v) for v in out_shape), "float32", dev)
    fn(*[tvm.runtime.tensor(a, dev) for a in inputs], out)
    return out.numpy()


def conv2d_plan(x_shape, w_shape, *, stride=1, padding=0, dilation=1, groups: int = 1,
                target: TargetLike = None) -> _conv.Conv2dPlan:
    """The plan (kernel kind, blocking, register tile) `conv2d` uses for these arguments."""
    wl = _conv.Conv2dWorkload.make(x_shape, w_shape, stride, padding, dilation, groups)
    plan = _conv.plan_conv2d(wl, vector_isa(target))
    if plan.kind == "direct":
        logger.warning("tvm_ext conv2d %s: fallback to the direct schedule: %s", x_shape, plan.reason)
    return plan


def conv2d(x, w, bias=None, *, stride=1, padding=0, dilation=1, groups: int = 1,
           target: TargetLike = None) -> np.ndarray:
    """2-D convolution (cross-correlation, as in PyTorch) of NCHW `x` with OIHW `w`.

    padding: int, (ph, pw) or (top, left, bottom, right). Raises ValueError naming the problem
    for mismatched channels, negative padding, a kernel larger than the padded input, or a dtype
    other than float32.
    """
    x = _check_array("conv2d data", x, 4)
    w = _check_array("conv2d weight", w, 4)
    if bias is not None:
        bias = _check_array("conv2d bias", bias, 1)
        if bias.shape[0] != w.shape[0]:
            raise ValueError(f"conv2d: bias has {bias.shape[0]} entries for {w.shape[0]} output channels")
    target = resolve_target(target)
    plan = conv2d_plan(x.shape, w.shape, stride=stride, padding=padding, dilation=dilation,
                       groups=groups, target=target)
    lanes = vector_isa(target).lanes
    key = ("conv2d", plan, bias is not None)
    inputs = [x, w] + ([bias] if bias is not None else [])
    out_shape = (plan.wl.N, plan.wl.K, plan.wl.OH, plan.wl.OW)
    return _run(key, lambda: _conv.conv2d_nchw_func(plan, lanes, bias is not None), target, inputs, out_shape)


def _pool_op(mode: str, x, kernel_size, stride, padding, dilation, ceil_mode, count_include_pad, target):
    x = _check_array(f"{mode}_pool2d data", x, 4)
    wl = _pool.Pool2dWorkload.make(x.shape, mode, kernel_size, stride, padding, dilation, ceil_mode,
                                   count_include_pad)
    return _run(("pool2d", wl), lambda: _pool.pool2d_func(wl), target, [x], (wl.N, wl.C, wl.OH, wl.OW))


def max_pool2d(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False, *,
               target: TargetLike = None) -> np.ndarray:
    """Max pooling of NCHW `x` (PyTorch semantics; stride defaults to the kernel size)."""
    return _pool_op("max", x, kernel_size, stride, padding, dilation, ceil_mode, True, target)


def avg_pool2d(x, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
               count_include_pad: bool = True, *, target: TargetLike = None) -> np.ndarray:
    """Average pooling of NCHW `x` (PyTorch semantics)."""
    return _pool_op("avg", x, kernel_size, stride, padding, 1, ceil_mode, count_include_pad, target)


def global_avg_pool2d(x, *, target: TargetLike = None) -> np.ndarray:
    """Mean over H and W of NCHW `x`, keeping them as 1x1."""
    x = _check_array("global_avg_pool2d data", x, 4)
    shape = x.shape
    return _run(("global_avg_pool2d", shape), lambda: _pool.global_avg_pool2d_func(shape), target, [x],
                (shape[0], shape[1], 1, 1))


def _activation(name: str, x, target) -> np.ndarray:
    x = _check_array(name, x)
    lanes = vector_isa(target).lanes
    flat = x.reshape(-1)
    out = _run((name, x.size), lambda: _elementwise.activation_func(name, x.shape, "float32", lanes),
               target, [flat], (x.size,))
    return out.reshape(x.shape)


def relu(x, *, target: TargetLike = None) -> np.ndarray:
    """max(x, 0), elementwise."""
    return _activation("relu", x, target)


def relu6(x, *, target: TargetLike = None) -> np.ndarray:
    """min(max(x, 0), 6), elementwise."""
    return _activation("relu6", x, target)


def sigmoid(x, *, target: TargetLike = None) -> np.ndarray:
    """1 / (1 + exp(-x)), elementwise."""
    return _activation("sigmoid", x, target)
