"""maxDNN-style direct convolution for CUDA: implicit GEMM, 64x64 block tile, 8x8 per thread (or larger).

The convolution is the GEMM  Y[o, col] = sum_k Wt[k, o] * im2col(X)[k, col]  with o the output
channel, col = (p, q, n) the output pixel and image, k = (c, r, s) the filter tap. The im2col
matrix is never stored: each k step's tile of it is gathered straight from the input into shared
memory. Layouts (those of maxDNN/cuda-convnet, chosen so that every global access is a coalesced
128-bit one):

- activations CHWN (the image index innermost): four consecutive columns of a tile are four images
  at the same pixel, one float4 in memory; the output, KPQN, is the same layout;
- weights CRSK per group ([groups, C/groups*R*S, K/groups]; RSCK when the channels per group
  are a multiple of 8, see :attr:`MaxDNNPlan.k_order`): a k step's row of the A tile is
  contiguous in output channels.

One thread block computes a `rows x cols` tile of Y with rows/8 x cols/8 threads, each holding an
8x8 register tile (maxDNN's 64x64) updated by the :class:`~tvm_ext.intrin.outer_tile.OuterTile` tensor
intrinsic; :func:`choose_tile` picks from :data:`FFMA_TILES`, mostly 16x8 thread tiles on 128x128,
64x128 or 96x128 blocks, which spend fewer of a scheduler's issue slots on shared loads per FFMA
(94% of the k loop's SASS is FFMA, against 91% for 8x8). The k loop runs in steps
of 8 through two shared buffers: while the block computes on one, each thread has the next step's
global loads in flight in registers and stores them to the other buffer afterwards, so one barrier
per k step suffices. The loop is unrolled by two so the two buffers are distinct allocations,
which lets TVM's barrier planner see that the compute and the store do not conflict (with one
buffer indexed by k % 2 it inserts a second barrier). In RSC order (:attr:`MaxDNNPlan.tap_loop`)
the k loop is a loop over filter taps around a loop over channel steps: where each load slot
reads and whether it falls in the padding is worked out once per tap, and the channel loop issues
nothing but its loads, stores, shared loads, FFMAs and one barrier per step (91% of its SASS is
FFMA on sm_80 and sm_90 with 8x8 thread tiles, against a floor of 92.6%). The finished tile is
staged through shared memory so the global stores are coalesced float4 rows, with the epilogue
(bias, residual add, activation) applied on the way out. A grid too small to fill a GPU splits
its reduction (split-K, :func:`choose_splits`): each slice of taps or channel steps is a set of
blocks writing partial sums, and :func:`split_reduce_func` adds them with the epilogue.

Where a float4 would straddle a row of memory (images per batch or output channels not a multiple
of 4) the loads fall back to scalars, and all bounds (K not a multiple of 8, tiles past the edge,
padding) are guarded, so every shape is computed exactly.

The tensor-core engines (`BlockTile(engine="mma_tf32" | "mma_bf16")`) keep all of the above and
replace the threads' FFMA tiles by warps issuing `mma.sync` (:class:`~tvm_ext.intrin.cuda.MmaShape`): each warp owns
`warp_rows` rows of the block, its fragments loaded from the same shared buffers (rows padded
so the loads do not conflict), its accumulators staged into the same output tile.

Hopper's engines (`BlockTile(engine="wgmma_tf32" | "wgmma_bf16")`, sm_90a) are one warpgroup per
block issuing an asynchronous `wgmma.mma_async` m64nNk8 (bf16: m64nNk16, its operands rounded and
packed two to a register) per 64-column slab and k step (:class:`~tvm_ext.intrin.cuda.WgmmaShape`): N is
the block's rows, the weights' tile is read by the tensor cores from shared memory through a
matrix descriptor (so the weights are packed per block and k step in that layout,
:func:`pack_wgmma_weight`), and the A operand comes from registers, gathered by each thread
straight from the input in RSC order (:attr:`MaxDNNPlan.gathers_fragments`). A step issues its
wgmmas and stores the next step's tile while they run; gathered, its group stays in flight
across the barrier (:attr:`MaxDNNPlan.wgmma_in_flight`), else it is waited for before it.

A tile past the 48 KB a kernel declares statically (wgmma's 128 x 128) stages its output in
dynamic shared memory (:attr:`MaxDNNPlan.dynamic_shared_bytes`).

The package, one concern a module: :mod:`.tile` (the block tile and its choice), :mod:`.plan`
(a workload's plan, split-K's choice), :mod:`.operands`, :mod:`.codegen` and :mod:`.engines` (the
kernel, built with TVM's IRBuilder: the operands' movement; the k loop and output, and the PrimFunc
and CUDA C; each compute engine's part: FFMA, mma.sync, wgmma), :mod:`.split_k` (split-K's
reduce kernel) and :mod:`.pack` (host-side arrays in the kernel's layouts). The names below are
its API; running a plan on the CPU emulator, and the tests' deliberately broken kernels, are in
:mod:`tvm_ext.testing.maxdnn`.
"""

from ....intrin.cuda import MMA_SHAPES, WGMMA_SHAPES, MmaShape, WgmmaShape
from .codegen import Generator, cuda_source, maxdnn_conv2d_func, plan_module
from .pack import (
    WGMMA_PACK_AXES,
    bf16_pairs,
    cuda_param_order,
    data_to_chwn,
    kernel_arrays,
    output_to_nchw,
    pack_wgmma_weight,
    weight_to_crsk,
    wgmma_pack_tiles,
)
from .plan import (
    ACTIVATIONS,
    FILL_THREADS,
    FLAT_PARAMS,
    KERNEL_NAME,
    MAX_ELEMENTS,
    MIN_SPLIT_STEPS,
    WGMMA_RING,
    Epilogue,
    MaxDNNPlan,
    choose_splits,
)
from .split_k import REDUCE_SUFFIX, reduce_launch, split_reduce_func
from .tile import (
    DYNAMIC_SHARED_LIMIT,
    ENGINES,
    FFMA_TILES,
    MMA_TILE_ROWS,
    STATIC_SHARED_LIMIT,
    WGMMA_TILE_COLS,
    WGMMA_TILE_ROWS,
    BlockTile,
    choose_tile,
)

__all__ = [
    "ACTIVATIONS", "DYNAMIC_SHARED_LIMIT", "ENGINES", "FFMA_TILES", "FILL_THREADS", "FLAT_PARAMS", "KERNEL_NAME",
    "MAX_ELEMENTS", "MIN_SPLIT_STEPS", "MMA_SHAPES", "MMA_TILE_ROWS", "REDUCE_SUFFIX", "STATIC_SHARED_LIMIT",
    "WGMMA_PACK_AXES", "WGMMA_RING", "WGMMA_SHAPES", "WGMMA_TILE_COLS", "WGMMA_TILE_ROWS", "BlockTile", "Epilogue",
    "Generator", "MaxDNNPlan", "MmaShape", "WgmmaShape", "bf16_pairs", "choose_splits", "choose_tile",
    "cuda_param_order", "cuda_source", "data_to_chwn", "kernel_arrays", "maxdnn_conv2d_func", "output_to_nchw",
    "pack_wgmma_weight", "plan_module", "reduce_launch", "split_reduce_func", "weight_to_crsk", "wgmma_pack_tiles",
]
