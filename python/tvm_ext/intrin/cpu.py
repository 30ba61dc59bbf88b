"""Batch-reduce GEMM (BRGEMM) tensor intrinsics for LLVM CPUs.

One microkernel, described as data (:class:`BRGEMM`) and generated on demand:

    C[m, n] += sum_{b0, b1, b2} sum_k  A[b0, b1*dh, m*s + b2*dw, k] * B[b0, b1, b2, k, n]

C is an m_r x n_r tile held in vector registers for the whole reduction and written once; the
batch (b0, b1, b2) walks fixed strides through A and B, as in LIBXSMM's stride-based BRGEMM. For a
direct convolution in blocked layout the batch is (input-channel block, kh, kw), k the channels
inside a block, m the output pixels of a row and n the output channels of a block; a plain GEMM is
the batch (1, 1, 1) with s = 1.

The register tile must fit the ISA's register file (m_r*n_r/lanes accumulators + n_r/lanes B
vectors + 1 broadcast): a tile that does not fit spills inside the inner loop and runs about 3x
slower, so :meth:`BRGEMM.validate` refuses it.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import tvm
import tvm.script
from tvm.s_tir import TensorIntrin

from ..target import VectorISA


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
    dtype: str = "float32"
    init: bool = False  # C = sum(...) (accumulators start at zero, C is only written) vs C += sum
    unroll: int = 1  # k steps unrolled in the implementation (largest divisor of k up to this)

    @property
    def k_unroll(self) -> int:
        """Unrolled k steps let LLVM hoist loads across steps until a large tile spills."""
        limit = self.unroll
        return max(d for d in range(1, min(limit, self.k) + 1) if self.k % d == 0)

    @property
    def vectors(self) -> int:
        return self.n_r // self.lanes

    def registers(self) -> int:
        """Vector registers the inner loop keeps live: accumulators, B row, broadcast A."""
        return self.m_r * self.vectors + self.vectors + 1

    def a_shape(self) -> tuple[int, int, int, int]:
        b0, b1, b2 = self.batch
        dh, dw = self.dilation
        return (b0, (b1 - 1) * dh + 1, (self.m_r - 1) * self.stride + (b2 - 1) * dw + 1, self.k)

    def validate(self, isa: VectorISA | None = None) -> None:
        if self.dtype != "float32":
            raise ValueError(f"BRGEMM: dtype {self.dtype} is not supported (float32 only)")
        if min(self.m_r, self.n_r, self.k, self.lanes, self.stride, *self.batch, *self.dilation) < 1:
            raise ValueError(f"BRGEMM: every extent must be positive: {self}")
        if self.n_r % self.lanes:
            raise ValueError(f"BRGEMM: n_r={self.n_r} is not a multiple of the {self.lanes} lanes")
        if isa is not None:
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
        )


_NAME = re.compile(r"tvm_ext\.brgemm_(\w+?)_(\d+)x(\d+)x(\d+)_l(\d+)_b(\d+)x(\d+)x(\d+)_s(\d+)_d(\d+)x(\d+)"
                   r"_u(\d+)(_init)?\b")


def brgemm_from_name(name: str) -> BRGEMM:
    """The BRGEMM whose intrinsic is registered as `name` (the inverse of :attr:`BRGEMM.name`).

    Tuning records name the intrinsics their traces tensorize with; a process that replays
    them registers those first.
    """
    match = _NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"{name!r} is not the name of a tvm_ext BRGEMM intrinsic")
    dtype, *v, init = match.groups()
    m_r, n_r, k, lanes, b0, b1, b2, stride, dh, dw, unroll = (int(x) for x in v)
    return BRGEMM(m_r, n_r, k, lanes, (b0, b1, b2), stride, (dh, dw), dtype, init is not None, unroll)


def register_named(text: str) -> list[str]:
    """Register every tvm_ext BRGEMM intrinsic named in `text` (e.g. a tuning record file)."""
    names = sorted({m.group(0) for m in _NAME.finditer(text)})
    for name in names:
        get_brgemm_intrin(brgemm_from_name(name))
    return names


def register_tiles(isa: VectorISA, max_vectors: int = 4, spare: int = 0) -> list[tuple[int, int]]:
    """Every (m_r, n_r) that fits `isa`'s registers with `spare` left over, largest m_r first."""
    tiles = []
    for vectors in range(1, max_vectors + 1):
        m_max = (isa.registers - 1 - vectors - spare) // vectors
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


def default_tile(isa: VectorISA, n_choices: list[int], width: int) -> tuple[int, int]:
    """The analytic register tile (m_r, n_r) for rows of `width` pixels, n_r among `n_choices`.

    Ranks tiles that fit the register file by the FMA-slot fraction of their inner loop, then by
    the accumulators per call that the row width really fills (more independent FMA chains hide
    the FMA latency and amortize writing the tile back).
    """
    best, best_key = None, None
    # One register stays spare: with every register live, LLVM spilled a 4x24 AVX2 tile that
    # starts from zeroed accumulators (found by the assembly test).
    for m_r, n_r in register_tiles(isa, spare=1):
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


_DESC = """

@T.prim_func(s_tir=True)
def desc(a: T.handle, b: T.handle, c: T.handle{batch_params}) -> None:
    A = T.match_buffer(a, {a_shape}, "{dtype}", offset_factor=1)
    B = T.match_buffer(b, {b_shape}, "{dtype}", offset_factor=1)
    C = T.match_buffer(c, ({m_r}, {n_r}), "{dtype}", offset_factor=1)
    with T.sblock("root"):
        T.reads({c_read}A[{a_region}], B[{b_region}])
        T.writes(C[0:{m_r}, 0:{n_r}])
        for {loop_vars} in T.grid({loop_extents}):
            with T.sblock("update"):
{bindings}
                T.reads(C[{c_index}], A[{a_index}], B[{b_index}])
                T.writes(C[{c_index}])
{init}
                C[{c_index}] = C[{c_index}] + A[{a_index}] * B[{b_index}]
"""

_IMPL = """
@T.prim_func(s_tir=True)
def impl(a: T.handle, b: T.handle, c: T.handle{batch_params}) -> None:
    sa0, sa1, sa2 = T.int32(), T.int32(), T.int32()
    sb0, sb1, sb2, sb3 = T.int32(), T.int32(), T.int32(), T.int32()
    sc0 = T.int32()
    A = T.match_buffer(a, {a_shape}, "{dtype}", offset_factor=1, strides=[sa0, sa1, sa2, 1])
    B = T.match_buffer(b, {b_shape}, "{dtype}", offset_factor=1, strides=[sb0, sb1, sb2, sb3, 1])
    C = T.match_buffer(c, ({m_r}, {n_r}), "{dtype}", offset_factor=1, strides=[sc0, 1])
    with T.sblock("root"):
        T.reads({c_read}A[{a_region}], B[{b_region}])
        T.writes(C[0:{m_r}, 0:{n_r}])
{registers}
{acc_start}
        for i0, i1, i2 in T.grid({b0}, {b1}, {b2}):
            for k0 in T.serial({k} // {k_unroll}):
                for k1 in T.unroll({k_unroll}):
{step}
{acc_store}
"""


def _impl_body(spec: BRGEMM) -> dict[str, str]:
    """The unrolled statements of the implementation.

    Each row of accumulators is a small array indexed by constants only, which LLVM promotes to
    vector registers. TVM puts a buffer on the stack only if its scope is "global" and it has at
    most 1 KiB; "local" buffers and larger ones (a 14x32 AVX-512 tile is 1.8 KiB) go to a heap
    workspace, where the accumulators were loaded and stored around every FMA (4x slower).
    """
    vec, lanes, s = f"{spec.dtype}x{spec.lanes}", spec.lanes, spec.stride
    dh, dw = spec.dilation
    ku, nv = spec.k_unroll, spec.vectors
    tile = [(i, j) for i in range(spec.m_r) for j in range(nv)]
    pad8, pad20 = " " * 8, " " * 20
    registers = [f'{pad8}acc{i} = T.alloc_buffer(({nv},), "{vec}")' for i in range(spec.m_r)]
    registers.append(f'{pad8}bv = T.alloc_buffer(({nv},), "{vec}")')
    start = f"T.broadcast(T.{spec.dtype}(0), {lanes})" if spec.init else None
    acc_start = [f"{pad8}acc{i}[{j}] = " + (start or f'C.vload([{i}, {j * lanes}], "{vec}")') for i, j in tile]
    k = f"k0 * {ku} + k1"
    step = [f'{pad20}bv[{j}] = B.vload([i0, i1, i2, {k}, {j * lanes}], "{vec}")' for j in range(nv)]
    step += [
        f'{pad20}acc{i}[{j}] = T.call_llvm_pure_intrin("{vec}", "llvm.fmuladd", '
        f"T.broadcast(A[i0, i1 * {dh}, {i * s} + i2 * {dw}, {k}], {lanes}), bv[{j}], acc{i}[{j}])"
        for i, j in tile
    ]
    acc_store = [f"{pad8}C[{i}, {j * lanes}:{(j + 1) * lanes}] = acc{i}[{j}]" for i, j in tile]
    return {name: "\n".join(lines) for name, lines in
            (("registers", registers), ("acc_start", acc_start), ("step", step), ("acc_store", acc_store))}


def _desc_impl(spec: BRGEMM):
    """The (description, implementation) pair of `spec`: its family's, specialized to its batch."""
    desc, impl = _family(dataclasses.replace(spec, batch=tuple(min(b, 2) for b in spec.batch)))
    values = {f"b{i}": b for i, b in enumerate(spec.batch) if b > 1}
    return tuple(func.specialize({p: values[p.name] for p in func.params[3:]}) for func in (desc, impl))


@functools.cache
def _family(spec: BRGEMM):
    """TVMScript (description, implementation) for every batch shape with the same unit batch
    extents as `spec` (1 stays 1, 2 stands for any larger extent: a scalar parameter).

    Parsing is slow (about 0.1 s a function) and a network needs a microkernel per channel-block
    count; :func:`_desc_impl` specializes the parameters instead (microseconds). The extents
    of one stay literal because the description's block binds no iterator to a loop of extent
    one: blockize drops unit iterators from the block being tensorized (it keeps the loops), so
    a description that bound them (a 1x1 filter, a single channel block, a one-pixel tail)
    would never match. (The symbolic A shape here is :meth:`BRGEMM.a_shape` in TVMScript.)
    """
    dh, dw = spec.dilation
    b0, b1, b2 = (f"b{i}" if b > 1 else "1" for i, b in enumerate(spec.batch))
    dims = [("m", str(spec.m_r), spec.m_r > 1, "S"), ("n", str(spec.n_r), spec.n_r > 1, "S"),
            ("i0", b0, b0 != "1", "R"), ("i1", b1, b1 != "1", "R"), ("i2", b2, b2 != "1", "R"),
            ("k", str(spec.k), spec.k > 1, "R")]
    v = {name: (f"v{name}" if live else "0") for name, _, live, _ in dims}
    a_shape = (b0, f"({b1} - 1) * {dh} + 1", f"{(spec.m_r - 1) * spec.stride} + ({b2} - 1) * {dw} + 1", str(spec.k))
    fields = dict(
        k_unroll=spec.k_unroll, dtype=spec.dtype, m_r=spec.m_r, n_r=spec.n_r, k=spec.k, lanes=spec.lanes,
        nv=spec.vectors,
        vec=f"{spec.dtype}x{spec.lanes}", b0=b0, b1=b1, b2=b2, s=spec.stride, dh=dh, dw=dw,
        batch_params="".join(f", {b}: T.int32" for b in (b0, b1, b2) if b != "1"),
        a_shape=f"({', '.join(a_shape)})", b_shape=f"({b0}, {b1}, {b2}, {spec.k}, {spec.n_r})",
        a_region=", ".join(f"0:{e}" for e in a_shape),
        b_region=f"0:{b0}, 0:{b1}, 0:{b2}, 0:{spec.k}, 0:{spec.n_r}",
        loop_vars=", ".join(name for name, _, _, _ in dims),
        loop_extents=", ".join(extent for _, extent, _, _ in dims),
        bindings="\n".join(
            f"{' ' * 16}v{name} = T.axis.{'spatial' if kind == 'S' else 'reduce'}({extent}, {name})"
            for name, extent, live, kind in dims if live),
        c_index=f"{v['m']}, {v['n']}",
        c_read="" if spec.init else f"C[0:{spec.m_r}, 0:{spec.n_r}], ",
        init=(f"{' ' * 16}with T.init():\n{' ' * 20}C[{v['m']}, {v['n']}] = T.float32(0)" if spec.init else ""),
        **_impl_body(spec),
        a_index=f"{v['i0']}, {v['i1']} * {dh}, {v['m']} * {spec.stride} + {v['i2']} * {dw}, {v['k']}",
        b_index=f"{v['i0']}, {v['i1']}, {v['i2']}, {v['k']}, {v['n']}",
    )
    return tuple(tvm.script.from_source(text.format(**fields)) for text in (_DESC, _IMPL))


@functools.cache
def get_brgemm_intrin(spec: BRGEMM) -> str:
    """Register (once) the tensor intrinsic for `spec` and return its name."""
    spec.validate()
    if TensorIntrin.get(spec.name, allow_missing=True) is None:
        desc, impl = _desc_impl(spec)
        TensorIntrin.register(spec.name, desc, impl)
    return spec.name
