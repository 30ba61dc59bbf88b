"""The passes between the blocked layout and the maxDNN tile's (images in the vector lanes):
exact copies, zero borders and zero images, the epilogue applied on the way back; both the
register-transpose and the element-wise forms, on random shapes."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from tvm_ext.kernels import conv2d_maxdnn as M
from tvm_ext.kernels import maxdnn_layout as L
from tvm_ext.kernels.conv2d import Conv2dWorkload
from tvm_ext.target import AVX2, AVX512


def _blocked(x: np.ndarray, block: int) -> np.ndarray:
    """NCHW -> (N, ceil(C/block), H, W, block), the last block's extra channels random (a
    producer that pads them writes finite values the reader must ignore)."""
    n, c, h, w = x.shape
    padded = np.random.default_rng(0).standard_normal((n, -(-c // block) * block, h, w)).astype(np.float32)
    padded[:, :c] = x
    return np.ascontiguousarray(padded.reshape(n, -1, block, h, w).transpose(0, 1, 3, 4, 2))


def _cases(count: int, seed: int) -> list[tuple]:
    """(plan, input block or None, output block) for random convolutions."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < count:
        N = int(rng.choice([1, 3, 8, 16, 17, 33, 64]))
        groups = int(rng.choice([1, 1, 1, 2]))
        C = groups * int(rng.choice([3, 8, 12, 16, 24]))
        K = groups * int(rng.choice([8, 16, 24, 40]))
        R = int(rng.choice([1, 3, 5]))
        H, W = int(rng.integers(R, R + 6)), int(rng.integers(R, R + 6))
        stride, padding = int(rng.choice([1, 2])), tuple(int(p) for p in rng.integers(0, 3, size=4))
        isa = AVX512 if rng.random() < 0.7 else AVX2
        try:
            wl = Conv2dWorkload.make((N, C, H, W), (K, C // groups, R, R), stride, padding, 1, groups)
        except ValueError:
            continue
        in_block = [None, 4, 8, 16][rng.integers(4)]
        out_block = int(rng.choice([b for b in (4, 8, 16, 32) if K % b == 0]))
        out.append((M.MaxDNNCpuPlan.make(wl, isa), in_block, out_block))
    return out


CASES = _cases(40, seed=35)


def _run(func, *arrays: np.ndarray, out_shape) -> np.ndarray:
    lib = tvm.compile(func, "llvm")
    out = tvm.runtime.tensor(np.full(out_shape, np.nan, np.float32))  # every element written
    lib(*(tvm.runtime.tensor(a) for a in arrays), out)
    return out.numpy()


@pytest.mark.parametrize("plan, in_block, out_block", CASES)
def test_layout_passes_match_the_host_side_layouts(plan, in_block, out_block):
    wl, rng = plan.wl, np.random.default_rng(1)
    x = rng.standard_normal((wl.N, wl.C, wl.H, wl.W)).astype(np.float32)
    source = x if in_block is None else _blocked(x, in_block)
    got = _run(L.tile_input_func(plan, source.shape, in_block), source, out_shape=plan.data_shape())
    np.testing.assert_array_equal(got, M.pack_data(plan, x))

    sums = rng.standard_normal(plan.out_shape()).astype(np.float32)
    bias = rng.standard_normal(wl.K).astype(np.float32)
    residual = rng.standard_normal((wl.N, wl.K, wl.OH, wl.OW)).astype(np.float32)
    out_shape = (wl.N, wl.K // out_block, wl.OH, wl.OW, out_block)
    plain = _run(L.tile_output_func(plan, out_block), sums, out_shape=out_shape)
    np.testing.assert_array_equal(plain, _blocked(M.unpack_output(plan, sums), out_block))
    epilogue = M.Epilogue(bias=True, residual=True, activation="leaky_relu", alpha=0.2)
    got = _run(L.tile_output_func(plan, out_block, epilogue), sums, bias, _blocked(residual, out_block),
               out_shape=out_shape)
    value = M.unpack_output(plan, sums) + bias[None, :, None, None] + residual
    np.testing.assert_allclose(got, _blocked(np.where(value < 0, 0.2 * value, value), out_block), rtol=1e-6)


def test_layout_passes_refuse_mismatched_shapes():
    plan = M.MaxDNNCpuPlan.make(Conv2dWorkload.make((16, 24, 7, 7), (32, 24, 3, 3), 1, 1), AVX512)
    with pytest.raises(ValueError, match="source"):
        L.tile_input_func(plan, (16, 3, 7, 7, 4), 4)  # 12 channels, not 24
    with pytest.raises(ValueError, match="source"):
        L.tile_input_func(plan, (16, 24, 7, 8), None)
    with pytest.raises(ValueError, match="does not divide"):
        L.tile_output_func(plan, 24)
    with pytest.raises(ValueError, match="activation"):
        M.Epilogue(activation="tanh")
    with pytest.raises(ValueError, match="residual is added by the output pass"):
        M.maxdnn_conv2d_func(plan, M.Epilogue(residual=True))
