"""CUDA: the maxDNN convolution and its thread-tile intrinsic, checked without a GPU.

Numbers come from the CPU emulator (the generated CUDA C compiled with g++), machine code from
nvcc (PTX and ptxas for sm_80 and sm_90). Tests marked `gpu` run the kernel on a device.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import re
import tempfile
import time

import numpy as np
import pytest
import tvm
from reference import conv2d_nchw, rel_err

from tvm_ext import ops
from tvm_ext.intrin.cuda import ThreadTile, get_outer_product_intrin
from tvm_ext.kernels.conv2d import KERNEL_ATTR, Conv2dWorkload
from tvm_ext.kernels.cuda import maxdnn as cc
from tvm_ext.kernels.cuda import ptx
from tvm_ext.testing import cuda_emulator
from tvm_ext.testing import maxdnn as tm

needs_nvcc = pytest.mark.skipif(not ptx.have_nvcc(), reason="nvcc is not installed")
needs_gxx = pytest.mark.skipif(not cuda_emulator.have_compiler(), reason="g++ is not installed")
has_gpu = tvm.cuda(0).exist


def _inputs(wl: Conv2dWorkload, epilogue: cc.Epilogue, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((wl.N, wl.C, wl.H, wl.W)).astype(np.float32)
    w = rng.standard_normal((wl.K, wl.C // wl.groups, wl.KH, wl.KW)).astype(np.float32)
    bias = rng.standard_normal(wl.K).astype(np.float32) if epilogue.bias else None
    residual = rng.standard_normal(wl.out_shape).astype(np.float32) if epilogue.residual else None
    return x, w, bias, residual


def _reference(wl, epilogue, x, w, bias, residual) -> np.ndarray:
    ref = conv2d_nchw(x, w, bias, stride=wl.stride, padding=wl.padding, dilation=wl.dilation, groups=wl.groups)
    if residual is not None:
        ref = ref + residual.astype(np.float64)
    if epilogue.activation in ("relu", "relu6"):
        ref = np.maximum(ref, 0)
    if epilogue.activation == "relu6":
        ref = np.minimum(ref, 6)
    return ref


def _emulated(plan: cc.MaxDNNPlan, source: str | None = None, seed: int = 0):
    x, w, bias, residual = _inputs(plan.wl, plan.epilogue, seed)
    y = tm.emulate(plan, cc.kernel_arrays(plan, x, w, bias, residual), source)
    return cc.output_to_nchw(y), _reference(plan.wl, plan.epilogue, x, w, bias, residual)


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


# -- deliberately broken kernels must fail the same check ------------------------------------

_WL_FAULT = Conv2dWorkload.make((8, 16, 6, 6), (64, 16, 3, 3), padding=1)  # 18 k steps: the loop runs


def _without_first_loop_barrier(source: str) -> str:
    """The CUDA C with the k loop's first barrier deleted (the loop is flat, over taps, or over the ring)."""
    loop = re.search(r"for \(int (kt2|rs|kr) ", source).start()
    barrier = source.index("__syncthreads();", loop)
    return source[:barrier] + source[barrier + len("__syncthreads();"):]


def _fails(got, ref) -> bool:
    return not np.isfinite(got).all() or rel_err(got, ref) > 1e-4


@needs_gxx
@pytest.mark.parametrize("tile", [cc.BlockTile(), cc.FFMA_TILES[0]], ids=["64x64", "128x128_16x8"])
@pytest.mark.parametrize("fault", ["wrong_buffer", "no_store"])
def test_emulator_catches_broken_kernels(fault, tile):
    plan = cc.MaxDNNPlan.make(_WL_FAULT, tile)
    got, ref = _emulated(plan, tm.cuda_source(plan, fault=fault))
    assert _fails(got, ref)


@needs_gxx
@pytest.mark.parametrize("tile", [cc.BlockTile(), cc.FFMA_TILES[0]], ids=["64x64", "128x128_16x8"])
def test_emulator_catches_a_missing_barrier(tile):
    """TVM puts back a barrier missing from the TIR, so delete the k loop's first from the CUDA C."""
    plan = cc.MaxDNNPlan.make(_WL_FAULT, tile)
    source = cc.cuda_source(plan)
    broken = _without_first_loop_barrier(source)
    got, ref = _emulated(plan, broken)
    assert _fails(got, ref)


@needs_gxx
def test_emulator_reports_divergent_barriers():
    source = """
extern "C" __global__ void __launch_bounds__(4) k(float* __restrict__ y_ptr) {
  if (threadIdx.x > 0) { __syncthreads(); }
  y_ptr[threadIdx.x] = 1.0f;
}
"""
    y = np.zeros(4, np.float32)
    with pytest.raises(cuda_emulator.EmulationError, match="same __syncthreads"):
        cuda_emulator.run_kernel(source, "k", (1, 1, 1), (4, 1, 1), {"y": y})


@needs_gxx
def test_emulator_refuses_dynamic_shared_memory_the_launch_does_not_give():
    """The Winograd GEMM's launches gave no dynamic shared memory for its staged output tile: on
    an H200 its writes went out of bounds; the emulator ran them. Now it says so."""
    source = """
extern "C" __global__ void __launch_bounds__(2) k(float* __restrict__ y_ptr);
extern "C" __global__ void __launch_bounds__(2) j(float* __restrict__ y_ptr) { y_ptr[threadIdx.x] = 2.0f; }
extern "C" __global__ void __launch_bounds__(2) k(float* __restrict__ y_ptr) {
  extern __shared__ __align__(64) float4 o_ptr[];
  ((float*)o_ptr)[threadIdx.x] = 3.0f;
  __syncthreads();
  y_ptr[threadIdx.x] = ((float*)o_ptr)[1 - threadIdx.x];
}
"""
    y = np.zeros(2, np.float32)
    with pytest.raises(cuda_emulator.EmulationError, match="dynamic shared memory"):
        cuda_emulator.run_kernel(source, "k", (1, 1, 1), (2, 1, 1), {"y": y})
    cuda_emulator.run_kernel(source, "j", (1, 1, 1), (2, 1, 1), {"y": y})  # the other kernel needs none
    cuda_emulator.run_kernel(source, "k", (1, 1, 1), (2, 1, 1), {"y": y}, shared_bytes=32)
    assert (y == 3).all()


@needs_gxx
def test_emulator_shared_memory_is_per_block_and_poisoned():
    """A block that reads shared memory it never wrote sees NaN, not the last block's data."""
    source = """
extern "C" __global__ void __launch_bounds__(2) k(float* __restrict__ y_ptr) {
  __shared__ alignas(64) float s_ptr[2];
  if (blockIdx.x == 0) { s_ptr[threadIdx.x] = 5.0f; }
  __syncthreads();
  y_ptr[blockIdx.x * 2 + threadIdx.x] = s_ptr[1 - threadIdx.x];
}
"""
    y = np.zeros(4, np.float32)
    cuda_emulator.run_kernel(source, "k", (2, 1, 1), (2, 1, 1), {"y": y})
    assert (y[:2] == 5).all() and np.isnan(y[2:]).all()


@needs_gxx
def test_emulator_runtime_is_shared_and_a_failed_launch_leaves_nothing_behind():
    """A source's kernels are compiled once, into one library that links against the emulator's
    runtime (not compiled in); the runtime's threads and state are reused from launch to launch,
    also after a launch that failed midway."""
    source = """
extern "C" __global__ void __launch_bounds__(4) divergent(float* __restrict__ y_ptr) {
  if (threadIdx.x > 0) { __syncthreads(); }
  y_ptr[threadIdx.x] = 1.0f;
}

extern "C" __global__ void __launch_bounds__(1024) reverse(float* __restrict__ y_ptr) {
  __shared__ alignas(64) float s_ptr[1024];
  s_ptr[threadIdx.x] = (float)(blockIdx.x * blockDim.x + threadIdx.x);
  __syncthreads();
  y_ptr[blockIdx.x * blockDim.x + threadIdx.x] = s_ptr[blockDim.x - 1 - threadIdx.x];
  __syncthreads();
}
"""
    for threads in (64, 1024, 32):  # the pool of threads grows, then serves a smaller block
        with pytest.raises(cuda_emulator.EmulationError, match="same __syncthreads"):
            cuda_emulator.run_kernel(source, "divergent", (1, 1, 1), (4, 1, 1), {"y": np.zeros(4, np.float32)})
        y = np.zeros(3 * threads, np.float32)
        cuda_emulator.run_kernel(source, "reverse", (3, 1, 1), (threads, 1, 1), {"y": y})
        expect = np.arange(3 * threads).reshape(3, threads)[:, ::-1].ravel()
        np.testing.assert_array_equal(y, expect)
    with pytest.raises(cuda_emulator.EmulationError, match="more than 1024"):
        cuda_emulator.run_kernel(source, "reverse", (1, 1, 1), (1025, 1, 1), {"y": np.zeros(1025, np.float32)})
    library = cuda_emulator.compile_source(source)._name
    assert os.path.basename(library).startswith("divergent_")  # one library, named after the first kernel
    with open(library[:-3] + ".cc") as f:
        text = f.read()
    assert "makecontext" not in text and "_setjmp" not in text  # the runtime is not compiled in
    runtime = text.splitlines()[0].removeprefix("// links against ")
    assert os.path.exists(os.path.join(os.path.dirname(library), runtime))


def test_emulator_argument_errors():
    source = 'extern "C" __global__ void k(float* __restrict__ y_ptr, int n) {}'
    with pytest.raises(ValueError, match="not a pointer"):
        ptx.kernel_params(source, "k")
    with pytest.raises(cuda_emulator.EmulationError, match="not a pointer"):
        cuda_emulator.run_kernel(source, "k", (1, 1, 1), (1, 1, 1), {"y": np.zeros(1, np.float32)})
    source = 'extern "C" __global__ void k(float* __restrict__ y_ptr) {}'
    assert ptx.kernel_params(source, "k") == [("float", "y_ptr")] and ptx.kernel_names(source) == ["k"]
    with pytest.raises(ValueError, match="no kernel named"):
        ptx.kernel_params(source, "other")
    with pytest.raises(cuda_emulator.EmulationError, match="no __global__ kernel"):
        cuda_emulator.compile_source("__device__ float f(float x) { return x; }")
    with pytest.raises(cuda_emulator.EmulationError, match="no array"):
        cuda_emulator.run_kernel(source, "k", (1, 1, 1), (1, 1, 1), {})
    with pytest.raises(cuda_emulator.EmulationError, match="C-contiguous float"):
        cuda_emulator.run_kernel(source, "k", (1, 1, 1), (1, 1, 1), {"y": np.zeros(2)})


# -- machine code: PTX and ptxas for sm_80 and sm_90 ------------------------------------------

_WL_STATIC = Conv2dWorkload.make((128, 96, 13, 13), (256, 96, 3, 3), padding=1)  # OverFeat L3 shape


@needs_nvcc
# every tile on sm_90; sm_80 on the tile with the most registers a thread (16 x 8)
@pytest.mark.parametrize("arch, tile", [("sm_90", cc.BlockTile(rows=64)), ("sm_90", cc.BlockTile(rows=96)),
                                        ("sm_90", cc.FFMA_TILES[0]), ("sm_80", cc.FFMA_TILES[0])],
                         ids=["64x64-sm_90", "96x64-sm_90", "128x128_16x8-sm_90", "128x128_16x8-sm_80"])
def test_machine_code(arch, tile):
    plan = cc.MaxDNNPlan.make(_WL_STATIC, tile)
    source = cc.cuda_source(plan, {"kind": "cuda", "arch": arch})
    ops_count = ptx.ptx_instructions(ptx.compile_source(source, arch).decode())
    t, steps = plan.tile, plan.code_steps
    tt = t.thread_tile()
    fma = sum(n for op, n in ops_count.items() if op.startswith("fma.rn") and op.endswith(".f32"))
    assert fma == tt.ffma_per_k() * t.k_step * steps  # 64 FMAs per thread per k (8 x 8), 128 (16 x 8)
    # per k: a thread's 8 rows and 8 columns as four 128-bit shared loads (16 x 8: six)
    assert ops_count["ld.shared.v4.f32"] == (tt.rows + tt.cols) // t.vec * t.k_step * steps
    assert ops_count["ld.global.nc.v4.f32"] > 0  # 128-bit loads through the read-only path
    assert ops_count["bar.sync"] == steps + 2  # one per k step, the prologue's and the staging's
    assert sum(n for op, n in ops_count.items() if op.startswith("st.global.v4")) > 0  # coalesced float4
    assert len(re.findall(r"__shared__[^;]*\b[AB]_sh[01]_ptr\[", source)) == 4  # the double buffer
    resources = ptx.ptxas_resources(source, arch)
    assert resources["spill_stores"] == resources["spill_loads"] == resources["stack"] == 0
    assert resources["registers"] <= 255
    # the k loop (the channel loop's pair of steps) is FFMA-bound: 89% of the PTX instructions it
    # issues are FFMA with 64 rows, 88% with 96 (the rest: 4 shared loads per k, the prefetch's
    # loads and stores, the loop; the SASS, below, is 90-91%)
    loop = ptx.main_loop_instructions(ptx.compile_source(source, arch).decode())
    loop_fma = sum(n for op, n in loop.items() if op.startswith("fma.rn"))
    assert loop_fma == 2 * tt.ffma_per_k() * t.k_step and loop_fma >= 0.87 * sum(loop.values())
    cubin = ptx.compile_source(source, arch, "cubin")
    assert cubin[:4] == b"\x7fELF"


@needs_nvcc
@pytest.mark.skipif(ptx.find_nvdisasm() is None, reason="nvdisasm is not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("tile, share", [(cc.BlockTile(), 0.9), (cc.FFMA_TILES[0], 0.935)],
                         ids=["maxdnn_64x64", "128x128_16x8"])
def test_k_loop_machine_code_is_ffma_bound(arch, tile, share):
    """The SASS the GPU issues per pair of k steps: a scheduler issues one warp instruction a
    cycle, so the FFMA share of the loop bounds the share of the FFMA peak the kernel reaches."""
    plan = cc.MaxDNNPlan.make(_WL_STATIC, tile)
    source = cc.cuda_source(plan, {"kind": "cuda", "arch": arch})
    loop = ptx.sass_loop_instructions(ptx.disassemble(ptx.compile_source(source, arch, "cubin")))
    tt, t = plan.tile.thread_tile(), plan.tile
    assert loop["FFMA"] == 2 * tt.ffma_per_k() * t.k_step
    # the floor: per k a thread's rows and columns in LDS.128 (8 x 8: 4, 16 x 8: 6); per step its
    # share of the next step's tiles in LDG.128 and STS.128 (4 each for both tiles) and a barrier:
    # 92.6% FFMA for 8 x 8, 94.7% for 16 x 8 on 128 x 128 (BlockTile.ffma_issue_share)
    moves = 2 * t.k_step * (t.rows + t.cols) // (t.threads * t.vec)
    assert loop["LDS"] == 2 * (tt.rows + tt.cols) // t.vec * t.k_step and loop["BAR"] == 2
    assert loop["LDG"] == loop["STS"] == moves
    assert loop["FFMA"] >= share * sum(loop.values()), loop.most_common(12)


@needs_nvcc
def test_nvcc_outputs_are_cached_by_content(tmp_path, monkeypatch):
    """compile_source and ptxas_resources cache nvcc's outputs by content (the checks compile the
    same kernels many times); a source that does not compile raises every time."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    source = 'extern "C" __global__ void k(float* y) { y[threadIdx.x] = 1.0f; }\n'
    first = ptx.compile_source(source, "sm_80")
    assert b".entry k" in first and len(list((tmp_path / f"tvm_ext_nvcc_{os.getuid()}").iterdir())) == 1
    start = time.perf_counter()
    assert ptx.compile_source(source, "sm_80") == first and time.perf_counter() - start < 0.5
    assert ptx.compile_source(source, "sm_90") != first  # another arch, another entry
    assert ptx.ptxas_resources(source, "sm_80")["registers"] > 0
    for _ in range(2):
        with pytest.raises(Exception, match="error"):
            ptx.compile_source(source.replace("1.0f", "undeclared"), "sm_80")
    assert len(list((tmp_path / f"tvm_ext_nvcc_{os.getuid()}").iterdir())) == 3


def test_k_loop_is_found_in_listings():
    """The innermost loop, not the one around it; the longest of several."""
    sass = """
.L_x_0:
        /*0000*/                   FFMA R1, R2, R3, R1 ;
.L_x_1:
        /*0010*/                   FFMA R1, R2, R3, R1 ;
        /*0020*/                   LDS.128 R4, [R0] ;
        /*0030*/               @P0 BRA `(.L_x_1) ;
        /*0040*/              @!P1 BRA `(.L_x_0) ;
.L_x_2:
        /*0050*/                   IADD3 R1, R1, 0x1, RZ ;
        /*0060*/                   BRA `(.L_x_2);
"""
    assert ptx.sass_loop_instructions(sass) == {"FFMA": 1, "LDS": 1, "BRA": 1}
    assert ptx.sass_loop_instructions("") == {}
    ptx_text = """
$L__BB0_1:
\tfma.rn.f32 \t%f1, %f2, %f3, %f1;
$L__BB0_2:
\tfma.rn.f32 \t%f1, %f2, %f3, %f1;
\tld.shared.v4.f32 \t{%f4, %f5, %f6, %f7}, [%r1];
\t@%p1 bra.uni \t$L__BB0_2;
\t@%p2 bra.uni \t$L__BB0_1;
"""
    assert ptx.main_loop_instructions(ptx_text) == {"fma.rn.f32": 1, "ld.shared.v4.f32": 1, "bra.uni": 1}


def test_source_generation_survives_the_nvcc_callback():
    """With tvm.support.nvcc imported, tvm.compile for CUDA needs a CUDA runtime; we do not."""
    import tvm.support.nvcc  # noqa: F401

    plan = cc.MaxDNNPlan.make(Conv2dWorkload.make((4, 8, 5, 5), (8, 8, 1, 1)))
    for target in ("cuda -arch=sm_90", "nvidia/nvidia-h100", {"kind": "cuda", "arch": "sm_80"}):
        assert "maxdnn_conv2d_kernel" in cc.cuda_source(plan, target)


# -- descriptions, plans and layouts ----------------------------------------------------------

def test_thread_tile_description():
    spec = ThreadTile()
    assert (spec.span_a, spec.span_b, spec.ffma_per_k()) == (36, 36, 64)
    name = get_outer_product_intrin(spec)
    assert name == spec.name and tvm.s_tir.TensorIntrin.get(name) is not None
    assert get_outer_product_intrin(ThreadTile(row_gap=48, col_gap=32)) != name
    with pytest.raises(ValueError, match="float32"):
        ThreadTile(dtype="float16").validate()
    with pytest.raises(ValueError, match="multiple of vec"):
        ThreadTile(rows=6).validate()
    with pytest.raises(ValueError, match="overlap"):
        ThreadTile(row_gap=2).validate()
    with pytest.raises(ValueError, match="spills"):
        ThreadTile(rows=16, cols=16).validate()


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


# -- the tensor-core (mma.sync tf32) variant of the tile ---------------------------------------

def _as_read(a: np.ndarray, engine: str) -> np.ndarray:
    """What the tensor cores compute with: tf32 drops the low 13 mantissa bits of the fp32
    register; bf16 is rounded to nearest even when the fragment is packed."""
    bits = np.ascontiguousarray(a, np.float32).view(np.uint32)
    if engine.endswith("tf32"):
        return (bits & np.uint32(0xFFFFE000)).view(np.float32)
    rounded = (bits.astype(np.uint64) + 0x7FFF + ((bits >> 16) & 1)).astype(np.uint32)
    return (rounded & np.uint32(0xFFFF0000)).view(np.float32)


@needs_gxx
@pytest.mark.parametrize("engine", ["mma_tf32", "mma_bf16"])
@pytest.mark.parametrize("x_shape, w_shape, options, epilogue", [
    ((8, 16, 12, 12), (64, 16, 3, 3), dict(padding=1), cc.Epilogue()),
    ((3, 5, 9, 7), (70, 5, 3, 2), dict(padding=(1, 0, 2, 1), stride=2), cc.Epilogue(bias=True, activation="relu")),
    ((4, 6, 9, 7), (96, 3, 5, 5), dict(padding=2, dilation=2, groups=2), cc.Epilogue(residual=True)),
])
def test_emulated_tensor_core_conv2d(x_shape, w_shape, options, epilogue, engine):
    wl = Conv2dWorkload.make(x_shape, w_shape, **options)
    plan = cc.MaxDNNPlan.make(wl, cc.choose_tile(wl.K // wl.groups, engine), epilogue)
    x, w, bias, residual = _inputs(wl, epilogue)
    got = cc.output_to_nchw(tm.emulate(plan, cc.kernel_arrays(plan, x, w, bias, residual)))
    ref = _reference(wl, epilogue, _as_read(x, engine), _as_read(w, engine), bias, residual)
    assert rel_err(got, ref) < 1e-5
    assert rel_err(got, _reference(wl, epilogue, x, w, bias, residual)) > 1e-5  # it really is tf32 / bf16


@needs_gxx
def test_emulated_tensor_cores_with_dynamic_shared_memory():
    """128 rows of bf16 k steps of 16 need 57 KB: the output tile moves to dynamic shared memory."""
    wl = Conv2dWorkload.make((4, 16, 7, 6), (128, 16, 3, 3), padding=1)
    plan = cc.MaxDNNPlan.make(wl, cc.BlockTile(rows=128, engine="mma_bf16", k_step=16, warp_rows=64))
    assert plan.tile.shared_bytes() > cc.STATIC_SHARED_LIMIT and plan.dynamic_shared_bytes == 4 * 128 * 64
    x, w, _, residual = _inputs(wl, cc.Epilogue(residual=True))
    plan = dataclasses.replace(plan, epilogue=cc.Epilogue(residual=True))
    got = cc.output_to_nchw(tm.emulate(plan, cc.kernel_arrays(plan, x, w, None, residual)))
    ref = _reference(wl, plan.epilogue, _as_read(x, "mma_bf16"), _as_read(w, "mma_bf16"), None, residual)
    assert rel_err(got, ref) < 1e-5


@needs_gxx
def test_emulated_tensor_cores_with_64_row_warp_slabs():
    wl = Conv2dWorkload.make((4, 10, 7, 6), (128, 10, 3, 3), padding=1)
    plan = cc.MaxDNNPlan.make(wl, cc.BlockTile(rows=128, engine="mma_tf32", warp_rows=64))
    assert plan.tile.threads == 64 and plan.tile.mma_tiles == (4, 8)
    x, w, bias, residual = _inputs(wl, plan.epilogue)
    got = cc.output_to_nchw(tm.emulate(plan, cc.kernel_arrays(plan, x, w)))
    assert rel_err(got, _reference(wl, plan.epilogue, _as_read(x, "mma_tf32"), _as_read(w, "mma_tf32"), None,
                                   None)) < 1e-5


@needs_gxx
def test_emulator_catches_broken_tensor_core_kernels():
    plan = cc.MaxDNNPlan.make(_WL_FAULT, cc.BlockTile(engine="mma_tf32"))
    got, ref = _emulated(plan, tm.cuda_source(plan, fault="wrong_buffer"))
    assert _fails(got, ref)
    got, ref = _emulated(plan, _without_first_loop_barrier(cc.cuda_source(plan)))
    assert _fails(got, ref)


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("engine, warp_rows", [("mma_tf32", 32), ("mma_bf16", 32), ("mma_tf32", 64)])
def test_tensor_core_machine_code(arch, engine, warp_rows):
    tile = dataclasses.replace(cc.choose_tile(256, engine), rows=128 if warp_rows == 64 else 64, warp_rows=warp_rows)
    plan = cc.MaxDNNPlan.make(_WL_STATIC, tile)
    source = cc.cuda_source(plan, {"kind": "cuda", "arch": arch})
    ops_count = ptx.ptx_instructions(ptx.compile_source(source, arch).decode())
    mt, nt = plan.tile.mma_tiles
    assert ops_count[plan.tile.mma.opcode] == mt * nt * plan.code_steps
    assert ops_count["bar.sync"] == plan.code_steps + 2 and ops_count["ld.global.nc.v4.f32"] > 0
    # fragment loads as vectors (mma_chunks): tf32 A's row pairs 64-bit, B 32-bit; bf16 128-bit
    ca, cb = plan.tile.mma_chunks
    per = plan.tile.mma.per_reg
    kind, width = ("u32" if per == 1 else "f32"), {1: "", 2: ".v2", 4: ".v4"}
    expected = collections.Counter({f"ld.shared{width[ca]}.{kind}": 2 * per * (2 * mt // ca) * plan.code_steps})
    expected[f"ld.shared{width[cb]}.{kind}"] += 2 * per * (nt // cb) * plan.code_steps
    assert {op: ops_count[op] for op in expected} == dict(expected)
    assert (ca, cb) == ((2, 1) if engine == "mma_tf32" else (4, 4))
    resources = ptx.ptxas_resources(source, arch)
    assert resources["spill_stores"] == resources["spill_loads"] == resources["stack"] == 0


@pytest.mark.parametrize("engine, operands", [("mma_tf32", "AB"), ("mma_bf16", "AB"), ("wgmma_tf32", "B")])
def test_padded_shared_rows_survive_lowering(engine, operands):
    """The fragment loads' bank spread needs the padded row stride in the CUDA C: TVM's
    CompactBufferAllocation trims a 2-D buffer to the columns it sees used (0.5.6's tensor-core
    tiles lost their padding that way), so padded tiles are flat, indexed with the padded stride."""
    tile = cc.choose_tile(64, engine)
    if tile.wgmma is not None:  # its im2col tile in shared memory (by default gathered into registers)
        tile = dataclasses.replace(tile, gather_fragments=False)
    plan = cc.MaxDNNPlan.make(_WL_STATIC, tile)
    source = cc.cuda_source(plan)
    declared = re.findall(r"__shared__ alignas\(\d+\) (float4?) (\w_sh\d)_ptr\[(\d+)\]", source)
    floats = {name: int(count) * (4 if kind == "float4" else 1) for kind, name, count in declared}
    for name in operands:
        stride = (tile.rows if name == "A" else tile.cols) + tile.pad
        assert stride % 32 in (4, 8)  # k-row t at bank 4t or 8t
        for buf in (0, 1):  # (a buffer may be shared with the output tile, and larger)
            assert floats[f"{name}_sh{buf}"] >= (tile.k_step - 1) * stride + stride - tile.pad


@pytest.mark.parametrize("engine", ["ffma", "mma_tf32", "mma_bf16", "wgmma_tf32", "wgmma_bf16"])
@pytest.mark.parametrize("channels", [1, 16])  # 9 and 16 reduction rows: one or two k steps
def test_short_reductions_keep_their_tiles_apart(engine, channels):
    """A reduction of one or two k steps has no k loop to join its buffers' lifetimes, and TVM's
    StorageRewrite laid one operand tile over another whose last access it saw earlier: a
    second barrier a step for FFMA and mma.sync, and for wgmma (whose tensor cores read the
    weights through a descriptor TVM does not see) a tile overwritten while a wgmma read it.
    The generator marks the tiles live after the k loop: each keeps its own array, and a step
    has one barrier (the prologue and the staged output one more each). (The network test
    with weights as inputs covers three k steps, a loop of one iteration, on wgmma bf16.)"""
    filt = 3 if channels == 1 else 1
    wl = Conv2dWorkload.make((4, channels, 6, 6), (64, channels, filt, filt), padding=filt // 2)
    tile = cc.choose_tile(64, engine, columns=144)
    if tile.wgmma is not None:  # the shared-tile path (gathered fragments keep a ring, always live)
        tile = dataclasses.replace(tile, gather_fragments=False)
    plan = cc.MaxDNNPlan.make(wl, tile)
    source = cc.cuda_source(plan)
    declared = re.findall(r"__shared__ alignas\(\d+\) float4? (\w_sh\d)_ptr\[", source)
    buffers = range(min(plan.k_steps, 2))
    assert sorted(declared) == sorted(f"{name}_sh{buf}" for name in plan.operand_tiles for buf in buffers)
    assert source.count("__syncthreads();") == plan.k_steps + 2


@needs_gxx
def test_short_wgmma_reduction_is_not_overwritten():
    """The two-step wgmma tf32 kernel of a 1-channel 3x3 convolution: before its tiles were
    marked live, the emulator caught its second weights' tile stored over the first while the
    tensor cores read it."""
    wl = Conv2dWorkload.make((4, 1, 6, 6), (64, 1, 3, 3), padding=1)
    plan = cc.MaxDNNPlan.make(wl, cc.choose_tile(64, "wgmma_tf32"))
    assert plan.k_steps == 2 and not plan.gathers_fragments
    x, w, _, _ = _inputs(wl, plan.epilogue)
    got = cc.output_to_nchw(tm.emulate(plan, cc.kernel_arrays(plan, x, w)))
    assert rel_err(got, _reference(wl, plan.epilogue, _as_read(x, "wgmma_tf32"), _as_read(w, "wgmma_tf32"),
                                   None, None)) < 1e-5


def test_tensor_core_tile_validation():
    assert cc.BlockTile(rows=96, engine="mma_tf32").threads == 96  # three warps of 32 rows
    assert cc.choose_tile(96, "mma_tf32").engine == "mma_tf32"
    with pytest.raises(ValueError, match="engine"):
        cc.BlockTile(engine="wgmma").validate()
    with pytest.raises(ValueError, match="rows % warp_rows"):
        cc.BlockTile(rows=48, engine="mma_tf32").validate()
    with pytest.raises(ValueError, match="shared memory; a block has at most"):
        cc.BlockTile(rows=256, cols=256, engine="mma_bf16", k_step=16, warp_rows=64).validate()
    with pytest.raises(ValueError, match="rows % warp_rows"):
        cc.BlockTile(rows=96, engine="mma_tf32", warp_rows=64).validate()
    with pytest.raises(ValueError, match="k_step 16"):
        cc.BlockTile(engine="mma_bf16").validate()  # bf16 reduces 16 per instruction
    assert cc.choose_tile(64, "mma_bf16").k_step == 16
    with pytest.raises(ValueError, match="accumulators"):
        cc.BlockTile(cols=128, engine="mma_tf32", warp_rows=64).validate()


def test_emulator_refuses_unknown_inline_ptx():
    source = """
extern "C" __global__ void k(float* __restrict__ y_ptr) {
  __asm__ __volatile__("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" "{%0}" : "=f"(y_ptr[0]) : );
}
"""
    with pytest.raises(cuda_emulator.EmulationError, match="no mma"):
        cuda_emulator.run_kernel(source, "k", (1, 1, 1), (32, 1, 1), {"y": np.zeros(1, np.float32)})


@needs_nvcc
def test_prepare_device_compile_picks_a_compiler(monkeypatch):
    import os

    import tvm_ffi

    monkeypatch.delenv("TVM_CUDA_COMPILE_MODE", raising=False)
    ptx.prepare_device_compile()
    expected = None if ptx.have_nvrtc() else "nvcc"  # NVRTC needs cuda-bindings
    assert os.environ.get("TVM_CUDA_COMPILE_MODE") == expected
    assert tvm_ffi.get_global_func("tvm_callback_cuda_compile", allow_missing=True) is not None
    # and source generation still works without a CUDA runtime
    plan = cc.MaxDNNPlan.make(Conv2dWorkload.make((4, 8, 5, 5), (8, 8, 1, 1)))
    assert "maxdnn_conv2d_kernel" in cc.cuda_source(plan)
