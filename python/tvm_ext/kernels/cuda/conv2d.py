"""maxDNN-style direct convolution for CUDA: implicit GEMM, 64x64 block tile, 8x8 per thread (or larger).

The convolution is the GEMM  Y[o, col] = sum_k Wt[k, o] * im2col(X)[k, col]  with o the output
channel, col = (p, q, n) the output pixel and image, k = (c, r, s) the filter tap. The im2col
matrix is never stored: each k step's tile of it is gathered straight from the input into shared
memory. Layouts (those of maxDNN/cuda-convnet, chosen so that every global access is a coalesced
128-bit one):

- activations CHWN (the image index innermost): four consecutive columns of a tile are four images
  at the same pixel, one float4 in memory; the output, KPQN, is the same layout;
- weights CRSK per group ([groups, C/groups*R*S, K/groups]; RSCK when the channels per group
  are a multiple of 8, see :attr:`MaxDNNPlan.k_order`): a k step's row of the A tile is
  contiguous in output channels.

One thread block computes a `rows x cols` tile of Y with rows/8 x cols/8 threads, each holding an
8x8 register tile (maxDNN's 64x64) updated by the :class:`~tvm_ext.intrin.cuda.ThreadTile` tensor
intrinsic; :func:`choose_tile` picks from :data:`FFMA_TILES`, mostly 16x8 thread tiles on 128x128,
64x128 or 96x128 blocks, which spend fewer of a scheduler's issue slots on shared loads per FFMA
(94% of the k loop's SASS is FFMA, against 91% for 8x8). The k loop runs in steps
of 8 through two shared buffers: while the block computes on one, each thread has the next step's
global loads in flight in registers and stores them to the other buffer afterwards, so one barrier
per k step suffices. The loop is unrolled by two so the two buffers are distinct allocations,
which lets TVM's barrier planner see that the compute and the store do not conflict (with one
buffer indexed by k % 2 it inserts a second barrier). In RSC order (:attr:`MaxDNNPlan.tap_loop`)
the k loop is a loop over filter taps around a loop over channel steps: where each load slot
reads and whether it falls in the padding is worked out once per tap, and the channel loop issues
nothing but its loads, stores, shared loads, FFMAs and one barrier per step (91% of its SASS is
FFMA on sm_80 and sm_90 with 8x8 thread tiles, against a floor of 92.6%). The finished tile is
staged through shared memory so the global stores are coalesced float4 rows, with the epilogue
(bias, residual add, activation) applied on the way out. A grid too small to fill a GPU splits
its reduction (split-K, :func:`choose_splits`): each slice of taps or channel steps is a set of
blocks writing partial sums, and :func:`split_reduce_func` adds them with the epilogue.

Where a float4 would straddle a row of memory (images per batch or output channels not a multiple
of 4) the loads fall back to scalars, and all bounds (K not a multiple of 8, tiles past the edge,
padding) are guarded, so every shape is computed exactly.

The tensor-core engines (`BlockTile(engine="mma_tf32" | "mma_bf16")`) keep all of the above and
replace the threads' FFMA tiles by warps issuing `mma.sync` (:class:`MmaShape`): each warp owns
`warp_rows` rows of the block, its fragments loaded from the same shared buffers (rows padded
so the loads do not conflict), its accumulators staged into the same output tile.

Hopper's engines (`BlockTile(engine="wgmma_tf32" | "wgmma_bf16")`, sm_90a) are one warpgroup per
block issuing an asynchronous `wgmma.mma_async` m64nNk8 (bf16: m64nNk16, its operands rounded and
packed two to a register) per 64-column slab and k step (:class:`WgmmaShape`): N is
the block's rows, the weights' tile is read by the tensor cores from shared memory through a
matrix descriptor (so the weights are packed per block and k step in that layout,
:func:`pack_wgmma_weight`), and the A operand comes from registers, gathered by each thread
straight from the input in RSC order (:attr:`MaxDNNPlan.gathers_fragments`). A step issues its
wgmmas and stores the next step's tile while they run; gathered, its group stays in flight
across the barrier (:attr:`MaxDNNPlan.wgmma_in_flight`), else it is waited for before it.

A tile past the 48 KB a kernel declares statically (wgmma's 128 x 128) stages its output in
dynamic shared memory (:attr:`MaxDNNPlan.dynamic_shared_bytes`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable

import numpy as np
import tvm
from tvm import s_tir

from ...intrin.cuda import ThreadTile, get_outer_product_intrin
from ...target import resolve_target
from .. import script
from ..conv2d import KERNEL_ATTR, Conv2dWorkload, activation_expr
from .ptx import generate_source, kernel_params

KERNEL_NAME = "maxdnn_conv2d"
ACTIVATIONS = (None, "relu", "relu6")
# Deliberate bugs for the tests: compute on the buffer being filled instead of the one filled
# last step; never move the prefetched tile into shared memory.
FAULTS = (None, "wrong_buffer", "no_store", "no_proxy_fence")
# The kernel indexes flat views of its tensors; these names are its CUDA parameters (`<name>_ptr`).
FLAT_PARAMS = {"x": "Xf", "w": "Wf", "y": "Yf", "residual": "Rf", "bias": "bias", "partial": "Pf"}


@dataclasses.dataclass(frozen=True)
class BlockTile:
    """One thread block's output tile and its threads' register tiles."""

    rows: int = 64  # output channels per block
    cols: int = 64  # output columns (pixels x images) per block
    thread_rows: int = 8
    thread_cols: int = 8
    k_step: int = 8
    vec: int = 4
    engine: str = "ffma"  # "ffma": thread_rows x thread_cols FFMA per thread; tensor cores: MMA_SHAPES, WGMMA_SHAPES
    warp_rows: int = 32  # mma.sync: rows of the block one warp computes (32: 2 x m16; 64: 4 x m16)
    # wgmma in RSC order: each thread gathers its A fragments straight from the input, no shared tile
    gather_fragments: bool = False

    @property
    def mma(self) -> MmaShape | None:
        return MMA_SHAPES.get(self.engine)

    @property
    def wgmma(self) -> WgmmaShape | None:
        return WGMMA_SHAPES.get(self.engine)

    @property
    def slabs(self) -> int:
        """wgmma: the 64-column slabs of the block, one wgmma each per k step (its M is 64)."""
        return self.cols // 64

    @property
    def threads_m(self) -> int:
        return self.rows // self.thread_rows

    @property
    def threads_n(self) -> int:
        return self.cols // self.thread_cols

    @property
    def threads(self) -> int:
        if self.wgmma is not None:
            return 128  # one warpgroup
        if self.mma is not None:
            return self.rows // self.warp_rows * 32  # one warp per slab of warp_rows
        return self.threads_m * self.threads_n

    @property
    def pad(self) -> int:
        """Extra floats per shared row, so that the k-rows a fragment load touches fall in different banks
        (wgmma: B's rows only; its A tile is the descriptor's, unpadded)."""
        if self.wgmma is not None:
            return self.wgmma.pad
        return self.mma.pad if self.mma is not None else 0

    @property
    def mma_tiles(self) -> tuple[int, int]:
        """(m16 tiles, n8 tiles) of one warp's warp_rows x cols slab."""
        return self.warp_rows // 16, self.cols // 8

    @property
    def mma_chunks(self) -> tuple[int, int]:
        """Tensor cores: how many of a lane's values from one shared row of A (2 per m16 tile) and
        of B (1 per n8 tile) sit side by side and load as one vector: for tf32, A's row pairs g,
        g + 8 (the registers an mma reads as a pair) and B's one by one; for bf16, up to 4 each."""
        mt, nt = self.mma_tiles
        if self.mma.per_reg == 1:
            return 2, 1
        return tuple(next(c for c in (4, 2, 1) if count % c == 0) for count in (2 * mt, nt))

    def mma_row(self, v: str, g: str) -> str:
        """The row of a warp's slab behind mma row g + 8 (v % 2) of m16 tile v // 2: lane group g's
        values v = 0 .. 2 mt - 1 side by side, in chunks of :attr:`mma_chunks`."""
        c = self.mma_chunks[0]
        return f"({v}) // {c} * {8 * c} + ({g}) * {c} + ({v}) % {c}"

    def mma_col(self, ni: str, n: str) -> str:
        """The tile column behind column n of n8 tile ni (B's lane group n = g, C's n = 2t + b)."""
        c = self.mma_chunks[1]
        return f"({ni}) // {c} * {8 * c} + ({n}) * {c} + ({ni}) % {c}"

    def thread_tile(self) -> ThreadTile:
        return ThreadTile(
            rows=self.thread_rows, cols=self.thread_cols, k_step=self.k_step, vec=self.vec,
            row_gap=self.rows * self.vec // self.thread_rows, col_gap=self.cols * self.vec // self.thread_cols)

    def validate(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"BlockTile: engine {self.engine!r} is not one of {ENGINES}")
        if self.shared_bytes() > DYNAMIC_SHARED_LIMIT:
            raise ValueError(f"BlockTile: {self.shared_bytes()} bytes of shared memory; a block has at most "
                             f"{DYNAMIC_SHARED_LIMIT} (sm_90)")
        if self.wgmma is not None:
            if (self.rows % 8 or not 8 <= self.rows <= 256 or self.cols % 64 or not self.slabs
                    or self.k_step != self.wgmma.k or self.vec != 4):
                raise ValueError(f"BlockTile: the {self.engine} tile needs rows a multiple of 8 up to 256 (the "
                                 f"wgmma's N), cols a multiple of 64 (its M) and k_step {self.wgmma.k}, got {self}")
            if self.slabs * self.rows // 2 > 128:
                raise ValueError(f"BlockTile: a {self.rows}x{self.cols} wgmma tile needs more than 128 "
                                 "accumulators per thread")
            return
        if self.gather_fragments:
            raise ValueError("BlockTile: gather_fragments is a wgmma option")
        if self.mma is not None:
            if (self.warp_rows % 16 or self.rows % self.warp_rows or self.cols % 8 or self.k_step != self.mma.k
                    or self.vec != 4):
                raise ValueError(f"BlockTile: the {self.engine} tensor-core tile needs rows % warp_rows == 0 "
                                 f"(warp_rows a multiple of 16), cols % 8 == 0 and k_step {self.mma.k}, got {self}")
            if self.mma_tiles[0] * self.mma_tiles[1] * 4 > 128:
                raise ValueError(f"BlockTile: a {self.warp_rows}x{self.cols} warp slab needs more than 128 "
                                 "accumulators per thread")
            return
        for extent, per_thread in ((self.rows, self.thread_rows), (self.cols, self.thread_cols)):
            if extent % per_thread or (extent * self.vec) % per_thread:
                raise ValueError(f"BlockTile: {extent} is not a multiple of the thread tile {per_thread}")
        if not 32 <= self.threads <= 1024:
            raise ValueError(f"BlockTile: {self.threads} threads per block (32..1024 allowed)")
        self.thread_tile().validate()

    @property
    def weight_words(self) -> int:
        """32-bit words of a k step's weights tile (rows x k_step values): wgmma's come packed
        :attr:`WgmmaShape.per_reg` to a word (bf16: two), the others are floats."""
        return self.rows * self.k_step // (self.wgmma.per_reg if self.wgmma is not None else 1)

    def shared_bytes(self) -> int:
        """The double-buffered operand tiles and the output tile (at most; TVM may overlap them)."""
        weights = self.weight_words + self.k_step * self.pad
        return 4 * (2 * (weights + self.k_step * (self.cols + self.pad)) + self.rows * self.cols)

    def ffma_issue_share(self) -> float:
        """FFMA tile: the share of FFMA in a thread's instructions per k step, counting its FFMAs,
        shared float4 loads, its share of the next step's global loads and shared stores (float4)
        and the barrier: the most of the FFMA peak the tile can reach at one warp instruction per
        clock (92.6% for 8 x 8, 94.7% for 128 x 128 with 16 x 8; the SASS adds a few more)."""
        ffma = self.thread_rows * self.thread_cols * self.k_step
        shared_loads = self.k_step * (self.thread_rows + self.thread_cols) / self.vec
        moves = 2 * self.k_step * (self.rows + self.cols) / (self.threads * self.vec)
        return ffma / (ffma + shared_loads + moves + 1)


@dataclasses.dataclass(frozen=True)
class MmaShape:
    """One `mma.sync.aligned.m16n8k*` flavour, as data: what the generator and the checks read.

    Fragments (PTX ISA): lane (g, t) = (lane // 4, lane % 4); A register j, element e holds
    A[g + 8 (j % 2)][t * per_reg + e + k/2 (j // 2)], B register j, element e holds
    B[t * per_reg + e + k/2 j][g], the accumulators C[g + 8 (i // 2)][2t + i % 2].
    """

    shape: str  # "m16n8k8"
    ptx_type: str  # operand type in the instruction: "tf32", "bf16"
    k: int  # reduction per instruction = the block's k step
    per_reg: int  # operand elements per 32-bit register
    pad: int  # floats added to each shared row: a fragment load's k-rows in distinct banks

    @property
    def opcode(self) -> str:
        return f"mma.sync.aligned.{self.shape}.row.col.f32.{self.ptx_type}.{self.ptx_type}.f32"


MMA_SHAPES = {
    # tf32: fp32 registers as they are (the tensor cores read their top 19 bits); rows of 72
    # floats put k-row t at bank 8t, so a warp's 64-bit A loads (banks 8t + 2g, + 1) and 32-bit
    # B loads (8t + g) are conflict-free
    "mma_tf32": MmaShape("m16n8k8", "tf32", 8, 1, 8),
    # bf16: two values rounded and packed per register; rows of 68 put k-row 2t at bank 8t, so a
    # quarter warp's 128-bit loads (banks 8t + 4g .. + 3) are conflict-free
    "mma_bf16": MmaShape("m16n8k16", "bf16", 16, 2, 4),
}


@dataclasses.dataclass(frozen=True)
class WgmmaShape:
    """One Hopper `wgmma.mma_async` flavour (sm_90a), as data: what the generator and the checks read.

    A warpgroup (128 threads, warps w = 0..3, lane (g, t) = (lane // 4, lane % 4)) computes
    D[64, n] += A[64, k] B[k, n] asynchronously. Here A comes from registers, register j, element
    e holding A[16w + g + 8 (j % 2)][t * per_reg + e + k/2 (j // 2)] (tf32: the fp32 bits; bf16:
    two values, the lower k in the low half); B is read by the tensor cores from shared memory
    through a 64-bit matrix descriptor, K-major without swizzle (tf32 allows no other
    major-ness): 8 rows x 16 bytes core matrices, B[n][k] at byte (n // 8) SBO + (n % 8) 16 +
    (k // c) LBO + (k % c) 4 / per_reg with c = 4 per_reg values in 16 bytes; accumulator
    register 4c + 2h + b holds D[16w + g + 8h][8c + 2t + b]. (PTX ISA 9.7.15.5.1, "Register
    Fragments and Shared Memory Matrix Layouts", and CUTLASS's SM90 GMMA layouts agree on all
    of these.) In bytes, a k step's B tile is the same for both: 32 bytes of k per row of n.
    """

    ptx_type: str  # "tf32", "bf16"
    k: int  # reduction per instruction = the block's k step
    pad: int  # floats added to each shared row of the register operand's tile (bank spread)
    per_reg: int = 1  # operand values per 32-bit register (and per 4 bytes of shared memory)
    transposes: bool = False  # the instruction takes a transpose immediate for B (16-bit types)
    lbo: int = 128  # bytes between the two core matrices of a row's k (the leading dimension)
    sbo: int = 256  # bytes between 8-row groups of n (the stride dimension)

    def opcode(self, n: int) -> str:
        return f"wgmma.mma_async.sync.aligned.m64n{n}k{self.k}.f32.{self.ptx_type}.{self.ptx_type}"

    @property
    def core_k(self) -> int:
        """Values of k in one 16-byte row of a core matrix."""
        return 4 * self.per_reg

    @property
    def immediates(self) -> str:
        """The instruction's immediate operands after scale-d: scale-a, scale-b (1: no negation)
        and, for 16-bit types, B's transpose (0: K-major, as packed)."""
        return "1, 1, 0" if self.transposes else "1, 1"


WGMMA_SHAPES = {
    # tf32 from fp32 registers as they are; the data tile's rows of cols + 8 floats put k-row t at
    # bank 8t, so a warp's A-fragment loads (banks 8t + g) are conflict-free
    "wgmma_tf32": WgmmaShape("tf32", 8, 8),
    # bf16: fp32 values rounded and packed two to a register (the weights once, when packed); rows
    # of cols + 4 floats put k-row 2t at bank 8t: a warp's loads of the fragments' k rows 2t + e
    # (banks 8t + 4e + g) are conflict-free
    "wgmma_bf16": WgmmaShape("bf16", 16, 4, per_reg=2, transposes=True),
}
ENGINES = ("ffma", *MMA_SHAPES, *WGMMA_SHAPES)
MAX_ELEMENTS = 2**31 - 1  # the kernels index with int32
STATIC_SHARED_LIMIT = 48 * 1024  # per block, without opting in to dynamic shared memory
DYNAMIC_SHARED_LIMIT = 227 * 1024  # per block, opted in (sm_90; sm_80 has 163 KB)
MMA_TILE_ROWS = (64, 96, 128, 32)  # mma.sync block heights in order of preference: maxDNN's, then taller
# wgmma: the tallest first, as its N (each wgmma then reads more of B per A fragment loaded)
WGMMA_TILE_ROWS = (128, 96, 64, 32)
# wgmma: two m64 slabs of pixels per block. A 128 x 128 tile moves 16 MACs per byte it loads
# (weights' tile and fragments), 128 x 64 10.7: the tensor cores' tf32 rate (1024 MACs a clock
# per SM) outruns what L2 delivers to an SM at either, so the taller tile is the faster bet. Its
# staged output (64 KB) is past the 48 KB a kernel declares statically: dynamic shared memory.
WGMMA_TILE_COLS = 128
# The FFMA tiles choose_tile picks from, in order of preference at equal cost. A scheduler issues
# one warp instruction a clock, so the FFMA peak needs the k loop to be all FFMA: a thread's k
# issues rows x cols FFMAs on (rows + cols) / 4 shared float4 loads, 64 on 4 for maxDNN's 8 x 8,
# 128 on 6 for 16 x 8 (:meth:`BlockTile.ffma_issue_share`). In the k loop's SASS (sm_90, RSC
# layers): 94.3% FFMA for 128 x 128 with 16 x 8 threads, 93% for 64 x 128 and 92.6% for 96 x 128
# (12 x 8), against 91.3% for maxDNN's 64 x 64; 214-231 registers, no spills, 8 warps an SM.
# The 64-column tiles are for small images at small batch, where 128 columns would waste most.
FFMA_TILES = (
    BlockTile(128, 128, 16, 8),
    BlockTile(64, 128, 16, 8),
    BlockTile(96, 128, 12, 8),
    BlockTile(128, 64, 16, 8),
    BlockTile(96, 64, 12, 8),
    BlockTile(64, 64),  # maxDNN's
    BlockTile(32, 64),
)


def choose_tile(out_channels_per_group: int, engine: str = "ffma", columns: int | None = None) -> BlockTile:
    """The block tile for a GEMM of `out_channels_per_group` rows and `columns` (output pixels x
    images; None: many) on `engine`.

    FFMA: the tile of :data:`FFMA_TILES` that issues the fewest instructions on the padded GEMM
    (its padded area over :meth:`BlockTile.ffma_issue_share`). Tensor cores: the block height
    that wastes the fewest rows (ties to 64, maxDNN's, then taller, then 32; wgmma: tallest first).

    maxDNN's fixed 64 x 64 lost a quarter of its speed on OverFeat layer 1 (96 filters = 1.5
    tiles); a 96-row tile covers 96 exactly.
    """
    def padded(extent: int, tile: int) -> int:
        return -(-extent // tile) * tile

    if engine == "ffma":
        def cost(tile: BlockTile) -> float:
            cols = padded(columns, tile.cols) if columns else 1
            return padded(out_channels_per_group, tile.rows) * cols / tile.ffma_issue_share()
        return min(FFMA_TILES, key=lambda tile: (cost(tile), FFMA_TILES.index(tile)))
    order = WGMMA_TILE_ROWS if engine in WGMMA_SHAPES else MMA_TILE_ROWS
    best = min(order, key=lambda rows: (padded(out_channels_per_group, rows), order.index(rows)))
    if engine in WGMMA_SHAPES:  # one warpgroup, two m64 slabs of pixels: see WGMMA_TILE_COLS
        return BlockTile(rows=best, cols=WGMMA_TILE_COLS, engine=engine, k_step=WGMMA_SHAPES[engine].k,
                         gather_fragments=True)
    mma = MMA_SHAPES.get(engine)
    return BlockTile(rows=best, engine=engine, k_step=8 if mma is None else mma.k)


# wgmma in flight (MaxDNNPlan.wgmma_in_flight): the weights' tiles in a ring of this many buffers,
# a register set per slot for the fragments and the weights, the k loop this many steps at a time
WGMMA_RING = 3

# Split-K: the threads that fill an H100/H200 (132 SMs; 1024 of our 64-thread blocks, 6-8 an SM;
# a grid of fewer leaves SMs idle or short of warps to hide latency), and the k steps a slice
# keeps at least (its prologue, epilogue and partial-sum write stay small beside its loop).
FILL_THREADS = 1024 * 64
MIN_SPLIT_STEPS = 16


def choose_splits(plan: MaxDNNPlan) -> int:
    """How many slices split-K cuts the reduction of `plan` into: 1 where its grid has at least
    half of the blocks that make :data:`FILL_THREADS`, else the fewest that reach them, each
    keeping :data:`MIN_SPLIT_STEPS` k steps (ResNet-50's 7 x 7 layers at batch 32 have 200
    64-thread blocks: its 3x3 runs 9 slices of a tap, its 1x1 from 2048 channels 8 slices of 256).
    Counting threads, not blocks: a wgmma block is a warpgroup of 128 with a tile 4 times as
    large, and 2-4 of them fill an SM."""
    unit = plan.split_unit
    blocks = math.prod(dataclasses.replace(plan, splits=1).grid)
    fill = FILL_THREADS // plan.tile.threads
    if unit is None or 2 * blocks >= fill:
        return 1
    best = 1
    for d in range(2, unit[1] + 1):
        if unit[1] % d:
            continue
        if plan.k_steps // d < MIN_SPLIT_STEPS:
            break
        best = d
        if blocks * d >= fill:
            break
    return best


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """What the output write applies: Y = act(acc + bias[o] + residual)."""

    bias: bool = False
    residual: bool = False
    activation: str | None = None

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"maxdnn_conv2d: activation {self.activation!r} is not one of {ACTIVATIONS}")


@dataclasses.dataclass(frozen=True)
class MaxDNNPlan:
    """A workload, its block tile and its epilogue: everything the generator reads."""

    wl: Conv2dWorkload
    tile: BlockTile
    epilogue: Epilogue = Epilogue()
    splits: int = 1  # split-K: the reduction in this many slices (see :attr:`split_unit`)

    @staticmethod
    def make(wl: Conv2dWorkload, tile: BlockTile | None = None, epilogue: Epilogue | None = None,
             splits: int = 1) -> MaxDNNPlan:
        if wl.dtype != "float32":
            raise ValueError(f"maxdnn_conv2d: dtype {wl.dtype} is not supported (float32 only)")
        tile = tile or choose_tile(wl.K // wl.groups, columns=wl.N * wl.OH * wl.OW)
        tile.validate()
        plan = MaxDNNPlan(wl, tile, epilogue or Epilogue(), splits)
        if splits != 1:
            unit = plan.split_unit
            if unit is None or splits < 1 or unit[1] % splits:
                raise ValueError(f"maxdnn_conv2d: split-K into {splits} needs an RSC reduction whose taps (or, "
                                 f"for a 1x1 filter, k steps) divide into {splits}; this one has {unit}")
        largest = max(math.prod(shape) for shape in {**plan.shapes(), **plan.reduce_shapes()}.values())
        if largest > MAX_ELEMENTS:
            raise ValueError(f"maxdnn_conv2d: a tensor of {largest} elements is past the kernel's 32-bit indices "
                             f"({MAX_ELEMENTS})")
        return plan

    def with_chosen_splits(self) -> MaxDNNPlan:
        """This plan with the split-K the graph strategy uses for it (:func:`choose_splits`)."""
        return dataclasses.replace(self, splits=choose_splits(self))

    @property
    def split_unit(self) -> tuple[str, int] | None:
        """What split-K divides, and how many there are: the filter taps of a :attr:`tap_loop`,
        or the k steps of a 1x1 filter in RSC order; None where the reduction does not split."""
        if self.tap_loop:
            return "taps", self.wl.KH * self.wl.KW
        if self.k_order == "rsc" and self.wl.KH * self.wl.KW == 1:
            return "steps", self.k_steps
        return None

    @property
    def y_shape(self) -> tuple[int, int, int, int]:
        """The output, KPQN."""
        wl = self.wl
        return (wl.K, wl.OH, wl.OW, wl.N)

    @property
    def gemm(self) -> tuple[int, int, int]:
        """(M, N, K) of one group's implicit GEMM."""
        wl = self.wl
        return wl.K // wl.groups, wl.OH * wl.OW * wl.N, wl.C // wl.groups * wl.KH * wl.KW

    @property
    def grid(self) -> tuple[int, int, int]:
        m, n, _ = self.gemm
        return (-(-n // self.tile.cols), -(-m // self.tile.rows), self.wl.groups * self.splits)

    @property
    def k_steps(self) -> int:
        return -(-self.gemm[2] // self.tile.k_step)

    @property
    def code_steps(self) -> int:
        """k steps written out in the kernel's code: with :attr:`tap_loop`, the channel loop's
        unrolled pair (where a tap has more than one pair) and the tap's last pair; otherwise the
        loop's unrolled pair plus the tail; with wgmma in flight, the loop's :data:`WGMMA_RING`
        steps and the rest."""
        if self.wgmma_in_flight:
            steps = self.k_steps // self.splits
            return (WGMMA_RING if steps // WGMMA_RING else 0) + steps % WGMMA_RING
        if self.tap_loop:
            return 4 if self.steps_per_tap > 2 else 2
        pairs = (self.k_steps - 1) // 2
        return (2 if pairs else 0) + self.k_steps - 2 * pairs

    @property
    def steps_per_tap(self) -> int:
        """k steps per filter tap in RSC order (C/groups/k_step)."""
        return self.wl.C // self.wl.groups // self.tile.k_step

    @property
    def tap_loop(self) -> bool:
        """The k loop as a loop over filter taps around a loop over channel steps (RSC order,
        several taps, an even number of steps per tap so each tap starts on the same buffer):
        the inner loop then issues no index math or bounds logic at all, the per-tap work (where
        each load slot reads, whether it is in the padding) runs once per tap."""
        return self.k_order == "rsc" and self.wl.KH * self.wl.KW > 1 and self.steps_per_tap % 2 == 0

    @property
    def k_order(self) -> str:
        """The order of the reduction (c, r, s): "rsc" (channels innermost) when a k step's 8
        rows are 8 channels of one filter tap, which makes the tap uniform across the block and
        leaves one division per step instead of four per load slot; "crs" otherwise (3 input
        channels, say). The weights are laid out in the same order."""
        cg = self.wl.C // self.wl.groups
        return "rsc" if cg % self.tile.k_step == 0 else "crs"

    @property
    def gathers_fragments(self) -> bool:
        """wgmma with :attr:`BlockTile.gather_fragments` in RSC order: each thread loads its four
        A-fragment values per slab and k step straight from the input (the im2col tile never goes
        through shared memory, which then holds only the weights' tile: a third less shared
        traffic per MAC); in CRS order the tile is staged in shared memory as for mma.sync."""
        return self.tile.gather_fragments and self.k_order == "rsc"

    @property
    def wgmma_in_flight(self) -> bool:
        """wgmma with gathered fragments keeps one group in flight across each k step's barrier:
        the weights' tiles in a ring of :data:`WGMMA_RING` shared buffers (a step fills the one
        the group before last read, which every thread has waited for before the last barrier;
        a ring of two would need a second barrier per step). The fragments and the weights are
        loaded two steps ahead, into a register set per ring slot (the k loop runs a ring at a
        time, :meth:`_Generator.step_in_flight`): neither the store at the end of a step nor the
        next step's wgmma waits for loads issued at its start. Elsewhere a step waits for its
        group before the barrier."""
        return self.gathers_fragments

    @property
    def operand_tiles(self) -> dict[str, int]:
        """The operand tiles in shared memory, floats per buffer (each is double-buffered): the
        weights' "A" (wgmma: in the descriptor's layout, unpadded) and the im2col "B", their
        rows padded by :attr:`BlockTile.pad`; no B where the fragments are gathered."""
        t = self.tile
        tiles = {"A": t.weight_words if t.wgmma is not None else t.k_step * (t.rows + t.pad)}
        if not self.gathers_fragments:
            tiles["B"] = t.k_step * (t.cols + t.pad)
        return tiles

    @property
    def dynamic_shared_bytes(self) -> int:
        """The dynamic shared memory the kernel is launched with: 0 where its tiles fit the 48 KB
        a kernel may declare statically; else the output tile's (the operand tiles stay static)."""
        if self.tile.shared_bytes() <= STATIC_SHARED_LIMIT:
            return 0
        return 4 * self.tile.rows * self.tile.cols

    @property
    def vector_a(self) -> bool:
        """Weight rows hold whole float4 (output channels per group a multiple of 4)."""
        return self.gemm[0] % self.tile.vec == 0

    @property
    def vector_b(self) -> bool:
        """Four consecutive columns are four images of one pixel (batch a multiple of 4)."""
        return self.wl.N % self.tile.vec == 0

    @property
    def vector_y(self) -> bool:
        return self.gemm[1] % self.tile.vec == 0

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The kernel's parameters in order, with their shapes: x, w[, bias][, residual], y; with
        split-K x, w, partial (each slice's sums; the epilogue is :meth:`reduce_shapes`' kernel's)."""
        wl = self.wl
        shapes = {"x": (wl.C, wl.H, wl.W, wl.N), "w": self.weight_shape}
        if self.splits > 1:
            shapes["partial"] = (self.splits, *self.y_shape)
            return shapes
        return {**shapes, **self._epilogue_shapes(), "y": self.y_shape}

    @property
    def weight_shape(self) -> tuple[int, ...]:
        """The kernel's weights: [groups, K, M] (:func:`weight_to_crsk`); for wgmma, each block's k
        steps already in the tensor cores' shared layout (:func:`pack_wgmma_weight`)."""
        m, _, k = self.gemm
        if self.tile.wgmma is None:
            return (self.wl.groups, k, m)
        return (self.wl.groups, self.grid[1], self.k_steps, self.tile.weight_words)

    def reduce_shapes(self) -> dict[str, tuple[int, ...]]:
        """With split-K, the parameters of the kernel that sums the slices and applies the
        epilogue (:func:`split_reduce_func`): partial[, bias][, residual], y; else none."""
        if self.splits == 1:
            return {}
        return {"partial": (self.splits, *self.y_shape), **self._epilogue_shapes(), "y": self.y_shape}

    def _epilogue_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {}
        if self.epilogue.bias:
            shapes["bias"] = (self.wl.K,)
        if self.epilogue.residual:
            shapes["residual"] = self.y_shape
        return shapes


class _Emitter:
    """Builds the kernel's TVMScript text line by line (indentation tracked)."""

    def __init__(self):
        self.lines: list[str] = []
        self.depth = 0

    def __call__(self, line: str) -> None:
        self.lines.append("    " * self.depth + line)

    def block(self, header: str):
        emitter = self

        class _Scope:
            def __enter__(self):
                emitter(header)
                emitter.depth += 1

            def __exit__(self, *exc):
                emitter.depth -= 1

        return _Scope()


def _clamp_text(value: str, vec: int, upper: float | None) -> str:
    """relu (`upper` None) or relu6 of the TVMScript value `value` (a name: it is read twice), as
    selects that keep a NaN, as PyTorch does."""
    def const(c: float) -> str:
        return f"T.Broadcast(T.float32({c}), {vec})" if vec > 1 else f"T.float32({c})"

    clamped = value if upper is None else f"T.Select({value} > {const(upper)}, {const(upper)}, {value})"
    return f"T.Select({value} < {const(0)}, {const(0)}, {clamped})"


def _zero(vec: int) -> str:
    return f"T.Broadcast(T.float32(0), {vec})"


def _bf16_pair(low: str, high: str) -> str:
    """Two float32 expressions rounded to bf16 (nearest even) and packed into a uint32, `low` in
    the low half: one register of a bf16 tensor-core operand."""
    low, high = (f'T.Cast("uint32", T.reinterpret("uint16", T.Cast("bfloat16", {v})))' for v in (low, high))
    return f"{low} | ({high} << T.uint32(16))"


class _Generator:
    """Emits the kernel for one plan (see the module docstring for the algorithm)."""

    def __init__(self, plan: MaxDNNPlan, fault: str | None = None):
        self.plan, self.t, self.wl = plan, plan.tile, plan.wl
        self.M, self.NCOLS, self.K = plan.gemm
        self.e = _Emitter()
        if fault not in FAULTS:
            raise ValueError(f"maxdnn_conv2d: fault {fault!r} is not one of {FAULTS}")
        self.fault = fault
        self.load_sites = 0

    # -- per-thread constants -------------------------------------------------------------
    def slots(self, count: int) -> list[tuple[int, bool]]:
        """(slot, guarded) for distributing `count` float4 slots over the block's threads."""
        n = -(-count // self.t.threads)
        return [(s, (s + 1) * self.t.threads > count) for s in range(n)]

    def b_columns(self) -> None:
        """Bind, per B load slot (and lane if scalar), the k-invariant part of the gather."""
        t, e = self.t, self.e
        if self.plan.gathers_fragments:
            self.fragment_columns()
            return
        per_row = t.cols // t.vec
        lanes = self.lanes
        for s, _ in self.slots(t.k_step * per_row):
            e(f"bf{s}: T.let = tid + {s * t.threads}")
            for lane in lanes:
                self.bind_column("b", f"{s}_{lane}", f"bx * {t.cols} + bf{s} % {per_row} * {t.vec} + {lane}")
        if self.plan.k_order == "rsc":
            self.declare_tap_state("b", len(self.slots(t.k_step * per_row)) * len(lanes))

    def bind_column(self, prefix: str, v: str, column: str) -> None:
        """Bind tile column `column`'s k-invariant gather: `{prefix}c{v}` the column, `{prefix}h{v}`
        and `{prefix}w{v}` the input row and column of its pixel at filter tap (0, 0) (padding
        subtracted), `{prefix}n{v}` its image."""
        wl, e = self.wl, self.e
        e(f"{prefix}c{v}: T.let = {column}")
        e(f"{prefix}pq{v}: T.let = {prefix}c{v} // {wl.N}")
        e(f"{prefix}h{v}: T.let = {prefix}pq{v} // {wl.OW} * {wl.stride[0]} - {wl.padding[0]}")
        e(f"{prefix}w{v}: T.let = {prefix}pq{v} % {wl.OW} * {wl.stride[1]} - {wl.padding[1]}")
        e(f"{prefix}n{v}: T.let = {prefix}c{v} % {wl.N}")

    def declare_tap_state(self, prefix: str, count: int) -> None:
        """RSC order: the running (tap, channel step) where there is no tap loop or the fragments
        are gathered, and per gathered column its offset in the input at the current tap and
        whether it reads the input."""
        e = self.e
        if not self.plan.tap_loop or self.plan.gathers_fragments:
            e('tap = T.decl_buffer((1,), "int32", scope="local")')
            e('c0 = T.decl_buffer((1,), "int32", scope="local")')
        e(f'{prefix}_off = T.decl_buffer(({count},), "int32", scope="local")')
        if self.plan.gathers_fragments:  # as a mask: all ones where the column reads the input
            e(f'{prefix}_mask = T.decl_buffer(({count},), "uint32", scope="local")')
        else:
            e(f'{prefix}_live = T.decl_buffer(({count},), "bool", scope="local")')

    def tap_position(self, prefix: str, tap: str) -> Callable[[str], tuple[str, str, str]]:
        """Bind filter tap `tap`'s (row, column) offsets once per site; returns a function of a
        bound column's suffix giving (whether it reads the input, its input row, its input column)."""
        wl, e = self.wl, self.e
        z = f"_{self.load_sites}"
        e(f"{prefix}r{z}: T.let = {tap} // {wl.KW} * {wl.dilation[0]}")
        e(f"{prefix}s{z}: T.let = {tap} % {wl.KW} * {wl.dilation[1]}")

        def at(v: str) -> tuple[str, str, str]:
            h, w = f"{prefix}h{v} + {prefix}r{z}", f"{prefix}w{v} + {prefix}s{z}"
            live = f"{prefix}c{v} < {self.NCOLS} and 0 <= {h} and {h} < {wl.H} and 0 <= {w} and {w} < {wl.W}"
            return live, h, w

        return at

    def fragment_columns(self) -> None:
        """Gathered wgmma fragments: per slab and row half h, the tile column this thread's A
        registers h and h + 2 read (row 16 warp + g + 8h of the slab), its k-invariant gather."""
        t = self.t
        for sl in range(t.slabs):
            for h in range(2):
                self.bind_column("f", f"{sl}_{h}", f"bx * {t.cols} + {sl * 64 + h * 8} + warp * 16 + gq")
        self.declare_tap_state("f", 2 * t.slabs)

    def enter_tap_fragments(self, tap: str) -> None:
        """Gathered wgmma fragments, for filter tap `tap`: per column, where its k row t (channel
        t of the step) is in the input, and whether it is read at all (`f_mask`: all ones, or
        zeros). A dead column (padding, past the end) reads its channel's first element instead,
        and its loads are masked to zeros."""
        t, wl, e = self.t, self.wl, self.e
        cg = wl.C // wl.groups
        position = self.tap_position("f", tap)
        for sl in range(t.slabs):
            for h in range(2):
                v, i = f"{sl}_{h}", sl * 2 + h
                live, row, col = position(v)
                e(f"f_mask[{i}] = T.Select({live}, T.uint32({2**32 - 1}), T.uint32(0))")
                per = t.wgmma.per_reg
                chan = f"(g * {cg} + tq{f' * {per}' if per > 1 else ''})"
                e(f"f_off[{i}] = T.Select(f_mask[{i}] > T.uint32(0), (({chan} * {wl.H} + {row}) * {wl.W} + "
                  f"{col}) * {wl.N} + fn{v}, {chan} * {wl.H * wl.W * wl.N})")

    def load_fragments(self, chan: str, regs: int = 0) -> None:
        """Gathered wgmma fragments of channel step `chan` of the current tap, straight into the
        registers the wgmma reads (set `regs` of `af`): register h + 2j of a slab holds k rows
        t per_reg + e + k/2 j (channels) of the column of row half h (bf16: two, rounded and
        packed); scalar loads, 8 lanes of a warp reading 8 consecutive images or pixels, zeros
        for a dead column. Each load is unconditional (a dead column's offset is a safe one)
        and then masked: a load under a condition becomes a zeroing move and a predicated load,
        and a select a branch, after either of which ptxas (nvcc 13.0) serializes the wgmma
        (C7513) where the gather has no tap entry to keep it apart from the wait (1x1 filters)."""
        t, wl, e = self.t, self.wl, self.e
        plane = wl.H * wl.W * wl.N
        base = self.fragment_base(regs)
        per = t.wgmma.per_reg
        for sl in range(t.slabs):
            for h in range(2):
                i = sl * 2 + h
                for j in range(2):
                    r = sl * 4 + h + 2 * j
                    for el in range(per):
                        e(f"fv[{r * per + el}] = Xf[f_off[{i}] + ({chan} * {t.k_step} + {j * t.k_step // 2 + el}) * "
                          f"{plane}]")
                    bits = (f'T.reinterpret("uint32", fv[{r}])' if per == 1
                            else f'({_bf16_pair(f"fv[{r * per}]", f"fv[{r * per + 1}]")})')
                    e(f"af[{base + r}] = {bits} & f_mask[{i}]")

    @property
    def lanes(self) -> list[int]:
        """The lanes of a B load slot gathered one by one (one float4 where the batch allows)."""
        return [0] if self.plan.vector_b else list(range(self.t.vec))

    # -- the RSC gather: per-tap state, loads with no index math ---------------------------
    def enter_tap(self, tap: str) -> None:
        """Per B load slot (and lane), for filter tap `tap`: where its rows start in the input at
        channel offset 0, and whether it reads the input at all (a padding border, a column past
        the end, a slot beyond the tile). A dead slot's registers are zeroed here and left alone
        by the tap's loads, so its shared row is zero without a select per step."""
        if self.plan.gathers_fragments:
            self.enter_tap_fragments(tap)
            return
        t, wl, e = self.t, self.wl, self.e
        per_row = t.cols // t.vec
        cg = wl.C // wl.groups
        position = self.tap_position("b", tap)
        vec = t.vec if self.plan.vector_b else 1
        for s, guarded in self.slots(t.k_step * per_row):
            for lane in self.lanes:
                v, i = f"{s}_{lane}", s * len(self.lanes) + lane
                live, h, w = position(v)
                live += f" and bf{s} < {t.k_step * per_row}" if guarded else ""
                e(f"b_live[{i}] = {live}")
                # in units of the load's width, so that TVM sees the float4 loads aligned
                e(f"b_off[{i}] = (((g * {cg} + bf{s} // {per_row}) * {wl.H} + {h}) * {wl.W} + {w}) * {wl.N // vec}"
                  f" + bn{v} // {vec}")
                at = s * t.vec + lane
                with e.block(f"if not b_live[{i}]:"):
                    e(f"b_pre[T.ramp({at}, 1, {vec})] = {_zero(vec)}" if vec > 1 else f"b_pre[{at}] = T.float32(0)")

    def advance_running_tap(self, first: bool) -> str:
        """Without :attr:`MaxDNNPlan.tap_loop` (or for gathered fragments, loaded two steps
        ahead of the loop's tap): move the running (tap, channel step) to the next k step,
        entering a new tap only when the channels run out (a runtime check; a 1x1 filter has one
        tap). Returns the channel step's expression."""
        wl, e = self.wl, self.e
        if first:  # a slice of split-K starts at its first tap, or a 1x1 filter's at its first channel step
            e(f"tap[0] = {self.first_step() if self.plan.tap_loop else 0}")
            e(f"c0[0] = {0 if self.plan.tap_loop else self.first_step()}")
            self.enter_tap("tap[0]")
        elif wl.KH * wl.KW == 1:
            e("c0[0] = c0[0] + 1")
        else:
            e("c0[0] = c0[0] + 1")
            with e.block(f"if c0[0] == {self.plan.steps_per_tap}:"):
                e("c0[0] = 0")
                e("tap[0] = tap[0] + 1")
                self.enter_tap("tap[0]")
        return "c0[0]"

    def load_b_rsc(self, chan: str) -> None:
        """The B loads of a k step in RSC order, channel step `chan` of the current tap: its 8
        rows are 8 channels of one tap, so each live slot reads at its tap's offset plus the
        channel offset, with no index math or bounds checks."""
        t, wl, e = self.t, self.wl, self.e
        per_row = t.cols // t.vec
        vec = t.vec if self.plan.vector_b else 1
        plane = wl.H * wl.W * wl.N // vec * t.k_step  # one channel step, in units of the load
        for s, _ in self.slots(t.k_step * per_row):
            for lane in self.lanes:
                i, at = s * len(self.lanes) + lane, s * t.vec + lane
                addr = f"(b_off[{i}] + {chan} * {plane}) * {vec}"
                with e.block(f"if b_live[{i}]:"):
                    if vec > 1:
                        e(f"b_pre[T.ramp({at}, 1, {vec})] = Xf[T.ramp({addr}, 1, {vec})]")
                    else:
                        e(f"b_pre[{at}] = Xf[{addr}]")

    # -- global -> registers -> shared -----------------------------------------------------
    def load_global(self, kt: str, at: tuple[str | None, str] | None = None, first: bool = False,
                    regs: int = 0) -> None:
        """Issue the global loads of k step `kt` into the prefetch registers (gathered fragments:
        into set `regs`).

        In RSC order the B loads come from the per-tap state: `at` = (the tap to enter first, or
        None to stay; the channel step) where the k loop knows them (:attr:`MaxDNNPlan.tap_loop`);
        otherwise a running state moves one step per call (`first`: step 0), so calls come in k
        order. Gathered fragments always take the running state: they are loaded two steps
        ahead of the loop's tap."""
        t, wl, e = self.t, self.wl, self.e
        z = f"_{self.load_sites}"  # TVMScript lets are scoped to the function: one name per site
        self.load_sites += 1
        if t.wgmma is None:
            self.load_weight_rows(kt, z)
        elif not self.plan.wgmma_in_flight:  # (in flight, they are loaded two steps ahead: step)
            self.load_packed_weights(kt)
        if self.plan.gathers_fragments:
            self.load_fragments(self.advance_running_tap(first), regs)
            return
        if self.plan.k_order == "rsc":
            load = self.load_b_rsc
            if at is None:
                load(self.advance_running_tap(first))
                return
            tap, chan = at
            if tap is not None:
                self.enter_tap(tap)
            load(chan)
            return
        per_row_b = t.cols // t.vec
        rs, S = wl.KH * wl.KW, wl.KW
        dh, dw = wl.dilation
        cg = wl.C // wl.groups
        for s, guarded in self.slots(t.k_step * per_row_b):  # k = (c * R + r) * S + s
            e(f"bk{s}{z}: T.let = {kt} * {t.k_step} + bf{s} // {per_row_b}")
            e(f"bcin{s}{z}: T.let = g * {cg} + bk{s}{z} // {rs}")
            e(f"br{s}{z}: T.let = bk{s}{z} % {rs} // {S} * {dh}")
            e(f"bs{s}{z}: T.let = bk{s}{z} % {S} * {dw}")
            k_live = f"bk{s}{z} < {self.K}" + (f" and bf{s} < {t.k_step * per_row_b}" if guarded else "")
            for lane in self.lanes:
                v = f"{s}_{lane}"
                h, w = f"bh{v} + br{s}{z}", f"bw{v} + bs{s}{z}"
                live = (f"{k_live} and bc{v} < {self.NCOLS} and 0 <= {h} and {h} < {wl.H} "
                        f"and 0 <= {w} and {w} < {wl.W}")
                addr = f"((bcin{s}{z} * {wl.H} + {h}) * {wl.W} + {w}) * {wl.N} + bn{v}"
                vec = t.vec if self.plan.vector_b else 1
                self.guarded_load("b_pre", s * t.vec + lane, live, "Xf", addr, vec)

    def load_weight_rows(self, kt: str, z: str) -> None:
        """k step `kt`'s k_step rows of the [groups, K, M] weights, guarded at the K and M edges
        (float4 where M allows); `z` names this load site's lets."""
        t, e = self.t, self.e
        M, K = self.M, self.K
        per_row_a = t.rows // t.vec
        for s, guarded in self.slots(t.k_step * per_row_a):
            f = f"(tid + {s * t.threads})"
            e(f"ak{s}{z}: T.let = {kt} * {t.k_step} + {f} // {per_row_a}")
            e(f"ao{s}{z}: T.let = by * {t.rows} + {f} % {per_row_a} * {t.vec}")
            live = f"ak{s}{z} < {K}" + (f" and {f} < {t.k_step * per_row_a}" if guarded else "")
            base = f"(g * {K} + ak{s}{z}) * {M} + ao{s}{z}"
            if self.plan.vector_a:
                self.guarded_load("a_pre", s * t.vec, f"{live} and ao{s}{z} < {M}", "Wf", base, t.vec)
            else:
                for lane in range(t.vec):
                    self.guarded_load("a_pre", s * t.vec + lane, f"{live} and ao{s}{z} + {lane} < {M}", "Wf",
                                      f"{base} + {lane}", 1)

    @property
    def weight_regs(self) -> int:
        """Words of one set of the weights' prefetch registers (`a_pre`): the thread's float4
        slots of a k step's rows x k_step tile (:attr:`BlockTile.weight_words`)."""
        t = self.t
        return len(self.slots(t.weight_words // t.vec)) * t.vec

    def fragment_base(self, slot: int) -> int:
        """Where the fragment registers (`af`) of a step in ring slot `slot` start: one set per
        slot where wgmma groups stay in flight (:attr:`MaxDNNPlan.wgmma_in_flight`), else one."""
        return slot * 4 * self.t.slabs if self.plan.wgmma_in_flight else 0

    def load_packed_weights(self, kt: str, regs: int = 0) -> None:
        """wgmma: k step `kt`'s chunk of the packed weights (:func:`pack_wgmma_weight`), contiguous
        and zero-padded: float4 loads with no guards (of bf16 pairs' bits for bf16), into register
        set `regs` (one per ring slot where the weights are loaded two steps ahead,
        :attr:`MaxDNNPlan.wgmma_in_flight`)."""
        t, e = self.t, self.e
        chunk = t.weight_words
        base = regs * self.weight_regs
        for s, guarded in self.slots(chunk // t.vec):
            f = f"(tid + {s * t.threads})"
            addr = f"((g * {self.plan.grid[1]} + by) * {self.plan.k_steps} + {kt}) * {chunk} + {f} * {t.vec}"
            with self.only_if(f"{f} < {chunk // t.vec}" if guarded else None):
                e(f"a_pre[T.ramp({base + s * t.vec}, 1, {t.vec})] = Wf[T.ramp({addr}, 1, {t.vec})]")

    def guarded_load(self, reg: str, at: int, live: str, src: str, addr: str, vec: int) -> None:
        """reg[at : at + vec] = src[addr : addr + vec] where `live`, else zeros (a border, a tail)."""
        e = self.e
        if vec == 1:
            e(f"{reg}[{at}] = T.if_then_else({live}, {src}[{addr}], T.float32(0))")
            return
        with e.block(f"if {live}:"):
            e(f"{reg}[T.ramp({at}, 1, {vec})] = {src}[T.ramp({addr}, 1, {vec})]")
        with e.block("else:"):
            e(f"{reg}[T.ramp({at}, 1, {vec})] = {_zero(vec)}")

    def store_shared(self, buf: int, kt: str) -> None:
        """The prefetched tiles of k step `kt` into shared buffer `buf` (where wgmma stays in
        flight: the ring's slot `buf`, from the weights' register set of that slot)."""
        t, e = self.t, self.e
        if t.wgmma is not None:  # A: the packed chunk as it is, already in the descriptor's layout
            chunk = t.weight_words
            tile, at = (("A_ring", f"{buf * chunk} + ") if self.plan.wgmma_in_flight else (f"A_sh{buf}", ""))
            regs = buf * self.weight_regs if self.plan.wgmma_in_flight else 0
            for s, guarded in self.slots(chunk // t.vec):
                f = f"(tid + {s * t.threads})"
                with self.only_if(f"{f} < {chunk // t.vec}" if guarded else None):
                    e(f"{tile}[T.ramp({at}{f} * {t.vec}, 1, {t.vec})] = a_pre[T.ramp({regs + s * t.vec}, 1, {t.vec})]")
        for name in self.staged_tiles:
            extent, reg = (t.rows, "a_pre") if name == "A" else (t.cols, "b_pre")
            per_row = extent // t.vec
            for s, guarded in self.slots(t.k_step * per_row):
                f = f"(tid + {s * t.threads})"
                store = (f"{self.shared_at(name, buf, f'{f} // {per_row}', f'{f} % {per_row} * {t.vec}', t.vec)} = "
                         f"{reg}[T.ramp({s * t.vec}, 1, {t.vec})]")
                if guarded:
                    with e.block(f"if {f} < {t.k_step * per_row}:"):
                        e(store)
                else:
                    e(store)
        if t.wgmma is not None and self.fault != "no_proxy_fence":  # the tensor cores read the
            # weights' tile through the async proxy: without this fence they may see it as it was
            # before the stores (NaN on an H200)
            e('T.ptx["fence.proxy.async.shared::cta"]()')

    def shared_at(self, name: str, buf: int, row: str, col: str, lanes: int = 1) -> str:
        """Element (row, col) of operand tile `name` ("A", "B") in shared buffer `buf`, `lanes`
        consecutive columns as one vector. Padded tiles are declared flat and indexed with their
        padded row stride: TVM's CompactBufferAllocation trims a 2-D buffer to the columns it
        sees accessed, which drops the padding and, with it, the bank spread the padding is for."""
        if self.t.pad:
            index = f"({row}) * {self.shared_stride(name)} + {col}"
            return f"{name}_sh{buf}[T.ramp({index}, 1, {lanes})]" if lanes > 1 else f"{name}_sh{buf}[{index}]"
        return f"{name}_sh{buf}[{row}, {f'T.ramp({col}, 1, {lanes})' if lanes > 1 else col}]"

    @property
    def staged_tiles(self) -> tuple[str, ...]:
        """The operand tiles staged as k_step rows: all but wgmma's weights, which come already
        in the descriptor's layout."""
        return tuple(name for name in self.plan.operand_tiles if self.t.wgmma is None or name != "A")

    def shared_stride(self, name: str) -> int:
        """Floats per shared row of operand tile `name`, padding included."""
        return (self.t.rows if name == "A" else self.t.cols) + self.t.pad

    def declare_shared(self) -> None:
        """The operand tiles, double-buffered (:meth:`MaxDNNPlan.operand_tiles`), as `__shared__`
        arrays, and the output tile: one too, or where the block needs more than a kernel may
        declare statically, the launch's dynamic shared memory (:attr:`MaxDNNPlan.dynamic_shared_bytes`).
        Separate allocations, not views into one arena: TVM's barrier planner tells buffers apart
        by allocation, and would put a second barrier in every k step between the compute on
        one buffer and the stores to the other."""
        t, e = self.t, self.e
        if self.plan.wgmma_in_flight:  # (only the weights' tile: the fragments are gathered)
            e(f'A_ring = T.decl_buffer(({WGMMA_RING * self.plan.operand_tiles["A"]},), "float32", scope="shared")')
        else:
            for buf in (0, 1):
                for name, floats in self.plan.operand_tiles.items():
                    # flat: the descriptor's layout (WgmmaShape), or padded rows (see shared_at)
                    flat = name not in self.staged_tiles or t.pad
                    shape = f"({floats},)" if flat else f"({t.k_step}, {self.shared_stride(name)})"
                    e(f'{name}_sh{buf} = T.decl_buffer({shape}, "float32", scope="shared")')
        scope = "shared.dyn" if self.plan.dynamic_shared_bytes else "shared"
        e(f'O_sh = T.decl_buffer(({t.rows}, {t.cols}), "float32", scope="{scope}")')

    def sync(self) -> None:
        self.e('T.evaluate(T.tvm_storage_sync("shared"))')

    def compute(self, buf: int, name: str) -> None:
        t, e = self.t, self.e
        tt = t.thread_tile()
        with e.block(f"for kk, i0, i1, j0, j1 in T.grid({t.k_step}, {tt.rows // t.vec}, {t.vec}, "
                     f"{tt.cols // t.vec}, {t.vec}):"):
            with e.block(f'with T.sblock("{name}"):'):
                e(f"vty = T.axis.spatial({t.threads_m}, tid // {t.threads_n})")
                e(f"vtx = T.axis.spatial({t.threads_n}, tid % {t.threads_n})")
                e(f"vk = T.axis.reduce({t.k_step}, kk)")
                e('vi0, vi1, vj0, vj1 = T.axis.remap("SSSS", [i0, i1, j0, j1])')
                c = f"vi0 * {t.vec} + vi1, vj0 * {t.vec} + vj1"
                e(f"acc[{c}] = acc[{c}] + A_sh{buf}[vk, vty * {t.vec} + vi0 * {tt.row_gap} + vi1] * "
                  f"B_sh{buf}[vk, vtx * {t.vec} + vj0 * {tt.col_gap} + vj1]")

    def compute_mma(self, buf: int) -> None:
        """One k step on the tensor cores: a warp's warp_rows x cols slab as warp_rows/16 x cols/8
        mma.sync, its fragments loaded from shared memory in the layouts of :class:`MmaShape`.

        The mma's row and column indices are a permutation of the tile's (:meth:`BlockTile.mma_row`,
        :meth:`BlockTile.mma_col`; the output staging undoes it) that puts side by side the values a
        lane needs from one shared row, so that it loads them as one vector (:attr:`BlockTile.mma_chunks`).
        tf32 takes the registers as loaded: an A fragment's rows g and g + 8 are one 64-bit load
        into the register pair the mma reads (its B registers come from two k rows: 32-bit loads).
        bf16 packs two k rows into each register anyway: its loads are 128-bit, into `a_val` and
        `b_val`, then packed."""
        t, e, mma = self.t, self.e, self.t.mma
        mt, nt = t.mma_tiles
        half, per = mma.k // 2, mma.per_reg
        ca, cb = t.mma_chunks
        a_base = f"warp * {t.warp_rows} + "
        if per == 1:
            with e.block(f"for mi in T.unroll({mt}):"):
                for kh in range(2):  # A registers j, j + 1 = rows g, g + 8 of k-half j // 2
                    e(f"a_val[T.ramp(mi * 4 + {2 * kh}, 1, 2)] = "
                      f"{self.shared_at('A', buf, f'tq + {kh * half}', a_base + t.mma_row('mi * 2', 'gq'), 2)}")
                # a copy nvcc does not issue (the same registers); TVM would declare `af` float2
                # if the load wrote it, and offset the mma's pointer into it in float2 units
                with e.block("for j in T.unroll(4):"):
                    e("af[mi * 4 + j] = a_val[mi * 4 + j]")
            with e.block(f"for ni in T.unroll({nt}):"):
                with e.block("for j in T.unroll(2):"):
                    e(f"bf[ni * 2 + j] = {self.shared_at('B', buf, f'tq + j * {half}', t.mma_col('ni', 'gq'))}")
        else:
            for operand, count, chunk, base in (("a", 2 * mt, ca, a_base), ("b", nt, cb, "")):
                for kh in range(2):  # the 2 x per k rows a lane reads, `chunk` values a load
                    for el in range(per):
                        at = (kh * per + el) * count
                        for q in range(count // chunk):
                            col = f"{base}{q * 8 * chunk} + gq * {chunk}"
                            e(f"{operand}_val[T.ramp({at + q * chunk}, 1, {chunk})] = "
                              f"{self.shared_at(operand.upper(), buf, f'tq * {per} + {el + kh * half}', col, chunk)}")

            def packed(operand: str, count: int, kh: int, v: int) -> str:
                return _bf16_pair(*(f"{operand}_val[{(kh * per + el) * count + v}]" for el in range(per)))

            for mi in range(mt):
                for j in range(4):  # A register j: rows g + 8 (j % 2), k-half j // 2
                    e(f"af[{mi * 4 + j}] = {packed('a', 2 * mt, j // 2, 2 * mi + j % 2)}")
            for ni in range(nt):
                for j in range(2):  # B register j: k-half j
                    e(f"bf[{ni * 2 + j}] = {packed('b', nt, j, ni)}")
        with e.block(f"for mi in T.unroll({mt}):"):
            with e.block(f"for ni in T.unroll({nt}):"):
                e(f'T.evaluate(T.ptx_legacy.mma("{mma.shape}", "row", "col", "{mma.ptx_type}", "{mma.ptx_type}", '
                  f'"fp32", af.data, mi * 4, bf.data, ni * 2, acc.data, (mi * {nt} + ni) * 4, False, '
                  'dtype="float32"))')

    def compute_wgmma(self, buf: int, slot: int = 0) -> None:
        """One k step on Hopper's tensor cores: per 64-column slab one asynchronous wgmma of the
        whole warpgroup, N = the block's rows. Its A operand is the slab's data (the im2col tile),
        from registers in the layout of :class:`WgmmaShape` (where groups stay in flight, the set
        of ring slot `slot`, gathered there two steps before); its B operand the weights' tile,
        which the tensor cores read from shared memory through a descriptor: of buffer `buf` (in
        flight: of the ring's slot `buf`). The caller waits for the group before the tile or
        registers change."""
        t, e, wg = self.t, self.e, self.t.wgmma
        half = wg.k // 2
        base = self.fragment_base(slot)
        desc = f"desc[{buf}]"
        if self.plan.wgmma_in_flight:  # the start address (16-byte units, the low bits) moved to the slot
            desc = f"desc[0] + T.uint64({buf * t.weight_words * 4 // 16})"
        if not self.plan.gathers_fragments:
            per = wg.per_reg
            with e.block(f"for sl in T.unroll({t.slabs}):"):
                # A[16 warp + g + 8 (j % 2)][t per + e + k/2 (j // 2)]
                with e.block("for j in T.unroll(4):"):
                    at = [self.shared_at("B", buf, f"tq{f' * {per} + {el}' if per > 1 else ''} + j // 2 * {half}",
                                         "sl * 64 + warp * 16 + gq + j % 2 * 8") for el in range(per)]
                    bits = f'T.reinterpret("uint32", {at[0]})' if per == 1 else _bf16_pair(*at)
                    e(f"af[{base} + sl * 4 + j] = {bits}")
        e('T.ptx["wgmma.fence.sync.aligned"]()')
        per_slab = t.rows // 2
        for sl in range(t.slabs):
            d = ", ".join(f"acc[{sl * per_slab + i}]" for i in range(per_slab))
            a = ", ".join(f"af[{base + sl * 4 + j}]" for j in range(4))
            e(f'T.ptx["{wg.opcode(t.rows)}"]({d}, {a}, {desc}, T.bool(True), {wg.immediates})')
        e('T.ptx["wgmma.commit_group.sync.aligned"]()')

    def stage_accumulators(self) -> None:
        """Each thread's accumulators into the block's output tile in shared memory."""
        t, e = self.t, self.e
        if t.wgmma is not None:  # D[16 warp + g + 8h][8c + 2t + b] of slab sl: row = channel
            with e.block(f"for sl, c, h, b in T.grid({t.slabs}, {t.rows // 8}, 2, 2):"):
                e(f"O_sh[c * 8 + tq * 2 + b, sl * 64 + warp * 16 + gq + h * 8] = "
                  f"acc[sl * {t.rows // 2} + c * 4 + h * 2 + b]")
            return
        if t.mma is not None:
            mt, nt = t.mma_tiles
            with e.block(f"for mi, ni, h, b in T.grid({mt}, {nt}, 2, 2):"):  # C[g + 8h][2t + b] of tile (mi, ni)
                e(f"O_sh[warp * {t.warp_rows} + {t.mma_row('mi * 2 + h', 'gq')}, {t.mma_col('ni', 'tq * 2 + b')}] = "
                  f"acc[(mi * {nt} + ni) * 4 + h * 2 + b]")
            return
        tt = t.thread_tile()
        for i in range(tt.rows):
            row = f"ty * {t.vec} + {i // t.vec * tt.row_gap + i % t.vec}"
            for h in range(tt.cols // t.vec):
                e(f"O_sh[{row}, T.ramp(tx * {t.vec} + {h * tt.col_gap}, 1, {t.vec})] = "
                  f"acc[{i}, T.ramp({h * t.vec}, 1, {t.vec})]")

    def step(self, kt: str, buf: int, prefetch: bool, at: tuple[str | None, str] | None = None,
             when: str | None = None) -> None:
        """One k step on buffer `buf`; with `prefetch`, the next step's loads overlap it (only
        where the condition `when` holds, if given; `at`: see :meth:`load_global`)."""
        if prefetch:
            with self.only_if(when):
                self.load_global(f"({kt} + 1)", at)
        source = 1 - buf if self.fault == "wrong_buffer" else buf
        if self.t.wgmma is not None:
            self.compute_wgmma(source)
        elif self.t.mma is not None:
            self.compute_mma(source)
        else:
            self.compute(source, f"update{len(self.updates)}")
            self.updates.append(f"update{len(self.updates)}")
        if prefetch and self.fault != "no_store":
            with self.only_if(when):
                self.store_shared(1 - buf, f"({kt} + 1)")
        if self.t.wgmma is not None:  # the tensor cores worked through the store;
            self.e('T.ptx["wgmma.wait_group.sync.aligned"](0)')  # the buffer and registers are free now
        self.sync()

    def step_in_flight(self, kt: str, slot: int) -> None:
        """One k step (`kt`, in ring slot `slot` = its index in the slice modulo
        :data:`WGMMA_RING`) with wgmma groups in flight (:attr:`MaxDNNPlan.wgmma_in_flight`):
        issue its group on the slot's fragments and weights' tile; wait for the group before
        (whose registers and slot are then free in this thread, and by the barrier in all);
        gather step k + 2's fragments into the registers that group read and load its weights;
        store step k + 1's weights (loaded a step ago) into its slot, which the group before
        last read; barrier. Every register a wgmma reads is written only after the group that
        read it last is waited for, with no copies: ptxas serializes every wgmma (C7513) when a
        register of one is defined while a group is in flight between the copy and the issue."""
        e, ring = self.e, WGMMA_RING
        end = self.slice_end()
        # wrong_buffer: the weights of the slot being filled, not of the one filled last step
        self.compute_wgmma((slot + 1) % ring if self.fault == "wrong_buffer" else slot, slot)
        e('T.ptx["wgmma.wait_group.sync.aligned"](1)')
        with self.only_if(f"{kt} + 2 < {end}"):
            self.load_global(f"({kt} + 2)", regs=(slot + 2) % ring)
            self.load_packed_weights(f"({kt} + 2)", (slot + 2) % ring)
        if self.fault != "no_store":
            with self.only_if(f"{kt} + 1 < {end}"):
                self.store_shared((slot + 1) % ring, f"({kt} + 1)")
        self.sync()

    def only_if(self, condition: str | None):
        """A scope whose statements run where `condition` holds (always, if None)."""
        return self.e.block(f"if {condition}:") if condition else contextlib.nullcontext()

    def k_loop(self) -> None:
        """Every k step after the prologue's, each computing on one buffer while the next step's
        loads fill the other."""
        plan, e = self.plan, self.e
        first = self.first_step()
        if plan.wgmma_in_flight:
            self.k_loop_in_flight()
            return
        if plan.tap_loop:
            taps, per_tap = self.wl.KH * self.wl.KW // plan.splits, plan.steps_per_tap
            tap = f"({first} + rs)"
            with e.block(f"for rs in range({taps}):"):
                if per_tap > 2:
                    # kept a loop: nvcc would unroll a short one, spilling the tensor-core tiles
                    with e.block(f"for c2 in T.serial(0, {per_tap // 2 - 1}, unroll=False):"):
                        self.step(f"{tap} * {per_tap} + c2 * 2", 0, True, (None, "(c2 * 2 + 1)"))
                        self.step(f"{tap} * {per_tap} + c2 * 2 + 1", 1, True, (None, "(c2 * 2 + 2)"))
                self.step(f"{tap} * {per_tap} + {per_tap - 2}", 0, True, (None, str(per_tap - 1)))
                self.step(f"{tap} * {per_tap} + {per_tap - 1}", 1, True, (f"({tap} + 1)", "0"),
                          when=f"rs < {taps - 1}")
            return
        steps = self.slice_steps()
        pairs = (steps - 1) // 2  # pairs of steps that both prefetch
        if pairs:
            with e.block(f"for kt2 in range({pairs}):"):
                self.step(f"{first} + kt2 * 2", 0, True)
                self.step(f"{first} + kt2 * 2 + 1", 1, True)
        tail = steps - 2 * pairs  # 1 or 2 steps; only the last has nothing to prefetch
        if tail == 2:
            self.step(f"{first} + {2 * pairs}", 0, True)
            self.step(f"{first} + {2 * pairs + 1}", 1, False)
        else:
            self.step(f"{first} + {2 * pairs}", 0, False)

    def k_loop_in_flight(self) -> None:
        """The slice's k steps, :data:`WGMMA_RING` at a time so each step's ring slot and
        register sets are constants (registers cannot be indexed at run time), then the rest.
        The fragments' gather keeps a running tap of its own, two steps ahead of the steps."""
        e, ring = self.e, WGMMA_RING
        first, steps = self.first_kt(), self.slice_steps()
        if steps // ring:
            # kept a loop: nvcc would unroll a short one, spilling the tensor-core tiles
            with e.block(f"for kr in T.serial(0, {steps // ring}, unroll=False):"):
                for slot in range(ring):
                    self.step_in_flight(f"{first} + kr * {ring} + {slot}", slot)
        for slot in range(steps % ring):
            self.step_in_flight(f"{first} + {steps // ring * ring + slot}", slot)

    def first_kt(self) -> str:
        """This block's first k step (see :meth:`first_step`)."""
        plan = self.plan
        return f"{self.first_step()} * {plan.steps_per_tap}" if plan.tap_loop else self.first_step()

    def slice_steps(self) -> int:
        """The k steps of this block's share of the reduction."""
        return self.plan.k_steps // self.plan.splits

    def slice_end(self) -> str:
        """The k step after this block's share of the reduction (see :meth:`first_step`)."""
        return f"{self.first_kt()} + {self.slice_steps()}"

    def first_step(self) -> str:
        """Where this block's share of the reduction starts: its slice's first tap (with
        :attr:`MaxDNNPlan.tap_loop`) or k step; 0 without split-K."""
        plan = self.plan
        if plan.splits == 1:
            return "0"
        _, count = plan.split_unit
        return f"(sp * {count // plan.splits})"

    def keep_tiles_live(self) -> None:
        """Mark the operand tiles used after the k loop, so that TVM keeps each allocated
        through all of it. TVM's StorageRewrite lays a buffer over another whose last access it
        sees before the first of its own, and only a loop joins the double buffers' lifetimes;
        a slice of a few k steps has none (or one of a single iteration, which TVM unrolls), and
        there it merged them: for mma.sync and FFMA a second barrier a step, for wgmma, whose
        tensor cores read the weights' tile through a descriptor TVM does not see, a tile
        stored over the one a wgmma was reading. (wgmma in flight has one ring, always live.)
        The mark is a pure call, which RemoveNoOp drops after StorageRewrite: it emits no code
        (the k loops' SASS is unchanged where there was a loop)."""
        if self.plan.wgmma_in_flight:
            return
        for buf in range(min(self.slice_steps(), 2)):
            for name in self.plan.operand_tiles:
                at = self.shared_at(name, buf, "0", "0", self.t.vec)
                self.e(f'T.evaluate(T.call_pure_extern("void", "(void)", {at}))')

    # -- output ----------------------------------------------------------------------------
    def write_output(self) -> None:
        """The block's tile through shared memory to the output with the epilogue; with split-K,
        the slice's raw sums to `partial` (the reduce kernel applies the epilogue)."""
        t, e, ep = self.t, self.e, self.plan.epilogue
        M, NC = self.M, self.NCOLS
        split = self.plan.splits > 1
        if split:
            ep = Epilogue()
        if self.plan.wgmma_in_flight:  # the last step's group, in every thread before the output
            e('T.ptx["wgmma.wait_group.sync.aligned"](0)')  # tile (TVM may lay it over the ring)
            self.sync()
        self.stage_accumulators()
        e('T.evaluate(T.tvm_storage_sync("shared"))')
        per_row = t.cols // t.vec
        vec = t.vec if self.plan.vector_y else 1
        for s, _ in self.slots(t.rows * per_row):
            f = f"(tid + {s * t.threads})"
            e(f"oo{s}: T.let = by * {t.rows} + {f} // {per_row}")
            e(f"oc{s}: T.let = bx * {t.cols} + {f} % {per_row} * {t.vec}")
            for lane in range(0, t.vec, vec):
                sidx = (f"T.ramp({f} % {per_row} * {t.vec} + {lane}, 1, {vec})" if vec > 1
                        else f"{f} % {per_row} * {t.vec} + {lane}")
                value = f"O_sh[{f} // {per_row}, {sidx}]"
                yaddr = (f"((sp * {self.wl.groups} + g) * {M} + oo{s}) * {NC} + " if split
                         else f"(g * {M} + oo{s}) * {NC} + ")
                yidx = (f"T.ramp({yaddr}oc{s} + {lane}, 1, {vec})" if vec > 1 else f"{yaddr}oc{s} + {lane}")
                if ep.bias:
                    b = f"bias[g * {M} + oo{s}]"
                    value = f"{value} + " + (f"T.Broadcast({b}, {vec})" if vec > 1 else b)
                if ep.residual:
                    value = f"{value} + Rf[{yidx}]"
                with e.block(f"if oo{s} < {M} and oc{s} + {lane} < {NC}:"):
                    if ep.activation in ("relu", "relu6"):  # selects: a NaN stays NaN (fmaxf drops it)
                        e(f"v{s}_{lane}: T.let = {value}")
                        value = _clamp_text(f"v{s}_{lane}", vec, 6.0 if ep.activation == "relu6" else None)
                    e(f"{'Pf' if split else 'Yf'}[{yidx}] = {value}")

    # -- the whole function ----------------------------------------------------------------
    def text(self, symbol: str) -> str:
        plan, t, e = self.plan, self.t, self.e
        tt = t.thread_tile() if t.engine == "ffma" else None
        shapes = plan.shapes()
        self.updates: list[str] = []
        params = list(shapes)
        e("# from tvm.script import tirx as T")
        e("@T.prim_func(s_tir=True)")
        e("def main(" + ", ".join(f'{n}: T.Buffer({shapes[n]}, "float32")' for n in params) + "):")
        e.depth += 1
        e(f'T.func_attr({{"global_symbol": "{symbol}", "tirx.noalias": True, '
          f'"{KERNEL_ATTR}": "{KERNEL_NAME}"}})')
        # The explicit root block comes first: a statement before it would make it a child of an
        # implicit root whose inferred reads name the buffers allocated here (ill-formed TIR).
        with e.block('with T.sblock("root"):'):
            # explicit regions: inference cannot read the tensor-core calls' raw buffer pointers
            out = params[-1]  # y, or with split-K the slices' partial sums
            e("T.reads(" + ", ".join(f"{n}[{', '.join(f'0:{d}' for d in shapes[n])}]" for n in params[:-1]) + ")")
            e(f"T.writes({out}[{', '.join(f'0:{d}' for d in shapes[out])}])")
            flat = FLAT_PARAMS
            sizes = {n: math.prod(shape) for n, shape in shapes.items()}
            for n in params:
                if flat[n] != n:
                    e(f'{flat[n]} = T.decl_buffer(({sizes[n]},), "float32", data={n}.data)')
            gx, gy, gz = plan.grid
            e(f'for {"gz" if plan.splits > 1 else "g"} in T.thread_binding({gz}, thread="blockIdx.z"):')
            e.depth += 1
            e(f'for by in T.thread_binding({gy}, thread="blockIdx.y"):')
            e.depth += 1
            e(f'for bx in T.thread_binding({gx}, thread="blockIdx.x"):')
            e.depth += 1
            e(f'for tid in T.thread_binding({t.threads}, thread="threadIdx.x"):')
            e.depth += 1
            # Declared (allocated) here, under the thread loops: block allocations would be
            # hoisted out of the kernel, and a block here would hide `tid` from blockize.
            self.declare_shared()
            if t.wgmma is not None:
                e(f'acc = T.decl_buffer(({t.slabs * t.rows // 2},), "float32", scope="local")')
                sets = WGMMA_RING if plan.wgmma_in_flight else 1  # one per ring slot
                e(f'af = T.decl_buffer(({sets * t.slabs * 4},), "uint32", scope="local")')
                if plan.gathers_fragments:  # a step's gathered values, before the dead columns' zeros
                    e(f'fv = T.decl_buffer(({t.slabs * 4 * t.wgmma.per_reg},), "float32", scope="local")')
                e(f'desc = T.decl_buffer(({1 if plan.wgmma_in_flight else 2},), "uint64", scope="local")')
            elif t.mma is not None:
                mt, nt = t.mma_tiles
                reg = "float32" if t.mma.per_reg == 1 else "uint32"
                e(f'acc = T.decl_buffer(({mt * nt * 4},), "float32", scope="local")')
                e(f'af = T.decl_buffer(({mt * 4},), "{reg}", scope="local")')
                e(f'bf = T.decl_buffer(({nt * 2},), "{reg}", scope="local")')
                # the fragments' values as loaded from shared memory (bf16: before packing)
                e(f'a_val = T.decl_buffer(({2 * t.mma.per_reg * 2 * mt},), "float32", scope="local")')
                if t.mma.per_reg > 1:
                    e(f'b_val = T.decl_buffer(({2 * t.mma.per_reg * nt},), "float32", scope="local")')
            else:
                e(f'acc = T.decl_buffer(({tt.rows}, {tt.cols}), "float32", scope="local")')
            nb = len(self.slots(t.k_step * t.cols // t.vec))
            sets = WGMMA_RING if plan.wgmma_in_flight else 1  # the weights two steps ahead: per ring slot
            e(f'a_pre = T.decl_buffer(({sets * self.weight_regs},), "float32", scope="local")')
            if not plan.gathers_fragments:
                e(f'b_pre = T.decl_buffer(({nb * t.vec},), "float32", scope="local")')
            if plan.splits > 1:  # blockIdx.z: the group and the slice of the reduction
                e(f"g: T.let = gz // {plan.splits}")
                e(f"sp: T.let = gz % {plan.splits}")
            if t.mma is not None or t.wgmma is not None:
                e("warp: T.let = tid // 32")
                e("gq: T.let = tid % 32 // 4")
                e("tq: T.let = tid % 4")
                accumulators = t.slabs * t.rows // 2 if t.wgmma is not None else mt * nt * 4
                with e.block(f"for i in T.serial({accumulators}):"):
                    e("acc[i] = T.float32(0)")
                if t.wgmma is not None:  # LBO and SBO in 16-byte units, no swizzle
                    # the ring's, moved per slot; else each buffer's (a single step uses one)
                    tiles = ["A_ring"] if plan.wgmma_in_flight else ["A_sh0", "A_sh1"][:self.slice_steps()]
                    for buf, tile in enumerate(tiles):
                        e(f"T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc[{buf}]), "
                          f"T.address_of({tile}[0]), {t.wgmma.lbo // 16}, {t.wgmma.sbo // 16}, 0)")
            else:
                e(f"ty: T.let = tid // {t.threads_n}")
                e(f"tx: T.let = tid % {t.threads_n}")
                with e.block(f"for i, j in T.grid({tt.rows}, {tt.cols}):"):
                    e("acc[i, j] = T.float32(0)")
            self.b_columns()
            first = self.first_step()
            first_kt = self.first_kt()
            if plan.wgmma_in_flight:  # the weights of the first step, and of the next into set 1
                self.load_packed_weights(first_kt, 0)
            if plan.tap_loop and not plan.gathers_fragments:
                self.load_global(first_kt, (first, "0"), first=True)
            else:
                self.load_global(first, first=True)
            self.store_shared(0, first_kt)
            if plan.wgmma_in_flight:  # and the next step's weights and fragments into set 1
                with self.only_if(f"{first_kt} + 1 < {self.slice_end()}"):
                    self.load_packed_weights(f"({first_kt} + 1)", 1)
                    self.load_global(f"({first_kt} + 1)", regs=1)
            self.sync()
            self.k_loop()
            self.keep_tiles_live()
            self.write_output()
        return "\n".join(e.lines) + "\n"


def maxdnn_conv2d_func(plan: MaxDNNPlan, symbol: str = "maxdnn_conv2d", *, tensorize: bool = True,
                       fault: str | None = None) -> tvm.tirx.PrimFunc:
    """The CUDA PrimFunc of `plan`, its 8x8 updates tensorized onto the thread-tile intrinsic.

    Parameters are (x, w[, bias][, residual], y) in the layouts of :meth:`MaxDNNPlan.shapes`.
    `fault` builds a deliberately broken kernel for the tests (see :data:`FAULTS`). A missing
    barrier cannot be built this way: TVM's barrier planner puts it back, so the tests delete one
    from the generated CUDA instead.
    """
    gen = _Generator(plan, fault)
    func = script.from_source(gen.text(symbol))
    if not tensorize or not gen.updates:  # the tensor-core engines issue mma.sync themselves
        return func
    intrin = get_outer_product_intrin(plan.tile.thread_tile())
    sch = s_tir.Schedule(func)
    for name in gen.updates:
        sch.tensorize(sch.get_loops(sch.get_sblock(name))[-5], intrin)
    return sch.mod["main"]


REDUCE_SUFFIX = "_reduce"  # the split-K reduce kernel's symbol: the convolution's + this


def split_reduce_func(plan: MaxDNNPlan, symbol: str = KERNEL_NAME + REDUCE_SUFFIX) -> tvm.tirx.PrimFunc:
    """Split-K's second kernel: y = act(sum of the slices' partial sums + bias + residual), one
    thread per output element (the slices summed in registers, in order: deterministic).
    Parameters as :meth:`MaxDNNPlan.reduce_shapes`."""
    from tvm import te

    from .simple import bind_threads

    shapes, ep = plan.reduce_shapes(), plan.epilogue
    if not shapes:
        raise ValueError("split_reduce_func: the plan has no split-K")
    partial = te.placeholder(shapes["partial"], "float32", name="partial")
    inputs = [partial]
    bias = residual = None
    if ep.bias:
        bias = te.placeholder(shapes["bias"], "float32", name="bias")
        inputs.append(bias)
    if ep.residual:
        residual = te.placeholder(shapes["residual"], "float32", name="residual")
        inputs.append(residual)
    sp = te.reduce_axis((0, plan.splits), "sp")
    total = te.compute(plan.y_shape, lambda *i: te.sum(partial[(sp, *i)], axis=sp), name="slices")

    def value(*i):
        v = total[i]
        if bias is not None:
            v = v + bias[i[0]]
        if residual is not None:
            v = v + residual[i]
        return activation_expr(ep.activation, v) if ep.activation else v  # the CPU epilogue's definition

    y = te.compute(plan.y_shape, value, name="output")
    func = bind_threads(te.create_prim_func([*inputs, y]), KERNEL_NAME + REDUCE_SUFFIX, reducer="slices")
    return func.with_attr("global_symbol", symbol)


def reduce_launch(plan: MaxDNNPlan) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, block) of :func:`split_reduce_func`'s kernel: one thread per output element."""
    from .simple import THREADS

    return (-(-math.prod(plan.y_shape) // THREADS), 1, 1), (THREADS, 1, 1)


def data_to_chwn(x: np.ndarray) -> np.ndarray:
    """NCHW activations -> the kernel's CHWN (a copy; graph edges do this once)."""
    return np.ascontiguousarray(np.asarray(x).transpose(1, 2, 3, 0))


def output_to_nchw(y: np.ndarray) -> np.ndarray:
    """The kernel's KPQN output -> NCHW."""
    return np.ascontiguousarray(np.asarray(y).transpose(3, 0, 1, 2))


def weight_to_crsk(w: np.ndarray, groups: int = 1, k_order: str = "crs") -> np.ndarray:
    """OIHW weights -> [groups, I*H*W, O/groups], the A operand of each group's GEMM, its rows in
    the reduction order `k_order` ("crs": CRSK; "rsc": RSCK, see :attr:`MaxDNNPlan.k_order`)."""
    w = np.asarray(w)
    o, i, kh, kw = w.shape
    if o % groups:
        raise ValueError(f"weight_to_crsk: {o} output channels do not split into {groups} groups")
    if k_order not in ("crs", "rsc"):
        raise ValueError(f"weight_to_crsk: k_order must be 'crs' or 'rsc', got {k_order!r}")
    axes = (0, 2, 3, 4, 1) if k_order == "crs" else (0, 3, 4, 2, 1)
    per_group = w.reshape(groups, o // groups, i, kh, kw).transpose(*axes)
    return np.ascontiguousarray(per_group.reshape(groups, i * kh * kw, o // groups))


# The wgmma weights' packing, as a permutation of the zero-padded [groups, K, M] weights viewed as
# (g, step, k-chunk, k % c, block, n-group of 8, n % 8) with c = WgmmaShape.core_k: to (g, block,
# step, n-group, k-chunk, n % 8, k % c). Shared by the NumPy packing and the graph's (strategy/cuda.py).
WGMMA_PACK_AXES = (0, 4, 1, 5, 2, 6, 3)


def wgmma_pack_tiles(plan: MaxDNNPlan) -> tuple[tuple[int, int, int], tuple[int, ...]]:
    """The padded [groups, K, M] shape of the weights :func:`pack_wgmma_weight` packs, and its
    7-D view that :data:`WGMMA_PACK_AXES` permutes."""
    t = plan.tile
    groups, blocks, steps, _ = plan.weight_shape
    c = t.wgmma.core_k
    return ((groups, steps * t.k_step, blocks * t.rows),
            (groups, steps, t.k_step // c, c, blocks, t.rows // 8, 8))


def bf16_pairs(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16 as CUDA's `__float2bfloat16` does (nearest even; a NaN
    becomes 0x7FFF) and packed in pairs along the last axis, the first of each pair in the low
    half, as float32 words (their bits): what a 32-bit load of two consecutive bf16 gives."""
    a = np.ascontiguousarray(a, np.float32)
    bits = a.view(np.uint32).astype(np.uint64)
    rounded = np.where(np.isnan(a), 0x7FFF, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    if rounded.shape[-1] % 2:
        raise ValueError(f"bf16_pairs: the last axis has {rounded.shape[-1]} values, not pairs")
    return rounded.view(np.uint32).view(np.float32)


def pack_wgmma_weight(wt: np.ndarray, plan: MaxDNNPlan) -> np.ndarray:
    """[groups, K, M] weights (:func:`weight_to_crsk`) -> the wgmma kernel's: per group, block of
    rows and k step, the rows x k_step tile in the shared layout the tensor cores read (K-major
    core matrices, :class:`WgmmaShape`; bf16: rounded and packed in pairs, :func:`bf16_pairs`),
    zero-padded past M and K. A block's k steps are then contiguous chunks it copies to shared
    memory as they are, float4 by float4, with no guards."""
    k, m = plan.gemm[2], plan.gemm[0]
    if wt.shape != (plan.wl.groups, k, m):
        raise ValueError(f"pack_wgmma_weight: weights of shape {wt.shape}, the plan's GEMM needs "
                         f"{(plan.wl.groups, k, m)}")
    padded_shape, tiles = wgmma_pack_tiles(plan)
    padded = np.zeros(padded_shape, np.float32)
    padded[:, :k, :m] = wt
    packed = padded.reshape(tiles).transpose(*WGMMA_PACK_AXES)
    if plan.tile.wgmma.per_reg == 2:
        packed = bf16_pairs(packed)
    return np.ascontiguousarray(packed.reshape(plan.weight_shape))


def kernel_arrays(plan: MaxDNNPlan, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None,
                  residual: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The parameters of the plan's kernels from NCHW/OIHW NumPy arrays (and an NCHW residual),
    by name: x, w[, bias][, residual][, partial], y.

    The outputs ("y"; "partial", split-K's slices) start filled with NaN so that anything the
    kernels fail to write shows.
    """
    wl, ep = plan.wl, plan.epilogue
    if (bias is not None) != ep.bias or (residual is not None) != ep.residual:
        raise ValueError(f"kernel_arrays: the plan's epilogue {ep} does not match the arrays given")
    arrays = {"x": data_to_chwn(x.astype(np.float32, copy=False)),
              "w": weight_to_crsk(w.astype(np.float32, copy=False), wl.groups, plan.k_order)}
    if plan.tile.wgmma is not None:
        arrays["w"] = pack_wgmma_weight(arrays["w"], plan)
    if bias is not None:
        arrays["bias"] = np.ascontiguousarray(bias, dtype=np.float32)
    if residual is not None:
        arrays["residual"] = data_to_chwn(residual.astype(np.float32, copy=False))
    shapes = {**plan.shapes(), **plan.reduce_shapes()}
    for output in ("partial", "y"):
        if output in shapes:
            arrays[output] = np.full(shapes[output], np.nan, np.float32)
    for name, shape in shapes.items():
        if arrays[name].shape != shape:
            raise ValueError(f"kernel_arrays: {name} has shape {arrays[name].shape}, the plan needs {shape}")
    return arrays


def plan_module(plan: MaxDNNPlan, symbol: str = KERNEL_NAME, fault: str | None = None) -> tvm.IRModule:
    """The plan's kernels: the convolution, and with split-K the reduce kernel after it."""
    funcs = {"main": maxdnn_conv2d_func(plan, symbol, fault=fault)}
    if plan.splits > 1:
        funcs["reduce"] = split_reduce_func(plan, symbol + REDUCE_SUFFIX)
    return tvm.IRModule(funcs)


def cuda_source(plan: MaxDNNPlan, target="nvidia/nvidia-h100", fault: str | None = None) -> str:
    """The CUDA C that TVM generates for `plan` (no GPU needed): its kernels, in launch order."""
    return generate_source(plan_module(plan, fault=fault), resolve_target(target))


def emulate(plan: MaxDNNPlan, arrays: dict[str, np.ndarray], source: str | None = None) -> np.ndarray:
    """Run the kernels of `plan` on the CPU emulator (:mod:`tvm_ext.testing.cuda_emulator`).

    `arrays` are the kernels' parameters (:func:`kernel_arrays`); returns arrays["y"], written.
    """
    from ...testing.cuda_emulator import run_kernel

    source = source or cuda_source(plan)
    main = {FLAT_PARAMS[name]: arrays[name] for name in plan.shapes()}
    run_kernel(source, KERNEL_NAME + "_kernel", plan.grid, (plan.tile.threads, 1, 1), main, plan.dynamic_shared_bytes)
    if plan.splits > 1:
        reduce = {("output" if name == "y" else name): arrays[name] for name in plan.reduce_shapes()}
        run_kernel(source, KERNEL_NAME + REDUCE_SUFFIX + "_kernel", *reduce_launch(plan), reduce)
    return arrays["y"]


def cuda_param_order(source: str, kernel: str = "maxdnn_conv2d_kernel") -> list[str]:
    """The plan parameter ("x", "w", "bias", "residual", "partial", "y") behind each argument of
    a plan's CUDA kernel (the convolution, or split-K's reduce kernel).

    Whoever launches the CUDA C directly (the GPU check, the emulator) passes them in this order.
    """
    by_flat = {flat: name for name, flat in FLAT_PARAMS.items()} | {"output": "y", "partial": "partial",
                                                                   "residual": "residual"}
    return [by_flat[param.removesuffix("_ptr")] for _, param in kernel_params(source, kernel)]
