"""Tutorial 4: the maxDNN convolution tile for CUDA, generated and inspected (GPU optional).

What you will see:
1. the 8x8-per-thread FFMA outer product (maxDNN's; and the 16x8 one the strategy mostly picks)
   described as data and registered as a tensor intrinsic;
2. the implicit-GEMM convolution (64x64 block tile or larger, double-buffered shared memory, float4 loads,
   one barrier per k step, output staged through shared memory), generated as TensorIR with its
   updates tensorized, and the CUDA C TVM makes of it;
3. what nvcc makes of that for sm_90: instruction counts in the PTX, registers and spills, the
   k loop's SASS (with nvdisasm), and the tensor-core variants of the same block: mma.sync tf32
   per warp, and Hopper's asynchronous wgmma per warpgroup (sm_90a);
4. its numbers: on the GPU if there is one, else on the CPU emulator (the same CUDA C, compiled
   with g++, one fiber per CUDA thread);
5. a whole network through `tvm_ext.build(mod, "cuda")`: which kernel serves each op;
6. Winograd on the GPU: a 3x3 layer as an input transform, 36 GEMMs on the same tile and an
   output transform, where the strategy's estimate says it beats the direct tile;
7. the same tile description on this CPU: a register tile of output channels x images (the
   images in the vector lanes), its k loop's assembly, and a convolution on it timed against
   the BRGEMM kernel and checked against float64.

Run: python tutorials/04_cuda_maxdnn_tile.py [--small]
"""

from __future__ import annotations

import argparse
import re
import time

import numpy as np
import tvm

import tvm_ext
from tvm_ext.intrin.cuda import get_outer_product_intrin, thread_tile
from tvm_ext.kernels.conv2d import Conv2dWorkload
from tvm_ext.kernels.cuda import maxdnn, toolchain
from tvm_ext.testing.maxdnn import emulate, emulate_winograd


def main(small: bool = False) -> None:
    # 1. The thread tile as data: C[8x8] += A[k, rows] x B[k, cols] for 8 k, a thread's 8 rows as
    #    two float4 half a tile apart (conflict-free 128-bit shared loads).
    #    A 16x8 thread tile issues 128 FFMA per 6 shared loads instead of 64 per 4: fewer of the
    #    scheduler's issue slots go to loads, so more of the FFMA peak is within reach.
    for spec in (thread_tile(rows=8, cols=8, k_step=8, row_gap=32, col_gap=32), maxdnn.FFMA_TILES[0].thread_tile()):
        print(f"1. {get_outer_product_intrin(spec)}: {spec.fma_per_k()} FFMA per k, "
              f"{(spec.rows + spec.cols) // spec.row_vec} float4 shared loads per k")

    # 2. A convolution layer (OverFeat layer 3, maxDNN's benchmark) and its kernel.
    wl = Conv2dWorkload.make((128, 256, 12, 12), (512, 256, 3, 3), padding=1)
    plan = maxdnn.MaxDNNPlan.make(wl, epilogue=maxdnn.Epilogue(bias=True, activation="relu"))
    m, n, k = plan.gemm
    print(f"\n2. conv {wl.C}x{wl.H}x{wl.W}x{wl.N} -> {wl.K}, 3x3: implicit GEMM {m}x{n}x{k}, "
          f"tile {plan.tile.rows}x{plan.tile.cols}, {plan.tile.threads} threads of "
          f"{plan.tile.thread_rows}x{plan.tile.thread_cols}, grid {plan.grid}, "
          f"{plan.tile.shared_bytes()} B shared")
    print(f"   96 filters get a {maxdnn.choose_tile(96).rows}-row tile (maxDNN's 64 wasted a quarter); "
          f"FFMA share of a thread's instructions: {100 * plan.tile.ffma_issue_share():.1f}% "
          f"(maxDNN's 64x64: {100 * maxdnn.BlockTile().ffma_issue_share():.1f}%)")
    source = maxdnn.cuda_source(plan, "nvidia/nvidia-h100")
    shared = re.findall(r"__shared__[^;]*?(\w+_sh\w*)\[", source)
    print(f"   CUDA C: {len(source.splitlines())} lines; shared arrays: {shared}; "
          f"__syncthreads: {source.count('__syncthreads')} for {plan.code_steps} k steps written out")

    # 3. Machine code.
    if toolchain.have_nvcc():
        counts = toolchain.ptx_instructions(toolchain.compile_source(source, "sm_90").decode())
        fma = sum(v for op, v in counts.items() if op.startswith("fma.rn"))
        print(f"\n3. sm_90 PTX: {fma} FFMA ({fma // plan.code_steps // plan.tile.k_step} per thread per k), "
              f"{counts['ld.shared.v4.f32']} ld.shared.v4.f32, {counts['ld.global.nc.v4.f32']} ld.global.nc.v4.f32, "
              f"{counts['bar.sync']} bar.sync")
        print(f"   ptxas: {toolchain.ptxas_resources(source, 'sm_90')}")
        loop = toolchain.main_loop_instructions(toolchain.compile_source(source, "sm_90").decode())
        loop_fma = sum(v for op, v in loop.items() if op.startswith("fma.rn"))
        print(f"   the k loop issues {sum(loop.values())} PTX instructions per pair of k steps, "
              f"{loop_fma} of them FFMA ({100 * loop_fma / sum(loop.values()):.0f}%)")
        if toolchain.find_nvdisasm() is not None:  # what the GPU issues: one warp instruction a cycle
            cubin = toolchain.compile_source(source, "sm_90", "cubin")
            sass = toolchain.sass_loop_instructions(toolchain.disassemble(cubin))
            print(f"   in SASS: {sum(sass.values())} instructions, {sass['FFMA']} FFMA "
                  f"({100 * sass['FFMA'] / sum(sass.values()):.1f}%: the most of the FFMA peak it can reach)")
        # The tensor-core variant: the same block, its compute as mma.sync m16n8k8 (tf32) per warp.
        tc_plan = maxdnn.MaxDNNPlan.make(wl, maxdnn.BlockTile(engine="mma_tf32"), plan.epilogue)
        tc_counts = toolchain.ptx_instructions(toolchain.compile_source(maxdnn.cuda_source(tc_plan), "sm_90").decode())
        mma = sum(v for op, v in tc_counts.items() if op.startswith("mma.sync"))
        print(f"   tensor-core tile: {mma} mma.sync.m16n8k8.tf32 ({mma // tc_plan.code_steps} per warp per k step)")
        # Hopper: one warpgroup issues wgmma m64nNk8 per 64-column slab, N = the block's rows; its B
        # operand (the weights' tile) is read by the tensor cores from shared memory via a descriptor.
        wg_plan = maxdnn.MaxDNNPlan.make(wl, maxdnn.choose_tile(wl.K, "wgmma_tf32"), plan.epilogue)
        wg_source = maxdnn.cuda_source(wg_plan, "cuda -arch=sm_90a")
        wg_counts = toolchain.ptx_instructions(toolchain.compile_source(wg_source, "sm_90a").decode())
        wgmma = sum(v for op, v in wg_counts.items() if op.startswith("wgmma.mma_async"))
        print(f"   wgmma tile {wg_plan.tile.rows}x{wg_plan.tile.cols}: {wgmma} "
              f"{wg_plan.tile.wgmma.opcode(wg_plan.tile.rows)} ({wgmma // wg_plan.code_steps} per k step), "
              + ("one group left in flight across each barrier" if wg_plan.wgmma_in_flight
                 else "each waited for after the next tile's shared stores"))
    else:
        print("\n3. nvcc is not installed: no PTX to look at")

    # 4. Numbers.
    small_wl = Conv2dWorkload.make((4, 16, 10, 9), (70, 16, 3, 3), padding=1) if small else \
        Conv2dWorkload.make((8, 64, 14, 14), (96, 64, 3, 3), padding=1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((small_wl.N, small_wl.C, small_wl.H, small_wl.W)).astype(np.float32)
    w = rng.standard_normal((small_wl.K, small_wl.C, 3, 3)).astype(np.float32)
    bias = rng.standard_normal(small_wl.K).astype(np.float32)
    ref = _reference(x, w, bias)
    if tvm.cuda(0).exist:
        got = tvm_ext.ops.conv2d(x, w, bias, padding=1, target="cuda")
        where = f"on the GPU ({tvm.cuda(0).device_name})"
    else:
        small_plan = maxdnn.MaxDNNPlan.make(small_wl, epilogue=maxdnn.Epilogue(bias=True))
        start = time.perf_counter()
        y = emulate(small_plan, maxdnn.kernel_arrays(small_plan, x, w, bias))
        got = maxdnn.output_to_nchw(y)
        where = f"on the CPU emulator ({time.perf_counter() - start:.1f} s, no GPU here)"
    err = np.abs(got - ref).max() / np.abs(ref).max()
    print(f"\n4. conv {small_wl.C}x{small_wl.H}x{small_wl.W}x{small_wl.N} -> {small_wl.K} {where}: "
          f"relative error against float64 NumPy {err:.1e}")
    if not tvm.cuda(0).exist:  # the wgmma tiles on the emulator: tf32 and bf16 (10 and 7 mantissa bits
        for engine in ("wgmma_tf32", "wgmma_bf16"):  # read), so about 1e-3 of fp32's answer
            wg_plan = maxdnn.MaxDNNPlan.make(small_wl, maxdnn.choose_tile(small_wl.K, engine),
                                             maxdnn.Epilogue(bias=True))
            wg_got = maxdnn.output_to_nchw(emulate(wg_plan, maxdnn.kernel_arrays(wg_plan, x, w, bias),
                                                          maxdnn.cuda_source(wg_plan, "cuda -arch=sm_90a")))
            wg_err = np.abs(wg_got - ref).max() / np.abs(ref).max()
            print(f"   the {engine} tile on the emulator: relative error {wg_err:.1e}")

    # 5. A network for CUDA: our kernels where they apply, stock TVM (with a reason) elsewhere.
    mod, _ = tvm_ext.models.get("resnet18", batch=8)
    report = tvm_ext.dispatch_report(mod, "cuda -arch=sm_90")
    served = sum(r.kernel != "fallback" for r in report)
    print(f"\n5. ResNet-18 for CUDA: {served} of {len(report)} ops served by tvm_ext kernels")
    print("\n".join(str(report).splitlines()[:6]))
    if not small:
        start = time.perf_counter()
        ex = tvm_ext.build(mod, "cuda -arch=sm_90")
        kernels = toolchain.kernel_names(toolchain.executable_cuda_source(ex))
        print(f"   built in {time.perf_counter() - start:.0f} s: {len(kernels)} CUDA kernels, "
              f"{sum('maxdnn' in k for k in kernels)} of them maxDNN convolutions")
    winograd(small_wl, x, w, bias, ref)
    cpu_tile(small)


def winograd(small_wl: Conv2dWorkload, x: np.ndarray, w: np.ndarray, bias: np.ndarray, ref: np.ndarray) -> None:
    """Step 6: the strategy's choice for OverFeat layer 3 at batch 128, and a small layer's numbers."""
    from tvm_ext.kernels.cuda import winograd as cw
    from tvm_ext.strategy.cuda_engine import conv2d_decision

    layer = Conv2dWorkload.make((128, 256, 12, 12), (512, 256, 3, 3), padding=1)
    kernel, reason, plan = conv2d_decision(layer, "ffma", winograd=True)
    print(f"\n6. OverFeat L3 at batch 128 for CUDA: {kernel}, {reason}")
    print(f"   kernels: {', '.join(f'{stage} grid {grid}' for stage, (grid, _) in plan.launches().items())}; "
          f"V and M: {plan.traffic_bytes() / 2e6:.0f} MB written and read")
    small = cw.WinogradPlan.make(small_wl, epilogue=maxdnn.Epilogue(bias=True))
    arrays = cw.kernel_arrays(small, x, w, bias)
    y = cw.run_on_gpu(small, arrays) if tvm.cuda(0).exist else emulate_winograd(small, arrays)
    err = np.abs(maxdnn.output_to_nchw(y) - ref).max() / np.abs(ref).max()
    print(f"   F(4x4, 3x3) on the small layer, {'GPU' if tvm.cuda(0).exist else 'emulator'}: relative error "
          f"against float64 NumPy {err:.1e} (direct: the tile's rounding only; Winograd's transforms add some)")


def cpu_tile(small: bool) -> None:
    """Step 7: the tile's description (OuterTile, outer_description) generating the CPU kernel."""
    from tvm_ext.asm import inner_loop
    from tvm_ext.intrin.cpu_outer import get_cpu_outer_intrin
    from tvm_ext.intrin.outer_tile import OuterTile, outer_description
    from tvm_ext.kernels import conv2d as blocked
    from tvm_ext.kernels import conv2d_maxdnn as mx

    target = tvm_ext.resolve_target("llvm")
    isa = tvm_ext.vector_isa(target)
    layer = Conv2dWorkload.make((32, 64, 13, 13), (96, 64, 3, 3), padding=1) if small else \
        Conv2dWorkload.make((128, 192, 13, 13), (384, 192, 3, 3), padding=1)  # AlexNet conv3, batch 128
    plan = mx.MaxDNNCpuPlan.make(layer, isa)
    # step 1's data, one contiguous group of rows and of columns, reducing the 9 filter taps too
    cpu = plan.tile
    assert cpu == OuterTile.contiguous(cpu.rows, cpu.cols, cpu.k_step, (3, 3), (1, 1), init=True)
    lines = [line.strip() for line in outer_description(cpu).script().splitlines()]
    update = next(line for line in lines if line.startswith("C[") and " + " in line)
    print(f"\n7. The CPU ({isa.name}): {get_cpu_outer_intrin(cpu, isa)}, {cpu.rows} output channels x "
          f"{cpu.cols} images ({cpu.cols // isa.lanes} vectors) over 3x3 taps x {cpu.k_step} channels a call; "
          f"step 1's description: {update}")
    func = mx.maxdnn_conv2d_kernel(plan, mx.Epilogue(bias=True, activation="relu"))
    lib = tvm.compile(tvm.IRModule({"conv": func}), target)
    loop = inner_loop(lib.mod.inspect_source("asm"), isa)
    print(f"   its k loop: {loop.fma} FMAs on {isa.asm_register} registers, {loop.stack_accesses} spills; the first:")
    print("\n".join(f"     {line}" for line in loop.lines[:6]))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((layer.N, layer.C, layer.H, layer.W)).astype(np.float32)
    w = rng.standard_normal((layer.K, layer.C, 3, 3)).astype(np.float32)
    b = rng.standard_normal(layer.K).astype(np.float32)
    args = [tvm.runtime.tensor(a) for a in (mx.pack_data(plan, x), mx.pack_weight(plan, w), mx.pack_bias(plan, b))]
    y = tvm.runtime.empty(plan.out_shape(), "float32", tvm.cpu())
    lib["conv"](*args, y)
    ref = np.maximum(_reference(x, w, b), 0)
    err = np.abs(mx.unpack_output(plan, y.numpy()) - ref).max() / np.abs(ref).max()
    bplan = blocked.plan_conv2d(layer, isa)
    blib = tvm.compile(blocked.conv2d_blocked_kernel(bplan, isa.lanes, blocked.Epilogue()), target)
    bargs = [tvm.runtime.tensor(rng.standard_normal(s).astype(np.float32)) for s in (bplan.data_shape(),
                                                                                   bplan.weight_shape())]
    bargs.append(tvm.runtime.empty(blocked.Epilogue().out_shape(bplan), "float32", tvm.cpu()))
    times: dict[str, list[float]] = {"maxdnn": [], "brgemm": []}
    for _ in range(3 if small else 5):  # alternated, medians: this machine may be shared
        for name, run in (("maxdnn", lambda: lib["conv"](*args, y)), ("brgemm", lambda: blib.mod["main"](*bargs))):
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    gflops = {name: layer.flops / np.median(t) / 1e9 for name, t in times.items()}
    print(f"   conv {layer.C}x{layer.H}x{layer.W}x{layer.N} -> {layer.K}: relative error against float64 NumPy "
          f"{err:.1e}; {gflops['maxdnn']:.0f} GFLOP/s on the tile, {gflops['brgemm']:.0f} on the BRGEMM kernel "
          f"({tvm.get_global_func('runtime.NumThreads')()} threads)")


def _reference(x: np.ndarray, w: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """Float64 3x3 convolution, padding 1."""
    n, c, h, wd = x.shape
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    out = np.zeros((n, w.shape[0], h, wd))
    for i in range(3):
        for j in range(3):
            out += np.einsum("nchw,kc->nkhw", xp[:, :, i:i + h, j:j + wd], w[:, :, i, j].astype(np.float64))
    return out + bias[None, :, None, None]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="smaller problems, skip the network build")
    main(parser.parse_args().small)
