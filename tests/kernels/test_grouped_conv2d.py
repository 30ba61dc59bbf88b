"""Grouped convolutions with 2-8 channels a group (ResNeXt's 32 groups of 4 or 8): the depthwise
microkernel with a group size, several groups to a vector, in the blocked layout of the
convolutions around it. Checked against float64 PyTorch, with infinities too."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import tvm
from reference import built_kernels, rel_err
from tvm import relax

import tvm_ext
from tvm_ext import ops
from tvm_ext.intrin.cpu_depthwise import DepthwiseTile
from tvm_ext.target import vector_isa

TARGET = tvm_ext.resolve_target("llvm")
LANES = vector_isa(TARGET).lanes

# N, C, H, W, groups, (KH, KW), stride, padding, dilation: channels per group 2, 4, 8 (8 is a
# whole AVX2 vector: the BRGEMM there), pixel tails, strides, dilation, asymmetric padding
CASES = [
    (1, 64, 11, 13, 16, (3, 3), 1, 1, 1),
    (2, 64, 12, 9, 8, (3, 3), 2, 1, 1),
    (1, 32, 10, 17, 16, (3, 3), 1, 2, 2),
    (1, 48, 9, 9, 12, (5, 5), (2, 1), (1, 2, 0, 2), 1),
    (1, 128, 7, 7, 32, (1, 3), 1, (0, 1), 1),
]


def _reference(x, w, b, stride, padding, dilation, groups):
    if isinstance(padding, tuple) and len(padding) == 4:  # top, left, bottom, right
        x = np.pad(x, ((0, 0), (0, 0), (padding[0], padding[2]), (padding[1], padding[3])))
        padding = 0
    return F.conv2d(torch.from_numpy(x).double(), torch.from_numpy(w).double(), torch.from_numpy(b).double(),
                    stride, padding, dilation, groups).numpy()


@pytest.mark.parametrize("case", CASES, ids=[f"c{c[1]}g{c[4]}" for c in CASES])
def test_grouped_conv2d_matches_float64(case):
    N, C, H, W, groups, kernel, stride, padding, dilation = case
    rng = np.random.default_rng(C + groups)
    x = rng.standard_normal((N, C, H, W)).astype(np.float32)
    w = rng.standard_normal((C, C // groups, *kernel)).astype(np.float32)
    b = rng.standard_normal(C).astype(np.float32)
    plan = ops.conv2d_plan(x.shape, w.shape, stride=stride, padding=padding, dilation=dilation, groups=groups)
    assert plan.kind == ("grouped" if C // groups < LANES else "brgemm")
    got = ops.conv2d(x, w, b, stride=stride, padding=padding, dilation=dilation, groups=groups)
    assert rel_err(got, _reference(x, w, b, stride, padding, dilation, groups)) < 1e-5


def test_which_groups_take_the_grouped_kernel():
    """Groups of as many channels in as out that tile a vector; other groups keep their kernels."""
    plan = ops.conv2d_plan((1, 128, 56, 56), (128, 4, 3, 3), padding=1, groups=32)  # ResNeXt-50's first
    assert (plan.kind, plan.ic_bn, plan.oc_bn) == ("grouped", LANES, LANES)
    assert ops.conv2d_plan((1, 64, 8, 8), (64, LANES, 3, 3), groups=64 // LANES).kind == "brgemm"
    assert ops.conv2d_plan((1, 6, 9, 9), (9, 2, 3, 3), groups=3).kind == "direct"  # 2 in, 3 out a group
    assert ops.conv2d_plan((1, 12, 9, 9), (12, 4, 3, 3), groups=3).kind == "direct"  # 12 channels: no vector


def test_infinity_stays_in_its_group():
    """No zero weights stand for the other groups' channels: 0 * inf would make every channel
    of the block NaN. Infinities and NaNs land where float64 PyTorch puts them, nowhere else."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 64, 9, 9)).astype(np.float32)
    x[0, 5, 4, 4], x[0, 22, 0, 8], x[0, 41, 3, 3] = np.inf, -np.inf, np.nan
    w = rng.standard_normal((64, 4, 3, 3)).astype(np.float32)
    b = np.zeros(64, np.float32)
    got, ref = ops.conv2d(x, w, b, padding=1, groups=16), _reference(x, w, b, 1, 1, 1, 16)
    assert (np.isnan(got) == np.isnan(ref)).all() and (np.isinf(got) == np.isinf(ref)).all()
    finite = np.isfinite(ref)
    assert rel_err(got[finite], ref[finite]) < 1e-5


def test_tile_rejects_groups_that_do_not_tile_the_lanes():
    with pytest.raises(ValueError, match="groups of 3"):
        DepthwiseTile(4, 16, 16, (3, 3), group=3).validate()
    assert DepthwiseTile(4, 16, 16, (3, 3), group=4).name.endswith("_g4")


def _resnext_block(rng, channels=32, width=64, groups=16):
    """1x1 -> grouped 3x3 -> 1x1 + x, relu after each (ResNeXt's bottleneck, small)."""
    def const(*shape):
        return relax.const((rng.standard_normal(shape) * 0.2).astype(np.float32))

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, channels, 14, 14), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.relu(relax.op.nn.conv2d(x, const(width, channels, 1, 1))))
            y = bb.emit(relax.op.nn.relu(relax.op.add(
                relax.op.nn.conv2d(y, const(width, width // groups, 3, 3), padding=(1, 1), groups=groups),
                const(1, width, 1, 1))))
            y = bb.emit(relax.op.nn.relu(relax.op.add(relax.op.nn.conv2d(y, const(channels, width, 1, 1)), x)))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def test_resnext_block_stays_blocked():
    """The grouped layer reads and writes the blocks of the 1x1 layers around it: no layout copy
    of its 64-channel input or output (the direct schedule's 4-channel blocks needed both)."""
    rng = np.random.default_rng(0)
    mod = _resnext_block(rng)
    x = rng.standard_normal((1, 32, 14, 14)).astype(np.float32)
    ours = relax.VirtualMachine(tvm_ext.build(mod, TARGET), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    stock = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    assert rel_err(ours, stock) < 1e-5
    report = tvm_ext.dispatch_report(mod, TARGET)
    assert "grouped_conv2d" in str(report)
    names = built_kernels(mod, TARGET)
    assert not [name for name in names if "pack_nchwc_1x64x" in name or "pack_nchwc_1x4x" in name], names
