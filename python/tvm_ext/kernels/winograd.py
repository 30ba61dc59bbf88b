"""Winograd F(m x m, r x r) convolution for stride-1 3x3 and 5x5 layers: fewer multiplies, the
same BRGEMM.

F(m, r) computes m outputs of an r-tap correlation from a = m + r - 1 inputs with a multiplies
instead of r m (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks", 2016): per
a x a input tile d, Y = A^T [(G g G^T) * (B^T d B)] A. Summed over input channels, the
elementwise product becomes a² independent GEMMs, one per position (xi, nu) of the tile, of
(tiles x C) by (C x K): a 1x1 convolution with a² groups on the grid of tiles, which tvm_ext runs
with its BRGEMM kernel (:func:`gemm_plan`). Around it:

- the weights are transformed (U = G g G^T, :func:`transform_weight`) at build time;
- :func:`input_transform_func` writes V = B^T d B for every tile, blocked like any activation;
- :func:`output_transform_func` applies A^T . A and the convolution's epilogue (bias, shortcut,
  activation, zero border) in the same pass.

Multiplies per output fall from r² C K to (a/m)² C K: for 3x3 from 9 to 4 (F(2, 3)) or 2.25
(F(4, 3)), for 5x5 from 25 to 9 (F(2, 5)) or 4 (F(4, 5)). The transforms cost memory passes (V
and the GEMM's output are (a/m)² times the input and output), which the saved multiplies
outweigh from 16 channels up (measured; :data:`MIN_CHANNELS`).
Accuracy, float32 against a float64 direct convolution, as the largest error over the largest
output: F(2, 3) 4e-7 to 9e-7 and F(4, 3) 7e-6 to 1.2e-5 on 64-512 channel layers; F(2, 5) 5e-6
to 9e-6 and F(4, 5) 7e-6 to 9e-6 on AlexNet's and OverFeat's 5x5 layers (direct float32: 2e-7 to
4e-7).
The plan is a :class:`~tvm_ext.kernels.conv2d.Conv2dPlan` of kind "winograd" whose `m_r` is m.
"""

from __future__ import annotations

import contextlib
import functools
import math
from fractions import Fraction

import numpy as np
from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from .common import ACTIVATIONS, KERNEL_ATTR, activation_expr, bf16_bits, load_value, param_buffer
from .conv2d import IMAGES_INSIDE_BLOCKS, Conv2dPlan, Conv2dWorkload, Epilogue, plan_conv2d

# Interpolation points of F(m, r) by the tile size a = m + r - 1 (the point at infinity is
# implied): small integers and halves keep the transforms exact in float32 and their error growth
# low. a = 4: F(2, 3); 6: F(4, 3) and F(2, 5); 8: F(4, 5).
POINTS = {4: (0, 1, -1), 6: (0, 1, -1, 2, -2), 8: (0, 1, -1, 2, -2, Fraction(1, 2), Fraction(-1, 2))}
# Fewer channels stay direct: such layers are small either way, and direct has the lower error.
# (Measured, 1 thread: 16 channels at 56x56 0.37 ms direct, 0.21 Winograd; 64 channels at 7x7
# 0.093 against 0.088 ms.)
MIN_CHANNELS = 32


@functools.cache
def winograd_matrices(m: int, r: int = 3) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(A^T: m x a, G: a x r, B^T: a x a) of F(m, r), from :data:`POINTS` (exact, then float64).

    Toom-Cook: evaluate at the points and at infinity, multiply, interpolate; the correlation is
    the transpose of that linear convolution. Each row of B^T is scaled to integers, and the
    matching row of G by the inverse.
    """
    a = m + r - 1
    points = [Fraction(p) for p in POINTS[a]]
    # Values at the points (and the leading coefficient, "at infinity") of a degree a-1 polynomial.
    values = [[p ** c for c in range(a)] for p in points] + [[Fraction(int(c == a - 1)) for c in range(a)]]
    inverse = _inverse(values)
    bt = [[inverse[c][j] for c in range(a)] for j in range(a)]
    g = [[p ** k for k in range(r)] for p in points] + [[Fraction(int(k == r - 1)) for k in range(r)]]
    at = [[p ** i for p in points] + [Fraction(int(i == m - 1))] for i in range(m)]
    for j in range(a):
        scale = math.lcm(*(v.denominator for v in bt[j]))
        bt[j] = [v * scale for v in bt[j]]
        g[j] = [v / scale for v in g[j]]
    at_m, g_m, bt_m = (np.array(mat, dtype=np.float64) for mat in (at, g, bt))
    for mat in (at_m, g_m, bt_m):  # shared by every caller (cached)
        mat.flags.writeable = False
    return at_m, g_m, bt_m


def matrices(plan: Conv2dPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`winograd_matrices` of a Winograd plan: F(m, r) for its m and its r x r kernel."""
    return winograd_matrices(plan.m_r, plan.wl.KH)


def _inverse(matrix: list[list[Fraction]]) -> list[list[Fraction]]:
    """Exact Gauss-Jordan inverse."""
    n = len(matrix)
    rows = [row[:] + [Fraction(int(i == j)) for j in range(n)] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = next(i for i in range(col, n) if rows[i][col] != 0)
        rows[col], rows[pivot] = rows[pivot], rows[col]
        rows[col] = [v / rows[col][col] for v in rows[col]]
        for i in range(n):
            if i != col and rows[i][col] != 0:
                factor = rows[i][col]
                rows[i] = [vi - factor * vc for vi, vc in zip(rows[i], rows[col], strict=True)]
    return [row[n:] for row in rows]


def shape_eligible(wl: Conv2dWorkload) -> str:
    """Why the F(m, r) of :data:`POINTS` cannot compute `wl` at all, or "" if they can."""
    if (wl.KH, wl.KW) not in ((3, 3), (5, 5)) or wl.stride != (1, 1) or wl.dilation != (1, 1) or wl.groups != 1:
        return "not a 3x3 or 5x5, stride-1, undilated, ungrouped convolution"
    if wl.dtype != "float32":
        return f"dtype {wl.dtype}"
    return ""


def eligible(wl: Conv2dWorkload) -> str:
    """Why `wl` cannot run as Winograd F(m, r) on the CPU, or "" if it can."""
    why = shape_eligible(wl)
    if why:
        return why
    if wl.C % 16 or wl.K % 16 or min(wl.C, wl.K) < MIN_CHANNELS:
        return f"channels {wl.C} -> {wl.K}: Winograd needs multiples of 16, at least {MIN_CHANNELS}"
    return ""


def tile_size(wl: Conv2dWorkload) -> int:
    """m: 4 where the image holds 2 x 2 whole tiles of 4, else 2 (3x3 and 5x5 alike).

    Measured on AVX2, 1 thread. 3x3, GEMM stage: F(4, 3) was 1.15-1.8x faster than F(2, 3) from
    56 x 56 down to 12 x 12 images, ragged edges included (13 x 13: 3.70 against 4.61 ms,
    384 -> 256). At 7 x 7 it was 13% faster (3.82 against 4.39 ms, 512 -> 512), but its
    transformed weights are 2.25x larger (38 against 17 MB there) and its error 10x higher.
    F(6, 3) was slower than F(4, 3) from 56 x 56 to 14 x 14 (2.0 against 1.9 ms up to 3.1
    against 2.6 ms): its transforms cost more than its GEMMs save. 5x5, all three kernels:
    F(4, 5) 2.77 ms, F(3, 5) 3.26, F(2, 5) 5.62, direct 11.7 (AlexNet's 64 -> 192 at 27 x 27);
    2.83, 3.80, 5.35 and 12.9 ms on OverFeat's 96 -> 256 at 20 x 20.
    With 4 or more images per call the GEMMs of small images run their images inside each output
    block (:data:`~tvm_ext.kernels.conv2d.IMAGES_INSIDE_BLOCKS`), which reads the larger weights
    once for all of them: then F(4, 3) at 7 x 7 took 2.40 ms an image against 3.74 for F(2, 3)
    (GEMMs, 512 -> 512, 4 images, cold weights), so it is used from 6 x 6 up.
    """
    images_share_weights = wl.N >= IMAGES_INSIDE_BLOCKS[0]
    return 4 if min(wl.OH, wl.OW) >= (6 if images_share_weights else 8) else 2


def winograd_plan(wl: Conv2dWorkload, isa, ic_bn: int = 16) -> Conv2dPlan:
    """The plan of `wl` as Winograd: input blocks of `ic_bn`, output blocks of its GEMM's n_r."""
    m = tile_size(wl)
    gemm = plan_conv2d(_gemm_workload(wl, m, *_grid(wl, m)), isa, ic_bn=ic_bn)
    return Conv2dPlan(wl, "winograd", ic_bn, gemm.oc_bn, m, reason=f"Winograd F({m}x{m}, {wl.KH}x{wl.KW})")


def tiles(plan: Conv2dPlan) -> tuple[int, int]:
    """Tiles per column and per row of the output."""
    m = plan.m_r
    return -(-plan.wl.OH // m), -(-plan.wl.OW // m)


FLAT_GRID_WIDTH = 4  # a grid of tiles at most this wide is one row for the GEMMs (:func:`grid`)


def grid(plan: Conv2dPlan) -> tuple[int, int]:
    """The (rows, columns) of tiles the GEMMs see: the tile grid, or the whole grid as one row
    when its rows are narrow. A row of 4 tiles allows only a 4 x 16 register tile on AVX2; as one
    row, 16 tiles take 6 x 16 ones (measured 3-15% faster on 3 x 3 to 4 x 4 grids). A 7-wide
    grid stays 2-D: 49 tiles in one row split as 8 x 6 + 1, and measured 7% slower."""
    return _grid(plan.wl, plan.m_r)


def _grid(wl: Conv2dWorkload, m: int) -> tuple[int, int]:
    th, tw = -(-wl.OH // m), -(-wl.OW // m)
    return (1, th * tw) if tw <= FLAT_GRID_WIDTH else (th, tw)


def input_padding(plan: Conv2dPlan) -> tuple[int, int, int, int]:
    """The zero border the input needs (top, left, bottom, right): the convolution's padding, and
    below and right enough more that every tile of the last row and column reads zeros."""
    th, tw = tiles(plan)
    top, left, bottom, right = plan.wl.padding
    return top, left, bottom + th * plan.m_r - plan.wl.OH, right + tw * plan.m_r - plan.wl.OW


def _gemm_workload(wl: Conv2dWorkload, m: int, rows: int, cols: int) -> Conv2dWorkload:
    a2 = (m + wl.KH - 1) ** 2
    return Conv2dWorkload.make((wl.N, a2 * wl.C, rows, cols), (a2 * wl.K, wl.C, 1, 1), 1, 0, 1, a2)


def gemm_plan(plan: Conv2dPlan, isa) -> Conv2dPlan:
    """The a² GEMMs as the BRGEMM plan of a grouped 1x1 convolution on the :func:`grid` of tiles."""
    return plan_conv2d(_gemm_workload(plan.wl, plan.m_r, *grid(plan)), isa, ic_bn=plan.ic_bn, n_r=plan.oc_bn)


def transform_weight(plan: Conv2dPlan, weight: np.ndarray) -> np.ndarray:
    """OIHW r x r weights -> U = G g G^T as the grouped 1x1 weights of :func:`gemm_plan`:
    (a² K, C, 1, 1), group xi * a + nu; computed in float64."""
    _, g, _ = matrices(plan)
    u = np.einsum("xi,kcij,nj->xnkc", g, weight.astype(np.float64), g)
    a, k, c = g.shape[0], plan.wl.K, plan.wl.C
    return u.reshape(a * a * k, c, 1, 1).astype(np.float32)


# The transforms are built with TVM's IRBuilder, not written as TVMScript text: their unrolled
# bodies (up to 8 x 8 loads, sums and stores per tile) took 0.3-1.6 s each to parse, about 8 of the
# 21 s of an AlexNet build; built, 0.01-0.02 s. (The same IR: structurally equal.)


def weighted_sum(coefficients, terms: list[tirx.PrimExpr]) -> tirx.PrimExpr:
    """sum(c * t) without the zero terms and the multiplications by +-1."""
    total = None
    for c, t in zip(coefficients, terms, strict=True):
        if c == 0:
            continue
        term = t if abs(c) == 1 else tirx.const(abs(float(c)), "float32") * t
        if total is None:
            total = term if c > 0 else tirx.const(0.0, "float32") - term
        else:
            total = total + term if c > 0 else total - term
    return tirx.const(0.0, "float32") if total is None else total


@contextlib.contextmanager
def _tile_loops(plan: Conv2dPlan, blocks: int, block: int, vectorized: bool = True):
    """The loops of both transforms: one parallel task per (image, block of channels, row of
    tiles); inside, the row's tiles, a vector of `block` channels each. Yields (n, channel
    block, ty, tx, c)."""
    th, tw = tiles(plan)
    with T.parallel(0, plan.wl.N * blocks * th) as task:
        n = T.Bind(task // (blocks * th))
        b = T.Bind(task % (blocks * th) // th)
        ty = T.Bind(task % th)
        with T.serial(0, tw) as tx, (T.vectorized if vectorized else T.serial)(0, block) as c:
            yield n, b, ty, tx, c


def _grid_index(plan: Conv2dPlan, ty: tirx.Var, tx: tirx.Var) -> list:
    """Tile (ty, tx) in the GEMMs' grid of tiles (:func:`grid`)."""
    return [ty, tx] if grid(plan) == tiles(plan) else [0, ty * tiles(plan)[1] + tx]


# Activations whose epilogue keeps a serial channel loop: TVM's vectorizer cannot vectorize
# T.erf, and falling back to scalar code inside a vectorized loop it lost the loop's let bindings
# (the tile's values). The output transform keeps GELU's scalar erf: with the vectorized erf
# (:func:`.vector_math.vector_erf`, 7 bound steps) in each of the tile's m x m outputs, TVM's
# passes took about 2 minutes to lower one kernel (docs/tvm_0.27_hazards.md, "let bindings").
_UNVECTORIZED_ACTIVATIONS = frozenset({"gelu"})


def input_transform_func(plan: Conv2dPlan) -> tirx.PrimFunc:
    """Blocked, padded input (N, C/x, HP, WP, x) -> V (N, a² C/x, the :func:`grid` of tiles, x):
    V = B^T d B for each a x a tile d (stride m), group xi * a + nu of the GEMM's input."""
    wl, m = plan.wl, plan.m_r
    _, _, bt = matrices(plan)
    a, icb = len(bt), wl.C // plan.ic_bn
    top, left, bottom, right = input_padding(plan)
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("winograd_input")
        T.func_attr({"tirx.noalias": True})
        x = param_buffer("x", (wl.N, icb, wl.H + top + bottom, wl.W + left + right, plan.ic_bn))
        v = param_buffer("v", (wl.N, a * a * icb, *grid(plan), plan.ic_bn))
        with T.sblock("root"), _tile_loops(plan, icb, plan.ic_bn) as (n, cb, ty, tx, c):
            d = [[T.Bind(x[n, cb, ty * m + i, tx * m + j, c]) for j in range(a)] for i in range(a)]
            bt_d = [[T.Bind(weighted_sum(bt[xi], [d[i][j] for i in range(a)])) for j in range(a)] for xi in range(a)]
            for xi in range(a):
                for nu in range(a):
                    T.buffer_store(v, weighted_sum(bt[nu], bt_d[xi]),
                                   [n, (xi * a + nu) * icb + cb, *_grid_index(plan, ty, tx), c])
    return builder.get().with_attr(KERNEL_ATTR, "winograd_input_transform")


def bf16_output_reason(epilogue: Epilogue) -> str | None:
    """Why the output transform cannot write `epilogue` in bfloat16 (None: it can). The
    activations built on a vectorized exp or erf bind variables inside the value (Let
    expressions), and TVM's passes refused them bound again for the rounding to bf16 (a conflict
    of their ranges in the arithmetic analyzer)."""
    if epilogue.activation and "_vector_" in ACTIVATIONS[epilogue.activation]:
        return f"{epilogue.activation} (vectorized exp or erf) before a rounding to bf16"
    return None


def output_transform_func(plan: Conv2dPlan, epilogue: Epilogue | None = None) -> tirx.PrimFunc:
    """The GEMM's output (N, a² K/y, the :func:`grid` of tiles, y) -> the blocked output
    (N, K/y, OH, OW, y) with `epilogue`'s border: A^T M A per tile, then + bias, + shortcut
    (blocked, no border), activation; outputs past the image's edge are not written."""
    epilogue = epilogue or Epilogue()
    if epilogue.nchw_out:
        raise ValueError("winograd: the output transform writes the blocked layout only")
    if epilogue.mask:
        raise ValueError("winograd: the output transform applies no mask (a gradient's convolutions have "
                         "run-time weights, which Winograd does not take)")
    refused = bf16_output_reason(epilogue) if epilogue.buffer_dtype == "bfloat16" else None
    if refused:
        raise ValueError(f"winograd: no bf16 output after {refused}")
    wl, m = plan.wl, plan.m_r
    at, _, _ = matrices(plan)
    a, (th, tw), ocb = at.shape[1], tiles(plan), wl.K // plan.oc_bn
    top, left, bottom, right = epilogue.out_pad
    y_shape = epilogue.out_shape(plan)
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("winograd_output")
        T.func_attr({"tirx.noalias": True})
        products = param_buffer("mm", (wl.N, a * a * ocb, *grid(plan), plan.oc_bn))
        bias = param_buffer("b", (ocb, plan.oc_bn)) if epilogue.bias else None
        residual = param_buffer("r", plan.out_shape(), dtype=epilogue.residual_dtype) if epilogue.residual else None
        y = param_buffer("y", y_shape, dtype=epilogue.buffer_dtype)  # fp32, or bf16 (rounded) for bf16 readers
        # a bf16 output is written as bits (:func:`~.common.bf16_bits`), its zero border too;
        # a bf16 residual is read as bits and widened
        bits = y if epilogue.buffer_dtype == "float32" else T.decl_buffer(y_shape, "uint16", data=y.data)
        if residual is not None and residual.dtype == "bfloat16":
            residual = T.decl_buffer(residual.shape, "uint16", data=residual.data)
        with T.sblock("root"):
            vectorized = epilogue.activation not in _UNVECTORIZED_ACTIVATIONS
            with _tile_loops(plan, ocb, plan.oc_bn, vectorized) as (n, ob, ty, tx, c):
                s = [[T.Bind(products[(n, (xi * a + nu) * ocb + ob, *_grid_index(plan, ty, tx), c)])
                      for nu in range(a)] for xi in range(a)]
                at_s = [[T.Bind(weighted_sum(at[i], [s[xi][nu] for xi in range(a)])) for nu in range(a)]
                        for i in range(m)]
                for i in range(m):
                    for j in range(m):
                        value = weighted_sum(at[j], at_s[i])
                        if bias is not None:  # (epilogue.bias)
                            value = value + bias[ob, c]
                        if residual is not None:  # (epilogue.residual)
                            value = value + load_value(residual, [n, ob, ty * m + i, tx * m + j, c])
                        if epilogue.activation:
                            value = activation_expr(epilogue.activation, T.Bind(value), epilogue.alpha,
                                                    scalar_erf=not vectorized)
                        inside = ([ty * m + i < wl.OH] if i >= wl.OH - (th - 1) * m else []) + (
                            [tx * m + j < wl.OW] if j >= wl.OW - (tw - 1) * m else [])
                        index = [n, ob, ty * m + (i + top), tx * m + (j + left), c]
                        target = y
                        if epilogue.buffer_dtype == "bfloat16":  # rounded for bf16 readers, as bits
                            value, target = bf16_bits(T.Bind(value)), bits
                        if inside:
                            with T.If(functools.reduce(tirx.And, inside)), T.Then():
                                T.buffer_store(target, value, index)
                        else:
                            T.buffer_store(target, value, index)
            for rows, cols, row, col in ((top, y_shape[3], 0, 0), (bottom, y_shape[3], top + wl.OH, 0),
                                         (wl.OH, left, top, 0), (wl.OH, right, top, left + wl.OW)):
                if rows and cols:
                    with T.grid(wl.N, ocb, rows, cols) as (n, ob, i, j), T.vectorized(0, plan.oc_bn) as c:
                        T.buffer_store(bits, tirx.const(0, bits.dtype), [n, ob, row + i, col + j, c])
    return builder.get().with_attr(KERNEL_ATTR, "winograd_conv2d")
