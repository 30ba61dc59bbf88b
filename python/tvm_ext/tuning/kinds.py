"""What tuning needs to know about each kind of tvm_ext kernel, as data.

A tuning task is an unscheduled workload that describes itself in one function attribute
(:data:`tvm_ext.tuning.space.PLAN_ATTR` for convolutions, :data:`tvm_ext.tuning.pool_space.POOL_ATTR`
for poolings). The tuner looks the kind up from that attribute once
(:func:`tvm_ext.tuning.known_kinds.kind_of`) and asks it
for everything else, so a third kind of task is one more :class:`TaskKind`, not one more branch in
every step of the tuner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import tvm
from tvm.s_tir import Schedule


def fields_from_json(fields: dict[str, Any]) -> dict[str, Any]:
    """A workload dataclass's fields as its JSON description gives them back: the arrays as the
    tuples they were (how a kernel's attribute records its workload, for both kinds)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}


class VectorShape(Protocol):
    """What a workload records of the vector ISA it was made for (a :class:`~tvm_ext.target.VectorISA`
    has both)."""

    @property
    def lanes(self) -> int: ...

    @property
    def registers(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class TaskKind:
    """One kind of tuning task.

    - `attr`: the function attribute that describes a workload (or a kernel) of this kind;
    - `task_of(kernel, isa)`: the tuning workload of a kernel lowered by the strategy, or None
      when that kernel has no design space (`isa`: None for a kind whose workloads do not
      depend on it);
    - `design_space(sch)`: the MetaSchedule ScheduleFn;
    - `postprocessors()`: fresh MetaSchedule postprocessors of a candidate;
    - `default_trace(workload)`: the point of the space that is the analytic schedule;
    - `flops(workload)`: operations of one run;
    - `finish(sch)`: the kernel of a schedule replayed without postprocessing (postprocessed
      again and named), or None when the record does not apply.
    """

    name: str
    attr: str
    task_of: Callable[[tvm.tirx.PrimFunc, VectorShape | None], tvm.tirx.PrimFunc | None]
    design_space: Callable[[Schedule], None]
    postprocessors: Callable[[], list]
    default_trace: Callable[[tvm.tirx.PrimFunc], tvm.s_tir.Trace]
    flops: Callable[[tvm.tirx.PrimFunc], int]
    finish: Callable[[Schedule], tvm.tirx.PrimFunc | None]

    def describes(self, func: tvm.tirx.PrimFunc) -> bool:
        return func.attrs is not None and self.attr in func.attrs
