"""PyTorch PT2E-quantized exports as Relax, in the QDQ form the int8 kernels run.

`torchao`'s PT2E flow (`prepare_pt2e`, calibration, `convert_pt2e`, then `torch.export`) writes
a quantized network as float ops between `quantized_decomposed` quantize / dequantize calls:
uint8 activations per tensor, int8 weights per channel (frozen constants), the bias in float.
TVM's torch importer reads none of those ops. :func:`from_pt2e` imports them as
`relax.quantize` / `relax.dequantize`, the form ONNX Runtime's QDQ models import to, so the
pipeline's int8 lowering (:mod:`tvm_ext.strategy.quantized`) serves both.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
from tvm import relax

from ..errors import UnsupportedError

if TYPE_CHECKING:
    import torch
    from tvm.ir import IRModule

_RANGES = {"uint8": (0, 255), "int8": (-128, 127)}


def _dtype(node, value) -> str:
    name = str(value).replace("torch.", "")
    if name not in _RANGES:
        raise UnsupportedError(f"from_pt2e: {node.name} quantizes to {name}; the int8 kernels take uint8 and int8")
    return name


def _check_range(node, dtype: str, low, high) -> None:
    """PT2E's quant_min / quant_max must be the dtype's (relax's quantize clamps to those)."""
    if (int(low), int(high)) != _RANGES[dtype]:
        raise UnsupportedError(f"from_pt2e: {node.name} clamps {dtype} to [{low}, {high}], not the whole range "
                               f"{list(_RANGES[dtype])} (a reduced range is not supported)")


def _tensors(program: torch.export.ExportedProgram) -> dict[str, np.ndarray]:
    """The program's parameters, buffers and constants by the name of the placeholder that reads
    them (PT2E's scales and zero points are buffers; the importer binds them only at the end)."""
    signature = program.graph_signature
    by_name = {**program.state_dict, **program.constants}
    placeholders = {**signature.inputs_to_parameters, **signature.inputs_to_buffers,
                    **getattr(signature, "inputs_to_lifted_tensor_constants", {})}
    return {node: by_name[name].detach().numpy() for node, name in placeholders.items() if name in by_name}


class _Converters:
    """The converters of PT2E's ops, reading scales and zero points off `program`."""

    def __init__(self, program: torch.export.ExportedProgram):
        self.tensors = _tensors(program)

    def constant(self, node, arg, dtype: str) -> relax.Expr:
        """A scale or zero point (a Python number or a tensor of the program) as a `dtype` constant."""
        value = self.tensors.get(arg.name) if hasattr(arg, "name") else arg
        if value is None:
            raise UnsupportedError(f"from_pt2e: {node.name} takes a scale or zero point computed at run time")
        return relax.const(np.asarray(value).astype(dtype))

    def convert(self, node, importer, quantize: bool, per_channel: bool) -> relax.Var:
        """quantize_per_tensor / dequantize_per_tensor (x, scale, zero_point, quant_min, quant_max,
        dtype) or dequantize_per_channel (q, scales, zero_points, axis, quant_min, quant_max, dtype)."""
        x, scale, zero = node.args[:3]
        axis, (low, high, dtype) = (int(node.args[3]), node.args[4:7]) if per_channel else (1, node.args[3:6])
        dtype = _dtype(node, dtype)
        _check_range(node, dtype, low, high)
        args = (importer._retrieve_args(x), self.constant(node, scale, "float32"), self.constant(node, zero, dtype))
        op = relax.op.quantize(*args, axis=axis, out_dtype=dtype) if quantize else relax.op.dequantize(*args, axis=axis)
        return importer.block_builder.emit(op)

    def convert_map(self) -> dict:
        maps = {"quantize_per_tensor": (True, False), "dequantize_per_tensor": (False, False),
                "dequantize_per_channel": (False, True)}
        return {f"{name}.{overload}": functools.partial(self.convert, quantize=quantize, per_channel=per_channel)
                for name, (quantize, per_channel) in maps.items() for overload in ("default", "tensor")
                if not (per_channel and overload == "tensor")}


def pt2e_convert_map(program: torch.export.ExportedProgram) -> dict:
    """`custom_convert_map` entries for `relax.frontend.torch.from_exported_program` that import
    `program`'s PT2E quantize / dequantize ops (see :func:`from_pt2e`)."""
    return _Converters(program).convert_map()


def from_pt2e(program: torch.export.ExportedProgram) -> IRModule:
    """A PT2E-quantized network (`torch.export` of `convert_pt2e`'s module) as a Relax module whose
    weights are constants and whose quantization is `relax.quantize` / `relax.dequantize`:
    `tvm_ext.build` runs its quantized convolutions on the int8 kernels. A quantization the
    kernels do not take (another dtype, a reduced range, scales computed at run time) is an
    UnsupportedError naming the node."""
    from tvm.relax.frontend.torch import from_exported_program

    return from_exported_program(program, custom_convert_map=pt2e_convert_map(program))


def quantize_pt2e(model: torch.nn.Module, example: torch.Tensor,
                  calibration: Iterable[torch.Tensor]) -> tuple[torch.nn.Module, torch.export.ExportedProgram]:
    """torchao's PT2E flow for x86 (`X86InductorQuantizer`'s default configuration: uint8
    activations per tensor, int8 weights per channel): export `model` (in eval mode) at
    `example`, annotate, calibrate on `calibration`, convert; (the quantized module, its
    `torch.export`) — the program :func:`from_pt2e` imports. Needs torchao."""
    import torch
    from torchao.quantization.pt2e import quantize_pt2e as pt2e
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as x86

    quantizer = x86.X86InductorQuantizer()
    quantizer.set_global(x86.get_default_x86_inductor_quantization_config())
    prepared = pt2e.prepare_pt2e(torch.export.export(model.eval(), (example,)).module(), quantizer)
    with torch.no_grad():
        for batch in calibration:
            prepared(batch)
    converted = pt2e.convert_pt2e(prepared)
    return converted, torch.export.export(converted, (example,))


def one_relu_per_call(model: torch.nn.Module) -> torch.nn.Module:
    """`model` (changed in place) with each torchvision ResNet block (BasicBlock, Bottleneck:
    ResNet, ResNeXt, wide ResNet) calling a ReLU module of its own at each of its relus.
    X86InductorQuantizer's patterns are by module, and those blocks call one ReLU module two or
    three times: torchao fails on them ("Input partition has more than one output node")."""
    import torch

    from .torchvision_zoo import import_torchvision

    resnet = import_torchvision().models.resnet
    BasicBlock, Bottleneck = resnet.BasicBlock, resnet.Bottleneck  # noqa: N806 (classes)

    def forward(block, x):
        identity = x if block.downsample is None else block.downsample(x)
        out = block.relu_1(block.bn1(block.conv1(x)))
        if isinstance(block, Bottleneck):
            out = block.bn3(block.conv3(block.relu_2(block.bn2(block.conv2(out)))))
        else:
            out = block.bn2(block.conv2(out))
        return block.relu_out(out + identity)

    for module in model.modules():
        if isinstance(module, BasicBlock | Bottleneck):
            module.relu_1, module.relu_2, module.relu_out = (torch.nn.ReLU() for _ in range(3))
            module.forward = types.MethodType(forward, module)
    return model
