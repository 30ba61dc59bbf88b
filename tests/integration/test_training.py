"""Training through relax.training (SetupTrainer(..., legalize=False), then tvm_ext.build): a
small CNN on scikit-learn's 8x8 digits,
step by step against PyTorch from the same initial weights (tvm_ext's conv2d gradient: dX on the
forward kernels, dW on the X^T dY kernel)."""

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvm_ext
from tvm_ext.models.training import DIGITS_CNN_SHAPES, digits_cnn, digits_cnn_init, digits_cnn_torch, loss_gradient

BATCH = 32
LR = 0.2


def _digits() -> tuple[np.ndarray, np.ndarray]:
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    return (digits.images / 16.0).astype(np.float32).reshape(-1, 1, 8, 8), digits.target.astype(np.int64)


def _torch_losses(init: dict, images: np.ndarray, labels: np.ndarray, steps: int) -> list[float]:
    params = {name: torch.tensor(value, requires_grad=True) for name, value in init.items()}
    sgd = torch.optim.SGD(params.values(), lr=LR)
    losses = []
    for step in range(steps):
        x, y = (torch.from_numpy(a[step * BATCH:(step + 1) * BATCH]) for a in (images, labels))
        loss = torch.nn.functional.cross_entropy(digits_cnn_torch(params, x), y)
        sgd.zero_grad()
        loss.backward()
        sgd.step()
        losses.append(loss.item())
    return losses


def test_a_small_cnn_trains_like_pytorch():
    from tvm.relax.training import SetupTrainer, Trainer
    from tvm.relax.training.loss import CrossEntropyLoss
    from tvm.relax.training.optimizer import SGD

    images, labels = _digits()
    steps = 50
    init = digits_cnn_init()
    # legalize=False: the ops stay Relax ops, for tvm_ext.build's strategy (legalized, every op
    # would be a call_tir of TOPI's kernels)
    train_mod = SetupTrainer(CrossEntropyLoss(reduction="mean"), SGD(LR),
                             [relax.TensorType((BATCH, 10), "float32"), relax.TensorType((BATCH,), "int64")],
                             legalize=False)(digits_cnn(BATCH))
    report = tvm_ext.dispatch_report(train_mod, "llvm", function="backbone_loss_adjoint")
    assert sum(row.op == "nn.conv2d" and row.kernel == "conv2d_backward_weight" for row in report) == 2
    # the convolutions' bias gradients summed by their dW kernels (the dense layer's: stock TVM)
    assert [row.kernel for row in report if row.op == "collapse_sum_to"].count("conv2d_backward_weight") == 2
    assert not any(row.op == "nn.conv2d" and row.kernel == "fallback" for row in report)
    trainer = Trainer(train_mod, relax.VirtualMachine(tvm_ext.build(train_mod, "llvm"), tvm.cpu()), tvm.cpu(), False)
    trainer.load_params([init[name] for name in DIGITS_CNN_SHAPES])
    held_out = slice(len(images) - BATCH, len(images))

    def accuracy() -> float:
        return float((trainer.predict(images[held_out]).numpy().argmax(1) == labels[held_out]).mean())

    before = accuracy()
    losses = [float(trainer.update([images[s * BATCH:(s + 1) * BATCH]], [labels[s * BATCH:(s + 1) * BATCH]]).numpy())
              for s in range(steps)]
    expected = _torch_losses(init, images, labels, steps)
    np.testing.assert_allclose(losses, expected, rtol=1e-3)
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])  # 2.0 -> 0.46
    assert accuracy() > before + 0.3  # 16% -> 78% of a held-out batch


def test_resnet18_gradients_match_pytorch():
    """One training step's gradients of torchvision's ResNet-18 (32x32, batch 2, batch norms in
    inference form): every one of its 62 parameters' against PyTorch autograd. Before: the
    gradient graph failed to build (a constant at two sites broke FuseOpsByPattern), and the stem
    pooling's gradient came out wrong (dlight's Reduction rule)."""
    from tvm_ext.models import torchvision_zoo

    x = np.random.default_rng(1).standard_normal((2, 3, 32, 32)).astype(np.float32)
    mod, params, loss = loss_gradient(torchvision_zoo.load("resnet18", 32).eval(), x)
    report = tvm_ext.dispatch_report(mod, "llvm", function="main_adjoint")
    assert sum(row.op == "nn.conv2d" and row.kernel == "conv2d_backward_weight" for row in report) == 20  # all dW
    # each batch norm's shift (folded into a bias of its convolution) summed by that convolution's dW kernel: 17
    # sums, as a downsampling block's last convolution and its shortcut's share dY and one sum
    assert [row.kernel for row in report if row.op == "collapse_sum_to"].count("conv2d_backward_weight") == 17
    assert sum(row.op == "where" and row.kernel == "brgemm_conv2d epilogue" for row in report) >= 12  # relu masks
    assert not any(row.op == "nn.conv2d" and row.kernel == "fallback" for row in report)
    vm = relax.VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())
    _, grads = vm["main_adjoint"](tvm.runtime.tensor(x), *[tvm.runtime.tensor(p) for p in params])
    loss(torch.from_numpy(x)).backward()
    expected = [p.grad.numpy() for p in loss.parameters()]
    assert len(grads) == len(expected) == 62
    for got, want in zip(grads, expected, strict=True):
        assert np.abs(got.numpy() - want).max() <= 1e-4 * np.abs(want).max()


def test_resnet18_training_mode_gradients_match_float64_autograd():
    """torchvision's ResNet-18 in training mode (batch statistics in its 20 batch norms; 64x64,
    batch 4, so that the last stage still normalizes over 16 values): every parameter's
    gradient against float64 autograd, each batch norm's two passes on tvm_ext's kernels (their
    relu and shortcut adds in the forward kernel), nothing of them on stock TVM."""
    import copy

    from tvm_ext.models import torchvision_zoo

    x = np.random.default_rng(1).standard_normal((4, 3, 64, 64)).astype(np.float32)
    mod, params, loss = loss_gradient(torchvision_zoo.load("resnet18", 64).train(), x)
    report = tvm_ext.dispatch_report(mod, "llvm", function="main_adjoint")
    assert [row.kernel for row in report if row.op == "nn.batch_norm"] == ["batch_norm_training"] * 20
    assert [row.kernel for row in report if row.op in ("variance", "rsqrt")] == ["batch_norm_backward"] * 40
    # the blocks' residual adds and relus in the forward kernels' epilogues
    assert sum(row.op == "add" and row.kernel == "batch_norm_training epilogue" for row in report) == 8
    vm = relax.VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())
    _, grads = vm["main_adjoint"](tvm.runtime.tensor(x), *[tvm.runtime.tensor(p) for p in params])
    reference = copy.deepcopy(loss).double()
    reference(torch.from_numpy(x).double()).backward()
    expected = [p.grad.numpy() for p in reference.parameters()]
    assert len(grads) == len(expected) == 62
    for got, want in zip(grads, expected, strict=True):
        assert np.abs(got.numpy() - want).max() <= 1e-4 * np.abs(want).max()
