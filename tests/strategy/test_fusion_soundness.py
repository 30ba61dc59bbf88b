"""Epilogue fusion never changes what a graph computes: operand order, values used twice, values
read outside the fused region, odd bias shapes. Each graph is built with tvm_ext and compared
with stock TVM on fresh random inputs; the dispatch report says "fused" only for what the kernel
computes."""

import numpy as np
import pytest
import tvm
from reference import random_const, rel_err
from tvm import relax

import tvm_ext

TARGET = tvm_ext.resolve_target("llvm")
SHAPE = (1, 16, 9, 11)


def _conv(bb, rng, x, k=16):
    return bb.emit(relax.op.nn.conv2d(x, random_const(rng, k, SHAPE[1], 3, 3), padding=(1, 1)))


def _shortcut_first(bb, rng, x):
    """RegNet's `x + f(x)`: the shortcut is the add's first operand."""
    return bb.emit(relax.op.add(x, _conv(bb, rng, x)))


def _shortcut_first_then_relu(bb, rng, x):
    y = bb.emit(relax.op.add(_conv(bb, rng, x), random_const(rng, 1, 16, 1, 1)))
    return bb.emit(relax.op.nn.relu(relax.op.add(x, y)))


def _bias_first(bb, rng, x):
    return bb.emit(relax.op.nn.relu(relax.op.add(random_const(rng, 1, 16, 1, 1), _conv(bb, rng, x))))


def _bias_first_shortcut_first(bb, rng, x):
    y = bb.emit(relax.op.add(random_const(rng, 16, 1, 1), _conv(bb, rng, x)))
    return bb.emit(relax.op.nn.relu(relax.op.add(x, y)))


def _sum_of_itself(bb, rng, x):
    """y + y with y = conv + bias: the 'shortcut' is the fused value itself."""
    y = bb.emit(relax.op.add(_conv(bb, rng, x), random_const(rng, 1, 16, 1, 1)))
    return bb.emit(relax.op.nn.relu(relax.op.add(y, y)))


def _silu_as_product(bb, rng, x):
    """EfficientNet's SiLU as imported: (conv + b) * sigmoid(conv + b); conv + b is read twice."""
    y = bb.emit(relax.op.add(_conv(bb, rng, x), random_const(rng, 1, 16, 1, 1)))
    return bb.emit(relax.op.multiply(y, bb.emit(relax.op.sigmoid(y))))


def _activation_input_read_outside(bb, rng, x):
    y = bb.emit(relax.op.add(_conv(bb, rng, x), random_const(rng, 1, 16, 1, 1)))
    return bb.emit(relax.op.add(bb.emit(relax.op.nn.relu(y)), y))


def _convolution_read_twice(bb, rng, x):
    c = _conv(bb, rng, x)
    return bb.emit(relax.op.add(relax.op.nn.relu(c), c))


def _sum_of_two_convolutions(bb, rng, x):
    return bb.emit(relax.op.nn.relu(relax.op.add(_conv(bb, rng, x), _conv(bb, rng, x))))


def _sum_of_two_biased_convolutions(bb, rng, x):
    a = bb.emit(relax.op.add(_conv(bb, rng, x), random_const(rng, 1, 16, 1, 1)))
    b = bb.emit(relax.op.add(random_const(rng, 1, 16, 1, 1), _conv(bb, rng, x)))
    return bb.emit(relax.op.add(b, a))


def _scalar_biases(bb, rng, x):
    y = bb.emit(relax.op.add(_conv(bb, rng, x), random_const(rng, 1, 1, 1, 1)))
    y = bb.emit(relax.op.add(relax.const(np.float32(0.25)), _conv(bb, rng, y)))
    return bb.emit(relax.op.nn.relu(relax.op.add(_conv(bb, rng, y), random_const(rng, 11))))  # along W


def _broadcast_shortcut(bb, rng, x):
    """A shortcut of shape (1, 16, 1, 1) broadcast over the output: not a residual of its shape."""
    pooled = bb.emit(relax.op.mean(x, axis=[2, 3], keepdims=True))
    return bb.emit(relax.op.nn.relu(relax.op.add(pooled, _conv(bb, rng, x))))


def _chain_of_activations(bb, rng, x):
    y = bb.emit(relax.op.nn.relu(relax.op.add(_conv(bb, rng, x), random_const(rng, 1, 16, 1, 1))))
    return bb.emit(relax.op.sigmoid(relax.op.nn.relu(y)))


def _graph_output_and_epilogue(bb, rng, x):
    """The conv + bias is an output of the graph as well as the relu's input."""
    y = bb.emit(relax.op.add(_conv(bb, rng, x), random_const(rng, 1, 16, 1, 1)))
    return bb.emit(relax.Tuple([y, bb.emit(relax.op.nn.relu(y))]))


GRAPHS = [_shortcut_first, _shortcut_first_then_relu, _bias_first, _bias_first_shortcut_first, _sum_of_itself,
          _silu_as_product, _activation_input_read_outside, _convolution_read_twice, _sum_of_two_convolutions,
          _sum_of_two_biased_convolutions, _scalar_biases, _broadcast_shortcut, _chain_of_activations,
          _graph_output_and_epilogue]


def _module(body, seed: int) -> tvm.IRModule:
    rng = np.random.default_rng(seed)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(SHAPE, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(body(bb, rng, x))
        bb.emit_func_output(out)
    return bb.get()


def _outputs(ex, x: np.ndarray) -> list[np.ndarray]:
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x))
    return [out.numpy()] if hasattr(out, "numpy") else [o.numpy() for o in out]


@pytest.mark.parametrize("body", GRAPHS, ids=[g.__name__.strip("_") for g in GRAPHS])
def test_fusion_keeps_what_the_graph_computes(body):
    mod = _module(body, 0)
    x = np.random.default_rng(1).standard_normal(SHAPE).astype("float32")
    got = _outputs(tvm_ext.build(mod, TARGET, winograd=False), x)
    ref = _outputs(tvm.compile(mod, TARGET), x)
    assert len(got) == len(ref)
    for g, r in zip(got, ref, strict=True):
        assert g.shape == r.shape and rel_err(g, r) <= 1e-4, rel_err(g, r)


def test_a_shortcut_first_is_fused_as_a_shortcut():
    """x + conv(x) still runs in the kernel's epilogue, and the report says so."""
    report = tvm_ext.dispatch_report(_module(_shortcut_first_then_relu, 0), TARGET)
    assert [(r.op, r.reason) for r in report[1:]] == [("add", "fused")] * 2 + [("nn.relu", "fused")]


def test_a_value_read_outside_its_match_is_not_fused_away():
    """relu(conv + b) + (conv + b): the relu is not fused (conv + b is needed outside)."""
    report = tvm_ext.dispatch_report(_module(_activation_input_read_outside, 0), TARGET)
    assert not any(r.op == "nn.relu" and r.reason == "fused" for r in report), str(report)


@pytest.mark.parametrize("sigmoid_first", [False, True])
def test_silu_as_a_product_fuses_as_silu(sigmoid_first):
    """EfficientNet's (conv + b) * sigmoid(conv + b), in either operand order, runs as one kernel
    with a SiLU epilogue."""
    def body(bb, rng, x):
        y = bb.emit(relax.op.add(_conv(bb, rng, x), random_const(rng, 1, 16, 1, 1)))
        s = bb.emit(relax.op.sigmoid(y))
        return bb.emit(relax.op.multiply(s, y) if sigmoid_first else relax.op.multiply(y, s))

    report = tvm_ext.dispatch_report(_module(body, 0), TARGET)
    assert [(r.op, r.reason) for r in report[1:]] == [("add", "fused"), ("nn.silu", "fused")], str(report)


def _hardsigmoid(x, three=3.0, six=6.0):
    """PyTorch's importer's hardsigmoid: clip(x + 3, 0, 6) / 6."""
    shifted = relax.op.add(x, relax.const(np.float32(three)))
    return relax.op.divide(relax.op.clip(shifted, 0, 6), relax.const(np.float32(six)))


def _exported_relu6_of_x_plus_3(x):
    """torch.export's clamp(x + 3, 0, 6): two one-sided clips."""
    shifted = relax.op.add(x, relax.const(np.float32(3.0)))
    return relax.op.clip(relax.op.clip(shifted, 0, float("inf")), float("-inf"), 6)


@pytest.mark.parametrize("form", ["hardswish", "hardswish_gate_first", "hardsigmoid", "exported_hardswish",
                                  "exported_hardsigmoid", "divided_by_5", "gate_of_another_value"])
def test_hardswish_and_hardsigmoid_fuse_as_written_by_the_importer(form):
    """MobileNet-v3's hardswish x * (clip(x + 3, 0, 6) / 6), in either operand order or as
    torch.export writes it ((x * clamp(x + 3, 0, 6)) / 6, two one-sided clips), and hardsigmoid
    run in the convolution's epilogue; look-alikes (another constant, a gate computed
    from another value) are left as they are, and every form computes what the graph says."""
    def body(bb, rng, x):
        y = bb.emit(relax.op.add(_conv(bb, rng, x), random_const(rng, 1, 16, 1, 1)))
        if form == "hardsigmoid":
            return bb.emit(_hardsigmoid(y))
        if form == "exported_hardsigmoid":
            return bb.emit(relax.op.divide(_exported_relu6_of_x_plus_3(y), relax.const(np.float32(6.0))))
        if form == "exported_hardswish":  # (y * clamp(y + 3, 0, 6)) / 6
            product = bb.emit(relax.op.multiply(y, bb.emit(_exported_relu6_of_x_plus_3(y))))
            return bb.emit(relax.op.divide(product, relax.const(np.float32(6.0))))
        gate = bb.emit(_hardsigmoid(y, six=5.0) if form == "divided_by_5" else
                       _hardsigmoid(x) if form == "gate_of_another_value" else _hardsigmoid(y))
        return bb.emit(relax.op.multiply(gate, y) if form == "hardswish_gate_first" else relax.op.multiply(y, gate))

    mod = _module(body, 0)
    report = tvm_ext.dispatch_report(mod, TARGET)
    fused_ops = [r.op for r in report if r.reason == "fused"]
    if form in ("divided_by_5", "gate_of_another_value"):
        assert "multiply" not in fused_ops, str(report)
    else:
        assert "divide" in fused_ops and "clip" in fused_ops, str(report)
        assert all(r.reason == "fused" for r in report[1:]), str(report)
    x = np.random.default_rng(1).standard_normal(SHAPE).astype("float32") * 4
    got = _outputs(tvm_ext.build(mod, TARGET, winograd=False), x)
    ref = _outputs(tvm.compile(mod, TARGET), x)
    assert rel_err(got[0], ref[0]) <= 1e-5, rel_err(got[0], ref[0])


@pytest.mark.parametrize("gate_first", [False, True])
@pytest.mark.parametrize("batch", [2, "n"])
def test_squeeze_excitation_gate_runs_on_the_channel_scale_kernel(gate_first, batch):
    """x * sigmoid(conv(relu(conv(mean(x))))) (EfficientNet's squeeze-excitation): the gate's
    multiply runs on tvm_ext's channel-scale kernel in the blocked layout, operands in either
    order, static or symbolic batch; a gate of another batch (1 against 2) broadcasts and stays
    with stock TVM. Every form computes what the graph says."""
    rng = np.random.default_rng(5)
    n = tvm.tirx.Var("n", "int64") if batch == "n" else batch
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, 16, 9, 11), "float32"))
    other = relax.Var("g", relax.TensorType((1, 16, 1, 1), "float32"))
    with bb.function("main", [x, other]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.relu(relax.op.add(_conv(bb, rng, x), random_const(rng, 1, 16, 1, 1))))
            squeezed = bb.emit(relax.op.mean(y, axis=[2, 3], keepdims=True))
            hidden = bb.emit(relax.op.nn.relu(relax.op.nn.conv2d(squeezed, random_const(rng, 4, 16, 1, 1))))
            gate = bb.emit(relax.op.sigmoid(relax.op.nn.conv2d(hidden, random_const(rng, 16, 4, 1, 1))))
            scaled = bb.emit(relax.op.multiply(gate, y) if gate_first else relax.op.multiply(y, gate))
            out = bb.emit_output(relax.Tuple([scaled, bb.emit(relax.op.multiply(y, other))]))
        bb.emit_func_output(out)
    mod = bb.get()
    kernels = [r.kernel for r in tvm_ext.dispatch_report(mod, TARGET) if r.op == "multiply"]
    assert kernels == ["channel_scale", "fallback"], kernels
    xv = np.random.default_rng(1).standard_normal((2, 16, 9, 11)).astype("float32")
    gv = np.random.default_rng(2).standard_normal((1, 16, 1, 1)).astype("float32")
    inputs = [tvm.runtime.tensor(xv), tvm.runtime.tensor(gv)]
    got, ref = (relax.VirtualMachine(ex, tvm.cpu())["main"](*inputs)
                for ex in (tvm_ext.build(mod, TARGET, winograd=False), tvm.compile(mod, TARGET)))
    for g, r in zip(got, ref, strict=True):
        assert rel_err(g.numpy(), r.numpy()) <= 1e-5


@pytest.mark.parametrize("bias_shape", [(1, 20, 1, 1), (20, 1, 1), (1, 1, 1, 1)])
def test_weights_and_biases_computed_at_run_time_fuse(bias_shape):
    """A training graph's convolution: weights and bias are parameters (after a folded batch
    norm, expressions of them). conv + bias + shortcut -> relu is one kernel call, the bias
    read at run time (20 channels: padded to whole blocks), as stock TVM computes it. Before,
    only constant weights and biases fused: the bias add and relu ran as passes of their own."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 16, 9, 11), "float32"))
    w = relax.Var("w", relax.TensorType((20, 16, 3, 3), "float32"))
    b = relax.Var("b", relax.TensorType(bias_shape, "float32"))
    s = relax.Var("s", relax.TensorType((2, 20, 9, 11), "float32"))
    with bb.function("main", [x, w, b, s]):
        with bb.dataflow():
            y = relax.op.add(relax.op.nn.conv2d(x, relax.op.multiply(w, relax.const(np.float32(0.5))), padding=1), b)
            out = bb.emit_output(relax.op.nn.relu(relax.op.add(y, s)))
        bb.emit_func_output(out)
    mod = bb.get()
    report = tvm_ext.dispatch_report(mod, TARGET)
    assert [(r.op, r.reason) for r in report if r.op in ("add", "nn.relu")] == [("add", "fused")] * 2 + [
        ("nn.relu", "fused")], str(report)
    rng = np.random.default_rng(3)
    args = [rng.standard_normal(shape).astype("float32")
            for shape in ((2, 16, 9, 11), (20, 16, 3, 3), bias_shape, (2, 20, 9, 11))]
    outputs = []
    for ex in (tvm_ext.build(mod, TARGET), tvm.compile(mod, TARGET)):
        outputs.append(relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in args]).numpy())
    assert rel_err(*outputs) <= 1e-5


def test_a_mask_computed_inside_the_match_is_not_fused():
    """where(y > 0, y, 0) of a convolution y with run-time weights (a relu written out): the
    shape of an activation's gradient, but its mask is the value the match computes. Lowering
    raised "not where(y > 0, ...)" before; now it is left to stock TVM, same numbers."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(SHAPE, "float32"))
    w = relax.Var("w", relax.TensorType((16, 16, 3, 3), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, w, padding=1))
            zero = relax.const(np.float32(0))
            out = bb.emit_output(relax.op.where(relax.op.greater(y, zero), y, relax.const(np.float32(0))))
        bb.emit_func_output(out)
    mod = bb.get()
    rng = np.random.default_rng(4)
    args = [rng.standard_normal(SHAPE).astype("float32"), rng.standard_normal((16, 16, 3, 3)).astype("float32")]
    outputs = [relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()
               for ex in (tvm_ext.build(mod, TARGET), tvm.compile(mod, TARGET))]
    assert rel_err(*outputs) <= 1e-5
