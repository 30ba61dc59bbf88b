"""GELU on tvm_ext kernels (a vectorized erf, fused into convolution epilogues on CPUs, a separate
kernel on CUDA) and ConvNeXt's channels-last blocks rewritten as NCHW convolutions (issue 30)."""

import math
import time

import numpy as np
import pytest
import torch
import tvm
from reference import conv2d_nchw, rel_err
from tvm import relax, te

import tvm_ext
from tvm_ext.kernels.elementwise import activation_func
from tvm_ext.kernels.vector_math import vector_erf, vector_exp
from tvm_ext.strategy.decide import epilogue_activation
from tvm_ext.target import resolve_target, vector_isa
from tvm_ext.testing import cuda_emulator
from tvm_ext.transform.channels_last import channels_last_as_nchw, is_view

TARGET = resolve_target("llvm")
CUDA = "cuda -arch=sm_90"


def _run(ex, x: np.ndarray) -> np.ndarray:
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x))
    return (out if hasattr(out, "numpy") else out[0]).numpy()


def _gelu64(x: np.ndarray) -> np.ndarray:
    return torch.nn.functional.gelu(torch.from_numpy(np.asarray(x, np.float64))).numpy()


def test_vector_math_binds_what_it_reuses():
    """The polynomials use their argument and intermediates many times; each is bound once
    (tirx.Let). As a DAG of shared nodes it printed 172 KB for one erf, and TVM's passes, which
    walk trees, took 13 s to lower one GELU convolution (2.4 s bound; relu: 0.14 s)."""
    x = tvm.tirx.Var("x", "float32")
    assert len(str(vector_erf(x))) < 4000
    assert len(str(vector_exp(x * x + x))) < 1500
    assert str(vector_erf(x)).count("x * x + x") == 0 and str(vector_exp(x * x + x)).count("x * x + x") == 1


def test_vector_erf_lowers_quickly():
    """erf's |x| and clamp are abs and min: as Selects, TVM's simplifiers took 1.7-2.4 s to lower
    one elementwise erf (each GELU convolution of ConvNeXt 2.1 s, half its build); now ~0.05 s."""
    x = te.placeholder((64, 16), "float32", name="x")
    y = te.compute((64, 16), lambda i, j: vector_erf(x[i, j]), name="y")
    sch = tvm.s_tir.Schedule(te.create_prim_func([x, y]))
    sch.vectorize(sch.get_loops(sch.get_sblock("y"))[1])
    mod = tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")})
    best = math.inf
    for _ in range(2):  # the first build also loads LLVM's passes
        start = time.perf_counter()
        tvm.compile(mod, TARGET)
        best = min(best, time.perf_counter() - start)
    assert best < 0.5, f"lowering one erf took {best:.2f} s"


def test_vector_erf_is_accurate_and_vectorizes():
    """Within 1.5 ulp of float64 erf over a dense sweep of [-6, 6] and of magnitudes 1e-40..30
    (subnormals included), erf(+-0) = +-0, erf(+-inf) = +-1, NaN stays NaN; a kernel built from it
    calls neither erff nor expf."""
    n = 1 << 20
    x = te.placeholder((n,), "float32", name="x")
    y = te.compute((n,), lambda i: vector_erf(x[i]), name="y")
    sch = tvm.s_tir.Schedule(te.create_prim_func([x, y]))
    _, inner = sch.split(sch.get_loops(sch.get_sblock("y"))[0], [None, 16])
    sch.vectorize(inner)
    lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), TARGET)
    asm = lib.mod.inspect_source("asm")
    assert "erff" not in asm and "expf" not in asm
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e30, -1e30, 3.4e38]
    sweep = np.concatenate([np.linspace(-6, 6, n - 100_000 - len(special)), np.logspace(-40, 1.5, 50_000),
                            -np.logspace(-40, 1.5, 50_000)])
    values = np.concatenate([sweep, special]).astype(np.float32)
    out = tvm.runtime.empty((n,), "float32")
    lib["main"](tvm.runtime.tensor(values), out)
    got = out.numpy()
    ref = np.array([math.erf(float(v)) for v in values[:-len(special)]])
    ulp = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got[:-len(special)] - ref) / ulp) <= 1.5
    tail = got[-len(special):]
    np.testing.assert_array_equal(tail[[0, 2, 3, 5, 6, 7]], [0, 1, -1, 1, -1, 1])
    assert np.signbit(tail[1]) and np.isnan(tail[4])


def test_gelu_kernel_calls_no_scalar_erf():
    func = activation_func("gelu", (1, 64, 7, 9), "float32", vector_isa(TARGET).lanes)
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), TARGET)
    assert "erff" not in lib.mod.inspect_source("asm")


def _conv_gelu(then_conv: bool):
    """conv + bias -> gelu [-> conv]: gelu fused into the first convolution's epilogue."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((32, 32, 3, 3)) * 0.2).astype(np.float32)
    b1 = rng.standard_normal((1, 32, 1, 1)).astype(np.float32)
    w2 = (rng.standard_normal((16, 32, 1, 1)) * 0.3).astype(np.float32)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 32, 11, 13), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, relax.const(w1), padding=(1, 1)))
            y = bb.emit(relax.op.nn.gelu(relax.op.add(y, relax.const(b1))))
            if then_conv:
                y = bb.emit(relax.op.nn.conv2d(y, relax.const(w2)))
            out = bb.emit_output(y)
        bb.emit_func_output(out)

    def reference(xv):
        y = _gelu64(conv2d_nchw(xv, w1, b1.reshape(-1), padding=(1, 1, 1, 1)))
        return conv2d_nchw(y, w2) if then_conv else y

    return bb.get(), reference


@pytest.mark.parametrize("then_conv", [False, True])
def test_gelu_fuses_into_the_convolution_epilogue(then_conv):
    mod, reference = _conv_gelu(then_conv)
    report = tvm_ext.dispatch_report(mod, "llvm", winograd=False)
    gelu = [r for r in report if r.op == "nn.gelu"]
    assert len(gelu) == 1 and gelu[0].reason == "fused" and gelu[0].kernel.endswith("conv2d epilogue"), report
    x = (np.random.default_rng(1).standard_normal((1, 32, 11, 13)) * 2).astype(np.float32)
    assert any(r.kernel == "winograd_conv2d" for r in tvm_ext.dispatch_report(mod, "llvm"))
    for winograd in (False, True):  # GELU in the direct and in Winograd's output-transform epilogue
        assert rel_err(_run(tvm_ext.build(mod, "llvm", winograd=winograd), x), reference(x)) <= 1e-5


@pytest.mark.parametrize("form", ["gelu", "gelu_after_reshape"])
def test_standalone_gelu_runs_on_the_vectorized_kernel(form):
    """gelu of a graph input (no convolution to fuse into): the elementwise kernel."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 5, 7, 33), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            v = x if form == "gelu" else bb.emit(relax.op.reshape(x, (10, 231)))
            out = bb.emit_output(relax.op.nn.gelu(v))
        bb.emit_func_output(out)
    mod = bb.get()
    report = tvm_ext.dispatch_report(mod, "llvm")
    assert [r.kernel for r in report if r.op == "nn.gelu"] == ["gelu"], report
    xv = (np.random.default_rng(2).standard_normal((2, 5, 7, 33)) * 4).astype(np.float32)
    got = _run(tvm_ext.build(mod, "llvm"), xv)
    np.testing.assert_allclose(got.reshape(xv.shape), _gelu64(xv), rtol=2e-6, atol=2e-7)


def test_gelu_is_not_fused_on_cuda():
    """The maxDNN epilogue applies relu and relu6 only: on CUDA gelu stays a separate kernel with
    the reason, relu still fuses; the CUDA build lowers (no GPU needed)."""
    assert epilogue_activation("gelu", resolve_target(CUDA)).kernel is None
    assert "separate activation kernel" in epilogue_activation("gelu", resolve_target(CUDA)).reason
    assert epilogue_activation("relu", resolve_target(CUDA)).kernel is not None
    assert epilogue_activation("gelu", TARGET).kernel is not None
    mod, _ = _conv_gelu(then_conv=True)
    report = tvm_ext.dispatch_report(mod, CUDA)
    gelu = [r for r in report if r.op == "nn.gelu"]
    assert len(gelu) == 1 and gelu[0].reason != "fused" and gelu[0].kernel == "gelu", report
    tvm_ext.pipeline(CUDA)(mod)  # lowers with the separate kernel


class _Block(torch.nn.Module):
    """torchvision's CNBlock (ConvNeXt), eval mode: dw 7x7, permute, LayerNorm, Linear, GELU,
    Linear, layer scale, permute back, + input."""

    def __init__(self, dim: int):
        super().__init__()
        self.dw = torch.nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = torch.nn.LayerNorm(dim, eps=1e-6)
        self.fc1, self.fc2 = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)
        self.scale = torch.nn.Parameter(torch.rand(dim, 1, 1) + 0.5)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        y = self.dw(x).permute(0, 2, 3, 1)
        y = self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(y)))).permute(0, 3, 1, 2)
        return x + self.scale * y


def test_convnext_block_runs_its_linear_layers_as_convolutions():
    """A ConvNeXt block through torch.export: the Linear layers are 1x1 convolutions, GELU in the
    first one's epilogue, the layer scale folded into the second's weights; no multiply, matmul
    or standalone gelu left. The layer norm stays channels-last on stock TVM (with its permute
    and the transposes into the convolution); the shortcut add too. Right against float64
    PyTorch."""
    from tvm.relax.frontend.torch import from_exported_program

    torch.manual_seed(0)
    block = torch.nn.Sequential(_Block(32), _Block(32)).eval()
    x = torch.randn(1, 32, 9, 10)
    with torch.no_grad():
        mod = from_exported_program(torch.export.export(block, (x,)), keep_params_as_input=False)
        ref = block.double()(x.double()).numpy()
    report = tvm_ext.dispatch_report(mod, "llvm")
    assert "multiply" not in {r.op for r in report}, report
    assert all(r.kernel == "brgemm_conv2d" for r in report if r.op == "matmul"), report
    fallback = {r.op for r in report if r.kernel == "fallback"}
    assert fallback <= {"nn.layer_norm", "permute_dims", "reshape", "add"}, fallback
    gelu = [r for r in report if r.op == "nn.gelu"]
    assert len(gelu) == 2 and all(r.reason == "fused" for r in gelu), gelu
    assert rel_err(_run(tvm_ext.build(mod, "llvm"), x.numpy()), ref) <= 1e-5


def _op_names(func: relax.Function) -> list[str]:
    names = []
    relax.analysis.post_order_visit(func, lambda e: names.append(e.op.name) if isinstance(
        e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return names


def test_layout_chains_collapse_only_when_they_keep_element_order():
    def movement(shape, *steps):
        bb = relax.BlockBuilder()
        x = relax.Var("x", relax.TensorType(shape, "float32"))
        with bb.function("main", [x]):
            with bb.dataflow():
                v = x
                for step in steps:
                    v = bb.emit(relax.op.permute_dims(v, step) if isinstance(step, list) else relax.op.reshape(v, step))
                out = bb.emit_output(relax.op.nn.relu(v))
            bb.emit_func_output(out)
        return bb.get()

    for steps, collapses in [(([0, 2, 3, 1], (12, 2), [1, 0], (1, 2, 1, 12)), True),
                             (([0, 2, 3, 1], (12, 2)), False), (((2, 12), [1, 0], [1, 0]), True)]:
        mod = movement((1, 2, 3, 4), *steps)
        lowered = channels_last_as_nchw()(mod)
        names = _op_names(lowered["main"])
        assert ("relax.permute_dims" not in names) == collapses, (steps, names)
        xv = np.random.default_rng(3).standard_normal((1, 2, 3, 4)).astype(np.float32)
        expected = _run(tvm.compile(mod, "llvm"), xv)
        np.testing.assert_array_equal(_run(tvm.compile(lowered, "llvm"), xv), expected)
    assert is_view((2, 3), []) and not is_view((2, 3), [relax.op.permute_dims(relax.Var("v", relax.TensorType(
        (2, 3), "float32")), [1, 0])])


def test_one_permutation_is_a_view_as_its_indices_say():
    """is_view decides one permute_dims from its axes: the same answer as running it on the
    element indices, over every permutation of shapes with and without unit axes."""
    import itertools

    for shape in [(2, 3, 4), (1, 3, 1, 4), (1, 1, 5), (2, 1, 3, 1), (3,)]:
        var = relax.Var("v", relax.TensorType(shape, "float32"))
        for axes in [None, *itertools.permutations(range(len(shape)))]:
            call = relax.op.permute_dims(var, axes)
            moved = np.arange(math.prod(shape)).reshape(shape).transpose(axes).reshape(-1)
            assert is_view(shape, [call]) == bool(np.array_equal(moved, np.arange(moved.size))), (shape, axes)


@pytest.mark.skipif(not cuda_emulator.have_compiler(), reason="g++ is not installed")
@pytest.mark.parametrize("name", ["gelu", "silu", "sigmoid"])
def test_cuda_activation_kernels_on_the_emulator(name):
    """CUDA's standalone activation kernels (GELU's now the polynomial erf, the exp let-bound):
    the CUDA C TVM generates, run on the CPU emulator, against float64 PyTorch, with zeros,
    large values, infinities and NaN."""
    from tvm_ext.kernels.cuda.memory_bound import THREADS, activation_func
    from tvm_ext.kernels.cuda.toolchain import generate_source

    rng = np.random.default_rng(5)
    specials = [0.0, -0.0, 1e-30, -9.0, 9.0, 30.0, -30.0, np.inf, -np.inf, np.nan]
    x = np.concatenate([rng.standard_normal(1000) * 4, specials]).astype(np.float32)
    source = generate_source(activation_func(name, x.shape), resolve_target(CUDA))
    y = np.full_like(x, 7.0)
    cuda_emulator.run_kernel(source, "activation_kernel", (-(-x.size // THREADS), 1, 1), (THREADS, 1, 1),
                             {"X_flat": x, "Y_flat": y})
    t = torch.from_numpy(x.astype(np.float64))
    torch_op = {"gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu, "sigmoid": torch.sigmoid}[name]
    ref = torch_op(t).numpy()
    finite = np.isfinite(ref)
    np.testing.assert_allclose(y[finite], ref[finite], rtol=2e-6, atol=2e-7)
    assert np.isnan(y[np.isnan(ref)]).all() and (y[np.isinf(ref)] == ref[np.isinf(ref)]).all()
