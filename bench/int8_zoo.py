"""Quantized torchvision models (ONNX Runtime's quantize_static, QDQ): tvm_ext's build of each
against ONNX Runtime running the same model, in one process: the share of outputs within one
quantization step of ORT's (and identical), the same top-1, how many convolutions run on the
int8 kernels (dispatch_report), the build time and both runtimes' median latency, alternated
round by round (ORT's threads not spinning after a call: they took a core from the tvm_ext call
timed after them, EfficientNet-B0 11.2 ms for its 5.4).

Benchmarks print; they never assert. Usage:
    python bench/int8_zoo.py [--models resnet50,mobilenet_v2,...] [--size 64] [--threads 2] [--inputs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_MODELS = ("resnet18,resnet50,resnext50_32x4d,wide_resnet50_2,mobilenet_v2,mobilenet_v3_large,"
                  "efficientnet_b0,efficientnet_v2_s,regnet_x_400mf,regnet_y_400mf,mnasnet1_0,shufflenet_v2_x1_0,"
                  "squeezenet1_1,googlenet,inception_v3,densenet121,convnext_tiny")


def _parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--size", type=int, default=64, help="image size (inception_v3 takes at least 75: 96 there)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--inputs", type=int, default=3, help="random images compared")
    ap.add_argument("--repeat", type=int, default=20, help="calls a round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the two runtimes, alternated")
    return ap.parse_args(argv)


ARGS = _parse_args()
os.environ["TVM_NUM_THREADS"] = str(ARGS.threads)  # read when TVM's pool starts

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
import tvm  # noqa: E402
from e2e import time_calls  # noqa: E402 (bench/ is the script's folder)
from tvm import relax  # noqa: E402
from tvm.relax.frontend.onnx import from_onnx  # noqa: E402

import tvm_ext  # noqa: E402
from tvm_ext.models.quantized import quantized_onnx  # noqa: E402


def median_ms(fn, repeat: int) -> float:
    return statistics.median(time_calls(fn, repeat))


def main() -> int:
    print(f"{'model':>22} {'build s':>8} {'within 1 step':>14} {'identical':>10} {'top-1':>6} {'int8 convs':>11} "
          f"{'tvm_ext ms':>11} {'ORT int8 ms':>12} {'vs ORT':>7}")
    for name in ARGS.models.split(","):
        size = max(ARGS.size, 96) if name == "inception_v3" else ARGS.size
        with tempfile.TemporaryDirectory() as folder:
            path = quantized_onnx(name, Path(folder) / "model.onnx", size)
            mod = from_onnx(onnx.load(path), keep_params_in_input=False)
            options = ort.SessionOptions()
            options.intra_op_num_threads = ARGS.threads
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        start = time.perf_counter()
        run = relax.VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())["main"]
        build_s = time.perf_counter() - start
        rng = np.random.default_rng(7)
        within = identical = total = 0
        top1 = True
        for _ in range(ARGS.inputs):
            x = rng.standard_normal((1, 3, size, size)).astype(np.float32)
            expected = session.run(None, {"x": x})[0]
            got = run(tvm.runtime.tensor(x)).numpy()
            steps = np.abs(got - expected) / np.diff(np.unique(expected)).min()
            within, identical = within + (steps <= 1.001).sum(), identical + (steps < 1e-3).sum()
            total, top1 = total + steps.size, top1 and bool(got.argmax() == expected.argmax())
        convs = [row for row in tvm_ext.dispatch_report(mod, "llvm") if row.op == "nn.conv2d"]
        on_int8 = sum(row.kernel.startswith("int8_conv2d") for row in convs)
        xt = tvm.runtime.tensor(x)
        rounds = [(median_ms(lambda run=run, xt=xt: run(xt), ARGS.repeat),
                   median_ms(lambda session=session, x=x: session.run(None, {"x": x}), ARGS.repeat))
                  for _ in range(ARGS.rounds)]
        ours, theirs = (statistics.median(times) for times in zip(*rounds, strict=True))
        print(f"{name:>22} {build_s:8.1f} {100 * within / total:13.3f}% {100 * identical / total:9.2f}% {str(top1):>6} "
              f"{on_int8:>5}/{len(convs):<5} {ours:11.2f} {theirs:12.2f} {theirs / ours:6.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
