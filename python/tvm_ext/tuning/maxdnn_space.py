"""The MetaSchedule design space of the maxDNN tile's convolution on the LLVM CPU.

A task is a graph's kernel unscheduled (:func:`maxdnn_workload`): what the graph's layout passes
agreed on (the workload, the register tile's rows and cols) is fixed; the blocking is not. Its
design space is the kernel's own blocking (:func:`tvm_ext.kernels.conv2d_maxdnn.block_maxdnn_conv2d`)
with its decisions sampled: three perfect tiles, the output channels of a task's tile (row tiles),
its images (image blocks) and the channels a call reduces (a group's channels: k_step), and the
unroll of a call's k loop. Every decision feeds `split` and `annotate`, so the loops are the same
for every decision; the postprocessor :class:`TensorizeTile` tensorizes with the tile of the
sampled k_step.
"""

from __future__ import annotations

import dataclasses
import json

import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir import Schedule
from tvm.s_tir.meta_schedule.postproc import PyPostproc

from ..kernels import conv2d_maxdnn as _maxdnn
from ..kernels.conv2d import Conv2dWorkload
from ..target import AVX2, AVX512, NEON, SSE, usable_cores
from .kinds import TaskKind, fields_from_json

MAXDNN_ATTR = "tvm_ext.maxdnn_plan"

_ISAS = {isa.name: isa for isa in (AVX512, AVX2, NEON, SSE)}


def _describe(plan: _maxdnn.MaxDNNCpuPlan, epilogue: _maxdnn.Epilogue) -> str:
    """What a task is: the layouts (workload, ISA, register tile) and the epilogue, not the blocking."""
    return json.dumps({"wl": dataclasses.asdict(plan.wl), "isa": plan.isa.name, "rows": plan.rows,
                       "cols": plan.cols, "epilogue": dataclasses.asdict(epilogue)}, sort_keys=True)


def describe_maxdnn(func: tvm.tirx.PrimFunc) -> tuple[_maxdnn.MaxDNNCpuPlan, _maxdnn.Epilogue] | None:
    """(analytic plan, epilogue) of a maxDNN-tile kernel or workload, or None. The plan is the one a
    graph makes on this machine (:meth:`~tvm_ext.kernels.conv2d_maxdnn.MaxDNNCpuPlan.make` for its
    cores): what runs when nothing was tuned."""
    if func.attrs is None or MAXDNN_ATTR not in func.attrs:
        return None
    data = json.loads(str(func.attrs[MAXDNN_ATTR]))
    wl = Conv2dWorkload(**fields_from_json(data["wl"]))
    plan = _maxdnn.MaxDNNCpuPlan.make(wl, _ISAS[data["isa"]], rows=data["rows"], cols=data["cols"],
                                      threads=usable_cores())
    return plan, _maxdnn.Epilogue(**data["epilogue"])


def _described(func: tvm.tirx.PrimFunc) -> tuple[_maxdnn.MaxDNNCpuPlan, _maxdnn.Epilogue]:
    described = describe_maxdnn(func)
    if described is None:
        raise ValueError(f"not a tvm_ext maxDNN-tile kernel or workload: no {MAXDNN_ATTR} attribute")
    return described


_PLAIN = _maxdnn.Epilogue()


def maxdnn_workload(plan: _maxdnn.MaxDNNCpuPlan, epilogue: _maxdnn.Epilogue = _PLAIN) -> tvm.tirx.PrimFunc:
    """The tuning task of a convolution on the tile: its unscheduled TensorIR, describing itself."""
    return _maxdnn.maxdnn_conv2d_func(plan, epilogue).with_attr(MAXDNN_ATTR, _describe(plan, epilogue))


def default_maxdnn_kernel(plan: _maxdnn.MaxDNNCpuPlan, epilogue: _maxdnn.Epilogue = _PLAIN) -> tvm.tirx.PrimFunc:
    """The plan's schedule of the same workload (what runs when nothing was tuned)."""
    return _maxdnn.maxdnn_conv2d_kernel(plan, epilogue).with_attr(MAXDNN_ATTR, _describe(plan, epilogue))


def maxdnn_space(sch: Schedule) -> None:
    """The design space (a MetaSchedule ScheduleFn) of a :func:`maxdnn_workload`."""
    plan, _ = _described(sch.mod["main"])
    loops = sch.get_loops(sch.get_sblock("update"))
    rows, images, channels = loops[1], loops[4], loops[5]
    most_rows, most_cols = max(1, _maxdnn.MACRO_ROWS // plan.rows), max(1, _maxdnn.MACRO_COLS // plan.cols)
    tiles = (sch.sample_perfect_tile(rows, n=2, max_innermost_factor=most_rows),
             sch.sample_perfect_tile(images, n=2, max_innermost_factor=most_cols),
             sch.sample_perfect_tile(channels, n=2, max_innermost_factor=plan.channels))
    choices = list(_maxdnn.UNROLL_CHOICES)
    unroll = sch.sample_categorical(choices, [1 / len(choices)] * len(choices))
    _maxdnn.block_maxdnn_conv2d(sch, tiles, unroll)


def default_maxdnn_trace(workload: tvm.tirx.PrimFunc) -> tvm.s_tir.Trace:
    """The point of :func:`maxdnn_space` that is the analytic plan's blocking."""
    plan, _ = _described(workload)
    sch = Schedule(tvm.IRModule({"main": workload}))
    maxdnn_space(sch)
    trace = sch.trace
    tiles = [inst for inst in trace.insts if inst.kind.name == "SamplePerfectTile"]
    (unroll,) = [inst for inst in trace.insts if inst.kind.name == "SampleCategorical"]
    for inst, factors in zip(tiles, _maxdnn.analytic_tiles(plan), strict=True):
        trace = trace.with_decision(inst, factors, remove_postproc=True)
    return trace.with_decision(unroll, list(_maxdnn.UNROLL_CHOICES).index(plan.unroll), remove_postproc=True)


def tensorize_tile(sch: Schedule) -> bool:
    """Tensorize a blocked candidate (:func:`~tvm_ext.kernels.conv2d_maxdnn.tensorize_maxdnn_conv2d`);
    False if it cannot be."""
    described = describe_maxdnn(sch.mod["main"])
    if described is None:
        return False
    try:
        _maxdnn.tensorize_maxdnn_conv2d(sch, described[0])
    except (RuntimeError, ValueError):  # ScheduleError is a RuntimeError
        return False
    return True


@derived_object
class TensorizeTile(PyPostproc):
    """MetaSchedule postprocessor: :func:`tensorize_tile`."""

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def apply(self, sch: Schedule) -> bool:
        return tensorize_tile(sch)

    def clone(self) -> TensorizeTile:
        return TensorizeTile()


def _finish(sch: Schedule) -> tvm.tirx.PrimFunc | None:
    return sch.mod["main"] if tensorize_tile(sch) else None


MAXDNN_CONV2D = TaskKind(
    name="maxdnn_conv2d", attr=MAXDNN_ATTR, task_of=lambda kernel, _isa: maxdnn_workload(*_described(kernel)),
    design_space=maxdnn_space, postprocessors=lambda: [TensorizeTile()], default_trace=default_maxdnn_trace,
    flops=lambda workload: _described(workload)[0].wl.flops, finish=_finish)
"""The maxDNN tile's convolution as a tuning task kind."""
