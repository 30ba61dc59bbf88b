"""Blocked activations whose last channel block is padded (72 channels in 5 blocks of 16): a
convolution writes the padded channels as zeros, and the convolutions, pools and activations
after it read the blocked tensor as it is; everything else reads the NCHW view. Checked against
stock TVM, with infinities in the input too (0 * inf in a padded channel must not reach a real
one)."""

import numpy as np
import pytest
import tvm
from reference import built_kernels, rel_err
from tvm import relax

import tvm_ext
from tvm_ext.kernels.layout import pack_nchwc_func

TARGET = tvm_ext.resolve_target("llvm")


def _const(rng, *shape):
    return relax.const((rng.standard_normal(shape) * 0.3).astype(np.float32))


def _inverted_residual(rng, channels: int = 24, hidden: int = 72, se: bool = True):
    """MobileNet's block at odd widths: 1x1 expand -> depthwise 3x3 -> [SE] -> 1x1 project + x,
    then a max pool, a standalone sigmoid and a global pool over padded blocks."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, channels, 10, 10), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.relu(relax.op.add(relax.op.nn.conv2d(x, _const(rng, hidden, channels, 1, 1)),
                                                      _const(rng, 1, hidden, 1, 1))))
            y = bb.emit(relax.op.clip(relax.op.nn.conv2d(y, _const(rng, hidden, 1, 3, 3), padding=(1, 1),
                                                         groups=hidden), 0, 6))
            if se:
                gate = bb.emit(relax.op.mean(y, axis=[2, 3], keepdims=True))
                gate = bb.emit(relax.op.nn.relu(relax.op.nn.conv2d(gate, _const(rng, 8, hidden, 1, 1))))
                gate = bb.emit(relax.op.sigmoid(relax.op.nn.conv2d(gate, _const(rng, hidden, 8, 1, 1))))
                y = bb.emit(relax.op.multiply(y, gate))
            y = bb.emit(relax.op.add(relax.op.nn.conv2d(y, _const(rng, channels, hidden, 1, 1)), x))
            z = bb.emit(relax.op.nn.conv2d(y, _const(rng, 40, channels, 3, 3), padding=(1, 1)))
            z = bb.emit(relax.op.sigmoid(relax.op.nn.max_pool2d(z, (2, 2), (2, 2))))
            z = bb.emit(relax.op.nn.adaptive_avg_pool2d(relax.op.nn.conv2d(z, _const(rng, 40, 40, 1, 1)), (1, 1)))
            out = bb.emit_output(relax.Tuple([y, z]))
        bb.emit_func_output(out)
    return bb.get()


def _run(ex, x):
    return [t.numpy() for t in relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x))]


@pytest.mark.parametrize("se", [True, False])
def test_padded_blocks_flow_between_convolutions(se):
    rng = np.random.default_rng(0)
    mod = _inverted_residual(rng, se=se)
    x = rng.standard_normal((1, 24, 10, 10)).astype(np.float32)
    ours, stock = _run(tvm_ext.build(mod, TARGET), x), _run(tvm.compile(mod, "llvm"), x)
    for a, b in zip(ours, stock, strict=True):
        assert rel_err(a, b) < 1e-5
    if not se:  # 72 channels in whole vectors from the expand layer to the project layer: no layout copy
        kernels = built_kernels(mod, TARGET)
        assert not [name for name in kernels if "pack_nchwc_1x72" in name or "unpack_nchwc_1x5x" in name]


def test_infinity_in_a_real_channel_does_not_reach_others_through_padding():
    """0 * inf is NaN: a padded output channel computed from an infinite input would be NaN, and
    the next convolution's zero weight for it would carry the NaN into every real channel. The
    epilogue writes zeros there instead, so the answer is stock TVM's, infinities and NaNs
    where stock TVM has them and nowhere else."""
    rng = np.random.default_rng(1)
    mod = _inverted_residual(rng, se=False)
    x = rng.standard_normal((1, 24, 10, 10)).astype(np.float32)
    x[0, 3, 4, 4] = np.inf
    ours, stock = _run(tvm_ext.build(mod, TARGET), x), _run(tvm.compile(mod, "llvm"), x)
    for a, b in zip(ours, stock, strict=True):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        np.testing.assert_array_equal(np.isinf(a), np.isinf(b))
        finite = np.isfinite(b)
        assert rel_err(a[finite], b[finite]) < 1e-5


def test_pack_pads_channels_with_zeros():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 20, 3, 5)).astype(np.float32)
    lib = tvm.compile(pack_nchwc_func(x.shape, 8, (1, 0, 0, 2), pad_channels=True), TARGET)
    y = tvm.runtime.tensor(np.full((1, 3, 4, 7, 8), np.nan, np.float32))
    lib["main"](tvm.runtime.tensor(x), y)
    expected = np.zeros((1, 24, 4, 7), np.float32)
    expected[:, :20, 1:, :5] = x
    np.testing.assert_array_equal(y.numpy(), expected.reshape(1, 3, 8, 4, 7).transpose(0, 1, 3, 4, 2))
    with pytest.raises(ValueError, match="not a multiple of the block"):
        pack_nchwc_func(x.shape, 8)
