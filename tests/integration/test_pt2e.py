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
from tvm_ext.models.pt2e import from_pt2e
from tvm_ext.strategy.quantized import int8_engine
from tvm_ext.target import resolve_target

pt2e = pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
x86 = pytest.importorskip("torchao.quantization.pt2e.quantizer.x86_inductor_quantizer")

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
    """torchao's PT2E flow: export, annotate for x86, calibrate on random batches, convert, export."""
    torch.manual_seed(0)
    example = torch.randn(*shape)
    quantizer = x86.X86InductorQuantizer()
    quantizer.set_global(x86.get_default_x86_inductor_quantization_config())
    prepared = pt2e.prepare_pt2e(torch.export.export(model.eval(), (example,)).module(), quantizer)
    for _ in range(8):
        prepared(torch.randn(*shape))
    converted = pt2e.convert_pt2e(prepared)
    return converted, torch.export.export(converted, (example,))


@pytest.mark.skipif(int8_engine(TARGET) is None, reason="the CPU has neither AMX-INT8 nor VNNI")
def test_a_pt2e_network_runs_on_the_int8_kernels():
    """The convolutions whose outputs the quantizer quantizes run on the int8 kernels (the one
    whose float output feeds the residual add stays float, with its reason); the outputs follow
    PyTorch's quantized module (within its quantization's rounding: the kernels round the float
    bias to the sums' unit) and stock TVM's float arithmetic of the same module."""
    shape = (2, 3, 20, 20)
    converted, program = _quantized(_Net(), shape)
    mod = from_pt2e(program)
    report = tvm_ext.dispatch_report(mod, TARGET)
    int8_rows = [row for row in report if row.kernel.startswith("int8_conv2d")]
    assert len(int8_rows) >= 3, str(report)
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
    assert (got.argmax(1) == expected.argmax(1)).all()


class _ReducedRange(torch.nn.Module):
    def forward(self, x):
        ops = torch.ops.quantized_decomposed
        return ops.dequantize_per_tensor(ops.quantize_per_tensor(x, 0.1, 0, 0, 127, torch.uint8),
                                         0.1, 0, 0, 127, torch.uint8)


def test_a_quantization_the_kernels_do_not_take_is_refused_by_name():
    program = torch.export.export(_ReducedRange(), (torch.randn(1, 4, 3, 3),))
    with pytest.raises(UnsupportedError, match=r"quantize_per_tensor.*\[0, 127\].*reduced range"):
        from_pt2e(program)
