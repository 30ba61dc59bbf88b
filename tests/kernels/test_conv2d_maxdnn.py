"""The maxDNN tile on the CPU: one description with CUDA's thread tile, the CPU generator's
limits and machine code, and the images-in-lanes convolution against a float64 reference on
random configurations (batch 1..130, awkward channel counts, several tiles)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tvm
from reference import conv2d_nchw, rel_err

from tvm_ext.asm import fma_blocks, inner_loop
from tvm_ext.intrin.cpu import register_tiles
from tvm_ext.intrin.cpu_outer import check_cpu_tile, get_cpu_outer_intrin
from tvm_ext.intrin.cuda import get_outer_product_intrin, thread_tile
from tvm_ext.intrin.outer_tile import OuterTile, outer_description
from tvm_ext.kernels import conv2d_maxdnn as M
from tvm_ext.kernels.conv2d import Conv2dWorkload
from tvm_ext.target import AVX2, AVX512, NEON, resolve_target, vector_isa

AVX2_TARGET = "llvm -mcpu=znver3"
AVX512_TARGET = "llvm -mcpu=skylake-avx512"
NEON_TARGET = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a72"}
TOL = 1e-5


def test_cuda_and_cpu_tiles_share_one_description():
    """The CUDA thread tile and the CPU tile are the same data and the same loop nest; only the
    scopes (shared/local on CUDA) and the implementations differ."""
    cuda, cpu = thread_tile(), OuterTile.contiguous(6, 64, 16, batch=(3, 3), dilation=(1, 2), init=True)
    assert type(cuda) is type(cpu) is OuterTile
    for tile, scopes, name in ((cuda, ("shared", "local"), get_outer_product_intrin(cuda)),
                               (cpu, ("global", "global"), get_cpu_outer_intrin(cpu, AVX512))):
        desc = tvm.s_tir.TensorIntrin.get(name).desc
        tvm.ir.assert_structural_equal(desc, outer_description(tile, *scopes))
    assert (cpu.span_a, cpu.span_b, cpu.fma_per_k(), cpu.b_batch) == (6, 64, 384, (3, 5))
    with pytest.raises(ValueError, match="no batch"):  # CUDA's thread tile reduces one k step
        get_outer_product_intrin(dataclasses.replace(thread_tile(), batch=(3,), dilation=(1,)))


def test_cpu_tile_is_refused_where_it_would_spill_or_misfit():
    check_cpu_tile(OuterTile.contiguous(6, 64, 8), AVX512)  # 24 + 4 + 1 registers
    with pytest.raises(ValueError, match="spill"):
        check_cpu_tile(OuterTile.contiguous(8, 64, 8), AVX512)  # 32 + 4 + 1
    check_cpu_tile(OuterTile.contiguous(6, 16, 8), AVX2)  # 12 + 2 + 1 of 16
    with pytest.raises(ValueError, match="spill"):
        check_cpu_tile(OuterTile.contiguous(6, 24, 8), AVX2)  # 18 + 3 + 1
    with pytest.raises(ValueError, match="lanes"):
        check_cpu_tile(OuterTile.contiguous(4, 20, 8), AVX512)
    with pytest.raises(ValueError, match="contiguous"):
        check_cpu_tile(thread_tile(), AVX512)
    assert all(r * (c // 16) + c // 16 + 1 <= 31 for r, c in register_tiles(AVX512, spare=1))


def _random_config(rng: np.random.Generator) -> dict:
    filt = [(1, 1), (3, 3), (5, 5), (1, 3), (3, 1), (2, 2), (1, 7)]
    R, S = filt[rng.integers(len(filt))]
    stride = (int(rng.choice([1, 1, 2, 3])), int(rng.choice([1, 1, 2])))
    dilation = (1, 1) if rng.random() < 0.75 else (int(rng.choice([1, 2])), int(rng.choice([2, 3])))
    kind = rng.random()
    if kind < 0.1:
        C = int(rng.choice([4, 8, 16]))
        groups, K = C, C * int(rng.choice([1, 2]))
    elif kind < 0.25:
        groups = int(rng.choice([2, 3]))
        C, K = groups * int(rng.choice([1, 5, 8])), groups * int(rng.choice([3, 8, 16]))
    else:
        groups = 1
        C = int(rng.choice([1, 3, 7, 16, 17, 32, 64, 96]))
        K = int(rng.choice([1, 5, 16, 24, 30, 64, 100]))
    padding = tuple(int(v) for v in rng.integers(0, 3, size=4)) if rng.random() < 0.6 else 0
    N = int(rng.choice([1, 2, 5, 8, 16, 17, 31, 33, 64, 100, 128, 130]))
    H = int(rng.integers((R - 1) * dilation[0] + 1, (R - 1) * dilation[0] + 7))
    W = int(rng.integers((S - 1) * dilation[1] + 1, (S - 1) * dilation[1] + 7))
    return dict(N=N, C=C, H=H, W=W, K=K, R=R, S=S, stride=stride, padding=padding, dilation=dilation, groups=groups)


def _plan(rng: np.random.Generator, cfg: dict, isa) -> M.MaxDNNCpuPlan:
    """The analytic plan, or (one in three) a random tile, chunk of channels and task tile."""
    wl = Conv2dWorkload.make((cfg["N"], cfg["C"], cfg["H"], cfg["W"]),
                             (cfg["K"], cfg["C"] // cfg["groups"], cfg["R"], cfg["S"]),
                             cfg["stride"], cfg["padding"], cfg["dilation"], cfg["groups"])
    if rng.random() < 2 / 3:
        return M.MaxDNNCpuPlan.make(wl, isa)
    tiles = [(r, c) for r, c in register_tiles(isa, spare=1) if r <= 2 * wl.K and c <= 2 * wl.N + isa.lanes]
    rows, cols = tiles[rng.integers(len(tiles))]
    channels = wl.C // wl.groups
    k_step = int(rng.choice([d for d in range(1, channels + 1) if channels % d == 0]))
    plan = M.MaxDNNCpuPlan.make(wl, isa, rows=rows, cols=cols, k_step=k_step)
    return M.MaxDNNCpuPlan.make(wl, isa, rows=rows, cols=cols, k_step=k_step, macro_rows=rows,
                                macro_cols=plan.images if rng.random() < 0.5 else cols)


def _configs(count: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < count:
        cfg = _random_config(rng)
        try:
            Conv2dWorkload.make((1, cfg["C"], cfg["H"], cfg["W"]), (cfg["K"], cfg["C"] // cfg["groups"], cfg["R"],
                                cfg["S"]), cfg["stride"], cfg["padding"], cfg["dilation"], cfg["groups"])
        except ValueError:
            continue
        out.append(cfg)
    return out


RANDOM = _configs(216, seed=20261206)
CHUNK = 24  # configurations compiled as one module (one LLVM run)


def _run_chunk(cases: list[tuple[M.MaxDNNCpuPlan, M.Epilogue]], target, seed: int) -> None:
    funcs = {f"conv{i}": M.maxdnn_conv2d_kernel(plan, epilogue).with_attr("global_symbol", f"conv{i}")
             for i, (plan, epilogue) in enumerate(cases)}
    lib = tvm.compile(tvm.IRModule(funcs), target)
    rng = np.random.default_rng(seed)
    failures = []
    for i, (plan, epilogue) in enumerate(cases):
        wl = plan.wl
        x = rng.standard_normal((wl.N, wl.C, wl.H, wl.W)).astype(np.float32)
        w = rng.standard_normal((wl.K, wl.C // wl.groups, wl.KH, wl.KW)).astype(np.float32)
        b = rng.standard_normal(wl.K).astype(np.float32)
        args = [M.pack_data(plan, x), M.pack_weight(plan, w)]
        if epilogue.bias:
            args.append(M.pack_bias(plan, b))
        y = tvm.runtime.tensor(np.full(plan.out_shape(), np.nan, np.float32))  # every element written
        lib[f"conv{i}"](*(tvm.runtime.tensor(a) for a in args), y)
        out = M.unpack_output(plan, y.numpy())
        ref = conv2d_nchw(x, w, b if epilogue.bias else None, wl.stride, wl.padding, wl.dilation, wl.groups)
        if epilogue.activation == "relu":
            ref = np.maximum(ref, 0)
        err = rel_err(out, ref)
        if not err <= TOL:
            failures.append(f"{plan} {epilogue}: relative error {err:.2e}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("chunk", range(len(RANDOM) // CHUNK))
def test_random_configurations_against_float64(chunk):
    target = resolve_target("llvm")
    isa = vector_isa(target)
    rng = np.random.default_rng(chunk)
    cases = []
    for cfg in RANDOM[chunk * CHUNK:(chunk + 1) * CHUNK]:
        epilogue = M.Epilogue(bias=bool(rng.random() < 0.7), activation="relu" if rng.random() < 0.4 else None)
        cases.append((_plan(rng, cfg, isa), epilogue))
    _run_chunk(cases, target, seed=100 + chunk)


def test_random_space_is_covered():
    """The draw covers batches that are not whole vectors, groups, depthwise, strides, dilation,
    asymmetric padding and output channels that are not whole tiles."""
    rng = np.random.default_rng(0)
    plans = [_plan(rng, cfg, AVX512) for cfg in RANDOM]
    assert len(RANDOM) >= 200
    assert sum(p.wl.N % 16 != 0 for p in plans) >= 50 and max(p.wl.N for p in plans) == 130
    assert sum(p.wl.groups > 1 for p in plans) >= 15 and any(p.wl.groups == p.wl.C for p in plans)
    assert sum(p.wl.stride != (1, 1) for p in plans) >= 40 and sum(p.wl.dilation != (1, 1) for p in plans) >= 20
    assert sum(p.wl.padding[:2] != p.wl.padding[2:] for p in plans) >= 40
    assert sum(p.outputs != p.wl.K // p.wl.groups for p in plans) >= 40
    assert sum(p.steps > 1 for p in plans) >= 30 and sum(p.steps == 1 for p in plans) >= 30  # accumulate, init
    assert sum(p.macro_cols > p.cols for p in plans) >= 20


def test_avx2_kernels_are_right():
    """The 8-lane tiles (AVX2 registers: 16), run on this host."""
    rng = np.random.default_rng(5)
    cases = [(_plan(rng, cfg, AVX2), M.Epilogue(bias=True)) for cfg in RANDOM[:12]]
    _run_chunk(cases, resolve_target(AVX2_TARGET), seed=5)


@pytest.mark.parametrize("activation", ["relu6", "sigmoid", "silu", "gelu"])
def test_epilogue_activations(activation):
    target = resolve_target("llvm")
    wl = Conv2dWorkload.make((19, 12, 6, 5), (20, 12, 3, 3), 1, 1)
    plan = M.MaxDNNCpuPlan.make(wl, vector_isa(target))
    lib = tvm.compile(tvm.IRModule({"conv": M.maxdnn_conv2d_kernel(plan, M.Epilogue(True, activation))}), target)
    rng = np.random.default_rng(1)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((19, 12, 6, 5), (20, 12, 3, 3), (20,)))
    y = tvm.runtime.empty(plan.out_shape(), "float32", tvm.cpu())
    lib["conv"](*(tvm.runtime.tensor(a) for a in (M.pack_data(plan, x), M.pack_weight(plan, w),
                                                  M.pack_bias(plan, b))), y)
    torch = pytest.importorskip("torch")
    z = torch.nn.functional.conv2d(torch.tensor(x, dtype=torch.float64), torch.tensor(w, dtype=torch.float64),
                                   torch.tensor(b, dtype=torch.float64), padding=1)
    ref = {"relu6": torch.nn.functional.relu6, "sigmoid": torch.sigmoid, "silu": torch.nn.functional.silu,
           "gelu": torch.nn.functional.gelu}[activation](z).numpy()
    assert rel_err(M.unpack_output(plan, y.numpy()), ref) <= 1e-5


@pytest.mark.parametrize("target, isa, shape", [
    (AVX512_TARGET, AVX512, ((128, 64, 13, 13), (96, 64, 3, 3))),
    (AVX2_TARGET, AVX2, ((64, 64, 13, 13), (96, 64, 3, 3))),
    (NEON_TARGET, NEON, ((32, 64, 13, 13), (96, 64, 3, 3))),
])
@pytest.mark.parametrize("k_step", [None, 16])  # every channel in one call (init), or chunks (accumulate)
def test_inner_loop_is_fma_with_broadcast_operands_and_no_spills(target, isa, shape, k_step):
    target = resolve_target(target)
    plan = M.MaxDNNCpuPlan.make(Conv2dWorkload.make(*shape, 1, 1), isa, k_step=k_step)
    func = M.maxdnn_conv2d_kernel(plan, M.Epilogue(bias=True, activation="relu"))
    asm = tvm.compile(tvm.IRModule({"conv": func}), target).mod.inspect_source("asm")
    loop = inner_loop(asm, isa)
    step = plan.rows * plan.cols // isa.lanes  # FMAs of one k step of the tile
    assert loop.fma % step == 0 and loop.fma >= step
    assert all(b.fma_on_isa_registers == b.fma and not b.spills for b in fma_blocks(asm, isa))
    if isa is AVX512:  # the weights' broadcasts folded into the FMAs, or one vbroadcastss each
        broadcasts = sum("{1to16}" in ln or ln.startswith("vbroadcastss") for ln in loop.lines)
        assert broadcasts == plan.rows * loop.fma // step


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(rows=7, cols=20), "cols=20"),
    (dict(k_step=5), "k_step=5"),
    (dict(macro_rows=9, rows=6, cols=16), "macro_rows=9"),
    (dict(macro_cols=48, cols=32), "macro_cols=48"),
    (dict(rows=15, cols=32), "spill"),
    (dict(rows=0, cols=16), "rows must be a positive integer"),
    (dict(k_step=0), "k_step must be"),
    (dict(macro_rows=0), "macro_rows must be"),
    (dict(threads=-1), "threads must be"),
])
def test_bad_plans_are_refused(kwargs, message):
    wl = Conv2dWorkload.make((20, 16, 8, 8), (24, 16, 3, 3), 1, 1)
    with pytest.raises(ValueError, match=message):
        M.MaxDNNCpuPlan.make(wl, AVX512, **kwargs)


def test_fma_efficiency_counts_the_tile_and_its_padding():
    """What a cost model reads: the k loop's share of FMA slots times the work that is not padding."""
    full = M.MaxDNNCpuPlan.make(Conv2dWorkload.make((128, 64, 8, 8), (96, 64, 3, 3), 1, 1), AVX512, rows=12, cols=32)
    assert full.fma_efficiency() == pytest.approx(1.0)  # 24 FMAs to 14 loads a k step, no padding
    padded = M.MaxDNNCpuPlan.make(Conv2dWorkload.make((17, 64, 8, 8), (90, 64, 3, 3), 1, 1), AVX512, rows=12, cols=32)
    assert padded.fma_efficiency() == pytest.approx(17 / 32 * 90 / 96)
    narrow = M.MaxDNNCpuPlan.make(Conv2dWorkload.make((16, 64, 8, 8), (29, 64, 3, 3), 1, 1), AVX512, rows=29, cols=16)
    assert narrow.fma_efficiency() == pytest.approx(14.5 / 15)  # 29 broadcasts + 1 load for 29 FMAs
