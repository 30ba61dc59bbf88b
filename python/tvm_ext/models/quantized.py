"""Quantized ONNX models as users bring them: a torchvision network exported to ONNX and quantized
by ONNX Runtime's `quantize_static` (QDQ form, random calibration images), for tests, benchmarks
and the tutorial. Nothing is downloaded."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from .torchvision_zoo import load

__all__ = ["quantized_onnx"]


def quantized_onnx(name: str, path: str | os.PathLike, size: int = 64, *, per_channel: bool = True,
                   activations: str = "uint8", calibration: int = 8, seed: int = 0) -> Path:
    """torchvision model `name` (random weights, :func:`~.torchvision_zoo.load`) at 1 x 3 x `size`
    x `size`, exported to ONNX (opset 17) and quantized with ONNX Runtime's `quantize_static`
    in QDQ form (after its `quant_pre_process`): int8 weights (per output channel with
    `per_channel`), `activations` "uint8" or "int8" calibrated by min/max on `calibration`
    random images. Written to `path`; returns it."""
    import torch
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    if activations not in ("uint8", "int8"):
        raise ValueError(f"quantized_onnx: activations must be 'uint8' or 'int8', got {activations!r}")
    rng = np.random.default_rng(seed)
    images = [rng.standard_normal((1, 3, size, size)).astype(np.float32) for _ in range(calibration)]

    class Images(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter({"x": image} for image in images)

        def get_next(self):
            return next(self.feeds, None)

    model = load(name, size, seed)
    path = Path(path)
    with tempfile.TemporaryDirectory() as work:
        fp32, prepared = Path(work) / "fp32.onnx", Path(work) / "prepared.onnx"
        with torch.no_grad():
            torch.onnx.export(model, (torch.from_numpy(images[0]),), str(fp32), opset_version=17, dynamo=False,
                              input_names=["x"], output_names=["y"])
        quant_pre_process(str(fp32), str(prepared))
        quantize_static(str(prepared), str(path), Images(), quant_format=QuantFormat.QDQ, per_channel=per_channel,
                        activation_type=QuantType.QUInt8 if activations == "uint8" else QuantType.QInt8,
                        weight_type=QuantType.QInt8)
    return path
