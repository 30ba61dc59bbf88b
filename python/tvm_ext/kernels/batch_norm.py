"""Batch norm in training mode (batch statistics) on a blocked NCHW[x]c tensor (LLVM CPU): the
forward pass and its gradient.

Each channel's statistics reduce over the images and pixels (N x H x W values), so the
statistics run one task per channel block, its channels in the vector's lanes, and the
elementwise passes one task per (image, block, row). Sums are taken a row at a time and the rows'
sums added (N x H + W additions per value instead of N x H x W into one float); the variance is
the mean squared deviation from the mean, as TVM's batch_norm and PyTorch compute it (no
E[x^2] - E[x]^2 cancellation): each row's own, merged by Chan's formula (one pass over x from
memory, two over each row in L1).

Forward (relax.nn.batch_norm with training=True): mean, var (biased), then
y = (x - mean) * rstd * gamma + beta with rstd = 1 / sqrt(var + epsilon).
Backward, from the statistics (the forward's, or computed here) and dY:
dbeta = sum(dY), dgamma = sum(dY * xhat), dX = gamma * rstd * (dY - dbeta / M - xhat * dgamma / M)
with xhat = (x - mean) * rstd and M = N x H x W. TVM's decomposition (DecomposeOpsForTraining,
then Gradient) runs about 30 stock NCHW ops for the same.
"""

from __future__ import annotations

import dataclasses

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from .common import KERNEL_ATTR, param_buffer

__all__ = ["BatchNorm", "batch_norm_backward_func", "batch_norm_forward_func"]


@dataclasses.dataclass(frozen=True)
class BatchNorm:
    """A training-mode batch norm over the channels of a blocked (N, C / block, H, W, block)
    tensor (the CPU kernels'; `layout` "CHWN": a (C, H, W, N) one, CUDA's,
    :mod:`tvm_ext.kernels.cuda.batch_norm`); gamma and beta one value per channel."""

    shape: tuple[int, ...]  # (N, C / block, H, W, block), or (C, H, W, N)
    epsilon: float
    scale: bool = True
    center: bool = True
    residual: bool = False  # the forward adds a shortcut (x's shape) to y
    relu: bool = False  # the forward's y goes through a relu (after the shortcut)
    layout: str = "NCHWc"

    def __post_init__(self) -> None:
        rank = {"NCHWc": 5, "CHWN": 4}.get(self.layout)
        if rank is None:
            raise ValueError(f"batch_norm: layout {self.layout!r} is not NCHWc or CHWN")
        if len(self.shape) != rank or min(self.shape) < 1:
            raise ValueError(f"batch_norm: {self.shape} is not a {self.layout} shape")
        if not self.epsilon >= 0:
            raise ValueError(f"batch_norm: epsilon must be >= 0, got {self.epsilon}")

    @property
    def channels(self) -> int:
        return self.shape[0] if self.layout == "CHWN" else self.shape[1] * self.shape[4]

    def tag(self) -> str:
        return ("x".join(map(str, self.shape)) + "_scale" * self.scale + "_center" * self.center
                + "_residual" * self.residual + "_relu" * self.relu)


def _reduce(bn: BatchNorm, b, sums: list) -> None:
    """out[b * block + lane] = the sum of term(n, h, w, lane) over the images and pixels for each
    (out, term) of `sums`, in one pass, a row at a time (module docstring)."""
    n_images, _, height, width, block = bn.shape
    totals = [IRBuilder.name(f"total{i}", T.alloc_buffer((block,), "float32")) for i in range(len(sums))]
    rows = [IRBuilder.name(f"row{i}", T.alloc_buffer((block,), "float32")) for i in range(len(sums))]
    with T.vectorized(0, block) as lane:
        for total in totals:
            T.buffer_store(total, T.float32(0), [lane])
    with T.grid(n_images, height) as (n, h):
        with T.vectorized(0, block) as lane:
            for row in rows:
                T.buffer_store(row, T.float32(0), [lane])
        with T.serial(0, width) as w, T.vectorized(0, block) as lane:
            for row, (_, term) in zip(rows, sums, strict=True):
                T.buffer_store(row, row[lane] + term(n, h, w, lane), [lane])
        with T.vectorized(0, block) as lane:
            for total, row in zip(totals, rows, strict=True):
                T.buffer_store(total, total[lane] + row[lane], [lane])
    with T.vectorized(0, block) as lane:
        for total, (out, _) in zip(totals, sums, strict=True):
            T.buffer_store(out, total[lane], [b * block + lane])


def _blocked(bn: BatchNorm) -> int:
    """The block of a blocked batch norm (the layout these kernels take)."""
    if bn.layout != "NCHWc":
        raise ValueError(f"batch_norm (CPU): a {bn.layout} tensor, not blocked NCHWc")
    return bn.shape[4]


def _rstd(bn: BatchNorm, var: tirx.Buffer, c):
    return T.float32(1) / T.sqrt(var[c] + T.float32(bn.epsilon))


def _statistics(bn: BatchNorm, x: tirx.Buffer, mean: tirx.Buffer, var: tirx.Buffer) -> None:
    """mean and (biased) var of each channel of x: one task per channel block, one pass over x
    from memory. Each row of pixels (in L1) gets its own mean and squared deviations (two passes
    over the row), merged into the running ones by Chan's formula: as exact as two passes over
    all of x, with a third of the traffic saved."""
    n_images, _, height, width, block = bn.shape
    with T.parallel(0, bn.shape[1]) as b:
        acc_mean = IRBuilder.name("acc_mean", T.alloc_buffer((block,), "float32"))
        acc_m2 = IRBuilder.name("acc_m2", T.alloc_buffer((block,), "float32"))
        row_mean = IRBuilder.name("row_mean", T.alloc_buffer((block,), "float32"))
        row_m2 = IRBuilder.name("row_m2", T.alloc_buffer((block,), "float32"))
        with T.vectorized(0, block) as lane:
            T.buffer_store(acc_mean, T.float32(0), [lane])
            T.buffer_store(acc_m2, T.float32(0), [lane])
        with T.grid(n_images, height) as (n, h):
            with T.vectorized(0, block) as lane:
                T.buffer_store(row_mean, T.float32(0), [lane])
                T.buffer_store(row_m2, T.float32(0), [lane])
            with T.serial(0, width) as w, T.vectorized(0, block) as lane:
                T.buffer_store(row_mean, row_mean[lane] + x[n, b, h, w, lane], [lane])
            with T.vectorized(0, block) as lane:
                T.buffer_store(row_mean, row_mean[lane] / T.float32(width), [lane])
            with T.serial(0, width) as w, T.vectorized(0, block) as lane:
                d = x[n, b, h, w, lane] - row_mean[lane]
                T.buffer_store(row_m2, row_m2[lane] + d * d, [lane])
            # rows so far: seen = (n * H + h) * W values; merged with this row's W
            seen = T.Cast("float32", (n * height + h) * width)
            total = seen + T.float32(width)
            with T.vectorized(0, block) as lane:
                delta = row_mean[lane] - acc_mean[lane]
                T.buffer_store(acc_m2, acc_m2[lane] + row_m2[lane] + delta * delta * seen * T.float32(width) / total,
                               [lane])
                T.buffer_store(acc_mean, acc_mean[lane] + delta * T.float32(width) / total, [lane])
        with T.vectorized(0, block) as lane:
            T.buffer_store(mean, acc_mean[lane], [b * block + lane])
            T.buffer_store(var, acc_m2[lane] / T.float32(n_images * height * width), [b * block + lane])


def _elementwise(bn: BatchNorm, coefficients: int, prepare, body) -> None:
    """body(n, b, h, w, lane, k) over every element, one task per (image, block, row), with
    `coefficients` per-lane values k[i][lane] that prepare(b, lane, k) sets once a task."""
    n_images, blocks, height, width, block = bn.shape
    with T.parallel(0, n_images * blocks * height) as task:
        n, b, h = T.Bind(task // (blocks * height)), T.Bind(task // height % blocks), T.Bind(task % height)
        k = [IRBuilder.name(f"k{i}", T.alloc_buffer((block,), "float32")) for i in range(coefficients)]
        with T.vectorized(0, block) as lane:
            prepare(b, lane, k)
        with T.serial(0, width) as w, T.vectorized(0, block) as lane:
            body(n, b, h, w, lane, k)


def batch_norm_forward_func(bn: BatchNorm, normalize: bool = True) -> tirx.PrimFunc:
    """The forward kernel of `bn`: parameters x, then gamma (C,) and beta (C,) where `bn` applies
    them, the shortcut (x's shape) if it adds one, then the outputs y (x's shape, if
    `normalize`; relu(y + shortcut) with those), mean (C,) and var (C,). Without `normalize`,
    the statistics only (for a gradient whose forward ran elsewhere)."""
    block = _blocked(bn)
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("batch_norm_forward")
        T.func_attr({"tirx.noalias": True, KERNEL_ATTR: "batch_norm_training"})
        x = param_buffer("x", bn.shape)
        gamma = param_buffer("gamma", (bn.channels,)) if normalize and bn.scale else None
        beta = param_buffer("beta", (bn.channels,)) if normalize and bn.center else None
        shortcut = param_buffer("shortcut", bn.shape) if normalize and bn.residual else None
        y = param_buffer("y", bn.shape) if normalize else None
        mean = param_buffer("mean", (bn.channels,))
        var = param_buffer("var", (bn.channels,))
        with T.sblock("root"):
            _statistics(bn, x, mean, var)
            if y is not None:
                def prepare(b, lane, k) -> None:  # k0 = gamma * rstd, k1 = mean, k2 = beta
                    c = b * block + lane
                    rstd = _rstd(bn, var, c)
                    T.buffer_store(k[0], rstd * gamma[c] if gamma is not None else rstd, [lane])
                    T.buffer_store(k[1], mean[c], [lane])
                    T.buffer_store(k[2], beta[c] if beta is not None else T.float32(0), [lane])

                def normalized(n, b, h, w, lane, k) -> None:
                    value = (x[n, b, h, w, lane] - k[1][lane]) * k[0][lane] + k[2][lane]
                    if shortcut is not None:
                        value = value + shortcut[n, b, h, w, lane]
                    if bn.relu:  # (a select: a NaN stays a NaN, as in PyTorch)
                        value = tirx.Select(value < T.float32(0), T.float32(0), value)
                    T.buffer_store(y, value, [n, b, h, w, lane])

                _elementwise(bn, 3, prepare, normalized)
    return builder.get()


def batch_norm_backward_func(bn: BatchNorm) -> tirx.PrimFunc:
    """The gradient kernel of `bn`: parameters x, dy (x's shape), mean (C,), var (C,) of the
    forward pass, gamma (C,) if `bn` scales, then the outputs dx (x's shape), dgamma (C,) and
    dbeta (C,) (module docstring)."""
    block = _blocked(bn)
    count = float(bn.shape[0] * bn.shape[2] * bn.shape[3])
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("batch_norm_backward")
        T.func_attr({"tirx.noalias": True, KERNEL_ATTR: "batch_norm_backward"})
        x = param_buffer("x", bn.shape)
        dy = param_buffer("dy", bn.shape)
        mean = param_buffer("mean", (bn.channels,))
        var = param_buffer("var", (bn.channels,))
        gamma = param_buffer("gamma", (bn.channels,)) if bn.scale else None
        dx = param_buffer("dx", bn.shape)
        dgamma = param_buffer("dgamma", (bn.channels,))
        dbeta = param_buffer("dbeta", (bn.channels,))
        with T.sblock("root"):
            with T.parallel(0, bn.shape[1]) as b:
                _reduce(bn, b, [(dbeta, lambda n, h, w, lane: dy[n, b, h, w, lane]),
                                (dgamma, lambda n, h, w, lane: dy[n, b, h, w, lane]
                                 * (x[n, b, h, w, lane] - mean[b * block + lane]))])
                with T.vectorized(0, block) as lane:  # sum(dY * (x - mean)) * rstd = sum(dY * xhat)
                    c = b * block + lane
                    T.buffer_store(dgamma, dgamma[c] * _rstd(bn, var, c), [c])

            # dX = k0 * dY + (x - mean) * k1 + k2: k0 = gamma * rstd, k1 = -k0 * rstd * dgamma / M,
            # k2 = -k0 * dbeta / M, k3 = mean
            def prepare(b, lane, k) -> None:
                c = b * block + lane
                rstd = _rstd(bn, var, c)
                T.buffer_store(k[0], rstd * gamma[c] if gamma is not None else rstd, [lane])
                T.buffer_store(k[1], T.float32(0) - k[0][lane] * rstd * dgamma[c] / T.float32(count), [lane])
                T.buffer_store(k[2], T.float32(0) - k[0][lane] * dbeta[c] / T.float32(count), [lane])
                T.buffer_store(k[3], mean[c], [lane])

            def data_gradient(n, b, h, w, lane, k) -> None:
                T.buffer_store(dx, dy[n, b, h, w, lane] * k[0][lane] + (x[n, b, h, w, lane] - k[3][lane]) * k[1][lane]
                               + k[2][lane], [n, b, h, w, lane])

            _elementwise(bn, 4, prepare, data_gradient)
    return builder.get()
