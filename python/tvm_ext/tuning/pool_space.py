"""The MetaSchedule design space of the pooling kernels.

A pooling task is the unscheduled max / average pooling of a graph (:func:`pool2d_workload`, on
the layout the graph gave it: NCHW or blocked). Its design space is the kernel's own schedule
(:func:`tvm_ext.kernels.pool2d.schedule_pool2d` with `tunable=True`), which samples two perfect
tiles: the output rows per parallel task and the pixels of an unrolled group. Pooling is memory
bound and small next to the convolutions; the space exists so that a tuned network tunes every
tvm_ext kernel with a schedule of its own, as the convolution space does.
"""

from __future__ import annotations

import dataclasses
import json

import tvm
from tvm.s_tir import Schedule

from ..kernels import pool2d as _pool
from ..kernels.common import KERNEL_ATTR
from .kinds import TaskKind, fields_from_json

POOL_ATTR = "tvm_ext.pool2d_plan"


def _describe(wl: _pool.Pool2dWorkload, block: int | None) -> str:
    return json.dumps({"wl": dataclasses.asdict(wl), "block": block}, sort_keys=True)


def describe_pool(func: tvm.tirx.PrimFunc) -> tuple[_pool.Pool2dWorkload, int | None] | None:
    """(workload, channel block or None) of a pooling kernel or workload, or None."""
    if func.attrs is None or POOL_ATTR not in func.attrs:
        return None
    data = json.loads(str(func.attrs[POOL_ATTR]))
    return _pool.Pool2dWorkload(**fields_from_json(data["wl"])), data["block"]


def _described_pool(func: tvm.tirx.PrimFunc) -> tuple[_pool.Pool2dWorkload, int | None]:
    """:func:`describe_pool` of a function that must be a pooling kernel or workload."""
    described = describe_pool(func)
    if described is None:
        raise ValueError(f"not a tvm_ext pooling kernel or workload: no {POOL_ATTR} attribute")
    return described


def pool2d_workload(wl: _pool.Pool2dWorkload, block: int | None) -> tvm.tirx.PrimFunc:
    """The tuning task of a pooling: its unscheduled TensorIR, describing itself."""
    return _pool.pool2d_compute(wl, block=block).with_attr(POOL_ATTR, _describe(wl, block))


def default_pool_kernel(wl: _pool.Pool2dWorkload, block: int | None) -> tvm.tirx.PrimFunc:
    """The analytic schedule of the same workload (what runs when nothing was tuned)."""
    return _pool.pool2d_func(wl, block=block).with_attr(POOL_ATTR, _describe(wl, block))


def pool2d_space(sch: Schedule) -> None:
    """The design space (a MetaSchedule ScheduleFn) of a :func:`pool2d_workload`."""
    wl, block = _described_pool(sch.mod["main"])
    _pool.schedule_pool2d(sch, wl, block, tunable=True)


def default_pool_trace(workload: tvm.tirx.PrimFunc) -> tvm.s_tir.Trace:
    """The point of :func:`pool2d_space` that is the analytic schedule: one row per task, no
    unrolled group."""
    wl, _ = _described_pool(workload)
    sch = Schedule(tvm.IRModule({"main": workload}))
    pool2d_space(sch)
    trace = sch.trace
    tiles = [inst for inst in trace.insts if inst.kind.name == "SamplePerfectTile"]
    for inst, factors in zip(tiles, ([wl.OH, 1], [wl.OW, 1]), strict=True):
        trace = trace.with_decision(inst, factors, remove_postproc=True)
    return trace


def _finish(sch: Schedule) -> tvm.tirx.PrimFunc:
    return sch.mod["main"].with_attr(KERNEL_ATTR, _described_pool(sch.mod["main"])[0].kernel_name)


POOL2D = TaskKind(
    name="pool2d", attr=POOL_ATTR, task_of=lambda kernel, _isa: pool2d_workload(*_described_pool(kernel)),
    design_space=pool2d_space, postprocessors=list, default_trace=default_pool_trace,
    flops=lambda workload: _described_pool(workload)[0].flops, finish=_finish)
"""Max and average pooling as a tuning task kind."""
