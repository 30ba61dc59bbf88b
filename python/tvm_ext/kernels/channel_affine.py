"""Concatenation along channels, a per-channel scale and shift, and an activation, in one pass
over blocked NCHW[x]c tensors (LLVM CPU).

DenseNet's layers each read `relu(batch_norm(concat(features)))`: on stock TVM that is NCHW,
so every convolution output was unpacked, concatenated, normalised and packed again (a fifth
of DenseNet-121's time). Here the inputs stay in the blocks their producers wrote (blocks may
differ between inputs) and the output is blocked for its consumer: one read and one write per
element. The same kernel serves a concatenation alone (GoogLeNet's and Inception's branches)
and an inference batch norm that follows no convolution (a scale and a shift).

Inputs that are all NCHW (no producer wrote them blocked: ShuffleNet's concatenations of
convolutions written in NCHW and of a split) are read and written as they are: blocks of one
channel, rows vectorized along the pixels (:func:`planar`). Packing them into blocks for the
kernel and unpacking its output for an NCHW consumer made three copies of what stock TVM's
concatenation copies once (a tenth of ShuffleNet's time).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from .common import ACTIVATIONS, KERNEL_ATTR, activation_expr, param_buffer

__all__ = ["ChannelAffine", "channel_affine_func", "choose_out_block"]

# activations that are a few compares and multiplies: applied as each input is copied; the
# others (erf, exp) once over the output row afterwards
_SELECTS = ("relu", "relu6", "leaky_relu", "hardsigmoid", "hardswish")


@dataclasses.dataclass(frozen=True)
class ChannelAffine:
    """What one call computes: y = act(concat(x_0, ..., x_k-1) * scale + shift) per channel.

    `inputs`: (channels, block) of each input, in concatenation order, each blocked as
    (N, channels / block, H, W, block); `image`: (N, H, W); `out_block`: the output's block.
    """

    inputs: tuple[tuple[int, int], ...]
    image: tuple[int, int, int]
    out_block: int
    scale: bool = False
    shift: bool = False
    activation: str | None = None
    alpha: float = 0.01

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ValueError("channel_affine: no inputs")
        for channels, block in self.inputs:
            if block < 1 or channels % block:
                raise ValueError(f"channel_affine: {channels} channels are not a multiple of their block {block}")
        if self.out_block < 1 or self.channels % self.out_block:
            raise ValueError(f"channel_affine: {self.channels} channels are not a multiple of the output block "
                             f"{self.out_block}")
        if self.activation is not None and self.activation not in ACTIVATIONS:
            raise ValueError(f"channel_affine: activation {self.activation!r} is not one of {sorted(ACTIVATIONS)}")

    @property
    def channels(self) -> int:
        return sum(c for c, _ in self.inputs)

    @property
    def planar(self) -> bool:
        """Every input and the output in blocks of one channel: NCHW."""
        return self.out_block == 1 and all(block == 1 for _, block in self.inputs)

    @property
    def chunk(self) -> int:
        """The channels moved together: a divisor of every input's channels and block and of the
        output's block, so a chunk never straddles a block (or two inputs)."""
        return math.gcd(self.out_block, *(v for pair in self.inputs for v in pair))

    def out_shape(self) -> tuple[int, int, int, int, int]:
        n, h, w = self.image
        return (n, self.channels // self.out_block, h, w, self.out_block)

    def tag(self) -> str:
        """A readable, deterministic name part."""
        n, h, w = self.image
        parts = "_".join(f"{c}b{b}" for c, b in self.inputs)
        ops = "".join(("_scale" * self.scale, "_shift" * self.shift,
                       f"_{self.activation}" if self.activation else ""))
        return f"{n}x{h}x{w}_{parts}_o{self.out_block}{ops}"


def channel_affine_func(affine: ChannelAffine, lanes: int) -> tirx.PrimFunc:
    """The kernel of `affine`: parameters x_0..x_k-1 (blocked inputs), then scale (C,) and
    shift (C,) where `affine` has them, then the blocked output.

    One parallel task per (image, output chunk, row): a chunk's input is found by a binary
    search over the inputs' chunk ranges (a few compares a row, not one parallel region an
    input: DenseNet concatenates up to 49 tensors). Vectors of min(chunk, lanes) lanes, or
    narrower where the chunk is not a multiple of that.
    """
    n_images, height, width = affine.image
    chunk = affine.chunk
    vector = math.gcd(chunk, lanes)
    starts = [0]
    for channels, _ in affine.inputs:
        starts.append(starts[-1] + channels // chunk)
    out_block = affine.out_block
    activation = affine.activation
    inline = activation in _SELECTS
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("channel_affine")
        T.func_attr({"tirx.noalias": True, KERNEL_ATTR: "channel_affine"})
        xs = [param_buffer(f"x{i}", (n_images, c // b, height, width, b)) for i, (c, b) in enumerate(affine.inputs)]
        scale = param_buffer("scale", (affine.channels,)) if affine.scale else None
        shift = param_buffer("shift", (affine.channels,)) if affine.shift else None
        y = param_buffer("y", affine.out_shape())
        chunks = starts[-1]

        @contextlib.contextmanager
        def row_of_chunk(unroll: bool):
            """(pixel, vector, lane) over a row of a chunk: vectorized along the chunk's channels,
            or, planar, along the row's pixels (a chunk is then one channel)."""
            if affine.planar:
                with T.vectorized(0, width) as w:
                    yield w, 0, 0
                return
            with (T.serial(0, width) as w, (T.unroll if unroll else T.serial)(0, chunk // vector) as v,
                  T.vectorized(0, vector) as lane):
                yield w, v, lane

        def copy(i: int, n, j, h) -> None:
            """Input i's chunk j (counted from its first) of row h of image n."""
            block = affine.inputs[i][1]
            with row_of_chunk(unroll=True) as (w, v, lane):
                c_in = j * chunk + v * vector + lane
                c_out = (starts[i] + j) * chunk + v * vector + lane
                value = xs[i][n, c_in // block, h, w, c_in % block]
                if scale is not None:
                    value = value * scale[c_out]
                if shift is not None:
                    value = value + shift[c_out]
                if activation is not None and inline:
                    value = activation_expr(activation, value, affine.alpha)
                T.buffer_store(y, value, [n, c_out // out_block, h, w, c_out % out_block])

        def activate(activation: str, n, j, h) -> None:
            """The activation over output chunk j of row h, in place (in L1): one copy of it in the
            kernel, not one an input (GELU's took 49 s to compile for 9 inputs)."""
            with row_of_chunk(unroll=False) as (w, v, lane):
                c_out = j * chunk + v * vector + lane
                index = [n, c_out // out_block, h, w, c_out % out_block]
                T.buffer_store(y, activation_expr(activation, y[tuple(index)], affine.alpha), index)

        def search(lo: int, hi: int, n, j, h) -> None:
            """The copy of the input among lo..hi-1 whose chunk range holds output chunk j."""
            if hi - lo == 1:
                copy(lo, n, j - starts[lo], h)
                return
            mid = (lo + hi) // 2
            with T.If(j < starts[mid]):
                with T.Then():
                    search(lo, mid, n, j, h)
                with T.Else():
                    search(mid, hi, n, j, h)

        with T.sblock("root"), T.parallel(0, n_images * chunks * height) as task:
            n, j, h = T.Bind(task // (chunks * height)), T.Bind(task // height % chunks), T.Bind(task % height)
            search(0, len(xs), n, j, h)
            if activation is not None and not inline:
                activate(activation, n, j, h)
    return builder.get()


def choose_out_block(channels: Sequence[int], blocks: Sequence[int], lanes: int) -> int:
    """The output block: the largest of the inputs' blocks and 2 or 1 vectors that divides the
    channels (a consumer convolution then reads it as its input block), else the largest power
    of two that does."""
    total = sum(channels)
    for block in sorted({*blocks, 2 * lanes, lanes}, reverse=True):
        if total % block == 0:
            return block
    return math.gcd(total, 1 << 10) if total else 1
