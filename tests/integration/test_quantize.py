"""tvm_ext.quantize: a float32 Relax module calibrated and written in the QDQ form ONNX Runtime's
quantize_static writes (its arithmetic for scales, zero points, weights and biases), which
tvm_ext.build runs on the int8 kernels."""

import numpy as np
import pytest
import torch
import tvm
from reference import rel_err
from tvm import relax

import tvm_ext
from tvm_ext.models import torchvision_zoo as zoo
from tvm_ext.quantization import _parameters, _quantized_weights
from tvm_ext.strategy.quantized import int8_engine
from tvm_ext.target import resolve_target

SIZE = 64


def _run(ex, x: np.ndarray) -> np.ndarray:
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x))
    return (out if hasattr(out, "numpy") else out[0]).numpy()


def _conv_kernels(mod) -> list[str]:
    return [r.kernel for r in tvm_ext.dispatch_report(mod, "llvm") if r.op == "nn.conv2d"]


def _quantize_ops(mod) -> list[relax.Call]:
    return [b.value for b in mod["main"].body.blocks[0].bindings
            if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == "relax.quantize"]


def test_parameters_are_onnx_runtimes():
    """Scales and zero points bit for bit as ONNX Runtime's compute_scale_zp, weights and their
    per-channel scales as its symmetric quantize_data."""
    from onnx import TensorProto
    from onnxruntime.quantization.quant_utils import compute_scale_zp, quantize_data

    rng = np.random.default_rng(0)
    ranges = [(-1.5, 2.25), (0.0, 6.0), (0.3, 4.0), (-3.0, -0.2), (0.0, 0.0), (-1e-3, 1e5)]
    ranges += [tuple(sorted(rng.standard_normal(2) * 10 ** rng.uniform(-3, 3))) for _ in range(50)]
    for lo, hi in ranges:
        for dtype, (qmin, qmax) in {"uint8": (0, 255), "int8": (-128, 127)}.items():
            np_type = np.uint8 if dtype == "uint8" else np.int8
            zero, scale = compute_scale_zp(np.float32(lo), np.float32(hi), np_type(qmin), np_type(qmax))
            ours = _parameters(float(np.float32(lo)), float(np.float32(hi)), dtype)
            assert (ours.scale, ours.zero_point) == (scale, int(zero)), (lo, hi, dtype)
    w = rng.standard_normal((6, 3, 3, 3)).astype(np.float32) * rng.uniform(0.01, 5, (6, 1, 1, 1)).astype(np.float32)
    w[2] = 0  # an all-zero channel: scale 1
    q, scales = _quantized_weights(w)
    for k in range(6):
        zero, scale, expected = quantize_data(w[k].reshape(-1), TensorProto.INT8, symmetric=True)
        assert zero == 0 and scales[k] == scale and (q[k].reshape(-1) == expected).all(), k


@pytest.fixture(scope="module")
def resnet18():
    model = zoo.load("resnet18", SIZE)
    mod, x = zoo.export(model, SIZE)
    rng = np.random.default_rng(0)
    calibration = [rng.standard_normal(x.shape).astype(np.float32) for _ in range(4)]
    return model, mod, calibration, [rng.standard_normal(x.shape).astype(np.float32) for _ in range(6)]


def test_a_network_agrees_with_onnx_runtimes_quantize_static(resnet18, tmp_path):
    """torchvision ResNet-18, the same calibration inputs for both: every activation scale within
    float32 rounding of ONNX Runtime's (its float32 run and ours differ in the last bits), every
    convolution and the classifier on an int8 kernel, and outputs as close to the float32 network as ORT's are."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    model, mod, calibration, inputs = resnet18
    quantized = tvm_ext.quantize(mod, calibration)
    assert _conv_kernels(quantized) and all(k.startswith("int8_conv2d") for k in _conv_kernels(quantized))
    assert [r.kernel.split(" ")[0] for r in tvm_ext.dispatch_report(quantized, "llvm") if r.op == "matmul"] == \
        ["int8_conv2d" if int8_engine(resolve_target("llvm")) else "brgemm_conv2d"]
    with torch.no_grad():
        torch.onnx.export(model, (torch.from_numpy(inputs[0]),), str(tmp_path / "fp32.onnx"), opset_version=17,
                          dynamo=False, input_names=["x"], output_names=["y"])
    quant_pre_process(str(tmp_path / "fp32.onnx"), str(tmp_path / "prepared.onnx"))

    class Feeds(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter([{"x": c} for c in calibration])

        def get_next(self):
            return next(self.feeds, None)

    quantize_static(str(tmp_path / "prepared.onnx"), str(tmp_path / "int8.onnx"), Feeds(), quant_format=QuantFormat.QDQ,
                    per_channel=True, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    op_types_to_quantize=["Conv", "Add", "MaxPool", "Relu", "Gemm"])  # (the classifier: since 0.5.36)
    initializers = onnx.load(str(tmp_path / "int8.onnx")).graph.initializer
    theirs = sorted({float(numpy_helper.to_array(i)) for i in initializers
                     if i.name.endswith("_scale") and numpy_helper.to_array(i).size == 1})
    ours = sorted({float(q.args[1].value.numpy()) for q in _quantize_ops(quantized)})
    assert len(ours) == len(theirs) and np.allclose(ours, theirs, rtol=1e-5, atol=0), (ours, theirs)

    session = ort.InferenceSession(str(tmp_path / "int8.onnx"), providers=["CPUExecutionProvider"])
    int8, fp32 = tvm_ext.build(quantized, "llvm"), tvm_ext.build(mod, "llvm")
    ours_err, theirs_err = [], []
    for x in inputs:
        reference = _run(fp32, x)
        ours_err.append(rel_err(_run(int8, x), reference))
        theirs_err.append(rel_err(session.run(None, {"x": x})[0], reference))
    assert np.mean(ours_err) <= 1.3 * np.mean(theirs_err) + 5e-3, (ours_err, theirs_err)


def test_percentile_calibration_ignores_outliers(resnet18):
    """An input with one huge value: min/max calibration widens the input's range to it, the
    99.9th percentile does not (and the result still runs every convolution in int8)."""
    _, mod, calibration, _ = resnet18
    spiked = [c.copy() for c in calibration]
    spiked[0].flat[0] = 1000.0
    minmax, percentile = (tvm_ext.quantize(mod, spiked, method=m, percentile=99.9) for m in ("minmax", "percentile"))
    scale = {name: float(_quantize_ops(q)[0].args[1].value.numpy()) for name, q in
             (("minmax", minmax), ("percentile", percentile))}
    assert scale["minmax"] > 100 * scale["percentile"], scale
    assert all(k.startswith("int8_conv2d") for k in _conv_kernels(percentile))


def test_mobilenet_v2_relu6_and_depthwise_in_int8():
    """Depthwise convolutions and relu6 (written as relu before its quantize: exact, below) all on
    int8 kernels, the same top-1 as float32."""
    model = zoo.load("mobilenet_v2", SIZE)
    mod, x = zoo.export(model, SIZE)
    rng = np.random.default_rng(1)
    quantized = tvm_ext.quantize(mod, [rng.standard_normal(x.shape).astype(np.float32) for _ in range(4)])
    kernels = _conv_kernels(quantized)
    assert len(kernels) == 52 and all(k.startswith("int8_conv2d") for k in kernels), kernels
    int8, fp32 = tvm_ext.build(quantized, "llvm"), tvm_ext.build(mod, "llvm")
    for _ in range(3):
        x = rng.standard_normal(x.shape).astype(np.float32)
        got, want = _run(int8, x), _run(fp32, x)
        assert got.argmax() == want.argmax() and rel_err(got, want) < 0.05


def _conv_relu6(activations: str):
    rng = np.random.default_rng(5)
    weight = rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 2  # outputs well past 6
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 3, 12, 12), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, relax.const(weight), padding=1))
            y = bb.emit(relax.op.clip(y, 0, 6))
            y = bb.emit(relax.op.nn.max_pool2d(y, 2, 2))
            y = bb.emit(relax.op.nn.max_pool2d(y, 3, 1, 1))  # a pool of a pool (GoogLeNet's) shares its parameters
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get(), [rng.standard_normal((1, 3, 12, 12)).astype(np.float32) for _ in range(3)]


@relax.expr_functor.mutator
class _ReluAsRelu6(relax.PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if getattr(call.op, "name", "") == "relax.nn.relu":
            return relax.op.clip(call.args[0], 0, 6)
        return call


@pytest.mark.parametrize("activations", ["uint8", "int8"])
def test_relu6_written_as_relu_is_exact(activations):
    """quantize(clip(y, 0, 6)) and quantize(relu(y)) agree on every value once the range ends at
    or below 6: the quantized module (relu) and the same module with relu6 put back, both run by
    stock TVM, are bit-identical; the int8 kernels compute it too (within a step: their
    requantization rounds as ONNX Runtime's)."""
    mod, calibration = _conv_relu6(activations)
    quantized = tvm_ext.quantize(mod, calibration, activations=activations)
    assert not any(getattr(b.value.op, "name", "") == "relax.clip" for b in quantized["main"].body.blocks[0].bindings
                   if isinstance(b.value, relax.Call))
    with_relu6 = tvm.IRModule({"main": _ReluAsRelu6().visit_expr(quantized["main"])})
    stock, stock_relu6 = tvm.compile(quantized, "llvm"), tvm.compile(with_relu6, "llvm")
    ours = tvm_ext.build(quantized, "llvm")
    scale = float(_quantize_ops(quantized)[-1].args[1].value.numpy())
    for x in calibration + [np.random.default_rng(9).standard_normal((1, 3, 12, 12)).astype(np.float32) * 3]:
        expected = _run(stock_relu6, x)
        assert expected.max() > 5.9 and (_run(stock, x) == expected).all()
        assert np.abs(_run(ours, x) - expected).max() <= scale * 1.001


def test_bad_arguments_are_named_before_any_build(resnet18):
    _, mod, calibration, _ = resnet18
    for kwargs, message in [({"method": "kl"}, "method"), ({"activations": "int4"}, "activations"),
                            ({"percentile": 30.0}, "percentile")]:
        with pytest.raises(ValueError, match=message):
            tvm_ext.quantize(mod, calibration, **kwargs)
    with pytest.raises(ValueError, match="the calibration runs on a CPU"):
        tvm_ext.quantize(mod, calibration, target="cuda -arch=sm_90")
    with pytest.raises(ValueError, match="calibration is empty"):
        tvm_ext.quantize(mod, [])
    with pytest.raises(ValueError, match=r"calibration\[0\] has 2 arrays"):
        tvm_ext.quantize(mod, [(calibration[0], calibration[0])])


def test_a_module_without_constant_weight_convolutions_comes_back_as_it_was():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 8, 8), "float32"))
    w = relax.Var("w", relax.TensorType((4, 4, 3, 3), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.sigmoid(relax.op.nn.conv2d(x, w)))
        bb.emit_func_output(out)
    mod = bb.get()
    rng = np.random.default_rng(0)
    data = [(rng.standard_normal((1, 4, 8, 8)), rng.standard_normal((4, 4, 3, 3)))]
    assert tvm_ext.quantize(mod, data).same_as(mod)
