"""A network exported with a symbolic batch against the same network built per static batch.

torch.export with a `torch.export.Dim` batch gives a Relax module whose batch is symbolic;
tvm_ext runs each of its kernels image by image over that batch (:mod:`tvm_ext.kernels.batch_loop`).
This times that one dynamic build against static builds at each --batches, in one process,
alternating (median of --repeat runs per round, --rounds rounds), checks both against PyTorch,
and prints the dynamic build's time over the static one's. Goal: within 10% at batch 1 and 8.

Usage: python bench/dynamic_batch.py [--model resnet50] [--size 224] [--batches 1,8] [--repeat 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import time_calls  # noqa: E402  (bench/e2e.py: warm-up calls for 0.25 s, then the timed ones)


def _median_ms(fn, repeat: int) -> float:
    return statistics.median(time_calls(fn, repeat))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet50", help="a torchvision classification model")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if min(batches) < 1 or args.repeat < 1 or args.rounds < 1:
        ap.error("--batches, --repeat and --rounds must be >= 1")

    import torch
    import tvm
    from tvm import relax

    import tvm_ext
    from tvm_ext.models import torchvision_zoo

    model = torchvision_zoo.load(args.model, args.size)
    dynamic_mod, _ = torchvision_zoo.export(model, args.size, batch=2, dynamic_batch=True)
    start = time.perf_counter()
    dynamic = relax.VirtualMachine(tvm_ext.build(dynamic_mod, "llvm"), tvm.cpu())["main"]
    print(f"{args.model}: dynamic build {time.perf_counter() - start:.1f} s", flush=True)
    print(f"{'batch':>5} {'static ms':>10} {'dynamic ms':>11} {'dynamic/static':>15} {'err static':>11} "
          f"{'err dynamic':>12}")
    for batch in batches:
        static_mod, x = torchvision_zoo.export(model, args.size, batch=batch)
        static = relax.VirtualMachine(tvm_ext.build(static_mod, "llvm"), tvm.cpu())["main"]
        xt = tvm.runtime.tensor(x)
        with torch.no_grad():
            ref = model(torch.from_numpy(x)).numpy()
        errs = []
        for fn in (static, dynamic):
            out = fn(xt)
            out = (out if hasattr(out, "numpy") else out[0]).numpy()
            errs.append(float(np.abs(out - ref).max() / np.abs(ref).max()))
        ratios, times = [], {"static": [], "dynamic": []}
        for _ in range(args.rounds):
            s = _median_ms(lambda fn=static, xt=xt: fn(xt), args.repeat)
            d = _median_ms(lambda xt=xt: dynamic(xt), args.repeat)
            times["static"].append(s)
            times["dynamic"].append(d)
            ratios.append(d / s)
        print(f"{batch:>5} {statistics.median(times['static']):10.2f} {statistics.median(times['dynamic']):11.2f} "
              f"{statistics.median(ratios):15.3f} {errs[0]:11.1e} {errs[1]:12.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
