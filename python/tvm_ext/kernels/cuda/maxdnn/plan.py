"""The maxDNN kernel's plan (:class:`MaxDNNPlan`): a workload, its block tile, its epilogue and its
split-K, and everything derived from them (grid, k order, shapes, shared memory).

Kept apart from the generator because the graph strategy, the host-side packing and the tests read
plans without generating a kernel: what the plan says is the kernel's interface.
"""

from __future__ import annotations

import dataclasses
import math

from ...conv2d import Conv2dWorkload
from .tile import STATIC_SHARED_LIMIT, BlockTile, choose_tile

KERNEL_NAME = "maxdnn_conv2d"
ACTIVATIONS = (None, "relu", "relu6")
# The kernel indexes flat views of its tensors; these names are its CUDA parameters (`<name>_ptr`).
FLAT_PARAMS = {"x": "Xf", "w": "Wf", "y": "Yf", "residual": "Rf", "bias": "bias", "partial": "Pf"}
MAX_ELEMENTS = 2**31 - 1  # the kernels index with int32

# wgmma in flight (MaxDNNPlan.wgmma_in_flight): the weights' tiles in a ring of this many buffers,
# a register set per slot for the fragments and the weights, the k loop this many steps at a time
WGMMA_RING = 3

# Split-K: the threads that fill an H100/H200 (132 SMs; 1024 of our 64-thread blocks, 6-8 an SM;
# a grid of fewer leaves SMs idle or short of warps to hide latency), and the k steps a slice
# keeps at least (its prologue, epilogue and partial-sum write stay small beside its loop).
FILL_THREADS = 1024 * 64
MIN_SPLIT_STEPS = 16


def choose_splits(plan: MaxDNNPlan) -> int:
    """How many slices split-K cuts the reduction of `plan` into: 1 where its grid has at least
    half of the blocks that make :data:`FILL_THREADS`, else the fewest that reach them, each
    keeping :data:`MIN_SPLIT_STEPS` k steps (ResNet-50's 7 x 7 layers at batch 32 have 200
    64-thread blocks: its 3x3 runs 9 slices of a tap, its 1x1 from 2048 channels 8 slices of 256).
    Counting threads, not blocks: a wgmma block is a warpgroup of 128 with a tile 4 times as
    large, and 2-4 of them fill an SM."""
    unit = plan.split_unit
    blocks = math.prod(dataclasses.replace(plan, splits=1).grid)
    fill = FILL_THREADS // plan.tile.threads
    if unit is None or 2 * blocks >= fill:
        return 1
    best = 1
    for d in range(2, unit[1] + 1):
        if unit[1] % d:
            continue
        if plan.k_steps // d < MIN_SPLIT_STEPS:
            break
        best = d
        if blocks * d >= fill:
            break
    return best


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """What the output write applies: Y = act(acc + bias[o] + residual)."""

    bias: bool = False
    residual: bool = False
    activation: str | None = None

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"maxdnn_conv2d: activation {self.activation!r} is not one of {ACTIVATIONS}")


@dataclasses.dataclass(frozen=True)
class MaxDNNPlan:
    """A workload, its block tile and its epilogue: everything the generator reads."""

    wl: Conv2dWorkload
    tile: BlockTile
    epilogue: Epilogue = Epilogue()
    splits: int = 1  # split-K: the reduction in this many slices (see :attr:`split_unit`)

    @staticmethod
    def make(wl: Conv2dWorkload, tile: BlockTile | None = None, epilogue: Epilogue | None = None,
             splits: int = 1) -> MaxDNNPlan:
        if wl.dtype != "float32":
            raise ValueError(f"maxdnn_conv2d: dtype {wl.dtype} is not supported (float32 only)")
        tile = tile or choose_tile(wl.K // wl.groups, columns=wl.N * wl.OH * wl.OW)
        tile.validate()
        plan = MaxDNNPlan(wl, tile, epilogue or Epilogue(), splits)
        if splits != 1:
            unit = plan.split_unit
            if unit is None or splits < 1 or unit[1] % splits:
                raise ValueError(f"maxdnn_conv2d: split-K into {splits} needs an RSC reduction whose taps (or, "
                                 f"for a 1x1 filter, k steps) divide into {splits}; this one has {unit}")
        largest = max(math.prod(shape) for shape in {**plan.shapes(), **plan.reduce_shapes()}.values())
        if largest > MAX_ELEMENTS:
            raise ValueError(f"maxdnn_conv2d: a tensor of {largest} elements is past the kernel's 32-bit indices "
                             f"({MAX_ELEMENTS})")
        return plan

    def with_chosen_splits(self) -> MaxDNNPlan:
        """This plan with the split-K the graph strategy uses for it (:func:`choose_splits`)."""
        return dataclasses.replace(self, splits=choose_splits(self))

    @property
    def split_unit(self) -> tuple[str, int] | None:
        """What split-K divides, and how many there are: the filter taps of a :attr:`tap_loop`,
        or the k steps of a 1x1 filter in RSC order; None where the reduction does not split."""
        if self.tap_loop:
            return "taps", self.wl.KH * self.wl.KW
        if self.k_order == "rsc" and self.wl.KH * self.wl.KW == 1:
            return "steps", self.k_steps
        return None

    @property
    def split_slices(self) -> tuple[str, int]:
        """:attr:`split_unit` of a plan that splits its reduction (:meth:`make` checked it has one)."""
        unit = self.split_unit
        if unit is None:
            raise ValueError(f"maxdnn_conv2d: split-K into {self.splits} of a reduction that does not split "
                             "(see MaxDNNPlan.split_unit)")
        return unit

    @property
    def y_shape(self) -> tuple[int, int, int, int]:
        """The output, KPQN."""
        wl = self.wl
        return (wl.K, wl.OH, wl.OW, wl.N)

    @property
    def gemm(self) -> tuple[int, int, int]:
        """(M, N, K) of one group's implicit GEMM."""
        wl = self.wl
        return wl.K // wl.groups, wl.OH * wl.OW * wl.N, wl.C // wl.groups * wl.KH * wl.KW

    @property
    def grid(self) -> tuple[int, int, int]:
        m, n, _ = self.gemm
        return (-(-n // self.tile.cols), -(-m // self.tile.rows), self.wl.groups * self.splits)

    @property
    def k_steps(self) -> int:
        return -(-self.gemm[2] // self.tile.k_step)

    @property
    def code_steps(self) -> int:
        """k steps written out in the kernel's code: with :attr:`tap_loop`, the channel loop's
        unrolled pair (where a tap has more than one pair) and the tap's last pair; otherwise the
        loop's unrolled pair plus the tail; with wgmma in flight, the loop's :data:`WGMMA_RING`
        steps and the rest."""
        if self.wgmma_in_flight:
            steps = self.k_steps // self.splits
            return (WGMMA_RING if steps // WGMMA_RING else 0) + steps % WGMMA_RING
        if self.tap_loop:
            return 4 if self.steps_per_tap > 2 else 2
        pairs = (self.k_steps - 1) // 2
        return (2 if pairs else 0) + self.k_steps - 2 * pairs

    @property
    def steps_per_tap(self) -> int:
        """k steps per filter tap in RSC order (C/groups/k_step)."""
        return self.wl.C // self.wl.groups // self.tile.k_step

    @property
    def tap_loop(self) -> bool:
        """The k loop as a loop over filter taps around a loop over channel steps (RSC order,
        several taps, an even number of steps per tap so each tap starts on the same buffer):
        the inner loop then issues no index math or bounds logic at all, the per-tap work (where
        each load slot reads, whether it is in the padding) runs once per tap."""
        return self.k_order == "rsc" and self.wl.KH * self.wl.KW > 1 and self.steps_per_tap % 2 == 0

    @property
    def k_order(self) -> str:
        """The order of the reduction (c, r, s): "rsc" (channels innermost) when a k step's 8
        rows are 8 channels of one filter tap, which makes the tap uniform across the block and
        leaves one division per step instead of four per load slot; "crs" otherwise (3 input
        channels, say). The weights are laid out in the same order."""
        cg = self.wl.C // self.wl.groups
        return "rsc" if cg % self.tile.k_step == 0 else "crs"

    @property
    def gathers_fragments(self) -> bool:
        """wgmma with :attr:`BlockTile.gather_fragments` in RSC order: each thread loads its four
        A-fragment values per slab and k step straight from the input (the im2col tile never goes
        through shared memory, which then holds only the weights' tile: a third less shared
        traffic per MAC); in CRS order the tile is staged in shared memory as for mma.sync."""
        return self.tile.gather_fragments and self.k_order == "rsc"

    @property
    def wgmma_in_flight(self) -> bool:
        """wgmma with gathered fragments keeps one group in flight across each k step's barrier:
        the weights' tiles in a ring of :data:`WGMMA_RING` shared buffers (a step fills the one
        the group before last read, which every thread has waited for before the last barrier;
        a ring of two would need a second barrier per step). The fragments and the weights are
        loaded two steps ahead, into a register set per ring slot (the k loop runs a ring at a
        time, :meth:`~.codegen.Generator.step_in_flight`): neither the store at the end of a step nor the
        next step's wgmma waits for loads issued at its start. Elsewhere a step waits for its
        group before the barrier."""
        return self.gathers_fragments

    @property
    def operand_tiles(self) -> dict[str, int]:
        """The operand tiles in shared memory, floats per buffer (each is double-buffered): the
        weights' "A" (wgmma: in the descriptor's layout, unpadded) and the im2col "B", their
        rows padded by :attr:`BlockTile.pad`; no B where the fragments are gathered."""
        t = self.tile
        tiles = {"A": t.weight_words if t.wgmma is not None else t.k_step * (t.rows + t.pad)}
        if not self.gathers_fragments:
            tiles["B"] = t.k_step * (t.cols + t.pad)
        return tiles

    @property
    def dynamic_shared_bytes(self) -> int:
        """The dynamic shared memory the kernel is launched with: 0 where its tiles fit the 48 KB
        a kernel may declare statically; else the output tile's (the operand tiles stay static)."""
        if self.tile.shared_bytes() <= STATIC_SHARED_LIMIT:
            return 0
        return 4 * self.tile.rows * self.tile.cols

    @property
    def vector_a(self) -> bool:
        """Weight rows hold whole float4 (output channels per group a multiple of 4)."""
        return self.gemm[0] % self.tile.vec == 0

    @property
    def vector_b(self) -> bool:
        """Four consecutive columns are four images of one pixel (batch a multiple of 4)."""
        return self.wl.N % self.tile.vec == 0

    @property
    def vector_y(self) -> bool:
        return self.gemm[1] % self.tile.vec == 0

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The kernel's parameters in order, with their shapes: x, w[, bias][, residual], y; with
        split-K x, w, partial (each slice's sums; the epilogue is :meth:`reduce_shapes`' kernel's)."""
        wl = self.wl
        shapes = {"x": (wl.C, wl.H, wl.W, wl.N), "w": self.weight_shape}
        if self.splits > 1:
            shapes["partial"] = (self.splits, *self.y_shape)
            return shapes
        return {**shapes, **self._epilogue_shapes(), "y": self.y_shape}

    @property
    def weight_shape(self) -> tuple[int, ...]:
        """The kernel's weights: [groups, K, M] (:func:`weight_to_crsk`); for wgmma, each block's k
        steps already in the tensor cores' shared layout (:func:`pack_wgmma_weight`)."""
        m, _, k = self.gemm
        if self.tile.wgmma is None:
            return (self.wl.groups, k, m)
        return (self.wl.groups, self.grid[1], self.k_steps, self.tile.weight_words)

    def reduce_shapes(self) -> dict[str, tuple[int, ...]]:
        """With split-K, the parameters of the kernel that sums the slices and applies the
        epilogue (:func:`split_reduce_func`): partial[, bias][, residual], y; else none."""
        if self.splits == 1:
            return {}
        return {"partial": (self.splits, *self.y_shape), **self._epilogue_shapes(), "y": self.y_shape}

    def _epilogue_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {}
        if self.epilogue.bias:
            shapes["bias"] = (self.wl.K,)
        if self.epilogue.residual:
            shapes["residual"] = self.y_shape
        return shapes
