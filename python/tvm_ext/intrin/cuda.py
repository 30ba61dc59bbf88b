"""The maxDNN thread tile for CUDA as a tensor intrinsic: an 8x8 FFMA outer-product update.

One microkernel, described as data (:class:`~tvm_ext.intrin.outer_tile.OuterTile`, which the
CPU's tile shares) and generated on demand:

    C[i, j] += sum_k  A[k, row(i)] * B[k, col(j)]        (i < rows, j < cols, k < k_step)

C is a thread's register tile. A and B are one k step of the block's operand tiles in shared
memory (k-major, as maxDNN and Maxas SGEMM64 keep them). A thread's rows are not contiguous: it
owns `vec` consecutive rows in each of `rows / vec` groups spaced `row_gap` apart (8 rows as
4 + 4, half a tile apart). That spacing is what makes the shared loads conflict-free 128-bit
loads: in one k step a warp reads 8 distinct float4 of B and 4 of A, each broadcast to the
threads that share it. Per k step the implementation loads rows/vec + cols/vec float4 from shared
memory into registers and issues rows*cols FFMAs on them.

It is the CUDA form of the CPU's batch-reduce GEMM (:class:`tvm_ext.intrin.cpu.BRGEMM`): a batch of
k_step rank-one products at a fixed stride (one shared row apart), reduced into a register tile
that is written once, at the end of the convolution.

The description is the plain loop nest; the implementation is the same arithmetic in the order the
hardware wants (vector shared loads into a register array, then the unrolled FMAs).

The tensor cores' instructions the maxDNN kernel also runs on (:mod:`tvm_ext.kernels.cuda.maxdnn`),
`mma.sync` (:class:`MmaShape`) and Hopper's `wgmma.mma_async` (:class:`WgmmaShape`), are data here
too: their shapes, operand types and fragment layouts as the PTX ISA gives them, which the generator
and the checks read (:data:`MMA_SHAPES`, :data:`WGMMA_SHAPES`, by engine name).
"""

from __future__ import annotations

import dataclasses
import functools

import tvm
import tvm.script

from .outer_tile import OuterTile, outer_description
from .registry import register_once


def check_thread_tile(tile: OuterTile) -> None:
    """Raise ValueError unless `tile` is one a CUDA thread can run: the description's checks, one
    load width for both operands, and accumulators and operands in registers without spilling."""
    tile.validate()
    if tile.batch or tile.init:
        raise ValueError(f"OuterTile: a CUDA thread's tile reduces one k step into its registers (no batch, no init): "
                         f"{tile}")
    if tile.row_vec != tile.col_vec:
        raise ValueError(f"OuterTile: a CUDA thread loads rows and columns in groups of one width "
                         f"(row_vec={tile.row_vec}, col_vec={tile.col_vec})")
    if tile.rows * tile.cols + tile.rows + tile.cols > 200:
        raise ValueError(
            f"OuterTile: {tile.rows}x{tile.cols} needs {tile.rows * tile.cols + tile.rows + tile.cols}"
            " registers for accumulators and operands; more than 200 spills (255 per thread)")


def thread_tile(rows: int = 8, cols: int = 8, k_step: int = 8, row_gap: int = 32, col_gap: int = 32,
                vec: int = 4) -> OuterTile:
    """A CUDA thread's tile: groups of `vec` rows and columns (one shared-memory vector load each)."""
    return OuterTile(rows, cols, k_step, row_vec=vec, col_vec=vec, row_gap=row_gap, col_gap=col_gap)


_IMPL = """
@T.prim_func(s_tir=True)
def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
    sa, sb, sc = T.int32(), T.int32(), T.int32()
    A = T.match_buffer(a, ({k}, {span_a}), "{dtype}", offset_factor=1, scope="shared", strides=[sa, 1])
    B = T.match_buffer(b, ({k}, {span_b}), "{dtype}", offset_factor=1, scope="shared", strides=[sb, 1])
    C = T.match_buffer(c, ({rows}, {cols}), "{dtype}", offset_factor=1, scope="local", strides=[sc, 1])
    with T.sblock("root"):
        T.reads(C[0:{rows}, 0:{cols}], A[0:{k}, 0:{span_a}], B[0:{k}, 0:{span_b}])
        T.writes(C[0:{rows}, 0:{cols}])
        a_reg = T.alloc_buffer(({rows},), "{dtype}", scope="local")
        b_reg = T.alloc_buffer(({cols},), "{dtype}", scope="local")
        for kk in T.unroll({k}):
            for g in T.unroll({row_groups}):
                a_reg[T.ramp(g * {vec}, 1, {vec})] = A[kk, T.ramp(g * {row_gap}, 1, {vec})]
            for g in T.unroll({col_groups}):
                b_reg[T.ramp(g * {vec}, 1, {vec})] = B[kk, T.ramp(g * {col_gap}, 1, {vec})]
            for i in T.unroll({rows}):
                for j in T.unroll({cols}):
                    C[i, j] = C[i, j] + a_reg[i] * b_reg[j]
"""


@functools.cache
def get_outer_product_intrin(tile: OuterTile) -> str:
    """Register (once) the CUDA tensor intrinsic for `tile` (:func:`check_thread_tile`) and return
    its name: the shared description over shared-memory operands and a register tile, and the
    implementation that loads each group as one vector into registers, then issues the FFMAs."""
    check_thread_tile(tile)
    fields = dict(k=tile.k_step, rows=tile.rows, cols=tile.cols, vec=tile.row_vec, dtype=tile.dtype,
                  span_a=tile.span_a, span_b=tile.span_b, row_gap=tile.row_gap, col_gap=tile.col_gap,
                  row_groups=tile.row_groups, col_groups=tile.col_groups)
    return register_once(tile.name("cuda"), lambda: (outer_description(tile, "shared", "local"),
                                                      tvm.script.from_source(_IMPL.format(**fields))))


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
    def immediates(self) -> tuple[int, ...]:
        """The instruction's immediate operands after scale-d: scale-a, scale-b (1: no negation)
        and, for 16-bit types, B's transpose (0: K-major, as packed)."""
        return (1, 1, 0) if self.transposes else (1, 1)


WGMMA_SHAPES = {
    # tf32 from fp32 registers as they are; the data tile's rows of cols + 8 floats put k-row t at
    # bank 8t, so a warp's A-fragment loads (banks 8t + g) are conflict-free
    "wgmma_tf32": WgmmaShape("tf32", 8, 8),
    # bf16: fp32 values rounded and packed two to a register (the weights once, when packed); rows
    # of cols + 4 floats put k-row 2t at bank 8t: a warp's loads of the fragments' k rows 2t + e
    # (banks 8t + 4e + g) are conflict-free
    "wgmma_bf16": WgmmaShape("bf16", 16, 4, per_reg=2, transposes=True),
}
