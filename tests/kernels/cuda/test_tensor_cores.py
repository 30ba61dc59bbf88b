"""CUDA: the maxDNN tile on the tensor cores (mma.sync tf32 and bf16; what wgmma shares with it:
padded shared rows, short reductions), checked without a GPU (wgmma itself: test_wgmma.py)."""

from __future__ import annotations

import collections
import dataclasses
import re

import pytest
from maxdnn_cases import _WL_STATIC, _as_read, _inputs, _reference, needs_gxx, needs_nvcc
from reference import rel_err

from tvm_ext.kernels.conv2d import Conv2dWorkload
from tvm_ext.kernels.cuda import maxdnn as cc
from tvm_ext.kernels.cuda import toolchain
from tvm_ext.testing import maxdnn as tm


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


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("engine, warp_rows", [("mma_tf32", 32), ("mma_bf16", 32), ("mma_tf32", 64)])
def test_tensor_core_machine_code(arch, engine, warp_rows):
    tile = dataclasses.replace(cc.choose_tile(256, engine), rows=128 if warp_rows == 64 else 64, warp_rows=warp_rows)
    plan = cc.MaxDNNPlan.make(_WL_STATIC, tile)
    source = cc.cuda_source(plan, {"kind": "cuda", "arch": arch})
    ops_count = toolchain.ptx_instructions(toolchain.compile_source(source, arch).decode())
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
    resources = toolchain.ptxas_resources(source, arch)
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
