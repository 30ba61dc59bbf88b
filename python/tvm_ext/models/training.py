"""Training examples as Relax modules: a small CNN for scikit-learn's 8x8 digits, written as a
`relax.training` backbone and in PyTorch with the same parameters, and any PyTorch model's loss
differentiated by `relax.transform.Gradient` (with the gradients `import tvm_ext` registers).
For the training tests, the tutorial and bench/train.py. Needs torch (a test and bench extra).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ..transform import fold_trained_batch_norm

__all__ = ["DIGITS_CNN_SHAPES", "digits_cnn", "digits_cnn_init", "digits_cnn_torch", "loss_gradient", "loss_module",
           "loss_step_gradient"]

# conv 3x3 (8) -> relu -> max pool 2 -> conv 3x3 (16) -> relu -> flatten -> linear (10), biases
DIGITS_CNN_SHAPES = {"w1": (8, 1, 3, 3), "b1": (8,), "w2": (16, 8, 3, 3), "b2": (16,), "w3": (10, 256), "b3": (10,)}
_FAN_IN = {"w1": 9, "w2": 72, "w3": 256}


def digits_cnn(batch: int) -> tvm.IRModule:
    """The CNN as a `relax.training` backbone: `backbone(x, *parameters)` -> logits, with the
    attributes SetupTrainer reads (its parameters are all trained; no states)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((batch, 1, 8, 8), "float32"))
    p = {name: relax.Var(name, relax.TensorType(shape, "float32")) for name, shape in DIGITS_CNN_SHAPES.items()}
    op = relax.op
    with bb.function("backbone", [x, *p.values()]):
        with bb.dataflow():
            h = bb.emit(op.nn.relu(op.add(op.nn.conv2d(x, p["w1"], padding=1), op.reshape(p["b1"], (1, 8, 1, 1)))))
            h = bb.emit(op.nn.max_pool2d(h, 2, 2))
            h = bb.emit(op.nn.relu(op.add(op.nn.conv2d(h, p["w2"], padding=1), op.reshape(p["b2"], (1, 16, 1, 1)))))
            h = bb.emit(op.reshape(h, (batch, 256)))
            out = bb.emit_output(op.add(op.matmul(h, op.permute_dims(p["w3"])), p["b3"]))
        bb.emit_func_output(out)
    return bb.get().with_attr("param_num", len(DIGITS_CNN_SHAPES)).with_attr("state_num", 0)


def digits_cnn_init(seed: int = 0) -> dict[str, np.ndarray]:
    """Initial parameters: He's initialization for the weights, zero biases."""
    rng = np.random.default_rng(seed)
    return {name: (rng.standard_normal(shape) * np.sqrt(2 / _FAN_IN.get(name, np.inf))).astype(np.float32)
            for name, shape in DIGITS_CNN_SHAPES.items()}


def digits_cnn_torch(params: dict, x):
    """The same CNN in PyTorch: logits of images `x` (a torch tensor) with `params` (torch tensors)."""
    import torch

    functional = torch.nn.functional
    h = torch.relu(functional.conv2d(x, params["w1"], params["b1"], padding=1))
    h = functional.max_pool2d(h, 2)
    h = torch.relu(functional.conv2d(h, params["w2"], params["b2"], padding=1)).reshape(x.shape[0], 256)
    return h @ params["w3"].T + params["b3"]


def loss_module(model, x: np.ndarray, seed: int = 2):
    """`model`'s loss sum(model(x) * r) as a torch module of images x, r seeded (images x
    classes): the loss :func:`loss_gradient` differentiates."""
    import torch

    with torch.no_grad():
        modes = [(module, module.training) for module in model.modules()]  # (a part may be in eval mode)
        classes = model.eval()(torch.from_numpy(x[:1])).shape[1]  # (batch statistics of one image may not exist)
        for module, training in modes:
            module.train(training)
    weights = torch.from_numpy(np.random.default_rng(seed).standard_normal((x.shape[0], classes),
                                                                            dtype=np.float32))

    class Loss(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, images):
            return (self.net(images) * weights).sum()

    return Loss(model)


def loss_gradient(model, x: np.ndarray, seed: int = 2):
    """(gradient module, parameter arrays, torch loss) for `model`'s loss sum(model(x) * r)
    (:func:`loss_module`): `main_adjoint(x, *parameters)` of the module returns the loss and
    every parameter's gradient, in the order of the torch loss module's `parameters()`. A model
    in eval mode has its batch norms in inference form, folded into their convolutions' weights
    (:func:`tvm_ext.transform.fold_trained_batch_norm`); in training mode they normalize with the
    batch's statistics (the running statistics are not updated: the importer drops them;
    :func:`loss_step_gradient` updates them)."""
    import torch
    from tvm.relax.frontend.torch import from_exported_program

    from ..train import check_deterministic

    loss = loss_module(model, x, seed)
    with torch.no_grad():
        program = torch.export.export(loss, (torch.from_numpy(x),))
    check_deterministic(program, "loss_gradient")
    mod = from_exported_program(program, keep_params_as_input=True, unwrap_unit_return_tuple=True)
    mod, params = relax.frontend.detach_params(mod)
    if model.training:  # the importer's tuples around each batch norm, read back at once
        mod = relax.transform.DeadCodeElimination()(relax.transform.CanonicalizeBindings()(mod))
    else:
        mod = fold_trained_batch_norm()(mod)
        mod = relax.transform.DecomposeOpsForInference()(mod)
    mod = relax.transform.Gradient("main", require_grads=mod["main"].params[1:])(mod)
    return mod, [p.numpy() for p in params["main"]], loss


def loss_step_gradient(model, x: np.ndarray, seed: int = 2):
    """(gradient module, parameter arrays, state arrays, torch loss) for a training step of
    `model`'s loss sum(model(x) * r) (:func:`loss_module`) imported by
    :func:`tvm_ext.train.from_torch`: `backbone_adjoint(x, *parameters, *states)` returns ((the
    loss, *the new states), the parameters' gradients), the states being the batch norms' running
    statistics, updated as PyTorch's training step updates them."""
    import torch

    from ..train import from_torch

    loss = loss_module(model, x, seed)
    imported = from_torch(loss, (torch.from_numpy(x),))
    backbone = imported.mod["backbone"]
    params = backbone.params[1:1 + len(imported.params)]
    mod = relax.transform.Gradient("backbone", require_grads=list(params))(imported.mod)
    return mod, imported.params, imported.states, loss
