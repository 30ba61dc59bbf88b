"""Batch-reduce GEMM (BRGEMM) tensor intrinsics for LLVM CPUs.

One microkernel, described as data (:class:`BRGEMM`) and generated on demand:

    C[m, n] += sum_{b0, b1, b2} sum_k  A[b0, b1*dh, m*s + b2*dw, k] * B[b0, b1, b2, k, n]

or, with A transposed (``a_transposed``), A[b0, b1*dh, k*s + b2*dw, m]. C is an m_r x n_r tile
held in vector registers for the whole reduction and written once; the batch (b0, b1, b2) walks
fixed strides through A and B, as in LIBXSMM's stride-based BRGEMM. For a direct convolution in
blocked layout the batch is (input-channel block, kh, kw), k the channels inside a block, m the
output pixels of a row and n the output channels of a block; a plain GEMM is the batch (1, 1, 1)
with s = 1. For the weight gradient X^T dY (LIBXSMM's formulation) A is transposed: m the input
channels of a block, k the pixels of a row, the batch (images, rows).

The register tile must fit the ISA's register file (m_r*n_r/lanes accumulators + n_r/lanes B
vectors + 1 broadcast): a tile that does not fit spills inside the inner loop and runs about 3x
slower, so :meth:`BRGEMM.validate` refuses it.

dtype "bfloat16" (AVX512-BF16): A and B are bf16, C fp32, and one `vdpbf16ps` multiplies a pair
of channels of A (one 32-bit broadcast) by the same pair of B for each of 16 output lanes, adding
both products to the fp32 accumulator: 2x the fp32 FMA's work per instruction. B is packed in
pairs, (batch..., k / 2, n, 2), the pair innermost (oneDNN's and LIBXSMM's VNNI layout). TVM
legalizes bf16 vectors to 16-bit integers, which LLVM's intrinsic does not take, so the
instruction is a small LLVM IR function imported into the module (`pragma_import_llvm`) and
inlined (:data:`DOT_PRODUCTS`; see docs/low_precision.md).

Without AVX512-BF16 (AVX2, AVX-512 before Cooper Lake, NEON, SSE), or where it is slower than
fp32 FMA (Intel's), engine "emulated" runs the bf16 BRGEMM on FMA: B's pairs are widened to fp32
in registers (a bf16 is the top half of an fp32: a mask and a shift) and A is read as fp32 holding
bf16 values, rounded as the data is packed, so that its broadcast stays one load folded into the
FMA (widened in registers, LLVM hoisted all m_r broadcasts of a step and spilled the tile). A bf16
product is exact in fp32, and each pair is added odd channel first as vdpbf16ps adds it: the
results are vdpbf16ps's, bit for bit (Zen 4's, measured).

dtype "int8" (AVX512-VNNI on 16 lanes, AVX-VNNI on 8): A is uint8, B int8, C int32, and one
`vpdpbusd` multiplies a group of 4 channels of A (one 32-bit broadcast) by the same 4 of B for
each output lane, adding the four products to the int32 accumulator (exact: no rounding). B is
packed in groups of 4, (batch..., k / 4, n, 4). The instruction likewise is imported LLVM IR
(:data:`DOT_PRODUCTS`): TVM 0.27's `dot_16x4_vnni` passes it int32 vectors, which LLVM 22's
intrinsic (byte-vector operands) no longer takes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from ..target import VectorISA
from .registry import register_once


@dataclasses.dataclass(frozen=True)
class DotType:
    """The element types of a BRGEMM dtype and the channels of k one 32-bit lane of B packs (the
    dot-product instruction's group: 1 for fp32's FMA)."""

    a: str
    b: str
    c: str
    group: int


DOT_TYPES = {"float32": DotType("float32", "float32", "float32", 1),
             "bfloat16": DotType("bfloat16", "bfloat16", "float32", 2),
             "int8": DotType("uint8", "int8", "int32", 4)}

EMULATED_BF16 = DotType("float32", "bfloat16", "float32", 2)


@dataclasses.dataclass(frozen=True)
class BRGEMM:
    """Shape of one BRGEMM microkernel call (everything the generator needs)."""

    m_r: int  # output pixels (rows of C) per call
    n_r: int  # output channels (columns of C) per call: a multiple of `lanes`
    k: int  # reduction inside one batch entry (input channels of a block)
    lanes: int  # fp32 lanes of one vector register
    batch: tuple[int, int, int] = (1, 1, 1)  # (channel blocks, kh, kw)
    stride: int = 1  # distance in A between two rows of C (the convolution stride)
    dilation: tuple[int, int] = (1, 1)
    dtype: str = "float32"  # a key of DOT_TYPES: "float32", "bfloat16" or "int8" (u8 x s8 -> s32)
    init: bool = False  # C = sum(...) (accumulators start at zero, C is only written) vs C += sum
    unroll: int = 1  # k steps unrolled in the implementation (largest divisor of k up to this)
    # Software prefetch of A this many channel blocks (batch entries along b0) ahead; 0: none.
    prefetch: int = 1
    # A indexed (batch..., k * stride, m): one pixel's channels contiguous (the weight gradient).
    a_transposed: bool = False
    # "fma": vector registers (FMA, vdpbf16ps in bfloat16, vpdpbusd in int8); "amx": bfloat16 or
    # int8 on AMX tiles (:mod:`tvm_ext.intrin.cpu_amx`); "emulated": bfloat16 on any vector ISA
    # without a bf16 dot product, by FMA (A then fp32: :data:`EMULATED_BF16`)
    engine: str = "fma"

    @property
    def k_unroll(self) -> int:
        """Unrolled k steps let LLVM hoist loads across steps until a large tile spills (a step:
        one channel, or a group of them: a pair in bfloat16, 4 in int8)."""
        steps = self.k // self.group
        return max(d for d in range(1, min(self.unroll, steps) + 1) if steps % d == 0)

    @property
    def vectors(self) -> int:
        return self.n_r // self.lanes

    @property
    def b_rows(self) -> int:
        return b_rows_for(self.engine)

    def registers(self) -> int:
        """Vector registers the inner loop keeps live: accumulators, B rows, broadcast A (and
        emulated bf16's mask)."""
        return tile_registers(self.m_r, self.vectors, self.b_rows)

    def a_shape(self, batch: tuple | None = None) -> tuple:
        """A's extents (`batch`: the batch extents to use, parameters in a family's signature)."""
        b0, b1, b2 = batch or self.batch
        dh, dw = self.dilation
        strided, other = (self.k, self.m_r) if self.a_transposed else (self.m_r, self.k)
        return (b0, (b1 - 1) * dh + 1, (strided - 1) * self.stride + (b2 - 1) * dw + 1, other)

    @property
    def types(self) -> DotType:
        if self.engine == "emulated":  # A's bf16 values held in fp32: its broadcast folds into the FMA
            return EMULATED_BF16
        return DOT_TYPES[self.dtype]

    @property
    def group(self) -> int:
        """Channels of k that B packs in each lane (a dot-product step): 1, 2 (bf16) or 4 (int8)."""
        return self.types.group

    def b_shape(self, batch: tuple | None = None) -> tuple:
        b0, b1, b2 = batch or self.batch
        g = self.group
        return (b0, b1, b2, self.k // g, self.n_r, g) if g > 1 else (b0, b1, b2, self.k, self.n_r)

    def validate(self, isa: VectorISA | None = None) -> None:
        if self.dtype not in DOT_TYPES:
            raise ValueError(f"BRGEMM: dtype {self.dtype} is not supported ({', '.join(DOT_TYPES)})")
        g = self.group
        lanes = (4, 8, 16) if self.engine == "emulated" else (16,) if self.dtype == "bfloat16" else (8, 16)
        if g > 1 and (self.k % g or self.lanes not in lanes or self.a_transposed):
            raise ValueError(f"BRGEMM: {self.dtype} takes groups of {g} channels of k (k={self.k}) over "
                             f"{' or '.join(map(str, lanes))} lanes ({self.lanes} given), A not transposed")
        if self.engine == "emulated" and self.dtype != "bfloat16":
            raise ValueError("BRGEMM: only bfloat16 is emulated")
        if self.engine not in ("fma", "amx", "emulated"):
            raise ValueError(f"BRGEMM: engine {self.engine!r} is not 'fma', 'amx' or 'emulated'")
        if self.engine == "amx":
            from .cpu_amx import amx_k_step

            if g == 1 or self.m_r > 32 or self.n_r not in (16, 32) or self.k % amx_k_step(self):
                raise ValueError(f"BRGEMM: AMX takes bfloat16 or int8 tiles of up to 32 rows and 16 or 32 "
                                 f"columns, k in whole 64-byte steps: {self}")
        if min(self.m_r, self.n_r, self.k, self.lanes, self.stride, *self.batch, *self.dilation) < 1:
            raise ValueError(f"BRGEMM: every extent must be positive: {self}")
        if self.prefetch < 0:
            raise ValueError(f"BRGEMM: prefetch distance {self.prefetch} is negative")
        if self.n_r % self.lanes:
            raise ValueError(f"BRGEMM: n_r={self.n_r} is not a multiple of the {self.lanes} lanes")
        if isa is not None and self.engine != "amx":  # (AMX's tiles are not vector registers)
            if isa.lanes != self.lanes:
                raise ValueError(f"BRGEMM: {isa.name} has {isa.lanes} lanes, not {self.lanes}")
            if self.registers() > isa.registers:
                raise ValueError(
                    f"BRGEMM: a {self.m_r}x{self.n_r} tile needs {self.registers()} vector "
                    f"registers, {isa.name} has {isa.registers}: it would spill in the inner loop"
                )

    @property
    def name(self) -> str:
        b0, b1, b2 = self.batch
        dh, dw = self.dilation
        return (
            f"tvm_ext.brgemm_{self.dtype}_{self.m_r}x{self.n_r}x{self.k}_l{self.lanes}"
            f"_b{b0}x{b1}x{b2}_s{self.stride}_d{dh}x{dw}_u{self.k_unroll}{'_init' if self.init else ''}"
            # The default distance is unnamed: records tuned before prefetching name no distance.
            f"{'' if self.prefetch == BRGEMM.prefetch else f'_p{self.prefetch}'}"
            f"{'_at' if self.a_transposed else ''}{'' if self.engine == 'fma' else '_' + self.engine}"
        )


_NAME = re.compile(r"tvm_ext\.brgemm_(\w+?)_(\d+)x(\d+)x(\d+)_l(\d+)_b(\d+)x(\d+)x(\d+)_s(\d+)_d(\d+)x(\d+)"
                   r"_u(\d+)(_init)?(?:_p(\d+))?(_at)?(?:_(amx|emulated))?\b")


def brgemm_from_name(name: str) -> BRGEMM:
    """The BRGEMM whose intrinsic is registered as `name` (the inverse of :attr:`BRGEMM.name`).

    Tuning records name the intrinsics their traces tensorize with; a process that replays
    them registers those first.
    """
    match = _NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"{name!r} is not the name of a tvm_ext BRGEMM intrinsic")
    dtype, *v, init, prefetch, transposed, engine = match.groups()
    m_r, n_r, k, lanes, b0, b1, b2, stride, dh, dw, unroll = (int(x) for x in v)
    return BRGEMM(m_r, n_r, k, lanes, (b0, b1, b2), stride, (dh, dw), dtype, init is not None, unroll,
                  BRGEMM.prefetch if prefetch is None else int(prefetch), transposed is not None,
                  engine or "fma")


def register_named(text: str) -> list[str]:
    """Register every tvm_ext BRGEMM intrinsic named in `text` (e.g. a tuning record file)."""
    names = sorted({m.group(0) for m in _NAME.finditer(text)})
    for name in names:
        get_brgemm_intrin(brgemm_from_name(name))
    return names


def b_rows_for(engine: str) -> int:
    """Rows of B vectors a k step of `engine` keeps live: two for emulated bf16 (a row of pairs
    widened into two), else one."""
    return 2 if engine == "emulated" else 1


def tile_registers(rows: int, vectors: int, b_rows: int = 1) -> int:
    """Vector registers a k loop of rows x `vectors` accumulators keeps live: the accumulators,
    `b_rows` rows of the vector operand, the broadcast (the BRGEMM's tile and the CPU maxDNN tile
    alike; emulated bf16 widens a row of pairs into two and keeps a mask)."""
    return rows * vectors + b_rows * vectors + 1 + (1 if b_rows > 1 else 0)


def register_tiles(isa: VectorISA, max_vectors: int = 4, spare: int = 0, b_rows: int = 1) -> list[tuple[int, int]]:
    """Every (m_r, n_r) that fits `isa`'s registers with `spare` left over, largest m_r first."""
    tiles = []
    for vectors in range(1, max_vectors + 1):
        m_max = (isa.registers - tile_registers(0, vectors, b_rows) - spare) // vectors
        tiles += [(m, vectors * isa.lanes) for m in range(m_max, 0, -1)]
    return tiles


def tile_efficiency(m_r: int, vectors: int, fma_per_cycle: float = 2.0, loads_per_cycle: float = 2.0) -> float:
    """Fraction of FMA issue slots one k step of an m_r x (vectors*lanes) tile can fill.

    A step issues m_r*vectors FMAs and needs m_r broadcasts plus `vectors` loads of B; with two
    FMA pipes and two load ports (Zen 3/4, Skylake-SP, Neoverse) it is FMA-bound once
    m_r*vectors >= m_r + vectors.
    """
    fma_cycles = m_r * vectors / fma_per_cycle
    return fma_cycles / max(fma_cycles, (m_r + vectors) / loads_per_cycle)


def default_tile(isa: VectorISA, n_choices: list[int], width: int, b_rows: int = 1) -> tuple[int, int]:
    """The analytic register tile (m_r, n_r) for rows of `width` pixels, n_r among `n_choices`.

    Ranks tiles that fit the register file by the FMA-slot fraction of their inner loop, then by
    the accumulators per call that the row width really fills (more independent FMA chains hide
    the FMA latency and amortize writing the tile back).
    """
    best, best_key = None, None
    # One register stays spare: with every register live, LLVM spilled a 4x24 AVX2 tile that
    # starts from zeroed accumulators (found by the assembly test).
    for m_r, n_r in register_tiles(isa, spare=1, b_rows=b_rows):
        if n_r not in n_choices:
            continue
        calls = -(-width // m_r)
        m = -(-width // calls)  # balanced: 7 = 4 + 3, not 6 + 1 (a 1-pixel tail spilled on AVX2)
        m_avg = width / calls  # pixels per call, tail included
        vectors = n_r // isa.lanes
        key = (round(tile_efficiency(m, vectors), 3), m_avg * vectors, -vectors)
        if best_key is None or key > best_key:
            best, best_key = (m, n_r), key
    if best is None:
        raise ValueError(f"no register tile for {isa.name} with n_r in {n_choices}")
    return best


# The description and implementation are built with TVM's IRBuilder, not written as TVMScript
# text: the implementation's unrolled tile (up to 14 x 2 FMAs) took 0.3-0.9 s to parse, a pair
# about 0.9 s, paid for every distinct microkernel of a build or a tuning run (25 of the 107 s of
# a small tuning test). Built, a pair takes milliseconds; the IR is the same.


def operand_buffer(handle: tirx.Var, shape, dtype: str, strided: bool, unit_last: bool = True) -> tirx.Buffer:
    """The buffer of a microkernel operand passed as `handle` (named in capitals); `strided`: any
    strides but a unit last one (an implementation runs on views of larger tensors), or any at
    all without `unit_last` (an operand only ever read element by element)."""
    name = handle.name
    last = [1] if unit_last else [tirx.Var(f"s{name}{len(shape) - 1}", "int32")]
    strides = [tirx.Var(f"s{name}{i}", "int32") for i in range(len(shape) - 1)] + last if strided else None
    return IRBuilder.name(name.upper(), T.match_buffer(handle, shape, dtype, offset_factor=1, strides=strides))


def _signature(spec: BRGEMM, strided: bool) -> tuple[tuple, tirx.Buffer, tirx.Buffer, tirx.Buffer]:
    """Parameters (a, b, c, then each batch extent above one) and buffers: (batch, A, B, C).

    An extent of one stays literal; a larger one is a scalar parameter (see :func:`_family`).
    `strided`: the buffers take any strides (the implementation runs on views of larger tensors);
    A's channels too, as it is only broadcast element by element: a convolution reads NCHW data
    as a view of blocks whose channels lie a plane apart (:attr:`~tvm_ext.kernels.conv2d.Conv2dPlan.nchw_in`).
    """
    handles = [T.arg(name, T.handle()) for name in "abc"]
    batch = tuple(T.arg(f"b{i}", T.int32()) if b > 1 else 1 for i, b in enumerate(spec.batch))
    shapes = (spec.a_shape(batch), spec.b_shape(batch), (spec.m_r, spec.n_r))
    types = spec.types
    # (a group of A is loaded as one 32-bit word: its channels contiguous)
    return (batch, *(operand_buffer(handle, shape, dtype, strided, unit_last=handle.name != "a" or spec.group > 1)
                     for handle, shape, dtype in zip(handles, shapes, (types.a, types.b, types.c), strict=True)))


def _b_index(spec: BRGEMM, i0, i1, i2, k, n) -> list:
    """Where B holds channel `k` of output lane `n` of batch entry (i0, i1, i2)."""
    g = spec.group
    return [i0, i1, i2, k // g, n, k % g] if g > 1 else [i0, i1, i2, k, n]


def _product(spec: BRGEMM, a_value: tirx.PrimExpr, b_value: tirx.PrimExpr) -> tirx.PrimExpr:
    """One product in C's type: bf16 operands multiplied and summed in fp32, int8's in int32."""
    c = spec.types.c
    if spec.group > 1:
        return tirx.Cast(c, a_value) * tirx.Cast(c, b_value)
    return a_value * b_value


def _a_index(spec: BRGEMM, i0, i1, i2, m, k) -> list:
    """Where row `m` of C reads A at channel `k` of batch entry (i0, i1, i2): the description's
    access, and the loads and prefetches of the implementation."""
    dh, dw = spec.dilation
    if spec.a_transposed:
        return [i0, i1 * dh, k * spec.stride + i2 * dw, m]
    return [i0, i1 * dh, m * spec.stride + i2 * dw, k]


def _regions(spec: BRGEMM, a: tirx.Buffer, b: tirx.Buffer, c: tirx.Buffer) -> None:
    """The root block's reads and writes: the whole of A and B, and C unless it starts at zero."""
    whole = [a[tuple(slice(0, e) for e in a.shape)], b[tuple(slice(0, e) for e in b.shape)]]
    T.reads(*([] if spec.init else [c[0:spec.m_r, 0:spec.n_r]]), *whole)
    T.writes(c[0:spec.m_r, 0:spec.n_r])


def _description(spec: BRGEMM) -> tirx.PrimFunc:
    """C (+)= the batch-reduce product, one multiply-add per block: what tensorize matches."""
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("desc")
        batch, a, b, c = _signature(spec, strided=False)
        extents = [spec.m_r, spec.n_r, *batch, spec.k]
        with T.sblock("root"):
            _regions(spec, a, b, c)
            with T.grid(*extents) as loops, T.sblock("update"):
                IRBuilder.name_many(["m", "n", "i0", "i1", "i2", "k"], loops)
                # Unit extents bind no iterator (blockize drops them from the tensorized block).
                v = [IRBuilder.name(f"v{loop.name}", (T.axis.spatial if d < 2 else T.axis.reduce)(e, loop))
                     if not (isinstance(e, int) and e == 1) else 0
                     for d, (e, loop) in enumerate(zip(extents, loops, strict=True))]
                vm, vn, vi0, vi1, vi2, vk = v
                c_index = [vm, vn]
                a_index = _a_index(spec, vi0, vi1, vi2, vm, vk)
                b_index = _b_index(spec, vi0, vi1, vi2, vk, vn)
                T.reads(c[tuple(c_index)], a[tuple(a_index)], b[tuple(b_index)])
                T.writes(c[tuple(c_index)])
                if spec.init:
                    with T.init():
                        T.buffer_store(c, tirx.const(0, spec.types.c), c_index)
                T.buffer_store(c, c[tuple(c_index)] + _product(spec, a[tuple(a_index)], b[tuple(b_index)]), c_index)
    return builder.get()


def _dot_llvm(name: str, acc: str, operand: str, intrinsic: str) -> str:
    """A dot-product instruction as a function LLVM inlines, its operands passed as 32-bit lanes
    (TVM cannot pass bf16 vectors, and LLVM 22's VNNI intrinsics take byte vectors) and bitcast;
    linkonce_odr: each kernel's import of it is one definition."""
    lanes = int(acc.split()[0][1:])
    return f"""
define linkonce_odr {acc} @{name}({acc} %acc, <{lanes} x i32> %a, <{lanes} x i32> %b) #0 {{
  %av = bitcast <{lanes} x i32> %a to {operand}
  %bv = bitcast <{lanes} x i32> %b to {operand}
  %r = call {acc} @{intrinsic}({acc} %acc, {operand} %av, {operand} %bv)
  ret {acc} %r
}}
declare {acc} @{intrinsic}({acc}, {operand}, {operand})
attributes #0 = {{ alwaysinline }}
"""


# (dtype, lanes) -> (function name, its LLVM IR): vdpbf16ps on zmm, vpdpbusd on zmm or ymm
DOT_PRODUCTS = {
    ("bfloat16", 16): ("tvmext_dpbf16ps", _dot_llvm("tvmext_dpbf16ps", "<16 x float>", "<32 x bfloat>",
                                                    "llvm.x86.avx512bf16.dpbf16ps.512")),
    ("int8", 16): ("tvmext_dpbusd16", _dot_llvm("tvmext_dpbusd16", "<16 x i32>", "<64 x i8>",
                                                "llvm.x86.avx512.vpdpbusd.512")),
    ("int8", 8): ("tvmext_dpbusd8", _dot_llvm("tvmext_dpbusd8", "<8 x i32>", "<32 x i8>",
                                              "llvm.x86.avx512.vpdpbusd.256")),
}


def _implementation(spec: BRGEMM) -> tirx.PrimFunc:
    """The microkernel: the m_r x n_r tile in registers over the whole batch-reduce, stored once.

    Each row of accumulators is a small array indexed by constants only, which LLVM promotes to
    vector registers. TVM puts a buffer on the stack only if its scope is "global" and it has at
    most 1 KiB; "local" buffers and larger ones (a 14x32 AVX-512 tile is 1.8 KiB) go to a heap
    workspace, where the accumulators were loaded and stored around every FMA (4x slower).
    """
    if spec.engine == "amx":
        from .cpu_amx import amx_implementation

        return amx_implementation(spec, _signature, _a_index, _regions)
    lanes, g = spec.lanes, spec.group
    vec = f"{spec.types.c}x{lanes}"
    ku, nv = spec.k_unroll, spec.vectors
    tile = [(i, j) for i in range(spec.m_r) for j in range(nv)]
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("impl")
        batch, a, b, c = _signature(spec, strided=True)
        with T.sblock("root"):
            _regions(spec, a, b, c)
            acc = [IRBuilder.name(f"acc{i}", T.alloc_buffer((nv,), vec)) for i in range(spec.m_r)]
            bv = IRBuilder.name("bv", T.alloc_buffer((nv,), f"int32x{lanes}" if g > 1 and spec.engine != "emulated"
                                                     else vec))
            for i, j in tile:
                start = (T.broadcast(tirx.const(0, spec.types.c), lanes) if spec.init
                         else c.vload([i, j * lanes], vec))
                T.buffer_store(acc[i], start, [j])
            with contextlib.ExitStack() as frames:
                if g > 1 and spec.engine != "emulated":
                    frames.enter_context(T.attr(0, "pragma_import_llvm", DOT_PRODUCTS[spec.dtype, lanes][1]))
                i0 = IRBuilder.name("i0", frames.enter_context(T.serial(batch[0])))
                if spec.prefetch and spec.batch[0] > 1 and not spec.a_transposed:
                    _prefetch_block(spec, a, batch, i0 + spec.prefetch)
                steps = spec.k // g  # a group of k per step in bf16 and int8
                with T.grid(*batch[1:]) as (i1, i2), T.serial(steps // ku) as k0, T.unroll(ku) as k1:
                    IRBuilder.name_many(["i1", "i2", "k0", "k1"], [i1, i2, k0, k1])
                    k = k0 * ku + k1
                    if spec.engine == "emulated":
                        _emulated_bf16_step(spec, a, b, acc, bv, tile, (i0, i1, i2), k)
                    elif g > 1:
                        _group_step(spec, a, b, acc, bv, tile, (i0, i1, i2), k)
                    else:
                        for j in range(nv):
                            T.buffer_store(bv, b.vload([i0, i1, i2, k, j * lanes], vec), [j])
                        for i, j in tile:
                            a_value = T.broadcast(a[tuple(_a_index(spec, i0, i1, i2, i, k))], lanes)
                            T.buffer_store(acc[i], T.call_llvm_pure_intrin(vec, "llvm.fmuladd", a_value, bv[j],
                                                                           acc[i][j]), [j])
            for i, j in tile:
                T.buffer_store(c, acc[i][j], [i, slice(j * lanes, (j + 1) * lanes)])
    return builder.get()


def _group_step(spec: BRGEMM, a: tirx.Buffer, b: tirx.Buffer, acc: list, bv: tirx.Buffer, tile: list,
                batch: tuple, group) -> None:
    """One bf16 or int8 step: channels g * group .. g * group + g - 1 of the batch entry, by the
    dot-product instruction (vdpbf16ps, vpdpbusd)."""
    lanes, g, words, types = spec.lanes, spec.group, f"int32x{spec.lanes}", spec.types
    dot = DOT_PRODUCTS[spec.dtype, lanes][0]
    i0, i1, i2 = batch
    for j in range(spec.vectors):  # the output lanes x a group of channels: one vector load
        T.buffer_store(bv, T.reinterpret(words, b.vload([*batch, group, j * lanes, 0], f"{types.b}x{g * lanes}")), [j])
    for i, j in tile:
        group_of_a = T.reinterpret("int32", a.vload(_a_index(spec, i0, i1, i2, i, g * group), f"{types.a}x{g}"))
        T.buffer_store(acc[i], T.call_extern(f"{types.c}x{lanes}", dot, acc[i][j], T.broadcast(group_of_a, lanes),
                                             bv[j]), [j])


def _emulated_bf16_step(spec: BRGEMM, a: tirx.Buffer, b: tirx.Buffer, acc: list, bv: tirx.Buffer, tile: list,
                        batch: tuple, pair) -> None:
    """One bf16 step without a bf16 dot product: B's pairs widened to fp32 in registers (a bf16 is
    the top half of its fp32: the odd channel masked, the even one shifted up), A's two channels
    (fp32 holding bf16 values) broadcast into two FMAs, odd channel first as `vdpbf16ps` adds
    them. A bf16 product is exact in fp32, so each FMA rounds once, as the instruction does."""
    lanes, words, vec = spec.lanes, f"int32x{spec.lanes}", f"float32x{spec.lanes}"
    i0, i1, i2 = batch
    for half in (1, 0):
        for j in range(spec.vectors):
            word = T.reinterpret(words, b.vload([*batch, pair, j * lanes, 0], f"bfloat16x{2 * lanes}"))
            widened = (word & T.broadcast(tirx.const(-65536, "int32"), lanes) if half  # 0xffff0000
                       else word << T.broadcast(tirx.const(16, "int32"), lanes))
            T.buffer_store(bv, T.reinterpret(vec, widened), [j])
        for i, j in tile:
            a_value = T.broadcast(a[tuple(_a_index(spec, i0, i1, i2, i, 2 * pair + half))], lanes)
            T.buffer_store(acc[i], T.call_llvm_pure_intrin(vec, "llvm.fmuladd", a_value, bv[j], acc[i][j]), [j])


def _prefetch_block(spec: BRGEMM, a: tirx.Buffer, batch: tuple, i0: tirx.PrimExpr) -> None:
    """Prefetch into L1 (llvm.prefetch: read, high locality, data) what channel block `i0` of A
    holds for the tile, if that block exists: for each filter tap and row of C, the cache line
    its k channels start on.

    A channel block of a blocked activation lies a whole image plane past the one before (12.5 KB
    at 14 x 14, 200 KB at 56 x 56), too far for the hardware prefetchers to follow the m_r short
    streams of a tile. Prefetching the next block while this one's k steps run measured
    1.05-1.08x on ResNet-50 at batch 16 with 1 thread, 1.06-1.07x with 2 (a Zen 1; isolated layers
    with cold data up to 1.2x, none slower). Issued before the block's taps, not inside them:
    addresses that move with the taps cost LLVM general registers, and it spilled one in the
    k loop of a 3x3 tile.
    """
    with T.If(i0 < batch[0]), T.Then(), T.grid(*batch[1:]) as (i1, i2):
        IRBuilder.name_many(["p1", "p2"], [i1, i2])
        for i in range(spec.m_r):
            address = T.address_of(a[tuple(_a_index(spec, i0, i1, i2, i, 0))])
            T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", address, 0, 3, 1))


def _desc_impl(spec: BRGEMM):
    """The (description, implementation) pair of `spec`: its family's, specialized to its batch."""
    desc, impl = _family(dataclasses.replace(spec, batch=tuple(min(b, 2) for b in spec.batch)))
    values = {f"b{i}": b for i, b in enumerate(spec.batch) if b > 1}
    return tuple(func.specialize({p: values[p.name] for p in func.params[3:]}) for func in (desc, impl))


@functools.cache
def _family(spec: BRGEMM) -> tuple[tirx.PrimFunc, tirx.PrimFunc]:
    """(description, implementation) for every batch shape with the same unit batch extents as
    `spec` (1 stays 1, 2 stands for any larger extent: a scalar parameter).

    A network needs a microkernel per channel-block count; :func:`_desc_impl` specializes the
    parameters (microseconds). The extents of one stay literal because the description's block
    binds no iterator to a loop of extent one: blockize drops unit iterators from the block being
    tensorized (it keeps the loops), so a description that bound them (a 1x1 filter, a single
    channel block, a one-pixel tail) would never match.
    """
    return _description(spec), _implementation(spec)


@functools.cache
def get_brgemm_intrin(spec: BRGEMM) -> str:
    """Register (once) the tensor intrinsic for `spec` and return its name."""
    spec.validate()
    return register_once(spec.name, lambda: _desc_impl(spec))
