"""Tutorial 7: run a quantized (int8) network: quantize it, compile it, check it against ONNX Runtime.

1. export torchvision's ResNet-18 (random weights) to ONNX and quantize it with ONNX Runtime's
   `quantize_static` (QDQ form: uint8 activations, per-channel int8 weights, calibrated on random
   images; `tvm_ext.models.quantized.quantized_onnx` does both steps);
2. import the QDQ model into Relax and ask `tvm_ext.dispatch_report` what runs where: every
   convolution between a dequantize and a quantize runs as an int8 convolution (AMX where the CPU
   has AMX-INT8, else VNNI), the residual adds and the max pooling between them on the int8
   kernels' blocked uint8 outputs;
3. build it, compare with ONNX Runtime running the same model (the outputs lie on a quantization
   grid: count the outputs within one step of it), time both, and compare with the float32 network
   (random weights and calibration: expect a few percent);
4. without ONNX: quantize the float32 Relax module itself (`tvm_ext.quantize`, the same
   arithmetic as `quantize_static`, calibrated on the same kind of inputs), build and time it.

Run: python tutorials/07_int8.py [--size 224]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

# TVM's thread pool takes half the CPUs it sees when not told (1 on a 2-core machine); ONNX
# Runtime takes them all. Read when the pool starts: set before the first run.
os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402
import tvm  # noqa: E402
from tvm import relax  # noqa: E402
from tvm.relax.frontend.onnx import from_onnx  # noqa: E402

import tvm_ext  # noqa: E402
from tvm_ext.models import torchvision_zoo  # noqa: E402
from tvm_ext.models.quantized import quantized_onnx  # noqa: E402
from tvm_ext.strategy.quantized import int8_engine  # noqa: E402


def median_ms(fn, repeat: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=224)
    size = parser.parse_args().size
    x = np.random.default_rng(0).standard_normal((1, 3, size, size)).astype(np.float32)
    with tempfile.TemporaryDirectory() as folder:
        path = quantized_onnx("resnet18", Path(folder) / "resnet18_int8.onnx", size)
        mod = from_onnx(onnx.load(path), keep_params_in_input=False)
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    engine = int8_engine(tvm_ext.resolve_target("llvm"))
    print(f"int8 engine on this CPU: {engine[0] if engine else 'none (the convolutions stay in float)'}")
    report = tvm_ext.dispatch_report(mod, "llvm")
    convolutions = [row for row in report if row.op == "nn.conv2d"]
    in_int8 = sum(row.kernel.startswith("int8_conv2d") for row in convolutions)
    print(f"{in_int8} of {len(convolutions)} convolutions in int8; the first one: {convolutions[0].kernel}, "
          f"{convolutions[0].reason}")

    run = relax.VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())["main"]
    xt = tvm.runtime.tensor(x)
    ours = run(xt).numpy()
    theirs = session.run(None, {"x": x})[0]
    step = np.diff(np.unique(theirs)).min()  # the output's quantization step
    within = np.mean(np.abs(ours - theirs) <= 1.001 * step)
    print(f"against ONNX Runtime int8: {100 * within:.2f}% of the outputs within one quantization step, "
          f"same top-1: {ours.argmax() == theirs.argmax()}")

    # (timed before PyTorch runs: its OpenMP threads keep spinning on the cores for a while after)
    ms_ours, ms_ort = median_ms(lambda: run(xt)), median_ms(lambda: session.run(None, {"x": x}))
    print(f"tvm_ext int8 {ms_ours:.2f} ms, ONNX Runtime int8 {ms_ort:.2f} ms ({ms_ort / ms_ours:.2f}x)")

    model = torchvision_zoo.load("resnet18", size).eval()
    with torch.no_grad():
        fp32 = model(torch.from_numpy(x)).numpy()
    top5 = [set(np.argsort(out[0])[-5:]) for out in (fp32, ours)]
    print(f"against the float32 network: relative error {np.abs(ours - fp32).max() / np.abs(fp32).max():.1e}, "
          f"{len(top5[0] & top5[1])} of its top-5 classes")

    # 4. From a float32 Relax module (torch.export -> Relax), no ONNX: calibrate and quantize it here.
    fp32_mod, _ = torchvision_zoo.export(model, size)
    rng = np.random.default_rng(1)
    quantized = tvm_ext.quantize(fp32_mod, [rng.standard_normal(x.shape).astype(np.float32) for _ in range(8)])
    run_q = relax.VirtualMachine(tvm_ext.build(quantized, "llvm"), tvm.cpu())["main"]
    ours_q = run_q(xt)
    ours_q = (ours_q if hasattr(ours_q, "numpy") else ours_q[0]).numpy()
    print(f"tvm_ext.quantize: {median_ms(lambda: run_q(xt)):.2f} ms, relative error to float32 "
          f"{np.abs(ours_q - fp32).max() / np.abs(fp32).max():.1e}, same top-1: {ours_q.argmax() == fp32.argmax()}")


if __name__ == "__main__":
    main()
