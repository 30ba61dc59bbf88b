"""Winograd F(m x m, r x r): the transforms, the three kernels against float64, the graph path."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tvm
from reference import conv2d_nchw, rel_err
from tvm import relax

import tvm_ext
from tvm_ext.kernels import winograd
from tvm_ext.kernels.common import KERNEL_ATTR
from tvm_ext.kernels.conv2d import Conv2dWorkload, Epilogue, pack_weight_func
from tvm_ext.tuning import space

TARGET = tvm_ext.resolve_target("llvm")
ISA = tvm_ext.vector_isa(TARGET)


@pytest.mark.parametrize("m,r", [(2, 3), (4, 3), (2, 5), (4, 5), (6, 3)])
def test_matrices_compute_the_correlation(m, r):
    at, g, bt = winograd.winograd_matrices(m, r)
    a = m + r - 1
    assert at.shape == (m, a) and g.shape == (a, r) and bt.shape == (a, a)
    assert np.array_equal(bt, np.round(bt))  # integer input transform: exact in float32
    rng = np.random.default_rng(m * r)
    d, w = rng.standard_normal(a), rng.standard_normal(r)
    ref = [sum(w[k] * d[i + k] for k in range(r)) for i in range(m)]
    np.testing.assert_allclose(at @ ((g @ w) * (bt @ d)), ref, rtol=1e-12, atol=1e-12)


def test_matrices_need_interpolation_points():
    with pytest.raises(KeyError):
        winograd.winograd_matrices(3, 3)  # a = 5: no points chosen


def test_weighted_sum_skips_zeros_and_unit_factors():
    """The transforms' sums: no multiply by 0 or +-1, and the value of sum(c * t)."""
    from tvm import tirx

    terms = [tirx.Var(name, "float32") for name in "pqrs"]
    expr = winograd.weighted_sum([1, 0, -1, 2.5], terms)
    text = str(expr)
    assert "q" not in text and text.count("*") == 1 and "2.5" in text
    values = dict(zip("pqrs", (3.0, 7.0, 0.5, 2.0), strict=True))
    assert eval(text.replace("T.float32", "float"), {}, values) == 3.0 - 0.5 + 2.5 * 2.0  # noqa: S307
    assert str(winograd.weighted_sum([0, 0], terms[:2])) in ("T.float32(0.0)", "T.float32(0)")
    negative_first = str(winograd.weighted_sum([-1, 1], terms[:2]))
    assert negative_first.startswith("T.float32(0") and "- p" in negative_first


def test_eligibility_and_tile_size():
    make = Conv2dWorkload.make
    assert winograd.eligible(make((1, 64, 14, 14), (64, 64, 3, 3), 1, 1, 1, 1)) == ""
    assert winograd.eligible(make((1, 64, 27, 27), (192, 64, 5, 5), 1, 2, 1, 1)) == ""
    assert "3x3" in winograd.eligible(make((1, 64, 14, 14), (64, 64, 3, 3), 2, 1, 1, 1))
    assert "5x5" in winograd.eligible(make((1, 64, 14, 14), (64, 64, 5, 5), 2, 2, 1, 1))
    assert "5x5" in winograd.eligible(make((1, 64, 14, 14), (64, 64, 7, 7), 1, 3, 1, 1))
    assert "5x5" in winograd.eligible(make((1, 64, 14, 14), (64, 64, 3, 5), 1, (1, 2), 1, 1))
    assert "3x3" in winograd.eligible(make((1, 64, 14, 14), (64, 64, 1, 1), 1, 0, 1, 1))
    assert "3x3" in winograd.eligible(make((1, 64, 14, 14), (64, 32, 3, 3), 1, 1, 1, 2))
    assert "3x3" in winograd.eligible(make((1, 64, 14, 14), (64, 64, 3, 3), 1, 2, 2, 1))
    assert "channels" in winograd.eligible(make((1, 16, 14, 14), (64, 16, 3, 3), 1, 1, 1, 1))
    assert "channels" in winograd.eligible(make((1, 40, 14, 14), (64, 40, 3, 3), 1, 1, 1, 1))
    assert winograd.tile_size(make((1, 64, 14, 14), (64, 64, 3, 3), 1, 1, 1, 1)) == 4
    assert winograd.tile_size(make((1, 64, 8, 9), (64, 64, 3, 3), 1, 1, 1, 1)) == 4
    assert winograd.tile_size(make((1, 64, 7, 9), (64, 64, 3, 3), 1, 1, 1, 1)) == 2
    # 4 images a call share the larger weights of F(4, 3) (their GEMMs run images inside blocks).
    assert winograd.tile_size(make((4, 64, 7, 7), (64, 64, 3, 3), 1, 1, 1, 1)) == 4
    assert winograd.tile_size(make((4, 64, 5, 7), (64, 64, 3, 3), 1, 1, 1, 1)) == 2
    assert winograd.tile_size(make((1, 64, 27, 27), (192, 64, 5, 5), 1, 2, 1, 1)) == 4
    assert winograd.tile_size(make((1, 64, 11, 11), (64, 64, 5, 5), 1, 0, 1, 1)) == 2
    assert "F(4x4, 5x5)" in winograd.winograd_plan(make((1, 64, 27, 27), (192, 64, 5, 5), 1, 2, 1, 1), ISA).reason


def _blocked(x: np.ndarray, block: int, pads=(0, 0, 0, 0)) -> np.ndarray:
    n, c, h, w = x.shape
    top, left, bottom, right = pads
    padded = np.zeros((n, c, h + top + bottom, w + left + right), np.float32)
    padded[:, :, top:top + h, left:left + w] = x
    return np.ascontiguousarray(padded.reshape(n, c // block, block, *padded.shape[2:]).transpose(0, 1, 3, 4, 2))


def _unblocked(y: np.ndarray) -> np.ndarray:
    n, kb, h, w, k = y.shape
    return y.transpose(0, 1, 4, 2, 3).reshape(n, kb * k, h, w)


# (x shape, K, kernel size, padding, epilogue): both tile sizes of 3x3 and 5x5, ragged last tiles,
# batch 2, asymmetric padding.
_CASES = [
    ((1, 32, 14, 14), 32, 3, (1, 1, 1, 1), Epilogue()),
    ((1, 32, 23, 21), 48, 3, (1, 1, 1, 1), Epilogue(bias=True)),  # a 6 x 6 grid of tiles, not flattened
    ((1, 64, 17, 14), 48, 3, (1, 1, 1, 1), Epilogue(bias=True, activation="relu", out_pad=(1, 1, 1, 1))),
    ((2, 48, 9, 11), 64, 3, (1, 1, 1, 1),
     Epilogue(bias=True, residual=True, activation="relu", out_pad=(1, 2, 3, 1))),
    ((1, 64, 15, 13), 32, 3, (0, 1, 2, 1), Epilogue(bias=True, activation="sigmoid")),
    ((1, 32, 6, 5), 32, 3, (2, 2, 2, 2), Epilogue(residual=True, activation="gelu")),
    ((1, 64, 27, 27), 48, 5, (2, 2, 2, 2), Epilogue(bias=True, activation="relu", out_pad=(1, 1, 1, 1))),
    ((2, 32, 13, 18), 32, 5, (0, 1, 2, 1), Epilogue(bias=True, residual=True)),  # 3 x 4 tiles, flattened
    ((1, 48, 9, 10), 64, 5, (0, 0, 0, 0), Epilogue(activation="sigmoid")),  # F(2x2, 5x5)
    # 4 images of 7 x 7: F(4x4, 3x3) on a 2 x 2 grid, the GEMMs' images inside their output blocks
    ((4, 32, 7, 7), 48, 3, (1, 1, 1, 1), Epilogue(bias=True, residual=True, activation="relu")),
]


@pytest.mark.parametrize("shape,K,R,padding,epilogue", _CASES)
def test_kernels_match_float64(shape, K, R, padding, epilogue):
    """Input transform -> the BRGEMM GEMMs on transformed weights -> output transform + epilogue,
    against a float64 direct convolution; the border is zero."""
    rng = np.random.default_rng(sum(shape) + K)
    x = rng.standard_normal(shape).astype(np.float32)
    w = (rng.standard_normal((K, shape[1], R, R)) / np.sqrt(R * R * shape[1])).astype(np.float32)
    wl = Conv2dWorkload.make(x.shape, w.shape, 1, padding, 1, 1)
    plan = winograd.winograd_plan(wl, ISA)
    gemm = winograd.gemm_plan(plan, ISA)
    assert plan.kind == "winograd" and gemm.kind == "brgemm" and gemm.wl.groups == (plan.m_r + R - 1) ** 2
    if shape[0] >= 4:
        assert plan.m_r == 4 and gemm.row_order == "ob_n_oh"
    rows, cols = winograd.grid(plan)
    assert rows * cols == np.prod(winograd.tiles(plan)) and (rows == 1) == (winograd.tiles(plan)[1] <= 4)
    build = lambda f: tvm.compile(f, TARGET)  # noqa: E731
    device = tvm.cpu()
    u = tvm.runtime.empty(gemm.weight_shape(), "float32", device)
    build(pack_weight_func(gemm))(tvm.runtime.tensor(winograd.transform_weight(plan, w)), u)
    v = tvm.runtime.empty(gemm.data_shape(), "float32", device)
    products = tvm.runtime.empty(gemm.out_shape(), "float32", device)
    y = tvm.runtime.empty(epilogue.out_shape(plan), "float32", device)
    bias = rng.standard_normal(K).astype(np.float32)
    residual = rng.standard_normal((shape[0], K, wl.OH, wl.OW)).astype(np.float32)
    extra = ([tvm.runtime.tensor(bias.reshape(-1, plan.oc_bn))] if epilogue.bias else []) + (
        [tvm.runtime.tensor(_blocked(residual, plan.oc_bn))] if epilogue.residual else [])
    build(winograd.input_transform_func(plan))(
        tvm.runtime.tensor(_blocked(x, plan.ic_bn, winograd.input_padding(plan))), v)
    build(space.default_kernel(gemm, Epilogue(), ISA))(v, u, products)
    output = space.default_kernel(plan, epilogue, ISA)
    assert str(output.attrs[KERNEL_ATTR]) == "winograd_conv2d" and space.describe_kernel(output)[0] == plan
    build(output)(products, *extra, y)

    out = y.numpy()
    top, left, bottom, right = epilogue.out_pad
    inner = np.zeros(out.shape, bool)
    inner[:, :, top:top + wl.OH, left:left + wl.OW] = True
    assert np.all(out[~inner] == 0)
    ref = conv2d_nchw(x, w, bias if epilogue.bias else None, padding=padding)
    if epilogue.residual:
        ref = ref + residual
    if epilogue.activation == "relu":
        ref = np.maximum(ref, 0)
    elif epilogue.activation == "sigmoid":
        ref = 1 / (1 + np.exp(-ref))
    elif epilogue.activation == "gelu":
        ref = ref * 0.5 * (1 + np.vectorize(math.erf)(ref / math.sqrt(2)))
    assert rel_err(_unblocked(out[:, :, top:top + wl.OH, left:left + wl.OW]), ref) <= 1e-4


def test_output_transform_writes_blocked_only():
    plan = winograd.winograd_plan(Conv2dWorkload.make((1, 32, 8, 8), (32, 32, 3, 3), 1, 1, 1, 1), ISA)
    with pytest.raises(ValueError, match="blocked"):
        winograd.output_transform_func(plan, Epilogue(nchw_out=True))


def _block_graph(weights_as_params: bool = False) -> tvm.IRModule:
    """conv3x3 -> bias -> relu -> conv3x3 -> bias -> + shortcut -> relu, on a ragged 14x15 image."""
    rng = np.random.default_rng(21)
    const = lambda *s: relax.const((rng.standard_normal(s) * 0.1).astype("float32"))  # noqa: E731
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 32, 14, 15), "float32"))
    params = [x]
    if weights_as_params:
        params.append(relax.Var("w", relax.TensorType((32, 32, 3, 3), "float32")))
    with bb.function("main", params):
        with bb.dataflow():
            w1 = params[1] if weights_as_params else const(32, 32, 3, 3)
            y = bb.emit(relax.op.nn.conv2d(x, w1, padding=(1, 1)))
            y = bb.emit(relax.op.nn.relu(relax.op.add(y, const(1, 32, 1, 1))))
            y = bb.emit(relax.op.nn.conv2d(y, const(32, 32, 3, 3), padding=(1, 1)))
            y = bb.emit(relax.op.nn.relu(relax.op.add(relax.op.add(y, const(1, 32, 1, 1)), x)))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def _run(ex, *args: np.ndarray) -> np.ndarray:
    return relax.VirtualMachine(ex, tvm.cpu())["main"](*(tvm.runtime.tensor(a) for a in args)).numpy()


def test_graph_runs_winograd_and_can_turn_it_off():
    mod = _block_graph()
    report = tvm_ext.dispatch_report(mod, TARGET)
    convs = [r for r in report if r.op == "nn.conv2d"]
    assert [r.kernel for r in convs] == ["winograd_conv2d"] * 2 and "F(4x4, 3x3)" in convs[0].reason
    assert [r.kernel for r in tvm_ext.dispatch_report(mod, TARGET, winograd=False)
            if r.op == "nn.conv2d"] == ["brgemm_conv2d"] * 2
    lowered = tvm_ext.pipeline(TARGET)(mod)
    kernels = [str(f.attrs[KERNEL_ATTR]) for _, f in lowered.functions_items()
               if isinstance(f, tvm.tirx.PrimFunc) and f.attrs and KERNEL_ATTR in f.attrs]
    assert {"winograd_input_transform", "brgemm_conv2d", "winograd_conv2d"} <= set(kernels)
    assert lowered["main"].script().count("tvm_ext_winograd_input_") == 2
    assert "pack_weight" not in lowered["main"].script()  # weights transformed and packed at build time
    x = np.random.default_rng(3).standard_normal((1, 32, 14, 15)).astype("float32")
    ours, direct = _run(tvm_ext.build(mod, TARGET), x), _run(tvm_ext.build(mod, TARGET, winograd=False), x)
    assert rel_err(ours, _run(tvm.compile(mod, TARGET), x)) <= 1e-4 and rel_err(ours, direct) <= 1e-4


def test_weights_as_parameters_stay_direct():
    """Winograd transforms weights at build time; a weight passed at run time keeps the direct kernel."""
    mod = _block_graph(weights_as_params=True)
    assert [r.kernel for r in tvm_ext.dispatch_report(mod, TARGET)
            if r.op == "nn.conv2d"] == ["brgemm_conv2d", "winograd_conv2d"]
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 32, 14, 15)).astype("float32")
    w = (rng.standard_normal((32, 32, 3, 3)) * 0.1).astype("float32")
    assert rel_err(_run(tvm_ext.build(mod, TARGET), x, w), _run(tvm.compile(mod, TARGET), x, w)) <= 1e-4


@pytest.mark.parametrize("target", [{"kind": "llvm", "mcpu": "znver4"},
                                    {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a72"}])
def test_cross_compiles_for_avx512_and_neon(target):
    """The transforms and GEMMs compile for 16-lane AVX-512 and 4-lane NEON whatever the host."""
    mod = _block_graph()
    assert [r.kernel for r in tvm_ext.dispatch_report(mod, target) if r.op == "nn.conv2d"] == ["winograd_conv2d"] * 2
    assert tvm_ext.build(mod, target) is not None

