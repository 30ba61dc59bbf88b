"""channel_scale_func: x * s with one gate per image and channel (squeeze-excitation), in NCHW
and in blocked layouts, a padded last block scaled by the last channel's gate."""

import numpy as np
import pytest
import tvm

from tvm_ext.kernels.elementwise import channel_scale_func
from tvm_ext.target import resolve_target, vector_isa

TARGET = resolve_target("llvm")


@pytest.mark.parametrize(("shape", "channels"), [
    ((2, 24, 7, 5), None),  # NCHW
    ((1, 4, 28, 28, 32), None),  # blocked
    ((1, 4, 28, 28, 32), 120),  # MobileNet-v3's 120 channels in four blocks of 32
    ((2, 5, 9, 7, 16), 72),
])
def test_channel_scale(shape, channels):
    lanes = vector_isa(TARGET).lanes
    func = channel_scale_func(shape, lanes, channels)
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), TARGET)
    rng = np.random.default_rng(4)
    total = shape[1] * shape[4] if len(shape) == 5 else shape[1]
    channels = channels or total
    x = rng.standard_normal(shape).astype(np.float32)
    s = rng.standard_normal((shape[0], channels, 1, 1)).astype(np.float32)
    out = tvm.runtime.empty(shape, "float32")
    lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(s), out)
    gates = np.concatenate([s[:, :, 0, 0], np.repeat(s[:, -1:, 0, 0], total - channels, axis=1)], axis=1)
    if len(shape) == 5:
        expected = x * gates.reshape(shape[0], shape[1], 1, 1, shape[4])
    else:
        expected = x * gates.reshape(shape[0], shape[1], 1, 1)
    np.testing.assert_array_equal(out.numpy(), expected)


def test_padded_gates_are_read_as_vectors():
    """The padded block's gates are laid out per task before its pixels: the vectorized loop reads
    them contiguously, not through a clamped index (a gather a lane: 32 against 5 us)."""
    script = channel_scale_func((1, 4, 28, 28, 32), 16, 120).script()
    out_block = script[script.index('T.sblock("out")'):]
    assert "T.min" not in out_block
    assert script.index("T.parallel") < script.index('T.sblock("gates")')
