"""The maxDNN kernel's host side: NumPy arrays in its layouts (CHWN activations, CRSK/RSCK weights,
wgmma's packed weight tiles, bf16 pairs) and the order of its CUDA parameters.

What runs the kernel outside a TVM executable (the emulator, the GPU check, the eager op) needs
these; the graph strategy builds the same layouts from graph ops (strategy/cuda.py).
"""

from __future__ import annotations

import numpy as np

from ..toolchain import kernel_params
from .plan import FLAT_PARAMS, MaxDNNPlan


def data_to_chwn(x: np.ndarray) -> np.ndarray:
    """NCHW activations -> the kernel's CHWN (a copy; graph edges do this once)."""
    return np.ascontiguousarray(np.asarray(x).transpose(1, 2, 3, 0))


def output_to_nchw(y: np.ndarray) -> np.ndarray:
    """The kernel's KPQN output -> NCHW."""
    return np.ascontiguousarray(np.asarray(y).transpose(3, 0, 1, 2))


def weight_to_crsk(w: np.ndarray, groups: int = 1, k_order: str = "crs") -> np.ndarray:
    """OIHW weights -> [groups, I*H*W, O/groups], the A operand of each group's GEMM, its rows in
    the reduction order `k_order` ("crs": CRSK; "rsc": RSCK, see :attr:`MaxDNNPlan.k_order`)."""
    w = np.asarray(w)
    o, i, kh, kw = w.shape
    if o % groups:
        raise ValueError(f"weight_to_crsk: {o} output channels do not split into {groups} groups")
    if k_order not in ("crs", "rsc"):
        raise ValueError(f"weight_to_crsk: k_order must be 'crs' or 'rsc', got {k_order!r}")
    axes = (0, 2, 3, 4, 1) if k_order == "crs" else (0, 3, 4, 2, 1)
    per_group = w.reshape(groups, o // groups, i, kh, kw).transpose(*axes)
    return np.ascontiguousarray(per_group.reshape(groups, i * kh * kw, o // groups))


# The wgmma weights' packing, as a permutation of the zero-padded [groups, K, M] weights viewed as
# (g, step, k-chunk, k % c, block, n-group of 8, n % 8) with c = WgmmaShape.core_k: to (g, block,
# step, n-group, k-chunk, n % 8, k % c). Shared by the NumPy packing and the graph's (strategy/cuda.py).
WGMMA_PACK_AXES = (0, 4, 1, 5, 2, 6, 3)


def wgmma_pack_tiles(plan: MaxDNNPlan) -> tuple[tuple[int, int, int], tuple[int, ...]]:
    """The padded [groups, K, M] shape of the weights :func:`pack_wgmma_weight` packs, and its
    7-D view that :data:`WGMMA_PACK_AXES` permutes."""
    t = plan.tile
    groups, blocks, steps, _ = plan.weight_shape
    c = t.wgmma_shape.core_k
    return ((groups, steps * t.k_step, blocks * t.rows),
            (groups, steps, t.k_step // c, c, blocks, t.rows // 8, 8))


def bf16_pairs(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16 as CUDA's `__float2bfloat16` does (nearest even; a NaN
    becomes 0x7FFF) and packed in pairs along the last axis, the first of each pair in the low
    half, as float32 words (their bits): what a 32-bit load of two consecutive bf16 gives."""
    a = np.ascontiguousarray(a, np.float32)
    bits = a.view(np.uint32).astype(np.uint64)
    rounded = np.where(np.isnan(a), 0x7FFF, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    if rounded.shape[-1] % 2:
        raise ValueError(f"bf16_pairs: the last axis has {rounded.shape[-1]} values, not pairs")
    return rounded.view(np.uint32).view(np.float32)


def pack_wgmma_weight(wt: np.ndarray, plan: MaxDNNPlan) -> np.ndarray:
    """[groups, K, M] weights (:func:`weight_to_crsk`) -> the wgmma kernel's: per group, block of
    rows and k step, the rows x k_step tile in the shared layout the tensor cores read (K-major
    core matrices, :class:`WgmmaShape`; bf16: rounded and packed in pairs, :func:`bf16_pairs`),
    zero-padded past M and K. A block's k steps are then contiguous chunks it copies to shared
    memory as they are, float4 by float4, with no guards."""
    k, m = plan.gemm[2], plan.gemm[0]
    if wt.shape != (plan.wl.groups, k, m):
        raise ValueError(f"pack_wgmma_weight: weights of shape {wt.shape}, the plan's GEMM needs "
                         f"{(plan.wl.groups, k, m)}")
    padded_shape, tiles = wgmma_pack_tiles(plan)
    padded = np.zeros(padded_shape, np.float32)
    padded[:, :k, :m] = wt
    packed = padded.reshape(tiles).transpose(*WGMMA_PACK_AXES)
    if plan.tile.wgmma_shape.per_reg == 2:
        packed = bf16_pairs(packed)
    return np.ascontiguousarray(packed.reshape(plan.weight_shape))


def kernel_arrays(plan: MaxDNNPlan, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None,
                  residual: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The parameters of the plan's kernels from NCHW/OIHW NumPy arrays (and an NCHW residual),
    by name: x, w[, bias][, residual][, partial], y.

    The outputs ("y"; "partial", split-K's slices) start filled with NaN so that anything the
    kernels fail to write shows.
    """
    wl, ep = plan.wl, plan.epilogue
    if (bias is not None) != ep.bias or (residual is not None) != ep.residual:
        raise ValueError(f"kernel_arrays: the plan's epilogue {ep} does not match the arrays given")
    arrays = {"x": data_to_chwn(x.astype(np.float32, copy=False)),
              "w": weight_to_crsk(w.astype(np.float32, copy=False), wl.groups, plan.k_order)}
    if plan.tile.wgmma is not None:
        arrays["w"] = pack_wgmma_weight(arrays["w"], plan)
    if bias is not None:
        arrays["bias"] = np.ascontiguousarray(bias, dtype=np.float32)
    if residual is not None:
        arrays["residual"] = data_to_chwn(residual.astype(np.float32, copy=False))
    shapes = {**plan.shapes(), **plan.reduce_shapes()}
    for output in ("partial", "y"):
        if output in shapes:
            arrays[output] = np.full(shapes[output], np.nan, np.float32)
    for name, shape in shapes.items():
        if arrays[name].shape != shape:
            raise ValueError(f"kernel_arrays: {name} has shape {arrays[name].shape}, the plan needs {shape}")
    return arrays


def cuda_param_order(source: str, kernel: str = "maxdnn_conv2d_kernel") -> list[str]:
    """The plan parameter ("x", "w", "bias", "residual", "partial", "y") behind each argument of
    a plan's CUDA kernel (the convolution, or split-K's reduce kernel).

    Whoever launches the CUDA C directly (the GPU check, the emulator) passes them in this order.
    """
    by_flat = {flat: name for name, flat in FLAT_PARAMS.items()} | {"output": "y", "partial": "partial",
                                                                   "residual": "residual"}
    return [by_flat[param.removesuffix("_ptr")] for _, param in kernel_params(source, kernel)]
