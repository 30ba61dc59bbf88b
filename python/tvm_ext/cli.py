"""`python -m tvm_ext demo|report|bench`: compile a network through tvm_ext and show what ran.

demo   build the model with tvm_ext and with stock TVM, check the outputs agree, print the
       dispatch summary and the latency against stock TVM and PyTorch eager (same weights).
report print the dispatch report (one row per op).
bench  the per-layer convolution benchmark (bench/layers.py) for the model's layers.
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
    ap.add_argument("command", choices=("demo", "report", "bench"))
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--target", default="llvm")
    ap.add_argument("--threads", type=int, default=0, help="TVM and PyTorch threads (0: every core we may use)")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--no-stock", action="store_true", help="skip stock TVM (it takes seconds per run)")
    return ap.parse_args(argv)


def _median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def torch_resnet(params: dict):
    """The same network in PyTorch eager, from the same weights (a reference and a baseline)."""
    import torch
    import torch.nn.functional as F

    p = {k: torch.from_numpy(v) for k, v in params.items()}

    def conv_bn(x, name, stride, relu=True):
        w = p[f"{name}.weight"]
        y = F.conv2d(x, w, None, stride, w.shape[-1] // 2)
        y = F.batch_norm(y, p[f"{name}.bn.mean"], p[f"{name}.bn.var"], p[f"{name}.bn.gamma"], p[f"{name}.bn.beta"],
                         False, 0.0, 1e-5)
        return F.relu(y) if relu else y

    blocks = sorted({k.split(".")[0] + "." + k.split(".")[1] for k in params if k.startswith("layer")},
                    key=lambda s: (int(s[5]), int(s.split(".")[1])))
    bottleneck = any(k.endswith("conv3.weight") for k in params)

    def forward(x):
        x = F.max_pool2d(conv_bn(x, "stem", 2), 3, 2, 1)
        for block in blocks:
            stride = 2 if block.endswith(".0") and not block.startswith("layer1") else 1
            shortcut = conv_bn(x, f"{block}.downsample", stride, False) if f"{block}.downsample.weight" in p else x
            if bottleneck:
                y = conv_bn(conv_bn(conv_bn(x, f"{block}.conv1", 1), f"{block}.conv2", stride), f"{block}.conv3", 1,
                            False)
            else:
                y = conv_bn(conv_bn(x, f"{block}.conv1", stride), f"{block}.conv2", 1, False)
            x = F.relu(y + shortcut)
        return x.mean((2, 3)) @ p["fc.weight"] + p["fc.bias"]

    return forward


def demo(args: argparse.Namespace) -> int:
    import numpy as np
    import tvm
    from tvm import relax

    import tvm_ext
    from tvm_ext import models

    target = tvm_ext.resolve_target(args.target)
    print(f"tvm_ext demo: {args.model} batch {args.batch} on {target} ({tvm_ext.vector_isa(target).name}), "
          f"{args.threads} threads")
    mod, params = models.get(args.model, batch=args.batch)
    report = tvm_ext.dispatch_report(mod, target)
    counts = collections.Counter(r.kernel for r in report)
    print("dispatch: " + ", ".join(f"{n} x {k}" for k, n in counts.most_common()))
    start = time.perf_counter()
    ex = tvm_ext.build(mod, target)
    print(f"built with tvm_ext in {time.perf_counter() - start:.1f} s")
    x = np.random.default_rng(0).standard_normal((args.batch, 3, 224, 224)).astype("float32")
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
        torch.set_num_threads(args.threads)
        forward = torch_resnet(params) if args.model.startswith("resnet") else None
        if forward is not None:
            with torch.inference_mode():
                xt_torch = torch.from_numpy(x)
                err = float(np.abs(ours - forward(xt_torch).numpy()).max() / np.abs(ours).max())
                print(f"output vs PyTorch eager: relative error {err:.1e}")
                rows.append(("PyTorch eager (NCHW)", _median_ms(lambda: forward(xt_torch), args.repeat)))
    print(f"{'runtime':28s} {'ms':>9s} {'images/s':>9s} {'tvm_ext speed-up':>17s}")
    for name, t in rows:
        print(f"{name:28s} {t:9.2f} {1e3 * args.batch / t:9.1f} {t / ms:16.1f}x")
    return status


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    # Set explicitly: TVM's own default pool ran ResNet-18 at half speed on this 2-core machine.
    args.threads = args.threads or len(os.sched_getaffinity(0))
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    if args.command == "demo":
        return demo(args)
    if args.command == "report":
        import tvm_ext
        from tvm_ext import models

        print(tvm_ext.dispatch_report(models.get(args.model, batch=args.batch)[0], args.target))
        return 0
    bench = Path(__file__).resolve().parents[2] / "bench" / "layers.py"
    layer_set = "resnet50" if args.model.startswith("resnet") else args.model
    cmd = [sys.executable, str(bench), "--set", layer_set, "--batch", str(args.batch), "--threads",
           str(args.threads), "--target", args.target, "--repeat", str(args.repeat)]
    return subprocess.call(cmd)
