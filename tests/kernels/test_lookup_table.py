"""The table lookup kernel of quantized element-wise chains (strategy.quantized_tables)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from tvm_ext.kernels.elementwise import lookup_table_func
from tvm_ext.target import CPU_FEATURES_ATTR, has_avx512_vbmi, host_target

HOST = host_target()
VBMI = pytest.mark.skipif(not has_avx512_vbmi(HOST), reason="no AVX512-VBMI on this CPU")


def _check_lookup(in_dtype: str, out_dtype: str, shape: tuple, target) -> tvm.tirx.PrimFunc:
    rng = np.random.default_rng(5)
    low, high = (-128, 127) if in_dtype == "int8" else (0, 255)
    x = rng.integers(low, high + 1, shape).astype(in_dtype)
    out_low, out_high = (-128, 127) if out_dtype == "int8" else (0, 255)
    table = rng.integers(out_low, out_high + 1, 256).astype(out_dtype)
    y = tvm.runtime.tensor(np.zeros(shape, out_dtype))
    func = lookup_table_func(shape, in_dtype, out_dtype, target)
    tvm.compile(func, target=target or "llvm")(tvm.runtime.tensor(x), tvm.runtime.tensor(table), y)
    np.testing.assert_array_equal(y.numpy(), table[x.astype(np.int64) - low])
    return func


@pytest.mark.parametrize("in_dtype, out_dtype, shape", [
    ("uint8", "uint8", (1, 7, 9, 40)), ("int8", "int8", (3, 5)), ("int8", "uint8", (1000,)), ("uint8", "int8", (7,))])
def test_lookup_table_reads_each_value_from_its_table(in_dtype, out_dtype, shape):
    """y = table[x] for every element (int8 from -128 at the table's start), any shape, sizes
    below and above a task's 256 elements."""
    _check_lookup(in_dtype, out_dtype, shape, None)


@VBMI
@pytest.mark.parametrize("in_dtype, out_dtype, shape", [
    ("uint8", "uint8", (1, 7, 9, 40)), ("int8", "int8", (3, 5)), ("int8", "uint8", (64,)), ("uint8", "int8", (65,)),
    ("int8", "int8", (2, 4096 + 64 * 3 + 17)), ("uint8", "uint8", (1, 64, 56, 56))])
def test_lookup_table_with_byte_permutes_reads_each_value_from_its_table(in_dtype, out_dtype, shape):
    """The AVX512-VBMI kernel: both halves of the table (bytes below and above 128: int8's
    negative values), whole vectors, a tail of under 64 bytes, more than one task's 4096."""
    func = _check_lookup(in_dtype, out_dtype, shape, HOST)
    assert func.attrs[CPU_FEATURES_ATTR] == "avx512vbmi,avx512bw"  # (the byte-permute kernel ran)


@VBMI
def test_lookup_table_into_floats_is_looked_up_one_element_at_a_time():
    """A float table has no byte permute: the scalar kernel, on a VBMI target too."""
    rng = np.random.default_rng(6)
    x = rng.integers(0, 256, (300,)).astype("uint8")
    table = rng.standard_normal(256).astype("float32")
    func = lookup_table_func(x.shape, "uint8", "float32", HOST)
    assert CPU_FEATURES_ATTR not in (func.attrs or {})
    y = tvm.runtime.tensor(np.zeros(x.shape, "float32"))
    tvm.compile(func, target=HOST)(tvm.runtime.tensor(x), tvm.runtime.tensor(table), y)
    np.testing.assert_array_equal(y.numpy(), table[x])


def test_lookup_table_refuses_a_float_input():
    with pytest.raises(ValueError, match="float32 is not uint8 or int8"):
        lookup_table_func((4,), "float32", "uint8")


def test_has_avx512_vbmi_names_the_cpus_with_byte_permutes():
    assert has_avx512_vbmi({"kind": "llvm", "mcpu": "znver4"})
    assert has_avx512_vbmi({"kind": "llvm", "mcpu": "icelake-server"})
    assert not has_avx512_vbmi({"kind": "llvm", "mcpu": "skylake-avx512"}) and not has_avx512_vbmi("cuda")
