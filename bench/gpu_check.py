"""GPU check: tvm_ext's maxDNN convolution against cuDNN, on a machine with an NVIDIA GPU.

Reads the CUDA C that bench/gpu_export.py generated (manifest.json + one .cu per layer and
engine), compiles it with nvcc for this GPU, and for every kernel:
- checks the output against a float64 PyTorch convolution on the GPU: relative error < 1e-4 for
  the FFMA kernel; for a tensor-core kernel < 1e-5 (more on reductions over 1,342 terms: see
  `error_bound`) against the float64 convolution of the inputs as the tensor cores read them
  (tf32: low 13 mantissa bits dropped; bf16: rounded);
- times it (CUDA events, median) against cuDNN through PyTorch: the FFMA kernel against cuDNN fp32
  (TF32 off), the tf32 tensor-core kernels (mma.sync; wgmma, compiled for sm_90a on a Hopper GPU)
  against cuDNN with TF32 on, the bf16 ones (exported with `--engines ... mma_bf16 wgmma_bf16`)
  against cuDNN on bf16 tensors;
- prints GFLOP/s and, for FFMA, % of the fp32 FFMA peak it measures itself with an FFMA-chain kernel.
A training gradient's kernel (ResNet-50's layers by default: dX per stride phase, dW as x^T
convolved with dY^T, see gpu_export.py) is checked as the convolution it computes and timed
against cuDNN's own dgrad or wgrad of its layer; a second table sums each pass's kernels.
A layer exported with split-K (a grid too small to fill the GPU; "K/n" in the tile column) runs
its two kernels, the slices and their sum, and both are timed together. A Winograd entry (engine
"winograd", fp32 on the FFMA tile; "F(4x4)" in the tile column) runs and times its three kernels
(input transform, GEMMs, output transform) with its weights transformed beforehand, as a graph
does at build time; its GFLOP/s are effective ones (the direct convolution's FLOPs).

Needs numpy, torch (CUDA) and cupy (to load a cubin and launch it); not TVM. Layouts: the kernel
takes activations CHWN and weights CRSK (maxDNN's); the conversion from NCHW/OIHW is done once
per layer, outside the timing, as a graph does it once at its edges.

    python3 bench/gpu_check.py --kernels bench/gpu_kernels --repeat 30 --report $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent

FFMA_SOURCE = r"""
extern "C" __global__ void ffma_peak(float* __restrict__ out, int iters, float b, float c) {
  float a[16];
#pragma unroll
  for (int k = 0; k < 16; ++k) a[k] = threadIdx.x * 1e-3f + k;
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int k = 0; k < 16; ++k) a[k] = fmaf(a[k], b, c);
  }
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < 16; ++k) s += a[k];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
"""


def _source_arch(source: Path, arch: str) -> str:
    """The arch a source compiles for: a kernel that issues wgmma, sm_90a (Hopper's arch-specific target)."""
    return "sm_90a" if arch == "sm_90" and "wgmma" in source.read_text() else arch


def cubin_path(source: Path, arch: str) -> Path:
    """Where nvcc_cubin puts the cubin of `source` for `arch`."""
    return source.with_suffix(f".{_source_arch(source, arch)}.cubin")


def _arch() -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    return f"sm_{major}{minor}"


def _wanted(args, entry: dict) -> bool:
    """Whether --only names the layer (every layer without it)."""
    return args.only is None or any(o in entry["name"] for o in args.only)


def _is_wgmma(entry: dict) -> bool:
    return entry.get("engine", "").startswith("wgmma")


def _selected(manifest: dict, args, arch: str) -> list[dict]:
    """The manifest's layers this run checks: --only's, and wgmma ones on Hopper only."""
    return [e for e in manifest["layers"] if (arch == "sm_90" or not _is_wgmma(e)) and _wanted(args, e)]


def nvcc_cubin(source: Path, arch: str) -> Path:
    """Compile one .cu file to a cubin next to it (nvcc -O3); returns the cubin's path. A kernel
    that issues wgmma compiles for sm_90a, Hopper's arch-specific target (nowhere else)."""
    cubin, arch = cubin_path(source, arch), _source_arch(source, arch)
    # -lineinfo: compute-sanitizer names the CUDA C line of a bad access (no cost in speed)
    cmd = ["nvcc", "-cubin", f"-arch={arch}", "-O3", "-lineinfo", "-w", str(source), "-o", str(cubin)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"nvcc failed on {source.name}:\n{result.stderr[-2000:]}")
    return cubin


def compile_all(sources: list[Path], arch: str, jobs: int | None = None) -> dict[Path, Path | Exception]:
    """nvcc every source in parallel; a failure is returned in place of its cubin."""
    def one(path: Path):
        try:
            return nvcc_cubin(path, arch)
        except Exception as err:  # reported per layer, the others still run
            return err

    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 4) as pool:
        return dict(zip(sources, pool.map(one, sources), strict=True))


class CudaDevice:
    """The real thing: cubins loaded with CuPy, timed with CUDA events, baselines from cuDNN."""

    torch_device = "cuda"
    baseline = "cuDNN"

    def __init__(self, torch, cp):
        self.torch, self.cp = torch, cp

    def kernel(self, launch: dict, cubin: Path, tensors: dict):
        """One of a layer's kernels ("launches" of its manifest entry), ready to launch."""
        function = self.cp.RawModule(path=str(cubin)).get_function(launch["kernel"])
        args = tuple(self.cp.asarray(tensors[name]) for name in launch["cuda_args"])
        grid, block, shared = tuple(launch["grid"]), tuple(launch["block"]), launch.get("shared_bytes", 0)
        if shared:  # opt in: past 48 KB of static and dynamic shared memory together, a launch fails
            function.max_dynamic_shared_size_bytes = shared
        return lambda: function(grid, block, args, shared_mem=shared)

    def median_ms(self, fn, repeat: int) -> float:
        """Median time of one call over `repeat` calls, each between two CUDA events (after warm-up)."""
        torch = self.torch
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    def ffma_peak_gflops(self, cubin: Path, repeat: int) -> float:
        cp = self.cp
        sms = self.torch.cuda.get_device_properties(0).multi_processor_count
        kernel = cp.RawModule(path=str(cubin)).get_function("ffma_peak")
        blocks, threads, iters = sms * 8, 256, 4096
        out = cp.empty(blocks * threads, dtype=cp.float32)
        args = (out, cp.int32(iters), cp.float32(1.0000001), cp.float32(1e-7))
        ms = self.median_ms(lambda: kernel((blocks,), (threads,), args), repeat)
        return 2 * 16 * iters * blocks * threads / ms / 1e6


class EmulatedDevice(CudaDevice):
    """A dry run on the CPU: the same CUDA C through tvm_ext's emulator, PyTorch on the CPU as the
    baseline, wall-clock times. It checks this script (layouts, argument order, the checks
    themselves) where there is no GPU; its times mean nothing."""

    torch_device = "cpu"
    baseline = "torch CPU"

    def kernel(self, launch: dict, cubin: Path, tensors: dict):
        from tvm_ext.kernels.cuda.toolchain import kernel_params
        from tvm_ext.testing.cuda_emulator import run_kernel

        source = cubin.with_suffix("").with_suffix(".cu").read_text()
        names = [name for _, name in kernel_params(source, launch["kernel"])]
        arrays = {cuda: tensors[ours].numpy() for cuda, ours in zip(names, launch["cuda_args"], strict=True)}
        return lambda: run_kernel(source, launch["kernel"], tuple(launch["grid"]), tuple(launch["block"]), arrays,
                                  launch.get("shared_bytes", 0))

    def median_ms(self, fn, repeat: int) -> float:
        """Wall-clock median of `repeat` calls; NaN for 0 (a dry run that only checks)."""
        if repeat == 0:
            return float("nan")
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    def ffma_peak_gflops(self, cubin: Path, repeat: int) -> float:
        return float("nan")


def set_tf32(torch, on: bool) -> None:
    torch.backends.cudnn.allow_tf32 = on
    torch.backends.cuda.matmul.allow_tf32 = on


def base_engine(entry: dict) -> str:
    """The arithmetic of an entry's kernel: "mma_tf32_w64" is the tf32 engine with 64-row warp
    slabs, "wgmma_tf32_shared" wgmma with A fragments from shared memory, "wgmma_tf32_static"
    wgmma on tiles within 48 KB, "ffma_maxdnn" maxDNN's 64x64 tile of 8x8 threads; Winograd
    is fp32 on the FFMA tile."""
    if "winograd" in entry:
        return "ffma"
    return re.sub(r"_(w\d+|shared|static|maxdnn)$", "", entry.get("engine", "ffma"))


def run_layer(torch, device: CudaDevice, entry: dict, cubin: Path, repeat: int) -> dict:
    """Check and time one layer's kernel against the baseline at the same precision."""
    F = torch.nn.functional
    n, c, h, w_ = entry["x_nchw"]
    groups = entry["groups"]
    x = torch.randn(n, c, h, w_, device=device.torch_device)
    w = torch.randn(*entry["w_oihw"], device=device.torch_device)
    k, cg, r, s = entry["w_oihw"]
    top, left, bottom, right = entry["padding"]
    options = dict(stride=tuple(entry["stride"]), dilation=tuple(entry["dilation"]), groups=groups)

    def pad(t):
        return F.pad(t, (left, right, top, bottom))

    # the kernel's operands, laid out once: CHWN data; weights CRSK, or RSCK (the reduction order),
    # and for wgmma packed per block and k step (tvm_ext's pack_wgmma_weight); or for Winograd
    # U = G w G^T as the GEMMs' [a², C, K]
    order = entry.get("k_order", "crs")
    if order == "winograd":
        g = torch.tensor(entry["winograd"]["G"], dtype=torch.float64, device=device.torch_device)
        u = torch.einsum("xi,kcij,nj->xnck", g, w.double(), g)
        weights = u.reshape(g.shape[0] ** 2, cg, k).float().contiguous()
    else:
        axes = (0, 2, 3, 4, 1) if order == "crs" else (0, 3, 4, 2, 1)
        weights = w.reshape(groups, k // groups, cg, r, s).permute(*axes).reshape(groups, cg * r * s, k // groups)
    if "wgmma" in entry:  # each (group, block of rows, k step) tile in the layout the tensor cores read
        rows, step = entry["wgmma"]["rows"], entry["wgmma"]["k_step"]
        per = entry["wgmma"].get("per_reg", 1)  # values in 4 bytes: bf16 comes rounded, in pairs
        _, blocks, steps, _ = entry["params"]["w"]
        weights = F.pad(weights, (0, blocks * rows - k // groups, 0, steps * step - cg * r * s))
        core = 4 * per  # k values in a core matrix's 16-byte row
        weights = weights.reshape(groups, steps, step // core, core, blocks, rows // 8, 8).permute(0, 4, 1, 5, 2, 6, 3)
        weights = weights.reshape(groups, blocks, steps, rows * step)
        if per == 2:
            weights = weights.bfloat16().contiguous().view(torch.float32)
    tensors = {"x": x.permute(1, 2, 3, 0).contiguous(), "w": weights.contiguous()}
    for name, shape in entry["params"].items():  # what the kernels write: "y", and split-K's
        if name not in tensors:                  # slices or Winograd's transformed tiles
            tensors[name] = torch.full(shape, float("nan"), device=device.torch_device)
        assert list(tensors[name].shape) == shape, (name, tensors[name].shape, shape)
    launches = [device.kernel(launch, cubin, tensors) for launch in entry["launches"]]

    def ours():
        for launch in launches:
            launch()

    ours()
    if device.torch_device == "cuda":
        torch.cuda.synchronize()
    got = tensors["y"].permute(3, 0, 1, 2)
    engine = base_engine(entry)
    tf32 = engine in ("mma_tf32", "wgmma_tf32")
    bf16 = engine in ("mma_bf16", "wgmma_bf16")

    def as_read(t):  # what the kernel's arithmetic sees of an fp32 input
        if tf32:
            return (t.view(torch.int32) & -8192).view(torch.float32)
        return t.bfloat16().float() if bf16 else t

    ref = F.conv2d(pad(as_read(x).double()), as_read(w).double(), **options)
    scale = ref.abs().max().item()
    err = (got.double() - ref).abs().max().item() / scale
    # the baseline at the same precision: fp32, TF32 allowed, bf16 tensors; for a gradient's
    # kernel cuDNN's own pass of the layer (all of dX, where ours is one stride phase of it)
    xp, wb = (pad(x).bfloat16(), w.bfloat16()) if bf16 else (pad(x), w)
    baseline, what = (lambda: F.conv2d(xp, wb, **options)), ""
    if entry.get("pass", "forward") != "forward":
        baseline, what = gradient_baseline(torch, entry["pass"], entry["of"], device.torch_device)
    set_tf32(torch, tf32)
    t_ours = device.median_ms(ours, repeat)
    t_base = device.median_ms(baseline, repeat)
    set_tf32(torch, False)
    precision = "TF32" if tf32 else "bf16" if bf16 else "fp32"
    return {"err": err, "ok": err < error_bound(engine, w[0].numel()), "ours_ms": t_ours, "cudnn_ms": t_base,
            "cudnn": f"{device.baseline} {precision}{what}"}


def gradient_baseline(torch, pass_name: str, layer: dict, torch_device: str):
    """(call, label) of cuDNN's dX or dW of `layer` (a manifest entry's "of") through PyTorch."""
    grad = torch.nn.grad
    x = torch.randn(*layer["x_nchw"], device=torch_device)
    w = torch.randn(*layer["w_oihw"], device=torch_device)
    top, left, bottom, right = layer["padding"]
    if (top, left) != (bottom, right):  # PyTorch pads symmetrically: pad x itself
        x = torch.nn.functional.pad(x, (left, right, top, bottom))
        top = left = 0
    options = dict(stride=tuple(layer["stride"]), padding=(top, left), dilation=tuple(layer["dilation"]),
                   groups=layer["groups"])
    dy = torch.randn_like(torch.nn.functional.conv2d(x, w, **options))
    if pass_name == "data_gradient":
        return (lambda: grad.conv2d_input(x.shape, w, dy, **options)), " dgrad"
    return (lambda: grad.conv2d_weight(x, w.shape, dy, **options)), " wgrad"


def training_passes(rows: list[dict]) -> list[str]:
    """A table of each layer's dX and dW: the sum of its kernels (dX's stride phases) against
    cuDNN's pass, timed in the same run."""
    passes: dict[tuple, list[dict]] = {}
    for row in rows:
        if "of_pass" in row:
            passes.setdefault(tuple(row["of_pass"]), []).append(row)
    if not passes:
        return []
    lines = ["", "| layer | pass | kernels | ms | cuDNN ms | speed-up |", "|" + "---|" * 6]
    for (set_name, layer, name), parts in passes.items():
        ours = sum(part["ours_ms"] for part in parts)
        base = parts[0]["cudnn_ms"]
        pass_name = "dX" if name == "data_gradient" else "dW"
        lines.append(f"| {set_name} {layer} | {pass_name} | {len(parts)} | {ours:.3f} | {base:.3f} | "
                     f"{base / ours if ours else float('nan'):.2f}x |")
    return lines


def error_bound(engine: str, reduction: int) -> float:
    """The largest relative error (max-norm) a correct kernel shows on a reduction of
    `reduction` terms: 1e-4 for FFMA; for the tensor cores 1e-5, or more on long reductions:
    they add fp32 partial sums with truncation, so the error grows with the length (an H200:
    9.1e-6 at 3,456 terms, 2.3e-5 at 9,216, about 2.5e-9 a term, on mma.sync and wgmma alike;
    the bound, 2^-27 a term, leaves 3x). A wrong tile, buffer or race errs by 1e-3 or more."""
    if engine == "ffma":
        return 1e-4
    return max(1e-5, reduction * 2.0 ** -27)


# CUDA errors after which the process's context is lost: every later call fails with them
_STICKY = ("illegal memory access", "illegal address", "unspecified launch failure", "misaligned address",
           "illegal instruction", "hardware stack error", "launch timed out")
_RESULT = "@@gpu_check "  # the prefix of a worker's result lines


def _layer_result(torch, device, entry: dict, cubin, repeat: int) -> dict:
    """run_layer's result, or {"error": ...} (a broken layer must not hide the others)."""
    try:
        if isinstance(cubin, Exception):
            raise cubin
        return run_layer(torch, device, entry, cubin, repeat)
    except Exception as err:
        return {"error": str(err)}


def _worker(args, layers: list, cubins: dict) -> int:
    """Run layers from args.worker_from, one result line each; exit 3 after a sticky CUDA error
    (the parent starts a new process for the layers after it)."""
    import cupy as cp
    import torch

    torch.backends.cudnn.benchmark = True
    device = CudaDevice(torch, cp)
    for index in range(args.worker_from, len(layers)):
        if time.time() > args.deadline:
            return 0
        entry = layers[index]
        result = _layer_result(torch, device, entry, cubins[args.kernels / entry["file"]], args.repeat)
        print(_RESULT + json.dumps({"index": index, "result": result}), flush=True)
        if any(text in result.get("error", "").lower() for text in _STICKY):
            return 3
    return 0


def _isolated_results(args, argv: list, count: int, deadline: float):
    """(index, result) of every layer run in worker processes: a kernel that corrupts its CUDA
    context (an illegal address) fails alone instead of every layer after it."""
    index = 0
    while index < count and time.time() < deadline:
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker-from", str(index),
               "--deadline", str(deadline)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        for line in proc.stdout:
            if line.startswith(_RESULT):
                message = json.loads(line[len(_RESULT):])
                index = message["index"] + 1
                yield message["index"], message["result"]
            else:
                print(line, end="", flush=True)
        code = proc.wait()
        if code not in (0, 3) and index < count:  # died inside a layer without reporting it
            yield index, {"error": f"the worker process died (exit {code}) in this layer"}
            index += 1
        elif code == 0:
            return


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", type=Path, default=HERE / "gpu_kernels", help="bench/gpu_export.py's --out")
    parser.add_argument("--repeat", type=int, default=30, help="timed calls a kernel (--emulate: 0 times nothing)")
    parser.add_argument("--report", type=Path, default=None, help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting layers after this long")
    parser.add_argument("--emulate", action="store_true",
                        help="no GPU: run the kernels on tvm_ext's CPU emulator (a dry run of this script)")
    parser.add_argument("--only", nargs="+", default=None, help="the layers whose names contain one of these")
    parser.add_argument("--in-process", action="store_true",
                        help="every layer in this process (e.g. under compute-sanitizer): a kernel that corrupts "
                             "the CUDA context then fails every layer after it")
    parser.add_argument("--worker-from", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.repeat < (0 if args.emulate else 1):
        parser.error("--repeat must be at least 1 (0 only with --emulate)")
    start = time.perf_counter()
    if args.worker_from is not None:
        manifest = json.loads((args.kernels / "manifest.json").read_text())
        arch = _arch()
        layers = _selected(manifest, args, arch)
        return _worker(args, layers, {args.kernels / e["file"]: cubin_path(args.kernels / e["file"], arch)
                                      for e in layers})

    import torch

    if args.emulate:
        device, arch, where = EmulatedDevice(torch, None), "sm_90", "CPU emulator (times mean nothing)"
    else:
        try:
            import cupy as cp
        except ImportError:
            print("gpu_check: needs CuPy (to load the compiled kernels); pip install cupy-cuda12x or -cuda13x",
                  file=sys.stderr)
            return 2
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device visible to PyTorch", file=sys.stderr)
            return 2
        torch.backends.cudnn.benchmark = True  # cuDNN picks its fastest algorithm per shape
        major, minor = torch.cuda.get_device_capability(0)
        device, arch = CudaDevice(torch, cp), f"sm_{major}{minor}"
        where = f"{torch.cuda.get_device_name(0)}, cuDNN {torch.backends.cudnn.version()}"
    manifest = json.loads((args.kernels / "manifest.json").read_text())
    ffma_src = args.kernels / "ffma_peak.cu"
    ffma_src.write_text(FFMA_SOURCE)
    # wgmma exists on Hopper only (sm_90a): elsewhere those layers are listed as skipped, not failed
    layers = _selected(manifest, args, arch)
    for entry in manifest["layers"]:
        if entry not in layers and _wanted(args, entry):
            print(f"| {entry['name']} | skipped: wgmma needs a Hopper GPU (sm_90a), this one is {arch} |")
    sources = [ffma_src] + [args.kernels / e["file"] for e in layers]
    if args.emulate:  # the emulator compiles the CUDA C itself (nvcc's cubins are for a GPU)
        cubins, compiled = {path: path for path in sources}, "the emulator's own compile"
    else:
        cubins, compiled = compile_all(sources, arch), f"{len(sources)} kernels compiled"
    print(f"device: {where} ({arch}), torch {torch.version.__version__}; {compiled} "
          f"in {time.perf_counter() - start:.0f} s", flush=True)
    if isinstance(cubins[ffma_src], Exception):
        raise cubins[ffma_src]
    peak = device.ffma_peak_gflops(cubins[ffma_src], args.repeat)
    print(f"measured fp32 FFMA peak: {peak:,.0f} GFLOP/s", flush=True)

    # "loop bound": the FFMA share of the k loop's SASS (gpu_export.py --sass), the most of the
    # FFMA peak the kernel can reach at one warp instruction per cycle per scheduler
    header = ("| layer | engine | tile | err | ms | GFLOP/s | % FFMA peak | loop bound | baseline | baseline ms "
              "| speed-up |")
    lines = [header, "|" + "---|" * 11]
    print(header, flush=True)
    rows = []
    deadline = time.time() + args.budget_s - (time.perf_counter() - start)
    if args.emulate or args.in_process:
        results = ((i, _layer_result(torch, device, entry, cubins[args.kernels / entry["file"]], args.repeat))
                   for i, entry in enumerate(layers) if time.time() < deadline)
    else:
        for path, cubin in cubins.items():  # a worker reports these as the layer's error
            if isinstance(cubin, Exception):
                cubin_path(path, arch).unlink(missing_ok=True)
        results = _isolated_results(args, argv, len(layers), deadline)
    done = set()
    for index, result in results:
        entry = layers[index]
        done.add(index)
        if isinstance(cubins[args.kernels / entry["file"]], Exception):
            result = {"error": str(cubins[args.kernels / entry["file"]])}
        if "error" in result:  # one broken layer must not hide the others
            line = f"| {entry['name']} | error: {result['error'].strip().splitlines()[0][:120]} |"
            rows.append({"name": entry["name"], "error": result["error"]})
        else:
            gflops = entry["flops"] / result["ours_ms"] / 1e6
            engine = entry.get("engine", "ffma")
            result.update(name=entry["name"], engine=engine, gflops=gflops, peak_pct=100 * gflops / peak,
                          tile=entry["tile"])
            rows.append(result)
            # the FFMA peak is no tensor peak; Winograd's GFLOP/s are effective (a direct conv's FLOPs)
            winograd, ffma = "winograd" in entry, base_engine(entry) == "ffma"
            pct = "-"
            if ffma:
                pct = f"{result['peak_pct']:.1f}%" + (" eff." if winograd else "")
            loop = entry.get("sass_loop")
            ffma_loop = loop and ffma
            bound = f"{100 * loop['ffma'] / loop['instructions']:.1f}%" if ffma_loop else "-"
            tile = f"{entry['tile'][0]}x{entry['tile'][1]}"
            if ffma and "thread_tile" in entry:  # a thread's FFMA tile
                tile += " ({}x{})".format(*entry["thread_tile"])
            tile += f", K/{entry['splits']}" if entry.get("splits", 1) > 1 else ""
            if winograd:  # with the strategy's estimate of its speed-up over the direct tile
                m, (direct_ms, winograd_ms) = entry["winograd"]["m"], entry["estimate_ms"]
                tile = f"F({m}x{m}), {tile}, est. {direct_ms / winograd_ms:.1f}x"
            if entry.get("pass", "forward") != "forward":  # which gradient, and its phase of dX
                engine += " dW" if entry["pass"] == "weight_gradient" else " dX"
                if entry.get("phases", 1) > 1:
                    engine += " phase {},{} of {}".format(*entry["phase"], entry["phases"])
                result.update(of_pass=[entry["set"], entry["layer"], entry["pass"]])
            line = (f"| {entry['set']} {entry['layer']} | {engine} | {tile} | "
                    f"{result['err']:.1e}{'' if result['ok'] else ' FAIL'} | {result['ours_ms']:.3f} | "
                    f"{gflops:,.0f} | {pct} | {bound} | {result['cudnn']} | {result['cudnn_ms']:.3f} | "
                    f"{result['cudnn_ms'] / result['ours_ms']:.2f}x |")
        lines.append(line)
        print(line, flush=True)
    for index, entry in enumerate(layers):
        if index not in done:
            print(f"| {entry['name']} | budget of {args.budget_s:.0f} s spent: not run |")
    lines += training_passes(rows)
    print("\n".join(training_passes(rows)), flush=True)
    failed = [r["name"] for r in rows if not r.get("ok")]
    skipped = sum(_is_wgmma(e) and e not in layers and _wanted(args, e) for e in manifest["layers"])
    print(f"{len(rows) - len(failed)}/{len(layers)} layers correct; "
          f"total {time.perf_counter() - start:.0f} s" + (f"; failed: {failed}" if failed else "")
          + (f"; {skipped} wgmma layers skipped (not a Hopper GPU)" if skipped else ""))
    if args.report:
        args.report.mkdir(parents=True, exist_ok=True)
        (args.report / "gpu_check.md").write_text("\n".join(lines) + "\n")
        (args.report / "gpu_check.json").write_text(json.dumps({"peak_gflops": peak, "arch": arch, "layers": rows},
                                                               indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
