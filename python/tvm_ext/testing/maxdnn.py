"""The CUDA convolution kernels on the CPU emulator, and the maxDNN kernel deliberately broken.

:func:`emulate` runs a maxDNN plan's kernels (:mod:`tvm_ext.kernels.cuda.maxdnn`) and
:func:`emulate_winograd` a Winograd plan's three (:mod:`tvm_ext.kernels.cuda.winograd`) on
:mod:`tvm_ext.testing.cuda_emulator`, so that their CUDA C is checked on a machine without a GPU.

:data:`FAULTS` are the broken kernels the tests show the emulator catches: subclasses of the
generator (:class:`~tvm_ext.kernels.cuda.maxdnn.codegen.Generator`) that each override one of its
steps, so the production generator carries no test switches. A missing barrier cannot be built
this way (TVM's barrier planner puts it back): the tests delete one from the generated CUDA.
"""

from __future__ import annotations

import numpy as np

from ..kernels.cuda import winograd as _winograd
from ..kernels.cuda.maxdnn import codegen as _codegen
from ..kernels.cuda.maxdnn.operands import Cond, Expr
from ..kernels.cuda.maxdnn.plan import FLAT_PARAMS, KERNEL_NAME, MaxDNNPlan
from ..kernels.cuda.maxdnn.split_k import REDUCE_SUFFIX, reduce_launch
from .cuda_emulator import run_kernel


class WrongBuffer(_codegen.Generator):
    """Computes on the buffer (ring slot) being filled instead of the one filled last step."""

    def source_buffer(self, filled: int, filling: int) -> int:
        return filling


class NoStore(_codegen.Generator):
    """Never moves the prefetched tiles into shared memory (the prologue's first tile still is)."""

    def store_prefetched(self, buf: int, kt: Expr, when: Cond | None) -> None:
        pass


class NoProxyFence(_codegen.Generator):
    """wgmma: no `fence.proxy.async` between the weights' stores and the tensor cores' reads."""

    def fence_proxy_async(self) -> None:
        pass


# fault -> the generator that builds it (None: the working kernel)
FAULTS = {None: _codegen.Generator, "wrong_buffer": WrongBuffer, "no_store": NoStore,
          "no_proxy_fence": NoProxyFence}


def cuda_source(plan: MaxDNNPlan, target="nvidia/nvidia-h100", fault: str | None = None) -> str:
    """The CUDA C of `plan` (:func:`tvm_ext.kernels.cuda.maxdnn.cuda_source`), with `fault`
    (one of :data:`FAULTS`) built into it."""
    if fault not in FAULTS:
        raise ValueError(f"maxdnn_conv2d: fault {fault!r} is not one of {tuple(FAULTS)}")
    return _codegen.cuda_source(plan, target, generator=FAULTS[fault])


def emulate(plan: MaxDNNPlan, arrays: dict[str, np.ndarray], source: str | None = None) -> np.ndarray:
    """Run the kernels of `plan` on the CPU emulator (:mod:`tvm_ext.testing.cuda_emulator`).

    `arrays` are the kernels' parameters (:func:`~tvm_ext.kernels.cuda.maxdnn.kernel_arrays`);
    returns arrays["y"], written.
    """
    source = source or _codegen.cuda_source(plan)
    main = {FLAT_PARAMS[name]: arrays[name] for name in plan.shapes()}
    run_kernel(source, KERNEL_NAME + "_kernel", plan.grid, (plan.tile.threads, 1, 1), main, plan.dynamic_shared_bytes)
    if plan.splits > 1:
        reduce = {("output" if name == "y" else name): arrays[name] for name in plan.reduce_shapes()}
        run_kernel(source, KERNEL_NAME + REDUCE_SUFFIX + "_kernel", *reduce_launch(plan), reduce)
    return arrays["y"]


def emulate_winograd(plan: _winograd.WinogradPlan, arrays: dict[str, np.ndarray],
                     source: str | None = None) -> np.ndarray:
    """Run a Winograd plan's three kernels on the CPU emulator (:func:`~tvm_ext.kernels.cuda.winograd.run_on_gpu`'s
    counterpart); `arrays`: :func:`~tvm_ext.kernels.cuda.winograd.kernel_arrays`. Returns arrays["y"], written."""
    source = source or _winograd.cuda_source(plan)
    params = plan.stage_params()
    for stage, (grid, block) in plan.launches().items():
        bound = {stem: arrays[name] for stem, name in params[stage].items()}
        run_kernel(source, f"{_winograd.KERNEL_NAME}_{stage}_kernel", grid, block, bound, plan.shared_bytes(stage))
    return arrays["y"]
