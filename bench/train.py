"""Training convolutions, layer by layer: forward, data gradient (dX) and weight gradient (dW) of
tvm_ext's eager primitives against PyTorch's (oneDNN) in the same run.

For each layer of a set in bench/workloads.json: ops.conv2d / torch.nn.functional.conv2d,
ops.conv2d_backward_data / torch.nn.grad.conv2d_input, ops.conv2d_backward_weight /
torch.nn.grad.conv2d_weight, all NCHW NumPy/torch tensors in and out (layouts and weight packing
included on both sides), timed alternately (median of --repeat rounds), with GFLOP/s, % of the
measured peak (bench/peak.py) and the ratio to PyTorch. Benchmarks print; they never assert.

With --model (a torchvision name), whole training steps instead: the model's loss (its output
against fixed weights, summed; batch norms in inference form, or with the batch's statistics
under --batch-norm training, on every side, each side updating the running statistics: tvm_ext's
are states, tvm_ext.train.from_torch) differentiated by relax.transform.Gradient and built with
tvm_ext, against PyTorch eager's forward + backward and torch.compile's (unless --no-compile),
plus an SGD update of every parameter on each side;
median ms timed alternately in one process, and the peak memory (RSS high-water mark) of a
process that runs only that side's steps; for tvm_ext two: a process that exports and builds the
step itself, and one that loads the built step as a library (as torch.compile's process, whose
compile workers are processes of their own, does not count its compiler either).

With --blocked, the kernels alone in the blocked layouts a compiled training step keeps between
them (NCHW[x]c in and out, weights packed, borders written by the producer): forward = the BRGEMM
convolution, dX = its phase convolutions (one at stride 1) plus the interleave of the phases into
dX, dW = the batch-reduce kernel, against PyTorch's faster of NCHW and channels_last tensors
(oneDNN's nhwc needs no reorder on its side either). The first layer has no dX (the image's).

Usage: python bench/train.py --set resnet50 --batch 16 --threads 1 [--layers K | --only A,B] [--repeat R]
                             [--blocked]
       python bench/train.py --model resnet18 --size 224 --batch 16 --threads 2 [--no-compile]
                             [--batch-norm inference|training]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", default="resnet50")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=0, help="only the first K layers (0: all)")
    ap.add_argument("--only", default="", help="only these layers (names, comma-separated)")
    ap.add_argument("--repeat", type=int, default=7, help="timed rounds per measurement (median)")
    ap.add_argument("--blocked", action="store_true", help="the kernels alone, in blocked layouts (docstring)")
    ap.add_argument("--model", default="", help="time whole training steps of this torchvision model")
    ap.add_argument("--size", type=int, default=224, help="image size of --model")
    ap.add_argument("--no-compile", action="store_true", help="--model: leave torch.compile out")
    ap.add_argument("--batch-norm", choices=("inference", "training"), default="inference",
                    help="--model: batch norms with running (folded) or the batch's statistics")
    ap.add_argument("--memory", default="", help=argparse.SUPPRESS)  # (internal) one side's peak memory
    ap.add_argument("--library", default="", help=argparse.SUPPRESS)  # (internal) --memory tvm_ext_library's
    return ap.parse_args(argv)


ARGS = _parse_args()
# TVM's thread pool and PyTorch read their thread count once: set it before importing them.
os.environ["TVM_NUM_THREADS"] = str(ARGS.threads)
os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import tvm  # noqa: E402

import tvm_ext  # noqa: E402
from tvm_ext.kernels import conv2d as K  # noqa: E402
from tvm_ext.kernels import conv2d_backward_data as DG  # noqa: E402
from tvm_ext.kernels import conv2d_backward_weight as WG  # noqa: E402

sys.path.insert(0, str(HERE))
import peak as peak_bench  # noqa: E402

torch.set_num_threads(ARGS.threads)
TARGET = tvm_ext.resolve_target(None)
ISA = tvm_ext.vector_isa(TARGET)


def _time_ms(fn, min_ms: float = 20.0) -> float:
    """One timing: a batch of calls sized to last at least `min_ms`, per call."""
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-6)
    number = max(1, int(min_ms / 1e3 / once))
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number * 1e3


def _alternate(fns: dict, repeat: int) -> dict[str, float]:
    """Median ms of each function, timed in alternation (a noisy machine drifts for all alike)."""
    for fn in fns.values():
        fn()  # compile, warm
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            times[name].append(_time_ms(fn))
    return {name: statistics.median(values) for name, values in times.items()}


def _layer(layer: dict, rng: np.random.Generator) -> tuple[dict, dict]:
    n, c, h, w = ARGS.batch, layer["C"], layer["H"], layer["W"]
    k, r, s, stride, pad = layer["K"], layer["R"], layer["S"], layer["stride"], layer["pad"]
    x = rng.standard_normal((n, c, h, w), dtype=np.float32)
    wt = rng.standard_normal((k, c, r, s), dtype=np.float32)
    oh, ow = (h + 2 * pad - r) // stride + 1, (w + 2 * pad - s) // stride + 1
    dy = rng.standard_normal((n, k, oh, ow), dtype=np.float32)
    tx, tw, tdy = torch.from_numpy(x), torch.from_numpy(wt), torch.from_numpy(dy)
    options = {"stride": stride, "padding": pad}
    flops = 2 * n * k * c * r * s * oh * ow
    fns = {
        "fwd": lambda: tvm_ext.ops.conv2d(x, wt, **options),
        "fwd_torch": lambda: torch.nn.functional.conv2d(tx, tw, None, **options),
        "dx": lambda: tvm_ext.ops.conv2d_backward_data(dy, wt, x.shape, **options),
        "dx_torch": lambda: torch.nn.grad.conv2d_input(tx.shape, tw, tdy, **options),
        "dw": lambda: tvm_ext.ops.conv2d_backward_weight(x, dy, wt.shape, **options),
        "dw_torch": lambda: torch.nn.grad.conv2d_weight(tx, tw.shape, tdy, **options),
    }
    return fns, {"flops": flops, "shape": f"{c}x{h}x{w}->{k} {r}x{s}/s{stride}"}


def _tensor(rng: np.random.Generator, shape) -> tvm.runtime.Tensor:
    return tvm.runtime.tensor(rng.standard_normal(shape, dtype=np.float32))


def _blocked_conv(wl: K.Conv2dWorkload, rng: np.random.Generator):
    """The forward BRGEMM kernel of `wl` alone (its input padded and blocked), and its output."""
    plan = K.plan_conv2d(wl, ISA)
    fn = tvm.compile(K.conv2d_blocked_kernel(plan, ISA.lanes, K.Epilogue()), TARGET)["main"]
    args = [_tensor(rng, plan.data_shape()), _tensor(rng, plan.weight_shape()),
            tvm.runtime.empty(K.Epilogue().out_shape(plan), "float32", tvm.cpu())]
    return (lambda: fn(*args)), args[-1]


def _blocked_data_gradient(wl: K.Conv2dWorkload, rng: np.random.Generator):
    """dX as a training step runs it: each non-zero phase's forward convolution of dY, then (at
    stride > 1) the kernel that interleaves the phases' blocks into dX's."""
    calls, outputs, shapes = [], [], []
    for phase in DG.data_gradient_phases(wl):
        if phase.zero:
            shapes.append(None)
            continue
        rows, cols = phase.rows[1] - phase.rows[0], phase.cols[1] - phase.cols[0]
        conv = K.Conv2dWorkload.make((wl.N, wl.K, rows, cols), (wl.C, wl.K, len(phase.taps_h), len(phase.taps_w)),
                                     1, phase.padding, phase.dilation, 1)
        call, out = _blocked_conv(conv, rng)
        calls.append(call)
        outputs.append(out)
        shapes.append(tuple(out.shape))
    if len(shapes) > 1:
        block = outputs[0].shape[-1]
        dx = (wl.N, -(-wl.C // block), wl.H, wl.W, block)
        fn = tvm.compile(DG.interleave_phases_func(dx, wl.stride, shapes), TARGET)["main"]
        args = [*outputs, tvm.runtime.empty(dx, "float32", tvm.cpu())]
        calls.append(lambda: fn(*args))
    return lambda: [call() for call in calls]


def _blocked_weight_gradient(wl: K.Conv2dWorkload, rng: np.random.Generator):
    plan = WG.plan_conv2d_backward_weight(wl, ISA)
    fn = tvm.compile(WG.conv2d_backward_weight_kernel(plan, ISA.lanes), TARGET)["main"]
    args = [_tensor(rng, plan.data_shape()), _tensor(rng, plan.grad_out_shape()),
            tvm.runtime.empty(plan.weight_shape(), "float32", tvm.cpu())]
    return lambda: fn(*args)


def _blocked_layer(layer: dict, rng: np.random.Generator, first: bool) -> tuple[dict, dict]:
    """--blocked: the three passes' kernels, and PyTorch's on NCHW and on channels_last tensors
    (its faster layout counts: oneDNN's 1x1 data gradients are slower on channels_last here). The
    network's first layer has no dX (nothing needs the image's gradient)."""
    n, c, h, w = ARGS.batch, layer["C"], layer["H"], layer["W"]
    k, r, s, stride, pad = layer["K"], layer["R"], layer["S"], layer["stride"], layer["pad"]
    wl = K.Conv2dWorkload.make((n, c, h, w), (k, c, r, s), stride, pad, 1, 1)
    options = {"stride": stride, "padding": pad}
    fns = {"fwd": _blocked_conv(wl, rng)[0], "dw": _blocked_weight_gradient(wl, rng)}
    if not first:
        fns["dx"] = _blocked_data_gradient(wl, rng)
    for layout in (torch.contiguous_format, torch.channels_last):
        tx, tw, tdy = (torch.randn(*shape).contiguous(memory_format=layout)
                       for shape in ((n, c, h, w), (k, c, r, s), (n, k, wl.OH, wl.OW)))
        name = "nchw" if layout == torch.contiguous_format else "nhwc"
        fns[f"fwd_torch_{name}"] = lambda tx=tx, tw=tw: torch.nn.functional.conv2d(tx, tw, None, **options)
        fns[f"dw_torch_{name}"] = lambda tx=tx, tw=tw, tdy=tdy: torch.nn.grad.conv2d_weight(tx, tw.shape, tdy,
                                                                                             **options)
        if not first:
            fns[f"dx_torch_{name}"] = lambda tx=tx, tw=tw, tdy=tdy: torch.nn.grad.conv2d_input(tx.shape, tw, tdy,
                                                                                               **options)
    return fns, {"flops": 2 * n * k * c * r * s * wl.OH * wl.OW, "shape": f"{c}x{h}x{w}->{k} {r}x{s}/s{stride}"}


def geomean(values: list[float]) -> float:
    values = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def _sgd_step(adjoint, x, tensors: list, lr: float, num_states: int = 0):
    """tvm_ext's step: the built gradient function, then SGD in NumPy on the VM's tensors. The
    last `num_states` tensors are states (running statistics): the step returns their new values,
    which the next step reads."""
    split = len(tensors) - num_states
    params = [np.from_dlpack(t) for t in tensors[:split]]  # views: SGD updates the parameters in place

    def ours() -> None:
        out, grads = adjoint(x, *tensors)
        if num_states:
            tensors[split:] = [out[i] for i in range(1, num_states + 1)]
        for param, grad in zip(params, grads, strict=True):
            step = np.from_dlpack(grad)
            step *= -lr
            param += step

    return ours


LEARNING_RATE = 1e-6


def _step_functions(sides: tuple[str, ...]) -> tuple[dict, float, tuple | None]:
    """One training step of each side (tvm_ext, torch, torch.compile), tvm_ext's build time and
    what it built (its executable and input tensors, for :func:`_export_step`; None without it)."""
    import tvm
    from tvm import relax

    from tvm_ext.models import torchvision_zoo
    from tvm_ext.models.training import loss_gradient, loss_module, loss_step_gradient

    x = np.random.default_rng(1).standard_normal((ARGS.batch, 3, ARGS.size, ARGS.size), dtype=np.float32)
    model = torchvision_zoo.load(ARGS.model, ARGS.size).train(ARGS.batch_norm == "training")
    images, steps, build_s, built = torch.from_numpy(x), {}, 0.0, None
    # one torch loss module (the model's parameters) for every side, built with the export if tvm_ext runs
    loss = loss_module(model, x) if "tvm_ext" not in sides else None
    if "tvm_ext" in sides:
        if model.training:  # the running statistics are states, updated as PyTorch's step updates them
            mod, values, states, loss = loss_step_gradient(model, x)
        else:
            (mod, values, loss), states = loss_gradient(model, x), []
        if sides == ("tvm_ext",):  # tvm_ext's own process: the torch model is not needed once exported
            del model, loss
        start = time.perf_counter()
        ex = tvm_ext.build(mod, "llvm")
        build_s = time.perf_counter() - start
        del mod
        xt = tvm.runtime.tensor(x)
        tensors, num_states = [tvm.runtime.tensor(v) for v in [*values, *states]], len(states)
        del values, states
        steps["tvm_ext"] = _sgd_step(relax.VirtualMachine(ex, tvm.cpu())[_adjoint_name(num_states)], xt, tensors,
                                     LEARNING_RATE, num_states)
        built = (ex, [xt, *tensors], num_states)
    if sides == ("tvm_ext",):
        return steps, build_s, built
    sgd = torch.optim.SGD(loss.parameters(), lr=LEARNING_RATE)
    compiled = torch.compile(loss) if "torch.compile" in sides else None
    for side, forward in (("torch", loss), ("torch.compile", compiled)):
        if side in sides:
            def theirs(forward=forward) -> None:
                sgd.zero_grad()
                forward(images).backward()
                sgd.step()

            steps[side] = theirs
    return steps, build_s, built


def _adjoint_name(num_states: int) -> str:
    """The step's gradient function: loss_step_gradient's with states, loss_gradient's without."""
    return "backbone_adjoint" if num_states else "main_adjoint"


def _library_step(folder: Path):
    """tvm_ext's step loaded from the library `_export_step` wrote: how a trainer deploys a built
    step (tvm and NumPy only; no export, no compiler in the process)."""
    import tvm
    from tvm import relax

    data = np.load(folder / "tensors.npz")
    num_states = int(data["num_states"])
    x, *tensors = (tvm.runtime.tensor(data[f"arr_{i}"]) for i in range(len(data.files) - 1))
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(folder / "step.so")), tvm.cpu())
    return _sgd_step(vm[_adjoint_name(num_states)], x, tensors, LEARNING_RATE, num_states)


def _export_step(folder: Path, executable, tensors: list, num_states: int) -> None:
    """A built step as a shared library, with its input, parameters and states."""
    executable.export_library(str(folder / "step.so"))
    np.savez(folder / "tensors.npz", *(t.numpy() for t in tensors), num_states=np.array(num_states))


def _peak_memory_mib(side: str, library: Path | None = None) -> float:
    """The RSS high-water mark of a process that runs only `side`'s steps (module docstring)."""
    import subprocess

    argv = [sys.executable, __file__, "--model", ARGS.model, "--size", str(ARGS.size), "--batch", str(ARGS.batch),
            "--threads", str(ARGS.threads), "--batch-norm", ARGS.batch_norm, "--memory", side]
    if library is not None:
        argv += ["--library", str(library)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


def _training_steps() -> int:
    """--model: whole training steps of each side (module docstring)."""
    import resource
    import tempfile

    sides = ("tvm_ext", "torch") + (() if ARGS.no_compile else ("torch.compile",))
    if ARGS.memory:  # (a child of _peak_memory_mib)
        if ARGS.memory == "tvm_ext_library":
            step = _library_step(Path(ARGS.library))
        else:
            step = _step_functions((ARGS.memory,))[0][ARGS.memory]
        for _ in range(3):
            step()
        # VmHWM: this process's own high-water mark (ru_maxrss keeps the parent's across fork and exec)
        status = Path("/proc/self/status")
        if status.exists():
            print(int(next(line for line in status.read_text().splitlines() if line.startswith("VmHWM:")).split()[1])
                  / 1024)
        else:
            print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        return 0
    steps, build_s, (executable, tensors, num_states) = _step_functions(sides)
    ms = _alternate(steps, ARGS.repeat)
    print(f"# training step: {ARGS.model} {ARGS.size}x{ARGS.size} batch={ARGS.batch} threads={ARGS.threads} "
          f"batch norms: {ARGS.batch_norm}; "
          f"tvm_ext build {build_s:.1f} s; ms medians of {ARGS.repeat} alternating rounds; peak memory: RSS "
          "high-water mark of a process running only that side (tvm_ext: exported and built in that process "
          "/ its built library loaded)")
    print("side | ms | tvm_ext speedup | peak MiB")
    with tempfile.TemporaryDirectory(prefix="tvm_ext_train_") as folder:
        _export_step(Path(folder), executable, tensors, num_states)
        for side in sides:
            mib = f"{_peak_memory_mib(side):.0f}"
            if side == "tvm_ext":
                mib += f" / {_peak_memory_mib('tvm_ext_library', Path(folder)):.0f}"
            print(f"{side} | {ms[side]:.1f} | {ms[side] / ms['tvm_ext']:.2f}x | {mib}", flush=True)
    return 0


def main() -> int:
    if ARGS.model:
        return _training_steps()
    peak = peak_bench.load_or_measure()
    peak_gflops = peak["peak_gflops_1thread"] * ARGS.threads
    if ARGS.threads > 1 and int(peak.get("threads", 1)) >= ARGS.threads:
        peak_gflops = peak["peak_gflops_all"] * ARGS.threads / int(peak["threads"])
    layers = all_layers = json.loads((HERE / "workloads.json").read_text())[ARGS.set]
    if ARGS.only:
        names = ARGS.only.split(",")
        unknown = sorted(set(names) - {layer["name"] for layer in layers})
        if unknown:
            raise SystemExit(f"--only: no layers {unknown} in set {ARGS.set}")
        layers = [layer for layer in layers if layer["name"] in names]
    if ARGS.layers:
        layers = layers[: ARGS.layers]
    what = ("kernels alone, blocked layouts; PyTorch NCHW or channels_last, the faster" if ARGS.blocked
            else "NCHW in and out")
    print(f"# tvm_ext training convolutions ({what}): set={ARGS.set} batch={ARGS.batch} threads={ARGS.threads} "
          f"peak={peak_gflops:.1f} GFLOP/s (bench/peak.py); ms medians of {ARGS.repeat} alternating rounds")
    passes = ("fwd", "dx", "dw")
    print("layer | shape | " + " | ".join(f"{p}_ms | {p}_GFLOP/s | {p}_%peak | {p}_x_torch" for p in passes))
    ratios: dict[str, list[float]] = {p: [] for p in passes}
    percents: dict[str, list[float]] = {p: [] for p in passes}
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for layer in layers:
            first = layer is all_layers[0]
            fns, info = _blocked_layer(layer, rng, first) if ARGS.blocked else _layer(layer, rng)
            ms = _alternate(fns, ARGS.repeat)
            cells = [layer["name"], info["shape"]]
            for p in passes:
                if p not in ms:
                    cells += ["-"] * 4
                    continue
                gflops = info["flops"] / ms[p] / 1e6
                ratio = min(t for name, t in ms.items() if name.startswith(f"{p}_torch")) / ms[p]
                ratios[p].append(ratio)
                percents[p].append(100 * gflops / peak_gflops)
                cells += [f"{ms[p]:.3f}", f"{gflops:.1f}", f"{percents[p][-1]:.0f}", f"{ratio:.2f}"]
            print(" | ".join(cells), flush=True)
    print("# " + "; ".join(f"{p}: median {statistics.median(percents[p]):.0f}% of peak, geomean "
                          f"{geomean(ratios[p]):.2f}x torch, min {min(ratios[p]):.2f}x" for p in passes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
