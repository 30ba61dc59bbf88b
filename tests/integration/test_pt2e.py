"""PyTorch PT2E-quantized exports (torchao's X86InductorQuantizer) imported with
`tvm_ext.models.from_pt2e` and run on the int8 kernels: right against PyTorch's own quantized
module, and a quantization the kernels do not take refused with the node's name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvm_ext
from tvm_ext.errors import UnsupportedError
from tvm_ext.models.pt2e import from_pt2e, one_relu_per_call, quantize_pt2e
from tvm_ext.strategy.quantized import int8_engine
from tvm_ext.target import resolve_target

pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")

TARGET = resolve_target("llvm")


class _Net(torch.nn.Module):
    """Strided and padded 3x3 convolutions with bias and relu, a 1x1 one, a residual add + relu
    (each relu a module of its own: the quantizer's patterns are by module), average pooling and
    a classifier."""

    def __init__(self):
        super().__init__()
        self.conv1, self.relu1 = torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU()
        self.conv2, self.relu2 = torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU()
        self.conv3, self.relu3 = torch.nn.Conv2d(32, 32, 3, padding=(1, 1)), torch.nn.ReLU()
        self.conv4, self.relu4 = torch.nn.Conv2d(32, 32, 1), torch.nn.ReLU()
        self.pool, self.fc = torch.nn.AdaptiveAvgPool2d(1), torch.nn.Linear(32, 10)

    def forward(self, x):
        y = self.relu2(self.conv2(self.relu1(self.conv1(x))))
        z = self.relu3(self.conv3(y))
        z = self.relu4(self.conv4(z) + y)
        return self.fc(torch.flatten(self.pool(z), 1))


def _quantized(model: torch.nn.Module, shape: tuple[int, ...]) -> tuple[torch.nn.Module, torch.export.ExportedProgram]:
    """torchao's PT2E flow (quantize_pt2e), calibrated on random batches."""
    torch.manual_seed(0)
    return quantize_pt2e(model, torch.randn(*shape), [torch.randn(*shape) for _ in range(8)])


@pytest.mark.skipif(int8_engine(TARGET) is None, reason="the CPU has neither AMX-INT8 nor VNNI")
def test_a_pt2e_network_runs_on_the_int8_kernels():
    """Every convolution runs on the int8 kernels, the one whose float output feeds the residual
    add with the add and relu in its epilogue (the quantizer quantizes the sum only: float
    kernels before 0.5.33), the classifier as a 1x1 one (float before 0.5.36); the outputs
    follow PyTorch's quantized module (within its quantization's rounding: the kernels round the
    float bias to the sums' unit) and stock TVM's float arithmetic of the same module."""
    shape = (2, 3, 20, 20)
    converted, program = _quantized(_Net(), shape)
    mod = from_pt2e(program)
    report = tvm_ext.dispatch_report(mod, TARGET)
    int8_rows = [row for row in report if row.kernel.startswith("int8_conv2d")]
    assert [row.op for row in int8_rows] == ["nn.conv2d"] * 4 + ["add", "matmul"], str(report)
    assert "PT2E" in int8_rows[-2].reason
    assert int8_rows[-1].shapes == ((2, 32), (32, 10)) and "float32 out" in int8_rows[-1].reason
    x = torch.randn(*shape)
    expected = converted(x).detach().numpy()

    def run(ex) -> np.ndarray:
        out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x.numpy()))
        return (out[0] if isinstance(out, tvm.ir.Array) or not hasattr(out, "numpy") else out).numpy()

    got, stock = run(tvm_ext.build(mod, TARGET)), run(tvm.compile(mod, TARGET))
    scale = np.abs(expected).max()
    # A quantized value rounded the other way at a tie moves the output by up to 3e-3 of its
    # range here (stock TVM's float arithmetic of the module as much as the int8 kernels); a
    # wrong scale or zero point moves it by 10x that and more.
    for name, out in (("stock TVM", stock), ("tvm_ext", got)):
        assert np.abs(out - expected).max() <= 1e-2 * scale, (name, np.abs(out - expected).max() / scale)
    # the same top-1 where it is not a near tie (random input: two logits within the rounding
    # above of each other picked either way, 1 run in ~50)
    top2 = np.sort(expected, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2e-2 * scale
    assert (got.argmax(1) == expected.argmax(1))[clear].all()


@pytest.mark.skipif(int8_engine(TARGET) is None, reason="the CPU has neither AMX-INT8 nor VNNI")
def test_a_torchvision_resnet_quantizes_with_one_relu_per_call():
    """torchvision's ResNet blocks call one ReLU module several times, which torchao's quantizer
    refuses; with a ReLU per call the same network quantizes, and every convolution and residual
    add runs on the int8 kernels (each add in its convolution's epilogue), the max pooling on the
    quantized tensor, right against PyTorch's quantized module."""
    from tvm_ext.models import torchvision_zoo

    model = torchvision_zoo.load("resnet18", 32)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        before = model(x)
        assert torch.equal(one_relu_per_call(model)(x), before)  # the same network
    converted, program = _quantized(model, (1, 3, 32, 32))
    mod = from_pt2e(program)
    report = tvm_ext.dispatch_report(mod, TARGET)
    convs = [row for row in report if row.op == "nn.conv2d"]
    assert len(convs) == 20 and all(row.kernel.startswith("int8_conv2d") for row in convs)
    assert sum(row.op == "add" and "PT2E" in row.reason for row in report) == 8  # every block's
    # (max_pool2d_with_indices imports as a tuple of the pooling and zeros: read through it)
    assert [row.kernel for row in report if row.op == "nn.max_pool2d"] == ["quantized_max_pool"]
    x = torch.randn(1, 3, 32, 32)
    expected = converted(x).detach().numpy()
    out = relax.VirtualMachine(tvm_ext.build(mod, TARGET), tvm.cpu())["main"](tvm.runtime.tensor(x.numpy()))
    got = (out[0] if isinstance(out, tvm.ir.Array) or not hasattr(out, "numpy") else out).numpy()
    # (2.7e-2 seen: the integer sums and PyTorch's float32 ones round a few values at the first
    # layers the other way, and a random network spreads those steps; a dropped add is O(1))
    assert np.abs(got - expected).max() <= 5e-2 * np.abs(expected).max()
    assert got.argmax() == expected.argmax()


class _ReducedRange(torch.nn.Module):
    def forward(self, x):
        ops = torch.ops.quantized_decomposed
        return ops.dequantize_per_tensor(ops.quantize_per_tensor(x, 0.1, 0, 0, 127, torch.uint8),
                                         0.1, 0, 0, 127, torch.uint8)


def test_a_quantization_the_kernels_do_not_take_is_refused_by_name():
    program = torch.export.export(_ReducedRange(), (torch.randn(1, 4, 3, 3),))
    with pytest.raises(UnsupportedError, match=r"quantize_per_tensor.*\[0, 127\].*reduced range"):
        from_pt2e(program)
