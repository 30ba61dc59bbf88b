"""A quantized dense layer reads and writes its rows: one pass each side, not a transpose and a pack.

A dense layer runs as a 1x1 convolution over a 1 x M image of its (M, K) input's transpose
(:func:`~tvm_ext.transform.quantized_matmul_as_conv2d`). Lowered, its int8 kernel's input is
permute_dims + reshape of the matrix (a byte transpose, stock TVM) then pack_quantized (another),
and its output unpack_quantized (a third) then reshape + permute_dims (a fourth): ORT's QDQ
ConvNeXt has 36 such layers at up to 3136 rows. In the blocked layout the matrix's rows are
runs of `block` channels already: :func:`quantized_dense_rows` replaces each side with one
kernel that copies those runs (:func:`~tvm_ext.kernels.layout.pack_quantized_rows_func`,
:func:`~tvm_ext.kernels.layout.unpack_quantized_rows_func`).
"""

from __future__ import annotations

from typing import TypeGuard

import tvm
from tvm import relax

from ..kernels import layout as _layout
from ..relax_info import is_call, static_shape
from .base import called_kernel, rebind_each_function

__all__ = ["quantized_dense_rows"]


def _transposed(value) -> TypeGuard[relax.Call]:
    """Whether `value` is the transpose of a matrix: permute_dims(., [1, 0]), or with no axes (all
    reversed: a training graph's transposes are so)."""
    if not is_call(value, "relax.permute_dims"):
        return False
    axes = value.attrs.axes
    return getattr(value.args[0].ty, "ndim", -1) == 2 if axes is None else [int(a) for a in axes] == [1, 0]


def _replacements(mod: tvm.IRModule, func: relax.Function) -> dict:
    """Each binding of `func` that a rows kernel computes -> ([its argument], the kernel, its name)."""
    values = {b.var: b.value for block in func.body.blocks for b in block.bindings
              if isinstance(b, relax.VarBinding)}

    def bound(expr):
        return values.get(expr) if isinstance(expr, relax.Var) else None

    found = {}
    for var, value in values.items():
        pack = called_kernel(mod, value, "pack_quantized")
        if pack is not None and _layout.PACK_ZERO_ATTR in pack.attrs:
            image = bound(value.args[1].fields[0])
            transposed = bound(image.args[0]) if is_call(image, "relax.reshape") else None
            blocked = static_shape(var)
            if _transposed(transposed) and not any(int(p) for p in pack.attrs[_layout.PACK_PADDING_ATTR]) \
                    and blocked is not None and blocked[0] == blocked[2] == 1:
                matrix = transposed.args[0]
                shape = static_shape(matrix)
                if shape is not None and len(shape) == 2 and shape[0] == blocked[3]:
                    zero = int(pack.attrs[_layout.PACK_ZERO_ATTR])
                    kernel = _layout.pack_quantized_rows_func(*shape, blocked[4], zero, str(matrix.ty.dtype.dtype))
                    found[var] = ([matrix], kernel.without_attr("global_symbol"),
                                  f"tvm_ext_pack_quantized_rows_{'x'.join(map(str, shape))}_{blocked[4]}_z{zero}")
        if _transposed(value):  # (M, N) = permute_dims(reshape(unpack_quantized(blocks), (N, M)))
            reshaped = bound(value.args[0])
            unpack = bound(reshaped.args[0]) if is_call(reshaped, "relax.reshape") else None
            if unpack is None or called_kernel(mod, unpack, "unpack_quantized") is None:
                continue
            blocks = unpack.args[1].fields[0]
            blocked, rows = static_shape(blocks), static_shape(var)
            if blocked is None or rows is None or blocked[0] != 1 or blocked[2] != 1 or blocked[3] != rows[0]:
                continue
            kernel = _layout.unpack_quantized_rows_func(blocked, rows[1], str(var.ty.dtype.dtype))
            found[var] = ([blocks], kernel.without_attr("global_symbol"),
                          f"tvm_ext_unpack_quantized_rows_{'x'.join(map(str, rows))}_{var.ty.dtype.dtype}")
    return found


def quantized_dense_rows(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` (lowered to tvm_ext kernels) with each quantized dense layer's input packed from its
    rows and its output written as rows (see the module's docstring); the transposes, the pack
    and the unpack are dropped where nothing else reads them."""
    return rebind_each_function(mod, _replacements, "quantized dense inputs and outputs as rows")
