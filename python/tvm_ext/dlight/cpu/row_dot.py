"""Matrix-vector products whose reduction runs along the matrix rows, one vector of partial sums each.

dlight's CPU GEMV rule vectorizes such a product across 64-128 rows: every lane a strided gather,
the reduction unrolled 128-256 times: LLVM took 17-192 s on one such function (timm's
gcresnet50t, whose global-context blocks pool with a (64 x 256) x (256 x 1) matmul, built in
779 s). Here each row's dot product is split into vector lanes (rfactor): contiguous loads and
vector FMAs into `lanes` partial sums, then one horizontal sum per row; threads over the rows when
the product is large enough to pay for them.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight import ScheduleRule
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.analysis.gemv import is_gemv, normalize
from tvm.s_tir.dlight.base import try_inline_contiguous_spatial
from tvm.target import Target

from ...target import vector_isa

__all__ = ["RowDotProducts"]

# Below this many multiply-adds one thread is faster than waking the pool.
_MIN_PARALLEL_MACS = 1 << 15


class RowDotProducts(ScheduleRule):
    """`out[b, s] = sum_r A[b, s, r] * v[b, r]` (a matmul with a vector operand, an epilogue
    allowed): vector partial sums along r, a horizontal sum per row. None for other functions, for
    products whose reduction is not innermost in the matrix, and for symbolic extents."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
            return None
        sch = s_tir.Schedule(func)
        infos = try_inline_contiguous_spatial(sch, normalize_prim_func(sch))
        if infos is None or len(infos) not in (1, 2) or (len(infos) == 2 and not infos[1].is_injective()):
            return None
        info = infos[0]
        if len(info.iters) not in (2, 3) or is_gemv(sch, info) is None or normalize(sch, info) is not True:
            return None
        batch, s, r, c = sch.get_loops(info.block_rv)
        extents = [sch.get(loop).extent for loop in (batch, s, r, c)]
        if not all(isinstance(e, tirx.IntImm) for e in extents) or int(extents[3]) != 1:
            return None
        rows, depth = int(extents[0]) * int(extents[1]), int(extents[2])
        lanes = next((n for n in (vector_isa(target).lanes, 8, 4) if depth % n == 0), None)
        if lanes is None:
            return None
        _, inner = sch.split(r, [None, lanes])
        partial = sch.rfactor(inner, factor_axis=len(sch.get(info.block_rv).writes[0].region))
        b, row, outer, inner, c = sch.get_loops(partial)
        sch.reorder(b, row, c, outer, inner)
        sch.vectorize(inner)
        row = sch.fuse(b, row)
        sch.reverse_compute_at(info.block_rv, row)
        if len(infos) == 2:
            sch.reverse_compute_at(infos[1].block_rv, row)
        if rows * depth >= _MIN_PARALLEL_MACS and rows > 1:
            sch.parallel(row)
        return sch
