"""Run under qemu-aarch64 by :mod:`tvm_ext.testing.aarch64`: load each case's Relax VM library
with TVM's AArch64 runtime, call its function on the saved inputs and save the outputs.

`python3 aarch64_runner.py SITE MANIFEST`: SITE holds NumPy, tvm_ffi and tvm/lib/libtvm_runtime.so;
MANIFEST is JSON, a list of {"library", "function", "inputs", "outputs"} (paths of the .so, .npz
in, .npz out). A case that raises writes its error to "outputs" + ".error" and the next one runs.
Imports only NumPy and tvm_ffi: there is no TVM compiler (nor tvm_ext) on this side.
"""

import ctypes
import json
import sys
import traceback
from pathlib import Path


def _flatten(value, tvm_ffi) -> list:
    if isinstance(value, tvm_ffi.Tensor):
        return [value]
    return [tensor for item in value for tensor in _flatten(item, tvm_ffi)]


def main() -> None:
    site, manifest = sys.argv[1], sys.argv[2]
    sys.path.insert(0, site)
    import numpy as np
    import tvm_ffi

    # the Relax VM and the kernels' runtime calls (workspace, parallel launch) live here
    ctypes.CDLL(str(Path(site) / "tvm" / "lib" / "libtvm_runtime.so"), mode=ctypes.RTLD_GLOBAL)
    for index, case in enumerate(json.loads(Path(manifest).read_text())):
        print(f"case {index}: {case['library']}", file=sys.stderr, flush=True)
        try:
            vm = tvm_ffi.load_module(case["library"])["vm_load_executable"]()
            vm["vm_initialization"](1, 0, 2)  # kDLCPU, device 0, the pooled allocator
            with np.load(case["inputs"]) as saved:
                inputs = [tvm_ffi.from_dlpack(np.ascontiguousarray(saved[f"arr_{i}"])) for i in range(len(saved.files))]
            outputs = _flatten(vm[case["function"]](*inputs), tvm_ffi)
            np.savez(case["outputs"], *[np.from_dlpack(t) for t in outputs])
        except Exception:  # noqa: BLE001 - reported to the host, which decides
            Path(case["outputs"] + ".error").write_text(traceback.format_exc())


if __name__ == "__main__":
    main()
