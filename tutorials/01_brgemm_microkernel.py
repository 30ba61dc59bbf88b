"""Tutorial 1: the BRGEMM microkernel, a tensorized direct convolution, and its assembly.

What you will see:
1. a batch-reduce GEMM described as data and registered as a TVM tensor intrinsic;
2. a direct convolution in blocked layout (NCHW[x]c / OIHW[x]i[y]o), generated as TensorIR and
   tensorized onto it, with bias and ReLU fused into the row write;
3. its result checked against a float64 NumPy reference;
4. the inner loop of the generated assembly: vector FMAs, no spills.

Run: python tutorials/01_brgemm_microkernel.py [--small]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import tvm
from tvm import s_tir

import tvm_ext
from tvm_ext.asm import inner_loop
from tvm_ext.intrin.cpu import BRGEMM, get_brgemm_intrin
from tvm_ext.kernels import conv2d as K


def main(small: bool = False) -> None:
    target = tvm_ext.resolve_target("llvm")  # plain "llvm" means this host, with its vector ISA
    isa = tvm_ext.vector_isa(target)
    print(f"target {target}  ->  {isa.name}: {isa.lanes} fp32 lanes, {isa.registers} vector registers")

    # 1. The microkernel as data. C[m, n] += sum_batch sum_k A[batch, m, k] * B[batch, k, n]; the
    #    m_r x n_r tile of C stays in registers for the whole reduction.
    spec = BRGEMM(m_r=4, n_r=3 * isa.lanes, k=16, lanes=isa.lanes, batch=(4, 3, 3))
    print(f"\n1. {spec.name}: needs {spec.registers()} of {isa.registers} registers")
    try:
        BRGEMM(m_r=isa.registers, n_r=2 * isa.lanes, k=16, lanes=isa.lanes).validate(isa)
    except ValueError as err:
        print(f"   a tile too large is refused: {err}")
    get_brgemm_intrin(spec)  # generated and registered once, cached by name

    # 2. A convolution in blocked layout: the plan chooses the channel blocks and register tile.
    C, H, W, KO = (32, 14, 14, 64) if small else (128, 28, 28, 128)
    wl = K.Conv2dWorkload.make((1, C, H, W), (KO, C, 3, 3), stride=1, padding=1)
    plan = K.plan_conv2d(wl, isa)
    print(f"\n2. conv {C}x{H}x{W} -> {KO}, 3x3: kernel={plan.kind} tile={plan.m_r}x{plan.oc_bn} "
          f"input block={plan.ic_bn}; extra bytes for the zero border: {plan.pad_bytes()}")
    # The kernel is TensorIR generated from the plan: one parallel task per output row, the row
    # split into whole m_r tiles and a tail, each a block that the schedule tensorizes.
    epilogue = K.Epilogue(bias=True, activation="relu")  # fused into the row while it is in L1
    func = K.conv2d_blocked_func(plan, epilogue)
    print("   blocks:", [name for name, _, _ in plan.row_segments()] + ["epilogue"])
    sch = s_tir.Schedule(func)
    K.schedule_conv2d_blocked(sch, plan, isa.lanes)  # split into m_r tiles, tensorize
    lib = tvm.compile(sch.mod, target)

    # 3. Check against NumPy (float64) on random data.
    rng = np.random.default_rng(0)
    xv = rng.standard_normal(plan.data_shape(), dtype=np.float32)
    xv[:, :, 0, :, :] = xv[:, :, -1, :, :] = xv[:, :, :, 0, :] = xv[:, :, :, -1, :] = 0  # the zero border
    wv = rng.standard_normal(plan.weight_shape(), dtype=np.float32)
    bv = rng.standard_normal((plan.OCB, plan.oc_bn), dtype=np.float32)
    yv = tvm.runtime.empty(plan.out_shape(), "float32", tvm.cpu())
    lib(tvm.runtime.tensor(xv), tvm.runtime.tensor(wv), tvm.runtime.tensor(bv), yv)
    ref = np.zeros(plan.out_shape())
    for r in range(3):
        for s in range(3):
            ref += np.einsum("nchwi,bcio->nbhwo", xv[:, :, r:r + H, s:s + W].astype(np.float64), wv[:, :, r, s])
    ref = np.maximum(ref + bv[None, :, None, None, :], 0)
    err = np.abs(yv.numpy() - ref).max() / np.abs(ref).max()
    print(f"\n3. conv + bias + relu, relative error against float64 NumPy: {err:.1e}")
    assert err < 1e-4

    fn = lib.mod["main"]
    args = [tvm.runtime.tensor(xv), tvm.runtime.tensor(wv), tvm.runtime.tensor(bv), yv]
    fn(*args)
    start = time.perf_counter()
    runs = 20
    for _ in range(runs):
        fn(*args)
    ms = (time.perf_counter() - start) / runs * 1e3
    print(f"   {ms:.3f} ms, {wl.flops / ms / 1e6:.1f} GFLOP/s")

    # 4. The assembly: the loop with the most FMAs is one k step of the register tile.
    loop = inner_loop(lib.mod.inspect_source("asm"), isa)
    print(f"\n4. inner loop {loop.label}: {loop.fma} vector FMAs ({loop.fma_on_isa_registers} on full "
          f"{isa.name} registers), spilled stack slots: {loop.stack_accesses}")
    for line in [ln for ln in loop.lines if ln.split()[0].startswith(isa.asm_fma)][:4]:
        print("   ", line)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="a small layer (CI)")
    main(ap.parse_args().small)
