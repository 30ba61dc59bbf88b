"""Concatenation + per-channel scale and shift + activation in the blocked layout
(tvm_ext.kernels.channel_affine) and in graphs: DenseNet's concat -> batch norm -> relu."""

import numpy as np
import pytest
import torch
import tvm
from reference import kernel_calls, one_input_graph, rel_err
from tvm import relax

import tvm_ext
from tvm_ext.kernels.channel_affine import ChannelAffine, channel_affine_func, choose_out_block
from tvm_ext.transform import fold_batch_norm

TARGET = tvm_ext.resolve_target("llvm")


def _blocked(x: np.ndarray, block: int) -> np.ndarray:
    n, c, h, w = x.shape
    return np.ascontiguousarray(x.reshape(n, c // block, block, h, w).transpose(0, 1, 3, 4, 2))


def _nchw(y: np.ndarray) -> np.ndarray:
    n, cb, h, w, b = y.shape
    return y.transpose(0, 1, 4, 2, 3).reshape(n, cb * b, h, w)


def _activation(name: str | None, x: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(x.astype(np.float64))
    return {None: t, "relu": torch.relu(t), "leaky_relu": torch.nn.functional.leaky_relu(t, 0.1),
            "relu6": torch.clamp(t, 0, 6), "gelu": torch.nn.functional.gelu(t)}[name].numpy()


@pytest.mark.parametrize("inputs, out_block, scale, shift, activation", [
    (((64, 16), (32, 32), (32, 32)), 16, True, True, "relu"),    # DenseNet: blocks differ between inputs
    (((8, 8), (24, 8)), 32, False, False, None),                   # a concatenation alone, wider output blocks
    (((12, 4), (20, 4)), 16, True, False, "leaky_relu"),           # chunks of 4 channels: narrow vectors
    (((48, 16),), 16, False, True, "relu6"),                       # one input: a batch norm after no convolution
    (((32, 32),) * 9, 32, True, True, "gelu"),                     # many inputs: the binary search over them
    (((58, 1), (58, 1)), 1, False, False, None),                   # planar (NCHW in and out): ShuffleNet's
    (((6, 1), (10, 1), (3, 1)), 1, True, True, "gelu"),            # planar, odd channels, the activation after
])
def test_kernel_matches_numpy(inputs, out_block, scale, shift, activation):
    rng = np.random.default_rng(len(inputs) * 100 + out_block)
    n, h, w = 2, 5, 7
    affine = ChannelAffine(inputs, (n, h, w), out_block, scale, shift, activation, 0.1)
    lib = tvm.compile(channel_affine_func(affine, TARGET_LANES), TARGET)
    xs = [rng.standard_normal((n, c, h, w)).astype(np.float32) for c, _ in inputs]
    channels = affine.channels
    s, b = (rng.standard_normal(channels).astype(np.float32) for _ in range(2))
    out = tvm.runtime.tensor(np.full(affine.out_shape(), np.nan, np.float32))
    args = [tvm.runtime.tensor(_blocked(x, block)) for x, (_, block) in zip(xs, inputs, strict=True)]
    args += [tvm.runtime.tensor(v) for v, wanted in ((s, scale), (b, shift)) if wanted]
    lib["channel_affine"](*args, out)
    expected = np.concatenate(xs, 1).astype(np.float64)
    if scale:
        expected = expected * s[None, :, None, None]
    if shift:
        expected = expected + b[None, :, None, None]
    assert rel_err(_nchw(out.numpy()), _activation(activation, expected)) < 1e-6


TARGET_LANES = tvm_ext.target.vector_isa(TARGET).lanes


@pytest.mark.parametrize("inputs, out_block, message", [
    ((), 16, "no inputs"),
    (((24, 16),), 8, "multiple of their block"),
    (((24, 8),), 16, "multiple of the output block"),
])
def test_kernel_description_refuses_bad_blocks(inputs, out_block, message):
    with pytest.raises(ValueError, match=message):
        ChannelAffine(inputs, (1, 4, 4), out_block)
    with pytest.raises(ValueError, match="activation"):
        ChannelAffine(((16, 16),), (1, 4, 4), 16, activation="softplus")


def test_output_block():
    """The inputs' block where it divides the channels, else one or two vectors, else a power of two."""
    assert choose_out_block([64, 32, 32], [16, 32, 32], 16) == 32
    assert choose_out_block([64, 32, 16], [32, 32, 16], 16) == 16  # 112 channels: 32 does not divide
    assert choose_out_block([24, 16], [], 8) == 8
    assert choose_out_block([12, 12], [], 16) == 8


_graph = one_input_graph


def _const(rng, *shape, positive=False):
    data = rng.standard_normal(shape)
    return relax.const((np.abs(data) + 0.5 if positive else data * 0.3).astype(np.float32))


def _batch_norm(bb, x, rng, channels: int):
    stats = [_const(rng, channels), _const(rng, channels), _const(rng, channels), _const(rng, channels, positive=True)]
    return bb.emit(relax.TupleGetItem(bb.emit(relax.op.nn.batch_norm(x, *stats, axis=1, training=False)), 0))


def _dense_block(bb, x, rng, layers: int = 3, growth: int = 16):
    """DenseNet's block: each layer reads relu(bn(concat(everything before))), 1x1 then 3x3."""
    features = [x]
    for _ in range(layers):
        channels = sum(int(f.ty.shape[1]) for f in features)
        y = bb.emit(relax.op.concat(features, axis=1)) if len(features) > 1 else features[0]
        y = bb.emit(relax.op.nn.relu(_batch_norm(bb, y, rng, channels)))
        y = bb.emit(relax.op.nn.conv2d(y, _const(rng, 32, channels, 1, 1)))
        y = bb.emit(relax.op.nn.relu(_batch_norm(bb, y, rng, 32)))
        features.append(bb.emit(relax.op.nn.conv2d(y, _const(rng, growth, 32, 3, 3), padding=(1, 1))))
    return bb.emit(relax.op.concat(features, axis=1))


def _run(ex, x: np.ndarray) -> np.ndarray:
    return relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()


def test_dense_block_runs_on_the_channel_affine_kernel():
    rng = np.random.default_rng(0)
    mod = _graph((1, 32, 12, 12), lambda bb, x: _dense_block(bb, x, rng))
    report = tvm_ext.dispatch_report(mod, TARGET)
    affine = [r for r in report if r.kernel == "channel_affine"]
    assert [r.op for r in affine] == ["multiply", "concat", "concat", "concat"]  # the first layer reads x alone
    assert not any(r.op == "nn.batch_norm" or r.kernel == "fallback" for r in report), str(report)
    assert all(r.reason == "fused" for r in report if r.kernel == "channel_affine epilogue")
    x = rng.standard_normal((1, 32, 12, 12)).astype(np.float32)
    assert rel_err(_run(tvm_ext.build(mod, TARGET), x), _run(tvm.compile(mod, "llvm"), x)) < 1e-5


@pytest.mark.parametrize("scale_first, shift_first, shape", [
    (False, False, (1, 24, 1, 1)), (True, True, (24, 1, 1)), (True, False, (1,)), (False, True, ())])
def test_scale_and_shift_in_either_operand_order(scale_first, shift_first, shape):
    """s * x + t, x * s + t, t + x * s: TVM matches multiply and add as commutative; the reader
    takes the constant operand whichever it is, of any per-channel or scalar shape."""
    rng = np.random.default_rng(1)

    def body(bb, x):
        a = bb.emit(relax.op.nn.relu(relax.op.nn.conv2d(x, _const(rng, 8, 16, 3, 3), padding=(1, 1))))
        cat = bb.emit(relax.op.concat([x, a], axis=1))
        s, t = _const(rng, *shape), _const(rng, *shape)
        y = bb.emit(relax.op.multiply(s, cat) if scale_first else relax.op.multiply(cat, s))
        return bb.emit(relax.op.nn.relu(relax.op.add(t, y) if shift_first else relax.op.add(y, t)))

    mod = _graph((1, 16, 9, 9), body)
    report = tvm_ext.dispatch_report(mod, TARGET)
    assert [r.kernel for r in report if r.op in ("concat", "multiply", "add")] == \
        ["channel_affine", "channel_affine epilogue", "channel_affine epilogue"]
    x = rng.standard_normal((1, 16, 9, 9)).astype(np.float32)
    assert rel_err(_run(tvm_ext.build(mod, TARGET), x), _run(tvm.compile(mod, "llvm"), x)) < 1e-5


def test_fallbacks_and_values_read_twice():
    """Channels that do not fill vectors of 8 stay with stock TVM (with the reason); a concat also
    read elsewhere is not fused into its scale (its value is needed as it is); inputs that no
    tvm_ext kernel wrote (tanh) are packed first. All right against stock TVM."""
    rng = np.random.default_rng(2)

    def body(bb, x):
        t = bb.emit(relax.op.tanh(x))
        odd = bb.emit(relax.op.concat([x, bb.emit(relax.op.strided_slice(x, [1], [0], [4]))], axis=1))  # 20 channels
        cat = bb.emit(relax.op.concat([t, x], axis=1))
        scaled = bb.emit(relax.op.multiply(cat, _const(rng, 1, 32, 1, 1)))
        return bb.emit(relax.Tuple([odd, cat, scaled]))

    mod = _graph((1, 16, 6, 6), body)
    report = tvm_ext.dispatch_report(mod, TARGET)
    concats = [r for r in report if r.op == "concat"]
    assert concats[0].kernel == "fallback" and "4 channels are not a multiple of 8" in concats[0].reason
    assert concats[1].kernel == "channel_affine"
    assert [r.kernel for r in report if r.op == "multiply"] == ["channel_affine"]  # its own call
    x = rng.standard_normal((1, 16, 6, 6)).astype(np.float32)
    ours = relax.VirtualMachine(tvm_ext.build(mod, TARGET), tvm.cpu())["main"](tvm.runtime.tensor(x))
    stock = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())["main"](tvm.runtime.tensor(x))
    for a, b in zip(ours, stock, strict=True):
        assert rel_err(a.numpy(), b.numpy()) < 1e-6


def test_symbolic_batch():
    rng = np.random.default_rng(3)
    n = tvm.tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, 16, 8, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(_dense_block(bb, x, rng, layers=2))
        bb.emit_func_output(out)
    mod = bb.get()
    report = tvm_ext.dispatch_report(mod, TARGET)
    assert "channel_affine" in {r.kernel for r in report}
    assert not any(r.op == "nn.batch_norm" for r in report), str(report)  # a scale and shift, batch or not
    ours, stock = tvm_ext.build(mod, TARGET), tvm.compile(mod, "llvm")
    for batch in (1, 3):
        x = rng.standard_normal((batch, 16, 8, 8)).astype(np.float32)
        assert rel_err(_run(ours, x), _run(stock, x)) < 1e-5


def test_batch_norm_after_no_convolution_becomes_scale_and_shift():
    """fold_batch_norm turns an inference batch norm that no convolution precedes into x * s + t
    (s, t computed in float64), and leaves a training-mode one alone."""
    rng = np.random.default_rng(4)
    for training in (False, True):
        def body(bb, x, training=training):
            stats = [_const(rng, 8), _const(rng, 8), _const(rng, 8), _const(rng, 8, positive=True)]
            bn = bb.emit(relax.op.nn.batch_norm(bb.emit(relax.op.tanh(x)), *stats, axis=1, training=training))
            return bb.emit(relax.TupleGetItem(bn, 0))

        mod = _graph((2, 8, 5, 5), body)
        folded = fold_batch_norm()(mod)
        text = folded.script()
        assert ("batch_norm" in text) == training
        if not training:
            x = rng.standard_normal((2, 8, 5, 5)).astype(np.float32)
            assert rel_err(_run(tvm.compile(folded, "llvm"), x), _run(tvm.compile(mod, "llvm"), x)) < 1e-6


def test_concatenation_of_nchw_tensors_stays_nchw():
    """ShuffleNet's unit: split -> 1x1 convolution of 40 channels (written in NCHW: 40 fill no
    block of 16 or 48) -> concat with the other half -> channel shuffle. Neither input has a
    blocked form: the concatenation reads and writes NCHW, with no pack or unpack around it
    (there were two packs and an unpack, three copies of what stock TVM's concatenation copies
    once: ShuffleNet's 232-channel halves)."""
    rng = np.random.default_rng(8)

    def body(bb, x):
        halves = bb.emit(relax.op.split(x, 2, axis=1))
        left, right = bb.emit(relax.TupleGetItem(halves, 0)), bb.emit(relax.TupleGetItem(halves, 1))
        w = relax.const((rng.standard_normal((40, 40, 1, 1)) * 0.2).astype(np.float32))
        right = bb.emit(relax.op.nn.relu(relax.op.nn.conv2d(right, w)))
        y = bb.emit(relax.op.concat([left, right], axis=1))
        y = bb.emit(relax.op.reshape(y, (1, 2, 40, 7, 7)))
        return bb.emit(relax.op.reshape(relax.op.permute_dims(y, [0, 2, 1, 3, 4]), (1, 80, 7, 7)))

    mod = one_input_graph((1, 80, 7, 7), body)
    report = tvm_ext.dispatch_report(mod, TARGET)
    assert [r.kernel for r in report if r.op == "concat"] == ["channel_affine"]
    calls = kernel_calls(mod, TARGET)
    assert [c for c in calls if "channel_affine" in c] == ["tvm_ext_channel_affine_1x7x7_40b1_40b1_o1"]
    assert not [c for c in calls if "pack_nchwc" in c], calls
    x = rng.standard_normal((1, 80, 7, 7)).astype(np.float32)
    run = lambda ex: relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()  # noqa: E731
    assert rel_err(run(tvm_ext.build(mod, TARGET)), run(tvm.compile(mod, "llvm"))) < 1e-5
