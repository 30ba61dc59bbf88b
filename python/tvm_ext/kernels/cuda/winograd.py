"""Winograd F(m x m, r x r) convolution on CUDA: two transform kernels around the maxDNN GEMM.

The algorithm and its matrices are the CPU's (:mod:`tvm_ext.kernels.winograd`): per a x a input
tile d (a = m + r - 1, stride m), Y = A^T [(G g G^T) * (B^T d B)] A, and summed over the input
channels the elementwise product is a² independent GEMMs, one per tile position (xi, nu). On the
GPU these are the maxDNN kernel (:mod:`tvm_ext.kernels.cuda.maxdnn`) running a 1x1 convolution
with a² groups over the grid of tiles, all in the kernels' CHWN layout:

- the weights are transformed once, at build time (:func:`transform_weight`: U = G g G^T, laid
  out as the GEMM's [a², C, K]);
- :func:`input_transform_func` writes V = B^T d B, (a² C, tile rows, tile columns, N): one
  thread per (channel, tile, image), the image innermost so a warp's loads and stores coalesce;
  padding is handled in its index bounds (no padded copy);
- the GEMMs, :attr:`WinogradPlan.gemm`: M = U V, (a² K, tile rows, tile columns, N);
- :func:`output_transform_func` applies A^T . A and the convolution's epilogue (bias, residual,
  relu/relu6) in one pass and writes Y (K, OH, OW, N), skipping outputs past the image's edge.

Why: the FFMA tile runs a direct convolution at up to ~91% of the FFMA peak, so on 3x3 stride-1
layers (AlexNet conv3-5, OverFeat L3-L5, ResNet-50's 3x3s) the only way to go faster is fewer
multiplies. F(4x4, 3x3) does 36 per 16 outputs instead of 144 (4x fewer); F(4x4, 5x5) 64
instead of 400. The price is memory traffic: V and M are (a/m)² times the input and output.
:func:`estimate` weighs the two, and the graph strategy takes Winograd where it wins.

Accuracy (float32 against a float64 direct convolution, largest error over largest output):
F(4, 3) about 1e-5, F(4, 5) about 1e-5 (the CPU's measurements; the same matrices), within the
1e-4 bound. The tensor-core engines keep direct convolution: a 10-bit mantissa does not survive
the transforms' error growth.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import tvm
from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from ...target import resolve_target
from .. import winograd as _cpu
from ..conv2d import KERNEL_ATTR, Conv2dWorkload, param_buffer
from ..winograd import weighted_sum
from . import maxdnn as _maxdnn
from .memory_bound import THREADS, thread_per_element, to_coordinates
from .toolchain import generate_source

KERNEL_NAME = "winograd_conv2d"  # the three kernels: <symbol>_input, <symbol>_gemm, <symbol>_output
STAGES = ("input", "gemm", "output")
TILE = 4  # m: F(4x4, 3x3) and F(4x4, 5x5); fewer multiplies and less transform traffic than m = 2
TILES = (4, 2)  # the tiles :func:`choose_plan` weighs, F(4x4) first (ties go to it)

# The cost model that picks Winograd over direct convolution (:func:`estimate`): an H100/H200's
# FFMA rate at the tile's ~90% and its DRAM bandwidth at ~80% of the data sheet. Unmeasured on a
# GPU yet: bench/gpu_check.py times both forms of every eligible layer against cuDNN.
FFMA_GFLOPS = 60_000.0
DRAM_GBPS = 3_500.0
MIN_SPEEDUP = 1.2  # Winograd must be estimated this much faster (it is also the less accurate form)
# A block's prologue (first loads) and output write cost about this many k steps of its loop: a
# short reduction (the Winograd GEMMs of a 64-channel layer have 8 steps) runs well below the
# loop's rate.
OVERHEAD_STEPS = 4
LAUNCH_MS = 0.003  # a kernel launch and its tail: what keeps small layers in one kernel


@dataclasses.dataclass(frozen=True)
class WinogradPlan:
    """A convolution as Winograd F(m x m, r x r) on CUDA: its tiles, its GEMM's maxDNN plan and
    the epilogue the output transform applies."""

    wl: Conv2dWorkload
    m: int = TILE
    epilogue: _maxdnn.Epilogue = _maxdnn.Epilogue()

    @staticmethod
    def make(wl: Conv2dWorkload, m: int = TILE, epilogue: _maxdnn.Epilogue | None = None) -> WinogradPlan:
        why = eligible(wl)
        if why:
            raise ValueError(f"winograd_conv2d: {why}")
        if m not in (2, 4):
            raise ValueError(f"winograd_conv2d: tile m={m} is not supported (2 or 4)")
        plan = WinogradPlan(wl, m, epilogue or _maxdnn.Epilogue())
        largest = max(math.prod(shape) for shape in plan.shapes().values())
        if largest > _maxdnn.MAX_ELEMENTS:  # V and M are (a/m)² times the activations
            raise ValueError(f"winograd_conv2d: a transformed tensor of {largest} elements is past the kernels' "
                             f"32-bit indices ({_maxdnn.MAX_ELEMENTS})")
        return plan

    @property
    def a(self) -> int:
        """The input tile's side, m + r - 1."""
        return self.m + self.wl.KH - 1

    @property
    def tiles(self) -> tuple[int, int]:
        """Tiles per column and per row of the output."""
        return -(-self.wl.OH // self.m), -(-self.wl.OW // self.m)

    @property
    def matrices(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(A^T, G, B^T) in float64."""
        return _cpu.winograd_matrices(self.m, self.wl.KH)

    @functools.cached_property
    def gemm(self) -> _maxdnn.MaxDNNPlan:
        """The a² GEMMs: a 1x1 convolution with a² groups on the grid of tiles (no epilogue,
        no split-K: a² groups fill the GPU)."""
        wl, a2 = self.wl, self.a * self.a
        th, tw = self.tiles
        gemm_wl = Conv2dWorkload.make((wl.N, a2 * wl.C, th, tw), (a2 * wl.K, wl.C, 1, 1), 1, 0, 1, a2)
        return _maxdnn.MaxDNNPlan.make(gemm_wl, _maxdnn.choose_tile(wl.K, columns=wl.N * th * tw))

    @property
    def y_shape(self) -> tuple[int, int, int, int]:
        wl = self.wl
        return (wl.K, wl.OH, wl.OW, wl.N)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the three kernels: x, w (transformed), [bias], [residual], v, mm, y."""
        gemm = self.gemm.shapes()
        wl, ep = self.wl, self.epilogue
        shapes = {"x": (wl.C, wl.H, wl.W, wl.N), "w": gemm["w"]}
        if ep.bias:
            shapes["bias"] = (wl.K,)
        if ep.residual:
            shapes["residual"] = self.y_shape
        return {**shapes, "v": gemm["x"], "mm": gemm["y"], "y": self.y_shape}

    def stage_params(self) -> dict[str, dict[str, str]]:
        """Each kernel's parameters: the stem of its CUDA parameter (`<stem>_ptr`) -> the
        tensor of :meth:`shapes` it takes."""
        ep = self.epilogue
        epilogue = (["bias"] if ep.bias else []) + (["residual"] if ep.residual else [])
        flat = _maxdnn.FLAT_PARAMS
        return {"input": {"X": "x", "V": "v"}, "gemm": {flat["x"]: "v", flat["w"]: "w", flat["y"]: "mm"},
                "output": {name.upper(): name for name in ["mm", *epilogue, "y"]}}

    def shared_bytes(self, stage: str) -> int:
        """The dynamic shared memory a stage's launch gives (the GEMM's staged output tile)."""
        return self.gemm.dynamic_shared_bytes if stage == "gemm" else 0

    def launches(self) -> dict[str, tuple[tuple[int, int, int], tuple[int, int, int]]]:
        """(grid, block) of each kernel, in launch order."""
        wl = self.wl
        th, tw = self.tiles
        per_tile = th * tw * wl.N

        def flat(count: int):
            return (-(-count // THREADS), 1, 1), (THREADS, 1, 1)

        return {"input": flat(wl.C * per_tile), "gemm": (self.gemm.grid, (self.gemm.tile.threads, 1, 1)),
                "output": flat(wl.K * per_tile)}

    @property
    def gemm_flops(self) -> int:
        _, n, k = self.gemm.gemm
        return 2 * self.a * self.a * self.wl.K * n * k

    def traffic_bytes(self) -> int:
        """DRAM bytes the transforms add: V and M each written once and read once."""
        shapes = self.shapes()
        return 4 * 2 * (math.prod(shapes["v"]) + math.prod(shapes["mm"]))


def eligible(wl: Conv2dWorkload) -> str:
    """Why `wl` cannot run as Winograd on CUDA, or "" if it can: any channel counts (the GEMM
    takes ragged ones; whether it pays is :func:`estimate`'s question)."""
    return _cpu.shape_eligible(wl)


def estimate(plan: WinogradPlan) -> tuple[float, float]:
    """(direct, Winograd) time estimates in ms, with :data:`FFMA_GFLOPS`, :data:`DRAM_GBPS`,
    :data:`OVERHEAD_STEPS` and :data:`LAUNCH_MS`: each form's GEMM FLOPs at the FFMA rate, slowed
    by the blocks' overhead on its k steps, plus its launches (direct: 1, or 2 with split-K;
    Winograd: 3), and for Winograd the transforms' traffic at the DRAM rate (both forms read x
    and w and write y once: left out)."""
    def gemm_ms(flops: int, steps: int) -> float:
        return flops / FFMA_GFLOPS / 1e6 * (steps + OVERHEAD_STEPS) / steps

    direct = _maxdnn.MaxDNNPlan.make(plan.wl).with_chosen_splits()
    direct_ms = gemm_ms(plan.wl.flops, direct.k_steps // direct.splits) + LAUNCH_MS * (1 + (direct.splits > 1))
    winograd_ms = gemm_ms(plan.gemm_flops, plan.gemm.k_steps) + plan.traffic_bytes() / DRAM_GBPS / 1e6
    return direct_ms, winograd_ms + LAUNCH_MS * len(STAGES)


def choose_plan(wl: Conv2dWorkload) -> tuple[WinogradPlan | None, float, float]:
    """(plan, direct ms, its ms): the tile of :data:`TILES` :func:`estimate` finds fastest for
    `wl` (F(4x4) on every layer of bench/workloads.json; F(2x2) can win where F(4x4)'s tiles
    waste more of a small image); None where neither fits the kernels' indices."""
    best = None
    for m in TILES:
        try:
            plan = WinogradPlan.make(wl, m)
        except ValueError:  # transformed tensors too large to index
            continue
        direct_ms, winograd_ms = estimate(plan)
        if best is None or winograd_ms < best[2]:
            best = (plan, direct_ms, winograd_ms)
    return best or (None, 0.0, 0.0)


def transform_weight(plan: WinogradPlan, weight: np.ndarray) -> np.ndarray:
    """OIHW r x r weights -> U = G g G^T as the GEMM's A operand [a², C, K] (in float64, then
    float32)."""
    _, g, _ = plan.matrices
    if tuple(weight.shape) != (plan.wl.K, plan.wl.C, plan.wl.KH, plan.wl.KW):
        raise ValueError(f"winograd_conv2d: weight shape {tuple(weight.shape)} does not match the plan's "
                         f"{(plan.wl.K, plan.wl.C, plan.wl.KH, plan.wl.KW)}")
    u = np.einsum("xi,kcij,nj->xnck", g, np.asarray(weight, np.float64), g)
    a = plan.a
    return np.ascontiguousarray(u.reshape(a * a, plan.wl.C, plan.wl.K), dtype=np.float32)


def input_transform_func(plan: WinogradPlan, symbol: str = KERNEL_NAME + "_input") -> tirx.PrimFunc:
    """x (C, H, W, N) -> V (a² C, tile rows, tile columns, N), V = B^T d B per a x a tile d of
    the zero-padded input; group xi * a + nu of the GEMM's input channels."""
    wl, m, a = plan.wl, plan.m, plan.a
    _, _, bt = plan.matrices
    th, tw = plan.tiles
    top, left = wl.padding[0], wl.padding[1]
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name(symbol)
        T.func_attr({"global_symbol": symbol, "tirx.noalias": True})
        x = param_buffer("x", plan.shapes()["x"])
        v = param_buffer("v", plan.shapes()["v"])
        with T.sblock("root"), thread_per_element(wl.C * th * tw * wl.N) as index:
            c, ty, tx, n = to_coordinates(index, (wl.C, th, tw, wl.N))
            d = []
            for i in range(a):
                h = ty * m + (i - top)
                row = []
                for j in range(a):
                    w = tx * m + (j - left)
                    inside = tirx.all(0 <= h, h < wl.H, 0 <= w, w < wl.W)
                    row.append(T.Bind(tirx.if_then_else(inside, x[c, h, w, n], tirx.const(0.0, "float32"))))
                d.append(row)
            bt_d = [[T.Bind(weighted_sum(bt[xi], [d[i][j] for i in range(a)])) for j in range(a)] for xi in range(a)]
            for xi in range(a):
                for nu in range(a):
                    T.buffer_store(v, weighted_sum(bt[nu], bt_d[xi]), [(xi * a + nu) * wl.C + c, ty, tx, n])
    return builder.get().with_attr(KERNEL_ATTR, "winograd_input_transform")


def output_transform_func(plan: WinogradPlan, symbol: str = KERNEL_NAME + "_output") -> tirx.PrimFunc:
    """M (a² K, tile rows, tile columns, N) -> y (K, OH, OW, N): A^T M A per tile, then + bias,
    + residual, relu/relu6; outputs past the image's edge are not written."""
    wl, m, a, ep = plan.wl, plan.m, plan.a, plan.epilogue
    at, _, _ = plan.matrices
    th, tw = plan.tiles
    shapes = plan.shapes()
    zero = tirx.const(0.0, "float32")
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name(symbol)
        T.func_attr({"global_symbol": symbol, "tirx.noalias": True})
        products = param_buffer("mm", shapes["mm"])
        bias = param_buffer("bias", shapes["bias"]) if ep.bias else None
        residual = param_buffer("residual", shapes["residual"]) if ep.residual else None
        y = param_buffer("y", shapes["y"])
        with T.sblock("root"), thread_per_element(wl.K * th * tw * wl.N) as index:
            k, ty, tx, n = to_coordinates(index, (wl.K, th, tw, wl.N))
            s = [[T.Bind(products[(xi * a + nu) * wl.K + k, ty, tx, n]) for nu in range(a)] for xi in range(a)]
            at_s = [[T.Bind(weighted_sum(at[i], [s[xi][nu] for xi in range(a)])) for nu in range(a)] for i in range(m)]
            for i in range(m):
                for j in range(m):
                    h, w = ty * m + i, tx * m + j
                    value = weighted_sum(at[j], at_s[i])
                    if bias is not None:
                        value = value + bias[k]
                    if residual is not None:
                        value = value + residual[k, h, w, n]
                    if ep.activation in ("relu", "relu6"):
                        value = tirx.max(value, zero)
                    if ep.activation == "relu6":
                        value = tirx.min(value, tirx.const(6.0, "float32"))
                    inside = ([h < wl.OH] if i >= wl.OH - (th - 1) * m else []) + (
                        [w < wl.OW] if j >= wl.OW - (tw - 1) * m else [])
                    if inside:
                        with T.If(functools.reduce(tirx.And, inside)), T.Then():
                            T.buffer_store(y, value, [k, h, w, n])
                    else:
                        T.buffer_store(y, value, [k, h, w, n])
    return builder.get().with_attr(KERNEL_ATTR, "winograd_output_transform")


def winograd_module(plan: WinogradPlan, symbol: str = KERNEL_NAME) -> tvm.IRModule:
    """The plan's three kernels, `<symbol>_input`, `<symbol>_gemm` and `<symbol>_output`."""
    return tvm.IRModule({
        "input": input_transform_func(plan, symbol + "_input"),
        "gemm": _maxdnn.maxdnn_conv2d_func(plan.gemm, symbol + "_gemm"),
        "output": output_transform_func(plan, symbol + "_output"),
    })


def cuda_source(plan: WinogradPlan, target="nvidia/nvidia-h100") -> str:
    """The CUDA C that TVM generates for the plan's kernels (no GPU needed)."""
    return generate_source(winograd_module(plan), resolve_target(target))


def kernel_arrays(plan: WinogradPlan, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None,
                  residual: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The kernels' tensors from NCHW/OIHW NumPy arrays (and an NCHW residual), by the names of
    :meth:`WinogradPlan.shapes`; v, mm and y start filled with NaN so that anything unwritten shows."""
    ep = plan.epilogue
    if (bias is not None) != ep.bias or (residual is not None) != ep.residual:
        raise ValueError(f"kernel_arrays: the plan's epilogue {ep} does not match the arrays given")
    arrays = {"x": _maxdnn.data_to_chwn(x.astype(np.float32, copy=False)), "w": transform_weight(plan, w)}
    if bias is not None:
        arrays["bias"] = np.ascontiguousarray(bias, dtype=np.float32)
    if residual is not None:
        arrays["residual"] = _maxdnn.data_to_chwn(residual.astype(np.float32, copy=False))
    for name, shape in plan.shapes().items():
        arrays.setdefault(name, np.full(shape, np.nan, np.float32))
        if arrays[name].shape != shape:
            raise ValueError(f"kernel_arrays: {name} has shape {arrays[name].shape}, the plan needs {shape}")
    return arrays


def run_on_gpu(plan: WinogradPlan, arrays: dict[str, np.ndarray], target="cuda") -> np.ndarray:
    """Run the three kernels on this machine's GPU (the CPU emulator's counterpart:
    :func:`tvm_ext.testing.maxdnn.emulate_winograd`); returns y."""
    from .toolchain import build_for_device

    executable = build_for_device(winograd_module(plan), resolve_target(target))
    device = tvm.cuda(0)
    tensors = {name: tvm.runtime.tensor(array, device) for name, array in arrays.items()}
    for stage, params in plan.stage_params().items():  # in the PrimFuncs' parameter order
        executable[f"{KERNEL_NAME}_{stage}"](*(tensors[name] for name in params.values()))
    return tensors["y"].numpy()


def cuda_param_order(plan: WinogradPlan, source: str, stage: str) -> list[str]:
    """The tensors of :meth:`WinogradPlan.shapes` behind each argument of kernel `stage`, in the
    CUDA function's order (TVM sorts them): whoever launches the CUDA C directly passes them so."""
    from .toolchain import kernel_params

    params = plan.stage_params()[stage]
    return [params[name.removesuffix("_ptr")] for _, name in kernel_params(source, f"{KERNEL_NAME}_{stage}_kernel")]
