"""Long runs of the random-graph property test (tvm_ext.testing.random_graphs).

Builds graphs FIRST .. FIRST+N-1 with tvm_ext, compares each with its float64 PyTorch reference,
and prints every failure as a reproducer: the seed, the grammar steps, whether stock TVM gets the
same graph right (whose bug it is), and with --show the Relax script. A failure found here becomes
a fixed test. Exit status 1 when any graph failed.

With --precision bf16 the graphs are built with `precision="bf16"` (convolutions on bf16 inputs
where the CPU has a bf16 engine) and judged by `testing.random_graphs.check_bf16_graph`: within
3e-2, or where a graph is that sensitive to rounding, within 4x the error of its fp32 build with
the weights and inputs rounded to bf16 (a chain of 2-channel convolutions: 7%). bf16 rounding is
not checked so; a wrong layout or a lost epilogue is.

With --precision int8 each graph is first quantized (`testing.random_graphs.quantized_graph`:
tvm_ext.quantize's QDQ form), then built by tvm_ext (the int8 kernels) and by stock TVM (the same
module in float32) and judged by `check_int8_graph`: at most 10% of the values a step apart (a
tie the integer sums round the other way, spread by the layers after it), none by more than the
quantization's own error.

--video draws video graphs instead (`random_video_graph`: 3-D convolutions, which tvm_ext runs
as 2-D ones over the frames).

--mcpu builds for another CPU than this one (haswell: AVX2, x86-64: SSE), which this host must
be able to run. --maxdnn always puts every convolution the maxDNN tile takes on it (its layout
passes in and out of the blocked kernels included).

Usage: python bench/fuzz.py [--graphs 1000] [--first 0] [--max-steps 7] [--show] [--stock]
                            [--precision fp32|bf16|int8] [--mcpu NAME] [--maxdnn auto|always|never]
                            [--video]
"""

from __future__ import annotations

import argparse
import sys
import time

import tvm

import tvm_ext
from tvm_ext.testing.random_graphs import (
    check_bf16_graph,
    check_graph,
    check_int8_graph,
    random_graph,
    random_video_graph,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", type=int, default=1000, help="how many graphs")
    parser.add_argument("--first", type=int, default=0, help="the first graph's seed")
    parser.add_argument("--max-steps", type=int, default=7, help="grammar steps per graph (at most)")
    parser.add_argument("--show", action="store_true", help="print each failing graph's Relax script")
    parser.add_argument("--stock", action="store_true", help="also build every graph with stock TVM")
    parser.add_argument("--precision", choices=("fp32", "bf16", "int8"), default="fp32",
                        help="tvm_ext.build's precision; int8: the graph's QDQ form (tvm_ext.quantize)")
    parser.add_argument("--mcpu", help="an LLVM CPU name to build for (default: this host's)")
    parser.add_argument("--maxdnn", choices=("auto", "always", "never"), default="auto",
                        help="tvm_ext.build's maxdnn: always runs every convolution the maxDNN tile takes on it")
    parser.add_argument("--video", action="store_true", help="video graphs (3-D convolutions)")
    args = parser.parse_args(argv)
    if args.graphs < 1 or args.max_steps < 2:
        parser.error("--graphs must be >= 1 and --max-steps >= 2")
    target = tvm_ext.resolve_target({"kind": "llvm", "mcpu": args.mcpu} if args.mcpu else "llvm")
    print(f"target {target}", flush=True)
    precision = "fp32" if args.precision == "int8" else args.precision  # (int8: the module says it)
    ours = lambda mod, winograd: tvm_ext.build(mod, target, winograd=winograd, precision=precision,  # noqa: E731
                                               maxdnn=args.maxdnn)
    fp32 = lambda mod, winograd: tvm_ext.build(mod, target, winograd=winograd)  # noqa: E731
    stock = lambda mod, _winograd: tvm.compile(mod, target)  # noqa: E731
    failed, stock_failed, start = [], 0, time.time()
    for seed in range(args.first, args.first + args.graphs):
        graph = (random_video_graph if args.video else random_graph)(seed, args.max_steps)
        if args.precision == "bf16":
            problem, sensitivity = check_bf16_graph(graph, ours, fp32)
            if sensitivity is not None and problem is None:
                print(f"seed {seed}: within 4x its bf16 sensitivity {sensitivity:.3g}", flush=True)
        elif args.precision == "int8":
            problem = check_int8_graph(graph, ours, target)
        else:
            problem = check_graph(graph, ours)
        stock_problem = check_graph(graph, stock) if (problem or args.stock) else None
        stock_failed += stock_problem is not None
        if problem:
            failed.append(seed)
            print(f"FAIL {problem}\n  stock TVM: {stock_problem or 'right'}\n  {graph.describe()}", flush=True)
            if args.show:
                print(graph.module.script())
        done = seed - args.first + 1
        if done % 50 == 0:
            print(f"{done}/{args.graphs} graphs, {len(failed)} failed, {time.time() - start:.0f} s", flush=True)
    print(f"{args.graphs} graphs (seeds {args.first}..{args.first + args.graphs - 1}): {len(failed)} failed "
          f"{failed[:20]}; stock TVM failed {stock_failed}{'' if args.stock else ' of those'}; "
          f"{time.time() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
