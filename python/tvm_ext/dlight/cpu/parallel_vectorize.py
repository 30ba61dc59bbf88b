"""A catch-all CPU schedule: threads over the outer spatial loops, vectors on the innermost.

Stock TVM leaves legalized ops as naive single-threaded loops (about 1.5 GFLOP/s on a
convolution); dlight's CPU rules cover only GEMV and reductions. This rule gives every other
PrimFunc (elementwise ops, layout transforms, pooling, a convolution we fell back on) the
parallelism and vectorization a demanding user expects, block by block. It only touches blocks
whose loop nest is still the one legalization created (one loop per block iterator, spatial
first), never changes what a block computes, and leaves a block alone when a primitive refuses.

Blocks that only move data (a concatenation, reshape, transpose, split, pad: a load, a constant
or a choice between them) are first inlined into their element-wise consumers: ShuffleNet's
channel shuffle (concat, reshape, transpose, reshape, split) was five passes over memory and six
parallel launches, and becomes one pass.
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight import ScheduleRule
from tvm.target import Target

_MIN_PARALLEL = 2
_MAX_VECTOR = 64
_IF_THEN_ELSE = tvm.ir.Op.get("prim.if_then_else")


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


def _moves_data(value: tirx.PrimExpr) -> bool:
    """Whether a stored value only selects data: loads and constants, chosen by conditions."""
    if isinstance(value, tvm.ir.expr.TensorLoad | tirx.IntImm | tirx.FloatImm):
        return True
    if isinstance(value, tirx.Select):
        return _moves_data(value.true_value) and _moves_data(value.false_value)
    if isinstance(value, tvm.ir.expr.Call) and value.op.same_as(_IF_THEN_ELSE):
        return _moves_data(value.args[1]) and _moves_data(value.args[2])
    return False


def _is_spatial(sch: s_tir.Schedule, block) -> bool:
    return all(iv.iter_type == tirx.IterVar.DataPar for iv in sch.get(block).iter_vars)


def _inline_data_movement(sch: s_tir.Schedule) -> None:
    """Inline every block that only moves data into consumers that are element-wise (spatial)
    blocks, so nothing is recomputed per reduction step."""
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        stmt = sch.get(block)
        if not (isinstance(stmt.body, tirx.BufferStore) and _moves_data(stmt.body.value) and _is_spatial(sch, block)):
            continue
        consumers = sch.get_consumers(block)
        if consumers and all(_is_spatial(sch, consumer) for consumer in consumers):
            try:
                sch.compute_inline(block)
            except s_tir.ScheduleError:  # an output, or a block it cannot substitute: keep it
                continue


class ParallelVectorize(ScheduleRule):
    """Parallelize the fused outer spatial loops and vectorize the innermost spatial loop."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
            return None
        sch = s_tir.Schedule(func)
        try:
            _inline_data_movement(sch)
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
