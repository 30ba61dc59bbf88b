"""Where a training step's time goes: tvm_ext's built step of a torchvision model (as
bench/train.py --model builds it) run with a VM instrument that times every kernel call, summed
by kernel and by kind (forward convolutions, data and weight gradients, batch norms, layout
copies, stock TVM ops), against the step's time without the instrument. Benchmarks print; they
never assert.

A kind's GFLOP/s is not printed: the forward and data-gradient convolutions share one kernel
family. The instrument's own cost (a Python call before and after each kernel) is the difference
between the calls' sum and the step timed without it, minus the NumPy SGD update.

Usage: python bench/profile_step.py --model resnet50 --size 224 --batch 16 --threads 2
                                    [--batch-norm inference|training] [--repeat R] [--top K]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-norm", choices=("inference", "training"), default="training")
    ap.add_argument("--repeat", type=int, default=3, help="instrumented steps (their median per kernel)")
    ap.add_argument("--top", type=int, default=25, help="kernels listed, the slowest first")
    return ap.parse_args()


ARGS = _parse_args()
os.environ["TVM_NUM_THREADS"] = str(ARGS.threads)  # before TVM's thread pool starts

import numpy as np  # noqa: E402

# (kind, what a kernel name starts with or contains), the first match wins
KINDS = [
    ("weight gradient", "backward_weight"),
    ("weight packing (and dX's flipped weights)", "pack_weight"),
    ("weight packing (and dX's flipped weights)", "unpack_weight"),
    ("weight packing (and dX's flipped weights)", "phase_weight"),
    ("batch norm backward", "batch_norm_backward"),
    ("batch norm forward", "tvm_ext_batch_norm"),
    ("batch statistics", "tvm_ext_batch_statistics"),
    ("data gradient (relu mask)", "_mask"),
    ("convolution", "conv2d"),
    ("stride phases' interleave", "interleave_phases"),
    ("pooling and its gradient", "pool"),
    ("layout copies (pack, pad, unpack)", "pack"),
    ("layout copies (pack, pad, unpack)", "pad_nchwc"),
]


def kind_of(name: str) -> str:
    for kind, part in KINDS:
        if part in name:
            return kind
    return "stock TVM and other" if not name.startswith("tvm_ext_") else "other tvm_ext"


def main() -> int:
    import torch
    import tvm
    from tvm import relax

    import tvm_ext
    from tvm_ext.models import torchvision_zoo
    from tvm_ext.models.training import loss_gradient, loss_step_gradient

    torch.set_num_threads(ARGS.threads)
    x = np.random.default_rng(1).standard_normal((ARGS.batch, 3, ARGS.size, ARGS.size), dtype=np.float32)
    model = torchvision_zoo.load(ARGS.model, ARGS.size).train(ARGS.batch_norm == "training")
    if model.training:
        mod, params, states, _ = loss_step_gradient(model, x)
        name = "backbone_adjoint"
    else:
        (mod, params, _), states, name = loss_gradient(model, x), [], "main_adjoint"
    del model
    ex = tvm_ext.build(mod, "llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    args = [tvm.runtime.tensor(a) for a in [x, *params, *states]]
    adjoint = vm[name]

    def step() -> float:
        start = time.perf_counter()
        adjoint(*args)
        return (time.perf_counter() - start) * 1e3

    for _ in range(2):
        step()
    plain = statistics.median(step() for _ in range(ARGS.repeat))

    calls: dict[str, list[float]] = defaultdict(list)  # kernel -> its call times in one step
    started: list[float] = []

    def instrument(func, symbol, before, ret, *rest):
        if before:
            started.append(time.perf_counter())
        else:
            calls[str(symbol)].append((time.perf_counter() - started.pop()) * 1e3)
        return 0

    vm.set_instrument(tvm.runtime.convert(instrument) if hasattr(tvm.runtime, "convert") else instrument)
    per_step: list[dict[str, float]] = []
    for _ in range(ARGS.repeat):
        calls.clear()
        step()
        per_step.append({k: sum(v) for k, v in calls.items()})
    counts = {k: len(v) for k, v in calls.items()}
    kernels = {k: statistics.median(s.get(k, 0.0) for s in per_step) for k in per_step[0]}
    total = sum(kernels.values())
    print(f"# {ARGS.model} {ARGS.size}x{ARGS.size} batch={ARGS.batch} threads={ARGS.threads} batch norms: "
          f"{ARGS.batch_norm}; {name}: {plain:.0f} ms a step without the instrument (median of {ARGS.repeat}), "
          f"{total:.0f} ms of calls with it (medians per kernel)")
    by_kind: dict[str, float] = defaultdict(float)
    kind_calls: dict[str, int] = defaultdict(int)
    for kernel, ms in kernels.items():
        by_kind[kind_of(kernel)] += ms
        kind_calls[kind_of(kernel)] += counts.get(kernel, 0)
    print("kind | ms | % of calls | calls")
    for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"{kind} | {ms:.1f} | {100 * ms / total:.1f} | {kind_calls[kind]}")
    print(f"# the {ARGS.top} slowest kernels")
    print("kernel | ms | calls | kind")
    for kernel, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:ARGS.top]:
        print(f"{kernel} | {ms:.2f} | {counts.get(kernel, 0)} | {kind_of(kernel)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
