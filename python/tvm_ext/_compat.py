"""Checks for the TVM 0.27 installation hazards tvm_ext depends on being absent."""

from __future__ import annotations

from importlib import metadata

# apache-tvm-ffi 0.1.15.x segfaults in Schedule.tensorize and tvm.ir.save_json with TVM 0.27.
BAD_FFI_PREFIX = "0.1.15"


def check_environment() -> None:
    """Raise RuntimeError naming the fix when a known-bad apache-tvm-ffi is installed.

    Without this check the first tensorize crashes the interpreter with a segmentation fault.
    """
    try:
        ffi = metadata.version("apache-tvm-ffi")
    except metadata.PackageNotFoundError:
        return
    if ffi.startswith(BAD_FFI_PREFIX):
        raise RuntimeError(
            f"apache-tvm-ffi {ffi} crashes TVM 0.27 in Schedule.tensorize and tvm.ir.save_json; "
            "install 'apache-tvm-ffi<0.1.15' (0.1.14.post1 works)"
        )


check_environment()
