"""The maxDNN outer-product tile as data: one description for CUDA and the LLVM CPU.

    C[i, j] (+)= sum_b sum_k  A[b, k, row(i)] * B[b * dilation, k, col(j)]    (i < rows, j < cols, k < k_step)

C is a register tile; A and B are k-major operand panels (a row of A is contiguous in output
channels, a row of B in output columns: pixels x images, the images innermost, as maxDNN keeps
them), optionally a batch of them: the filter taps of a convolution, B's entries a dilation
apart (BRGEMM's batch-reduce, so that C stays in registers for a whole reduction). With `init`,
C starts at zero instead of being read. The tile's rows need not be contiguous in A: they lie in
groups of `row_vec` consecutive rows spaced `row_gap` apart (columns likewise), which is how a
CUDA thread owns 8 rows as 4 + 4, half a 64-row tile apart, so that its shared-memory loads are
conflict-free float4 (:func:`tvm_ext.intrin.cuda.get_outer_product_intrin`). On a CPU a tile is one group of each:
`rows` output channels broadcast from A, `cols` images loaded as vectors of B
(:func:`tvm_ext.intrin.cpu_outer.get_cpu_outer_intrin`).

:class:`OuterTile` is the data; :func:`outer_description` is the loop nest both targets'
tensorize matches, in the operands' memory scopes; each target family has one generator of the
implementation (the same arithmetic in the order its hardware wants).
"""

from __future__ import annotations

import dataclasses

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T


@dataclasses.dataclass(frozen=True)
class OuterTile:
    """One register tile's share of a k step: rows x cols, k_step deep, and where its rows and
    columns lie in the operand panels."""

    rows: int = 8  # output channels (rows of C)
    cols: int = 8  # output columns (pixels x images)
    k_step: int = 8  # reduction steps per call
    row_vec: int = 4  # consecutive rows of A in a group (CUDA: one float4 shared load)
    col_vec: int = 4  # consecutive columns of B in a group
    row_gap: int = 32  # distance in A between groups of rows (CUDA: half a 64-row block tile)
    col_gap: int = 32
    dtype: str = "float32"
    batch: tuple[int, ...] = ()  # extents of a batch of (A, B) panels reduced into C (filter taps)
    dilation: tuple[int, ...] = ()  # B's distance between batch entries, per batch axis
    init: bool = False  # C = the sum (C only written) instead of C += the sum

    @staticmethod
    def contiguous(rows: int, cols: int, k_step: int, batch: tuple[int, ...] = (), dilation: tuple[int, ...] = (),
                   init: bool = False) -> OuterTile:
        """A tile whose rows and columns are each one contiguous group (the CPU's)."""
        return OuterTile(rows, cols, k_step, row_vec=rows, col_vec=cols, row_gap=rows, col_gap=cols, batch=batch,
                         dilation=dilation or (1,) * len(batch), init=init)

    @property
    def b_batch(self) -> tuple[int, ...]:
        """B's extents along the batch axes (dilated)."""
        return tuple((b - 1) * d + 1 for b, d in zip(self.batch, self.dilation, strict=True))

    def validate(self) -> None:
        """What every target needs; the generators add their register files' limits."""
        if self.dtype != "float32":
            raise ValueError(f"OuterTile: dtype {self.dtype} is not supported (float32 FMA only)")
        if self.k_step < 1:
            raise ValueError(f"OuterTile: k_step must be positive, got {self.k_step}")
        if len(self.dilation) != len(self.batch) or min((*self.batch, *self.dilation), default=1) < 1:
            raise ValueError(f"OuterTile: batch {self.batch} and dilation {self.dilation} must be positive, "
                             "one dilation per batch axis")
        for name, extent, vec, gap in (("rows", self.rows, self.row_vec, self.row_gap),
                                       ("cols", self.cols, self.col_vec, self.col_gap)):
            if vec < 1 or extent < vec or extent % vec:
                raise ValueError(f"OuterTile: {name}={extent} is not a multiple of its group of {vec}")
            if extent > vec and gap < vec:
                raise ValueError(f"OuterTile: {name} groups of {vec} overlap (gap {gap})")

    @property
    def row_groups(self) -> int:
        return self.rows // self.row_vec

    @property
    def col_groups(self) -> int:
        return self.cols // self.col_vec

    @property
    def span_a(self) -> int:
        """Elements of one row of A the tile's groups cover (first to last)."""
        return (self.row_groups - 1) * self.row_gap + self.row_vec

    @property
    def span_b(self) -> int:
        return (self.col_groups - 1) * self.col_gap + self.col_vec

    def fma_per_k(self) -> int:
        return self.rows * self.cols

    def name(self, family: str) -> str:
        """The intrinsic's registered name for one target family's generator ("cuda", "cpu_l16")."""
        layout = (f"_g{self.row_gap}x{self.col_gap}_v{self.row_vec}x{self.col_vec}"
                  if (self.row_groups, self.col_groups) != (1, 1) else "")
        batch = (f"_b{'x'.join(map(str, self.batch))}_d{'x'.join(map(str, self.dilation))}" if self.batch else "")
        return (f"tvm_ext.{family}_outer_{self.dtype}_{self.rows}x{self.cols}x{self.k_step}{layout}{batch}"
                f"{'_init' if self.init else ''}")


def outer_description(tile: OuterTile, operand_scope: str = "global", tile_scope: str = "global") -> tirx.PrimFunc:
    """The loop nest tensorize matches: C (tile_scope) (+)= A^T B over the batch and k_step rows of
    A and B (operand_scope). Its loops are (batch..., k, row groups, rows in a group, column
    groups, columns in a group), unit ones included: a kernel's update block has the same
    loops. Iterators of unit loops are not bound (blockize drops them from the block it makes)."""
    nb = len(tile.batch)
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("desc")
        a, b, c = (T.arg(name, T.handle()) for name in "abc")
        shapes = {"A": ((*tile.batch, tile.k_step, tile.span_a), operand_scope),
                  "B": ((*tile.b_batch, tile.k_step, tile.span_b), operand_scope),
                  "C": ((tile.rows, tile.cols), tile_scope)}
        bufs = {name: IRBuilder.name(name, T.match_buffer(handle, shape, tile.dtype, offset_factor=1, scope=scope))
                for (name, (shape, scope)), handle in zip(shapes.items(), (a, b, c), strict=True)}
        A, B, C = bufs["A"], bufs["B"], bufs["C"]
        with T.sblock("root"):
            whole = [buf[tuple(slice(0, e) for e in shapes[name][0])] for name, buf in (("A", A), ("B", B))]
            T.reads(*([] if tile.init else [C[0:tile.rows, 0:tile.cols]]), *whole)
            T.writes(C[0:tile.rows, 0:tile.cols])
            extents = {**{f"b{i}": e for i, e in enumerate(tile.batch)}, "kk": tile.k_step, "i0": tile.row_groups,
                       "i1": tile.row_vec, "j0": tile.col_groups, "j1": tile.col_vec}
            with T.grid(*extents.values()) as loops, T.sblock("update"):
                IRBuilder.name_many(list(extents), loops)
                v = {}
                for (name, extent), loop in zip(extents.items(), loops, strict=True):
                    if extent > 1:
                        axis = T.axis.reduce if name == "kk" or name.startswith("b") else T.axis.spatial
                        v[name] = IRBuilder.name("vk" if name == "kk" else f"v{name}", axis(extent, loop))
                vb = [v.get(f"b{i}", 0) for i in range(nb)]
                vk, i0, i1, j0, j1 = (v.get(name, 0) for name in ("kk", "i0", "i1", "j0", "j1"))
                c_index = (i0 * tile.row_vec + i1, j0 * tile.col_vec + j1)
                a_index = (*vb, vk, i0 * tile.row_gap + i1)
                b_index = (*(x * d for x, d in zip(vb, tile.dilation, strict=True)), vk, j0 * tile.col_gap + j1)
                T.reads(C[c_index], A[a_index], B[b_index])
                T.writes(C[c_index])
                if tile.init:
                    with T.init():
                        T.buffer_store(C, tirx.const(0, tile.dtype), c_index)
                T.buffer_store(C, C[c_index] + A[a_index] * B[b_index], c_index)
    return builder.get()
