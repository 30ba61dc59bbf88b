"""The forward primitives of :mod:`tvm_ext.ops`: NCHW data, OIHW weights, NCHW results.

Each call compiles its kernel once per signature (shapes, options, target) and reuses it, so a
network evaluated op by op pays compilation only on its first pass. Activations take the element
count at run time: one kernel per activation serves every tensor size.

The compiled signatures live in one cache, bounded by count and by bytes and emptied least
recently used first (:func:`set_cache_limit`, :func:`clear_cache`, :func:`cache_size`,
:func:`cache_bytes`): a process that sees many shapes (a server with dynamic sizes) would
otherwise keep every kernel and every convolution's workspace for good.
"""

from __future__ import annotations

import logging
import math
import operator
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TypedDict, TypeVar, cast

import numpy as np
import numpy.typing as npt
import tvm
import tvm_ffi

from ..errors import UnsupportedError
from ..kernels import conv2d as _conv
from ..kernels import conv2d_maxdnn as _maxdnn
from ..kernels import elementwise as _elementwise
from ..kernels import layout as _layout
from ..kernels import maxdnn_layout as _maxdnn_layout
from ..kernels import pool2d as _pool
from ..kernels import script as _script
from ..kernels.common import KERNEL_ATTR, STACK_BUFFER_CONFIG, USER_ALIGNMENT
from ..strategy.cpu_engine import check_maxdnn, maxdnn_decision, tile_out_block
from ..target import TargetLike, check_cpu_features, resolve_target, vector_isa

logger = logging.getLogger("tvm_ext")

# The kernels index their buffers with int32 (TVM's default for shapes that fit): a tensor of more
# elements fails mid-compile ("Literal value ... exceeds range of int32"), so it is refused first.
MAX_ELEMENTS = 2**31 - 1


def check_elements(what: str, shape: Sequence[int]) -> None:
    count = math.prod(int(v) for v in shape)
    if count > MAX_ELEMENTS:
        raise UnsupportedError(
            f"{what}: shape {tuple(int(v) for v in shape)} has {count} elements, more than the "
            f"{MAX_ELEMENTS} (2^31 - 1) the kernels can index (int32)")


def check_array(name: str, arr, ndim: int | None = None) -> np.ndarray:
    """`arr` as an array, checked (dtype, rank, size) before any copy: a huge broadcast view is
    refused without being materialized. Not made contiguous: :func:`_contiguous` does that."""
    arr = np.asarray(arr)
    if arr.dtype != np.float32:
        raise ValueError(f"{name}: dtype {arr.dtype} is not supported (float32 only)")
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array, got shape {arr.shape}")
    check_elements(name, arr.shape)
    return arr


def _contiguous(arr: np.ndarray) -> np.ndarray:
    """C-contiguous `arr`, keeping its rank (np.ascontiguousarray turns a 0-d array into 1-d)."""
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def _int(name: str, value) -> int:
    """An integer argument as a Python int: NumPy's integer scalars too (they are not `int`)."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None


def check_ints(name: str, value, lengths: tuple[int, ...]) -> int | tuple[int, ...]:
    """An integer, or a sequence of `lengths` integers (NumPy's included), as Python ints."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be an integer or a tuple of integers, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        pass
    try:
        items = tuple(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer or a tuple of integers, got {type(value).__name__} "
                        f"{value!r}") from None
    if len(items) not in lengths:
        counts = " or ".join(str(n) for n in lengths)
        raise ValueError(f"{name} must be an integer or {counts} integers, got {value!r}")
    return tuple(_int(name, v) for v in items)


def _pair(name: str, value) -> tuple[int, int]:
    v = check_ints(name, value, (2,))
    if isinstance(v, int):
        return v, v
    first, second = v  # check_ints checked: 2 of them
    return first, second


def conv_options(op: str, w_shape: Sequence[int], stride: int | Sequence[int], padding: int | str | Sequence[int],
                 dilation: int | Sequence[int],
                 groups: int) -> tuple[tuple[int, int], tuple[int, ...], tuple[int, int], int]:
    """(stride, (top, left, bottom, right), dilation, groups) as Python ints.

    padding may also be "valid" (none) or "same" (stride 1 only: the output has the input's
    size; an odd total padding puts the extra row and column at the bottom and right, as PyTorch).
    """
    if len(w_shape) != 4:
        raise ValueError(f"{op}: weight must be 4-D OIHW, got shape {tuple(w_shape)}")
    stride, dilation = _pair(f"{op}: stride", stride), _pair(f"{op}: dilation", dilation)
    groups = _int(f"{op}: groups", groups)
    if isinstance(padding, str):
        if padding == "valid":
            return stride, (0, 0, 0, 0), dilation, groups
        if padding != "same":
            raise ValueError(f"{op}: padding must be an int, (ph, pw), (top, left, bottom, right), 'same' or "
                             f"'valid', got {padding!r}")
        if stride != (1, 1):
            raise ValueError(f"{op}: padding='same' is not supported for strided convolutions (stride {stride}), "
                             "as in PyTorch; give the padding as numbers")
        th, tw = (d * (k - 1) for d, k in zip(dilation, w_shape[2:], strict=True))
        return stride, (th // 2, tw // 2, th - th // 2, tw - tw // 2), dilation, groups
    try:
        pads = check_ints(f"{op}: padding", padding, (2, 4))
    except ValueError:
        raise ValueError(f"{op}: padding must be an int, (ph, pw), (top, left, bottom, right), 'same' or "
                         f"'valid', got {padding!r}") from None
    if isinstance(pads, int):
        pads = (pads,) * 4
    elif len(pads) == 2:
        pads = (*pads, *pads)
    return stride, pads, dilation, groups


def check_conv_shapes(op: str, x_shape: Sequence[int] | None, w_shape: Sequence[int]) -> None:
    """Refuse the empty convolutions PyTorch refuses or answers inconsistently (zero input channels
    give it an output of zero channels, whatever the weights): only a batch of 0 images is one."""
    if x_shape is not None and min(x_shape[1:]) == 0:
        raise ValueError(f"{op}: data of shape {tuple(x_shape)} has no channels or an empty image "
                         "(only the batch may be 0)")
    if min(w_shape) == 0:
        raise ValueError(f"{op}: weight of shape {tuple(w_shape)} is empty (out channels, in channels per "
                         "group and kernel size must be at least 1)")


KERNEL_BYTES = 5 << 18  # what one compiled kernel counts as in cache_bytes(): 1.2 MB of RSS each, measured


class _KernelCache:
    """Compiled signatures, least recently used first, bounded by entries and by bytes.

    An entry is only referenced here and by the calls running it: one evicted while another
    thread runs it lives (its workspace too) until that call returns, and is freed then.
    """

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self._entries: OrderedDict[tuple, tuple[object, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.max_entries, self.max_bytes, self.nbytes = max_entries, max_bytes, 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple):
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: tuple, value: object, nbytes: int) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.nbytes -= old[1]
            self._entries[key] = (value, nbytes)
            self.nbytes += nbytes
            evicted = self._shrink()
        del old, evicted  # the last references go outside the lock: destructors run here, not under it

    def _shrink(self) -> list:
        """Drop the oldest entries until both limits hold (the newest stays even alone over them)."""
        evicted = []
        while len(self._entries) > 1 and (len(self._entries) > self.max_entries or self.nbytes > self.max_bytes):
            _, (value, nbytes) = self._entries.popitem(last=False)
            self.nbytes -= nbytes
            evicted.append(value)
        return evicted

    def set_limit(self, max_entries: int, max_bytes: int) -> None:
        with self._lock:
            self.max_entries, self.max_bytes = max_entries, max_bytes
            evicted = self._shrink()
        del evicted

    def clear(self) -> None:
        with self._lock:
            entries, self._entries, self.nbytes = self._entries, OrderedDict(), 0
        del entries


# 512 signatures (a network's layers several times over: the test suite's ~230 convolutions fit
# in one process) and 2 GiB, which ~500 small convolutions' kernels reach first.
_CACHE = _KernelCache(max_entries=512, max_bytes=2 << 30)
_KEY_LOCKS: dict[tuple, threading.Lock] = {}
_KEY_LOCKS_LOCK = threading.Lock()


_Made = TypeVar("_Made")


def _once(cache: _KernelCache, key: tuple, make: Callable[[], _Made]) -> _Made:
    """cache[key], made by `make()` when missing: once, when threads ask together (each key
    has a lock of its own, so different signatures still compile side by side).

    A key is only ever made by one `make` (each key names its kind of kernel), so what the cache
    holds under it is what `make` returns."""
    value = cast(_Made, cache.get(key))
    if value is not None:
        return value
    with _KEY_LOCKS_LOCK:
        lock = _KEY_LOCKS.setdefault((id(cache), key), threading.Lock())
    try:
        with lock:
            value = cast(_Made, cache.get(key))
            if value is None:
                value = make()
                cache.put(key, value, getattr(value, "nbytes", KERNEL_BYTES))
    finally:
        with _KEY_LOCKS_LOCK:  # made (or failed): later callers find the cache or start over
            _KEY_LOCKS.pop((id(cache), key), None)
    return value


def cached(key: tuple, make: Callable[[], _Made]) -> _Made:
    """What ops' bounded cache holds under `key` (a signature's compiled kernels and workspace),
    made once by `make()`; its `nbytes` attribute, if any, is what it counts as."""
    return _once(_CACHE, key, make)


def cache_size() -> int:
    """Number of signatures the eager API holds compiled (a convolution's packing and convolution
    kernels with their workspace are one; a pooling or an activation kernel is one)."""
    return len(_CACHE)


def cache_bytes() -> int:
    """Bytes the cache counts: workspaces exactly, each compiled kernel as its measured ~1.2 MB."""
    return _CACHE.nbytes


def set_cache_limit(max_entries: int | None = None, max_bytes: int | None = None) -> tuple[int, int]:
    """Bound the eager cache; returns the previous (max_entries, max_bytes). None keeps a limit.

    Past either limit the least recently used signatures are dropped (the newest always stays),
    and recompiled if asked for again: set the limits above a network's working set (its distinct
    layer signatures; its workspaces, the padded input of each convolution) or every pass
    recompiles. Defaults: 512 entries, 2 GiB. An entry that a running call uses is freed when the
    call returns.
    """
    previous = (_CACHE.max_entries, _CACHE.max_bytes)
    entries = previous[0] if max_entries is None else _int("set_cache_limit: max_entries", max_entries)
    nbytes = previous[1] if max_bytes is None else _int("set_cache_limit: max_bytes", max_bytes)
    if entries < 1 or nbytes < 0:
        raise ValueError(f"set_cache_limit: max_entries must be >= 1 and max_bytes >= 0, got {entries}, {nbytes}")
    _CACHE.set_limit(entries, nbytes)
    return previous


def clear_cache() -> None:
    """Drop every compiled signature and workspace (and the IR the kernels were generated from);
    the next calls compile again. Calls running meanwhile finish on what they hold."""
    _CACHE.clear()
    _conv.conv2d_blocked_func.cache_clear()
    _script.from_source.cache_clear()


def compile_kernel(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> tvm.runtime.Executable:
    """`func` compiled for `target`, its scratch buffers on the task's stack (STACK_BUFFER_CONFIG:
    a generated kernel declares each buffer where it lives)."""
    name = "tvm_ext_" + str(func.attrs[KERNEL_ATTR])  # te.create_prim_func says "main"
    mod = tvm.IRModule({name: func.with_attr("global_symbol", name)})
    check_cpu_features(mod, target)
    current = tvm.transform.PassContext.current()  # the caller's context, with the stack buffers' config
    with tvm.transform.PassContext(opt_level=current.opt_level, required_pass=list(current.required_pass),
                                   disabled_pass=list(current.disabled_pass), instruments=list(current.instruments),
                                   config={**current.config, **STACK_BUFFER_CONFIG}):
        return tvm.compile(mod, target)


def build_kernel(func: tvm.tirx.PrimFunc, target: tvm.target.Target):
    """`func` compiled for `target`; returns the callable function."""
    return compile_kernel(func, target)["tvm_ext_" + str(func.attrs[KERNEL_ATTR])]


def _target_key(target: TargetLike):
    return target if target is None or isinstance(target, str) else str(target)


def _kernel(key: tuple, make: Callable[[tvm.target.Target], tvm.tirx.PrimFunc], target: TargetLike):
    """The compiled `make(resolved target)`, once per (key, target)."""

    def build():
        resolved = resolve_target(target)
        return build_kernel(make(resolved), resolved)

    return _once(_CACHE, (key, _target_key(target)), build)


_ALIGN = 64  # TVM's DLPack import requires 64-byte aligned data


def aligned_empty(shape, dtype: npt.DTypeLike = np.float32) -> np.ndarray:
    """An uninitialized C-contiguous array whose data is 64-byte aligned."""
    shape = tuple(int(v) for v in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = (-raw.ctypes.data) % _ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def as_tvm(arr: np.ndarray, alignment: int = _ALIGN) -> tvm.runtime.Tensor:
    """Share `arr` with TVM without a copy when it is aligned; copy it into an aligned one if not.

    Kernels whose parameter accepts less (the packing stages: USER_ALIGNMENT) take NumPy's
    arrays as they are. A read-only array (np.frombuffer of bytes, a read-only memmap) is only
    ever a kernel's input: NumPy exports it as a DLPack 1.0 tensor flagged read-only, which TVM
    imports; the legacy export that from_dlpack asks for refuses it.
    """
    if arr.ctypes.data % alignment:
        aligned = aligned_empty(arr.shape, arr.dtype)
        aligned[...] = arr
        arr = aligned
    if not arr.flags.writeable:
        try:
            versioned = arr.__dlpack__(max_version=(1, 0))
        except (TypeError, BufferError):  # a NumPy before 2.1 has no versioned export: a copy
            copy = aligned_empty(arr.shape, arr.dtype)
            copy[...] = arr
            arr = copy
        else:
            return tvm_ffi.from_dlpack(versioned, require_alignment=alignment, require_contiguous=True)
    return tvm_ffi.from_dlpack(arr, require_alignment=alignment, require_contiguous=True)


def run_kernel(key: tuple, make, target, inputs: list[np.ndarray], out_shape,
               input_alignment: int = _ALIGN) -> np.ndarray:
    """`make(target)`'s kernel (compiled once per key and target) on NumPy `inputs`, writing a
    new array of `out_shape`. `input_alignment`: what the kernel declares of its inputs
    (USER_ALIGNMENT where it takes NumPy's arrays as they are; 64 bytes, TVM's default, copies
    a less aligned one)."""
    fn = _kernel(key, make, target)
    out = aligned_empty(out_shape)
    fn(*[as_tvm(_contiguous(a), input_alignment) for a in inputs], as_tvm(out))
    return out


def conv2d_plan(x_shape, w_shape, *, stride=1, padding=0, dilation=1, groups: int = 1,
                target: TargetLike = None, maxdnn: str = "auto") -> _conv.Conv2dPlan | _maxdnn.MaxDNNCpuPlan:
    """The plan `conv2d` uses for these arguments: the blocked kernel's (kind, blocking, register
    tile), or the maxDNN tile's where `maxdnn` lets it serve (:func:`conv2d`)."""
    check_maxdnn(maxdnn)
    stride, padding, dilation, groups = conv_options("conv2d", w_shape, stride, padding, dilation, groups)
    wl = _conv.Conv2dWorkload.make(x_shape, w_shape, stride, padding, dilation, groups)
    isa = vector_isa(target)
    plan = _conv.plan_conv2d(wl, isa)
    tile, why = maxdnn_decision(wl, isa, plan, None, True, maxdnn)
    if tile is not None:
        return tile
    if why:  # (maxdnn="always" where the tile cannot serve)
        logger.info("tvm_ext conv2d %s: %s", x_shape, why)
    if plan.kind == "direct":
        logger.warning("tvm_ext conv2d %s: fallback to the direct schedule: %s", x_shape, plan.reason)
    return plan


def _nbytes(shape: Sequence[int]) -> int:
    return 4 * math.prod(int(v) for v in shape)


class _Conv2dKernel:
    """A compiled conv2d signature: pack data, pack weights, blocked conv (+bias, NCHW write).

    The blocked data and weights are a workspace allocated once per signature and
    reused by every call (as cuDNN's workspace): allocating megabytes inside each call costs
    page faults that took longer than the packing itself. The kernels and the workspace are the
    signature's own, so evicting it from the cache frees them all. A plan that reads OIHW
    weights (`oihw_weight`) lays them out inside the convolution: no packing kernel, no weight
    workspace.
    """

    def __init__(self, plan: _conv.Conv2dPlan, target: tvm.target.Target, bias: bool):
        lanes = vector_isa(target).lanes
        epilogue = _conv.Epilogue(bias=bias, nchw_out=True)
        plan = _conv.reading_nchw(plan)  # the NCHW array as it is where the kernel can: no packing copy
        self.plan = plan
        self.pack_data = None if plan.nchw_in else build_kernel(_layout.pack_data_func(plan), target)
        self.pack_weight = None if plan.oihw_weight else build_kernel(_conv.pack_weight_func(plan), target)
        self.conv = build_kernel(_conv.conv2d_blocked_kernel(plan, lanes, epilogue), target)
        self.out_shape = plan.wl.out_shape
        self.data = None if plan.nchw_in else as_tvm(aligned_empty(plan.data_shape()))
        self.weight = None if plan.oihw_weight else as_tvm(aligned_empty(plan.weight_shape()))
        self.bias = as_tvm(np.zeros((plan.OCB, plan.oc_bn), np.float32)) if bias else None
        self.nbytes = ((2 + (self.pack_weight is not None)) * KERNEL_BYTES
                       + (0 if plan.nchw_in else _nbytes(plan.data_shape()))
                       + (0 if plan.oihw_weight else _nbytes(plan.weight_shape()))
                       + (_nbytes((plan.OCB, plan.oc_bn)) if bias else 0))
        self.lock = threading.Lock()  # the workspace belongs to one call at a time

    @property
    def layout(self) -> tuple:
        """What a packed weight's layout depends on (:class:`Conv2d` packs once per layout)."""
        return (self.plan.kind, self.plan.weight_shape())

    def packed_weight(self, w: np.ndarray) -> tvm.runtime.Tensor:
        """`w` in the kernel's blocked layout, in memory of its own (for :class:`Conv2d`)."""
        if self.pack_weight is None:
            raise ValueError("conv2d: this kernel reads OIHW weights; it has no packed layout")
        packed = as_tvm(aligned_empty(self.plan.weight_shape()))
        self.pack_weight(as_tvm(w, USER_ALIGNMENT), packed)
        return packed

    def blocked_bias(self, bias: np.ndarray) -> np.ndarray:
        blocked = np.zeros(self.plan.OCB * self.plan.oc_bn, np.float32)
        blocked[: bias.shape[0]] = bias
        return blocked.reshape(self.plan.OCB, self.plan.oc_bn)

    def __call__(self, x: np.ndarray, w: np.ndarray | tvm.runtime.Tensor, bias: np.ndarray | None) -> np.ndarray:
        """`w`: OIHW weights (packed here, or read by a kernel of OIHW weights), or weights
        :meth:`packed_weight` packed already."""
        out = aligned_empty(self.out_shape)
        with self.lock:
            data = as_tvm(x, USER_ALIGNMENT)
            if self.pack_data is not None:
                self.pack_data(data, self.data)
                data = self.data
            if isinstance(w, np.ndarray):
                w = as_tvm(w, USER_ALIGNMENT)
                if self.pack_weight is not None:
                    self.pack_weight(w, self.weight)
                    w = self.weight
            args = [data, w]
            if self.bias is not None:
                if bias is None:  # the kernel's signature has a bias (_conv_kernel's key says so)
                    raise ValueError("conv2d: this kernel adds a bias and none was given")
                self.bias.copyfrom(self.blocked_bias(bias))
                args.append(self.bias)
            self.conv(*args, as_tvm(out))
        return out


class _MaxDNNConv2dKernel:
    """A compiled conv2d signature on the maxDNN tile (:mod:`tvm_ext.kernels.conv2d_maxdnn`: the
    images in the vector lanes): the NCHW data into the tile's layout, the tile's kernel, its
    output back to channel blocks with the bias, then NCHW; the weights laid out by NumPy (once,
    by :class:`Conv2d`). The intermediate tensors are the signature's workspace, as
    :class:`_Conv2dKernel`'s."""

    def __init__(self, plan: _maxdnn.MaxDNNCpuPlan, blocked: _conv.Conv2dPlan, target: tvm.target.Target,
                 bias: bool):
        wl = self.wl = plan.wl
        self.plan = plan
        block = tile_out_block(blocked)
        blocked_shape = (wl.N, wl.K // block, wl.OH, wl.OW, block)
        self.tile_input = build_kernel(_maxdnn_layout.tile_input_func(plan, (wl.N, wl.C, wl.H, wl.W), None), target)
        self.conv = build_kernel(_maxdnn.maxdnn_conv2d_kernel(plan), target)
        self.tile_output = build_kernel(_maxdnn_layout.tile_output_func(plan, block, _maxdnn.Epilogue(bias=bias)),
                                        target)
        self.unpack = build_kernel(_layout.unpack_nchwc_func(blocked_shape, wl.K), target)
        self.data, self.sums, self.blocked = (as_tvm(aligned_empty(shape)) for shape in (
            plan.data_shape(), plan.out_shape(), blocked_shape))
        self.weight = as_tvm(aligned_empty(plan.weight_shape()))
        self.bias = as_tvm(np.zeros(wl.K, np.float32)) if bias else None
        self.nbytes = 4 * KERNEL_BYTES + sum(_nbytes(shape) for shape in (
            plan.data_shape(), plan.out_shape(), blocked_shape, plan.weight_shape())) + (4 * wl.K if bias else 0)
        self.lock = threading.Lock()

    @property
    def layout(self) -> tuple:
        return ("maxdnn", self.plan.weight_shape())

    def packed_weight(self, w: np.ndarray) -> tvm.runtime.Tensor:
        """`w` in the tile's layout (:meth:`MaxDNNCpuPlan.weight_shape`), in memory of its own."""
        return as_tvm(_maxdnn.pack_weight(self.plan, w))

    def __call__(self, x: np.ndarray, w: np.ndarray | tvm.runtime.Tensor, bias: np.ndarray | None) -> np.ndarray:
        out = aligned_empty(self.wl.out_shape)
        with self.lock:
            self.tile_input(as_tvm(x, USER_ALIGNMENT), self.data)
            if isinstance(w, np.ndarray):
                self.weight.copyfrom(_maxdnn.pack_weight(self.plan, w))
                w = self.weight
            self.conv(self.data, w, self.sums)
            if self.bias is not None:
                if bias is None:
                    raise ValueError("conv2d: this kernel adds a bias and none was given")
                self.bias.copyfrom(np.ascontiguousarray(bias, np.float32))
                self.tile_output(self.sums, self.bias, self.blocked)
            else:
                self.tile_output(self.sums, self.blocked)
            self.unpack(self.blocked, as_tvm(out))
        return out


def _empty_conv(x_shape, w_shape, stride, padding, dilation, groups) -> np.ndarray:
    """A batch of no images: PyTorch's empty (0, K, OH, OW) result, the shapes still validated."""
    wl = _conv.Conv2dWorkload.make((1, *x_shape[1:]), w_shape, stride, padding, dilation, groups)
    return np.empty((0, *wl.out_shape[1:]), np.float32)


def conv2d(x, w, bias=None, *, stride: int | Sequence[int] = 1, padding: int | str | Sequence[int] = 0,
           dilation: int | Sequence[int] = 1, groups: int = 1, target: TargetLike = None,
           maxdnn: str = "auto") -> np.ndarray:
    """2-D convolution (cross-correlation, as in PyTorch) of NCHW `x` with OIHW `w`.

    padding: int, (ph, pw), (top, left, bottom, right), "valid" or "same" (stride 1; PyTorch's
    split). Integers may be NumPy's. `maxdnn` (CPU targets), as `tvm_ext.build`'s: "auto" runs a
    layer on the maxDNN tile (images in the vector lanes) where the cost model expects it faster
    than the blocked kernel (large batches of small images), "always" wherever it can (not
    grouped), "never". Raises ValueError naming the problem for mismatched channels,
    negative padding, a kernel larger than the padded input, empty inputs other than a batch of 0
    (which gives an empty result), or a dtype other than float32; UnsupportedError for tensors of
    more than 2^31 - 1 elements. A repeated signature goes straight to its compiled kernel.
    """
    check_maxdnn(maxdnn)
    x = check_array("conv2d data", x, 4)
    w = check_array("conv2d weight", w, 4)
    if bias is not None:
        bias = check_array("conv2d bias", bias, 1)
        if bias.shape[0] != w.shape[0]:
            raise ValueError(f"conv2d: bias has {bias.shape[0]} entries for {w.shape[0]} output channels")
    check_conv_shapes("conv2d", x.shape, w.shape)
    stride, padding, dilation, groups = conv_options("conv2d", w.shape, stride, padding, dilation, groups)
    if x.shape[0] == 0:
        return _empty_conv(x.shape, w.shape, stride, padding, dilation, groups)
    if resolve_target(target).kind.name != "llvm":  # CPU kernels read the pixels they use in place (nchw_in)
        x, stride = _pointwise_subsample(x, w.shape, stride, padding)
    kernel = _conv_kernel(x.shape, w.shape, bias is not None, stride, padding, dilation, groups, target,
                          maxdnn=maxdnn)
    return kernel(_contiguous(x), _contiguous(w), None if bias is None else _contiguous(bias))


def _pointwise_subsample(x: np.ndarray, w_shape: Sequence[int], stride: tuple[int, int],
                         padding: tuple[int, ...]) -> tuple[np.ndarray, tuple[int, int]]:
    """A strided 1x1 convolution without padding reads every stride-th pixel only: (those pixels,
    stride 1), so a CUDA call copies a quarter of a stride-2 input to the device; otherwise (x,
    stride). (The CPU kernels read them in place: a NumPy copy of them cost more, 0.78 against
    0.84 ms on ResNet's 256x56x56 downsampling layer.)"""
    if tuple(w_shape[2:]) != (1, 1) or any(padding) or stride == (1, 1):
        return x, stride
    return x[:, :, ::stride[0], ::stride[1]], (1, 1)


def _runtime_threads() -> int:
    """The threads TVM's pool runs a parallel loop on (TVM_NUM_THREADS, else its default)."""
    return int(tvm.get_global_func("runtime.NumThreads")())


_CpuConv2dKernel = _Conv2dKernel | _MaxDNNConv2dKernel


def _conv_kernel(x_shape, w_shape, bias: bool, stride, padding, dilation, groups,
                 target, prepacked: bool = False, maxdnn: str = "auto") -> _CpuConv2dKernel | _CudaConv2dKernel:
    """The kernel of a signature whose options :func:`conv_options` normalized. `prepacked`:
    its calls bring weights :meth:`_Conv2dKernel.packed_weight` laid out (:class:`Conv2d`);
    otherwise OIHW weights, which large layers lay out inside the convolution."""
    key = ("conv2d", x_shape, w_shape, bias, stride, padding, dilation, groups, _target_key(target), prepacked,
           maxdnn)

    def make() -> _CpuConv2dKernel | _CudaConv2dKernel:
        resolved = resolve_target(target)
        wl = _conv.Conv2dWorkload.make(x_shape, w_shape, stride, padding, dilation, groups)
        check_elements("conv2d padded data", (wl.N, wl.C, wl.HP, wl.WP))
        check_elements("conv2d output", wl.out_shape)
        if resolved.kind.name == "cuda":
            return _CudaConv2dKernel(wl, resolved, bias)
        plan = conv2d_plan(x_shape, w_shape, stride=stride, padding=padding, dilation=dilation,
                           groups=groups, target=resolved, maxdnn=maxdnn)
        if isinstance(plan, _maxdnn.MaxDNNCpuPlan):
            for what, shape in (("data", plan.data_shape()), ("weight", plan.weight_shape()),
                                ("output", plan.out_shape())):
                check_elements(f"conv2d maxdnn tile {what}", shape)
            return _MaxDNNConv2dKernel(plan, _conv.plan_conv2d(wl, vector_isa(resolved)), resolved, bias)
        check_elements("conv2d blocked data", plan.data_shape())
        check_elements("conv2d blocked weight", plan.weight_shape())
        if not prepacked:
            plan = _conv.reading_oihw_weights(plan, _runtime_threads())
        return _Conv2dKernel(plan, resolved, bias)

    return _once(_CACHE, key, make)


class _CudaConv2dKernel:
    """The maxDNN kernel for one signature on this machine's GPU (NCHW in and out)."""

    def __init__(self, wl: _conv.Conv2dWorkload, target: tvm.target.Target, bias: bool):
        from ..kernels.cuda import maxdnn as cuda_conv
        from ..kernels.cuda.toolchain import build_for_device

        self.device = tvm.cuda(0)
        if not self.device.exist:
            raise RuntimeError(
                f"conv2d: target {target.kind.name} ({target.attrs.get('arch', '')}) needs an NVIDIA GPU and this "
                "machine has none; tvm_ext.testing.maxdnn.emulate runs the same kernel on the CPU")
        self.cuda_conv = cuda_conv
        self.plan = cuda_conv.MaxDNNPlan.make(wl, epilogue=cuda_conv.Epilogue(bias=bias))
        func = cuda_conv.maxdnn_conv2d_func(self.plan)
        self.fn = build_for_device(func, target)["main"]

    def __call__(self, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        arrays = self.cuda_conv.kernel_arrays(self.plan, x, w, bias)
        args = [tvm.runtime.tensor(arrays[name], self.device) for name in self.plan.shapes()]
        self.fn(*args)
        return self.cuda_conv.output_to_nchw(args[-1].numpy())


class _Conv2dOptions(TypedDict):
    """:class:`Conv2d`'s options, as :func:`conv_options` normalized them."""

    stride: tuple[int, int]
    padding: tuple[int, ...]
    dilation: tuple[int, int]
    groups: int
    target: TargetLike


class Conv2d:
    """A convolution whose weights are fixed: packed once, not on every call.

    `ops.conv2d` re-lays out its weights at each call, as a stateless API must (the caller may
    change them); this is the inference-time form (cuDNN keeps its filter in place the same way,
    and oneDNN calls it prepacking). Copy semantics: the weights are read when first packed.
    Options are as :func:`conv2d`'s (`maxdnn` too), checked here ("same" is resolved from the weights).
    """

    def __init__(self, weight, bias=None, *, stride=1, padding=0, dilation=1, groups: int = 1,
                 target: TargetLike = None, maxdnn: str = "auto"):
        check_maxdnn(maxdnn)
        self.maxdnn = maxdnn
        self.weight = check_array("Conv2d weight", weight, 4).copy()
        self.bias = None if bias is None else check_array("Conv2d bias", bias, 1).copy()
        if self.bias is not None and self.bias.shape[0] != self.weight.shape[0]:
            raise ValueError(f"Conv2d: bias has {self.bias.shape[0]} entries for {self.weight.shape[0]} channels")
        check_conv_shapes("Conv2d", None, self.weight.shape)
        if resolve_target(target).kind.name != "llvm":  # the CUDA kernel lays its weights out per call
            raise UnsupportedError(f"Conv2d: prepacked weights are for CPU (llvm) targets, not "
                                   f"{resolve_target(target).kind.name}; use ops.conv2d(..., target=...)")
        stride, padding, dilation, groups = conv_options("Conv2d", self.weight.shape, stride, padding, dilation,
                                                          groups)
        self.options = _Conv2dOptions(stride=stride, padding=padding, dilation=dilation, groups=groups,
                                      target=target)
        self._packed: dict[tuple, tvm.runtime.Tensor] = {}  # by input shape
        # ...one packing per blocked layout, which input shapes seldom change: not a copy per shape
        self._layouts: dict[tuple, tvm.runtime.Tensor] = {}

    def __call__(self, x) -> np.ndarray:
        x = check_array("Conv2d data", x, 4)
        check_conv_shapes("Conv2d", x.shape, self.weight.shape)
        if x.shape[0] == 0:
            return _empty_conv(x.shape, self.weight.shape,
                               **{k: v for k, v in self.options.items() if k != "target"})
        kernel = _conv_kernel(x.shape, self.weight.shape, self.bias is not None, **self.options, prepacked=True,
                              maxdnn=self.maxdnn)
        if not isinstance(kernel, (_Conv2dKernel, _MaxDNNConv2dKernel)):  # refused in __init__: only CPU kernels
            raise UnsupportedError(f"Conv2d: no prepacked kernel for target {self.options['target']!r}")
        packed = self._packed.get(x.shape)
        if packed is None:
            layout = kernel.layout
            packed = self._layouts.get(layout)
            if packed is None:
                packed = self._layouts[layout] = kernel.packed_weight(self.weight)
            self._packed[x.shape] = packed
        return kernel(_contiguous(x), packed, self.bias)


def checked_pool_workload(op: str, mode: str, shape: Sequence[int], kernel_size, stride, padding, dilation,
                          ceil_mode: bool, count_include_pad: bool = True) -> _pool.Pool2dWorkload:
    """The `mode` pooling of NCHW data of `shape` with these options, checked (ValueError naming
    `op`'s argument). A batch or channels of none: the workload of one image and channel (its
    windows and output size are the same)."""
    kernel_size = check_ints(f"{op}: kernel_size", kernel_size, (2,))
    stride = None if stride is None else check_ints(f"{op}: stride", stride, (2,))
    padding = check_ints(f"{op}: padding", padding, (2, 4))
    dilation = check_ints(f"{op}: dilation", dilation, (2,))
    N, C, H, W = shape
    if H == 0 or W == 0:
        raise ValueError(f"{op}: data of shape {tuple(shape)} has an empty {H}x{W} image")
    return _pool.Pool2dWorkload.make((N, C, H, W) if N and C else (1, 1, H, W), mode, kernel_size, stride, padding,
                                     dilation, ceil_mode, count_include_pad)


def _pool_op(mode: str, x, kernel_size, stride, padding, dilation, ceil_mode, count_include_pad, target):
    op = f"{mode}_pool2d"
    x = check_array(f"{op} data", x, 4)
    wl = checked_pool_workload(op, mode, x.shape, kernel_size, stride, padding, dilation, ceil_mode,
                               count_include_pad)
    N, C = x.shape[:2]
    if N == 0 or C == 0:  # no windows to reduce: an empty result of the right shape
        return np.empty((N, C, wl.OH, wl.OW), np.float32)
    check_elements(f"{op} output", (N, C, wl.OH, wl.OW))
    return run_kernel(("pool2d", wl), lambda _: _pool.pool2d_func(wl), target, [x], (N, C, wl.OH, wl.OW))


def max_pool2d(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False, *,
               target: TargetLike = None) -> np.ndarray:
    """Max pooling of NCHW `x` (PyTorch semantics; stride defaults to the kernel size)."""
    return _pool_op("max", x, kernel_size, stride, padding, dilation, ceil_mode, True, target)


def avg_pool2d(x, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
               count_include_pad: bool = True, *, target: TargetLike = None) -> np.ndarray:
    """Average pooling of NCHW `x` (PyTorch semantics)."""
    return _pool_op("avg", x, kernel_size, stride, padding, 1, ceil_mode, count_include_pad, target)


def global_avg_pool2d(x, *, target: TargetLike = None) -> np.ndarray:
    """Mean over H and W of NCHW `x`, keeping them as 1x1.

    An image of no pixels has no mean: ValueError (PyTorch answers NaN). No images or no
    channels give an empty (N, C, 1, 1) result.
    """
    x = check_array("global_avg_pool2d data", x, 4)
    shape = x.shape
    if shape[2] == 0 or shape[3] == 0:
        raise ValueError(f"global_avg_pool2d: data of shape {shape} has an empty {shape[2]}x{shape[3]} image, "
                         "which has no mean")
    if shape[0] == 0 or shape[1] == 0:
        return np.empty((shape[0], shape[1], 1, 1), np.float32)
    return run_kernel(("global_avg_pool2d", shape), lambda _: _pool.global_avg_pool2d_func(shape), target, [x],
                (shape[0], shape[1], 1, 1))


def _activation(name: str, x, target, alpha: float = 0.01) -> np.ndarray:
    """One kernel per activation (and slope) and target, whatever the shape: the tensor is a
    flat vector whose length the kernel takes at run time."""
    x = check_array(f"{name} data", x)
    if x.size == 0:
        return np.empty(x.shape, np.float32)
    key = ("activation", name, repr(alpha) if name == "leaky_relu" else None)  # repr: -0.0 != 0.0 in the kernel
    fn = _kernel(key, lambda t: _elementwise.dynamic_activation_func(name, "float32", vector_isa(t).lanes, alpha),
                 target)
    out = aligned_empty(x.shape)
    fn(as_tvm(_contiguous(x).reshape(-1)), as_tvm(out.reshape(-1)))
    return out


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


def hardsigmoid(x, *, target: TargetLike = None) -> np.ndarray:
    """clip(x + 3, 0, 6) / 6, elementwise (PyTorch's hardsigmoid)."""
    return _activation("hardsigmoid", x, target)


def hardswish(x, *, target: TargetLike = None) -> np.ndarray:
    """x * clip(x + 3, 0, 6) / 6, elementwise (PyTorch's hardswish, MobileNet-v3's activation)."""
    return _activation("hardswish", x, target)


def leaky_relu(x, negative_slope: float = 0.01, *, target: TargetLike = None) -> np.ndarray:
    """max(x, 0) + negative_slope * min(x, 0), elementwise.

    negative_slope must be a finite float32 (ValueError for NaN or an infinity, TypeError for a
    non-number: the slope is a constant of the compiled kernel).
    """
    return _activation("leaky_relu", x, target, _elementwise.check_slope(negative_slope))
