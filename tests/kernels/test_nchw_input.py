"""Convolutions that read their data in NCHW (Conv2dPlan.nchw_in): a strided view of channel
blocks over the NCHW tensor, with no packing copy, where the convolution has no padding."""

import dataclasses

import numpy as np
import pytest
import tvm
from reference import conv2d_nchw, kernel_calls, one_input_graph, rel_err
from tvm import relax

import tvm_ext
from tvm_ext.kernels import conv2d as cv
from tvm_ext.target import vector_isa

TARGET = tvm_ext.resolve_target("llvm")
ISA = vector_isa(TARGET)


def _blocked_out(y: np.ndarray, channels: int) -> np.ndarray:
    n, cb, h, w, b = y.shape
    return y.transpose(0, 1, 4, 2, 3).reshape(n, cb * b, h, w)[:, :channels]


# N, C, H, W, K, (KH, KW), stride, dilation: ShuffleNet's 58 channels, odd channels and sizes,
# strided 1x1 (ResNet's downsampling), a valid 3x3 with dilation, two images
CASES = [
    (1, 58, 28, 28, 58, (1, 1), 1, 1),
    (2, 17, 9, 13, 24, (3, 3), 2, 1),
    (1, 64, 14, 14, 40, (1, 1), 2, 1),
    (1, 32, 11, 10, 16, (3, 3), 1, 2),
]


@pytest.mark.parametrize("case", CASES, ids=[f"c{c[1]}k{c[4]}" for c in CASES])
def test_kernel_reads_nchw(case):
    N, C, H, W, K, kernel, stride, dilation = case
    rng = np.random.default_rng(C * K)
    x = rng.standard_normal((N, C, H, W)).astype(np.float32)
    w = rng.standard_normal((K, C, *kernel)).astype(np.float32)
    wl = cv.Conv2dWorkload.make(x.shape, w.shape, stride, 0, dilation)
    plan = dataclasses.replace(cv.plan_conv2d(wl, ISA), nchw_in=True)
    assert cv.nchw_input_reason(plan) is None and plan.data_shape() == x.shape
    lib = tvm.compile(cv.conv2d_blocked_kernel(plan, ISA.lanes), TARGET)
    out = tvm.runtime.tensor(np.full(plan.out_shape(), np.nan, np.float32))
    lib(tvm.runtime.tensor(x), tvm.runtime.tensor(cv.pack_weight_array(plan, w)), out)
    expected = conv2d_nchw(x, w, None, (stride, stride), (0, 0, 0, 0), (dilation, dilation))
    assert rel_err(_blocked_out(out.numpy(), K), expected) < 1e-5


def test_which_plans_read_nchw():
    def reason(x_shape, w_shape, **kw):
        wl = cv.Conv2dWorkload.make(x_shape, w_shape, kw.get("stride", 1), kw.get("padding", 0), 1,
                                    kw.get("groups", 1))
        return cv.nchw_input_reason(cv.plan_conv2d(wl, ISA))

    assert reason((1, 64, 8, 8), (64, 64, 1, 1)) is None
    assert "padding" in reason((1, 64, 8, 8), (64, 64, 3, 3), padding=1)
    assert "depthwise" in reason((1, 64, 8, 8), (64, 1, 3, 3), groups=64)
    pointwise = cv.plan_conv2d(cv.Conv2dWorkload.make((1, 64, 8, 8), (64, 64, 1, 1)), ISA)
    padded = cv.plan_conv2d(cv.Conv2dWorkload.make((1, 64, 8, 8), (64, 64, 3, 3), 1, 1), ISA)
    assert cv.reading_nchw(pointwise) == dataclasses.replace(pointwise, nchw_in=True)
    assert cv.reading_nchw(padded) is padded


def test_graph_input_is_read_without_a_copy():
    """A 1x1 convolution of the graph's NCHW input reads it as it is: no pack kernel, and the
    same numbers as stock TVM; a padded one still packs (the copy carries the zero border)."""
    rng = np.random.default_rng(4)

    def body(bb, x):
        w1 = relax.const(rng.standard_normal((16, 24, 1, 1)).astype(np.float32))
        w3 = relax.const(rng.standard_normal((16, 24, 3, 3)).astype(np.float32))
        a = bb.emit(relax.op.nn.relu(relax.op.nn.conv2d(x, w1, strides=2)))
        b = bb.emit(relax.op.nn.conv2d(x, w3, strides=2, padding=1))
        return bb.emit(relax.op.add(a, relax.op.nn.max_pool2d(b, (1, 1))))

    mod = one_input_graph((1, 24, 14, 14), body)
    calls = kernel_calls(mod, TARGET)
    assert not [c for c in calls if "16x3x3" in c and "_nchw" in c], calls
    assert [c for c in calls if "16x1x1" in c and c.endswith("_nchw_conv2d_relu")], calls
    assert sum(c.startswith("tvm_ext_pack_nchwc") for c in calls) == 1  # the 3x3's padded copy
    x = rng.standard_normal((1, 24, 14, 14)).astype(np.float32)
    run = lambda ex: relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()  # noqa: E731
    assert rel_err(run(tvm_ext.build(mod, TARGET)), run(tvm.compile(mod, "llvm"))) < 1e-5


def test_tuning_workloads_name_nchw_input_only_when_set():
    """A workload's description (what tuning records are found by) names nchw_in only when it
    is set: records tuned before it existed still match the blocked kernels."""
    from tvm_ext.tuning.space import PLAN_ATTR, conv2d_workload, describe_kernel

    wl = cv.Conv2dWorkload.make((1, 32, 8, 8), (32, 32, 1, 1))
    plan = cv.plan_conv2d(wl, ISA)
    blocked = conv2d_workload(plan, cv.Epilogue(), ISA)
    assert "nchw_in" not in str(blocked.attrs[PLAN_ATTR]) and describe_kernel(blocked)[0] == plan
    nchw = dataclasses.replace(plan, nchw_in=True)
    assert describe_kernel(conv2d_workload(nchw, cv.Epilogue(), ISA))[0] == nchw
