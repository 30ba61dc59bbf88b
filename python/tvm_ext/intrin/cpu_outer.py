"""The maxDNN tile on LLVM CPUs: the outer-product tile's implementation in vector registers.

The description is :func:`~tvm_ext.intrin.outer_tile.outer_description`, shared with CUDA. On a
CPU a tile is `rows` output channels x `cols` columns (images at one output pixel, the images
innermost, so `cols` is a multiple of the vector lanes): C's rows x cols/lanes accumulators stay
in registers for the call's k_step steps; each step loads cols/lanes vectors of B (a row of the
input: images) and broadcasts `rows` scalars of A (a row of the weights: output channels), then
issues rows x cols/lanes FMAs. Where the convolution's spatial size is, the tile is the same,
which is what a blocked-channel tile (:class:`~tvm_ext.intrin.cpu.BRGEMM`, pixels of a row) is
not at 7x7.

A, B and C are strided views of the weights, the input and the output, so the implementation
takes any row strides (unit innermost). A tile whose accumulators, B vectors and the broadcast
do not fit the ISA's register file would spill inside the k loop: :func:`check_cpu_tile`
refuses it (the register count and the tiles that fit are the BRGEMM's:
:func:`~tvm_ext.intrin.cpu.tile_registers`, :func:`~tvm_ext.intrin.cpu.register_tiles`).
"""

from __future__ import annotations

import contextlib
import functools

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from ..target import VectorISA
from .cpu import operand_buffer, tile_registers
from .outer_tile import OuterTile, outer_description
from .registry import register_once


def check_cpu_tile(tile: OuterTile, isa: VectorISA) -> None:
    """Raise ValueError unless `isa` runs `tile` from registers: one contiguous group of rows and
    of columns, whole vectors of columns, and no spill."""
    tile.validate()
    if (tile.row_groups, tile.col_groups) != (1, 1):
        raise ValueError(f"OuterTile: a CPU tile is one contiguous group of rows and of columns, not {tile}")
    if tile.cols % isa.lanes:
        raise ValueError(f"OuterTile: cols={tile.cols} is not a multiple of {isa.name}'s {isa.lanes} lanes")
    registers = tile_registers(tile.rows, tile.cols // isa.lanes)
    if registers > isa.registers:
        raise ValueError(f"OuterTile: a {tile.rows}x{tile.cols} tile needs {registers} vector registers, {isa.name} "
                         f"has {isa.registers}: it would spill in the k loop")


def _implementation(tile: OuterTile, lanes: int, unroll: int) -> tirx.PrimFunc:
    """C's accumulators loaded once (zeros with `init`), for each batch entry k_step steps of
    (B's vectors, rows broadcasts, rows x vectors FMAs), C stored once. Accumulators are small
    arrays indexed by constants (LLVM promotes them to registers; see
    :func:`tvm_ext.intrin.cpu._implementation`)."""
    vec, nv = f"{tile.dtype}x{lanes}", tile.cols // lanes
    steps = tile.k_step
    ku = max(d for d in range(1, min(unroll, steps) + 1) if steps % d == 0)
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("impl")
        handles = [T.arg(name, T.handle()) for name in "abc"]
        shapes = ((*tile.batch, tile.k_step, tile.span_a), (*tile.b_batch, tile.k_step, tile.span_b),
                  (tile.rows, tile.cols))
        a, b, c = (operand_buffer(handle, shape, tile.dtype, strided=True)
                   for handle, shape in zip(handles, shapes, strict=True))
        with T.sblock("root"):
            whole = [buf[tuple(slice(0, e) for e in shape)] for buf, shape in zip((a, b), shapes[:2], strict=True)]
            T.reads(*([] if tile.init else [c[0:tile.rows, 0:tile.cols]]), *whole)
            T.writes(c[0:tile.rows, 0:tile.cols])
            acc = [IRBuilder.name(f"acc{i}", T.alloc_buffer((nv,), vec)) for i in range(tile.rows)]
            bv = IRBuilder.name("bv", T.alloc_buffer((nv,), vec))
            for i in range(tile.rows):
                for j in range(nv):
                    start = T.broadcast(tirx.const(0, tile.dtype), lanes) if tile.init else c.vload([i, j * lanes], vec)
                    T.buffer_store(acc[i], start, [j])
            with contextlib.ExitStack() as frames:
                entry = [frames.enter_context(T.serial(extent)) for extent in tile.batch]
                k0, k1 = frames.enter_context(T.serial(steps // ku)), frames.enter_context(T.unroll(ku))
                IRBuilder.name_many([*(f"b{i}" for i in range(len(entry))), "k0", "k1"], [*entry, k0, k1])
                k = k0 * ku + k1
                b_entry = [x * d for x, d in zip(entry, tile.dilation, strict=True)]
                for j in range(nv):
                    T.buffer_store(bv, b.vload([*b_entry, k, j * lanes], vec), [j])
                for i in range(tile.rows):
                    a_value = T.broadcast(a[(*entry, k, i)], lanes)
                    for j in range(nv):
                        T.buffer_store(acc[i], T.call_llvm_pure_intrin(vec, "llvm.fmuladd", a_value, bv[j], acc[i][j]),
                                       [j])
            for i in range(tile.rows):
                for j in range(nv):
                    T.buffer_store(c, acc[i][j], [i, slice(j * lanes, (j + 1) * lanes)])
    return builder.get()


@functools.cache
def get_cpu_outer_intrin(tile: OuterTile, isa: VectorISA, unroll: int = 2) -> str:
    """Register (once) the CPU tensor intrinsic for `tile` on `isa` (:func:`check_cpu_tile`),
    `unroll` k steps unrolled (the largest divisor of k_step up to it), and return its name."""
    check_cpu_tile(tile, isa)
    name = f"{tile.name(f'cpu_l{isa.lanes}')}_u{unroll}"  # (the effective unroll divides k_step)
    return register_once(name, lambda: (outer_description(tile), _implementation(tile, isa.lanes, unroll)))
