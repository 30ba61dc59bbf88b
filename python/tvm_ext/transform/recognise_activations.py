"""Activations that importers write out as several ops, recognised as the one op a convolution's
epilogue applies."""

from __future__ import annotations

import tvm
from tvm import relax

__all__ = ["recognise_silu"]


def recognise_silu() -> tvm.transform.Pass:
    """x * sigmoid(x), either operand order (how EfficientNet's SiLU arrives through torch.export)
    ==>  silu(x), which a convolution's epilogue applies. The sigmoid stays where something else
    reads it."""
    from tvm.relax.dpl import is_op, rewrite_call, wildcard

    x = wildcard()
    pattern = is_op("relax.multiply")(x, is_op("relax.sigmoid")(x))  # multiply matches commutatively

    @tvm.transform.module_pass(opt_level=0, name="tvm_ext.RecogniseSiLU")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = mod.clone()  # the caller's module stays as it was
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                mod[gvar] = rewrite_call(pattern, lambda _orig, matched: relax.op.nn.silu(matched[x]), func)
        return mod

    return _pass
