"""CUDA kernels from source to machine code, with or without a GPU.

- :func:`generate_source`: the CUDA C TVM emits for a PrimFunc (no GPU, no CUDA runtime needed);
  :func:`kernel_names`, :func:`kernel_params`: the kernels in it and their arguments.
- :func:`compile_source`, :func:`ptx_instructions`, :func:`ptxas_resources`: what it compiles to
  (TVM's own nvcc driver for PTX and cubin; register use and spills from `ptxas -v`, which only
  nvcc's command line reports). nvcc's outputs are cached on disk by content (source, arch,
  format, nvcc's version): the checks compile the same kernels again and again.
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
import functools
import glob
import hashlib
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


@functools.cache
def _nvcc_version() -> str:
    result = subprocess.run(["nvcc", "--version"], capture_output=True, text=True)
    return result.stdout if result.returncode == 0 else ""


def _cached(kind: str, source: str, arch: str, make) -> bytes:
    """`make()` (nvcc's output of `kind` for `source` and `arch`), cached on disk by content and
    nvcc's version; failures are not cached. Files are renamed into place: pytest-xdist's
    workers may compile the same kernel at once."""
    key = hashlib.sha256("\0".join((kind, arch, _nvcc_version(), source)).encode()).hexdigest()[:32]
    folder = os.path.join(tempfile.gettempdir(), f"tvm_ext_nvcc_{os.getuid()}")
    path = os.path.join(folder, f"{key}.{kind}")
    with contextlib.suppress(OSError), open(path, "rb") as f:
        return f.read()
    data = make()
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return data


def compile_source(source: str, arch: str, target_format: str = "ptx") -> bytes:
    """Compile CUDA C for `arch` ("sm_80", "sm_90", ...) to "ptx" or "cubin" with nvcc (cached)."""
    from tvm.support import nvcc

    def make() -> bytes:
        with tvm.target.Target({"kind": "cuda", "arch": arch}):
            return bytes(nvcc.compile_cuda(source, target_format, arch=arch, compiler="nvcc"))

    return _cached(target_format, source, arch, make)


def ptx_instructions(ptx: str) -> collections.Counter:
    """How often each PTX instruction (opcode with its modifiers, e.g. "ld.shared.v4.f32") occurs,
    those of a braced inline-asm block (`{ .reg .pred p; setp...; wgmma...; }`) included."""
    ptx = re.sub(r"^\s*\{(.*)\}\s*$", lambda m: "\n".join("\t" + part for part in m.group(1).split(";")),
                 ptx, flags=re.M)
    ops = re.findall(r"^\s+(?:@%p\d+\s+)?([a-z][\w.]*)", ptx, flags=re.M)
    return collections.Counter(ops)


def _k_loop(lines: list[str], label: str, branch: str) -> list[str]:
    """The longest innermost loop of a listing, from its label (regex `label`, group 1 the name)
    to the branch back to it (`branch`, group 1 the target)."""
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(label, line))}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(branch, line)) and labels.get(m.group(1), i) < i]
    innermost = [(lo, hi) for lo, hi in loops
                 if not any(lo <= lo2 and hi2 <= hi and (lo2, hi2) != (lo, hi) for lo2, hi2 in loops)]
    lo, hi = max(innermost, key=lambda loop: loop[1] - loop[0], default=(0, -1))
    return lines[lo:hi + 1]


def main_loop_instructions(ptx: str) -> collections.Counter:
    """The PTX instructions of the k loop: the longest innermost loop body (from a label to the
    branch back to it), which every k step but a few issue."""
    body = _k_loop(ptx.splitlines(), r"^(\$L__BB\d+_\d+):", r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);")
    return ptx_instructions("\n".join(body))


def find_nvdisasm() -> str | None:
    """nvdisasm: on PATH, in the `nvidia-cuda-nvdisasm` wheel (a test dependency), or, where nvcc
    is installed, in a toolkit under /usr/local/cuda*/bin."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    candidates = []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates += sorted(glob.glob(os.path.join(root, "cu*", "bin", "nvdisasm")))
    if have_nvcc():
        candidates += sorted(glob.glob("/usr/local/cuda*/bin/nvdisasm"))
    return next((c for c in candidates if os.access(c, os.X_OK)), None)


def disassemble(cubin: bytes) -> str:
    """The SASS of a cubin (nvdisasm; raises if it is not installed)."""
    nvdisasm = find_nvdisasm()
    if nvdisasm is None:
        raise RuntimeError("disassembling SASS needs nvdisasm (pip install nvidia-cuda-nvdisasm)")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout


def sass_loop_instructions(sass: str) -> collections.Counter:
    """The SASS opcodes (without modifiers: "FFMA", "LDS", ...) of the k loop, the longest
    innermost loop: what the GPU issues per pair of k steps, the instruction mix that bounds the
    share of the FFMA peak a kernel can reach (one warp instruction per cycle per scheduler)."""
    body = _k_loop(sass.splitlines(), r"^(\.L_x_\d+):", r"\bBRA\s+`\((\.L_x_\d+)\)")
    ops = [m.group(1) for line in body
           if (m := re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line))]
    return collections.Counter(ops)


def ptxas_resources(source: str, arch: str) -> dict[str, int]:
    """`ptxas -v` for each kernel of `source`, summed: registers (max), spill bytes, shared bytes,
    and `serialized_wgmma`: the kernels where ptxas waits for every wgmma right after issuing it
    (its "Potential Performance Loss: wgmma.mma_async instructions are serialized ..." infos,
    C7513 and kin, which `-w` does not silence: say, a register a wgmma reads defined while a
    group is in flight)."""
    def make() -> bytes:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "kernel.cu")
            with open(path, "w") as f:
                f.write(source)
            cmd = ["nvcc", "-cubin", f"-arch={arch}", "-O3", "-Xptxas", "-v", "-w", path, "-o",
                   os.path.join(tmp, "kernel.cubin")]
            result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"nvcc failed for {arch}:\n{result.stderr[-3000:]}")
        return result.stderr.encode()

    info = _cached("ptxas-v", source, arch, make).decode()
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
            "shared": max(numbers["shared"], default=0),
            "serialized_wgmma": len(re.findall(r"wgmma\.mma_async instructions are serialized", info))}
