"""CUDA kernels from source to machine code, with or without a GPU.

- :func:`generate_source`: the CUDA C TVM emits for a PrimFunc (no GPU, no CUDA runtime needed);
  :func:`kernel_names`, :func:`kernel_params`: the kernels in it and their arguments.
- :func:`compile_source`, :func:`ptx_instructions`, :func:`ptxas_resources`: what it compiles to
  (TVM's own nvcc driver for PTX and cubin; register use and spills from `ptxas -v`, which only
  nvcc's command line reports).
- :func:`build_for_device`: a runnable module for a machine that has a GPU.

TVM 0.27 hazard: once `tvm.support.nvcc` is imported, its `tvm_callback_cuda_compile` is
registered and every `tvm.compile` for CUDA compiles to a cubin and wraps it in a CUDA runtime
module. Without a GPU the wheel's CUDA runtime is not loaded and that fails ("CUDA runtime is not
linked into this build"); without the `cuda-bindings` package the default NVRTC path fails too. So
source generation hides the callback, and device builds pick the compiler that is there.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile

import tvm
import tvm_ffi

_CALLBACK = "tvm_callback_cuda_compile"


_KERNEL = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(([^)]*)\)\s*\{')
_PARAM = re.compile(r"^\s*(\w+)\s*\*\s*(?:__restrict__\s+)?(\w+)\s*$")


def kernel_names(source: str) -> list[str]:
    """The `__global__` kernels defined in CUDA `source`, in order."""
    return [match.group(1) for match in _KERNEL.finditer(source)]


def kernel_params(source: str, kernel: str) -> list[tuple[str, str]]:
    """(element type, name) of each pointer parameter of `kernel` in CUDA `source`.

    TVM orders a kernel's arguments its own way (not as the PrimFunc's) and names each after its
    buffer (`<buffer>_ptr`); whoever launches the CUDA C directly needs both.
    """
    for match in _KERNEL.finditer(source):
        if match.group(1) == kernel:
            params = []
            for text in match.group(2).split(","):
                param = _PARAM.match(text)
                if param is None:
                    raise ValueError(f"{kernel}: parameter {text.strip()!r} is not a pointer")
                params.append((param.group(1), param.group(2)))
            return params
    raise ValueError(f"no kernel named {kernel!r} in the source")


def have_nvcc() -> bool:
    return shutil.which("nvcc") is not None


def have_nvrtc() -> bool:
    """Whether TVM can compile CUDA C in-process: NVRTC through the `cuda-bindings` package."""
    try:
        return importlib.util.find_spec("cuda.bindings") is not None
    except ModuleNotFoundError:  # no `cuda` package at all
        return False


@contextlib.contextmanager
def cuda_source_only():
    """Within: `tvm.compile` for CUDA stops at CUDA C (the compile callback is unregistered), as
    it does in a process that never imported `tvm.support.nvcc`: what builds on a machine
    without a GPU."""
    callback = tvm_ffi.get_global_func(_CALLBACK, allow_missing=True)
    if callback is None:
        yield
        return
    tvm_ffi.remove_global_func(_CALLBACK)
    try:
        yield
    finally:
        tvm_ffi.register_global_func(_CALLBACK, callback, override=True)


def generate_source(func: tvm.tirx.PrimFunc | tvm.IRModule, target: tvm.target.Target) -> str:
    """The CUDA C of `func` for the CUDA `target` (works on any machine)."""
    mod = func if isinstance(func, tvm.IRModule) else tvm.IRModule({"main": func})
    with cuda_source_only():
        source = executable_cuda_source(tvm.compile(mod, target=target))
    if not source:
        raise RuntimeError(f"tvm.compile for {target} produced no CUDA module")
    return source


def executable_cuda_source(executable) -> str:
    """The CUDA C inside a built module or Relax executable (its CUDA modules, at any depth)."""
    sources, stack = [], [getattr(executable, "mod", executable)]
    while stack:  # the imports form a tree: host module, library, device modules
        module = stack.pop()
        if module.kind == "cuda":
            sources.append(module.inspect_source())
        stack.extend(module.imports)
    return "\n".join(sources)


def prepare_device_compile() -> None:
    """Make `tvm.compile` for CUDA produce machine code for this machine's GPU.

    TVM compiles the CUDA C with NVRTC when the `cuda-bindings` package is installed and with
    nvcc otherwise (TVM_CUDA_COMPILE_MODE, unless the user set it); the compile callback is
    registered by importing `tvm.support.nvcc`.
    """
    if "TVM_CUDA_COMPILE_MODE" not in os.environ and not have_nvrtc():
        if not have_nvcc():
            raise RuntimeError("compiling for the GPU needs the cuda-bindings package (NVRTC) or nvcc on PATH")
        os.environ["TVM_CUDA_COMPILE_MODE"] = "nvcc"
    import tvm.support.nvcc  # noqa: F401  (registers the compile callback)


def build_for_device(func: tvm.tirx.PrimFunc | tvm.IRModule, target: tvm.target.Target) -> tvm.runtime.Executable:
    """Compile `func` to a module that runs on this machine's GPU (see :func:`prepare_device_compile`)."""
    prepare_device_compile()
    mod = func if isinstance(func, tvm.IRModule) else tvm.IRModule({"main": func})
    return tvm.compile(mod, target=target)


def compile_source(source: str, arch: str, target_format: str = "ptx") -> bytes:
    """Compile CUDA C for `arch` ("sm_80", "sm_90", ...) to "ptx" or "cubin" with nvcc."""
    from tvm.support import nvcc

    with tvm.target.Target({"kind": "cuda", "arch": arch}):
        return bytes(nvcc.compile_cuda(source, target_format, arch=arch, compiler="nvcc"))


def ptx_instructions(ptx: str) -> collections.Counter:
    """How often each PTX instruction (opcode with its modifiers, e.g. "ld.shared.v4.f32") occurs."""
    ops = re.findall(r"^\s+(?:@%p\d+\s+)?([a-z][\w.]*)", ptx, flags=re.M)
    return collections.Counter(ops)


def main_loop_instructions(ptx: str) -> collections.Counter:
    """The instructions of the longest loop body in `ptx` (from a label to the branch back to it):
    for a kernel with one k loop, what every k step issues."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\$L__BB\d+_\d+):", line))}
    body: list[str] = []
    for i, line in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if m and labels.get(m.group(1), i) < i and i - labels[m.group(1)] > len(body):
            body = lines[labels[m.group(1)]:i + 1]
    return ptx_instructions("\n".join(body))


def ptxas_resources(source: str, arch: str) -> dict[str, int]:
    """`ptxas -v` for each kernel of `source`, summed: registers (max), spill bytes, shared bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cu")
        with open(path, "w") as f:
            f.write(source)
        cmd = ["nvcc", "-cubin", f"-arch={arch}", "-O3", "-Xptxas", "-v", "-w", path, "-o",
               os.path.join(tmp, "kernel.cubin")]
        result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"nvcc failed for {arch}:\n{result.stderr[-3000:]}")
    info = result.stderr
    numbers = {
        "registers": [int(v) for v in re.findall(r"Used (\d+) registers", info)],
        "spill_stores": [int(v) for v in re.findall(r"(\d+) bytes spill stores", info)],
        "spill_loads": [int(v) for v in re.findall(r"(\d+) bytes spill loads", info)],
        "stack": [int(v) for v in re.findall(r"(\d+) bytes stack frame", info)],
        "shared": [int(v) for v in re.findall(r"(\d+) bytes smem", info)],
    }
    if not numbers["registers"]:
        raise RuntimeError(f"no ptxas resource lines in nvcc's output:\n{info[-2000:]}")
    return {"registers": max(numbers["registers"]), "spill_stores": sum(numbers["spill_stores"]),
            "spill_loads": sum(numbers["spill_loads"]), "stack": sum(numbers["stack"]),
            "shared": max(numbers["shared"], default=0)}
