"""Layout kernels (NCHW <-> NCHW[x]c, zero borders) and pooling on blocked tensors."""

import numpy as np
import pytest
import torch
import tvm
from reference import rel_err

from tvm_ext.kernels.layout import pack_nchwc_func, pad_nchwc_func, unpack_nchwc_func
from tvm_ext.kernels.pool2d import Pool2dWorkload, global_avg_pool2d_func, pool2d_func

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": "znver3"})


def _run(func, *arrays, out_shape):
    out = tvm.runtime.tensor(np.full(out_shape, np.nan, np.float32))
    tvm.compile(func, TARGET)(*(tvm.runtime.tensor(a) for a in arrays), out)
    return out.numpy()


def _blocked(x: np.ndarray, block: int) -> np.ndarray:
    n, c, h, w = x.shape
    return np.ascontiguousarray(x.reshape(n, c // block, block, h, w).transpose(0, 1, 3, 4, 2))


@pytest.mark.parametrize("shape,block,pads", [((1, 32, 7, 9), 16, (1, 1, 1, 1)), ((2, 24, 5, 13), 8, (0, 2, 3, 1)),
                                              ((1, 3, 11, 6), 3, (3, 3, 3, 3)), ((1, 96, 4, 4), 32, (0, 0, 0, 0)),
                                              ((1, 64, 6, 21), 32, (2, 0, 1, 3)), ((1, 16, 3, 5), 4, (1, 0, 0, 1))])
def test_pack_pad_unpack_round_trip(shape, block, pads):
    x = np.random.default_rng(sum(shape)).standard_normal(shape).astype("float32")
    top, left, bottom, right = pads
    n, c, h, w = shape
    padded_shape = (n, c // block, h + top + bottom, w + left + right, block)
    expected = _blocked(np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right))), block)
    packed = _run(pack_nchwc_func(shape, block, pads), x, out_shape=padded_shape)
    np.testing.assert_array_equal(packed, expected)
    xb = _blocked(x, block)
    np.testing.assert_array_equal(_run(pad_nchwc_func(xb.shape, pads), xb, out_shape=padded_shape), expected)
    np.testing.assert_array_equal(_run(unpack_nchwc_func(xb.shape, c), xb, out_shape=shape), x)
    if c > block:  # the channels that only fill the last block are dropped
        kept = c - block // 2
        np.testing.assert_array_equal(_run(unpack_nchwc_func(xb.shape, kept), xb, out_shape=(n, kept, h, w)),
                                      x[:, :kept])


def test_layout_kernels_reject_bad_blocks():
    with pytest.raises(ValueError, match="multiple of the block"):
        pack_nchwc_func((1, 12, 4, 4), 8)
    with pytest.raises(ValueError, match="do not fit"):
        unpack_nchwc_func((1, 2, 4, 4, 8), 17)
    with pytest.raises(ValueError, match="multiple of the block"):
        pool2d_func(Pool2dWorkload.make((1, 12, 4, 4), "max", 2), block=8)


@pytest.mark.parametrize("mode,kernel,stride,pad,ceil,include", [
    ("max", 3, 2, 1, False, True), ("max", 2, 2, 0, True, True), ("avg", 3, 2, 1, False, False),
    ("avg", 3, 1, 1, False, True), ("avg", 2, 2, 0, False, True)])
def test_blocked_pooling_matches_pytorch(mode, kernel, stride, pad, ceil, include):
    x = np.random.default_rng(kernel * 10 + stride).standard_normal((2, 32, 13, 11)).astype("float32")
    wl = Pool2dWorkload.make(x.shape, mode, kernel, stride, pad, ceil_mode=ceil, count_include_pad=include)
    got = _run(pool2d_func(wl, block=16), _blocked(x, 16), out_shape=(2, 2, wl.OH, wl.OW, 16))
    xt = torch.from_numpy(x).double()
    if mode == "max":
        ref = torch.nn.functional.max_pool2d(xt, kernel, stride, pad, ceil_mode=ceil)
    else:
        ref = torch.nn.functional.avg_pool2d(xt, kernel, stride, pad, ceil_mode=ceil, count_include_pad=include)
    assert rel_err(got, _blocked(ref.numpy(), 16)) <= 1e-6


def test_blocked_global_average_pool():
    x = np.random.default_rng(3).standard_normal((2, 48, 7, 5)).astype("float32")
    got = _run(global_avg_pool2d_func((2, 3, 7, 5, 16)), _blocked(x, 16), out_shape=(2, 3, 1, 1, 16))
    assert rel_err(got, _blocked(x.astype(np.float64).mean((2, 3), keepdims=True), 16)) <= 1e-6


@pytest.mark.parametrize("dtype", ["uint8", "int8"])
@pytest.mark.parametrize("channels,h,w,block_in,block,pads", [
    (40, 6, 5, 16, 64, (0, 0, 0, 0)),  # blocks of 64 from blocks of 16, 24 channels past C
    (112, 4, 7, 16, 16, (1, 1, 1, 1)),  # the same blocks, a border
    (40, 3, 9, 48, 8, (1, 2, 0, 1)),  # blocks of 8 from blocks of 48
    (72, 5, 3, 48, 64, (2, 0, 1, 1)),  # neither divides the other: a channel at a time
    (3, 8, 9, 3, 4, (0, 0, 0, 0)),  # an RGB image's 3 channels into a block of 4
])
def test_quantized_blocks_write_the_quantized_pack_of_fp32_blocks(dtype, channels, h, w, block_in, block, pads):
    """quantized_blocks_func(fp32 blocks) == pack_quantized(quantize(unpack(blocks))), bit for bit,
    with round to nearest even (exact ties included) and saturation; the fp32 blocks' channels
    past C (NaN here) are never read into the output."""
    from tvm_ext.kernels.layout import pack_quantized_func, quantized_blocks_func

    rng = np.random.default_rng(channels + block)
    scale, zero = 0.05, (7 if dtype == "uint8" else -3)
    offset = 128 if dtype == "int8" else 0
    blocks = -(-channels // block_in)
    x = (rng.standard_normal((1, blocks * block_in, h, w)) * 5).astype(np.float32)
    ties = rng.random(x.shape) < 0.2
    x[ties] = ((rng.integers(-300, 300, ties.sum()) + 0.5) * scale).astype(np.float32)  # k + 0.5 steps
    x[:, channels:] = np.nan
    top, left, bottom, right = pads
    out_shape = (1, -(-channels // block), h + top + bottom, w + left + right, block)
    got = tvm.runtime.tensor(np.zeros(out_shape, np.uint8))
    tvm.compile(quantized_blocks_func((1, blocks, h, w, block_in), channels, block, pads, scale, zero, dtype),
                TARGET)(tvm.runtime.tensor(_blocked(x, block_in)), got)
    low, high = (-128, 127) if dtype == "int8" else (0, 255)
    q = np.clip(np.rint(x[:, :channels] / np.float32(scale)) + zero, low, high).astype(dtype)
    assert np.rint(np.float32(0.5)) == 0 and (np.abs(x[:, :channels] / np.float32(scale) % 1 - 0.5) < 1e-6).any()
    expected = tvm.runtime.tensor(np.zeros(out_shape, np.uint8))
    tvm.compile(pack_quantized_func(q.shape, block, pads, zero + offset, dtype), TARGET)(tvm.runtime.tensor(q),
                                                                                        expected)
    np.testing.assert_array_equal(got.numpy(), expected.numpy())
    assert (got.numpy() == zero + offset).mean() < 0.9 and len(np.unique(got.numpy())) > 50


@pytest.mark.parametrize("dtype", ["uint8", "int8"])
@pytest.mark.parametrize("rows, channels, block", [(49, 384, 16), (5, 40, 16), (3, 1000, 64), (1, 7, 16)])
def test_a_dense_layers_rows_pack_and_unpack_in_one_pass(dtype, rows, channels, block):
    """pack_quantized_rows of a (rows, channels) matrix is pack_quantized of the 1 x rows image
    of its transpose (channels past the matrix's hold the zero point), and unpack_quantized_rows
    gives the matrix back: a quantized dense layer's input and output (strategy.quantized_rows)."""
    from tvm_ext.kernels.layout import pack_quantized_func, pack_quantized_rows_func, unpack_quantized_rows_func

    rng = np.random.default_rng(rows + channels)
    low, high = (-128, 127) if dtype == "int8" else (0, 255)
    x = rng.integers(low, high + 1, (rows, channels)).astype(dtype)
    blocked_shape = (1, -(-channels // block), 1, rows, block)
    got, expected = (tvm.runtime.tensor(np.zeros(blocked_shape, np.uint8)) for _ in range(2))
    tvm.compile(pack_quantized_rows_func(rows, channels, block, 42, dtype), target="llvm")(tvm.runtime.tensor(x), got)
    tvm.compile(pack_quantized_func((1, channels, 1, rows), block, (0, 0, 0, 0), 42, dtype), target="llvm")(
        tvm.runtime.tensor(np.ascontiguousarray(x.T).reshape(1, channels, 1, rows)), expected)
    np.testing.assert_array_equal(got.numpy(), expected.numpy())
    back = tvm.runtime.tensor(np.zeros((rows, channels), dtype))
    tvm.compile(unpack_quantized_rows_func(blocked_shape, channels, dtype), target="llvm")(got, back)
    np.testing.assert_array_equal(back.numpy(), x)
