"""`ops.conv2d(..., maxdnn=)` and `ops.Conv2d`: the maxDNN tile (images in the vector lanes) in the
primitive library, as `tvm_ext.build` has it: chosen by the same cost model ("auto"), or asked
for ("always") or refused ("never"), right against float64 either way."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tvm_ext import ops
from tvm_ext.kernels.conv2d import Conv2dPlan
from tvm_ext.kernels.conv2d_maxdnn import MaxDNNCpuPlan


def _case(rng: np.random.Generator) -> dict:
    """A dense convolution of any batch (to 19: not whole vectors of images), kernel to 5x5,
    stride, dilation, asymmetric padding, channel counts that fill no block, with or without bias."""
    kh, kw = (int(v) for v in rng.integers(1, 6, 2))
    dilation = tuple(int(v) for v in rng.integers(1, 3, 2))
    return {"n": int(rng.integers(1, 20)), "c": int(rng.integers(1, 40)), "k": int(rng.integers(1, 70)),
            "h": int(rng.integers((kh - 1) * dilation[0] + 1, 16)),
            "w": int(rng.integers((kw - 1) * dilation[1] + 1, 16)),
            "kernel": (kh, kw), "stride": tuple(int(v) for v in rng.integers(1, 4, 2)), "dilation": dilation,
            "padding": tuple(int(v) for v in rng.integers(0, 3, 4)), "bias": bool(rng.random() < 0.6)}


def _reference(x, w, b, cfg) -> np.ndarray:
    top, left, bottom, right = cfg["padding"]
    xt = torch.nn.functional.pad(torch.from_numpy(x).double(), (left, right, top, bottom))
    bias = None if b is None else torch.from_numpy(b).double()
    return torch.nn.functional.conv2d(xt, torch.from_numpy(w).double(), bias, cfg["stride"], 0, cfg["dilation"]).numpy()


def test_the_tile_matches_float64_over_random_convolutions():
    """24 random convolutions on the tile (`maxdnn="always"`), stateless and prepacked alike."""
    rng = np.random.default_rng(35)
    for _ in range(24):
        cfg = _case(rng)
        x = rng.standard_normal((cfg["n"], cfg["c"], cfg["h"], cfg["w"])).astype(np.float32)
        w = rng.standard_normal((cfg["k"], cfg["c"], *cfg["kernel"])).astype(np.float32)
        b = rng.standard_normal(cfg["k"]).astype(np.float32) if cfg["bias"] else None
        options = {"stride": cfg["stride"], "padding": cfg["padding"], "dilation": cfg["dilation"]}
        assert isinstance(ops.conv2d_plan(x.shape, w.shape, **options, maxdnn="always"), MaxDNNCpuPlan), cfg
        expected = _reference(x, w, b, cfg)
        scale = max(np.abs(expected).max(), 1e-30)
        got = ops.conv2d(x, w, b, **options, maxdnn="always")
        assert got.shape == expected.shape and np.abs(got - expected).max() / scale <= 1e-5, cfg
        prepacked = ops.Conv2d(w, b, **options, maxdnn="always")
        for _ in range(2):  # (packed once, then the same result)
            np.testing.assert_array_equal(prepacked(x), got)


def test_auto_chooses_the_tile_where_the_cost_model_does():
    """Large batches of one-pixel images (a squeeze-excitation's convolutions, a classifier) fill
    the blocked kernel's FMA slots by half: there "auto" takes the tile, elsewhere the blocked
    kernel; "never" never takes it, and a grouped convolution never can."""
    assert isinstance(ops.conv2d_plan((32, 480, 1, 1), (120, 480, 1, 1)), MaxDNNCpuPlan)
    assert isinstance(ops.conv2d_plan((32, 480, 1, 1), (120, 480, 1, 1), maxdnn="never"), Conv2dPlan)
    assert isinstance(ops.conv2d_plan((1, 256, 14, 14), (256, 256, 3, 3), padding=1), Conv2dPlan)
    grouped = ops.conv2d_plan((16, 32, 8, 8), (32, 8, 3, 3), padding=1, groups=4, maxdnn="always")
    assert isinstance(grouped, Conv2dPlan)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, 480, 1, 1)).astype(np.float32)
    w = rng.standard_normal((120, 480, 1, 1)).astype(np.float32)
    tile, blocked = (ops.conv2d(x, w, maxdnn=mode) for mode in ("auto", "never"))
    np.testing.assert_allclose(tile, blocked, rtol=1e-5, atol=1e-4)


def test_a_bad_maxdnn_option_is_refused_before_anything_compiles():
    x, w = np.ones((1, 4, 5, 5), np.float32), np.ones((4, 4, 3, 3), np.float32)
    with pytest.raises(ValueError, match="maxdnn must be one of"):
        ops.conv2d(x, w, maxdnn="sometimes")
    with pytest.raises(ValueError, match="maxdnn must be one of"):
        ops.Conv2d(w, maxdnn=True)
    with pytest.raises(ValueError, match="maxdnn must be one of"):
        ops.conv2d_plan(x.shape, w.shape, maxdnn="")


def test_data_aligned_as_numpy_aligns_it_is_read_in_place():
    """NumPy aligns an array to 16 bytes, not TVM's 64: the tile's input pass reads the user's
    NCHW array as it is, so it must not assume more (its aligned vector loads crashed the process
    on an array 16 bytes past a 64-byte boundary: a segmentation fault one run in three)."""
    rng = np.random.default_rng(3)
    for shape, w_shape in (((32, 480, 1, 1), (120, 480, 1, 1)), ((9, 16, 6, 7), (24, 16, 3, 3))):
        size = int(np.prod(shape))
        storage = ops.aligned_empty((size + 16,))
        x = storage[4:4 + size].reshape(shape)  # 16 bytes past a 64-byte boundary
        x[...] = rng.standard_normal(shape)
        assert x.ctypes.data % 64 == 16
        w = rng.standard_normal(w_shape).astype(np.float32)
        expected = ops.conv2d(np.ascontiguousarray(x), w, padding=1 if w_shape[2] == 3 else 0, maxdnn="never")
        for _ in range(3):
            got = ops.conv2d(x, w, padding=1 if w_shape[2] == 3 else 0, maxdnn="always")
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)
