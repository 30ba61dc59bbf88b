"""Per-layer convolution benchmark: tvm_ext against PyTorch/oneDNN and stock TVM, same run.

For each layer of a set in ../shared/workloads.json (or bench/workloads.json) it times
- tvm_ext's blocked kernel (NCHW[x]c in, NCHW[y]c out: what runs inside a compiled graph),
- tvm_ext.ops.conv2d (NCHW NumPy in and out, warm cache: packing included),
- tvm_ext.ops.Conv2d (the same with its weights packed once, as for inference),
- torch.nn.functional.conv2d in NCHW and in channels_last (oneDNN), no gradients,
- stock TVM: a Relax conv2d through `tvm.compile` with the default pipeline (fewer repeats: it is
  about 1.5 GFLOP/s),
and prints ms (median), GFLOP/s, % of the measured peak (bench/peak.py), the ratios and the extra
bytes tvm_ext's layout needs (the input's zero border, zero output channels). A CSV goes to
bench/results/. Benchmarks print; they never assert.

With `--dtype bf16`: tvm_ext's bfloat16 blocked kernel (dense layers) on each engine the CPU has
(AMX tiles; AVX512-BF16 vectors), its fp32 kernel and PyTorch's bf16 convolution in channels_last
(oneDNN: AMX where the CPU has it).

With `--dtype int8`: tvm_ext's int8 blocked kernel (uint8 data, int8 weights, int32 sums, bias,
relu and the uint8 requantization fused: what a quantized graph runs) on each engine the CPU has
(AMX tiles; VNNI vectors), its fp32 kernel and PyTorch's quantized convolution (quint8 x qint8
per-channel, channels_last) on its "onednn" (AMX where the CPU has it) and "x86" engines.

With `--engine maxdnn|brgemm|all|auto`: each layer (fp32) on the maxDNN tile (images in the
vector lanes, tvm_ext.kernels.conv2d_maxdnn) and/or the BRGEMM kernel, against oneDNN
(PyTorch channels_last), alternated call by call in one process: median ms, % of the FMA peak,
ratio to oneDNN. The tile's kernel is timed alone and with the two layout passes a graph adds
around it (tvm_ext.kernels.maxdnn_layout: from and to the blocked kernel's blocks). `all` and
`auto` time both engines and name the one `maxdnn="auto"` chooses (the cost model of
tvm_ext.strategy.cpu_engine) with its time over the faster engine's (tile with passes or BRGEMM).

Usage: python bench/layers.py --set resnet50 --batch 1 --threads 1 [--layers K] [--repeat R] [--dtype bf16|int8]
       python bench/layers.py --set alexnet --batch 128 --engine auto
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETS = ("resnet50", "vgg16", "alexnet", "overfeat", "mobilenet_v2")


def _parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", default="resnet50", choices=SETS)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=0, help="only the first K layers (0: all)")
    ap.add_argument("--repeat", type=int, default=15, help="timed repeats per measurement (median)")
    ap.add_argument("--no-stock", action="store_true", help="skip stock TVM (slow on big layers)")
    ap.add_argument("--target", default="llvm")
    ap.add_argument("--csv", default="")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "int8"])
    ap.add_argument("--engine", default="", choices=["", "maxdnn", "brgemm", "all", "auto"],
                    help="compare the fp32 engines: the maxDNN tile (images in the vector lanes), "
                         "the BRGEMM kernel, oneDNN (all, auto: every one of them, and maxdnn='auto''s choice)")
    return ap.parse_args(argv)


ARGS = _parse_args()
# TVM's thread pool and PyTorch read their thread count once: set it before importing them.
os.environ["TVM_NUM_THREADS"] = str(ARGS.threads)
os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)
# Engines alternated call by call share the cores: a pool whose threads spin after a call (PyTorch's
# OpenMP, TVM's) takes a core from the next engine's. With 2 threads, BRGEMM timed right after
# oneDNN read 37-68% of the peak against 96-101% alone. Idle threads sleep instead.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import tvm  # noqa: E402
from tvm import relax  # noqa: E402

import tvm_ext  # noqa: E402
from tvm_ext.kernels import conv2d as K  # noqa: E402
from tvm_ext.kernels import conv2d_maxdnn as MX  # noqa: E402
from tvm_ext.kernels import maxdnn_layout as ML  # noqa: E402
from tvm_ext.strategy.cpu_engine import maxdnn_decision, tile_out_block  # noqa: E402

sys.path.insert(0, str(HERE))
import peak as peak_bench  # noqa: E402

torch.set_num_threads(ARGS.threads)


def load_layers(name: str) -> list[dict]:
    for path in (HERE / "workloads.json", HERE.parent.parent / "shared" / "workloads.json"):
        if path.exists():
            return json.loads(path.read_text())[name]
    raise FileNotFoundError("workloads.json not found in bench/ or ../shared/")


def _median_ms(fn, repeat: int, min_ms: float = 20.0) -> float:
    """Median over `repeat` timings of a batch of calls sized to last at least `min_ms`."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-6)
    number = max(1, int(min_ms / 1e3 / once))
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - start) / number)
    return statistics.median(times) * 1e3


def bench_blocked(plan: K.Conv2dPlan, target, repeat: int, lanes: int | None = None) -> float:
    return _median_ms(blocked_call(plan, target, lanes), repeat)


def maxdnn_call(plan: MX.MaxDNNCpuPlan, target):
    """The maxDNN tile's kernel alone (its layouts in and out: what would run inside a graph)."""
    lib = tvm.compile(tvm.IRModule({"conv": MX.maxdnn_conv2d_kernel(plan, MX.Epilogue())}), target)
    rng = np.random.default_rng(0)
    args = [tvm.runtime.tensor(rng.standard_normal(s).astype(np.float32))
            for s in (plan.data_shape(), plan.weight_shape(), plan.out_shape())]
    fn = lib["conv"]
    return lambda: fn(*args)


def tile_passes_call(plan: MX.MaxDNNCpuPlan, blocked: K.Conv2dPlan, target):
    """The two layout passes a graph adds around the tile: from the blocked kernel's input blocks
    and back to its output blocks (bias and ReLU applied on the way, as a ResNet layer's)."""
    out_block = tile_out_block(blocked)
    wl = plan.wl
    source = (wl.N, -(-wl.C // blocked.in_bn), wl.H, wl.W, blocked.in_bn)
    epilogue = MX.Epilogue(bias=True, activation="relu")
    mod = tvm.IRModule({"into": ML.tile_input_func(plan, source, blocked.in_bn).with_attr("global_symbol", "into"),
                        "back": ML.tile_output_func(plan, out_block, epilogue).with_attr("global_symbol", "back")})
    lib = tvm.compile(mod, target)
    rng = np.random.default_rng(0)
    shapes = (source, plan.data_shape(), plan.out_shape(), (wl.K,), (wl.N, wl.K // out_block, wl.OH, wl.OW, out_block))
    src, x, t, b, y = (tvm.runtime.tensor(rng.standard_normal(s).astype(np.float32)) for s in shapes)
    into, back = lib["into"], lib["back"]
    return lambda: (into(src, x), back(t, b, y))


def blocked_call(plan: K.Conv2dPlan, target, lanes: int | None = None):
    """The BRGEMM kernel alone (NCHW[x]c in, NCHW[y]c out); an int8 one as a quantized graph runs
    it: bias, relu and the uint8 output fused."""
    wl = plan.wl
    epilogue = K.Epilogue(bias=True, activation="relu", out_dtype="uint8") if wl.dtype == "int8" else K.Epilogue()
    lib = tvm.compile(K.conv2d_blocked_kernel(plan, lanes or tvm_ext.vector_isa(target).lanes, epilogue), target)
    rng = np.random.default_rng(0)
    numpy_type = {"bfloat16": ml_dtypes.bfloat16}.get
    args = [tvm.runtime.tensor(rng.standard_normal(s).astype(numpy_type(wl.dtype, np.float32)))
            for s in (plan.data_shape(), plan.weight_shape())]
    if wl.dtype == "int8":
        args = [tvm.runtime.tensor(rng.integers(0, 256, plan.data_shape()).astype(np.uint8)),
                tvm.runtime.tensor(rng.integers(-128, 128, plan.weight_shape()).astype(np.int8)),
                tvm.runtime.tensor(rng.integers(-1000, 1000, (plan.OCB, plan.oc_bn)).astype(np.int32)),
                tvm.runtime.tensor(np.full((plan.OCB, plan.oc_bn), 1e-4, np.float32))]
    args.append(tvm.runtime.empty(epilogue.out_shape(plan), epilogue.out_dtype, tvm.cpu()))
    fn = lib.mod["main"]
    return lambda: fn(*args)


def torch_call(wl: K.Conv2dWorkload, channels_last: bool = True, dtype=None):
    """PyTorch's convolution (oneDNN), NCHW or channels_last (an asymmetric padding applied to
    the input beforehand)."""
    x = torch.randn(wl.N, wl.C, wl.H, wl.W, dtype=dtype)
    w = torch.randn(wl.K, wl.C // wl.groups, wl.KH, wl.KW, dtype=dtype)
    top, left, bottom, right = wl.padding
    if (top, left) != (bottom, right):
        x, pad = torch.nn.functional.pad(x, (left, right, top, bottom)), 0
    else:
        pad = (top, left)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
        w = w.contiguous(memory_format=torch.channels_last)

    # (no tensor requires a gradient: autograd records nothing, as in inference mode, whose
    # context would cost each call a microsecond)
    return lambda: torch.nn.functional.conv2d(x, w, None, wl.stride, pad, wl.dilation, wl.groups)


def alternated_ms(calls: dict, rounds: int) -> dict[str, float]:
    """Median ms of each call, timed in turn round after round (the machine's state moves: side by
    side in one process is the comparison that holds)."""
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def bench_stock_tvm(wl: K.Conv2dWorkload, target, repeat: int) -> float:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((wl.N, wl.C, wl.H, wl.W), "float32"))
    w = relax.Var("w", relax.TensorType((wl.K, wl.C // wl.groups, wl.KH, wl.KW), "float32"))
    with bb.function("main", [x, w]):
        y = bb.emit(relax.op.nn.conv2d(x, w, wl.stride, wl.padding, wl.dilation, wl.groups))
        bb.emit_func_output(y)
    ex = tvm.compile(bb.get(), target)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(0)
    xs = tvm.runtime.tensor(rng.standard_normal((wl.N, wl.C, wl.H, wl.W), dtype=np.float32))
    ws = tvm.runtime.tensor(rng.standard_normal((wl.K, wl.C // wl.groups, wl.KH, wl.KW), dtype=np.float32))
    return _median_ms(lambda: vm["main"](xs, ws), repeat, min_ms=0.0)


def bench_torch(wl: K.Conv2dWorkload, channels_last: bool, repeat: int, dtype=None) -> float:
    return _median_ms(torch_call(wl, channels_last, dtype), repeat)


def bench_ops(wl: K.Conv2dWorkload, target, repeat: int) -> float:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((wl.N, wl.C, wl.H, wl.W), dtype=np.float32)
    w = rng.standard_normal((wl.K, wl.C // wl.groups, wl.KH, wl.KW), dtype=np.float32)
    return _median_ms(lambda: tvm_ext.ops.conv2d(x, w, stride=wl.stride, padding=wl.padding,
                                                 dilation=wl.dilation, groups=wl.groups, target=target), repeat)


def bench_prepacked(wl: K.Conv2dWorkload, target, repeat: int) -> float:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((wl.N, wl.C, wl.H, wl.W), dtype=np.float32)
    conv = tvm_ext.ops.Conv2d(rng.standard_normal((wl.K, wl.C // wl.groups, wl.KH, wl.KW), dtype=np.float32),
                              stride=wl.stride, padding=wl.padding, dilation=wl.dilation, groups=wl.groups,
                              target=target)
    return _median_ms(lambda: conv(x), repeat)


def bench_torch_int8(wl: K.Conv2dWorkload, repeat: int, engine: str) -> float:
    """PyTorch's quantized convolution (quint8 data, qint8 weights per output channel, bias, relu
    fused, quint8 out; channels_last) on quantized `engine` ("onednn", "x86")."""
    import torch.ao.nn.intrinsic.quantized as nniq

    torch.backends.quantized.engine = engine
    top, left, bottom, right = wl.padding
    x = torch.rand(wl.N, wl.C, wl.H, wl.W)
    if (top, left) != (bottom, right):
        x, pad = torch.nn.functional.pad(x, (left, right, top, bottom)), 0
    else:
        pad = (top, left)
    conv = nniq.ConvReLU2d(wl.C, wl.K, (wl.KH, wl.KW), wl.stride, pad, wl.dilation, wl.groups)
    weight = torch.quantize_per_channel(torch.randn(wl.K, wl.C // wl.groups, wl.KH, wl.KW),
                                        torch.rand(wl.K) * 0.01 + 1e-3, torch.zeros(wl.K, dtype=torch.long), 0,
                                        torch.qint8)
    conv.set_weight_bias(weight, torch.randn(wl.K))
    conv.scale, conv.zero_point = 0.05, 0
    xq = torch.quantize_per_tensor(x, 1 / 255, 0, torch.quint8).contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        return _median_ms(lambda: conv(xq), repeat)


def layer_workload(layer: dict, dtype: str = "float32") -> K.Conv2dWorkload:
    """Layer `layer` of a set, at --batch, as a convolution of `dtype`."""
    return K.Conv2dWorkload.make((ARGS.batch, layer["C"], layer["H"], layer["W"]),
                                 (layer["K"], layer["C"] // layer.get("groups", 1), layer["R"], layer["S"]),
                                 layer["stride"], layer["pad"], 1, layer.get("groups", 1), dtype=dtype)


def _median_peak(rows: list[list[str]], column: int) -> str:
    """The median of a %peak column ("n/a" where the peak was not measured)."""
    values = [float(r[column]) for r in rows if r[column] != "nan"]
    return f"{statistics.median(values):.0f}%" if values else "n/a"


def geomean(values: list[float]) -> float:
    values = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def dot_peak(peak: dict, dot: str) -> float:
    """bench/peak.py's measured peak of `dot` (GOP/s or GFLOP/s) for ARGS.threads threads; NaN
    where it was not measured (a CPU without the instruction)."""
    values = peak.get("dot_peaks", {}).get(dot)
    if not values:
        return float("nan")
    if ARGS.threads > 1 and "all" in values and int(peak.get("threads", 1)) >= ARGS.threads:
        return values["all"] * ARGS.threads / int(peak["threads"])
    return values["1thread"] * ARGS.threads


def main_bf16(target, layers: list[dict], peak: dict) -> int:
    """--dtype bf16: the bf16 kernel on each engine the CPU has (AMX tiles, AVX512-BF16 vectors)
    against our fp32 kernel and PyTorch's bf16, same run."""
    from tvm_ext.target import amx_permitted, has_amx_bf16, has_avx512_bf16

    isa = tvm_ext.vector_isa(target)
    engines = [e for e, has in (("amx", has_amx_bf16(target) and amx_permitted()), ("fma", has_avx512_bf16(target)))
               if has]
    peaks = [dot_peak(peak, {"amx": "bf16_amx", "fma": "bf16_dot512"}[e]) for e in engines]
    print(f"# tvm_ext bf16 layer benchmark: set={ARGS.set} batch={ARGS.batch} threads={ARGS.threads} "
          f"target={target} engines={engines} (amx: AMX tiles; fma: AVX512-BF16 vdpbf16ps); peaks "
          f"{', '.join(f'{e} {p:.0f}' for e, p in zip(engines, peaks, strict=True))} GFLOP/s (bench/peak.py)")
    header = ["layer", "shape", *[f"{e}_{col}" for e in engines for col in ("ms", "GFLOP/s", "%peak")], "fp32_ms",
              "torch_bf16_cl_ms", *[f"x_{e}_vs_fp32" for e in engines], *[f"x_{e}_vs_torch_bf16" for e in engines]]
    print(" | ".join(header))
    rows = []
    for layer in layers:
        wl = layer_workload(layer, "bfloat16")
        if not engines:  # (a kernel compiles only for a CPU with its instructions)
            print(f"{layer['name']} | skipped: no AVX512-BF16 or AMX on {target}")
            continue
        try:
            plans = [K.plan_conv2d(wl, isa, engine=engine) for engine in engines]
        except ValueError as err:
            print(f"{layer['name']} | skipped: {err}")
            continue
        times = [bench_blocked(plan, target, ARGS.repeat) for plan in plans]
        fp32 = bench_blocked(K.plan_conv2d(layer_workload(layer), isa), target, ARGS.repeat)
        t_torch = bench_torch(wl, True, ARGS.repeat, torch.bfloat16)
        row = [layer["name"], f"{wl.C}x{wl.H}x{wl.W}->{wl.K} {wl.KH}x{wl.KW}/s{wl.stride[0]}",
               *[v for ms, p in zip(times, peaks, strict=True)
                 for v in (f"{ms:.3f}", f"{wl.flops / ms / 1e6:.1f}", f"{100 * wl.flops / ms / 1e6 / p:.0f}")],
               f"{fp32:.3f}",
               f"{t_torch:.3f}", *[f"{fp32 / ms:.2f}" for ms in times], *[f"{t_torch / ms:.2f}" for ms in times]]
        rows.append(row)
        print(" | ".join(row), flush=True)
    if rows:
        ratios = len(header) - 2 * len(engines)
        summary = [f"{engine} {geomean([float(r[ratios + i]) for r in rows]):.2f}x our fp32, "
                   f"{geomean([float(r[ratios + len(engines) + i]) for r in rows]):.2f}x PyTorch bf16, "
                   f"median {_median_peak(rows, 4 + 3 * i)} of its peak" for i, engine in enumerate(engines)]
        print("# geomean: " + "; ".join(summary))
    return 0


def main_int8(target, layers: list[dict], peak: dict) -> int:
    """--dtype int8: the int8 kernel on each engine the CPU has (AMX tiles, VNNI vectors) against
    our fp32 kernel and PyTorch's quantized convolution on its oneDNN and x86 engines, same run."""
    from tvm_ext.target import amx_permitted, has_amx_int8, has_vnni

    isa = tvm_ext.vector_isa(target)
    engines = [e for e, has in (("amx", has_amx_int8(target) and amx_permitted()), ("vnni", has_vnni(target, 16)))
               if has]
    torch_engines = [e for e in ("onednn", "x86") if e in torch.backends.quantized.supported_engines]
    peaks = [dot_peak(peak, {"amx": "int8_amx", "vnni": "int8_vnni512"}[e]) for e in engines]
    print(f"# tvm_ext int8 layer benchmark: set={ARGS.set} batch={ARGS.batch} threads={ARGS.threads} "
          f"target={target} engines={engines} (amx: AMX tiles; vnni: AVX512-VNNI vpdpbusd); GOP/s count a "
          f"multiply-add as 2; peaks {', '.join(f'{e} {p:.0f}' for e, p in zip(engines, peaks, strict=True))} "
          "GOP/s (bench/peak.py)")
    header = ["layer", "shape", *[f"{e}_{col}" for e in engines for col in ("ms", "GOP/s", "%peak")], "fp32_ms",
              *[f"torch_{e}_ms" for e in torch_engines], *[f"x_{e}_vs_fp32" for e in engines],
              *[f"x_{e}_vs_torch_{t}" for e in engines for t in torch_engines]]
    print(" | ".join(header))
    rows = []
    for layer in layers:
        wl = layer_workload(layer, "int8")
        if not engines:  # (a kernel compiles only for a CPU with its instructions)
            print(f"{layer['name']} | skipped: no VNNI or AMX-INT8 on {target}")
            continue
        try:
            plans = [K.plan_conv2d(wl, K.AVX512, engine="amx" if e == "amx" else "fma") for e in engines]
        except ValueError as err:
            print(f"{layer['name']} | skipped: {err}")
            continue
        times = [bench_blocked(plan, target, ARGS.repeat, lanes=16) for plan in plans]
        fp32 = bench_blocked(K.plan_conv2d(layer_workload(layer), isa), target, ARGS.repeat)
        t_torch = [bench_torch_int8(wl, ARGS.repeat, e) for e in torch_engines]
        row = [layer["name"], f"{wl.C}x{wl.H}x{wl.W}->{wl.K} {wl.KH}x{wl.KW}/s{wl.stride[0]}",
               *[v for ms, p in zip(times, peaks, strict=True)
                 for v in (f"{ms:.3f}", f"{wl.flops / ms / 1e6:.1f}", f"{100 * wl.flops / ms / 1e6 / p:.0f}")],
               f"{fp32:.3f}",
               *[f"{t:.3f}" for t in t_torch], *[f"{fp32 / ms:.2f}" for ms in times],
               *[f"{t / ms:.2f}" for ms in times for t in t_torch]]
        rows.append(row)
        print(" | ".join(row), flush=True)
    if rows:
        first = len(header) - len(engines) * (1 + len(torch_engines))
        columns = list(zip(*[[float(v) for v in r[first:]] for r in rows], strict=True))
        names = header[first:]
        means = [f"{name} {geomean(list(c)):.2f}" for name, c in zip(names, columns, strict=True)]
        print("# geomean: " + ", ".join(means) + "; median %peak: "
              + ", ".join(f"{e} {_median_peak(rows, 4 + 3 * i)}" for i, e in enumerate(engines)))
    return 0


def main_engines(target, isa, layers: list[dict], peak_gflops: float) -> int:
    """--engine: each layer on the maxDNN tile (its kernel, and with the two layout passes a graph
    adds) and the BRGEMM kernel, against oneDNN (PyTorch channels_last), alternated call by call
    for --repeat rounds: median ms, % of the FMA peak, ratio to oneDNN; and the engine
    maxdnn="auto" chooses, with its time over the faster engine's."""
    both = ARGS.engine in ("all", "auto")
    names = [name for name in ("maxdnn", "brgemm") if both or ARGS.engine == name]
    print(f"# tvm_ext engines: set={ARGS.set} batch={ARGS.batch} threads={ARGS.threads} target={target} "
          f"isa={isa.name} peak={peak_gflops:.1f} GFLOP/s (bench/peak.py); ms (%peak, x oneDNN); maxdnn: "
          "kernel + layout passes = total")
    header = ["layer", "shape", *names, "onednn", *(["auto"] if both else []), "tiles"]
    print(" | ".join(header))
    ratios: dict[str, list[float]] = {name: [] for name in [*names, "auto"]}
    pcts: dict[str, list[float]] = {name: [] for name in names}
    rows, over_best = [], []
    for layer in layers:
        wl = layer_workload(layer)
        blocked = K.plan_conv2d(wl, isa)
        calls, tiles = {"onednn": torch_call(wl)}, []
        if "brgemm" in names:
            calls["brgemm"] = blocked_call(blocked, target)
            tiles.append(f"{blocked.m_r}x{blocked.oc_bn}")
        if "maxdnn" in names:
            mplan = maxdnn_decision(wl, isa, blocked, None, True, "always")[0] or MX.MaxDNNCpuPlan.make(wl, isa)
            calls["maxdnn"] = maxdnn_call(mplan, target)
            calls["passes"] = tile_passes_call(mplan, blocked, target)
            tiles.append(f"{mplan.rows}x{mplan.cols}/k{mplan.k_step}/m{mplan.macro_rows}x{mplan.macro_cols}")
        times = alternated_ms(calls, max(3, ARGS.repeat))
        if "maxdnn" in names:
            times["maxdnn_total"] = times["maxdnn"] + times["passes"]
        t_dnn = times["onednn"]
        cells = []
        for name in names:
            ms = times["maxdnn_total" if name == "maxdnn" else name]
            pct = 100 * wl.flops / times[name] / 1e6 / peak_gflops  # (the kernel's, without the passes)
            ratios[name].append(t_dnn / ms)
            pcts[name].append(pct)
            passes = f"{times['maxdnn']:.2f} + {times['passes']:.2f} = " if name == "maxdnn" else ""
            cells.append(f"{passes}{ms:.2f} ({pct:.0f}%, {t_dnn / ms:.2f}x)")
        dnn_pct = 100 * wl.flops / t_dnn / 1e6 / peak_gflops
        auto = []
        if both:
            chosen = "maxdnn_total" if maxdnn_decision(wl, isa, blocked, None, True, "auto")[0] else "brgemm"
            best = min(times["maxdnn_total"], times["brgemm"])
            over_best.append(times[chosen] / best)
            ratios["auto"].append(t_dnn / times[chosen])
            auto = [f"{chosen.split('_')[0]} {times[chosen] / best:.2f}x best"]
        row = [layer["name"], f"{wl.C}x{wl.H}x{wl.W}->{wl.K} {wl.KH}x{wl.KW}/s{wl.stride[0]}", *cells,
               f"{t_dnn:.2f} ({dnn_pct:.0f}%)", *auto, " ".join(tiles)]
        rows.append(row)
        print(" | ".join(row), flush=True)
    for name in names:
        passes = " (with its layout passes)" if name == "maxdnn" else ""
        print(f"# {name}: kernel median {statistics.median(pcts[name]):.0f}% of peak, min {min(pcts[name]):.0f}%; "
              f"geomean {geomean(ratios[name]):.2f}x oneDNN{passes}")
    if both:
        print(f"# auto: geomean {geomean(ratios['auto']):.2f}x oneDNN; at most {max(over_best):.2f}x the faster "
              f"engine's time ({sum(r > 1.03 for r in over_best)} layers over 1.03x)")
    out = Path(ARGS.csv) if ARGS.csv else HERE / "results" / f"engines_{ARGS.set}_b{ARGS.batch}_t{ARGS.threads}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    return 0


def main() -> int:
    target = tvm_ext.resolve_target(ARGS.target)
    isa = tvm_ext.vector_isa(target)
    peak = peak_bench.load_or_measure()
    peak_gflops = peak["peak_gflops_1thread"] * min(ARGS.threads, int(peak.get("threads", 1)))
    if ARGS.threads > 1 and int(peak.get("threads", 1)) >= ARGS.threads:
        peak_gflops = peak["peak_gflops_all"] * ARGS.threads / int(peak["threads"])
    layers = load_layers(ARGS.set)
    if ARGS.layers:
        layers = layers[: ARGS.layers]
    if ARGS.dtype == "bf16":
        return main_bf16(target, layers, peak)
    if ARGS.dtype == "int8":
        return main_int8(target, layers, peak)
    if ARGS.engine:
        return main_engines(target, isa, layers, peak_gflops)
    print(f"# tvm_ext layer benchmark: set={ARGS.set} batch={ARGS.batch} threads={ARGS.threads} "
          f"target={target} isa={isa.name} peak={peak_gflops:.1f} GFLOP/s (bench/peak.py)")
    header = ["layer", "shape", "kernel", "tile", "ms", "GFLOP/s", "%peak", "x_torch_nchw", "x_torch_cl",
              "x_stock_tvm", "ops_ms", "torch_nchw_ms", "x_ops_vs_torch_nchw", "Conv2d_ms",
              "x_Conv2d_vs_torch_nchw", "extra_bytes"]
    rows = []
    print(" | ".join(header))
    for layer in layers:
        wl = layer_workload(layer)
        plan = K.plan_conv2d(wl, isa)
        ms = bench_blocked(plan, target, ARGS.repeat)
        gflops = wl.flops / ms / 1e6
        t_nchw = bench_torch(wl, False, ARGS.repeat)
        t_cl = bench_torch(wl, True, ARGS.repeat)
        t_stock = float("nan") if ARGS.no_stock else bench_stock_tvm(wl, target, 3)
        t_ops = bench_ops(wl, target, ARGS.repeat)
        t_prepacked = bench_prepacked(wl, target, ARGS.repeat)
        row = [layer["name"], f"{wl.C}x{wl.H}x{wl.W}->{wl.K} {wl.KH}x{wl.KW}/s{wl.stride[0]}", plan.kind,
               f"{plan.m_r}x{plan.oc_bn}", f"{ms:.3f}", f"{gflops:.1f}", f"{100 * gflops / peak_gflops:.0f}",
               f"{t_nchw / ms:.2f}", f"{t_cl / ms:.2f}", f"{t_stock / ms:.0f}", f"{t_ops:.3f}", f"{t_nchw:.3f}",
               f"{t_nchw / t_ops:.2f}", f"{t_prepacked:.3f}", f"{t_nchw / t_prepacked:.2f}",
               str(plan.pad_bytes() + plan.channel_pad_bytes())]
        rows.append(row)
        print(" | ".join(row), flush=True)
    pct = [float(r[6]) for r in rows]
    stock = "" if ARGS.no_stock else f"vs stock TVM {geomean([float(r[9]) for r in rows]):.0f}x; "
    print(f"# median %peak {statistics.median(pct):.0f}, min %peak {min(pct):.0f}; geomean speed-up: "
          f"vs torch NCHW {geomean([float(r[7]) for r in rows]):.2f}x, "
          f"vs torch channels_last {geomean([float(r[8]) for r in rows]):.2f}x, {stock}"
          f"ops.conv2d vs torch NCHW {geomean([float(r[12]) for r in rows]):.2f}x, "
          f"ops.Conv2d (prepacked weights) vs torch NCHW {geomean([float(r[14]) for r in rows]):.2f}x")
    out = Path(ARGS.csv) if ARGS.csv else HERE / "results" / f"layers_{ARGS.set}_b{ARGS.batch}_t{ARGS.threads}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    print(f"# wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
