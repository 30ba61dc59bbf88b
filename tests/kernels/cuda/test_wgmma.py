"""CUDA: the maxDNN tile on Hopper's asynchronous warpgroup tensor cores (wgmma, tf32 and bf16), without a GPU.

Numbers come from the CPU emulator, which carries out each wgmma when its group is waited for,
reading B from shared memory through the kernel's own descriptor; machine code from nvcc for
sm_90a (PTX, ptxas and SASS).
"""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess

import numpy as np
import pytest
import tvm
from maxdnn_cases import _as_read, _fails, _inputs, _reference, _without_first_loop_barrier
from reference import conv2d_nchw, rel_err
from tvm import relax

import tvm_ext
from tvm_ext.kernels.conv2d import Conv2dWorkload
from tvm_ext.kernels.cuda import maxdnn as cc
from tvm_ext.kernels.cuda import toolchain
from tvm_ext.strategy.cuda_engine import engine_for
from tvm_ext.testing import cuda_emulator
from tvm_ext.testing import maxdnn as tm
from tvm_ext.testing.relax_emulator import dynamic_shared_bytes, emulated_executable, lower

ENGINE = "wgmma_tf32"
BF16 = "wgmma_bf16"
TARGET = "cuda -arch=sm_90a"
needs_nvcc = pytest.mark.skipif(not toolchain.have_nvcc(), reason="nvcc is not installed")
needs_gxx = pytest.mark.skipif(not cuda_emulator.have_compiler(), reason="g++ is not installed")


def unfenced_shared_stores(ptx_text: str) -> int:
    """How many wgmma issues read shared memory stored since the last async-proxy fence. The
    tensor cores read the weights' tile through the async proxy: stores to it must be followed
    by `fence.proxy.async` (before the barrier), or a wgmma may read the tile as it was; the
    H200 gave NaN on 31 of 34 layers without it, the emulator and compute-sanitizer saw nothing."""
    pending, count = False, 0
    for line in ptx_text.splitlines():
        line = line.strip().lstrip("{").strip()
        if line.startswith("st.shared"):
            pending = True
        elif line.startswith("fence.proxy.async"):
            pending = False
        elif "wgmma.mma_async" in line:
            count += pending
            pending = False
    return count


@needs_gxx
@pytest.mark.parametrize("gather", [True, False])  # A fragments from the input, or from a shared tile
@pytest.mark.parametrize("x_shape, w_shape, options, epilogue", [
    ((8, 16, 12, 12), (64, 16, 3, 3), dict(padding=1), cc.Epilogue()),  # N=64, two slabs, tap loop
    ((3, 5, 9, 7), (70, 5, 3, 2), dict(padding=(1, 0, 2, 1), stride=2), cc.Epilogue(bias=True, activation="relu")),
    ((4, 6, 9, 7), (96, 3, 5, 5), dict(padding=2, dilation=2, groups=2), cc.Epilogue(residual=True)),
    ((5, 12, 5, 9), (40, 12, 1, 7), dict(padding=(0, 3)), cc.Epilogue(activation="relu6")),  # N=64 for 40
    ((4, 24, 6, 5), (128, 24, 3, 3), dict(padding=1, stride=2), cc.Epilogue(bias=True)),  # N=128, dynamic
    ((3, 16, 9, 7), (64, 16, 3, 3), dict(padding=(1, 0, 2, 1), dilation=2), cc.Epilogue()),  # batch 3, dilated
    ((4, 32, 6, 6), (32, 16, 3, 3), dict(padding=1, groups=2), cc.Epilogue(activation="relu")),
    ((2, 8, 5, 5), (16, 8, 3, 3), dict(padding=1), cc.Epilogue()),  # N=32, batch 2
])
def test_emulated_wgmma_conv2d(x_shape, w_shape, options, epilogue, gather):
    wl = Conv2dWorkload.make(x_shape, w_shape, **options)
    tile = dataclasses.replace(cc.choose_tile(wl.K // wl.groups, ENGINE), gather_fragments=gather)
    plan = cc.MaxDNNPlan.make(wl, tile, epilogue)
    assert plan.gathers_fragments == (gather and plan.k_order == "rsc")
    x, w, bias, residual = _inputs(wl, epilogue)
    got = cc.output_to_nchw(tm.emulate(plan, cc.kernel_arrays(plan, x, w, bias, residual)))
    ref = _reference(wl, epilogue, _as_read(x, "mma_tf32"), _as_read(w, "mma_tf32"), bias, residual)
    assert rel_err(got, ref) < 1e-5
    assert rel_err(got, _reference(wl, epilogue, x, w, bias, residual)) > 1e-5  # it really is tf32


@needs_gxx
@pytest.mark.parametrize("gather", [True, False])
@pytest.mark.parametrize("x_shape, w_shape, options, epilogue", [
    ((8, 32, 12, 12), (64, 32, 3, 3), dict(padding=1), cc.Epilogue()),  # tap loop, 2 channel steps a tap
    # CRS order (K = 30, padded to 32: 2 k steps of 16)
    ((3, 5, 9, 7), (70, 5, 3, 2), dict(padding=(1, 0, 2, 1), stride=2), cc.Epilogue(bias=True, activation="relu")),
    # 24 channels (not a multiple of 16: CRS), N = 128 with dynamic shared memory
    ((4, 24, 6, 5), (128, 24, 3, 3), dict(padding=1, stride=2), cc.Epilogue(residual=True)),
    ((4, 64, 6, 6), (48, 32, 3, 3), dict(padding=2, dilation=2, groups=2), cc.Epilogue(activation="relu6")),
])
def test_emulated_wgmma_bf16_conv2d(x_shape, w_shape, options, epilogue, gather):
    """bf16 wgmma (m64nNk16): the gathered fragments rounded and packed two to a register, the
    shared tile's likewise, the weights packed as bf16 pairs (:func:`cc.bf16_pairs`)."""
    wl = Conv2dWorkload.make(x_shape, w_shape, **options)
    tile = dataclasses.replace(cc.choose_tile(wl.K // wl.groups, BF16), gather_fragments=gather)
    plan = cc.MaxDNNPlan.make(wl, tile, epilogue)
    assert tile.k_step == 16 and plan.gathers_fragments == (gather and wl.C // wl.groups % 16 == 0)
    got, ref = _emulated(plan)
    assert rel_err(got, ref) < 1e-5
    x, w, bias, residual = _inputs(wl, epilogue)
    assert rel_err(got, _reference(wl, epilogue, x, w, bias, residual)) > 1e-4  # it really is bf16


@needs_gxx
@pytest.mark.parametrize("engine, channels", [(ENGINE, 8), (ENGINE, 16), (ENGINE, 32), (ENGINE, 40),
                                              (BF16, 16), (BF16, 80)])  # 1, 2, 4 and 5 k steps
def test_emulated_wgmma_in_flight_on_short_reductions(engine, channels):
    """Groups in flight, the loop WGMMA_RING steps at a time: slices shorter than the ring (no
    loop), and loops with a remainder of one and two steps."""
    wl = Conv2dWorkload.make((4, channels, 5, 6), (64, channels, 1, 1))
    plan = cc.MaxDNNPlan.make(wl, cc.choose_tile(64, engine), cc.Epilogue(bias=True))
    steps = channels // plan.tile.k_step
    assert plan.wgmma_in_flight and plan.code_steps == (3 if steps >= 3 else 0) + steps % 3
    got, ref = _emulated(plan)
    assert rel_err(got, ref) < 1e-5


@needs_gxx
@pytest.mark.parametrize("engine, channels", [(ENGINE, 16), (BF16, 32)])
def test_emulated_wgmma_split_k(engine, channels):
    wl = Conv2dWorkload.make((4, channels, 6, 6), (64, channels, 3, 3), padding=1)
    plan = cc.MaxDNNPlan.make(wl, cc.choose_tile(64, engine), cc.Epilogue(bias=True, activation="relu"), splits=3)
    got, ref = _emulated(plan)
    assert rel_err(got, ref) < 1e-5


_WL = Conv2dWorkload.make((4, 16, 7, 7), (64, 16, 3, 3), padding=1)
_WL_CRS = Conv2dWorkload.make((4, 4, 7, 7), (64, 4, 3, 3), padding=1)  # 4 channels: the shared A tile


def _emulated(plan: cc.MaxDNNPlan, source: str | None = None):
    """The emulated output and the float64 reference on the inputs as the tensor cores read them."""
    x, w, bias, residual = _inputs(plan.wl, plan.epilogue)
    got = cc.output_to_nchw(tm.emulate(plan, cc.kernel_arrays(plan, x, w, bias, residual), source))
    engine = plan.tile.engine
    return got, _reference(plan.wl, plan.epilogue, _as_read(x, engine), _as_read(w, engine), bias, residual)


def _broken(plan: cc.MaxDNNPlan, source: str) -> bool:
    """Whether the emulator shows `source` wrong: wrong numbers, or an error (a descriptor that
    reads shared memory nobody declared, say)."""
    try:
        return _fails(*_emulated(plan, source))
    except cuda_emulator.EmulationError:
        return True


@needs_gxx
@pytest.mark.parametrize("engine, wl", [(ENGINE, _WL), (ENGINE, _WL_CRS), (BF16, _WL)])
def test_emulator_catches_broken_wgmma_kernels(engine, wl):
    plan = cc.MaxDNNPlan.make(wl, cc.choose_tile(64, engine))
    assert plan.gathers_fragments == (wl is _WL)
    source = cc.cuda_source(plan)
    got, ref = _emulated(plan, source)
    assert rel_err(got, ref) < 1e-5
    for fault in ("wrong_buffer", "no_store"):
        assert _broken(plan, tm.cuda_source(plan, fault=fault))
    # the weights' tile stored without fence.proxy.async (NaN on an H200 in 0.5.12)
    with pytest.raises(cuda_emulator.EmulationError, match="after the last fence.proxy.async"):
        _emulated(plan, tm.cuda_source(plan, fault="no_proxy_fence"))
    assert _broken(plan, _without_first_loop_barrier(source))
    # the descriptor's strides swapped: the tensor cores would read the weights' tile transposed
    encode = re.compile(r"(ptx_wgmma_encode_matrix_descriptor\([^;]*), 8, 16, 0\);")
    assert len(encode.findall(source)) == (1 if plan.wgmma_in_flight else 2)  # the ring: one, moved per slot
    assert _broken(plan, encode.sub(r"\1, 16, 8, 0);", source))
    # accumulators read (and buffers refilled) without waiting for the tensor cores
    wait = "tvm_builtin_ptx_wgmma_wait_group_wait_group_sync_aligned_0();"
    assert wait in source
    with pytest.raises(cuda_emulator.EmulationError, match="never waited"):
        _emulated(plan, source.replace(wait, ""))


@needs_gxx
@pytest.mark.parametrize("engine", [ENGINE, BF16])
def test_emulator_catches_wgmma_races_in_flight(monkeypatch, engine):
    """One group in flight across each barrier (gathered fragments and weights loaded two steps
    ahead): the ring's slot is refilled only after every thread has waited for the group that
    read it. A store before the wait, a ring of two (a slot refilled while the group before last
    may still read it) or a missing barrier are races the emulator reports: the B tile changed
    between a wgmma's issue and its wait."""
    plan = cc.MaxDNNPlan.make(_WL, cc.choose_tile(64, engine))
    assert plan.wgmma_in_flight and cc.WGMMA_RING == 3
    source = cc.cuda_source(plan)
    # per ring slot: the fragments' register set, and the weights' (loaded two steps ahead): a
    # k step's 64 x 8 tf32 or 64 x 16 bf16 (in pairs) is 512 words, 4 a thread
    per_set = plan.tile.weight_words // 128
    assert per_set == 4
    assert f"uint af_ptr[{3 * 4 * plan.tile.slabs}];" in source and f"float a_pre_ptr[{3 * per_set}];" in source
    assert "af_pre" not in source  # gathered straight into the registers the wgmma reads: no copies
    got, ref = _emulated(plan, source)
    assert rel_err(got, ref) < 1e-5
    race = "B tile changed between its issue and its wait"
    wait = "tvm_builtin_ptx_wgmma_wait_group_wait_group_sync_aligned_1();"
    assert source.count(wait) == plan.code_steps
    with pytest.raises(cuda_emulator.EmulationError, match=race):
        _emulated(plan, source.replace(wait, ""))
    with pytest.raises(cuda_emulator.EmulationError, match=race):
        _emulated(plan, _without_first_loop_barrier(source))
    monkeypatch.setattr(cc.Generator, "ring", 2)  # the generator's ring, for this test
    with pytest.raises(cuda_emulator.EmulationError, match=race):
        _emulated(plan, cc.cuda_source(plan))


def test_pack_wgmma_weight_is_the_descriptor_layout():
    """Each (group, block of rows, k step) chunk holds B[n][k] at float (n // 8) 64 + (k // 4) 32 +
    (n % 8) 4 + k % 4: the K-major core matrices of WgmmaShape with LBO 128 and SBO 256 bytes,
    zero past the GEMM's M and K."""
    wl = Conv2dWorkload.make((2, 5, 6, 6), (70, 5, 3, 2), padding=1)
    plan = cc.MaxDNNPlan.make(wl, cc.choose_tile(70, ENGINE))
    rows, m, k = plan.tile.rows, plan.gemm[0], plan.gemm[2]
    wt = np.random.default_rng(0).standard_normal((1, k, m)).astype(np.float32)
    packed = cc.pack_wgmma_weight(wt, plan)
    assert packed.shape == plan.weight_shape == (1, -(-m // rows), -(-k // 8), rows * 8)
    wg = plan.tile.wgmma
    for block in range(packed.shape[1]):
        for step in range(packed.shape[2]):
            for n in range(rows):
                for kk in range(8):
                    at = (n // 8) * wg.sbo // 4 + (kk // 4) * wg.lbo // 4 + (n % 8) * 4 + kk % 4
                    row, col = step * 8 + kk, block * rows + n
                    want = wt[0, row, col] if row < k and col < m else 0.0
                    assert packed[0, block, step, at] == want
    with pytest.raises(ValueError, match="GEMM needs"):
        cc.pack_wgmma_weight(wt[:, :-1], plan)


def test_pack_wgmma_weight_bf16_pairs():
    """bf16: each chunk holds B[n][k] rounded to bf16 (nearest even) at 16-bit word (n // 8) 128 +
    (k // 8) 64 + (n % 8) 8 + k % 8: the same bytes as tf32's layout, 8 values of k in a core
    matrix's row instead of 4, two to a float32 word, the lower k in the low half."""
    wl = Conv2dWorkload.make((2, 5, 6, 6), (70, 5, 3, 2), padding=1)
    plan = cc.MaxDNNPlan.make(wl, cc.choose_tile(70, BF16))
    rows, m, k = plan.tile.rows, plan.gemm[0], plan.gemm[2]
    wt = np.random.default_rng(0).standard_normal((1, k, m)).astype(np.float32)
    packed = cc.pack_wgmma_weight(wt, plan)
    assert packed.dtype == np.float32 and packed.shape == plan.weight_shape == (1, 1, 2, rows * 16 // 2)
    halves = packed.view(np.uint16)
    want_bits = (_as_read(wt, "mma_bf16").view(np.uint32) >> 16).astype(np.uint16)
    for step in range(2):
        for n in range(rows):
            for kk in range(16):
                at = (n // 8) * 128 + (kk // 8) * 64 + (n % 8) * 8 + kk % 8
                row, col = step * 16 + kk, n
                assert halves[0, 0, step, at] == (want_bits[0, row, col] if row < k and col < m else 0)
    with pytest.raises(ValueError, match="not pairs"):
        cc.bf16_pairs(np.ones((3, 5), np.float32))


@needs_gxx
def test_bf16_pairs_kernel_packs_as_numpy():
    """The graph's packing of bf16 weight pairs (weights that are inputs) gives NumPy's bits
    (constant weights), ties to even included: the same weights whichever way they arrive."""
    from tvm_ext.kernels.cuda import memory_bound
    from tvm_ext.kernels.cuda.toolchain import generate_source

    x = np.random.default_rng(3).standard_normal((3, 10)).astype(np.float32)
    # halfway cases: bit 16 even (rounds down), odd (up), negative, and one that rounds to inf
    x.view(np.uint32)[0, :4] = [0x3F808000, 0x3F818000, 0xBF818000, 0x7F7F8000]
    x.view(np.uint32)[1, :2] = [0x7F800001, 0xFFC00000]  # NaNs (one that rounding would make inf)
    source = generate_source(tvm.IRModule({"main": memory_bound.bf16_pairs_func(x.shape)}),
                             tvm_ext.resolve_target(TARGET))
    out = np.full((3, 5), np.nan, np.float32)
    cuda_emulator.run_kernel(source, "main_kernel", (1, 1, 1), (memory_bound.THREADS, 1, 1), {"data": x, "output": out})
    want = cc.bf16_pairs(x)
    assert want.view(np.uint32)[0, :2].tolist() == [0x3F823F80, 0x7F80BF82]  # (0x7F80: inf)
    assert want.view(np.uint32)[1, 0] == 0x7FFF7FFF  # CUDA's NaN
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="not pairs"):
        memory_bound.bf16_pairs_func((3, 5))


def test_wgmma_tile_validation_and_choice():
    assert cc.BlockTile(rows=64, cols=128, engine=ENGINE).threads == 128  # one warpgroup
    # the fewest wasted rows, the tallest of equals; two slabs
    assert [(t.rows, t.cols) for t in (cc.choose_tile(c, ENGINE) for c in (16, 64, 70, 96, 384))] == [
        (32, 128), (64, 128), (96, 128), (96, 128), (128, 128)]
    with pytest.raises(ValueError, match="multiple of 8 up to 256"):
        cc.BlockTile(rows=36, cols=64, engine=ENGINE).validate()
    with pytest.raises(ValueError, match="multiple of 8 up to 256"):
        cc.BlockTile(rows=64, cols=96, engine=ENGINE).validate()
    with pytest.raises(ValueError, match="shared memory; a block has at most"):
        cc.BlockTile(rows=256, cols=256, engine=ENGINE).validate()
    cc.BlockTile(rows=256, cols=64, engine=ENGINE).validate()  # N = 256: 128 accumulators a thread
    with pytest.raises(ValueError, match="more than 128 accumulators"):
        cc.BlockTile(rows=256, cols=128, engine=ENGINE).validate()


def test_wgmma_split_k_counts_threads():
    """A wgmma block is 128 threads with a 128 x 128 tile: half the blocks of 64 threads fill a
    GPU. AlexNet conv4 at batch 128 (338 blocks) needs no split; ResNet-50's last 3x3 at batch
    32 (52 blocks) splits its 9 taps."""
    conv4 = cc.MaxDNNPlan.make(Conv2dWorkload.make((128, 384, 13, 13), (256, 384, 3, 3), padding=1),
                               cc.choose_tile(256, ENGINE))
    assert math.prod(conv4.grid) == 338 and cc.choose_splits(conv4) == 1
    late = cc.MaxDNNPlan.make(Conv2dWorkload.make((32, 512, 7, 7), (512, 512, 3, 3), padding=1),
                              cc.choose_tile(512, ENGINE))
    assert math.prod(late.grid) == 52 and cc.choose_splits(late) == 9


@needs_gxx
def test_dynamic_shared_memory():
    """A tile past the 48 KB a kernel declares statically: its output tile in dynamic shared
    memory, its operand tiles static. TVM launches it with the plan's size (what the GPU check
    passes), and the emulator gives each block that much; a launch without it is an error."""
    wl = Conv2dWorkload.make((4, 16, 6, 5), (128, 16, 3, 3), padding=1)
    sizes = {rows: cc.MaxDNNPlan.make(wl, cc.choose_tile(rows, ENGINE)).dynamic_shared_bytes
             for rows in (32, 64, 70, 128)}
    assert sizes == {32: 0, 64: 0, 70: 4 * 96 * 128, 128: 4 * 128 * 128}  # static below 48 KB
    plan = cc.MaxDNNPlan.make(wl, cc.choose_tile(128, ENGINE))
    assert plan.operand_tiles == {"A": 128 * 8}  # gathered fragments: only the weights' tile
    source = cc.cuda_source(plan, TARGET)
    assert len(re.findall(r"extern __shared__", source)) == 1
    assert toolchain.ptxas_resources(source, "sm_90a")["shared"] == cc.WGMMA_RING * 4 * 128 * 8  # the weights' ring
    with toolchain.cuda_source_only():
        host = tvm.compile(cc.plan_module(plan), target=tvm_ext.resolve_target(TARGET)).mod.inspect_source("ll")
    assert f"store i64 {plan.dynamic_shared_bytes}," in host  # the launch's dynamic shared memory
    assert dynamic_shared_bytes(cc.maxdnn_conv2d_func(plan)) == plan.dynamic_shared_bytes
    x, w, bias, residual = _inputs(wl, plan.epilogue)
    arrays = cc.kernel_arrays(plan, x, w, bias, residual)
    with pytest.raises(cuda_emulator.EmulationError, match="dynamic shared memory and is launched with none"):
        cuda_emulator.run_kernel(source, cc.KERNEL_NAME + "_kernel", plan.grid, (plan.tile.threads, 1, 1),
                                 {cc.FLAT_PARAMS[name]: arrays[name] for name in plan.shapes()})
    got, ref = _emulated(plan, source)
    assert rel_err(got, ref) < 1e-5


def test_engine_needs_sm_90a():
    for engine in (ENGINE, BF16):
        assert engine_for(engine, tvm_ext.resolve_target(TARGET)) == engine
        assert engine_for(engine, tvm_ext.resolve_target("nvidia/nvidia-h100")) == engine
        for target in ("cuda -arch=sm_90", "cuda -arch=sm_80"):
            with pytest.raises(tvm_ext.UnsupportedError, match="sm_90a only"):
                engine_for(engine, tvm_ext.resolve_target(target))
    with pytest.raises(ValueError, match="'wgmma_bf16'"):
        engine_for("wgmma_fp16")
    with pytest.raises(tvm_ext.UnsupportedError, match="sm_90a only"):
        tvm_ext.pipeline("cuda -arch=sm_80", tensor_cores="wgmma_tf32")


@needs_nvcc
@pytest.mark.parametrize("engine", [ENGINE, BF16])
@pytest.mark.parametrize("gather", [True, False])
def test_wgmma_machine_code(gather, engine):
    """sm_90a: one wgmma per slab and k step in PTX, HGMMA in the SASS k loop between the fence
    and the wait, the weights' tile stored while it runs; no spills, no ptxas warning, and no
    serialized wgmma: ptxas says so only in an info line (C7513 and kin), and then waits for
    every group right after issuing it (0.5.8's gathered kernel: a copy into the registers of
    the next step's wgmma while a group was in flight). bf16 packs its fragments with one F2FP a
    register."""
    wl = Conv2dWorkload.make((128, 256, 13, 13), (384, 256, 3, 3), padding=1)  # AlexNet conv3, b128
    tile = dataclasses.replace(cc.choose_tile(384, engine), gather_fragments=gather)
    plan = cc.MaxDNNPlan.make(wl, tile)
    t = plan.tile
    assert (t.rows, t.cols, plan.tap_loop, plan.gathers_fragments) == (128, 128, True, gather)
    source = cc.cuda_source(plan, TARGET)
    ptx_text = toolchain.compile_source(source, "sm_90a").decode()
    ops_count = toolchain.ptx_instructions(ptx_text)
    assert ops_count[t.wgmma.opcode(t.rows)] == t.slabs * plan.code_steps
    assert unfenced_shared_stores(ptx_text) == 0
    for op in ("wgmma.fence.sync.aligned", "wgmma.commit_group.sync.aligned"):
        assert ops_count[op] == plan.code_steps
    # a group a step (waited for a step later where they stay in flight, and once more at the end)
    assert ops_count["wgmma.wait_group.sync.aligned"] == plan.code_steps + plan.wgmma_in_flight
    assert ops_count["ld.global.nc.v4.f32"] > 0 and ops_count["st.shared.v4.f32"] > 0
    # gathered fragments: 4 scalar loads a slab and step (bf16: 8, rounded and packed), and no
    # shared loads at all
    per = t.wgmma.per_reg
    scalar = "ld.global.nc.u32" if per == 1 else "ld.global.nc.f32"
    assert (ops_count[scalar] > 0) == gather
    assert (ops_count["ld.shared.u32" if per == 1 else "ld.shared.f32"] == 0) == gather
    resources = toolchain.ptxas_resources(source, "sm_90a")
    assert resources["spill_stores"] == resources["spill_loads"] == resources["stack"] == 0
    assert resources["serialized_wgmma"] == 0
    if toolchain.find_nvdisasm() is not None:
        sass = toolchain.disassemble(toolchain.compile_source(source, "sm_90a", "cubin"))
        loop = toolchain.sass_loop_instructions(sass)
        steps = cc.WGMMA_RING if plan.wgmma_in_flight else 2  # a loop iteration: the ring's slots, or a pair
        assert loop["HGMMA"] == steps * t.slabs and loop["BAR"] == steps
        assert loop["LDS"] == (0 if gather else steps * 4 * t.slabs * per)
        assert loop["F2FP"] == (0 if per == 1 else steps * 4 * t.slabs)  # bf16: a pack a register
        # float4 stores of the weights' 4 KB (and of the data's 4 KB, bf16 8 KB: fp32 values) a step
        stores = t.weight_words + (0 if gather else t.k_step * t.cols)
        assert loop["STS"] == steps * stores // 4 // t.threads
        # in flight: each step waits for the group before its own, not for its own
        assert sass.count("DEPBAR.LE gsb0, 0x1") == (plan.code_steps if plan.wgmma_in_flight else 0)
    with_warnings = subprocess.run(["nvcc", "-cubin", "-arch=sm_90a", "-O3", "-x", "cu", "-", "-o", "/dev/null",
                                    "-diag-suppress", "177"], input=source, capture_output=True, text=True)
    assert with_warnings.returncode == 0 and "warning" not in with_warnings.stderr.lower()


@needs_nvcc
@pytest.mark.parametrize("engine", [ENGINE, BF16])
@pytest.mark.parametrize("x_shape, w_shape, splits", [
    ((32, 128, 28, 28), (512, 128, 1, 1), 1),  # ResNet-50 stage 3 at batch 32: no tap entry in the loop
    ((32, 512, 28, 28), (128, 512, 1, 1), 4),  # split-K by channel steps
    ((32, 256, 14, 14), (256, 256, 3, 3), 9),  # a tap a slice
])
def test_wgmma_in_flight_is_not_serialized(x_shape, w_shape, splits, engine):
    """ptxas keeps one group in flight on 1x1 layers too: nvcc 13.0 serialized them while a
    gathered load was conditional (a zeroing move and a predicated load after the wait) and the
    gather had no tap entry to keep it apart from the wait; the loads are now unconditional
    (dead columns read a safe address) and masked."""
    wl = Conv2dWorkload.make(x_shape, w_shape, padding=w_shape[2] // 2)
    plan = cc.MaxDNNPlan.make(wl, cc.choose_tile(wl.K, engine), splits=splits)
    assert plan.wgmma_in_flight
    source = cc.cuda_source(plan, TARGET)
    resources = toolchain.ptxas_resources(source, "sm_90a")
    assert resources["serialized_wgmma"] == 0 and resources["spill_stores"] == 0, resources
    assert unfenced_shared_stores(toolchain.compile_source(source, "sm_90a").decode()) == 0


@needs_gxx
@pytest.mark.parametrize("engine, channels", [(ENGINE, 8), (ENGINE, 3), (BF16, 16)])  # RSC (gathered), CRS
def test_network_on_wgmma_with_weights_as_inputs(engine, channels):
    """tensor_cores="wgmma_tf32" or "wgmma_bf16" through the graph strategy: constant weights
    packed in NumPy, a weight that is a function parameter packed by graph ops (for bf16, its
    pairs by a kernel of their own); the report names the engine."""
    rng = np.random.default_rng(5)
    k = (rng.standard_normal((24, 40, 1, 1)) * 0.3).astype(np.float32)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, channels, 7, 6), "float32"))
    w = relax.Var("w", relax.TensorType((40, channels, 3, 3), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.relu(relax.op.nn.conv2d(x, w, padding=1)))
            out = bb.emit_output(bb.emit(relax.op.nn.conv2d(y, relax.const(k))))
        bb.emit_func_output(out)
    mod = bb.get()
    report = [row for row in tvm_ext.dispatch_report(mod, TARGET, tensor_cores=engine)
              if row.op == "nn.conv2d"]
    assert len(report) == 2 and all(f"{engine} tile" in row.reason for row in report)
    gathered = channels % cc.WGMMA_SHAPES[engine].k == 0  # RSC order: the first layer's fragments come from the input
    assert ("A fragments gathered from the input" in report[0].reason) == gathered
    assert ("A fragments through shared memory" in report[0].reason) == (not gathered)
    lowered = lower(mod, TARGET, tensor_cores=engine)
    vm = relax.VirtualMachine(emulated_executable(lowered, TARGET), tvm.cpu())
    xv = rng.standard_normal((4, channels, 7, 6)).astype(np.float32)
    wv = rng.standard_normal((40, channels, 3, 3)).astype(np.float32)
    got = vm["main"](tvm.runtime.tensor(xv), tvm.runtime.tensor(wv)).numpy()
    ref = conv2d_nchw(np.maximum(conv2d_nchw(xv, wv, padding=(1, 1, 1, 1)), 0), k)
    assert 1e-6 < rel_err(got, ref) < 1e-2


needs_hopper = pytest.mark.skipif(not tvm.cuda(0).exist or tvm.cuda(0).compute_version != "9.0",
                                  reason="no Hopper GPU")


@pytest.mark.gpu
@needs_hopper
def test_wgmma_on_the_gpu():
    wl = Conv2dWorkload.make((8, 16, 12, 12), (64, 16, 3, 3), padding=1)
    plan = cc.MaxDNNPlan.make(wl, cc.choose_tile(64, ENGINE), cc.Epilogue(bias=True, activation="relu"))
    x, w, bias, _ = _inputs(wl, plan.epilogue)
    arrays = cc.kernel_arrays(plan, x, w, bias)
    lib = toolchain.build_for_device(cc.plan_module(plan), tvm_ext.resolve_target(TARGET))
    dev = tvm.cuda()
    args = {name: tvm.runtime.tensor(arrays[name], dev) for name in plan.shapes()}
    lib["main"](*args.values())
    got = cc.output_to_nchw(args["y"].numpy())
    ref = _reference(wl, plan.epilogue, _as_read(x, "mma_tf32"), _as_read(w, "mma_tf32"), bias, None)
    assert rel_err(got, ref) < 1e-5


@needs_nvcc
def test_a_whole_network_builds_for_hopper():
    """ResNet-18 at batch 8 through `tvm_ext.build(..., "nvidia/nvidia-h100", tensor_cores=
    "wgmma_tf32")`: every convolution a wgmma tile, and all of its CUDA C compiles for sm_90a
    with no spills."""
    from tvm_ext import models

    mod = models.get("resnet18", batch=8)[0]
    convs = [row for row in tvm_ext.dispatch_report(mod, "nvidia/nvidia-h100", tensor_cores="wgmma_tf32")
             if row.op == "nn.conv2d"]
    assert convs and all("wgmma_tf32 tile" in row.reason for row in convs)
    ex = tvm_ext.build(mod, "nvidia/nvidia-h100", tensor_cores="wgmma_tf32")
    source = toolchain.executable_cuda_source(ex)
    assert "wgmma.mma_async.sync.aligned.m64n" in source
    resources = toolchain.ptxas_resources(source, "sm_90a")
    assert resources["spill_stores"] == resources["spill_loads"] == resources["stack"] == 0
