"""NaN and infinity as PyTorch treats them, in the eager ops, the fused convolution epilogues
and pooling: a NaN stays a NaN (relu's max(x, 0) made it 0), an all -inf window pools to -inf."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import tvm
from reference import random_const
from tvm import relax

import tvm_ext
from tvm_ext import ops

NAN, INF = float("nan"), float("inf")
SPECIAL = np.array([NAN, INF, -INF, -1.5, -0.0, 0.0, 0.25, 3.0, 7.0], np.float32)

ACTIVATIONS = {
    "relu": (ops.relu, F.relu), "relu6": (ops.relu6, F.relu6), "sigmoid": (ops.sigmoid, torch.sigmoid),
    "leaky_relu": (lambda x: ops.leaky_relu(x, 0.2), lambda x: F.leaky_relu(x, 0.2)),
    "silu": (ops.silu, F.silu), "gelu": (ops.gelu, F.gelu),
}
# gelu(+-inf) is NaN in PyTorch (inf * 0 inside its formula) and +-inf... here: compare finite and NaN inputs
_FINITE_OR_NAN = {"silu", "gelu"}


def _values(name: str) -> np.ndarray:
    values = SPECIAL[~np.isinf(SPECIAL)] if name in _FINITE_OR_NAN else SPECIAL
    rng = np.random.default_rng(0)
    x = rng.standard_normal(300).astype(np.float32) * 4  # longer than a vector: the vector loop too
    x[rng.choice(300, len(values) * 4, replace=False)] = np.tile(values, 4)
    return x.reshape(3, 100)


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_eager_activations_keep_nan_and_inf_as_pytorch(name):
    ours, theirs = ACTIVATIONS[name]
    x = _values(name)
    np.testing.assert_allclose(ours(x), theirs(torch.from_numpy(x)).numpy(), rtol=1e-6, atol=2e-6, equal_nan=True)


def test_max_pool_propagates_nan_and_keeps_minus_infinity():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 16, 12, 12)).astype(np.float32)
    x[0, 3, 5, 7] = x[0, 9, 0, 0] = x[0, 12, 11, 11] = NAN  # inside, first and last of a window
    x[0, 4, 2:4, 2:4] = -INF  # a whole 2x2 window
    x[0, 5, 6, 6] = INF
    for kernel, stride, padding in (((2, 2), (2, 2), 0), ((3, 3), (2, 2), 1), ((3, 3), (1, 1), 1)):
        ref = F.max_pool2d(torch.from_numpy(x), kernel, stride, padding).numpy()
        got = ops.max_pool2d(x, kernel, stride, padding)
        np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("activation", ["relu", "relu6", "leaky_relu"])
def test_fused_epilogues_keep_nan(activation):
    """conv + bias (+ shortcut) -> activation, in one kernel: a NaN input pixel stays NaN."""
    act = {"relu": relax.op.nn.relu, "relu6": lambda v: relax.op.clip(v, 0.0, 6.0),
           "leaky_relu": lambda v: relax.op.nn.leakyrelu(v, 0.1)}[activation]
    rng = np.random.default_rng(2)
    w, b = random_const(rng, 16, 16, 1, 1), random_const(rng, 1, 16, 1, 1)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 16, 8, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(act(relax.op.add(relax.op.add(relax.op.nn.conv2d(x, w), b), x)))
            out = bb.emit_output(relax.op.nn.max_pool2d(y, (3, 3), (2, 2), (1, 1)))  # blocked, unrolled
        bb.emit_func_output(out)
    mod = bb.get()
    assert any(r.reason == "fused" and r.op != "add" for r in tvm_ext.dispatch_report(mod, "llvm"))
    xv = rng.standard_normal((1, 16, 8, 8)).astype(np.float32)
    xv[0, :, 3, 3] = NAN
    got = relax.VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())["main"](tvm.runtime.tensor(xv)).numpy()
    torch_act = {"relu": F.relu, "relu6": F.relu6, "leaky_relu": lambda v: F.leaky_relu(v, 0.1)}[activation]
    t = torch.from_numpy(xv)
    conv = F.conv2d(t, torch.from_numpy(w.value.numpy()), torch.from_numpy(b.value.numpy().reshape(-1)))
    ref = F.max_pool2d(torch_act(conv + t), 3, 2, 1).numpy()
    assert np.isnan(got[0, :, 1, 1]).all()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5, equal_nan=True)
