"""What the maxDNN kernel's tests share (tests/kernels/cuda): seeded inputs, the float64
reference, a plan run on the CPU emulator, what the tensor cores read, a kernel with a barrier
deleted, and the markers for nvcc and g++."""

from __future__ import annotations

import re

import numpy as np
import pytest
from reference import conv2d_nchw, rel_err

from tvm_ext.kernels.conv2d import Conv2dWorkload
from tvm_ext.kernels.cuda import maxdnn as cc
from tvm_ext.kernels.cuda import toolchain
from tvm_ext.testing import cuda_emulator
from tvm_ext.testing import maxdnn as tm

needs_nvcc = pytest.mark.skipif(not toolchain.have_nvcc(), reason="nvcc is not installed")
needs_gxx = pytest.mark.skipif(not cuda_emulator.have_compiler(), reason="g++ is not installed")


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


def _without_first_loop_barrier(source: str) -> str:
    """The CUDA C with the k loop's first barrier deleted (the loop is flat, over taps, or over the ring)."""
    loop = re.search(r"for \(int (kt2|rs|kr) ", source).start()
    barrier = source.index("__syncthreads();", loop)
    return source[:barrier] + source[barrier + len("__syncthreads();"):]


def _fails(got, ref) -> bool:
    return not np.isfinite(got).all() or rel_err(got, ref) > 1e-4


def _as_read(a: np.ndarray, engine: str) -> np.ndarray:
    """What the tensor cores compute with: tf32 drops the low 13 mantissa bits of the fp32
    register; bf16 is rounded to nearest even when the fragment is packed."""
    bits = np.ascontiguousarray(a, np.float32).view(np.uint32)
    if engine.endswith("tf32"):
        return (bits & np.uint32(0xFFFFE000)).view(np.float32)
    rounded = (bits.astype(np.uint64) + 0x7FFF + ((bits >> 16) & 1)).astype(np.uint32)
    return (rounded & np.uint32(0xFFFF0000)).view(np.float32)


_WL_STATIC = Conv2dWorkload.make((128, 96, 13, 13), (256, 96, 3, 3), padding=1)  # OverFeat L3 shape
