"""Layout changes around the maxDNN tile's convolution in a graph (LLVM CPU): one pass each way.

Between the other tvm_ext kernels activations are blocked by channels, (N, C/b, H, W, b); the
tile's kernel (:mod:`tvm_ext.kernels.conv2d_maxdnn`) reads its images in the vector lanes,
(N/cols, H, W, C, cols) with a zero border, and writes (N/cols, P, Q, G*K', cols). These are
the two passes between them:

- :func:`tile_input_func`: blocked (or NCHW, a graph's input) -> the tile's input, with its zero
  border and zero images up to whole tiles;
- :func:`tile_output_func`: the tile's output -> blocked, applying the convolution's epilogue on
  the way (:class:`~tvm_ext.kernels.conv2d_maxdnn.Epilogue`: bias, a residual in the blocked
  layout, an activation): the pass reads and writes every element anyway, so in a graph the
  kernel itself writes plain sums.

Where images and channels come in groups of 8 the pass moves them in 8x8 register transposes
(:mod:`.transpose`: a pixel's (image, channel) tile in both directions); other shapes take an
element-wise TensorIR schedule.
"""

from __future__ import annotations

from collections.abc import Sequence

from tvm import s_tir, te, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from .common import KERNEL_ATTR, accept_user_alignment, param_buffer
from .conv2d_maxdnn import Epilogue, MaxDNNCpuPlan
from .transpose import TILE, transpose8x8

__all__ = ["tile_input_func", "tile_output_func"]


_PLAIN = Epilogue()  # (the layout change alone)


def _zeros() -> tirx.PrimExpr:
    return T.Broadcast(T.float32(0), TILE)


def _source_shape(plan: MaxDNNCpuPlan, shape: Sequence[int], block: int | None) -> tuple[int, ...]:
    """`shape` as ints, checked against the plan: NCHW (`block` None) or blocked by `block`,
    whose last block may hold channels past the convolution's (they are not read)."""
    shape, wl = tuple(int(v) for v in shape), plan.wl
    if block is None:
        expected = (wl.N, wl.C, wl.H, wl.W)
        ok = shape == expected
    else:
        expected = (wl.N, -(-wl.C // block), wl.H, wl.W, block)
        ok = len(shape) == 5 and shape[:1] + shape[2:] == expected[:1] + expected[2:] and shape[1] * block >= wl.C
    if not ok:
        raise ValueError(f"maxdnn layout: the source {shape} is not {expected} for {wl}")
    return shape


def tile_input_func(plan: MaxDNNCpuPlan, source_shape: Sequence[int], block: int | None) -> tirx.PrimFunc:
    """The tile's input (:meth:`MaxDNNCpuPlan.data_shape`) from `source_shape`: NCHW where `block`
    is None, else (N, ceil(C/block), H, W, block)."""
    source_shape = _source_shape(plan, source_shape, block)
    if block is not None and block % TILE == 0 and plan.wl.C % TILE == 0 and plan.cols % TILE == 0:
        return _tile_input_transposed(plan, source_shape, block)
    wl, cols = plan.wl, plan.cols
    top, left = wl.padding[:2]
    x = te.placeholder(source_shape, "float32", name="data")

    def body(nb, h, w, c, j):
        n, ih, iw = nb * cols + j, h - top, w - left
        inside = tirx.all(n < wl.N, ih >= 0, ih < wl.H, iw >= 0, iw < wl.W)
        n, ih, iw = tirx.min(n, wl.N - 1), tirx.max(tirx.min(ih, wl.H - 1), 0), tirx.max(tirx.min(iw, wl.W - 1), 0)
        value = x[n, c, ih, iw] if block is None else x[n, c // block, ih, iw, c % block]
        return tirx.if_then_else(inside, value, tirx.const(0.0, "float32"))

    y = te.compute(plan.data_shape(), body, name="tile_input")
    func = te.create_prim_func([x, y])
    # NCHW data may be a user's array (`ops.conv2d`): NumPy aligns it to 16 bytes, not TVM's 64,
    # and LLVM's aligned vector loads of it crashed the process where it was not
    sch = s_tir.Schedule(accept_user_alignment(func, "data") if block is None else func)
    nb, h, w, c, j = sch.get_loops(sch.get_sblock("tile_input"))
    sch.parallel(sch.fuse(nb, h))
    return sch.mod["main"].with_attr(KERNEL_ATTR, "maxdnn_tile_input")


def _tile_input_transposed(plan: MaxDNNCpuPlan, source_shape: tuple[int, ...], block: int) -> tirx.PrimFunc:
    """Blocked -> the tile's input: each pixel's 8 images x 8 channels in a register transpose;
    the border and the images past N as zero vectors."""
    wl, cols = plan.wl, plan.cols
    NB, HP, WP, C, _ = plan.data_shape()
    top, left = wl.padding[:2]
    width = min(wl.W, WP - left)  # (columns past the last one an output reads are not copied)
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("maxdnn_tile_input")
        T.func_attr({"tirx.noalias": True, KERNEL_ATTR: "maxdnn_tile_input"})
        x = param_buffer("x", source_shape)
        y = param_buffer("y", plan.data_shape())
        with T.sblock("root"), T.parallel(0, NB * HP) as task:
            nb, h = T.Bind(task // HP), T.Bind(task % HP)
            with T.If(tirx.Or(h < top, h >= top + wl.H)):
                with T.Then(), T.grid(WP, C, cols // TILE) as (w, c, j):
                    T.buffer_store(y, _zeros(), [nb, h, w, c, T.Ramp(j * TILE, 1, TILE)])
                with T.Else():
                    for start, extent in ((0, left), (left + width, WP - left - width)):
                        with T.grid(extent, C, cols // TILE) as (w, c, j):
                            T.buffer_store(y, _zeros(), [nb, h, start + w, c, T.Ramp(j * TILE, 1, TILE)])
                    with T.grid(width, C // TILE, cols // TILE) as (w, c8, j8):
                        def load(i: int, w=w, c8=c8, j8=j8):
                            n = nb * cols + j8 * TILE + i
                            value = x[T.min(n, wl.N - 1), c8 * TILE // block, h - top, w,
                                      T.Ramp(c8 * TILE % block, 1, TILE)]
                            return T.Select(T.Broadcast(n < wl.N, TILE), value, _zeros())

                        transpose8x8(load, lambda i, v, w=w, c8=c8, j8=j8: T.buffer_store(
                            y, v, [nb, h, left + w, c8 * TILE + i, T.Ramp(j8 * TILE, 1, TILE)]))
    return builder.get()


def _output_check(plan: MaxDNNCpuPlan, block: int) -> tuple[int, ...]:
    wl = plan.wl
    if block < 1 or wl.K % block:
        raise ValueError(f"maxdnn layout: the output block {block} does not divide {wl.K} channels")
    return (wl.N, wl.K // block, wl.OH, wl.OW, block)


def tile_output_func(plan: MaxDNNCpuPlan, block: int, epilogue: Epilogue = _PLAIN) -> tirx.PrimFunc:
    """The tile's output (:meth:`MaxDNNCpuPlan.out_shape`) -> (N, K/block, P, Q, block) with the
    epilogue applied. Parameters: (t[, bias (K,)][, residual (the output's shape)], y)."""
    out_shape = _output_check(plan, block)
    wl = plan.wl
    kg = wl.K // wl.groups
    if block % TILE == 0 and plan.cols % TILE == 0 and kg % TILE == 0:
        return _tile_output_transposed(plan, block, epilogue)
    t = te.placeholder(plan.out_shape(), "float32", name="tile")
    bias = te.placeholder((wl.K,), "float32", name="bias") if epilogue.bias else None
    residual = te.placeholder(out_shape, "float32", name="residual") if epilogue.residual else None

    def body(n, kb, p, q, kc):
        k = kb * block + kc
        value = t[n // plan.cols, p, q, k // kg * plan.outputs + k % kg, n % plan.cols]
        return epilogue.apply(value, None if bias is None else bias[k],
                              None if residual is None else residual[n, kb, p, q, kc])

    y = te.compute(out_shape, body, name="tile_output")
    params = [t, *(b for b in (bias, residual) if b is not None), y]
    sch = s_tir.Schedule(te.create_prim_func(params))
    n, kb, p, q, kc = sch.get_loops(sch.get_sblock("tile_output"))
    sch.parallel(sch.fuse(n, kb, p))
    return sch.mod["main"].with_attr(KERNEL_ATTR, "maxdnn_tile_output")


def _tile_output_transposed(plan: MaxDNNCpuPlan, block: int, epilogue: Epilogue) -> tirx.PrimFunc:
    """The tile's output -> blocked: each pixel's 8 channels x 8 images in a register transpose
    (the images past N not written), then the epilogue over the pixel's row while it is in L1."""
    wl, cols = plan.wl, plan.cols
    out_shape = _output_check(plan, block)
    NB, P, Q, _, _ = plan.out_shape()
    kg = wl.K // wl.groups
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("maxdnn_tile_output")
        T.func_attr({"tirx.noalias": True, KERNEL_ATTR: "maxdnn_tile_output"})
        t = param_buffer("t", plan.out_shape())
        bias = param_buffer("b", (wl.K,)) if epilogue.bias else None
        residual = param_buffer("r", out_shape) if epilogue.residual else None
        y = param_buffer("y", out_shape)
        with T.sblock("root"), T.parallel(0, NB * P) as task:
            nb, p = T.Bind(task // P), T.Bind(task % P)
            with T.serial(0, Q) as q:
                with T.grid(wl.K // TILE, cols // TILE) as (k8, j8):
                    k0 = k8 * TILE
                    channel = k0 // kg * plan.outputs + k0 % kg  # (8 channels of one group: kg is whole 8s)

                    def store(j: int, v, q=q, k0=k0, j8=j8) -> None:
                        n = nb * cols + j8 * TILE + j
                        with T.If(n < wl.N), T.Then():
                            T.buffer_store(y, v, [n, k0 // block, p, q, T.Ramp(k0 % block, 1, TILE)])

                    transpose8x8(lambda i, q=q, channel=channel, j8=j8: t[nb, p, q, channel + i,
                                                                           T.Ramp(j8 * TILE, 1, TILE)], store)
                if not epilogue.empty:
                    with T.serial(0, T.min(cols, wl.N - nb * cols)) as j, T.serial(0, wl.K // block) as kb, \
                            T.vectorized(0, block) as kc:
                        at = [nb * cols + j, kb, p, q, kc]
                        T.buffer_store(y, epilogue.apply(y[tuple(at)], None if bias is None else bias[kb * block + kc],
                                                         None if residual is None else residual[tuple(at)]), at)
    return builder.get()
