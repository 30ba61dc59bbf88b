"""A Relax executable for an LLVM CPU whose kernels are lowered and compiled on several threads.

`tvm.compile` lowers every kernel of a network and generates its code in one LLVM module, on one
thread: 11 of DenseNet-121's 16 s build (4.4 s of TIR passes, 6.5 s of LLVM). Both are C++ that
releases the GIL, so here the kernels are split into one module per thread, built side by side,
and the executable imports them all (the VM finds a kernel in any module it imports; an exported
library links them into one shared object). Everything else is `relax.build`'s bytecode path.
"""

from __future__ import annotations

import concurrent.futures
import os

import tvm
from tvm import relax, tirx
from tvm.relax import vm_build

from .target import check_cpu_features

__all__ = ["build_threads", "compile_relax"]

# Below this many kernels a module each thread would not pay for its thread and LLVM module.
MIN_KERNELS_PER_PART = 8
MAX_THREADS = 8


def build_threads() -> int:
    """Threads for lowering and code generation: the CPUs this process may run on (at most 8)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_THREADS))


def _parts(mod: tvm.IRModule, count: int) -> list[tvm.IRModule]:
    """The PrimFuncs of `mod`, sorted by name (the same split for the same module: kernels of one
    kind and similar cost sit together) and dealt round-robin into `count` modules with `mod`'s
    attributes."""
    kernels = sorted(((gvar, func) for gvar, func in mod.functions_items() if isinstance(func, tirx.PrimFunc)),
                     key=lambda item: item[0].name_hint)
    return [tvm.IRModule(dict(kernels[i::count]), attrs=mod.attrs) for i in range(count) if kernels[i::count]]


def compile_relax(mod: tvm.IRModule, target: tvm.target.Target, relax_pipeline: tvm.transform.Pass,
                  threads: int | None = None) -> relax.VMExecutable:
    """What `tvm.compile(mod, target, relax_pipeline=relax_pipeline)` returns for an LLVM target,
    with the kernels built on `threads` threads (default :func:`build_threads`)."""
    with target:
        mod = relax_pipeline(mod)
    attrs = dict(mod.attrs) if mod.attrs else {}
    ext_libs = list(attrs.get("external_mods", []))
    device = [lib.kind for lib in ext_libs if vm_build._is_device_module(lib)]
    if device:
        raise ValueError(f"tvm_ext: device modules {device} in an LLVM CPU build")
    params = dict(attrs.get("const_name_to_constant", {}))
    builder = relax.ExecBuilder()
    leftover = vm_build._vmcodegen(builder, mod, "bytecode")
    check_cpu_features(leftover, target)
    kernels = sum(isinstance(func, tirx.PrimFunc) for _, func in leftover.functions_items())
    count = max(1, min(threads or build_threads(), kernels // MIN_KERNELS_PER_PART))
    parts = [vm_build._auto_attach_system_lib_prefix(part, target) for part in _parts(leftover, count)]
    context = tvm.transform.PassContext.current()  # thread-local: each worker enters it

    def build(part: tvm.IRModule) -> tvm.runtime.Module:
        with context:
            return tvm.tirx.build(part, target=target)

    if len(parts) > 1:
        with concurrent.futures.ThreadPoolExecutor(len(parts), thread_name_prefix="tvm_ext_build") as pool:
            libs = list(pool.map(build, parts))
    else:
        libs = [build(part) for part in parts]
    lib = libs[0] if libs else None
    return relax.VMExecutable(vm_build._ffi_api.VMLink(builder, target, lib, [*libs[1:], *ext_libs], params))
