"""Convolutions write the zero border their consumer reads: no padded copies between layers.

A padded convolution reads its input with a zero border (the blocked data layout carries it).
When that input is another tvm_ext convolution's blocked output, the emitter first produces a
`pad_nchwc` call: a copy of the whole tensor into a larger one (about 9% of MobileNet-v2's time
on this machine, before the depthwise layers). :func:`write_borders` removes those copies after
lowering: a convolution whose output only feeds a `pad_nchwc` is rebuilt with that border
(:attr:`tvm_ext.kernels.conv2d.Epilogue.out_pad`) and writes the padded tensor itself, so the
activations take no more memory than the padded input always did.

It runs on lowered Relax (call_tir of our kernels), after dead code elimination: a conv output
that something else still reads (a shortcut, the graph's output, an NCHW view) keeps its copy.

In a gradient graph the activation y before a padded convolution has a second reader: the data
gradient's mask (where(y > 0, dY, 0)), in the backward pass. :func:`read_masks_padded` first
points such masks at the padded copy, which the convolution's weight gradient keeps alive
anyway (:attr:`~tvm_ext.kernels.conv2d.Epilogue.mask_pad`): y then dies in the forward pass (a
batch norm's output: 88 MB of ResNet-50's batch-16 step), or its producer writes the border.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable

import tvm
from tvm import relax

from ..kernels import conv2d as _conv
from ..kernels.batch_loop import BATCHED_ATTR, batch_loop
from ..kernels.layout import PADDING_ATTR
from ..tuning import space as _space
from .base import readers_of

logger = logging.getLogger("tvm_ext")

KernelMaker = Callable[[_conv.Conv2dPlan, _conv.Epilogue], tvm.tirx.PrimFunc]


def _called_kernel(mod: tvm.IRModule, value) -> tvm.tirx.PrimFunc | None:
    """The PrimFunc `value` calls if it is a call_tir, else None."""
    if not (isinstance(value, relax.Call) and value.op == tvm.ir.Op.get("relax.call_tir")):
        return None
    func = mod[value.args[0]]
    return func if isinstance(func, tvm.tirx.PrimFunc) else None


@dataclasses.dataclass(frozen=True)
class _Border:
    """A convolution to rebuild: the pad it replaces, and its kernel with the border."""

    pad_var: relax.Var
    plan: _conv.Conv2dPlan
    epilogue: _conv.Epilogue  # with out_pad set


def _padded_producers(mod: tvm.IRModule, func: relax.Function) -> dict[relax.Var, _Border]:
    """conv output var -> its :class:`_Border`, for convolutions whose output only a pad reads."""
    uses = Counter({var: len(readers) for var, readers in readers_of(func).items()})
    bindings = relax.analysis.get_var2val(func)
    found = {}
    for var, value in bindings.items():
        pad = _called_kernel(mod, value)
        if pad is None or PADDING_ATTR not in (pad.attrs or {}):
            continue
        source = value.args[1].fields[0]
        producer = _called_kernel(mod, bindings.get(source)) if isinstance(source, relax.Var) else None
        described = None if producer is None else _space.describe_kernel(producer)
        if described is None or uses[source] != 1:
            continue
        plan, epilogue, _, _ = described
        if epilogue.nchw_out or any(epilogue.out_pad):
            continue
        border = tuple(int(p) for p in pad.attrs[PADDING_ATTR])
        found[source] = _Border(var, plan, dataclasses.replace(epilogue, out_pad=border))
    return found


def _padded_copies(mod: tvm.IRModule, func: relax.Function) -> dict[relax.Var, tuple[relax.Var, tuple[int, ...]]]:
    """tensor -> (its padded copy, the border) for each `pad_nchwc` call of `func`."""
    copies = {}
    for var, value in relax.analysis.get_var2val(func).items():
        pad = _called_kernel(mod, value)
        if pad is not None and PADDING_ATTR in (pad.attrs or {}) and isinstance(value.args[1].fields[0], relax.Var):
            copies[value.args[1].fields[0]] = (var, tuple(int(p) for p in pad.attrs[PADDING_ATTR]))
    return copies


def read_masks_padded(mod: tvm.IRModule, make_kernel: KernelMaker) -> tvm.IRModule:
    """Rebuild each convolution whose epilogue masks with a tensor that also has a padded copy so
    that it reads the copy (module docstring)."""
    for gvar, func in list(mod.functions_items()):
        if not isinstance(func, relax.Function) or "Composite" in (func.attrs or {}):
            continue
        copies = _padded_copies(mod, func)
        if not copies:
            continue
        rebuilt = {}
        for var, value in relax.analysis.get_var2val(func).items():
            kernel = _called_kernel(mod, value)
            described = None if kernel is None else _space.describe_kernel(kernel)
            if described is None or described[1].mask is None or any(described[1].mask_pad):
                continue
            plan, epilogue, _, _ = described
            mask = value.args[1].fields[-1]
            if mask not in copies or epilogue.nchw_out:
                continue
            padded, border = copies[mask]
            expected = dataclasses.replace(epilogue, out_pad=border).out_shape(plan)
            shapes = (tuple(mask.ty.shape), tuple(padded.ty.shape))
            if (shapes[0][1:] != plan.out_shape()[1:] or shapes[1][1:] != expected[1:]
                    or BATCHED_ATTR in (kernel.attrs or {})):
                continue  # other channel blocks (or one image's kernel over a symbolic batch): keep y
            rebuilt[var] = (padded, dataclasses.replace(epilogue, mask_pad=border), plan)
        if rebuilt:
            mod = _rewrite_masks(mod, gvar, func, rebuilt, make_kernel)
    return mod


def _rewrite_masks(mod: tvm.IRModule, gvar: tvm.ir.GlobalVar, func: relax.Function, rebuilt: dict,
                   make_kernel: KernelMaker) -> tvm.IRModule:
    @relax.expr_functor.mutator
    class _Mutator(relax.PyExprMutator):
        def visit_var_binding_(self, binding: relax.VarBinding) -> None:
            if binding.var not in rebuilt:
                super().visit_var_binding_(binding)
                return
            padded, epilogue, plan = rebuilt[binding.var]
            call = binding.value
            old = self.builder_.get()[call.args[0]]
            kernel = make_kernel(plan, epilogue).with_attr("op_pattern", old.attrs["op_pattern"])
            name = call.args[0].name_hint + "_maskpad" + "x".join(map(str, epilogue.mask_pad))
            args = [self.visit_expr(arg) for arg in call.args[1].fields[:-1]] + [self.visit_expr(padded)]
            out = self.builder_.emit(relax.call_tir(self.builder_.add_func(kernel, name), args, binding.var.ty))
            self.set_var_remap(binding.var, out)

    mutator = _Mutator(mod)
    mutator.builder_.update_func(gvar, mutator.visit_expr(func))
    return relax.transform.DeadCodeElimination()(mutator.builder_.get())


def write_borders(mod: tvm.IRModule, make_kernel: KernelMaker) -> tvm.IRModule:
    """Rebuild each convolution whose output only a `pad_nchwc` reads so that it writes the border
    itself (`make_kernel(plan, epilogue)` gives the kernel: tuned or analytic), and drop the pad."""
    for gvar, func in list(mod.functions_items()):
        if not isinstance(func, relax.Function) or "Composite" in (func.attrs or {}):
            continue
        producers = _padded_producers(mod, func)
        if producers:
            mod = _rewrite(mod, gvar, func, producers, make_kernel)
    return mod


def _rewrite(mod: tvm.IRModule, gvar: tvm.ir.GlobalVar, func: relax.Function,
             producers: dict[relax.Var, _Border], make_kernel: KernelMaker) -> tvm.IRModule:
    @relax.expr_functor.mutator
    class _Mutator(relax.PyExprMutator):
        def __init__(self, mod: tvm.IRModule):
            super().__init__(mod)
            self.dropped = {border.pad_var for border in producers.values()}

        def visit_var_binding_(self, binding: relax.VarBinding) -> None:
            if binding.var in self.dropped:
                return  # the producer now writes this tensor: its var was remapped there
            if binding.var not in producers:
                super().visit_var_binding_(binding)
                return
            border = producers[binding.var]
            call = binding.value
            old = self.builder_.get()[call.args[0]]
            kernel = make_kernel(border.plan, border.epilogue).with_attr("op_pattern", old.attrs["op_pattern"])
            shape = border.epilogue.out_shape(border.plan)
            if BATCHED_ATTR in old.attrs:  # one image's kernel over a symbolic batch, as the old one
                kernel = batch_loop(kernel, [int(i) for i in old.attrs[BATCHED_ATTR]])
                shape = (binding.var.ty.shape[0], *shape[1:])
            name = call.args[0].name_hint + "_border" + "x".join(map(str, border.epilogue.out_pad))
            new_gvar = self.builder_.add_func(kernel, name)
            args = [self.visit_expr(arg) for arg in call.args[1].fields]
            out = self.builder_.emit(relax.call_tir(new_gvar, args, relax.TensorType(shape, "float32")))
            self.set_var_remap(border.pad_var, out)
            logger.debug("tvm_ext: %s writes its %s border; no padded copy", name, border.epilogue.out_pad)

    mutator = _Mutator(mod)
    mutator.builder_.update_func(gvar, mutator.visit_expr(func))
    return mutator.builder_.get()
