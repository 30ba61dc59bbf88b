"""ops.conv2d_backward_weight against PyTorch autograd in float64, over random convolutions (the
generator of ops.conv2d_backward_data's tests, another seed), ResNet layers and the bias
gradient; the kernel is LIBXSMM's X^T dY batch-reduce on the BRGEMM microkernel."""

import numpy as np
import pytest
import torch
from reference import random_conv_cases, rel_err, torch_conv

from tvm_ext import ops
from tvm_ext.ops import backward


def _reference_dw(x, w_shape, dy, stride, padding, dilation, groups) -> tuple[np.ndarray, np.ndarray]:
    w = torch.zeros(w_shape, dtype=torch.float64, requires_grad=True)
    y = torch_conv(torch.from_numpy(x).double(), w, stride, padding, dilation, groups)
    y.backward(torch.from_numpy(dy).double())
    return w.grad.numpy(), dy.astype(np.float64).sum((0, 2, 3))


def _dy_shape(case) -> tuple[int, ...]:
    return tuple(torch_conv(torch.zeros(case["x_shape"]), torch.zeros(case["w_shape"]), case["stride"],
                            case["padding"], case["dilation"], case["groups"]).shape)


RANDOM = random_conv_cases(200, 20261206)


@pytest.mark.parametrize("index", range(len(RANDOM)), ids=[f"r{i}" for i in range(len(RANDOM))])
def test_backward_weight_matches_autograd(index):
    case = RANDOM[index]
    rng = np.random.default_rng(index)
    x = rng.standard_normal(case["x_shape"]).astype(np.float32)
    dy = rng.standard_normal(_dy_shape(case)).astype(np.float32)
    options = {k: case[k] for k in ("stride", "padding", "dilation", "groups")}
    dw, db = ops.conv2d_backward_weight(x, dy, case["w_shape"], bias=True, **options)
    expected_dw, expected_db = _reference_dw(x, case["w_shape"], dy, **options)
    assert dw.shape == expected_dw.shape and dw.dtype == np.float32
    assert rel_err(dw, expected_dw) <= 1e-5, case
    # dB is a sum of signed terms that may cancel: its error is measured against their magnitude
    scale = np.abs(dy.astype(np.float64)).sum((0, 2, 3))
    assert np.all(np.abs(db - expected_db) <= 1e-5 * scale), case


def test_random_cases_reach_every_path():
    """The kernel (groups=1), the kernel group by group, and NumPy tap by tap (depthwise)."""
    groups = [(c["groups"], c["w_shape"]) for c in RANDOM]
    assert any(g == 1 for g, _ in groups)
    assert any(g > 1 and shape[1] >= 8 and shape[0] // g >= 8 for g, shape in groups)
    assert any(g > 1 and shape[1] == 1 for g, shape in groups)


@pytest.mark.parametrize("x_shape,w_shape,stride,padding", [
    ((2, 64, 14, 14), (64, 64, 3, 3), 1, 1),
    ((2, 64, 14, 14), (128, 64, 3, 3), 2, 1),
    ((1, 128, 14, 14), (256, 128, 1, 1), 2, 0),
    ((1, 3, 32, 32), (64, 3, 7, 7), 2, 3),  # a stem: 3 input channels, one block
    ((1, 64, 7, 7), (520, 64, 1, 1), 1, 0),  # output channels past the last whole block
])
def test_resnet_layers(x_shape, w_shape, stride, padding):
    rng = np.random.default_rng(2)
    x = rng.standard_normal(x_shape).astype(np.float32)
    case = {"x_shape": x_shape, "w_shape": w_shape, "stride": stride, "padding": padding, "dilation": 1,
            "groups": 1}
    dy = rng.standard_normal(_dy_shape(case)).astype(np.float32)
    dw = ops.conv2d_backward_weight(x, dy, w_shape, stride=stride, padding=padding)
    assert rel_err(dw, _reference_dw(x, w_shape, dy, stride, padding, 1, 1)[0]) <= 1e-5
    kernel = backward._weight_grad_kernel(x.shape, w_shape, False, (stride, stride), (padding,) * 4, (1, 1), None)
    assert kernel.plan.m_r * (kernel.plan.n_r // 8) > 1  # a register tile, not a scalar loop


def test_calls_reuse_the_workspace_and_return_fresh_arrays():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 16, 9, 9)).astype(np.float32)
    dy1, dy2 = (rng.standard_normal((1, 32, 9, 9)).astype(np.float32) for _ in range(2))
    first = ops.conv2d_backward_weight(x, dy1, (32, 16, 3, 3), padding=1)
    kept = first.copy()
    second = ops.conv2d_backward_weight(x, dy2, (32, 16, 3, 3), padding=1)
    np.testing.assert_array_equal(first, kept)
    assert rel_err(second, _reference_dw(x, (32, 16, 3, 3), dy2, 1, 1, 1, 1)[0]) <= 1e-5


@pytest.mark.parametrize("args, message", [
    (((1, 8, 6, 6), (1, 8, 4, 4), (8, 8, 3, 3), {"padding": 1}), "dy has shape"),
    (((1, 8, 6, 6), (1, 8, 6, 6), (8, 4, 3, 3), {"padding": 1}), "channel mismatch"),
    (((1, 8, 6, 6), (1, 8, 6, 6), (8, 8, 3), {"padding": 1}), "w_shape"),
    (((1, 8, 6), (1, 8, 6, 6), (8, 8, 3, 3), {}), "data"),
])
def test_bad_input_raises(args, message):
    x_shape, dy_shape, w_shape, kw = args
    with pytest.raises(ValueError, match=message):
        ops.conv2d_backward_weight(np.ones(x_shape, np.float32), np.ones(dy_shape, np.float32), w_shape, **kw)


def test_a_batch_of_no_images():
    dw, db = ops.conv2d_backward_weight(np.ones((0, 4, 6, 6), np.float32), np.ones((0, 8, 6, 6), np.float32),
                                        (8, 4, 3, 3), padding=1, bias=True)
    assert dw.shape == (8, 4, 3, 3) and not dw.any() and db.shape == (8,) and not db.any()


@pytest.mark.parametrize("mcpu, register", [("haswell", "%ymm"), ("skylake-avx512", "%zmm")])
def test_weight_gradient_inner_loop_is_vfmadd_without_spills(mcpu, register):
    """The X^T dY microkernel (A transposed): whole-tile FMAs on the ISA's vector registers, one
    broadcast per input channel and pixel, no stack traffic in the loop."""
    import tvm

    from tvm_ext.asm import fma_blocks
    from tvm_ext.kernels.conv2d import Conv2dWorkload
    from tvm_ext.kernels.conv2d_backward_weight import conv2d_backward_weight_kernel, plan_conv2d_backward_weight
    from tvm_ext.target import resolve_target, vector_isa

    target = resolve_target({"kind": "llvm", "mcpu": mcpu, "mtriple": "x86_64-linux-gnu"})
    isa = vector_isa(target)
    plan = plan_conv2d_backward_weight(Conv2dWorkload.make((2, 64, 14, 14), (64, 64, 3, 3), 1, 1), isa)
    func = conv2d_backward_weight_kernel(plan, isa.lanes)
    asm = tvm.compile(tvm.IRModule({"dw": func.with_attr("global_symbol", "dw")}), target).mod.inspect_source("asm")
    blocks = fma_blocks(asm, isa)
    step = plan.m_r * plan.n_r // isa.lanes  # FMAs of one pixel of the tile
    assert blocks and all(b.fma % step == 0 for b in blocks)
    for block in blocks:
        assert block.fma_on_isa_registers == block.fma
        assert all(register in ln for ln in block.lines if "vfmadd" in ln)
        assert not block.spills, [ln for ln in block.lines if "rsp" in ln]


@pytest.mark.parametrize("x_shape,w_shape,stride", [
    ((2, 128, 28, 28), (64, 128, 1, 1), 1),
    ((1, 192, 56, 56), (72, 192, 1, 1), 2),  # strided, output channels past the last whole block
    ((2, 256, 28, 28), (512, 256, 1, 1), 2),  # ResNet-50's strided shortcut: many output blocks a task
    ((1, 96, 14, 14), (200, 96, 1, 1), 1),  # 14x14, the last of 7 output blocks partial
    ((2, 64, 129, 129), (96, 64, 3, 3), 2),  # a strided 3x3 layer whose X (8.5 MB) is re-read from memory
])
@pytest.mark.parametrize("bias", [False, True])
def test_weight_gradient_tasks_take_several_blocks(x_shape, w_shape, stride, bias):
    """Large images: a task reduces several input and output blocks' dW (WeightGradPlan.ib_tile,
    ob_tile), reading each chunk of X and dY once for them; the result (and the bias gradient
    beside it) is the same."""
    from tvm_ext.kernels.conv2d import Conv2dWorkload
    from tvm_ext.kernels.conv2d_backward_weight import plan_conv2d_backward_weight
    from tvm_ext.target import resolve_target, vector_isa

    plan = plan_conv2d_backward_weight(Conv2dWorkload.make(x_shape, w_shape, stride, 0),
                                       vector_isa(resolve_target("llvm")))
    assert plan.ib_tile * plan.ob_tile > 1 and plan.ICB % plan.ib_tile == 0 and plan.OCB % plan.ob_tile == 0
    rng = np.random.default_rng(7)
    x = rng.standard_normal(x_shape).astype(np.float32)
    case = {"x_shape": x_shape, "w_shape": w_shape, "stride": stride, "padding": 0, "dilation": 1, "groups": 1}
    dy = rng.standard_normal(_dy_shape(case)).astype(np.float32)
    got = ops.conv2d_backward_weight(x, dy, w_shape, stride=stride, bias=bias)
    expected, _ = _reference_dw(x, w_shape, dy, stride, 0, 1, 1)
    assert rel_err(got[0] if bias else got, expected) <= 1e-5
    if bias:
        assert rel_err(got[1], dy.astype(np.float64).sum((0, 2, 3))) <= 1e-5


@pytest.mark.parametrize("ib_tile, ob_tile", [(1, 3), (2, 3), (4, 1), (4, 3), (2, 1)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("taps", [1, 3])
def test_blocks_a_task_do_not_change_a_bit(ib_tile, ob_tile, bias, taps):
    """Grouping input and output blocks into a task changes which task reduces a dW block, not the
    order of its sums: the kernel's output (and bias gradient) is bitwise that of one-block tasks,
    the last output block partial (80 channels in blocks of 32), strided, 1x1 and 3x3 padded."""
    import dataclasses

    import tvm

    from tvm_ext.kernels.conv2d import Conv2dWorkload
    from tvm_ext.kernels.conv2d_backward_weight import conv2d_backward_weight_kernel, plan_conv2d_backward_weight
    from tvm_ext.target import resolve_target, vector_isa

    target = resolve_target("llvm")
    isa = vector_isa(target)
    wl = Conv2dWorkload.make((2, 64, 15, 15), (80, 64, taps, taps), 2, taps // 2)
    base = plan_conv2d_backward_weight(wl, isa, bias, ic_bn=16, oc_bn=32)
    rng = np.random.default_rng(11)
    inputs = [rng.standard_normal(shape).astype(np.float32) for shape in (base.data_shape(), base.grad_out_shape())]
    results = []
    for plan in (dataclasses.replace(base, ib_tile=1, ob_tile=1), dataclasses.replace(base, ib_tile=ib_tile,
                                                                                       ob_tile=ob_tile)):
        fn = tvm.compile(conv2d_backward_weight_kernel(plan, isa.lanes), target)["main"]
        outs = [tvm.runtime.tensor(np.full(plan.weight_shape(), np.nan, np.float32))]
        if bias:
            outs.append(tvm.runtime.tensor(np.full((plan.OCB, plan.oc_bn), np.nan, np.float32)))
        fn(*[tvm.runtime.tensor(a) for a in inputs], *outs)
        results.append([o.numpy() for o in outs])
    for one, grouped in zip(*results, strict=True):
        assert np.isfinite(one).all()
        np.testing.assert_array_equal(grouped, one)


def test_strided_weight_gradients_read_x_a_few_times():
    """ResNet-50's strided layers at batch 16: one-block tasks read X once per output block (the
    1x1 shortcuts 16 and 32 times: 822 MB, 40% and 30% of the peak on a Zen 4; the 3x3 ones at
    74%); the tasks now group output blocks, so X is read at most twice, with at least MIN_TASKS
    tasks and their blocks in L2."""
    from tvm_ext.kernels import conv2d_backward_weight as wg
    from tvm_ext.kernels.conv2d import Conv2dWorkload
    from tvm_ext.target import AVX512

    for c, h, k, taps in ((256, 56, 512, 1), (512, 28, 1024, 1), (128, 56, 128, 3), (256, 28, 256, 3)):
        wl = Conv2dWorkload.make((16, c, h, h), (k, c, taps, taps), 2, taps // 2)
        plan = wg.plan_conv2d_backward_weight(wl, AVX512)
        assert plan.OCB // plan.ob_tile <= 2
        assert (plan.ICB // plan.ib_tile) * (plan.OCB // plan.ob_tile) >= wg.MIN_TASKS
        assert 4 * plan.ib_tile * plan.ic_bn * plan.ob_tile * plan.oc_bn * taps * taps <= wg.TASK_L2_BYTES
    # 7x7 images, and a 3x3 layer whose X stays in the L3: one-block tasks were faster
    for wl in (Conv2dWorkload.make((16, 1024, 14, 14), (2048, 1024, 1, 1), 2, 0),
               Conv2dWorkload.make((16, 256, 14, 14), (256, 256, 3, 3), 1, 1)):
        plan = wg.plan_conv2d_backward_weight(wl, AVX512)
        assert (plan.ib_tile, plan.ob_tile) == (1, 1)
