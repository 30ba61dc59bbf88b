"""One arena per function for the tensors TVM's memory planner placed, at offsets planned from
each tensor's own lifetime.

`relax.transform.StaticPlanBlockMemory` reuses a storage for a tensor whose predecessor in it is
dead, so a storage lives from its first tensor to its last one's last use: in a training step,
where forward activations wait for the backward pass, nearly every storage is alive at the peak,
and the VM's pooled allocator keeps one buffer per storage size: ResNet-50's training step at
batch 16 planned 1015 MiB of storages, where one arena needs 834. Here every
tensor of a constant-sized planned storage gets an offset in one arena instead (greedy by size:
the largest first, each at the lowest offset free over its lifetime), as TFLite's and MNN's
planners do.

A tensor's lifetime runs from its `alloc_tensor` to the last binding that reads it or anything
bound from it (a view, a tuple, a rebinding: every binding whose value names a variable is taken
to alias it, which can only lengthen lifetimes), except that a field taken out of a tuple built
in the function aliases that field alone (a kernel's outputs come as a tuple: a batch norm
gradient's dgamma and dbeta are returned, its dX is not). Tensors the function returns keep their own
storages. Functions with control flow or nested functions are left as they are.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax

__all__ = ["ALIGNMENT", "plan_arena"]

ALIGNMENT = 256  # bytes between tensors' offsets (TVM's kernels assume 64)

_ALLOC_STORAGE = tvm.ir.Op.get("relax.memory.alloc_storage")
_ALLOC_TENSOR = tvm.ir.Op.get("relax.memory.alloc_tensor")


def _call_of(binding: relax.Binding, op: tvm.ir.Op) -> relax.Call | None:
    value = binding.value
    return value if isinstance(value, relax.Call) and value.op.same_as(op) else None


def _constant_ints(expr: relax.Expr) -> list[int] | None:
    if not isinstance(expr, relax.ShapeExpr) or not all(isinstance(v, tvm.tirx.IntImm) for v in expr.values):
        return None
    return [int(v) for v in expr.values]


def _tensor_bytes(call: relax.Call) -> int | None:
    """The bytes an `alloc_tensor` call's tensor covers, if its shape and offset are constants."""
    _, offset, shape, dtype = call.args[:4]
    dims = _constant_ints(shape)
    if dims is None or not isinstance(offset, tvm.tirx.IntImm):
        return None
    dt = tvm.runtime.DataType(str(dtype.value))
    return int(offset) + math.prod(dims) * ((dt.bits * dt.lanes + 7) // 8)


def _offsets(tensors: dict[relax.Var, tuple[int, int, int]]) -> tuple[dict[relax.Var, int], int]:
    """Offsets for tensors -> (bytes, first binding, last binding) such that no two whose
    lifetimes overlap overlap in the arena: the largest first, each at the lowest gap that fits
    it among those placed that it meets. Returns the offsets and the arena's size."""
    placed: list[tuple[int, int, int, int]] = []  # (offset, end, first, last)
    offsets, size = {}, 0
    for var, (nbytes, first, last) in sorted(tensors.items(), key=lambda item: (-item[1][0], item[1][1])):
        need = -(-nbytes // ALIGNMENT) * ALIGNMENT
        offset = 0
        for start, end, _, _ in sorted(p for p in placed if p[2] <= last and first <= p[3]):
            if start - offset >= need:
                break
            offset = max(offset, end)
        placed.append((offset, offset + need, first, last))
        offsets[var] = offset
        size = max(size, offset + need)
    return offsets, size


def _plan(func: relax.Function) -> relax.Function:
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        return func
    bindings = [binding for block in body.blocks for binding in block.bindings]
    storages: dict[relax.Var, relax.Call] = {}  # planned storages of constant size
    tensors: dict[relax.Var, list] = {}  # tensor -> [bytes, first, last, storage]
    aliases: dict[relax.Var, set[relax.Var]] = {}  # variable -> the tensors it may point into
    hosted: dict[relax.Var, list[relax.Var]] = {}  # storage -> its tensors
    fields: dict[relax.Var, list[relax.Expr]] = {}  # tuples built here -> their fields
    for index, binding in enumerate(bindings):
        value = binding.value
        if isinstance(value, (relax.If, relax.Function)):
            return func
        storage = _call_of(binding, _ALLOC_STORAGE)
        if storage is not None:
            if _constant_ints(storage.args[0]) is not None:
                storages[binding.var] = storage
            continue
        tensor = _call_of(binding, _ALLOC_TENSOR)
        if tensor is not None and tensor.args[0] in storages:
            hosted.setdefault(tensor.args[0], []).append(binding.var)
            nbytes = _tensor_bytes(tensor)
            if nbytes is not None:
                tensors[binding.var] = [nbytes, index, index, tensor.args[0]]
                aliases[binding.var] = {binding.var}
                continue
        if isinstance(value, relax.Tuple):
            fields[binding.var] = list(value.fields)
        if isinstance(value, relax.TupleGetItem) and value.tuple_value in fields:
            value = fields[value.tuple_value][value.index]  # that field's tensors, not its siblings'
        reached = set().union(*(aliases.get(var, ()) for var in relax.analysis.free_vars(value)))
        for var in reached:
            tensors[var][2] = index
        if reached:
            aliases[binding.var] = reached
    for var in relax.analysis.free_vars(body.body):  # returned: they keep their own storages
        for tensor in aliases.get(var, ()):
            tensors.pop(tensor, None)
    groups: dict[tuple, dict[relax.Var, tuple[int, int, int]]] = {}
    for var, (nbytes, first, last, storage) in tensors.items():
        _, device, scope, _ = storages[storage].args
        groups.setdefault((str(device), str(scope)), {})[var] = (nbytes, first, last)
    arenas, placement = [], {}
    for group in groups.values():
        offsets, size = _offsets(group)
        moved = {tensors[var][3] for var in group}
        freed = [storage for storage in moved if all(var in group for var in hosted[storage])]
        if size >= sum((_constant_ints(storages[storage].args[0]) or [0])[0] for storage in freed):
            continue  # the storages pack these tensors as tightly already (greedy is not optimal)
        first_storage = storages[tensors[next(iter(group))][3]]
        arena = relax.Var("tvm_ext_arena", relax.ObjectType())
        _, device, scope, dtype = first_storage.args
        arenas.append(relax.VarBinding(arena, relax.op.memory.alloc_storage(
            relax.ShapeExpr([size]), device, scope, dtype)))
        placement.update({var: (arena, offset) for var, offset in offsets.items()})
    if not placement:
        return func
    still_used = set()
    for binding in bindings:  # storages with a tensor left in them (a returned one, a symbolic shape)
        tensor = _call_of(binding, _ALLOC_TENSOR)
        if tensor is not None and binding.var not in placement:
            still_used.add(tensor.args[0])
    blocks = []
    for number, block in enumerate(body.blocks):
        new = list(arenas) if number == 0 else []
        for binding in block.bindings:
            if binding.var in storages and binding.var not in still_used:
                continue
            if binding.var in placement:
                arena, offset = placement[binding.var]
                _, old_offset, shape, dtype, device_index = binding.value.args
                offset += int(old_offset)
                alloc = relax.op.memory.alloc_tensor(arena, tvm.tirx.IntImm("int64", offset), shape, dtype,
                                                     device_index)
                if offset:  # kernels take tensors whose byte_offset is 0: the offset goes into the pointer
                    raw = relax.Var(f"{binding.var.name}_in_arena", binding.var.ty)
                    new.append(relax.VarBinding(raw, alloc))
                    alloc = relax.op.memory.ensure_zero_offset(raw)
                binding = relax.VarBinding(binding.var, alloc)
            new.append(binding)
        blocks.append(relax.BindingBlock(new) if not isinstance(block, relax.DataflowBlock)
                      else relax.DataflowBlock(new))
    return relax.Function(func.params, relax.SeqExpr(blocks, body.body), func.ret_ty, func.is_pure, func.attrs,
                          func.span)


def plan_arena() -> tvm.transform.Pass:
    """The pass (module docstring); it runs right after `relax.transform.StaticPlanBlockMemory`."""

    @tvm.transform.module_pass(opt_level=0, name="tvm_ext.PlanArena")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        builder = relax.BlockBuilder(mod)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                planned = _plan(func)
                if not planned.same_as(func):
                    builder.update_func(gvar, planned)
        return builder.get()

    return _pass
