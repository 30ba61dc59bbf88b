"""What ops' compiled kernels allocate and what a repeated call costs besides its kernel."""

from __future__ import annotations

import numpy as np
import tvm

from tvm_ext import ops
from tvm_ext.kernels.conv2d import Conv2dWorkload, Epilogue, conv2d_blocked_kernel, plan_conv2d
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
