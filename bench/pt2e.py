"""PyTorch PT2E-quantized torchvision ResNets (torchao's X86InductorQuantizer, uint8 activations,
per-channel int8 weights) imported with `tvm_ext.models.pt2e.from_pt2e` and built by tvm_ext,
against tvm_ext's fp32 build of the same float network and PyTorch eager fp32, alternated in one
process: how many convolutions and residual adds run on the int8 kernels (dispatch_report), the
error from PyTorch's quantized module (its float emulation of the quantization: the reference)
and the same top-1, median latency.

Benchmarks print; they never assert. Usage:
    python bench/pt2e.py [--models resnet18,resnet50] [--size 224] [--threads 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys


def _parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="resnet18,resnet50")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--inputs", type=int, default=3, help="random images compared")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the three runtimes, alternated")
    ap.add_argument("--repeat", type=int, default=10, help="calls a round")
    return ap.parse_args(argv)


ARGS = _parse_args()
# (read once, when TVM's pool and PyTorch's start) Idle threads sleep: alternated runtimes share
# the cores, and a pool that spins after its call takes one from the next runtime's.
os.environ["TVM_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import tvm  # noqa: E402
from e2e import time_calls  # noqa: E402 (bench/ is the script's folder)
from tvm import relax  # noqa: E402
from tvm.relax.frontend.torch import from_exported_program  # noqa: E402

import tvm_ext  # noqa: E402
from tvm_ext.models import torchvision_zoo  # noqa: E402
from tvm_ext.models.pt2e import from_pt2e, one_relu_per_call, quantize_pt2e  # noqa: E402


def _first(out) -> np.ndarray:
    return (out if hasattr(out, "numpy") else out[0]).numpy()


def _row(name: str) -> str:
    """`name`'s line of the table."""
    shape = (1, 3, ARGS.size, ARGS.size)
    model = one_relu_per_call(torchvision_zoo.load(name, ARGS.size))
    torch.manual_seed(0)
    example = torch.randn(*shape)
    quantized, program = quantize_pt2e(model, example, [torch.randn(*shape) for _ in range(8)])
    mod = from_pt2e(program)
    report = tvm_ext.dispatch_report(mod, "llvm")
    convs = [row for row in report if row.op == "nn.conv2d"]
    on_int8 = sum(row.kernel.startswith("int8_conv2d") for row in convs)
    fused = sum(row.op == "add" and row.kernel == "int8_conv2d epilogue" for row in report)
    int8 = relax.VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())["main"]
    with torch.no_grad():
        float_mod = from_exported_program(torch.export.export(model.eval(), (example,)), keep_params_as_input=False)
    fp32 = relax.VirtualMachine(tvm_ext.build(float_mod, "llvm"), tvm.cpu())["main"]
    rng = np.random.default_rng(7)
    err, top1 = 0.0, True
    for _ in range(ARGS.inputs):
        x = rng.standard_normal(shape).astype(np.float32)
        with torch.no_grad():
            expected = quantized(torch.from_numpy(x)).numpy()
        got = _first(int8(tvm.runtime.tensor(x)))
        err = max(err, float(np.abs(got - expected).max() / np.abs(expected).max()))
        top1 = top1 and bool((got.argmax(1) == expected.argmax(1)).all())
    xt, xp = tvm.runtime.tensor(x), torch.from_numpy(x)

    def eager():
        with torch.no_grad():
            model(xp)

    runs = {"int8": lambda: int8(xt), "fp32": lambda: fp32(xt), "pytorch": eager}
    times: dict[str, list[float]] = {key: [] for key in runs}
    for _ in range(ARGS.rounds):
        for key, fn in runs.items():
            times[key].append(statistics.median(time_calls(fn, ARGS.repeat)))
    ms = {key: statistics.median(values) for key, values in times.items()}
    return (f"{name:>10} {on_int8:>5}/{len(convs):<5} {fused:>11} {err:8.1e} {str(top1):>6} {ms['int8']:8.2f} "
            f"{ms['fp32']:8.2f} {ms['pytorch']:11.2f} {ms['fp32'] / ms['int8']:6.2f}x "
            f"{ms['pytorch'] / ms['int8']:9.2f}x")


def main() -> int:
    torch.set_num_threads(ARGS.threads)
    print(f"{'model':>10} {'int8 convs':>11} {'fused adds':>11} {'max err':>8} {'top-1':>6} {'int8 ms':>8} "
          f"{'fp32 ms':>8} {'PyTorch ms':>11} {'x fp32':>7} {'x PyTorch':>10}")
    for name in ARGS.models.split(","):
        print(_row(name), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
