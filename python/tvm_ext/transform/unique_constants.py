"""One constant per use: the graph a gradient writes may use one Constant object at several sites
(TVM's relu gradient and tvm_ext's use their zero twice), and FuseOpsByPattern then fails with
"appears in multiple partitions ... not single-site assignment". Each further use gets a copy of
the node (the same tensor, not a copy of its data)."""

from __future__ import annotations

import tvm
from tvm import relax

__all__ = ["unique_constants"]


def unique_constants() -> tvm.transform.Pass:
    """The pass: every Relax function's second and later uses of a Constant object become
    Constants of their own over the same data."""

    @relax.expr_functor.mutator
    class _Unique(relax.PyExprMutator):
        def __init__(self, mod: tvm.IRModule):
            super().__init__(mod)
            self.seen: set[int] = set()

        def visit_generic_const_(self, const: tvm.ir.expr.GenericConst) -> relax.Expr:
            if hash(const) not in self.seen:
                self.seen.add(hash(const))
                return const
            return tvm.ir.expr.GenericConst(const.value, const.ty, const.span)

    @tvm.transform.module_pass(opt_level=0, name="tvm_ext.UniqueConstants")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mutator = _Unique(mod)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                mutator.builder_.update_func(gvar, mutator.visit_expr(func))
        return mutator.builder_.get()

    return _pass
