"""The CUDA toolchain helpers (tvm_ext.kernels.cuda.toolchain): CUDA C without a GPU or CUDA
runtime, nvcc's outputs cached by content, the k loop found in PTX and SASS listings, the
device compiler picked."""

from __future__ import annotations

import os
import tempfile
import time

import pytest
from maxdnn_cases import needs_nvcc

from tvm_ext.kernels.conv2d import Conv2dWorkload
from tvm_ext.kernels.cuda import maxdnn as cc
from tvm_ext.kernels.cuda import toolchain


@needs_nvcc
def test_nvcc_outputs_are_cached_by_content(tmp_path, monkeypatch):
    """compile_source and ptxas_resources cache nvcc's outputs by content (the checks compile the
    same kernels many times); a source that does not compile raises every time."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    source = 'extern "C" __global__ void k(float* y) { y[threadIdx.x] = 1.0f; }\n'
    first = toolchain.compile_source(source, "sm_80")
    assert b".entry k" in first and len(list((tmp_path / f"tvm_ext_nvcc_{os.getuid()}").iterdir())) == 1
    start = time.perf_counter()
    assert toolchain.compile_source(source, "sm_80") == first and time.perf_counter() - start < 0.5
    assert toolchain.compile_source(source, "sm_90") != first  # another arch, another entry
    assert toolchain.ptxas_resources(source, "sm_80")["registers"] > 0
    for _ in range(2):
        with pytest.raises(Exception, match="error"):
            toolchain.compile_source(source.replace("1.0f", "undeclared"), "sm_80")
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
    assert toolchain.sass_loop_instructions(sass) == {"FFMA": 1, "LDS": 1, "BRA": 1}
    assert toolchain.sass_loop_instructions("") == {}
    ptx_text = """
$L__BB0_1:
\tfma.rn.f32 \t%f1, %f2, %f3, %f1;
$L__BB0_2:
\tfma.rn.f32 \t%f1, %f2, %f3, %f1;
\tld.shared.v4.f32 \t{%f4, %f5, %f6, %f7}, [%r1];
\t@%p1 bra.uni \t$L__BB0_2;
\t@%p2 bra.uni \t$L__BB0_1;
"""
    assert toolchain.main_loop_instructions(ptx_text) == {"fma.rn.f32": 1, "ld.shared.v4.f32": 1, "bra.uni": 1}


def test_source_generation_survives_the_nvcc_callback():
    """With tvm.support.nvcc imported, tvm.compile for CUDA needs a CUDA runtime; we do not."""
    import tvm.support.nvcc  # noqa: F401

    plan = cc.MaxDNNPlan.make(Conv2dWorkload.make((4, 8, 5, 5), (8, 8, 1, 1)))
    for target in ("cuda -arch=sm_90", "nvidia/nvidia-h100", {"kind": "cuda", "arch": "sm_80"}):
        assert "maxdnn_conv2d_kernel" in cc.cuda_source(plan, target)


@needs_nvcc
def test_prepare_device_compile_picks_a_compiler(monkeypatch):
    import os

    import tvm_ffi

    monkeypatch.delenv("TVM_CUDA_COMPILE_MODE", raising=False)
    toolchain.prepare_device_compile()
    expected = None if toolchain.have_nvrtc() else "nvcc"  # NVRTC needs cuda-bindings
    assert os.environ.get("TVM_CUDA_COMPILE_MODE") == expected
    assert tvm_ffi.get_global_func("tvm_callback_cuda_compile", allow_missing=True) is not None
    # and source generation still works without a CUDA runtime
    plan = cc.MaxDNNPlan.make(Conv2dWorkload.make((4, 8, 5, 5), (8, 8, 1, 1)))
    assert "maxdnn_conv2d_kernel" in cc.cuda_source(plan)
