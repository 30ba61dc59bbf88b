"""Whole-network benchmark: tvm_ext against ONNX Runtime, PyTorch eager and stock TVM, same run.

For each network (tvm_ext.models, seeded weights shared by every runtime), batch and thread count:
- tvm_ext: `tvm_ext.build` for the host CPU (with the tuning records shipped for it, if any);
- tvm_ext_untuned: the same with no tuning records (the analytic schedules; not run by default);
- tvm_ext_direct: the same with `winograd=False`, every convolution direct (not run by default);
- tvm_ext_bf16: the same with `precision="bf16"` (convolutions in bfloat16 on AMX), and
  pytorch_bf16: PyTorch eager under bf16 autocast (oneDNN): `--precision bf16` adds both;
- tvm_ext_int8 and onnxruntime_int8: `--precision int8` adds both: the ONNX export quantized by
  ONNX Runtime's quantize_static (QDQ, uint8 activations, per-channel int8 weights, random
  calibration images), built by `tvm_ext.build` from its Relax import, and run by ONNX Runtime;
- ONNX Runtime (CPU): the same network exported with torch.onnx, all graph optimizations,
  intra-op threads set;
- PyTorch eager: the same graph evaluated op by op in inference mode, best of NCHW and
  channels_last;
- stock TVM: `tvm.compile` with the default pipeline (naive loops, about 1.5 GFLOP/s: only at the
  batches of --stock-batches).
Each runtime runs in a process of its own (its peak RSS is its own; thread pools start with the
right size) on artifacts built once per network and batch. The runtimes take turns: --rounds
rounds of --repeat timed runs each, round-robin, so that a slow minute of a shared host falls on
every runtime alike rather than on whichever ran then (one runtime after another, ratios taken an
hour apart moved by 5-15% on a shared host). Printed: median latency (over every round),
images/s, GFLOP/s, % of the measured peak (bench/peak.py) for the threads used, peak RSS, and
tvm_ext's speed-up over each runtime: the median of the ratios of the two runtimes' medians in the
same round, with their range; outputs are checked against ONNX Runtime's. A CSV goes to
bench/results/.

Usage: python bench/e2e.py [--models resnet50,vgg16,...] [--batches 1,16] [--threads 1,2] [--repeat 10] [--rounds 3]
       [--precision bf16|int8]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNTIMES = ("tvm_ext", "onnxruntime", "pytorch", "stock_tvm")  # and tvm_ext_untuned / _direct on request


def _parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="resnet50,vgg16,alexnet,overfeat,mobilenet_v2")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeat", type=int, default=10, help="timed runs per round (median)")
    ap.add_argument("--rounds", type=int, default=3, help="turns each runtime takes, round-robin")
    ap.add_argument("--runtimes", default=",".join(RUNTIMES))
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "int8"],
                    help="bf16: also tvm_ext_bf16 and pytorch_bf16 (outputs then differ by bf16 rounding); int8: "
                         "also tvm_ext_int8 and onnxruntime_int8 on the QDQ model")
    ap.add_argument("--stock-batches", default="1", help="batches at which stock TVM runs (it is slow)")
    ap.add_argument("--target", default="llvm")
    ap.add_argument("--csv", default="")
    ap.add_argument("--work-dir", default="", help="where built artifacts go (default: a temporary folder)")
    ap.add_argument("--child", nargs=6, metavar=("RUNTIME", "MODEL", "BATCH", "THREADS", "ARTIFACT", "OUT"),
                    help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def network_flops(mod) -> int:
    """Multiply-adds x 2 of every convolution and matmul of `mod["main"]`."""
    from tvm import relax

    total = 0

    def visit(expr) -> None:
        nonlocal total
        if not (isinstance(expr, relax.Call) and hasattr(expr.op, "name")):
            return
        if expr.op.name == "relax.nn.conv2d":
            n, k, oh, ow = (int(v) for v in expr.ty.shape)
            _, cg, kh, kw = (int(v) for v in expr.args[1].ty.shape)
            total += 2 * n * k * cg * kh * kw * oh * ow
        elif expr.op.name == "relax.matmul":
            m, kk = (int(v) for v in expr.args[0].ty.shape)
            total += 2 * m * kk * int(expr.args[1].ty.shape[1])

    relax.analysis.post_order_visit(mod["main"], visit)
    return total


# ------------------------------------------------------------------------------------------
# Children: one runtime, one configuration; print {"ms": [...], "rss_mib": ...} as JSON.


def time_calls(fn, repeat: int, warmup_s: float = 0.25) -> list[float]:
    """Milliseconds of each of `repeat` calls of `fn`, after warm-up calls for `warmup_s` seconds
    (at least one: first-run allocation, lazy initialization). A fresh process's first calls are
    slower for ~20 ms of work: with TVM's threads pinned to cores (its default), ShuffleNet's
    first 8 calls on 2 threads ran 2.5 ms, then 2.0, on the 2-core Xeon."""
    start = time.perf_counter()
    fn()
    while time.perf_counter() - start < warmup_s:
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _peak_rss_mib() -> float:
    """This process's peak resident memory. (Not getrusage's ru_maxrss: Linux carries that over
    from the parent across fork and exec, so every child would report the parent's.)"""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _child(args: argparse.Namespace) -> None:
    runtime, model, batch, threads, artifact, out = args.child
    batch, threads = int(batch), int(threads)
    import numpy as np

    x = None
    result: dict = {}
    if runtime in ("tvm_ext", "tvm_ext_untuned", "tvm_ext_direct", "tvm_ext_bf16", "tvm_ext_int8", "stock_tvm"):
        import tvm
        from tvm import relax

        vm = relax.VirtualMachine(tvm.runtime.load_module(artifact), tvm.cpu())["main"]
        x = np.load(Path(artifact).with_name("input.npy"))
        xt = tvm.runtime.tensor(x)
        repeat = 1 if runtime == "stock_tvm" else args.repeat
        result["ms"] = time_calls(lambda: vm(xt), repeat)
        output = vm(xt)
        output = (output if hasattr(output, "numpy") else output[0]).numpy()  # imported models return tuples
    elif runtime in ("onnxruntime", "onnxruntime_int8"):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        session = ort.InferenceSession(artifact, options, providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        x = np.load(Path(artifact).with_name("input.npy"))
        result["ms"] = time_calls(lambda: session.run(None, {name: x}), args.repeat)
        output = session.run(None, {name: x})[0]
    else:  # pytorch (pytorch_bf16: under bf16 autocast): best of NCHW and channels_last
        import contextlib

        import torch

        from tvm_ext import models
        from tvm_ext.models.torch_reference import to_torch

        torch.set_num_threads(threads)
        if artifact.endswith(".pt"):  # a whole torch module (bench/zoo.py: torchvision's own model)
            from tvm_ext.models.torchvision_zoo import import_torchvision

            import_torchvision()
            forward = torch.load(artifact, weights_only=False)
        else:
            mod, _ = models.get(model, batch=batch)
            forward = to_torch(mod)
        x = np.load(Path(artifact).with_name("input.npy"))
        best = None
        bf16 = torch.autocast("cpu", dtype=torch.bfloat16) if runtime == "pytorch_bf16" else contextlib.nullcontext()
        with torch.inference_mode(), bf16:
            channels_last = torch.channels_last if x.ndim == 4 else torch.channels_last_3d  # (a video's clips)
            for fmt in (torch.contiguous_format, channels_last):
                xt = torch.from_numpy(x).contiguous(memory_format=fmt)
                times = time_calls(lambda xt=xt: forward(xt), args.repeat)
                if best is None or statistics.median(times) < statistics.median(best[0]):
                    best = (times, "channels_last" if fmt is channels_last else "NCHW")
            result["ms"], result["note"] = best
            output = forward(torch.from_numpy(x)).float().numpy()
    np.save(out, output)
    result["rss_mib"] = _peak_rss_mib()
    print(json.dumps(result))


# ------------------------------------------------------------------------------------------
# Parent: build artifacts once per network and batch, run the children, print the table.


def _prepare(model: str, batch: int, runtimes: list[str], stock: bool, target, folder: Path,
             threads: list[int]) -> tuple[dict, int]:
    import numpy as np
    import tvm
    from tvm.s_tir import meta_schedule as ms

    import tvm_ext
    from tvm_ext import models

    mod, _ = models.get(model, batch=batch)
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "input.npy", np.random.default_rng(0).standard_normal(models.image_shape(mod)).astype("float32"))
    artifacts = {"pytorch": str(folder / "pytorch"), "pytorch_bf16": str(folder / "pytorch")}
    for runtime in ("tvm_ext", "tvm_ext_untuned", "tvm_ext_direct", "tvm_ext_bf16"):
        if runtime not in runtimes:
            continue
        # No records at all, not even the shipped ones: the analytic schedules.
        database = ms.database.MemoryDatabase() if runtime == "tvm_ext_untuned" else None
        # At batch > 1 the trunk runs one image per runtime thread: one build per thread count.
        for t in threads if batch > 1 else [0]:
            start = time.perf_counter()
            path = folder / f"{runtime}_t{t}.so"
            tvm_ext.build(mod, target, database=database, images_per_call=t or None,
                          winograd=runtime != "tvm_ext_direct",
                          precision="bf16" if runtime == "tvm_ext_bf16" else "fp32").export_library(str(path))
            print(f"  built {model} batch {batch} with {runtime} in {time.perf_counter() - start:.0f} s", flush=True)
            artifacts[f"{runtime}_t{t}"] = str(path)
    if "stock_tvm" in runtimes and stock:
        tvm.compile(mod, target).export_library(str(folder / "stock_tvm.so"))
        artifacts["stock_tvm"] = str(folder / "stock_tvm.so")
    int8 = [r for r in ("tvm_ext_int8", "onnxruntime_int8") if r in runtimes]
    if "onnxruntime" in runtimes or int8:
        import torch

        from tvm_ext.models.torch_reference import TorchModule

        x = torch.from_numpy(np.load(folder / "input.npy"))
        torch.onnx.export(TorchModule(mod), (x,), str(folder / "model.onnx"), dynamo=False, input_names=["data"])
        artifacts["onnxruntime"] = str(folder / "model.onnx")
    if int8:
        import onnx
        from tvm.relax.frontend.onnx import from_onnx

        from tvm_ext.models.quantized import quantize_onnx_file

        quantized = quantize_onnx_file(folder / "model.onnx", folder / "model_int8.onnx")
        artifacts["onnxruntime_int8"] = str(quantized)
        if "tvm_ext_int8" in runtimes:
            start = time.perf_counter()
            tvm_ext.build(from_onnx(onnx.load(quantized), keep_params_in_input=False), target).export_library(
                str(folder / "tvm_ext_int8.so"))
            print(f"  built {model} batch {batch} with tvm_ext_int8 in {time.perf_counter() - start:.0f} s", flush=True)
            artifacts["tvm_ext_int8"] = str(folder / "tvm_ext_int8.so")
    return artifacts, network_flops(mod)


def main(argv=None) -> int:
    args = _parse_args(argv)
    if args.child:
        _child(args)
        return 0
    sys.path.insert(0, str(HERE))
    import numpy as np
    import peak as peak_bench

    import tvm_ext

    target = tvm_ext.resolve_target(args.target)
    peaks = peak_bench.load_or_measure()
    runtimes = [r for r in args.runtimes.split(",") if r]
    if args.precision == "bf16":
        runtimes += [r for r in ("tvm_ext_bf16", "pytorch_bf16") if r not in runtimes]
    if args.precision == "int8":
        runtimes += [r for r in ("tvm_ext_int8", "onnxruntime_int8") if r not in runtimes]
    # Built networks, exported models and outputs take 2-7 GB a model: a temporary folder is
    # removed as each model is done (it filled the disk over a few runs when it was kept).
    keep = bool(args.work_dir)
    work = Path(args.work_dir) if keep else Path(tempfile.mkdtemp(prefix="tvm_ext_e2e_"))
    rows = []
    print(f"target {target}; peak {peaks['peak_gflops_1thread']} GFLOP/s (1 thread), "
          f"{peaks['peak_gflops_all']} ({peaks['threads']} threads)")
    print(" ".join(f"{name:>{width}}" for name, width in _COLUMNS))
    try:
        for model in args.models.split(","):
            for batch in _ints(args.batches):
                folder = work / f"{model}_b{batch}"
                artifacts, flops = _prepare(model, batch, runtimes, batch in _ints(args.stock_batches), target, folder,
                                            _ints(args.threads))
                for threads in _ints(args.threads):
                    peak = (peaks["peak_gflops_1thread"] if threads == 1
                            else peaks["peak_gflops_all"] * threads / peaks["threads"])
                    variant = f"_t{threads if batch > 1 else 0}"
                    todo = {runtime: artifacts.get(runtime) or artifacts.get(runtime + variant) for runtime in runtimes}
                    results = _run_rounds({r: a for r, a in todo.items() if a}, args, model, batch, threads, folder)
                    ref = results.get("onnxruntime", {}).get("out")
                    ours = results.get("tvm_ext")
                    for runtime, r in results.items():
                        err = "" if ref is None else f"{float(np.abs(r['out'] - ref).max() / np.abs(ref).max()):.1e}"
                        median = statistics.median(ms for round_ms in r["rounds"] for ms in round_ms)
                        gflops = flops / median / 1e6
                        speedup, spread = ("", "") if ours is None else _paired_speedup(r["rounds"], ours["rounds"])
                        rows.append({
                            "model": model, "batch": batch, "threads": threads, "runtime": runtime,
                            "ms": round(median, 2), "images_s": round(batch * 1e3 / median, 1),
                            "gflops": round(gflops, 1), "pct_peak": round(100 * gflops / peak),
                            "rss_mib": round(r["rss_mib"]), "tvm_ext_speedup": speedup, "speedup_range": spread,
                            "err_vs_ort": err, "note": r.get("note", ""),
                        })
                    _print(rows[len(rows) - len(results):])
                if not keep:
                    shutil.rmtree(folder, ignore_errors=True)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    path = Path(args.csv) if args.csv else HERE / "results" / f"e2e_{'_'.join(args.models.split(','))[:60]}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["model"])
        writer.writeheader()
        writer.writerows(rows)
    print(f"CSV: {path}")
    return 0


def _run_rounds(artifacts: dict[str, str], args: argparse.Namespace, model: str, batch: int, threads: int,
                folder: Path) -> dict[str, dict]:
    """Each runtime's child `args.rounds` times, round-robin. Per runtime: the timings of each
    round ("rounds", one list per round), its peak RSS over the rounds and the last round's
    output ("out"). A runtime that fails is left out; stock TVM runs one round."""
    import numpy as np

    results: dict[str, dict] = {}
    finished: set[str] = set()  # failed, or stock TVM after its round
    env = dict(os.environ, TVM_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    for _ in range(args.rounds):
        for runtime, artifact in artifacts.items():
            if runtime in finished:
                continue
            out = folder / f"out_{runtime}.npy"
            cmd = [sys.executable, __file__, "--repeat", str(args.repeat), "--child", runtime, model,
                   str(batch), str(threads), artifact, str(out)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode:
                print(f"  {runtime} failed:\n{proc.stderr[-2000:]}", flush=True)
                finished.add(runtime)
                results.pop(runtime, None)
                continue
            child = json.loads(proc.stdout.strip().splitlines()[-1])
            result = results.setdefault(runtime, {"rounds": [], "rss_mib": 0.0})
            result["rounds"].append(child["ms"])
            result["rss_mib"] = max(result["rss_mib"], child["rss_mib"])
            result["note"] = child.get("note", "")
            result["out"] = np.load(out)
            if runtime == "stock_tvm":  # 30-90x slower: its ratio needs no pairing to be read
                finished.add(runtime)
    return results


def _paired_speedup(theirs: list[list[float]], ours: list[list[float]]) -> tuple[float, str]:
    """tvm_ext's speed-up over a runtime: the median, over rounds, of the ratio of the two
    runtimes' medians in the same round; and the range of those ratios ("lo-hi")."""
    # A runtime that ran fewer rounds (stock TVM: one) pairs with tvm_ext's first ones.
    ratios = sorted(statistics.median(t) / statistics.median(o) for t, o in zip(theirs, ours, strict=False))
    return round(statistics.median(ratios), 2), f"{ratios[0]:.2f}-{ratios[-1]:.2f}"


_COLUMNS = (("model", 13), ("batch", 5), ("threads", 7), ("runtime", 15), ("ms", 9), ("images_s", 9),
            ("gflops", 7), ("pct_peak", 8), ("rss_mib", 8), ("tvm_ext_speedup", 15), ("speedup_range", 13),
            ("err_vs_ort", 10), ("note", 13))


def _print(rows: list[dict]) -> None:
    for row in rows:
        print(" ".join(f"{row[name]!s:>{width}}" for name, width in _COLUMNS), flush=True)


if __name__ == "__main__":
    sys.exit(main())
