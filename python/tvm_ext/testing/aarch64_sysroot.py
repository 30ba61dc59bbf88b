"""Set up what runs our NEON kernels on an x86 machine: qemu-user, an AArch64 linker and a small
AArch64 Python with NumPy, tvm-ffi and TVM's runtime library.

`python -m tvm_ext.testing.aarch64_sysroot DIR` (`make aarch64`) installs the Debian packages
qemu-user and binutils-aarch64-linux-gnu when they are missing (as root, with apt-get), extracts
Debian's arm64 Python and the C/C++ libraries it needs into DIR (apt-get download and dpkg -x:
nothing of arm64 is installed on the host), and unpacks the manylinux aarch64 wheels of NumPy,
apache-tvm-ffi and apache-tvm (only its libtvm_runtime.so: the compiler stays on the host) at the
host's versions, so that the runtime reads what the host's TVM wrote. `DIR/.ready` records them.
:mod:`tvm_ext.testing.aarch64` runs modules in it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["HOST_TOOLS", "DEFAULT_ROOT", "prepare", "python_path", "site_path"]

# command -> the Debian package that provides it
HOST_TOOLS = {"qemu-aarch64": "qemu-user", "aarch64-linux-gnu-ld": "binutils-aarch64-linux-gnu"}
# the repository's .aarch64 (an editable install), unless TVM_EXT_AARCH64_ROOT names another
DEFAULT_ROOT = Path(os.environ.get("TVM_EXT_AARCH64_ROOT", Path(__file__).resolve().parents[3] / ".aarch64"))
# Debian arm64 packages of the interpreter and the shared libraries it, NumPy and TVM's runtime load
_LIBRARIES = ["libc6", "libexpat1", "zlib1g", "libffi8", "libstdc++6", "libgcc-s1"]
_APT_ARM64 = ["-o", "APT::Architectures::=amd64", "-o", "APT::Architectures::=arm64"]
_WHEEL_PLATFORM = "manylinux_2_28_aarch64"


def python_path(root: Path) -> Path:
    """The AArch64 interpreter inside `root` (run it with `qemu-aarch64 -L root`)."""
    found = sorted((root / "usr" / "bin").glob("python3.*"))
    if not found:
        raise FileNotFoundError(f"no AArch64 Python under {root}: run `make aarch64`")
    return found[0]


def site_path(root: Path) -> Path:
    """Where the AArch64 wheels are unpacked (on the runner's sys.path)."""
    return root / "site"


def _run(cmd: list[str], **kwargs) -> str:
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({done.returncode}):\n{done.stderr.strip()[-2000:]}")
    return done.stdout


def _install_host_tools() -> None:
    missing = sorted({pkg for cmd, pkg in HOST_TOOLS.items() if shutil.which(cmd) is None})
    if not missing:
        return
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        raise RuntimeError(f"install the Debian packages {' '.join(missing)} (needs apt-get as root)")
    _run(["apt-get", "update", "-q"])
    _run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing],
         env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def _extract_debian_python(root: Path, work: Path) -> str:
    """Extract the arm64 interpreter and libraries into `root`; returns its version ('3.11')."""
    _run(["apt-get", *_APT_ARM64, "update", "-q"])
    depends = _run(["apt-cache", *_APT_ARM64, "depends", "python3-minimal:arm64"])
    match = re.search(r"Depends: python(3\.\d+)-minimal", depends)
    if not match:
        raise RuntimeError(f"cannot tell Debian's arm64 Python version from:\n{depends}")
    version = match.group(1)
    packages = [f"python{version}-minimal", f"libpython{version}-minimal", f"libpython{version}-stdlib",
                *_LIBRARIES]
    debs = work / "debs"
    debs.mkdir()
    # apt's sandbox user cannot write to a root-owned temporary directory
    _run(["apt-get", *_APT_ARM64, "-o", "APT::Sandbox::User=root", "download",
          *[f"{p}:arm64" for p in packages]], cwd=debs)
    for deb in sorted(debs.glob("*.deb")):
        _run(["dpkg", "-x", str(deb), str(root)])
    return version


def _unpack_wheels(root: Path, python_version: str, work: Path) -> None:
    """Unpack the AArch64 wheels at the host's versions into site_path(root)."""
    pins = {name: importlib.metadata.version(name)
            for name in ("numpy", "apache-tvm-ffi", "apache-tvm", "typing_extensions")}
    wheels = work / "wheels"
    _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
          "--platform", _WHEEL_PLATFORM, "--python-version", python_version, "-d", str(wheels),
          *[f"{name}=={version}" for name, version in pins.items()]])
    site = site_path(root)
    site.mkdir(parents=True, exist_ok=True)
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            if wheel.name.startswith("apache_tvm-"):
                # the runtime only: libtvm_compiler.so alone is 240 MB
                archive.extract("tvm/lib/libtvm_runtime.so", site)
            else:
                archive.extractall(site)


def prepare(root: Path = DEFAULT_ROOT) -> Path:
    """Make `root` a sysroot that runs host-built AArch64 modules (see the module docstring);
    a no-op when `root/.ready` names the host's versions already."""
    root = Path(root)
    _install_host_tools()
    stamp = root / ".ready"
    pins = {name: importlib.metadata.version(name) for name in ("numpy", "apache-tvm-ffi", "apache-tvm")}
    wanted = "".join(f"{name}=={version}\n" for name, version in sorted(pins.items()))
    if stamp.exists() and stamp.read_text() == wanted:
        return root
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        version = _extract_debian_python(root, Path(tmp))
        _unpack_wheels(root, version, Path(tmp))
    stamp.write_text(wanted)
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description="Prepare the AArch64 sysroot that runs NEON builds under qemu-user.")
    parser.add_argument("root", nargs="?", type=Path, default=DEFAULT_ROOT)
    try:
        root = prepare(parser.parse_args().root)
    except (RuntimeError, OSError) as err:
        sys.exit(f"aarch64 sysroot not prepared: {err}")
    print(f"aarch64 sysroot ready: {root}")


if __name__ == "__main__":
    main()
