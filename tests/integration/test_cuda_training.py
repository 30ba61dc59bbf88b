"""Training graphs through the CUDA strategy, built without a GPU, numbers from the emulator: dX on
the forward maxDNN kernel (tvm_ext's gradient writes it as forward convolutions of dY), dW on the
same kernel as the forward convolution of x^T and dY^T (a reduction over images x dY's pixels,
split-K where the grid is small)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from reference import random_conv_cases, rel_err, torch_conv
from tvm import relax

import tvm_ext
from tvm_ext.models.training import DIGITS_CNN_SHAPES, digits_cnn, digits_cnn_init, digits_cnn_torch
from tvm_ext.testing import cuda_emulator
from tvm_ext.testing.relax_emulator import emulated_executable, lower

TARGET = "cuda -arch=sm_90"
pytestmark = pytest.mark.skipif(not cuda_emulator.have_compiler(), reason="g++ is not installed")


def _conv_loss_gradient(case: dict) -> tuple[tvm.IRModule, np.ndarray]:
    """main(x, w) = sum(conv2d(x, w) * r), differentiated: main_adjoint gives (dX, dW) for dY = r."""
    pads = case["padding"] if isinstance(case["padding"], tuple) else (case["padding"],) * 4
    out_shape = torch_conv(torch.zeros(case["x_shape"]), torch.zeros(case["w_shape"]), case["stride"],
                           case["padding"], case["dilation"], case["groups"]).shape
    r = np.random.default_rng(9).standard_normal(tuple(out_shape)).astype(np.float32)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(case["x_shape"], "float32"))
    w = relax.Var("w", relax.TensorType(case["w_shape"], "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, w, strides=case["stride"], padding=pads, dilation=case["dilation"],
                                           groups=case["groups"]))
            loss = bb.emit_output(relax.op.sum(relax.op.multiply(y, relax.const(r))))
        bb.emit_func_output(loss)
    return relax.transform.Gradient("main")(bb.get()), r


def _check_gradients(case: dict, seed: int, tensor_cores: bool | str = False) -> tvm.IRModule:
    mod, r = _conv_loss_gradient(case)
    lowered = lower(mod, TARGET, tensor_cores=tensor_cores)
    vm = relax.VirtualMachine(emulated_executable(lowered, TARGET), tvm.cpu())
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(case["x_shape"]).astype(np.float32)
    w = rng.standard_normal(case["w_shape"]).astype(np.float32)
    _, (dx, dw) = vm["main_adjoint"](tvm.runtime.tensor(x), tvm.runtime.tensor(w))
    xt = torch.from_numpy(x).double().requires_grad_()
    wt = torch.from_numpy(w).double().requires_grad_()
    y = torch_conv(xt, wt, case["stride"], case["padding"], case["dilation"], case["groups"])
    (y * torch.from_numpy(r).double()).sum().backward()
    bound = 1e-5 if tensor_cores is False else 5e-3  # tf32: 10-bit mantissas
    assert rel_err(dx.numpy(), xt.grad.numpy()) <= bound, case
    assert rel_err(dw.numpy(), wt.grad.numpy()) <= bound, case
    return lowered


def _weight_gradient_rows(mod: tvm.IRModule, tensor_cores: bool | str = False) -> list:
    report = tvm_ext.dispatch_report(mod, TARGET, function="main_adjoint", tensor_cores=tensor_cores)
    return [row for row in report if row.op == "nn.conv2d" and "weight gradient" in row.reason]


# stride 1 and 2, dilation, asymmetric padding, 1x1, batches of 8 (RSC order, float4 loads) and 3
CASES = [
    {"x_shape": (8, 16, 10, 9), "w_shape": (24, 16, 3, 3), "stride": 1, "padding": 1, "dilation": 1, "groups": 1},
    {"x_shape": (3, 8, 11, 11), "w_shape": (16, 8, 3, 3), "stride": 2, "padding": 1, "dilation": 1, "groups": 1},
    {"x_shape": (2, 5, 12, 10), "w_shape": (7, 5, 3, 3), "stride": 1, "padding": (2, 0, 1, 2), "dilation": 2,
     "groups": 1},
    {"x_shape": (8, 32, 7, 7), "w_shape": (64, 32, 1, 1), "stride": 1, "padding": 0, "dilation": 1, "groups": 1},
    {"x_shape": (4, 8, 13, 12), "w_shape": (8, 8, 5, 5), "stride": (2, 3), "padding": 2, "dilation": 1, "groups": 1},
]
RANDOM = [case for case in random_conv_cases(40, 20261205) if case["groups"] == 1][:6]


@pytest.mark.parametrize("case", CASES + RANDOM, ids=[f"c{i}" for i in range(len(CASES))]
                         + [f"r{i}" for i in range(len(RANDOM))])
def test_conv2d_gradients_on_the_maxdnn_tile(case):
    mod = _check_gradients(case, seed=1)
    names = [gv.name_hint for gv, func in mod.functions_items() if isinstance(func, tvm.tirx.PrimFunc)]
    assert any(name.startswith("tvm_ext_maxdnn_conv2d_backward_weight_") for name in names), names
    # a strided dX: its phases interleaved by one CHWN kernel, not stacked, padded and cropped in NCHW
    # (where the chain has the form the CPU's kernel takes too: not a phase with fewer rows than its share)
    report = tvm_ext.dispatch_report(_conv_loss_gradient(case)[0], TARGET, function="main_adjoint")
    interleaved = any(row.kernel == "interleave_phases" for row in report)
    assert interleaved or case not in CASES or case["stride"] == 1
    assert any(name.startswith("tvm_ext_interleave_phases_chwn_") for name in names) == interleaved, names
    assert ("R.stack" in mod["main_adjoint"].script()) != interleaved or case["stride"] == 1


def test_weight_gradient_is_reported_on_the_tile_and_splits_its_reduction():
    """A small grid with a long reduction (16 x 16 pixels of 16 images, two channel steps a tap):
    split-K slices of its taps summed by a second kernel; dispatch_report says so."""
    case = {"x_shape": (16, 16, 16, 16), "w_shape": (32, 16, 3, 3), "stride": 1, "padding": 1, "dilation": 1,
            "groups": 1}
    mod, _ = _conv_loss_gradient(case)
    rows = _weight_gradient_rows(mod)
    assert len(rows) == 1 and rows[0].kernel == "maxdnn_conv2d", rows
    assert "a reduction of 4096" in rows[0].reason and "split-K slices of its taps" in rows[0].reason, rows[0].reason
    lowered = _check_gradients(case, seed=2)
    names = [gv.name_hint for gv, func in lowered.functions_items() if isinstance(func, tvm.tirx.PrimFunc)]
    assert any(name.startswith("tvm_ext_maxdnn_conv2d_backward_weight_") and name.endswith("_reduce")
               for name in names), names


def test_weight_gradient_on_tensor_cores():
    case = {"x_shape": (8, 16, 9, 9), "w_shape": (32, 16, 3, 3), "stride": 1, "padding": 1, "dilation": 1,
            "groups": 1}
    mod, _ = _conv_loss_gradient(case)
    assert [row.reason.split(": ", 1)[1].split(" tile")[0] for row in _weight_gradient_rows(mod, "tf32")] \
        == ["32x64 mma_tf32"]
    _check_gradients(case, seed=3, tensor_cores="tf32")


def test_grouped_weight_gradient_stays_with_stock_tvm_with_a_reason():
    case = {"x_shape": (2, 8, 6, 6), "w_shape": (8, 4, 3, 3), "stride": 1, "padding": 1, "dilation": 1, "groups": 2}
    mod, _ = _conv_loss_gradient(case)
    assert [(row.kernel, row.reason) for row in _weight_gradient_rows(mod)] == [
        ("fallback", "a weight gradient of 2 groups (the kernel takes 1)")]
    _check_gradients(case, seed=4)


@pytest.mark.parametrize("index", range(len(RANDOM)))
def test_weight_gradient_as_conv2d_is_what_the_graph_runs(index):
    """weight_gradient_as_conv2d (bench/gpu_export.py's dW kernels) is the workload the strategy
    plans for the gradient's conv2d, whose output is dW transposed."""
    from tvm_ext.kernels.conv2d import Conv2dWorkload
    from tvm_ext.transform.gradients import weight_gradient_as_conv2d

    case = RANDOM[index]
    wl = Conv2dWorkload.make(case["x_shape"], case["w_shape"], case["stride"], case["padding"], case["dilation"])
    forward = weight_gradient_as_conv2d(wl)
    rows = _weight_gradient_rows(_conv_loss_gradient(case)[0])
    assert [row.shapes for row in rows] == [((forward.C, forward.N, forward.H, forward.W), (wl.N, wl.K, wl.OH, wl.OW))]
    assert f"a reduction of {wl.N * wl.OH * wl.OW}" in rows[0].reason
    assert (forward.N, forward.K, forward.OH, forward.OW) == (wl.C, wl.K, wl.KH, wl.KW)


# (mode, producer, kernel, stride, padding, dilation, ceil_mode, count_include_pad)
POOLS = [
    ("max", "relu", 3, 2, 1, 1, False, True),  # ResNet's stem: relu's gradient fused (fails before: no build)
    ("max", "conv", 3, 2, 1, 1, False, True),
    ("max", "relu", 2, 2, 0, 2, True, True),
    ("avg", "relu", 3, 2, 1, 1, False, True),
    ("avg", "conv", 3, 2, 1, 1, True, False),
    ("avg", "conv", 2, 1, 0, 1, False, True),
]


@pytest.mark.parametrize("mode, producer, kernel, stride, padding, dilation, ceil_mode, count_include_pad", POOLS)
def test_pooling_gradients_on_cuda(mode, producer, kernel, stride, padding, dilation, ceil_mode, count_include_pad):
    """max/avg pooling's gradient (after a relu: its gradient too) as a CHWN kernel of ours, on the
    emulator against float64 autograd. Before, a relu's and a max pooling's gradients were one
    stock function that dlight's GPU Reduction rule scheduled and the build then rejected ("No
    matched reducer": a ResNet training graph did not build for CUDA)."""
    rng = np.random.default_rng(6)
    w = rng.standard_normal((8, 4, 3, 3)).astype(np.float32)
    pool_options = dict(pool_size=(kernel, kernel), strides=(stride, stride), padding=(padding, padding),
                        ceil_mode=ceil_mode)
    if mode == "max":
        pool_options["dilation"] = (dilation, dilation)
    else:
        pool_options["count_include_pad"] = count_include_pad
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 4, 11, 11), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            h = bb.emit(relax.op.nn.conv2d(x, relax.const(w), padding=1))
            h = bb.emit(relax.op.nn.relu(h)) if producer == "relu" else h
            y = bb.emit((relax.op.nn.max_pool2d if mode == "max" else relax.op.nn.avg_pool2d)(h, **pool_options))
            r = rng.standard_normal([int(v) for v in y.ty.shape]).astype(np.float32)
            loss = bb.emit_output(relax.op.sum(relax.op.multiply(y, relax.const(r))))
        bb.emit_func_output(loss)
    mod = relax.transform.Gradient("main")(bb.get())
    report = tvm_ext.dispatch_report(mod, TARGET, function="main_adjoint")
    kernels = [row.kernel.split()[0] for row in report if row.op.endswith("pool2d_backward")]
    assert kernels == [f"{mode}_pool2d_backward"]
    lowered = lower(mod, TARGET)
    names = [gv.name_hint for gv, func in lowered.functions_items() if isinstance(func, tvm.tirx.PrimFunc)]
    fused = mode == "max" and producer == "relu"
    assert sum(name.startswith(f"tvm_ext_{mode}_pool2d_backward") and name.endswith("_relu_mask") == fused
               for name in names) == 1, names
    if fused and stride == 2:  # the whole CUDA build (stock TVM's part too) goes through
        tvm_ext.build(mod, TARGET)
    xv = rng.standard_normal((4, 4, 11, 11)).astype(np.float32)
    _, (dx,) = relax.VirtualMachine(emulated_executable(lowered, TARGET), tvm.cpu())["main_adjoint"](
        tvm.runtime.tensor(xv))
    xt = torch.from_numpy(xv).double().requires_grad_()
    ht = torch.nn.functional.conv2d(xt, torch.from_numpy(w).double(), padding=1)
    ht = torch.relu(ht) if producer == "relu" else ht
    if mode == "max":
        yt = torch.nn.functional.max_pool2d(ht, kernel, stride, padding, dilation, ceil_mode)
    else:
        yt = torch.nn.functional.avg_pool2d(ht, kernel, stride, padding, ceil_mode, count_include_pad)
    (yt * torch.from_numpy(r).double()).sum().backward()
    assert rel_err(dx.numpy(), xt.grad.numpy()) <= 1e-5


class _NormNet(torch.nn.Module):
    """conv-bn-relu, conv-bn + shortcut -> relu, conv-bn (its y read as is), global mean, dense:
    a training-mode batch norm in each of its three forms."""

    def __init__(self):
        super().__init__()
        conv = lambda c, k: torch.nn.Conv2d(c, k, 3, padding=1, bias=False)  # noqa: E731
        self.c1, self.b1 = conv(3, 8), torch.nn.BatchNorm2d(8)
        self.c2, self.b2 = conv(8, 8), torch.nn.BatchNorm2d(8)
        self.c3, self.b3 = conv(8, 12), torch.nn.BatchNorm2d(12)
        self.fc = torch.nn.Linear(12, 5)

    def forward(self, x):
        h = torch.relu(self.b1(self.c1(x)))
        h = torch.relu(self.b2(self.c2(h)) + h)
        return self.fc(self.b3(self.c3(h)).mean((2, 3)))


def test_training_mode_batch_norms_on_cuda():
    """Batch norms with batch statistics, forward (with relu and shortcut fused) and backward, as
    CHWN kernels of ours (a block a channel); every parameter's gradient against float64 autograd
    on the emulator, and the CUDA build goes through. Before, they were stock TVM's decomposition."""
    import copy

    from tvm_ext.models.training import loss_gradient

    torch.manual_seed(0)
    x = np.random.default_rng(1).standard_normal((4, 3, 9, 7)).astype(np.float32)
    mod, params, loss = loss_gradient(_NormNet().train(), x)
    report = tvm_ext.dispatch_report(mod, TARGET, function="main_adjoint")
    assert [row.kernel for row in report if row.op == "nn.batch_norm"] == ["batch_norm_training"] * 3
    assert [row.kernel for row in report if row.op in ("variance", "rsqrt")] == ["batch_norm_backward"] * 6
    lowered = lower(mod, TARGET)
    names = [gv.name_hint for gv, func in lowered.functions_items() if isinstance(func, tvm.tirx.PrimFunc)]
    assert sorted(name for name in names if "batch_norm" in name) == [
        "tvm_ext_batch_norm_backward_chwn_12x9x7x4_scale_center",
        "tvm_ext_batch_norm_backward_chwn_8x9x7x4_scale_center",
        "tvm_ext_batch_norm_chwn_12x9x7x4_scale_center", "tvm_ext_batch_norm_chwn_8x9x7x4_scale_center_relu",
        "tvm_ext_batch_norm_chwn_8x9x7x4_scale_center_residual_relu"]
    vm = relax.VirtualMachine(emulated_executable(lowered, TARGET), tvm.cpu())
    _, grads = vm["main_adjoint"](tvm.runtime.tensor(x), *[tvm.runtime.tensor(p) for p in params])
    reference = copy.deepcopy(loss).double()
    reference(torch.from_numpy(x).double()).backward()
    expected = [p.grad.numpy() for p in reference.parameters()]
    assert len(grads) == len(expected) == 11
    for got, want in zip(grads, expected, strict=True):
        assert rel_err(got.numpy(), want) <= 1e-5
    tvm_ext.build(mod, TARGET)


@pytest.mark.parametrize("relu", [False, True])
def test_batch_norm_running_statistics_on_cuda(relu):
    """A training-mode batch norm's whole result, (y, new running mean, new running variance), as
    TVM's batch_norm defines it (momentum 0.1, the biased variance), on the emulator; with a relu
    after y, the relu in the batch norm's kernel and the statistics it computed reused for the
    running ones (split_running_statistics), no second pass over x."""
    rng = np.random.default_rng(2)
    stats = [rng.uniform(0.5, 1.5, 6), rng.uniform(-0.5, 0.5, 6), rng.uniform(-0.5, 0.5, 6), rng.uniform(0.5, 1.5, 6)]
    gamma, beta, moving_mean, moving_var = (relax.const(v.astype(np.float32)) for v in stats)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((3, 6, 5, 4), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            norm = bb.emit(relax.op.nn.batch_norm(x, gamma, beta, moving_mean, moving_var, axis=1, epsilon=1e-5,
                                                  momentum=0.1, training=True))
            y = relax.TupleGetItem(norm, 0)
            outs = [bb.emit_output(relax.op.nn.relu(y) if relu else y),
                    *(bb.emit_output(relax.TupleGetItem(norm, i)) for i in (1, 2))]
        bb.emit_func_output(relax.Tuple(outs))
    lowered = lower(bb.get(), TARGET)
    names = [gv.name_hint for gv, _ in lowered.functions_items()]
    assert [name.endswith("_relu") for name in names if name.startswith("tvm_ext_batch_norm_chwn_")] == [relu], names
    assert not any(name.startswith(("tvm_ext_batch_statistics", "relu", "fused_relu")) for name in names), names
    xv = (rng.standard_normal((3, 6, 5, 4)) * 2 + 1).astype(np.float32)
    y, new_mean, new_var = relax.VirtualMachine(emulated_executable(lowered, TARGET), tvm.cpu())["main"](
        tvm.runtime.tensor(xv))
    xd = xv.astype(np.float64)
    mean, var = xd.mean((0, 2, 3)), xd.var((0, 2, 3))
    shape = (1, 6, 1, 1)
    expected = (xd - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + 1e-5) * stats[0].reshape(shape) \
        + stats[1].reshape(shape)
    expected = np.maximum(expected, 0) if relu else expected
    assert rel_err(y.numpy(), expected) <= 1e-5
    assert rel_err(new_mean.numpy(), 0.9 * stats[2] + 0.1 * mean) <= 1e-6
    assert rel_err(new_var.numpy(), 0.9 * stats[3] + 0.1 * var) <= 1e-6


def test_a_small_cnn_training_step_on_cuda():
    """Five SGD steps of the 8x8-digits CNN (SetupTrainer, built for CUDA, run on the emulator):
    every convolution's forward, dX and dW on the maxDNN tile, losses equal to PyTorch's."""
    from tvm.relax.training import SetupTrainer, Trainer
    from tvm.relax.training.loss import CrossEntropyLoss
    from tvm.relax.training.optimizer import SGD

    batch, lr, steps = 16, 0.2, 5
    rng = np.random.default_rng(5)
    images = rng.uniform(0, 1, (steps * batch, 1, 8, 8)).astype(np.float32)
    labels = rng.integers(0, 10, steps * batch).astype(np.int64)
    train_mod = SetupTrainer(CrossEntropyLoss(reduction="mean"), SGD(lr),
                             [relax.TensorType((batch, 10), "float32"), relax.TensorType((batch,), "int64")],
                             legalize=False)(digits_cnn(batch))
    report = tvm_ext.dispatch_report(train_mod, TARGET, function="backbone_loss_adjoint")
    convs = [row for row in report if row.op == "nn.conv2d"]
    assert {row.kernel for row in convs} == {"maxdnn_conv2d"}, [(r.kernel, r.reason) for r in convs]
    assert sum("weight gradient" in row.reason for row in convs) == 2
    lowered = lower(train_mod, TARGET)
    trainer = Trainer(lowered, relax.VirtualMachine(emulated_executable(lowered, TARGET), tvm.cpu()), tvm.cpu(),
                      False)
    init = digits_cnn_init()
    trainer.load_params([init[name] for name in DIGITS_CNN_SHAPES])
    losses = [float(trainer.update([images[s * batch:(s + 1) * batch]], [labels[s * batch:(s + 1) * batch]]).numpy())
              for s in range(steps)]
    params = {name: torch.tensor(value, dtype=torch.float64, requires_grad=True) for name, value in init.items()}
    sgd = torch.optim.SGD(params.values(), lr=lr)
    expected = []
    for s in range(steps):
        x, y = (torch.from_numpy(a[s * batch:(s + 1) * batch]) for a in (images, labels))
        loss = torch.nn.functional.cross_entropy(digits_cnn_torch(params, x.double()), y)
        sgd.zero_grad()
        loss.backward()
        sgd.step()
        expected.append(loss.item())
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
