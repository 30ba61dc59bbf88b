"""Convolutions write bfloat16 for their bfloat16 readers: no rounding pass between the layers.

In a `precision="bf16"` build a bf16 convolution (on `vdpbf16ps` or AMX) reads its input rounded
to bf16: the emitter packs the input in blocks (the producer's own where it can) and rounds it
with an `astype` pass. When that input is another tvm_ext convolution's blocked output that
nothing else reads (after dead code elimination: no shortcut, no NCHW view, not the graph's
output), :func:`write_bf16_activations` rebuilds the producer with a bf16 output
(:attr:`tvm_ext.kernels.conv2d.Epilogue.out_dtype`, rounded to nearest even as `astype`
rounds) and drops the pass: the activation between the two kernels is bf16, half the bytes
written and read, the same values. Producers: the BRGEMM kernel (fp32 or bf16 workloads) and
Winograd's output transform. It runs on lowered Relax after :func:`~.borders.write_borders` (a
producer may write its reader's zero border too).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import tvm
from tvm import relax

from ..kernels import conv2d as _conv
from ..kernels import winograd as _winograd
from ..kernels.batch_loop import BATCHED_ATTR, batch_loop
from ..tuning import space as _space
from .base import called_kernel, readers_of

logger = logging.getLogger("tvm_ext")

__all__ = ["write_bf16_activations"]

KernelMaker = Callable[[_conv.Conv2dPlan, _conv.Epilogue], tvm.tirx.PrimFunc]

# the kernel kinds whose generators write a bf16 output
_WRITERS = ("brgemm", "winograd")


@dataclasses.dataclass(frozen=True)
class _Rounded:
    """A convolution to rebuild: the rounding pass it replaces, and its plan and bf16 epilogue."""

    cast_var: relax.Var
    plan: _conv.Conv2dPlan
    epilogue: _conv.Epilogue  # with out_dtype "bfloat16"


def _rounded_producers(mod: tvm.IRModule, func: relax.Function) -> dict[relax.Var, _Rounded]:
    """conv output var -> its :class:`_Rounded`, for convolutions whose output only an
    `astype(..., "bfloat16")` reads."""
    readers = readers_of(func)
    bindings = relax.analysis.get_var2val(func)
    astype = tvm.ir.Op.get("relax.astype")
    found = {}
    for var, value in bindings.items():
        if not (isinstance(value, relax.Call) and value.op.same_as(astype) and str(value.attrs.dtype) == "bfloat16"):
            continue
        source = value.args[0]
        if not isinstance(source, relax.Var) or len(readers.get(source, [])) != 1:
            continue
        producer = called_kernel(mod, bindings.get(source))
        described = None if producer is None else _space.describe_kernel(producer)
        if described is None:
            continue
        plan, epilogue, _, _ = described
        if (plan.kind not in _WRITERS or plan.wl.dtype == "int8" or epilogue.out_dtype != "float32"
                or epilogue.nchw_out or epilogue.mask
                or (plan.kind == "winograd" and _winograd.bf16_output_reason(epilogue) is not None)):
            continue
        found[source] = _Rounded(var, plan, dataclasses.replace(epilogue, out_dtype="bfloat16"))
    return found


def write_bf16_activations(mod: tvm.IRModule, make_kernel: KernelMaker) -> tvm.IRModule:
    """Rebuild each convolution whose output only a rounding to bf16 reads so that it writes the
    bf16 tensor itself (`make_kernel(plan, epilogue)` gives the kernel: tuned or analytic), and
    drop the rounding (module docstring)."""
    for gvar, func in list(mod.functions_items()):
        if not isinstance(func, relax.Function) or "Composite" in (func.attrs or {}):
            continue
        producers = _rounded_producers(mod, func)
        if producers:
            mod = _rewrite(mod, gvar, func, producers, make_kernel)
    return mod


def _rewrite(mod: tvm.IRModule, gvar: tvm.ir.GlobalVar, func: relax.Function,
             producers: dict[relax.Var, _Rounded], make_kernel: KernelMaker) -> tvm.IRModule:
    @relax.expr_functor.mutator
    class _Mutator(relax.PyExprMutator):
        def __init__(self, mod: tvm.IRModule):
            super().__init__(mod)
            self.dropped = {rounded.cast_var for rounded in producers.values()}

        def visit_var_binding_(self, binding: relax.VarBinding) -> None:
            if binding.var in self.dropped:
                return  # the producer now writes this tensor: its var was remapped there
            if binding.var not in producers:
                super().visit_var_binding_(binding)
                return
            rounded = producers[binding.var]
            call = binding.value
            old = self.builder_.get()[call.args[0]]
            kernel = make_kernel(rounded.plan, rounded.epilogue).with_attr("op_pattern", old.attrs["op_pattern"])
            shape = tuple(binding.var.ty.shape)
            if BATCHED_ATTR in old.attrs:  # one image's kernel over a symbolic batch, as the old one
                kernel = batch_loop(kernel, [int(i) for i in old.attrs[BATCHED_ATTR]])
            name = call.args[0].name_hint + "_bf16"
            args = [self.visit_expr(arg) for arg in call.args[1].fields]
            out = self.builder_.emit(relax.call_tir(self.builder_.add_func(kernel, name), args,
                                                    relax.TensorType(shape, "bfloat16")))
            self.set_var_remap(rounded.cast_var, out)
            logger.debug("tvm_ext: %s writes bf16 for its bf16 reader; no rounding pass", name)

    mutator = _Mutator(mod)
    mutator.builder_.update_func(gvar, mutator.visit_expr(func))
    return mutator.builder_.get()
