"""ops.conv2d_backward_data against PyTorch autograd in float64, over random convolutions:
strides 1, 2, 3 and 4 (and unequal ones), padding (asymmetric too), dilation, groups and
depthwise, odd sizes, batches of one and more."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from reference import rel_err

from tvm_ext import ops


def _torch_conv(x, w, stride, padding, dilation, groups):
    if isinstance(padding, tuple) and len(padding) == 4:  # top, left, bottom, right
        x = F.pad(x, (padding[1], padding[3], padding[0], padding[2]))
        padding = 0
    return F.conv2d(x, w, None, stride, padding, dilation, groups)


def _reference_dx(x_shape, w, dy, stride, padding, dilation, groups) -> np.ndarray:
    x = torch.zeros(x_shape, dtype=torch.float64, requires_grad=True)
    _torch_conv(x, torch.from_numpy(w).double(), stride, padding, dilation, groups).backward(
        torch.from_numpy(dy).double())
    return x.grad.numpy()


def _random_case(rng):
    groups = int(rng.choice([1, 1, 1, 2, 4, 0]))  # 0: depthwise
    cg, kg = int(rng.choice([1, 3, 8, 16])), int(rng.choice([1, 5, 8, 16]))
    if groups == 0:
        groups, cg, kg = int(rng.choice([8, 16, 24])), 1, 1
        c = groups
    else:
        c = groups * cg
    k = groups * kg
    kh, kw = [(1, 1), (3, 3), (3, 3), (5, 5), (1, 3), (3, 1), (2, 2), (7, 7)][rng.integers(8)]
    stride = int(rng.choice([1, 1, 2, 2, 3, 4]))
    if rng.random() < 0.15:
        stride = (int(rng.choice([1, 2])), int(rng.choice([1, 2, 3])))
    dilation = 1 if rng.random() < 0.8 else int(rng.choice([2, 3]))
    if rng.random() < 0.25:
        padding = tuple(int(v) for v in rng.integers(0, 3, size=4))
    else:
        padding = int(rng.integers(0, max(kh, kw) // 2 + 2))
    sh, sw = (stride, stride) if isinstance(stride, int) else stride
    pads = padding if isinstance(padding, tuple) else (padding,) * 4
    h = int(rng.integers(max(1, dilation * (kh - 1) + 1 - pads[0] - pads[2]), 20))
    w = int(rng.integers(max(1, dilation * (kw - 1) + 1 - pads[1] - pads[3]), 20))
    n = int(rng.choice([1, 1, 2, 3]))
    return dict(x_shape=(n, c, h, w), w_shape=(k, c // groups, kh, kw), stride=stride, padding=padding,
                dilation=dilation, groups=groups), (sh, sw)


def _cases(count: int, seed: int):
    rng = np.random.default_rng(seed)
    return [_random_case(rng)[0] for _ in range(count)]


RANDOM = _cases(200, 20261205)


@pytest.mark.parametrize("index", range(len(RANDOM)), ids=[f"r{i}" for i in range(len(RANDOM))])
def test_backward_data_matches_autograd(index):
    case = RANDOM[index]
    rng = np.random.default_rng(index)
    w = rng.standard_normal(case["w_shape"]).astype(np.float32)
    out_shape = _torch_conv(torch.zeros(case["x_shape"]), torch.from_numpy(w), case["stride"], case["padding"],
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
