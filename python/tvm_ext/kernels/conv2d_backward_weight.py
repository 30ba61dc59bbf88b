"""The weight gradient of a convolution on the BRGEMM microkernel (LIBXSMM's formulation).

    dW[ob, ib, r, s, i, o] = sum_{n, oh, ow} X[n, ib, oh*sh + r*dh, ow*sw + s*dw, i] * dY[n, ob, oh, ow, o]

X is the forward's blocked, padded input (N, C/x, H+pads, W+pads, x), dY the output gradient
blocked like the forward's output (N, K/y, OH, OW, y), and dW comes out in the forward's blocked
weight layout (K/y, C/x, KH, KW, x, y), where an optimizer updates it in place. Each tile of dW
(m_r input channels x n_r output channels of one filter tap) is a batch-reduce GEMM: A = X read
transposed (one pixel's channels, broadcast one by one), B = dY rows (vectors of output
channels), the reduction over a chunk of rows' pixels, the tile in registers throughout.

A task owns one (output block, input block) of dW, or a group of them on large images
(:func:`blocks_per_task`): its dW blocks (KH*KW taps x x x y each) stay in L1/L2 while the task
walks the images in chunks of rows; for each chunk every block, tap and channel tile reduces the
same rows of X and dY, which stay in L1/L2 (each element of X and dY is read from memory once per
task, not once per tap or block). No partial sums between tasks: they own disjoint blocks of dW.
The bias gradient (a sum of dY over images and pixels) is a block of its own, one task per
output block.
"""

from __future__ import annotations

import dataclasses
import functools

from tvm import s_tir, te, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from ..intrin.cpu import BRGEMM, get_brgemm_intrin, tile_efficiency
from ..target import VectorISA
from .common import KERNEL_ATTR, param_buffer
from .conv2d import Conv2dWorkload, plan_conv2d
from .transpose import transpose8x8

__all__ = ["WeightGradPlan", "blocks_per_task", "conv2d_backward_weight_kernel", "plan_conv2d_backward_weight",
           "unpack_weight_func"]

# Rows of a chunk: the rows of X and dY that every tap and channel tile of a task reduces before
# the next chunk (ResNet-50's 56-pixel rows: 8 rows of dY (32 channels) are 57 KB, of X 37 KB).
CHUNK_ROWS = 8


@dataclasses.dataclass(frozen=True)
class WeightGradPlan:
    """How a convolution's weight gradient maps onto the blocked layouts and the microkernel."""

    wl: Conv2dWorkload
    ic_bn: int  # input channels per block (x): the forward's
    oc_bn: int  # output channels per block (y): the forward's
    m_r: int  # input channels per microkernel call (rows of the dW tile)
    n_r: int  # output channels per call: a multiple of the lanes
    rows: int  # output rows per chunk of the reduction
    bias: bool = False  # also the bias gradient (OCB, y)
    # Input and output blocks per task (large images): a task reduces each chunk of rows into the
    # dW blocks of all of them, reading each block's chunk of X and dY from memory once for them
    # (:func:`blocks_per_task`).
    ib_tile: int = 1
    ob_tile: int = 1

    @property
    def ICB(self) -> int:
        return self.wl.C // self.ic_bn

    @property
    def OCB(self) -> int:
        return -(-self.wl.K // self.oc_bn)

    def data_shape(self) -> tuple[int, ...]:
        wl = self.wl
        return (wl.N, self.ICB, wl.HP, wl.WP, self.ic_bn)

    def grad_out_shape(self) -> tuple[int, ...]:
        wl = self.wl
        return (wl.N, self.OCB, wl.OH, wl.OW, self.oc_bn)

    def weight_shape(self) -> tuple[int, ...]:
        wl = self.wl
        return (self.OCB, self.ICB, wl.KH, wl.KW, self.ic_bn, self.oc_bn)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_conv2d_backward_weight(wl: Conv2dWorkload, isa: VectorISA, bias: bool = False, ic_bn: int | None = None,
                                oc_bn: int | None = None) -> WeightGradPlan:
    """The forward's channel blocks (dW in its weight layout), or those given (x and dY as a
    graph's kernels wrote them: read with no repacking), and the register tile that fills the
    FMA slots best: m_r divides the input block, n_r the output block (one spare register)."""
    if wl.groups != 1:
        raise ValueError(f"conv2d_backward_weight: {wl.groups} groups (the kernel takes groups=1)")
    forward = plan_conv2d(wl, isa)
    ic_bn, oc_bn = ic_bn or forward.ic_bn, oc_bn or forward.oc_bn
    if wl.C % ic_bn or oc_bn % isa.lanes:
        raise ValueError(f"conv2d_backward_weight: blocks of {ic_bn} input channels (of {wl.C}) and {oc_bn} "
                         f"output channels (vectors of {isa.lanes})")
    best, best_key = None, None
    for n_r in (v for v in _divisors(oc_bn) if v % isa.lanes == 0):
        vectors = n_r // isa.lanes
        for m_r in _divisors(ic_bn):
            if m_r * vectors + vectors + 1 > isa.registers - 1:
                continue
            key = (round(tile_efficiency(m_r, vectors), 3), m_r * vectors, n_r)
            if best_key is None or key > best_key:
                best, best_key = (m_r, n_r), key
    if best is None:
        raise ValueError(f"conv2d_backward_weight: no register tile for blocks of {ic_bn} x {oc_bn}")
    rows = max(d for d in _divisors(wl.OH) if d <= CHUNK_ROWS)
    ib_tile, ob_tile = blocks_per_task(wl, ic_bn, oc_bn, rows)
    return WeightGradPlan(wl, ic_bn, oc_bn, best[0], best[1], rows, bias, ib_tile, ob_tile)


# A weight gradient does 2 x y x taps multiply-adds per element of X it reads (y output channels
# a block), so a task of one (output block, input block) reads X once per output block from
# memory: ResNet-50's strided 1x1 layers (batch 16) read 822 MB for 14 ms of multiply-adds and ran
# at 30-46% of the peak, its strided 3x3 ones at 74% (Zen 4, 2 threads). A task therefore reduces
# several input and output blocks together, each chunk of rows of X and dY read from memory once
# for all of them: the pair of tiles with the least traffic (X times the output-block groups, dY
# times the input-block groups) whose dW blocks and chunks of X stay in L2, with at least
# MIN_TASKS tasks. Measured there: 1x1 layers of 56x56 to 14x14 output pixels 1.03-2.3x (the
# strided ones 40% -> 76% and 30% -> 70% of the peak), strided 3x3 74% -> 86-92%, stride-1 3x3
# 87-91% -> 90-92%; but 0.9x on 7x7 images, whose one-block tasks keep their dW block in L1
# through all images. Output blocks are grouped only where X is larger than X_CACHED_BYTES: a
# smaller X is re-read from the L3 (1x1 256 -> 1024 at 14x14, X 3 MB: 88% of the peak with one
# output block a task, 83% with 16; 128 -> 512 at 28x28: 90% / 85%), and a 3x3 layer with such
# an X keeps one-block tasks (256 -> 256 at 14x14: 92%, with 8 input blocks 84%).
IB_TILE = 8
MIN_TASKS = 4
TASK_L2_BYTES = 512 * 1024
MIN_PIXELS = 14 * 14
X_CACHED_BYTES = 8 * 1024 * 1024


def blocks_per_task(wl: Conv2dWorkload, ic_bn: int, oc_bn: int, rows: int) -> tuple[int, int]:
    """(input blocks, output blocks) a task of the weight gradient reduces together
    (:attr:`WeightGradPlan.ib_tile`, :attr:`WeightGradPlan.ob_tile`), for chunks of `rows`
    output rows; (1, 1) below MIN_PIXELS output pixels (comment above)."""
    icb, ocb = wl.C // ic_bn, -(-wl.K // oc_bn)
    taps = wl.KH * wl.KW
    if wl.OH * wl.OW < MIN_PIXELS:
        return 1, 1
    (sh, _), (dh, _) = wl.stride, wl.dilation
    read_rows = min(wl.HP, (wl.OH - 1) * sh + (wl.KH - 1) * dh + 1)  # the rows of X any tap reads
    x_bytes = 4 * wl.N * wl.C * read_rows * wl.WP
    if taps > 1 and x_bytes <= X_CACHED_BYTES:
        return 1, 1
    dy_bytes = 4 * wl.N * ocb * oc_bn * wl.OH * wl.OW
    x_chunk = 4 * ic_bn * ((rows - 1) * sh + (wl.KH - 1) * dh + 1) * wl.WP  # an input block's rows of a chunk
    best, best_key = (1, 1), None
    for ib in (d for d in _divisors(icb) if d <= IB_TILE):
        for ob in _divisors(ocb) if x_bytes > X_CACHED_BYTES else [1]:
            if (ib, ob) != (1, 1) and ((icb // ib) * (ocb // ob) < MIN_TASKS
                                       or 4 * ib * ic_bn * ob * oc_bn * taps + ib * x_chunk > TASK_L2_BYTES):
                continue
            key = (x_bytes * (ocb // ob) + dy_bytes * (icb // ib), ib * ob)
            if best_key is None or key < best_key:
                best, best_key = (ib, ob), key
    return best


@functools.lru_cache(maxsize=256)
def conv2d_backward_weight_func(plan: WeightGradPlan) -> tirx.PrimFunc:
    """The unscheduled weight gradient (+ bias gradient) as TensorIR: parameters X (blocked,
    padded), dY (blocked), then dW (blocked weights) [and dB (K/y, y)]."""
    wl = plan.wl
    (sh, sw), (dh, dw) = wl.stride, wl.dilation
    chunks = wl.OH // plan.rows
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("conv2d_backward_weight")
        T.func_attr({"tirx.noalias": True})
        x = param_buffer("x", plan.data_shape())
        dy = param_buffer("dy", plan.grad_out_shape())
        dwt = param_buffer("dw", plan.weight_shape())
        db = param_buffer("db", (plan.OCB, plan.oc_bn)) if plan.bias else None
        # Views that put each operand's batch dimensions where the microkernel's description has
        # them: X as (input block, image, row, column, channel) and dY as (output block, image,
        # row, 1, column, channel); the same memory.
        image_x = plan.ICB * wl.HP * wl.WP * plan.ic_bn
        x_view = IRBuilder.name("X_images", T.decl_buffer(
            (plan.ICB, wl.N, wl.HP, wl.WP, plan.ic_bn), "float32", data=x.data,
            strides=(wl.HP * wl.WP * plan.ic_bn, image_x, wl.WP * plan.ic_bn, plan.ic_bn, 1)))
        plane_dy = wl.OH * wl.OW * plan.oc_bn
        dy_view = IRBuilder.name("dY_images", T.decl_buffer(
            (plan.OCB, wl.N, wl.OH, 1, wl.OW, plan.oc_bn), "float32", data=dy.data,
            strides=(plane_dy, plan.OCB * plane_dy, wl.OW * plan.oc_bn, 0, plan.oc_bn, 1)))
        # The unit loops u0, u2 stand for the microkernel's unit batch extents (its description's
        # loop nest is m, n, b0, b1, b2, k).
        extents = (plan.OCB, plan.ICB, wl.N, chunks, wl.KH, wl.KW, plan.ic_bn, plan.oc_bn, 1, plan.rows, 1, wl.OW)
        names = ["ob", "ib", "n", "chunk", "r", "s", "i", "o", "u0", "row", "u2", "ow"]
        with T.grid(*extents) as loops, T.sblock("dw"):
            IRBuilder.name_many(names, loops)
            v_ob, v_ib, v_n, v_chunk, v_r, v_s, v_i, v_o, _, v_row, _, v_ow = IRBuilder.name_many(
                [f"v_{name}" for name in names], T.axis.remap("SSRRSSSSRRRR", list(loops)))
            oh = v_chunk * plan.rows + v_row
            index = [v_ob, v_ib, v_r, v_s, v_i, v_o]
            with T.init():
                T.buffer_store(dwt, T.float32(0), index)
            product = (x_view[v_ib, v_n, oh * sh + v_r * dh, v_ow * sw + v_s * dw, v_i]
                       * dy_view[v_ob, v_n, oh, 0, v_ow, v_o])
            T.buffer_store(dwt, dwt[tuple(index)] + product, index)
        if db is not None:
            with T.grid(plan.OCB, plan.oc_bn, wl.N, wl.OH, wl.OW) as loops, T.sblock("db"):
                v_ob, v_o, v_n, v_oh, v_ow = T.axis.remap("SSRRR", list(loops))
                with T.init():
                    T.buffer_store(db, T.float32(0), [v_ob, v_o])
                T.buffer_store(db, db[v_ob, v_o] + dy[v_n, v_ob, v_oh, v_ow, v_o], [v_ob, v_o])
    return builder.get()


def microkernel(plan: WeightGradPlan, lanes: int) -> BRGEMM:
    """One call: an m_r x n_r tile of one tap, reduced over a chunk's rows (the batch) and each
    row's pixels (k), X read transposed."""
    wl = plan.wl
    return BRGEMM(m_r=plan.m_r, n_r=plan.n_r, k=wl.OW, lanes=lanes, batch=(1, plan.rows, 1), stride=wl.stride[1],
                  dilation=(wl.stride[0], 1), a_transposed=True, unroll=4)


def schedule_conv2d_backward_weight(sch: s_tir.Schedule, plan: WeightGradPlan, lanes: int) -> None:
    """Tasks of (output block, input block); in each, the chunks of rows outer, then the taps and
    the channel tiles, each a microkernel call accumulating into dW (zeroed at the task's start)."""
    if plan.bias:  # per output block: a sum over the images' pixels, channels in vectors
        db = sch.get_sblock("db")
        ob_db, o_db, n_db, oh_db, ow_db = sch.get_loops(db)
        sch.reorder(ob_db, n_db, oh_db, ow_db, o_db)
        sch.parallel(ob_db)
        sch.vectorize(o_db)
    block = sch.get_sblock("dw")
    ob, ib, n, chunk, r, s, i, o, u0, row, u2, ow = sch.get_loops(block)
    i_outer, i_inner = sch.split(i, [None, plan.m_r], preserve_unit_iters=True)
    o_outer, o_inner = sch.split(o, [None, plan.n_r], preserve_unit_iters=True)
    ib_outer, ib_inner = sch.split(ib, [None, plan.ib_tile], preserve_unit_iters=True)
    ob_outer, ob_inner = sch.split(ob, [None, plan.ob_tile], preserve_unit_iters=True)
    sch.reorder(ob_outer, ib_outer, n, chunk, ob_inner, ib_inner, r, s, i_outer, o_outer, i_inner, o_inner, u0,
                row, u2, ow)
    task = sch.fuse(ob_outer, ib_outer, preserve_unit_iters=True)
    sch.parallel(task)
    init = sch.decompose_reduction(block, n)
    sch.vectorize(sch.get_loops(init)[-1])
    sch.tensorize(i_inner, get_brgemm_intrin(microkernel(plan, lanes)))


def conv2d_backward_weight_kernel(plan: WeightGradPlan, lanes: int) -> tirx.PrimFunc:
    """The scheduled weight gradient, tagged with its kernel name."""
    sch = s_tir.Schedule(conv2d_backward_weight_func(plan))
    schedule_conv2d_backward_weight(sch, plan, lanes)
    return sch.mod["main"].with_attr(KERNEL_ATTR, "conv2d_backward_weight")


def unpack_weight_func(plan: WeightGradPlan) -> tirx.PrimFunc:
    """Blocked weights (K/y, C/x, KH, KW, x, y) -> OIHW (K, C, KH, KW): the inverse of the
    forward's weight packing, in 8x8 register tiles of (8 output channels, 8 (i, kh, kw) of one
    input block) where the blocks allow; the channels past K are dropped."""
    wl = plan.wl
    K, khw = wl.K, wl.KH * wl.KW
    q_block = plan.ic_bn * khw
    if plan.oc_bn % 8 or q_block % 8:
        blocked = te.placeholder(plan.weight_shape(), "float32", name="blocked")
        oihw = te.compute((K, wl.C, wl.KH, wl.KW), lambda k, c, r, s: blocked[
            k // plan.oc_bn, c // plan.ic_bn, r, s, c % plan.ic_bn, k % plan.oc_bn], name="oihw")
        sch = s_tir.Schedule(te.create_prim_func([blocked, oihw]))
        sch.parallel(sch.get_loops(sch.get_sblock("oihw"))[0])
        return sch.mod["main"].with_attr(KERNEL_ATTR, "unpack_weight")
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("unpack_weight")
        T.func_attr({"tirx.noalias": True, KERNEL_ATTR: "unpack_weight"})
        blocked = param_buffer("blocked", plan.weight_shape())
        oihw = param_buffer("oihw", (K, wl.C, wl.KH, wl.KW))
        rows = IRBuilder.name("OIHW_rows", T.decl_buffer((K, wl.C * khw), "float32", data=oihw.data))
        with T.sblock("root"), T.parallel(0, plan.OCB) as ob:
            with T.grid(plan.oc_bn // 8, plan.ICB, q_block // 8) as (o0, ib, q0):
                def load(j: int) -> tirx.PrimExpr:  # 8 output channels of one (i, kh, kw)
                    q = q0 * 8 + j
                    return blocked[ob, ib, q % khw // wl.KW, q % wl.KW, q // khw, T.Ramp(o0 * 8, 1, 8)]

                with T.If(ob * plan.oc_bn + o0 * 8 + 8 <= K):
                    with T.Then():
                        transpose8x8(load, lambda i, value: T.buffer_store(
                            rows, value, [ob * plan.oc_bn + o0 * 8 + i, T.Ramp(ib * q_block + q0 * 8, 1, 8)]))
                    with T.Else(), T.grid(8, 8) as (q, o), T.If(ob * plan.oc_bn + o0 * 8 + o < K), T.Then():
                        p = T.Bind(q0 * 8 + q)
                        T.buffer_store(rows, blocked[ob, ib, p % khw // wl.KW, p % wl.KW, p // khw, o0 * 8 + o],
                                       [ob * plan.oc_bn + o0 * 8 + o, ib * q_block + p])
    return builder.get()
