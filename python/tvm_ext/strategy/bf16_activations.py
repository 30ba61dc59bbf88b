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

A ResNet block's output has two readers: the next block's first convolution (rounded to bf16)
and a shortcut, added in the epilogue of a later convolution. Where every other reader is such a
shortcut, the producer writes bf16 and the shortcuts read it widened
(:attr:`~tvm_ext.kernels.conv2d.Epilogue.residual_dtype`), as PyTorch's bf16 autocast and oneDNN
keep a bf16 network's residual stream: the roundings (two where a strided shortcut convolution
reads the tensor too) and the fp32 tensor are gone, and the add sees the rounded value.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import relax

from ..kernels import conv2d as _conv
from ..kernels import winograd as _winograd
from ..tuning import space as _space
from .base import called_kernel, readers_of
from .borders import KernelMaker, Rebuilt, rebuild_producers

__all__ = ["write_bf16_activations"]

# the kernel kinds whose generators write a bf16 output and read a bf16 residual
_WRITERS = ("brgemm", "winograd")


def _described(mod: tvm.IRModule, value) -> tuple[tvm.tirx.PrimFunc, _conv.Conv2dPlan, _conv.Epilogue] | None:
    """(kernel, plan, epilogue) of the float convolution `value` calls, if one of :data:`_WRITERS`."""
    kernel = called_kernel(mod, value)
    described = None if kernel is None else _space.describe_kernel(kernel)
    if kernel is None or described is None or described[0].kind not in _WRITERS or described[0].wl.dtype == "int8":
        return None
    return kernel, described[0], described[1]


def _reads_as_residual(described: tuple | None, call: relax.Call, source: relax.Var) -> bool:
    """Whether `call`, of the convolution `described` (:func:`_described`), reads `source` once, as
    its fp32 blocked residual."""
    if described is None or not described[2].residual or described[2].residual_dtype != "float32":
        return False
    # the parameter named R (:func:`~tvm_ext.kernels.common.param_buffer`; R_batch over a symbolic batch)
    names = [param.name.removesuffix("_batch") for param in described[0].params]
    args = list(call.args[1].fields)
    return (names.count("R") == 1 and sum(arg.same_as(source) for arg in args) == 1
            and args[names.index("R")].same_as(source))


def _bf16_tensors(mod: tvm.IRModule, func: relax.Function) -> dict[relax.Var, Rebuilt]:
    """conv output var -> its rebuild (:class:`~.borders.Rebuilt`): with a bf16 output where
    roundings to bf16 read it and nothing else but shortcuts of convolutions (or only shortcuts,
    of a bf16 convolution); with a bf16 residual where it reads such a tensor."""
    readers = readers_of(func)
    bindings = relax.analysis.get_var2val(func)
    var_of = {value: var for var, value in bindings.items()}
    kernels = {var: found for var, value in bindings.items() if (found := _described(mod, value)) is not None}
    astype = tvm.ir.Op.get("relax.astype")
    changes: dict[relax.Var, dict[str, str]] = {}
    roundings: dict[relax.Var, list[relax.Var]] = {}
    for source, (_, plan, epilogue) in kernels.items():
        if (epilogue.out_dtype != "float32" or epilogue.nchw_out or epilogue.mask
                or (plan.kind == "winograd" and _winograd.bf16_output_reason(epilogue) is not None)):
            continue
        rounded, shortcuts = [], []
        for reader in readers.get(source, []):
            if (isinstance(reader, relax.Call) and reader.op.same_as(astype)
                    and str(reader.attrs.dtype) == "bfloat16"):
                rounded.append(var_of[reader])
            elif (reader is not None and not any(epilogue.out_pad)
                  and _reads_as_residual(kernels.get(var_of[reader]), reader, source)):
                shortcuts.append(var_of[reader])
            else:
                break  # an fp32 reader: the tensor stays fp32
        else:
            # a bf16 convolution's output that only shortcuts read is a bf16 activation too; an
            # fp32 one's (Winograd) stays fp32 where no bf16 convolution reads it
            if rounded or (shortcuts and plan.wl.dtype == "bfloat16"):
                changes.setdefault(source, {})["out_dtype"] = "bfloat16"
                roundings[source] = rounded
                for reader in shortcuts:
                    changes.setdefault(reader, {})["residual_dtype"] = "bfloat16"
    found = {}
    for var, change in changes.items():
        _, plan, epilogue = kernels[var]  # (a writer, or a reader of a residual)
        suffix = ("_bf16" if "out_dtype" in change else "") + ("_bf16r" if "residual_dtype" in change else "")
        found[var] = Rebuilt(tuple(roundings.get(var, ())), plan, dataclasses.replace(epilogue, **change), suffix)
    return found


def write_bf16_activations(mod: tvm.IRModule, make_kernel: KernelMaker) -> tvm.IRModule:
    """Rebuild each convolution whose output roundings to bf16 read (and shortcuts of convolutions,
    nothing else) so that it writes the bf16 tensor itself, those shortcuts to read it, and drop
    the roundings (`make_kernel(plan, epilogue)` gives the kernels: tuned or analytic; module
    docstring)."""
    return rebuild_producers(mod, _bf16_tensors, make_kernel)
