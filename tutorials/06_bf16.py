"""Tutorial 6: run a network's convolutions in bfloat16 (AMX tiles; AVX512-BF16 on Zen 4;
emulated on FMA elsewhere).

1. import torchvision's ResNet-18 (random weights) into Relax;
2. ask `tvm_ext.dispatch_report(..., precision="bf16")` which convolutions run in bf16 (on a CPU
   with AMX-BF16, Sapphire Rapids and later: all of them; on Zen 4 and later, on `vdpbf16ps`, all
   but the 3x3 layers Winograd serves in fp32; elsewhere the same layers as Zen 4's, emulated on
   FMA: bf16's arithmetic at about fp32's speed, not faster);
3. build it in fp32 and in bf16, compare the outputs (bf16 keeps 8 bits of mantissa of each
   convolution's inputs: expect about 1e-2 relative) and the top-5 classes, and time both against
   ONNX Runtime in fp32 (if installed).

Run: python tutorials/06_bf16.py
"""

from __future__ import annotations

import time

import numpy as np
import torch
import tvm
from tvm import relax
from tvm.relax.frontend.torch import from_exported_program

import tvm_ext
from tvm_ext.models import torchvision_zoo
from tvm_ext.strategy.decide import bf16_engine
from tvm_ext.target import amx_permitted, has_amx_bf16


def median_ms(fn, repeat: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def main() -> None:
    model = torchvision_zoo.load("resnet18", 224).eval()
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    with torch.no_grad():
        program = torch.export.export(model, (torch.from_numpy(x),))
    mod = from_exported_program(program, keep_params_as_input=False)

    print(f"AMX-BF16 on this CPU: {has_amx_bf16('llvm')}, tiles granted by the OS: {amx_permitted()}; "
          f"bf16 engine: {bf16_engine(tvm_ext.resolve_target('llvm'))}")
    report = tvm_ext.dispatch_report(mod, "llvm", precision="bf16")
    convolutions = [row for row in report if row.op == "nn.conv2d"]
    in_bf16 = sum(row.reason.startswith("bf16") for row in convolutions)
    print(f"{in_bf16} of {len(convolutions)} convolutions in bf16; the first one: {convolutions[0].reason}")

    outputs, times = {}, {}
    xt = tvm.runtime.tensor(x)
    for precision in ("fp32", "bf16"):
        run = relax.VirtualMachine(tvm_ext.build(mod, "llvm", precision=precision), tvm.cpu())["main"]
        result = run(xt)
        outputs[precision] = (result if hasattr(result, "numpy") else result[0]).numpy()
        times[precision] = median_ms(lambda run=run: run(xt))
    error = np.abs(outputs["bf16"] - outputs["fp32"]).max() / np.abs(outputs["fp32"]).max()
    top5 = [set(np.argsort(outputs[p][0])[-5:]) for p in ("fp32", "bf16")]
    print(f"bf16 against fp32: relative error {error:.1e}, same top-5 classes: {top5[0] == top5[1]}")
    print(f"tvm_ext fp32 {times['fp32']:.2f} ms, bf16 {times['bf16']:.2f} ms "
          f"({times['fp32'] / times['bf16']:.2f}x)")
    try:
        import onnxruntime as ort
    except ImportError:
        return
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "resnet18.onnx")
        torch.onnx.export(model, (torch.from_numpy(x),), path, dynamo=False, input_names=["data"])
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        ms = median_ms(lambda: session.run(None, {"data": x}))
    print(f"ONNX Runtime fp32 {ms:.2f} ms: tvm_ext bf16 is {ms / times['bf16']:.2f}x faster")


if __name__ == "__main__":
    main()
