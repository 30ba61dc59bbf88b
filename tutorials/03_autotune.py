"""Tutorial 3: tune a network's convolutions with MetaSchedule, then build with the records.

1. see the tuning tasks tvm_ext extracts (each distinct convolution kernel, weighted by how often
   the network calls it);
2. look at one task's design space: the sampled decisions (the blocking of images, output
   channels and rows, then m_r, n_r and unroll per row segment) and the microkernel each
   candidate is tensorized with;
3. tune with `tvm_ext.tune` (evolutionary search, XGBoost cost model) into a JSON database;
4. build with `tvm_ext.build(..., database=work_dir)`, check the numbers, compare the latency.

Run: python tutorials/03_autotune.py [--trials 32] [--work-dir DIR]   (CI runs a few trials)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import tvm
from tvm import relax
from tvm.s_tir import Schedule

import tvm_ext
from tvm_ext.tuning import extract_tasks
from tvm_ext.tuning.progress import TuningProgress
from tvm_ext.tuning.space import conv2d_space, flat_decisions, tensorize_segments


def network() -> tvm.IRModule:
    """Four 3x3 conv + bias + relu layers on a 28x28 image. They run as Winograd F(4x4, 3x3), so
    the tasks are their GEMMs (1x1 convolutions with 36 groups on the 7x7 grid of tiles; the
    transforms have no design space): the last three layers share one, called 3x."""
    rng = np.random.default_rng(0)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 32, 28, 28), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = x
            for cin in (32, 64, 64, 64):
                w = relax.const((rng.standard_normal((64, cin, 3, 3)) * np.sqrt(2 / cin / 9)).astype("float32"))
                b = relax.const(rng.uniform(-0.1, 0.1, (1, 64, 1, 1)).astype("float32"))
                y = bb.emit(relax.op.nn.relu(relax.op.add(relax.op.nn.conv2d(y, w, padding=(1, 1)), b)))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def median_ms(run, x, repeat: int = 30) -> float:
    run(x)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=32)
    ap.add_argument("--work-dir", default="")
    args = ap.parse_args()
    target = tvm_ext.resolve_target("llvm")
    mod = network()

    # 1. The tasks.
    tasks = extract_tasks(mod, target)
    for task in tasks:
        print(f"task {task.name}: called {task.weight}x")

    # 2. Three candidates of the first task's design space.
    for seed in (1, 2, 3):
        sch = Schedule(tasks[0].workload, seed=seed)
        conv2d_space(sch)
        decisions = flat_decisions(sch.trace)
        fits = tensorize_segments(sch)
        intrinsics = [str(inst.attrs[0]) for inst in sch.trace.insts if inst.kind.name == "Tensorize"]
        print(f"candidate {seed}: decisions {decisions} -> {intrinsics if fits else 'rejected (spills)'}")

    # 3. Tune.
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="tvm_ext_tune_")
    progress = TuningProgress(tasks, args.trials)
    tvm_ext.tune(mod, target, work_dir, max_trials=args.trials, num_trials_per_iter=8, tasks=tasks,
                 measure_callbacks=[progress])
    print(f"\n{progress.summary()}\nrecords: {work_dir}")

    # 4. Build with the records, check, compare.
    x = tvm.runtime.tensor(np.random.default_rng(1).standard_normal((1, 32, 28, 28)).astype("float32"))
    tuned = relax.VirtualMachine(tvm_ext.build(mod, target, database=work_dir), tvm.cpu())["main"]
    untuned = relax.VirtualMachine(tvm_ext.build(mod, target), tvm.cpu())["main"]
    reference = relax.VirtualMachine(tvm.compile(mod, target), tvm.cpu())["main"](x).numpy()
    err = float(np.abs(tuned(x).numpy() - reference).max() / np.abs(reference).max())
    print(f"tuned build: relative error against stock TVM {err:.1e}")
    print(f"latency: tuned {median_ms(tuned, x):.3f} ms, untuned (analytic tiles) {median_ms(untuned, x):.3f} ms")


if __name__ == "__main__":
    main()
