"""`tvm_ext.build(mod, target, precision="bf16")`: convolutions in bfloat16 on AMX tiles, on
AVX512-BF16 vectors where those beat fp32 (Zen 4), else emulated on FMA, where they can (fp32
accumulation and output), fp32 elsewhere with the reason in `dispatch_report`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from reference import host_x86_targets, kernel_calls, rel_err
from tvm import relax

import tvm_ext
from tvm_ext.errors import UnsupportedError
from tvm_ext.models.torch_reference import to_torch
from tvm_ext.strategy.decide import BF16_ENGINES, bf16_engine
from tvm_ext.target import vector_isa

ENGINE = bf16_engine(tvm_ext.resolve_target("llvm"))  # this machine's: "amx", "fma" or "emulated"
BF16 = f"{BF16_ENGINES[ENGINE]}, fp32 accumulation and output"
WINOGRAD = "fp32 (Winograd's fewer multiplies beat bf16 on AVX512-BF16 vdpbf16ps); Winograd F(4x4, 3x3)"


def _net(seed: int = 0) -> tvm.IRModule:
    """A 3-channel stem (bf16 with a zero fourth channel), a residual block, a strided 1x1, a grouped
    3x3 and a 3x3 of 40 filters (padded to 64 in blocks of 32), global mean."""
    rng = np.random.default_rng(seed)

    def const(*shape, scale=0.2):
        return relax.const((rng.standard_normal(shape) * scale).astype(np.float32))

    op = relax.op
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 3, 20, 18), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(op.nn.relu(op.add(op.nn.conv2d(x, const(32, 3, 3, 3), padding=1), const(1, 32, 1, 1))))
            z = bb.emit(op.nn.relu(op.add(op.nn.conv2d(y, const(32, 32, 3, 3), padding=1), const(1, 32, 1, 1))))
            z = bb.emit(op.nn.relu(op.add(op.nn.conv2d(z, const(32, 32, 3, 3), padding=1), y)))
            z = bb.emit(op.nn.conv2d(z, const(64, 32, 1, 1), strides=2))
            z = bb.emit(op.nn.conv2d(z, const(64, 16, 3, 3), padding=1, groups=4))
            z = bb.emit(op.nn.conv2d(z, const(40, 64, 3, 3), padding=1))
            out = bb.emit_output(op.mean(z, axis=[2, 3]))
        bb.emit_func_output(out)
    return bb.get()


def test_report_says_which_convolutions_run_in_bf16_and_why_not():
    mod = _net()
    def reasons_on(target) -> list[str]:
        return [row.reason for row in tvm_ext.dispatch_report(mod, target, precision="bf16") if row.op == "nn.conv2d"]

    reasons = reasons_on("llvm")
    if ENGINE == "amx":  # the RGB stem with a zero fourth channel
        assert reasons[:4] == [BF16] * 4 and reasons[5] == BF16
        assert reasons[4].startswith("fp32 (4 groups")
    # Zen 4: AVX512-BF16 at twice the FMA's rate, no AMX: the stem, the 1x1 and the 3x3 of 40 filters
    # in bf16 on vdpbf16ps, the two Winograd 3x3 layers fp32 (fewer multiplies), the grouped one fp32
    fma = f"{BF16_ENGINES['fma']}, fp32 accumulation and output"
    zen4 = reasons_on({"kind": "llvm", "mcpu": "znver4"})
    assert zen4[:4] == [fma, WINOGRAD, WINOGRAD, fma] and zen4[5] == fma, zen4
    assert zen4[4].startswith("fp32 (4 groups"), zen4
    # Cooper Lake: AVX512-BF16 no faster than fp32; Skylake: no bf16 at all. Both emulate it on FMA,
    # at fp32's rate: Winograd's 3x3 layers stay fp32, as on Zen 4
    emulated = "bf16 emulated on fp32 FMA ({}), fp32 accumulation and output"
    winograd = "fp32 (Winograd's fewer multiplies beat bf16 emulated on fp32 FMA); Winograd F(4x4, 3x3)"
    for mcpu, why in (("cooperlake", "the CPU has no AMX-BF16, and its AVX512-BF16 is no faster than fp32"),
                      ("skylake-avx512", "the CPU has neither AMX-BF16 nor AVX512-BF16")):
        found = reasons_on({"kind": "llvm", "mcpu": mcpu})
        assert found[:4] == [emulated.format(why), winograd, winograd, emulated.format(why)], found
        assert found[5] == emulated.format(why) and found[4].startswith("fp32 (4 groups"), found
    # the default precision names none of it
    assert not any("bf16" in row.reason or "fp32 (" in row.reason for row in tvm_ext.dispatch_report(mod, "llvm"))


def test_bf16_network_matches_float64_within_bf16_rounding():
    mod = _net()
    vm = relax.VirtualMachine(tvm_ext.build(mod, "llvm", precision="bf16"), tvm.cpu())
    x = np.random.default_rng(1).standard_normal((2, 3, 20, 18)).astype(np.float32)
    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    expected = to_torch(mod, torch.float64)(torch.from_numpy(x).double()).numpy()
    # inputs of each bf16 convolution rounded to 8 bits of mantissa: about 2^-9 a rounding
    assert 1e-5 < rel_err(got, expected) < 2e-2


def test_emulated_bf16_network_runs_on_every_x86_isa_this_host_has():
    """A CPU without a bf16 dot product runs the same bf16 arithmetic on FMA: SSE, AVX2 and
    AVX-512 builds executed here, where the host has them (its data rounded by a kernel of
    integer operations: TVM folded astype to bfloat16 and back, and the emulated build ran fp32)."""
    mod = _net()
    x = np.random.default_rng(1).standard_normal((2, 3, 20, 18)).astype(np.float32)
    expected = to_torch(mod, torch.float64)(torch.from_numpy(x).double()).numpy()
    targets = host_x86_targets()
    if not targets:
        pytest.skip("not an x86 host")
    for isa, target in targets:
        assert bf16_engine(target) == "emulated"
        got = relax.VirtualMachine(tvm_ext.build(mod, target, precision="bf16"), tvm.cpu())["main"](
            tvm.runtime.tensor(x)).numpy()
        assert 1e-5 < rel_err(got, expected) < 2e-2, isa.name


def test_emulated_bf16_network_equals_vdpbf16ps_bit_for_bit():
    """The same network built for Skylake-SP (emulated) and for Zen 4 (vdpbf16ps), run on a host
    with both: the same output, bit for bit (the emulation adds a pair as the instruction does)."""
    host = tvm_ext.resolve_target("llvm")
    if ENGINE != "fma" or vector_isa(host).lanes != 16:
        pytest.skip("no AVX512-BF16 here to compare with")
    mod = _net()
    x = tvm.runtime.tensor(np.random.default_rng(2).standard_normal((2, 3, 20, 18)).astype(np.float32))
    outputs = [relax.VirtualMachine(tvm_ext.build(mod, {"kind": "llvm", "mcpu": mcpu}, precision="bf16"),
                                    tvm.cpu())["main"](x).numpy() for mcpu in ("skylake-avx512", "znver4")]
    assert np.array_equal(*outputs)


def test_bf16_convolutions_read_their_producers_blocks():
    """On vdpbf16ps (Zen 4) a bf16 convolution reads the 32-channel blocks its producer wrote
    (16 bf16 pairs), rounded in place; it re-blocked them to 16 before (an unpack and a pack
    around every layer: 25.4 -> 22.7 ms for ResNet-50 at batch 1 on 2 threads)."""
    rng = np.random.default_rng(3)
    op = relax.op
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 64, 14, 14), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            z = x
            for c_in, c_out in ((64, 128), (128, 64), (64, 256)):
                w = relax.const((rng.standard_normal((c_out, c_in, 1, 1)) * 0.1).astype(np.float32))
                z = bb.emit(op.nn.relu(op.nn.conv2d(z, w)))
            out = bb.emit_output(z)
        bb.emit_func_output(out)
    zen4 = tvm.target.Target({"kind": "llvm", "mcpu": "znver4"})
    calls = kernel_calls(bb.get(), zen4, precision="bf16")
    convs = [name for name in calls if "conv2d" in name]
    assert len(convs) == 3 and all("_bf16_fma" in name for name in convs), calls
    assert [name for name in calls if "pack_nchwc" in name] == [calls[0], calls[-1]], calls  # in and out only


def _resnet_block(batch=1) -> tvm.IRModule:
    """A bottleneck: 1x1 -> 3x3 (Winograd on Zen 4) -> 1x1 + shortcut -> relu, then a strided 3x3
    (bf16) -> 1x1: the activations the next convolution alone reads, and one it shares."""
    rng = np.random.default_rng(5)
    op = relax.op
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((batch, 64, 14, 14), "float32"))

    def conv(z, c_out, c_in, k, stride=1):
        w = relax.const((rng.standard_normal((c_out, c_in, k, k)) * 0.1).astype(np.float32))
        b = relax.const((rng.standard_normal((1, c_out, 1, 1)) * 0.1).astype(np.float32))
        return op.add(op.nn.conv2d(z, w, strides=stride, padding=k // 2), b)

    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(op.nn.relu(conv(x, 32, 64, 1)))
            y = bb.emit(op.nn.relu(conv(y, 32, 32, 3)))
            y = bb.emit(op.nn.relu(op.add(conv(y, 64, 32, 1), x)))
            y = bb.emit(op.nn.relu(conv(y, 64, 64, 3, stride=2)))
            out = bb.emit_output(conv(y, 96, 64, 1))
        bb.emit_func_output(out)
    return bb.get()


def test_bf16_convolutions_read_bf16_their_producers_wrote(monkeypatch):
    """Activations between kernels in bf16 (issue 34): a convolution whose output only a bf16
    convolution reads writes it rounded to bf16 itself (Winograd's output transform, the BRGEMM
    kernel), instead of an fp32 tensor and a rounding pass; the block's input, which the shortcut
    also reads, stays fp32 and is rounded for its bf16 reader. The values are the same, bit for
    bit, and over a symbolic batch the same kernels write bf16."""
    from tvm_ext.strategy import dispatch

    mod, symbolic = _resnet_block(), _resnet_block(tvm.tirx.Var("n", "int64"))
    zen4 = tvm.target.Target({"kind": "llvm", "mcpu": "znver4"})
    for graph in (mod, symbolic):  # 3x3 -> 1x1 (Winograd), the shortcut's sum -> strided 3x3 -> 1x1
        writers = [name for name in kernel_calls(graph, zen4, precision="bf16") if name.endswith("_bf16")]
        assert len(writers) == 3 and any("winograd" in name for name in writers), writers
    if ENGINE != "fma":
        return  # (built for Zen 4; run where the CPU has AVX512-BF16)
    x = tvm.runtime.tensor(np.random.default_rng(6).standard_normal((1, 64, 14, 14)).astype(np.float32))
    with_pass = relax.VirtualMachine(tvm_ext.build(mod, zen4, precision="bf16"), tvm.cpu())["main"](x).numpy()
    over_n = relax.VirtualMachine(tvm_ext.build(symbolic, zen4, precision="bf16"), tvm.cpu())["main"](x).numpy()
    assert np.array_equal(over_n, with_pass)
    monkeypatch.setattr(dispatch, "write_bf16_activations", lambda lowered, _make: lowered)
    without = relax.VirtualMachine(tvm_ext.build(mod, zen4, precision="bf16"), tvm.cpu())["main"](x).numpy()
    assert np.array_equal(with_pass, without)


def _bottlenecks() -> tvm.IRModule:
    """A stem, two bottlenecks (each block's output read by the next block's first convolution and
    by its shortcut) and a strided one with a projection (its input read by two convolutions)."""
    rng = np.random.default_rng(8)
    op = relax.op
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 32, 12, 12), "float32"))

    def conv(z, c_out, c_in, k, stride=1):
        w = relax.const((rng.standard_normal((c_out, c_in, k, k)) * (2 / (c_in * k * k)) ** 0.5).astype(np.float32))
        b = relax.const((rng.standard_normal((1, c_out, 1, 1)) * 0.1).astype(np.float32))
        return op.add(op.nn.conv2d(z, w, strides=stride, padding=k // 2), b)

    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(op.nn.relu(conv(x, 64, 32, 1)))
            for _ in range(2):
                z = bb.emit(op.nn.relu(conv(y, 32, 64, 1)))
                z = bb.emit(op.nn.relu(conv(z, 32, 32, 3)))
                y = bb.emit(op.nn.relu(op.add(conv(z, 64, 32, 1), y)))
            shortcut = bb.emit(conv(y, 128, 64, 1, stride=2))
            z = bb.emit(op.nn.relu(conv(y, 64, 64, 1)))
            z = bb.emit(op.nn.relu(conv(z, 64, 64, 3, stride=2)))
            out = bb.emit_output(op.nn.relu(op.add(conv(z, 128, 64, 1), shortcut)))
        bb.emit_func_output(out)
    return bb.get()


def test_a_bf16_residual_stream_has_no_fp32_copy(monkeypatch):
    """A block's output that the next block's first convolution (in bf16) and a shortcut read is
    written in bf16 and read widened by the shortcut's convolution (Epilogue.residual_dtype), as
    the strided projection's, which only a shortcut reads; a tensor two convolutions read is
    rounded once. Before: an fp32 tensor and a rounding pass each (two at the projection), 2.5-7%
    of ResNet-50's bf16 time on the Zen 4. The sum then sees the rounded value: within bf16's
    error of float64 and of the build without it."""
    from tvm_ext.strategy import bf16_activations

    mod = _bottlenecks()
    zen4 = tvm.target.Target({"kind": "llvm", "mcpu": "znver4"})
    calls = kernel_calls(mod, zen4, precision="bf16")
    convs = [name for name in calls if "conv2d" in name and "winograd_input" not in name]
    readers = [name for name in convs if name.endswith("_residual_relu_bf16r") or name.endswith("_bf16_bf16r")]
    assert len(readers) == 3, convs  # each block's last convolution reads its shortcut in bf16
    assert convs[0].endswith("_bias_relu_bf16"), convs  # the stem: read by a block and a shortcut
    assert sum(name.endswith("_bf16_bf16r") for name in readers) == 2, convs  # the blocks' outputs
    assert [name for name in convs if "_128x1x1_s2x2" in name][0].endswith("_bias_bf16"), convs  # the projection
    assert not [name for name in calls if "cast" in name or "round" in name], calls
    if ENGINE != "fma":
        return  # (built for Zen 4; run where the CPU has AVX512-BF16)
    x = np.random.default_rng(9).standard_normal((1, 32, 12, 12)).astype(np.float32)
    got = relax.VirtualMachine(tvm_ext.build(mod, zen4, precision="bf16"), tvm.cpu())["main"](
        tvm.runtime.tensor(x)).numpy()
    expected = to_torch(mod, torch.float64)(torch.from_numpy(x).double()).numpy()
    assert 1e-5 < rel_err(got, expected) < 2e-2
    monkeypatch.setattr(bf16_activations, "_reads_as_residual", lambda *_: False)
    kept = relax.VirtualMachine(tvm_ext.build(mod, zen4, precision="bf16"), tvm.cpu())["main"](
        tvm.runtime.tensor(x)).numpy()
    assert 0 < rel_err(got, kept) < 1e-2


def test_precision_is_checked_before_anything_compiles():
    mod = _net()
    with pytest.raises(ValueError, match="precision must be one of"):
        tvm_ext.build(mod, "llvm", precision="fp16")
    with pytest.raises(ValueError, match="precision must be one of"):
        tvm_ext.dispatch_report(mod, "llvm", precision="int8")
    with pytest.raises(UnsupportedError, match="precision applies to CPU targets"):
        tvm_ext.pipeline("cuda -arch=sm_90", precision="bf16")


def test_a_symbolic_batch_runs_in_bf16():
    """The bf16 kernel for one image runs over a symbolic batch, as fp32's does (before: the
    build failed inside TVM, the batch loop's per-image views taken with an access_ptr of a bf16
    buffer, whose element type TVM's legalization changes)."""
    n = tvm.tirx.Var("n", "int64")
    rng = np.random.default_rng(2)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, 16, 10, 10), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            weight = relax.const((rng.standard_normal((32, 16, 3, 3)) * 0.2).astype(np.float32))
            out = bb.emit_output(relax.op.nn.relu(relax.op.nn.conv2d(x, weight, padding=1)))
        bb.emit_func_output(out)
    mod = bb.get()
    reasons = [row.reason for row in tvm_ext.dispatch_report(mod, "llvm", precision="bf16") if row.op == "nn.conv2d"]
    assert reasons == [BF16]
    vm = relax.VirtualMachine(tvm_ext.build(mod, "llvm", precision="bf16"), tvm.cpu())
    for batch in (1, 3):
        xv = rng.standard_normal((batch, 16, 10, 10)).astype(np.float32)
        got = vm["main"](tvm.runtime.tensor(xv)).numpy()
        error = rel_err(got, to_torch(mod, torch.float64)(torch.from_numpy(xv).double()).numpy())
        assert 1e-5 < error < 2e-2
