"""relax_info's shape helpers and the Decision's narrowing accessors: what the strategy relies on
where a decision has already checked a shape or chosen a kernel."""

import pytest
import tvm
from tvm import relax

from tvm_ext.errors import UnsupportedError
from tvm_ext.relax_info import image_shape, known_shape, static_shape
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
