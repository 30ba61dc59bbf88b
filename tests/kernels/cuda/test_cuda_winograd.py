"""CUDA Winograd: input transform, the maxDNN GEMMs, output transform; checked without a GPU.

Numbers come from the CPU emulator (the generated CUDA C compiled with g++) against a float64
PyTorch convolution, machine code from nvcc. The test marked `gpu` runs the kernels on a device.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from reference import conv2d_nchw, random_const, rel_err
from tvm import relax

import tvm_ext
from tvm_ext.kernels.conv2d import Conv2dWorkload
from tvm_ext.kernels.cuda import maxdnn as cc
from tvm_ext.kernels.cuda import toolchain
from tvm_ext.kernels.cuda import winograd as cw
from tvm_ext.models.torch_reference import to_torch
from tvm_ext.strategy import cuda_engine
from tvm_ext.testing import cuda_emulator
from tvm_ext.testing import maxdnn as tm
from tvm_ext.testing.relax_emulator import emulated_executable, lower

needs_nvcc = pytest.mark.skipif(not toolchain.have_nvcc(), reason="nvcc is not installed")
needs_gxx = pytest.mark.skipif(not cuda_emulator.have_compiler(), reason="g++ is not installed")
TARGET = "cuda -arch=sm_90"


def _case(x_shape, w_shape, padding, epilogue: cc.Epilogue, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    bias = rng.standard_normal(w_shape[0]).astype(np.float32) if epilogue.bias else None
    ref = conv2d_nchw(x, w, bias, padding=padding)
    residual = None
    if epilogue.residual:
        residual = rng.standard_normal(ref.shape).astype(np.float32)
        ref = ref + residual
    if epilogue.activation in ("relu", "relu6"):
        ref = np.maximum(ref, 0)
    if epilogue.activation == "relu6":
        ref = np.minimum(ref, 6)
    return x, w, bias, residual, ref


@needs_gxx
@pytest.mark.parametrize("x_shape, w_shape, padding, m, epilogue", [
    # ragged tiles both ways (7 x 9 outputs, tiles of 4), channels in RSC steps
    ((2, 16, 7, 9), (16, 16, 3, 3), (1, 1, 1, 1), 4, cc.Epilogue()),
    # F(2x2): batch 3 (scalar lanes in the GEMM), K = 20 (a ragged tile), the whole epilogue
    ((3, 32, 10, 10), (20, 32, 3, 3), (1, 1, 1, 1), 2, cc.Epilogue(True, True, "relu")),
    # 5x5 (a = 8, 64 GEMMs), relu6
    ((4, 16, 8, 8), (32, 16, 5, 5), (2, 2, 2, 2), 4, cc.Epilogue(bias=True, activation="relu6")),
    # asymmetric padding, batch 1, 12 channels (a CRS-order GEMM: not a multiple of 8)
    ((1, 12, 9, 6), (24, 12, 3, 3), (0, 1, 2, 1), 4, cc.Epilogue(residual=True)),
])
def test_emulated_winograd_matches_float64(x_shape, w_shape, padding, m, epilogue):
    wl = Conv2dWorkload.make(x_shape, w_shape, 1, padding)
    plan = cw.WinogradPlan.make(wl, m, epilogue)
    x, w, bias, residual, ref = _case(x_shape, w_shape, padding, epilogue)
    arrays = cw.kernel_arrays(plan, x, w, bias, residual)
    got = cc.output_to_nchw(tm.emulate_winograd(plan, arrays))
    assert np.isfinite(got).all()
    assert rel_err(got, ref) < 1e-4
    # the GEMM really ran the transformed problem: a² groups of (C x K) on the grid of tiles
    assert arrays["v"].shape == (plan.a ** 2 * wl.C, *plan.tiles, wl.N)
    assert np.isfinite(arrays["mm"]).all()


@needs_gxx
def test_emulator_catches_a_wrong_transform():
    """A GEMM reading another tile position's weights (U's groups swapped) must fail the check."""
    wl = Conv2dWorkload.make((2, 16, 8, 8), (16, 16, 3, 3), 1, 1)
    plan = cw.WinogradPlan.make(wl)
    x, w, _, _, ref = _case((2, 16, 8, 8), (16, 16, 3, 3), (1, 1, 1, 1), cc.Epilogue())
    arrays = cw.kernel_arrays(plan, x, w)
    arrays["w"] = np.ascontiguousarray(arrays["w"][::-1])
    assert rel_err(cc.output_to_nchw(tm.emulate_winograd(plan, arrays)), ref) > 1e-2


def test_plan_shapes_and_validation():
    wl = Conv2dWorkload.make((8, 64, 13, 13), (96, 64, 3, 3), 1, 1)
    plan = cw.WinogradPlan.make(wl)
    assert (plan.m, plan.a, plan.tiles) == (4, 6, (4, 4))
    assert plan.shapes() == {"x": (64, 13, 13, 8), "w": (36, 64, 96), "v": (36 * 64, 4, 4, 8),
                             "mm": (36 * 96, 4, 4, 8), "y": (96, 13, 13, 8)}
    assert plan.gemm.wl.groups == 36 and (plan.gemm.wl.KH, plan.gemm.wl.KW) == (1, 1)
    assert plan.gemm.tile.rows == 96  # choose_tile on the layer's 96 filters
    assert list(plan.launches()) == list(cw.STAGES)
    assert plan.launches()["gemm"] == (plan.gemm.grid, (plan.gemm.tile.threads, 1, 1))
    ep = cc.Epilogue(bias=True, residual=True)
    params = cw.WinogradPlan.make(wl, 4, ep).stage_params()
    assert params["output"] == {"MM": "mm", "BIAS": "bias", "RESIDUAL": "residual", "Y": "y"}
    for bad, match in ((dict(stride=2), "stride-1"), (dict(dilation=2), "undilated"), (dict(groups=2), "ungrouped")):
        w_shape = (96, 64 // bad.get("groups", 1), 3, 3)
        with pytest.raises(ValueError, match=match):
            cw.WinogradPlan.make(Conv2dWorkload.make((8, 64, 13, 13), w_shape, padding=1, **bad))
    with pytest.raises(ValueError, match="tile m=3"):
        cw.WinogradPlan.make(wl, 3)
    with pytest.raises(ValueError, match="weight shape"):
        cw.transform_weight(plan, np.zeros((96, 64, 5, 5), np.float32))
    with pytest.raises(ValueError, match="epilogue"):
        cw.kernel_arrays(plan, np.zeros((8, 64, 13, 13), np.float32), np.zeros((96, 64, 3, 3), np.float32),
                         bias=np.zeros(96, np.float32))


def test_transform_weight_is_g_g_gt():
    """U[xi * a + nu, c, k] = (G w[k, c] G^T)[xi, nu], computed in float64."""
    wl = Conv2dWorkload.make((1, 3, 6, 6), (2, 3, 3, 3), 1, 1)
    plan = cw.WinogradPlan.make(wl, 2)
    w = np.random.default_rng(0).standard_normal((2, 3, 3, 3)).astype(np.float32)
    _, g, _ = plan.matrices
    u = cw.transform_weight(plan, w)
    assert u.shape == (16, 3, 2) and u.dtype == np.float32
    expected = g @ w[1, 2].astype(np.float64) @ g.T
    np.testing.assert_allclose(u[:, 2, 1].reshape(4, 4), expected, rtol=1e-6)


def test_strategy_takes_winograd_where_the_estimate_wins():
    """Big 3x3 and 5x5 layers run as Winograd (the reason says so, with the estimate); small
    ones, tensor-core engines, non-constant weights (the caller's flag) and strided layers stay direct."""
    alexnet_conv3 = Conv2dWorkload.make((128, 256, 13, 13), (384, 256, 3, 3), 1, 1)
    kernel, reason, plan = cuda_engine.conv2d_decision(alexnet_conv3, "ffma", True)
    assert kernel == cw.KERNEL_NAME and isinstance(plan, cw.WinogradPlan)
    assert reason.startswith("Winograd F(4x4, 3x3): 36 GEMMs") and "faster than direct" in reason
    direct_ms, winograd_ms = cw.estimate(plan)
    assert direct_ms > cw.MIN_SPEEDUP * winograd_ms
    alexnet_conv2 = Conv2dWorkload.make((128, 64, 27, 27), (192, 64, 5, 5), 1, 2)
    assert cuda_engine.conv2d_decision(alexnet_conv2, "ffma", True)[0] == cw.KERNEL_NAME
    small = Conv2dWorkload.make((1, 16, 8, 8), (16, 16, 3, 3), 1, 1)  # launches dominate
    assert cuda_engine.conv2d_decision(small, "ffma", True)[0] == cc.KERNEL_NAME
    for engine, allowed in (("mma_tf32", True), ("ffma", False)):
        assert cuda_engine.conv2d_decision(alexnet_conv3, engine, allowed)[0] == cc.KERNEL_NAME
    strided = Conv2dWorkload.make((128, 256, 13, 13), (384, 256, 3, 3), 2, 1)
    assert cuda_engine.conv2d_decision(strided, "ffma", True)[0] == cc.KERNEL_NAME
    tiny_images = Conv2dWorkload.make((64, 256, 2, 2), (256, 256, 3, 3), 1, 1)  # F(4x4): 36 products for 4
    assert cw.choose_plan(tiny_images)[0].m == 2 and cw.choose_plan(alexnet_conv3)[0].m == 4
    huge = Conv2dWorkload.make((256, 128, 224, 224), (64, 128, 3, 3), 1, 1)  # V: 3.7e9 elements
    with pytest.raises(ValueError, match="32-bit indices"):
        cw.WinogradPlan.make(huge)
    assert cuda_engine.conv2d_decision(huge, "ffma", True)[0] == cc.KERNEL_NAME
    larger = Conv2dWorkload.make((1024, 128, 224, 224), (64, 128, 3, 3), 1, 1)  # x itself: 6.6e9 elements
    kernel, reason, _ = cuda_engine.conv2d_decision(larger, "ffma", True)
    assert kernel is None and "32-bit indices" in reason and reason.endswith("stock TVM")


@needs_gxx
def test_network_through_winograd(monkeypatch):
    """A graph of 3x3 and 5x5 convolutions with bias, residual and relu through the CUDA strategy,
    every convolution as Winograd (the estimate's threshold lowered: these layers are small), on
    the emulator against float64 PyTorch; `winograd=False` and weights given at run time stay direct."""
    monkeypatch.setattr(cw, "MIN_SPEEDUP", 0.0)
    rng = np.random.default_rng(7)

    def const(*shape):
        return random_const(rng, *shape)

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((3, 48, 9, 7), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.relu(relax.op.add(relax.op.nn.conv2d(x, const(64, 48, 3, 3), padding=1),
                                                      const(1, 64, 1, 1))))
            y = bb.emit(relax.op.nn.relu(relax.op.add(relax.op.nn.conv2d(y, const(48, 64, 5, 5), padding=2), x)))
            out = bb.emit_output(bb.emit(relax.op.nn.conv2d(y, const(40, 48, 3, 3), padding=(0, 1, 2, 1))))
        bb.emit_func_output(out)
    mod = bb.get()
    convs = [row for row in tvm_ext.dispatch_report(mod, TARGET) if row.op == "nn.conv2d"]
    assert [row.kernel for row in convs] == [cw.KERNEL_NAME] * 3
    assert "Winograd F(4x4, 5x5): 64 GEMMs" in convs[1].reason
    direct = tvm_ext.dispatch_report(mod, TARGET, winograd=False)
    assert {row.kernel for row in direct if row.op == "nn.conv2d"} == {cc.KERNEL_NAME}

    lowered = lower(mod, TARGET)
    names = [gv.name_hint for gv, f in lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    for stage in cw.STAGES:
        assert sum(name.startswith("tvm_ext_winograd_conv2d") and name.endswith("_" + stage) for name in names) == 3
    assert not any(name.startswith("tvm_ext_maxdnn_conv2d") for name in names)
    vm = relax.VirtualMachine(emulated_executable(lowered, TARGET), tvm.cpu())
    xv = rng.standard_normal((3, 48, 9, 7)).astype(np.float32)
    out = vm["main"](tvm.runtime.tensor(xv)).numpy()
    ref = to_torch(mod, torch.float64)(torch.from_numpy(xv).double()).numpy()
    assert np.isfinite(out).all() and rel_err(out, ref) < 1e-4

    bb = relax.BlockBuilder()  # weights given at run time: transformed only at build time, so direct
    w = relax.Var("w", relax.TensorType((40, 48, 3, 3), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.nn.conv2d(x, w, padding=1)))
        bb.emit_func_output(out)
    assert [row.kernel for row in tvm_ext.dispatch_report(bb.get(), TARGET)] == [cc.KERNEL_NAME]


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_machine_code(arch):
    """All three kernels compile for sm_80 and sm_90 without spills; the GEMM is the maxDNN tile
    (128-bit loads, 64 FMAs per thread per k step); the transforms coalesce over the batch."""
    wl = Conv2dWorkload.make((128, 256, 13, 13), (384, 256, 3, 3), 1, 1)  # AlexNet conv3
    plan = cw.WinogradPlan.make(wl, epilogue=cc.Epilogue(bias=True, activation="relu"))
    source = cw.cuda_source(plan, {"kind": "cuda", "arch": arch})
    assert [f"{cw.KERNEL_NAME}_{stage}_kernel" for stage in cw.STAGES] == [
        name for name in toolchain.kernel_names(source) if name.startswith(cw.KERNEL_NAME)]
    ops_count = toolchain.ptx_instructions(toolchain.compile_source(source, arch).decode())
    assert ops_count["ld.global.nc.v4.f32"] > 0 and ops_count["ld.shared.v4.f32"] > 0
    resources = toolchain.ptxas_resources(source, arch)
    assert resources["spill_stores"] == resources["spill_loads"] == resources["stack"] == 0
    assert cw.cuda_param_order(plan, source, "gemm") == ["w", "v", "mm"]  # TVM orders them by name
    assert cw.cuda_param_order(plan, source, "output") == ["bias", "mm", "y"]


@pytest.mark.gpu
@pytest.mark.skipif(not tvm.cuda(0).exist, reason="no CUDA device")
def test_gpu_winograd_matches_reference():
    wl = Conv2dWorkload.make((8, 32, 14, 14), (64, 32, 3, 3), 1, 1)
    plan = cw.WinogradPlan.make(wl, epilogue=cc.Epilogue(bias=True))
    x, w, bias, _, ref = _case((8, 32, 14, 14), (64, 32, 3, 3), (1, 1, 1, 1), plan.epilogue)
    got = cw.run_on_gpu(plan, cw.kernel_arrays(plan, x, w, bias))
    assert rel_err(cc.output_to_nchw(got), ref) < 1e-4
