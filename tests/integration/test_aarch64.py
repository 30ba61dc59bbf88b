"""The NEON kernels executed, not only compiled: built here for AArch64 (Cortex-A72: NEON, no
SVE), linked by the cross linker and run under qemu-user with TVM's AArch64 runtime
(tvm_ext.testing.aarch64), against float64 PyTorch. `make aarch64` prepares the emulator and its
sysroot; without them these tests skip and say so."""

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import tvm
from reference import rel_err
from tvm import relax

import tvm_ext
from tvm_ext.models import torchvision_zoo as zoo
from tvm_ext.testing import aarch64, aarch64_sysroot
from tvm_ext.testing.random_graphs import compare_outputs, random_graph

needs_emulator = pytest.mark.skipif(aarch64.unavailable() is not None,
                                    reason=f"AArch64 emulation: {aarch64.unavailable()}")
TARGET = aarch64.NEON_TARGET
ACTIVATIONS = {
    "none": (lambda x: x, lambda x: x),
    "relu": (relax.op.nn.relu, F.relu),
    "relu6": (lambda x: relax.op.clip(x, 0, 6), F.relu6),
    "sigmoid": (relax.op.sigmoid, torch.sigmoid),
}


def _conv_config(rng: np.random.Generator) -> dict:
    """A convolution of any shape family: dense, depthwise or grouped; kernels to 5x5, strides to
    3, dilation, asymmetric padding, batches to 3, channel counts that are not multiples of 4."""
    family = rng.choice(["dense"] * 6 + ["depthwise"] * 2 + ["grouped"] * 2)
    groups = {"dense": 1, "depthwise": 0, "grouped": int(rng.choice([2, 4]))}[family]
    c = int(rng.integers(1, 41)) if groups == 1 else int(rng.integers(1, 13)) * max(groups, 1)
    groups = groups or c
    k = c if family == "depthwise" else int(rng.integers(1, 11)) * groups
    kh, kw = (int(v) for v in rng.integers(1, 6, 2))
    stride, dilation = (int(v) for v in rng.integers(1, 4, 2)), (int(v) for v in rng.integers(1, 3, 2))
    stride, dilation = tuple(stride), tuple(dilation)
    h = int(rng.integers((kh - 1) * dilation[0] + 1, 20))
    w = int(rng.integers((kw - 1) * dilation[1] + 1, 20))
    return {"n": int(rng.choice([1, 1, 2, 3])), "c": c, "h": h, "w": w, "k": k, "kernel": (kh, kw),
            "stride": stride, "dilation": dilation, "padding": tuple(int(v) for v in rng.integers(0, 3, 4)),
            "groups": groups, "bias": bool(rng.random() < 0.7), "activation": str(rng.choice(list(ACTIVATIONS))),
            "residual": bool(rng.random() < 0.3)}


def _conv_graph(cfg: dict, rng: np.random.Generator, bf16: bool = False):
    """The Relax graph of `cfg` (constant weights, as an importer writes them), its inputs and
    the float64 PyTorch reference (`bf16`: of the data and weights rounded to bfloat16)."""
    n, c, h, w, k, groups = cfg["n"], cfg["c"], cfg["h"], cfg["w"], cfg["k"], cfg["groups"]
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    weight = rng.standard_normal((k, c // groups, *cfg["kernel"])).astype(np.float32)
    bias = rng.standard_normal(k).astype(np.float32)
    pt, pl, pb, pr = cfg["padding"]
    rounded = [v.astype(ml_dtypes.bfloat16) if bf16 else v for v in (x, weight)]
    ref = F.conv2d(F.pad(torch.from_numpy(rounded[0].astype(np.float64)), (pl, pr, pt, pb)),
                   torch.from_numpy(rounded[1].astype(np.float64)),
                   torch.from_numpy(bias).double() if cfg["bias"] else None, cfg["stride"], 0, cfg["dilation"], groups)
    act, act_ref = ACTIVATIONS[cfg["activation"]]
    ref = act_ref(ref)
    shortcut = rng.standard_normal(tuple(ref.shape)).astype(np.float32)
    bb = relax.BlockBuilder()
    params = [relax.Var("x", relax.TensorType(x.shape, "float32"))]
    if cfg["residual"]:
        params.append(relax.Var("shortcut", relax.TensorType(shortcut.shape, "float32")))
        ref = torch.from_numpy(shortcut).double() + ref  # shortcut first, as RegNet writes it
    with bb.function("main", params):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(params[0], relax.const(weight), cfg["stride"], (pt, pl, pb, pr),
                                           cfg["dilation"], groups))
            if cfg["bias"]:
                y = bb.emit(relax.op.add(y, relax.const(bias.reshape(1, k, 1, 1))))
            y = bb.emit(act(y))
            if cfg["residual"]:
                y = bb.emit(relax.op.add(params[1], y))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    inputs = [x, shortcut] if cfg["residual"] else [x]
    return bb.get(), inputs, ref.numpy()


def _run_all(modules, winograd: bool = False, precision: str = "fp32") -> list:
    """Build each (module, inputs) for NEON and run them all in one emulator process."""
    cases = [aarch64.Case(tvm_ext.build(mod, TARGET, winograd=winograd, precision=precision), inputs)
             for mod, inputs in modules]
    return aarch64.run(cases)


def _assert_right_on_neon(graphs: list, tolerance: float, winograd: bool = False, precision: str = "fp32") -> None:
    """Run every (config, module, inputs, float64 reference) on NEON, in one emulator process:
    each output within `tolerance` (relative to its largest value) of its reference."""
    results = _run_all([(mod, inputs) for _, mod, inputs, _ in graphs], winograd, precision)
    for (cfg, _, _, ref), got in zip(graphs, results, strict=True):
        assert not isinstance(got, str), f"{cfg}\n{got}"
        assert got[0].shape == ref.shape and rel_err(got[0], ref) <= tolerance, (cfg, rel_err(got[0], ref))


def _conv_kernels(mod, winograd: bool = False) -> list[str]:
    return [r.kernel for r in tvm_ext.dispatch_report(mod, TARGET, winograd=winograd) if r.op == "nn.conv2d"]


@needs_emulator
def test_random_convolutions_on_neon():
    """30 random convolutions with their epilogues (bias, activation, a residual add in either
    order), each on a tvm_ext NEON kernel, within 1e-5 of float64."""
    rng = np.random.default_rng(2026)
    graphs = [(cfg, *_conv_graph(cfg, rng)) for cfg in (_conv_config(rng) for _ in range(30))]
    for cfg, mod, _, _ in graphs:
        assert "fallback" not in _conv_kernels(mod), cfg
    _assert_right_on_neon(graphs, 1e-5)


@needs_emulator
def test_emulated_bf16_convolutions_on_neon():
    """precision="bf16" on NEON (no bf16 dot product on a Cortex-A72): 12 random dense
    convolutions emulated on FMA with their epilogues, within 1e-5 of float64 on the bf16-rounded
    data and weights (what the kernel multiplies exactly)."""
    rng = np.random.default_rng(34)
    configs = [cfg for cfg in (_conv_config(rng) for _ in range(40)) if cfg["groups"] == 1][:12]
    graphs = [(cfg, *_conv_graph(cfg, rng, bf16=True)) for cfg in configs]
    for cfg, mod, _, _ in graphs:
        reasons = [r.reason for r in tvm_ext.dispatch_report(mod, TARGET, precision="bf16") if r.op == "nn.conv2d"]
        assert reasons[0].startswith("bf16 emulated on fp32 FMA"), (cfg, reasons)
    _assert_right_on_neon(graphs, 1e-5, precision="bf16")


@needs_emulator
def test_maxdnn_tile_on_neon():
    """The maxDNN tile's convolution (images in NEON's 4 lanes, bias and relu) on
    awkward batches, channels, strides, dilation, groups and padding, within 1e-5 of float64."""
    from reference import conv2d_nchw

    from tvm_ext.kernels import conv2d_maxdnn as mx
    from tvm_ext.kernels.conv2d import Conv2dWorkload

    configs = [((5, 7, 9, 8), (10, 7, 3, 3), 1, (1, 0, 2, 1), 1, 1), ((17, 16, 6, 7), (24, 16, 1, 1), 2, 0, 1, 1),
               ((4, 12, 9, 9), (12, 4, 3, 3), (2, 1), 1, 2, 3), ((9, 8, 7, 7), (8, 1, 5, 5), 1, 2, 1, 8),
               ((33, 3, 11, 10), (30, 3, 2, 2), 1, 0, (1, 2), 1), ((2, 64, 5, 5), (96, 64, 3, 3), 1, 1, 1, 1)]
    rng = np.random.default_rng(35)
    cases, expected = [], []
    for i, (x_shape, w_shape, stride, padding, dilation, groups) in enumerate(configs):
        wl = Conv2dWorkload.make(x_shape, w_shape, stride, padding, dilation, groups)
        plan = mx.MaxDNNCpuPlan.make(wl, tvm_ext.vector_isa(TARGET), k_step=None if i % 2 else 1)
        x, w, b = (rng.standard_normal(s).astype(np.float32) for s in (x_shape, w_shape, (w_shape[0],)))
        bb = relax.BlockBuilder()
        shapes = {"x": plan.data_shape(), "w": plan.weight_shape(), "b": (plan.groups, plan.outputs)}
        params = [relax.Var(n, relax.TensorType(s, "float32")) for n, s in shapes.items()]
        with bb.function("main", params):
            kernel = bb.add_func(mx.maxdnn_conv2d_kernel(plan, mx.Epilogue(bias=True, activation="relu")), "conv")
            out = bb.emit(relax.call_tir(kernel, params, relax.TensorType(plan.out_shape(), "float32")))
            bb.emit_func_output(out)
        executable = tvm.compile(bb.get(), tvm_ext.resolve_target(TARGET))
        cases.append(aarch64.Case(executable, [mx.pack_data(plan, x), mx.pack_weight(plan, w), mx.pack_bias(plan, b)]))
        ref = np.maximum(conv2d_nchw(x, w, b, wl.stride, wl.padding, wl.dilation, groups), 0)
        expected.append((plan, ref))
    for (plan, ref), got in zip(expected, aarch64.run(cases), strict=True):
        assert not isinstance(got, str), f"{plan}\n{got}"
        assert rel_err(mx.unpack_output(plan, got[0]), ref) <= 1e-5, plan


@needs_emulator
def test_winograd_on_neon():
    """3x3 stride-1 layers on the NEON Winograd kernel (F(4x4, 3x3) or F(2x2, 3x3)), within the
    transforms' float32 rounding of float64."""
    rng = np.random.default_rng(7)
    graphs = []
    for n, c, k, h, w, pad in [(1, 32, 32, 14, 14, 1), (2, 32, 48, 9, 11, 1), (1, 64, 32, 8, 8, 0),
                               (3, 48, 32, 13, 7, 1)]:
        cfg = {"n": n, "c": c, "h": h, "w": w, "k": k, "kernel": (3, 3), "stride": (1, 1), "dilation": (1, 1),
               "padding": (pad,) * 4, "groups": 1, "bias": True, "activation": "relu", "residual": False}
        graphs.append((cfg, *_conv_graph(cfg, rng)))
    for cfg, mod, _, _ in graphs:
        assert _conv_kernels(mod, winograd=True) == ["winograd_conv2d"], cfg
    _assert_right_on_neon(graphs, 5e-5, winograd=True)


POOLS = [("max", 3, 2, 1, False, True), ("max", 2, 2, 0, True, True), ("max", 3, 1, 1, False, True),
         ("avg", 3, 2, 1, False, True), ("avg", 3, 2, 1, False, False), ("avg", 2, 2, 0, False, True),
         ("global", 0, 0, 0, False, True)]


def _pool_graph(kind: str, size: int, stride: int, pad: int, ceil: bool, count_pad: bool, after_conv: bool,
                rng: np.random.Generator):
    x = rng.standard_normal((2, 20, 13, 11)).astype(np.float32)
    weight = rng.standard_normal((24, 20, 1, 1)).astype(np.float32)
    bb = relax.BlockBuilder()
    param = relax.Var("x", relax.TensorType(x.shape, "float32"))
    ref = torch.from_numpy(x).double()
    with bb.function("main", [param]):
        with bb.dataflow():
            y = param
            if after_conv:  # reads the conv's blocked output: the pooling kernels' own layout
                y = bb.emit(relax.op.nn.conv2d(y, relax.const(weight)))
                ref = F.conv2d(ref, torch.from_numpy(weight).double())
            if kind == "max":
                y = bb.emit(relax.op.nn.max_pool2d(y, size, stride, pad, ceil_mode=ceil))
                ref = F.max_pool2d(ref, size, stride, pad, ceil_mode=ceil)
            elif kind == "avg":
                y = bb.emit(relax.op.nn.avg_pool2d(y, size, stride, pad, ceil_mode=ceil,
                                                   count_include_pad=count_pad))
                ref = F.avg_pool2d(ref, size, stride, pad, ceil_mode=ceil, count_include_pad=count_pad)
            else:
                y = bb.emit(relax.op.mean(y, axis=[2, 3], keepdims=True))
                ref = ref.mean((2, 3), keepdim=True)
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get(), [x], ref.numpy()


@needs_emulator
def test_pooling_on_neon():
    """Max, average (padding counted or not) and global average pooling on NEON, on
    NCHW input and after a convolution (blocked input). (Average pooling in ceil mode stays with
    stock TVM, with its reason: frameworks differ on its divisor.)"""
    rng = np.random.default_rng(11)
    graphs = [(cfg, *_pool_graph(*cfg, after_conv, rng)) for cfg in POOLS for after_conv in (False, True)]
    for cfg, mod, _, _ in graphs:
        pools = [r for r in tvm_ext.dispatch_report(mod, TARGET) if r.op != "nn.conv2d"]
        assert pools and all(r.kernel != "fallback" for r in pools), (cfg, pools)
    _assert_right_on_neon(graphs, 1e-5)


@needs_emulator
def test_random_graphs_on_neon():
    """The property test's first 24 graphs (every fused epilogue, concat, split, squeeze-
    excitation, layer norm, dense heads, symbolic batches) built for NEON and run there."""
    graphs = [random_graph(seed) for seed in range(24)]
    cases = [aarch64.Case(tvm_ext.build(g.module, TARGET, winograd=g.winograd), g.inputs) for g in graphs]
    failures = [f"seed {g.seed}: {got if isinstance(got, str) else compare_outputs(g, got)}\n{g.describe()}"
                for g, got in zip(graphs, aarch64.run(cases), strict=True)
                if isinstance(got, str) or compare_outputs(g, got)]
    assert not failures, "\n\n".join(failures)


@needs_emulator
def test_a_torchvision_network_on_neon():
    """A network nobody here wrote, every convolution on a NEON kernel: MobileNet-v2 (depthwise,
    1x1, relu6, residual adds), within the zoo tests' bound. (Winograd: the test above.)"""
    model = zoo.load("mobilenet_v2", 64)
    mod, x = zoo.export(model, 64)
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy()
    assert "fallback" not in _conv_kernels(mod)
    (got,) = _run_all([(mod, [x])])
    assert not isinstance(got, str), got
    assert rel_err(got[0], ref) <= 1e-4, rel_err(got[0], ref)


@needs_emulator
@pytest.mark.slow
@pytest.mark.long
def test_the_harness_reports_wrong_answers_and_errors():
    """Not vacuous: another graph's executable fails the comparison, and a case that raises on
    the emulated side comes back as its error while the next case still runs."""
    right, other = random_graph(3), random_graph(4)
    ex = tvm_ext.build(right.module, TARGET)
    wrong_input = np.ones((1, 1, 1, 1), np.float32)
    got = aarch64.run([aarch64.Case(tvm_ext.build(other.module, TARGET), other.inputs),
                       aarch64.Case(ex, [wrong_input]), aarch64.Case(ex, right.inputs)])
    assert compare_outputs(right, got[0]) is not None
    assert isinstance(got[1], str) and "Error" in got[1]
    assert compare_outputs(right, got[2]) is None


def test_without_the_sysroot_it_says_how_to_get_it(tmp_path):
    assert "make aarch64" in aarch64.unavailable(tmp_path)
    with pytest.raises(RuntimeError, match="cannot run AArch64 modules: .*make aarch64"):
        aarch64.run([aarch64.Case(tvm_ext.build(random_graph(0).module, TARGET), [])], root=tmp_path)


def test_the_sysroot_names_the_packages_it_cannot_install(tmp_path, monkeypatch):
    """Missing tools and no root: a clear error naming the Debian packages, before any download."""
    monkeypatch.setattr(aarch64_sysroot.shutil, "which", lambda _cmd: None)
    monkeypatch.setattr(aarch64_sysroot.os, "geteuid", lambda: 1000)
    with pytest.raises(RuntimeError, match="binutils-aarch64-linux-gnu qemu-user"):
        aarch64_sysroot.prepare(tmp_path / "root")
    assert not (tmp_path / "root").exists()
