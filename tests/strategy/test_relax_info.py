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
