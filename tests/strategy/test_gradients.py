"""tvm_ext's conv2d gradient for relax.transform.Gradient: dX as forward convolutions of dY (the
stride phases), dW on the X^T dY kernel; built with tvm_ext and checked against PyTorch autograd
in float64 over random convolutions."""

import numpy as np
import pytest
import torch
import tvm
from reference import built_kernels, kernel_calls, random_conv_cases, rel_err, torch_conv
from tvm import relax

import tvm_ext
from tvm_ext.kernels.conv2d import Conv2dWorkload
from tvm_ext.transform.gradients import weight_gradient_input

TARGET = tvm_ext.resolve_target("llvm")


def _loss_module(x_shape, w_shape, stride, padding, dilation, groups) -> tvm.IRModule:
    """main(x, w) = sum(conv2d(x, w) * r) for a constant r: its gradient is dY = r."""
    pads = padding if isinstance(padding, tuple) else (padding,) * 4
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(x_shape, "float32"))
    w = relax.Var("w", relax.TensorType(w_shape, "float32"))
    out_shape = torch_conv(torch.zeros(x_shape), torch.zeros(w_shape), stride, padding, dilation, groups).shape
    r = np.random.default_rng(9).standard_normal(tuple(out_shape)).astype(np.float32)
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, w, strides=stride, padding=pads, dilation=dilation, groups=groups))
            loss = bb.emit_output(relax.op.sum(relax.op.multiply(y, relax.const(r))))
        bb.emit_func_output(loss)
    return relax.transform.Gradient("main")(bb.get()), r


def _check(case: dict, seed: int) -> tvm.IRModule:
    mod, r = _loss_module(case["x_shape"], case["w_shape"], case["stride"], case["padding"], case["dilation"],
                          case["groups"])
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(case["x_shape"]).astype(np.float32)
    w = rng.standard_normal(case["w_shape"]).astype(np.float32)
    vm = relax.VirtualMachine(tvm_ext.build(mod, TARGET), tvm.cpu())
    _, (dx, dw) = vm["main_adjoint"](tvm.runtime.tensor(x), tvm.runtime.tensor(w))
    xt = torch.from_numpy(x).double().requires_grad_()
    wt = torch.from_numpy(w).double().requires_grad_()
    y = torch_conv(xt, wt, case["stride"], case["padding"], case["dilation"], case["groups"])
    (y * torch.from_numpy(r).double()).sum().backward()
    assert rel_err(dx.numpy(), xt.grad.numpy()) <= 1e-5, case
    assert rel_err(dw.numpy(), wt.grad.numpy()) <= 1e-5, case
    return mod


RANDOM = random_conv_cases(40, 20261207)


@pytest.mark.parametrize("index", range(len(RANDOM)), ids=[f"r{i}" for i in range(len(RANDOM))])
def test_gradient_matches_autograd(index):
    _check(RANDOM[index], index)


def test_strided_gradient_runs_on_tvm_ext_kernels():
    """A stride-2 3x3 convolution's gradient: dX is four phase convolutions on the BRGEMM kernel
    (TVM's is a conv2d_transpose over a dY with zeros inserted, on stock TVM), dW the X^T dY kernel
    (TVM's a CNHW/IOHW conv2d of 4x4 taps on stock TVM, sliced to 3x3)."""
    case = {"x_shape": (2, 32, 14, 14), "w_shape": (64, 32, 3, 3), "stride": 2, "padding": 1, "dilation": 1,
            "groups": 1}
    mod = _check(case, 0)
    calls = kernel_calls(mod, TARGET, function="main_adjoint")
    assert sum("brgemm_conv2d" in name for name in calls) == 1 + 4  # the forward and the phases
    assert sum("conv2d_backward_weight" in name for name in calls) == 1
    # each phase's weights packed straight from W (not a stock swap, flip and takes, then a pack)
    assert sum(name.startswith("tvm_ext_pack_phase_weight_") for name in calls) == 4, calls
    assert not any(name.startswith(("take", "fused_reshape", "transpose")) for name in calls), calls
    kernels = built_kernels(mod, TARGET)  # the phases interleaved in blocks, not stacked in NCHW
    assert sum(name.startswith("tvm_ext_interleave_phases_") and name.endswith("_s2x2_7x7_7x7_7x7_7x7")
               for name in kernels) == 1, kernels
    assert not any("stack" in name for name in kernels), kernels
    report = tvm_ext.dispatch_report(mod, TARGET, function="main_adjoint")
    assert not any(row.op == "nn.conv2d_transpose" for row in report)
    assert not any(row.op == "nn.conv2d" and row.kernel == "fallback" for row in report)


@pytest.mark.parametrize("case", [
    {"x_shape": (2, 64, 28, 28), "w_shape": (96, 64, 1, 1), "stride": 2, "padding": 0, "dilation": 1, "groups": 1},
    {"x_shape": (1, 48, 16, 16), "w_shape": (160, 48, 1, 1), "stride": 1, "padding": 0, "dilation": 1, "groups": 1},
], ids=["strided", "partial-block"])
def test_one_by_one_weight_gradients_with_several_blocks_a_task(case):
    """1x1 layers of >= 14x14 output pixels, in a graph: the weight gradient's tasks take several
    input blocks (output blocks too only where X is larger than 8 MB, not at these sizes; the
    kernel-level tests cover those), blocks as the graph's producers wrote them, against float64."""
    from tvm_ext.kernels.conv2d_backward_weight import blocks_per_task, plan_conv2d_backward_weight
    from tvm_ext.target import vector_isa

    wl = Conv2dWorkload.make(case["x_shape"], case["w_shape"], case["stride"], case["padding"])
    plan = plan_conv2d_backward_weight(wl, vector_isa(TARGET))
    assert blocks_per_task(wl, plan.ic_bn, plan.oc_bn, plan.rows) != (1, 1)
    _check(case, 3)


def test_tvm_gradient_form_runs_on_the_kernel():
    """TVM's own dW form, a CNHW/IOHW conv2d (here 4x4 taps for a stride-2 3x3 filter, which TVM
    then slices), is the weight gradient of a 4x4 filter: the kernel serves it, exactly."""
    from tvm_ext.strategy.decide import decide

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 8, 8), "float32"))
    dy = relax.Var("dy", relax.TensorType((1, 16, 4, 4), "float32"))
    with bb.function("main", [x, dy]):
        dw = bb.emit(relax.op.nn.conv2d(x, dy, strides=1, padding=1, dilation=2, data_layout="CNHW",
                                        kernel_layout="IOHW", out_layout="CNHW"))
        bb.emit_func_output(dw)
    mod = bb.get()
    call = mod["main"].body.blocks[0].bindings[0].value
    assert tuple(call.ty.shape) == (16, 8, 4, 4)
    assert decide(call, TARGET).kernel == "conv2d_backward_weight"
    rng = np.random.default_rng(4)
    xv = rng.standard_normal((1, 8, 8, 8)).astype(np.float32)
    dyv = rng.standard_normal((1, 16, 4, 4)).astype(np.float32)
    got = relax.VirtualMachine(tvm_ext.build(mod, TARGET), tvm.cpu())["main"](tvm.runtime.tensor(xv),
                                                                              tvm.runtime.tensor(dyv)).numpy()
    expected = torch.nn.grad.conv2d_weight(torch.from_numpy(xv).double(), (16, 8, 4, 4),
                                           torch.from_numpy(dyv).double(), stride=2, padding=1).numpy()
    assert rel_err(got, expected) <= 1e-5


def test_a_weight_gradient_layout_conv_with_unread_rows_of_dy_stays_on_stock_tvm():
    """A CNHW/IOHW conv2d over fewer rows of dY than the convolution its taps describe has (3
    taps 3 apart over 9 rows make 3 rows, dY has 2): the kernel would read past dY; the decision
    says why."""
    from tvm_ext.strategy.decide import decide

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 9, 9), "float32"))
    dy = relax.Var("dy", relax.TensorType((1, 16, 2, 2), "float32"))
    with bb.function("main", [x, dy]):
        bb.emit_func_output(bb.emit(relax.op.nn.conv2d(x, dy, strides=3, padding=0, dilation=1, data_layout="CNHW",
                                                       kernel_layout="IOHW", out_layout="CNHW")))
    call = bb.get()["main"].body.blocks[0].bindings[0].value
    decision = decide(call, TARGET)
    assert decision.kernel is None and "more taps" in decision.reason, decision


def test_weight_gradient_crops_what_no_tap_reads():
    """(OH - 1) * stride + (KH - 1) * dilation + 1 rows are read: the bottom padding goes first."""
    wl = Conv2dWorkload.make((1, 8, 14, 14), (16, 8, 3, 3), 2, 1)  # 7 rows out, 15 of 16 padded rows read
    assert weight_gradient_input(wl) == ((14, 14), (1, 1, 0, 0))
    wl = Conv2dWorkload.make((1, 8, 15, 15), (16, 8, 1, 1), 2, 0)  # 8 rows out, all 15 read
    assert weight_gradient_input(wl) == ((15, 15), (0, 0, 0, 0))
    wl = Conv2dWorkload.make((1, 8, 16, 16), (16, 8, 1, 1), 2, 0)  # the last row and column unread
    assert weight_gradient_input(wl) == ((15, 15), (0, 0, 0, 0))


def _two_conv_gradients(x_shape, first: dict, second: dict):
    """main(x, w1, w2) = sum(conv2(relu(conv1(x))) * r): the module
    differentiated for w1 and w2, and a check of both gradients against float64 autograd."""
    op = relax.op
    c = x_shape[1]
    w1_shape, w2_shape = (first["K"], c, first["k"], first["k"]), (second["K"], first["K"], second["k"], second["k"])
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(x_shape, "float32"))
    w1 = relax.Var("w1", relax.TensorType(w1_shape, "float32"))
    w2 = relax.Var("w2", relax.TensorType(w2_shape, "float32"))

    def torch_forward(xt, w1t, w2t):
        h = torch.relu(torch_conv(xt, w1t, first["stride"], first["padding"], 1, 1))
        return torch_conv(h, w2t, second["stride"], second["padding"], 1, 1)

    out_shape = tuple(torch_forward(torch.zeros(x_shape), torch.zeros(w1_shape), torch.zeros(w2_shape)).shape)
    r = np.random.default_rng(3).standard_normal(out_shape).astype(np.float32)
    with bb.function("main", [x, w1, w2]):
        with bb.dataflow():
            h = bb.emit(op.nn.relu(op.nn.conv2d(x, w1, strides=first["stride"], padding=first["padding"])))
            y = bb.emit(op.nn.conv2d(h, w2, strides=second["stride"], padding=second["padding"]))
            loss = bb.emit_output(op.sum(op.multiply(y, relax.const(r))))
        bb.emit_func_output(loss)
    mod = relax.transform.Gradient("main", require_grads=[w1, w2])(bb.get())
    rng = np.random.default_rng(5)
    values = [rng.standard_normal(shape).astype(np.float32) for shape in (x_shape, w1_shape, w2_shape)]
    _, grads = relax.VirtualMachine(tvm_ext.build(mod, TARGET), tvm.cpu())["main_adjoint"](
        *(tvm.runtime.tensor(v) for v in values))
    tensors = [torch.from_numpy(v).double().requires_grad_() for v in values]
    (torch_forward(*tensors) * torch.from_numpy(r).double()).sum().backward()
    for got, tensor in zip(grads, tensors[1:], strict=True):
        assert rel_err(got.numpy(), tensor.grad.numpy()) <= 1e-5
    return mod


def test_weight_gradient_reads_the_blocked_input_not_a_cropped_copy():
    """A 1x1 stride-2 convolution over 14 rows reads 13 of them: the gradient crops the 14th off,
    but the kernel reads x whole, in the blocks the forward wrote it (before: the forward also kept
    x in NCHW, for a strided_slice and a repack at the weight gradient)."""
    mod = _two_conv_gradients((2, 8, 14, 14), {"K": 16, "k": 3, "stride": 1, "padding": 1},
                              {"K": 32, "k": 1, "stride": 2, "padding": 0})
    kernels = built_kernels(mod, TARGET)
    assert "tvm_ext_conv2d_backward_weight_2x16x14x14_32x1x1_s2x2_p0x0x0x0_d1x1_g1_x16y32" in kernels, kernels
    assert not any(name.startswith("strided_slice") or "13x13" in name for name in kernels), kernels
    # dX: the one phase with taps and three of zeros interleaved in blocks, with the relu's mask
    assert "tvm_ext_interleave_phases_2x1x14x14x16_s2x2_7x7_0_0_0_relu_mask" in kernels, kernels
    assert not any("stack" in name for name in kernels), kernels
    report = tvm_ext.dispatch_report(mod, TARGET, function="main_adjoint")
    assert {row.kernel for row in report if row.op in ("stack", "zeros", "where", "greater")} == {"interleave_phases"}


@pytest.mark.parametrize("seed", range(6))
def test_pack_phase_weight_kernel(seed):
    """A phase's blocked weights from the forward's OIHW weights: W swapped, its taps picked,
    blocked as the plan packs (zero past the channels), equal to NumPy's."""
    from tvm_ext.kernels import conv2d as conv
    from tvm_ext.kernels.conv2d_backward_data import pack_phase_weight_func
    from tvm_ext.ops.forward import build_kernel
    from tvm_ext.target import vector_isa

    rng = np.random.default_rng(seed)
    k, c, kh, kw = int(rng.integers(1, 40)), int(rng.integers(1, 40)), int(rng.integers(1, 4)), int(rng.integers(1, 4))
    taps_h = tuple(int(t) for t in rng.permutation(kh)[: int(rng.integers(1, kh + 1))])
    taps_w = tuple(int(t) for t in rng.permutation(kw)[: int(rng.integers(1, kw + 1))])
    wl = Conv2dWorkload.make((2, k, 9, 9), (c, k, len(taps_h), len(taps_w)), [1, 1], [0, 0, 0, 0], [1, 1], 1)
    plan = conv.plan_conv2d(wl, vector_isa(TARGET))
    w = rng.standard_normal((k, c, kh, kw)).astype(np.float32)
    out = tvm.runtime.tensor(np.full(plan.weight_shape(), np.nan, np.float32))
    build_kernel(pack_phase_weight_func(plan, w.shape, taps_h, taps_w), TARGET)(tvm.runtime.tensor(w), out)
    phase = w.transpose(1, 0, 2, 3)[:, :, list(taps_h)][:, :, :, list(taps_w)]  # (c, k, rows, cols)
    expected = np.zeros((plan.K_pad, k, len(taps_h), len(taps_w)), np.float32)
    expected[:c] = phase
    ob, ib = plan.K_pad // plan.oc_bn, k // plan.ic_bn
    expected = expected.reshape(ob, plan.oc_bn, ib, plan.ic_bn, len(taps_h), len(taps_w)).transpose(0, 2, 4, 5, 3, 1)
    np.testing.assert_array_equal(out.numpy(), expected)


@pytest.mark.parametrize("stride,relu_mask,mask_pad", [((2, 2), False, (0, 0, 0, 0)), ((2, 2), True, (0, 0, 0, 0)),
                                                       ((3, 2), True, (0, 0, 0, 0)), ((2, 2), True, (1, 2, 0, 1))])
def test_interleave_phases_kernel(stride, relu_mask, mask_pad):
    """Phases (some zero, some covering fewer pixels than their share) into every s-th pixel;
    masked by y, also read inside a padded copy of y (its border holding other values)."""
    from tvm_ext.kernels.conv2d_backward_data import interleave_phases_func

    n, blocks, h, w, block = 2, 2, 7, 9, 16
    rng = np.random.default_rng(2)
    sh, sw = stride
    phases = []
    for a in range(sh):
        for b in range(sw):
            rows, cols = -(-(h - a) // sh), -(-(w - b) // sw)
            phases.append(None if (a, b) == (0, 1) else (n, blocks, rows, cols - (a + b) % 2, block))
    data = [rng.standard_normal(shape).astype(np.float32) for shape in phases if shape is not None]
    y = rng.standard_normal((n, blocks, h, w, block)).astype(np.float32)
    expected, used = np.zeros((n, blocks, h, w, block), np.float32), iter(data)
    for index, shape in enumerate(phases):
        if shape is not None:
            expected[:, :, index // sw::sh, index % sw::sw][:, :, :shape[2], :shape[3]] = next(used)
    if relu_mask:
        expected = np.where(y > 0, expected, 0)
    top, left, bottom, right = mask_pad
    padded = rng.standard_normal((n, blocks, h + top + bottom, w + left + right, block)).astype(np.float32)
    padded[:, :, top: top + h, left: left + w] = y
    kernel = tvm.compile(interleave_phases_func((n, blocks, h, w, block), stride, phases, relu_mask, mask_pad),
                         target=TARGET)
    out = tvm.runtime.tensor(np.full((n, blocks, h, w, block), np.nan, np.float32))
    kernel(*[tvm.runtime.tensor(d) for d in data], *([tvm.runtime.tensor(padded)] if relu_mask else []), out)
    np.testing.assert_array_equal(out.numpy(), expected)


def test_weight_gradient_of_a_user_crop_keeps_it():
    """The weight gradient of a 3x3 stride-2 convolution with a border over x[..., :49, :49]: its
    taps read the bottom padding, which in x is a row past the crop: the kernel reads the crop."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 8, 50, 50), "float32"))
    dy = relax.Var("dy", relax.TensorType((2, 16, 25, 25), "float32"))
    with bb.function("main", [x, dy]):
        crop = bb.emit(relax.op.strided_slice(x, axes=[2, 3], begin=[0, 0], end=[49, 49]))
        bb.emit_func_output(bb.emit(relax.op.nn.conv2d(crop, dy, strides=1, padding=1, dilation=2, data_layout="CNHW",
                                                       kernel_layout="IOHW", out_layout="CNHW")))
    rng = np.random.default_rng(6)
    xv = rng.standard_normal((2, 8, 50, 50)).astype(np.float32)
    dyv = rng.standard_normal((2, 16, 25, 25)).astype(np.float32)
    built = tvm_ext.build(bb.get(), TARGET)
    assert any("conv2d_backward_weight" in name for name in built_kernels(bb.get(), TARGET))
    got = relax.VirtualMachine(built, tvm.cpu())["main"](tvm.runtime.tensor(xv), tvm.runtime.tensor(dyv)).numpy()
    expected = torch.nn.grad.conv2d_weight(torch.from_numpy(xv[:, :, :49, :49]).double(), (16, 8, 3, 3),
                                           torch.from_numpy(dyv).double(), stride=2, padding=1).numpy()
    assert rel_err(got, expected) <= 1e-5


def test_dispatch_report_names_a_missing_function():
    mod, _ = _loss_module((1, 8, 6, 6), (8, 8, 3, 3), 1, 1, 1, 1)
    with pytest.raises(ValueError, match="no function 'train'"):
        tvm_ext.dispatch_report(mod, TARGET, function="train")


@pytest.mark.parametrize("name", ["relu", "leaky_relu", "relu6", "clip", "gelu"])
def test_activation_gradients_follow_pytorch(name):
    """At the kinks too: x == 0 for relu and leaky_relu, the bounds of relu6 and clip (a clip is
    PyTorch's hardtanh: no gradient at the bounds; torch.clamp, which exports to the same clip,
    passes it there). TVM's relu passed the gradient at 0; clip and GELU had none."""
    op = relax.op
    forward = {"relu": (op.nn.relu, torch.relu), "leaky_relu": (lambda v: op.nn.leakyrelu(v, 0.1),
                                                                 lambda v: torch.nn.functional.leaky_relu(v, 0.1)),
               "relu6": (lambda v: op.clip(v, 0.0, 6.0), torch.nn.functional.relu6),
               "clip": (lambda v: op.clip(v, -1.5, 2.0), lambda v: torch.nn.functional.hardtanh(v, -1.5, 2.0)),
               "gelu": (op.nn.gelu, torch.nn.functional.gelu)}[name]
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((2, 8, 5, 5)) * 4).astype(np.float32)
    x.reshape(-1)[:12] = [0, 0, 6, 6, -1.5, 2.0, 0, 6, -1.5, 2.0, 0, 0]  # the kinks, exactly
    r = rng.standard_normal(x.shape).astype(np.float32)
    bb = relax.BlockBuilder()
    xv = relax.Var("x", relax.TensorType(x.shape, "float32"))
    with bb.function("main", [xv]):
        with bb.dataflow():
            loss = bb.emit_output(op.sum(op.multiply(forward[0](xv), relax.const(r))))
        bb.emit_func_output(loss)
    mod = relax.transform.Gradient("main")(bb.get())
    _, (dx,) = relax.VirtualMachine(tvm_ext.build(mod, TARGET), tvm.cpu())["main_adjoint"](tvm.runtime.tensor(x))
    xt = torch.from_numpy(x).double().requires_grad_()
    (forward[1](xt) * torch.from_numpy(r).double()).sum().backward()
    assert rel_err(dx.numpy(), xt.grad.numpy()) <= 1e-5


def _pooled_loss_gradient(x: np.ndarray, w: np.ndarray, producer: str, rng, relax_pool, torch_pool):
    """(module, tvm_ext's dx, float64 autograd's dx) of the loss sum(pool(h) * r), h = relu(x) or
    conv2d(x, w) (padding 1), r random in the pooling's output shape (drawn from `rng`)."""
    bb = relax.BlockBuilder()
    xv = relax.Var("x", relax.TensorType(x.shape, "float32"))
    with bb.function("main", [xv]):
        with bb.dataflow():
            h = relax.op.nn.relu(xv) if producer == "relu" else relax.op.nn.conv2d(xv, relax.const(w), padding=1)
            pooled = bb.emit(relax_pool(bb.emit(h)))
            r = rng.standard_normal([int(v) for v in pooled.ty.shape]).astype(np.float32)
            loss = bb.emit_output(relax.op.sum(relax.op.multiply(pooled, relax.const(r))))
        bb.emit_func_output(loss)
    mod = relax.transform.Gradient("main")(bb.get())
    _, (dx,) = relax.VirtualMachine(tvm_ext.build(mod, TARGET), tvm.cpu())["main_adjoint"](tvm.runtime.tensor(x))
    xt = torch.from_numpy(x).double().requires_grad_()
    wt = torch.from_numpy(w).double()
    h = torch.relu(xt) if producer == "relu" else torch.nn.functional.conv2d(xt, wt, padding=1)
    (torch_pool(h) * torch.from_numpy(r).double()).sum().backward()
    return mod, dx.numpy(), xt.grad.numpy()


@pytest.mark.parametrize("producer", ["relu", "conv"])
def test_stem_max_pool_gradient_matches_autograd(producer):
    """ResNet's stem: a 3x3 stride-2 max pooling with padding after a relu (or a convolution).
    Its gradient (argmax over overlapping windows, fused with the relu's by TVM) was scheduled by
    dlight's CPU Reduction rule, which computed it wrong even on one thread (92% relative error;
    the convolution's case read garbage): that rule now takes aligned accesses only."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 16, 12, 12)).astype(np.float32)
    w = (rng.standard_normal((16, 16, 3, 3)) * 0.2).astype(np.float32)
    mod, dx, expected = _pooled_loss_gradient(x, w, producer, rng, lambda h: relax.op.nn.max_pool2d(h, 3, 2, 1),
                                              lambda h: torch.nn.functional.max_pool2d(h, 3, 2, 1))
    assert rel_err(dx, expected) <= 1e-5
    # the pooling's gradient on the blocked kernel; after a relu, with the relu's gradient fused
    pooling = [name for name in built_kernels(mod, TARGET) if name.startswith("tvm_ext_max_pool2d_backward")]
    assert len(pooling) == 1 and pooling[0].endswith("_relu_mask") == (producer == "relu"), pooling
    if producer == "relu":
        assert not any("where" in name for name in built_kernels(mod, TARGET))
        report = tvm_ext.dispatch_report(mod, TARGET, function="main_adjoint")
        assert {row.kernel for row in report if row.op in ("where", "greater")} == {"max_pool2d_backward epilogue"}


def test_aligned_accesses_tells_rows_from_windows():
    from tvm import te

    from tvm_ext.dlight import aligned_accesses

    x = te.placeholder((4, 8), "float32", name="x")
    k = te.reduce_axis((0, 8), name="k")
    row_sum = te.compute((4,), lambda i: te.sum(x[i, k], axis=k), name="row_sum")
    shifted = te.compute((4, 6), lambda i, j: x[i, j + 2], name="shifted")
    window = te.compute((4, 3), lambda i, j: x[i, j * 2] + x[i, j * 2 + 1], name="window")
    assert aligned_accesses(te.create_prim_func([x, row_sum]))
    assert aligned_accesses(te.create_prim_func([x, shifted]))
    assert not aligned_accesses(te.create_prim_func([x, window]))


def test_each_use_of_a_constant_is_its_own_node():
    """Gradients reuse one Constant object (TVM's relu gradient its zero, twice in one where):
    FuseOpsByPattern then refused the module ("appears in multiple partitions"). unique_constants
    gives each further use a node of its own over the same data."""
    from tvm_ext.transform import unique_constants

    zero = relax.const(np.zeros((4,), np.float32))
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4,), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.where(relax.op.greater(x, zero), x, zero))
        bb.emit_func_output(out)
    found = []
    relax.analysis.post_order_visit(unique_constants()(bb.get())["main"],
                                    lambda e: found.append(e) if isinstance(e, tvm.ir.expr.GenericConst) else None)
    assert len(found) == 2 and not found[0].same_as(found[1])
    assert all(np.array_equal(c.value.numpy(), np.zeros(4)) for c in found)


@pytest.mark.parametrize("statistics", ["constant", "parameters"])
def test_trained_batch_norm_folds_into_the_convolution(statistics):
    """fold_trained_batch_norm: conv2d -> batch_norm (inference form, trained scale and shift)
    becomes conv2d(x, W * s) + t, s and t expressions of the parameters. The loss and every
    gradient (W, gamma, beta; the statistics' too when they are parameters) agree with PyTorch
    autograd in float64, and no per-pixel batch-norm arithmetic is left in the graph."""
    from tvm_ext.transform import fold_trained_batch_norm

    rng = np.random.default_rng(5)
    x_np = rng.standard_normal((2, 8, 7, 9)).astype(np.float32)
    values = {"w": rng.standard_normal((12, 8, 3, 3)), "gamma": rng.standard_normal(12), "beta":
              rng.standard_normal(12), "mean": rng.standard_normal(12), "var": rng.uniform(0.5, 2.0, 12)}
    values = {k: v.astype(np.float32) for k, v in values.items()}
    r = rng.standard_normal((2, 12, 4, 5)).astype(np.float32)
    trained = ["w", "gamma", "beta"] + (["mean", "var"] if statistics == "parameters" else [])
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(x_np.shape, "float32"))
    params = {k: relax.Var(k, relax.TensorType(values[k].shape, "float32")) for k in trained}
    stat = {k: params.get(k, relax.const(values[k])) for k in ("mean", "var")}
    with bb.function("main", [x, *params.values()]):
        with bb.dataflow():
            y = relax.op.nn.conv2d(x, params["w"], strides=2, padding=1)
            bn = bb.emit(relax.op.nn.batch_norm(y, params["gamma"], params["beta"], stat["mean"], stat["var"],
                                                axis=1, epsilon=1e-3, training=False))
            loss = bb.emit_output(relax.op.sum(relax.op.multiply(relax.TupleGetItem(bn, 0), relax.const(r))))
        bb.emit_func_output(loss)
    mod = fold_trained_batch_norm()(bb.get())
    assert "batch_norm" not in mod.script()
    mod = relax.transform.DecomposeOpsForInference()(mod)
    mod = relax.transform.Gradient("main", require_grads=mod["main"].params[1:])(mod)
    vm = relax.VirtualMachine(tvm_ext.build(mod, TARGET), tvm.cpu())
    loss_value, grads = vm["main_adjoint"](tvm.runtime.tensor(x_np), *[tvm.runtime.tensor(values[k]) for k in trained])
    t = {k: torch.from_numpy(v).double().requires_grad_() for k, v in values.items()}
    y = torch_conv(torch.from_numpy(x_np).double(), t["w"], 2, 1, 1, 1)
    channel = {k: v.reshape(1, -1, 1, 1) for k, v in t.items() if k != "w"}  # batch_norm's inference form, written out
    want = (y - channel["mean"]) / torch.sqrt(channel["var"] + 1e-3) * channel["gamma"] + channel["beta"]
    want = (want * torch.from_numpy(r).double()).sum()
    want.backward()
    assert rel_err(loss_value.numpy(), want.detach().numpy()) <= 1e-5
    for name, got in zip(trained, grads, strict=True):
        assert rel_err(got.numpy(), t[name].grad.numpy()) <= 1e-5, name


@pytest.mark.parametrize("activation", ["relu", "leaky_relu"])
def test_a_residual_block_trains_in_blocks(activation):
    """A residual block as a training graph sees it: act(conv2(act(conv1(x) + b1)) + b2 + x),
    its loss differentiated. The backward stays in the blocked layout: each activation's
    gradient is the mask epilogue of the data-gradient convolution that produces its input
    (where(y > 0, ., 0) fused), each bias gradient is summed by the weight-gradient kernel
    while it reads dY (no stock reduction over an NCHW copy), and the weight gradients read x
    and dY in the blocks their producers wrote (no repacking). Every gradient agrees with
    PyTorch autograd in float64. Before, masks and bias sums ran on stock TVM in NCHW, with a
    pack or unpack around every kernel (ResNet-50's step: 300 of its 1300 ms)."""
    from reference import built_kernels

    rng = np.random.default_rng(11)
    shapes = {"w1": (32, 32, 3, 3), "b1": (1, 32, 1, 1), "w2": (32, 32, 1, 1), "b2": (1, 32, 1, 1)}
    values = {k: (rng.standard_normal(v) * 0.2).astype(np.float32) for k, v in shapes.items()}
    x_np = rng.standard_normal((2, 32, 10, 12)).astype(np.float32)
    r = rng.standard_normal((2, 32, 10, 12)).astype(np.float32)
    act = {"relu": relax.op.nn.relu, "leaky_relu": lambda v: relax.op.nn.leakyrelu(v, 0.2)}[activation]
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(x_np.shape, "float32"))
    params = {k: relax.Var(k, relax.TensorType(v, "float32")) for k, v in shapes.items()}
    with bb.function("main", [x, *params.values()]):
        with bb.dataflow():
            h = bb.emit(act(relax.op.add(relax.op.nn.conv2d(x, params["w1"], padding=1), params["b1"])))
            h = bb.emit(act(relax.op.add(relax.op.add(relax.op.nn.conv2d(h, params["w2"]), params["b2"]), x)))
            loss = bb.emit_output(relax.op.sum(relax.op.multiply(h, relax.const(r))))
        bb.emit_func_output(loss)
    mod = relax.transform.Gradient("main", require_grads=list(params.values()))(bb.get())
    report = tvm_ext.dispatch_report(mod, TARGET, function="main_adjoint")
    # the first activation's mask follows a convolution; the second's, the loss's dY (stock TVM)
    assert [row.kernel for row in report if row.op == "where"] == ["fallback", "brgemm_conv2d epilogue"]
    assert [row.kernel for row in report if row.op == "collapse_sum_to"] == ["conv2d_backward_weight"] * 2
    kernels = built_kernels(mod, TARGET)
    assert sum("conv2d_backward_weight" in k and k.endswith("_bias") for k in kernels) == 2, kernels
    assert any(k.endswith(f"_{activation}_mask") for k in kernels), kernels
    # the input x packed for its weight gradient and for the shortcut, one view unpacked: no gradient repacked
    assert sum("pack_nchwc" in k for k in kernels) <= 3, kernels
    vm = relax.VirtualMachine(tvm_ext.build(mod, TARGET), tvm.cpu())
    _, grads = vm["main_adjoint"](tvm.runtime.tensor(x_np), *[tvm.runtime.tensor(values[k]) for k in shapes])
    t = {k: torch.from_numpy(v).double().requires_grad_() for k, v in values.items()}
    act_t = {"relu": torch.relu, "leaky_relu": lambda v: torch.nn.functional.leaky_relu(v, 0.2)}[activation]
    xt = torch.from_numpy(x_np).double()
    h_t = act_t(torch_conv(xt, t["w1"], 1, 1, 1, 1) + t["b1"])
    h_t = act_t(torch_conv(h_t, t["w2"], 1, 0, 1, 1) + t["b2"] + xt)
    (h_t * torch.from_numpy(r).double()).sum().backward()
    for name, got in zip(shapes, grads, strict=True):
        assert rel_err(got.numpy(), t[name].grad.numpy()) <= 1e-5, name


@pytest.mark.parametrize(("kernel", "stride", "padding", "ceil_mode", "count_include_pad", "producer"), [
    (2, 2, 0, False, True, "conv"),  # DenseNet's transition
    (3, 1, 1, False, False, "conv"),  # Inception's branch pooling: overlapping windows, padding uncounted
    (3, 2, 1, True, True, "relu"),  # ceil mode: the last windows past the padding
    (3, 2, 1, True, False, "conv"),
])
def test_avg_pool_gradient_matches_autograd(kernel, stride, padding, ceil_mode, count_include_pad, producer):
    """Average pooling's gradient runs on the blocked kernel (each window's dY / its count spread
    over its taps; stock TVM before), after a convolution's blocked output or a relu."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 24, 11, 11)).astype(np.float32)
    w = (rng.standard_normal((24, 24, 3, 3)) * 0.2).astype(np.float32)
    options = {"ceil_mode": ceil_mode, "count_include_pad": count_include_pad}
    mod, dx, expected = _pooled_loss_gradient(
        x, w, producer, rng, lambda h: relax.op.nn.avg_pool2d(h, kernel, stride, padding, **options),
        lambda h: torch.nn.functional.avg_pool2d(h, kernel, stride, padding, **options))
    assert rel_err(dx, expected) <= 1e-5
    pooling = [name for name in built_kernels(mod, TARGET) if name.startswith("tvm_ext_avg_pool2d_backward")]
    assert len(pooling) == 1 and pooling[0].endswith("_exclude_pad") != count_include_pad, pooling


def test_dense_connections_with_a_one_tensor_concat_differentiate():
    """DenseNet's pattern: torch.cat([x]) (one tensor) then concatenations that reuse earlier
    features. TVM's concat gradient splits dY at no index and Gradient failed ("Expected nested to
    match tuple"); tvm_ext's gives the one-tensor case its tuple. Gradients against float64 autograd."""
    rng = np.random.default_rng(11)
    xv = rng.standard_normal((2, 4, 6, 6)).astype(np.float32)
    w1, w2 = (rng.standard_normal(shape).astype(np.float32) * 0.3 for shape in ((4, 4, 3, 3), (4, 8, 3, 3)))
    r = rng.standard_normal((2, 12, 6, 6)).astype(np.float32)
    op, bb = relax.op, relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 4, 6, 6), "float32"))
    wa, wb = (relax.Var(name, relax.TensorType(w.shape, "float32")) for name, w in (("wa", w1), ("wb", w2)))
    with bb.function("main", [x, wa, wb]):
        with bb.dataflow():
            y1 = bb.emit(op.nn.relu(op.nn.conv2d(bb.emit(op.concat([x], axis=1)), wa, padding=1)))
            y2 = bb.emit(op.nn.conv2d(bb.emit(op.concat([x, y1], axis=1)), wb, padding=1))
            loss = bb.emit_output(op.sum(op.multiply(op.concat([x, y1, y2], axis=1), relax.const(r))))
        bb.emit_func_output(loss)
    mod = relax.transform.Gradient("main")(bb.get())
    vm = relax.VirtualMachine(tvm_ext.build(mod, TARGET), tvm.cpu())
    _, grads = vm["main_adjoint"](*map(tvm.runtime.tensor, (xv, w1, w2)))
    xt, at, bt = (torch.from_numpy(v).double().requires_grad_() for v in (xv, w1, w2))
    t1 = torch.relu(torch.nn.functional.conv2d(torch.cat([xt], 1), at, padding=1))
    t2 = torch.nn.functional.conv2d(torch.cat([xt, t1], 1), bt, padding=1)
    (torch.cat([xt, t1, t2], 1) * torch.from_numpy(r).double()).sum().backward()
    for got, want in zip(grads, (xt, at, bt), strict=True):
        assert rel_err(got.numpy(), want.grad.numpy()) <= 1e-5
