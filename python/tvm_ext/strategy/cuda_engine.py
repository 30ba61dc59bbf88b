"""Which CUDA engine a `tensor_cores` option asks for, and which kernel (maxDNN tile, Winograd,
split-K) serves a convolution on it: the CUDA rule of :func:`tvm_ext.strategy.decide.decide`."""

from __future__ import annotations

import tvm

from ..errors import UnsupportedError
from ..kernels import conv2d as _conv
from ..kernels.cuda import maxdnn as _maxdnn
from ..kernels.cuda import winograd as _winograd

__all__ = ["FUSED_ACTIVATIONS", "conv2d_decision", "engine_for"]

# The activations the maxDNN kernel's epilogue applies itself.
FUSED_ACTIVATIONS = tuple(a for a in _maxdnn.ACTIVATIONS if a is not None)


def engine_for(tensor_cores, target: tvm.target.Target | None = None) -> str:
    """The convolution engine a `tensor_cores` option asks for: False -> fp32 FFMA, True or
    "tf32" -> tf32 mma.sync, "bf16" -> bf16 mma.sync, "wgmma_tf32" and "wgmma_bf16" -> Hopper's
    wgmma (a `target` given must then be compiled for sm_90a, as the nvidia/nvidia-h100 tag is)."""
    engines = {False: "ffma", True: "mma_tf32", "tf32": "mma_tf32", "bf16": "mma_bf16",
               "wgmma_tf32": "wgmma_tf32", "wgmma_bf16": "wgmma_bf16"}
    if tensor_cores not in engines:
        raise ValueError("tensor_cores must be False, True, 'tf32', 'bf16', 'wgmma_tf32' or 'wgmma_bf16', got "
                         f"{tensor_cores!r}")
    engine = engines[tensor_cores]
    if engine in _maxdnn.WGMMA_SHAPES and target is not None and target.attrs.get("arch") != "sm_90a":
        raise UnsupportedError(f"tensor_cores={tensor_cores!r}: wgmma exists on sm_90a only (Hopper: a target "
                               f"like 'cuda -arch=sm_90a' or the nvidia/nvidia-h100 tag); this target's arch is "
                               f"{target.attrs.get('arch')}")
    return engine


def conv2d_decision(wl: _conv.Conv2dWorkload, engine: str = "ffma", winograd: bool = False
                    ) -> tuple[str | None, str, _maxdnn.MaxDNNPlan | _winograd.WinogradPlan | None]:
    """(kernel or None, reason, plan) for a validated float32 NCHW/OIHW convolution on `engine`;
    `winograd`: the weights are constant and Winograd is allowed (FFMA only: a tensor core's
    10-bit mantissa does not survive the transforms)."""
    if wl.depthwise:
        return None, "depthwise: one filter per group would fill 1 row of a 64-row maxDNN tile; stock TVM", None
    if winograd and engine == "ffma" and not _winograd.eligible(wl):
        fast, direct_ms, winograd_ms = _winograd.choose_plan(wl)
        if fast is not None and direct_ms >= _winograd.MIN_SPEEDUP * winograd_ms:
            gemm = fast.gemm
            return _winograd.KERNEL_NAME, (
                f"Winograd F({fast.m}x{fast.m}, {wl.KH}x{wl.KW}): {fast.a ** 2} GEMMs on the {gemm.tile.rows}x"
                f"{gemm.tile.cols} ffma tile, grid {gemm.grid}, between an input and an output transform "
                f"(estimated {direct_ms / winograd_ms:.1f}x faster than direct)"), fast
    try:
        plan = _maxdnn.MaxDNNPlan.make(
            wl, _maxdnn.choose_tile(wl.K // wl.groups, engine, columns=wl.N * wl.OH * wl.OW))
    except ValueError as err:  # a tensor too large for the kernel's indices
        return None, f"{err}: stock TVM", None
    reason = f"{plan.tile.rows}x{plan.tile.cols} {engine} tile, grid {plan.grid}"
    if plan.tile.wgmma is not None:
        reason += ", A fragments " + ("gathered from the input" if plan.gathers_fragments else "through shared memory")
    plan = plan.with_chosen_splits()
    if plan.splits > 1:
        reason += (f" x {plan.splits} split-K slices of its {plan.split_slices[0]} (a small grid), summed by a "
                   "second kernel")
    return _maxdnn.KERNEL_NAME, reason, plan
