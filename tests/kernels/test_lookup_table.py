"""The table lookup kernel of quantized element-wise chains (strategy.quantized_tables)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from tvm_ext.kernels.elementwise import lookup_table_func


@pytest.mark.parametrize("in_dtype, out_dtype, shape", [
    ("uint8", "uint8", (1, 7, 9, 40)), ("int8", "int8", (3, 5)), ("int8", "uint8", (1000,)), ("uint8", "int8", (7,))])
def test_lookup_table_reads_each_value_from_its_table(in_dtype, out_dtype, shape):
    """y = table[x] for every element (int8 from -128 at the table's start), any shape, sizes
    below and above a task's 256 elements."""
    rng = np.random.default_rng(5)
    low, high = (-128, 127) if in_dtype == "int8" else (0, 255)
    x = rng.integers(low, high + 1, shape).astype(in_dtype)
    out_low, out_high = (-128, 127) if out_dtype == "int8" else (0, 255)
    table = rng.integers(out_low, out_high + 1, 256).astype(out_dtype)
    y = tvm.runtime.tensor(np.zeros(shape, out_dtype))
    tvm.compile(lookup_table_func(shape, in_dtype, out_dtype), target="llvm")(
        tvm.runtime.tensor(x), tvm.runtime.tensor(table), y)
    np.testing.assert_array_equal(y.numpy(), table[x.astype(np.int64) - low])


def test_lookup_table_refuses_a_float_input():
    with pytest.raises(ValueError, match="float32 is not uint8 or int8"):
        lookup_table_func((4,), "float32", "uint8")
