"""The module pass around a `relax.dpl.rewrite_call` rewrite, which several passes share."""

from __future__ import annotations

import tvm
from tvm import relax

__all__ = ["rewriting_pass"]


def rewriting_pass(name: str, pattern, rewriter) -> tvm.transform.Pass:
    """A module pass that rewrites each Relax function's calls matching `pattern` with `rewriter`
    (relax.dpl.rewrite_call), on a copy of the module (the caller's stays as it was)."""
    from tvm.relax.dpl import rewrite_call

    @tvm.transform.module_pass(opt_level=0, name=name)
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = mod.clone()
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                mod[gvar] = rewrite_call(pattern, rewriter, func)
        return mod

    return _pass
