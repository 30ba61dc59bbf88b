"""Backward primitives of :mod:`tvm_ext.ops`, with cuDNN's meaning (PyTorch's gradients).

The data gradient of a convolution is a forward convolution of dY on the same BRGEMM kernels
(``ops.conv2d``), as oneDNN and LIBXSMM compute it, never a convolution of a dY with zeros
inserted (TOPI's `conv2d_transpose`: 75% of the multiply-adds on zeros at stride 2):

- stride 1: dX = conv2d(dY, W'), W' the weights with the filter flipped and the input and output
  channels of each group swapped, padded by dilation * (KH - 1) - padding;
- stride s: the s_h x s_w phases of dX (rows a, a + s_h, ...; columns likewise) each read only
  the filter taps r with (a + pad - r * dilation) divisible by s, at consecutive rows of dY: each
  phase is a dense stride-1 convolution of dY with those taps (dilation / gcd(dilation, s)),
  written into every s-th pixel of dX. Phases that no tap reaches are zero.

The phases are written into dX by a strided NumPy copy (dX's size once more): the kernels
that write every s-th pixel themselves are still to come (issue 33).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..kernels.conv2d import Conv2dWorkload
from ..target import TargetLike
from .forward import check_array, check_conv_shapes, conv2d, conv_options

__all__ = ["conv2d_backward_data"]


def _taps(phase: int, pad: int, kernel: int, dilation: int, stride: int) -> tuple[list[int], int, int]:
    """(filter taps, first offset into dY, dilation) of one phase along one axis: the taps r,
    ordered by the row of dY they read, (phase + pad - r * dilation) / stride, which grows by
    dilation / gcd(dilation, stride) from one tap to the next."""
    taps = [r for r in range(kernel) if (phase + pad - r * dilation) % stride == 0]
    taps.sort(key=lambda r: (phase + pad - r * dilation) // stride)
    first = (phase + pad - taps[0] * dilation) // stride if taps else 0
    return taps, first, dilation // math.gcd(dilation, stride)


def _window(outputs: int, first: int, taps: int, step: int, available: int) -> tuple[int, int, int, int]:
    """(rows of dY to skip, rows to keep, zero rows before, after) for a stride-1 convolution of
    `taps` taps `step` apart that makes `outputs` rows, output row i reading dY row i + first +
    j * step for tap j."""
    skip, before = max(first, 0), max(-first, 0)
    needed = outputs - 1 + (taps - 1) * step + 1 - before  # rows of dY from `skip` on
    keep = min(needed, available - skip)
    return skip, keep, before, needed - keep


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
    n, c, h, width = x_shape
    k, cg, kh, kw = w.shape
    kg = k // groups
    if n == 0:
        return np.empty(x_shape, np.float32)
    # W'[g*Cg + c, j, r, s] = W[g*Kg + j, c, r, s]: each group's channels in and out swapped
    swapped = w.reshape(groups, kg, cg, kh, kw).transpose(0, 2, 1, 3, 4).reshape(c, kg, kh, kw)
    (sh, sw), (dh, dw), (top, left, _, _) = stride, dilation, padding
    # the phases are written into it; at stride 1 the one convolution's output is dX itself
    dx = np.zeros(x_shape, np.float32) if (sh, sw) != (1, 1) else None
    for a in range(min(sh, h)):
        rows, first_row, step_h = _taps(a, top, kh, dh, sh)
        out_rows = -(-(h - a) // sh)
        for b in range(min(sw, width)):
            cols, first_col, step_w = _taps(b, left, kw, dw, sw)
            if not rows or not cols:
                continue  # no tap reaches these pixels: their gradient is zero
            out_cols = -(-(width - b) // sw)
            skip_h, keep_h, pad_top, pad_bottom = _window(out_rows, first_row, len(rows), step_h, dy.shape[2])
            skip_w, keep_w, pad_left, pad_right = _window(out_cols, first_col, len(cols), step_w, dy.shape[3])
            if keep_h <= 0 or keep_w <= 0:
                continue  # every tap reads past dY: zero
            taps = swapped[:, :, rows][:, :, :, cols]
            part = conv2d(dy[:, :, skip_h:skip_h + keep_h, skip_w:skip_w + keep_w], taps,
                          padding=(pad_top, pad_left, pad_bottom, pad_right), dilation=(step_h, step_w),
                          groups=groups, target=target)
            if dx is None:
                return part
            dx[:, :, a::sh, b::sw] = part
    return np.zeros(x_shape, np.float32) if dx is None else dx  # stride 1, every tap past dY: zero
