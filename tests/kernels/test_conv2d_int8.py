"""int8 convolutions on the BRGEMM microkernel, on VNNI's `vpdpbusd` (zmm and AVX-VNNI's ymm) and on
AMX tiles (`tdpbusd`): uint8 data, int8 weights in groups of 4 input channels, int32 sums, then the
quantizing epilogue. Checked bit for bit against NumPy doing the same arithmetic: the int32 sums
(exact), + bias, times the channel's scale in float32, the activation, times out_scale, rounded to
nearest with ties to even (np.rint), + the zero point, saturated."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from reference import tensorized_batch_reduce

from tvm_ext.errors import UnsupportedError
from tvm_ext.intrin.cpu import BRGEMM, brgemm_from_name
from tvm_ext.kernels.conv2d import (
    QUANTIZED_RANGES,
    Conv2dWorkload,
    Epilogue,
    conv2d_blocked_kernel,
    pack_weight_array,
    plan_conv2d,
)
from tvm_ext.ops.forward import compile_kernel
from tvm_ext.target import (
    AVX2,
    AVX512,
    CPU_FEATURES_ATTR,
    SSE,
    amx_permitted,
    has_amx_int8,
    has_vnni,
    resolve_target,
)

TARGET = resolve_target("llvm")
# (engine, ISA of the plan): zmm vpdpbusd, ymm vpdpbusd (AVX-VNNI), AMX tiles
ENGINES = [pytest.param(("fma", AVX512), id="vnni512", marks=pytest.mark.skipif(
               not has_vnni(TARGET, 16), reason="no AVX512-VNNI")),
           pytest.param(("fma", AVX2), id="avxvnni", marks=pytest.mark.skipif(
               not has_vnni(TARGET, 8), reason="no AVX-VNNI")),
           pytest.param(("amx", AVX512), id="amx", marks=pytest.mark.skipif(
               not (has_amx_int8(TARGET) and amx_permitted()),
               reason="no AMX-INT8, or the OS does not grant its tiles"))]


@pytest.mark.parametrize("engine", ENGINES)
# (m_r, k, batch, stride): AMX's tiles of 16 rows, two of them, a short one; 16 to 128 channels
@pytest.mark.parametrize("m_r, k, batch, stride", [(6, 16, (1, 1, 1), 1), (12, 32, (3, 3, 3), 2),
                                                   (16, 64, (1, 1, 1), 1), (32, 128, (2, 3, 3), 1),
                                                   (24, 32, (1, 3, 3), 2)])
def test_int8_brgemm_is_exact(engine, m_r, k, batch, stride):
    """The microkernel tensorized into a plain batch-reduce: A (rows x uint8 channels) by B in groups of 4."""
    engine, isa = engine
    if engine == "fma" and m_r * 2 + 3 > isa.registers:
        pytest.skip(f"a tile of {m_r} rows does not fit {isa.name}'s registers")
    m, n = 2 * m_r, 2 * 16 if engine == "amx" else 2 * isa.lanes
    b0, b1, b2 = batch
    width = (m - 1) * stride + b2
    lanes = 16 if engine == "amx" else isa.lanes
    lib = tensorized_batch_reduce(BRGEMM(m_r, n, k, lanes, batch, stride, dtype="int8", engine=engine), m, TARGET)
    asm = lib.mod.inspect_source("asm")
    if engine == "amx":
        assert asm.count("tdpbusd") >= 2 * -(-m_r // 16) and "ldtilecfg" in asm
    else:
        register = "zmm" if lanes == 16 else "ymm"
        assert asm.count("vpdpbusd") >= 2 * m_r and f"vpdpbusd\t%{register}" in asm.replace("{vex} ", "")
    rng = np.random.default_rng(0)
    av = rng.integers(0, 256, (b0, b1, width, k)).astype(np.uint8)
    bv = rng.integers(-128, 128, (b0, b1, b2, k // 4, n, 4)).astype(np.int8)
    out = tvm.runtime.empty((m, n), "int32")
    lib(tvm.runtime.tensor(av), tvm.runtime.tensor(bv), out)
    a64, b64 = av.astype(np.int64), bv.astype(np.int64)
    ref = sum(a64[x0, x1, x2 + stride * np.arange(m)] @ b64[x0, x1, x2].transpose(0, 2, 1).reshape(k, n)
              for x0 in range(b0) for x1 in range(b1) for x2 in range(b2))
    np.testing.assert_array_equal(out.numpy(), ref)


def requantize_reference(sums: np.ndarray, bias: np.ndarray | None, scale: np.ndarray,
                         epilogue: Epilogue) -> np.ndarray:
    """The quantizing epilogue's arithmetic in NumPy (:func:`tvm_ext.kernels.conv2d.quantized_value`)."""
    sums = sums + (0 if bias is None else bias[None, :, None, None])
    value = sums.astype(np.float32) * scale[None, :, None, None]
    if epilogue.activation == "relu":
        value = np.maximum(value, np.float32(0))
    if not epilogue.quantized:
        return value
    if epilogue.out_scale != 1.0:
        value = value * np.float32(epilogue.out_scale)
    low, high = QUANTIZED_RANGES[epilogue.out_dtype]
    quantized = np.clip(np.rint(value) + np.float32(epilogue.zero_point), low, high)
    if epilogue.units:  # q - zero point, as float32
        return (quantized - np.float32(epilogue.zero_point)).astype(np.float32)
    return quantized.astype(epilogue.out_dtype)


def run_int8_conv(x_shape, w_shape, stride, padding, dilation, engine, isa, epilogue: Epilogue, x_zero: int,
                  seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the kernel's output, NumPy's, the kernel's whole blocked output with its border) for random
    uint8 data with zero point `x_zero` (the padding holds it), int8 weights, an int32 bias folding
    in the zero point's share of the sums."""
    wl = Conv2dWorkload.make(x_shape, w_shape, stride, padding, dilation, dtype="int8")
    plan = plan_conv2d(wl, isa, engine=engine)
    lib = compile_kernel(conv2d_blocked_kernel(plan, isa.lanes, epilogue), TARGET)
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, x_shape).astype(np.uint8)
    w = rng.integers(-128, 128, w_shape).astype(np.int8)
    # sum (x - zx) w = sum x w - zx sum w: the zero point's share goes into the bias
    bias = rng.integers(-20000, 20000, wl.K) - x_zero * w.astype(np.int64).sum(axis=(1, 2, 3))
    # scales that spread the outputs over the 8-bit range and past it (saturation)
    scale = (rng.random(wl.K) * 2.0 / (255 * 128 * np.sqrt(wl.C * wl.KH * wl.KW))).astype(np.float32)
    n, c, h, width = x_shape
    top, left, bottom, right = wl.padding
    padded = np.full((n, c, h + top + bottom, width + left + right), x_zero, np.uint8)
    padded[:, :, top:top + h, left:left + width] = x
    blocked = padded.reshape(n, c // plan.ic_bn, plan.ic_bn, *padded.shape[2:]).transpose(0, 1, 3, 4, 2)

    def per_channel(values, dtype):
        out = np.zeros(plan.K_pad, dtype)
        out[:wl.K] = values
        return tvm.runtime.tensor(out.reshape(plan.OCB, plan.oc_bn))

    args = [tvm.runtime.tensor(np.ascontiguousarray(blocked)), tvm.runtime.tensor(pack_weight_array(plan, w)),
            *([per_channel(bias, np.int32)] if epilogue.bias else []), per_channel(scale, np.float32)]
    out = tvm.runtime.empty(epilogue.out_shape(plan), epilogue.buffer_dtype)
    lib(*args, out)
    whole = out.numpy()
    top_out, left_out = epilogue.out_pad[:2]
    got = whole[:, :, top_out:top_out + wl.OH, left_out:left_out + wl.OW]
    got = got.transpose(0, 1, 4, 2, 3).reshape(n, plan.K_pad, wl.OH, wl.OW)[:, :wl.K]
    sums = torch.nn.functional.conv2d(torch.from_numpy(padded.astype(np.float64)),
                                      torch.from_numpy(w.astype(np.float64)), None, stride, 0, dilation)
    sums = sums.numpy().round().astype(np.int64)  # exact: the sums are far below 2**53
    expected = requantize_reference(sums, bias if epilogue.bias else None, scale, epilogue)
    return got, expected, whole


def _random_case(rng: np.random.Generator):
    """A random convolution and epilogue: channels in groups of 4, any stride, padding, dilation."""
    c = 4 * int(rng.integers(1, 25))
    kh, kw = (int(v) for v in rng.integers(1, 6, 2))
    dh, dw = (int(v) for v in rng.choice([1, 1, 2], 2))
    padding = tuple(int(v) for v in rng.integers(0, 3, 4))
    h = int(rng.integers(max(1, (kh - 1) * dh + 1 - padding[0] - padding[2]), 20))
    w = int(rng.integers(max(1, (kw - 1) * dw + 1 - padding[1] - padding[3]), 20))
    out_dtype = str(rng.choice(["uint8", "int8", "float32"]))
    low, high = QUANTIZED_RANGES.get(out_dtype, (0, 0))
    epilogue = Epilogue(bias=bool(rng.integers(0, 4)), activation=[None, "relu"][int(rng.integers(0, 2))],
                        out_dtype=out_dtype,
                        zero_point=int(rng.integers(low, high + 1)), out_scale=float(rng.choice([1.0, 0.75])),
                        out_pad=tuple(int(v) for v in rng.integers(0, 2, 4)) if out_dtype != "float32" else (0,) * 4,
                        units=out_dtype != "float32" and rng.integers(0, 3) == 0)  # (a depthwise reader's input)
    stride = tuple(int(v) for v in rng.integers(1, 4, 2))
    return ((int(rng.integers(1, 4)), c, h, w), (int(rng.integers(1, 80)), c, kh, kw), stride, padding, (dh, dw),
            epilogue, int(rng.integers(0, 256)))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("chunk", range(4))
def test_int8_conv2d_is_bit_exact_over_random_configurations(engine, chunk):
    """70 random convolutions and epilogues per engine (4 chunks x 70 / 4; 210 over the three engines)."""
    engine, isa = engine
    rng = np.random.default_rng(1000 * chunk + {"fma": 0, "amx": 7}[engine] + isa.lanes)
    for case in range(70 // 4 + (chunk < 70 % 4)):
        x_shape, w_shape, stride, padding, dilation, epilogue, x_zero = _random_case(rng)
        got, expected, whole = run_int8_conv(x_shape, w_shape, stride, padding, dilation, engine, isa, epilogue,
                                             x_zero, seed=case)
        where = f"case {case}: {x_shape} {w_shape} stride {stride} padding {padding} dilation {dilation} {epilogue}"
        np.testing.assert_array_equal(got, expected, err_msg=where)
        if epilogue.quantized:  # the border (the next convolution's padding) holds the zero point
            border = np.ones(whole.shape, bool)
            top, left = epilogue.out_pad[:2]
            border[:, :, top:top + got.shape[2], left:left + got.shape[3]] = False
            assert (whole[border] == (0 if epilogue.units else epilogue.zero_point)).all(), where


# ResNet-50's shapes: a 3x3 of 64 channels (AMX: a tile row of 32 and a tail of 24), a strided 1x1
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", [((1, 64, 56, 56), (64, 64, 3, 3), 1, 1, 1),
                                  ((1, 256, 14, 14), (512, 256, 1, 1), 2, 0, 1)],
                         ids=["3x3", "1x1s2"])
def test_int8_conv2d_on_network_shapes(engine, case):
    engine, isa = engine
    got, expected, _ = run_int8_conv(*case, engine, isa, Epilogue(bias=True, activation="relu", out_dtype="uint8",
                                                                   zero_point=0), x_zero=12)
    np.testing.assert_array_equal(got, expected)
    assert 0 < (got > 0).mean() < 1  # neither all zero nor all saturated


def test_int8_plans_and_epilogues_refuse_what_they_do_not_take():
    with pytest.raises(ValueError, match="6 input channels: not groups of 4"):
        plan_conv2d(Conv2dWorkload.make((1, 6, 8, 8), (32, 6, 3, 3), 1, 1, dtype="int8"), AVX512)
    with pytest.raises(ValueError, match="no int8 dot product"):
        plan_conv2d(Conv2dWorkload.make((1, 32, 8, 8), (32, 32, 3, 3), 1, 1, dtype="int8"), SSE)
    with pytest.raises(ValueError, match="zero_point 300 is outside uint8"):
        Epilogue(out_dtype="uint8", zero_point=300)
    with pytest.raises(ValueError, match="bias and an activation only"):
        Epilogue(out_dtype="int8", residual=True)
    with pytest.raises(ValueError, match="out_dtype 'float16'"):
        Epilogue(out_dtype="float16")
    bf16 = plan_conv2d(Conv2dWorkload.make((1, 32, 8, 8), (32, 32, 3, 3), 1, 1, dtype="bfloat16"), AVX512)
    with pytest.raises(ValueError, match="a bfloat16 workload cannot take"):
        conv2d_blocked_kernel(bf16, 16, Epilogue(out_dtype="uint8"))
    with pytest.raises(ValueError, match="groups of 4 channels of k"):
        BRGEMM(4, 16, 6, 16, dtype="int8").validate()
    spec = BRGEMM(32, 32, 64, 16, (2, 3, 3), 2, dtype="int8", init=True, engine="amx")
    assert brgemm_from_name(spec.name) == spec


def test_an_int8_kernel_names_the_cpu_features_it_needs():
    wl = Conv2dWorkload.make((1, 32, 8, 8), (32, 32, 3, 3), 1, 1, dtype="int8")
    epilogue = Epilogue(out_dtype="uint8")
    kernels = [conv2d_blocked_kernel(plan_conv2d(wl, isa, engine=engine), isa.lanes, epilogue)
               for engine, isa in (("fma", AVX512), ("fma", AVX2), ("amx", AVX512))]
    features = {str(kernel.attrs[CPU_FEATURES_ATTR]) for kernel in kernels}
    assert features == {"avx512vnni", "avxvnni", "amx-int8,amx-tile"}
    kernel = conv2d_blocked_kernel(plan_conv2d(wl, AVX512), 16, epilogue)
    with pytest.raises(UnsupportedError, match="avx512vnni"):
        compile_kernel(kernel, tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"}))


def test_int8_feature_queries_read_the_target_not_the_host():
    assert has_vnni({"kind": "llvm", "mcpu": "icelake-server"}, 16)
    assert not has_vnni({"kind": "llvm", "mcpu": "icelake-server"}, 8)  # AVX-VNNI came with Alder Lake
    alderlake = {"kind": "llvm", "mcpu": "alderlake"}
    assert has_vnni(alderlake, 8) and not has_vnni(alderlake, 16)
    assert not has_vnni({"kind": "llvm", "mcpu": "skylake-avx512"}, 16) and not has_vnni("llvm", 4)
    assert has_amx_int8({"kind": "llvm", "mcpu": "sapphirerapids"})
    assert not has_amx_int8({"kind": "llvm", "mcpu": "znver4"}) and not has_amx_int8("cuda -arch=sm_90")


@pytest.mark.parametrize("engine", ENGINES)
def test_the_quantizing_epilogue_is_vectorized_by_tvm(engine):
    """The epilogue's rounding is LLVM's nearbyint intrinsic: with tirx.nearbyint TVM's vectorizer
    left the loop scalar and LLVM's own vectorizer chose 8-lane vectors on Sapphire Rapids (its
    256-bit preference): the epilogue ran in ymm, ResNet-50's int8 build 8% slower."""
    import re

    engine, isa = engine
    wl = Conv2dWorkload.make((1, 64, 8, 8), (64, 64, 3, 3), 1, 1, dtype="int8")
    plan = plan_conv2d(wl, isa, engine=engine)
    lib = compile_kernel(conv2d_blocked_kernel(plan, isa.lanes, Epilogue(bias=True, out_dtype="uint8")), TARGET)
    rounded = {int(n) for n in re.findall(r"llvm\.nearbyint\.v(\d+)f32", lib.mod.inspect_source("ll"))}
    assert rounded and min(rounded) >= plan.oc_bn, rounded  # the whole vectorized channel loop, not LLVM's 8


def test_an_epilogue_with_a_fused_add_reads_back_from_its_json_description():
    """(A tuning description holds the epilogue as JSON: its fused add comes back as the objects.)"""
    import dataclasses
    import json

    from tvm_ext.kernels.quantized import Quantization, QuantizedSum

    add = QuantizedSum(Quantization(0.1, 3), Quantization(0.2, 5, "int8"), Quantization(0.3, 1), True, "b")
    float_add = QuantizedSum.of_float_output(Quantization(0.2, 5, "int8"), Quantization(0.3, 1), True)
    for fused in (add, float_add):
        epilogue = Epilogue(bias=True, out_dtype="uint8", zero_point=3, add=fused)
        fields = json.loads(json.dumps(dataclasses.asdict(epilogue)))
        assert Epilogue(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}) == epilogue
    with pytest.raises(ValueError, match="a fused quantized add follows a uint8 output without a border"):
        Epilogue(out_dtype="uint8", out_pad=(1, 1, 1, 1), add=add)
    with pytest.raises(ValueError, match="the activation after it"):
        Epilogue(bias=True, activation="relu", out_dtype="uint8", add=float_add)
    with pytest.raises(ValueError, match="own must be 'a' or 'b'"):
        QuantizedSum(add.a, add.b, add.out, own="c")
    with pytest.raises(ValueError, match="a float operand is a"):
        QuantizedSum(Quantization(0.3, 2), add.b, add.out, float_own=True)


@pytest.mark.skipif(not (has_amx_int8(TARGET) and amx_permitted()),
                    reason="no AMX-INT8, or the OS does not grant its tiles")
def test_amx_kernels_reload_a_tile_configuration_that_changed():
    """An AMX microkernel call loads its tile configuration only where the one in force differs
    (read back with sttilecfg): right after a kernel of another tile shape, and after the tiles
    were released (as other libraries do when they finish) — the second call of each pair is
    right."""
    from tvm.script.ir_builder import IRBuilder
    from tvm.tirx.script import builder as T

    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("release")
        T.arg("x", T.Buffer((1,), "int32"))
        release_ir = ("define linkonce_odr void @tvmext_test_release() {\n  call void @llvm.x86.tilerelease()\n"
                      "  ret void\n}\ndeclare void @llvm.x86.tilerelease()\n")
        with T.attr(0, "pragma_import_llvm", release_ir):
            T.evaluate(T.call_extern("void", "tvmext_test_release"))
    release = tvm.compile(tvm.IRModule({"release": builder.get()}), TARGET)["release"]
    epilogue = Epilogue(bias=True, out_dtype="uint8", zero_point=3)
    small = ((1, 32, 7, 9), (32, 32, 3, 3), 1, 1, 1)  # tiles of 7 and 9 rows
    large = ((1, 64, 20, 20), (64, 64, 3, 3), 1, 1, 1)  # tiles of 16 rows
    for between in ("another shape", "released tiles"):
        first, expected, _ = run_int8_conv(*small, "amx", AVX512, epilogue, x_zero=5, seed=1)
        if between == "another shape":
            got, want, _ = run_int8_conv(*large, "amx", AVX512, epilogue, x_zero=5, seed=2)
            np.testing.assert_array_equal(got, want)
        else:
            release(tvm.runtime.empty((1,), "int32"))
        again, _, _ = run_int8_conv(*small, "amx", AVX512, epilogue, x_zero=5, seed=1)
        np.testing.assert_array_equal(first, expected)
        np.testing.assert_array_equal(again, expected)
