"""Quantized ONNX models as users bring them: a torchvision network exported to ONNX and quantized
by ONNX Runtime's `quantize_static` (QDQ form, random calibration images), for tests, benchmarks
and the tutorial. Nothing is downloaded."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from .torchvision_zoo import load

__all__ = ["quantize_onnx_file", "quantized_onnx"]


def quantize_onnx_file(fp32: str | os.PathLike, path: str | os.PathLike, *, per_channel: bool = True,
                       activations: str = "uint8", calibration: int = 8, seed: int = 0) -> Path:
    """The float32 ONNX model at `fp32` quantized with ONNX Runtime's `quantize_static` in QDQ form
    (after its `quant_pre_process`): int8 weights (per output channel with `per_channel`),
    `activations` "uint8" or "int8" calibrated by min/max on `calibration` random normal inputs of
    the model's (static) input shape. Written to `path`; returns it."""
    import onnx
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    if activations not in ("uint8", "int8"):
        raise ValueError(f"quantize_onnx_file: activations must be 'uint8' or 'int8', got {activations!r}")
    graph_input = onnx.load(str(fp32)).graph.input[0]
    shape = [d.dim_value for d in graph_input.type.tensor_type.shape.dim]
    rng = np.random.default_rng(seed)
    feeds = [{graph_input.name: rng.standard_normal(shape).astype(np.float32)} for _ in range(calibration)]

    class Feeds(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter(feeds)

        def get_next(self):
            return next(self.feeds, None)

    path = Path(path)
    with tempfile.TemporaryDirectory() as work:
        prepared = Path(work) / "prepared.onnx"
        quant_pre_process(str(fp32), str(prepared))
        quantize_static(str(prepared), str(path), Feeds(), quant_format=QuantFormat.QDQ, per_channel=per_channel,
                        activation_type=QuantType.QUInt8 if activations == "uint8" else QuantType.QInt8,
                        weight_type=QuantType.QInt8)
    return path


def quantized_onnx(name: str, path: str | os.PathLike, size: int = 64, *, per_channel: bool = True,
                   activations: str = "uint8", calibration: int = 8, seed: int = 0) -> Path:
    """torchvision model `name` (random weights, :func:`~.torchvision_zoo.load`) at 1 x 3 x `size`
    x `size`, exported to ONNX (opset 17, input "x") and quantized (:func:`quantize_onnx_file`).
    Written to `path`; returns it."""
    import torch

    model = load(name, size, seed)
    with tempfile.TemporaryDirectory() as work:
        fp32 = Path(work) / "fp32.onnx"
        with torch.no_grad():
            torch.onnx.export(model, (torch.randn(1, 3, size, size),), str(fp32), opset_version=17, dynamo=False,
                              input_names=["x"], output_names=["y"])
        return quantize_onnx_file(fp32, path, per_channel=per_channel, activations=activations,
                                  calibration=calibration, seed=seed)
