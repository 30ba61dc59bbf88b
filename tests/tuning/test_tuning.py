"""Autotuning: the design space's candidates, tuning a small network, records that persist."""

import contextlib
import json
import sys

import numpy as np
import pytest
import tvm
from reference import conv2d_nchw, rel_err
from tvm import relax
from tvm.s_tir import Schedule

import tvm_ext
from tvm_ext.kernels.conv2d import Conv2dWorkload, Epilogue, plan_conv2d
from tvm_ext.target import AVX2
from tvm_ext.tuning import extract_tasks, open_database, tuned_kernel
from tvm_ext.tuning.records import compact_database
from tvm_ext.tuning.space import (
    conv2d_space,
    conv2d_workload,
    default_kernel,
    default_trace,
    flat_decisions,
    tensorize_segments,
)

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": "znver3"})  # AVX2: the CI machine's ISA


@pytest.mark.parametrize("batch", [1, 2])
def test_every_candidate_of_the_design_space_computes_the_convolution(batch):
    """Candidates differ in the blocking of images, output channels and rows (and so in the loop
    order and the parallel split), m_r, n_r and unroll; each that fits the registers gives the
    same numbers."""
    wl = Conv2dWorkload.make((batch, 16, 9, 13), (32, 16, 3, 3), 1, 1)  # 13 wide: whole tiles and a tail
    plan = plan_conv2d(wl, AVX2)
    assert len(plan.row_segments()) == 2
    border = (1, 1, 0, 2) if batch > 1 else (0, 0, 0, 0)  # a kernel that writes its consumer's border
    epilogue = Epilogue(bias=True, activation="relu", out_pad=border)
    workload = conv2d_workload(plan, epilogue, AVX2)
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s).astype("float32") for s in (plan.data_shape(), plan.weight_shape(),
                                                                (plan.OCB, plan.oc_bn))]

    def run(func) -> np.ndarray:
        out = tvm.runtime.tensor(np.full(epilogue.out_shape(plan), np.nan, np.float32))
        tvm.compile(func, TARGET)(*(tvm.runtime.tensor(a) for a in args), out)
        return out.numpy()

    expected = run(default_kernel(plan, epilogue, AVX2))
    # An independent float64 reference: the blocked arguments as NCHW / OIHW (the input already
    # carries its zero border), convolved, + bias, relu, blocked again.
    x, w, b = args
    n, icb, hp, wp, ic = x.shape
    ocb, _, kh, kw, _, oc = w.shape
    reference = conv2d_nchw(x.transpose(0, 1, 4, 2, 3).reshape(n, icb * ic, hp, wp),
                            w.transpose(0, 5, 1, 4, 2, 3).reshape(ocb * oc, icb * ic, kh, kw), b.reshape(-1))
    reference = np.maximum(reference, 0).reshape(n, ocb, oc, wl.OH, wl.OW).transpose(0, 1, 3, 4, 2)
    top, left, _, _ = border
    inner = (slice(None), slice(None), slice(top, top + wl.OH), slice(left, left + wl.OW))
    padded_reference = np.zeros(epilogue.out_shape(plan), np.float64)
    padded_reference[inner] = reference
    reference = padded_reference
    assert rel_err(expected, reference) <= 1e-4
    seen, rejected = set(), 0
    for seed in range(1, 17):
        sch = Schedule(workload, seed=seed)
        conv2d_space(sch)
        decisions = flat_decisions(sch.trace)
        if not tensorize_segments(sch):
            rejected += 1  # a tile larger than the register file
            continue
        if decisions in seen:
            continue
        seen.add(decisions)
        got = run(sch.mod["main"])
        assert rel_err(got, expected) <= 1e-6 and rel_err(got, reference) <= 1e-4, decisions
    assert len(seen) >= 4


def _body(func) -> str:
    """A kernel's TVMScript without its attributes."""
    return "\n".join(line for line in func.script().splitlines() if "T.func_attr" not in line)


@pytest.mark.parametrize("border,images", [((0, 0, 0, 0), 1), ((1, 1, 1, 1), 1), ((0, 0, 0, 0), 4)])
def test_the_default_point_of_the_space_is_the_analytic_schedule(border, images):
    """default_trace picks the analytic row order and, per segment, the analytic m_r, n_r and
    unroll: the same kernel (4 images of 7 x 7: images inside the output blocks)."""
    wl = Conv2dWorkload.make((images, 16, 9 if images == 1 else 7, 13 if images == 1 else 7), (32, 16, 3, 3), 1, 1)
    plan = plan_conv2d(wl, AVX2)
    assert plan.row_order == ("ob_oh" if images == 1 else "ob_n_oh")
    epilogue = Epilogue(bias=True, out_pad=border)
    workload = conv2d_workload(plan, epilogue, AVX2)
    sch = Schedule(workload)
    default_trace(workload).apply_to_schedule(sch, remove_postproc=False)
    assert tensorize_segments(sch)
    assert _body(sch.mod["main"]) == _body(default_kernel(plan, epilogue, AVX2))


def test_only_blocked_brgemm_kernels_have_a_design_space():
    """NCHW-writing kernels (channels that do not fill their last block) and depthwise ones are
    not tuning tasks: MetaSchedule's FLOP estimator rejects the former's register transposes."""
    from tvm_ext.tuning.space import tunable

    plan = plan_conv2d(Conv2dWorkload.make((1, 16, 8, 8), (32, 16, 3, 3), 1, 1), AVX2)
    assert tunable(plan, Epilogue()) and not tunable(plan, Epilogue(nchw_out=True))
    depthwise = plan_conv2d(Conv2dWorkload.make((1, 16, 8, 8), (16, 1, 3, 3), 1, 1, groups=16), AVX2)
    assert depthwise.kind == "depthwise" and not tunable(depthwise, Epilogue())
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 16, 8, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            w = relax.const(np.ones((20, 16, 3, 3), "float32"))  # 20 channels: NCHW output
            out = bb.emit_output(bb.emit(relax.op.nn.conv2d(x, w, padding=(1, 1))))
        bb.emit_func_output(out)
    assert extract_tasks(bb.get(), TARGET) == []


def test_each_kernel_kind_names_its_tuning_task():
    """kind_of finds a workload's kind from its attribute; the task of an analytic kernel is the
    workload it was scheduled from (what extract_tasks relies on); other functions have no kind."""
    from tvm_ext.kernels.pool2d import Pool2dWorkload
    from tvm_ext.tuning.known_kinds import kind_of
    from tvm_ext.tuning.pool_space import POOL2D, default_pool_kernel, pool2d_workload
    from tvm_ext.tuning.space import CONV2D

    plan = plan_conv2d(Conv2dWorkload.make((1, 16, 8, 8), (32, 16, 3, 3), 1, 1), AVX2)
    pool = Pool2dWorkload.make((1, 32, 8, 8), "max", kernel_size=3, stride=2, padding=1)
    cases = [(CONV2D, conv2d_workload(plan, Epilogue(), AVX2), default_kernel(plan, Epilogue(), AVX2), plan.wl.flops),
             (POOL2D, pool2d_workload(pool, 16), default_pool_kernel(pool, 16), pool.flops)]
    for kind, workload, kernel, flops in cases:
        assert kind_of(workload) is kind and kind_of(kernel) is kind
        tvm.ir.assert_structural_equal(kind.task_of(kernel, AVX2), workload)
        assert kind.flops(workload) == flops
    assert CONV2D.task_of(default_kernel(plan, Epilogue(nchw_out=True), AVX2), AVX2) is None
    assert kind_of(conv2d_workload(plan, Epilogue(), AVX2).without_attr("tvm_ext.conv2d_plan")) is None


@pytest.mark.parametrize("mode, shape, block, kwargs", [
    ("max", (2, 64, 13, 11), 32, dict(kernel_size=3, stride=2, padding=1)),
    ("avg", (1, 8, 12, 13), None, dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), count_include_pad=False)),
])
def test_every_candidate_of_the_pool_space_computes_the_pooling(mode, shape, block, kwargs):
    """Candidates differ in the rows per parallel task and the unrolled pixels; each gives the
    analytic kernel's numbers, which equal a NumPy pooling's; the default point is that kernel."""
    from tvm_ext.kernels.pool2d import Pool2dWorkload
    from tvm_ext.tuning.pool_space import default_pool_kernel, default_pool_trace, pool2d_space, pool2d_workload

    wl = Pool2dWorkload.make(shape, mode, **kwargs)
    workload = pool2d_workload(wl, block)
    x = np.random.default_rng(4).standard_normal(shape).astype("float32")
    data = x if block is None else x.reshape(shape[0], shape[1] // block, block, *shape[2:]).transpose(0, 1, 3, 4, 2)

    def run(func) -> np.ndarray:
        out_shape = (*data.shape[:2], wl.OH, wl.OW, *data.shape[4:])
        out = tvm.runtime.tensor(np.full(out_shape, np.nan, np.float32))
        tvm.compile(func, TARGET)(tvm.runtime.tensor(data), out)
        y = out.numpy()
        return y if block is None else y.transpose(0, 1, 4, 2, 3).reshape(shape[0], shape[1], wl.OH, wl.OW)

    (kh, kw), (sh, sw), (top, left, bottom, right) = wl.kernel, wl.stride, wl.padding
    fill = -np.inf if mode == "max" else np.nan
    padded = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (top, bottom), (left, right)), constant_values=fill)
    windows = np.stack([padded[:, :, i:i + sh * wl.OH:sh, j:j + sw * wl.OW:sw] for i in range(kh) for j in range(kw)])
    reference = windows.max(axis=0) if mode == "max" else np.nanmean(windows, axis=0)
    expected = run(default_pool_kernel(wl, block))
    assert rel_err(expected, reference) <= 1e-5
    seen = set()
    for seed in range(1, 13):
        sch = Schedule(workload, seed=seed)
        pool2d_space(sch)
        decisions = flat_decisions(sch.trace)
        if decisions not in seen:
            seen.add(decisions)
            assert rel_err(run(sch.mod["main"]), expected) <= 1e-6, decisions
    assert len(seen) >= 3
    sch = Schedule(workload)
    default_pool_trace(workload).apply_to_schedule(sch, remove_postproc=False)
    assert _body(sch.mod["main"]) == _body(default_pool_kernel(wl, block))


@pytest.mark.long
@pytest.mark.slow
def test_a_network_with_pooling_tunes_and_uses_its_pooling_record(tmp_path):
    """The max pooling is a task of its own; after tuning, the build runs its tuned kernel."""
    from tvm_ext.tuning.records import TUNED_ATTR

    rng = np.random.default_rng(5)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 16, 14, 14), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.relu(relax.op.nn.conv2d(
                x, relax.const((rng.standard_normal((32, 16, 3, 3)) * 0.1).astype("float32")), padding=(1, 1))))
            out = bb.emit_output(bb.emit(relax.op.nn.max_pool2d(y, (3, 3), (2, 2), (1, 1))))
        bb.emit_func_output(out)
    mod = bb.get()
    tasks = extract_tasks(mod, TARGET)
    assert sorted(t.name.split("_")[2] for t in tasks) == ["brgemm", "max"]
    pool = next(t for t in tasks if t.name.startswith("tvm_ext_max_pool2d"))
    conv = next(t for t in tasks if t is not pool)
    # What the progress lines count: 2 per multiply-add, one per pooling window element.
    assert (conv.flops, pool.flops) == (2 * 32 * 16 * 9 * 14 * 14, 32 * 7 * 7 * 9)
    tvm_ext.tune(mod, TARGET, tmp_path, max_trials=8, num_trials_per_iter=4)
    tuned = tuned_kernel(open_database(tmp_path), pool.workload, TARGET)
    assert tuned is not None and TUNED_ATTR in tuned.attrs
    xv = rng.standard_normal((1, 16, 14, 14)).astype("float32")
    run = lambda ex: relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(xv)).numpy()  # noqa: E731
    assert rel_err(run(tvm_ext.build(mod, TARGET, database=tmp_path)), run(tvm.compile(mod, TARGET))) <= 1e-4


def _net(repeated: int = 3) -> tvm.IRModule:
    """A conv-bias-relu and `repeated` more. `repeated=0` is one task: for the tests of records,
    resumption and measurement, where the number of tasks does not matter but each costs trials."""
    rng = np.random.default_rng(1)

    def const(*shape):
        return relax.const((rng.standard_normal(shape) * 0.1).astype("float32"))

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 16, 14, 14), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.relu(relax.op.add(relax.op.nn.conv2d(x, const(32, 16, 3, 3), padding=(1, 1)),
                                                      const(1, 32, 1, 1))))
            # Winograd convolutions of one shape: their GEMM is one task (weight `repeated`).
            for _ in range(repeated):
                y = bb.emit(relax.op.nn.relu(relax.op.add(relax.op.nn.conv2d(y, const(32, 32, 3, 3), padding=(1, 1)),
                                                          const(1, 32, 1, 1))))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def test_tasks_are_the_kernels_the_split_batch_runs():
    """A batch's trunk runs a few images a call (transform.split_batch): the tasks are those
    kernels, weighted by how often one inference calls them, not the whole-batch ones."""
    rng = np.random.default_rng(4)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 16, 14, 14), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = x
            for c in (16, 32):  # the second, small and with 32 channels, is the late stage's Winograd
                y = bb.emit(relax.op.nn.relu(relax.op.nn.conv2d(
                    y, relax.const((rng.standard_normal((32, c, 3, 3)) * 0.1).astype("float32")), padding=(1, 1))))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    mod = bb.get()

    def tasks(images_per_call: int) -> list[tuple[int, str, int]]:
        """(images a call, kernel, calls) per task; names read tvm_ext_brgemm_conv2d_<N>x<C>x..."""
        found = extract_tasks(mod, TARGET, images_per_call=images_per_call)
        return sorted((int(t.name.split("_")[4].split("x")[0]), "winograd" if "_g36_" in t.name else "direct",
                       t.weight) for t in found)

    assert tasks(1) == [(1, "direct", 4), (4, "winograd", 1)]  # 4 calls of one image, then the batch
    assert tasks(2) == [(2, "direct", 2), (4, "winograd", 1)]
    assert tasks(4) == [(4, "direct", 1), (4, "winograd", 1)]  # one call: the batch runs whole
    with TARGET:  # the build lowers to the same kernels
        lowered = tvm_ext.pipeline(TARGET, images_per_call=2)(mod)
    kernels = {gv.name_hint for gv, f in lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    assert {t.name for t in extract_tasks(mod, TARGET, images_per_call=2)} <= kernels


@pytest.mark.slow
def test_tune_a_network_then_build_with_its_records(tmp_path):
    mod = _net()
    tasks = extract_tasks(mod, TARGET)
    assert sorted(t.weight for t in tasks) == [1, 3]  # the 16-channel conv, the Winograd GEMM of the rest
    work_dir = tmp_path / "records"
    tvm_ext.tune(mod, TARGET, work_dir, max_trials=8, num_trials_per_iter=4)
    records = [json.loads(line) for line in (work_dir / "database_tuning_record.json").read_text().splitlines()]
    assert len(records) >= 6 and any(r[1][1][0] < 1 for r in records)  # measured run times, in seconds
    database = open_database(work_dir)
    assert all(tuned_kernel(database, t.workload, TARGET) is not None for t in tasks)
    for task in tasks:  # each task's analytic schedule was measured and recorded too
        workload = database.commit_workload(tvm.IRModule({"main": task.workload}))
        decisions = [flat_decisions(r.trace) for r in database.get_top_k(workload, 100)]
        assert flat_decisions(default_trace(task.workload)) in decisions
    x = np.random.default_rng(2).standard_normal((1, 16, 14, 14)).astype("float32")
    run = lambda ex: relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()  # noqa: E731
    assert rel_err(run(tvm_ext.build(mod, TARGET, database=work_dir)), run(tvm.compile(mod, TARGET))) <= 1e-4
    # Compacted (as shipped records are): one record per task, no tensorize steps, same kernels.
    import shutil

    compact_dir = tmp_path / "compact"
    shutil.copytree(work_dir, compact_dir)
    assert compact_database(compact_dir) == len(tasks)
    assert "Tensorize" not in (compact_dir / "database_tuning_record.json").read_text()
    compact = open_database(compact_dir)
    for task in tasks:
        assert tuned_kernel(compact, task.workload, TARGET).script() == tuned_kernel(
            database, task.workload, TARGET).script()
    # A second run continues from the same records.
    tvm_ext.tune(mod, TARGET, work_dir, max_trials=4, num_trials_per_iter=4)
    assert len((work_dir / "database_tuning_record.json").read_text().splitlines()) > len(records)


def _kill_session(proc) -> None:
    """SIGKILL a process started with start_new_session=True and everything it forked."""
    import os
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the whole session is gone already
        pass
    proc.wait()


def _test_paths() -> list[str]:
    """What a tuning script in a subprocess puts on sys.path to import this file (and its reference)."""
    from pathlib import Path

    here = Path(__file__).resolve().parent
    return [str(here), str(here.parent)]


_TUNE_UNTIL_KILLED = """
import sys
sys.path[:0] = {tests!r}  # test_tuning's folder and tests/ (reference)
import tvm, tvm_ext
from test_tuning import _net
tvm_ext.tune(_net(repeated=0), tvm.target.Target({{"kind": "llvm", "mcpu": "znver3"}}), {work_dir!r}, max_trials=64,
             num_trials_per_iter=4)
"""


@pytest.mark.slow
@pytest.mark.long
def test_sigkill_loses_no_finished_trial_and_the_rerun_continues(tmp_path):
    """A tuning process killed with SIGKILL keeps every record it wrote; tuning again resumes."""
    import os
    import subprocess
    import sys
    import time

    work_dir = tmp_path / "records"
    script = _TUNE_UNTIL_KILLED.format(tests=_test_paths(), work_dir=str(work_dir))
    # A session of its own: the kill takes the run's builder and runner workers with it.
    child = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "TVM_NUM_THREADS": "1"},
                             start_new_session=True)
    records = work_dir / "database_tuning_record.json"
    try:
        deadline = time.monotonic() + 300
        while child.poll() is None and time.monotonic() < deadline:
            if records.is_file() and len(records.read_text().splitlines()) >= 5:
                break
            time.sleep(0.2)
        assert child.poll() is None, "the tuning run ended before it could be killed"
    finally:
        _kill_session(child)
    before = records.read_text().splitlines()
    assert len(before) >= 5
    lines = [json.loads(line) for line in before]  # each finished trial is a whole line
    assert all(len(line[1][1]) >= 1 for line in lines)
    tvm_ext.tune(_net(repeated=0), TARGET, work_dir, max_trials=4, num_trials_per_iter=4)
    after = records.read_text().splitlines()
    assert after[: len(before)] == before and len(after) > len(before)


def test_corrupt_database_names_the_file_and_line(tmp_path):
    (tmp_path / "database_workload.json").write_text("")
    (tmp_path / "database_tuning_record.json").write_text('\n[0, [[], [1.0\n')
    with pytest.raises(ValueError, match=r"database_tuning_record.json:2: corrupt"):
        open_database(tmp_path)
    assert (tmp_path / "database_tuning_record.json").read_text() == '\n[0, [[], [1.0\n'  # left as it was
    with pytest.raises(FileNotFoundError, match="run tvm_ext.tune"):
        tvm_ext.build(_net(repeated=0), TARGET, database=tmp_path / "missing")


def test_tune_rejects_what_it_cannot_tune(tmp_path):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 6, 6), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.nn.relu(x)))
        bb.emit_func_output(out)
    with pytest.raises(tvm_ext.UnsupportedError, match="no tvm_ext convolution or pooling"):
        tvm_ext.tune(bb.get(), TARGET, tmp_path)
    with pytest.raises(tvm_ext.UnsupportedError, match="cuda"):
        tvm_ext.tune(_net(repeated=0), "cuda", tmp_path)


@pytest.mark.slow
@pytest.mark.long
def test_shipped_records_apply_only_to_their_target(tmp_path, monkeypatch):
    from tvm_ext.strategy.dispatch import lower_to_kernels
    from tvm_ext.strategy.fusion import fusion_passes
    from tvm_ext.tuning.records import TUNED_ATTR, shipped_database, shipped_records_dir, target_key

    mod = _net(repeated=0)
    tvm_ext.tune(mod, TARGET, tmp_path / target_key(TARGET), max_trials=8, num_trials_per_iter=8)
    monkeypatch.setenv("TVM_EXT_SCHEDULES", str(tmp_path))

    def tuned_kernels(target) -> int:
        with target:
            lowered = tvm.transform.Sequential(fusion_passes(target) + [
                lower_to_kernels(target, shipped_database(target))])(mod)
        funcs = [f for _, f in lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
        return sum(TUNED_ATTR in f.attrs for f in funcs)

    assert target_key(TARGET) == "llvm-znver3"
    assert tuned_kernels(TARGET) >= 1
    other = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})
    assert shipped_database(other) is None and tuned_kernels(other) == 0
    assert shipped_records_dir(TARGET) == tmp_path / "llvm-znver3" and shipped_records_dir(other) is None
    x = np.random.default_rng(3).standard_normal((1, 16, 14, 14)).astype("float32")
    ours = relax.VirtualMachine(tvm_ext.build(mod, TARGET), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    stock = relax.VirtualMachine(tvm.compile(mod, TARGET), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    assert rel_err(ours, stock) <= 1e-4


@pytest.mark.parametrize("model, batch, precision", [
    ("resnet50", 1, "fp32"), ("resnet50", 2, "fp32"), ("resnet50", 1, "bf16"),
    pytest.param("vgg16", 1, "fp32", marks=[pytest.mark.slow, pytest.mark.long])])
def test_shipped_records_cover_every_task_of_their_networks(model, batch, precision):
    """A change of the analytic plan changes a task's workload and orphans its shipped record
    (the build then silently falls back to the analytic schedule): every tunable kernel of the
    networks the records were tuned for (Zen 4; ResNet-50's two-image trunk is what batch 16 runs
    on 2 threads) must still find one. The fp32 ones were tuned before Winograd: they cover the
    direct build, and the Winograd GEMMs of the default build run their analytic schedule. The
    bf16 ones (0.5.31) cover the default bf16 build, its fp32 Winograd GEMMs included."""
    from tvm_ext import models
    from tvm_ext.tuning.records import shipped_database
    from tvm_ext.tuning.tuner import extract_tasks

    target = tvm.target.Target({"kind": "llvm", "mcpu": "znver4"})
    database = shipped_database(target)
    assert database is not None
    tasks = extract_tasks(models.get(model, batch=batch)[0], target, winograd=precision == "bf16",
                          images_per_call=2, precision=precision)
    missing = [t.name for t in tasks if not database.has_workload(tvm.IRModule({"main": t.workload}))]
    assert tasks and not missing, f"no shipped record for {missing}: re-run `python -m tvm_ext tune --ship`"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rpc_tracker(port: int):
    """A TVM RPC tracker on 127.0.0.1:`port` (exactly that port), in a session of its own:
    killing it takes the processes it forked with it."""
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1",
                             "--port", str(port), "--port-end", str(port + 1)], start_new_session=True)


def _rpc_server(tracker_port: int, key: str):
    import subprocess
    import sys

    port = _free_port()
    return subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_server", "--tracker", f"127.0.0.1:{tracker_port}",
                             "--key", key, "--host", "127.0.0.1", "--port", str(port), "--port-end", str(port + 1)],
                            start_new_session=True)


def _wait_for_servers(tracker, port: int, count: int, timeout: float = 60) -> None:
    """Until `count` servers are registered with the tracker on `port`."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        assert tracker.poll() is None, "the RPC tracker exited (is tornado installed?)"
        try:
            if len(tvm.rpc.connect_tracker("127.0.0.1", port).summary()["server_info"]) == count:
                return
        except (RuntimeError, ConnectionError, OSError):
            pass
        time.sleep(1)
    pytest.fail(f"{count} RPC servers did not register with the tracker")


@contextlib.contextmanager
def _rpc_cluster(servers: int = 2):
    """A tracker and `servers` servers on loopback, registered: (port, key, processes), the
    tracker first; every process still in the list is killed on the way out."""
    import time

    port, key = _free_port(), "tvm_ext_test"
    procs = [_rpc_tracker(port)]
    try:
        time.sleep(2)
        procs += [_rpc_server(port, key) for _ in range(servers)]
        _wait_for_servers(procs[0], port, servers)
        yield port, key, procs
    finally:
        for proc in procs:
            _kill_session(proc)


def _records(work_dir) -> list:
    return [json.loads(line) for line in (work_dir / "database_tuning_record.json").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.long
def test_rpc_tuning_on_loopback_survives_a_dead_server(tmp_path):
    """A tracker and two servers on loopback measure the candidates; one server is killed after
    the first batch, and tuning still finishes with its records."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback

    with _rpc_cluster() as (port, key, procs):

        @derived_object
        class KillOneServer(PyMeasureCallback):
            def apply(self, task_scheduler, task_id, candidates, builder_results, runner_results) -> None:
                if procs[1].poll() is None:
                    _kill_session(procs[1])

        work_dir = tmp_path / "records"
        tvm_ext.tune(_net(repeated=0), TARGET, work_dir, max_trials=8, num_trials_per_iter=4,
                     rpc=f"127.0.0.1:{port}:{key}", measure_callbacks=[KillOneServer()])
        assert procs[1].poll() is not None  # the server was killed during tuning
    records = _records(work_dir)
    assert len(records) >= 6
    assert sum(r[1][1][0] < 1 for r in records) >= 3  # measured by the surviving server too


@pytest.mark.slow
@pytest.mark.long
def test_rpc_tuning_survives_a_tracker_restart(tmp_path):
    """The tracker is killed after the first batch and restarted on its port: the servers
    register again (they retry the tracker), the run finishes, the first batch's records are
    all still there and later candidates are measured."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback

    work_dir = tmp_path / "records"
    before_restart: list = []
    with _rpc_cluster() as (port, key, procs):

        @derived_object
        class RestartTracker(PyMeasureCallback):
            def apply(self, task_scheduler, task_id, candidates, builder_results, runner_results) -> None:
                if before_restart:
                    return
                before_restart.extend(_records(work_dir))  # committed by the default callbacks
                _kill_session(procs[0])
                procs[0] = _rpc_tracker(port)
                _wait_for_servers(procs[0], port, 2)

        tvm_ext.tune(_net(repeated=0), TARGET, work_dir, max_trials=8, num_trials_per_iter=4,
                     rpc=f"127.0.0.1:{port}:{key}", measure_callbacks=[RestartTracker()])
    records = _records(work_dir)
    assert before_restart and records[:len(before_restart)] == before_restart  # nothing lost
    after = records[len(before_restart):]
    assert sum(r[1][1][0] < 1 for r in after) >= 3  # measured through the new tracker


def test_rpc_address_is_checked(tmp_path):
    with pytest.raises(ValueError, match="host:port:key"):
        tvm_ext.tune(_net(repeated=0), TARGET, tmp_path, max_trials=1, rpc="localhost:9190")


def test_progress_counts_the_trials_past_the_budget_apart():
    """MetaSchedule starts a batch while under max_trials and measures it whole: the progress
    line said "12/8 trials"; it says the budget is spent and counts the rest apart."""
    import io
    import types

    from tvm_ext.tuning.progress import TuningProgress

    task = types.SimpleNamespace(name="conv", flops=2_000_000)
    stream = io.StringIO()
    progress = TuningProgress._cls([task], 8, stream=stream)  # the Python class: apply() called directly
    ok = types.SimpleNamespace(run_secs=[1e-3, 1e-3, 1e-3], error_msg=None)
    for batch in (4, 3):
        progress.apply(None, 0, [], [], [ok] * batch)
    assert stream.getvalue().split("\r")[-1].startswith(f"[{'#' * 26}{'.' * 4}] 7/8 trials | task 0 (7 trials)")
    progress.apply(None, 0, [], [], [ok] * 5)  # begun at 7 of 8
    last = stream.getvalue().split("\r")[-1]
    assert "12/8" not in last and f"[{'#' * 30}] 8/8 trials +4 past the budget | task 0 (12 trials)" in last
    assert progress.summary().splitlines()[-1].startswith("12 trials: the budget of 8 and 4 more")
    assert "more" not in TuningProgress([task], 16, stream=io.StringIO()).summary()


def _nothing_starts(monkeypatch) -> None:
    """Fail the test if tune() starts a worker, extracts tasks or builds anything."""
    from tvm_ext.tuning import tuner

    def started(*args, **kwargs):
        raise AssertionError("tune() started work before checking its arguments")

    for name in ("_runner", "extract_tasks", "_measure_defaults"):
        monkeypatch.setattr(tuner, name, started)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_trials=-5), "max_trials must be an int of at least 1"),
    (dict(max_trials=0), "max_trials must be an int of at least 1"),
    (dict(trials_per_task=0), "trials_per_task must be"),
    (dict(num_trials_per_iter=0), "num_trials_per_iter must be"),
    (dict(max_trials=2.5), "max_trials must be an int"),
    (dict(images_per_call=-1), "images_per_call must be a positive int"),
    (dict(rpc="localhost:9190"), "host:port:key"),
])
def test_tune_checks_its_arguments_before_anything_starts(tmp_path, monkeypatch, kwargs, message):
    _nothing_starts(monkeypatch)
    with pytest.raises(ValueError, match=message):
        tvm_ext.tune(_net(repeated=0), TARGET, tmp_path, **kwargs)


def test_tune_into_a_read_only_work_dir_fails_before_anything_starts(tmp_path, monkeypatch):
    """The work_dir check (tuning.records) ran after the runner's worker started and the tasks
    were extracted (seconds for a large network); now it is the first thing tune() does."""
    import os
    import stat

    _nothing_starts(monkeypatch)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cannot be created"):
        tvm_ext.tune(_net(repeated=0), TARGET, tmp_path / "file" / "records")
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(stat.S_IRUSR | stat.S_IXUSR)
    if os.geteuid() == 0:  # root writes into a mode-0500 folder: fake a read-only mount instead
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if str(path) == str(read_only)
                            and mode & os.W_OK else real_access(path, mode, **kw))
    try:
        with pytest.raises(ValueError, match="is not writable"):
            tvm_ext.tune(_net(repeated=0), TARGET, read_only)
    finally:
        read_only.chmod(stat.S_IRWXU)


@pytest.mark.parametrize("images_per_call", [-1, 0, 2.5, "2", True])
def test_a_bad_images_per_call_fails_before_compiling(images_per_call, monkeypatch):
    """It failed inside tvm.compile with `max() arg is an empty sequence` (or not at all, for a
    batch of one)."""
    def compiled(*args, **kwargs):
        raise AssertionError("compiled before checking images_per_call")

    monkeypatch.setattr(tvm, "compile", compiled)
    mod = _net(repeated=0)
    for call in (lambda: tvm_ext.build(mod, TARGET, images_per_call=images_per_call),
                 lambda: tvm_ext.pipeline(TARGET, images_per_call=images_per_call),
                 lambda: tvm_ext.dispatch_report(mod, TARGET, images_per_call=images_per_call),
                 lambda: extract_tasks(mod, TARGET, images_per_call=images_per_call)):
        with pytest.raises(ValueError, match="images_per_call must be a positive int or None"):
            call()


_TUNE_WITH_A_SLOW_BUILD = """
import os, sys, time
sys.path[:0] = {tests!r}  # test_tuning's folder and tests/ (reference)
import tvm, tvm_ext
from tvm_ext.tuning import tuner
from test_tuning import _net

def slow_build(mod, target, params):  # defined in __main__: sent to the builder workers by value
    open({marker!r}, "a").write(f"{{os.getpid()}}\\n")
    time.sleep(120)

tuner._build = slow_build
tvm_ext.tune(_net(repeated=0), tvm.target.Target({{"kind": "llvm", "mcpu": "znver3"}}), {work_dir!r}, max_trials=4,
             num_trials_per_iter=4)
"""


def _descendants(pid: int) -> set[int]:
    """The processes `pid` started and theirs (Linux /proc)."""
    from pathlib import Path

    found, todo = set(), [pid]
    while todo:
        for children in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            try:
                new = {int(c) for c in children.read_text().split()}
            except OSError:  # the task ended meanwhile
                continue
            todo += list(new - found)
            found |= new
    return found


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie no one has reaped yet)."""
    from pathlib import Path

    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc: Linux")
def test_a_killed_tune_takes_its_workers_with_it(tmp_path):
    """SIGKILL of the tuning process while a builder worker is busy (a build that sleeps): its
    MetaSchedule workers (builder and runner) die with it instead of running on under init."""
    import os
    import signal
    import subprocess
    import time

    marker = tmp_path / "building"
    script = _TUNE_WITH_A_SLOW_BUILD.format(tests=_test_paths(), marker=str(marker),
                                            work_dir=str(tmp_path / "records"))
    child = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "TVM_NUM_THREADS": "1"},
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while child.poll() is None and not marker.is_file() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert child.poll() is None and marker.is_file(), "no build started"
        workers = _descendants(child.pid)
        building = {int(line) for line in marker.read_text().split()}
        assert building <= workers and len(workers) >= 2  # the busy builder, the runner
        os.kill(child.pid, signal.SIGKILL)  # the tuning process alone, as the OOM killer would
        child.wait()
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in workers if _alive(pid)], "workers outlived the tuning process"
    finally:
        _kill_session(child)


@pytest.mark.long
@pytest.mark.slow
def test_the_recorded_default_agrees_with_a_warm_measurement(tmp_path, monkeypatch):
    """Each task's analytic schedule is measured and recorded before the search (the best record
    is then never slower than no record). That number must be a warm one: 0.5.11 was reported to
    record it cold, 2-3x the warm time, so that the tuning curve showed gains that did not exist.
    A task of about 0.5 ms: its recorded default against a separate warm measurement of the same
    kernel (time_evaluator, 50 ms a repeat, best of 5, one TVM thread in a process of its own, as
    the runner measures): on a quiet Zen 5, 0.471 / 0.440 ms recorded against 0.441 / 0.463 ms."""
    import os
    import subprocess

    import tvm_ffi
    from tvm.s_tir import meta_schedule as ms

    monkeypatch.setenv("TVM_NUM_THREADS", "1")
    target = tvm.target.Target({"kind": "llvm", "mcpu": "znver3", "num-cores": 1})
    rng = np.random.default_rng(1)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 64, 56, 56), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            weight = relax.const((rng.standard_normal((64, 64, 3, 3)) * 0.1).astype("float32"))
            out = bb.emit_output(relax.op.nn.relu(relax.op.nn.conv2d(x, weight, padding=(1, 1))))
        bb.emit_func_output(out)
    mod = bb.get()
    (task,) = extract_tasks(mod, target)
    work_dir = tmp_path / "records"
    tvm_ext.tune(mod, target, work_dir, max_trials=2, num_trials_per_iter=2, tasks=[task])
    database = open_database(work_dir)
    workload = database.commit_workload(tvm.IRModule({"main": task.workload}))
    default = flat_decisions(default_trace(task.workload))
    (recorded,) = [r for r in database.get_all_tuning_records() if flat_decisions(r.trace) == default
                   and tvm_ffi.structural_equal(r.workload.mod, workload.mod)]
    recorded_s = min(float(s) for s in recorded.run_secs)

    sch = Schedule(tvm.IRModule({"main": task.workload}))
    default_trace(task.workload).apply_to_schedule(sch, remove_postproc=True)
    kernel = task.kind.finish(sch)
    library = str(tmp_path / "default.so")
    tvm.compile(tvm.IRModule({"main": kernel}), target).export_library(library)
    shapes = [[int(d) for d in info.as_json()[2]] for info in ms.arg_info.ArgInfo.from_prim_func(kernel)]
    # measured in a process of its own with one TVM thread, as the runner's workers measure
    script = (f"import numpy as np, tvm; lib = tvm.runtime.load_module({library!r}); "
              f"args = [tvm.runtime.tensor(np.random.default_rng(0).standard_normal(s).astype('float32')) "
              f"for s in {shapes!r}]; "
              f"t = lib.time_evaluator('main', tvm.cpu(), number=3, repeat=5, min_repeat_ms=50); "
              f"print(min(t(*args).results))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                          env={**os.environ, "TVM_NUM_THREADS": "1"})
    warm_s = float(done.stdout.split()[-1])
    # one-sided: a loaded machine slows the separate measurement too (2x seen with CI and two
    # other test runs on the 2 cores), which is not the defect; a quiet one agrees within 7%
    assert recorded_s < 1.33 * warm_s, (recorded_s, warm_s)


def test_workload_fields_come_back_from_json_as_tuples():
    """A kernel's attribute records its workload as JSON; fields_from_json rebuilds equal ones."""
    import dataclasses

    from tvm_ext.kernels.pool2d import Pool2dWorkload
    from tvm_ext.tuning.kinds import fields_from_json

    conv = Conv2dWorkload.make((1, 8, 9, 7), (16, 8, 3, 3), stride=(2, 1), padding=(1, 0, 1, 2))
    pool = Pool2dWorkload.make((1, 8, 9, 7), "max", (3, 3), (2, 2), (1, 1), (1, 1), False, True)
    for wl in (conv, pool):
        fields = json.loads(json.dumps(dataclasses.asdict(wl)))
        assert type(wl)(**fields_from_json(fields)) == wl
