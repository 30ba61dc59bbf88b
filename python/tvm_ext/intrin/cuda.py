"""The maxDNN thread tile for CUDA as a tensor intrinsic: an 8x8 FFMA outer-product update.

One microkernel, described as data (:class:`ThreadTile`) and generated on demand:

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
"""

from __future__ import annotations

import dataclasses
import functools

import tvm
import tvm.script

from .registry import register_once


@dataclasses.dataclass(frozen=True)
class ThreadTile:
    """Shape of one thread's share of a k-step: everything the generator needs."""

    rows: int = 8  # output channels per thread (rows of C)
    cols: int = 8  # output columns (batch x pixels) per thread
    k_step: int = 8  # reduction steps per call (rows of the shared tiles per buffer)
    row_gap: int = 32  # distance in A between a thread's groups of `vec` rows (half a 64 tile)
    col_gap: int = 32
    vec: int = 4  # elements of one shared-memory load (float4)
    dtype: str = "float32"

    def validate(self) -> None:
        if self.dtype != "float32":
            raise ValueError(f"ThreadTile: dtype {self.dtype} is not supported (float32 FFMA only)")
        for name in ("rows", "cols"):
            extent = getattr(self, name)
            gap = self.row_gap if name == "rows" else self.col_gap
            if extent < self.vec or extent % self.vec:
                raise ValueError(f"ThreadTile: {name}={extent} is not a multiple of vec={self.vec}")
            if extent > self.vec and gap < self.vec:
                raise ValueError(f"ThreadTile: {name} groups of {self.vec} overlap (gap {gap})")
        if self.k_step < 1:
            raise ValueError(f"ThreadTile: k_step must be positive, got {self.k_step}")
        if self.rows * self.cols + self.rows + self.cols > 200:
            raise ValueError(
                f"ThreadTile: {self.rows}x{self.cols} needs {self.rows * self.cols + self.rows + self.cols}"
                " registers for accumulators and operands; more than 200 spills (255 per thread)")

    def span(self, extent: int, gap: int) -> int:
        """Elements of one shared row a thread's groups cover (first to last)."""
        return (extent // self.vec - 1) * gap + self.vec

    @property
    def span_a(self) -> int:
        return self.span(self.rows, self.row_gap)

    @property
    def span_b(self) -> int:
        return self.span(self.cols, self.col_gap)

    @property
    def name(self) -> str:
        return (f"tvm_ext.cuda_outer_{self.dtype}_{self.rows}x{self.cols}x{self.k_step}"
                f"_g{self.row_gap}x{self.col_gap}_v{self.vec}")

    def ffma_per_k(self) -> int:
        return self.rows * self.cols


_DESC = """
@T.prim_func(s_tir=True)
def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
    A = T.match_buffer(a, ({k}, {span_a}), "{dtype}", offset_factor=1, scope="shared")
    B = T.match_buffer(b, ({k}, {span_b}), "{dtype}", offset_factor=1, scope="shared")
    C = T.match_buffer(c, ({rows}, {cols}), "{dtype}", offset_factor=1, scope="local")
    with T.sblock("root"):
        T.reads(C[0:{rows}, 0:{cols}], A[0:{k}, 0:{span_a}], B[0:{k}, 0:{span_b}])
        T.writes(C[0:{rows}, 0:{cols}])
        for kk, i0, i1, j0, j1 in T.grid({k}, {row_groups}, {vec}, {col_groups}, {vec}):
            with T.sblock("update"):
                vk = T.axis.reduce({k}, kk)
{bindings}
                C[{c_index}] = C[{c_index}] + A[vk, {a_col}] * B[vk, {b_col}]
"""

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


def _fields(spec: ThreadTile) -> dict:
    live = [(name, extent) for name, extent in (("i0", spec.rows // spec.vec), ("i1", spec.vec),
                                                 ("j0", spec.cols // spec.vec), ("j1", spec.vec)) if extent > 1]
    v = {name: f"v{name}" for name, _ in live}
    i0, i1, j0, j1 = (v.get(name, "0") for name in ("i0", "i1", "j0", "j1"))
    return dict(
        k=spec.k_step, rows=spec.rows, cols=spec.cols, vec=spec.vec, dtype=spec.dtype,
        span_a=spec.span_a, span_b=spec.span_b, row_gap=spec.row_gap, col_gap=spec.col_gap,
        row_groups=spec.rows // spec.vec, col_groups=spec.cols // spec.vec,
        bindings="\n".join(f"{' ' * 16}v{name} = T.axis.spatial({extent}, {name})" for name, extent in live),
        c_index=f"{i0} * {spec.vec} + {i1}, {j0} * {spec.vec} + {j1}",
        a_col=f"{i0} * {spec.row_gap} + {i1}", b_col=f"{j0} * {spec.col_gap} + {j1}",
    )


@functools.cache
def get_outer_product_intrin(spec: ThreadTile) -> str:
    """Register (once) the tensor intrinsic for `spec` and return its name."""
    spec.validate()
    fields = _fields(spec)
    return register_once(spec.name, lambda: tuple(tvm.script.from_source(text.format(**fields))
                                                   for text in (_DESC, _IMPL)))
