"""The depthwise convolution microkernel for LLVM CPUs (a tensor intrinsic, like the BRGEMM).

A depthwise convolution has no reduction over channels: each output channel sums KH x KW
products of its own input channel. Vectorized over the channel block alone, every multiply-add
loads both operands (an input vector and a weight vector) and the accumulator goes through
memory between kernel taps: at most half the FMA issue rate, 19-49% of peak measured in
MobileNet-v2 (stride 2 the worst). The microkernel keeps an m_r x n_r tile of outputs (pixels x
channels) in vector registers for the whole KH x KW reduction, loads each weight vector once per
tile and, unrolled over a filter row, loads each input vector once for every tap that reads it
(LLVM merges the identical loads of overlapping windows):

    C[m, n] = sum_{kh, kw} A[kh * dh, m * s + kw * dw, n] * B[kh, kw, n]

A is a window of one blocked input channel block (rows, pixels, channels), B the block's
weights (KH, KW, channels), C the tile of the blocked output.

The same tile serves grouped convolutions with `group` (2, 4, 8) input and output channels a
group, several groups to a vector (ResNeXt's 32 groups of 4 or 8): each output lane sums the
`group` channels of its own group, so for each channel i of a group the input vector is
shuffled to repeat that channel over the group's lanes (`vshufps`/`vpermps`, one per
multiply-add) and B holds the weights per channel i (KH, KW, group, channels):

    C[m, n] = sum_{kh, kw, i} A[kh * dh, m * s + kw * dw, n // group * group + i] * B[kh, kw, i, n]

Vectorized over whole groups instead, such a layer ran with 4- or 8-lane vectors at 60-90
GFLOP/s and needed its activations re-blocked around it; zero weights filling a dense block
would give NaN for an infinite input (0 * inf) where the convolution gives inf.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from ..target import VectorISA
from .cpu import operand_buffer
from .registry import register_once


@dataclasses.dataclass(frozen=True)
class DepthwiseTile:
    """Shape of one depthwise microkernel call."""

    m_r: int  # output pixels of one row
    n_r: int  # channels: a multiple of `lanes`
    lanes: int
    kernel: tuple[int, int]  # (KH, KW)
    stride: int = 1  # horizontal stride (one output row per call: the vertical one is outside)
    dilation: tuple[int, int] = (1, 1)
    dtype: str = "float32"
    group: int = 1  # channels a group (1: depthwise)

    @property
    def vectors(self) -> int:
        return self.n_r // self.lanes

    def registers(self) -> int:
        """Accumulators, the weight vectors of one tap and one input vector (and its shuffle)."""
        return self.m_r * self.vectors + 1 + self.vectors + (self.group > 1)

    def b_shape(self) -> tuple[int, ...]:
        return (*self.kernel, self.n_r) if self.group == 1 else (*self.kernel, self.group, self.n_r)

    def a_shape(self) -> tuple[int, int, int]:
        (kh, kw), (dh, dw) = self.kernel, self.dilation
        return ((kh - 1) * dh + 1, (self.m_r - 1) * self.stride + (kw - 1) * dw + 1, self.n_r)

    def validate(self, isa: VectorISA | None = None) -> None:
        if self.dtype != "float32":
            raise ValueError(f"depthwise microkernel: dtype {self.dtype} is not supported (float32 only)")
        if min(self.m_r, self.n_r, self.lanes, self.stride, *self.kernel, *self.dilation) < 1:
            raise ValueError(f"depthwise microkernel: every extent must be positive: {self}")
        if self.n_r % self.lanes:
            raise ValueError(f"depthwise microkernel: n_r={self.n_r} is not a multiple of the {self.lanes} lanes")
        if self.lanes % self.group:
            raise ValueError(f"depthwise microkernel: groups of {self.group} channels do not tile {self.lanes} lanes")
        if isa is not None and self.registers() > isa.registers:
            raise ValueError(f"depthwise microkernel: a {self.m_r}x{self.n_r} tile needs {self.registers()} "
                             f"vector registers, {isa.name} has {isa.registers}")

    @property
    def name(self) -> str:
        (kh, kw), (dh, dw) = self.kernel, self.dilation
        return (f"tvm_ext.depthwise_{self.dtype}_{self.m_r}x{self.n_r}_l{self.lanes}_k{kh}x{kw}"
                f"_s{self.stride}_d{dh}x{dw}" + (f"_g{self.group}" if self.group > 1 else ""))


def _buffers(tile: DepthwiseTile, strided: bool) -> tuple[tirx.Buffer, tirx.Buffer, tirx.Buffer]:
    """Parameters a, b, c and their buffers; `strided`: any strides (the implementation runs on
    views of the blocked tensors)."""
    shapes = (tile.a_shape(), tile.b_shape(), (tile.m_r, tile.n_r))
    return tuple(operand_buffer(T.arg(name, T.handle()), shape, tile.dtype, strided)
                 for name, shape in zip("abc", shapes, strict=True))


@contextlib.contextmanager
def _root(tile: DepthwiseTile, a: tirx.Buffer, b: tirx.Buffer, c: tirx.Buffer):
    """The root block: reads all of A and B, writes all of C (which starts at zero)."""
    with T.sblock("root"):
        T.reads(a[tuple(slice(0, e) for e in a.shape)], b[tuple(slice(0, e) for e in b.shape)])
        T.writes(c[0:tile.m_r, 0:tile.n_r])
        yield


def _description(tile: DepthwiseTile) -> tirx.PrimFunc:
    """C = the tile's sum over the filter taps (and a group's channels), one multiply-add per
    block: what tensorize matches."""
    (dh, dw), s, g = tile.dilation, tile.stride, tile.group
    extents = [tile.m_r, tile.n_r, *tile.kernel] + ([g] if g > 1 else [])
    names = ["m", "n", "kh", "kw", "i"][:len(extents)]
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("desc")
        a, b, c = _buffers(tile, strided=False)
        with _root(tile, a, b, c), T.grid(*extents) as loops, T.sblock("update"):
            IRBuilder.name_many(names, loops)
            # Unit extents bind no iterator (blockize drops them from the tensorized block).
            vm, vn, vkh, vkw, *vi = (
                IRBuilder.name(f"v{loop.name}", (T.axis.spatial if d < 2 else T.axis.reduce)(e, loop)) if e > 1 else 0
                for d, (e, loop) in enumerate(zip(extents, loops, strict=True)))
            channel, weight = (vn, [vkh, vkw, vn]) if g == 1 else (vn // g * g + vi[0], [vkh, vkw, vi[0], vn])
            T.reads(c[vm, vn], a[vkh * dh, vm * s + vkw * dw, channel], b[tuple(weight)])
            T.writes(c[vm, vn])
            with T.init():
                T.buffer_store(c, T.float32(0), [vm, vn])
            T.buffer_store(c, c[vm, vn] + a[vkh * dh, vm * s + vkw * dw, channel] * b[tuple(weight)], [vm, vn])
    return builder.get()


def _implementation(tile: DepthwiseTile) -> tirx.PrimFunc:
    """The microkernel: accumulators in registers (small "global" arrays indexed by constants, as
    in the BRGEMM), a filter row unrolled per kernel row, the tile stored once."""
    (kh_extent, kw_extent), (dh, dw), s = tile.kernel, tile.dilation, tile.stride
    vec, lanes, nv = f"{tile.dtype}x{tile.lanes}", tile.lanes, tile.vectors
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("impl")
        a, b, c = _buffers(tile, strided=True)
        with _root(tile, a, b, c):
            acc = [IRBuilder.name(f"acc{i}", T.alloc_buffer((nv,), vec)) for i in range(tile.m_r)]
            for i in range(tile.m_r):
                for j in range(nv):
                    T.buffer_store(acc[i], T.broadcast(tirx.const(0.0, tile.dtype), lanes), [j])
            with T.serial(0, kh_extent) as kh:
                IRBuilder.name("kh", kh)
                for kw, channel in itertools.product(range(kw_extent), range(tile.group)):
                    for j in range(nv):
                        weight = T.Bind(b.vload([kh, kw, j * lanes] if tile.group == 1
                                                else [kh, kw, channel, j * lanes], vec))
                        for i in range(tile.m_r):
                            value = a.vload([kh * dh, i * s + kw * dw, j * lanes], vec)
                            if tile.group > 1:  # lane l reads channel `channel` of its group
                                value = tirx.Shuffle([value], [tirx.IntImm("int32", lane - lane % tile.group + channel)
                                                               for lane in range(lanes)])
                            T.buffer_store(acc[i], T.call_llvm_pure_intrin(vec, "llvm.fmuladd", value, weight,
                                                                           acc[i][j]), [j])
            for i in range(tile.m_r):
                for j in range(nv):
                    T.buffer_store(c, acc[i][j], [i, slice(j * lanes, (j + 1) * lanes)])
    return builder.get()


@functools.cache
def get_depthwise_intrin(tile: DepthwiseTile) -> str:
    """Register (once) the tensor intrinsic for `tile` and return its name."""
    tile.validate()
    return register_once(tile.name, lambda: (_description(tile), _implementation(tile)))
