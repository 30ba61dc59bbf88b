"""The maxDNN kernel's compute engines: what FFMA, mma.sync and wgmma write into the kernel's text.

The generator (:class:`~.codegen.Generator`) writes the parts every engine shares (the operands'
movement, the k loop, the output's epilogue) and hands the rest to one :class:`Engine`, chosen
once from the plan's tile (:func:`engine_for`). An engine reads what :class:`Host` lists of its
generator and writes, through the generator's emitter, in this order:

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
from typing import Protocol

from .operands import Emitter, bf16_pair_text
from .plan import MaxDNNPlan
from .tile import BlockTile


class Host(Protocol):
    """What an engine reads of its generator (:class:`~.codegen.Generator`, which satisfies it)."""

    plan: MaxDNNPlan
    t: BlockTile
    e: Emitter
    ring: int  # wgmma in flight: the weights' ring's slots
    updates: list[str]  # FFMA: the names of the update blocks written so far

    def shared_at(self, name: str, buf: int, row: str, col: str, lanes: int = 1) -> str: ...

    def fragment_base(self, slot: int) -> int: ...

    def slice_steps(self) -> int: ...

    def sync(self) -> None: ...


class Engine(abc.ABC):
    """How one engine computes the block's tile: the text it adds to its generator's kernel."""

    def __init__(self, gen: Host):
        self.gen, self.plan, self.t, self.e = gen, gen.plan, gen.t, gen.e

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
    tensorized onto the :class:`~tvm_ext.intrin.cuda.ThreadTile` intrinsic afterwards (their
    blocks' names in :attr:`~.codegen.Generator.updates`)."""

    def declare_registers(self) -> None:
        tt = self.t.thread_tile()
        self.e(f'acc = T.decl_buffer(({tt.rows}, {tt.cols}), "float32", scope="local")')

    def prologue(self) -> None:
        t, e = self.t, self.e
        e(f"ty: T.let = tid // {t.threads_n}")
        e(f"tx: T.let = tid % {t.threads_n}")
        tt = t.thread_tile()
        with e.block(f"for i, j in T.grid({tt.rows}, {tt.cols}):"):
            e("acc[i, j] = T.float32(0)")

    def compute(self, buf: int, slot: int = 0) -> None:
        t, e, updates = self.t, self.e, self.gen.updates
        name = f"update{len(updates)}"
        tt = t.thread_tile()
        with e.block(f"for kk, i0, i1, j0, j1 in T.grid({t.k_step}, {tt.rows // t.vec}, {t.vec}, "
                     f"{tt.cols // t.vec}, {t.vec}):"):
            with e.block(f'with T.sblock("{name}"):'):
                e(f"vty = T.axis.spatial({t.threads_m}, tid // {t.threads_n})")
                e(f"vtx = T.axis.spatial({t.threads_n}, tid % {t.threads_n})")
                e(f"vk = T.axis.reduce({t.k_step}, kk)")
                e('vi0, vi1, vj0, vj1 = T.axis.remap("SSSS", [i0, i1, j0, j1])')
                c = f"vi0 * {t.vec} + vi1, vj0 * {t.vec} + vj1"
                e(f"acc[{c}] = acc[{c}] + A_sh{buf}[vk, vty * {t.vec} + vi0 * {tt.row_gap} + vi1] * "
                  f"B_sh{buf}[vk, vtx * {t.vec} + vj0 * {tt.col_gap} + vj1]")
        updates.append(name)

    def stage_accumulators(self) -> None:
        t, e = self.t, self.e
        tt = t.thread_tile()
        for i in range(tt.rows):
            row = f"ty * {t.vec} + {i // t.vec * tt.row_gap + i % t.vec}"
            for h in range(tt.cols // t.vec):
                e(f"O_sh[{row}, T.ramp(tx * {t.vec} + {h * tt.col_gap}, 1, {t.vec})] = "
                  f"acc[{i}, T.ramp({h * t.vec}, 1, {t.vec})]")


class _TensorCores(Engine):
    """What mma.sync and wgmma share: a flat array of `accumulators` per thread, and the thread's
    warp, lane group `gq` and lane in it `tq`, in whose layouts the fragments are."""

    @property
    @abc.abstractmethod
    def accumulators(self) -> int:
        """float32 accumulators per thread."""

    def prologue(self) -> None:
        e = self.e
        e("warp: T.let = tid // 32")
        e("gq: T.let = tid % 32 // 4")
        e("tq: T.let = tid % 4")
        with e.block(f"for i in T.serial({self.accumulators}):"):
            e("acc[i] = T.float32(0)")


class MmaSync(_TensorCores):
    """Warps issuing `mma.sync` (:class:`~tvm_ext.intrin.cuda.MmaShape`): each owns `warp_rows`
    rows of the block, its fragments loaded from the shared tiles."""

    @property
    def accumulators(self) -> int:
        mt, nt = self.t.mma_tiles
        return mt * nt * 4

    def declare_registers(self) -> None:
        t, e, mma = self.t, self.e, self.t.mma_shape
        mt, nt = t.mma_tiles
        reg = "float32" if mma.per_reg == 1 else "uint32"
        e(f'acc = T.decl_buffer(({self.accumulators},), "float32", scope="local")')
        e(f'af = T.decl_buffer(({mt * 4},), "{reg}", scope="local")')
        e(f'bf = T.decl_buffer(({nt * 2},), "{reg}", scope="local")')
        # the fragments' values as loaded from shared memory (bf16: before packing)
        e(f'a_val = T.decl_buffer(({2 * mma.per_reg * 2 * mt},), "float32", scope="local")')
        if mma.per_reg > 1:
            e(f'b_val = T.decl_buffer(({2 * mma.per_reg * nt},), "float32", scope="local")')

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
        t, e, mma, shared_at = self.t, self.e, self.t.mma_shape, self.gen.shared_at
        mt, nt = t.mma_tiles
        half, per = mma.k // 2, mma.per_reg
        ca, cb = t.mma_chunks
        a_base = f"warp * {t.warp_rows} + "
        if per == 1:
            with e.block(f"for mi in T.unroll({mt}):"):
                for kh in range(2):  # A registers j, j + 1 = rows g, g + 8 of k-half j // 2
                    e(f"a_val[T.ramp(mi * 4 + {2 * kh}, 1, 2)] = "
                      f"{shared_at('A', buf, f'tq + {kh * half}', a_base + t.mma_row('mi * 2', 'gq'), 2)}")
                # a copy nvcc does not issue (the same registers); TVM would declare `af` float2
                # if the load wrote it, and offset the mma's pointer into it in float2 units
                with e.block("for j in T.unroll(4):"):
                    e("af[mi * 4 + j] = a_val[mi * 4 + j]")
            with e.block(f"for ni in T.unroll({nt}):"):
                with e.block("for j in T.unroll(2):"):
                    e(f"bf[ni * 2 + j] = {shared_at('B', buf, f'tq + j * {half}', t.mma_col('ni', 'gq'))}")
        else:
            for operand, count, chunk, base in (("a", 2 * mt, ca, a_base), ("b", nt, cb, "")):
                for kh in range(2):  # the 2 x per k rows a lane reads, `chunk` values a load
                    for el in range(per):
                        at = (kh * per + el) * count
                        for q in range(count // chunk):
                            col = f"{base}{q * 8 * chunk} + gq * {chunk}"
                            e(f"{operand}_val[T.ramp({at + q * chunk}, 1, {chunk})] = "
                              f"{shared_at(operand.upper(), buf, f'tq * {per} + {el + kh * half}', col, chunk)}")

            def packed(operand: str, count: int, kh: int, v: int) -> str:
                return bf16_pair_text(*(f"{operand}_val[{(kh * per + el) * count + v}]" for el in range(per)))

            for mi in range(mt):
                for j in range(4):  # A register j: rows g + 8 (j % 2), k-half j // 2
                    e(f"af[{mi * 4 + j}] = {packed('a', 2 * mt, j // 2, 2 * mi + j % 2)}")
            for ni in range(nt):
                for j in range(2):  # B register j: k-half j
                    e(f"bf[{ni * 2 + j}] = {packed('b', nt, j, ni)}")
        with e.block(f"for mi in T.unroll({mt}):"):
            with e.block(f"for ni in T.unroll({nt}):"):
                e(f'T.evaluate(T.ptx_legacy.mma("{mma.shape}", "row", "col", "{mma.ptx_type}", "{mma.ptx_type}", '
                  f'"fp32", af.data, mi * 4, bf.data, ni * 2, acc.data, (mi * {nt} + ni) * 4, False, '
                  'dtype="float32"))')

    def stage_accumulators(self) -> None:
        t, e = self.t, self.e
        mt, nt = t.mma_tiles
        with e.block(f"for mi, ni, h, b in T.grid({mt}, {nt}, 2, 2):"):  # C[g + 8h][2t + b] of tile (mi, ni)
            e(f"O_sh[warp * {t.warp_rows} + {t.mma_row('mi * 2 + h', 'gq')}, {t.mma_col('ni', 'tq * 2 + b')}] = "
              f"acc[(mi * {nt} + ni) * 4 + h * 2 + b]")


class Wgmma(_TensorCores):
    """Hopper's warpgroup issuing asynchronous `wgmma.mma_async` (:class:`~tvm_ext.intrin.cuda.WgmmaShape`),
    one per 64-column slab and k step; the weights' tile read through a matrix descriptor."""

    @property
    def accumulators(self) -> int:
        return self.t.slabs * self.t.rows // 2

    def declare_registers(self) -> None:
        plan, t, e = self.plan, self.t, self.e
        e(f'acc = T.decl_buffer(({self.accumulators},), "float32", scope="local")')
        sets = self.gen.ring if plan.wgmma_in_flight else 1  # one per ring slot
        e(f'af = T.decl_buffer(({sets * t.slabs * 4},), "uint32", scope="local")')
        if plan.gathers_fragments:  # a step's gathered values, before the dead columns' zeros
            e(f'fv = T.decl_buffer(({t.slabs * 4 * t.wgmma_shape.per_reg},), "float32", scope="local")')
        e(f'desc = T.decl_buffer(({1 if plan.wgmma_in_flight else 2},), "uint64", scope="local")')

    def prologue(self) -> None:
        super().prologue()
        plan, wg = self.plan, self.t.wgmma_shape
        # LBO and SBO in 16-byte units, no swizzle; the ring's, moved per slot; else each
        # buffer's (a single step uses one)
        tiles = ["A_ring"] if plan.wgmma_in_flight else ["A_sh0", "A_sh1"][:self.gen.slice_steps()]
        for buf, tile in enumerate(tiles):
            self.e(f"T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc[{buf}]), "
                   f"T.address_of({tile}[0]), {wg.lbo // 16}, {wg.sbo // 16}, 0)")

    def compute(self, buf: int, slot: int = 0) -> None:
        """One k step on Hopper's tensor cores: per 64-column slab one asynchronous wgmma of the
        whole warpgroup, N = the block's rows. Its A operand is the slab's data (the im2col tile),
        from registers in the layout of :class:`WgmmaShape` (where groups stay in flight, the set
        of ring slot `slot`, gathered there two steps before); its B operand the weights' tile,
        which the tensor cores read from shared memory through a descriptor: of buffer `buf` (in
        flight: of the ring's slot `buf`). The caller waits for the group before the tile or
        registers change."""
        t, e, wg = self.t, self.e, self.t.wgmma_shape
        half = wg.k // 2
        base = self.gen.fragment_base(slot)
        desc = f"desc[{buf}]"
        if self.plan.wgmma_in_flight:  # the start address (16-byte units, the low bits) moved to the slot
            desc = f"desc[0] + T.uint64({buf * t.weight_words * 4 // 16})"
        if not self.plan.gathers_fragments:
            per = wg.per_reg
            with e.block(f"for sl in T.unroll({t.slabs}):"):
                # A[16 warp + g + 8 (j % 2)][t per + e + k/2 (j // 2)]
                with e.block("for j in T.unroll(4):"):
                    at = [self.gen.shared_at("B", buf, f"tq{f' * {per} + {el}' if per > 1 else ''} + j // 2 * {half}",
                                             "sl * 64 + warp * 16 + gq + j % 2 * 8") for el in range(per)]
                    bits = f'T.reinterpret("uint32", {at[0]})' if per == 1 else bf16_pair_text(*at)
                    e(f"af[{base} + sl * 4 + j] = {bits}")
        e('T.ptx["wgmma.fence.sync.aligned"]()')
        per_slab = t.rows // 2
        for sl in range(t.slabs):
            d = ", ".join(f"acc[{sl * per_slab + i}]" for i in range(per_slab))
            a = ", ".join(f"af[{base + sl * 4 + j}]" for j in range(4))
            e(f'T.ptx["{wg.opcode(t.rows)}"]({d}, {a}, {desc}, T.bool(True), {wg.immediates})')
        e('T.ptx["wgmma.commit_group.sync.aligned"]()')

    def end_step(self) -> None:
        # the tensor cores worked through the store; the buffer and registers are free now
        self.e('T.ptx["wgmma.wait_group.sync.aligned"](0)')

    def end_k_loop(self) -> None:
        if self.plan.wgmma_in_flight:  # the last step's group, in every thread before the output
            self.e('T.ptx["wgmma.wait_group.sync.aligned"](0)')  # tile (TVM may lay it over the ring)
            self.gen.sync()

    def stage_accumulators(self) -> None:
        t, e = self.t, self.e
        # D[16 warp + g + 8h][8c + 2t + b] of slab sl: row = channel
        with e.block(f"for sl, c, h, b in T.grid({t.slabs}, {t.rows // 8}, 2, 2):"):
            e(f"O_sh[c * 8 + tq * 2 + b, sl * 64 + warp * 16 + gq + h * 8] = "
              f"acc[sl * {t.rows // 2} + c * 4 + h * 2 + b]")


def engine_for(gen: Host) -> Engine:
    """The engine of `gen`'s tile (:attr:`BlockTile.engine`): wgmma, mma.sync or FFMA."""
    if gen.t.wgmma is not None:
        return Wgmma(gen)
    if gen.t.mma is not None:
        return MmaSync(gen)
    return Ffma(gen)
