"""Generate the CUDA C of tvm_ext's maxDNN convolution for the GPU check's layers (no GPU needed).

Writes one .cu file per layer and engine (FFMA; Winograd F(4x4) on the FFMA tile, for the layers
it can run; tf32 tensor cores through mma.sync and, for Hopper, wgmma), for ResNet-50's layers
also their training gradients on the FFMA tile (dX per stride phase, dW as x^T conv dY^T: the
kernels a training graph runs), and manifest.json (shapes, each kernel's launch and parameter
order, and a gradient's layer) into --out. bench/gpu_check.py compiles and runs
them with nvcc and CuPy on a GPU machine, so that machine needs no TVM: apache-tvm's wheel is
100 MB and the GPU machines lent here take 64 MiB.

    python bench/gpu_export.py --out bench/gpu_kernels            # AlexNet/OverFeat b128, ResNet-50 b32
    python bench/gpu_export.py --out /tmp/k --sets alexnet --batch 4 --layers 2
    python bench/gpu_export.py --train-sets              # no training passes (dX, dW of resnet50's layers)
    python bench/gpu_export.py --sass ...     # with each k loop's SASS instruction mix
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# maxDNN measured AlexNet and OverFeat at batch 128; the issue asks for ResNet-50 at batch 32.
DEFAULT_SETS = {"alexnet": 128, "overfeat": 128, "resnet50": 32}


def load_layers(name: str) -> list[dict]:
    for path in (HERE / "workloads.json", HERE.parent.parent / "shared" / "workloads.json"):
        if path.exists():
            return json.loads(path.read_text())[name]
    raise FileNotFoundError("workloads.json not found in bench/ or ../shared/")


def sass_loop(source: str, arch: str) -> dict:
    """The k loop's SASS instruction mix for `arch` (nvcc and nvdisasm here): what bounds the
    share of the FFMA peak the kernel can reach, to read next to what the GPU measures."""
    from tvm_ext.kernels.cuda import toolchain

    arch = wgmma_arch(source, arch)
    loop = toolchain.sass_loop_instructions(toolchain.disassemble(toolchain.compile_source(source, arch, "cubin")))
    mix = {"arch": arch, "instructions": sum(loop.values()), "ffma": loop["FFMA"], "hmma": loop["HMMA"],
           "hgmma": loop["HGMMA"], "lds": loop["LDS"]}
    if loop["HGMMA"]:  # whether ptxas waits for every wgmma right after issuing it (C7513 and kin)
        mix["serialized_wgmma"] = toolchain.ptxas_resources(source, arch)["serialized_wgmma"]
    return mix


def wgmma_arch(source: str, arch: str) -> str:
    """The arch a kernel compiles for: wgmma exists only in sm_90a, Hopper's arch-specific target."""
    return arch + "a" if "wgmma" in source and arch == "sm_90" else arch


ENGINES = ("ffma", "ffma:maxdnn", "winograd", "mma_tf32", "mma_tf32:64", "wgmma_tf32")  # the default variants
# a training step's three convolutions of a layer, for the layers of TRAIN_SETS (the gradients on
# the "ffma" engine); the other sets' layers run forward only
PASSES = ("forward", "data_gradient", "weight_gradient")
TRAIN_SETS = ("resnet50",)


def pass_workloads(wl, passes: tuple[str, ...] = PASSES) -> list[tuple[str, dict, object]]:
    """(pass, its manifest fields, the forward convolution its kernel computes) for layer `wl`,
    as a training graph runs them (tvm_ext.transform.gradients): dX as a stride-1 convolution of
    dY per stride phase (one at stride 1; phases no tap reaches are zeros, no kernel), dW as the
    convolution of x^T with dY^T (groups=1 only: a grouped dW stays with stock TVM)."""
    from tvm_ext.kernels.conv2d import Conv2dWorkload
    from tvm_ext.kernels.conv2d_backward_data import data_gradient_phases
    from tvm_ext.transform.gradients import weight_gradient_as_conv2d

    out = [("forward", {}, wl)] if "forward" in passes else []
    if "data_gradient" in passes:
        phases = [p for p in data_gradient_phases(wl) if not p.zero]
        for p in phases:
            dx = Conv2dWorkload.make((wl.N, wl.K, p.rows[1] - p.rows[0], p.cols[1] - p.cols[0]),
                                     (wl.C, wl.K // wl.groups, len(p.taps_h), len(p.taps_w)), 1, p.padding,
                                     p.dilation, wl.groups)
            out.append(("data_gradient", {"phase": [p.a, p.b], "phases": len(phases)}, dx))
    if "weight_gradient" in passes and wl.groups == 1:
        out.append(("weight_gradient", {}, weight_gradient_as_conv2d(wl)))
    return out


def export(out: Path, sets: dict[str, int], layers: int | None, arch: str, engines: tuple[str, ...] = ENGINES,
           sass: bool = False, train_sets: tuple[str, ...] = TRAIN_SETS) -> list[dict]:
    from tvm_ext.kernels.conv2d import Conv2dWorkload
    from tvm_ext.kernels.cuda import maxdnn as cc
    from tvm_ext.kernels.cuda import winograd as cw

    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for set_name, batch in sets.items():
        for index, layer in enumerate(load_layers(set_name)[:layers]):
            # a training step's passes: the first layer's input is the images, which need no dX
            passes = ("forward",) if set_name not in train_sets else PASSES if index else ("forward", "weight_gradient")
            groups = layer.get("groups", 1)
            layer_wl = Conv2dWorkload.make((batch, layer["C"], layer["H"], layer["W"]),
                                           (layer["K"], layer["C"] // groups, layer["R"], layer["S"]),
                                           stride=layer["stride"], padding=layer["pad"], groups=groups)
            for pass_name, pass_fields, wl, variant in ((p, f, w, v) for p, f, w in pass_workloads(layer_wl, passes)
                                                       for v in engines if p == "forward" or v == "ffma"):
                engine, _, warp_rows = variant.partition(":")
                start = time.perf_counter()
                target = {"kind": "cuda", "arch": "sm_90a" if engine.startswith("wgmma") else arch}
                if engine.startswith("winograd"):  # every layer it can run, chosen by the strategy's estimate or not
                    if cw.eligible(wl):
                        continue
                    plan = cw.WinogradPlan.make(wl, int(warp_rows or cw.TILE))  # "winograd:2": F(2x2)
                    source = cw.cuda_source(plan, target)
                elif warp_rows == "maxdnn":  # maxDNN's 64 x 64 tile of 8 x 8 threads, against choose_tile's
                    plan = cc.MaxDNNPlan.make(wl, cc.BlockTile()).with_chosen_splits()
                    source = cc.cuda_source(plan, target)
                elif warp_rows in ("shared", "static"):
                    # wgmma with its A fragments from a shared tile, not gathered; or with 0.5.7's
                    # tiles, which fit 48 KB of static shared memory (128 x 64, not 128 x 128)
                    tile = cc.choose_tile(wl.K // wl.groups, engine, columns=wl.N * wl.OH * wl.OW)
                    tile = (dataclasses.replace(tile, gather_fragments=False) if warp_rows == "shared"
                            else dataclasses.replace(tile, cols=64 if tile.rows > 64 else 128))
                    plan = cc.MaxDNNPlan.make(wl, tile).with_chosen_splits()
                    source = cc.cuda_source(plan, target)
                else:
                    tile = cc.choose_tile(wl.K // wl.groups, engine, columns=wl.N * wl.OH * wl.OW)
                    if warp_rows:  # a taller warp slab: rows in whole slabs
                        rows = 128 if (wl.K // wl.groups) % 128 == 0 else 64
                        tile = dataclasses.replace(tile, rows=rows, warp_rows=int(warp_rows))
                    plan = cc.MaxDNNPlan.make(wl, tile).with_chosen_splits()  # split-K as the graph strategy
                    source = cc.cuda_source(plan, target)
                engine = (variant.replace("winograd:", "winograd_f").replace(":shared", "_shared")
                          .replace(":static", "_static").replace(":maxdnn", "_maxdnn").replace(":", "_w"))
                name = f"{set_name}_{layer['name']}_{engine}"
                if pass_name == "data_gradient":
                    name += "_dx{}{}".format(*pass_fields["phase"])
                elif pass_name == "weight_gradient":
                    name += "_dw"
                (out / f"{name}.cu").write_text(source)
                entries.append(_entry(name, set_name, layer["name"], engine, wl, plan, source))
                if pass_name != "forward":  # the layer whose gradient this is, for cuDNN's own pass
                    entries[-1].update(pass_fields, **{"pass": pass_name}, of=_shapes(layer_wl))
                mix = ""
                if sass:
                    loop = entries[-1]["sass_loop"] = sass_loop(source, arch)
                    mix = (f" k loop: {loop['instructions']} instructions, "
                           f"{100 * (loop['ffma'] or loop['hmma'] or loop['hgmma']) / loop['instructions']:.1f}% "
                           f"{'FFMA' if loop['ffma'] else 'HMMA' if loop['hmma'] else 'HGMMA'}"
                           + (", wgmma serialized by ptxas" if loop.get("serialized_wgmma") else ""))
                if engine.startswith("winograd"):
                    direct_ms, winograd_ms = entries[-1]["estimate_ms"]
                    shape = (f"F({plan.m}x{plan.m}) GEMM tile {plan.gemm.tile.rows}x{plan.gemm.tile.cols} grid "
                             f"{plan.gemm.grid}, estimated {direct_ms / winograd_ms:.2f}x direct")
                else:
                    shape = f"tile {plan.tile.rows}x{plan.tile.cols} grid {plan.grid}"
                    if plan.tile.engine == "ffma":
                        shape += f" threads {plan.tile.thread_rows}x{plan.tile.thread_cols}"
                    shape += f" split-K {plan.splits}" if plan.splits > 1 else ""
                print(f"{name:36s} {shape}{mix} ({time.perf_counter() - start:.1f} s)", flush=True)
    (out / "manifest.json").write_text(json.dumps({"arch": arch, "layers": entries}, indent=1))
    return entries


def _shapes(wl) -> dict:
    return {"x_nchw": [wl.N, wl.C, wl.H, wl.W], "w_oihw": [wl.K, wl.C // wl.groups, wl.KH, wl.KW],
            "stride": list(wl.stride), "padding": list(wl.padding), "dilation": list(wl.dilation),
            "groups": wl.groups}


def _entry(name: str, set_name: str, layer: str, engine: str, wl, plan, source: str) -> dict:
    """The manifest entry bench/gpu_check.py launches and checks the layer from: its tensors'
    shapes ("params") and its kernels in launch order ("launches"), each with its arguments."""
    from tvm_ext.kernels.cuda import maxdnn as cc
    from tvm_ext.kernels.cuda import winograd as cw

    entry = {"name": name, "set": set_name, "layer": layer, "engine": engine, "file": f"{name}.cu", **_shapes(wl),
             "flops": wl.flops}
    if isinstance(plan, cw.WinogradPlan):  # input transform, the a² GEMMs, output transform
        _, g, _ = plan.matrices
        entry.update(tile=[plan.gemm.tile.rows, plan.gemm.tile.cols],
                     thread_tile=[plan.gemm.tile.thread_rows, plan.gemm.tile.thread_cols], splits=1, k_order="winograd",
                     winograd={"m": plan.m, "G": g.tolist()}, estimate_ms=list(cw.estimate(plan)),
                     params={k: list(v) for k, v in plan.shapes().items()})
        entry["launches"] = [
            {"kernel": f"{cw.KERNEL_NAME}_{stage}_kernel", "grid": list(grid), "block": list(block),
             "shared_bytes": plan.shared_bytes(stage), "cuda_args": cw.cuda_param_order(plan, source, stage)}
            for stage, (grid, block) in plan.launches().items()]
        return entry
    entry.update(tile=[plan.tile.rows, plan.tile.cols], thread_tile=[plan.tile.thread_rows, plan.tile.thread_cols],
                 splits=plan.splits, k_order=plan.k_order,
                 params={k: list(v) for k, v in {**plan.shapes(), **plan.reduce_shapes()}.items()})
    if plan.tile.wgmma is not None:  # the weights packed per block and k step (pack_wgmma_weight)
        entry["wgmma"] = {"rows": plan.tile.rows, "k_step": plan.tile.k_step, "per_reg": plan.tile.wgmma.per_reg}
    entry["launches"] = [{"kernel": cc.KERNEL_NAME + "_kernel", "grid": list(plan.grid),
                          "block": [plan.tile.threads, 1, 1], "shared_bytes": plan.dynamic_shared_bytes,
                          "cuda_args": cc.cuda_param_order(source)}]
    if plan.splits > 1:  # split-K: a second kernel sums the slices
        kernel = cc.KERNEL_NAME + cc.REDUCE_SUFFIX + "_kernel"
        grid, block = cc.reduce_launch(plan)
        entry["launches"].append({"kernel": kernel, "grid": list(grid), "block": list(block),
                                  "cuda_args": cc.cuda_param_order(source, kernel)})
    return entry


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE / "gpu_kernels")
    parser.add_argument("--sets", nargs="+", default=list(DEFAULT_SETS), choices=["alexnet", "overfeat", "resnet50",
                                                                                   "vgg16"])
    parser.add_argument("--batch", type=int, default=None, help="one batch for every set (default: per set)")
    parser.add_argument("--layers", type=int, default=None, help="first N layers of each set")
    parser.add_argument("--arch", default="sm_90", help="the arch TVM generates for (the source is portable)")
    parser.add_argument("--engines", nargs="+",
                        default=list(ENGINES),
                        choices=["ffma", "ffma:maxdnn", "winograd", "winograd:2", "mma_tf32", "mma_tf32:64",
                                 "mma_bf16", "wgmma_tf32", "wgmma_tf32:shared", "wgmma_tf32:static",
                                 "wgmma_bf16"],
                        help="kernel variants; 'ffma:maxdnn': maxDNN's 64 x 64 tile of 8 x 8 threads (the "
                             "'ffma' tile is choose_tile's, mostly 16 x 8 threads); ':64' = 64-row warp slabs "
                             "(4 x m16 per warp); winograd: fp32 "
                             "F(4x4) on the FFMA tile, for the 3x3 and 5x5 stride-1 layers (':2': F(2x2)); "
                             "wgmma_tf32: Hopper's warpgroup tensor cores (sm_90a; ':shared': A fragments from a "
                             "shared tile instead of gathered from the input; ':static': 128 x 64 tiles where "
                             "the default's 128 x 128 needs dynamic shared memory, as in 0.5.7); wgmma_bf16: "
                             "the same on bf16 (weights packed as bf16 pairs)")
    parser.add_argument("--train-sets", nargs="*", default=list(TRAIN_SETS),
                        help="sets whose layers also get a training step's gradients, dX (a kernel per stride "
                             "phase) and dW, on the FFMA tile (none: forward only)")
    parser.add_argument("--sass", action="store_true",
                        help="also record each kernel's k-loop SASS mix for --arch (needs nvcc and nvdisasm)")
    args = parser.parse_args(argv)
    sets = {name: args.batch or DEFAULT_SETS.get(name, 32) for name in args.sets}
    export(args.out, sets, args.layers, args.arch, tuple(args.engines), args.sass, tuple(args.train_sets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
