"""Batch norm in training mode (batch statistics): tvm_ext's gradient for relax.transform.Gradient
(TVM has none without DecomposeOpsForTraining) and the blocked forward and backward kernels a
build runs it on, against float64 NumPy and PyTorch autograd."""

import copy

import numpy as np
import pytest
import torch
import tvm
from reference import built_kernels, kernel_calls, rel_err
from tvm import relax

import tvm_ext
from tvm_ext.kernels.batch_norm import BatchNorm, batch_norm_backward_func, batch_norm_forward_func
from tvm_ext.ops.forward import build_kernel

TARGET = tvm_ext.resolve_target("llvm")


def _per_channel(blocked: np.ndarray) -> np.ndarray:
    """(C, N*H*W) float64 rows of a blocked (N, C/c, H, W, c) array."""
    n, blocks, h, w, block = blocked.shape
    return blocked.astype(np.float64).transpose(1, 4, 0, 2, 3).reshape(blocks * block, n * h * w)


def _blocked(rows: np.ndarray, shape: tuple) -> np.ndarray:
    n, blocks, h, w, block = shape
    return rows.reshape(blocks, block, n, h, w).transpose(2, 0, 3, 4, 1)


KERNEL_SHAPES = [(2, 3, 5, 7, 16), (1, 1, 1, 1, 8), (4, 2, 6, 3, 16), (3, 4, 7, 7, 8), (1, 2, 13, 9, 4),
                 (16, 1, 2, 2, 16)]


@pytest.mark.parametrize("shape", KERNEL_SHAPES, ids=["x".join(map(str, s)) for s in KERNEL_SHAPES])
@pytest.mark.parametrize("affine,residual,relu", [(True, False, False), (False, False, False), (True, False, True),
                                                  (True, True, True), (False, True, False)])
def test_kernels_match_float64(shape, affine, residual, relu):
    """Forward (y [+ shortcut] [-> relu], batch mean, biased variance) and backward (dX, dgamma,
    dbeta) of the blocked kernels against float64 NumPy, on inputs with a large mean (no
    E[x^2] - E[x]^2 cancellation)."""
    rng = np.random.default_rng(sum(shape))
    channels, epsilon = shape[1] * shape[4], 1e-5
    norm = BatchNorm(shape, epsilon, scale=affine, center=affine, residual=residual, relu=relu)
    x = (rng.standard_normal(shape) * 2 + 30).astype(np.float32)
    gamma, beta = rng.uniform(0.5, 1.5, channels).astype(np.float32), rng.standard_normal(channels).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    shortcut = rng.standard_normal(shape).astype(np.float32)
    rows = _per_channel(x)
    mean, var = rows.mean(1), rows.var(1)
    rstd = 1 / np.sqrt(var + epsilon)
    xhat = (rows - mean[:, None]) * rstd[:, None]
    g = gamma.astype(np.float64) if affine else np.ones(channels)
    b = beta.astype(np.float64) if affine else np.zeros(channels)

    outputs = [tvm.runtime.tensor(np.zeros(s, np.float32)) for s in (shape, (channels,), (channels,))]
    forward = build_kernel(batch_norm_forward_func(norm), TARGET)
    forward(tvm.runtime.tensor(x), *([tvm.runtime.tensor(gamma), tvm.runtime.tensor(beta)] if affine else []),
            *([tvm.runtime.tensor(shortcut)] if residual else []), *outputs)
    y, got_mean, got_var = (t.numpy() for t in outputs)
    expected = _blocked(xhat * g[:, None] + b[:, None], shape) + (shortcut if residual else 0)
    assert rel_err(y, np.maximum(expected, 0) if relu else expected) <= 1e-5
    assert rel_err(got_mean, mean) <= 1e-6 and rel_err(got_var, var) <= 1e-5

    grads = [tvm.runtime.tensor(np.zeros(s, np.float32)) for s in (shape, (channels,), (channels,))]
    backward = build_kernel(batch_norm_backward_func(BatchNorm(shape, epsilon, affine, affine)), TARGET)
    backward(tvm.runtime.tensor(x), tvm.runtime.tensor(dy), outputs[1], outputs[2],
             *([tvm.runtime.tensor(gamma)] if affine else []), *grads)
    dy_rows, count = _per_channel(dy), rows.shape[1]
    dbeta, dgamma = dy_rows.sum(1), (dy_rows * xhat).sum(1)
    dx = (g * rstd)[:, None] * (dy_rows - dbeta[:, None] / count - xhat * dgamma[:, None] / count)
    got_dx, got_dgamma, got_dbeta = (t.numpy() for t in grads)
    assert np.abs(got_dx - _blocked(dx, shape)).max() <= 1e-4 * max(np.abs(dx).max(), 1e-3)
    assert rel_err(got_dgamma, dgamma) <= 1e-4 and rel_err(got_dbeta, dbeta) <= 1e-5


class _ConvNormNet(torch.nn.Module):
    """conv -> batch norm -> relu -> conv (stride) -> batch norm [-> + shortcut] -> relu -> flatten."""

    def __init__(self, channels: int, width: int, stride: int, affine: bool, shortcut: bool):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, width, 3, padding=1, bias=False)
        self.norm1 = torch.nn.BatchNorm2d(width, affine=affine)
        self.conv2 = torch.nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.norm2 = torch.nn.BatchNorm2d(width, affine=affine)
        self.shortcut = shortcut
        with torch.no_grad():
            for norm in (self.norm1, self.norm2):
                if affine:
                    norm.weight.uniform_(0.5, 1.5)
                    norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        h = torch.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(h))
        return torch.relu(out + h if self.shortcut else out).flatten(1)


def _imported_gradient(loss, x: np.ndarray) -> tuple[tvm.IRModule, list[np.ndarray]]:
    """`loss` exported and imported as it comes (no canonicalization), differentiated by
    Gradient: (the module, the parameter arrays)."""
    from tvm.relax.frontend.torch import from_exported_program

    with torch.no_grad():
        program = torch.export.export(loss, (torch.from_numpy(x),))
    mod = from_exported_program(program, keep_params_as_input=True, unwrap_unit_return_tuple=True)
    mod, params = relax.frontend.detach_params(mod)
    mod = relax.transform.Gradient("main", require_grads=mod["main"].params[1:])(mod)
    return mod, [p.numpy() for p in params["main"]]


def _gradients_against_float64(mod: tvm.IRModule, params: list, loss, x: np.ndarray, tolerance: float) -> int:
    """Build `mod` with tvm_ext, run main_adjoint, and compare every gradient with float64
    autograd of `loss`; returns how many were compared."""
    vm = relax.VirtualMachine(tvm_ext.build(mod, TARGET), tvm.cpu())
    _, grads = vm["main_adjoint"](tvm.runtime.tensor(x), *map(tvm.runtime.tensor, params))
    reference = copy.deepcopy(loss).double()
    reference(torch.from_numpy(x).double()).backward()
    expected = [p.grad.numpy() for p in reference.parameters()]
    assert len(grads) == len(expected)
    for got, want in zip(grads, expected, strict=True):
        assert rel_err(got.numpy(), want) <= tolerance
    return len(expected)


CASES = [  # (batch, channels, size, width, stride, affine, shortcut)
    (2, 3, 8, 16, 1, True, False), (4, 8, 9, 32, 2, True, False), (1, 4, 10, 16, 1, False, True),
    (3, 16, 7, 24, 1, True, True), (2, 3, 12, 16, 2, False, False),
]


@pytest.mark.parametrize("case", CASES, ids=[f"c{i}" for i in range(len(CASES))])
def test_training_mode_network_gradients_match_autograd(case):
    """A training-mode network's loss gradient built with tvm_ext against float64 autograd: each
    batch norm forward and backward on tvm_ext's kernels (no stock mean, variance or sums of
    the decomposition left), the report saying so."""
    from tvm_ext.models.training import loss_gradient

    batch, channels, size, width, stride, affine, shortcut = case
    torch.manual_seed(sum(case[:5]))
    model = _ConvNormNet(channels, width, stride, affine, shortcut).train()
    x = np.random.default_rng(batch).standard_normal((batch, channels, size, size)).astype(np.float32)
    mod, params, loss = loss_gradient(model, x)
    assert _gradients_against_float64(mod, params, loss, x, 1e-4) == (6 if affine else 2)
    kernels = built_kernels(mod, TARGET)
    assert not any(name.startswith(("variance", "mean", "rsqrt")) for name in kernels), kernels
    calls = kernel_calls(mod, TARGET, function="main_adjoint")
    assert sum(name.startswith("tvm_ext_batch_norm_backward_") for name in calls) == 2, calls
    forward = [name for name in calls if name.startswith("tvm_ext_batch_norm_") and "backward" not in name]
    # relu (and the shortcut) in the forward kernels' epilogue: no stock add, no relu pass
    assert [name.endswith("_residual_relu") for name in forward] == [False, shortcut], forward
    assert all(name.endswith("_relu") for name in forward), forward
    assert not any(name.startswith("tvm_ext_relu") for name in calls), calls
    # the relu mask of conv2's data gradient reads conv2's padded input (kept for its weight
    # gradient), so the unpadded relu output dies in the forward pass (where both tensors have
    # the same channel blocks: one block of 16 here; strided, the stride phases' interleave masks)
    if width == 16:
        masks = [name for name in calls if name.endswith("_maskpad1x1x1x1")]
        assert [name.startswith("tvm_ext_interleave_phases") for name in masks] == [stride > 1], calls
        # and conv2's weight gradient reads the forward's padded copy too (strided, it needs no
        # bottom or right border, and made a copy of its own)
        dw = f"tvm_ext_conv2d_backward_weight_{batch}x16x{size}x{size}_16x3x3_s{stride}x{stride}_p1x1x1x1_"
        assert any(name.startswith(dw) for name in calls), calls
    report = tvm_ext.dispatch_report(mod, TARGET, function="main_adjoint")
    assert {row.kernel for row in report if row.op in ("variance", "rsqrt", "mean")} == {"batch_norm_backward"}
    assert [row.kernel for row in report if row.op == "nn.batch_norm"] == ["batch_norm_training"] * 2


def test_inference_batch_norm_gradient_matches_autograd():
    """A batch norm in inference form (running statistics) now has a gradient too (TVM has none):
    dX scaled per channel, dgamma and dbeta as PyTorch's."""
    from tvm_ext.models.training import loss_module

    torch.manual_seed(3)
    model = _ConvNormNet(3, 16, 1, True, False).eval()
    with torch.no_grad():
        for norm in (model.norm1, model.norm2):
            norm.running_mean.uniform_(-1, 1)
            norm.running_var.uniform_(0.5, 2)
    x = np.random.default_rng(3).standard_normal((2, 3, 8, 8)).astype(np.float32)
    loss = loss_module(model, x)
    mod, params = _imported_gradient(loss, x)
    assert _gradients_against_float64(mod, params, loss, x, 1e-5) == 6


def test_training_batch_norm_with_a_symbolic_batch_falls_back():
    """Batch statistics reduce over the batch, so the per-image kernels of a symbolic batch cannot
    compute them: stock TVM keeps the batch norm, with the reason, and the numbers are its own."""
    bb = relax.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, 16, 5, 5), "float32"))
    rng = np.random.default_rng(4)
    stats = [relax.const(rng.uniform(0.5, 1.5, 16).astype(np.float32)) for _ in range(4)]
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.TupleGetItem(bb.emit(relax.op.nn.batch_norm(x, *stats, axis=1,
                                                                                   training=True)), 0))
        bb.emit_func_output(out)
    mod = bb.get()
    rows = [row for row in tvm_ext.dispatch_report(mod, TARGET) if row.op == "nn.batch_norm"]
    assert rows and rows[0].kernel == "fallback" and "symbolic" in rows[0].reason, rows
    xv = rng.standard_normal((3, 16, 5, 5)).astype(np.float32)

    def run(ex):
        return relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(xv)).numpy()

    assert rel_err(run(tvm_ext.build(mod, TARGET)), run(tvm.compile(mod, TARGET))) <= 1e-6


def test_relax_training_trainer_updates_the_running_statistics():
    """relax.training with a batch norm's running statistics as states (the backbone returns the
    updated ones): five SGD steps of tvm_ext.train.SetupTrainer's module built with tvm_ext give
    the losses, parameters and states of TVM's SetupTrainer (which decomposes the batch norm) on
    stock TVM, the batch norm on tvm_ext's kernels with the relu in its kernel although its
    running statistics are read (split_running_statistics; before, the relu was a pass of its
    own), the statistics computed once. TVM's SetupTrainer left it on stock ops."""
    from tvm.relax.training import SetupTrainer, Trainer
    from tvm.relax.training.loss import CrossEntropyLoss
    from tvm.relax.training.optimizer import SGD

    n, c, k = 4, 3, 16
    op, bb = relax.op, relax.BlockBuilder()
    tensor = lambda name, *shape: relax.Var(name, relax.TensorType(shape, "float32"))  # noqa: E731
    x, w, gamma, beta, fc = tensor("x", n, c, 8, 8), tensor("w", k, c, 3, 3), tensor("g", k), tensor("b", k), \
        tensor("fc", k, 10)
    mean, var = tensor("mean", k), tensor("var", k)
    with bb.function("backbone", [x, w, gamma, beta, fc, mean, var]):
        with bb.dataflow():
            norm = bb.emit(op.nn.batch_norm(op.nn.conv2d(x, w, padding=1), gamma, beta, mean, var, axis=1,
                                            training=True))
            pooled = bb.emit(op.mean(op.nn.relu(relax.TupleGetItem(norm, 0)), axis=[2, 3]))
            logits = bb.emit_output(op.matmul(pooled, fc))
            states = [bb.emit_output(relax.TupleGetItem(norm, i)) for i in (1, 2)]
        bb.emit_func_output(relax.Tuple([logits, *states]))
    backbone = bb.get().with_attr("param_num", 4).with_attr("state_num", 2)
    from tvm_ext.train import SetupTrainer as KeepingBatchNorms

    loss_args = [relax.TensorType((n, 10), "float32"), relax.TensorType((n,), "int64")]
    decomposed = SetupTrainer(CrossEntropyLoss(reduction="sum"), SGD(0.01), loss_args, legalize=False)(backbone)
    mod = KeepingBatchNorms(CrossEntropyLoss(reduction="sum"), SGD(0.01), loss_args, legalize=False)(backbone)
    rng = np.random.default_rng(0)
    params = [0.3 * rng.standard_normal((k, c, 3, 3)), rng.uniform(0.5, 1.5, k), 0.1 * rng.standard_normal(k),
              0.3 * rng.standard_normal((k, 10))]
    params = [p.astype(np.float32) for p in params]
    data = [(rng.standard_normal((n, c, 8, 8)).astype(np.float32), rng.integers(0, 10, n)) for _ in range(5)]

    def train(module, executable):
        trainer = Trainer(module, relax.VirtualMachine(executable, tvm.cpu()), tvm.cpu())
        trainer.load_params(params)
        trainer.load_states([np.zeros(k, np.float32), np.ones(k, np.float32)])
        losses = [float(trainer.update([xv], [yv]).numpy()) for xv, yv in data]
        return losses, [p.numpy() for p in trainer.export_params().values()], \
            [s.numpy() for s in trainer.export_states().values()]

    got, want = train(mod, tvm_ext.build(mod, TARGET)), train(decomposed, tvm.compile(decomposed, TARGET))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for ours, theirs in zip(got[1] + got[2], want[1] + want[2], strict=True):
        assert rel_err(ours, theirs) <= 1e-5
    assert any(not np.allclose(s, 1) for s in got[2])  # the running variance moved
    calls = kernel_calls(mod, TARGET, function="backbone_loss_adjoint")
    assert sum(name.startswith("tvm_ext_batch_norm_backward_") for name in calls) == 1, calls
    assert not any(name.startswith(("mean", "variance", "fused_mean", "fused_variance")) for name in calls), calls
    forward = [name for name in calls if name.startswith("tvm_ext_batch_norm_") and "backward" not in name]
    assert len(forward) == 1 and forward[0].endswith("_relu"), calls
    assert not any(name.startswith(("tvm_ext_relu", "relu", "tvm_ext_batch_statistics")) for name in calls), calls


def test_importer_tuples_do_not_stop_the_fused_epilogue():
    """Differentiated straight after PyTorch's importer (which wraps each training-mode batch norm
    in tuples: y reached as (y, mean, var, ...)[0]), the forward kernels still apply the relu and
    the shortcut (the pipeline canonicalizes the bindings and drops the dead tuples first; before,
    the relu was its own pass and the shortcut a stock NCHW add)."""
    from tvm_ext.models.training import loss_module

    torch.manual_seed(5)
    model = _ConvNormNet(3, 16, 1, True, True).train()
    x = np.random.default_rng(5).standard_normal((2, 3, 8, 8)).astype(np.float32)
    loss = loss_module(model, x)
    mod, params = _imported_gradient(loss, x)
    calls = kernel_calls(mod, TARGET, function="main_adjoint")
    forward = [name for name in calls if name.startswith("tvm_ext_batch_norm_") and "backward" not in name]
    assert [name.rsplit("_", 2)[-2:] for name in forward] == [["center", "relu"], ["residual", "relu"]], forward
    assert not any(name.startswith(("tvm_ext_relu", "add")) for name in calls), calls
    assert _gradients_against_float64(mod, params, loss, x, 1e-4) == 6
