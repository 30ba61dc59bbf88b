"""Backward primitives of :mod:`tvm_ext.ops`, with cuDNN's meaning (PyTorch's gradients).

The data gradient of a convolution is forward convolutions of dY on the same BRGEMM kernels
(``ops.conv2d``): one at stride 1, one per stride phase otherwise
(:mod:`tvm_ext.kernels.conv2d_backward_data`). The phases are written into dX by a strided
NumPy copy (dX's size once more): the kernels that write every s-th pixel themselves are still
to come (issue 33).

The weight gradient is LIBXSMM's batch-reduce X^T dY on the same microkernel, X read transposed
(:mod:`tvm_ext.kernels.conv2d_backward_weight`); groups are reduced group by group, and groups
of fewer than 8 channels (depthwise) tap by tap in NumPy (BLAS), with the reason logged.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence

import numpy as np
import tvm

from ..errors import UnsupportedError
from ..kernels import conv2d_backward_weight as _weight_grad
from ..kernels import layout as _layout
from ..kernels import pool2d_backward as _pool_backward
from ..kernels.common import USER_ALIGNMENT
from ..kernels.conv2d import Conv2dWorkload, plan_conv2d
from ..kernels.conv2d_backward_data import data_gradient_phases, phase_weight_func
from ..target import TargetLike, resolve_target, vector_isa
from .forward import (
    KERNEL_BYTES,
    aligned_empty,
    as_tvm,
    build_kernel,
    cached,
    check_array,
    check_conv_shapes,
    check_elements,
    check_ints,
    checked_pool_workload,
    conv2d,
    conv_options,
    run_kernel,
)

__all__ = ["conv2d_backward_data", "conv2d_backward_weight", "max_pool2d_backward"]

logger = logging.getLogger("tvm_ext.ops")

# Channels per group from which a grouped weight gradient runs group by group on the kernel;
# below, (depthwise: 1) a call per group costs more than NumPy's tap-by-tap reduction.
KERNEL_GROUP_CHANNELS = 8


def conv2d_backward_data(dy, w, x_shape: Sequence[int], *, stride: int | Sequence[int] = 1,
                         padding: int | str | Sequence[int] = 0, dilation: int | Sequence[int] = 1,
                         groups: int = 1, target: TargetLike = None) -> np.ndarray:
    """The gradient of ``conv2d(x, w, stride=..., padding=..., dilation=..., groups=...)`` with
    respect to x (of shape `x_shape`), given the output's gradient `dy` (cuDNN's
    `cudnnConvolutionBackwardData`, PyTorch's `conv2d` input gradient). Options as
    :func:`~tvm_ext.ops.conv2d`; raises ValueError naming the argument for shapes that do not
    belong together, before any compile."""
    dy = check_array("conv2d_backward_data dy", dy, 4)
    w = check_array("conv2d_backward_data weight", w, 4)
    x_shape = tuple(int(v) for v in x_shape)
    if len(x_shape) != 4:
        raise ValueError(f"conv2d_backward_data: x_shape must be (N, C, H, W), got {x_shape}")
    check_conv_shapes("conv2d_backward_data", x_shape, w.shape)
    stride, padding, dilation, groups = conv_options("conv2d_backward_data", w.shape, stride, padding, dilation,
                                                      groups)
    # validated on one image: a batch of none is an empty gradient, as conv2d's output is empty
    wl = Conv2dWorkload.make((1, *x_shape[1:]), w.shape, stride, padding, dilation, groups)
    out_shape = (x_shape[0], *wl.out_shape[1:])
    if dy.shape != out_shape:
        raise ValueError(f"conv2d_backward_data: dy has shape {dy.shape}, the convolution's output is {out_shape}")
    n, c = x_shape[:2]
    kg = w.shape[0] // groups
    if n == 0:
        return np.empty(x_shape, np.float32)
    phases = data_gradient_phases(wl)
    # the phases are written into it; at stride 1 the one convolution's output is dX itself
    dx = np.zeros(x_shape, np.float32) if len(phases) > 1 else None
    for phase in phases:
        if phase.zero:
            continue  # no tap reaches these pixels, or every tap reads past dY: their gradient is zero
        # W'[g*Cg + c, j, r, s] = W[g*Kg + j, c, taps_h[r], taps_w[s]]: channels swapped per group
        key = ("phase_weight", w.shape, groups, phase.taps_h, phase.taps_w)
        taps = run_kernel(key, lambda _, phase=phase: phase_weight_func(w.shape, groups, phase.taps_h, phase.taps_w),
                          target, [w], (c, kg, len(phase.taps_h), len(phase.taps_w)), USER_ALIGNMENT)
        part = conv2d(dy[:, :, phase.rows[0]:phase.rows[1], phase.cols[0]:phase.cols[1]], taps,
                      padding=phase.padding, dilation=phase.dilation, groups=groups, target=target)
        if dx is None:
            return part
        dx[:, :, phase.a::wl.stride[0], phase.b::wl.stride[1]] = part
    return np.zeros(x_shape, np.float32) if dx is None else dx  # stride 1, every tap past dY: zero


class _WeightGradKernel:
    """A compiled weight-gradient signature (groups=1): pack X (padded, blocked) and dY
    (blocked), the batch-reduce kernel (+ bias gradient), unpack dW to OIHW. Its blocked arrays
    are a workspace reused by every call, one call at a time."""

    def __init__(self, wl: Conv2dWorkload, target: tvm.target.Target, bias: bool):
        isa = vector_isa(target)
        self.plan = plan = _weight_grad.plan_conv2d_backward_weight(wl, isa, bias)
        for what, shape in (("data", plan.data_shape()), ("dy", plan.grad_out_shape()),
                            ("weight", plan.weight_shape())):
            check_elements(f"conv2d_backward_weight blocked {what}", shape)
        self.pack_x = build_kernel(_layout.pack_data_func(plan_conv2d(wl, isa)), target)
        self.pack_dy = build_kernel(_layout.pack_nchwc_func(wl.out_shape, plan.oc_bn, user_input=True,
                                                            pad_channels=wl.K % plan.oc_bn != 0), target)
        self.kernel = build_kernel(_weight_grad.conv2d_backward_weight_kernel(plan, isa.lanes), target)
        self.unpack = build_kernel(_weight_grad.unpack_weight_func(plan), target)
        self.x = as_tvm(aligned_empty(plan.data_shape()))
        self.dy = as_tvm(aligned_empty(plan.grad_out_shape()))
        self.dw = as_tvm(aligned_empty(plan.weight_shape()))
        self.db = as_tvm(aligned_empty((plan.OCB, plan.oc_bn))) if bias else None
        arrays = (self.x, self.dy, self.dw, *([] if self.db is None else [self.db]))
        self.nbytes = 4 * KERNEL_BYTES + sum(4 * math.prod(a.shape) for a in arrays)
        self.lock = threading.Lock()

    def __call__(self, x: np.ndarray, dy: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        wl = self.plan.wl
        dw = aligned_empty((wl.K, wl.C, wl.KH, wl.KW))
        with self.lock:
            self.pack_x(as_tvm(x, USER_ALIGNMENT), self.x)
            self.pack_dy(as_tvm(dy, USER_ALIGNMENT), self.dy)
            self.kernel(self.x, self.dy, self.dw, *([] if self.db is None else [self.db]))
            self.unpack(self.dw, as_tvm(dw))
            db = None if self.db is None else self.db.numpy().reshape(-1)[:wl.K].copy()
        return dw, db


def _weight_grad_kernel(x_shape, w_shape, bias: bool, stride, padding, dilation, target) -> _WeightGradKernel:
    resolved = resolve_target(target)
    key = ("conv2d_backward_weight", x_shape, w_shape, bias, stride, padding, dilation, str(resolved))
    return cached(key, lambda: _WeightGradKernel(
        Conv2dWorkload.make(x_shape, w_shape, stride, padding, dilation, 1), resolved, bias))


def _weight_grad_by_taps(x: np.ndarray, dy: np.ndarray, wl: Conv2dWorkload) -> np.ndarray:
    """dW of a grouped convolution, tap by tap: for each (r, s) a contraction over images and
    pixels of the input pixels that tap reads with dY, per group (BLAS through einsum)."""
    top, left, bottom, right = wl.padding
    xp = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
    (sh, sw), (dh, dw) = wl.stride, wl.dilation
    g, cg, kg = wl.groups, wl.C // wl.groups, wl.K // wl.groups
    dy_groups = dy.reshape(wl.N, g, kg, wl.OH, wl.OW)
    out = np.empty((g, kg, cg, wl.KH, wl.KW), np.float32)
    for r in range(wl.KH):
        for s in range(wl.KW):
            taps = xp[:, :, r * dh: r * dh + sh * (wl.OH - 1) + 1: sh, s * dw: s * dw + sw * (wl.OW - 1) + 1: sw]
            out[:, :, :, r, s] = np.einsum("ngchw,ngkhw->gkc", taps.reshape(wl.N, g, cg, wl.OH, wl.OW), dy_groups,
                                           optimize=True)
    return out.reshape(wl.K, cg, wl.KH, wl.KW)


def conv2d_backward_weight(x, dy, w_shape: Sequence[int], *, stride: int | Sequence[int] = 1,
                           padding: int | str | Sequence[int] = 0, dilation: int | Sequence[int] = 1,
                           groups: int = 1, bias: bool = False,
                           target: TargetLike = None) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """The gradient of ``conv2d(x, w, stride=..., padding=..., dilation=..., groups=...)`` with
    respect to w (of shape `w_shape`, OIHW), given the output's gradient `dy` (cuDNN's
    `cudnnConvolutionBackwardFilter`, PyTorch's `conv2d` weight gradient). With `bias`, also the
    bias gradient (cuDNN's `cudnnConvolutionBackwardBias`: dY summed over images and pixels),
    computed by the same kernel: returns (dW, dB). Options as :func:`~tvm_ext.ops.conv2d`; raises
    ValueError naming the argument for shapes that do not belong together, before any compile."""
    x = check_array("conv2d_backward_weight data", x, 4)
    dy = check_array("conv2d_backward_weight dy", dy, 4)
    w_shape = tuple(int(v) for v in w_shape)
    if len(w_shape) != 4:
        raise ValueError(f"conv2d_backward_weight: w_shape must be (K, C/groups, KH, KW), got {w_shape}")
    check_conv_shapes("conv2d_backward_weight", x.shape, w_shape)
    stride, padding, dilation, groups = conv_options("conv2d_backward_weight", w_shape, stride, padding, dilation,
                                                      groups)
    wl = Conv2dWorkload.make((max(x.shape[0], 1), *x.shape[1:]), w_shape, stride, padding, dilation, groups)
    out_shape = (x.shape[0], *wl.out_shape[1:])
    if dy.shape != out_shape:
        raise ValueError(f"conv2d_backward_weight: dy has shape {dy.shape}, the convolution's output is {out_shape}")
    kind = resolve_target(target).kind.name
    if kind != "llvm":
        raise UnsupportedError(f"conv2d_backward_weight: CPU (llvm) targets only, not {kind}")
    k, cg = w_shape[:2]
    db = None  # the kernel's (groups=1), or summed here
    if x.shape[0] == 0:  # no images: nothing to sum
        dw = np.zeros(w_shape, np.float32)
    elif groups == 1:
        dw, db = _weight_grad_kernel(x.shape, w_shape, bias, stride, padding, dilation, target)(x, dy)
    elif cg >= KERNEL_GROUP_CHANNELS and k // groups >= KERNEL_GROUP_CHANNELS:
        kg = k // groups
        dw = np.empty(w_shape, np.float32)
        kernel = _weight_grad_kernel((x.shape[0], cg, *x.shape[2:]), (kg, *w_shape[1:]), False, stride, padding,
                                     dilation, target)
        for g in range(groups):
            dw[g * kg:(g + 1) * kg] = kernel(np.ascontiguousarray(x[:, g * cg:(g + 1) * cg]),
                                             np.ascontiguousarray(dy[:, g * kg:(g + 1) * kg]))[0]
    else:
        logger.info("conv2d_backward_weight %s groups=%d: %d channels a group, reduced tap by tap in NumPy",
                    w_shape, groups, cg)
        dw = _weight_grad_by_taps(x, dy, wl)
    if not bias:
        return dw
    if db is None:
        db = dy.sum((0, 2, 3), dtype=np.float64).astype(np.float32)
    return dw, db


def max_pool2d_backward(dy, x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False, *,
                        target: TargetLike = None) -> np.ndarray:
    """The gradient of ``max_pool2d(x, ...)`` with respect to x, given its output's gradient `dy`
    (cuDNN's `cudnnPoolingBackward` for max pooling): each window's gradient goes to its first
    maximum (PyTorch's choice among ties), summed where windows overlap. Options as
    :func:`~tvm_ext.ops.max_pool2d`; a `dy` of another shape than the pooling's output raises
    ValueError."""
    dy = check_array("max_pool2d_backward dy", dy, 4)
    x = check_array("max_pool2d_backward data", x, 4)
    wl = checked_pool_workload("max_pool2d_backward", "max", x.shape, kernel_size, stride, padding, dilation,
                               ceil_mode)
    n, c = x.shape[:2]
    if dy.shape != (n, c, wl.OH, wl.OW):
        raise ValueError(f"max_pool2d_backward: dy has shape {dy.shape}, the pooling's output is "
                         f"{(n, c, wl.OH, wl.OW)}")
    if n == 0 or c == 0:
        return np.zeros(x.shape, np.float32)
    return run_kernel(("max_pool2d_backward", wl), lambda _: _pool_backward.max_pool2d_backward_func(wl), target,
                      [dy, x], x.shape)


def avg_pool2d_backward(dy, x_shape: Sequence[int], kernel_size, stride=None, padding=0, ceil_mode: bool = False,
                        count_include_pad: bool = True, *, target: TargetLike = None) -> np.ndarray:
    """The gradient of ``avg_pool2d(x, ...)`` with respect to x (of shape `x_shape`), given its
    output's gradient `dy` (cuDNN's `cudnnPoolingBackward` for average pooling): each window's
    gradient divided by the count its forward divided by, spread over its pixels, summed where
    windows overlap. Options as :func:`~tvm_ext.ops.avg_pool2d`; a `dy` of another shape than the
    pooling's output raises ValueError."""
    dy = check_array("avg_pool2d_backward dy", dy, 4)
    shape = check_ints("avg_pool2d_backward: x_shape", x_shape, (4,))
    if not isinstance(shape, tuple) or min(shape) < 0:
        raise ValueError(f"avg_pool2d_backward: x_shape must be 4 non-negative ints (N, C, H, W), got {x_shape!r}")
    x_shape = shape
    wl = checked_pool_workload("avg_pool2d_backward", "avg", x_shape, kernel_size, stride, padding, 1, ceil_mode,
                               count_include_pad)
    n, c, h, w = x_shape
    if dy.shape != (n, c, wl.OH, wl.OW):
        raise ValueError(f"avg_pool2d_backward: dy has shape {dy.shape}, the pooling's output is "
                         f"{(n, c, wl.OH, wl.OW)}")
    if n == 0 or c == 0:
        return np.zeros(x_shape, np.float32)
    # NCHW is the blocked layout with blocks of one channel: one task per (image, channel) plane
    out = run_kernel(("avg_pool2d_backward", wl), lambda _: _pool_backward.avg_pool2d_backward_blocked_func(wl, 1),
                     target, [dy.reshape(*dy.shape, 1)], (n, c, h, w, 1))
    return out.reshape(x_shape)

