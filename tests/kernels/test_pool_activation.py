"""Pooling and activations through tvm_ext.ops against NumPy / PyTorch semantics."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tvm_ext import ops
from tvm_ext.kernels.common import KERNEL_ATTR
from tvm_ext.kernels.pool2d import Pool2dWorkload, global_avg_pool2d_func, pool2d_func

CASES = [
    # shape, kernel, stride, padding, ceil_mode
    ((1, 3, 13, 11), 3, 2, 1, False),
    ((2, 16, 16, 16), 2, 2, 0, False),
    ((1, 8, 15, 17), (3, 2), (2, 1), (1, 0), False),
    ((1, 5, 13, 13), 3, 2, 0, True),
    ((1, 64, 112, 112), 3, 2, 1, False),
]


@pytest.mark.parametrize("case", CASES)
def test_max_pool2d(case):
    shape, k, s, p, ceil = case
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    ref = F.max_pool2d(torch.from_numpy(x), k, s, p, ceil_mode=ceil).numpy()
    np.testing.assert_array_equal(ops.max_pool2d(x, k, s, p, ceil_mode=ceil), ref)


@pytest.mark.parametrize("case", [c for c in CASES if not c[4]])
@pytest.mark.parametrize("include_pad", [True, False])
def test_avg_pool2d(case, include_pad):
    shape, k, s, p, _ = case
    x = np.random.default_rng(1).standard_normal(shape, dtype=np.float32)
    ref = F.avg_pool2d(torch.from_numpy(x).double(), k, s, p, count_include_pad=include_pad).numpy()
    np.testing.assert_allclose(ops.avg_pool2d(x, k, s, p, count_include_pad=include_pad), ref, rtol=1e-5, atol=1e-6)


def test_max_pool2d_dilation():
    x = np.random.default_rng(2).standard_normal((1, 4, 12, 12), dtype=np.float32)
    ref = F.max_pool2d(torch.from_numpy(x), 3, 1, 1, dilation=2).numpy()
    np.testing.assert_array_equal(ops.max_pool2d(x, 3, 1, 1, dilation=2), ref)


def test_global_avg_pool2d():
    x = np.random.default_rng(3).standard_normal((2, 32, 7, 7), dtype=np.float32)
    np.testing.assert_allclose(ops.global_avg_pool2d(x), x.astype(np.float64).mean((2, 3), keepdims=True),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 5, 1, 5, 2), (1, 3, 4, 1, 8), (2, 2, 1, 1, 16)])
def test_global_avg_pool2d_of_a_single_row_or_column(shape):
    """Blocked data one pixel high or wide: compute_at dropped the unit loop and the schedule
    failed (found by the random graphs, seed 53)."""
    import tvm

    x = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    y = tvm.runtime.empty((*shape[:2], 1, 1, *shape[4:]), "float32", tvm.cpu())
    tvm.compile(global_avg_pool2d_func(shape), "llvm")(tvm.runtime.tensor(x), y)
    np.testing.assert_allclose(y.numpy(), x.astype(np.float64).mean((2, 3), keepdims=True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 3, 5, 112), (2, 4, 3, 56), (1, 2, 2, 14), (1, 2, 4, 7), (1, 3, 1, 1),
                                   (1, 2, 1, 48)])
def test_global_avg_pool2d_of_nchw_rows_sums_in_vectors(shape):
    """NCHW data (a squeeze-excitation's pooling of a dequantized tensor, PT2E EfficientNets):
    rows of an even width are summed in independent lanes (one chain of scalar adds was
    latency-bound, 0.17 ms for 32 x 112 x 112), odd widths in one chain."""
    import tvm

    func = global_avg_pool2d_func(shape)
    assert ("lane_sum" in func.script()) == (shape[3] % 2 == 0)
    x = np.random.default_rng(5).standard_normal(shape).astype(np.float32) + 3
    y = tvm.runtime.empty((*shape[:2], 1, 1), "float32", tvm.cpu())
    tvm.compile(func, "llvm")(tvm.runtime.tensor(x), y)
    np.testing.assert_allclose(y.numpy(), x.astype(np.float64).mean((2, 3), keepdims=True), rtol=1e-6)


def test_pool_bad_input():
    x = np.ones((1, 2, 4, 4), np.float32)
    with pytest.raises(ValueError, match="larger than"):
        ops.max_pool2d(x, 7)
    with pytest.raises(ValueError, match="half the kernel"):
        ops.max_pool2d(x, 2, 1, 2)
    with pytest.raises(ValueError, match="4-D"):
        ops.max_pool2d(np.ones((2, 4, 4), np.float32), 2)
    with pytest.raises(ValueError, match="mode"):
        Pool2dWorkload.make((1, 2, 4, 4), "min", 2)


@pytest.mark.parametrize("size", [1, 7, 64, 1000, 3 * 224 * 224])
def test_activations(size):
    x = np.random.default_rng(size).standard_normal(size, dtype=np.float32) * 5
    np.testing.assert_array_equal(ops.relu(x), np.maximum(x, 0))
    np.testing.assert_array_equal(ops.relu6(x), np.clip(x, 0, 6))
    np.testing.assert_allclose(ops.sigmoid(x), 1 / (1 + np.exp(-x.astype(np.float64))), rtol=1e-5, atol=1e-6)
    xt = torch.from_numpy(x).double()
    np.testing.assert_allclose(ops.silu(x), torch.nn.functional.silu(xt).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ops.gelu(x), torch.nn.functional.gelu(xt).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ops.leaky_relu(x, 0.3), torch.nn.functional.leaky_relu(xt, 0.3).numpy(), rtol=1e-6)
    np.testing.assert_allclose(ops.hardswish(x), torch.nn.functional.hardswish(xt).numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ops.hardsigmoid(x), torch.nn.functional.hardsigmoid(xt).numpy(), rtol=1e-6, atol=1e-7)
    special = np.array([np.nan, np.inf, -np.inf, -3.0, 3.0], np.float32)  # NaN stays NaN, as in PyTorch
    np.testing.assert_array_equal(ops.hardswish(special), torch.nn.functional.hardswish(torch.from_numpy(special)))
    np.testing.assert_array_equal(ops.hardsigmoid(special), torch.nn.functional.hardsigmoid(torch.from_numpy(special)))


def test_activation_keeps_shape_and_rejects_unknown():
    x = np.random.default_rng(5).standard_normal((2, 3, 4, 5), dtype=np.float32)
    assert ops.relu(x).shape == x.shape
    from tvm_ext.kernels.elementwise import activation_func

    with pytest.raises(ValueError, match="tanh"):
        activation_func("tanh", (4,), "float32", 8)
    with pytest.raises(ValueError, match="float64"):
        ops.relu(np.ones(4))


def test_kernel_attribute():
    func = pool2d_func(Pool2dWorkload.make((1, 2, 4, 4), "max", 2))
    assert str(func.attrs[KERNEL_ATTR]) == "max_pool2d"


def test_vector_exp_is_accurate_and_vectorizes():
    """vector_exp (behind sigmoid and SiLU): within 3e-7 of float64 exp over the float32 range it
    does not clamp, NaN stays NaN; and an exp kernel built from it calls no scalar expf."""
    import tvm
    from tvm import te

    from tvm_ext.kernels.vector_math import vector_exp
    from tvm_ext.target import resolve_target

    target = resolve_target("llvm")
    x = te.placeholder((4096,), "float32", name="x")
    y = te.compute((4096,), lambda i: vector_exp(x[i]), name="y")
    sch = tvm.s_tir.Schedule(te.create_prim_func([x, y]))
    _, inner = sch.split(sch.get_loops(sch.get_sblock("y"))[0], [None, 16])
    sch.vectorize(inner)
    lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target)
    assert "expf" not in lib.mod.inspect_source("asm")
    values = np.concatenate([np.linspace(-87, 88, 4093), [np.nan, -np.inf, 0.0]]).astype(np.float32)
    out = tvm.runtime.empty((4096,), "float32")
    lib["main"](tvm.runtime.tensor(values), out)
    got, ref = out.numpy()[:4093], np.exp(values[:4093].astype(np.float64))
    assert np.max(np.abs(got - ref) / ref) < 3e-7
    assert np.isnan(out.numpy()[4093]) and out.numpy()[4095] == 1.0


@pytest.mark.parametrize("shape,dtype", [((1, 2, 9, 7, 16), "uint8"), ((1, 3, 5, 7), "int8"), ((2, 37), "uint8")])
def test_fake_quantize_is_relax_quantize_then_dequantize_rounding_ties_to_even(shape, dtype):
    """One pass of dequantize(quantize(x)) (PT2E's fake quantization of a float tensor), bit for
    bit NumPy's (q - z2) * s2 of q = clip(rint(x / s) + z): exact ties, saturation, a tail past
    the vector loop."""
    import tvm

    from tvm_ext.kernels.elementwise import fake_quantize_func

    rng = np.random.default_rng(len(shape))
    scale, zero, out_scale, out_zero = 0.05, (7 if dtype == "uint8" else -3), 0.04, 5
    x = (rng.standard_normal(shape) * 5).astype(np.float32)
    ties = rng.random(shape) < 0.2
    x[ties] = ((rng.integers(-300, 300, ties.sum()) + 0.5) * scale).astype(np.float32)
    y = tvm.runtime.empty(shape, "float32", tvm.cpu())
    tvm.compile(fake_quantize_func(shape, 16, scale, zero, dtype, out_scale, out_zero), "llvm")(
        tvm.runtime.tensor(x), y)
    low, high = (-128, 127) if dtype == "int8" else (0, 255)
    q = np.clip(np.rint(x / np.float32(scale)) + zero, low, high).astype(np.int32)
    assert (q == low).any() and (q == high).any() and (np.abs(x / np.float32(scale) % 1 - 0.5) < 1e-6).any()
    np.testing.assert_array_equal(y.numpy(), (q - out_zero).astype(np.float32) * np.float32(out_scale))
