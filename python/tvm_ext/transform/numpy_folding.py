"""Arithmetic on constants done in NumPy at build time, before TVM's FoldConstant.

FoldConstant compiles every op it folds (legalized, lowered, LLVM) and runs it: about 50 ms an
op. Networks that compute their weights in the graph pay that per layer: timm's NFNets
standardize each convolution's weights (reshape, scale, instance norm, reshape: 57 layers), and
FoldConstant took 15 of dm_nfnet_f0's 22 s of build. The ops below are folded here instead, in
float32 as TVM computes them (the norm's statistics in float64, rounded once); any other op on
constants is left to FoldConstant.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ..relax_info import constant_array, dtype, op_name, static_shape

__all__ = ["fold_constants_in_numpy"]

_BINARY = {"relax.add": np.add, "relax.subtract": np.subtract, "relax.multiply": np.multiply,
           "relax.divide": np.divide}


def _instance_norm(call: relax.Call, data: np.ndarray, gamma: np.ndarray, beta: np.ndarray) -> np.ndarray | None:
    """topi's instance norm: (x - mean) / sqrt(var + eps) * gamma + beta over `axes`, gamma and
    beta (C,) along the channel axis. None where center or scale is off (the legalization ignores
    them: leave that to FoldConstant, which computes what TVM would) or gamma / beta are shaped
    otherwise."""
    attrs = call.attrs
    channels = data.shape[int(attrs.channel_axis) % data.ndim]
    if not (attrs.center and attrs.scale) or gamma.shape != (channels,) or beta.shape != (channels,):
        return None
    x = data.astype(np.float64)
    axes = tuple(int(a) % x.ndim for a in attrs.axes)
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    along = [1] * x.ndim
    along[int(attrs.channel_axis) % x.ndim] = -1
    out = (x - mean) / np.sqrt(var + float(attrs.epsilon)) * gamma.reshape(along) + beta.reshape(along)
    return out


def _fold(call: relax.Call, arrays: list[np.ndarray], out_shape: tuple[int, ...]) -> np.ndarray | None:
    """`call` on the constant `arrays` (float32), or None where it is not folded here."""
    name = op_name(call)
    if name in _BINARY and len(arrays) == 2:
        return _BINARY[name](arrays[0], arrays[1])
    if name == "relax.reshape":
        return arrays[0].reshape(out_shape)
    if name == "relax.permute_dims":
        axes = call.attrs.axes
        return np.transpose(arrays[0], None if axes is None else [int(a) for a in axes])
    if name == "relax.nn.instance_norm" and len(arrays) == 3:
        return _instance_norm(call, *arrays)
    return None


def _float32_array(expr) -> np.ndarray | None:
    array = constant_array(expr)
    return array if array is not None and array.dtype == np.float32 else None


def fold_constants_in_numpy() -> tvm.transform.Pass:
    """The pass: each binding of an op above whose tensor operands are float32 constants (a
    reshape's shape aside) becomes the constant it computes; its uses read that constant."""

    @relax.expr_functor.mutator
    class _Folder(relax.PyExprMutator):
        def __init__(self, mod: tvm.IRModule):
            super().__init__(mod)
            self.known: dict[relax.Var, relax.Expr] = {}

        def visit_var_(self, var: relax.Var) -> relax.Expr:
            return self.known.get(var, var)

        def visit_dataflow_var_(self, var: relax.DataflowVar) -> relax.Expr:
            return self.known.get(var, var)

        def visit_var_binding_(self, binding: relax.VarBinding) -> None:
            value = self.visit_expr(binding.value)
            folded = self._folded(value, binding.var)
            if folded is not None:
                self.known[binding.var] = folded
                value = folded
            self.builder_.emit_normalized(relax.VarBinding(binding.var, value))

        @staticmethod
        def _folded(value: relax.Expr, var: relax.Var) -> relax.Expr | None:
            out_shape = static_shape(var)
            if (not isinstance(value, relax.Call) or out_shape is None
                    or dtype(var) != "float32"):
                return None
            operands = value.args[:1] if op_name(value) == "relax.reshape" else value.args
            arrays = [a for a in map(_float32_array, operands) if a is not None]
            if not arrays or len(arrays) != len(operands):
                return None
            with np.errstate(all="ignore"):  # a division by zero gives inf, as TVM's would
                result = _fold(value, arrays, out_shape)
            if result is None or tuple(result.shape) != out_shape:
                return None
            return relax.const(np.ascontiguousarray(result, dtype=np.float32))

    @tvm.transform.module_pass(opt_level=0, name="tvm_ext.FoldConstantsInNumPy")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        folder = _Folder(mod)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                folder.builder_.update_func(gvar, folder.visit_expr(func))
        return folder.builder_.get()

    return _pass
