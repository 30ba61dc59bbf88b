"""Tuning benchmark: tuned tvm_ext against untuned tvm_ext against stock MetaSchedule, same run.

For each layer of a set (bench/workloads.json), at the same trial budget:
- untuned: tvm_ext's blocked kernel with its analytic tile;
- tuned: the same kernel tuned over tvm_ext's design space (`tvm_ext.tune` machinery: XGBoost
  cost model, evolutionary search);
- stock MetaSchedule: `ms.tune_tir` with MetaSchedule's own design space on a plain NCHW conv2d
  (TE), the way a TVM user tunes a convolution without tvm_ext.
Prints ms, GFLOP/s, % of the measured peak, the tuned/untuned and tuned/stock ratios, and the
best latency reached after 1/8, 1/4, 1/2 of the trials (how fast the search converges).

Usage: python bench/tune.py --set resnet50 --layers 3 --trials 64 [--threads 1] [--only NAME,NAME]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", default="resnet50")
    ap.add_argument("--layers", type=int, default=3, help="the first K layers of the set")
    ap.add_argument("--only", default="", help="comma-separated layer names (instead of --layers)")
    ap.add_argument("--trials", type=int, default=64, help="trial budget per layer, for both searches")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--target", default="llvm")
    ap.add_argument("--no-stock", action="store_true", help="skip stock MetaSchedule")
    return ap.parse_args(argv)


ARGS = _parse_args()
os.environ["TVM_NUM_THREADS"] = str(ARGS.threads)

import numpy as np  # noqa: E402
import tvm  # noqa: E402
from tvm import te, tirx  # noqa: E402
from tvm.s_tir import meta_schedule as ms  # noqa: E402

import tvm_ext  # noqa: E402
from tvm_ext.kernels import conv2d as K  # noqa: E402
from tvm_ext.tuning import records, tuner  # noqa: E402
from tvm_ext.tuning.progress import TuningProgress  # noqa: E402
from tvm_ext.tuning.space import conv2d_workload, default_kernel  # noqa: E402

sys.path.insert(0, str(HERE))
import e2e as e2e_bench  # noqa: E402
import peak as peak_bench  # noqa: E402


def load_layers(name: str) -> list[dict]:
    import json

    return json.loads((HERE / "workloads.json").read_text())[name]


def _time_ms(func: tvm.tirx.PrimFunc, shapes: list[tuple], target) -> float:
    """Median of 15 calls after a warm-up (e2e's timing loop)."""
    fn = tvm.compile(func, target).mod["main"]
    rng = np.random.default_rng(0)
    args = [tvm.runtime.tensor(rng.standard_normal(s).astype("float32")) for s in shapes]
    return statistics.median(e2e_bench.time_calls(lambda: fn(*args), 15))


def stock_conv2d(wl: K.Conv2dWorkload) -> tvm.tirx.PrimFunc:
    """A plain NCHW convolution with zero padding, as TE writes it (MetaSchedule's usual input)."""
    x = te.placeholder((wl.N, wl.C, wl.H, wl.W), "float32", name="x")
    w = te.placeholder((wl.K, wl.C, wl.KH, wl.KW), "float32", name="w")
    top, left, bottom, right = wl.padding
    pad = te.compute((wl.N, wl.C, wl.HP, wl.WP), lambda n, c, h, v: tirx.if_then_else(
        tirx.all(h >= top, h < wl.H + top, v >= left, v < wl.W + left), x[n, c, h - top, v - left], 0.0), name="pad")
    rc, rh, rw = te.reduce_axis((0, wl.C), "rc"), te.reduce_axis((0, wl.KH), "rh"), te.reduce_axis((0, wl.KW), "rw")
    sh, sw = wl.stride
    y = te.compute((wl.N, wl.K, wl.OH, wl.OW), lambda n, k, i, j: te.sum(
        pad[n, rc, i * sh + rh, j * sw + rw] * w[k, rc, rh, rw], axis=[rc, rh, rw]), name="conv")
    return te.create_prim_func([x, w, y])


def main() -> int:
    target = tvm_ext.resolve_target(ARGS.target)
    isa = tvm_ext.vector_isa(target)
    peaks = peak_bench.load_or_measure()
    peak = peaks["peak_gflops_1thread"] if ARGS.threads == 1 else peaks["peak_gflops_all"]
    layers = load_layers(ARGS.set)
    if ARGS.only:
        wanted = ARGS.only.split(",")
        unknown = sorted(set(wanted) - {layer["name"] for layer in layers})
        if unknown:
            sys.exit(f"bench/tune.py: no layer {', '.join(unknown)} in set {ARGS.set}")
        layers = [layer for layer in layers if layer["name"] in wanted]
    else:
        layers = layers[: ARGS.layers]
    print(f"# tuning benchmark: {ARGS.set}, {ARGS.trials} trials per layer and search, {ARGS.threads} threads, "
          f"target {target}, peak {peak:.1f} GFLOP/s")
    header = ("layer", "untuned ms", "tuned ms", "stock MS ms", "tuned %peak", "tuned/untuned", "tuned/stock",
              "best@1/8", "best@1/4", "best@1/2", "tune s", "stock s")
    print(" | ".join(header))
    for layer in layers:
        wl = K.Conv2dWorkload.make((1, layer["C"], layer["H"], layer["W"]), (layer["K"], layer["C"], layer["R"],
                                                                             layer["S"]), layer["stride"], layer["pad"])
        plan = K.plan_conv2d(wl, isa)
        epilogue = K.Epilogue()
        shapes = [plan.data_shape(), plan.weight_shape(), plan.out_shape()]
        untuned = _time_ms(default_kernel(plan, epilogue, isa), shapes, target)
        task = tuner.Task(layer["name"], conv2d_workload(plan, epilogue, isa), 1)
        work = Path(tempfile.mkdtemp(prefix="tvm_ext_tune_bench_"))
        progress = TuningProgress([task], ARGS.trials, stream=open(os.devnull, "w"))  # noqa: SIM115
        start = time.perf_counter()
        database = tvm_ext.tune(None, target, work / "tvm_ext", ARGS.trials, tasks=[task], num_trials_per_iter=16,
                                measure_callbacks=[progress])
        tune_s = time.perf_counter() - start
        tuned_func = records.tuned_kernel(database, task.workload, target)
        tuned = _time_ms(tuned_func, shapes, target) if tuned_func is not None else float("nan")
        curve = progress.curves[0]

        def best_at(fraction: float, curve=curve) -> str:
            points = [s for t, s in curve if t <= ARGS.trials * fraction]
            return f"{min(points) * 1e3:.3f}" if points else "-"

        stock, stock_s = float("nan"), 0.0
        if not ARGS.no_stock:
            start = time.perf_counter()
            # MetaSchedule's own rules need the core count in the target.
            stock_target = tvm.target.Target({**dict(target.export()), "num-cores": os.cpu_count() or 1})
            stock_db = ms.tune_tir(stock_conv2d(wl), stock_target, str(work / "stock"), max_trials_global=ARGS.trials,
                                   num_trials_per_iter=16,
                                   builder=ms.builder.LocalBuilder(f_build=tuner._build, timeout_sec=60),
                                   runner=tuner._runner(None))
            stock_s = time.perf_counter() - start
            sch = ms.tir_integration.compile_tir(stock_db, stock_conv2d(wl), stock_target)
            if sch is not None:
                stock = _time_ms(sch.mod["main"], [(wl.N, wl.C, wl.H, wl.W), (wl.K, wl.C, wl.KH, wl.KW),
                                                   wl.out_shape], target)
        gflops = wl.flops / tuned / 1e6
        row = (layer["name"], f"{untuned:.3f}", f"{tuned:.3f}", f"{stock:.3f}", f"{100 * gflops / peak:.0f}",
               f"{untuned / tuned:.2f}", f"{stock / tuned:.2f}", best_at(1 / 8), best_at(1 / 4), best_at(1 / 2),
               f"{tune_s:.0f}", f"{stock_s:.0f}")
        print(" | ".join(row), flush=True)
        shutil.rmtree(work, ignore_errors=True)  # the layer's records: measured, printed, done
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
