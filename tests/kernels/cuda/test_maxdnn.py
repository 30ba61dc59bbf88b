"""CUDA: the maxDNN convolution (FFMA tiles) and its thread-tile intrinsic, checked without a GPU.

Numbers come from the CPU emulator (the generated CUDA C compiled with g++), machine code from
nvcc (PTX and ptxas for sm_80 and sm_90). Tests marked `gpu` run the kernel on a device.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest
import tvm
from maxdnn_cases import _WL_STATIC, _emulated, _inputs, _reference, needs_gxx, needs_nvcc
from reference import conv2d_nchw, rel_err

from tvm_ext import ops
from tvm_ext.intrin.cuda import get_outer_product_intrin, thread_tile
from tvm_ext.intrin.outer_tile import OuterTile
from tvm_ext.kernels.common import KERNEL_ATTR
from tvm_ext.kernels.conv2d import Conv2dWorkload
from tvm_ext.kernels.cuda import maxdnn as cc
from tvm_ext.kernels.cuda import toolchain
from tvm_ext.testing import maxdnn as tm

has_gpu = tvm.cuda(0).exist


# (x shape, w shape, options): vector and scalar paths, every kind of edge
SHAPES = [
    ((8, 16, 12, 12), (64, 16, 3, 3), dict(padding=1)),  # everything float4, 18 k steps
    ((3, 5, 9, 7), (70, 5, 3, 2), dict(padding=(1, 0, 2, 1), stride=2)),  # batch 3, 70 filters: scalar paths
    ((4, 6, 9, 7), (96, 3, 5, 5), dict(padding=2, dilation=2, groups=2)),
    ((1, 3, 23, 23), (96, 3, 11, 11), dict(stride=4, padding=2)),  # AlexNet conv1 in small, batch 1
    ((4, 32, 7, 7), (16, 32, 1, 1), {}),  # 16 filters: a 32-row tile
    ((2, 8, 6, 6), (8, 1, 3, 3), dict(padding=1, groups=8)),  # depthwise
    ((5, 12, 5, 9), (40, 12, 1, 7), dict(padding=(0, 3))),  # 1x7
    ((4, 2, 5, 5), (8, 2, 1, 1), {}),  # one k step
    ((4, 16, 5, 5), (8, 16, 1, 1), {}),  # two k steps
    ((4, 24, 5, 5), (8, 24, 1, 1), {}),  # three: one loop pair and a tail of one
    ((8, 3, 4, 4), (130, 3, 2, 2), dict(stride=2)),  # 130 filters: three 64-row tiles
    # RSC order: a loop over taps around a loop over channel steps, or a running tap where a tap
    # has an odd number of channel steps
    ((4, 48, 7, 7), (64, 48, 3, 3), dict(padding=1)),  # 6 steps a tap: the channel loop runs
    ((3, 32, 7, 6), (40, 32, 3, 3), dict(padding=(1, 0, 2, 1), dilation=2)),  # scalar lanes, 4 a tap
    ((4, 32, 6, 6), (32, 16, 3, 3), dict(padding=1, groups=2)),  # per group: 2 steps a tap
    ((4, 24, 6, 5), (20, 24, 3, 3), dict(padding=1, stride=2)),  # 3 steps a tap: the running tap
    ((2, 8, 5, 5), (12, 8, 3, 3), dict(padding=1)),  # 1 step a tap, batch 2
]


@needs_gxx
@pytest.mark.parametrize("x_shape, w_shape, options", SHAPES)
def test_emulated_conv2d_matches_reference(x_shape, w_shape, options):
    plan = cc.MaxDNNPlan.make(Conv2dWorkload.make(x_shape, w_shape, **options))
    got, ref = _emulated(plan)
    assert np.isfinite(got).all()
    assert rel_err(got, ref) < 1e-4


@needs_gxx
@pytest.mark.parametrize("epilogue, batch", [
    (cc.Epilogue(bias=True, residual=True, activation="relu"), 4),
    (cc.Epilogue(bias=True, activation="relu6"), 3),
    (cc.Epilogue(residual=True), 1),
])
def test_emulated_epilogue(epilogue, batch):
    wl = Conv2dWorkload.make((batch, 8, 7, 6), (72, 8, 3, 3), padding=1)
    got, ref = _emulated(cc.MaxDNNPlan.make(wl, epilogue=epilogue))
    assert rel_err(got, ref) < 1e-4


@needs_gxx
@pytest.mark.parametrize("activation", ["relu", "relu6"])
@pytest.mark.parametrize("splits", [1, 3])
def test_emulated_epilogue_keeps_nan(activation, splits):
    """relu and relu6 of a NaN are NaN, as in PyTorch (fmaxf(NaN, 0) is 0), vector and split-K."""
    wl = Conv2dWorkload.make((4, 16, 6, 6), (64, 16, 3, 3), padding=1)
    plan = cc.MaxDNNPlan.make(wl, cc.choose_tile(wl.K, "ffma"), cc.Epilogue(bias=True, activation=activation),
                              splits=splits)
    x, w, bias, _ = _inputs(wl, plan.epilogue)
    x[1, :, 2, 3] = np.nan
    got = cc.output_to_nchw(tm.emulate(plan, cc.kernel_arrays(plan, x, w, bias, None)))
    ref = _reference(wl, plan.epilogue, np.where(np.isnan(x), 0, x), w, bias, None)
    poisoned = np.zeros(wl.out_shape, bool)
    poisoned[1, :, 1:4, 2:5] = True  # every output whose 3x3 window holds the NaN
    assert np.isnan(got[poisoned]).all() and not np.isnan(got[~poisoned]).any()
    assert rel_err(got[~poisoned], ref[~poisoned]) < 1e-4


@needs_gxx
@pytest.mark.parametrize("tile", [*cc.FFMA_TILES, cc.BlockTile(rows=128)],
                         ids=lambda t: f"{t.rows}x{t.cols}_{t.thread_rows}x{t.thread_cols}")
@pytest.mark.parametrize("x_shape, w_shape, padding", [
    ((4, 10, 6, 6), (100, 10, 3, 3), 1),  # CRS order
    ((5, 24, 9, 8), (140, 24, 3, 3), (1, 0, 2, 1)),  # RSC: taps of 3 steps, scalar lanes, part tiles
])
def test_emulated_tile_shapes(tile, x_shape, w_shape, padding):
    """Every FFMA tile the strategy picks from, on tiles past the edges in both directions."""
    wl = Conv2dWorkload.make(x_shape, w_shape, padding=padding)
    got, ref = _emulated(cc.MaxDNNPlan.make(wl, tile, cc.Epilogue(bias=True, activation="relu")))
    assert rel_err(got, ref) < 1e-4


@needs_gxx
@pytest.mark.parametrize("x_shape, w_shape, options, splits, engine", [
    ((4, 16, 6, 6), (64, 16, 3, 3), dict(padding=1), 3, "ffma"),  # 3 slices of 3 taps
    ((3, 48, 7, 7), (20, 48, 3, 3), dict(padding=1, stride=2), 9, "ffma"),  # a tap each, scalar lanes
    ((4, 32, 5, 5), (40, 32, 1, 1), {}, 2, "ffma"),  # 1x1: 2 slices of 2 channel steps
    ((4, 16, 6, 6), (64, 16, 3, 3), dict(padding=1), 3, "mma_tf32"),
])
def test_emulated_split_k(x_shape, w_shape, options, splits, engine):
    """Split-K: each slice of the reduction writes its partial sums, a second kernel adds them
    with bias, residual and relu."""
    wl = Conv2dWorkload.make(x_shape, w_shape, **options)
    epilogue = cc.Epilogue(bias=True, residual=True, activation="relu")
    plan = cc.MaxDNNPlan.make(wl, cc.choose_tile(wl.K, engine), epilogue, splits=splits)
    assert plan.grid[2] == splits and plan.shapes()["partial"] == (splits, *plan.y_shape)
    assert list(plan.reduce_shapes()) == ["partial", "bias", "residual", "y"]
    got, ref = _emulated(plan)
    assert np.isfinite(got).all() and rel_err(got, ref) < (1e-4 if engine == "ffma" else 1e-2)


def test_split_k_choice_and_validation():
    big = cc.MaxDNNPlan.make(Conv2dWorkload.make((128, 256, 13, 13), (512, 256, 3, 3), padding=1))
    assert cc.choose_splits(big) == 1  # 2704 blocks fill the GPU
    late = cc.MaxDNNPlan.make(Conv2dWorkload.make((32, 512, 7, 7), (512, 512, 3, 3), padding=1), cc.BlockTile())
    assert math.prod(late.grid) == 200 and cc.choose_splits(late) == 9  # ResNet-50's last 3x3, batch 32
    assert late.with_chosen_splits().grid == (*late.grid[:2], 9)
    one = cc.MaxDNNPlan.make(Conv2dWorkload.make((32, 2048, 7, 7), (512, 2048, 1, 1)), cc.BlockTile())
    assert cc.choose_splits(one) == 8  # 256 k steps: 8 slices of 32
    short = cc.MaxDNNPlan.make(Conv2dWorkload.make((4, 64, 6, 6), (64, 64, 1, 1)))
    assert cc.choose_splits(short) == 1  # 8 k steps: too few to share
    crs = Conv2dWorkload.make((4, 3, 9, 9), (64, 3, 3, 3))
    assert cc.MaxDNNPlan.make(crs).split_unit is None
    with pytest.raises(ValueError, match="split-K into 2"):
        cc.MaxDNNPlan.make(crs, splits=2)
    with pytest.raises(ValueError, match="split-K into 4"):
        cc.MaxDNNPlan.make(Conv2dWorkload.make((4, 16, 6, 6), (64, 16, 3, 3), padding=1), splits=4)  # 9 taps
    with pytest.raises(ValueError, match="no split-K"):
        cc.split_reduce_func(big)


# -- machine code: PTX and ptxas for sm_80 and sm_90 ------------------------------------------

@needs_nvcc
# every tile on sm_90; sm_80 on the tile with the most registers a thread (16 x 8)
@pytest.mark.parametrize("arch, tile", [("sm_90", cc.BlockTile(rows=64)), ("sm_90", cc.BlockTile(rows=96)),
                                        ("sm_90", cc.FFMA_TILES[0]), ("sm_80", cc.FFMA_TILES[0])],
                         ids=["64x64-sm_90", "96x64-sm_90", "128x128_16x8-sm_90", "128x128_16x8-sm_80"])
def test_machine_code(arch, tile):
    plan = cc.MaxDNNPlan.make(_WL_STATIC, tile)
    source = cc.cuda_source(plan, {"kind": "cuda", "arch": arch})
    ops_count = toolchain.ptx_instructions(toolchain.compile_source(source, arch).decode())
    t, steps = plan.tile, plan.code_steps
    tt = t.thread_tile()
    fma = sum(n for op, n in ops_count.items() if op.startswith("fma.rn") and op.endswith(".f32"))
    assert fma == tt.fma_per_k() * t.k_step * steps  # 64 FMAs per thread per k (8 x 8), 128 (16 x 8)
    # per k: a thread's 8 rows and 8 columns as four 128-bit shared loads (16 x 8: six)
    assert ops_count["ld.shared.v4.f32"] == (tt.rows + tt.cols) // t.vec * t.k_step * steps
    assert ops_count["ld.global.nc.v4.f32"] > 0  # 128-bit loads through the read-only path
    assert ops_count["bar.sync"] == steps + 2  # one per k step, the prologue's and the staging's
    assert sum(n for op, n in ops_count.items() if op.startswith("st.global.v4")) > 0  # coalesced float4
    assert len(re.findall(r"__shared__[^;]*\b[AB]_sh[01]_ptr\[", source)) == 4  # the double buffer
    resources = toolchain.ptxas_resources(source, arch)
    assert resources["spill_stores"] == resources["spill_loads"] == resources["stack"] == 0
    assert resources["registers"] <= 255
    # the k loop (the channel loop's pair of steps) is FFMA-bound: 89% of the PTX instructions it
    # issues are FFMA with 64 rows, 88% with 96 (the rest: 4 shared loads per k, the prefetch's
    # loads and stores, the loop; the SASS, below, is 90-91%)
    loop = toolchain.main_loop_instructions(toolchain.compile_source(source, arch).decode())
    loop_fma = sum(n for op, n in loop.items() if op.startswith("fma.rn"))
    assert loop_fma == 2 * tt.fma_per_k() * t.k_step and loop_fma >= 0.87 * sum(loop.values())
    cubin = toolchain.compile_source(source, arch, "cubin")
    assert cubin[:4] == b"\x7fELF"


@needs_nvcc
@pytest.mark.skipif(toolchain.find_nvdisasm() is None, reason="nvdisasm is not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("tile, share", [(cc.BlockTile(), 0.9), (cc.FFMA_TILES[0], 0.935)],
                         ids=["maxdnn_64x64", "128x128_16x8"])
def test_k_loop_machine_code_is_ffma_bound(arch, tile, share):
    """The SASS the GPU issues per pair of k steps: a scheduler issues one warp instruction a
    cycle, so the FFMA share of the loop bounds the share of the FFMA peak the kernel reaches."""
    plan = cc.MaxDNNPlan.make(_WL_STATIC, tile)
    source = cc.cuda_source(plan, {"kind": "cuda", "arch": arch})
    loop = toolchain.sass_loop_instructions(toolchain.disassemble(toolchain.compile_source(source, arch, "cubin")))
    tt, t = plan.tile.thread_tile(), plan.tile
    assert loop["FFMA"] == 2 * tt.fma_per_k() * t.k_step
    # the floor: per k a thread's rows and columns in LDS.128 (8 x 8: 4, 16 x 8: 6); per step its
    # share of the next step's tiles in LDG.128 and STS.128 (4 each for both tiles) and a barrier:
    # 92.6% FFMA for 8 x 8, 94.7% for 16 x 8 on 128 x 128 (BlockTile.ffma_issue_share)
    moves = 2 * t.k_step * (t.rows + t.cols) // (t.threads * t.vec)
    assert loop["LDS"] == 2 * (tt.rows + tt.cols) // t.vec * t.k_step and loop["BAR"] == 2
    assert loop["LDG"] == loop["STS"] == moves
    assert loop["FFMA"] >= share * sum(loop.values()), loop.most_common(12)


# -- descriptions, plans and layouts ----------------------------------------------------------

def test_thread_tile_description():
    spec = thread_tile()
    assert (spec.span_a, spec.span_b, spec.fma_per_k()) == (36, 36, 64)
    name = get_outer_product_intrin(spec)
    assert name == spec.name("cuda") and tvm.s_tir.TensorIntrin.get(name) is not None
    assert get_outer_product_intrin(thread_tile(row_gap=48, col_gap=32)) != name
    with pytest.raises(ValueError, match="float32"):
        get_outer_product_intrin(dataclasses.replace(spec, dtype="float16"))
    with pytest.raises(ValueError, match="multiple of its group"):
        get_outer_product_intrin(thread_tile(rows=6))
    with pytest.raises(ValueError, match="overlap"):
        get_outer_product_intrin(thread_tile(row_gap=2))
    with pytest.raises(ValueError, match="spills"):
        get_outer_product_intrin(thread_tile(rows=16, cols=16))
    with pytest.raises(ValueError, match="one width"):  # the CPU's contiguous tile is not a thread's
        get_outer_product_intrin(OuterTile.contiguous(8, 32, 8))


def test_block_tile_and_choice():
    assert cc.BlockTile().threads == 64 and cc.BlockTile(rows=96).threads == 96
    assert cc.choose_tile(96).rows == 96  # OverFeat L1: one 96-row tile, not 1.5 of 64
    assert cc.choose_tile(16).rows == 32

    def shape(tile: cc.BlockTile) -> tuple[int, int, int, int]:
        return tile.rows, tile.cols, tile.thread_rows, tile.thread_cols

    # many columns: the tiles whose threads issue the most FFMA per instruction
    assert shape(cc.choose_tile(256)) == shape(cc.choose_tile(1000)) == (128, 128, 16, 8)
    assert shape(cc.choose_tile(192)) == (64, 128, 16, 8)  # AlexNet conv2: 3 tiles of 64, none wasted
    assert shape(cc.choose_tile(96)) == (96, 128, 12, 8)
    # few: 64 columns where 128 would waste more than the taller thread tile gains
    assert shape(cc.choose_tile(64, columns=56 * 56)) == (64, 64, 8, 8)  # ResNet-50 stage 2 at batch 1
    assert shape(cc.choose_tile(512, columns=7 * 7)) == (128, 64, 16, 8)
    assert shape(cc.choose_tile(64, columns=56 * 56 * 32)) == (64, 128, 16, 8)
    # the estimate: 92.6% of a maxDNN 8 x 8 thread's instructions are FFMA, 94.7% of a 16 x 8's
    assert round(cc.BlockTile().ffma_issue_share(), 3) == 0.926
    assert round(cc.FFMA_TILES[0].ffma_issue_share(), 3) == 0.947
    for tile in cc.FFMA_TILES:
        tile.validate()
    with pytest.raises(ValueError, match="multiple of the thread tile"):
        cc.BlockTile(rows=60).validate()
    with pytest.raises(ValueError, match="threads per block"):
        cc.BlockTile(rows=16, cols=8).validate()
    assert cc.BlockTile().shared_bytes() == 4 * (2 * 8 * 128 + 64 * 64)


def test_plan_and_function():
    wl = Conv2dWorkload.make((128, 3, 231, 231), (96, 3, 11, 11), stride=4)  # OverFeat L1
    plan = cc.MaxDNNPlan.make(wl)
    assert plan.gemm == (96, 56 * 56 * 128, 3 * 11 * 11) and plan.grid == (3136, 1, 1)  # 96 x 128 tiles
    assert plan.vector_a and plan.vector_b and plan.k_steps == 46
    assert list(plan.shapes()) == ["x", "w", "y"]
    func = cc.maxdnn_conv2d_func(plan)
    assert func.attrs[KERNEL_ATTR] == cc.KERNEL_NAME
    script = func.script()  # the updates are tensorized: blockized, the intrinsic's body inlined
    assert 'T.sblock("update0_o")' in script and "a_reg" in script
    ep = cc.Epilogue(bias=True, residual=True, activation="relu")
    assert list(cc.MaxDNNPlan.make(wl, epilogue=ep).shapes()) == ["x", "w", "bias", "residual", "y"]
    with pytest.raises(ValueError, match="activation"):
        cc.Epilogue(activation="tanh")
    with pytest.raises(ValueError, match="fault"):
        tm.cuda_source(plan, fault="typo")


def test_layout_helpers():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    assert cc.data_to_chwn(x)[1, 2, 3, 0] == x[0, 1, 2, 3]
    assert np.array_equal(cc.output_to_nchw(cc.data_to_chwn(x)), x)
    w = rng.standard_normal((6, 2, 3, 3)).astype(np.float32)  # 2 groups of 3 filters
    a = cc.weight_to_crsk(w, groups=2)
    assert a.shape == (2, 2 * 9, 3)
    assert a[1, 1 * 9 + 2 * 3 + 0, 2] == w[3 + 2, 1, 2, 0]
    with pytest.raises(ValueError, match="groups"):
        cc.weight_to_crsk(w, groups=4)
    rsck = cc.weight_to_crsk(w, groups=2, k_order="rsc")  # k = (r * S + s) * I + i
    assert rsck[1, (2 * 3 + 0) * 2 + 1, 2] == w[3 + 2, 1, 2, 0]
    assert cc.MaxDNNPlan.make(Conv2dWorkload.make((1, 16, 5, 5), (8, 16, 3, 3))).k_order == "rsc"
    assert cc.MaxDNNPlan.make(Conv2dWorkload.make((1, 3, 5, 5), (8, 3, 3, 3))).k_order == "crs"
    plan = cc.MaxDNNPlan.make(Conv2dWorkload.make(x.shape, (4, 3, 3, 3)))
    with pytest.raises(ValueError, match="epilogue"):
        cc.kernel_arrays(plan, x, w[:4, :3], bias=np.zeros(4, np.float32))


@pytest.mark.skipif(has_gpu, reason="checks the message on a machine without a GPU")
def test_ops_conv2d_on_cuda_without_gpu_says_so():
    x = np.ones((1, 3, 8, 8), np.float32)
    w = np.ones((4, 3, 3, 3), np.float32)
    with pytest.raises(RuntimeError, match="needs an NVIDIA GPU"):
        ops.conv2d(x, w, target="cuda -arch=sm_90")


# -- on a GPU ---------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu, reason="no CUDA device")
@pytest.mark.parametrize("x_shape, w_shape, options", SHAPES)
def test_gpu_conv2d_matches_reference(x_shape, w_shape, options):
    rng = np.random.default_rng(2)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    bias = rng.standard_normal(w_shape[0]).astype(np.float32)
    got = ops.conv2d(x, w, bias, target="cuda", **options)
    wl = Conv2dWorkload.make(x_shape, w_shape, **options)
    ref = conv2d_nchw(x, w, bias, wl.stride, wl.padding, wl.dilation, wl.groups)
    assert rel_err(got, ref) < 1e-4
