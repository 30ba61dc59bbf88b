"""relax_info's shape helpers and the Decision's narrowing accessors: what the strategy relies on
where a decision has already checked a shape or chosen a kernel."""

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_ext.errors import UnsupportedError
from tvm_ext.relax_info import (
    Quantization,
    constant_array,
    image_shape,
    is_call,
    known_shape,
    op_name,
    per_tensor_quantization,
    scalar_array,
    static_shape,
)
from tvm_ext.strategy.base import Decision


def test_known_shape_passes_static_shapes_and_names_what_is_missing():
    static = relax.Var("x", relax.TensorType((1, 8, 5, 5), "float32"))
    assert known_shape(static_shape(static), "x") == (1, 8, 5, 5) == known_shape(image_shape(static), "x")
    n = relax.Var("y", relax.TensorType((tvm.tirx.Var("n", "int64"), 8, 5, 5), "float32"))
    assert static_shape(n) is None
    with pytest.raises(UnsupportedError, match="pack_nchwc: the data: the shape is not static"):
        known_shape(static_shape(n), "pack_nchwc: the data")


def test_decision_accessors_say_why_there_is_nothing_to_emit():
    fallback = Decision("nn.conv2d", ((1, 3, 4, 4),), None, "dtype float16 is not float32")
    with pytest.raises(UnsupportedError, match="no tvm_ext kernel to emit .dtype float16"):
        _ = fallback.chosen_kernel
    with pytest.raises(UnsupportedError, match="no convolution plan"):
        _ = fallback.conv_plan
    assert Decision("nn.relu", (), "relu", "fused").chosen_kernel == "relu"


def test_field_of_reads_through_tuple_get_items():
    """PyTorch's max_pool2d_with_indices imports as (the pooling, zeros) and a TupleGetItem of it:
    the pooling is found through it, a tuple field of a tuple too; anything else is itself (a
    TupleGetItem of a TupleGetItem's value included: only bound tuples are read)."""
    from tvm_ext.strategy.base import field_of

    x = relax.Var("x", relax.TensorType((1, 4, 8, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            pool = bb.emit(relax.op.nn.max_pool2d(x, 2, 2))
            zeros = bb.emit(relax.op.zeros_like(pool))
            pair = bb.emit(relax.Tuple([pool, zeros]))
            nested = bb.emit(relax.Tuple([zeros, pair]))
            first = bb.emit(relax.TupleGetItem(pair, 0))
            inner = bb.emit(relax.TupleGetItem(nested, 1))
            deep = bb.emit(relax.TupleGetItem(inner, 1))
            out = bb.emit_output(relax.Tuple([first, deep]))
        bb.emit_func_output(out)
    values = {b.var: b.value for block in bb.get()["main"].body.blocks for b in block.bindings}
    assert field_of(first, values.get).same_as(pool) and field_of(inner, values.get).same_as(pair)
    assert field_of(deep, values.get).same_as(deep)
    assert field_of(pool, values.get).same_as(pool) and field_of(x, values.get).same_as(x)


def test_per_tensor_quantization_reads_constant_parameters_of_a_quantize_or_dequantize():
    """One scale and zero point, float32 scale, uint8 or int8: a Quantization; a per-channel
    scale, a float16 scale (whose arithmetic the float32 kernels would not reproduce), another
    dtype or another op: None."""
    x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    q = relax.Var("q", relax.TensorType((2, 3), "int8"))
    scale, zero = relax.const(np.float32(0.25)), relax.const(np.int8(-3))
    op = relax.op
    assert per_tensor_quantization(op.quantize(x, scale, zero, axis=1, out_dtype="int8")) == \
        Quantization(0.25, -3, "int8")
    assert per_tensor_quantization(op.dequantize(q, scale, zero, axis=1)) == Quantization(0.25, -3, "int8")
    per_channel = relax.const(np.full(3, 0.25, np.float32))
    assert per_tensor_quantization(op.dequantize(q, per_channel, zero, axis=1)) is None
    assert per_tensor_quantization(op.quantize(x, relax.const(np.float16(0.25)), zero, axis=1, out_dtype="int8")) \
        is None
    assert per_tensor_quantization(op.add(x, x)) is None
    assert op_name(op.add(x, x)) == "relax.add" and op_name(x) is None
    assert is_call(op.add(x, x), "relax.add") and not is_call(op.add(x, x), "relax.multiply") and not is_call(x, "x")
    assert scalar_array(scale).dtype == np.float32 and scalar_array(per_channel) is None
    assert scalar_array(x) is None
    np.testing.assert_array_equal(constant_array(per_channel), np.full(3, 0.25, np.float32))
    assert constant_array(scale).shape == () and constant_array(x) is None
