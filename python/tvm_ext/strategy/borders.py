"""Convolutions write the zero border their consumer reads: no padded copies between layers.

A padded convolution reads its input with a zero border (the blocked data layout carries it).
When that input is another tvm_ext convolution's blocked output, the emitter first produces a
`pad_nchwc` call: a copy of the whole tensor into a larger one (about 9% of MobileNet-v2's time
on this machine, before the depthwise layers). :func:`write_borders` removes those copies after
lowering: a convolution whose output only feeds a `pad_nchwc` is rebuilt with that border
(:attr:`tvm_ext.kernels.conv2d.Epilogue.out_pad`) and writes the padded tensor itself, so the
activations take no more memory than the padded input always did. :func:`write_dequantized_borders`
does the same for a dequantize of an int8 kernel's blocks read by a padded fp32 convolution.

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
import functools
import json
import logging
from collections import Counter
from collections.abc import Callable

import tvm
from tvm import relax

from ..kernels import conv2d as _conv
from ..kernels import conv2d_backward_data as _data_grad
from ..kernels import layout as _layout
from ..kernels.batch_loop import BATCHED_ATTR, batch_loop
from ..kernels.common import with_border
from ..kernels.layout import PADDING_ATTR
from ..relax_info import static_shape
from ..tuning import space as _space
from .base import called_kernel, readers_of, rebind_to_kernels

logger = logging.getLogger("tvm_ext")

KernelMaker = Callable[[_conv.Conv2dPlan, _conv.Epilogue], tvm.tirx.PrimFunc]


def _padded_producers(mod: tvm.IRModule, func: relax.Function) -> dict[relax.Var, Rebuilt]:
    """conv output var -> its rebuild with the border (:class:`Rebuilt`), for convolutions whose
    output only a pad reads."""
    uses = Counter({var: len(readers) for var, readers in readers_of(func).items()})
    bindings = relax.analysis.get_var2val(func)
    found = {}
    for source, (pad_var, border) in _padded_copies(mod, func).items():
        producer = called_kernel(mod, bindings.get(source))
        described = None if producer is None else _space.describe_kernel(producer)
        if described is None or uses[source] != 1:
            continue
        plan, epilogue, _, _ = described
        if epilogue.nchw_out or any(epilogue.out_pad) or plan.wl.dtype == "int8":
            continue  # (an int8 kernel's border is its reader's zero point: strategy.quantized's own)
        found[source] = Rebuilt((pad_var,), plan, dataclasses.replace(epilogue, out_pad=border),
                                "_border" + "x".join(map(str, border)))
    return found


def _padded_copies(mod: tvm.IRModule, func: relax.Function) -> dict[relax.Var, tuple[relax.Var, tuple[int, ...]]]:
    """tensor -> (its padded copy, the border) for each `pad_nchwc` call of `func`."""
    copies = {}
    for var, value in relax.analysis.get_var2val(func).items():
        pad = called_kernel(mod, value)
        if pad is not None and PADDING_ATTR in (pad.attrs or {}) and isinstance(value.args[1].fields[0], relax.Var):
            copies[value.args[1].fields[0]] = (var, tuple(int(p) for p in pad.attrs[PADDING_ATTR]))
    return copies


def _with_mask_pad(kernel: tvm.tirx.PrimFunc, mask: relax.Var, padded: relax.Var, border: tuple[int, ...],
                   make_kernel: KernelMaker) -> tvm.tirx.PrimFunc | None:
    """`kernel` (a data-gradient convolution or stride-phase interleave that masks with `mask`)
    rebuilt to read the mask from `padded`, the copy of `mask` with `border`; None where the two
    tensors differ in more than the border (other channel blocks) or the kernel has no mask."""
    if BATCHED_ATTR in (kernel.attrs or {}):
        return None  # one image's kernel over a symbolic batch
    described = _space.describe_kernel(kernel)
    if described is not None:
        plan, epilogue, _, _ = described
        if epilogue.mask is None or any(epilogue.mask_pad) or epilogue.nchw_out:
            return None
        shape = plan.out_shape()
        rebuild = functools.partial(make_kernel, plan, dataclasses.replace(epilogue, mask_pad=border))
    elif _data_grad.INTERLEAVE_ATTR in (kernel.attrs or {}) and len(kernel.params) > 2:
        args = json.loads(str(kernel.attrs[_data_grad.INTERLEAVE_ATTR]))
        shape = tuple(args["out_shape"])
        rebuild = functools.partial(_data_grad.interleave_phases_func, **args, relu_mask=True, mask_pad=border)
    else:
        return None
    if tuple(mask.ty.shape)[1:] != tuple(shape[1:]) or tuple(padded.ty.shape)[1:] != with_border(shape, border)[1:]:
        return None
    return rebuild()


def read_masks_padded(mod: tvm.IRModule, make_kernel: KernelMaker) -> tvm.IRModule:
    """Rebuild each kernel whose mask tensor also has a padded copy so that it reads the copy
    (module docstring)."""
    for gvar, func in list(mod.functions_items()):
        if not isinstance(func, relax.Function) or "Composite" in (func.attrs or {}):
            continue
        copies = _padded_copies(mod, func)
        rebuilt = {}
        for var, value in relax.analysis.get_var2val(func).items() if copies else ():
            kernel = called_kernel(mod, value)
            if kernel is None or not value.args[1].fields or value.args[1].fields[-1] not in copies:
                continue
            mask = value.args[1].fields[-1]
            padded, border = copies[mask]
            new_kernel = _with_mask_pad(kernel, mask, padded, border, make_kernel)
            if new_kernel is not None:
                rebuilt[var] = ([*value.args[1].fields[:-1], padded], new_kernel,
                                value.args[0].name_hint + "_maskpad" + "x".join(map(str, border)))
        if rebuilt:
            mod = rebind_to_kernels(mod, gvar, func, rebuilt)
    return mod


def write_borders(mod: tvm.IRModule, make_kernel: KernelMaker) -> tvm.IRModule:
    """Rebuild each convolution whose output only a `pad_nchwc` reads so that it writes the border
    itself (`make_kernel(plan, epilogue)` gives the kernel: tuned or analytic), and drop the pad."""
    return rebuild_producers(mod, _padded_producers, make_kernel)


def write_dequantized_borders(mod: tvm.IRModule) -> tvm.IRModule:
    """Each dequantize of an int8 kernel's blocks (`dequantized_units`, strategy.quantized) whose
    output only a `pad_nchwc` reads rebuilt to write the padded tensor itself, and the pad dropped
    (PT2E's EfficientNets: the fp32 depthwise convolution after each int8 expansion)."""
    for gvar, func in list(mod.functions_items()):
        if not isinstance(func, relax.Function) or "Composite" in (func.attrs or {}):
            continue
        readers, bindings = readers_of(func), relax.analysis.get_var2val(func)
        found = {}
        for source, (pad_var, border) in _padded_copies(mod, func).items():
            dequantize = bindings.get(source)
            kernel = called_kernel(mod, dequantize, "dequantized_units")
            if kernel is None or _layout.DEQUANTIZE_ATTR not in kernel.attrs or len(readers.get(source, [])) != 1:
                continue
            data = dequantize.args[1].fields[0]
            shape = static_shape(data)
            if shape is None or static_shape(source) != shape:  # (no border yet, a static batch)
                continue
            zero, scale = kernel.attrs[_layout.DEQUANTIZE_ATTR]
            padded = static_shape(pad_var) or ()
            found[pad_var] = ([data], _layout.dequantized_units_func(shape, border, int(zero), float(scale)),
                              f"tvm_ext_dequantize_blocked_{'x'.join(map(str, padded))}")
        if found:
            mod = rebind_to_kernels(mod, gvar, func, found)
    return mod


@dataclasses.dataclass(frozen=True)
class Rebuilt:
    """A convolution rebuilt with another epilogue: the bindings its new output replaces (dropped;
    none where only what it reads changed), its plan and new epilogue, and the suffix of the new
    kernel's name."""

    replaced: tuple[relax.Var, ...]
    plan: _conv.Conv2dPlan
    epilogue: _conv.Epilogue
    suffix: str


def rebuild_producers(mod: tvm.IRModule, find: Callable[[tvm.IRModule, relax.Function], dict[relax.Var, Rebuilt]],
                      make_kernel: KernelMaker) -> tvm.IRModule:
    """Each Relax function of `mod` with the convolutions `find(mod, func)` names (by their
    output variables) rebuilt by `make_kernel(plan, epilogue)` (tuned or analytic)."""
    for gvar, func in list(mod.functions_items()):
        if not isinstance(func, relax.Function) or "Composite" in (func.attrs or {}):
            continue
        producers = find(mod, func)
        if producers:
            mod = _rebuild(mod, gvar, func, producers, make_kernel)
    return mod


def _rebuild(mod: tvm.IRModule, gvar: tvm.ir.GlobalVar, func: relax.Function,
             producers: dict[relax.Var, Rebuilt], make_kernel: KernelMaker) -> tvm.IRModule:
    """`func` with each convolution bound to a key of `producers` rebuilt (over a symbolic batch
    as the old kernel was) to write what its `replaced` bindings computed from its output, and
    those bindings dropped."""
    @relax.expr_functor.mutator
    class _Mutator(relax.PyExprMutator):
        def __init__(self, mod: tvm.IRModule):
            super().__init__(mod)
            self.dropped = {var for rebuilt in producers.values() for var in rebuilt.replaced}

        def visit_var_binding_(self, binding: relax.VarBinding) -> None:
            if binding.var in self.dropped:
                return  # the producer now writes this tensor: its var was remapped there
            if binding.var not in producers:
                super().visit_var_binding_(binding)
                return
            rebuilt = producers[binding.var]
            call = binding.value
            old = self.builder_.get()[call.args[0]]
            kernel = make_kernel(rebuilt.plan, rebuilt.epilogue).with_attr("op_pattern", old.attrs["op_pattern"])
            shape = rebuilt.epilogue.out_shape(rebuilt.plan)
            if BATCHED_ATTR in old.attrs:  # one image's kernel over a symbolic batch, as the old one
                kernel = batch_loop(kernel, [int(i) for i in old.attrs[BATCHED_ATTR]])
                shape = (binding.var.ty.shape[0], *shape[1:])
            name = call.args[0].name_hint + rebuilt.suffix
            args = [self.visit_expr(arg) for arg in call.args[1].fields]
            out = self.builder_.emit(relax.call_tir(self.builder_.add_func(kernel, name), args,
                                                    relax.TensorType(shape, rebuilt.epilogue.buffer_dtype)))
            for replaced in (binding.var, *rebuilt.replaced):
                self.set_var_remap(replaced, out)
            logger.debug("tvm_ext: %s rebuilt (%s)", name, rebuilt.suffix)

    mutator = _Mutator(mod)
    mutator.builder_.update_func(gvar, mutator.visit_expr(func))
    return mutator.builder_.get()
