"""Tutorial 2: compile a PyTorch network through tvm_ext.

1. export a small ResNet-style CNN with `torch.export` and import it into Relax;
2. see which tvm_ext kernel serves each op (`tvm_ext.dispatch_report`), including the bias, batch
   norm, shortcut additions and activations fused into the convolutions (the blocks' 3x3
   convolutions run as Winograd F(4x4, 3x3); `winograd=False` keeps them direct);
3. build it (`tvm_ext.build`), run it on the Relax VM and compare with PyTorch and stock TVM.

Run: python tutorials/02_compile_a_network.py
"""

from __future__ import annotations

import time

import numpy as np
import torch
import tvm
from tvm import relax
from tvm.relax.frontend.torch import from_exported_program

import tvm_ext


class Block(torch.nn.Module):
    """conv-bn-relu-conv-bn + shortcut, relu: the ResNet basic block."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(channels)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(channels)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + x)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 32, 5, stride=2, padding=2)
        self.blocks = torch.nn.Sequential(Block(32), Block(32))
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x):
        x = torch.nn.functional.max_pool2d(torch.relu(self.stem(x)), 2)
        x = self.blocks(x)
        return self.head(x.mean((2, 3)))


def main() -> None:
    torch.manual_seed(0)
    net = Net().eval()
    for module in net.modules():  # give batch norm non-trivial statistics
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-0.1, 0.1)
            module.running_var.uniform_(0.8, 1.2)
    x = torch.randn(1, 3, 64, 64)

    # 1. PyTorch -> Relax. Weights become bound constants, so tvm_ext packs them (and folds batch
    #    norm into them) once, at build time.
    mod = from_exported_program(torch.export.export(net, (x,)), keep_params_as_input=False)

    # 2. What serves each op.
    target = tvm_ext.resolve_target("llvm")  # this host's CPU and vector ISA
    report = tvm_ext.dispatch_report(mod, target)
    print(report)

    # 3. Build, run, compare.
    ex = tvm_ext.build(mod, target)
    run = relax.VirtualMachine(ex, tvm.cpu())["main"]
    out = run(tvm.runtime.tensor(x.numpy()))
    out = (out[0] if not hasattr(out, "numpy") else out).numpy()
    with torch.no_grad():
        ref = net(x).numpy()
    err = np.abs(out - ref).max() / np.abs(ref).max()
    print(f"\nrelative error against PyTorch: {err:.1e}")
    assert err < 1e-4

    stock = relax.VirtualMachine(tvm.compile(mod, target), tvm.cpu())["main"]
    for name, fn in (("tvm_ext", run), ("stock TVM", stock)):
        arg = tvm.runtime.tensor(x.numpy())
        fn(arg)
        start = time.perf_counter()
        fn(arg)
        print(f"{name:10s} {1e3 * (time.perf_counter() - start):8.2f} ms")


if __name__ == "__main__":
    main()
