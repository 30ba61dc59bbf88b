"""tvm_ext.train.from_torch: a PyTorch model trained through relax.training on tvm_ext's kernels
follows torch.optim.SGD step by step, its batch norms' running statistics included (PyTorch's
unbiased running variance, num_batches_tracked), and the trained values go back into the model."""

import copy

import numpy as np
import pytest
import torch
import tvm
from reference import kernel_calls, rel_err
from tvm import relax

import tvm_ext
from tvm_ext.errors import UnsupportedError
from tvm_ext.train import SetupTrainer, from_torch

TARGET = tvm_ext.resolve_target("llvm")
BATCH = 4


class _Net(torch.nn.Module):
    """conv -> bn -> relu, conv -> bn (momentum 0.3) + shortcut -> relu, a frozen 1x1 conv with a
    batch norm kept in eval mode (a fine-tuning's frozen part), global mean, linear."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(3, 16, 3, padding=1, bias=False), torch.nn.BatchNorm2d(16)
        self.conv2 = torch.nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(16, momentum=0.3)
        self.frozen, self.frozen_bn = torch.nn.Conv2d(16, 8, 1), torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 10)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.relu(self.bn2(self.conv2(h)) + h)
        return self.fc(self.frozen_bn(self.frozen(h)).mean((2, 3)))


def _net(seed: int = 0) -> _Net:
    torch.manual_seed(seed)
    net = _Net().train()
    net.frozen.requires_grad_(False)
    net.frozen_bn.eval()
    with torch.no_grad():  # statistics away from PyTorch's initial ones, so that a wrong update shows
        for bn in (net.bn1, net.bn2, net.frozen_bn):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
    return net


def test_training_follows_pytorch_with_running_statistics():
    """Five SGD steps: the losses, every parameter and every buffer after write_to agree with
    PyTorch's (the running variance from the unbiased batch variance: TVM's biased one would be
    1/63 of the batch variance short), and the batch norms still fuse their relu and shortcut
    although the step reads their running statistics."""
    from tvm.relax.training import Trainer
    from tvm.relax.training.loss import CrossEntropyLoss
    from tvm.relax.training.optimizer import SGD

    ours, theirs = _net(), _net()
    x = torch.randn(BATCH, 3, 8, 8)
    imported = from_torch(ours, (x,))
    assert imported.param_names == ["conv1.weight", "bn1.weight", "bn1.bias", "conv2.weight", "bn2.weight",
                                    "bn2.bias", "frozen_bn.weight", "frozen_bn.bias", "fc.weight", "fc.bias"]
    assert imported.state_names == [f"{bn}.{s}" for bn in ("bn1", "bn2")
                                    for s in ("running_mean", "running_var", "num_batches_tracked")]
    # the importer's tuples around each batch norm are gone: else Gradient writes zero adjoints for them
    values = [b.value for b in imported.mod["backbone"].body.blocks[0].bindings]
    assert not any(isinstance(v, relax.Tuple) or (isinstance(v, relax.Call) and v.op.name == "relax.zeros")
                   for v in values)
    loss_args = [imported.output_type, relax.TensorType((BATCH,), "int64")]
    mod = SetupTrainer(CrossEntropyLoss(reduction="sum"), SGD(0.05), loss_args, legalize=False)(imported.mod)
    trainer = Trainer(mod, relax.VirtualMachine(tvm_ext.build(mod, TARGET), tvm.cpu()), tvm.cpu(),
                      zero_init_param_state=False)
    trainer.load_params(imported.params)
    trainer.load_states(imported.states)
    sgd = torch.optim.SGD([p for p in theirs.parameters() if p.requires_grad], lr=0.05)
    rng = np.random.default_rng(1)
    for _ in range(5):
        xv, yv = rng.standard_normal((BATCH, 3, 8, 8)).astype(np.float32), rng.integers(0, 10, BATCH)
        loss = torch.nn.functional.cross_entropy(theirs(torch.from_numpy(xv)), torch.from_numpy(yv), reduction="sum")
        sgd.zero_grad()
        loss.backward()
        sgd.step()
        assert float(trainer.update([xv], [yv]).numpy()) == pytest.approx(loss.item(), rel=1e-5)
    before = {name: value.clone() for name, value in ours.state_dict().items()}
    imported.write_to(ours, list(trainer.export_params().values()), list(trainer.export_states().values()))
    for name, want in theirs.state_dict().items():
        got = ours.state_dict()[name]
        assert rel_err(got.numpy(), want.numpy()) <= 1e-5, name
        assert name.startswith(("frozen", "fc.")) or not torch.equal(got, before[name]), name  # trained, updated
    assert int(ours.bn1.num_batches_tracked) == 5

    calls = kernel_calls(mod, TARGET, function="backbone_loss_adjoint")
    forward = [name for name in calls if name.startswith("tvm_ext_batch_norm_") and "backward" not in name]
    assert [name.rsplit("_", 2)[-2:] for name in forward] == [["center", "relu"], ["residual", "relu"]], calls
    assert not any(name.startswith(("tvm_ext_batch_statistics", "tvm_ext_relu", "relu")) for name in calls), calls


def test_cumulative_average_statistics_follow_pytorch():
    """momentum=None (a cumulative average, factor 1 / num_batches_tracked) was refused: its
    factor would have been traced as the first step's number. Three forwards from statistics
    already 4 batches in, the states fed back, against PyTorch's module."""
    torch.manual_seed(5)
    ours = torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3), torch.nn.BatchNorm2d(6, momentum=None),
                               torch.nn.ReLU(), torch.nn.BatchNorm2d(6, momentum=0.3)).train()
    ours[1].num_batches_tracked.fill_(4)
    theirs = copy.deepcopy(ours)
    imported = from_torch(ours, (torch.randn(2, 3, 7, 7),))
    vm = relax.VirtualMachine(tvm_ext.build(imported.mod, TARGET), tvm.cpu())
    params, states = [tvm.runtime.tensor(p) for p in imported.params], [tvm.runtime.tensor(s) for s in imported.states]
    for _ in range(3):
        x = torch.randn(2, 3, 7, 7)
        got, *states = vm["backbone"](tvm.runtime.tensor(x.numpy()), *params, *states)
        with torch.no_grad():
            assert rel_err(got.numpy(), theirs(x).numpy()) <= 1e-5
    for name, state in zip(imported.state_names, states, strict=True):
        assert rel_err(state.numpy(), theirs.state_dict()[name].numpy()) <= 1e-5, name
    assert int(states[2].numpy()) == 7


def test_eval_mode_model_has_no_states():
    """A model in eval mode normalizes with its running statistics (constants): no states, and the
    backbone returns the output alone."""
    net = _net().eval()
    imported = from_torch(net, (torch.randn(2, 3, 8, 8),))
    assert imported.states == [] and imported.state_names == []
    assert int(imported.mod.attrs["state_num"]) == 0
    assert tuple(int(d) for d in imported.output_type.shape) == (2, 10)
    x = np.random.default_rng(2).standard_normal((2, 3, 8, 8)).astype(np.float32)
    vm = relax.VirtualMachine(tvm_ext.build(imported.mod, TARGET), tvm.cpu())
    got = vm["backbone"](tvm.runtime.tensor(x), *map(tvm.runtime.tensor, imported.params)).numpy()
    with torch.no_grad():
        assert rel_err(got, net(torch.from_numpy(x)).numpy()) <= 1e-5


class _Counting(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 1)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.calls += 1
        return self.conv(x)


class _TwiceNormed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm2d(3)

    def forward(self, x):
        return self.bn(self.bn(x))


class _StochasticDepth(torch.nn.Module):
    """torchvision's StochasticDepth (EfficientNet): the importer turned its bernoulli into the
    uninitialized tensor it fills, and the loss came out 0."""

    def forward(self, x):
        noise = torch.empty([x.shape[0], 1, 1, 1], dtype=x.dtype).bernoulli_(0.8)
        return x * noise.div_(0.8)


@pytest.mark.parametrize("model,message", [
    (_Counting(), "updates 'calls'"),
    (_TwiceNormed(), "runs twice"),
    (torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.Dropout(0.2)), "random numbers.*dropout"),
    (torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), _StochasticDepth()), "random numbers.*bernoulli"),
], ids=["other-buffer", "batch-norm-twice", "dropout", "stochastic-depth"])
def test_refused_models_say_why(model, message):
    """What the import cannot carry is refused with the reason, not trained wrongly."""
    with pytest.raises(UnsupportedError, match=message):
        from_torch(model.train(), (torch.randn(2, 3, 4, 4),))


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="model"):
        from_torch(lambda x: x, (torch.randn(1),))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="example_inputs"):
        from_torch(_net(), torch.randn(2, 3, 8, 8))  # type: ignore[arg-type]
    net = _net()
    imported = from_torch(net, (torch.randn(2, 3, 8, 8),))
    with pytest.raises(ValueError, match="params has 1 values"):
        imported.write_to(net, imported.params[:1], imported.states)
    with pytest.raises(ValueError, match="'conv1.weight' is"):
        imported.write_to(net, [np.zeros(3, np.float32)] + imported.params[1:], imported.states)


def test_batch_norm_without_running_statistics_has_no_state():
    """A batch norm that tracks no running statistics (always batch statistics) imports as such:
    not a state, not refused; the output is PyTorch's."""
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8, track_running_stats=False),
                              torch.nn.ReLU()).train()
    x = torch.randn(2, 3, 6, 6)
    imported = from_torch(net, (x,))
    assert imported.states == [] and imported.param_names == ["0.weight", "0.bias", "1.weight", "1.bias"]
    vm = relax.VirtualMachine(tvm_ext.build(imported.mod, TARGET), tvm.cpu())
    got = vm["backbone"](tvm.runtime.tensor(x.numpy()), *map(tvm.runtime.tensor, imported.params)).numpy()
    with torch.no_grad():
        assert rel_err(got, net(x).numpy()) <= 1e-5


def test_float64_batch_norm_updates_its_statistics_in_float64():
    """The running variance's update is written in the model's dtype (it was float32 constants:
    a float64 model's import failed on the dtype mismatch), and a batch norm that is the model
    itself has its statistics carried (their names have no module prefix: it was refused as a
    forward updating other buffers). TVM's importer writes convolutions in float32 whatever the
    model's dtype, so the model is a batch norm alone."""
    torch.manual_seed(4)
    net = torch.nn.BatchNorm2d(5).double().train()
    x = torch.randn(3, 5, 4, 4, dtype=torch.float64)
    imported = from_torch(net, (x,))
    vm = relax.VirtualMachine(tvm.compile(imported.mod, "llvm"), tvm.cpu())
    got, *states = vm["backbone"](*map(tvm.runtime.tensor, [x.numpy(), *imported.params, *imported.states]))
    with torch.no_grad():
        want = net(x).numpy()
    assert rel_err(got.numpy(), want) <= 1e-12
    for name, state in zip(imported.state_names, states, strict=True):
        assert state.numpy().dtype == net.state_dict()[name].numpy().dtype
        assert rel_err(state.numpy(), net.state_dict()[name].numpy()) <= 1e-12


def test_loss_step_gradient_returns_the_gradients_and_the_new_statistics():
    """models.training.loss_step_gradient (bench/train.py's step): the adjoint gives autograd's
    gradients of sum(model(x) * r) and the running statistics PyTorch's forward leaves."""
    from tvm_ext.models.training import loss_step_gradient

    net = _net()
    x = np.random.default_rng(4).standard_normal((BATCH, 3, 8, 8)).astype(np.float32)
    mod, params, states, loss = loss_step_gradient(net, x)
    vm = relax.VirtualMachine(tvm_ext.build(mod, TARGET), tvm.cpu())
    (value, *new_states), grads = vm["backbone_adjoint"](*map(tvm.runtime.tensor, [x, *params, *states]))
    want = loss(torch.from_numpy(x))  # (updates net's buffers as a training step does)
    want.backward()
    assert float(value.numpy()) == pytest.approx(want.item(), rel=1e-5)
    trained = [p for p in loss.parameters() if p.requires_grad]
    assert len(grads) == len(trained)
    for got, param in zip(grads, trained, strict=True):
        assert rel_err(got.numpy(), param.grad.numpy()) <= 1e-4
    buffers = dict(net.named_buffers())
    names = [f"{bn}.{s}" for bn in ("bn1", "bn2") for s in ("running_mean", "running_var", "num_batches_tracked")]
    assert len(new_states) == len(names)  # (frozen_bn, in eval mode, has none)
    for name, got in zip(names, new_states, strict=True):
        assert rel_err(got.numpy(), buffers[name].numpy()) <= 1e-5, name


class _TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.head1, self.head2 = torch.nn.Linear(8, 10), torch.nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        return self.head1(h), self.head2(h)


def test_a_model_of_several_outputs_returns_them_flat_before_the_states():
    """(SetupTrainer's loss takes the outputs as its first arguments; before, a model's tuple was
    one nested field and output_type its tuple type)"""
    torch.manual_seed(6)
    net = _TwoHeads().train()
    x = torch.randn(2, 3, 6, 6)
    imported = from_torch(net, (x,))
    assert [tuple(int(d) for d in t.shape) for t in imported.output_types] == [(2, 10), (2, 4)]
    with pytest.raises(ValueError, match="2 outputs; see output_types"):
        _ = imported.output_type
    vm = relax.VirtualMachine(tvm_ext.build(imported.mod, TARGET), tvm.cpu())
    out = vm["backbone"](*map(tvm.runtime.tensor, [x.numpy(), *imported.params, *imported.states]))
    with torch.no_grad():
        want = net(x)
    got = [out[i].numpy() for i in range(len(out))]
    assert len(got) == 2 + 3
    for ours, theirs in zip(got[:2], want, strict=True):
        assert rel_err(ours, theirs.numpy()) <= 1e-5
    for ours, name in zip(got[2:], imported.state_names, strict=True):
        assert rel_err(ours, net.state_dict()[name].numpy()) <= 1e-5, name


def test_dropout_in_eval_mode_or_of_zero_trains():
    """The way out the refusal names: dropout modules in eval mode (and p = 0) import as the
    identity they then are."""
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.Dropout(0.2), torch.nn.Dropout(0.0)).train()
    net[1].eval()
    x = torch.randn(2, 3, 4, 4)
    imported = from_torch(net, (x,))
    vm = relax.VirtualMachine(tvm_ext.build(imported.mod, TARGET), tvm.cpu())
    got = vm["backbone"](tvm.runtime.tensor(x.numpy()), *map(tvm.runtime.tensor, imported.params)).numpy()
    with torch.no_grad():
        assert rel_err(got, net(x).numpy()) <= 1e-6


def test_loss_gradient_refuses_dropout_in_training_mode():
    """models.training.loss_gradient exports the model itself; a training-mode dropout there was
    the identity, silently. Refused as from_torch refuses it; in eval mode (an undecomposed export
    keeps it as dropout(train=False)) it is the identity and the loss is PyTorch's."""
    from tvm_ext.models.training import loss_gradient

    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.Flatten(), torch.nn.Linear(64, 5),
                              torch.nn.Dropout(0.3)).train()
    x = np.random.default_rng(5).standard_normal((2, 3, 4, 4)).astype(np.float32)
    with pytest.raises(UnsupportedError, match="loss_gradient: .*random numbers"):
        loss_gradient(net, x)
    net[3].eval()
    mod, params, loss = loss_gradient(net, x)
    vm = relax.VirtualMachine(tvm_ext.build(mod, TARGET), tvm.cpu())
    value, _ = vm["main_adjoint"](*map(tvm.runtime.tensor, [x, *params]))
    with torch.no_grad():
        assert rel_err(value.numpy(), loss(torch.from_numpy(x)).numpy()) <= 1e-5
