"""Layer norm over channels in the blocked layout (tvm_ext.kernels.layer_norm) and ConvNeXt's
channels-last layer norm moved onto it."""

import numpy as np
import pytest
import torch
import tvm
from reference import rel_err
from tvm import relax

import tvm_ext
from tvm_ext.kernels.layer_norm import (
    QUANTIZED_NORM_MAX_CHANNELS,
    LayerNorm,
    layer_norm_func,
    quantized_layer_norm_func,
)
from tvm_ext.relax_info import Quantization

TARGET = tvm_ext.resolve_target("llvm")


@pytest.mark.parametrize("shape, scale, center", [((2, 3, 5, 7, 8), True, True), ((1, 2, 4, 4, 32), False, True),
                                                  ((1, 5, 3, 9, 16), True, False), ((1, 1, 1, 1, 4), False, False)])
def test_kernel_matches_pytorch(shape, scale, center):
    """Float64 PyTorch reference on data far from zero mean (the two-pass variance matters)."""
    rng = np.random.default_rng(sum(shape))
    n, cb, h, w, b = shape
    norm = LayerNorm(shape, 1e-5, scale, center)
    lib = tvm.compile(layer_norm_func(norm), TARGET)
    x = (rng.standard_normal(shape) * 3 + 40).astype(np.float32)
    gamma, beta = (rng.standard_normal(cb * b).astype(np.float32) for _ in range(2))
    y = tvm.runtime.tensor(np.full(shape, np.nan, np.float32))
    args = [tvm.runtime.tensor(x), *([tvm.runtime.tensor(gamma)] if scale else []),
            *([tvm.runtime.tensor(beta)] if center else [])]
    lib["layer_norm"](*args, y)
    nhwc = torch.from_numpy(x.transpose(0, 2, 3, 1, 4).reshape(n, h, w, cb * b)).double()
    expected = torch.nn.functional.layer_norm(nhwc, (cb * b,), torch.from_numpy(gamma).double() if scale else None,
                                              torch.from_numpy(beta).double() if center else None, 1e-5).numpy()
    assert rel_err(y.numpy(), expected.reshape(n, h, w, cb, b).transpose(0, 3, 1, 2, 4)) < 1e-5


def test_description_refuses_bad_shapes():
    with pytest.raises(ValueError, match="blocked"):
        LayerNorm((1, 4, 4, 4), 1e-5)
    with pytest.raises(ValueError, match="epsilon"):
        LayerNorm((1, 1, 4, 4, 8), -1.0)


_RANGE = {"uint8": (0, 255), "int8": (-128, 127)}


@pytest.mark.parametrize("shape, data_dtype, out_dtype", [
    ((1, 9, 11, 96), "uint8", "uint8"), ((3, 5, 37), "int8", "int8"), ((196, 384), "uint8", "int8"),
    ((4, 1), "int8", "uint8"), ((2, 3, 16), "uint8", "uint8")])
def test_quantized_kernel_matches_float64(shape, data_dtype, out_dtype):
    """quantize(layer_norm(dequantize(x)) * gamma + beta) against float64 NumPy, rounded to nearest
    even: every value equal (the statistics are exact integer sums; a float32 output within an ulp
    could flip a tie: none here). Channels a multiple of the 16 lanes and not (37, 1: a tail)."""
    rng = np.random.default_rng(sum(shape))
    data = Quantization(0.031, 117 if data_dtype == "uint8" else -5, data_dtype)
    out = Quantization(0.045, 128 if out_dtype == "uint8" else 3, out_dtype)
    x = rng.integers(*_RANGE[data_dtype], size=shape, endpoint=True).astype(data_dtype)
    gamma = (rng.standard_normal(shape[-1]) * 0.5 + 1).astype(np.float32)
    beta = (rng.standard_normal(shape[-1]) * 0.2).astype(np.float32)
    y = tvm.runtime.tensor(np.zeros(shape, out_dtype))
    tvm.compile(quantized_layer_norm_func(shape, data, out, 1e-6), TARGET)(
        tvm.runtime.tensor(x), tvm.runtime.tensor(gamma), tvm.runtime.tensor(beta), y)
    v = (x.astype(np.float64) - data.zero_point) * data.scale
    normed = (v - v.mean(-1, keepdims=True)) / np.sqrt(v.var(-1, keepdims=True) + 1e-6) * gamma + beta
    expected = np.clip(np.rint(normed / out.scale) + out.zero_point, *_RANGE[out_dtype])
    np.testing.assert_array_equal(y.numpy(), expected)


def test_quantized_kernel_refuses_what_it_does_not_compute():
    with pytest.raises(ValueError, match="float32 -> uint8 are not uint8 / int8"):
        quantized_layer_norm_func((2, 8), Quantization(0.1, 0, "float32"), Quantization(0.1, 0), 1e-5)
    with pytest.raises(ValueError, match="out of range"):
        quantized_layer_norm_func((2, 8), Quantization(0.1, 0), Quantization(0.1, 0), -1.0)
    with pytest.raises(ValueError, match="out of range"):  # (its int32 lanes would overflow)
        quantized_layer_norm_func((1, QUANTIZED_NORM_MAX_CHANNELS + 1), Quantization(0.1, 0), Quantization(0.1, 0),
                                  1e-5)


def _convnext_block(rng, x_shape, flatten: bool, batch=None):
    """ConvNeXt's block as torch.export writes it: depthwise 7x7, permute to channels-last,
    layer norm over the last axis, then (`flatten`) reshape + matmul or permute back + 1x1."""
    n, c, h, w = x_shape

    def const(*shape):
        return relax.const((rng.standard_normal(shape) * 0.2).astype(np.float32))

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n if batch is None else batch, c, h, w), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, const(c, 1, 7, 7), padding=(3, 3), groups=c))
            y = bb.emit(relax.op.permute_dims(y, [0, 2, 3, 1]))
            y = bb.emit(relax.op.nn.layer_norm(y, const(c), const(c), axes=[-1], epsilon=1e-6))
            if flatten:
                y = bb.emit(relax.op.reshape(y, (h * w, c)))
                y = bb.emit(relax.op.matmul(y, const(c, 4 * c)))
                y = bb.emit(relax.op.nn.gelu(relax.op.add(y, const(4 * c))))
                y = bb.emit(relax.op.permute_dims(relax.op.reshape(y, (1, h, w, 4 * c)), [0, 3, 1, 2]))
            else:
                y = bb.emit(relax.op.permute_dims(y, [0, 3, 1, 2]))
                y = bb.emit(relax.op.nn.conv2d(y, const(4 * c, c, 1, 1)))
            out = bb.emit_output(bb.emit(relax.op.add(y, y)))
        bb.emit_func_output(out)
    return bb.get()


def _run(ex, x):
    return relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()


@pytest.mark.parametrize("flatten", [False, True])
def test_convnext_layer_norm_runs_blocked(flatten):
    """The channels-last layer norm becomes the blocked kernel and the transposes around it
    cancel: no permute, pack or stock layer norm is left between the depthwise convolution and
    the 1x1 one. Same numbers as stock TVM."""
    rng = np.random.default_rng(1)
    mod = _convnext_block(rng, (1, 32, 9, 11), flatten)
    report = tvm_ext.dispatch_report(mod, TARGET)
    assert [r.kernel for r in report if r.op == "nn.layer_norm"] == ["layer_norm"], str(report)
    assert not any(r.op == "permute_dims" for r in report), str(report)
    x = rng.standard_normal((1, 32, 9, 11)).astype(np.float32)
    assert rel_err(_run(tvm_ext.build(mod, TARGET), x), _run(tvm.compile(mod, "llvm"), x)) < 1e-5


def test_symbolic_batch_and_an_unblocked_input():
    rng = np.random.default_rng(2)
    mod = _convnext_block(rng, (1, 24, 6, 6), False, batch=tvm.tirx.Var("n", "int64"))
    assert "layer_norm" in {r.kernel for r in tvm_ext.dispatch_report(mod, TARGET)}
    ours, stock = tvm_ext.build(mod, TARGET), tvm.compile(mod, "llvm")
    for batch in (1, 2):
        x = rng.standard_normal((batch, 24, 6, 6)).astype(np.float32)
        assert rel_err(_run(ours, x), _run(stock, x)) < 1e-5

    bb = relax.BlockBuilder()  # its input from stock TVM (tanh): packed first, any channel count
    x = relax.Var("x", relax.TensorType((1, 6, 5, 5), "float32"))
    g, b = (relax.const(rng.standard_normal(6).astype(np.float32)) for _ in range(2))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.nn.layer_norm(bb.emit(relax.op.tanh(x)), g, b, axes=[1])))
        bb.emit_func_output(out)
    mod = bb.get()
    x = rng.standard_normal((1, 6, 5, 5)).astype(np.float32)
    assert rel_err(_run(tvm_ext.build(mod, TARGET), x), _run(tvm.compile(mod, "llvm"), x)) < 1e-5


def test_cuda_keeps_the_channels_last_layer_norm():
    """No CUDA kernel: the layer norm is not moved to the channels (stock TVM's reduction over a
    strided axis is 27x slower than over the last one)."""
    mod = _convnext_block(np.random.default_rng(3), (1, 32, 8, 8), False)
    rows = [r for r in tvm_ext.dispatch_report(mod, "cuda") if r.op == "nn.layer_norm"]
    assert [(r.kernel, r.shapes[0]) for r in rows] == [("fallback", (1, 8, 8, 32))]
