"""A training-mode batch norm whose running statistics are read (a training step's new states)
gets a second batch norm call for them, so that its normalized output can still fuse with the
relu and shortcut after it: a fused pattern may not leak values from inside it, and (y, new
mean, new variance) would. The lowering computes the statistics once for both calls
(:meth:`~tvm_ext.strategy.cpu.CpuEmitter.batch_norm_statistics`): the second call reads no
tensor again."""

from __future__ import annotations

import tvm
from tvm import relax

__all__ = ["split_running_statistics"]

_STATISTICS = (1, 2)  # batch_norm's outputs: y, the new running mean, the new running variance


def split_running_statistics() -> tvm.transform.Pass:
    """The pass: in each dataflow block, `s = bn[1]`, `t = bn[2]` of a training-mode `bn` whose y
    is also read become reads of a copy of `bn`'s call, bound with them just before the first
    binding that reads `s` or `t` (for a training step's states: the block's end), so after the
    ops that consume y."""
    batch_norm = tvm.ir.Op.get("relax.nn.batch_norm")

    def is_training_norm(value) -> bool:
        return isinstance(value, relax.Call) and value.op.same_as(batch_norm) and bool(value.attrs.training)

    def split(block: relax.DataflowBlock) -> relax.DataflowBlock:
        bindings = list(block.bindings)
        norms = {b.var: b for b in bindings if isinstance(b, relax.VarBinding) and is_training_norm(b.value)}
        reads: dict[relax.Var, list[relax.VarBinding]] = {}  # bn -> the bindings of bn[1], bn[2]
        others: set[relax.Var] = set()  # batch norms something else reads (y, or the tuple)
        for binding in bindings:
            value = binding.value
            if isinstance(value, relax.TupleGetItem) and value.tuple_value in norms and value.index in _STATISTICS:
                reads.setdefault(value.tuple_value, []).append(binding)
            else:
                for var in relax.analysis.free_vars(value):
                    if var in norms:
                        others.add(var)
        moved = {id(b) for norm, found in reads.items() if norm in others for b in found}
        if not moved:
            return block
        pending: list[tuple[set, list[relax.Binding]]] = []  # (variables, the bindings that define them)
        for norm, found in reads.items():
            if norm not in others:
                continue
            copy = relax.DataflowVar(f"{norm.name}_statistics", norm.ty)
            split_bindings = [relax.VarBinding(copy, norms[norm].value)]
            split_bindings += [relax.VarBinding(b.var, relax.TupleGetItem(copy, b.value.index)) for b in found]
            pending.append(({b.var for b in found}, split_bindings))
        out: list[relax.Binding] = []
        for binding in bindings:
            if id(binding) in moved:
                continue
            free = set(relax.analysis.free_vars(binding.value))
            for entry in [p for p in pending if p[0] & free]:
                out.extend(entry[1])
                pending.remove(entry)
            out.append(binding)
        for _, split_bindings in pending:
            out.extend(split_bindings)
        return relax.DataflowBlock(out, block.span)

    @tvm.transform.module_pass(opt_level=0, name="tvm_ext.SplitRunningStatistics")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = mod.clone()  # the caller's module stays as it was
        for gvar, func in mod.functions_items():
            if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
                continue
            blocks = [split(b) if isinstance(b, relax.DataflowBlock) else b for b in func.body.blocks]
            if any(not new.same_as(old) for new, old in zip(blocks, func.body.blocks, strict=True)):
                body = relax.SeqExpr(blocks, func.body.body, func.body.span)
                mod[gvar] = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span)
        return mod

    return _pass
