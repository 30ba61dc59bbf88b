"""Layer norm over the channels of a blocked NCHW[x]c tensor (LLVM CPU): ConvNeXt's.

ConvNeXt normalises each pixel over its channels. In PyTorch that is channels-last: permute,
layer_norm over the last axis, permute back; on stock TVM in NCHW it is a reduction over a
strided axis (27 ms instead of 1 ms on 1x96x56x56), so the graph kept the transposes and the
convolutions around it packed and unpacked. Here the blocked tensor is normalised where it is:
one parallel task a row of pixels, whose channel blocks are summed lane by lane into a scratch
row (W x block floats, in L1), then reduced across the lanes. Two passes for the statistics
(mean, then the mean squared deviation: no cancellation, as PyTorch), one for the output.
"""

from __future__ import annotations

import dataclasses

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from .common import KERNEL_ATTR, param_buffer

__all__ = ["LayerNorm", "layer_norm_func"]


@dataclasses.dataclass(frozen=True)
class LayerNorm:
    """y = (x - mean) / sqrt(var + epsilon) [* gamma] [+ beta] per pixel, over the channels of a
    blocked (N, C / block, H, W, block) tensor; gamma and beta one value per channel."""

    shape: tuple[int, ...]  # (N, C / block, H, W, block)
    epsilon: float
    scale: bool = True
    center: bool = True

    def __post_init__(self) -> None:
        if len(self.shape) != 5 or min(self.shape) < 1:
            raise ValueError(f"layer_norm: {self.shape} is not a blocked (N, C/c, H, W, c) shape")
        if not self.epsilon >= 0:
            raise ValueError(f"layer_norm: epsilon must be >= 0, got {self.epsilon}")

    @property
    def channels(self) -> int:
        return self.shape[1] * self.shape[4]

    def tag(self) -> str:
        return "x".join(map(str, self.shape)) + "_scale" * self.scale + "_center" * self.center


def layer_norm_func(norm: LayerNorm) -> tirx.PrimFunc:
    """The kernel of `norm`: parameters x, then gamma (C,) and beta (C,) where `norm` applies
    them, then y (x's shape)."""
    n_images, blocks, height, width, block = norm.shape
    channels = float(norm.channels)
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("layer_norm")
        T.func_attr({"tirx.noalias": True, KERNEL_ATTR: "layer_norm"})
        x = param_buffer("x", norm.shape)
        gamma = param_buffer("gamma", (norm.channels,)) if norm.scale else None
        beta = param_buffer("beta", (norm.channels,)) if norm.center else None
        y = param_buffer("y", norm.shape)
        with T.sblock("root"), T.parallel(0, n_images * height) as task:
            n, h = T.Bind(task // height), T.Bind(task % height)
            lanes = IRBuilder.name("lanes", T.decl_buffer((width, block), "float32"))
            mean = IRBuilder.name("mean", T.decl_buffer((width,), "float32"))
            rstd = IRBuilder.name("rstd", T.decl_buffer((width,), "float32"))

            def reduce_lanes(term) -> None:
                """lanes[w, :] = the sum over the channel blocks of term(cb, w, lane)."""
                with T.serial(0, width) as w, T.vectorized(0, block) as lane:
                    T.buffer_store(lanes, T.float32(0), [w, lane])
                with T.serial(0, blocks) as cb, T.serial(0, width) as w, T.vectorized(0, block) as lane:
                    T.buffer_store(lanes, lanes[w, lane] + term(cb, w, lane), [w, lane])

            def across_lanes(out: tirx.Buffer, finish) -> None:
                """out[w] = finish(the sum of lanes[w, :] / C)."""
                with T.serial(0, width) as w:
                    T.buffer_store(out, T.float32(0), [w])
                    with T.serial(0, block) as lane:
                        T.buffer_store(out, out[w] + lanes[w, lane], [w])
                    T.buffer_store(out, finish(out[w] / T.float32(channels)), [w])

            reduce_lanes(lambda cb, w, lane: x[n, cb, h, w, lane])
            across_lanes(mean, lambda m: m)

            def squared_deviation(cb, w, lane):
                d = x[n, cb, h, w, lane] - mean[w]
                return d * d

            reduce_lanes(squared_deviation)
            across_lanes(rstd, lambda var: T.float32(1) / T.sqrt(var + T.float32(norm.epsilon)))
            with T.serial(0, blocks) as cb, T.serial(0, width) as w, T.vectorized(0, block) as lane:
                value = (x[n, cb, h, w, lane] - mean[w]) * rstd[w]
                if gamma is not None:
                    value = value * gamma[cb * block + lane]
                if beta is not None:
                    value = value + beta[cb * block + lane]
                T.buffer_store(y, value, [n, cb, h, w, lane])
    return builder.get()
