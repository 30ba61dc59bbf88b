"""ops.conv2d_backward_data against PyTorch autograd in float64, over random convolutions:
strides 1, 2, 3 and 4 (and unequal ones), padding (asymmetric too), dilation, groups and
depthwise, odd sizes, batches of one and more."""

import numpy as np
import pytest
import torch
from reference import random_conv_cases, rel_err, torch_conv

from tvm_ext import ops


def _reference_dx(x_shape, w, dy, stride, padding, dilation, groups) -> np.ndarray:
    x = torch.zeros(x_shape, dtype=torch.float64, requires_grad=True)
    torch_conv(x, torch.from_numpy(w).double(), stride, padding, dilation, groups).backward(
        torch.from_numpy(dy).double())
    return x.grad.numpy()


RANDOM = random_conv_cases(200, 20261205)


@pytest.mark.parametrize("index", range(len(RANDOM)), ids=[f"r{i}" for i in range(len(RANDOM))])
def test_backward_data_matches_autograd(index):
    case = RANDOM[index]
    rng = np.random.default_rng(index)
    w = rng.standard_normal(case["w_shape"]).astype(np.float32)
    out_shape = torch_conv(torch.zeros(case["x_shape"]), torch.from_numpy(w), case["stride"], case["padding"],
                            case["dilation"], case["groups"]).shape
    dy = rng.standard_normal(tuple(out_shape)).astype(np.float32)
    got = ops.conv2d_backward_data(dy, w, case["x_shape"], stride=case["stride"], padding=case["padding"],
                                   dilation=case["dilation"], groups=case["groups"])
    expected = _reference_dx(case["x_shape"], w, dy, case["stride"], case["padding"], case["dilation"],
                             case["groups"])
    assert got.shape == expected.shape
    assert rel_err(got, expected) <= 1e-5, case


def test_random_cases_cover_the_space():
    strides = {c["stride"] if isinstance(c["stride"], int) else "pair" for c in RANDOM}
    assert {1, 2, 3, 4, "pair"} <= strides
    assert any(c["dilation"] > 1 for c in RANDOM) and any(c["x_shape"][0] > 1 for c in RANDOM)
    assert any(c["groups"] == c["x_shape"][1] > 1 for c in RANDOM)  # depthwise
    assert any(1 < c["groups"] < c["x_shape"][1] for c in RANDOM)
    assert any(isinstance(c["padding"], tuple) for c in RANDOM)


def test_resnet_layers():
    """A 3x3 stride-1 and a 3x3 stride-2 ResNet-like layer, and a strided 1x1 (whose odd pixels
    get no gradient)."""
    rng = np.random.default_rng(1)
    for c, k, size, kernel, stride, padding in ((32, 32, 14, 3, 1, 1), (32, 64, 14, 3, 2, 1), (64, 128, 14, 1, 2, 0)):
        w = rng.standard_normal((k, c, kernel, kernel)).astype(np.float32)
        out = (size + 2 * padding - kernel) // stride + 1
        dy = rng.standard_normal((2, k, out, out)).astype(np.float32)
        got = ops.conv2d_backward_data(dy, w, (2, c, size, size), stride=stride, padding=padding)
        assert rel_err(got, _reference_dx((2, c, size, size), w, dy, stride, padding, 1, 1)) <= 1e-5


@pytest.mark.parametrize("args, message", [
    (((1, 8, 4, 4), (8, 8, 3, 3), (1, 8, 6, 6), {"padding": 1}), "dy has shape"),
    (((1, 8, 4, 4), (8, 4, 3, 3), (1, 8, 6, 6), {"padding": 1}), "channel mismatch"),
    (((1, 8, 4, 4), (8, 8, 3, 3), (8, 6, 6), {}), "x_shape"),
    (((1, 8, 4), (8, 8, 3, 3), (1, 8, 6, 6), {}), "dy"),
])
def test_bad_input_raises(args, message):
    dy_shape, w_shape, x_shape, kw = args
    with pytest.raises(ValueError, match=message):
        ops.conv2d_backward_data(np.ones(dy_shape, np.float32), np.ones(w_shape, np.float32), x_shape, **kw)


def test_a_batch_of_no_images():
    dx = ops.conv2d_backward_data(np.ones((0, 8, 6, 6), np.float32), np.ones((8, 4, 3, 3), np.float32),
                                  (0, 4, 6, 6), padding=1)
    assert dx.shape == (0, 4, 6, 6) and dx.dtype == np.float32
