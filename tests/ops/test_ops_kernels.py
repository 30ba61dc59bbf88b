"""What ops' compiled kernels allocate and what a repeated call costs besides its kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm

from tvm_ext import ops
from tvm_ext.kernels.conv2d import (
    WEIGHT_BLOCKS_PER_THREAD,
    Conv2dWorkload,
    Epilogue,
    conv2d_blocked_kernel,
    plan_conv2d,
    reading_oihw_weights,
    weight_block_reason,
)
from tvm_ext.ops import forward
from tvm_ext.target import resolve_target, vector_isa


def test_nchw_output_row_lives_on_the_stack():
    """ops' kernels write NCHW through a scratch row per task: on the task's stack, not from
    TVMBackendAllocWorkspace (a call and a free per task: 0.11 ms of a 0.72 ms ResNet layer)."""
    isa = vector_isa("llvm")
    plan = plan_conv2d(Conv2dWorkload.make((1, 512, 28, 28), (1024, 512, 1, 1), 2, 0), isa)
    func = conv2d_blocked_kernel(plan, isa.lanes, Epilogue(nchw_out=True))
    assert plan.oc_bn * min(plan.wl.OW, plan.m_r) * 4 > 1024  # above TVM's own limit for the stack
    lib = forward.compile_kernel(func, resolve_target("llvm"))
    assert "ptr @__TVMBackendAllocWorkspace" not in lib.mod.inspect_source("ll")


def test_a_repeated_call_does_not_ask_llvm_for_the_cpu(monkeypatch):
    """Resolving the default target asked LLVM for the host CPU on every call (44 us of a small
    conv2d's 60): the host target is read once per process."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 16, 8, 8), dtype=np.float32)
    w = rng.standard_normal((16, 16, 3, 3), dtype=np.float32)
    expected = ops.conv2d(x, w, padding=1)
    calls = []
    real = tvm.target.codegen.llvm_get_system_cpu
    monkeypatch.setattr(tvm.target.codegen, "llvm_get_system_cpu", lambda: calls.append(1) or real())
    for _ in range(3):
        np.testing.assert_array_equal(ops.conv2d(x, w, padding=1), expected)
    assert not calls


@pytest.mark.parametrize("x_shape,w_shape,stride,padding,bias", [
    ((2, 128, 9, 7), (1040, 128, 3, 3), 1, 1, True),   # 22 blocks, the last one partly zero; 2 images
    ((1, 512, 9, 9), (1024, 512, 1, 1), 2, 0, False),  # a strided 1x1 reading NCHW in place
    ((1, 256, 5, 6), (1088, 256, 3, 3), 2, (0, 1, 2, 1), True),
])
def test_large_weights_are_laid_out_inside_the_convolution(x_shape, w_shape, stride, padding, bias):
    """conv2d's weights come unpacked on every call: large ones are read in OIHW by the
    convolution, each output block's laid out by the task that computes it (no packing pass),
    and the result is the convolution's; Conv2d (prepacked) keeps the blocked weights."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal(x_shape, dtype=np.float32)
    w = rng.standard_normal(w_shape, dtype=np.float32)
    b = rng.standard_normal(w_shape[0], dtype=np.float32) if bias else None
    torch_padding = padding if isinstance(padding, int) else 0
    xt = torch.from_numpy(x).double()
    if not isinstance(padding, int):  # (top, left, bottom, right)
        xt = torch.nn.functional.pad(xt, (padding[1], padding[3], padding[0], padding[2]))
    expected = torch.nn.functional.conv2d(xt, torch.from_numpy(w).double(),
                                          None if b is None else torch.from_numpy(b).double(),
                                          stride=stride, padding=torch_padding).numpy()
    for got in (ops.conv2d(x, w, b, stride=stride, padding=padding),
                ops.Conv2d(w, b, stride=stride, padding=padding)(x)):
        assert got.shape == expected.shape
        assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
    options = forward.conv_options("conv2d", w.shape, stride, padding, 1, 1)
    unpacked = forward._conv_kernel(x.shape, w.shape, bias, *options, None)
    prepacked = forward._conv_kernel(x.shape, w.shape, bias, *options, None, prepacked=True)
    assert unpacked.plan.oihw_weight and unpacked.pack_weight is None and unpacked.weight is None
    assert not prepacked.plan.oihw_weight and prepacked.pack_weight is not None


def test_small_weights_keep_their_packing_pass():
    """Below the size where a separate packing pass costs, or with too few output blocks to
    share among the threads as tasks, the convolution reads blocked weights."""
    plan = ops.conv2d_plan((1, 64, 56, 56), (64, 64, 3, 3), padding=1)
    assert "small weights" in weight_block_reason(plan)
    plan = ops.conv2d_plan((1, 512, 14, 14), (128, 512, 3, 3), padding=1)
    assert plan.OCB < 2 * WEIGHT_BLOCKS_PER_THREAD
    assert weight_block_reason(plan, threads=1) is None
    assert "too few tasks for 2 threads" in weight_block_reason(plan, threads=2)
    assert reading_oihw_weights(plan, threads=2) == plan
