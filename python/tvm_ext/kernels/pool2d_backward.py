"""The gradient of max pooling (NCHW): each window's gradient goes to its maximum, as PyTorch
picks it (the first maximum in row-major order, a NaN taking precedence, the window's first
valid pixel if all are -inf), summed where windows overlap.

One task per (image, channel) plane: a plane's windows write only its own pixels, so tasks never
race, and the overlapping windows of a plane are walked in order. TVM's legalized gradient
recomputes each window's argmax for every input pixel (4 windows per pixel for ResNet's 3x3
stride-2 stem pooling): 18 ms of a 149 ms ResNet-18 training step at batch 4.

Blocked (N, C/c, H, W, c), the c channels of a pixel are one vector: each lane keeps its own
window maximum and its tap (compare and select, PyTorch's rule per lane), then every tap adds
dY where it is its lane's maximum. A graph also fuses relu's gradient of the pooling's input
(where(x > 0, dX, 0), :func:`max_pool2d_backward_blocked_func` `relu_mask`): dX[p] only sums dY
of windows whose maximum is x[p], so it is kept where that maximum is > 0.

Average pooling's gradient (:func:`avg_pool2d_backward_blocked_func`) spreads each window's dY
over its taps, divided by the window's count as the forward divided (padding counted or not).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from .common import KERNEL_ATTR, param_buffer
from .pool2d import Pool2dWorkload

__all__ = ["avg_pool2d_backward_blocked_func", "max_pool2d_backward_blocked_func", "max_pool2d_backward_func",
           "window_count"]


def max_pool2d_backward_func(wl: Pool2dWorkload) -> tirx.PrimFunc:
    """dX (N, C, H, W) of the max pooling `wl`, from dY (N, C, OH, OW) and its input X."""
    if wl.mode != "max":
        raise ValueError(f"max_pool2d_backward: a {wl.mode} pooling")
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    top, left = wl.padding[0], wl.padding[1]
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("max_pool2d_backward")
        T.func_attr({"tirx.noalias": True, KERNEL_ATTR: "max_pool2d_backward"})
        dy = param_buffer("dy", (wl.N, wl.C, wl.OH, wl.OW))
        x = param_buffer("x", (wl.N, wl.C, wl.H, wl.W))
        dx = param_buffer("dx", (wl.N, wl.C, wl.H, wl.W))
        dx_plane = IRBuilder.name("dX_planes", T.decl_buffer((wl.N, wl.C, wl.H * wl.W), "float32", data=dx.data))
        with T.sblock("root"), T.parallel(0, wl.N * wl.C) as plane:
            n, c = T.Bind(plane // wl.C), T.Bind(plane % wl.C)
            best = IRBuilder.name("best", T.alloc_buffer((1,), "float32"))
            at = IRBuilder.name("at", T.alloc_buffer((1,), "int32"))
            with T.serial(0, wl.H * wl.W) as p:
                T.buffer_store(dx_plane, T.float32(0), [n, c, p])
            with T.grid(wl.OH, wl.OW) as (oh, ow):
                T.buffer_store(at, T.int32(-1), [0])
                with T.grid(kh, kw) as (i, j):
                    h = T.Bind(oh * sh - top + i * dh)
                    w = T.Bind(ow * sw - left + j * dw)
                    with T.If(tirx.all(h >= 0, h < wl.H, w >= 0, w < wl.W)), T.Then():
                        value = T.Bind(x[n, c, h, w])
                        with T.If(tirx.any(at[0] < 0, value > best[0], tirx.isnan(value))), T.Then():
                            T.buffer_store(best, value, [0])
                            T.buffer_store(at, h * wl.W + w, [0])
                with T.If(at[0] >= 0), T.Then():
                    T.buffer_store(dx_plane, dx_plane[n, c, at[0]] + dy[n, c, oh, ow], [n, c, at[0]])
    return builder.get()


@contextlib.contextmanager
def _blocked_gradient(wl: Pool2dWorkload, block: int, mode: str) -> Iterator[tuple]:
    """The frame both blocked pooling gradients share: parameters dY, [X (max),] dX, in blocks of
    `block` channels, and one parallel task per block of an image, its dX block zeroed first.
    Yields (builder, dy, x or None, dx, n, b) inside the task."""
    if wl.mode != mode or wl.C % block:
        raise ValueError(f"{mode}_pool2d_backward: a {wl.mode} pooling of {wl.C} channels in blocks of {block}")
    blocks = wl.C // block
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name(f"{mode}_pool2d_backward")
        T.func_attr({"tirx.noalias": True, KERNEL_ATTR: f"{mode}_pool2d_backward"})
        dy = param_buffer("dy", (wl.N, blocks, wl.OH, wl.OW, block))
        x = param_buffer("x", (wl.N, blocks, wl.H, wl.W, block)) if mode == "max" else None
        dx = param_buffer("dx", (wl.N, blocks, wl.H, wl.W, block))
        with T.sblock("root"), T.parallel(0, wl.N * blocks) as task:
            n, b = T.Bind(task // blocks), T.Bind(task % blocks)
            with T.grid(wl.H, wl.W) as (h, w), T.vectorized(0, block) as c:
                T.buffer_store(dx, T.float32(0), [n, b, h, w, c])
            yield builder, dy, x, dx, n, b


def max_pool2d_backward_blocked_func(wl: Pool2dWorkload, block: int, relu_mask: bool = False) -> tirx.PrimFunc:
    """dX (N, C/block, H, W, block) of the max pooling `wl` (C a multiple of `block`), from dY
    (N, C/block, OH, OW, block) and X (N, C/block, H, W, block): one task per block of an image,
    the block's channels in vectors (module docstring). `relu_mask`: where(X > 0, dX, 0)."""
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    top, left = wl.padding[0], wl.padding[1]
    with _blocked_gradient(wl, block, "max") as (builder, dy, x, dx, n, b):
        assert x is not None  # (max pooling's gradient reads X)
        best = IRBuilder.name("best", T.alloc_buffer((block,), "float32"))
        at = IRBuilder.name("at", T.alloc_buffer((block,), "int32"))
        grad = IRBuilder.name("grad", T.alloc_buffer((block,), "float32"))
        with T.grid(wl.OH, wl.OW) as (oh, ow):
            with T.vectorized(0, block) as c:
                T.buffer_store(at, T.int32(-1), [c])
                T.buffer_store(best, T.float32(0), [c])
            with T.grid(kh, kw) as (i, j):
                h = T.Bind(oh * sh - top + i * dh)
                w = T.Bind(ow * sw - left + j * dw)
                with T.If(tirx.all(h >= 0, h < wl.H, w >= 0, w < wl.W)), T.Then(), T.vectorized(0, block) as c:
                    value, tap = x[n, b, h, w, c], i * kw + j
                    take = tirx.any(at[c] < 0, value > best[c], tirx.isnan(value))
                    T.buffer_store(at, tirx.Select(take, tap, at[c]), [c])  # (then at == tap iff taken)
                    T.buffer_store(best, tirx.Select(at[c] == tap, value, best[c]), [c])
            with T.vectorized(0, block) as c:
                keep = best[c] > T.float32(0) if relu_mask else at[c] >= 0
                T.buffer_store(grad, tirx.Select(keep, dy[n, b, oh, ow, c], T.float32(0)), [c])
            with T.grid(kh, kw) as (i, j):
                h = T.Bind(oh * sh - top + i * dh)
                w = T.Bind(ow * sw - left + j * dw)
                with T.If(tirx.all(h >= 0, h < wl.H, w >= 0, w < wl.W)), T.Then(), T.vectorized(0, block) as c:
                    T.buffer_store(dx, dx[n, b, h, w, c] + tirx.Select(at[c] == i * kw + j, grad[c], T.float32(0)),
                                   [n, b, h, w, c])
    return builder.get()


def window_count(wl: Pool2dWorkload, oh, ow) -> tirx.PrimExpr:
    """The pixels average pooling `wl` divides output (oh, ow) by: its window clipped to the
    padded input (count_include_pad) or to the input (:func:`~tvm_ext.kernels.pool2d.pool2d_func`)."""

    def count(size: int, o, k: int, stride: int, before: int, after: int) -> tirx.PrimExpr:
        start = o * stride - before
        if wl.count_include_pad:
            return tirx.min(start + k, size + after) - start
        return tirx.min(start + k, size) - tirx.max(start, 0)

    (kh, kw), (sh, sw) = wl.kernel, wl.stride
    top, left, bottom, right = wl.padding
    return count(wl.H, oh, kh, sh, top, bottom) * count(wl.W, ow, kw, sw, left, right)


def avg_pool2d_backward_blocked_func(wl: Pool2dWorkload, block: int) -> tirx.PrimFunc:
    """dX (N, C/block, H, W, block) of the average pooling `wl` (C a multiple of `block`) from dY
    (N, C/block, OH, OW, block): one task per block of an image (its windows write only its
    pixels), each window's dY / count added to its taps inside the input, vectors of the block's
    channels. TVM's legalized gradient sums, for every input pixel, the windows that may hold it."""
    (kh, kw), (sh, sw) = wl.kernel, wl.stride
    top, left = wl.padding[0], wl.padding[1]
    with _blocked_gradient(wl, block, "avg") as (builder, dy, _, dx, n, b):
        grad = IRBuilder.name("grad", T.alloc_buffer((block,), "float32"))
        with T.grid(wl.OH, wl.OW) as (oh, ow):
            area = T.Bind(T.Cast("float32", window_count(wl, oh, ow)))
            with T.vectorized(0, block) as c:
                T.buffer_store(grad, dy[n, b, oh, ow, c] / area, [c])
            with T.grid(kh, kw) as (i, j):
                h = T.Bind(oh * sh - top + i)
                w = T.Bind(ow * sw - left + j)
                with T.If(tirx.all(h >= 0, h < wl.H, w >= 0, w < wl.W)), T.Then(), T.vectorized(0, block) as c:
                    T.buffer_store(dx, dx[n, b, h, w, c] + grad[c], [n, b, h, w, c])
    return builder.get()
