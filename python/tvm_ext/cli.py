"""`python -m tvm_ext demo|report|bench|tune`: compile a network through tvm_ext and show what ran.

demo   build the model with tvm_ext and with stock TVM, check the outputs agree, print the
       dispatch summary and the latency against stock TVM and PyTorch eager (same weights).
report print the dispatch report (one row per op).
bench  the per-layer convolution benchmark (bench/layers.py) for the model's layers: a script of
       the repository, not of the package (an installed wheel says so and exits with status 2).
tune   tune the model's convolutions (MetaSchedule, XGBoost cost model) into --work-dir; then
       build with tvm_ext.build(mod, target, database=WORK_DIR).

Each subcommand takes only the options it uses (`python -m tvm_ext tune --help`), and every
argument is checked before anything is loaded or built: a bad one exits with status 2 and one
line on stderr, not a traceback after a build.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from . import models
from .target import resolve_target

_TENSOR_CORES = ("tf32", "bf16", "wgmma_tf32", "wgmma_bf16")


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (argparse prints the usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _int_in(low: int, high: int | None = None, note: str = "") -> Callable[[str], int]:
    """An argparse type: an int in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            bound = f"at least {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"{value} is out of range: it must be {bound}{note}")
        return value

    return parse


def _max_threads() -> int:
    """The most threads --threads takes: the machine's logical CPUs.

    TVM's runtime pool starts one spinning worker per thread; past the logical CPUs the extra
    ones only time-slice against each other (1000 threads on 2 cores took over 4 minutes just to
    exit), so a larger count is always a mistake.
    """
    return os.cpu_count() or 1


def _target(text: str) -> str:
    """An argparse type: a target string TVM can read (kept as written)."""
    try:
        resolve_target(text)
    except (ValueError, TypeError) as err:
        raise argparse.ArgumentTypeError(str(err).splitlines()[0]) from None
    return text


def _rpc(text: str) -> str:
    """An argparse type: host:port:key of a TVM RPC tracker."""
    host, _, rest = text.partition(":")
    port, _, key = rest.partition(":")
    if not (host and key and port.isdigit() and 0 < int(port) < 65536):
        raise argparse.ArgumentTypeError(f"{text!r} is not host:port:key (a TVM RPC tracker)")
    return text


def _existing_file(text: str) -> str:
    """An argparse type: a path to a file that exists (read later, with its own checks)."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return text


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = _Parser(prog="python -m tvm_ext", description=(__doc__ or "").split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True, metavar="{demo,report,bench,tune}",
                            parser_class=_Parser)

    def option(parser: argparse.ArgumentParser, name: str) -> None:
        """The options several subcommands share, defined once."""
        if name == "model":
            parser.add_argument("--model", choices=models.names(), default=None,
                                help="one of tvm_ext.models' networks (default: resnet50)")
        elif name == "batch":
            parser.add_argument("--batch", type=_int_in(1), default=None, help="images per inference (default: 1)")
        elif name == "target":
            parser.add_argument("--target", type=_target, default="llvm", help="default: this machine's CPU")
        elif name == "threads":
            parser.add_argument("--threads", type=_int_in(0, _max_threads(), " (this machine's logical CPUs)"),
                                default=0, help="TVM and PyTorch threads (0: every core this process may use)")
        elif name == "repeat":
            parser.add_argument("--repeat", type=_int_in(1), default=10, help="timed runs (median)")
        elif name == "onnx":
            parser.add_argument("--onnx", type=_existing_file, default=None,
                                help="an ONNX file instead of --model (its input shape is its own: no --batch)")
        elif name == "direct":
            parser.add_argument("--direct", action="store_true",
                                help="every convolution direct (no Winograd for 3x3 and 5x5 layers)")
        elif name == "precision":
            parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                                help="bf16: convolutions in bfloat16 on AMX tiles, or AVX512-BF16 where it beats fp32")

    demo = sub.add_parser("demo", help="build with tvm_ext and stock TVM, compare outputs and latency")
    report = sub.add_parser("report", help="the dispatch report (one row per op)")
    bench = sub.add_parser("bench", help="the per-layer convolution benchmark (bench/layers.py)")
    tune = sub.add_parser("tune", help="tune the network's convolutions and poolings into --work-dir")
    for parser, names in ((demo, ("model", "batch", "target", "threads", "repeat", "direct", "precision")),
                          (report, ("model", "onnx", "batch", "target", "direct", "precision")),
                          (bench, ("model", "batch", "target", "threads", "repeat")),
                          (tune, ("model", "onnx", "batch", "target", "threads", "direct", "precision"))):
        for name in names:
            option(parser, name)
    for parser in (demo, bench):
        parser.add_argument("--no-stock", action="store_true", help="skip stock TVM (it takes seconds per run)")
    report.add_argument("--tensor-cores", choices=_TENSOR_CORES, default=None,
                        help="CUDA targets: convolutions on the tensor-core tile (tvm_ext.build's tensor_cores)")
    tune.add_argument("--trials", type=_int_in(1), default=64, help="trials over all tasks")
    tune.add_argument("--trials-per-task", type=_int_in(0), default=0, help="cap per task (0: --trials)")
    tune.add_argument("--work-dir", default=None, help="where the records go (default: tuning)")
    tune.add_argument("--rpc", type=_rpc, default=None,
                      help="host:port:key of a TVM RPC tracker whose servers measure")
    tune.add_argument("--ship", action="store_true",
                      help="write into tvm_ext/schedules/<target key>/ (the records builds use by default)")
    args, extra = ap.parse_known_args(argv)
    parser = {"demo": demo, "report": report, "bench": bench, "tune": tune}[args.command]
    if extra:  # said by the subcommand: the option may well be another subcommand's
        parser.error(f"unrecognized arguments for {args.command}: {' '.join(extra)}")
    if getattr(args, "onnx", None) is not None:
        if args.model is not None:
            parser.error("--model and --onnx name the network twice: give one")
        if args.batch is not None:
            parser.error("--batch applies to --model networks (an ONNX file fixes its own input shape)")
    if args.command == "tune":
        if args.ship and args.work_dir is not None:
            parser.error("--ship writes into tvm_ext/schedules/<target key>/: it takes no --work-dir")
        args.work_dir = args.work_dir or "tuning"
    args.model = args.model or "resnet50"
    args.batch = args.batch or 1
    if args.command in ("demo", "tune", "bench") and resolve_target(args.target).kind.name != "llvm":
        parser.error(f"runs on the CPU (LLVM targets); for {args.target!r} use `report`, tvm_ext.build(mod, "
                     "target) in Python, or bench/gpu_check.sh on a GPU machine")
    if args.command == "report" and args.tensor_cores and resolve_target(args.target).kind.name != "cuda":
        parser.error("--tensor-cores applies to CUDA targets")
    if getattr(args, "precision", "fp32") != "fp32" and resolve_target(args.target).kind.name != "llvm":
        parser.error("--precision applies to CPU targets (CUDA: --tensor-cores bf16)")
    return args


def _median_ms(fn, repeat: int, warmup_s: float = 0.25) -> float:
    """Median of `repeat` timed calls, after warm-up calls for `warmup_s` seconds (at least one):
    TVM's pinned threads take some calls to reach their speed, AMX's more (ResNet-50 in bf16:
    14 ms a call over the first 10, 8.7 ms warm)."""
    start = time.perf_counter()
    fn()
    while time.perf_counter() - start < warmup_s:
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _network(args: argparse.Namespace):
    """(module, name) of --onnx or --model; a file that is not an ONNX model is a ValueError naming it."""
    if getattr(args, "onnx", None):
        return models.load_onnx(args.onnx), Path(args.onnx).stem
    return models.get(args.model, batch=args.batch)[0], args.model


def demo(args: argparse.Namespace) -> int:
    import numpy as np
    import tvm
    from tvm import relax

    import tvm_ext

    target = tvm_ext.resolve_target(args.target)
    print(f"tvm_ext demo: {args.model} batch {args.batch} on {target} ({tvm_ext.vector_isa(target).name}), "
          f"{args.threads} threads")
    mod, _ = models.get(args.model, batch=args.batch)
    report = tvm_ext.dispatch_report(mod, target, winograd=not args.direct, precision=args.precision)
    counts = collections.Counter(r.kernel for r in report)
    print("dispatch: " + ", ".join(f"{n} x {k}" for k, n in counts.most_common()))
    if args.precision == "bf16":
        bf16 = sum(r.op == "nn.conv2d" and r.reason.startswith("bf16") for r in report)
        print(f"precision bf16: {bf16} of {sum(r.op == 'nn.conv2d' for r in report)} convolutions in bfloat16")
    start = time.perf_counter()
    ex = tvm_ext.build(mod, target, winograd=not args.direct, precision=args.precision)
    from tvm_ext.tuning.records import shipped_records_dir, shipped_target_keys, target_key

    shipped = shipped_records_dir(target)
    others = ", ".join(shipped_target_keys()) or "no target"
    print(f"built with tvm_ext in {time.perf_counter() - start:.1f} s; tuning records for {target_key(target)}: "
          + (f"shipped ({shipped})" if shipped else f"none (analytic schedules; records are shipped for {others})"))
    x = np.random.default_rng(0).standard_normal(models.image_shape(mod)).astype("float32")
    xt = tvm.runtime.tensor(x)
    run = relax.VirtualMachine(ex, tvm.cpu())["main"]
    ours = run(xt).numpy()
    ms = _median_ms(lambda: run(xt), args.repeat)
    rows = [("tvm_ext", ms)]
    status = 0
    if not args.no_stock:
        stock = relax.VirtualMachine(tvm.compile(mod, target), tvm.cpu())["main"]
        ref = stock(xt).numpy()
        err = float(np.abs(ours - ref).max() / np.abs(ref).max())
        bound = 1e-4 if args.precision == "fp32" else 3e-2  # bf16: 8 bits of mantissa in each convolution's inputs
        print(f"output vs stock TVM: relative error {err:.1e} ({'ok' if err <= bound else 'MISMATCH'})")
        status = 0 if err <= bound else 1
        rows.append(("stock TVM (tvm.compile)", _median_ms(lambda: stock(xt), 1)))
    try:
        import torch
    except ImportError:
        print("PyTorch is not installed: no PyTorch baseline")
    else:
        from .models.torch_reference import to_torch

        torch.set_num_threads(args.threads)
        forward = to_torch(mod)
        with torch.inference_mode():
            xt_torch = torch.from_numpy(x)
            err = float(np.abs(ours - forward(xt_torch).numpy()).max() / np.abs(ours).max())
            print(f"output vs PyTorch eager: relative error {err:.1e}")
            rows.append(("PyTorch eager (NCHW)", _median_ms(lambda: forward(xt_torch), args.repeat)))
    print(f"{'runtime':28s} {'ms':>9s} {'images/s':>9s} {'tvm_ext speed-up':>17s}")
    for name, t in rows:
        print(f"{name:28s} {t:9.2f} {1e3 * args.batch / t:9.1f} {t / ms:16.1f}x")
    return status


def report(args: argparse.Namespace) -> int:
    import tvm_ext

    try:
        mod, _ = _network(args)
        print(tvm_ext.dispatch_report(mod, args.target, tensor_cores=args.tensor_cores or False,
                                      winograd=not args.direct, precision=args.precision))
    except (ValueError, tvm_ext.UnsupportedError) as err:  # a bad ONNX file; wgmma for a target not sm_90a
        print(f"tvm_ext report: {err}", file=sys.stderr)
        return 2
    return 0


def tune(args: argparse.Namespace) -> int:
    import tvm_ext
    from tvm_ext.tuning import extract_tasks
    from tvm_ext.tuning.progress import TuningProgress
    from tvm_ext.tuning.records import open_database

    target = tvm_ext.resolve_target(args.target)
    if args.ship:
        from tvm_ext.tuning.records import schedules_root, target_key

        args.work_dir = str(schedules_root() / target_key(target))
    try:
        open_database(args.work_dir, create=True)  # a work_dir we cannot write fails now, not after the model
        mod, name = _network(args)
    except ValueError as err:
        print(f"tvm_ext tune: {err}", file=sys.stderr)
        return 2
    tasks = extract_tasks(mod, target, winograd=not args.direct, precision=args.precision)
    print(f"tvm_ext tune: {name} on {target}: {len(tasks)} tasks ({sum(t.weight for t in tasks)} kernel calls), "
          f"{args.trials} trials, records in {args.work_dir}")
    progress = TuningProgress(tasks, args.trials)
    start = time.perf_counter()
    tvm_ext.tune(mod, target, args.work_dir, args.trials, args.trials_per_task or None, tasks=tasks,
                 measure_callbacks=[progress], rpc=args.rpc)
    print(f"\ntuned in {time.perf_counter() - start:.0f} s\n{progress.summary()}")
    if args.ship:
        from tvm_ext.tuning.records import compact_database

        print(f"shipped: the best record of each workload, {compact_database(args.work_dir)} records")
    plot = progress.plot(Path(args.work_dir) / "tuning_curve.png")
    print(f"tuning curve: {plot}" if plot else "tuning curve: matplotlib is not installed, no PNG")
    return 0


def _bench_script() -> Path:
    """bench/layers.py of the repository this package runs from (it is no part of the package)."""
    return Path(__file__).resolve().parents[2] / "bench" / "layers.py"


def bench(args: argparse.Namespace) -> int:
    script = _bench_script()
    if not script.is_file():  # an installed wheel: the benchmark (and bench/peak.py, its workloads) stayed behind
        print(f"tvm_ext bench: runs the repository's bench/layers.py, which is not installed with the package "
              f"({script} does not exist): run it from a clone of tvm_ext (pip install -e .)", file=sys.stderr)
        return 2
    layer_set = "resnet50" if args.model.startswith("resnet") else args.model
    cmd = [sys.executable, str(script), "--set", layer_set, "--batch", str(args.batch), "--threads",
           str(args.threads), "--target", args.target, "--repeat", str(args.repeat)]
    return subprocess.call(cmd + (["--no-stock"] if args.no_stock else []))


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand; its exit status (2: bad arguments, reported before anything is built)."""
    try:
        args = _parse(argv)
    except SystemExit as err:  # argparse: --help (0) or a bad argument (2), its message printed
        return 0 if err.code is None else err.code if isinstance(err.code, int) else 2
    if hasattr(args, "threads"):
        from .target import usable_cores

        # Set explicitly: TVM's own default pool ran ResNet-18 at half speed on this 2-core machine.
        args.threads = args.threads or usable_cores()
        os.environ["TVM_NUM_THREADS"] = str(args.threads)
    return {"demo": demo, "report": report, "bench": bench, "tune": tune}[args.command](args)
