"""Batch norm in training mode (batch statistics) on CHWN tensors for CUDA: the forward pass and its
gradient, with the arithmetic of the CPU kernels (:mod:`tvm_ext.kernels.batch_norm`).

In CHWN (the maxDNN convolution's layout) a channel's M = H x W x N values are one contiguous row,
so each channel is one thread block: its threads stride the row (coalesced loads), their partial
sums meet in a shared-memory tree, and the block then writes its row of y (or dX) from the
statistics it holds. The mean first, then the squared deviations from it (two passes over the
row, no E[x^2] - E[x]^2 cancellation), the variance biased as TVM's batch_norm and PyTorch's
normalization take it. One block a channel leaves a GPU's SMs idle on narrow layers (64 channels);
splitting a row over several blocks is the next step where it is measured.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from ..batch_norm import BatchNorm
from ..common import KERNEL_ATTR, param_buffer
from .memory_bound import THREADS

__all__ = ["batch_norm_backward_chwn_func", "batch_norm_forward_chwn_func"]


def _check(bn: BatchNorm) -> tuple[int, int]:
    """(channels, M) of a CHWN batch norm."""
    if bn.layout != "CHWN":
        raise ValueError(f"batch_norm (CUDA): a {bn.layout} tensor, not CHWN")
    c, h, w, n = bn.shape
    return c, h * w * n


def _block_sums(tid, terms: list, count: int, results: list) -> None:
    """results[i][0] = the sum of terms[i](m) over m < `count`, in every thread of the block: each
    thread sums its stride of the row, then a shared-memory tree adds the threads' sums."""
    parts = [IRBuilder.name(f"part{i}", T.alloc_buffer((1,), "float32", scope="local")) for i in range(len(terms))]
    trees = [IRBuilder.name(f"tree{i}", T.alloc_buffer((THREADS,), "float32", scope="shared"))
             for i in range(len(terms))]
    for part in parts:
        T.buffer_store(part, T.float32(0), [0])
    with T.serial(0, -(-count // THREADS)) as i:
        m = T.Bind(i * THREADS + tid)
        with T.If(m < count), T.Then():
            for part, term in zip(parts, terms, strict=True):
                T.buffer_store(part, part[0] + term(m), [0])
    for part, tree in zip(parts, trees, strict=True):
        T.buffer_store(tree, part[0], [tid])
    step = THREADS // 2
    while step:
        T.evaluate(T.tvm_storage_sync("shared"))
        with T.If(tid < step), T.Then():
            for tree in trees:
                T.buffer_store(tree, tree[tid] + tree[tid + step], [tid])
        step //= 2
    T.evaluate(T.tvm_storage_sync("shared"))
    for result, tree in zip(results, trees, strict=True):
        T.buffer_store(result, tree[0], [0])
    T.evaluate(T.tvm_storage_sync("shared"))  # every thread has read the trees before they are reused


def _rstd(bn: BatchNorm, var) -> tirx.PrimExpr:
    return T.float32(1) / T.sqrt(var + T.float32(bn.epsilon))


def batch_norm_forward_chwn_func(bn: BatchNorm, normalize: bool = True) -> tirx.PrimFunc:
    """The forward kernel of `bn` (CHWN): parameters x, then gamma (C,) and beta (C,) where `bn`
    applies them, the shortcut (x's shape) if it adds one, then the outputs y (x's shape, if
    `normalize`; relu(y + shortcut) with those), mean (C,) and var (C,). Without `normalize`, the
    statistics only (for a gradient whose forward ran elsewhere)."""
    channels, count = _check(bn)
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("batch_norm_forward_chwn")
        T.func_attr({"tirx.noalias": True, KERNEL_ATTR: "batch_norm_training"})
        x = param_buffer("x", bn.shape)
        gamma = param_buffer("gamma", (channels,)) if normalize and bn.scale else None
        beta = param_buffer("beta", (channels,)) if normalize and bn.center else None
        shortcut = param_buffer("shortcut", bn.shape) if normalize and bn.residual else None
        y = param_buffer("y", bn.shape) if normalize else None
        mean = param_buffer("mean", (channels,))
        var = param_buffer("var", (channels,))
        rows = {name: IRBuilder.name(f"{name}_rows", T.decl_buffer((channels, count), "float32", data=buf.data))
                for name, buf in (("x", x), ("shortcut", shortcut), ("y", y)) if buf is not None}
        with T.sblock("root"), T.thread_binding(0, channels, thread="blockIdx.x") as c, \
                T.thread_binding(0, THREADS, thread="threadIdx.x") as tid:
            xs = rows["x"]
            total = IRBuilder.name("total", T.alloc_buffer((1,), "float32", scope="local"))
            squares = IRBuilder.name("squares", T.alloc_buffer((1,), "float32", scope="local"))
            _block_sums(tid, [lambda m: xs[c, m]], count, [total])
            mu = T.Bind(total[0] / T.float32(count))
            _block_sums(tid, [lambda m: (xs[c, m] - mu) * (xs[c, m] - mu)], count, [squares])
            sigma2 = T.Bind(squares[0] / T.float32(count))
            with T.If(tid == 0), T.Then():
                T.buffer_store(mean, mu, [c])
                T.buffer_store(var, sigma2, [c])
            if y is not None:
                scale = T.Bind(_rstd(bn, sigma2) * gamma[c] if gamma is not None else _rstd(bn, sigma2))
                shift = beta[c] if beta is not None else T.float32(0)
                with T.serial(0, -(-count // THREADS)) as i:
                    m = T.Bind(i * THREADS + tid)
                    with T.If(m < count), T.Then():
                        value = (xs[c, m] - mu) * scale + shift
                        if shortcut is not None:
                            value = value + rows["shortcut"][c, m]
                        if bn.relu:  # (a select: a NaN stays a NaN, as in PyTorch)
                            value = tirx.Select(value < T.float32(0), T.float32(0), value)
                        T.buffer_store(rows["y"], value, [c, m])
    return builder.get()


def batch_norm_backward_chwn_func(bn: BatchNorm) -> tirx.PrimFunc:
    """The gradient kernel of `bn` (CHWN): parameters x, dy (x's shape), mean (C,), var (C,) of
    the forward pass, gamma (C,) if `bn` scales, then the outputs dx (x's shape), dgamma (C,) and
    dbeta (C,): dbeta = sum(dY), dgamma = sum(dY * xhat),
    dX = gamma * rstd * (dY - dbeta / M - xhat * dgamma / M)."""
    channels, count = _check(bn)
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("batch_norm_backward_chwn")
        T.func_attr({"tirx.noalias": True, KERNEL_ATTR: "batch_norm_backward"})
        x = param_buffer("x", bn.shape)
        dy = param_buffer("dy", bn.shape)
        mean = param_buffer("mean", (channels,))
        var = param_buffer("var", (channels,))
        gamma = param_buffer("gamma", (channels,)) if bn.scale else None
        dx = param_buffer("dx", bn.shape)
        dgamma = param_buffer("dgamma", (channels,))
        dbeta = param_buffer("dbeta", (channels,))
        xs, dys, dxs = (IRBuilder.name(f"{name}_rows", T.decl_buffer((channels, count), "float32", data=buf.data))
                        for name, buf in (("x", x), ("dy", dy), ("dx", dx)))
        with T.sblock("root"), T.thread_binding(0, channels, thread="blockIdx.x") as c, \
                T.thread_binding(0, THREADS, thread="threadIdx.x") as tid:
            mu, rstd = T.Bind(mean[c]), T.Bind(_rstd(bn, var[c]))
            sum_dy = IRBuilder.name("sum_dy", T.alloc_buffer((1,), "float32", scope="local"))
            sum_dy_xc = IRBuilder.name("sum_dy_xc", T.alloc_buffer((1,), "float32", scope="local"))
            _block_sums(tid, [lambda m: dys[c, m], lambda m: dys[c, m] * (xs[c, m] - mu)], count,
                        [sum_dy, sum_dy_xc])
            beta_grad, gamma_grad = T.Bind(sum_dy[0]), T.Bind(sum_dy_xc[0] * rstd)  # sum(dY * xhat)
            with T.If(tid == 0), T.Then():
                T.buffer_store(dbeta, beta_grad, [c])
                T.buffer_store(dgamma, gamma_grad, [c])
            # dX = k0 * dY + (x - mean) * k1 + k2, as the CPU kernel
            k0 = T.Bind(rstd * gamma[c] if gamma is not None else rstd)
            k1 = T.Bind(T.float32(0) - k0 * rstd * gamma_grad / T.float32(count))
            k2 = T.Bind(T.float32(0) - k0 * beta_grad / T.float32(count))
            with T.serial(0, -(-count // THREADS)) as i:
                m = T.Bind(i * THREADS + tid)
                with T.If(m < count), T.Then():
                    T.buffer_store(dxs, dys[c, m] * k0 + (xs[c, m] - mu) * k1 + k2, [c, m])
    return builder.get()
