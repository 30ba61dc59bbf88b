"""TVM 0.27 installation hazards: each reproduced (or guarded) and absorbed by the package."""

import subprocess
import sys
from importlib import metadata

import numpy as np
import pytest
import tvm

import tvm_ext
from tvm_ext import _compat, ops
from tvm_ext.target import vector_isa


def test_ffi_is_pinned_below_the_crashing_release():
    assert not metadata.version("apache-tvm-ffi").startswith("0.1.15")


def test_bad_ffi_gives_a_clear_error(monkeypatch):
    monkeypatch.setattr(_compat.metadata, "version", lambda name: "0.1.15.post1")
    with pytest.raises(RuntimeError, match="apache-tvm-ffi<0.1.15"):
        tvm_ext.check_environment()


def test_save_json_and_tensorize_survive():
    """The two calls the crashing ffi breaks: a segfault here would kill the test process."""
    plan = ops.conv2d_plan((1, 16, 6, 6), (16, 16, 3, 3), padding=1)
    from tvm_ext.kernels.conv2d import conv2d_blocked_kernel

    func = conv2d_blocked_kernel(plan, vector_isa("llvm").lanes)
    text = tvm.ir.save_json(func)
    assert "tvm_ext.kernel" in text


def test_import_does_not_load_stock_tensor_intrinsics():
    """`import tvm.s_tir.tensor_intrin` costs 45-55 s; tvm_ext must never pull it in."""
    code = ("import sys, tvm_ext, numpy as np; "
            "tvm_ext.ops.relu(np.ones(4, np.float32)); "
            "tvm_ext.ops.conv2d(np.ones((1,8,5,5),np.float32), np.ones((8,8,3,3),np.float32)); "
            "print('tvm.s_tir.tensor_intrin' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_every_kernel_has_a_unique_symbol_and_attribute():
    """te.create_prim_func names every function `main`; two kernels must still link together."""
    from tvm_ext.kernels.common import KERNEL_ATTR
    from tvm_ext.kernels.elementwise import activation_func
    from tvm_ext.kernels.pool2d import Pool2dWorkload, pool2d_func

    funcs = [activation_func("relu", (64,), "float32", 8), pool2d_func(Pool2dWorkload.make((1, 8, 8, 8), "max", 2))]
    assert str(funcs[1].attrs["global_symbol"]) == "main"  # the hazard (a TE-made kernel)
    names = [f"tvm_ext_{f.attrs[KERNEL_ATTR]}" for f in funcs]
    mod = tvm.IRModule({n: f.with_attr("global_symbol", n) for n, f in zip(names, funcs, strict=True)})
    lib = tvm.compile(mod, tvm_ext.resolve_target("llvm"))
    x = tvm.runtime.tensor(np.linspace(-1, 1, 64).astype("float32"))
    y = tvm.runtime.empty((64,), "float32", tvm.cpu())
    lib[names[0]](x, y)
    np.testing.assert_allclose(y.numpy(), np.maximum(x.numpy(), 0))
