"""Direct 2-D convolution in blocked layout, tensorized onto the BRGEMM microkernel (LLVM CPU).

Activations are NCHW[x]c, weights OIHW[x]i[y]o (x = input-channel block, y = output-channel
block = the microkernel's n_r). Each microkernel call computes m_r output pixels of one row times
n_r output channels, reducing over (input-channel blocks, kh, kw) x channels in registers. No
im2col and no packing at run time: the blocked tensors have the storage of the plain ones (the
input carries its zero border, whose bytes :meth:`Conv2dPlan.pad_bytes` reports), and the tiles
are stored straight into the output. The kernel is TensorIR generated from the plan
(:func:`conv2d_blocked_func`) and scheduled by :func:`schedule_conv2d_blocked`; the eager API and
graph edges convert layouts with :func:`pack_data_func`, :func:`pack_weight_func` and an
epilogue that writes NCHW.

Depthwise convolution (one input channel per group) has no reduction over channels to batch, so
it gets its own microkernel (:mod:`tvm_ext.intrin.cpu_depthwise`: pixels x the channel block in
registers over the filter); so do groups of 2-8 channels in and out ("grouped": several groups
to a vector). Other groups whose channels do not fill a vector block, and every other case
outside the tensorized paths, use the direct (untensorized) schedule, with the reason logged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence

import ml_dtypes
import numpy as np
import tvm
from tvm import s_tir, te, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from ..intrin.cpu import BRGEMM, DOT_TYPES, EMULATED_BF16, b_rows_for, default_tile, get_brgemm_intrin, register_tiles
from ..intrin.cpu_depthwise import DepthwiseTile, get_depthwise_intrin
from ..target import AVX2, AVX512, CPU_FEATURES_ATTR, NEON, SSE, VectorISA
from .common import (
    ACTIVATIONS,
    KERNEL_ATTR,
    USER_ALIGNMENT,
    accept_user_alignment,
    activation_expr,
    bf16_bits,
    load_value,
    normalize_padding,
    pair,
    param_buffer,
    scratch_buffer,
    with_border,
)
from .quantized import Quantization, QuantizedSum, quantized_sum
from .transpose import transpose8x8


@dataclasses.dataclass(frozen=True)
class Conv2dWorkload:
    """A forward convolution in NCHW/OIHW terms, validated."""

    N: int
    C: int
    H: int
    W: int
    K: int
    KH: int
    KW: int
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int, int, int] = (0, 0, 0, 0)
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1
    # "float32"; "bfloat16" (data and weights bf16, fp32 sums and output); "int8" (uint8 data,
    # int8 weights, int32 sums, then the output's quantization: :class:`Epilogue`)
    dtype: str = "float32"

    @staticmethod
    def make(x_shape: Sequence[int], w_shape: Sequence[int], stride: int | Sequence[int] = 1,
             padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1, groups: int = 1,
             dtype: str = "float32") -> Conv2dWorkload:
        if len(x_shape) != 4:
            raise ValueError(f"conv2d: data must be 4-D NCHW, got shape {tuple(x_shape)}")
        if len(w_shape) != 4:
            raise ValueError(f"conv2d: weight must be 4-D OIHW, got shape {tuple(w_shape)}")
        if dtype not in DOT_TYPES:
            raise ValueError(f"conv2d: dtype {dtype} is not supported (float32, bfloat16 data and weights, or "
                             "int8: uint8 data and int8 weights)")
        N, C, H, W = (int(v) for v in x_shape)
        K, Cg, KH, KW = (int(v) for v in w_shape)
        if groups < 1 or C % groups or K % groups:
            raise ValueError(f"conv2d: groups={groups} must divide in channels {C} and out channels {K}")
        if Cg * groups != C:
            raise ValueError(
                f"conv2d: channel mismatch: data has {C} channels, weight expects {Cg} x {groups} groups"
            )
        wl = Conv2dWorkload(N, C, H, W, K, KH, KW, pair(stride, "stride"), normalize_padding(padding),
                            pair(dilation, "dilation"), int(groups), dtype)
        if min(wl.stride) < 1 or min(wl.dilation) < 1:
            raise ValueError(f"conv2d: stride {wl.stride} and dilation {wl.dilation} must be positive")
        if min(N, C, H, W, K, KH, KW) < 1:
            raise ValueError(f"conv2d: empty tensor in shapes {tuple(x_shape)}, {tuple(w_shape)}")
        if wl.OH < 1 or wl.OW < 1:
            raise ValueError(
                f"conv2d: kernel {KH}x{KW} (dilation {wl.dilation}) is larger than the padded input "
                f"{wl.H + wl.padding[0] + wl.padding[2]}x{wl.W + wl.padding[1] + wl.padding[3]}"
            )
        return wl

    @property
    def HP(self) -> int:
        return self.H + self.padding[0] + self.padding[2]

    @property
    def WP(self) -> int:
        return self.W + self.padding[1] + self.padding[3]

    @property
    def OH(self) -> int:
        return (self.HP - (self.KH - 1) * self.dilation[0] - 1) // self.stride[0] + 1

    @property
    def OW(self) -> int:
        return (self.WP - (self.KW - 1) * self.dilation[1] - 1) // self.stride[1] + 1

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        """The NCHW output shape."""
        return (self.N, self.K, self.OH, self.OW)

    @property
    def flops(self) -> int:
        return 2 * self.N * self.K * (self.C // self.groups) * self.KH * self.KW * self.OH * self.OW

    @property
    def depthwise(self) -> bool:
        return self.groups == self.C and self.groups > 1 and self.K == self.C

    @property
    def data_dtype(self) -> str:
        return DOT_TYPES[self.dtype].a

    @property
    def weight_dtype(self) -> str:
        return DOT_TYPES[self.dtype].b

    @property
    def sum_dtype(self) -> str:
        """What the products are summed in: float32, or int32 for int8."""
        return DOT_TYPES[self.dtype].c


@dataclasses.dataclass(frozen=True)
class Conv2dPlan:
    """How a workload maps onto the blocked layouts and the microkernel."""

    wl: Conv2dWorkload
    kind: str  # "brgemm", "depthwise", "grouped" or "direct"
    ic_bn: int  # channels per input block (x)
    oc_bn: int  # channels per output block (y); n_r of the microkernel
    m_r: int  # output pixels per microkernel call
    reason: str = ""  # why not "brgemm"
    # The analytic schedule's order of an image's rows (:func:`order_rows`; tuning samples the
    # blockings in between): output block outer ("ob_oh": its weights are reused by every row)
    # or row outer ("oh_ob": one input row is reused by every block). Rows
    # outer won 1.1-1.25x on isolated ResNet-50 1x1 layers at batch 16 but measured neutral to
    # slightly slower inside the network (1332 vs 1309 ms at batch 16), so it is the default only
    # for strided 1x1 layers whose weights fit the last-level cache (:func:`plan_conv2d`).
    # "ob_n_oh": output block outer, then the images, then their rows: a block's weights are
    # reused over every image of the call, for small images (:data:`IMAGES_INSIDE_BLOCKS`).
    row_order: str = "ob_oh"
    # Read the data in NCHW, as a view of channel blocks a plane apart (no packing copy): for
    # convolutions without padding (the packed input carries the zero border), on the BRGEMM,
    # which broadcasts its input element by element (:func:`nchw_input_reason`).
    nchw_in: bool = False
    # Read the weights in OIHW, as a caller holds them, and lay out each output block's in a
    # scratch of the task that computes the block, before its rows (:func:`weight_block_reason`):
    # a stateless call's weights are read once instead of written blocked and read again.
    # Tasks are then the output blocks, each with all its rows.
    oihw_weight: bool = False
    # The data's channels per block where a grouped convolution reads each group from the wider
    # blocks its producer wrote (each group within one block; ic_bn is then the group's channels),
    # instead of a copy re-blocked to ic_bn (:func:`plan_conv2d`). 0: the data's blocks are ic_bn.
    data_bn: int = 0
    # The microkernel's engine: "fma" (vector registers), "amx" (a bfloat16 or int8 workload on
    # AMX tiles: :mod:`tvm_ext.intrin.cpu_amx`) or "emulated" (a bfloat16 workload on FMA, the
    # data fp32 holding bf16 values: :data:`~tvm_ext.intrin.cpu.EMULATED_BF16`)
    engine: str = "fma"
    # Output channels per microkernel call where fewer than a block (0: the block, oc_bn): AMX's
    # int8 tiles take 32 a call, and blocks of 64 let the next int8 convolution read whole
    # 64-byte tile rows of them.
    n_r: int = 0

    @property
    def tile_n(self) -> int:
        """Output channels per microkernel call."""
        return self.n_r or self.oc_bn

    @property
    def b_rows(self) -> int:
        """Rows of weight vectors the microkernel keeps live a step (:func:`~tvm_ext.intrin.cpu.b_rows_for`)."""
        return b_rows_for(self.engine)

    @property
    def data_dtype(self) -> str:
        """The data's element type as the kernel reads it (emulated bf16: fp32 of bf16 values)."""
        return EMULATED_BF16.a if self.engine == "emulated" else self.wl.data_dtype

    @property
    def in_bn(self) -> int:
        """Channels per block of the data as the kernel reads it."""
        return self.data_bn or self.ic_bn

    @property
    def K_pad(self) -> int:
        """Output channels rounded up to whole blocks (padded weights are zero)."""
        return -(-self.wl.K // self.oc_bn) * self.oc_bn

    @property
    def ICB(self) -> int:
        return self.wl.C // self.ic_bn

    @property
    def OCB(self) -> int:
        return self.K_pad // self.oc_bn

    def data_shape(self) -> tuple[int, ...]:
        """Blocked, padded input: N, C/x, H+pads, W+pads, x (NCHW with :attr:`nchw_in`)."""
        if self.nchw_in:
            return (self.wl.N, self.wl.C, self.wl.H, self.wl.W)
        return (self.wl.N, self.wl.C // self.in_bn, self.wl.HP, self.wl.WP, self.in_bn)

    def data_view(self, data: tirx.Buffer) -> tirx.Buffer:
        """The kernel's blocked view (N, C/x, H, W, x) of its NCHW `data` (:attr:`nchw_in`)."""
        wl, plane = self.wl, self.wl.H * self.wl.W
        return IRBuilder.name("X_blocks", T.decl_buffer(
            (wl.N, self.ICB, wl.H, wl.W, self.ic_bn), self.data_dtype, data=data.data,
            strides=(wl.C * plane, self.ic_bn * plane, wl.W, 1, plane)))

    def weight_shape(self) -> tuple[int, ...]:
        """The weight parameter's shape: blocked (OIHW with :attr:`oihw_weight`)."""
        wl = self.wl
        if self.oihw_weight:
            return (wl.K, wl.C // wl.groups, wl.KH, wl.KW)
        return self.blocked_weight_shape()

    def blocked_weight_shape(self) -> tuple[int, ...]:
        wl = self.wl
        g = DOT_TYPES[wl.dtype].group
        if g > 1:  # groups of input channels innermost (the dot-product instruction's: bf16 pairs, int8 4)
            return (self.OCB, wl.C // self.ic_bn, wl.KH, wl.KW, self.ic_bn // g, self.oc_bn, g)
        if self.kind == "depthwise":
            return (self.OCB, wl.KH, wl.KW, self.oc_bn)
        if self.kind == "grouped":  # per output block, the weights of each channel of a group
            return (self.OCB, wl.KH, wl.KW, wl.C // wl.groups, self.oc_bn)
        return (self.OCB, (wl.C // wl.groups) // self.ic_bn, wl.KH, wl.KW, self.ic_bn, self.oc_bn)

    def out_shape(self) -> tuple[int, ...]:
        return (self.wl.N, self.OCB, self.wl.OH, self.wl.OW, self.oc_bn)

    def pad_bytes(self) -> int:
        """Bytes the zero border adds to the input over the plain tensor."""
        wl = self.wl
        return tvm.DataType(self.data_dtype).bits // 8 * wl.N * wl.C * (wl.HP * wl.WP - wl.H * wl.W)

    def row_segments(self) -> list[tuple[str, int, int]]:
        """(block name, width, first pixel) of each row segment: whole m_r tiles, then a tail.

        Each is a block of its own, so that no microkernel call runs past the row and no tile
        needs a predicate. Untensorized kinds have one segment.
        """
        ow = self.wl.OW
        tail = ow % self.m_r if self.kind in ("brgemm", "depthwise", "grouped") else 0
        if tail == 0 or tail == ow:
            return [("conv", ow, 0)]
        return [("conv", ow - tail, 0), ("conv_tail", tail, ow - tail)]

    def reduce_axes(self) -> list[str]:
        return {"depthwise": ["kh", "kw"], "grouped": ["kh", "kw", "ic"]}.get(self.kind, ["icb", "kh", "kw", "ic"])

    def channel_pad_bytes(self) -> int:
        """Bytes of zero output channels added to fill the last block."""
        return 4 * self.wl.N * (self.K_pad - self.wl.K) * self.wl.OH * self.wl.OW


def largest_divisor(n: int, limit: int, multiple_of: int = 1) -> int:
    """The largest divisor of `n` up to `limit` that is a multiple of `multiple_of` (0 if none)."""
    for d in range(min(n, limit), 0, -1):
        if n % d == 0 and d % multiple_of == 0:
            return d
    return 0


DEPTHWISE_ACCUMULATORS = 8


def depthwise_m_r(channels: int, lanes: int) -> int:
    """Output pixels per depthwise microkernel call of `channels` (the whole channel block): about
    DEPTHWISE_ACCUMULATORS vector accumulators. Measured on MobileNet-v2's depthwise layers at
    batch 16 (AVX2, 1 thread): with 32-channel blocks 2 pixels beat 3 and 4 (13 and 27% less
    time), with 24-channel blocks 3 beat 4 and 5; tiles narrower than the block (4 x 16, 8 x 8)
    were 25-40% slower than the block-wide ones, and slower than no microkernel at stride 2 (every
    pass over the row touches a share of each pixel's cache lines). Unmeasured on AVX-512."""
    vectors = max(1, channels // lanes)
    return -(-DEPTHWISE_ACCUMULATORS // vectors)


ROWS_OUTER_WEIGHT_BYTES = 4 << 20  # a strided 1x1 with more weights keeps blocks outer (plan_conv2d)
# (images, pixels): from this many images per call, an output of at most this many pixels per
# image runs its images inside each output block ("ob_n_oh"), so that the block's weights are read
# once for all of them instead of once per image. Such a layer reuses each weight only over a few
# pixels of an image: 16-49 for ResNet-50's 7 x 7 layers and the Winograd GEMMs of its 14 x 14
# and 7 x 7 ones, whose weights (4-38 MB) stream from memory for every image. Measured on a Zen 1
# (AVX2, 1 thread, cold weights, per image), images outer -> inside, 4 images: Winograd GEMMs
# 14 x 14 F(4, 3) 2.36 -> 2.12 ms, 7 x 7 F(2, 3) 4.20 -> 3.74, 7 x 7 F(4, 3) 3.94 -> 2.40; 7 x 7
# 1x1 layers 2.87-2.95 -> 2.77-2.79; 3x3 stride 2 to 7 x 7 6.87 -> 6.56; 14 x 14 1x1 layers
# (196 pixels) the same or slower. At 2 images the gain was 1-5%, at 8 about the same as at 4.
IMAGES_INSIDE_BLOCKS = (4, 64)


def data_block_reason(wl: Conv2dWorkload, isa: VectorISA, data_bn: int) -> str | None:
    """Why a convolution of `wl` cannot read its data in blocks of `data_bn` channels wider than
    its own (:attr:`Conv2dPlan.data_bn`), or None if it can."""
    cg = wl.C // wl.groups
    if wl.groups == 1 or wl.depthwise or cg % isa.lanes or (wl.K // wl.groups) % isa.lanes:
        return "only a grouped convolution of whole vectors per group reads wider blocks"
    if data_bn <= cg or data_bn % cg or wl.C % data_bn:
        return f"blocks of {data_bn} channels do not hold whole groups of {cg}"
    return None


# int8 convolutions write blocks of this many output channels where K allows: a 64-byte row of an
# AMX tile of the next layer's input
INT8_BLOCK = 64


def _output_blocks(wl: Conv2dWorkload, tile_n: int, n_r: int | None) -> tuple[int, int]:
    """(oc_bn, Conv2dPlan.n_r) for microkernel calls of `tile_n` output channels: int8 blocks of
    :data:`INT8_BLOCK` (several calls each) where K allows and no n_r was asked for, so that the
    next int8 layer reads whole 64-byte groups of channels whichever engine wrote them."""
    if wl.dtype == "int8" and n_r is None and wl.groups == 1 and wl.K % INT8_BLOCK == 0 and INT8_BLOCK % tile_n == 0:
        return INT8_BLOCK, tile_n if tile_n != INT8_BLOCK else 0
    return tile_n, 0


def plan_conv2d(wl: Conv2dWorkload, isa: VectorISA, m_r: int | None = None, n_r: int | None = None,
                ic_bn: int | None = None, row_order: str | None = None, data_bn: int | None = None,
                engine: str = "fma") -> Conv2dPlan:
    """Choose blocking and register tile analytically (tuning overrides m_r / n_r / ic_bn).

    `data_bn`: read the data in its producer's blocks of that many channels, wider than a group
    (:func:`data_block_reason`): each group is one block of the kernel's (ic_bn = the group's
    channels), at an offset in a block of the data. `engine` "amx": a bfloat16 workload on AMX
    tiles (the CPU must have AMX-BF16: :func:`~tvm_ext.target.has_amx_bf16`), blocks of 32
    channels (a tile row of bf16 inputs; 16 output channels a tile) and rows of up to 32 pixels;
    or an int8 workload (AMX-INT8), blocks of 64 channels. "emulated": a bfloat16 workload on any
    vector ISA's FMA (:data:`~tvm_ext.intrin.cpu.EMULATED_BF16`), tiles that leave room for a row
    of pairs widened into two."""
    if engine == "amx":
        if wl.dtype not in ("bfloat16", "int8"):
            raise ValueError(f"conv2d: the AMX engine takes bfloat16 or int8, not {wl.dtype}")
        plan = plan_conv2d(wl, AVX512, row_order=row_order)
        g = DOT_TYPES[wl.dtype].group
        ic = ic_bn or largest_divisor(wl.C, 16 * g, g)
        _check_groups_of_k(wl, ic)
        block, tile_n = _output_blocks(wl, n_r or (32 if wl.K > 16 else 16), n_r)
        return dataclasses.replace(plan, ic_bn=ic, oc_bn=block, m_r=m_r or min(32, wl.OW), engine="amx", n_r=tile_n)
    if engine == "emulated" and wl.dtype != "bfloat16":
        raise ValueError(f"conv2d: the emulated engine takes bfloat16, not {wl.dtype}")
    if engine not in ("fma", "emulated"):
        raise ValueError(f"conv2d: engine {engine!r} is not 'fma', 'amx' or 'emulated'")
    if data_bn is not None:
        reason = data_block_reason(wl, isa, data_bn)
        if reason is not None:
            raise ValueError(f"conv2d: data_bn={data_bn}: {reason}")
        if row_order is None and wl.C == data_bn:
            # The data is one block, which its producer's threads shared by rows: so do these, or
            # each thread reads the rows the other wrote (RegNet-X's 32 x 112 x 112 stride-2
            # layer: 157 -> 80 us on 2 threads; with several blocks, threads share blocks alike).
            row_order = "oh_ob"
        return dataclasses.replace(plan_conv2d(wl, isa, m_r, n_r, wl.C // wl.groups, row_order), data_bn=data_bn)
    lanes = isa.lanes
    Cg, Kg = wl.C // wl.groups, wl.K // wl.groups
    if wl.dtype != "float32":
        reason = low_precision_reason(wl, isa, engine)
        if reason is not None:
            raise ValueError(f"conv2d: {wl.dtype}: {reason}")
    if wl.depthwise:
        oc_bn = n_r or largest_divisor(wl.C, 4 * lanes, lanes) or largest_divisor(wl.C, 4 * lanes)
        return Conv2dPlan(wl, "depthwise", oc_bn, oc_bn, m_r or min(wl.OW, depthwise_m_r(oc_bn, lanes)))
    if wl.groups > 1 and Cg == Kg < lanes and lanes % Kg == 0 and wl.C % lanes == 0:
        oc_bn = n_r or largest_divisor(wl.C, lanes, lanes)
        return Conv2dPlan(wl, "grouped", oc_bn, oc_bn, m_r or min(wl.OW, depthwise_m_r(oc_bn, lanes)))
    if wl.groups > 1 and Kg % lanes:
        ic = largest_divisor(Cg, 16)
        kb = largest_divisor(Kg, 64)
        reason = f"grouped conv with {Kg} output channels per group (not a multiple of {lanes} lanes)"
        return Conv2dPlan(wl, "direct", ic, kb, 1, reason)
    if wl.groups > 1:
        n_choices = [v for v in range(lanes, 4 * lanes + 1, lanes) if Kg % v == 0]
    else:
        k_pad = -(-wl.K // lanes) * lanes
        n_choices = [v for v in range(lanes, 4 * lanes + 1, lanes) if k_pad % v == 0]
    if n_r is not None:
        n_choices = [n_r]
    tile = default_tile(isa, n_choices, wl.OW, b_rows_for(engine))
    if m_r is not None:
        tile = (min(m_r, wl.OW), tile[1])
    ic = ic_bn or largest_divisor(Cg, 16 if Cg > 16 else Cg, DOT_TYPES[wl.dtype].group)
    _check_groups_of_k(wl, ic)
    # A strided 1x1 reads a sparse subset of its input (every other pixel of every other row),
    # which the prefetchers fetch poorly: streaming it once per output block cost AVX2 (16-channel
    # blocks, twice AVX-512's passes) 73% -> 91% of peak on ResNet-50's 256x56x56 -> 512 layer,
    # 78% -> 90% on 512x28x28 -> 1024. Rows outer reads it once and keeps the weights in cache
    # instead; on AVX-512 it measured neutral (93-96% either way, 1 and 2 threads). But rows
    # outer reads every weight once per output row, which pays only while the weights stay in
    # the last-level cache: ResNet-50's 1024x14x14 -> 2048 (8 MB of weights) ran at 24 GFLOP/s
    # rows outer and 29 blocks outer on a Zen 1 (8 MB of L3 per 4 cores), cold weights.
    strided_1x1 = (wl.KH, wl.KW) == (1, 1) and max(wl.stride) > 1
    weight_bytes = 4 * wl.K * Cg * wl.KH * wl.KW
    if row_order is None:
        min_images, max_pixels = IMAGES_INSIDE_BLOCKS
        if wl.N >= min_images and wl.OH * wl.OW <= max_pixels:
            row_order = "ob_n_oh"
        elif strided_1x1 and weight_bytes <= ROWS_OUTER_WEIGHT_BYTES:
            row_order = "oh_ob"
        else:
            row_order = "ob_oh"
    block, tile_n = _output_blocks(wl, tile[1], n_r)
    return Conv2dPlan(wl, "brgemm", ic, block, tile[0], row_order=row_order, n_r=tile_n, engine=engine)


def _check_groups_of_k(wl: Conv2dWorkload, ic_bn: int) -> None:
    """Raise ValueError (before any kernel is generated) if blocks of `ic_bn` input channels do not
    hold whole groups of the dot-product instruction's channels (bf16 pairs, int8 4)."""
    group = DOT_TYPES[wl.dtype].group
    if ic_bn % group or wl.C % ic_bn:
        raise ValueError(f"conv2d: {wl.dtype}: blocks of {ic_bn} input channels (of {wl.C}) are not whole "
                         f"groups of {group}")


def low_precision_reason(wl: Conv2dWorkload, isa: VectorISA, engine: str = "fma") -> str | None:
    """Why a bfloat16 or int8 convolution `wl` has no kernel on `isa`, or None. The BRGEMM's
    groups of input channels need a dot-product instruction: bf16 pairs AVX512-BF16 (16 lanes;
    :func:`~tvm_ext.target.has_avx512_bf16` says whether the CPU has it) or the "emulated"
    engine (any ISA), int8's groups of 4 AVX512-VNNI (16 lanes) or AVX-VNNI (8;
    :func:`~tvm_ext.target.has_vnni`); whole groups of input channels; only dense convolutions
    take them so far."""
    g = DOT_TYPES[wl.dtype].group
    if wl.dtype == "bfloat16" and isa.lanes != 16 and engine != "emulated":
        return f"the {isa.name} BRGEMM has no bf16 dot product (AVX512-BF16 only)"
    if wl.dtype == "int8" and isa.lanes not in (8, 16):
        return f"the {isa.name} BRGEMM has no int8 dot product (AVX512-VNNI or AVX-VNNI)"
    if wl.groups != 1:
        return f"{wl.groups} groups (dense convolutions only)"
    if wl.C % g:
        return f"{wl.C} input channels: not groups of {g}"
    return None



def nchw_input_reason(plan: Conv2dPlan) -> str | None:
    """Why `plan` cannot read its data in NCHW (:attr:`Conv2dPlan.nchw_in`), or None if it can."""
    if plan.kind != "brgemm":
        return f"a {plan.kind} convolution reads channel vectors"
    if plan.wl.dtype != "float32":
        return f"{plan.wl.dtype} reads groups of channels as one word: blocked data"
    if plan.data_bn:
        return "it reads its producer's blocks"
    if any(plan.wl.padding):
        return "padding: the blocked copy carries the zero border"
    if plan.wl.H * plan.wl.W == 1:  # a classifier's features: tuned records name the blocked kernel
        return "a one-pixel image: its blocked layout is the same memory (a view)"
    return None


# A separate packing pass writes the blocked weights and the convolution reads them again: a cost
# that shows from about this many bytes of weights (ResNet-50's 1024 -> 2048 1x1 layer: 8 MB,
# packed in 0.23 ms against its convolution's 0.77 at batch 1).
WEIGHT_BLOCK_MIN_BYTES = 1 << 20
# Output blocks per thread from which tasks of whole output blocks share out evenly enough
# (threads take contiguous ranges of tasks: 8 blocks on 2 threads, 4 each; 9, 5 and 4).
WEIGHT_BLOCKS_PER_THREAD = 4


def weight_block_reason(plan: Conv2dPlan, threads: int = 1) -> str | None:
    """Why `plan` should not lay out its OIHW weights per task (:attr:`Conv2dPlan.oihw_weight`)
    when it runs on `threads` threads, or None if it should."""
    wl = plan.wl
    if plan.kind != "brgemm" or wl.groups > 1:
        return f"a {plan.kind if plan.kind != 'brgemm' else 'grouped'} convolution"
    if not _tiled_weights(plan):
        return f"blocks of {plan.ic_bn} x {plan.oc_bn} channels do not tile by 8 x 8"
    if 4 * wl.K * wl.C * wl.KH * wl.KW < WEIGHT_BLOCK_MIN_BYTES:
        return "small weights: packed apart in little time"
    if threads > 1 and plan.OCB < WEIGHT_BLOCKS_PER_THREAD * threads:
        return f"{plan.OCB} output blocks: too few tasks for {threads} threads"
    return None


def reading_oihw_weights(plan: Conv2dPlan, threads: int = 1) -> Conv2dPlan:
    """`plan` laying out its OIHW weights per task where that pays on `threads` threads
    (:func:`weight_block_reason`), else `plan`: for calls whose weights come unpacked every time."""
    if weight_block_reason(plan, threads) is None:
        return dataclasses.replace(plan, oihw_weight=True)
    return plan


def reading_nchw(plan: Conv2dPlan) -> Conv2dPlan:
    """`plan` reading its data in NCHW as it is where it can (:func:`nchw_input_reason`), else `plan`."""
    return dataclasses.replace(plan, nchw_in=True) if nchw_input_reason(plan) is None else plan


# the activations whose gradient an epilogue applies as a mask (Epilogue.mask)
MASKS = ("relu", "leaky_relu")
# the values of a quantized output's dtypes
QUANTIZED_RANGES = {"uint8": (0, 255), "int8": (-128, 127)}


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """What happens to each output row after the convolution: + bias, then an activation, and
    where the row goes: it stays blocked, or it is also written to an NCHW output (a graph's exit,
    the eager API) while it is still in L1."""

    bias: bool = False
    residual: bool = False  # + a tensor of the output's shape and layout (a ResNet shortcut)
    activation: str | None = None
    nchw_out: bool = False
    alpha: float = 0.01  # leaky_relu's negative slope
    # A zero border (top, left, bottom, right) around the blocked output: the padded input of the
    # next convolution, written here so that no padded copy of the tensor is made.
    out_pad: tuple[int, int, int, int] = (0, 0, 0, 0)
    # An activation's gradient, last: the value kept where a tensor of the output's shape and
    # layout (the activation's output) is > 0, and zero ("relu") or times alpha ("leaky_relu")
    # elsewhere. A data-gradient convolution then writes the gradient of the activation's input.
    mask: str | None = None
    # The zero border (top, left, bottom, right) around the mask tensor: the activation's output
    # read in its padded copy (the next convolution's input, kept for its weight gradient), so
    # that the unpadded tensor need not outlive the forward pass.
    mask_pad: tuple[int, int, int, int] = (0, 0, 0, 0)
    # An int8 workload's output (its sums are int32, times a per-channel scale: :func:`quantized_value`):
    # "float32", or quantized to "uint8" / "int8" with this zero point (also the value of out_pad's
    # border: the next convolution's padding) after a multiplication by out_scale. A float
    # workload's: "float32", or "bfloat16" (rounded to nearest even: the input of bf16
    # convolutions, written here instead of by a rounding pass of theirs).
    out_dtype: str = "float32"
    zero_point: int = 0
    out_scale: float = 1.0
    # A quantized output written as float32 units, q - zero_point (exact; its border zeros): the
    # input of an int8 depthwise convolution, which sums in float32, with no conversion pass.
    units: bool = False
    # A quantized add fused after the requantization (a ResNet's residual add in a quantized
    # network): this output is one operand (`add.own`), a blocked uint8 tensor of its shape the
    # other (a parameter after the scale); the sum, ONNX Runtime's QLinearAdd, is written instead.
    # With `add.float_own` the unrounded output is the operand (PT2E's conv + add).
    add: QuantizedSum | None = None
    # The residual's element type: "float32", or "bfloat16" where a convolution writes it in bf16
    # for its bf16 readers (`precision="bf16"`): read widened, no fp32 copy of the tensor.
    residual_dtype: str = "float32"

    def __post_init__(self):
        if self.activation is not None and self.activation not in ACTIVATIONS:
            raise ValueError(f"epilogue: activation {self.activation!r} not in {sorted(ACTIVATIONS)}")
        for name in ("out_pad", "mask_pad"):  # JSON gives lists
            border = tuple(int(p) for p in getattr(self, name))
            if len(border) != 4 or min(border) < 0:
                raise ValueError(f"epilogue: {name} must be 4 non-negative ints, got {border}")
            object.__setattr__(self, name, border)
        if self.nchw_out and any(self.out_pad):
            raise ValueError("epilogue: out_pad applies to the blocked output, not to nchw_out")
        if self.mask not in (None, *MASKS):
            raise ValueError(f"epilogue: mask {self.mask!r} not in {MASKS}")
        if any(self.mask_pad) and (self.mask is None or self.nchw_out):
            raise ValueError("epilogue: mask_pad applies to a mask read in the blocked layout")
        if self.out_dtype not in QUANTIZED_RANGES and self.out_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"epilogue: out_dtype {self.out_dtype!r} is not float32, bfloat16, uint8 or int8")
        if self.out_dtype == "bfloat16" and (self.mask or self.nchw_out or self.units or self.add):
            raise ValueError("epilogue: a bfloat16 output is a blocked forward activation (no mask, no NCHW)")
        if self.residual_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"epilogue: residual_dtype {self.residual_dtype!r} is not float32 or bfloat16")
        if self.residual_dtype == "bfloat16" and (not self.residual or self.nchw_out):
            raise ValueError("epilogue: a bfloat16 residual is a blocked residual")
        low, high = QUANTIZED_RANGES.get(self.out_dtype, (0, 0))
        if not low <= self.zero_point <= high:
            raise ValueError(f"epilogue: zero_point {self.zero_point} is outside {self.out_dtype}'s range")
        if self.quantized and (self.residual or self.mask or self.nchw_out):
            raise ValueError("epilogue: a quantized output takes bias and an activation only")
        if self.units and not self.quantized:
            raise ValueError("epilogue: units are those of a uint8 or int8 output")
        if isinstance(self.add, dict):  # read back from a JSON description (tuning.space)
            add = dict(self.add)
            a, b, out = (Quantization(**add[name]) for name in ("a", "b", "out"))
            object.__setattr__(self, "add", QuantizedSum(a, b, out, bool(add["relu"]), str(add["own"]),
                                                         bool(add.get("float_own", False))))
        if self.add is not None and (not self.quantized or self.units or any(self.out_pad)):
            raise ValueError("epilogue: a fused quantized add follows a uint8 output without a border")
        if self.add is not None and self.add.float_own and (self.activation or self.out_scale != 1.0):
            raise ValueError("epilogue: an add of the float output takes the activation after it (add.relu)")

    @property
    def quantized(self) -> bool:
        return self.out_dtype in QUANTIZED_RANGES

    @property
    def buffer_dtype(self) -> str:
        """The output buffer's element type."""
        return "float32" if self.units else self.out_dtype

    def out_shape(self, plan: Conv2dPlan) -> tuple[int, ...]:
        """The blocked output with its border: N, O/y, OH + top + bottom, OW + left + right, y."""
        return with_border(plan.out_shape(), self.out_pad)

    @property
    def empty(self) -> bool:
        """No epilogue pass over the row (a border is written by blocks of its own)."""
        return not (self.bias or self.residual or self.activation or self.nchw_out or self.mask)


# The kernel is built with TVM's IRBuilder, not written as TVMScript text: parsing took 0.1-0.3 s a
# kernel, 8 of the 24 s of a ResNet-50 build. (The same IR: structurally equal.)


def _alias(name: str, of: tirx.Buffer, dtype: str | None = None) -> tirx.Buffer:
    return IRBuilder.name(name, T.decl_buffer(of.shape, dtype or of.dtype, data=of.data))


def _segment(plan: Conv2dPlan, name: str, width: int, start: int, row: tuple, out: tirx.Buffer,
             out_index: Callable, x: tirx.Buffer, w: tirx.Buffer) -> None:
    """The block of one row segment: output pixels [start, start + width) of row `row` (n, ob,
    oh), every channel of the output block, reduced over :meth:`Conv2dPlan.reduce_axes` into
    `out`[out_index(v_n, v_ob, v_oh, v_ow, v_o)]."""
    wl = plan.wl
    (sh, sw), (dh, dw) = wl.stride, wl.dilation
    extents = {"icb": (wl.C // wl.groups) // plan.ic_bn, "kh": wl.KH, "kw": wl.KW,
               "ic": wl.C // wl.groups if plan.kind == "grouped" else plan.ic_bn}
    axes = plan.reduce_axes()
    with T.grid(width, plan.oc_bn, *(extents[axis] for axis in axes)) as (ow, o, *reduce), T.sblock(name):
        IRBuilder.name_many(["ow", "o", *axes], [ow, o, *reduce])
        v_n, v_ob, v_oh = IRBuilder.name_many(["v_n", "v_ob", "v_oh"], T.axis.remap("SSS", list(row)))
        v_ow = IRBuilder.name("v_ow", T.axis.spatial(width, ow))
        v_o = IRBuilder.name("v_o", T.axis.spatial(plan.oc_bn, o))
        v = {axis: IRBuilder.name(f"v_{axis}", T.axis.reduce(extents[axis], r))
             for axis, r in zip(axes, reduce, strict=True)}
        h, col = v_oh * sh + v["kh"] * dh, (v_ow + start) * sw + v["kw"] * dw
        if plan.kind == "depthwise":
            product = x[v_n, v_ob, h, col, v_o] * w[v_ob, v["kh"], v["kw"], v_o]
        elif plan.kind == "grouped":  # channel ic of the group of output channel v_o
            group = wl.C // wl.groups
            product = x[v_n, v_ob, h, col, v_o // group * group + v["ic"]] * w[v_ob, v["kh"], v["kw"], v["ic"], v_o]
        else:
            icb = v["icb"]
            if wl.groups > 1:
                icbg = (wl.C // wl.groups) // plan.ic_bn
                ocbg = (wl.K // wl.groups) // plan.oc_bn
                icb = v_ob // ocbg * icbg + icb
            w_ob = 0 if plan.oihw_weight else v_ob  # (the task's block of weights)
            r = plan.in_bn // plan.ic_bn  # channel blocks of the kernel in a block of the data
            block, channel = (icb // r, icb % r * plan.ic_bn + v["ic"]) if r > 1 else (icb, v["ic"])
            g = DOT_TYPES[wl.dtype].group
            if g > 1:  # products and sums in fp32 (int32 for int8); weights in groups of channels
                weight = w[w_ob, v["icb"], v["kh"], v["kw"], v["ic"] // g, v_o, v["ic"] % g]
                product = tirx.Cast(wl.sum_dtype, x[v_n, block, h, col, channel]) * tirx.Cast(wl.sum_dtype, weight)
            else:
                product = x[v_n, block, h, col, channel] * w[w_ob, v["icb"], v["kh"], v["kw"], v["ic"], v_o]
        index = out_index(v_n, v_ob, v_oh, v_ow, v_o)
        with T.init():
            T.buffer_store(out, tirx.const(0, wl.sum_dtype), index)
        T.buffer_store(out, out[tuple(index)] + product, index)


def _load(buffer: tirx.Buffer | None, index: list) -> tirx.PrimExpr | None:
    return None if buffer is None else load_value(buffer, index)


def _epilogue_value(epilogue: Epilogue, src: tirx.PrimExpr, bias: tirx.PrimExpr | None,
                    residual: tirx.PrimExpr | None, mask: tirx.PrimExpr | None = None) -> tirx.PrimExpr:
    """src (+ bias) (+ residual), then the activation, then the mask."""
    value = src
    if epilogue.bias:
        value = value + bias
    if epilogue.residual:
        value = value + residual
    if epilogue.activation:
        value = activation_expr(epilogue.activation, value, epilogue.alpha)
    if epilogue.mask:
        below = T.float32(0) if epilogue.mask == "relu" else value * T.float32(epilogue.alpha)
        value = T.Select(mask > T.float32(0), value, below)
    return value


def _nearbyint(value: tirx.PrimExpr) -> tirx.PrimExpr:
    """Round to nearest even. LLVM's intrinsic, not tirx.nearbyint: TVM's vectorizer leaves a loop
    with that op scalar, and LLVM's own vectorizer then picked 256-bit vectors (8 lanes)."""
    return T.call_llvm_pure_intrin("float32", "llvm.nearbyint", value)


def quantized_value(epilogue: Epilogue, sums: tirx.PrimExpr, bias: tirx.PrimExpr | None,
                    scale: tirx.PrimExpr, other: tirx.PrimExpr | None = None) -> tirx.PrimExpr:
    """An int8 convolution's output from its int32 sums: (+ bias) in int32, times the channel's
    scale in fp32 (one rounding), the activation; for a uint8/int8 output times out_scale,
    rounded to nearest (ties to even), + the zero point, saturated. Each step is one IEEE fp32
    operation (no multiply-add to contract), so NumPy reproduces it bit for bit. Float32 sums of
    integers below 2**24 (and a float32 bias of integers) give the same, exactly.
    With `epilogue.add`, that value and `other` (the held uint8 of the add's other operand) are
    then added as the add kernel adds them (:func:`~tvm_ext.kernels.quantized.quantized_sum`);
    with `epilogue.add.float_own` the value before any rounding is the operand (PT2E)."""
    value = sums + bias if epilogue.bias else sums
    value = tirx.Cast("float32", value) * scale
    if epilogue.add is not None and epilogue.add.float_own and other is not None:
        # (scale is s_x * s_w / s_out: the float output in units of the sum's scale, unrounded)
        raw_other = tirx.Cast("float32", other) - T.float32(epilogue.add.b.offset)
        return tirx.Cast(epilogue.out_dtype, quantized_sum(value, raw_other, epilogue.add))
    if epilogue.activation:
        value = activation_expr(epilogue.activation, value, epilogue.alpha)
    if not epilogue.quantized:
        return value
    if epilogue.out_scale != 1.0:
        value = value * T.float32(epilogue.out_scale)
    low, high = QUANTIZED_RANGES[epilogue.out_dtype]
    if epilogue.units:  # q - zero_point, saturated alike: rint(v) within [low - z, high - z]
        return T.max(T.min(_nearbyint(value), T.float32(high - epilogue.zero_point)),
                     T.float32(low - epilogue.zero_point))
    value = _nearbyint(value) + T.float32(epilogue.zero_point)
    held = T.max(T.min(value, T.float32(high)), T.float32(low))
    if epilogue.add is not None and other is not None:
        terms = epilogue.add
        own_q, other_q = (terms.a, terms.b) if terms.own == "a" else (terms.b, terms.a)
        own = held - T.float32(own_q.offset)
        raw_other = tirx.Cast("float32", other) - T.float32(other_q.offset)
        held = quantized_sum(*((own, raw_other) if terms.own == "a" else (raw_other, own)), terms)
    return tirx.Cast(epilogue.out_dtype, held)


def _write_nchw(plan: Conv2dPlan, epilogue: Epilogue, row_buffer: tirx.Buffer, width: int, start: int,
                out: tirx.Buffer, bias: tirx.Buffer | None, residual: tirx.Buffer | None,
                mask: tirx.Buffer | None, v_n, v_ob, v_oh) -> None:
    """The NCHW write of one segment's scratch row (pixels x channels): 8x8 register transposes
    for whole tiles, element by element at the edges (a group of 8 channels that K cuts, channels
    past the last group of 8, pixels of a row narrower than 8). Pixels past the last whole tile
    of a wider row take one more transpose, of the row's last 8 pixels: it rewrites some of the
    previous tile's with the same values (ResNet-50's 14 and 28 pixel rows stored 6 and 4 of
    them element by element: 12% of a 3x3 layer's time). The epilogue then runs in place on the
    NCHW rows just written (still in L1), contiguous along pixels as an NCHW residual is."""
    K, oc_bn = plan.wl.K, plan.oc_bn
    tiled, grouped = width // 8 * 8, oc_bn // 8 * 8
    windows = [*(w * 8 for w in range(width // 8)), *([width - 8] if tiled < width and width >= 8 else [])]
    with T.serial(0, oc_bn // 8) as oo, T.If(v_ob * oc_bn + oo * 8 + 8 <= K):
        with T.Then():
            for first in windows:
                transpose8x8(lambda i, first=first: row_buffer[first + i, T.Ramp(oo * 8, 1, 8)],
                             lambda j, value, first=first: T.buffer_store(
                                 out, value, [v_n, v_ob * oc_bn + oo * 8 + j, v_oh, T.Ramp(start + first, 1, 8)]))
        with T.Else(), T.grid(8, width) as (oi, v_ow), T.If(v_ob * oc_bn + oo * 8 + oi < K), T.Then():
            T.buffer_store(out, row_buffer[v_ow, oo * 8 + oi], [v_n, v_ob * oc_bn + oo * 8 + oi, v_oh, start + v_ow])
    with T.grid(oc_bn - grouped, width) as (v_o, v_ow), T.If(v_ob * oc_bn + grouped + v_o < K), T.Then():
        T.buffer_store(out, row_buffer[v_ow, grouped + v_o], [v_n, v_ob * oc_bn + grouped + v_o, v_oh, start + v_ow])
    if width < 8:
        with T.grid(grouped, width) as (v_o, v_ow), T.If(v_ob * oc_bn + v_o < K), T.Then():
            T.buffer_store(out, row_buffer[v_ow, v_o], [v_n, v_ob * oc_bn + v_o, v_oh, start + v_ow])
    if not epilogue.empty:
        with T.serial(0, oc_bn) as v_o, T.If(v_ob * oc_bn + v_o < K), T.Then(), T.serial(0, width) as v_ow:
            index = [v_n, v_ob * oc_bn + v_o, v_oh, start + v_ow]
            T.buffer_store(out, _epilogue_value(epilogue, out[tuple(index)], _load(bias, [v_ob, v_o]),
                                                _load(residual, index), _load(mask, index)), index)


def _scratch_rows(plan: Conv2dPlan, row: tuple, x: tirx.Buffer, w: tirx.Buffer) -> tuple[list, tuple]:
    """Each row segment's sums in a scratch row of its own (L1-sized, private to the task;
    declared inside the parallel loop: one per task. A block there to hold them would break
    blockize, which drops bindings to variables outside its scope), for an epilogue that writes
    them elsewhere; and the row's (n, ob, oh) bound for it."""
    rows = [scratch_buffer(f"{name}_row", (width, plan.oc_bn), plan.wl.sum_dtype)
            for name, width, _ in plan.row_segments()]
    for (name, width, start), row_buffer in zip(plan.row_segments(), rows, strict=True):
        _segment(plan, name, width, start, row, row_buffer, lambda *v: [v[3], v[4]], x, w)
    return rows, tuple(IRBuilder.name(f"v_{name}", T.Bind(v)) for name, v in zip(("n", "ob", "oh"), row, strict=True))


@functools.lru_cache(maxsize=1024)
def conv2d_blocked_func(plan: Conv2dPlan, epilogue: Epilogue = Epilogue()) -> tirx.PrimFunc:
    """The unscheduled blocked convolution (+ epilogue) as TensorIR, generated from the plan.

    Parameters: data (N, C/x, H+pads, W+pads, x), weight (O/y, I/x, KH, KW, x, y) or depthwise
    (O/y, KH, KW, y) (OIHW with `plan.oihw_weight`), [bias (O/y, y)], [residual, in the output's
    shape and layout], [mask, likewise], then the output: blocked (N, O/y, OH, OW, y), or NCHW (N, K, OH, OW) with
    `epilogue.nchw_out`. An int8 workload takes its int32 bias and then a per-channel fp32 scale
    (O/y, y) after the weight, [with `epilogue.add` the add's other operand, blocked uint8 of the
    output's shape], and writes its output as `epilogue.out_dtype` says
    (:func:`quantized_value`). One parallel task per output row (per output block with
    `plan.oihw_weight`, which lays out the block's weights first); inside a row the row is whole m_r tiles ("conv"), one
    narrower tail ("conv_tail") and the epilogue, applied while the row is in L1. Blocked, the
    tiles accumulate straight into the output (no row buffer, no copy); NCHW, into a private
    scratch row that the epilogue transposes out. Cached: a network repeats layers of one shape,
    and TVM IR is immutable (scheduling works on a copy).
    """
    wl = plan.wl
    top, left, bottom, right = epilogue.out_pad
    # int8 sums, or float32 sums of integers (an int8 depthwise convolution on the float units:
    # exact below 2**24) quantized by the epilogue
    quantizing = wl.dtype == "int8" or epilogue.quantized
    if (quantizing and wl.dtype == "bfloat16") or (
            quantizing and (epilogue.residual or epilogue.mask or epilogue.nchw_out or plan.oihw_weight)) or (
            epilogue.out_dtype == "bfloat16" and wl.dtype == "int8"):
        raise ValueError(f"conv2d: a {wl.dtype} workload cannot take {epilogue}")
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("conv")
        # NCHW data may be a user's array (NumPy aligns to 16 bytes): it is only broadcast, element by element
        x = param_buffer("x", plan.data_shape(), align=USER_ALIGNMENT if plan.nchw_in else -1, dtype=plan.data_dtype)
        w = param_buffer("w", plan.weight_shape(), align=USER_ALIGNMENT if plan.oihw_weight else -1,
                         dtype=wl.weight_dtype)
        bias = param_buffer("b", (plan.OCB, plan.oc_bn), dtype=wl.sum_dtype) if epilogue.bias else None
        scale = param_buffer("scale", (plan.OCB, plan.oc_bn)) if quantizing else None
        residual_shape = wl.out_shape if epilogue.nchw_out else plan.out_shape()
        residual = param_buffer("r", residual_shape, dtype=epilogue.residual_dtype) if epilogue.residual else None
        if epilogue.add is not None:  # the quantized add's other operand
            residual = param_buffer("r", plan.out_shape(), dtype="uint8")
        mask_shape = residual_shape if epilogue.nchw_out else with_border(plan.out_shape(), epilogue.mask_pad)
        mask = param_buffer("m", mask_shape) if epilogue.mask else None
        mask_top, mask_left = epilogue.mask_pad[:2]
        if epilogue.nchw_out:
            out = param_buffer("out", wl.out_shape)
        else:
            # Blocked output: the tiles accumulate straight into it. The tail and the epilogue
            # write it through aliases (same memory, disjoint or later accesses): TensorIR
            # tensorizes a reduction with its initialization only if the block is the sole writer
            # of its buffer. The epilogue reads Y and writes its alias: a block reading and writing
            # one buffer in place is not "compact dataflow", and `parallel` refuses a loop above
            # it. A border (out_pad) is written by blocks of its own, through a third alias.
            y = param_buffer("y", epilogue.out_shape(plan), dtype=epilogue.buffer_dtype)
            y_tail, y_epilogue, y_border = (_alias(name, y) for name in ("Y_tail", "Y_epilogue", "Y_border"))
        if plan.nchw_in:  # after the parameters: a declared buffer opens a frame
            x = plan.data_view(x)
        border = tirx.const(0 if epilogue.units else epilogue.zero_point, epilogue.buffer_dtype)
        if epilogue.buffer_dtype == "bfloat16":  # written as bits (:func:`~.common.bf16_bits`)
            y_bits = y_border = _alias("Y_bits", y, "uint16")
            border = tirx.const(0, "uint16")
        if residual is not None and residual.dtype == "bfloat16":  # read as bits, widened (:func:`_load`)
            residual = _alias("R_bits", residual, "uint16")
        with contextlib.ExitStack() as loops:
            if plan.oihw_weight:
                # One task per output block: its weights laid out in a scratch of the task (the
                # microkernel's B operand) once, before all its rows.
                rows = _weight_rows(plan, w)
                ob = loops.enter_context(T.parallel(0, plan.OCB))
                w = scratch_buffer("W_block", (1, *plan.blocked_weight_shape()[1:]))
                _pack_weight_block(plan, rows, ob, lambda ib, kh, kw, i, o, value: T.buffer_store(
                    w, value, [0, ib, kh, kw, i, o]))
                n, oh = loops.enter_context(T.grid(wl.N, wl.OH))
                row = (n, ob, oh)
            else:
                row = loops.enter_context(T.grid(wl.N, plan.OCB, wl.OH))
            IRBuilder.name_many(["n", "ob", "oh"], row)
            n, ob, oh = row
            if epilogue.nchw_out:
                # The blocked output never reaches memory: the epilogue writes each row to NCHW.
                rows, (v_n, v_ob, v_oh) = _scratch_rows(plan, row, x, w)
                for (_, width, start), row_buffer in zip(plan.row_segments(), rows, strict=True):
                    _write_nchw(plan, epilogue, row_buffer, width, start, out, bias, residual, mask, v_n, v_ob,
                                v_oh)
            elif epilogue.out_dtype == "bfloat16":  # fp32 sums in a row, then rounded to the blocked output
                rows, (v_n, v_ob, v_oh) = _scratch_rows(plan, row, x, w)
                for (_, width, start), row_buffer in zip(plan.row_segments(), rows, strict=True):
                    with T.serial(0, width) as ow, T.vectorized(0, plan.oc_bn) as o:
                        value = _epilogue_value(epilogue, row_buffer[ow, o], _load(bias, [v_ob, o]),
                                                _load(residual, [v_n, v_ob, v_oh, ow + start, o]))
                        if plan.K_pad > wl.K:  # the channels past K are zeros, whatever the input held
                            value = T.Select(v_ob * plan.oc_bn + o < wl.K, value, T.float32(0))
                        T.buffer_store(y_bits, bf16_bits(T.Bind(value)),
                                       [v_n, v_ob, v_oh + top, ow + (start + left), o])
            elif scale is not None:  # int8: the int32 sums to the blocked output of the epilogue's dtype
                rows, (v_n, v_ob, v_oh) = _scratch_rows(plan, row, x, w)
                for (_, width, start), row_buffer in zip(plan.row_segments(), rows, strict=True):
                    with T.serial(0, width) as ow, T.vectorized(0, plan.oc_bn) as o:
                        value = quantized_value(epilogue, row_buffer[ow, o], _load(bias, [v_ob, o]), scale[v_ob, o],
                                                _load(residual, [v_n, v_ob, v_oh, ow + start, o]))
                        T.buffer_store(y_epilogue, value, [v_n, v_ob, v_oh + top, ow + (start + left), o])
            else:
                for name, width, start in plan.row_segments():
                    _segment(plan, name, width, start, row, y_tail if start else y,
                             lambda v_n, v_ob, v_oh, v_ow, v_o, start=start: [
                                 v_n, v_ob, v_oh + top, v_ow + (start + left), v_o], x, w)
                padded = plan.K_pad > wl.K
                if not epilogue.empty or padded:
                    with T.serial(0, wl.OW) as ow, T.vectorized(0, plan.oc_bn) as o, T.sblock("epilogue"):
                        v_n, v_ob, v_oh = T.axis.remap("SSS", [n, ob, oh])
                        v_ow, v_o = T.axis.remap("SS", [ow, o])
                        index = [v_n, v_ob, v_oh + top, v_ow + left, v_o]
                        value = _epilogue_value(epilogue, y[tuple(index)], _load(bias, [v_ob, v_o]),
                                                _load(residual, [v_n, v_ob, v_oh, v_ow, v_o]),
                                                _load(mask, [v_n, v_ob, v_oh + mask_top, v_ow + mask_left, v_o]))
                        if padded:  # the channels past K are zeros, whatever the input held (0 * inf)
                            value = T.Select(v_ob * plan.oc_bn + v_o < wl.K, value, T.float32(0))
                        T.buffer_store(y_epilogue, value, index)
            if not epilogue.nchw_out:
                # The zero border of a padded blocked output (a quantized output's zero point):
                # each row's left and right columns by the task of the row, the rows above the
                # first and below the last output row by loops of their own (after the parallel
                # one: a few rows per output block).
                for side, width, first in (("left", left, 0), ("right", right, left + wl.OW)):
                    if width:
                        with T.serial(0, width) as j, T.vectorized(0, plan.oc_bn) as o, T.sblock(f"border_{side}"):
                            v_n, v_ob, v_oh, v_j, v_o = T.axis.remap("SSSSS", [n, ob, oh, j, o])
                            T.buffer_store(y_border, border, [v_n, v_ob, v_oh + top, first + v_j, v_o])
        for side, height, first in (("top", top, 0), ("bottom", bottom, top + wl.OH)):
            if height and not epilogue.nchw_out:
                with (T.grid(wl.N, plan.OCB, height, epilogue.out_shape(plan)[3]) as (n, ob, i, j),
                      T.vectorized(0, plan.oc_bn) as o, T.sblock(f"border_{side}")):
                    v_n, v_ob, v_i, v_j, v_o = T.axis.remap("SSSSS", [n, ob, i, j, o])
                    T.buffer_store(y_border, border, [v_n, v_ob, first + v_i, v_j, v_o])
    return builder.get()


BRGEMM_UNROLL = "tvm_ext.brgemm_unroll"  # block annotation: the microkernel's k unroll
UNROLL_CHOICES = (1, 2, 4)


def _tile_segment(sch: s_tir.Schedule, plan: Conv2dPlan, block, width: int, lanes: int,
                  tunable: bool, registers: int | None) -> None:
    """Split one row segment into m_r x n_r microkernel tiles: the analytic tile, or (tunable)
    sampled decisions that feed the same primitives, so every decision gives the same loops."""
    ow, o = sch.get_loops(block)[-6:-4]
    if tunable:
        largest_m = max(m for m, _ in register_tiles_for(registers, lanes, plan.b_rows))
        choices = ([m for m in range(1, min(width, largest_m) + 1) if width % m == 0],
                   [n for n in range(lanes, plan.oc_bn + 1, lanes) if plan.oc_bn % n == 0],
                   list(UNROLL_CHOICES))
        m_r, n_r, unroll = (sch.sample_categorical(c, [1 / len(c)] * len(c)) for c in choices)
    else:
        m_r, n_r, unroll = min(plan.m_r, width), plan.tile_n, 1
    ow_outer, ow_inner = sch.split(ow, [None, m_r], preserve_unit_iters=True)
    o_outer, o_inner = sch.split(o, [None, n_r], preserve_unit_iters=True)
    sch.reorder(o_outer, ow_outer, ow_inner, o_inner)  # one weight block is reused along the row
    sch.annotate(block, BRGEMM_UNROLL, unroll)


def register_tiles_for(registers: int | None, lanes: int, b_rows: int = 1) -> list[tuple[int, int]]:
    """The (m_r, n_r) tiles that fit a vector register file (one register spare; `b_rows`:
    :attr:`~tvm_ext.intrin.cpu.BRGEMM.b_rows`)."""
    isa = next(i for i in (AVX512, AVX2, NEON, SSE) if i.lanes == lanes and registers in (None, i.registers))
    return register_tiles(isa, spare=1, b_rows=b_rows)


def tensorize_brgemm_segments(sch: s_tir.Schedule, plan: Conv2dPlan, lanes: int, registers: int | None = None) -> bool:
    """Tensorize each tiled segment with the microkernel of its tile (init=True: accumulators start
    at zero in registers and the tile is stored once, straight into the output; a zero-filled row
    buffer copied out afterwards cost a third of the time of AVX2 1x1 layers). False, and nothing
    tensorized, if a tile does not fit the register file."""
    wl = plan.wl
    fits = set(register_tiles_for(registers, lanes, plan.b_rows))
    tiles = []
    for name, _, _ in plan.row_segments():
        block = sch.get_sblock(name)
        ow_inner, o_inner, icb = sch.get_loops(block)[-6:-3]
        m_r, n_r = int(sch.get(ow_inner).extent), int(sch.get(o_inner).extent)
        if (m_r, n_r) not in fits and registers is not None:
            return False
        unroll = int(sch.get(block).annotations.get(BRGEMM_UNROLL, 1))
        tiles.append((name, ow_inner, BRGEMM(m_r=m_r, n_r=n_r, k=plan.ic_bn, lanes=lanes,
                                             batch=(int(sch.get(icb).extent), wl.KH, wl.KW), stride=wl.stride[1],
                                             dilation=wl.dilation, dtype=wl.dtype, init=True, unroll=unroll,
                                             engine=plan.engine)))
    for name, loop, spec in tiles:
        sch.tensorize(loop, get_brgemm_intrin(spec))
        drop_init(sch, sch.get_sblock(f"{name}_o"))  # the block blockize made around the call
    return True


def drop_init(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> None:
    """Remove the initialization that tensorizing left on a microkernel call's block.

    Tensorize keeps the original block's `T.init()` (zeros stored to the output tile) next to the
    microkernel, whose accumulators already start at zero and which writes the whole tile: every
    tile was written twice, and the zero stores cost up to 12% on AVX2 layers with short
    reductions (64x56x56 -> 256 1x1, 64 -> 64 3x3). Not a traced instruction: whatever
    tensorizes (analytic schedules, tuning candidates, replayed records) calls this again.
    """
    old = sch.get(block)
    new = s_tir.SBlock(old.iter_vars, old.reads, old.writes, old.name_hint, old.body, None,
                       old.alloc_buffers, old.match_buffers, old.annotations)
    sch.state.replace(sch.get_sref(block), new, {old: new})


def row_order_tiles(plan: Conv2dPlan) -> tuple[list[int], list[int], list[int]]:
    """The (outer, inner) splits of the image, output-block and row loops that give the analytic
    order: image outer, then output block then row ("ob_oh") or row then output block ("oh_ob");
    or output block outer, then image, then row ("ob_n_oh")."""
    n, ocb, oh = plan.wl.N, plan.OCB, plan.wl.OH
    if plan.row_order == "ob_oh":
        return [n, 1], [ocb, 1], [1, oh]
    if plan.row_order == "ob_n_oh":
        return [1, n], [ocb, 1], [1, oh]
    if plan.row_order == "oh_ob":
        return [n, 1], [1, ocb], [oh, 1]
    raise ValueError(f"row order {plan.row_order!r}: expected ob_oh, oh_ob or ob_n_oh")


def order_rows(sch: s_tir.Schedule, plan: Conv2dPlan, tunable: bool = False) -> None:
    """Order the output rows and share them among threads: the cache blocking of images, output
    channels and rows, and the parallel split.

    The image, output-block and row loops are each split in two and ordered
    (images, blocks, images in a block tile, rows, blocks in a tile, rows in a tile), then fused
    into the one parallel loop. A tile of blocks x rows reuses its blocks' weights over its rows
    (and over the images inside it) and each input row over its blocks; threads take contiguous
    ranges of the fused loop, so the splits also decide whether threads divide the output
    channels or the rows. The analytic schedule uses the plan's `row_order`
    (:func:`row_order_tiles`); tuning samples all three splits as perfect tiles, which keeps the
    loop structure the same for every decision.
    """
    if plan.oihw_weight:  # the generator made the output blocks the tasks (conv2d_blocked_func)
        return
    loops = sch.get_loops(sch.get_sblock(plan.row_segments()[0][0]))[:3]
    if tunable:
        tiles = [sch.sample_perfect_tile(loop, n=2) for loop in loops]
    else:
        tiles = row_order_tiles(plan)
    (n_outer, n_inner), (ob_outer, ob_inner), (oh_outer, oh_inner) = (
        sch.split(loop, factors, preserve_unit_iters=True) for loop, factors in zip(loops, tiles, strict=True))
    sch.reorder(n_outer, ob_outer, n_inner, oh_outer, ob_inner, oh_inner)
    sch.parallel(sch.fuse(n_outer, ob_outer, n_inner, oh_outer, ob_inner, oh_inner, preserve_unit_iters=True))


def schedule_conv2d_blocked(sch: s_tir.Schedule, plan: Conv2dPlan, lanes: int, tunable: bool = False,
                            registers: int | None = None) -> None:
    """Tile and tensorize the row segments (vectorize them, for depthwise and direct).

    One schedule for both uses: the analytic tile by default; with `tunable` (BRGEMM kind) the
    tile and unroll become MetaSchedule decisions and tensorizing is left to a postprocessor
    (:func:`tensorize_brgemm_segments`), which needs the sampled tile to pick the microkernel.
    `registers`: the vector register count that sampled tiles must fit (tunable only).

    The epilogue needs nothing: it updates the row in place (a block no schedule primitive can
    transform) and is generated with its channel loop already vectorized.
    """
    order_rows(sch, plan, tunable)
    if plan.kind == "brgemm":
        for name, width, _ in plan.row_segments():
            _tile_segment(sch, plan, sch.get_sblock(name), width, lanes, tunable, registers)
        if not tunable:
            tensorize_brgemm_segments(sch, plan, lanes)
        return
    if plan.kind in ("depthwise", "grouped") and plan.oc_bn % lanes == 0:
        tensorize_depthwise_segments(sch, plan, lanes)
        return
    for name, _, _ in plan.row_segments():
        block = sch.get_sblock(name)
        loops = sch.get_loops(block)
        ow, o, *reduction = loops[-2 - len(plan.reduce_axes()):]
        sch.reorder(*reduction, o)
        sch.decompose_reduction(block, reduction[0])


def tensorize_depthwise_segments(sch: s_tir.Schedule, plan: Conv2dPlan, lanes: int) -> None:
    """Split each row segment into tiles of m_r pixels x the whole channel block and tensorize
    them with the depthwise microkernel (:mod:`tvm_ext.intrin.cpu_depthwise`; a grouped plan's
    with its group size)."""
    wl = plan.wl
    group = 1 if plan.kind == "depthwise" else wl.C // wl.groups
    for name, width, _ in plan.row_segments():
        block = sch.get_sblock(name)
        ow = sch.get_loops(block)[-2 - len(plan.reduce_axes())]
        m_r = min(plan.m_r, width)
        _, ow_inner = sch.split(ow, [None, m_r], preserve_unit_iters=True)
        tile = DepthwiseTile(m_r, plan.oc_bn, lanes, (wl.KH, wl.KW), wl.stride[1], wl.dilation, group=group)
        sch.tensorize(ow_inner, get_depthwise_intrin(tile))
        drop_init(sch, sch.get_sblock(f"{name}_o"))


def conv2d_blocked_kernel(plan: Conv2dPlan, lanes: int, epilogue: Epilogue = Epilogue()) -> tirx.PrimFunc:
    """The scheduled blocked convolution, tagged with its kernel name."""
    sch = s_tir.Schedule(conv2d_blocked_func(plan, epilogue))
    schedule_conv2d_blocked(sch, plan, lanes)
    func = sch.mod["main"].with_attr(KERNEL_ATTR, f"{plan.kind}_conv2d")
    features = kernel_cpu_features(plan, lanes)
    return func.with_attr(CPU_FEATURES_ATTR, features) if features else func


def kernel_cpu_features(plan: Conv2dPlan, lanes: int) -> str | None:
    """The LLVM CPU features `plan`'s kernel issues beyond its vector ISA's (:data:`CPU_FEATURES_ATTR`)."""
    if plan.engine == "amx":
        return "amx-int8,amx-tile" if plan.wl.dtype == "int8" else "amx-bf16,amx-tile"
    if plan.wl.dtype == "int8":
        return "avx512vnni" if lanes == 16 else "avxvnni"
    return "avx512bf16" if plan.wl.dtype == "bfloat16" and plan.engine == "fma" else None


def _weight_tile(plan: Conv2dPlan, rows: tirx.Buffer, ob, ib, q0, o0, store: Callable) -> None:
    """One 8x8 tile of the OIHW -> blocked transpose: output channels ob*y + o0*8 + [0, 8) (8
    rows of OIHW `rows`, viewed as (K, I*KH*KW)) x the 8 (i, kh, kw) from q0*8 of input block ib.
    store(ib, kh, kw, i, o, value) writes the blocked weight(s) at o (a Ramp of 8 or a channel);
    channels past K are zeros."""
    wl = plan.wl
    K, khw = wl.K, wl.KH * wl.KW
    q_block = plan.ic_bn * khw  # one input-channel block's (i, kh, kw), contiguous in a row

    def at(q, o, value) -> None:
        store(ib, q % khw // wl.KW, q % wl.KW, q // khw, o, value)

    with T.If(ob * plan.oc_bn + o0 * 8 + 8 <= K):
        with T.Then():
            transpose8x8(lambda i: rows[ob * plan.oc_bn + o0 * 8 + i, T.Ramp(ib * q_block + q0 * 8, 1, 8)],
                         lambda j, value: at(q0 * 8 + j, T.Ramp(o0 * 8, 1, 8), value))
        with T.Else(), T.grid(8, 8) as (q, o):
            k = T.Bind(ob * plan.oc_bn + o0 * 8 + o)
            p = T.Bind(q0 * 8 + q)
            at(p, o0 * 8 + o, T.if_then_else(k < K, rows[T.min(k, K - 1), ib * q_block + p], T.float32(0)))


def _weight_rows(plan: Conv2dPlan, weight: tirx.Buffer) -> tirx.Buffer:
    """OIHW `weight` as (K, I*KH*KW): one output channel's weights per row."""
    wl = plan.wl
    return IRBuilder.name("W_rows", T.decl_buffer((wl.K, (wl.C // wl.groups) * wl.KH * wl.KW), "float32",
                                                  data=weight.data, align=USER_ALIGNMENT))


def _pack_weight_block(plan: Conv2dPlan, rows: tirx.Buffer, ob, store: Callable) -> None:
    """Output block `ob`'s weights, tile by tile. 1x1: a block's rows are one cache line each,
    4 KiB apart when C is a power of two (same L1 set), so 8 whole rows are swept at a time
    (0.67 -> 0.45 ms, 2048x1024); else one input block at a time."""
    q_tiles = plan.ic_bn * plan.wl.KH * plan.wl.KW // 8
    icb = plan.blocked_weight_shape()[1]  # of one group
    if plan.wl.KH * plan.wl.KW == 1:
        with T.grid(plan.oc_bn // 8, icb, q_tiles) as (o0, ib, q0):
            _weight_tile(plan, rows, ob, ib, q0, o0, store)
    else:
        with T.grid(icb, q_tiles, plan.oc_bn // 8) as (ib, q0, o0):
            _weight_tile(plan, rows, ob, ib, q0, o0, store)


def _pack_weight_tiled(plan: Conv2dPlan) -> tirx.PrimFunc:
    """The OIHW -> blocked transpose in 8x8 register tiles of (output channel, (i, kh, kw)).

    A row of OIHW holds one output channel's (i, kh, kw) contiguously, so 8 rows x 8 of them
    load as vectors; each column of the tile is 8 output channels of one (i, kh, kw): a vector
    store into the blocked weights.
    """
    wl = plan.wl
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("pack_weight")
        T.func_attr({"tirx.noalias": True, KERNEL_ATTR: "pack_weight_blocked"})
        weight = param_buffer("w", (wl.K, wl.C // wl.groups, wl.KH, wl.KW), align=USER_ALIGNMENT)
        d = param_buffer("d", plan.weight_shape())
        rows = _weight_rows(plan, weight)
        with T.sblock("root"):
            if wl.KH * wl.KW == 1:
                with T.parallel(0, plan.OCB) as ob:
                    _pack_weight_block(plan, rows, ob, lambda ib, kh, kw, i, o, value, ob=ob: T.buffer_store(
                        d, value, [ob, ib, kh, kw, i, o]))
            else:  # one (ob, ib) block per task: its rows are 576+ bytes, its output stays in L1
                icb = plan.blocked_weight_shape()[1]  # of one group
                with T.parallel(0, plan.OCB * icb) as task:
                    ob, ib = T.Bind(task // icb), T.Bind(task % icb)
                    with T.grid(plan.ic_bn * wl.KH * wl.KW // 8, plan.oc_bn // 8) as (q0, o0):
                        _weight_tile(plan, rows, ob, ib, q0, o0, lambda ib, kh, kw, i, o, value, ob=ob: T.buffer_store(
                            d, value, [ob, ib, kh, kw, i, o]))
    return builder.get()


def pack_weight_array(plan: Conv2dPlan, weight: np.ndarray) -> np.ndarray:
    """What :func:`pack_weight_func` computes, in NumPy: for weights known at build time.

    A graph's constant weights are packed while it is lowered; compiling a packing kernel per
    plan for that cost more than the packing (ResNet-50: 23 kernels, 4.6 s of parsing alone).
    """
    wl = plan.wl
    padded = np.zeros((plan.K_pad, *weight.shape[1:]), weight.dtype)
    padded[: wl.K] = weight
    k = plan.K_pad
    c, kh, kw = weight.shape[1:]
    if plan.kind == "depthwise":
        blocked = padded.reshape(k // plan.oc_bn, plan.oc_bn, kh, kw).transpose(0, 2, 3, 1)
    elif plan.kind == "grouped":
        blocked = padded.reshape(k // plan.oc_bn, plan.oc_bn, c, kh, kw).transpose(0, 3, 4, 2, 1)
    else:
        blocked = padded.reshape(k // plan.oc_bn, plan.oc_bn, c // plan.ic_bn, plan.ic_bn, kh, kw)
        blocked = blocked.transpose(0, 2, 4, 5, 3, 1)
    g = DOT_TYPES[wl.dtype].group
    if g > 1:  # groups of input channels innermost; bf16 rounded to nearest even
        groups = blocked.reshape(*blocked.shape[:4], plan.ic_bn // g, g, plan.oc_bn).transpose(0, 1, 2, 3, 4, 6, 5)
        if wl.dtype == "int8":
            if weight.dtype != np.int8:
                raise ValueError(f"pack_weight_array: int8 weights expected, got {weight.dtype}")
            return np.ascontiguousarray(groups)
        return np.ascontiguousarray(groups.astype(np.float32).astype(ml_dtypes.bfloat16))
    return np.ascontiguousarray(blocked)


def _tiled_weights(plan: Conv2dPlan) -> bool:
    """Whether the OIHW -> blocked transpose goes in 8x8 register tiles (:func:`_weight_tile`)."""
    wl = plan.wl
    return (plan.kind not in ("depthwise", "grouped") and wl.dtype == "float32" and plan.oc_bn % 8 == 0
            and (plan.ic_bn * wl.KH * wl.KW) % 8 == 0)


def pack_weight_func(plan: Conv2dPlan) -> tirx.PrimFunc:
    """OIHW -> O/y, I/x, KH, KW, x, y (depthwise: O/y, KH, KW, y; grouped: O/y, KH, KW, I/groups,
    y); missing output channels are zero."""
    wl = plan.wl
    plan = dataclasses.replace(plan, oihw_weight=False)  # its output: the blocked weights
    if _tiled_weights(plan):
        return _pack_weight_tiled(plan)
    w = te.placeholder((wl.K, wl.C // wl.groups, wl.KH, wl.KW), wl.dtype, name="weight")
    if plan.kind == "depthwise":
        wb = te.compute(plan.weight_shape(), lambda ob, r, s, o: w[ob * plan.oc_bn + o, 0, r, s],
                        name="weight_blocked")
    elif plan.kind == "grouped":
        wb = te.compute(plan.weight_shape(), lambda ob, r, s, i, o: w[ob * plan.oc_bn + o, i, r, s],
                        name="weight_blocked")
    else:
        def body(ob, ib, r, s, i, o):
            k = ob * plan.oc_bn + o
            value = w[tirx.min(k, wl.K - 1), ib * plan.ic_bn + i, r, s]
            return tirx.if_then_else(k < wl.K, value, tirx.const(0.0, wl.dtype)) if plan.K_pad > wl.K else value

        wb = te.compute(plan.weight_shape(), body, name="weight_blocked")
    sch = s_tir.Schedule(accept_user_alignment(te.create_prim_func([w, wb]), "weight"))
    loops = sch.get_loops(sch.get_sblock("weight_blocked"))
    if plan.kind in ("depthwise", "grouped"):
        sch.parallel(loops[0])
    else:
        ob, ib, r, s, i, o = loops
        sch.reorder(o, i, r, s)
        sch.parallel(sch.fuse(ob, ib))
    return sch.mod["main"].with_attr(KERNEL_ATTR, "pack_weight_blocked")
