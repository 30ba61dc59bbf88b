"""Tuning covers bf16 and int8 kernels: their tasks are the kernels a `precision="bf16"` build or a
quantized network runs, every candidate of their space computes what the analytic kernel does,
and a record of one is used by the build."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
from reference import rel_err
from tvm import relax
from tvm.s_tir import Schedule
from tvm.s_tir import meta_schedule as ms

import tvm_ext
from tvm_ext.kernels.conv2d import Conv2dWorkload, Epilogue, plan_conv2d
from tvm_ext.pipeline import cpu_kernel_passes
from tvm_ext.strategy.quantized import int8_engine
from tvm_ext.target import AVX512, has_avx512_bf16, resolve_target, vector_isa
from tvm_ext.tuning import extract_tasks, open_database
from tvm_ext.tuning.records import TUNED_ATTR
from tvm_ext.tuning.space import (
    conv2d_space,
    conv2d_workload,
    default_kernel,
    default_trace,
    describe_kernel,
    flat_decisions,
    tensorize_segments,
    tunable,
)

ZEN4 = resolve_target({"kind": "llvm", "mcpu": "znver4"})  # VNNI and AVX512-BF16 without AMX
HOST = resolve_target("llvm")


def _params(func: tvm.tirx.PrimFunc) -> list[tuple[tuple[int, ...], str]]:
    """(shape, dtype) of each parameter."""
    return [(tuple(int(e) for e in info.shape), str(info.dtype)) for info in ms.arg_info.ArgInfo.from_prim_func(func)]


def _random_args(func: tvm.tirx.PrimFunc, rng: np.random.Generator) -> list[np.ndarray]:
    """Random inputs for each parameter but the output, in its dtype's range."""
    args = []
    for info in _params(func)[:-1]:
        shape, dtype = info
        if dtype == "bfloat16":
            args.append(rng.standard_normal(shape).astype(ml_dtypes.bfloat16))
        elif dtype in ("uint8", "int8"):
            info = np.iinfo(dtype)
            args.append(rng.integers(info.min, info.max + 1, shape).astype(dtype))
        elif dtype == "int32":
            args.append(rng.integers(-5000, 5000, shape).astype(dtype))
        else:  # float32: the int8 kernels' scales, bf16's bias
            args.append((rng.random(shape) * 0.01 + 0.001).astype(dtype))
    return args


@pytest.mark.parametrize("dtype, engine", [
    pytest.param("bfloat16", "fma", marks=pytest.mark.skipif(not has_avx512_bf16(HOST), reason="no AVX512-BF16")),
    ("bfloat16", "emulated"),
    pytest.param("int8", "fma", marks=pytest.mark.skipif(int8_engine(HOST) is None, reason="no VNNI or AMX-INT8"))])
def test_every_candidate_of_a_low_precision_space_computes_the_analytic_kernel(dtype, engine):
    """bf16 on vdpbf16ps or emulated on FMA (this host's ISA; its tiles leave room for the
    widened pairs), and int8 on VNNI (u8 x s8, requantized to uint8): the candidates' tiles,
    blockings and unrolls reorder no sum, so int8 is bit for bit and bf16 within fp32 rounding."""
    isa = vector_isa(HOST) if engine == "emulated" else AVX512
    wl = Conv2dWorkload.make((2, 64, 9, 13), (64, 64, 3, 3), 1, 1, dtype=dtype)
    plan = plan_conv2d(wl, isa, engine=engine)
    epilogue = (Epilogue(bias=True, activation="relu", out_dtype="uint8", zero_point=3) if dtype == "int8"
                else Epilogue(bias=True, activation="relu"))
    assert tunable(plan, epilogue)
    workload = conv2d_workload(plan, epilogue, isa)
    default = default_kernel(plan, epilogue, isa)
    out_shape, out_dtype = _params(default)[-1]
    args = [tvm.runtime.tensor(a) for a in _random_args(default, np.random.default_rng(1))]

    def run(func) -> np.ndarray:
        out = tvm.runtime.tensor(np.zeros(out_shape, out_dtype))
        tvm.compile(func, HOST)(*args, out)
        return out.numpy()

    expected = run(default)
    assert np.count_nonzero(expected) > expected.size // 4  # (not a saturated or all-zero output)
    seen = set()
    for seed in range(1, 13):
        sch = Schedule(workload, seed=seed * 7919)
        conv2d_space(sch)
        decisions = flat_decisions(sch.trace)
        if decisions in seen or not tensorize_segments(sch):
            continue
        seen.add(decisions)
        got = run(sch.mod["main"])
        if dtype == "int8":
            np.testing.assert_array_equal(got, expected, err_msg=str(decisions))
        else:
            assert rel_err(got, expected) <= 1e-6, decisions
    assert len(seen) >= 4


def test_amx_kernels_keep_their_schedule():
    """The space's register tiles are the vector registers': an AMX kernel is no task."""
    plan = plan_conv2d(Conv2dWorkload.make((1, 64, 8, 8), (64, 64, 3, 3), 1, 1, dtype="int8"), AVX512, engine="amx")
    assert plan.engine == "amx" and not tunable(plan, Epilogue(out_dtype="uint8"))


def _qdq_conv(seed: int = 0, out_scale: float = 0.5, out_zero: int = 4) -> tuple[tvm.IRModule, np.ndarray]:
    """uint8 x -> dequantize -> conv2d 3x3 (int8 weights, per-channel scales) + bias -> relu ->
    quantize uint8 (`out_scale`, `out_zero`): one int8 kernel."""
    rng = np.random.default_rng(seed)
    n, c, h, w, k = 1, 32, 10, 12, 64
    f32 = lambda v: relax.const(np.asarray(v, np.float32))  # noqa: E731
    bb = relax.BlockBuilder()
    xv = relax.Var("x", relax.TensorType((n, c, h, w), "uint8"))
    with bb.function("main", [xv]):
        with bb.dataflow():
            xd = bb.emit(relax.op.dequantize(xv, f32(0.02), relax.const(np.asarray(120, "uint8")), axis=1))
            scales = (rng.random(k) * 0.01 + 0.001).astype(np.float32)
            wd = bb.emit(relax.op.dequantize(relax.const(rng.integers(-127, 128, (k, c, 3, 3)).astype(np.int8)),
                                             f32(scales), relax.const(np.zeros(k, np.int8)), axis=0))
            bias = bb.emit(relax.op.dequantize(relax.const(rng.integers(-3000, 3000, k).astype(np.int32)),
                                               f32(0.02 * scales), relax.const(np.zeros(k, np.int32)), axis=0))
            y = bb.emit(relax.op.nn.relu(relax.op.add(relax.op.nn.conv2d(xd, wd, padding=1),
                                                      relax.op.reshape(bias, (1, k, 1, 1)))))
            zero = relax.const(np.asarray(out_zero, "uint8"))
            out = bb.emit_output(bb.emit(relax.op.quantize(y, f32(out_scale), zero, axis=1, out_dtype="uint8")))
        bb.emit_func_output(out)
    return bb.get(), rng.integers(0, 256, (n, c, h, w)).astype(np.uint8)


def _tuned_kernels(mod: tvm.IRModule, database, **options) -> list[tvm.tirx.PrimFunc]:
    with ZEN4:
        lowered = tvm.transform.Sequential(cpu_kernel_passes(ZEN4, database, **options))(mod)
    return [f for f in lowered.functions.values()
            if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and TUNED_ATTR in f.attrs]


def _commit_other_record(work_dir, workload: tvm.tirx.PrimFunc) -> None:
    """A record of `workload` with the unroll of its first segment changed (as tuning would commit it)."""
    trace = default_trace(workload)
    unroll = [inst for inst in trace.insts if inst.kind.name == "SampleCategorical"][2]
    trace = trace.with_decision(unroll, 1, remove_postproc=True)  # unroll 2, not the analytic 1
    database = open_database(work_dir, create=True)
    database.commit_tuning_record(ms.database.TuningRecord(
        trace, database.commit_workload(tvm.IRModule({"main": workload})), [1e-6], ZEN4,
        ms.arg_info.ArgInfo.from_prim_func(workload)))


def test_a_quantized_network_tunes_its_int8_kernels(tmp_path):
    """extract_tasks finds the int8 kernel (before: the quantized convolutions were lowered after
    the tasks were taken, so a QDQ model's tuning never saw them), and the build runs its record."""
    mod, x = _qdq_conv()
    tasks = extract_tasks(mod, ZEN4)
    assert [describe_kernel(t.workload)[0].wl.dtype for t in tasks] == ["int8"]
    assert describe_kernel(tasks[0].workload)[1].out_dtype == "uint8"
    _commit_other_record(tmp_path, tasks[0].workload)
    assert len(_tuned_kernels(mod, open_database(tmp_path))) == 1
    if int8_engine(HOST) is not None and has_avx512_bf16(HOST):  # (a host that runs znver4 code)
        run = lambda ex: relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()  # noqa: E731
        np.testing.assert_array_equal(run(tvm_ext.build(mod, ZEN4, database=tmp_path)),
                                      run(tvm_ext.build(mod, ZEN4)))


def test_one_task_and_record_serve_every_quantization_of_a_layer(tmp_path):
    """Zero points and scales change no loop: two calibrations of one layer are one task (before,
    a task and a record per calibration), and its record runs each with its own constants."""
    first, x = _qdq_conv(out_scale=0.5, out_zero=4)
    second, _ = _qdq_conv(out_scale=0.3, out_zero=17)
    (task,), (other,) = extract_tasks(first, ZEN4), extract_tasks(second, ZEN4)
    tvm.ir.assert_structural_equal(task.workload, other.workload)
    _commit_other_record(tmp_path, task.workload)
    assert len(_tuned_kernels(second, open_database(tmp_path))) == 1
    if int8_engine(HOST) is not None and has_avx512_bf16(HOST):
        run = lambda ex: relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()  # noqa: E731
        tuned, untuned = run(tvm_ext.build(second, ZEN4, database=tmp_path)), run(tvm_ext.build(second, ZEN4))
        np.testing.assert_array_equal(tuned, untuned)
        assert not np.array_equal(tuned, run(tvm_ext.build(first, ZEN4)))


def test_a_bf16_build_tunes_its_bf16_kernels(tmp_path):
    """With precision="bf16" the tasks are the bf16 kernels the build runs (Winograd's 3x3 layers
    stay fp32 on vdpbf16ps), and a record of one is used."""
    rng = np.random.default_rng(4)
    bb = relax.BlockBuilder()
    xv = relax.Var("x", relax.TensorType((1, 64, 14, 14), "float32"))
    with bb.function("main", [xv]):
        with bb.dataflow():
            w = relax.const((rng.standard_normal((128, 64, 1, 1)) * 0.1).astype("float32"))
            out = bb.emit_output(bb.emit(relax.op.nn.relu(relax.op.nn.conv2d(xv, w))))
        bb.emit_func_output(out)
    mod = bb.get()
    assert [describe_kernel(t.workload)[0].wl.dtype for t in extract_tasks(mod, ZEN4)] == ["float32"]
    tasks = extract_tasks(mod, ZEN4, precision="bf16")
    assert [describe_kernel(t.workload)[0].wl.dtype for t in tasks] == ["bfloat16"]
    _commit_other_record(tmp_path, tasks[0].workload)
    assert len(_tuned_kernels(mod, open_database(tmp_path), precision="bf16")) == 1
    assert _tuned_kernels(mod, open_database(tmp_path)) == []  # (fp32's kernel is another task)
    with pytest.raises(ValueError, match="precision"):
        extract_tasks(mod, ZEN4, precision="int4")
