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

__all__ = ["Guarded"]


class Guarded(ScheduleRule):
    """`rule`, or None (the next rule's turn) where it raises a ScheduleError, or an internal
    error of a primitive (the Reduction rule's compute_at failed a bound check on the gradient
    of a mean: "intset.HasLowerBound() && intset.HasUpperBound()"). The rule works on a schedule
    of its own: giving up leaves the function as it was."""

    def __init__(self, rule: ScheduleRule):
        self.rule = rule

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        try:
            return self.rule.apply(func, target, tunable)
        except (s_tir.ScheduleError, tvm.error.InternalError) as err:
            logger.info("tvm_ext: dlight's %s rule gave up on a function (%s): the next rule schedules it",
                        type(self.rule).__name__, str(err).strip().splitlines()[-1])
            return None
