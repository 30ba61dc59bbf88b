"""bfloat16 convolutions on the BRGEMM microkernel, on AVX512-BF16's `vdpbf16ps`, on AMX tiles
(`tdpbf16ps`) and emulated on FMA (any vector ISA): bf16 data and weights (pairs of input
channels), fp32 products, sums and output. Checked against float64 on the bf16-rounded inputs
(what the instructions multiply exactly)."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
import torch
import tvm
from reference import host_x86_targets, rel_err, tensorized_batch_reduce

from tvm_ext.errors import UnsupportedError
from tvm_ext.intrin.cpu import BRGEMM, brgemm_from_name
from tvm_ext.kernels.conv2d import Conv2dWorkload, Epilogue, conv2d_blocked_kernel, pack_weight_array, plan_conv2d
from tvm_ext.kernels.elementwise import bf16_round_func
from tvm_ext.ops.forward import compile_kernel
from tvm_ext.target import (
    AVX2,
    AVX512,
    CPU_FEATURES_ATTR,
    NEON,
    SSE,
    amx_permitted,
    has_amx_bf16,
    has_avx512_bf16,
    resolve_target,
    vector_isa,
)

TARGET = resolve_target("llvm")
ENGINES = [pytest.param("fma", marks=pytest.mark.skipif(not has_avx512_bf16(TARGET), reason="no AVX512-BF16")),
           pytest.param("amx", marks=pytest.mark.skipif(not (has_amx_bf16(TARGET) and amx_permitted()),
                                                        reason="no AMX-BF16, or the OS does not grant its tiles")),
           "emulated"]  # (on this host's vector ISA)


@pytest.mark.parametrize("engine", ENGINES)
# (m_r, k, batch, stride): AMX's tiles of 16 rows, two of them, a short one, 16 and 64 channels
@pytest.mark.parametrize("m_r, k, batch, stride", [(6, 16, (1, 1, 1), 1), (12, 16, (3, 3, 3), 2),
                                                   (16, 32, (1, 1, 1), 1), (32, 32, (2, 3, 3), 1),
                                                   (24, 64, (1, 3, 3), 2)])
def test_bf16_brgemm_is_correct(engine, m_r, k, batch, stride):
    """The microkernel tensorized into a plain batch-reduce: A (rows x channels) by B in pairs."""
    lanes = vector_isa(TARGET).lanes if engine == "emulated" else 16
    spec = BRGEMM(m_r, 2 * lanes, k, lanes, batch, stride, dtype="bfloat16", engine=engine)
    if engine != "amx" and spec.registers() > vector_isa(TARGET).registers:
        pytest.skip(f"a tile of {m_r} rows does not fit the vector registers")
    m, n = 2 * m_r, spec.n_r
    b0, b1, b2 = batch
    width = (m - 1) * stride + b2
    lib = tensorized_batch_reduce(spec, m, TARGET)
    asm = lib.mod.inspect_source("asm")
    if engine == "amx":  # two C tiles a row of tiles, each a tdpbf16ps a step
        assert asm.count("tdpbf16ps") >= 2 * -(-m_r // 16) and "ldtilecfg" in asm
    elif engine == "fma":
        assert asm.count("vdpbf16ps") >= 2 * m_r and "tdpbf16ps" not in asm
    else:  # two FMAs a pair of channels, no bf16 instruction
        assert asm.count("vfmadd") >= 2 * 2 * m_r and "dpbf16ps" not in asm
    rng = np.random.default_rng(0)
    av = rng.standard_normal((b0, b1, width, k)).astype(ml_dtypes.bfloat16)
    bv = rng.standard_normal((b0, b1, b2, k // 2, n, 2)).astype(ml_dtypes.bfloat16)
    out = tvm.runtime.empty((m, n), "float32")
    lib(tvm.runtime.tensor(av.astype(spec.types.a)), tvm.runtime.tensor(bv), out)
    a64, b64 = av.astype(np.float64), bv.astype(np.float64)
    ref = sum(a64[x0, x1, x2 + stride * np.arange(m)] @ b64[x0, x1, x2].transpose(0, 2, 1).reshape(k, n)
              for x0 in range(b0) for x1 in range(b1) for x2 in range(b2))
    assert rel_err(out.numpy(), ref) <= 1e-6


def _run_conv(x_shape, w_shape, stride, padding, dilation, engine, seed=0, ic_bn=None, target=TARGET):
    wl = Conv2dWorkload.make(x_shape, w_shape, stride, padding, dilation, dtype="bfloat16")
    isa = vector_isa(target) if engine == "emulated" else AVX512
    plan = plan_conv2d(wl, isa, engine=engine, ic_bn=ic_bn)
    assert ic_bn is None or plan.ic_bn == ic_bn
    lib = compile_kernel(conv2d_blocked_kernel(plan, isa.lanes, Epilogue()), target)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal(w_shape).astype(np.float32)
    n, c, h, width = x_shape
    top, left, bottom, right = wl.padding
    padded = np.zeros((n, c, h + top + bottom, width + left + right), ml_dtypes.bfloat16)
    padded[:, :, top:top + h, left:left + width] = x
    blocked = padded.reshape(n, c // plan.ic_bn, plan.ic_bn, *padded.shape[2:]).transpose(0, 1, 3, 4, 2)
    blocked = blocked.astype(plan.data_dtype)  # (emulated: fp32 of the bf16 values)
    out = tvm.runtime.empty(plan.out_shape(), "float32")
    lib(tvm.runtime.tensor(np.ascontiguousarray(blocked)), tvm.runtime.tensor(pack_weight_array(plan, w)), out)
    got = out.numpy().transpose(0, 1, 4, 2, 3).reshape(n, plan.K_pad, wl.OH, wl.OW)[:, :wl.K]
    xt = torch.nn.functional.pad(torch.from_numpy(x.astype(np.float64)), (left, right, top, bottom))
    wt = torch.from_numpy(w.astype(ml_dtypes.bfloat16).astype(np.float64))
    return got, torch.nn.functional.conv2d(xt, wt, None, stride, 0, dilation).numpy()


# ResNet-like, strided, asymmetric padding, dilation, K past the blocks, 6 channels (pairs of a block
# of 6), rows of 56 pixels (AMX: a tile row of 32 and a tail of 24), 7 x 7 pixels of 256 channels
CASES = [((1, 64, 14, 14), (64, 64, 3, 3), 1, 1, 1), ((2, 32, 9, 11), (48, 32, 3, 3), 2, 1, 1),
         ((1, 6, 8, 8), (16, 6, 1, 1), 1, 0, 1), ((1, 64, 10, 10), (40, 64, 3, 3), 1, 2, 2),
         ((3, 16, 7, 9), (32, 16, 5, 5), 1, (2, 1, 2, 3), 1), ((1, 128, 8, 8), (256, 128, 1, 1), 2, 0, 1),
         ((2, 8, 13, 6), (24, 8, 3, 1), (2, 1), (1, 0, 1, 0), (1, 1)), ((1, 4, 31, 31), (16, 4, 7, 7), 2, 3, 1),
         ((1, 64, 56, 56), (64, 64, 3, 3), 1, 1, 1), ((2, 256, 7, 7), (512, 256, 1, 1), 1, 0, 1)]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", CASES, ids=[f"c{i}" for i in range(len(CASES))])
def test_bf16_conv2d_matches_float64_of_bf16_inputs(case, engine):
    got, expected = _run_conv(*case, engine)
    assert rel_err(got, expected) <= 1e-5


@pytest.mark.parametrize("case", [c for c in CASES if c[0][1] % 32 == 0],
                         ids=lambda c: f"{c[0][1]}x{c[0][2]}_{c[1][2]}x{c[1][3]}")
def test_bf16_conv2d_reads_blocks_of_32_channels(case):
    """vdpbf16ps over 16 pairs a block: the blocks an fp32 or bf16 producer writes, which a graph's
    bf16 convolution reads as they are (:meth:`~tvm_ext.strategy.cpu.CpuEmitter._plan`)."""
    if not has_avx512_bf16(TARGET):
        pytest.skip("no AVX512-BF16")
    got, expected = _run_conv(*case, "fma", ic_bn=32)
    assert rel_err(got, expected) <= 1e-5


def test_emulated_bf16_runs_on_every_x86_isa_this_host_has():
    """Emulated bf16 is the same arithmetic on any FMA (or SSE's multiply and add): SSE, AVX2 and
    AVX-512 kernels executed here, where the host has them, on a sample of the cases."""
    targets = host_x86_targets()
    if not targets:
        pytest.skip("not an x86 host (NEON's run under qemu: tests/integration/test_aarch64.py)")
    for isa, target in targets:
        for case in CASES[:4] + CASES[-2:]:
            got, expected = _run_conv(*case, "emulated", target=target)
            assert rel_err(got, expected) <= 1e-5, (isa.name, case)


def test_emulated_bf16_equals_vdpbf16ps_bit_for_bit():
    """Each pair's two products added odd channel first, one rounding each, as the instruction
    does: the emulated kernel's output is vdpbf16ps's, bit for bit (a convolution of 10 channel
    blocks)."""
    if not has_avx512_bf16(TARGET):
        pytest.skip("no AVX512-BF16 to compare with")
    case = ((1, 320, 9, 9), (64, 320, 3, 3), 1, 1, 1)
    native, _ = _run_conv(*case, "fma", seed=5, ic_bn=32)
    emulated, _ = _run_conv(*case, "emulated", seed=5, ic_bn=32)
    assert np.array_equal(native, emulated)


def test_bf16_rounding_kernel_is_astype_to_bfloat16():
    """Round to nearest, ties to even, NaN kept NaN (the carry of a NaN's low bits would make it
    infinite), overflow to infinity, subnormals kept: ml_dtypes' bfloat16, written as float32."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(3 * 5 * 7 * 11) * np.exp(rng.uniform(-87, 87, 3 * 5 * 7 * 11))).astype(np.float32)
    special = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 3.4e38, -3.4e38, 1e-45, 1e-39, 1.00390625,
                        1.01171875], np.float32)
    low_bits = np.array([0x7F800001, 0xFF800001, 0x7FC00000, 0x3F808000, 0x3F818000, 0x7F7FFFFF], np.uint32)
    x[:12], x[12:18] = special, low_bits.view(np.float32)
    out = tvm.runtime.empty((3, 5, 7, 11), "float32")
    compile_kernel(bf16_round_func((3, 5, 7, 11), vector_isa(TARGET).lanes), TARGET)(
        tvm.runtime.tensor(x.reshape(3, 5, 7, 11)), out)
    got = out.numpy().reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(np.isnan(got), np.isnan(expected))
    finite = ~np.isnan(expected)
    assert np.array_equal(got[finite].view(np.uint32), expected[finite].view(np.uint32))


def test_bf16_plans_refuse_what_the_microkernel_does_not_take():
    wl = Conv2dWorkload.make((1, 32, 8, 8), (32, 32, 3, 3), 1, 1, dtype="bfloat16")
    with pytest.raises(ValueError, match="AVX512-BF16 only"):
        plan_conv2d(wl, AVX2)
    with pytest.raises(ValueError, match="2 groups"):
        plan_conv2d(Conv2dWorkload.make((1, 32, 8, 8), (32, 16, 3, 3), 1, 1, groups=2, dtype="bfloat16"), AVX512)
    with pytest.raises(ValueError, match="3 input channels: not groups of 2"):
        plan_conv2d(Conv2dWorkload.make((1, 3, 8, 8), (32, 3, 3, 3), 1, 1, dtype="bfloat16"), AVX512)
    with pytest.raises(ValueError, match="float32, bfloat16 data and weights, or int8"):
        Conv2dWorkload.make((1, 32, 8, 8), (32, 32, 3, 3), dtype="float16")
    with pytest.raises(ValueError, match="groups of 2 channels of k"):
        BRGEMM(4, 16, 7, 16, dtype="bfloat16").validate()
    spec = BRGEMM(4, 32, 16, 16, (2, 3, 3), 2, dtype="bfloat16", init=True)
    assert brgemm_from_name(spec.name) == spec
    amx = BRGEMM(32, 32, 32, 16, (2, 3, 3), 2, dtype="bfloat16", init=True, engine="amx")
    assert amx.name.endswith("_amx") and brgemm_from_name(amx.name) == amx
    with pytest.raises(ValueError, match="AMX takes bfloat16 or int8 tiles"):
        BRGEMM(33, 32, 32, 16, dtype="bfloat16", engine="amx").validate()
    with pytest.raises(ValueError, match="AMX takes bfloat16 or int8 tiles"):
        BRGEMM(16, 16, 32, 16, engine="amx").validate()
    with pytest.raises(ValueError, match="the AMX engine takes bfloat16"):
        plan_conv2d(Conv2dWorkload.make((1, 32, 8, 8), (32, 32, 3, 3), 1, 1), AVX512, engine="amx")
    with pytest.raises(ValueError, match="the emulated engine takes bfloat16"):
        plan_conv2d(Conv2dWorkload.make((1, 32, 8, 8), (32, 32, 3, 3), 1, 1), AVX512, engine="emulated")
    with pytest.raises(ValueError, match="only bfloat16 is emulated"):
        BRGEMM(4, 16, 16, 16, dtype="int8", engine="emulated").validate()
    for isa in (SSE, NEON, AVX2, AVX512):  # any vector ISA, tiles that leave room for a pair widened to two rows
        plan = plan_conv2d(wl, isa, engine="emulated")
        spec = BRGEMM(plan.m_r, plan.tile_n, plan.ic_bn, isa.lanes, (1, 3, 3), dtype="bfloat16", engine="emulated")
        spec.validate(isa)
        assert plan.engine == "emulated" and spec.registers() < isa.registers and brgemm_from_name(spec.name) == spec
    with pytest.raises(ValueError, match="would spill"):
        BRGEMM(14, 32, 16, 16, dtype="bfloat16", engine="emulated").validate(AVX512)  # vdpbf16ps's 14 x 32 tile


def test_a_bf16_kernel_refuses_a_cpu_without_its_instructions():
    """LLVM aborts the whole process on vdpbf16ps (or AMX) for a CPU without it: the build says so first."""
    kernel = conv2d_blocked_kernel(plan_conv2d(Conv2dWorkload.make((1, 32, 8, 8), (32, 32, 3, 3), 1, 1,
                                                                   dtype="bfloat16"), AVX512), 16, Epilogue())
    assert str(kernel.attrs[CPU_FEATURES_ATTR]) == "avx512bf16"
    with pytest.raises(UnsupportedError, match="avx512bf16"):
        compile_kernel(kernel, tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"}))
    fp32 = conv2d_blocked_kernel(plan_conv2d(Conv2dWorkload.make((1, 32, 8, 8), (32, 32, 3, 3), 1, 1), AVX512), 16)
    assert CPU_FEATURES_ATTR not in fp32.attrs
    emulated = conv2d_blocked_kernel(plan_conv2d(Conv2dWorkload.make((1, 32, 8, 8), (32, 32, 3, 3), 1, 1,
                                                                     dtype="bfloat16"), AVX512, engine="emulated"), 16)
    assert CPU_FEATURES_ATTR not in emulated.attrs  # (compiles for any AVX-512 CPU)
    compile_kernel(emulated, tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"}))
    amx = conv2d_blocked_kernel(plan_conv2d(Conv2dWorkload.make((1, 32, 8, 8), (32, 32, 3, 3), 1, 1,
                                                                dtype="bfloat16"), AVX512, engine="amx"), 16)
    with pytest.raises(UnsupportedError, match="amx-bf16"):  # Zen 4: AVX512-BF16, no AMX
        compile_kernel(amx, tvm.target.Target({"kind": "llvm", "mcpu": "znver4"}))


def test_cpu_feature_queries_read_the_target_not_the_host():
    assert has_avx512_bf16({"kind": "llvm", "mcpu": "znver4"}) and not has_amx_bf16({"kind": "llvm", "mcpu": "znver4"})
    assert has_amx_bf16({"kind": "llvm", "mcpu": "sapphirerapids"})
    assert not has_avx512_bf16({"kind": "llvm", "mcpu": "skylake-avx512"})
    assert not has_amx_bf16("cuda -arch=sm_90") and not has_avx512_bf16("cuda -arch=sm_90")


def test_amx_tiles_are_granted_where_the_cpu_and_kernel_have_them():
    """Linux 5.16 and later grant a process AMX's tile data on request (the kernels need it)."""
    import os

    release = tuple(int(v) for v in os.uname().release.split(".")[:2] if v.isdigit())
    if not has_amx_bf16(TARGET) or release < (5, 16):
        pytest.skip("no AMX-BF16 on this CPU, or a kernel before 5.16")
    assert amx_permitted()


@pytest.mark.parametrize("dtype, shape, padding", [
    ("float32", ((1, 64, 14, 14), (64, 64, 1, 1)), 0), ("float32", ((2, 32, 9, 11), (40, 32, 3, 3)), 1),
    pytest.param("bfloat16", ((1, 64, 14, 14), (64, 64, 3, 3)), 1,
                 marks=pytest.mark.skipif(not has_avx512_bf16(TARGET), reason="no AVX512-BF16")),
    ("winograd", ((1, 64, 14, 14), (64, 64, 3, 3)), 1)])
@pytest.mark.parametrize("epilogue", [Epilogue(bias=True, activation="relu"), Epilogue(bias=True, residual=True),
                                      Epilogue(out_pad=(1, 1, 1, 1)),
                                      Epilogue(activation="sigmoid", out_pad=(0, 1, 2, 1))])
def test_a_bf16_output_is_the_fp32_output_rounded(dtype, shape, padding, epilogue):
    """A convolution writing its bf16 readers' input (Epilogue.out_dtype "bfloat16": the BRGEMM
    kernel from fp32 sums in a row, Winograd's output transform) writes the fp32 kernel's output
    rounded to nearest even, bit for bit: its border (zero bits) and channels past K included."""
    from tvm.s_tir import meta_schedule as ms

    from tvm_ext.kernels.winograd import bf16_output_reason, winograd_plan
    from tvm_ext.tuning.space import default_kernel

    if dtype == "winograd" and bf16_output_reason(epilogue):  # (refused: the next test)
        return
    isa = vector_isa(TARGET)
    wl = Conv2dWorkload.make(*shape, 1, padding, dtype="float32" if dtype == "winograd" else dtype)
    plan = winograd_plan(wl, isa) if dtype == "winograd" else plan_conv2d(wl, AVX512 if dtype == "bfloat16" else isa)
    kernels = [default_kernel(plan, dataclasses.replace(epilogue, out_dtype=out), isa)
               for out in ("float32", "bfloat16")]
    rng = np.random.default_rng(4)
    infos = ms.arg_info.ArgInfo.from_prim_func(kernels[0])
    inputs = [tvm.runtime.tensor(rng.standard_normal(tuple(int(e) for e in info.shape)).astype(
        ml_dtypes.bfloat16 if str(info.dtype) == "bfloat16" else np.float32)) for info in infos[:-1]]
    outputs = []
    for kernel, out_dtype in zip(kernels, ("float32", "bfloat16"), strict=True):
        out = tvm.runtime.tensor(np.full(tuple(int(e) for e in infos[-1].shape), 7, np.float32).astype(
            ml_dtypes.bfloat16 if out_dtype == "bfloat16" else np.float32))
        compile_kernel(kernel, TARGET)(*inputs, out)
        outputs.append(out.numpy())
    expected = outputs[0].astype(ml_dtypes.bfloat16)
    assert outputs[1].dtype == ml_dtypes.bfloat16
    assert np.array_equal(outputs[1].view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize("dtype, shape, padding", [
    ("float32", ((1, 64, 14, 14), (64, 64, 1, 1)), 0), ("float32", ((2, 32, 9, 11), (40, 32, 3, 3)), 1),
    pytest.param("bfloat16", ((1, 64, 14, 14), (64, 64, 1, 1)), 0,
                 marks=pytest.mark.skipif(not has_avx512_bf16(TARGET), reason="no AVX512-BF16")),
    ("winograd", ((1, 32, 10, 9), (64, 32, 3, 3)), 1)])
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_a_bf16_residual_is_read_as_its_fp32_value(dtype, shape, padding, out_dtype):
    """A shortcut that a convolution wrote in bf16 for its bf16 readers (Epilogue.residual_dtype)
    is read widened: the kernel's output equals, bit for bit, the fp32-residual kernel's given the
    same values as float32 (the BRGEMM kernel, fp32 or bf16 output; Winograd's output transform)."""
    from tvm.s_tir import meta_schedule as ms

    from tvm_ext.kernels.winograd import winograd_plan
    from tvm_ext.tuning.space import default_kernel

    isa = vector_isa(TARGET)
    wl = Conv2dWorkload.make(*shape, 1, padding, dtype="float32" if dtype == "winograd" else dtype)
    plan = winograd_plan(wl, isa) if dtype == "winograd" else plan_conv2d(wl, AVX512 if dtype == "bfloat16" else isa)
    epilogue = Epilogue(bias=True, residual=True, activation="relu", out_dtype=out_dtype)
    kernels = [default_kernel(plan, dataclasses.replace(epilogue, residual_dtype=r), isa)
               for r in ("float32", "bfloat16")]
    rng = np.random.default_rng(5)
    arrays = []
    for info in ms.arg_info.ArgInfo.from_prim_func(kernels[1])[:-1]:
        value = rng.standard_normal(tuple(int(e) for e in info.shape)).astype(np.float32)
        arrays.append(value.astype(ml_dtypes.bfloat16) if str(info.dtype) == "bfloat16" else value)
    residual = arrays[-1]
    assert residual.dtype == ml_dtypes.bfloat16 and residual.shape == plan.out_shape()
    out_shape, out_type = plan.out_shape(), ml_dtypes.bfloat16 if out_dtype == "bfloat16" else np.float32
    outputs = []
    for kernel, shortcut in zip(kernels, (residual.astype(np.float32), residual), strict=True):
        out = tvm.runtime.tensor(np.full(out_shape, 7, np.float32).astype(out_type))
        compile_kernel(kernel, TARGET)(*(tvm.runtime.tensor(a) for a in (*arrays[:-1], shortcut)), out)
        outputs.append(out.numpy())
    assert np.array_equal(outputs[0].view(np.uint8), outputs[1].view(np.uint8))
    with pytest.raises(ValueError, match="a bfloat16 residual is a blocked residual"):
        Epilogue(residual_dtype="bfloat16")


def test_a_bf16_output_takes_no_gradient_mask_and_no_int8():
    from tvm_ext.kernels.winograd import output_transform_func, winograd_plan

    plan = winograd_plan(Conv2dWorkload.make((1, 64, 14, 14), (64, 64, 3, 3), 1, 1), vector_isa(TARGET))
    with pytest.raises(ValueError, match="no bf16 output after sigmoid"):
        output_transform_func(plan, Epilogue(activation="sigmoid", out_dtype="bfloat16"))
    with pytest.raises(ValueError, match="a bfloat16 output is a blocked forward activation"):
        Epilogue(mask="relu", out_dtype="bfloat16")
    with pytest.raises(ValueError, match="a bfloat16 output is a blocked forward activation"):
        Epilogue(nchw_out=True, out_dtype="bfloat16")
    with pytest.raises(ValueError, match="cannot take"):
        conv2d_blocked_kernel(plan_conv2d(Conv2dWorkload.make((1, 32, 8, 8), (32, 32, 1, 1), dtype="int8"), AVX512),
                              16, Epilogue(out_dtype="bfloat16"))
