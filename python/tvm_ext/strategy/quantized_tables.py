"""Element-wise chains between quantized tensors as 256-entry lookup tables.

ONNX Runtime's QDQ form quantizes every op it can: ConvNeXt's GELU, x * (erf(x / sqrt 2) + 1)
* 0.5, is five float ops, each between a quantize and a dequantize, that stock TVM runs as float
passes over the tensor (erf unvectorized: 21 of int8 ConvNeXt-T's 70 ms at 224x224). Every value
of such a chain is a function of one uint8 or int8 tensor, element by element: its 256 possible
values give a table, and the chain is one lookup a value (ONNX Runtime's QLinearLookup idea).

:func:`quantized_lookup_tables` finds each chain (from a per-tensor dequantize, the element-wise
float ops and quantize / dequantize pairs whose every non-constant operand is in the chain; a
constant is a scalar, or a variable bound to the dequantize of one: ORT quantizes GELU's 1.0 and
0.5 too), and replaces the quantized values the rest of the graph reads with one
:func:`~tvm_ext.kernels.elementwise.lookup_table_func` call each, on the tensor the chain's source
is moved from (the moves after it). The tables are computed at build
time in NumPy with the graph's float32 arithmetic (relax's ops; the transcendental functions in
float64 rounded to float32, within an ulp of TVM's) and quantizes rounding to nearest even, as
ONNX and PyTorch round and as tvm_ext's fake quantization does.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax

from ..kernels.elementwise import lookup_table_func
from ..relax_info import DATA_MOVEMENT_OPS, op_name, per_tensor_quantization, prim_value, scalar_array, static_shape
from ..target import TargetLike
from .base import readers_of, rebind_to_kernels

__all__ = ["LOOKUP_KERNEL", "LOOKUP_ZEROS_ATTR", "quantized_lookup_tables"]

logger = logging.getLogger("tvm_ext")

LOOKUP_KERNEL = "tvm_ext_quantized_lookup"  # the kernels' name prefix (dispatch_report)
# on the lookup kernels: [the source's zero point, the output's], which the int8 lowering needs
# to run a lookup on an int8 kernel's blocks (their padding holds the source's zero point)
LOOKUP_ZEROS_ATTR = "tvm_ext.lookup_zero_points"
_RANGES = {"uint8": (0, 255), "int8": (-128, 127)}


def _float64_map(f: Callable[[float], float]) -> Callable[[np.ndarray], np.ndarray]:
    return lambda x: np.array([f(float(v)) for v in x], np.float64).astype(np.float32)


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v)) if v >= 0 else math.exp(v) / (1.0 + math.exp(v))


# relax's element-wise float32 ops: (operands: arrays or float32 scalars) -> float32
_UNARY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "relax.erf": _float64_map(math.erf),
    "relax.tanh": _float64_map(math.tanh),
    "relax.exp": _float64_map(lambda v: math.exp(min(v, 709.0))),
    "relax.sigmoid": _float64_map(_sigmoid),
    "relax.sqrt": _float64_map(lambda v: math.sqrt(v) if v >= 0 else math.nan),
    "relax.nn.gelu": _float64_map(lambda v: 0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0)))),
    "relax.nn.gelu_tanh": _float64_map(
        lambda v: 0.5 * v * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))),
    "relax.nn.silu": _float64_map(lambda v: v * _sigmoid(v)),
    "relax.nn.relu": lambda x: np.maximum(x, np.float32(0)),
    "relax.negative": np.negative,
    "relax.abs": np.abs,
    "relax.square": np.square,
}
_BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "relax.add": np.add, "relax.subtract": np.subtract, "relax.multiply": np.multiply,
    "relax.divide": np.divide, "relax.maximum": np.maximum, "relax.minimum": np.minimum,
}
_QDQ = ("relax.quantize", "relax.dequantize")


def _scalar(expr) -> np.float32 | None:
    """A float32 constant holding one number, as a NumPy scalar."""
    array = scalar_array(expr)
    return np.float32(array[0]) if array is not None and array.dtype == np.float32 else None


def _evaluate(value: relax.Call, operands: list) -> np.ndarray:
    """`value`'s result for its `operands` (arrays where a variable, scalars where a float32
    constant; quantize and dequantize read their parameters from the call)."""
    name, quantization = op_name(value) or "", per_tensor_quantization(value)
    if quantization is not None:
        scale, zero = np.float32(quantization.scale), np.float32(quantization.zero_point)
        if name == "relax.dequantize":
            return (operands[0].astype(np.float32) - zero) * scale
        low, high = _RANGES[quantization.dtype]
        return np.clip(np.rint(operands[0] / scale) + zero, low, high).astype(quantization.dtype)
    if name == "relax.clip":
        low, high = (prim_value(arg) or 0.0 for arg in value.args[1:])  # (numbers: _joins checked)
        return np.clip(operands[0], np.float32(low), np.float32(high))
    if name in _UNARY:
        return _UNARY[name](operands[0]).astype(np.float32)
    with np.errstate(all="ignore"):
        return _BINARY[name](*operands).astype(np.float32)


class _Chain:
    """One chain: its root dequantize's operand (the quantized tensor), its bindings in program
    order, and the quantized values read outside it."""

    def __init__(self, source: relax.Expr, dtype: str, zero_point: int, shape: tuple[int, ...],
                 constants: dict[relax.Var, np.float32]):
        self.source, self.dtype, self.zero_point, self.shape = source, dtype, zero_point, shape
        self.constants = constants  # the function's variables that hold one float32 number
        self.bindings: dict[relax.Var, relax.Call] = {}
        self.outputs: list[relax.Var] = []

    def tables(self) -> dict[relax.Var, np.ndarray]:
        """Each output's value for each of the source's 256 values, in order."""
        low, high = _RANGES[self.dtype]
        values: dict = {self.source: np.arange(low, high + 1).astype(self.dtype), **self.constants}
        for var, value in self.bindings.items():
            values[var] = _evaluate(value, [values[arg] if isinstance(arg, relax.Var) else _scalar(arg)
                                            for arg in value.args])
        return {var: values[var] for var in self.outputs}


def _joins(value, chain: _Chain, shape: tuple) -> bool:
    """Whether `value` is an element-wise op of chain values (and scalar constants) of the chain's shape."""
    name = op_name(value)
    variables = [arg for arg in value.args if isinstance(arg, relax.Var) and arg not in chain.constants] \
        if name is not None else []
    if not variables or any(v not in chain.bindings for v in variables) or static_shape(value) != shape:
        return False
    if name in _QDQ:
        if per_tensor_quantization(value) is None:
            return False
        return name == "relax.dequantize" or str(value.args[0].ty.dtype.dtype) == "float32"
    if any(str(v.ty.dtype.dtype) != "float32" for v in variables):
        return False
    constants = [arg for arg in value.args if not isinstance(arg, relax.Var)]
    if name == "relax.clip":
        return all(prim_value(arg) is not None for arg in constants)
    return (name in _UNARY and len(value.args) == 1) or (name in _BINARY and len(value.args) == 2 and all(
        arg in chain.constants if isinstance(arg, relax.Var) else _scalar(arg) is not None for arg in value.args
        if not (isinstance(arg, relax.Var) and arg in chain.bindings)))


def _scalar_variables(bindings: list) -> dict[relax.Var, np.float32]:
    """The variables bound to one float32 number: the per-tensor dequantize of a one-element
    constant (ONNX Runtime's QDQ form quantizes an op's scalar operands as well), by value."""
    numbers = {}
    for var, value in bindings:
        array = scalar_array(value.args[0]) if op_name(value) == "relax.dequantize" else None
        if array is not None and per_tensor_quantization(value) is not None:
            numbers[var] = np.float32(_evaluate(value, [array])[0])
    return numbers


def _chains(func: relax.Function) -> list[_Chain]:
    """The chains of `func` (see the module's docstring), each with a float op at least and read
    outside only through quantized values."""
    bindings = [(b.var, b.value) for block in func.body.blocks for b in block.bindings
                if isinstance(b, relax.VarBinding)]
    readers = readers_of(func)
    read_at: dict[relax.Var, list[int]] = {}  # each variable's readers by their bindings' index
    for i, (_, value) in enumerate(bindings):
        for arg in value.args if isinstance(value, relax.Call) else []:
            if isinstance(arg, relax.Var):
                read_at.setdefault(arg, []).append(i)
    constants = _scalar_variables(bindings)
    claimed: set = set()
    chains = []
    for root, value in bindings:
        quantization = per_tensor_quantization(value) if op_name(value) == "relax.dequantize" else None
        shape = static_shape(value)
        if root in claimed or quantization is None or shape is None or not isinstance(value.args[0], relax.Var):
            continue
        chain = _Chain(value.args[0], quantization.dtype, quantization.zero_point, shape, constants)
        chain.bindings[root] = value
        # grown through readers in program order (a heap: each index is pushed by a binding before
        # it, so when one is taken every binding before it has been decided)
        pending, seen = list(read_at.get(root, [])), set()
        heapq.heapify(pending)
        while pending:
            at = heapq.heappop(pending)
            var, later = bindings[at]
            if at not in seen and _joins(later, chain, shape):
                chain.bindings[var] = later
                for reader_at in read_at.get(var, []):
                    heapq.heappush(pending, reader_at)
            seen.add(at)
        # a float value read outside would be computed anyway: it leaves, and so does what reads it
        changed = True
        while changed:
            changed = False
            for var, later in list(chain.bindings.items()):
                escapes = any(reader is None or not any(reader.same_as(v) for v in chain.bindings.values())
                              for reader in readers.get(var, []))
                inputs_left = any(isinstance(arg, relax.Var) and arg not in chain.bindings and arg not in constants
                                  and not arg.same_as(chain.source) for arg in later.args)
                # (the root may stay for readers outside: the tables start from its operand)
                if var is not root and ((escapes and str(var.ty.dtype.dtype) == "float32") or inputs_left):
                    del chain.bindings[var]
                    changed = True
        chain.outputs = [var for var, later in chain.bindings.items() if op_name(later) == "relax.quantize" and any(
            reader is None or not any(reader.same_as(v) for v in chain.bindings.values())
            for reader in readers.get(var, []))]
        if chain.outputs and any(op_name(v) not in _QDQ for v in chain.bindings.values()):
            claimed.update(chain.bindings)
            chains.append(chain)
    return chains


def _unmoved(expr: relax.Expr, values: dict) -> tuple[relax.Expr, list[relax.Call]]:
    """(t, the data moves from t to `expr`, in order): `expr` followed back through moves."""
    moves: list[relax.Call] = []
    while isinstance(expr, relax.Var) and op_name(values.get(expr)) in DATA_MOVEMENT_OPS:
        moves.append(values[expr])
        expr = values[expr].args[0]
    return expr, moves[::-1]


def quantized_lookup_tables(target: TargetLike = None) -> tvm.transform.Pass:
    """Replace each element-wise chain between quantized tensors with table lookups (see the
    module's docstring) for `target` (None: the lookup any CPU runs), each on the quantized
    tensor its source is moved from, then those moves: an element-wise function commutes with
    data movement, and the moves then meet their inverses (:func:`~tvm_ext.transform.undone_moves`:
    a dense layer's rows transposed for a GELU and back) and the lookup its source's blocks (the
    int8 lowering). What nothing reads any more is dropped."""

    @tvm.transform.module_pass(opt_level=0, name="tvm_ext.QuantizedLookupTables")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for gvar, func in list(mod.functions_items()):
            if not isinstance(func, relax.Function) or "Composite" in (func.attrs or {}):
                continue
            values = relax.analysis.get_var2val(func)
            lookups, moved = {}, {}
            for chain in _chains(func):
                source, moves = _unmoved(chain.source, values)
                shape = static_shape(source)
                if shape is None:
                    source, moves, shape = chain.source, [], chain.shape
                for var, table in chain.tables().items():
                    out_dtype = str(var.ty.dtype.dtype)
                    # (private: this runs before TVM's library dispatch, which finds public symbols twice)
                    quantization = per_tensor_quantization(chain.bindings[var])  # (an output is a quantize: _joins)
                    out_zero = quantization.zero_point if quantization is not None else 0
                    kernel = lookup_table_func(shape, chain.dtype, out_dtype, target)
                    kernel = kernel.without_attr("global_symbol").with_attr(LOOKUP_ZEROS_ATTR,
                                                                           [chain.zero_point, out_zero])
                    name = f"{LOOKUP_KERNEL}_{'x'.join(map(str, shape))}"
                    lookups[var] = ([source, relax.const(table)], kernel, name)
                    moved[var] = (relax.TensorType(shape, out_dtype), moves)
            if lookups:
                mod = rebind_to_kernels(mod, gvar, func, lookups, moved)
                logger.debug("tvm_ext: %d quantized values as table lookups", len(lookups))
        return mod

    return _pass
