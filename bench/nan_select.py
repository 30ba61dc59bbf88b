"""What PyTorch's NaN semantics cost: relu, relu6 and leaky_relu as selects (NaN stays NaN, as
in PyTorch; tvm_ext's definition since 0.5.12) against max/min (LLVM's maxnum turns NaN into 0),
in the convolution epilogue and in the standalone activation kernel, side by side in one run.

Each pair is built from the same plan with only the activation's expression changed; the two
run alternately, --rounds rounds of a median of --repeat runs each. Printed: both medians and
select / max (1.00 = no cost).

Usage: python bench/nan_select.py [--threads 1] [--repeat 50] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import time_calls  # noqa: E402  (bench/e2e.py: warm-up calls for 0.25 s, then the timed ones)

# The definitions before 0.5.12: max/min, which turn a NaN into 0.
MAX_MIN = {
    "relu": "T.max({v}, T.float32(0))",
    "relu6": "T.min(T.max({v}, T.float32(0)), T.float32(6))",
    "leaky_relu": "T.max({v}, T.float32({alpha!r}) * {v})",
}

# (input NCHW, weight OIHW, padding): ResNet-50 layers, a 3x3 and a 1x1
LAYERS = [((1, 64, 56, 56), (64, 64, 3, 3), 1), ((1, 1024, 14, 14), (256, 1024, 1, 1), 0)]


def _variants(build) -> tuple:
    """build() with tvm_ext's activations (selects), then with MAX_MIN (caches cleared around)."""
    from tvm_ext.kernels import conv2d as conv
    from tvm_ext.kernels import script

    def fresh():
        conv.conv2d_blocked_func.cache_clear()
        script.from_source.cache_clear()

    saved = dict(conv.ACTIVATIONS)
    fresh()
    select = build()
    try:
        conv.ACTIVATIONS.update(MAX_MIN)
        fresh()
        maxmin = build()
    finally:
        conv.ACTIVATIONS.clear()
        conv.ACTIVATIONS.update(saved)
        fresh()
    return select, maxmin


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if min(args.threads, args.repeat, args.rounds) < 1:
        ap.error("--threads, --repeat and --rounds must be >= 1")
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    import tvm

    from tvm_ext.kernels import conv2d as conv
    from tvm_ext.kernels import elementwise
    from tvm_ext.target import resolve_target, vector_isa

    target = resolve_target("llvm")
    isa = vector_isa(target)
    rng = np.random.default_rng(0)

    def compiled(func):
        return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target)["main"]

    cases = []
    for activation in MAX_MIN:
        for x_shape, w_shape, pad in LAYERS:
            wl = conv.Conv2dWorkload.make(x_shape, w_shape, (1, 1), (pad,) * 4, (1, 1), 1)
            plan = conv.plan_conv2d(wl, isa)
            epilogue = conv.Epilogue(bias=True, activation=activation, alpha=0.1)
            kernels = _variants(lambda plan=plan, epilogue=epilogue: compiled(
                conv.conv2d_blocked_kernel(plan, isa.lanes, epilogue)))
            shapes = [plan.data_shape(), plan.weight_shape(), (plan.OCB, plan.oc_bn)]
            inputs = [tvm.runtime.tensor(rng.standard_normal(s).astype("float32")) for s in shapes]
            out = tvm.runtime.empty(plan.out_shape(), "float32", tvm.cpu())
            cases.append((f"conv {x_shape[1]}x{x_shape[2]}x{x_shape[3]} {w_shape[2]}x{w_shape[3]} + {activation}",
                          kernels, [*inputs, out]))
        size = 64 * 112 * 112
        kernels = _variants(lambda activation=activation: compiled(
            elementwise.dynamic_activation_func(activation, "float32", isa.lanes, 0.1)))
        data = tvm.runtime.tensor(rng.standard_normal(size).astype("float32"))
        cases.append((f"{activation} alone, 64x112x112", kernels, [data, tvm.runtime.empty((size,), "float32")]))

    print(f"{'kernel':>40} {'select ms':>10} {'max ms':>10} {'select/max':>11}  ({args.threads} threads, {isa.name})")
    for name, (select, maxmin), tensors in cases:
        times = {"select": [], "max": []}
        for _ in range(args.rounds):
            for label, kernel in (("select", select), ("max", maxmin)):
                times[label].append(statistics.median(time_calls(lambda k=kernel, t=tensors: k(*t), args.repeat)))
        ratio = statistics.median(s / m for s, m in zip(times["select"], times["max"], strict=True))
        print(f"{name:>40} {statistics.median(times['select']):10.4f} {statistics.median(times['max']):10.4f} "
              f"{ratio:11.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
