"""An int8 convolution reads its fp32 producer's blocks, quantized in one pass.

The int8 lowering (:func:`~.quantized.lower_quantized_conv2d`) runs before the fp32 kernels
exist: an int8 convolution whose input is quantized from a float tensor packs that NCHW uint8
tensor into its blocks (`pack_quantized`). When the float tensor is an fp32 kernel's output,
lowering leaves three passes between the two kernels: the fp32 blocks unpacked to NCHW, stock
TVM's quantize, the pack. :func:`quantize_fp32_blocks` runs on lowered Relax and replaces them
with one kernel that reads the fp32 blocks and writes the int8 kernel's input, border and
padded channels included (:func:`~tvm_ext.kernels.layout.quantized_blocks_func`). PT2E's
EfficientNets and MobileNet-v3 quantize every squeeze-excitation's output this way.
"""

from __future__ import annotations

from typing import TypeGuard

import tvm
from tvm import relax

from ..kernels import layout as _layout
from ..relax_info import static_shape
from .base import called_kernel, rebind_each_function, scalar_constant

__all__ = ["quantize_fp32_blocks"]


def _is_call(expr, op: str = "relax.call_tir") -> TypeGuard[relax.Call]:
    return isinstance(expr, relax.Call) and expr.op == tvm.ir.Op.get(op)


def _replacements(mod: tvm.IRModule,
                  func: relax.Function) -> dict[relax.Var, tuple[list[relax.Expr], tvm.tirx.PrimFunc, str]]:
    """Each pack_quantized binding of `func` whose input is a per-tensor quantize of an fp32
    kernel's NCHW view -> ([the blocked fp32 tensor], the kernel that writes the pack's output
    from it, its name): :func:`~.base.rebind_to_kernels`' calls."""
    values = {b.var: b.value for block in func.body.blocks for b in block.bindings
              if isinstance(b, relax.VarBinding)}

    def value_of(expr: relax.Expr) -> relax.Expr | None:
        while isinstance(expr, relax.Var) and expr in values:
            expr = values[expr]
        return None if isinstance(expr, relax.Var) else expr

    found: dict[relax.Var, tuple[list[relax.Expr], tvm.tirx.PrimFunc, str]] = {}
    for var, value in values.items():
        pack = called_kernel(mod, value, "pack_quantized")
        if pack is None or _layout.PACK_PADDING_ATTR not in pack.attrs:
            continue
        quantize = value_of(value.args[1].fields[0])
        if not _is_call(quantize, "relax.quantize"):
            continue
        scale, zero = scalar_constant(quantize.args[1]), scalar_constant(quantize.args[2])
        unpack = value_of(quantize.args[0])
        if scale is None or zero is None or not _is_call(unpack) or called_kernel(mod, unpack, "unpack_nchwc") is None:
            continue
        blocked = unpack.args[1].fields[0]
        shape, view, out = static_shape(blocked), static_shape(unpack), static_shape(var)
        if shape is None or view is None or out is None or str(blocked.ty.dtype.dtype) != "float32":
            continue  # (a symbolic batch: the pack stays)
        padding = [int(p) for p in pack.attrs[_layout.PACK_PADDING_ATTR]]
        kernel = _layout.quantized_blocks_func(shape, view[1], out[4], padding, scale, int(zero),
                                               str(quantize.attrs.out_dtype))
        found[var] = [blocked], kernel, f"tvm_ext_quantized_blocks_{'x'.join(map(str, out))}"
    return found


def quantize_fp32_blocks(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` (lowered to tvm_ext kernels) with each int8 convolution's input that is quantized
    from an fp32 kernel's output written from that kernel's blocks (see the module's docstring);
    the unpack and quantize are dropped where nothing else reads them."""
    return rebind_each_function(mod, _replacements, "int8 inputs quantized from fp32 blocks")
