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

import tvm
from tvm import relax

from ..kernels import winograd as _winograd
from ..tuning import space as _space
from .base import called_kernel, readers_of
from .borders import KernelMaker, Rebuilt, rebuild_producers

__all__ = ["write_bf16_activations"]

# the kernel kinds whose generators write a bf16 output
_WRITERS = ("brgemm", "winograd")


def _rounded_producers(mod: tvm.IRModule, func: relax.Function) -> dict[relax.Var, Rebuilt]:
    """conv output var -> its rebuild with a bf16 output (:class:`~.borders.Rebuilt`), for
    convolutions whose output only an `astype(..., "bfloat16")` reads."""
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
        found[source] = Rebuilt(var, plan, dataclasses.replace(epilogue, out_dtype="bfloat16"), "_bf16")
    return found


def write_bf16_activations(mod: tvm.IRModule, make_kernel: KernelMaker) -> tvm.IRModule:
    """Rebuild each convolution whose output only a rounding to bf16 reads so that it writes the
    bf16 tensor itself (`make_kernel(plan, epilogue)` gives the kernel: tuned or analytic), and
    drop the rounding (module docstring)."""
    return rebuild_producers(mod, _rounded_producers, make_kernel)
