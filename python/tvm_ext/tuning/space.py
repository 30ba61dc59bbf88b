"""The MetaSchedule design space of the BRGEMM convolution (what AutoTVM templates were).

A tuning task is the unscheduled blocked convolution of a graph (:func:`conv2d_workload`: the
layouts its neighbours agreed on are fixed, so a tuned kernel drops into the same graph). Its
design space, :func:`conv2d_space`, is the kernel's own schedule
(:func:`tvm_ext.kernels.conv2d.schedule_conv2d_blocked` with `tunable=True`: no second copy),
which samples, per task, the cache blocking of images, output channels and rows (three perfect
tiles, which together are the loop order and decide whether threads divide channels or rows;
see :func:`tvm_ext.kernels.conv2d.order_rows`) and, per row segment:

- m_r: output pixels per microkernel call, among the divisors of the segment's width (no tile
  ever needs a predicate);
- n_r: output channels per call, a multiple of the vector width dividing the channel block
  (several calls per block when smaller);
- the unroll of the microkernel's k loop.

Every decision is a `sample_perfect_tile` or `sample_categorical` whose value feeds `split` and
`annotate` directly, so the loop structure is the same for every decision (trace replay and
evolutionary mutation work).
The postprocessor :class:`TensorizeBRGEMM` then tensorizes each segment with the microkernel of
the sampled shape, and rejects tiles that do not fit the register file.
"""

from __future__ import annotations

import dataclasses
import json

import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir import Schedule
from tvm.s_tir.meta_schedule.postproc import PyPostproc

from ..kernels import conv2d as _conv
from ..kernels import winograd as _winograd
from ..kernels.common import KERNEL_ATTR
from ..kernels.quantized import Quantization
from .kinds import TaskKind, fields_from_json

PLAN_ATTR = "tvm_ext.conv2d_plan"


# Fields added after records were tuned: unnamed while they hold their default, so that those
# records keep their text (a workload's description is part of what a record matches).
_LATER_PLAN_FIELDS = ("nchw_in", "oihw_weight", "data_bn", "engine", "n_r")
_LATER_EPILOGUE_FIELDS = ("mask", "mask_pad", "out_dtype", "zero_point", "out_scale", "units", "add",
                         "residual_dtype")


def _fields(obj, later: tuple[str, ...]) -> dict:
    """`obj`'s fields as a dict, without the `later` ones that hold their default."""
    fields = dataclasses.asdict(obj)
    defaults = {f.name: f.default for f in dataclasses.fields(obj)}
    for name in later:
        value = tuple(fields[name]) if isinstance(defaults[name], tuple) else fields[name]
        if value == defaults[name]:
            del fields[name]
    return fields


def _describe(plan: _conv.Conv2dPlan, epilogue: _conv.Epilogue, lanes: int, registers: int) -> str:
    return json.dumps({"plan": _fields(plan, _LATER_PLAN_FIELDS),
                       "epilogue": _fields(epilogue, _LATER_EPILOGUE_FIELDS),
                       "lanes": lanes, "registers": registers}, sort_keys=True)


def describe_kernel(func: tvm.tirx.PrimFunc) -> tuple[_conv.Conv2dPlan, _conv.Epilogue, int, int] | None:
    """(plan, epilogue, lanes, registers) of a convolution kernel or workload, or None."""
    if func.attrs is None or PLAN_ATTR not in func.attrs:
        return None
    data = json.loads(str(func.attrs[PLAN_ATTR]))
    plan = data["plan"]
    wl = _conv.Conv2dWorkload(**fields_from_json(plan.pop("wl")))
    return (_conv.Conv2dPlan(wl, **plan), _conv.Epilogue(**data["epilogue"]), data["lanes"], data["registers"])


def _described_kernel(func: tvm.tirx.PrimFunc) -> tuple[_conv.Conv2dPlan, _conv.Epilogue, int, int]:
    """:func:`describe_kernel` of a function that must be a convolution kernel or workload."""
    described = describe_kernel(func)
    if described is None:
        raise ValueError(f"not a tvm_ext convolution kernel or workload: no {PLAN_ATTR} attribute")
    return described


def conv2d_workload(plan: _conv.Conv2dPlan, epilogue: _conv.Epilogue, isa) -> tvm.tirx.PrimFunc:
    """The tuning task of a convolution: its unscheduled TensorIR, describing itself."""
    func = _conv.conv2d_blocked_func(plan, epilogue)
    return func.with_attr(PLAN_ATTR, _describe(plan, epilogue, isa.lanes, isa.registers))


def task_epilogue(epilogue: _conv.Epilogue) -> _conv.Epilogue:
    """`epilogue` with its constants at canonical values: a quantized output's zero point and scale,
    a fused add's quantizations, leaky ReLU's slope. They change no loop of the kernel, so one
    schedule serves every value; without this, each quantization of a layer (a network's
    calibration) was a task and a record of its own."""
    add = epilogue.add
    if add is not None:
        add = dataclasses.replace(add, **{name: Quantization(1.0, 0, getattr(add, name).dtype)
                                          for name in ("a", "b", "out")})
    return dataclasses.replace(epilogue, zero_point=0, out_scale=1.0, alpha=0.01, add=add)


def conv2d_task(plan: _conv.Conv2dPlan, epilogue: _conv.Epilogue, isa) -> tvm.tirx.PrimFunc:
    """The tuning task of a kernel: :func:`conv2d_workload` of its :func:`task_epilogue` (what
    tuning measures and a record is found by; the record's schedule is then replayed on the
    kernel's own workload)."""
    return conv2d_workload(plan, task_epilogue(epilogue), isa)


def default_kernel(plan: _conv.Conv2dPlan, epilogue: _conv.Epilogue, isa) -> tvm.tirx.PrimFunc:
    """The analytic schedule of the same workload (what runs when nothing was tuned); for a
    Winograd plan, its output transform (the kernel that carries the epilogue and the border)."""
    if plan.kind == "winograd":
        func = _winograd.output_transform_func(plan, epilogue)
    else:
        func = _conv.conv2d_blocked_kernel(plan, isa.lanes, epilogue)
    return func.with_attr(PLAN_ATTR, _describe(plan, epilogue, isa.lanes, isa.registers))


def tunable(plan: _conv.Conv2dPlan, epilogue: _conv.Epilogue) -> bool:
    """Whether a kernel has a design space: the BRGEMM kind with a blocked output, on the vector
    registers (fp32, bf16 on `vdpbf16ps` or emulated on FMA, int8 on VNNI).

    Depthwise and direct kernels keep their schedule. So do kernels that write NCHW (output
    channels that do not fill their last block, e.g. a 1000-class classifier): their register
    transposes are `Shuffle` nodes, which MetaSchedule's FLOP estimator rejects. And AMX kernels:
    the space's register tiles are the vector registers', not AMX's tiles.
    """
    return plan.kind == "brgemm" and plan.engine != "amx" and not epilogue.nchw_out


def conv2d_space(sch: Schedule) -> None:
    """The design space (a MetaSchedule ScheduleFn) of a :func:`conv2d_workload`: the kernel's own
    schedule with its knobs sampled."""
    plan, _, lanes, registers = _described_kernel(sch.mod["main"])
    _conv.schedule_conv2d_blocked(sch, plan, lanes, tunable=True, registers=registers)


def default_trace(workload: tvm.tirx.PrimFunc) -> tvm.s_tir.Trace:
    """The point of :func:`conv2d_space` that is the analytic schedule (the default kernel).

    Tuning measures it first: a record of it keeps the best record from being a candidate
    slower than the schedule used without tuning. Postprocessing (tensorizing) is not in the
    trace; it is applied when the record is, as for every record.
    """
    plan = _described_kernel(workload)[0]
    sch = Schedule(tvm.IRModule({"main": workload}))
    conv2d_space(sch)
    trace = sch.trace
    tiles = [inst for inst in trace.insts if inst.kind.name == "SamplePerfectTile"]
    samples = [inst for inst in trace.insts if inst.kind.name == "SampleCategorical"]
    defaults = [value for _, width, _ in plan.row_segments() for value in (min(plan.m_r, width), plan.tile_n, 1)]
    if len(tiles) != 3 or len(samples) != len(defaults):
        raise ValueError(f"conv2d space: {len(tiles)} tile and {len(samples)} categorical decisions, "
                         f"expected 3 and {len(defaults)}")
    for inst, factors in zip(tiles, _conv.row_order_tiles(plan), strict=True):
        trace = trace.with_decision(inst, factors, remove_postproc=True)
    for inst, value in zip(samples, defaults, strict=True):
        trace = trace.with_decision(inst, [int(c) for c in inst.attrs[0]].index(value), remove_postproc=True)
    return trace


def flat_decisions(trace: tvm.s_tir.Trace) -> tuple[int, ...]:
    """A trace's sampled decisions as one tuple of ints (a perfect tile gives its factors)."""
    values = []
    for value in trace.decisions.values():
        if isinstance(value, tvm.ir.Array):
            values.extend(int(v) for v in value)
        else:
            values.append(int(value))
    return tuple(values)


def tensorize_segments(sch: Schedule) -> bool:
    """Tensorize every sampled segment with the microkernel of its tile; False if one does not fit."""
    described = describe_kernel(sch.mod["main"])
    if described is None:
        return False
    plan, _, lanes, registers = described
    return _conv.tensorize_brgemm_segments(sch, plan, lanes, registers)


@derived_object
class TensorizeBRGEMM(PyPostproc):
    """MetaSchedule postprocessor: :func:`tensorize_segments`."""

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def apply(self, sch: Schedule) -> bool:
        try:
            return tensorize_segments(sch)
        except (RuntimeError, ValueError):  # ScheduleError is a RuntimeError
            return False

    def clone(self) -> TensorizeBRGEMM:
        return TensorizeBRGEMM()


def _task_of(kernel: tvm.tirx.PrimFunc, isa) -> tvm.tirx.PrimFunc | None:
    plan, epilogue, _, _ = _described_kernel(kernel)
    return conv2d_task(plan, epilogue, isa) if tunable(plan, epilogue) else None


def _finish(sch: Schedule) -> tvm.tirx.PrimFunc | None:
    if not tensorize_segments(sch):
        return None
    return sch.mod["main"].with_attr(KERNEL_ATTR, "brgemm_conv2d")


CONV2D = TaskKind(
    name="conv2d", attr=PLAN_ATTR, task_of=_task_of, design_space=conv2d_space,
    postprocessors=lambda: [TensorizeBRGEMM()], default_trace=default_trace,
    flops=lambda workload: _described_kernel(workload)[0].wl.flops, finish=_finish)
"""The BRGEMM convolution as a tuning task kind."""
