"""tvm_ext.build lowers and compiles a network's kernels on several threads (tvm_ext.link)."""

import threading

import numpy as np
import pytest
import tvm
from reference import one_input_graph
from test_pipeline import _run, _small_cnn
from tvm import relax

import tvm_ext
from tvm_ext import link
from tvm_ext.pipeline import _GPU_ONLY_TIR_PASSES


def test_build_threads_is_the_cpus_we_may_use():
    assert 1 <= link.build_threads() <= link.MAX_THREADS


def test_kernels_compile_on_threads_into_one_executable(monkeypatch, tmp_path):
    """Three threads each build a module of kernels (their TIR passes under the caller's
    PassContext: the GPU-only passes stay disabled); the executable imports all three, computes
    what a one-thread build computes, and exports to one library that loads and runs."""
    x = np.random.default_rng(0).standard_normal((1, 16, 20, 20)).astype("float32")
    one = _run(tvm_ext.build(_small_cnn(), "llvm"), x)
    monkeypatch.setattr(link, "MIN_KERNELS_PER_PART", 1)
    monkeypatch.setattr(link, "build_threads", lambda: 3)
    # All three builds wait for one another: the pool must run them side by side on three threads
    # (without it, a thread done with its part may take the next one: CI saw two threads).
    together = threading.Barrier(3, timeout=60)
    compile_one = tvm.tirx.build

    def build_together(*args, **kwargs):
        together.wait()
        return compile_one(*args, **kwargs)

    monkeypatch.setattr(tvm.tirx, "build", build_together)
    seen = []

    @tvm.instrument.pass_instrument
    class Record:
        def run_before_pass(self, _mod, info):
            seen.append((threading.current_thread().name, info.name))

    with tvm.transform.PassContext(instruments=[Record()]):
        ex = tvm_ext.build(_small_cnn(), "llvm")
    assert [m.kind for m in ex.mod.imports] == ["llvm"] * 3
    workers = {thread for thread, _ in seen if thread.startswith("tvm_ext_build")}
    assert len(workers) == 3
    in_workers = {name for thread, name in seen if thread in workers}
    assert "tirx.LowerIntrin" in in_workers and not in_workers & set(_GPU_ONLY_TIR_PASSES)
    np.testing.assert_array_equal(_run(ex, x), one)
    path = str(tmp_path / "net.so")
    ex.export_library(path)
    loaded = relax.VirtualMachine(tvm.runtime.load_module(path), tvm.cpu())
    np.testing.assert_array_equal(loaded["main"](tvm.runtime.tensor(x)).numpy(), one)


def test_few_kernels_build_in_one_module():
    """Below MIN_KERNELS_PER_PART kernels a thread, one module, as tvm.compile builds it."""
    ex = tvm_ext.build(one_input_graph((1, 8, 6, 6), lambda bb, x: bb.emit(relax.op.nn.relu(x))), "llvm")
    assert len(ex.mod.imports) == 1


def test_a_kernel_that_fails_to_compile_raises(monkeypatch):
    """An error in a worker thread reaches the caller."""
    monkeypatch.setattr(link, "MIN_KERNELS_PER_PART", 1)
    monkeypatch.setattr(link, "build_threads", lambda: 2)

    def broken(*_args, **_kwargs):
        raise RuntimeError("codegen failed")

    monkeypatch.setattr(tvm.tirx, "build", broken)
    with pytest.raises(RuntimeError, match="codegen failed"):
        tvm_ext.build(_small_cnn(), "llvm")
