"""The MetaSchedule design space of the BRGEMM convolution (what AutoTVM templates were).

A tuning task is the unscheduled blocked convolution of a graph (:func:`conv2d_workload`: the
layouts its neighbours agreed on are fixed, so a tuned kernel drops into the same graph). Its
design space, :func:`conv2d_space`, samples per row segment:

- m_r: output pixels per microkernel call, among the divisors of the segment's width (no tile
  ever needs a predicate);
- n_r: output channels per call, a multiple of the vector width dividing the channel block
  (several calls per block when smaller);
- the unroll of the microkernel's k loop.

Every decision is a `sample_categorical` whose value feeds `split` and `annotate` directly, so
the loop structure is the same for every decision (trace replay and evolutionary mutation work).
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

from ..intrin.cpu import BRGEMM, get_brgemm_intrin, register_tiles
from ..kernels import conv2d as _conv
from ..target import AVX2, AVX512, NEON, SSE

PLAN_ATTR = "tvm_ext.conv2d_plan"
_MARK = "tvm_ext.brgemm_segment"
_UNROLL = "tvm_ext.brgemm_unroll"
UNROLL_CHOICES = (1, 2, 4)
_ISAS = {isa.lanes * 100 + isa.registers: isa for isa in (AVX512, AVX2, NEON, SSE)}


def _describe(plan: _conv.Conv2dPlan, epilogue: _conv.Epilogue, lanes: int, registers: int) -> str:
    return json.dumps({"plan": dataclasses.asdict(plan), "epilogue": dataclasses.asdict(epilogue),
                       "lanes": lanes, "registers": registers}, sort_keys=True)


def describe_kernel(func: tvm.tirx.PrimFunc) -> tuple[_conv.Conv2dPlan, _conv.Epilogue, int, int] | None:
    """(plan, epilogue, lanes, registers) of a convolution kernel or workload, or None."""
    if func.attrs is None or PLAN_ATTR not in func.attrs:
        return None
    data = json.loads(str(func.attrs[PLAN_ATTR]))
    plan = data["plan"]
    wl = _conv.Conv2dWorkload(**{k: tuple(v) if isinstance(v, list) else v for k, v in plan.pop("wl").items()})
    return (_conv.Conv2dPlan(wl, **plan), _conv.Epilogue(**data["epilogue"]), data["lanes"], data["registers"])


def conv2d_workload(plan: _conv.Conv2dPlan, epilogue: _conv.Epilogue, isa) -> tvm.tirx.PrimFunc:
    """The tuning task of a convolution: its unscheduled TensorIR, describing itself."""
    func = _conv.conv2d_blocked_func(plan, epilogue)
    return func.with_attr(PLAN_ATTR, _describe(plan, epilogue, isa.lanes, isa.registers))


def default_kernel(plan: _conv.Conv2dPlan, epilogue: _conv.Epilogue, isa) -> tvm.tirx.PrimFunc:
    """The analytic schedule of the same workload (what runs when nothing was tuned)."""
    func = _conv.conv2d_blocked_kernel(plan, isa.lanes, epilogue)
    return func.with_attr(PLAN_ATTR, _describe(plan, epilogue, isa.lanes, isa.registers))


def tunable(plan: _conv.Conv2dPlan) -> bool:
    """Only the BRGEMM kind has a design space (depthwise and direct keep their schedule)."""
    return plan.kind == "brgemm"


def conv2d_space(sch: Schedule) -> None:
    """The design space (a MetaSchedule ScheduleFn) of a :func:`conv2d_workload`."""
    plan, _, lanes, registers = describe_kernel(sch.mod["main"])
    isa = _ISAS[lanes * 100 + registers]
    largest_m = max(m for m, _ in register_tiles(isa, spare=1))
    n_choices = [n for n in range(lanes, plan.oc_bn + 1, lanes) if plan.oc_bn % n == 0]
    for name, width, _ in plan.row_segments():
        block = sch.get_sblock(name)
        ow, o = sch.get_loops(block)[-6:-4]
        m_choices = [m for m in range(1, min(width, largest_m) + 1) if width % m == 0]
        m_r = sch.sample_categorical(m_choices, [1 / len(m_choices)] * len(m_choices))
        n_r = sch.sample_categorical(n_choices, [1 / len(n_choices)] * len(n_choices))
        unroll = sch.sample_categorical(list(UNROLL_CHOICES), [1 / len(UNROLL_CHOICES)] * len(UNROLL_CHOICES))
        ow_outer, ow_inner = sch.split(ow, [None, m_r], preserve_unit_iters=True)
        o_outer, o_inner = sch.split(o, [None, n_r], preserve_unit_iters=True)
        sch.reorder(o_outer, ow_outer, ow_inner, o_inner)  # one weight block is reused along the row
        sch.annotate(block, _UNROLL, unroll)
        sch.annotate(block, _MARK, 1)


def tensorize_segments(sch: Schedule) -> bool:
    """Tensorize every sampled segment with the microkernel of its tile; False if one does not fit."""
    described = describe_kernel(sch.mod["main"])
    if described is None:
        return False
    plan, _, lanes, registers = described
    isa = _ISAS[lanes * 100 + registers]
    fits = set(register_tiles(isa, spare=1))
    wl = plan.wl
    for name, _, _ in plan.row_segments():
        block = sch.get_sblock(name)
        annotations = sch.get(block).annotations
        if _MARK not in annotations:
            return False
        ow_inner, o_inner, icb = sch.get_loops(block)[-6:-3]
        m_r, n_r = int(sch.get(ow_inner).extent), int(sch.get(o_inner).extent)
        if (m_r, n_r) not in fits:
            return False
        spec = BRGEMM(m_r=m_r, n_r=n_r, k=plan.ic_bn, lanes=lanes, batch=(int(sch.get(icb).extent), wl.KH, wl.KW),
                      stride=wl.stride[1], dilation=wl.dilation, init=True, unroll=int(annotations[_UNROLL]))
        sch.tensorize(ow_inner, get_brgemm_intrin(spec))
    return True


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
