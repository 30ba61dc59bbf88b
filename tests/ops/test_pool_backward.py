"""ops.max_pool2d_backward (and the kernel graphs use for relax.grad.max_pool2d_backward) against
PyTorch autograd: overlapping windows, padding, dilation, ceil_mode, ties (PyTorch's first
maximum), NaN and -inf windows."""

import numpy as np
import pytest
import torch

from tvm_ext import ops


def _expected(x, dy, kernel, stride, padding, dilation, ceil_mode):
    xt = torch.from_numpy(x).requires_grad_()
    torch.nn.functional.max_pool2d(xt, kernel, stride, padding, dilation, ceil_mode=ceil_mode).backward(
        torch.from_numpy(dy))
    return xt.grad.numpy()


@pytest.mark.parametrize("shape,kernel,stride,padding,dilation,ceil_mode", [
    ((2, 3, 11, 11), 3, 2, 1, 1, False),  # ResNet's stem: windows overlap
    ((1, 4, 8, 8), 2, 2, 0, 1, False),
    ((1, 2, 9, 7), 3, 2, 1, 2, True),
    ((3, 5, 10, 13), (3, 2), (1, 2), (1, 1), (1, 2), True),
    ((1, 1, 5, 5), 5, 1, 2, 1, False),
])
def test_matches_autograd(shape, kernel, stride, padding, dilation, ceil_mode):
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape).astype(np.float32)
    x[:, :, :3, :3] = 0.25  # ties: the first maximum takes the gradient
    x = np.where(rng.random(shape) < 0.3, 0.0, x).astype(np.float32)  # a relu's zeros
    y = torch.nn.functional.max_pool2d(torch.from_numpy(x), kernel, stride, padding, dilation, ceil_mode=ceil_mode)
    dy = rng.standard_normal(tuple(y.shape)).astype(np.float32)
    got = ops.max_pool2d_backward(dy, x, kernel, stride, padding, dilation, ceil_mode)
    np.testing.assert_allclose(got, _expected(x, dy, kernel, stride, padding, dilation, ceil_mode), rtol=1e-6,
                               atol=1e-6)


def test_nan_and_minus_infinity_windows():
    """A NaN is a window's maximum (PyTorch's rule); a window of -inf gives its first pixel."""
    x = np.zeros((1, 1, 4, 4), np.float32)
    x[0, 0, 0, 1] = np.nan
    x[0, 0, 2:, 2:] = -np.inf
    dy = np.arange(1, 5, dtype=np.float32).reshape(1, 1, 2, 2)
    np.testing.assert_array_equal(ops.max_pool2d_backward(dy, x, 2), _expected(x, dy, 2, 2, 0, 1, False))


def _blocked_kernel(dy, x, relu_mask, *pool):
    """The graphs' blocked kernel on NCHW arrays: channels packed in blocks of 16 (zeros past C)."""
    import tvm

    import tvm_ext
    from tvm_ext.kernels.pool2d import Pool2dWorkload
    from tvm_ext.kernels.pool2d_backward import max_pool2d_backward_blocked_func

    block, (n, c, h, w) = 16, x.shape
    blocks = -(-c // block)

    def packed(a):
        full = np.zeros((a.shape[0], blocks * block, *a.shape[2:]), np.float32)
        full[:, :c] = a
        return np.ascontiguousarray(full.reshape(a.shape[0], blocks, block, *a.shape[2:]).transpose(0, 1, 3, 4, 2))

    wl = Pool2dWorkload.make((n, blocks * block, h, w), "max", *pool)
    kernel = tvm.compile(max_pool2d_backward_blocked_func(wl, block, relu_mask), target=tvm_ext.resolve_target(None))
    out = tvm.runtime.tensor(np.full((n, blocks, h, w, block), np.nan, np.float32))
    kernel(tvm.runtime.tensor(packed(dy)), tvm.runtime.tensor(packed(x)), out)
    return out.numpy().transpose(0, 1, 4, 2, 3).reshape(n, blocks * block, h, w)[:, :c]


@pytest.mark.parametrize("relu_mask", [False, True])
@pytest.mark.parametrize("shape,kernel,stride,padding,dilation,ceil_mode", [
    ((2, 3, 11, 11), 3, 2, 1, 1, False),
    ((1, 20, 8, 8), 2, 2, 0, 1, False),
    ((1, 2, 9, 7), 3, 2, 1, 2, True),
    ((3, 5, 10, 13), (3, 2), (1, 2), (1, 1), (1, 2), True),
])
def test_blocked_kernel_matches_autograd(shape, kernel, stride, padding, dilation, ceil_mode, relu_mask):
    """Each lane of a vector keeps its own maximum and tap; ties, a relu's zeros, NaN and -inf
    windows as PyTorch; with `relu_mask`, relu's gradient of x too."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal(shape).astype(np.float32)
    x[:, :, :3, :3] = 0.25
    x = np.where(rng.random(shape) < 0.3, 0.0, x).astype(np.float32)
    x[0, 0, 0, 1], x[0, -1, -2:, -2:] = np.nan, -np.inf
    y = torch.nn.functional.max_pool2d(torch.from_numpy(x), kernel, stride, padding, dilation, ceil_mode=ceil_mode)
    dy = rng.standard_normal(tuple(y.shape)).astype(np.float32)
    expected = _expected(x, dy, kernel, stride, padding, dilation, ceil_mode)
    if relu_mask:
        expected = np.where(x > 0, expected, 0)
    got = _blocked_kernel(dy, x, relu_mask, kernel, stride, padding, dilation, ceil_mode)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_bad_input_raises():
    with pytest.raises(ValueError, match="dy has shape"):
        ops.max_pool2d_backward(np.ones((1, 2, 3, 3), np.float32), np.ones((1, 2, 8, 8), np.float32), 2)
    empty = ops.max_pool2d_backward(np.ones((0, 2, 4, 4), np.float32), np.ones((0, 2, 8, 8), np.float32), 2)
    assert empty.shape == (0, 2, 8, 8)


@pytest.mark.parametrize("shape,kernel,stride,padding,ceil_mode,count_include_pad", [
    ((2, 3, 11, 11), 3, 2, 1, False, True),  # overlapping windows
    ((1, 4, 8, 8), 2, 2, 0, False, True),  # DenseNet's transition
    ((1, 2, 9, 7), 3, 2, 1, True, False),  # ceil mode, padding not counted
    ((3, 5, 10, 13), (3, 2), (1, 2), (1, 1), True, True),
    ((1, 1, 5, 5), 5, 1, 2, False, False),
])
def test_avg_pool_gradient_matches_autograd(shape, kernel, stride, padding, ceil_mode, count_include_pad):
    rng = np.random.default_rng(4)
    xt = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).requires_grad_()
    y = torch.nn.functional.avg_pool2d(xt, kernel, stride, padding, ceil_mode, count_include_pad)
    dy = rng.standard_normal(tuple(y.shape)).astype(np.float32)
    y.backward(torch.from_numpy(dy))
    got = ops.avg_pool2d_backward(dy, shape, kernel, stride, padding, ceil_mode, count_include_pad)
    np.testing.assert_allclose(got, xt.grad.numpy(), rtol=1e-6, atol=1e-6)


def test_avg_pool_gradient_checks_its_arguments():
    with pytest.raises(ValueError, match="dy has shape"):
        ops.avg_pool2d_backward(np.ones((1, 2, 3, 3), np.float32), (1, 2, 8, 8), 2)
    with pytest.raises(ValueError, match="x_shape must be an integer or 4 integers"):
        ops.avg_pool2d_backward(np.ones((1, 2, 4, 4), np.float32), (2, 8, 8), 2)
    with pytest.raises(ValueError, match="x_shape must be 4 non-negative"):
        ops.avg_pool2d_backward(np.ones((1, 2, 4, 4), np.float32), 8, 2)
    with pytest.raises(ValueError, match="x_shape must be 4 non-negative"):
        ops.avg_pool2d_backward(np.ones((1, 2, 4, 4), np.float32), (1, -2, 8, 8), 2)
    assert ops.avg_pool2d_backward(np.ones((0, 2, 4, 4), np.float32), (0, 2, 8, 8), 2).shape == (0, 2, 8, 8)
