"""`python -m tvm_ext demo|report|bench`: compile a network through tvm_ext and show what ran.

demo   build the model with tvm_ext and with stock TVM, check the outputs agree, print the
       dispatch summary and the latency against stock TVM and PyTorch eager (same weights).
report print the dispatch report (one row per op).
bench  the per-layer convolution benchmark (bench/layers.py) for the model's layers.
tune   tune the model's convolutions (MetaSchedule, XGBoost cost model) into --work-dir; then
       build with tvm_ext.build(mod, target, database=WORK_DIR).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tvm_ext", description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=("demo", "report", "bench", "tune"))
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--onnx", default="", help="tune: an ONNX file instead of --model")
    ap.add_argument("--trials", type=int, default=64, help="tune: trials over all tasks")
    ap.add_argument("--trials-per-task", type=int, default=0, help="tune: cap per task (0: --trials)")
    ap.add_argument("--work-dir", default="tuning", help="tune: where the records go")
    ap.add_argument("--rpc", default="", help="tune: host:port:key of a TVM RPC tracker whose servers measure")
    ap.add_argument("--ship", action="store_true",
                    help="tune: write into schedules/<target key>/ (the records builds use by default)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--target", default="llvm")
    ap.add_argument("--threads", type=int, default=0, help="TVM and PyTorch threads (0: every core we may use)")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--no-stock", action="store_true", help="skip stock TVM (it takes seconds per run)")
    ap.add_argument("--direct", action="store_true",
                    help="demo, report: every convolution direct (no Winograd for 3x3 and 5x5 layers)")
    ap.add_argument("--tensor-cores", choices=("tf32", "bf16", "wgmma_tf32", "wgmma_bf16"), default=None,
                    help="report, CUDA targets: convolutions on the tensor-core tile (tvm_ext.build's tensor_cores)")
    return ap.parse_args(argv)


def _median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def demo(args: argparse.Namespace) -> int:
    import numpy as np
    import tvm
    from tvm import relax

    import tvm_ext
    from tvm_ext import models

    target = tvm_ext.resolve_target(args.target)
    print(f"tvm_ext demo: {args.model} batch {args.batch} on {target} ({tvm_ext.vector_isa(target).name}), "
          f"{args.threads} threads")
    mod, _ = models.get(args.model, batch=args.batch)
    report = tvm_ext.dispatch_report(mod, target, winograd=not args.direct)
    counts = collections.Counter(r.kernel for r in report)
    print("dispatch: " + ", ".join(f"{n} x {k}" for k, n in counts.most_common()))
    start = time.perf_counter()
    ex = tvm_ext.build(mod, target, winograd=not args.direct)
    from tvm_ext.tuning.records import shipped_records_dir, target_key

    shipped = shipped_records_dir(target)
    print(f"built with tvm_ext in {time.perf_counter() - start:.1f} s; tuning records for {target_key(target)}: "
          + (f"shipped ({shipped})" if shipped else "none (analytic schedules)"))
    x = np.random.default_rng(0).standard_normal(models.image_shape(mod)).astype("float32")
    xt = tvm.runtime.tensor(x)
    run = relax.VirtualMachine(ex, tvm.cpu())["main"]
    ours = run(xt).numpy()
    ms = _median_ms(lambda: run(xt), args.repeat)
    rows = [("tvm_ext", ms)]
    status = 0
    if not args.no_stock:
        stock = relax.VirtualMachine(tvm.compile(mod, target), tvm.cpu())["main"]
        ref = stock(xt).numpy()
        err = float(np.abs(ours - ref).max() / np.abs(ref).max())
        print(f"output vs stock TVM: relative error {err:.1e} ({'ok' if err <= 1e-4 else 'MISMATCH'})")
        status = 0 if err <= 1e-4 else 1
        rows.append(("stock TVM (tvm.compile)", _median_ms(lambda: stock(xt), 1)))
    try:
        import torch
    except ImportError:
        print("PyTorch is not installed: no PyTorch baseline")
    else:
        from .models.torch_reference import to_torch

        torch.set_num_threads(args.threads)
        forward = to_torch(mod)
        with torch.inference_mode():
            xt_torch = torch.from_numpy(x)
            err = float(np.abs(ours - forward(xt_torch).numpy()).max() / np.abs(ours).max())
            print(f"output vs PyTorch eager: relative error {err:.1e}")
            rows.append(("PyTorch eager (NCHW)", _median_ms(lambda: forward(xt_torch), args.repeat)))
    print(f"{'runtime':28s} {'ms':>9s} {'images/s':>9s} {'tvm_ext speed-up':>17s}")
    for name, t in rows:
        print(f"{name:28s} {t:9.2f} {1e3 * args.batch / t:9.1f} {t / ms:16.1f}x")
    return status


def tune(args: argparse.Namespace) -> int:
    import tvm_ext
    from tvm_ext import models
    from tvm_ext.tuning import extract_tasks
    from tvm_ext.tuning.progress import TuningProgress

    if args.onnx:
        import onnx
        from tvm.relax.frontend.onnx import from_onnx

        mod = from_onnx(onnx.load(args.onnx), keep_params_in_input=False)
        name = Path(args.onnx).stem
    else:
        mod, _ = models.get(args.model, batch=args.batch)
        name = args.model
    target = tvm_ext.resolve_target(args.target)
    if args.ship:
        from tvm_ext.tuning.records import schedules_root, target_key

        args.work_dir = str(schedules_root() / target_key(target))
    tasks = extract_tasks(mod, target)
    print(f"tvm_ext tune: {name} on {target}: {len(tasks)} tasks ({sum(t.weight for t in tasks)} kernel calls), "
          f"{args.trials} trials, records in {args.work_dir}")
    progress = TuningProgress(tasks, args.trials)
    start = time.perf_counter()
    tvm_ext.tune(mod, target, args.work_dir, args.trials, args.trials_per_task or None, tasks=tasks,
                 measure_callbacks=[progress], rpc=args.rpc or None)
    print(f"\ntuned in {time.perf_counter() - start:.0f} s\n{progress.summary()}")
    if args.ship:
        from tvm_ext.tuning.records import compact_database

        print(f"shipped: the best record of each workload, {compact_database(args.work_dir)} records")
    plot = progress.plot(Path(args.work_dir) / "tuning_curve.png")
    print(f"tuning curve: {plot}" if plot else "tuning curve: matplotlib is not installed, no PNG")
    return 0


def _is_cuda(target: str) -> bool:
    from .target import resolve_target

    return resolve_target(target).kind.name == "cuda"


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from .target import usable_cores

    # Set explicitly: TVM's own default pool ran ResNet-18 at half speed on this 2-core machine.
    args.threads = args.threads or usable_cores()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    if args.command in ("demo", "tune", "bench") and _is_cuda(args.target):
        print(f"tvm_ext {args.command}: runs on the CPU (LLVM targets); for {args.target!r} use "
              "`report`, tvm_ext.build(mod, target) in Python, or bench/gpu_check.sh on a GPU machine",
              file=sys.stderr)
        return 2
    if args.command == "demo":
        return demo(args)
    if args.command == "tune":
        return tune(args)
    if args.tensor_cores and (args.command != "report" or not _is_cuda(args.target)):
        print(f"tvm_ext {args.command}: --tensor-cores applies to `report` for CUDA targets", file=sys.stderr)
        return 2
    if args.command == "report":
        import tvm_ext
        from tvm_ext import models

        try:
            report = tvm_ext.dispatch_report(models.get(args.model, batch=args.batch)[0], args.target,
                                             tensor_cores=args.tensor_cores or False, winograd=not args.direct)
        except tvm_ext.UnsupportedError as err:  # e.g. wgmma for a target that is not sm_90a
            print(f"tvm_ext report: {err}", file=sys.stderr)
            return 2
        print(report)
        return 0
    bench = Path(__file__).resolve().parents[2] / "bench" / "layers.py"
    layer_set = "resnet50" if args.model.startswith("resnet") else args.model
    cmd = [sys.executable, str(bench), "--set", layer_set, "--batch", str(args.batch), "--threads",
           str(args.threads), "--target", args.target, "--repeat", str(args.repeat)]
    return subprocess.call(cmd)
