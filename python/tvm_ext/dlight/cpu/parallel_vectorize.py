"""A catch-all CPU schedule: threads over the outer spatial loops, vectors on the innermost.

Stock TVM leaves legalized ops as naive single-threaded loops (about 1.5 GFLOP/s on a
convolution); dlight's CPU rules cover only GEMV and reductions. This rule gives every other
PrimFunc (elementwise ops, layout transforms, pooling, a convolution we fell back on) the
parallelism and vectorization a demanding user expects, block by block. It only touches blocks
whose loop nest is still the one legalization created (one loop per block iterator, spatial
first), never changes what a block computes, and leaves a block alone when a primitive refuses.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight import ScheduleRule
from tvm.target import Target

_MIN_PARALLEL = 2
_MAX_VECTOR = 64


def _leading_spatial_loops(sch: s_tir.Schedule, block) -> list:
    """The outer loops of an unscheduled block that drive only spatial iterators."""
    loops = sch.get_loops(block)
    iter_vars = sch.get(block).iter_vars
    if len(loops) != len(iter_vars):  # not the loop nest legalization created: leave it
        return []
    spatial = []
    for loop, iv in zip(loops, iter_vars, strict=True):
        if iv.iter_type != tirx.IterVar.DataPar:
            break
        spatial.append(loop)
    return spatial


def _extent(sch: s_tir.Schedule, loop) -> int | None:
    """A loop's extent, None when it is symbolic (a dynamic batch, say)."""
    extent = sch.get(loop).extent
    return int(extent) if isinstance(extent, tirx.IntImm) else None


class ParallelVectorize(ScheduleRule):
    """Parallelize the fused outer spatial loops and vectorize the innermost spatial loop."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
            return None
        sch = s_tir.Schedule(func)
        try:
            blocks = sch.get_child_blocks(sch.get_sblock("root"))
        except s_tir.ScheduleError:
            return None
        for block in blocks:
            try:
                self._schedule_block(sch, block)
            except s_tir.ScheduleError:
                continue
        return sch

    @staticmethod
    def _schedule_block(sch: s_tir.Schedule, block) -> None:
        spatial = _leading_spatial_loops(sch, block)
        reduction = len(spatial) < len(sch.get_loops(block))
        if not spatial:
            return
        innermost = _extent(sch, spatial[-1])
        if not reduction and len(spatial) >= 2 and innermost is not None and innermost <= _MAX_VECTOR:
            sch.vectorize(spatial[-1])
            spatial = spatial[:-1]
        fused = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
        extent = _extent(sch, fused)
        if extent is None or extent >= _MIN_PARALLEL:  # a symbolic extent: threads split what there is
            sch.parallel(fused)
