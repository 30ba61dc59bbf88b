"""The maxDNN kernel's block tile (:class:`BlockTile`) and its choice (:func:`choose_tile`).

Kept apart from the plan and the generator because the tile is what the strategy and the tuner
reason about (its threads, its shared memory, its share of FFMA issue slots) without building a
kernel; the tensor-core instructions it is made of are data in :mod:`tvm_ext.intrin.cuda`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ....intrin.cuda import MMA_SHAPES, WGMMA_SHAPES, MmaShape, WgmmaShape, check_thread_tile, thread_tile
from ....intrin.outer_tile import OuterTile


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
    def mma_shape(self) -> MmaShape:
        """:attr:`mma` where the caller only runs on an mma.sync tile: an error on any other."""
        mma = self.mma
        if mma is None:
            raise ValueError(f"BlockTile: the {self.engine} engine is not an mma.sync one ({', '.join(MMA_SHAPES)})")
        return mma

    @property
    def wgmma_shape(self) -> WgmmaShape:
        """:attr:`wgmma` where the caller only runs on a wgmma tile: an error on any other."""
        wgmma = self.wgmma
        if wgmma is None:
            raise ValueError(f"BlockTile: the {self.engine} engine is not a wgmma one ({', '.join(WGMMA_SHAPES)})")
        return wgmma

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
        if self.mma_shape.per_reg == 1:
            return 2, 1

        def chunk(count: int) -> int:
            return next(c for c in (4, 2, 1) if count % c == 0)

        return chunk(2 * mt), chunk(nt)

    def mma_row(self, v: Any, g: Any) -> tuple[Any, Any, Any]:
        """The row of a warp's slab behind mma row g + 8 (v % 2) of m16 tile v // 2: lane group g's
        values v = 0 .. 2 mt - 1 side by side, in chunks of :attr:`mma_chunks`. The summands of
        the row (expressions of the kernel's variables), in order."""
        c = self.mma_chunks[0]
        return v // c * (8 * c), g * c, v % c

    def mma_col(self, ni: Any, n: Any) -> tuple[Any, Any, Any]:
        """The tile column behind column n of n8 tile ni (B's lane group n = g, C's n = 2t + b):
        its summands, as :meth:`mma_row`'s."""
        c = self.mma_chunks[1]
        return ni // c * (8 * c), n * c, ni % c

    def thread_tile(self) -> OuterTile:
        return thread_tile(
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
        check_thread_tile(self.thread_tile())

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


ENGINES = ("ffma", *MMA_SHAPES, *WGMMA_SHAPES)
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
