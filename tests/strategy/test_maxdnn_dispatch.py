"""The maxDNN tile in graphs: which convolutions decide() gives it (and which it never does), a
network mixing it with the blocked kernels, Winograd and stock TVM, right against float64;
random graphs on the tile; the option checked before any compile."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from reference import conv2d_nchw, rel_err
from tvm import relax

import tvm_ext
from tvm_ext.kernels.conv2d import Conv2dWorkload, plan_conv2d
from tvm_ext.kernels.conv2d_maxdnn import MaxDNNCpuPlan
from tvm_ext.strategy.cpu_engine import (
    L2_BYTES_PER_FMA,
    PASS_FLOPS_PER_BYTE,
    blocked_efficiency,
    estimates,
    tile_out_block,
    tile_pass_bytes,
)
from tvm_ext.strategy.decide import decide
from tvm_ext.target import AVX2, AVX512
from tvm_ext.testing.random_graphs import check_graph, random_graph

TARGET = tvm_ext.resolve_target("llvm")


def _conv_call(n=16, c=32, k=64, size=7, stride=1, groups=1, constant=True, batch=None):
    x = relax.Var("x", relax.TensorType((n if batch is None else batch, c, size, size), "float32"))
    w_shape = (k, c // groups, 3, 3)
    w = relax.const(np.ones(w_shape, np.float32)) if constant else relax.Var("w", relax.TensorType(w_shape, "float32"))
    return relax.op.nn.conv2d(x, w, strides=stride, padding=1, groups=groups)


def _normalized(call):
    """The call with its type inferred (as the pipeline sees it)."""
    bb = relax.BlockBuilder()
    return bb.normalize(call)


def test_decide_gives_the_tile_only_what_it_can_run():
    call = _normalized(_conv_call())
    assert decide(call, TARGET, maxdnn="always").kernel == "maxdnn_conv2d"
    assert decide(call, TARGET, maxdnn="never").kernel != "maxdnn_conv2d"
    refused = {
        "run-time weights": _normalized(_conv_call(constant=False)),
        "grouped": _normalized(_conv_call(groups=4)),
        "symbolic batch": _normalized(_conv_call(batch=tvm.tirx.Var("n", "int64"))),
    }
    for why, refused_call in refused.items():
        decision = decide(refused_call, TARGET, maxdnn="always")
        assert decision.kernel != "maxdnn_conv2d", why
        if why != "symbolic batch":  # (the report says why the tile was not used)
            assert "not on the maxDNN tile: " + why.split()[0] in decision.reason, decision.reason
    # one image: the tile's vectors would hold one useful lane in eight or sixteen
    assert decide(_normalized(_conv_call(n=1)), TARGET, maxdnn="auto").kernel != "maxdnn_conv2d"


def _squeeze_excitation_call(n: int):
    """The 1x1 convolution of a squeeze-excitation block (MobileNet-v3's 960 -> 240): one output
    pixel an image."""
    x = relax.Var("x", relax.TensorType((n, 960, 1, 1), "float32"))
    return _normalized(relax.op.nn.conv2d(x, relax.const(np.ones((240, 960, 1, 1), np.float32))))


def test_auto_gives_the_tile_rows_of_one_pixel_at_a_batch():
    """The cost model (measured on a Zen 4, bench/layers.py --engine auto and docs/maxdnn_cpu.md):
    a blocked kernel's call over a row of one output pixel streams its weights from L2 for one
    FMA each (1.75-3.3x slower than the tile at 16 images); ResNet's, AlexNet's and OverFeat's
    layers stay blocked (their kernels and the tile within 0.9-1.05x of each other, and the
    tile's layout passes on top)."""
    assert decide(_squeeze_excitation_call(16), TARGET).kernel == "maxdnn_conv2d"
    assert "estimated" in decide(_squeeze_excitation_call(16), TARGET).reason
    assert decide(_squeeze_excitation_call(4), TARGET).kernel != "maxdnn_conv2d"  # a quarter of the lanes
    assert decide(_normalized(_conv_call(n=64, c=256, k=256, size=14)), TARGET).kernel != "maxdnn_conv2d"


def test_a_bad_option_is_refused_before_compiling():
    mod = tvm.IRModule({"main": relax.Function([], relax.const(np.zeros(1, np.float32)))})
    for entry in (lambda: tvm_ext.build(mod, maxdnn="sometimes"),
                  lambda: tvm_ext.dispatch_report(mod, maxdnn=True),  # type: ignore[arg-type]
                  lambda: tvm_ext.pipeline(maxdnn="on")):
        with pytest.raises(ValueError, match="maxdnn must be one of"):
            entry()


def _mixed_network(rng: np.random.Generator, n: int):
    """Convolutions of every kind the tile takes (strided, padded, 1x1, 5x5, bias, residual of
    two convolutions, activations) beside one it does not (grouped), a max pool and stock TVM's
    tanh between them; the input has 3 channels (read in NCHW)."""
    shapes = {"stem": (32, 3, 5, 5), "a": (32, 32, 3, 3), "b": (48, 32, 1, 1), "c": (48, 32, 3, 3),
              "g": (48, 12, 3, 3), "d": (24, 48, 1, 1)}
    weights = {k: (rng.standard_normal(s) / np.sqrt(np.prod(s[1:]))).astype(np.float32) for k, s in shapes.items()}
    biases = {k: rng.standard_normal(s[0]).astype(np.float32) for k, s in shapes.items()}
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, 3, 23, 21), "float32"))

    def conv(v, key, stride=1, padding=0, groups=1):
        out = relax.op.nn.conv2d(v, relax.const(weights[key]), strides=stride, padding=padding, groups=groups)
        return relax.op.add(out, relax.const(biases[key].reshape(1, -1, 1, 1)))

    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.relu(conv(x, "stem", 2, 2)))
            y = bb.emit(relax.op.nn.max_pool2d(y, (3, 3), (2, 2), (1, 1)))
            y = bb.emit(relax.op.nn.relu(relax.op.add(y, conv(y, "a", 1, 1))))  # (shortcut first)
            z = bb.emit(relax.op.nn.relu(relax.op.add(conv(y, "b", 2), conv(y, "c", 2, 1))))
            z = bb.emit(relax.op.tanh(conv(z, "g", 1, 1, groups=4)))
            out = bb.emit_output(relax.op.sigmoid(conv(z, "d")))
        bb.emit_func_output(out)

    def reference(xv: np.ndarray) -> np.ndarray:
        def c(v, key, stride=1, padding=0, groups=1):
            return conv2d_nchw(v, weights[key], biases[key], (stride, stride), (padding,) * 4, (1, 1), groups)

        relu = lambda v: np.maximum(v, 0)  # noqa: E731
        y = relu(c(xv.astype(np.float64), "stem", 2, 2))
        pad = np.pad(y, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=-np.inf)
        oh, ow = (y.shape[2] - 1) // 2 + 1, (y.shape[3] - 1) // 2 + 1
        y = np.max([pad[:, :, i:i + 2 * oh:2, j:j + 2 * ow:2] for i in range(3) for j in range(3)], axis=0)
        y = relu(y + c(y, "a", 1, 1))
        z = relu(c(y, "b", 2) + c(y, "c", 2, 1))
        z = np.tanh(c(z, "g", 1, 1, groups=4))
        return 1 / (1 + np.exp(-c(z, "d")))

    return bb.get(), reference


@pytest.mark.parametrize("n", [19, 32])
def test_a_network_mixing_the_tile_with_the_other_engines_is_right(n):
    rng = np.random.default_rng(n)
    mod, reference = _mixed_network(rng, n)
    report = tvm_ext.dispatch_report(mod, TARGET, images_per_call=n, maxdnn="always")
    kernels = [row.kernel for row in report if row.op == "nn.conv2d"]
    assert kernels.count("maxdnn_conv2d") == 5 and len(kernels) == 6, str(report)  # all but the grouped one
    x = rng.standard_normal((n, 3, 23, 21)).astype(np.float32)
    ex = tvm_ext.build(mod, TARGET, images_per_call=n, maxdnn="always")
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    assert rel_err(got, reference(x)) < 1e-5


def test_random_graphs_on_the_tile():
    """The property test's graphs (batch 1-3, every op it generates) with every convolution the
    tile can take on it."""
    failures = []
    for seed in range(10):
        graph = random_graph(seed)
        problem = check_graph(graph, lambda mod, winograd: tvm_ext.build(mod, TARGET, winograd=winograd,
                                                                        maxdnn="always"))
        if problem:
            failures.append(f"seed {seed}: {problem}\n{graph.describe()}")
    assert not failures, "\n\n".join(failures)


def test_auto_runs_a_squeeze_excitation_block_on_the_tile():
    """At 16 images a call the block's two 1x1 convolutions (one pixel an image) go to the tile
    by the cost model, the convolution before them stays blocked; the result is right."""
    rng = np.random.default_rng(7)
    n, c, hidden = 16, 240, 64
    w = {"conv": rng.standard_normal((c, 32, 3, 3)).astype(np.float32) / 16,
         "down": rng.standard_normal((hidden, c, 1, 1)).astype(np.float32) / 16,
         "up": rng.standard_normal((c, hidden, 1, 1)).astype(np.float32) / 8}
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, 32, 9, 9), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.relu(relax.op.nn.conv2d(x, relax.const(w["conv"]), padding=1)))
            s = bb.emit(relax.op.mean(y, axis=[2, 3], keepdims=True))
            s = bb.emit(relax.op.nn.relu(relax.op.nn.conv2d(s, relax.const(w["down"]))))
            s = bb.emit(relax.op.sigmoid(relax.op.nn.conv2d(s, relax.const(w["up"]))))
            out = bb.emit_output(relax.op.multiply(y, s))
        bb.emit_func_output(out)
    mod = bb.get()
    report = tvm_ext.dispatch_report(mod, TARGET, images_per_call=n)
    assert [row.kernel for row in report if row.op == "nn.conv2d"][1:] == ["maxdnn_conv2d"] * 2, str(report)
    xv = rng.standard_normal((n, 32, 9, 9)).astype(np.float32)
    got = relax.VirtualMachine(tvm_ext.build(mod, TARGET, images_per_call=n), tvm.cpu())["main"](
        tvm.runtime.tensor(xv)).numpy()
    y = np.maximum(conv2d_nchw(xv, w["conv"], None, (1, 1), (1, 1, 1, 1)), 0)
    s = np.maximum(conv2d_nchw(y.mean(axis=(2, 3), keepdims=True), w["down"]), 0)
    s = 1 / (1 + np.exp(-conv2d_nchw(s, w["up"])))
    assert rel_err(got, y * s) < 1e-5


def test_the_cost_model_terms():
    # a row of one pixel: a weight vector from L2 for each FMA; on AVX-512 half the slots
    one_pixel = Conv2dWorkload.make((16, 512, 1, 1), (2048, 512, 1, 1))
    blocked = plan_conv2d(one_pixel, AVX512)
    assert blocked.m_r == 1 and blocked_efficiency(blocked, AVX512) <= L2_BYTES_PER_FMA / 64
    assert blocked_efficiency(plan_conv2d(Conv2dWorkload.make((1, 64, 28, 28), (64, 64, 3, 3), 1, 1), AVX512),
                              AVX512) == 1.0
    assert blocked_efficiency(plan_conv2d(one_pixel, AVX2), AVX2) > 0.6  # 32-byte vectors: L2 keeps up
    # the passes: 3 images padded to 16, a 1-pixel border
    plan = MaxDNNCpuPlan.make(Conv2dWorkload.make((3, 8, 5, 5), (16, 8, 3, 3), 1, 1), AVX512)
    assert (plan.images, plan.padded_hw) == (16, (7, 7))
    assert tile_pass_bytes(plan) == 4 * (3 * 8 * 25 + 16 * 49 * 8 + 16 * 25 * 16 + 3 * 16 * 25)
    tile, blocked_time = estimates(plan, plan_conv2d(plan.wl, AVX512))
    assert tile > PASS_FLOPS_PER_BYTE * tile_pass_bytes(plan) and blocked_time >= plan.wl.flops
    # the output blocks: the blocked kernel's, or the largest that divides K (in whole 8s first)
    assert tile_out_block(plan_conv2d(Conv2dWorkload.make((1, 16, 7, 7), (64, 16, 1, 1)), AVX512)) in (16, 32, 64)
    for k in (24, 40, 56):  # (the blocked kernel's blocks of 16 or 32 do not divide them)
        blocked = plan_conv2d(Conv2dWorkload.make((1, 16, 7, 7), (k, 16, 1, 1)), AVX512)
        block = tile_out_block(blocked)
        assert k % block == 0 and block % 8 == 0 and block <= blocked.oc_bn
    assert tile_out_block(plan_conv2d(Conv2dWorkload.make((1, 16, 7, 7), (10, 16, 1, 1)), AVX512)) == 10
