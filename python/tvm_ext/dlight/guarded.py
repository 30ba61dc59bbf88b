"""A dlight rule that gives up instead of failing the build.

dlight's stock rules raise when a primitive refuses a function they took on: its CPU Reduction
rule on a training-mode batch norm (several outputs, one computed from another) raised
"ScheduleError: ... is an output block" out of `tvm_ext.build`, where stock TVM compiled the
graph. Wrapped, such a rule returns None and the next rule (ParallelVectorize on CPUs,
Fallback on GPUs) schedules the function.
"""

from __future__ import annotations

import logging

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight import ScheduleRule
from tvm.target import Target

logger = logging.getLogger("tvm_ext")

__all__ = ["Guarded", "OnAlignedAccesses", "aligned_accesses"]


class Guarded(ScheduleRule):
    """`rule`, or None (the next rule's turn) where it raises a ScheduleError, or an internal
    error of a primitive (the Reduction rule's compute_at failed a bound check on the gradient
    of a mean: "intset.HasLowerBound() && intset.HasUpperBound()"), or an assert of the rule's
    own analysis (the GEMV rule's "assert s_loops" on a sum over the batch of one-pixel images).
    The rule works on a schedule of its own: giving up leaves the function as it was."""

    def __init__(self, rule: ScheduleRule):
        self.rule = rule

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        try:
            return self.rule.apply(func, target, tunable)
        except (s_tir.ScheduleError, tvm.error.InternalError, AssertionError) as err:
            logger.info("tvm_ext: dlight's %s rule gave up on a function (%s): the next rule schedules it",
                        type(self.rule).__name__, (str(err).strip().splitlines() or [type(err).__name__])[-1])
            return None


def _aligned(index: tirx.PrimExpr) -> bool:
    """An index that is a block iterator, a constant, or one plus a constant."""
    if isinstance(index, (tirx.Var, tirx.IntImm)):
        return True
    if isinstance(index, (tirx.Add, tirx.Sub)):
        return isinstance(index.a, tirx.Var) and isinstance(index.b, tirx.IntImm)
    return False


def aligned_accesses(func: tirx.PrimFunc) -> bool:
    """Whether every block of `func` reads and writes each buffer at its own iterators (plus
    constants), one element per iterator: elementwise ops, broadcasts and row reductions
    (softmax, mean, norms), not windows (pooling and its gradient, convolutions: h * s + r)."""
    sch = s_tir.Schedule(func)
    pending = list(sch.get_child_blocks(sch.get_sblock("root"))) if _has_root(sch) else []
    while pending:
        block = pending.pop()
        node = sch.get(block)
        for region in (*node.reads, *node.writes):
            for r in region.region:
                if not _aligned(r.min) or not (isinstance(r.extent, tirx.IntImm) and int(r.extent) == 1):
                    return False
        pending += sch.get_child_blocks(block)
    return True


def _has_root(sch: s_tir.Schedule) -> bool:
    try:
        sch.get_sblock("root")
    except s_tir.ScheduleError:
        return False
    return True


class OnAlignedAccesses(ScheduleRule):
    """`rule`, for functions of :func:`aligned_accesses` only; None (the next rule) otherwise.

    dlight's CPU Reduction rule computes a function's producers at the consumer's parallel loop;
    on the gradient of a 3x3 stride-2 max pooling (argmax over overlapping windows, fused with a
    relu's gradient) the result was wrong, single-threaded too (92% relative error), where the
    next rule's plain parallel loops are right.
    """

    def __init__(self, rule: ScheduleRule):
        self.rule = rule

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not aligned_accesses(func):
            return None
        return self.rule.apply(func, target, tunable)
