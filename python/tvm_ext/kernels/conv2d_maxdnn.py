"""Direct 2-D convolution on the maxDNN tile (LLVM CPU): the images in the vector lanes.

maxDNN (../shared/SEEDS.md, paper 1) computes a convolution as the implicit GEMM
Y[o, (p, q, n)] = sum_(r, s, c) W[(r, s, c), o] X[(r, s, c), (p, q, n)] with the image index
innermost. On a CPU that puts images in the vector lanes: a register tile is `rows` output
channels x `cols` images at one output pixel (:func:`tvm_ext.intrin.cpu_outer.get_cpu_outer_intrin`,
the description shared with the CUDA kernel), fed by broadcast weights and contiguous image
vectors whatever the spatial size, where the blocked-channel BRGEMM kernel tiles a row's pixels
(and needed plans of its own for 7x7 and 14x14 layers at batch 16).

Layouts: the images padded to whole tiles of `cols` with zeros and blocked by them, outermost:
- input (N/cols, H, W, C, cols) with its zero border: a pixel's channels x the block's images
  contiguous, so a call's B is one stream per filter tap (cuda-convnet's CHWN, the CUDA kernel's,
  puts a channel a whole image plane from the next: measured 0.5-0.7x of this layout, and with
  the images of a row of memory wider than the tile, rows 512 bytes apart at batch 128 fell onto
  a quarter of L1's sets, 2x slower);
- output (N/cols, P, Q, G*K', cols), K' the output channels of a group padded to whole tiles;
- weights RSCK per group and per `rows` output channels, (G, K'/rows, R, S, C/G, rows): a call's
  A is one contiguous stream.

A call reduces every filter tap (the tile's batch, B's entries a dilation apart) and `k_step`
channels into the rows x cols tile in registers; with all the channels of a group in one call
its accumulators start at zero and the tile is written once. A task is (group, block of
`macro_rows` output channels, output row); for each pixel of its row and block of
`macro_cols` images it calls the microkernel for every chunk of channels, every `cols` images and
every `rows` output channels (BLIS's order: a call's input stays in cache for the calls of every
`rows`), then applies the epilogue (bias, activation) while the tile is in cache.

The generator is :func:`maxdnn_conv2d_func`, which fixes the layouts only; the blocking above is
its schedule (:func:`block_maxdnn_conv2d`, then :func:`tensorize_maxdnn_conv2d`), the plan's
(:func:`schedule_maxdnn_conv2d`) or a tuner's (:mod:`tvm_ext.tuning.maxdnn_space`). The layouts'
host-side forms are :func:`pack_data`, :func:`pack_weight`, :func:`pack_bias` and
:func:`unpack_output`.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
from tvm import s_tir, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from ..intrin.cpu import register_tiles, tile_efficiency
from ..intrin.cpu_outer import check_cpu_tile, get_cpu_outer_intrin
from ..intrin.outer_tile import OuterTile
from ..target import VectorISA
from .common import ACTIVATIONS, KERNEL_ATTR, activation_expr, param_buffer
from .conv2d import Conv2dWorkload, drop_init, largest_divisor

# The analytic blocking. A call's input (its taps x k_step channels x cols images) is read from
# L2 by the calls of every `rows` output channels of the task's tile, which stream their weights.
# A call's input at most (all of a group's channels where it fits: the tile then starts at zero
# and is written once). OverFeat's 1024 x 3x3 layer at batch 128 on a Zen 4 (1 MB L2): one call
# of all 1024 channels (1.2 MB) 109 GFLOP/s, four of 256 97.
CALL_BYTES = 2 * 1024 * 1024
MACRO_ROWS = 384  # output channels a task's tile spans at most
MACRO_COLS = 128  # images a task's tile spans at most


def _ceil(a: int, b: int) -> int:
    return -(-a // b) * b


@dataclasses.dataclass(frozen=True)
class MaxDNNCpuPlan:
    """How a workload maps onto the images-in-lanes layouts and the tile."""

    wl: Conv2dWorkload
    isa: VectorISA
    rows: int  # output channels of the register tile
    cols: int  # images of the register tile (a multiple of the lanes)
    k_step: int  # channels per microkernel call (divides the channels of a group)
    macro_rows: int  # output channels of a task's tile (a multiple of rows)
    macro_cols: int  # images of a task's tile (a multiple of cols)
    unroll: int = 2

    @staticmethod
    def make(wl: Conv2dWorkload, isa: VectorISA, rows: int | None = None, cols: int | None = None,
             k_step: int | None = None, macro_rows: int | None = None, macro_cols: int | None = None,
             threads: int = 1) -> MaxDNNCpuPlan:
        """The plan for `wl` on `isa`: the given choices, the analytic ones for the rest (task
        tiles small enough to give `threads` threads four tasks each where the output allows)."""
        if wl.dtype != "float32":
            raise ValueError(f"maxdnn conv2d: float32 only, got {wl.dtype}")
        given = {"rows": rows, "cols": cols, "k_step": k_step, "macro_rows": macro_rows, "macro_cols": macro_cols,
                 "threads": threads}
        for name, value in given.items():
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"maxdnn conv2d: {name} must be a positive integer, got {value!r}")
        cg, kg = wl.C // wl.groups, wl.K // wl.groups
        if rows is None or cols is None:
            rows, cols = _default_tile(kg, wl.N, isa, rows, cols)
        if cols % isa.lanes:
            raise ValueError(f"maxdnn conv2d: cols={cols} must be whole {isa.lanes}-lane vectors")
        images = _ceil(wl.N, cols)
        if k_step is None:
            k_step = largest_divisor(cg, max(1, CALL_BYTES // (4 * cols * wl.KH * wl.KW)))
        if cg % k_step:
            raise ValueError(f"maxdnn conv2d: k_step={k_step} does not divide the {cg} channels of a group")
        kg_pad = _ceil(kg, rows)
        if macro_rows is None:
            tiles = kg_pad // rows
            most = max(1, MACRO_ROWS // rows)
            while most > 1 and wl.groups * (tiles // largest_divisor(tiles, most)) * wl.OH < 4 * threads:
                most = max(1, largest_divisor(tiles, most) - 1)
            macro_rows = rows * largest_divisor(tiles, most)
        if macro_rows % rows or kg_pad % macro_rows:
            raise ValueError(f"maxdnn conv2d: macro_rows={macro_rows} must be whole {rows}-row tiles dividing "
                             f"{kg_pad} output channels")
        if macro_cols is None:
            macro_cols = cols * largest_divisor(images // cols, max(1, MACRO_COLS // cols))
        if macro_cols % cols or images % macro_cols:
            raise ValueError(f"maxdnn conv2d: macro_cols={macro_cols} must be whole {cols}-image tiles dividing "
                             f"{images} padded images")
        plan = MaxDNNCpuPlan(wl, isa, rows, cols, k_step, macro_rows, macro_cols)
        check_cpu_tile(plan.tile, isa)
        return plan

    @property
    def steps(self) -> int:
        """Calls along the channels of a group (one: the tile starts at zero, no output read)."""
        return self.channels // self.k_step

    @property
    def tile(self) -> OuterTile:
        return OuterTile.contiguous(self.rows, self.cols, self.k_step, batch=(self.wl.KH, self.wl.KW),
                                    dilation=self.wl.dilation, init=self.steps == 1)

    @property
    def groups(self) -> int:
        return self.wl.groups

    @property
    def channels(self) -> int:
        """Input channels of a group."""
        return self.wl.C // self.wl.groups

    @property
    def outputs(self) -> int:
        """Output channels of a group, padded to whole register tiles."""
        return _ceil(self.wl.K // self.wl.groups, self.rows)

    @property
    def images(self) -> int:
        """Images, padded to whole tiles."""
        return _ceil(self.wl.N, self.cols)

    @property
    def image_blocks(self) -> int:
        return self.images // self.cols

    @property
    def padded_hw(self) -> tuple[int, int]:
        """The input's extents with the border the output reads (no more: a bottom or right
        padding row that no output pixel reaches is left out)."""
        wl = self.wl
        (sh, sw), (dh, dw) = wl.stride, wl.dilation
        return ((wl.OH - 1) * sh + (wl.KH - 1) * dh + 1, (wl.OW - 1) * sw + (wl.KW - 1) * dw + 1)

    def data_shape(self) -> tuple[int, ...]:
        return (self.image_blocks, *self.padded_hw, self.wl.C, self.cols)

    def weight_shape(self) -> tuple[int, ...]:
        return (self.groups, self.outputs // self.rows, self.wl.KH, self.wl.KW, self.channels, self.rows)

    def out_shape(self) -> tuple[int, ...]:
        return (self.image_blocks, self.wl.OH, self.wl.OW, self.groups * self.outputs, self.cols)

    def fma_efficiency(self) -> float:
        """The share of FMA slots the tile's k loop can fill, times the share of its work that is
        not padding (images to whole tiles, output channels to whole tiles)."""
        wl = self.wl
        useful = wl.N * (wl.K // wl.groups) / (self.images * self.outputs)
        return tile_efficiency(self.rows, self.cols // self.isa.lanes) * useful


def _default_tile(outputs: int, images: int, isa: VectorISA, rows: int | None, cols: int | None) -> tuple[int, int]:
    """The register tile with the most FMA slots filled on useful work (output channels and images
    padded to whole tiles are not), then the most accumulators (independent FMA chains)."""
    best, best_key = None, None
    for r, c in register_tiles(isa, spare=1):  # (one register spare: LLVM spilled tiles that used all)
        if (rows is not None and r != rows) or (cols is not None and c != cols):
            continue
        useful = outputs / _ceil(outputs, r) * images / _ceil(images, c)
        vectors = c // isa.lanes
        key = (round(tile_efficiency(r, vectors) * useful, 3), r * vectors)
        if best_key is None or key > best_key:
            best, best_key = (r, c), key
    if best is None:
        raise ValueError(f"maxdnn conv2d: no {isa.name} register tile with rows={rows}, cols={cols}")
    return best


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """What is applied to a finished convolution: a per-channel bias, a residual, then an
    activation (`alpha`: leaky ReLU's slope). The kernel applies a bias and an activation to
    its tile; a residual, read in the graph's blocked layout, is the output pass's
    (:func:`tvm_ext.kernels.maxdnn_layout.tile_output_func`, which applies all three)."""

    bias: bool = False
    activation: str | None = None
    residual: bool = False
    alpha: float = 0.01

    def __post_init__(self) -> None:
        if self.activation is not None and self.activation not in ACTIVATIONS:
            raise ValueError(f"maxdnn conv2d: activation {self.activation!r} is not one of {sorted(ACTIVATIONS)}")

    @property
    def empty(self) -> bool:
        return not (self.bias or self.residual or self.activation)

    def apply(self, value: tirx.PrimExpr, bias: tirx.PrimExpr | None = None,
              residual: tirx.PrimExpr | None = None) -> tirx.PrimExpr:
        """`value` with the bias, then the residual added and the activation applied."""
        if bias is not None:
            value = value + bias
        if residual is not None:
            value = value + residual
        return value if self.activation is None else activation_expr(self.activation, value, self.alpha)


def maxdnn_conv2d_func(plan: MaxDNNCpuPlan, epilogue: Epilogue = Epilogue()) -> tirx.PrimFunc:
    """The unscheduled kernel as TensorIR: parameters (x, w[, b], y) in :meth:`MaxDNNCpuPlan.data_shape`,
    :meth:`~MaxDNNCpuPlan.weight_shape`, (G, K') and :meth:`~MaxDNNCpuPlan.out_shape`.

    One reduction block ("update") over (group, row tile, output row, pixel, image block,
    channel, filter row, filter column, 1, rows, 1, cols): the tile's loops innermost but for the
    channels, which :func:`block_maxdnn_conv2d` splits into calls. It depends only on the
    layouts (the plan's workload, rows and cols), not on the blocking, which the schedule makes:
    that is what tuning searches (:mod:`tvm_ext.tuning.maxdnn_space`). With an epilogue the sums
    go to a scratch tile ("acc") that the epilogue block reads into y, moved by the schedule
    under the task's tile (its tile in cache, as the sums are written)."""
    if epilogue.residual:
        raise ValueError("maxdnn conv2d: the kernel's epilogue takes a bias and an activation; a residual is added "
                         "by the output pass (maxdnn_layout.tile_output_func)")
    wl = plan.wl
    (sh, sw), (dh, dw) = wl.stride, wl.dilation
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("conv")
        x = param_buffer("x", plan.data_shape())
        w = param_buffer("w", plan.weight_shape())
        bias = param_buffer("b", (plan.groups, plan.outputs)) if epilogue.bias else None
        y = param_buffer("y", plan.out_shape())
        with T.sblock("root"):
            acc = y if epilogue.empty else IRBuilder.name("acc", T.alloc_buffer(plan.out_shape(), "float32"))
            extents = (plan.groups, plan.outputs // plan.rows, wl.OH, wl.OW, plan.image_blocks, plan.channels,
                       wl.KH, wl.KW, 1, plan.rows, 1, plan.cols)
            with T.grid(*extents) as loops, T.sblock("update"):
                g, t, p, q, n, c, r, s, i0, i, j0, j = IRBuilder.name_many(
                    ["g", "t", "p", "q", "n", "c", "r", "s", "i0", "i", "j0", "j"], loops)
                del i0, j0  # (the tile description's unit loops: their iterators are not bound)
                vg, vt, vp, vq, vn = IRBuilder.name_many(["vg", "vt", "vp", "vq", "vn"],
                                                         T.axis.remap("SSSSS", [g, t, p, q, n]))
                # (the reduction's iterators in the description's order: taps, then channels)
                vr, vs, vc = IRBuilder.name_many(["vr", "vs", "vc"], T.axis.remap("RRR", [r, s, c]))
                vi, vj = IRBuilder.name_many(["vi", "vj"], T.axis.remap("SS", [i, j]))
                out = [vn, vp, vq, vg * plan.outputs + vt * plan.rows + vi, vj]
                xi = [vn, vp * sh + vr * dh, vq * sw + vs * dw, vg * plan.channels + vc, vj]
                with T.init():
                    T.buffer_store(acc, T.float32(0), out)
                T.buffer_store(acc, acc[tuple(out)] + w[vg, vt, vr, vs, vc, vi] * x[tuple(xi)], out)
            if not epilogue.empty:
                with T.grid(*plan.out_shape()) as loops, T.sblock("epilogue"):
                    index = IRBuilder.name_many(["vn", "vp", "vq", "vo", "vj"], T.axis.remap("SSSSS", loops))
                    vo = index[3]
                    value = acc[tuple(index)]
                    b = None if bias is None else bias[vo // plan.outputs, vo % plan.outputs]
                    T.buffer_store(y, epilogue.apply(value, b), index)
    return builder.get().with_attr(KERNEL_ATTR, "maxdnn_conv2d")


MAXDNN_UNROLL = "tvm_ext.maxdnn_unroll"  # update block annotation: k steps unrolled in a call
UNROLL_CHOICES: tuple[int, ...] = (1, 2, 4)


def block_maxdnn_conv2d(sch: s_tir.Schedule, tiles: tuple, unroll) -> None:
    """The blocking of :func:`maxdnn_conv2d_func`: `tiles` are the (outer, inner) splits of the row
    tiles (inner: a task's tile of `macro_rows`), of the image blocks (inner: `macro_cols`) and of
    the channels (inner: `k_step`, a call's), given or sampled; `unroll` likewise.

    The order is BLIS's: a task is (group, output channels of its tile, output row); for each
    pixel and block of images, the chunks of channels, then the register tiles of images and of
    output channels (a call's input stays in cache for the calls of every row tile). The epilogue
    runs on the task's tile after its last chunk, vectorized. Tensorizing, which needs the k_step
    the split gave, is :func:`tensorize_maxdnn_conv2d`'s. Every decision gives the same loops
    (trace replay, mutation)."""
    update = sch.get_sblock("update")
    g, t, p, q, n, c, r, s, i0, i, j0, j = sch.get_loops(update)
    ob, rt = sch.split(t, tiles[0], preserve_unit_iters=True)
    mb, nb = sch.split(n, tiles[1], preserve_unit_iters=True)
    cb, kk = sch.split(c, tiles[2], preserve_unit_iters=True)
    sch.reorder(g, ob, p, q, mb, cb, nb, rt, r, s, kk, i0, i, j0, j)
    sch.annotate(update, MAXDNN_UNROLL, unroll)
    if "epilogue" in _block_names(sch):
        epilogue = sch.get_sblock("epilogue")
        sch.reverse_compute_at(epilogue, mb, preserve_unit_loops=True)
        sch.vectorize(sch.get_loops(epilogue)[-1])  # (the tile's images, whole vectors)
    sch.parallel(sch.fuse(g, ob, p, preserve_unit_iters=True))


def _block_names(sch: s_tir.Schedule) -> set[str]:
    return {sch.get(block).name_hint for block in sch.get_child_blocks(sch.get_sblock("root"))}


def tensorize_maxdnn_conv2d(sch: s_tir.Schedule, plan: MaxDNNCpuPlan) -> None:
    """Tensorize the blocked update onto the tile's intrinsic for the k_step and unroll the
    schedule gave (:func:`block_maxdnn_conv2d`). With one chunk of channels the call starts its
    accumulators at zero (the initialization tensorize leaves beside it is dropped); with more, a
    vectorized zero pass over the task's tile comes first."""
    update = sch.get_sblock("update")
    # block_maxdnn_conv2d's order, innermost last: (task, q, mb, cb, nb, rt, r, s, kk, i0, i, j0, j)
    loops = sch.get_loops(update)
    chunks, taps, k_loop = loops[-10], loops[-7], loops[-5]
    steps, k_step = int(sch.get(chunks).extent), int(sch.get(k_loop).extent)
    unroll = int(sch.get(update).annotations.get(MAXDNN_UNROLL, plan.unroll))
    tile = dataclasses.replace(plan.tile, k_step=k_step, init=steps == 1)
    if steps > 1:
        zero = sch.decompose_reduction(update, chunks)
        sch.vectorize(sch.get_loops(zero)[-1])
    sch.tensorize(taps, get_cpu_outer_intrin(tile, plan.isa, unroll))
    if tile.init:
        drop_init(sch, sch.get_sblock("update_o"))


def schedule_maxdnn_conv2d(sch: s_tir.Schedule, plan: MaxDNNCpuPlan) -> None:
    """The analytic schedule: the plan's blocking (:func:`block_maxdnn_conv2d`), tensorized."""
    block_maxdnn_conv2d(sch, analytic_tiles(plan), plan.unroll)
    tensorize_maxdnn_conv2d(sch, plan)


def analytic_tiles(plan: MaxDNNCpuPlan) -> tuple[list[int], list[int], list[int]]:
    """The splits of :func:`block_maxdnn_conv2d` that give the plan's blocking."""
    row_tiles, col_tiles = plan.macro_rows // plan.rows, plan.macro_cols // plan.cols
    return ([plan.outputs // plan.macro_rows, row_tiles], [plan.image_blocks // col_tiles, col_tiles],
            [plan.steps, plan.k_step])


@functools.cache
def maxdnn_conv2d_kernel(plan: MaxDNNCpuPlan, epilogue: Epilogue = Epilogue()) -> tirx.PrimFunc:
    """The scheduled kernel (cached: layers of one shape repeat)."""
    sch = s_tir.Schedule(maxdnn_conv2d_func(plan, epilogue))
    schedule_maxdnn_conv2d(sch, plan)
    return sch.mod["main"]


# -- host-side layouts (NumPy): the eager path and the tests --------------------------------


def pack_data(plan: MaxDNNCpuPlan, x: np.ndarray) -> np.ndarray:
    """NCHW -> the kernel's input: its zero border, the images padded to whole blocks."""
    wl = plan.wl
    hp, wp = plan.padded_hw
    top, left = wl.padding[:2]
    out = np.zeros((plan.images, wl.C, hp, wp), np.float32)
    h, w = min(wl.H, hp - top), min(wl.W, wp - left)
    out[:wl.N, :, top:top + h, left:left + w] = x[:, :, :h, :w]
    blocked = out.reshape(plan.image_blocks, plan.cols, wl.C, hp, wp)
    return np.ascontiguousarray(blocked.transpose(0, 3, 4, 2, 1))


def pack_weight(plan: MaxDNNCpuPlan, w: np.ndarray) -> np.ndarray:
    """OIHW -> :meth:`MaxDNNCpuPlan.weight_shape` (zeros past a group's output channels)."""
    wl = plan.wl
    kg = wl.K // wl.groups
    per_group = np.asarray(w, np.float32).reshape(wl.groups, kg, plan.channels, wl.KH, wl.KW)
    rsck = np.zeros((wl.groups, wl.KH, wl.KW, plan.channels, plan.outputs), np.float32)
    rsck[..., :kg] = per_group.transpose(0, 3, 4, 2, 1)
    blocked = rsck.reshape(*rsck.shape[:4], -1, plan.rows)
    return np.ascontiguousarray(blocked.transpose(0, 4, 1, 2, 3, 5))


def pack_bias(plan: MaxDNNCpuPlan, b: np.ndarray) -> np.ndarray:
    wl = plan.wl
    out = np.zeros((plan.groups, plan.outputs), np.float32)
    out[:, :wl.K // wl.groups] = np.asarray(b, np.float32).reshape(wl.groups, -1)
    return out


def unpack_output(plan: MaxDNNCpuPlan, y: np.ndarray) -> np.ndarray:
    """The kernel's output -> NCHW (the padded images and output channels dropped)."""
    wl = plan.wl
    nkpq = np.asarray(y).transpose(0, 4, 3, 1, 2).reshape(plan.images, plan.groups, plan.outputs, wl.OH, wl.OW)
    return np.ascontiguousarray(nkpq[:wl.N, :, :wl.K // wl.groups].reshape(wl.N, wl.K, wl.OH, wl.OW))
