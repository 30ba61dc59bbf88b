"""Quantized tensors moved in their own dtype: quantize(move(dequantize(q))) is move(q).

ONNX Runtime's QDQ form wraps every op in a quantize and a dequantize, data movement included:
ConvNeXt's channels-last blocks reshape and transpose a dequantized tensor, then quantize it again
with the same scale and zero point, four float passes where one uint8 transpose does. With one
per-tensor scale s and zero point z on both sides the quantize gives back the moved values
exactly: rint(((q - z) * s) / s) + z = q for every |q - z| <= 255 (float32's relative error is
far below half a step), whatever the rounding of ties. :func:`quantized_data_movement` rewrites
each such quantize to the moves of the quantized tensor; the float ops are dropped where nothing
else reads them.

Moves that undo each other: a dense layer's rows, transposed for the 1x1 convolution that runs it
(:func:`~tvm_ext.transform.quantized_matmul_as_conv2d`), back to rows for an element-wise lookup
and again for the next layer, leave the elements in their order once the lookup runs before them
(:mod:`tvm_ext.strategy.quantized_tables`). :func:`undone_moves` replaces such a chain of moves
with a reshape of its start (a view), found by moving the elements' indices in NumPy.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax

from ..relax_info import DATA_MOVEMENT_OPS, op_name, per_tensor_quantization, static_shape

__all__ = ["quantized_data_movement", "replay_moves", "undone_moves"]

def _args(call) -> list[relax.Expr]:
    """A call's arguments (for a value the type checker cannot narrow)."""
    return list(call.args)


def replay_moves(bb: relax.BlockBuilder, value: relax.Expr, moves: list[relax.Call]) -> relax.Expr:
    """`moves` (data-movement calls, in order) emitted again on `value` in place of their first
    operand: the same movement of another tensor of the same shape."""
    for move in moves:
        value = bb.emit(relax.Call(move.op, [value, *move.args[1:]], move.attrs, move.ty_args))
    return value


def _moved_source(quantize: relax.Call, values: dict) -> tuple[relax.Expr, list[relax.Call]] | None:
    """(q, the moves from q's dequantize to `quantize`, in order) where `quantize` re-quantizes
    moved dequantized values of q with q's own scale, zero point and dtype, else None."""
    quantization = per_tensor_quantization(quantize)
    if quantization is None:
        return None
    moves: list[relax.Call] = []
    value = quantize.args[0]
    while isinstance(value, relax.Var) and op_name(values.get(value)) in DATA_MOVEMENT_OPS:
        move: relax.Call = values[value]
        moves.append(move)
        value = move.args[0]
    dequantize = values.get(value) if isinstance(value, relax.Var) else None
    if op_name(dequantize) != "relax.dequantize" or per_tensor_quantization(dequantize) != quantization:
        return None  # (equal quantizations: the same scale, zero point and dtype)
    return _args(dequantize)[0], moves[::-1]


def _rebinding_pass(name: str, find: Callable[[dict], dict], emit: Callable) -> tvm.transform.Pass:
    """A module pass: in each Relax function, each variable `find(its bindings)` maps to what it
    found is bound to `emit(mutator, binding, found)` instead; what nothing reads any more is
    dropped. The module given is left as it was."""

    @relax.expr_functor.mutator
    class _Rewrite(relax.PyExprMutator):
        def __init__(self, mod: tvm.IRModule, found: dict):
            super().__init__(mod)
            self.found = found

        def visit_var_binding_(self, binding: relax.VarBinding) -> None:
            if binding.var not in self.found:
                super().visit_var_binding_(binding)
                return
            self.set_var_remap(binding.var, emit(self, binding, self.found[binding.var]))

    @tvm.transform.module_pass(opt_level=0, name=name)
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        changed = False
        for gvar, func in list(mod.functions_items()):
            if not isinstance(func, relax.Function) or "Composite" in (func.attrs or {}):
                continue
            found = find({b.var: b.value for block in func.body.blocks for b in block.bindings
                          if isinstance(b, relax.VarBinding)})
            if not found:
                continue
            rewrite = _Rewrite(mod, found)
            rewrite.builder_.update_func(gvar, rewrite.visit_expr(func))
            mod, changed = rewrite.builder_.get(), True
        return relax.transform.DeadCodeElimination()(mod) if changed else mod

    return _pass


def quantized_data_movement() -> tvm.transform.Pass:
    """Rewrite each quantize of moved dequantized values with their own quantization to the moves
    of the quantized tensor (see the module's docstring)."""

    def find(values: dict) -> dict:
        # (an output stays: it is bound once)
        return {var: found for var, value in values.items() if isinstance(var, relax.DataflowVar)
                and op_name(value) == "relax.quantize" and (found := _moved_source(value, values)) is not None}

    def emit(mutator: relax.PyExprMutator, _binding: relax.VarBinding, found: tuple) -> relax.Expr:
        source, moves = found
        return replay_moves(mutator.builder_, mutator.visit_expr(source), moves)

    return _rebinding_pass("tvm_ext.QuantizedDataMovement", find, emit)


def _undone(value: relax.Call, values: dict) -> relax.Expr | None:
    """The tensor t where `value` ends a chain of data moves from t that leaves t's elements in
    their order (two transposes at least: a reshape alone is a view already), else None."""
    moves = [value]
    while isinstance(moves[-1].args[0], relax.Var) and op_name(values.get(moves[-1].args[0])) in DATA_MOVEMENT_OPS:
        moves.append(values[moves[-1].args[0]])
    start = moves[-1].args[0]
    shapes = [shape for shape in [static_shape(start)] + [static_shape(move) for move in reversed(moves)]
              if shape is not None]
    if sum(op_name(move) == "relax.permute_dims" for move in moves) < 2 or len(shapes) != len(moves) + 1:
        return None
    index = np.arange(math.prod(shapes[0])).reshape(shapes[0])
    for move, shape in zip(reversed(moves), shapes[1:], strict=True):
        if op_name(move) == "relax.permute_dims":
            axes = move.attrs.axes
            index = index.transpose(None if axes is None else [int(a) for a in axes])
        else:
            index = index.reshape(shape)
    return start if np.array_equal(index.reshape(-1), np.arange(index.size)) else None


def undone_moves() -> tvm.transform.Pass:
    """Replace each chain of data moves that leaves its start's elements in their order with a
    reshape of its start, or the start itself (see the module's docstring)."""

    def find(values: dict) -> dict:
        return {var: start for var, value in values.items() if op_name(value) in DATA_MOVEMENT_OPS
                and (start := _undone(value, values)) is not None}

    def emit(mutator: relax.PyExprMutator, binding: relax.VarBinding, start: relax.Expr) -> relax.Expr:
        start = mutator.visit_expr(start)
        if static_shape(start) == static_shape(binding.var):
            return start
        return mutator.builder_.emit(relax.op.reshape(start, binding.var.ty.shape), binding.var.name)

    return _rebinding_pass("tvm_ext.UndoneMoves", find, emit)
