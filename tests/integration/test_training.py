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

BATCH = 32
SHAPES = {"w1": (8, 1, 3, 3), "b1": (8,), "w2": (16, 8, 3, 3), "b2": (16,), "w3": (10, 256), "b3": (10,)}
FAN_IN = {"w1": 9, "w2": 72, "w3": 256}
LR = 0.2


def _digits() -> tuple[np.ndarray, np.ndarray]:
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    return (digits.images / 16.0).astype(np.float32).reshape(-1, 1, 8, 8), digits.target.astype(np.int64)


def _backbone() -> tvm.IRModule:
    """conv 3x3 -> relu -> max pool 2 -> conv 3x3 -> relu -> flatten -> linear, with biases."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((BATCH, 1, 8, 8), "float32"))
    p = {name: relax.Var(name, relax.TensorType(shape, "float32")) for name, shape in SHAPES.items()}
    op = relax.op
    with bb.function("backbone", [x, *p.values()]):
        with bb.dataflow():
            h = bb.emit(op.nn.relu(op.add(op.nn.conv2d(x, p["w1"], padding=1), op.reshape(p["b1"], (1, 8, 1, 1)))))
            h = bb.emit(op.nn.max_pool2d(h, 2, 2))
            h = bb.emit(op.nn.relu(op.add(op.nn.conv2d(h, p["w2"], padding=1), op.reshape(p["b2"], (1, 16, 1, 1)))))
            h = bb.emit(op.reshape(h, (BATCH, 256)))
            out = bb.emit_output(op.add(op.matmul(h, op.permute_dims(p["w3"])), p["b3"]))
        bb.emit_func_output(out)
    return bb.get().with_attr("param_num", len(SHAPES)).with_attr("state_num", 0)


def _torch_losses(init: dict, images: np.ndarray, labels: np.ndarray, steps: int) -> list[float]:
    params = {name: torch.tensor(value, requires_grad=True) for name, value in init.items()}
    sgd = torch.optim.SGD(params.values(), lr=LR)
    losses = []
    for step in range(steps):
        x, y = (torch.from_numpy(a[step * BATCH:(step + 1) * BATCH]) for a in (images, labels))
        h = torch.relu(torch.nn.functional.conv2d(x, params["w1"], params["b1"], padding=1))
        h = torch.nn.functional.max_pool2d(h, 2)
        h = torch.relu(torch.nn.functional.conv2d(h, params["w2"], params["b2"], padding=1)).reshape(BATCH, 256)
        loss = torch.nn.functional.cross_entropy(h @ params["w3"].T + params["b3"], y)
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
    rng = np.random.default_rng(0)
    init = {name: (rng.standard_normal(shape) * np.sqrt(2 / FAN_IN.get(name, np.inf))).astype(np.float32)
            for name, shape in SHAPES.items()}  # He's initialization, zero biases
    # legalize=False: the ops stay Relax ops, for tvm_ext.build's strategy (legalized, every op
    # would be a call_tir of TOPI's kernels)
    train_mod = SetupTrainer(CrossEntropyLoss(reduction="mean"), SGD(LR),
                             [relax.TensorType((BATCH, 10), "float32"), relax.TensorType((BATCH,), "int64")],
                             legalize=False)(_backbone())
    report = tvm_ext.dispatch_report(train_mod, "llvm", function="backbone_loss_adjoint")
    assert sum(row.kernel == "conv2d_backward_weight" for row in report) == 2
    assert not any(row.op == "nn.conv2d" and row.kernel == "fallback" for row in report)
    trainer = Trainer(train_mod, relax.VirtualMachine(tvm_ext.build(train_mod, "llvm"), tvm.cpu()), tvm.cpu(), False)
    trainer.load_params([init[name] for name in SHAPES])
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
    from tvm.relax.frontend.torch import from_exported_program

    from tvm_ext.models import torchvision_zoo

    size, batch = 32, 2
    model = torchvision_zoo.load("resnet18", size).eval()
    weights = torch.from_numpy(np.random.default_rng(2).standard_normal((batch, 1000)).astype(np.float32))

    class Loss(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x):
            return (self.net(x) * weights).sum()

    loss = Loss(model)
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((batch, 3, size, size)).astype(np.float32))
    with torch.no_grad():
        program = torch.export.export(loss, (x,))
    mod = from_exported_program(program, keep_params_as_input=True, unwrap_unit_return_tuple=True)
    mod, params = relax.frontend.detach_params(mod)
    mod = relax.transform.DecomposeOpsForInference()(mod)
    mod = relax.transform.Gradient("main", require_grads=mod["main"].params[1:])(mod)
    report = tvm_ext.dispatch_report(mod, "llvm", function="main_adjoint")
    assert sum(row.kernel == "conv2d_backward_weight" for row in report) == 20  # every convolution's dW
    assert not any(row.op == "nn.conv2d" and row.kernel == "fallback" for row in report)
    vm = relax.VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())
    _, grads = vm["main_adjoint"](tvm.runtime.tensor(x.numpy()), *[tvm.runtime.tensor(p.numpy())
                                                                   for p in params["main"]])
    loss(x).backward()
    expected = [p.grad.numpy() for p in loss.parameters()]
    assert len(grads) == len(expected) == 62
    for got, want in zip(grads, expected, strict=True):
        assert np.abs(got.numpy() - want).max() <= 1e-4 * np.abs(want).max()
