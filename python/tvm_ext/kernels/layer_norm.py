"""Layer norm over the channels of a blocked NCHW[x]c tensor (LLVM CPU): ConvNeXt's.

ConvNeXt normalises each pixel over its channels. In PyTorch that is channels-last: permute,
layer_norm over the last axis, permute back; on stock TVM in NCHW it is a reduction over a
strided axis (27 ms instead of 1 ms on 1x96x56x56), so the graph kept the transposes and the
convolutions around it packed and unpacked. Here the blocked tensor is normalised where it is:
one parallel task a row of pixels, whose channel blocks are summed lane by lane into a scratch
row (W x block floats, in L1), then reduced across the lanes. Two passes for the statistics
(mean, then the mean squared deviation: no cancellation, as PyTorch), one for the output.

A quantized network (ONNX Runtime's QDQ ConvNeXt) normalises rows of quantized values between a
dequantize and a quantize: :func:`quantized_layer_norm_func` reads the uint8 / int8 values and
writes quantized ones in one pass, its statistics exact integer sums of the values and their
squares (stock TVM: a float tensor written and read again, 4.6 of int8 ConvNeXt-T's 36 ms).
"""

from __future__ import annotations

import dataclasses
import math

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from ..relax_info import Quantization
from .common import KERNEL_ATTR, param_buffer

__all__ = ["QUANTIZED_NORM_MAX_CHANNELS", "LayerNorm", "layer_norm_func", "quantized_layer_norm_func"]


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


_QUANTIZED_RANGES = {"uint8": (0, 255), "int8": (-128, 127)}
_LANES = 16  # int32 / float32 lanes of a zmm: the channel loops' vector width
# each int32 lane sums the squares of C / 16 values of at most 255^2: the widest row it takes
QUANTIZED_NORM_MAX_CHANNELS = (2**31 - 1) // (255 * 255) * _LANES


def quantized_layer_norm_func(shape: tuple[int, ...], data: Quantization, out: Quantization,
                              epsilon: float) -> tirx.PrimFunc:
    """quantize(layer_norm(dequantize(x)) * gamma + beta) over the last axis of `shape` (rows of
    channels), x quantized by `data`, the result by `out` (rounding to nearest even, as ONNX's
    QuantizeLinear). Parameters x, gamma (C,), beta (C,), y. With t = x - z: mean = s * sum(t) /
    C and variance = s^2 * (C * sum(t^2) - sum(t)^2) / C^2, from exact integer sums (int32
    lanes: C up to :data:`QUANTIZED_NORM_MAX_CHANNELS`), then y = (t - sum(t) / C) * s * rstd *
    gamma + beta in float32."""
    if data.dtype not in _QUANTIZED_RANGES or out.dtype not in _QUANTIZED_RANGES:
        raise ValueError(f"quantized_layer_norm: dtypes {data.dtype} -> {out.dtype} are not uint8 / int8")
    *leading, channels = (int(v) for v in shape)
    if not 1 <= channels <= QUANTIZED_NORM_MAX_CHANNELS or min(leading, default=1) < 1 or not epsilon >= 0:
        raise ValueError(f"quantized_layer_norm: shape {tuple(shape)} or epsilon {epsilon} out of range")
    rows = math.prod(leading)
    whole = channels - channels % _LANES
    low, high = _QUANTIZED_RANGES[out.dtype]
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("quantized_layer_norm")
        T.func_attr({"tirx.noalias": True, KERNEL_ATTR: "quantized_layer_norm"})
        x_in = param_buffer("x", shape, dtype=data.dtype)
        gamma = param_buffer("gamma", (channels,))
        beta = param_buffer("beta", (channels,))
        y_out = param_buffer("y", shape, dtype=out.dtype)
        x = T.decl_buffer((rows, channels), data.dtype, data=x_in.data)
        y = T.decl_buffer((rows, channels), out.dtype, data=y_out.data)
        with T.sblock("root"), T.parallel(0, rows) as r:
            lanes = IRBuilder.name("lanes", T.decl_buffer((2, _LANES), "int32"))
            sums = IRBuilder.name("sums", T.decl_buffer((2,), "int64"))

            def centred(c):
                return tirx.Cast("int32", x[r, c]) - T.int32(data.zero_point)

            with T.vectorized(0, _LANES) as lane:
                T.buffer_store(lanes, T.int32(0), [0, lane])
                T.buffer_store(lanes, T.int32(0), [1, lane])
            with T.serial(0, whole // _LANES) as cb, T.vectorized(0, _LANES) as lane:
                t = centred(cb * _LANES + lane)
                T.buffer_store(lanes, lanes[0, lane] + t, [0, lane])
                T.buffer_store(lanes, lanes[1, lane] + t * t, [1, lane])
            T.buffer_store(sums, T.int64(0), [0])
            T.buffer_store(sums, T.int64(0), [1])
            with T.serial(0, _LANES) as lane:
                T.buffer_store(sums, sums[0] + tirx.Cast("int64", lanes[0, lane]), [0])
                T.buffer_store(sums, sums[1] + tirx.Cast("int64", lanes[1, lane]), [1])
            with T.serial(whole, channels) as c:
                t = tirx.Cast("int64", centred(c))
                T.buffer_store(sums, sums[0] + t, [0])
                T.buffer_store(sums, sums[1] + t * t, [1])
            mean = T.Bind(tirx.Cast("float32", tirx.Cast("float64", sums[0]) / T.float64(channels)))
            variance = (tirx.Cast("float64", sums[1] * T.int64(channels) - sums[0] * sums[0])
                        / T.float64(channels * channels) * T.float64(data.scale) * T.float64(data.scale))
            step = T.Bind(T.float32(data.scale) / T.sqrt(tirx.Cast("float32", variance) + T.float32(epsilon)))

            def store(c) -> None:
                value = (tirx.Cast("float32", centred(c)) - mean) * step * gamma[c] + beta[c]
                rounded = T.call_llvm_pure_intrin("float32", "llvm.nearbyint", value / T.float32(out.scale))
                clipped = T.max(T.min(rounded + T.float32(out.zero_point), T.float32(high)), T.float32(low))
                T.buffer_store(y, tirx.Cast(out.dtype, clipped), [r, c])

            with T.serial(0, whole // _LANES) as cb, T.vectorized(0, _LANES) as lane:
                store(cb * _LANES + lane)
            with T.serial(whole, channels) as c:
                store(c)
    return builder.get()
