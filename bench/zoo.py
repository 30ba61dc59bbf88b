"""The torchvision zoo (one model of each classification family, tvm_ext.models.torchvision_zoo):
tvm_ext against ONNX Runtime and PyTorch eager (and stock TVM with --stock), in one run.

Each model: random weights with calibrated batch norms, exported with torch.export and built
with `tvm_ext.build` (the build time is printed: the goal is <= 15 s a model); ONNX Runtime runs
the same torch model exported with torch.onnx (all graph optimizations, intra-op threads set);
PyTorch eager runs torchvision's module itself (best of NCHW and channels_last). The runtimes
take turns in processes of their own, as in bench/e2e.py (whose child and round-robin this
reuses): median ms over --rounds x --repeat runs, tvm_ext's speed-up as the median of same-round
ratios, outputs checked against ONNX Runtime's. Goal on 2 threads, batch 1: no model below 1.0x
ONNX Runtime, geometric mean >= 1.2x. A markdown table (for the README) ends the output.
torchvision's video models (torchvision_zoo.VIDEO: r3d_18, mc3_18, r2plus1d_18) run on clips of
--frames frames when named in --models.

Usage: python bench/zoo.py [--models resnet18,...] [--size 224] [--batch 1] [--threads 2]
                           [--repeat 20] [--rounds 3] [--stock] [--frames 16]
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import e2e  # noqa: E402  (bench/e2e.py: the child processes and the round-robin)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    from tvm_ext.models.torchvision_zoo import FAMILIES, VIDEO

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(FAMILIES))
    ap.add_argument("--size", type=int, default=224, help="image size (inception_v3 takes at least 75)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=20, help="timed runs per round")
    ap.add_argument("--rounds", type=int, default=3, help="turns each runtime takes, round-robin")
    ap.add_argument("--stock", action="store_true", help="also stock TVM's default build (slow)")
    ap.add_argument("--frames", type=int, default=16, help="frames a clip of a video model has")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.models.split(",")) - set(FAMILIES) - set(VIDEO))
    if unknown:
        ap.error(f"--models: {', '.join(unknown)} not in the zoo ({', '.join(FAMILIES + VIDEO)})")
    if min(args.size, args.batch, args.threads, args.repeat, args.rounds, args.frames) < 1:
        ap.error("--size, --batch, --threads, --repeat, --rounds and --frames must be >= 1")
    return args


def _prepare(name: str, args: argparse.Namespace, folder: Path) -> tuple[dict[str, str], float]:
    """Artifacts of each runtime for model `name`, and tvm_ext's build time in seconds."""
    import torch
    import tvm

    import tvm_ext
    from tvm_ext.models import torchvision_zoo

    size = max(args.size, torchvision_zoo.MIN_SIZE.get(name, 1))
    frames = args.frames if name in torchvision_zoo.VIDEO else None
    model = torchvision_zoo.load(name, size, frames=frames)
    mod, x = torchvision_zoo.export(model, size, args.batch, frames=frames)
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "input.npy", x)
    start = time.perf_counter()
    ex = tvm_ext.build(mod, "llvm", images_per_call=args.threads if args.batch > 1 else None)
    build_s = time.perf_counter() - start
    artifacts = {"tvm_ext": str(folder / "tvm_ext.so")}
    ex.export_library(artifacts["tvm_ext"])
    if args.stock:
        artifacts["stock_tvm"] = str(folder / "stock_tvm.so")
        tvm.compile(mod, "llvm").export_library(artifacts["stock_tvm"])
    artifacts["onnxruntime"] = str(folder / "model.onnx")
    with torch.no_grad():
        torch.onnx.export(model, (torch.from_numpy(x),), artifacts["onnxruntime"], dynamo=False,
                          input_names=["data"])
    artifacts["pytorch"] = str(folder / "model.pt")
    torch.save(model, artifacts["pytorch"])
    return artifacts, build_s


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tvm_ext_zoo_"))
    rounds = argparse.Namespace(repeat=args.repeat, rounds=args.rounds)
    rows = []
    print(f"{'model':>20} {'build s':>8} {'tvm_ext':>9} {'ORT':>9} {'PyTorch':>9} {'vs ORT':>7} {'range':>10} "
          f"{'vs PyTorch':>10} {'err':>8}" + (f" {'stock':>9}" if args.stock else ""), flush=True)
    try:
        for name in args.models.split(","):
            folder = work / name
            artifacts, build_s = _prepare(name, args, folder)
            results = e2e._run_rounds(artifacts, rounds, name, args.batch, args.threads, folder)
            shutil.rmtree(folder, ignore_errors=True)
            if "tvm_ext" not in results:
                print(f"{name:>20} tvm_ext failed", flush=True)
                continue
            ms = {r: statistics.median(t for round_ms in v["rounds"] for t in round_ms) for r, v in results.items()}
            ours = results["tvm_ext"]
            vs = {r: e2e._paired_speedup(results[r]["rounds"], ours["rounds"]) for r in results if r != "tvm_ext"}
            ref = results.get("onnxruntime", {}).get("out")
            err = float(np.abs(ours["out"] - ref).max() / np.abs(ref).max()) if ref is not None else float("nan")
            row = {"model": name, "build_s": build_s, "ms": ms, "vs": vs, "err": err}
            rows.append(row)
            print(f"{name:>20} {build_s:8.1f} {ms['tvm_ext']:9.2f} {ms.get('onnxruntime', math.nan):9.2f} "
                  f"{ms.get('pytorch', math.nan):9.2f} {vs.get('onnxruntime', (math.nan, ''))[0]:7.2f} "
                  f"{vs.get('onnxruntime', (0, ''))[1]:>10} {vs.get('pytorch', (math.nan, ''))[0]:10.2f} {err:8.1e}"
                  + (f" {ms.get('stock_tvm', math.nan):9.1f}" if args.stock else ""), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _summary(rows, args)
    return 0


def _summary(rows: list[dict], args: argparse.Namespace) -> None:
    with_ort = [r["vs"]["onnxruntime"][0] for r in rows if "onnxruntime" in r["vs"]]
    if with_ort:
        below = [r["model"] for r in rows if r["vs"].get("onnxruntime", (2, ""))[0] < 1.0]
        print(f"geometric mean vs ONNX Runtime: {math.exp(statistics.fmean(map(math.log, with_ort))):.2f}x "
              f"over {len(with_ort)} models; below 1.0x: {', '.join(below) or 'none'}; slowest build "
              f"{max(r['build_s'] for r in rows):.0f} s")
    print(f"\n{args.threads} threads, batch {args.batch}, {args.size}x{args.size}, median ms:\n")
    print("| model | tvm_ext | ONNX Runtime | PyTorch | vs ORT | vs PyTorch | build s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ms, vs = r["ms"], r["vs"]
        print(f"| {r['model']} | {ms['tvm_ext']:.2f} | {ms.get('onnxruntime', math.nan):.2f} | "
              f"{ms.get('pytorch', math.nan):.2f} | {vs.get('onnxruntime', (math.nan,))[0]:.2f}x | "
              f"{vs.get('pytorch', (math.nan,))[0]:.2f}x | {r['build_s']:.0f} |")


if __name__ == "__main__":
    sys.exit(main())
