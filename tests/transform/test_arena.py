"""The arena planner (tvm_ext.transform.arena): offsets that never overlap two live tensors, less
memory than TVM's storages where activations wait for a backward pass, and values that stay right
when a function's results and its arena are reused by the next call."""

import importlib

import numpy as np
import pytest
import tvm
from reference import rel_err
from tvm import relax

import tvm_ext
from tvm_ext.transform import arena

TARGET = tvm_ext.resolve_target("llvm")
PIPELINE = importlib.import_module("tvm_ext.pipeline")  # (tvm_ext.pipeline is also the function)


@pytest.mark.parametrize("seed", range(200))
def test_offsets_never_overlap_live_tensors(seed):
    rng = np.random.default_rng(seed)
    count = int(rng.integers(1, 40))
    tensors = {}
    for i in range(count):
        first = int(rng.integers(0, 60))
        tensors[i] = (int(rng.integers(1, 5000)), first, first + int(rng.integers(0, 20)))
    offsets, size = arena._offsets(tensors)
    spans = {i: (offsets[i], offsets[i] + tensors[i][0]) for i in tensors}
    for i in tensors:
        assert offsets[i] % arena.ALIGNMENT == 0 and spans[i][1] <= size
        for j in tensors:
            meet = tensors[i][1] <= tensors[j][2] and tensors[j][1] <= tensors[i][2]
            if i < j and meet:
                assert spans[i][1] <= spans[j][0] or spans[j][1] <= spans[i][0], (i, j)
    peak = max(sum(-(-n // arena.ALIGNMENT) * arena.ALIGNMENT for n, a, b in tensors.values() if a <= t <= b)
               for t in range(80))
    assert peak <= size <= sum(-(-n // arena.ALIGNMENT) * arena.ALIGNMENT for n, _, _ in tensors.values())


def _strided_gradient(batch_norm: bool = False) -> tvm.IRModule:
    """A small strided CNN's loss, differentiated: activations of several sizes wait for the
    backward pass, so TVM's storages live long and each hosts tensors of many lifetimes.
    `batch_norm`: a training-mode batch norm after each convolution (its gradient kernel's
    outputs come as a tuple, of which dgamma and dbeta are returned and dX is not)."""
    op = relax.op
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 8, 32, 32), "float32"))
    layers, channels, params = [], 8, []
    for i, (out, stride) in enumerate([(16, 1), (32, 2), (64, 2), (64, 1)]):
        layers.append((relax.Var(f"w{i}", relax.TensorType((out, channels, 3, 3), "float32")), stride,
                       [relax.Var(f"{n}{i}", relax.TensorType((out,), "float32")) for n in ("g", "b")]))
        params += [layers[-1][0], *(layers[-1][2] if batch_norm else [])]
        channels = out
    with bb.function("main", [x, *params]):
        with bb.dataflow():
            h = x
            for w, stride, (gamma, beta) in layers:
                h = bb.emit(op.nn.conv2d(h, w, strides=stride, padding=1))
                if batch_norm:
                    stats = [relax.const(np.full(int(gamma.ty.shape[0]), v, np.float32)) for v in (0, 1)]
                    h = bb.emit(relax.TupleGetItem(bb.emit(op.nn.batch_norm(h, gamma, beta, *stats, axis=1,
                                                                            training=True)), 0))
                h = bb.emit(op.nn.relu(h))
            loss = bb.emit_output(op.sum(op.multiply(h, h)))
        bb.emit_func_output(loss)
    return relax.transform.Gradient("main", require_grads=params)(bb.get())


def _storage_bytes(mod: tvm.IRModule, function: str) -> tuple[int, list[int]]:
    """(bytes of the arena, bytes of each other constant-size storage) a lowered `function` allocates."""
    arena_bytes, others = 0, []
    for block in mod[function].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and str(getattr(value.op, "name", "")) == "relax.vm.alloc_storage":
                size = int(value.args[0].values[0])
                if binding.var.name == "tvm_ext_arena":
                    arena_bytes += size
                else:
                    others.append(size)
    return arena_bytes, others


@pytest.mark.parametrize("batch_norm", [pytest.param(False, marks=[pytest.mark.slow, pytest.mark.long]), True])
def test_arena_is_smaller_than_the_storages_it_replaces(monkeypatch, batch_norm):
    """With training-mode batch norms, the arena was not made at all (every tensor of a kernel's
    output tuple counted as returned when one of its fields was)."""
    mod = _strided_gradient(batch_norm)
    with tvm.transform.PassContext(opt_level=3):
        planned = tvm_ext.pipeline(TARGET)(mod)
    monkeypatch.setattr(PIPELINE, "plan_arena", lambda: tvm.transform.Sequential([]))
    with tvm.transform.PassContext(opt_level=3):
        stock = tvm_ext.pipeline(TARGET)(mod)
    arena_bytes, rest = _storage_bytes(planned, "main_adjoint")
    none, storages = _storage_bytes(stock, "main_adjoint")
    assert none == 0 and arena_bytes > 0
    assert arena_bytes + sum(rest) < 0.9 * sum(storages), (arena_bytes, sum(rest), sum(storages))
    # and the gradients are those of stock TVM's build
    rng = np.random.default_rng(1)
    args = [tvm.runtime.tensor((0.2 * rng.standard_normal(tuple(int(d) for d in p.ty.shape))
                                + (1 if p.name.startswith("g") else 0)).astype(np.float32))
            for p in mod["main_adjoint"].params]
    _, got = relax.VirtualMachine(tvm_ext.build(mod, TARGET), tvm.cpu())["main_adjoint"](*args)
    _, want = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())["main_adjoint"](*args)
    for g, w in zip(got, want, strict=True):
        assert rel_err(g.numpy(), w.numpy()) <= 1e-5


def test_results_survive_the_next_call():
    """A function returning a view of an intermediate and a value computed early: the second
    call reuses the arena, the first call's results must not change."""
    op = relax.op
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 8, 8), "float32"))
    w = relax.Var("w", relax.TensorType((8, 8, 3, 3), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            a = bb.emit(op.nn.relu(op.nn.conv2d(x, w, padding=1)))
            b = bb.emit(op.nn.conv2d(a, w, padding=1))
            c = bb.emit(op.nn.conv2d(op.add(b, a), w, padding=1))
            out = bb.emit_output(relax.Tuple([op.reshape(a, (8, 64)), op.add(c, b)]))
        bb.emit_func_output(out)
    vm = relax.VirtualMachine(tvm_ext.build(bb.get(), TARGET), tvm.cpu())
    rng = np.random.default_rng(0)
    wv = rng.standard_normal((8, 8, 3, 3)).astype(np.float32)
    x1, x2 = (rng.standard_normal((1, 8, 8, 8)).astype(np.float32) for _ in range(2))
    first = vm["main"](tvm.runtime.tensor(x1), tvm.runtime.tensor(wv))
    kept = [t.numpy() for t in first]
    second = vm["main"](tvm.runtime.tensor(x2), tvm.runtime.tensor(wv))
    stock = relax.VirtualMachine(tvm.compile(bb.get(), "llvm"), tvm.cpu())["main"]
    for held, fresh, data in ((first, kept, x1), (second, None, x2)):
        expected = stock(tvm.runtime.tensor(data), tvm.runtime.tensor(wv))
        for got, want in zip(held, expected, strict=True):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4)
        if fresh is not None:
            for got, before in zip(held, fresh, strict=True):
                np.testing.assert_array_equal(got.numpy(), before)
