"""The maxDNN kernel's compute engines: what FFMA, mma.sync and wgmma build into the kernel.

The generator (:class:`~.codegen.Generator`) writes the parts every engine shares (the operands'
movement, the k loop, the output's epilogue) and hands the rest to one :class:`Engine`, chosen
once from the plan's tile (:func:`engine_for`). An engine reads what :class:`Host` lists of its
generator and builds, in the generator's open IRBuilder frame (``T.*``), in this order:

- :meth:`Engine.declare_registers`: its local buffers (accumulators, fragments, descriptors);
- :meth:`Engine.prologue`: the thread's coordinates in the tile, the accumulators zeroed (and
  whatever else the engine sets up once, wgmma's matrix descriptors);
- per k step :meth:`Engine.compute` on a shared buffer (or ring slot), then
  :meth:`Engine.end_step`: what the step waits for before its barrier;
- :meth:`Engine.end_k_loop`: what the output waits for after the last step;
- :meth:`Engine.stage_accumulators`: the accumulators into the block's output tile `O_sh`.

A new engine is a new subclass and an entry in :func:`engine_for`.
"""

from __future__ import annotations

import abc
from typing import Any, Protocol

from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from .operands import Expr, bf16_pair, evaluate, ramp, store, terms
from .plan import MaxDNNPlan
from .tile import BlockTile


class Host(Protocol):
    """What an engine reads of its generator (:class:`~.codegen.Generator`, which satisfies it)."""

    plan: MaxDNNPlan
    t: BlockTile
    v: dict[str, Any]  # the kernel's names bound so far: variables, buffers
    ring: int  # wgmma in flight: the weights' ring's slots
    updates: list[str]  # FFMA: the names of the update blocks built so far

    def let(self, name: str, value: Expr) -> Any: ...

    def buffer(self, name: str, shape: tuple, dtype: str = "float32", scope: str = "global",
               **kwargs: Any) -> Any: ...

    def load_shared(self, name: str, buf: int, row: Expr, col: Any, lanes: int = 1) -> Expr: ...

    def fragment_base(self, slot: int) -> int: ...

    def slice_steps(self) -> int: ...

    def sync(self) -> None: ...


def _wgmma_wait(groups: int) -> None:
    evaluate(T.ptx["wgmma.wait_group.sync.aligned"](groups))


class Engine(abc.ABC):
    """How one engine computes the block's tile: what it adds to its generator's kernel."""

    def __init__(self, gen: Host):
        self.gen, self.plan, self.t, self.v = gen, gen.plan, gen.t, gen.v

    @abc.abstractmethod
    def declare_registers(self) -> None:
        """Declare the engine's local buffers: the accumulators `acc` and whatever its compute reads."""

    @abc.abstractmethod
    def prologue(self) -> None:
        """Bind the thread's coordinates in the tile and zero the accumulators (once, before the
        first k step's loads)."""

    @abc.abstractmethod
    def compute(self, buf: int, slot: int = 0) -> None:
        """One k step on shared buffer `buf` (with wgmma groups in flight: ring slot `buf`, its
        fragments in register set `slot`)."""

    def end_step(self) -> None:
        """After a step's compute and the next step's stores, before its barrier: nothing to wait for."""
        return

    def end_k_loop(self) -> None:
        """After the last k step, before the accumulators are staged: nothing to wait for."""
        return

    @abc.abstractmethod
    def stage_accumulators(self) -> None:
        """Each thread's accumulators into the block's output tile in shared memory (`O_sh`)."""


class Ffma(Engine):
    """maxDNN's thread tiles: each thread an 8x8 (or 16x8) register tile of FFMAs, its updates
    tensorized onto the :class:`~tvm_ext.intrin.outer_tile.OuterTile` intrinsic afterwards (their
    blocks' names in :attr:`~.codegen.Generator.updates`)."""

    def declare_registers(self) -> None:
        tt = self.t.thread_tile()
        self.gen.buffer("acc", (tt.rows, tt.cols), scope="local")

    def prologue(self) -> None:
        t, gen, tid = self.t, self.gen, self.v["tid"]
        gen.let("ty", tid // t.threads_n)
        gen.let("tx", tid % t.threads_n)
        tt = t.thread_tile()
        with T.grid(tt.rows, tt.cols) as (i, j):
            IRBuilder.name_many(["i", "j"], [i, j])
            store(self.v["acc"], T.float32(0), i, j)

    def compute(self, buf: int, slot: int = 0) -> None:
        t, v, updates = self.t, self.v, self.gen.updates
        name = f"update{len(updates)}"
        tt = t.thread_tile()
        tid, acc = v["tid"], v["acc"]
        with T.grid(t.k_step, tt.rows // t.vec, t.vec, tt.cols // t.vec, t.vec) as loops, T.sblock(name):
            kk, i0, i1, j0, j1 = IRBuilder.name_many(["kk", "i0", "i1", "j0", "j1"], loops)
            vty = IRBuilder.name("vty", T.axis.spatial(t.threads_m, tid // t.threads_n))
            vtx = IRBuilder.name("vtx", T.axis.spatial(t.threads_n, tid % t.threads_n))
            vk = IRBuilder.name("vk", T.axis.reduce(t.k_step, kk))
            vi0, vi1, vj0, vj1 = IRBuilder.name_many(["vi0", "vi1", "vj0", "vj1"],
                                                    T.axis.remap("SSSS", [i0, i1, j0, j1]))
            at = (vi0 * t.vec + vi1, vj0 * t.vec + vj1)
            a = v[f"A_sh{buf}"][vk, vty * t.vec + vi0 * tt.row_gap + vi1]
            b = v[f"B_sh{buf}"][vk, vtx * t.vec + vj0 * tt.col_gap + vj1]
            store(acc, acc[vi0 * t.vec + vi1, vj0 * t.vec + vj1] + a * b, *at)
        updates.append(name)

    def stage_accumulators(self) -> None:
        t, v = self.t, self.v
        tt = t.thread_tile()
        for i in range(tt.rows):
            row = v["ty"] * t.vec + (i // t.vec * tt.row_gap + i % t.vec)
            for h in range(tt.cols // t.vec):
                store(v["O_sh"], v["acc"][i, ramp(h * t.vec, t.vec)], row,
                      ramp(v["tx"] * t.vec + h * tt.col_gap, t.vec))


class _TensorCores(Engine):
    """What mma.sync and wgmma share: a flat array of `accumulators` per thread, and the thread's
    warp, lane group `gq` and lane in it `tq`, in whose layouts the fragments are."""

    @property
    @abc.abstractmethod
    def accumulators(self) -> int:
        """float32 accumulators per thread."""

    def prologue(self) -> None:
        gen, tid = self.gen, self.v["tid"]
        gen.let("warp", tid // 32)
        gen.let("gq", tid % 32 // 4)
        gen.let("tq", tid % 4)
        with T.serial(self.accumulators) as i:
            store(self.v["acc"], T.float32(0), IRBuilder.name("i", i))


class MmaSync(_TensorCores):
    """Warps issuing `mma.sync` (:class:`~tvm_ext.intrin.cuda.MmaShape`): each owns `warp_rows`
    rows of the block, its fragments loaded from the shared tiles."""

    @property
    def accumulators(self) -> int:
        mt, nt = self.t.mma_tiles
        return mt * nt * 4

    def declare_registers(self) -> None:
        t, gen, mma = self.t, self.gen, self.t.mma_shape
        mt, nt = t.mma_tiles
        reg = "float32" if mma.per_reg == 1 else "uint32"
        gen.buffer("acc", (self.accumulators,), scope="local")
        gen.buffer("af", (mt * 4,), reg, scope="local")
        gen.buffer("bf", (nt * 2,), reg, scope="local")
        # the fragments' values as loaded from shared memory (bf16: before packing)
        gen.buffer("a_val", (2 * mma.per_reg * 2 * mt,), scope="local")
        if mma.per_reg > 1:
            gen.buffer("b_val", (2 * mma.per_reg * nt,), scope="local")

    def compute(self, buf: int, slot: int = 0) -> None:
        """One k step on the tensor cores: a warp's warp_rows x cols slab as warp_rows/16 x cols/8
        mma.sync, its fragments loaded from shared memory in the layouts of :class:`MmaShape`.

        The mma's row and column indices are a permutation of the tile's (:meth:`BlockTile.mma_row`,
        :meth:`BlockTile.mma_col`; the output staging undoes it) that puts side by side the values a
        lane needs from one shared row, so that it loads them as one vector (:attr:`BlockTile.mma_chunks`).
        tf32 takes the registers as loaded: an A fragment's rows g and g + 8 are one 64-bit load
        into the register pair the mma reads (its B registers come from two k rows: 32-bit loads).
        bf16 packs two k rows into each register anyway: its loads are 128-bit, into `a_val` and
        `b_val`, then packed."""
        t, v, mma, load_shared = self.t, self.v, self.t.mma_shape, self.gen.load_shared
        mt, nt = t.mma_tiles
        half, per = mma.k // 2, mma.per_reg
        ca, cb = t.mma_chunks
        warp, gq, tq = v["warp"], v["gq"], v["tq"]
        af, bf = v["af"], v["bf"]
        if per == 1:
            with T.unroll(mt) as mi:
                IRBuilder.name("mi", mi)
                for kh in range(2):  # A registers j, j + 1 = rows g, g + 8 of k-half j // 2
                    store(v["a_val"], load_shared("A", buf, tq + kh * half,
                                                  [warp * t.warp_rows, *t.mma_row(mi * 2, gq)], 2),
                          ramp(mi * 4 + 2 * kh, 2))
                # a copy nvcc does not issue (the same registers); TVM would declare `af` float2
                # if the load wrote it, and offset the mma's pointer into it in float2 units
                with T.unroll(4) as j:
                    IRBuilder.name("j", j)
                    store(af, v["a_val"][mi * 4 + j], mi * 4 + j)
            with T.unroll(nt) as ni:
                IRBuilder.name("ni", ni)
                with T.unroll(2) as j:
                    IRBuilder.name("j", j)
                    store(bf, load_shared("B", buf, tq + j * half, t.mma_col(ni, gq)), ni * 2 + j)
        else:
            for operand, count, chunk, base in (("a", 2 * mt, ca, [warp * t.warp_rows]), ("b", nt, cb, [])):
                for kh in range(2):  # the 2 x per k rows a lane reads, `chunk` values a load
                    for el in range(per):
                        at = (kh * per + el) * count
                        for q in range(count // chunk):
                            col = [*base, q * 8 * chunk, gq * chunk]
                            store(v[f"{operand}_val"],
                                  load_shared(operand.upper(), buf, tq * per + (el + kh * half), col, chunk),
                                  ramp(at + q * chunk, chunk))

            def packed(operand: str, count: int, kh: int, i: int) -> Expr:
                values = v[f"{operand}_val"]
                return bf16_pair(*(values[(kh * per + el) * count + i] for el in range(per)))

            for mi in range(mt):
                for j in range(4):  # A register j: rows g + 8 (j % 2), k-half j // 2
                    store(af, packed("a", 2 * mt, j // 2, 2 * mi + j % 2), mi * 4 + j)
            for ni in range(nt):
                for j in range(2):  # B register j: k-half j
                    store(bf, packed("b", nt, j, ni), ni * 2 + j)
        with T.unroll(mt) as mi, T.unroll(nt) as ni:
            IRBuilder.name_many(["mi", "ni"], [mi, ni])
            evaluate(T.ptx_legacy.mma(mma.shape, "row", "col", mma.ptx_type, mma.ptx_type, "fp32", af.data, mi * 4,
                                      bf.data, ni * 2, v["acc"].data, (mi * nt + ni) * 4, False, dtype="float32"))

    def stage_accumulators(self) -> None:
        t, v = self.t, self.v
        mt, nt = t.mma_tiles
        with T.grid(mt, nt, 2, 2) as loops:  # C[g + 8h][2t + b] of tile (mi, ni)
            mi, ni, h, b = IRBuilder.name_many(["mi", "ni", "h", "b"], loops)
            store(v["O_sh"], v["acc"][(mi * nt + ni) * 4 + h * 2 + b],
                  terms(v["warp"] * t.warp_rows, *t.mma_row(mi * 2 + h, v["gq"])),
                  terms(*t.mma_col(ni, v["tq"] * 2 + b)))


class Wgmma(_TensorCores):
    """Hopper's warpgroup issuing asynchronous `wgmma.mma_async` (:class:`~tvm_ext.intrin.cuda.WgmmaShape`),
    one per 64-column slab and k step; the weights' tile read through a matrix descriptor."""

    @property
    def accumulators(self) -> int:
        return self.t.slabs * self.t.rows // 2

    def declare_registers(self) -> None:
        plan, t, gen = self.plan, self.t, self.gen
        gen.buffer("acc", (self.accumulators,), scope="local")
        sets = gen.ring if plan.wgmma_in_flight else 1  # one per ring slot
        gen.buffer("af", (sets * t.slabs * 4,), "uint32", scope="local")
        if plan.gathers_fragments:  # a step's gathered values, before the dead columns' zeros
            gen.buffer("fv", (t.slabs * 4 * t.wgmma_shape.per_reg,), scope="local")
        gen.buffer("desc", (1 if plan.wgmma_in_flight else 2,), "uint64", scope="local")

    def prologue(self) -> None:
        super().prologue()
        plan, wg, v = self.plan, self.t.wgmma_shape, self.v
        # LBO and SBO in 16-byte units, no swizzle; the ring's, moved per slot; else each
        # buffer's (a single step uses one)
        tiles = ["A_ring"] if plan.wgmma_in_flight else ["A_sh0", "A_sh1"][:self.gen.slice_steps()]
        for buf, tile in enumerate(tiles):
            evaluate(T.cuda.wgmma.encode_matrix_descriptor(T.address_of(v["desc"][buf]), T.address_of(v[tile][0]),
                                                           wg.lbo // 16, wg.sbo // 16, 0))

    def compute(self, buf: int, slot: int = 0) -> None:
        """One k step on Hopper's tensor cores: per 64-column slab one asynchronous wgmma of the
        whole warpgroup, N = the block's rows. Its A operand is the slab's data (the im2col tile),
        from registers in the layout of :class:`WgmmaShape` (where groups stay in flight, the set
        of ring slot `slot`, gathered there two steps before); its B operand the weights' tile,
        which the tensor cores read from shared memory through a descriptor: of buffer `buf` (in
        flight: of the ring's slot `buf`). The caller waits for the group before the tile or
        registers change."""
        t, v, wg = self.t, self.v, self.t.wgmma_shape
        half = wg.k // 2
        base = self.gen.fragment_base(slot)
        af, acc = v["af"], v["acc"]
        if not self.plan.gathers_fragments:
            per = wg.per_reg
            warp, gq, tq = v["warp"], v["gq"], v["tq"]
            with T.unroll(t.slabs) as sl:
                IRBuilder.name("sl", sl)
                # A[16 warp + g + 8 (j % 2)][t per + e + k/2 (j // 2)]
                with T.unroll(4) as j:
                    IRBuilder.name("j", j)
                    at = [self.gen.load_shared("B", buf, (tq * per + el if per > 1 else tq) + j // 2 * half,
                                               [sl * 64, warp * 16, gq, j % 2 * 8]) for el in range(per)]
                    bits = T.reinterpret("uint32", at[0]) if per == 1 else bf16_pair(*at)
                    store(af, bits, base + sl * 4 + j)
        evaluate(T.ptx["wgmma.fence.sync.aligned"]())
        per_slab = t.rows // 2
        for sl in range(t.slabs):
            # the start address (16-byte units, the low bits) moved to the ring's slot
            desc = (v["desc"][0] + T.uint64(buf * t.weight_words * 4 // 16) if self.plan.wgmma_in_flight
                    else v["desc"][buf])
            evaluate(T.ptx[wg.opcode(t.rows)](*(acc[sl * per_slab + i] for i in range(per_slab)),
                                              *(af[base + sl * 4 + j] for j in range(4)), desc, T.bool(True),
                                              *wg.immediates))
        evaluate(T.ptx["wgmma.commit_group.sync.aligned"]())

    def end_step(self) -> None:
        # the tensor cores worked through the store; the buffer and registers are free now
        _wgmma_wait(0)

    def end_k_loop(self) -> None:
        if self.plan.wgmma_in_flight:  # the last step's group, in every thread before the output
            _wgmma_wait(0)  # tile (TVM may lay it over the ring)
            self.gen.sync()

    def stage_accumulators(self) -> None:
        t, v = self.t, self.v
        # D[16 warp + g + 8h][8c + 2t + b] of slab sl: row = channel
        with T.grid(t.slabs, t.rows // 8, 2, 2) as loops:
            sl, c, h, b = IRBuilder.name_many(["sl", "c", "h", "b"], loops)
            store(v["O_sh"], v["acc"][sl * (t.rows // 2) + c * 4 + h * 2 + b],
                  c * 8 + v["tq"] * 2 + b, sl * 64 + v["warp"] * 16 + v["gq"] + h * 8)


def engine_for(gen: Host) -> Engine:
    """The engine of `gen`'s tile (:attr:`BlockTile.engine`): wgmma, mma.sync or FFMA."""
    if gen.t.wgmma is not None:
        return Wgmma(gen)
    if gen.t.mma is not None:
        return MmaSync(gen)
    return Ffma(gen)
