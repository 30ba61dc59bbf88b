"""The maxDNN tile's design space: the blocking a tuner searches (a task's tile of output channels
and images, the channels a call reduces, the unroll), each candidate right, the default point the
analytic kernel, and a record of it used by a graph's build."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tvm
from reference import conv2d_nchw, rel_err
from tvm import relax
from tvm.s_tir import Schedule
from tvm.s_tir import meta_schedule as ms

import tvm_ext
from tvm_ext.kernels import conv2d_maxdnn as M
from tvm_ext.kernels.conv2d import Conv2dWorkload
from tvm_ext.target import AVX2, usable_cores
from tvm_ext.tuning import extract_tasks, open_database, tuned_kernel
from tvm_ext.tuning.known_kinds import kind_of
from tvm_ext.tuning.maxdnn_space import (
    MAXDNN_CONV2D,
    default_maxdnn_kernel,
    default_maxdnn_trace,
    describe_maxdnn,
    maxdnn_workload,
    tensorize_tile,
)
from tvm_ext.tuning.records import TUNED_ATTR

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": "znver3"})  # AVX2: the CI machine's ISA


def _plan() -> M.MaxDNNCpuPlan:
    """A graph's plan on this machine. 20 images (two tiles of 16, one padded), 3 row tiles of 4,
    24 channels: every split of the space has choices."""
    wl = Conv2dWorkload.make((20, 24, 5, 6), (12, 24, 3, 3), 1, (1, 0, 1, 1))
    return M.MaxDNNCpuPlan.make(wl, AVX2, rows=4, cols=16, threads=usable_cores())


def test_every_candidate_of_the_space_computes_the_convolution():
    """Candidates differ in the task tile (output channels, images), the chunk of channels a call
    reduces (all: the call starts at zero; fewer: a zero pass first) and the unroll; each gives
    the float64 answer, with the bias and relu of the epilogue. The decisions are set, not
    sampled: every tile of both task splits, four chunks, the unrolls in turn."""
    plan, epilogue = _plan(), M.Epilogue(bias=True, activation="relu")
    wl = plan.wl
    workload = maxdnn_workload(plan, epilogue)
    default = default_maxdnn_trace(workload)
    row_split, col_split, channel_split = [i for i in default.insts if i.kind.name == "SamplePerfectTile"]
    unroll = next(i for i in default.insts if i.kind.name == "SampleCategorical")
    grid = [(rt, ct, k) for rt in (1, 3) for ct in (1, 2) for k in (24, 8, 3, 1)]
    kernels = {}
    for index, (rt, ct, k) in enumerate(grid):
        trace = default
        for inst, inner, extent in ((row_split, rt, 3), (col_split, ct, 2), (channel_split, k, 24)):
            trace = trace.with_decision(inst, [extent // inner, inner], remove_postproc=True)
        trace = trace.with_decision(unroll, index % 3, remove_postproc=True)
        sch = Schedule(workload)
        trace.apply_to_schedule(sch, remove_postproc=True)
        assert tensorize_tile(sch)
        kernels[f"conv{index}"] = sch.mod["main"].with_attr("global_symbol", f"conv{index}")
    lib = tvm.compile(tvm.IRModule(kernels), TARGET)  # (one LLVM run)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((wl.N, wl.C, wl.H, wl.W)).astype(np.float32)
    w = rng.standard_normal((wl.K, wl.C, wl.KH, wl.KW)).astype(np.float32)
    b = rng.standard_normal(wl.K).astype(np.float32)
    args = [tvm.runtime.tensor(a) for a in (M.pack_data(plan, x), M.pack_weight(plan, w), M.pack_bias(plan, b))]
    ref = np.maximum(conv2d_nchw(x, w, b, wl.stride, wl.padding), 0)
    for index, decisions in enumerate(grid):
        y = tvm.runtime.tensor(np.full(plan.out_shape(), np.nan, np.float32))  # every element written
        lib[f"conv{index}"](*args, y)
        assert rel_err(M.unpack_output(plan, y.numpy()), ref) <= 1e-5, decisions


@pytest.mark.parametrize("epilogue", [M.Epilogue(), M.Epilogue(bias=True, activation="relu")])
def test_the_default_point_of_the_space_is_the_analytic_kernel(epilogue):
    """default_maxdnn_trace is the blocking a graph's plan has on this machine: the same kernel."""
    plan = _plan()
    workload = maxdnn_workload(plan, epilogue)
    sch = Schedule(workload)
    default_maxdnn_trace(workload).apply_to_schedule(sch, remove_postproc=True)
    tvm.ir.assert_structural_equal(MAXDNN_CONV2D.finish(sch), default_maxdnn_kernel(plan, epilogue))


def test_the_kind_names_its_task():
    plan = _plan()
    workload, kernel = maxdnn_workload(plan), default_maxdnn_kernel(plan)
    assert kind_of(workload) is MAXDNN_CONV2D and kind_of(kernel) is MAXDNN_CONV2D
    tvm.ir.assert_structural_equal(MAXDNN_CONV2D.task_of(kernel, None), workload)
    assert MAXDNN_CONV2D.flops(workload) == plan.wl.flops
    # The blocking is not part of the task: other blockings of one layer are one task.
    other = M.MaxDNNCpuPlan.make(plan.wl, AVX2, rows=4, cols=16, k_step=6, macro_rows=4)
    tvm.ir.assert_structural_equal(maxdnn_workload(other), workload)
    with pytest.raises(ValueError, match="maxDNN"):
        MAXDNN_CONV2D.flops(workload.without_attr("tvm_ext.maxdnn_plan"))


def _se_net() -> tvm.IRModule:
    """A 1x1 convolution on 16 images of one pixel (a squeeze-excitation's): the tile's case."""
    rng = np.random.default_rng(7)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((16, 32, 1, 1), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            w = relax.const((rng.standard_normal((48, 32, 1, 1)) * 0.2).astype("float32"))
            out = bb.emit_output(bb.emit(relax.op.nn.relu(relax.op.nn.conv2d(x, w))))
        bb.emit_func_output(out)
    return bb.get()


def test_a_record_of_the_tile_is_used_by_the_build(tmp_path):
    """extract_tasks finds the tile's convolution; a record of a blocking other than the analytic
    one (committed here as tuning would) makes the build run that schedule, and right."""
    from tvm_ext.strategy.dispatch import lower_to_kernels
    from tvm_ext.strategy.fusion import fusion_passes

    mod = _se_net()
    tasks = extract_tasks(mod, TARGET, images_per_call=16, maxdnn="always")
    assert [kind_of(t.workload) for t in tasks] == [MAXDNN_CONV2D]
    workload = tasks[0].workload
    trace = default_maxdnn_trace(workload)
    unroll = next(inst for inst in trace.insts if inst.kind.name == "SampleCategorical")
    trace = trace.with_decision(unroll, 0, remove_postproc=True)  # unroll 1: not the plan's 2
    database = open_database(tmp_path, create=True)
    database.commit_tuning_record(ms.database.TuningRecord(
        trace, database.commit_workload(tvm.IRModule({"main": workload})), [1e-6], TARGET,
        ms.arg_info.ArgInfo.from_prim_func(workload)))
    tuned = tuned_kernel(open_database(tmp_path), workload, TARGET)
    plan, _ = describe_maxdnn(workload)
    assert tuned is not None and plan.unroll == 2
    tvm.ir.assert_structural_equal(tuned.without_attr(TUNED_ATTR),
                                   default_maxdnn_kernel(dataclasses.replace(plan, unroll=1)))
    with TARGET:
        lowered = tvm.transform.Sequential(fusion_passes(TARGET) + [
            lower_to_kernels(TARGET, database=open_database(tmp_path), maxdnn="always")])(mod)
    kernels = [f for f in lowered.functions.values() if kind_of(f) is MAXDNN_CONV2D]
    assert len(kernels) == 1 and TUNED_ATTR in kernels[0].attrs
    xv = np.random.default_rng(8).standard_normal((16, 32, 1, 1)).astype("float32")
    run = lambda built: relax.VirtualMachine(built, tvm.cpu())["main"](tvm.runtime.tensor(xv)).numpy()  # noqa: E731
    built = tvm_ext.build(mod, TARGET, database=tmp_path, images_per_call=16, maxdnn="always")
    assert rel_err(run(built), run(tvm.compile(mod, TARGET))) <= 1e-5
