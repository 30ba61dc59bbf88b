"""3-D convolution networks as 2-D ones over frames (transform.conv3d_as_conv2d): video networks
(torchvision's R3D, R(2+1)D) run on the tvm_ext kernels; stock TVM took 22 s for R3D-18 on 8
frames of 112x112."""

import numpy as np
import tvm
from reference import conv3d_ncdhw, one_input_graph, random_const, rel_err
from tvm import relax

import tvm_ext
from tvm_ext.relax_info import op_name
from tvm_ext.transform import conv3d_as_conv2d


def _run(ex, *inputs) -> np.ndarray:
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](*(tvm.runtime.tensor(x) for x in inputs))
    return (out if isinstance(out, tvm.runtime.Tensor) else out[0]).numpy()


def _ops(mod: tvm.IRModule) -> list[str]:
    names = []
    relax.analysis.post_order_visit(mod["main"], lambda e: names.append(op_name(e)) if op_name(e) else None)
    return names


def _random_conv3d(rng) -> dict:
    groups = int(rng.choice([1, 1, 2, 4]))
    c = groups * int(rng.integers(1, 4))
    k = groups * int(rng.integers(1, 4)) if groups < 4 or rng.random() < 0.5 else c  # depthwise at times
    taps, kh, kw = (int(v) for v in rng.integers(1, 4, size=3))
    stride = tuple(int(v) for v in rng.integers(1, 3, size=3))
    dilation = tuple(int(v) for v in rng.integers(1, 3, size=3))
    padding = tuple(int(v) for v in rng.integers(0, 3, size=6))
    shape = (int(rng.integers(1, 3)), c, int(rng.integers(3, 7)), int(rng.integers(5, 11)), int(rng.integers(5, 11)))
    return {"shape": shape, "weight": (k, c // groups, taps, kh, kw), "strides": stride, "padding": padding,
            "dilation": dilation, "groups": groups}


def test_random_convolutions_equal_the_float64_reference():
    """Kernel sizes 1-3 per axis, strides and dilations 1-2, asymmetric padding, grouped and
    depthwise, batch 1-2: each built by tvm_ext (one module of 14) within float32 rounding of a
    float64 reference, every one on a tvm_ext kernel."""
    rng = np.random.default_rng(3)
    cases = [_random_conv3d(rng) for _ in range(14)]
    xs = [relax.Var(f"x{i}", relax.TensorType(case["shape"], "float32")) for i, case in enumerate(cases)]
    weights = [rng.standard_normal(case["weight"]).astype(np.float32) for case in cases]
    bb = relax.BlockBuilder()
    with bb.function("main", xs):
        with bb.dataflow():
            outs = [bb.emit(relax.op.nn.conv3d(x, relax.const(w), case["strides"], case["padding"], case["dilation"],
                                               case["groups"])) for x, w, case in zip(xs, weights, cases, strict=True)]
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    mod = bb.get()
    assert "relax.nn.conv3d" not in _ops(conv3d_as_conv2d()(mod))
    report = tvm_ext.dispatch_report(mod, "llvm")
    assert not [r for r in report if r.op == "nn.conv3d" or r.op == "nn.conv2d" and r.kernel == "fallback"]
    inputs = [rng.standard_normal(case["shape"]).astype(np.float32) for case in cases]
    got = relax.VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())["main"](*(tvm.runtime.tensor(x) for x in inputs))
    for i, case in enumerate(cases):
        want = conv3d_ncdhw(inputs[i], weights[i], case["strides"], case["padding"], case["dilation"], case["groups"])
        assert got[i].numpy().shape == want.shape, case
        assert rel_err(got[i].numpy(), want) < 1e-5, case


def _video_block(rng, shape=(2, 4, 5, 12, 10)) -> tvm.IRModule:
    """A residual video block as torchvision writes one: conv3d + bias, batch norm, relu, a
    (3, 1, 1) temporal conv (R(2+1)D), a per-channel scale, the shortcut added first (x + f(x)),
    a (1, 3, 3) max pool, a channel concat, a mean over frames read outside."""
    def body(bb, x):
        c = shape[1]
        y = bb.emit(relax.op.nn.conv3d(x, random_const(rng, 8, c, 3, 3, 3, scale=0.3), padding=1))
        y = bb.emit(relax.op.add(y, random_const(rng, 1, 8, 1, 1, 1)))
        stats = [random_const(rng, 8), random_const(rng, 8), random_const(rng, 8),
                 relax.const(rng.uniform(0.5, 2, 8).astype(np.float32))]
        y = bb.emit(relax.TupleGetItem(bb.emit(relax.op.nn.batch_norm(y, *stats, axis=1)), 0))
        y = bb.emit(relax.op.nn.relu(y))
        t = bb.emit(relax.op.nn.conv3d(y, random_const(rng, 8, 8, 3, 1, 1, scale=0.3), strides=(1, 1, 1),
                                       padding=(1, 0, 0, 1, 0, 0)))
        t = bb.emit(relax.op.multiply(t, random_const(rng, 8, 1, 1, 1, scale=1.0)))
        y = bb.emit(relax.op.nn.relu(relax.op.add(y, t)))
        pooled = bb.emit(relax.op.nn.max_pool3d(y, (1, 3, 3), (1, 2, 2), (0, 1, 1, 0, 1, 1)))
        both = bb.emit(relax.op.concat([pooled, relax.op.sigmoid(pooled)], axis=1))
        z = bb.emit(relax.op.nn.conv3d(both, random_const(rng, 6, 16, 2, 3, 3, scale=0.3), strides=(2, 1, 1)))
        return relax.op.mean(z, axis=[2], keepdims=False)

    return one_input_graph(shape, body)


def test_a_video_block_runs_on_frames_and_equals_stock_tvm():
    """The block's convolutions, batch norm (folded), activations, adds, pool and concat all on
    frames, and the one value read outside moved back to NCDHW once; built by tvm_ext it equals
    stock TVM's build of the 3-D graph."""
    rng = np.random.default_rng(0)
    mod = _video_block(rng)
    rewritten = conv3d_as_conv2d()(mod)
    ops = _ops(rewritten)
    assert "relax.nn.conv3d" not in ops and "relax.nn.max_pool3d" not in ops
    assert ops.count("relax.nn.conv2d") == 3 and ops.count("relax.nn.max_pool2d") == 1
    assert ops.count("relax.permute_dims") == 2  # the input moved to frames, the output moved back
    report = tvm_ext.dispatch_report(mod, "llvm")
    assert [r.kernel != "fallback" for r in report if r.op == "nn.conv2d"] == [True] * 3
    x = rng.standard_normal((2, 4, 5, 12, 10)).astype(np.float32)
    want = _run(tvm.compile(mod, "llvm"), x)
    assert rel_err(_run(tvm_ext.build(mod, "llvm"), x), want) < 1e-5


def test_what_frames_do_not_hold_stays_as_it_was():
    """A float16 conv3d, an NDHWC one and a pooling over frames stay 3-D ops (on stock TVM); a
    module without conv3d is returned as it was."""
    rng = np.random.default_rng(1)

    def half(bb, x):
        return relax.op.nn.conv3d(relax.op.astype(x, "float16"), relax.const(np.ones((4, 3, 1, 1, 1), np.float16)))

    def channels_last(bb, x):
        w = random_const(rng, 4, 3, 1, 1, 1)
        return relax.op.nn.conv3d(x, w, data_layout="NDHWC", kernel_layout="OIDHW")

    def frames_pooled(bb, x):
        y = bb.emit(relax.op.nn.conv3d(x, random_const(rng, 4, 3, 1, 3, 3), padding=1))
        return relax.op.nn.max_pool3d(y, (2, 1, 1), (2, 1, 1))

    assert _ops(conv3d_as_conv2d()(one_input_graph((1, 3, 4, 6, 6), half))).count("relax.nn.conv3d") == 1
    assert _ops(conv3d_as_conv2d()(one_input_graph((1, 4, 6, 6, 3), channels_last))).count("relax.nn.conv3d") == 1
    mod = one_input_graph((1, 3, 4, 6, 6), frames_pooled)
    ops = _ops(conv3d_as_conv2d()(mod))
    assert "relax.nn.max_pool3d" in ops and "relax.nn.conv3d" not in ops
    x = rng.standard_normal((1, 3, 4, 6, 6)).astype(np.float32)
    assert rel_err(_run(tvm_ext.build(mod, "llvm"), x), _run(tvm.compile(mod, "llvm"), x)) < 1e-6
    plain = one_input_graph((1, 3, 6, 6), lambda bb, x: relax.op.nn.relu(x))
    assert conv3d_as_conv2d()(plain).same_as(plain)


def test_a_symbolic_batch_keeps_its_frames():
    """The serving export (torch.export.Dim batch): the frames' batch N * D symbolic, every
    convolution on a tvm_ext kernel image by image, right at batch 1 and 3."""
    rng = np.random.default_rng(2)
    batch = tvm.tirx.Var("n", "int64")
    mod = _video_block(rng, shape=(batch, 4, 5, 12, 10))
    assert "relax.nn.conv3d" not in _ops(conv3d_as_conv2d()(mod))
    convs = [r for r in tvm_ext.dispatch_report(mod, "llvm") if r.op.startswith("nn.conv")]
    assert len(convs) == 3 and all(r.kernel != "fallback" and "symbolic batch" in r.reason for r in convs)
    ours, stock = tvm_ext.build(mod, "llvm"), tvm.compile(mod, "llvm")
    for n in (1, 3):
        x = rng.standard_normal((n, 4, 5, 12, 10)).astype(np.float32)
        assert rel_err(_run(ours, x), _run(stock, x)) < 1e-5


def test_a_convolution_that_is_the_output():
    """A block's output bound to a value computed on frames (the fuzzer's seeds 7, 14, 16, 18:
    a DataflowVar read outside its block crashed the build) is bound to its NCDHW value."""
    rng = np.random.default_rng(4)
    mod = one_input_graph((2, 3, 4, 8, 8), lambda bb, x: relax.op.nn.conv3d(x, random_const(rng, 5, 3, 3, 3, 3),
                                                                            padding=1))
    rewritten = conv3d_as_conv2d()(mod)
    relax.analysis.well_formed(rewritten)  # raises where it is not
    x = rng.standard_normal((2, 3, 4, 8, 8)).astype(np.float32)
    assert rel_err(_run(tvm_ext.build(mod, "llvm"), x), _run(tvm.compile(mod, "llvm"), x)) < 1e-5
