"""Run generated CUDA C on the CPU: numbers for CUDA kernels on a machine without a GPU.

The kernel source TVM emits is compiled with g++ against a small header (`cuda_emulator.h`: CUDA's
types and built-ins) and linked against the emulator's runtime (`cuda_emulator.cc`, compiled once
into a shared library: the fibers, the scheduler, shared memory, the tensor cores), so a kernel
compiles in little more than its own code's time. Each thread of a block is a fiber that switches
with `_setjmp`/`_longjmp` (no system call) and the fibers run cooperatively, one at a time, each
from one `__syncthreads()` to the next; blocks run one after the other. That order is deterministic
and adversarial for the bugs a barrier exists to prevent: thread 0 runs ahead to its barrier before
any other thread has written its part of a shared tile, so a missing barrier reads data that is not
there yet, and a buffer overwritten before everyone has read it shows up as a wrong result. Shared
memory is a per-block arena filled with NaN when the block starts, so reading shared data nobody
wrote poisons the output instead of passing silently with a previous block's values.
Warp-collective tensor-core instructions (`mma.sync` m16n8k8 tf32 and m16n8k16 bf16, as TVM's
inline PTX) become a rendezvous of the calling warp's lanes (only theirs: a missing `__syncthreads`
still shows) and the PTX ISA's fragment layouts, with tf32 operands truncated as the hardware reads
them. Hopper's asynchronous `wgmma.mma_async` (m64nNk8 tf32 and m64nNk16 bf16, A from registers, B
through a shared-memory matrix descriptor, K-major without swizzle) is recorded when issued and
carried out, for each thread, at the `wgmma.wait_group` that retires its group, which blocks only
until every thread of the warpgroup has committed that group (the hardware's one guarantee: it is
no barrier for anything else). B is read from shared memory then, so a kernel that overwrites the
tile before waiting, reads its accumulators early, or never waits, gets wrong numbers or an error;
the tensor cores may read B at any time in between, so a B tile that changed between a wgmma's
issue and its wait (a digest taken at each) is reported as a race. Shared memory is one arena per
block, so the descriptors' 14-bit shared addresses (`__cvta_generic_to_shared`) work; the dynamic
`extern __shared__` array is as large as the launch says.

What it does not model: warps, timing, memory coalescing, out-of-bounds global accesses (they are
plain C++ accesses), a wgmma's A registers rewritten before its wait (they are taken at the issue;
ptxas serializes such a wgmma, with a warning, which the tests check for), and any CUDA feature
beyond what TVM's fp32 kernels use.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping

import numpy as np

from ..kernels.cuda.toolchain import kernel_names, kernel_params

_HERE = os.path.dirname(os.path.abspath(__file__))


def _read(name: str) -> str:
    with open(os.path.join(_HERE, name)) as f:
        return f.read()


HEADER = _read("cuda_emulator.h")  # what a kernel sees; the runtime is in cuda_emulator.cc


class EmulationError(RuntimeError):
    """The kernel could not be compiled or did something the emulator cannot run."""


def have_compiler() -> bool:
    """Whether g++ (which the emulator compiles with) is installed."""
    return shutil.which("g++") is not None


_SHARED = re.compile(r"__shared__\s+(?:alignas\(\d+\)\s+)?(\w+)\s+(\w+)\[(\d+)\];")
_DYNAMIC_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?(\w+)\s+(\w+)\[\];")
_MMA = re.compile(r'__asm__ __volatile__\(\s*"mma\.sync\.aligned\.([\w.]+)"\s*"[^"]*"\s*:(.*?)\);', re.S)
_SUPPORTED_MMA = {"m16n8k8.row.col.f32.tf32.tf32.f32": "mma_m16n8<8, 1>",
                  "m16n8k16.row.col.f32.bf16.bf16.f32": "mma_m16n8<16, 2>"}
# TVM's wgmma helpers (`T.ptx["wgmma..."]`): one inline-PTX statement each, in the preamble
_WGMMA_ASM = re.compile(r'asm volatile\("((?:[^"\\]|\\.)*)"\s*:(.*?)\);', re.S)
# (A from registers; the 16-bit types' B-transpose immediate last, only 0 = K-major emulated)
_WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k(\d+)\.f32\.(tf32|bf16)\.\3 \{[^}]*\}, "
                    r"\{[^}]*\}, %\d+, ps0, (-?1), (-?1)(?:, (\d))?;")
_WGMMA_TYPES = {("tf32", 8): 1, ("bf16", 16): 2}  # (type, K): values a register


def _operands(text: str) -> list[str]:
    """The C expressions of an inline-asm operand list: `"=f"(expr), "r"(expr), ...`."""
    exprs, i = [], 0
    while True:
        i = text.find('"(', i)
        if i < 0:
            return exprs
        depth, j = 0, i + 1
        while True:
            depth += {"(": 1, ")": -1}.get(text[j], 0)
            if depth == 0:
                break
            j += 1
        exprs.append(text[i + 2:j])
        i = j


def _emulate_mma(match: re.Match) -> str:
    kind = match.group(1)
    if kind not in _SUPPORTED_MMA:
        raise EmulationError(f"the emulator has no mma.sync.aligned.{kind}")
    outputs, _, inputs = match.group(2).partition(":")
    args = [f"&({e})" for e in _operands(outputs)] + _operands(inputs)
    return f"emu::{_SUPPORTED_MMA[kind]}({', '.join(args)});"


def _emulate_wgmma(match: re.Match) -> str:
    """One of TVM's wgmma helper statements -> its emulation (see the header)."""
    text, operands = match.group(1), match.group(2)
    if text.startswith("wgmma.fence.sync.aligned"):
        return "emu::wgmma_fence();"
    if text.startswith("fence.proxy.async.shared::cta"):
        return "emu::fence_proxy_async();"
    if text.startswith("wgmma.commit_group.sync.aligned"):
        return "emu::wgmma_commit();"
    if text.startswith("wgmma.wait_group.sync.aligned"):
        return f"emu::wgmma_wait({int(text.split()[1].rstrip(';'))});"
    mma = _WGMMA.search(text)
    if mma is None or (mma.group(3), int(mma.group(2))) not in _WGMMA_TYPES:
        raise EmulationError(f"the emulator has no {text.split(';')[-2].strip().split()[0]!r}")
    if (mma.group(6) or "0") != "0":
        raise EmulationError("the emulator reads a wgmma's B tile K-major only (its transpose immediate 0)")
    n, k, scale_a, scale_b = int(mma.group(1)), int(mma.group(2)), mma.group(4), mma.group(5)
    per = _WGMMA_TYPES[mma.group(3), k]
    outputs, _, inputs = operands.partition(":")
    d, rest = _operands(outputs), _operands(inputs)
    if len(d) != n // 2 or len(rest) != 6:
        raise EmulationError(f"wgmma m64n{n}k{k}: {len(d)} accumulators and {len(rest)} inputs, expected "
                             f"{n // 2} and 6")
    a, desc, scale_d = rest[:4], rest[4], rest[5]
    return (f"{{ float* d_[] = {{{', '.join(f'&({e})' for e in d)}}}; "
            f"emu::wgmma_mma({n}, {k}, {per}, d_, {', '.join(a)}, {desc}, ({scale_d}) != 0, {scale_a}, {scale_b}); }}")


def _helpers(source: str, start: int) -> str:
    """TVM's device helpers the kernels call when they issue wgmma (the descriptor type and
    encoder, one function per instruction), from the preamble, their inline PTX emulated."""
    if "wgmma" not in source[start:]:
        return ""
    begin = source.find("#ifndef HOST_DEVICE")
    if begin < 0 or begin > start:
        raise EmulationError("the kernel calls wgmma helpers the source does not define")
    return _WGMMA_ASM.sub(_emulate_wgmma, source[begin:start])


def _device_code(source: str) -> str:
    """The kernels without TVM's CUDA preamble (but with the wgmma helpers they call): shared
    arrays turned into per-block arenas, tensor-core instructions (inline PTX) into calls of
    their emulation."""
    start = source.find('extern "C" __global__')
    if start < 0:
        raise EmulationError("the source has no __global__ kernel")
    code = _SHARED.sub(r"\1* \2 = emu::shared<\1>(\3);", source[start:])
    code = _DYNAMIC_SHARED.sub(r"\1* \2 = emu::dynamic_shared<\1>();", code)
    code = _helpers(source, start) + _MMA.sub(_emulate_mma, code)
    if "__asm__" in code or "asm volatile" in code:
        raise EmulationError("the kernel has inline PTX the emulator does not know")
    return code


def _cache_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), f"tvm_ext_cuda_emu_{os.getuid()}")
    os.makedirs(path, exist_ok=True)
    return path


def _params(source: str, kernel: str) -> list[tuple[str, str]]:
    try:
        return kernel_params(source, kernel)
    except ValueError as err:
        raise EmulationError(str(err)) from None


# TVM's kernels are long, unrolled code: -O1 takes 3-4 times as long as -O0 to compile them, and the
# code runs about 1.4 times as fast (the emulated FFMA tile), which pays only for grids far larger
# than a test's. The runtime is compiled once.
_KERNEL_OPT = "-O0"
_RUNTIME_OPT = "-O2"


def _compile(text: str, prefix: str, opt: str, libraries: tuple[str, ...] = ()) -> str:
    """`text` compiled with g++ `opt` into a shared library of the cache directory,
    `<prefix>_<digest>.so`, by content and flags (once: the file is reused when there);
    `libraries` are shared libraries of that directory it links against. Returns its path."""
    folder = _cache_dir()
    digest = hashlib.sha256(f"{opt}\n{text}".encode()).hexdigest()[:20]
    lib = os.path.join(folder, f"{prefix}_{digest}.so")
    if not os.path.exists(lib):
        # files of this process, renamed into place: pytest-xdist's workers may build the same
        # kernel at once, and a file replaced while another process writes it would be truncated
        src, tmp = f"{lib[:-3]}.{os.getpid()}.cc", f"{lib}.{os.getpid()}.tmp"
        with open(src, "w") as f:
            f.write(text)
        links = [f"-L{folder}", *(f"-l:{library}" for library in libraries), f"-Wl,-rpath,{folder}"]
        cmd = ["g++", "-std=c++17", opt, "-w", "-shared", "-fPIC", src, "-o", tmp, *links]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode:
            raise EmulationError(f"g++ failed on {prefix}:\n{result.stderr[-4000:]}")
        os.replace(src, lib[:-3] + ".cc")  # kept beside the library, to read
        os.replace(tmp, lib)
    return lib


@functools.cache
def _runtime() -> str:
    """The emulator's runtime library (cuda_emulator.cc with the header in it), by content."""
    text = _read("cuda_emulator.cc").replace('#include "cuda_emulator.h"', HEADER, 1)
    return os.path.basename(_compile(text, "libtvm_ext_cuda_emu", _RUNTIME_OPT))


@functools.cache
def compile_source(source: str) -> ctypes.CDLL:
    """Compile the kernels of `source` for the CPU into one library and load it (cached on disk by
    content, and in this process: a network's emulation launches each kernel many times).

    Kernel `k` is launched by the library's `emu_launch_k`; kernels with parameters that are not
    pointers (which `run_kernel` refuses) get none.
    """
    kernels, launchers = kernel_names(source), []
    if not kernels:
        raise EmulationError("the source has no __global__ kernel")
    for kernel in kernels:
        try:
            params = kernel_params(source, kernel)
        except ValueError:
            continue
        args = ", ".join(f"({ty}*)args[{i}]" for i, (ty, _) in enumerate(params))
        launchers.append(f"""
static void emu_body_{kernel}(void** args) {{ {kernel}({args}); }}
extern "C" int emu_launch_{kernel}(void** args, unsigned gx, unsigned gy, unsigned gz,
                          unsigned bx, unsigned by, unsigned bz, size_t dynamic_shared_bytes) {{
  return emu::launch(emu_body_{kernel}, args, {{gx, gy, gz}}, {{bx, by, bz}}, dynamic_shared_bytes);
}}""")
    runtime = _runtime()
    text = (f"// links against {runtime}\n" + HEADER + _device_code(source) + "".join(launchers) + """
extern "C" const char* emu_failure() { return emu::failure_message(); }
""")
    return ctypes.CDLL(_compile(text, kernels[0][:80], _KERNEL_OPT, (runtime,)))


def _body(source: str, kernel: str) -> str:
    """The text of `kernel`'s definition in `source` (up to the next kernel's)."""
    for chunk in source.split('extern "C" __global__')[1:]:
        head = chunk.split("{", 1)[0]
        if f" {kernel}(" in head and not head.rstrip().endswith(";"):
            return chunk
    return ""


def run_kernel(source: str, kernel: str, grid: tuple[int, int, int], block: tuple[int, int, int],
               arrays: Mapping[str, np.ndarray], shared_bytes: int = 0) -> None:
    """Run `kernel` over `grid` x `block` on the CPU, on `arrays` named as its parameters, with
    `shared_bytes` of dynamic shared memory (its `extern __shared__` array).

    A parameter `X_ptr` takes `arrays["X"]` (or `arrays["X_ptr"]`); arrays must be C-contiguous
    and of the parameter's element type. Outputs are written in place.
    """
    params = _params(source, kernel)
    if not shared_bytes and "extern __shared__" in _body(source, kernel):
        raise EmulationError(f"{kernel}: declares dynamic shared memory and is launched with none (extern "
                             "__shared__, shared_bytes=0): on a GPU its accesses go out of bounds")
    ctype = {"float": np.float32, "double": np.float64, "int": np.int32, "float4": np.float32}
    pointers = []
    for ty, name in params:
        key = name if name in arrays else name.removesuffix("_ptr")
        if key not in arrays:
            raise EmulationError(f"{kernel}: no array for parameter {name}")
        arr = arrays[key]
        if not arr.flags.c_contiguous or arr.dtype != ctype.get(ty, None):
            raise EmulationError(f"{kernel}: {name} needs a C-contiguous {ty} array, got {arr.dtype}")
        pointers.append(arr.ctypes.data_as(ctypes.c_void_p))
    lib = compile_source(source)
    argv = (ctypes.c_void_p * max(1, len(pointers)))(*pointers)
    launch = getattr(lib, f"emu_launch_{kernel}")
    status = launch(argv, *(ctypes.c_uint(v) for v in (*grid, *block)), ctypes.c_size_t(shared_bytes))
    if status == 1:
        raise EmulationError(f"{kernel}: the threads of a block did not all reach the same __syncthreads()")
    if status:
        lib.emu_failure.restype = ctypes.c_char_p
        raise EmulationError(f"{kernel}: {lib.emu_failure().decode()}")
