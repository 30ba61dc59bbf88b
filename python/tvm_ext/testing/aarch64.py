"""Execute AArch64 builds on an x86 machine: NEON kernels run, not only compile.

A Relax module built for an AArch64 target (:data:`NEON_TARGET`) is linked into a shared library
with the AArch64 linker (:func:`export`), and :func:`run` executes many of them in one
qemu-user process with TVM's own AArch64 runtime (the sysroot of
:mod:`tvm_ext.testing.aarch64_sysroot`, `make aarch64`): the instructions, the calling
convention, the runtime's parallel launch and memory pool are the ones an Arm server would run.
:func:`unavailable` says why not, for tests to skip with.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tvm import relax

from .aarch64_sysroot import DEFAULT_ROOT, HOST_TOOLS, python_path, site_path

__all__ = ["NEON_TARGET", "Case", "unavailable", "export", "run"]

# A Cortex-A72 (Raspberry Pi 4, AWS Graviton 1): NEON, no SVE, no dot products.
NEON_TARGET = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a72"}
_RUNNER = Path(__file__).with_name("aarch64_runner.py")
_LINKER = "aarch64-linux-gnu-ld"


@dataclasses.dataclass
class Case:
    """One call to run: `executable`'s `function` on `inputs`."""

    executable: relax.VMExecutable
    inputs: Sequence[np.ndarray]
    function: str = "main"


def unavailable(root: Path = DEFAULT_ROOT) -> str | None:
    """None when :func:`run` can run here, else what is missing and how to get it."""
    missing = [cmd for cmd in HOST_TOOLS if shutil.which(cmd) is None]
    if missing:
        return f"{', '.join(missing)} not found (`make aarch64` installs {', '.join(HOST_TOOLS[m] for m in missing)})"
    if not (Path(root) / ".ready").exists():
        return f"no AArch64 sysroot at {root} (`make aarch64` prepares it)"
    return None


def _link(output: str, objects: list[str], options: list[str] | None = None) -> None:
    """export_library's compiler: the objects TVM wrote for AArch64, linked by the cross linker
    (no C compiler needed: the kernels and the VM's bytecode blob are objects already)."""
    subprocess.run([_LINKER, "-shared", "-o", output, *objects], check=True, capture_output=True, text=True)


_link.output_format = "so"  # type: ignore[attr-defined] - read by export_library


def export(executable: relax.VMExecutable, path: str | os.PathLike) -> Path:
    """Link `executable` (built for an AArch64 target) into the shared library `path`."""
    executable.export_library(str(path), fcompile=_link)
    return Path(path)


def run(cases: Sequence[Case], root: Path = DEFAULT_ROOT, timeout: float = 900) -> list[list[np.ndarray] | str]:
    """Run every case in one qemu-aarch64 process (its start, ~3 s, is paid once). Per case: its
    outputs (a tuple flattened), or the error it raised there as text. A crash of the emulated
    process raises RuntimeError naming the case it was running."""
    reason = unavailable(root)
    if reason:
        raise RuntimeError(f"cannot run AArch64 modules: {reason}")
    with tempfile.TemporaryDirectory(prefix="tvm_ext_aarch64_") as tmp:
        manifest = []
        for i, case in enumerate(cases):
            library = export(case.executable, Path(tmp) / f"case{i}.so")
            inputs = Path(tmp) / f"case{i}_inputs.npz"
            np.savez(inputs, *[np.asarray(x) for x in case.inputs])
            manifest.append({"library": str(library), "function": case.function, "inputs": str(inputs),
                             "outputs": str(Path(tmp) / f"case{i}_outputs.npz")})
        (Path(tmp) / "manifest.json").write_text(json.dumps(manifest))
        done = subprocess.run(["qemu-aarch64", "-L", str(root), str(python_path(root)), str(_RUNNER),
                               str(site_path(root)), str(Path(tmp) / "manifest.json")],
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            last = [line for line in done.stderr.splitlines() if line.startswith("case ")]
            raise RuntimeError(f"qemu-aarch64 exited with {done.returncode} in {last[-1] if last else 'start-up'}:\n"
                               f"{done.stderr[-3000:]}")
        results: list[list[np.ndarray] | str] = []
        for case in manifest:
            error = Path(case["outputs"] + ".error")
            if error.exists():
                results.append(error.read_text())
                continue
            with np.load(case["outputs"]) as saved:
                results.append([saved[f"arr_{i}"] for i in range(len(saved.files))])
        return results
