"""A grouped convolution whose groups are narrower than its producer's blocks (RegNet-X: groups
of 16 channels after a 1x1 convolution writing blocks of 32) reads the groups inside those blocks
(Conv2dPlan.data_bn) instead of an unpacked and re-blocked copy. Checked against stock TVM."""

import re

import numpy as np
import pytest
import tvm
from reference import built_kernels, rel_err
from tvm import relax

import tvm_ext

TARGET = tvm_ext.resolve_target("llvm")


def _const(rng, *shape):
    return relax.const((rng.standard_normal(shape) * 0.2).astype(np.float32))


def _regnet_block(rng, channels: int, width: int, group: int, stride: int) -> tvm.IRModule:
    """1x1 -> grouped 3x3 (`group` channels a group) -> 1x1, + a 1x1 shortcut, relu (RegNet-X)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, channels, 14, 14), "float32"))

    def conv(y, k, c, size=1, stride=1, groups=1):
        return relax.op.add(relax.op.nn.conv2d(y, _const(rng, k, c // groups, size, size), strides=stride,
                                               padding=size // 2, groups=groups), _const(rng, 1, k, 1, 1))

    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.relu(conv(x, width, channels)))
            y = bb.emit(relax.op.nn.relu(conv(y, width, width, 3, stride, width // group)))
            y = bb.emit(conv(y, width, width))
            out = bb.emit_output(relax.op.nn.relu(relax.op.add(y, conv(x, width, channels, stride=stride))))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize(("channels", "width", "group", "stride"),
                         [(64, 160, 16, 1), (64, 160, 16, 2), (96, 256, 32, 1)])
def test_grouped_convolution_reads_its_producers_blocks(channels, width, group, stride):
    rng = np.random.default_rng(3)
    mod = _regnet_block(rng, channels, width, group, stride)
    x = rng.standard_normal((1, channels, 14, 14)).astype(np.float32)
    run = lambda ex: relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()  # noqa: E731
    assert rel_err(run(tvm_ext.build(mod, TARGET)), run(tvm.compile(mod, "llvm"))) < 1e-5
    kernels = built_kernels(mod, TARGET)
    assert not [name for name in kernels if f"pack_nchwc_1x{width}x" in name], kernels  # no re-blocked copy
    grouped = [name for name in kernels if f"_g{width // group}_" in name]
    producer = [name for name in kernels if f"1x{channels}x14x14_{width}x1x1_s1x1" in name and "relu" in name]
    assert len(grouped) == 1 and len(producer) == 1, kernels
    block = int(re.search(r"_x\d+y(\d+)", producer[0]).group(1))
    if block > group:  # groups inside the producer's wider blocks
        assert f"_in{block}" in grouped[0], kernels
