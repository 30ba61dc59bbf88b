"""Run a whole network's CUDA strategy on the CPU: every CUDA kernel through the emulator.

`lower(mod, target)` is the Relax module right after tvm_ext's CUDA strategy: our kernels as
`call_tir` to CUDA PrimFuncs, everything else still Relax ops. :func:`emulated_executable`
replaces each of those calls by a call to a Python function that runs that PrimFunc's generated
CUDA C on the CPU emulator (:mod:`tvm_ext.testing.cuda_emulator`), builds the rest for the CPU
with stock TVM, and returns a CPU executable. Its output checks the graph-level work (layouts at
the edges, weights laid out at build time, fused epilogues, residual wiring) with the very CUDA C
a GPU would run, on a machine without one.
"""

from __future__ import annotations

import re

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from ..kernels.common import KERNEL_ATTR
from ..kernels.cuda.toolchain import generate_source, kernel_names, kernel_params
from .cuda_emulator import run_kernel

_THREAD = re.compile(r'T\.thread_binding\((\d+), thread="(blockIdx|threadIdx)\.([xyz])"\)')
# the dynamic shared-memory arena: `smem = T.alloc_buffer((16384,), scope="shared.dyn")`
_DYNAMIC_SHARED = re.compile(r'T\.alloc_buffer\(\(([\d, ]+)\),(?: "(\w+)",)? scope="shared\.dyn"\)')
# a flat view of a parameter, as TVMScript prints it: `Xf = x.view(800)` or a decl_buffer on x.data
_ALIAS = re.compile(r"(\w+) = (?:(\w+)\.view\(|T\.decl_buffer\([^\n]*data=(\w+)\.data)")


def lower(mod: tvm.IRModule, target, tensor_cores: bool | str = False, winograd: bool = True) -> tvm.IRModule:
    """`mod` after tvm_ext's fusion and lowering passes for `target` (before legalization);
    `tensor_cores`, `winograd`: see :func:`tvm_ext.pipeline`."""
    from ..strategy.dispatch import lower_to_kernels
    from ..strategy.fusion import fusion_passes
    from ..target import resolve_target

    target = resolve_target(target)
    with target:
        passes = fusion_passes(target) + [lower_to_kernels(target, tensor_cores=tensor_cores, winograd=winograd)]
        return tvm.transform.Sequential(passes)(mod)


def launch_shape(func: tvm.tirx.PrimFunc) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, block) of a PrimFunc whose loops are bound to CUDA threads."""
    dims = {"blockIdx": [1, 1, 1], "threadIdx": [1, 1, 1]}
    for extent, kind, axis in _THREAD.findall(func.script()):
        dims[kind]["xyz".index(axis)] = int(extent)
    grid, block = dims["blockIdx"], dims["threadIdx"]
    return (grid[0], grid[1], grid[2]), (block[0], block[1], block[2])


def dynamic_shared_bytes(func: tvm.tirx.PrimFunc) -> int:
    """The dynamic shared memory a launch of `func` needs: the sum of its `shared.dyn` buffers,
    which TVM merges into the kernel's one `extern __shared__` array."""
    total = 0
    for shape, dtype in _DYNAMIC_SHARED.findall(func.script()):
        count = int(np.prod([int(d) for d in shape.replace(" ", "").strip(",").split(",")]))
        total += count * tvm.DataType(dtype or "float32").bits // 8
    return total


class _EmulatedKernel:
    """One of our CUDA PrimFuncs as a destination-passing Python function (inputs..., output)."""

    def __init__(self, name: str, func: tvm.tirx.PrimFunc, target: tvm.target.Target):
        self.source = generate_source(func.with_attr("global_symbol", name), target)
        kernels = kernel_names(self.source)
        if len(set(kernels)) != 1:
            raise ValueError(f"{name}: expected one CUDA kernel, found {sorted(set(kernels))}")
        self.kernel = kernels[0]
        self.grid, self.block = launch_shape(func)
        self.shared_bytes = dynamic_shared_bytes(func)
        script = func.script()
        params = [p.name for p in func.params]
        aliases = {alias: params.index(view or decl) for alias, view, decl in _ALIAS.findall(script)
                   if (view or decl) in params}
        self.order = {}  # CUDA parameter -> the PrimFunc argument behind it
        for _, cuda_name in kernel_params(self.source, self.kernel):
            base = cuda_name.removesuffix("_ptr")
            self.order[cuda_name] = aliases[base] if base in aliases else params.index(base)

        self.outputs = 1  # the last parameters it writes (set from its call: emulated_executable)

    def __call__(self, *tensors) -> None:
        arrays = [np.ascontiguousarray(t.numpy()) for t in tensors]
        for out in arrays[-self.outputs:]:
            out[...] = np.nan  # what the kernel does not write shows
        named = {cuda_name: arrays[index] for cuda_name, index in self.order.items()}
        run_kernel(self.source, self.kernel, self.grid, self.block, named, self.shared_bytes)
        for tensor, out in zip(tensors[-self.outputs:], arrays[-self.outputs:], strict=True):
            tensor.copyfrom(out)


def emulated_executable(lowered: tvm.IRModule, target, prefix: str = "tvm_ext.emulated.") -> relax.VMExecutable:
    """A CPU executable of `lowered` (see :func:`lower`) whose CUDA kernels run on the emulator."""
    from ..target import resolve_target

    target = resolve_target(target)
    ours = {gvar.name_hint: func for gvar, func in lowered.functions_items()
            if isinstance(func, tvm.tirx.PrimFunc) and KERNEL_ATTR in func.attrs}
    kernels = {name: _EmulatedKernel(name, func, target) for name, func in ours.items()}
    for name, kernel in kernels.items():
        tvm_ffi.register_global_func(prefix + name, kernel, override=True)

    @relax.expr_functor.mutator
    class _ToPacked(relax.PyExprMutator):
        def visit_call_(self, call: relax.Call) -> relax.Expr:
            call = super().visit_call_(call)
            if call.op == tvm.ir.Op.get("relax.call_tir") and call.args[0].name_hint in ours:
                name = call.args[0].name_hint
                kernels[name].outputs = len(ours[name].params) - len(call.args[1].fields)
                out = list(call.ty.fields) if isinstance(call.ty, relax.TupleType) else call.ty
                return relax.call_dps_packed(prefix + name, call.args[1], out)
            return call

    rewriter = _ToPacked(lowered)
    mod = tvm.IRModule({gvar: rewriter.visit_expr(func) for gvar, func in lowered.functions_items()
                        if isinstance(func, relax.Function)})
    return tvm.compile(mod, "llvm")
