"""The BRGEMM and depthwise microkernels: generated from one description, refused when they would
spill, and compiled to vector FMAs with no spills in the inner loop (checked in the assembly)."""

import re

import numpy as np
import pytest
import tvm
from tvm import s_tir, te
from tvm.s_tir import TensorIntrin

from tvm_ext.asm import fma_blocks, inner_loop
from tvm_ext.intrin.cpu import (
    BRGEMM,
    brgemm_from_name,
    default_tile,
    get_brgemm_intrin,
    register_named,
    register_tiles,
    tile_efficiency,
)
from tvm_ext.intrin.cpu_depthwise import DepthwiseTile, get_depthwise_intrin
from tvm_ext.kernels.common import KERNEL_ATTR
from tvm_ext.kernels.conv2d import Conv2dWorkload, Epilogue, conv2d_blocked_kernel, plan_conv2d, row_order_tiles
from tvm_ext.target import AVX2, AVX512, NEON, resolve_target, vector_isa

AVX2_TARGET = "llvm -mcpu=znver3"
AVX512_TARGET = "llvm -mcpu=skylake-avx512"
NEON_TARGET = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a72"}


def test_tile_register_budget():
    BRGEMM(6, 16, 16, 8).validate(AVX2)
    BRGEMM(4, 24, 16, 8).validate(AVX2)
    with pytest.raises(ValueError, match="17 vector registers"):
        BRGEMM(7, 16, 16, 8).validate(AVX2)  # measured about 3x slower: it spills
    BRGEMM(14, 32, 16, 16).validate(AVX512)
    with pytest.raises(ValueError, match="multiple of the 8 lanes"):
        BRGEMM(6, 12, 16, 8).validate()
    with pytest.raises(ValueError, match="float32, bfloat16, int8"):
        BRGEMM(6, 16, 16, 8, dtype="float16").validate()
    assert all(BRGEMM(m, n, 1, isa.lanes).registers() <= isa.registers
               for isa in (AVX2, AVX512, NEON) for m, n in register_tiles(isa))


def test_default_tiles_follow_the_isa():
    lanes_choices = lambda isa: [isa.lanes * v for v in (1, 2, 3, 4)]  # noqa: E731
    assert default_tile(AVX2, lanes_choices(AVX2), 56) in {(6, 16), (4, 24)}
    m, n = default_tile(AVX512, lanes_choices(AVX512), 56)
    assert n % 16 == 0 and BRGEMM(m, n, 1, 16).registers() <= 32 and m * n // 16 >= 24
    assert default_tile(AVX2, lanes_choices(AVX2), 3)[0] == 3  # never wider than the row
    assert tile_efficiency(6, 2) == 1.0 and tile_efficiency(14, 1) < 1.0


@pytest.mark.parametrize("isa", [AVX2, AVX512])
def test_strided_1x1_plans_rows_outer(isa):
    """A strided 1x1 reads its sparse input once (rows outer) unless its weights outgrow the
    last-level cache; every other layer keeps each output block's weights over the rows (blocks
    outer)."""
    def order(x_shape, w_shape, stride, padding=0):
        return plan_conv2d(Conv2dWorkload.make(x_shape, w_shape, stride, padding), isa).row_order

    assert order((1, 256, 56, 56), (512, 256, 1, 1), 2) == "oh_ob"
    assert order((1, 512, 28, 28), (1024, 512, 1, 1), 2) == "oh_ob"  # 2 MB of weights
    assert order((1, 1024, 14, 14), (2048, 1024, 1, 1), 2) == "ob_oh"  # 8 MB
    assert order((1, 64, 30, 31), (48, 64, 1, 1), (1, 2)) == "oh_ob"
    assert order((1, 256, 56, 56), (64, 256, 1, 1), 1) == "ob_oh"
    assert order((1, 128, 56, 56), (128, 128, 3, 3), 2, 1) == "ob_oh"
    forced = plan_conv2d(Conv2dWorkload.make((1, 64, 8, 8), (64, 64, 1, 1), 2), isa, row_order="ob_oh")
    assert forced.row_order == "ob_oh"


@pytest.mark.parametrize("isa", [AVX2, AVX512])
def test_small_images_run_inside_output_blocks(isa):
    """From 4 images a call, outputs of at most 64 pixels run their images inside each output
    block (its weights read once for all); fewer images, or larger outputs, keep images outer."""
    def order(x_shape, w_shape, stride=1, padding=0, groups=1):
        return plan_conv2d(Conv2dWorkload.make(x_shape, w_shape, stride, padding, 1, groups), isa).row_order

    assert order((4, 512, 7, 7), (2048, 512, 1, 1)) == "ob_n_oh"
    assert order((4, 1024, 14, 14), (2048, 1024, 1, 1), 2) == "ob_n_oh"  # 7 x 7 out, rows outer otherwise
    assert order((8, 9216, 1, 16), (9216, 256, 1, 1), groups=36) == "ob_n_oh"  # a Winograd GEMM
    assert order((4, 512, 8, 8), (512, 512, 3, 3), 1, 1) == "ob_n_oh"
    assert order((2, 512, 7, 7), (2048, 512, 1, 1)) == "ob_oh"
    assert order((4, 256, 14, 14), (1024, 256, 1, 1)) == "ob_oh"
    assert order((4, 256, 9, 8), (1024, 256, 1, 1)) == "ob_oh"  # 72 pixels
    with pytest.raises(ValueError, match="row order 'rows'"):
        row_order_tiles(plan_conv2d(Conv2dWorkload.make((4, 64, 7, 7), (64, 64, 1, 1)), isa, row_order="rows"))


def test_intrinsics_are_generated_once_under_stable_names():
    spec = BRGEMM(4, 24, 8, 8, batch=(2, 3, 3), stride=2, dilation=(1, 2))
    name = get_brgemm_intrin(spec)
    assert name == spec.name == "tvm_ext.brgemm_float32_4x24x8_l8_b2x3x3_s2_d1x2_u1"
    assert get_brgemm_intrin(spec) == name and TensorIntrin.get(name) is not None
    # A one-element batch (a GEMM) and unit dims generate too.
    assert TensorIntrin.get(get_brgemm_intrin(BRGEMM(1, 8, 1, 8))) is not None


def test_batch_shapes_share_one_build():
    """Microkernels that differ only in their batch counts (channel blocks, kh, kw > 1) are one
    built family, specialized to each: concrete shapes and loop extents, nothing symbolic left."""
    from tvm_ext.intrin import cpu

    first = BRGEMM(5, 16, 8, 8, batch=(3, 2, 5), stride=2, init=True)
    second = BRGEMM(5, 16, 8, 8, batch=(7, 3, 3), stride=2, init=True)
    desc, impl = cpu._desc_impl(first)
    misses = cpu._family.cache_info().misses
    desc2, impl2 = cpu._desc_impl(second)
    assert cpu._family.cache_info().misses == misses
    for func, spec in ((desc, first), (impl, first), (desc2, second), (impl2, second)):
        text = func.script()
        assert len(func.params) == 3 and f"A: T.Buffer({spec.a_shape()}" in text
        assert re.search(r"\bb[012]\b", text) is None  # no symbolic batch count left
    assert "T.grid(5, 16, 3, 2, 5, 8)" in desc.script() and "T.grid(5, 16, 7, 3, 3, 8)" in desc2.script()


def test_brgemm_as_plain_gemm_is_correct():
    """A GEMM is a batch-reduce of size one: tensorize a matmul with the same generator."""
    M, N, K = 12, 32, 16
    isa = vector_isa("llvm")
    n_r = isa.lanes * 2
    a = te.placeholder((1, 1, M, K), name="A")
    b = te.placeholder((1, 1, 1, K, N), name="B")
    batch = [te.reduce_axis((0, 1), f"b{d}") for d in range(3)]  # a batch of one
    k = te.reduce_axis((0, K), "k")
    c = te.compute((M, N), lambda i, j: te.sum(a[batch[0], batch[1], i + batch[2], k]
                                                * b[batch[0], batch[1], batch[2], k, j], axis=[*batch, k]),
                   name="C")
    sch = s_tir.Schedule(te.create_prim_func([a, b, c]))
    i, j, *reduction = sch.get_loops(sch.get_sblock("C"))
    io, ii = sch.split(i, [None, 6])
    jo, ji = sch.split(j, [None, n_r])
    sch.reorder(io, jo, ii, ji, *reduction)
    sch.decompose_reduction(sch.get_sblock("C"), ii)
    sch.tensorize(ii, get_brgemm_intrin(BRGEMM(6, n_r, K, isa.lanes)))
    lib = tvm.compile(sch.mod, resolve_target("llvm"))
    rng = np.random.default_rng(0)
    av = rng.standard_normal((1, 1, M, K), dtype=np.float32)
    bv = rng.standard_normal((1, 1, 1, K, N), dtype=np.float32)
    out = tvm.runtime.empty((M, N), "float32", tvm.cpu())
    lib(tvm.runtime.tensor(av), tvm.runtime.tensor(bv), out)
    np.testing.assert_allclose(out.numpy(), av[0, 0].astype(np.float64) @ bv[0, 0, 0], rtol=1e-5, atol=1e-4)


def _conv_asm(target, shape=((1, 64, 14, 14), (64, 64, 3, 3)), padding=1):
    target = resolve_target(target)
    isa = vector_isa(target)
    plan = plan_conv2d(Conv2dWorkload.make(*shape, 1, padding), isa)
    func = conv2d_blocked_kernel(plan, isa.lanes, Epilogue(bias=True, activation="relu"))
    lib = tvm.compile(tvm.IRModule({"conv": func.with_attr("global_symbol", "conv")}), target)
    return plan, isa, lib.mod.inspect_source("asm")


@pytest.mark.parametrize("target, register", [(AVX2_TARGET, "%ymm"), (AVX512_TARGET, "%zmm")])
@pytest.mark.parametrize("shape", [((1, 64, 14, 14), (64, 64, 3, 3)), ((1, 256, 7, 7), (512, 256, 1, 1))])
def test_x86_inner_loop_is_vfmadd_without_spills(target, register, shape):
    plan, isa, asm = _conv_asm(target, shape, padding=1 if shape[1][2] == 3 else 0)
    blocks = fma_blocks(asm, isa)
    step = plan.m_r * plan.oc_bn // isa.lanes  # FMAs of one k step of the full tile
    assert any(b.fma % step == 0 for b in blocks)
    for block in blocks:  # main and tail tiles alike
        assert block.fma_on_isa_registers == block.fma
        assert all(register in ln for ln in block.lines if "vfmadd" in ln)
        assert not block.spills, [ln for ln in block.lines if "rsp" in ln]


@pytest.mark.parametrize("target, register", [(AVX2_TARGET, "%ymm"), (AVX512_TARGET, "%zmm"), (NEON_TARGET, "v")])
def test_emulated_bf16_inner_loop_is_fma_without_spills(target, register):
    """Emulated bf16 (a CPU without AVX512-BF16) widens a row of B's pairs into two: its tiles
    leave room for them and a mask, and the A broadcast stays folded into the FMA on AVX-512
    (widened in registers, LLVM hoisted every row's broadcast and spilled the tile)."""
    target = resolve_target(target)
    isa = vector_isa(target)
    plan = plan_conv2d(Conv2dWorkload.make((1, 64, 14, 14), (64, 64, 3, 3), 1, 1, dtype="bfloat16"), isa,
                       engine="emulated")
    func = conv2d_blocked_kernel(plan, isa.lanes, Epilogue(bias=True, activation="relu"))
    asm = tvm.compile(tvm.IRModule({"conv": func.with_attr("global_symbol", "conv")}), target).mod.inspect_source("asm")
    blocks = fma_blocks(asm, isa)
    step = 2 * plan.m_r * plan.tile_n // isa.lanes  # FMAs of one pair of channels over the tile
    assert "dpbf16" not in asm and any(b.fma % step == 0 for b in blocks)
    for block in blocks:
        assert block.fma_on_isa_registers == block.fma and not block.spills, [ln for ln in block.lines if "sp" in ln]


def test_aarch64_inner_loop_is_fmla_without_spills():
    plan, isa, asm = _conv_asm(NEON_TARGET)
    blocks = fma_blocks(asm, isa)
    assert isa is NEON and inner_loop(asm, isa).fma % (plan.m_r * plan.oc_bn // 4) == 0
    assert all(b.fma_on_isa_registers == b.fma and not b.spills for b in blocks)


def test_spill_detector_sees_a_spill():
    """The check above can fail: a stack slot written and read back inside the loop is a spill."""
    asm = ".LBB0_1:\n vfmadd231ps %ymm1, %ymm2, %ymm3\n vmovups %ymm3, 32(%rsp)\n vmovups 32(%rsp), %ymm4\n"
    assert inner_loop(asm, AVX2).spills
    row_store = ".LBB0_1:\n vfmadd231ps %ymm1, %ymm2, %ymm3\n vmovups %ymm3, 208(%rsp,%r11,4)\n"
    assert not inner_loop(row_store, AVX2).spills


def test_every_generated_function_names_its_kernel():
    isa = vector_isa("llvm")
    for shape, groups in [(((1, 16, 8, 8), (16, 16, 3, 3)), 1), (((1, 16, 8, 8), (16, 1, 3, 3)), 16),
                          (((1, 6, 8, 8), (9, 2, 3, 3)), 3)]:
        plan = plan_conv2d(Conv2dWorkload.make(*shape, 1, 1, 1, groups), isa)
        assert str(conv2d_blocked_kernel(plan, isa.lanes).attrs[KERNEL_ATTR]) == f"{plan.kind}_conv2d"


def test_blocked_kernel_allocates_nothing_but_registers():
    """Blocked in, blocked out: no padded copy, no im2col, no row buffer; only the microkernel's
    accumulator and B-vector arrays (registers after LLVM), and no heap workspace at all."""
    isa = vector_isa("llvm")
    plan = plan_conv2d(Conv2dWorkload.make((1, 64, 28, 29), (64, 64, 3, 3), 1, 1), isa)
    func = conv2d_blocked_kernel(plan, isa.lanes, Epilogue(bias=True, activation="relu"))
    allocs = set(re.findall(r"(\w+) = T\.alloc_buffer", func.script()))
    assert allocs == {"bv"} | {f"acc{i}" for i in range(plan.m_r)} and len(plan.row_segments()) == 2
    # Each output tile is written once, by the microkernel: tensorizing leaves no zero-filling
    # initialization beside it (it did until 0.4.4: every tile was stored twice).
    assert "T.init()" not in func.script()
    lib = tvm.compile(tvm.IRModule({"conv": func.with_attr("global_symbol", "conv")}), resolve_target("llvm"))
    assert "ptr @__TVMBackendAllocWorkspace" not in lib.mod.inspect_source("ll")  # declared, never called


def test_intrinsic_names_parse_back_to_their_brgemm():
    """Tuning records name intrinsics; a fresh process registers them from those names."""
    specs = [BRGEMM(5, 16, 16, 8, (1, 3, 3), init=True, unroll=2),
             BRGEMM(14, 32, 16, 16, (2, 1, 7), stride=2, dilation=(2, 3), unroll=4),
             BRGEMM(1, 8, 3, 8), BRGEMM(6, 16, 16, 8, (4, 1, 1), prefetch=2), BRGEMM(6, 16, 16, 8, prefetch=0),
             BRGEMM(8, 32, 56, 16, (1, 8, 1), stride=2, dilation=(2, 1), a_transposed=True, unroll=4)]
    assert specs[3].name.endswith("_u1_p2") and specs[4].name.endswith("_u1_p0")
    for spec in specs:
        assert brgemm_from_name(spec.name).name == spec.name
    record = f'[0, [["Tensorize", "{specs[1].name}"], ["Tensorize", "{specs[2].name}"]]]'
    assert register_named(record) == sorted([specs[1].name, specs[2].name])
    assert TensorIntrin.get(specs[1].name, allow_missing=True) is not None
    with pytest.raises(ValueError, match="not the name"):
        brgemm_from_name("tvm_ext.brgemm_float32_5x16")


def test_microkernel_prefetches_the_next_channel_block():
    """A's next channel block is prefetched while the current one's k steps run: one prefetch per
    row of C and filter tap, only while that block exists (never past the operand)."""
    def impl(spec: BRGEMM) -> str:
        return TensorIntrin.get(get_brgemm_intrin(spec)).impl.script()

    near, far = impl(BRGEMM(3, 16, 16, 8, (4, 3, 3))), impl(BRGEMM(3, 16, 16, 8, (4, 1, 1), prefetch=2))
    assert near.count("llvm.prefetch") == far.count("llvm.prefetch") == 3  # per tap of the 3x3 filter
    assert "if i0 + 1 < 4:" in near and "T.address_of(A[i0 + 1, p1, 2 + p2, 0])" in near
    assert "if i0 + 2 < 4:" in far
    for spec in (BRGEMM(3, 16, 16, 8, (1, 3, 3)), BRGEMM(3, 16, 16, 8, (4, 3, 3), prefetch=0)):
        assert "llvm.prefetch" not in impl(spec)
    with pytest.raises(ValueError, match="prefetch distance"):
        BRGEMM(3, 16, 16, 8, prefetch=-1).validate()
    plan, _, asm = _conv_asm(AVX2_TARGET, ((1, 64, 7, 7), (64, 64, 1, 1)), padding=0)
    assert asm.count("prefetcht0") >= plan.m_r  # the hint reaches the machine code


def test_depthwise_intrinsic_is_registered_once_and_refuses_a_spilling_tile():
    tile = DepthwiseTile(4, 16, 8, (3, 3), stride=2, dilation=(1, 2))
    assert get_depthwise_intrin(tile) == tile.name == "tvm_ext.depthwise_float32_4x16_l8_k3x3_s2_d1x2"
    assert get_depthwise_intrin(tile) == tile.name and TensorIntrin.get(tile.name) is not None
    assert tile.a_shape() == (3, 3 * 2 + 2 * 2 + 1, 16)
    DepthwiseTile(6, 16, 8, (3, 3)).validate(AVX2)  # 12 accumulators, 2 weight vectors, 1 input: 15 of 16
    with pytest.raises(ValueError, match="vector registers"):
        DepthwiseTile(8, 16, 8, (3, 3)).validate(AVX2)
    with pytest.raises(ValueError, match="multiple of the 8 lanes"):
        DepthwiseTile(4, 12, 8, (3, 3)).validate()


@pytest.mark.parametrize("target, register", [(AVX2_TARGET, "%ymm"), (AVX512_TARGET, "%zmm")])
@pytest.mark.parametrize("stride", [1, 2])
def test_depthwise_kernel_is_the_microkernel_without_spills(target, register, stride):
    """MobileNet's depthwise layers run the microkernel: no zero-filling pass, the tile's
    accumulators the only arrays, and straight-line vector FMAs that never touch the stack."""
    target = resolve_target(target)
    isa = vector_isa(target)
    plan = plan_conv2d(Conv2dWorkload.make((1, 96, 28, 28), (96, 1, 3, 3), stride, 1, 1, 96), isa)
    func = conv2d_blocked_kernel(plan, isa.lanes, Epilogue(bias=True, activation="relu6"))
    script = func.script()
    assert plan.kind == "depthwise" and "T.init()" not in script
    assert set(re.findall(r"(\w+) = T\.alloc_buffer", script)) == {f"acc{i}" for i in range(plan.m_r)}
    lib = tvm.compile(tvm.IRModule({"conv": func.with_attr("global_symbol", "conv")}), target)
    blocks = fma_blocks(lib.mod.inspect_source("asm"), isa)
    filter_row = plan.m_r * (plan.oc_bn // isa.lanes) * 3  # FMAs of one filter row over the whole tile
    assert any(b.fma >= filter_row and b.fma % filter_row == 0 for b in blocks)
    for block in blocks:
        assert block.fma_on_isa_registers == block.fma and not block.spills
        assert all(register in ln for ln in block.lines if "vfmadd" in ln)
