"""Filter taps that read only padding, dropped from a convolution: they multiply zeros.

DeepLabV3's atrous pyramid runs 3x3 convolutions dilated 12, 24 and 36 on a 14x14 (MobileNet)
or 28x28 (ResNet) feature map, padded as much: at dilation 24 and 36 every tap but the centre
reads the zero border for every output pixel, so the kernel did 9x the work of the 1x1
convolution it computes (three such layers were 14 of DeepLabV3-MobileNet's 26 ms). A video's
temporal taps do the same on short clips (:func:`used_taps`).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ..relax_info import constant_array, image_shape, static_shape
from .rewriting import rewriting_pass

__all__ = ["drop_padding_taps", "used_taps"]


def used_taps(size: int, out_size: int, taps: int, stride: int, dilation: int, before: int) -> list[int]:
    """The taps of one axis that read at least one element of the input (of `size`; the others
    read only its `before` and after padding, for every one of the `out_size` outputs)."""
    return [t for t in range(taps)
            if any(0 <= o * stride + t * dilation - before < size for o in range(out_size))]


def _axis_crop(size: int, out_size: int, taps: int, stride: int, dilation: int,
               before: int) -> tuple[int, int, int, int] | None:
    """(first tap, tap count, padding before, padding after) of the taps one axis keeps, or None
    where it keeps all of them or the kept ones are no contiguous run with a padding >= 0."""
    used = used_taps(size, out_size, taps, stride, dilation, before)
    if not used or len(used) == taps or used != list(range(used[0], used[-1] + 1)):
        return None
    first, count = used[0], len(used)
    pad_before = before - first * dilation
    pad_after = (out_size - 1) * stride + dilation * (count - 1) + 1 - size - pad_before
    if pad_before < 0 or pad_after < 0:
        return None
    return first, count, pad_before, pad_after


def drop_padding_taps() -> tvm.transform.Pass:
    """conv2d(x, W) of a constant W, NCHW / OIHW, whose filter rows or columns read only padding
    for every output pixel  ==>  conv2d(x, W cropped to the rest) with the padding that keeps
    each output where it was: the same sums, without the zero products (the rewrite is left out
    where W holds an inf or NaN, whose product with zero is NaN)."""
    from tvm.relax.dpl import is_const, is_op, wildcard

    pattern = is_op("relax.nn.conv2d")(wildcard(), is_const())

    def rewriter(orig: relax.Expr, _matched: dict) -> relax.Expr:
        if not isinstance(orig, relax.Call):
            return orig
        attrs = orig.attrs
        layouts = (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout))
        x_shape, out_shape, w_shape = image_shape(orig.args[0]), image_shape(orig), static_shape(orig.args[1])
        if layouts != ("NCHW", "OIHW", "NCHW") or x_shape is None or out_shape is None or w_shape is None:
            return orig
        strides, dilation = [int(v) for v in attrs.strides], [int(v) for v in attrs.dilation]
        top, left, bottom, right = (int(v) for v in attrs.padding)
        rows = _axis_crop(x_shape[2], out_shape[2], w_shape[2], strides[0], dilation[0], top)
        cols = _axis_crop(x_shape[3], out_shape[3], w_shape[3], strides[1], dilation[1], left)
        if rows is None and cols is None:  # (decided from shapes: most filters are not read out)
            return orig
        w = constant_array(orig.args[1])
        if w is None or not np.isfinite(w).all():
            return orig
        r0, rn, top, bottom = rows or (0, w_shape[2], top, bottom)
        c0, cn, left, right = cols or (0, w_shape[3], left, right)
        kept = w[:, :, r0:r0 + rn, c0:c0 + cn]
        out_dtype = str(attrs.out_dtype)
        return relax.op.nn.conv2d(orig.args[0], relax.const(np.ascontiguousarray(kept)), strides,
                                  (top, left, bottom, right), dilation, int(attrs.groups),
                                  out_dtype=None if out_dtype in ("", "void", "None") else out_dtype)

    return rewriting_pass("tvm_ext.DropPaddingTaps", pattern, rewriter)

