"""cuDNN-like eager primitives on NumPy arrays: NCHW data, OIHW weights, NCHW results.

Each call compiles its kernel once per signature (shapes, options, target) and reuses it, so a
network evaluated op by op pays compilation only on its first pass.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np
import tvm
import tvm_ffi

from .kernels import conv2d as _conv
from .kernels import elementwise as _elementwise
from .kernels import layout as _layout
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
_KEY_LOCKS: dict[tuple, threading.Lock] = {}
_KEY_LOCKS_LOCK = threading.Lock()


def _once(cache: dict, key: tuple, make: Callable[[], object]):
    """cache[key], made by `make()` the first time: once, when threads ask together (each key
    has a lock of its own, so different signatures still compile side by side)."""
    value = cache.get(key)
    if value is not None:
        return value
    with _KEY_LOCKS_LOCK:
        lock = _KEY_LOCKS.setdefault((id(cache), key), threading.Lock())
    try:
        with lock:
            value = cache.get(key)
            if value is None:
                value = cache[key] = make()
    finally:
        with _KEY_LOCKS_LOCK:  # made (or failed): later callers find the cache or start over
            _KEY_LOCKS.pop((id(cache), key), None)
    return value


def _compiled(key: tuple, make: Callable[[], tvm.tirx.PrimFunc], target: tvm.target.Target):
    """Compile `make()` for `target` once per key; returns the callable function."""

    def compile_() -> tvm.runtime.Module:
        func = make()
        name = "tvm_ext_" + str(func.attrs[_conv.KERNEL_ATTR])  # te.create_prim_func says "main"
        mod = tvm.IRModule({name: func.with_attr("global_symbol", name)})
        return tvm.compile(mod, target)[name]

    return _once(_CACHE, (key, str(target)), compile_)


def cache_size() -> int:
    """Number of compiled kernels the eager API holds."""
    return len(_CACHE)


_ALIGN = 64  # TVM's DLPack import requires 64-byte aligned data


def aligned_empty(shape, dtype=np.float32) -> np.ndarray:
    """An uninitialized C-contiguous array whose data is 64-byte aligned."""
    shape = tuple(int(v) for v in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = (-raw.ctypes.data) % _ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _as_tvm(arr: np.ndarray, alignment: int = _ALIGN) -> tvm.runtime.Tensor:
    """Share `arr` with TVM without a copy when it is aligned; copy it into an aligned one if not.

    Kernels whose parameter accepts less (the packing stages: USER_ALIGNMENT) take NumPy's
    arrays as they are.
    """
    if arr.ctypes.data % alignment:
        aligned = aligned_empty(arr.shape, arr.dtype)
        aligned[...] = arr
        arr = aligned
    return tvm_ffi.from_dlpack(arr, require_alignment=alignment, require_contiguous=True)


def _run(key: tuple, make, target, inputs: list[np.ndarray], out_shape) -> np.ndarray:
    target = resolve_target(target)
    fn = _compiled(key, make, target)
    out = aligned_empty(out_shape)
    fn(*[_as_tvm(a) for a in inputs], _as_tvm(out))
    return out


def conv2d_plan(x_shape, w_shape, *, stride=1, padding=0, dilation=1, groups: int = 1,
                target: TargetLike = None) -> _conv.Conv2dPlan:
    """The plan (kernel kind, blocking, register tile) `conv2d` uses for these arguments."""
    wl = _conv.Conv2dWorkload.make(x_shape, w_shape, stride, padding, dilation, groups)
    plan = _conv.plan_conv2d(wl, vector_isa(target))
    if plan.kind == "direct":
        logger.warning("tvm_ext conv2d %s: fallback to the direct schedule: %s", x_shape, plan.reason)
    return plan


class _Conv2dKernel:
    """A compiled conv2d signature: pack data, pack weights, blocked conv (+bias, NCHW write).

    The blocked data and weights are a workspace allocated once per signature and
    reused by every call (as cuDNN's workspace): allocating megabytes inside each call costs
    page faults that took longer than the packing itself.
    """

    def __init__(self, plan: _conv.Conv2dPlan, target: tvm.target.Target, bias: bool):
        lanes = vector_isa(target).lanes
        epilogue = _conv.Epilogue(bias=bias, nchw_out=True)
        self.plan = plan
        self.pack_data = _compiled(("pack_data", plan), lambda: _layout.pack_data_func(plan), target)
        self.pack_weight = _compiled(("pack_weight", plan), lambda: _conv.pack_weight_func(plan), target)
        self.conv = _compiled(("conv2d", plan, epilogue),
                              lambda: _conv.conv2d_blocked_kernel(plan, lanes, epilogue), target)
        self.out_shape = plan.wl.out_shape
        self.data = _as_tvm(aligned_empty(plan.data_shape()))
        self.weight = _as_tvm(aligned_empty(plan.weight_shape()))
        self.bias = _as_tvm(np.zeros((plan.OCB, plan.oc_bn), np.float32)) if bias else None
        self.lock = threading.Lock()  # the workspace belongs to one call at a time

    def packed_weight(self, w: np.ndarray) -> tvm.runtime.Tensor:
        """`w` in the kernel's blocked layout, in memory of its own (for :class:`Conv2d`)."""
        packed = _as_tvm(aligned_empty(self.plan.weight_shape()))
        self.pack_weight(_as_tvm(w, _conv.USER_ALIGNMENT), packed)
        return packed

    def blocked_bias(self, bias: np.ndarray) -> np.ndarray:
        blocked = np.zeros(self.plan.OCB * self.plan.oc_bn, np.float32)
        blocked[: bias.shape[0]] = bias
        return blocked.reshape(self.plan.OCB, self.plan.oc_bn)

    def __call__(self, x: np.ndarray, w: np.ndarray | tvm.runtime.Tensor, bias: np.ndarray | None) -> np.ndarray:
        """`w`: OIHW weights (packed here), or weights :meth:`packed_weight` packed already."""
        out = aligned_empty(self.out_shape)
        with self.lock:
            self.pack_data(_as_tvm(x, _conv.USER_ALIGNMENT), self.data)
            if isinstance(w, np.ndarray):
                self.pack_weight(_as_tvm(w, _conv.USER_ALIGNMENT), self.weight)
                w = self.weight
            args = [self.data, w]
            if self.bias is not None:
                self.bias.copyfrom(self.blocked_bias(bias))
                args.append(self.bias)
            self.conv(*args, _as_tvm(out))
        return out


_CONV_KERNELS: dict[tuple, _Conv2dKernel] = {}


def _target_key(target: TargetLike):
    return target if target is None or isinstance(target, str) else str(target)


def conv2d(x, w, bias=None, *, stride=1, padding=0, dilation=1, groups: int = 1,
           target: TargetLike = None) -> np.ndarray:
    """2-D convolution (cross-correlation, as in PyTorch) of NCHW `x` with OIHW `w`.

    padding: int, (ph, pw) or (top, left, bottom, right). Raises ValueError naming the problem
    for mismatched channels, negative padding, a kernel larger than the padded input, or a dtype
    other than float32. A repeated signature goes straight to its compiled kernel.
    """
    x = _check_array("conv2d data", x, 4)
    w = _check_array("conv2d weight", w, 4)
    if bias is not None:
        bias = _check_array("conv2d bias", bias, 1)
        if bias.shape[0] != w.shape[0]:
            raise ValueError(f"conv2d: bias has {bias.shape[0]} entries for {w.shape[0]} output channels")
    kernel = _conv_kernel(x.shape, w.shape, bias is not None, stride, padding, dilation, groups, target)
    return kernel(x, w, bias)


def _conv_kernel(x_shape, w_shape, bias: bool, stride, padding, dilation, groups, target) -> _Conv2dKernel:
    key = (x_shape, w_shape, bias, str(stride), str(padding), str(dilation), groups, _target_key(target))

    def make() -> _Conv2dKernel:
        resolved = resolve_target(target)
        if resolved.kind.name == "cuda":
            wl = _conv.Conv2dWorkload.make(x_shape, w_shape, stride, padding, dilation, groups)
            return _CudaConv2dKernel(wl, resolved, bias)
        plan = conv2d_plan(x_shape, w_shape, stride=stride, padding=padding, dilation=dilation,
                           groups=groups, target=resolved)
        return _Conv2dKernel(plan, resolved, bias)

    return _once(_CONV_KERNELS, key, make)


class _CudaConv2dKernel:
    """The maxDNN kernel for one signature on this machine's GPU (NCHW in and out)."""

    def __init__(self, wl: _conv.Conv2dWorkload, target: tvm.target.Target, bias: bool):
        from .kernels.cuda import conv2d as cuda_conv
        from .kernels.cuda.ptx import build_for_device

        self.device = tvm.cuda(0)
        if not self.device.exist:
            raise RuntimeError(
                f"conv2d: target {target.kind.name} ({target.attrs.get('arch', '')}) needs an NVIDIA GPU and this "
                "machine has none; tvm_ext.kernels.cuda.conv2d.emulate runs the same kernel on the CPU")
        self.cuda_conv = cuda_conv
        self.plan = cuda_conv.MaxDNNPlan.make(wl, epilogue=cuda_conv.Epilogue(bias=bias))
        func = cuda_conv.maxdnn_conv2d_func(self.plan)
        self.fn = build_for_device(func, target)["main"]

    def __call__(self, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        arrays = self.cuda_conv.kernel_arrays(self.plan, x, w, bias)
        args = [tvm.runtime.tensor(arrays[name], self.device) for name in self.plan.shapes()]
        self.fn(*args)
        return self.cuda_conv.output_to_nchw(args[-1].numpy())


class Conv2d:
    """A convolution whose weights are fixed: packed once per input shape, not on every call.

    `ops.conv2d` re-lays out its weights at each call, as a stateless API must (the caller may
    change them); this is the inference-time form (cuDNN keeps its filter in place the same way,
    and oneDNN calls it prepacking). Copy semantics: the weights are read when first packed.
    """

    def __init__(self, weight, bias=None, *, stride=1, padding=0, dilation=1, groups: int = 1,
                 target: TargetLike = None):
        self.weight = _check_array("Conv2d weight", weight, 4).copy()
        self.bias = None if bias is None else _check_array("Conv2d bias", bias, 1).copy()
        if self.bias is not None and self.bias.shape[0] != self.weight.shape[0]:
            raise ValueError(f"Conv2d: bias has {self.bias.shape[0]} entries for {self.weight.shape[0]} channels")
        self.options = dict(stride=stride, padding=padding, dilation=dilation, groups=groups, target=target)
        self._packed: dict[tuple, tvm.runtime.Tensor] = {}

    def __call__(self, x) -> np.ndarray:
        x = _check_array("Conv2d data", x, 4)
        kernel = _conv_kernel(x.shape, self.weight.shape, self.bias is not None, **self.options)
        packed = self._packed.get(x.shape)
        if packed is None:
            packed = self._packed[x.shape] = kernel.packed_weight(self.weight)
        return kernel(x, packed, self.bias)


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


def _activation(name: str, x, target, alpha: float = 0.01) -> np.ndarray:
    x = _check_array(name, x)
    lanes = vector_isa(target).lanes
    flat = x.reshape(-1)
    out = _run((name, x.size, alpha), lambda: _elementwise.activation_func(name, (x.size,), "float32", lanes, alpha),
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


def silu(x, *, target: TargetLike = None) -> np.ndarray:
    """x * sigmoid(x), elementwise."""
    return _activation("silu", x, target)


def gelu(x, *, target: TargetLike = None) -> np.ndarray:
    """x * (1 + erf(x / sqrt(2))) / 2 (the exact GELU), elementwise."""
    return _activation("gelu", x, target)


def leaky_relu(x, negative_slope: float = 0.01, *, target: TargetLike = None) -> np.ndarray:
    """max(x, 0) + negative_slope * min(x, 0), elementwise."""
    return _activation("leaky_relu", x, target, negative_slope)
