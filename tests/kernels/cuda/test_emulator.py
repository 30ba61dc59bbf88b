"""The CPU emulator of CUDA kernels (tvm_ext.testing.cuda_emulator): deliberately broken kernels
fail the same check as the working ones pass; barriers, shared memory, launches and arguments
are checked as a GPU would (or more strictly)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from maxdnn_cases import _emulated, _fails, _without_first_loop_barrier, needs_gxx

from tvm_ext.kernels.conv2d import Conv2dWorkload
from tvm_ext.kernels.cuda import maxdnn as cc
from tvm_ext.kernels.cuda import toolchain
from tvm_ext.testing import cuda_emulator
from tvm_ext.testing import maxdnn as tm

# -- deliberately broken kernels must fail the same check ------------------------------------

_WL_FAULT = Conv2dWorkload.make((8, 16, 6, 6), (64, 16, 3, 3), padding=1)  # 18 k steps: the loop runs


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
def test_emulator_catches_broken_tensor_core_kernels():
    plan = cc.MaxDNNPlan.make(_WL_FAULT, cc.BlockTile(engine="mma_tf32"))
    got, ref = _emulated(plan, tm.cuda_source(plan, fault="wrong_buffer"))
    assert _fails(got, ref)
    got, ref = _emulated(plan, _without_first_loop_barrier(cc.cuda_source(plan)))
    assert _fails(got, ref)


# -- the emulator itself -----------------------------------------------------------------------

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
        toolchain.kernel_params(source, "k")
    with pytest.raises(cuda_emulator.EmulationError, match="not a pointer"):
        cuda_emulator.run_kernel(source, "k", (1, 1, 1), (1, 1, 1), {"y": np.zeros(1, np.float32)})
    source = 'extern "C" __global__ void k(float* __restrict__ y_ptr) {}'
    assert toolchain.kernel_params(source, "k") == [("float", "y_ptr")] and toolchain.kernel_names(source) == ["k"]
    with pytest.raises(ValueError, match="no kernel named"):
        toolchain.kernel_params(source, "other")
    with pytest.raises(cuda_emulator.EmulationError, match="no __global__ kernel"):
        cuda_emulator.compile_source("__device__ float f(float x) { return x; }")
    with pytest.raises(cuda_emulator.EmulationError, match="no array"):
        cuda_emulator.run_kernel(source, "k", (1, 1, 1), (1, 1, 1), {})
    with pytest.raises(cuda_emulator.EmulationError, match="C-contiguous float"):
        cuda_emulator.run_kernel(source, "k", (1, 1, 1), (1, 1, 1), {"y": np.zeros(2)})


def test_emulator_refuses_unknown_inline_ptx():
    source = """
extern "C" __global__ void k(float* __restrict__ y_ptr) {
  __asm__ __volatile__("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" "{%0}" : "=f"(y_ptr[0]) : );
}
"""
    with pytest.raises(cuda_emulator.EmulationError, match="no mma"):
        cuda_emulator.run_kernel(source, "k", (1, 1, 1), (32, 1, 1), {"y": np.zeros(1, np.float32)})
