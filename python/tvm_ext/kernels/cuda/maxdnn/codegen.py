"""The maxDNN kernel as TVMScript text (:class:`Generator`), parsed and tensorized into a PrimFunc
(:func:`maxdnn_conv2d_func`) and lowered to CUDA C (:func:`cuda_source`).

The generator writes text rather than building TIR because the kernel is a fixed, hand-placed
schedule (which buffer each k step reads, where each barrier and wgmma wait goes) that reads best
as the loop nest it is. Its steps are methods so that a subclass can change one: the tests' broken
kernels (:mod:`tvm_ext.testing.maxdnn`) override :meth:`Generator.source_buffer`,
:meth:`Generator.store_prefetched` and :meth:`~.operands.OperandWriter.fence_proxy_async`.
"""

from __future__ import annotations

import math

import tvm
from tvm import s_tir

from ....intrin.cuda import get_outer_product_intrin
from ....target import resolve_target
from ... import script
from ...conv2d import KERNEL_ATTR
from ..ptx import generate_source
from .operands import OperandWriter, bf16_pair_text
from .plan import FLAT_PARAMS, KERNEL_NAME, Epilogue, MaxDNNPlan
from .split_k import REDUCE_SUFFIX, split_reduce_func


def _clamp_text(value: str, vec: int, upper: float | None) -> str:
    """relu (`upper` None) or relu6 of the TVMScript value `value` (a name: it is read twice), as
    selects that keep a NaN, as PyTorch does."""
    def const(c: float) -> str:
        return f"T.Broadcast(T.float32({c}), {vec})" if vec > 1 else f"T.float32({c})"

    clamped = value if upper is None else f"T.Select({value} > {const(upper)}, {const(upper)}, {value})"
    return f"T.Select({value} < {const(0)}, {const(0)}, {clamped})"


class Generator(OperandWriter):
    """Emits the kernel for one plan (the algorithm: :mod:`tvm_ext.kernels.cuda.maxdnn`)."""

    def sync(self) -> None:
        self.e('T.evaluate(T.tvm_storage_sync("shared"))')

    def compute(self, buf: int, name: str) -> None:
        t, e = self.t, self.e
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

    def compute_mma(self, buf: int) -> None:
        """One k step on the tensor cores: a warp's warp_rows x cols slab as warp_rows/16 x cols/8
        mma.sync, its fragments loaded from shared memory in the layouts of :class:`MmaShape`.

        The mma's row and column indices are a permutation of the tile's (:meth:`BlockTile.mma_row`,
        :meth:`BlockTile.mma_col`; the output staging undoes it) that puts side by side the values a
        lane needs from one shared row, so that it loads them as one vector (:attr:`BlockTile.mma_chunks`).
        tf32 takes the registers as loaded: an A fragment's rows g and g + 8 are one 64-bit load
        into the register pair the mma reads (its B registers come from two k rows: 32-bit loads).
        bf16 packs two k rows into each register anyway: its loads are 128-bit, into `a_val` and
        `b_val`, then packed."""
        t, e, mma = self.t, self.e, self.t.mma_shape
        mt, nt = t.mma_tiles
        half, per = mma.k // 2, mma.per_reg
        ca, cb = t.mma_chunks
        a_base = f"warp * {t.warp_rows} + "
        if per == 1:
            with e.block(f"for mi in T.unroll({mt}):"):
                for kh in range(2):  # A registers j, j + 1 = rows g, g + 8 of k-half j // 2
                    e(f"a_val[T.ramp(mi * 4 + {2 * kh}, 1, 2)] = "
                      f"{self.shared_at('A', buf, f'tq + {kh * half}', a_base + t.mma_row('mi * 2', 'gq'), 2)}")
                # a copy nvcc does not issue (the same registers); TVM would declare `af` float2
                # if the load wrote it, and offset the mma's pointer into it in float2 units
                with e.block("for j in T.unroll(4):"):
                    e("af[mi * 4 + j] = a_val[mi * 4 + j]")
            with e.block(f"for ni in T.unroll({nt}):"):
                with e.block("for j in T.unroll(2):"):
                    e(f"bf[ni * 2 + j] = {self.shared_at('B', buf, f'tq + j * {half}', t.mma_col('ni', 'gq'))}")
        else:
            for operand, count, chunk, base in (("a", 2 * mt, ca, a_base), ("b", nt, cb, "")):
                for kh in range(2):  # the 2 x per k rows a lane reads, `chunk` values a load
                    for el in range(per):
                        at = (kh * per + el) * count
                        for q in range(count // chunk):
                            col = f"{base}{q * 8 * chunk} + gq * {chunk}"
                            e(f"{operand}_val[T.ramp({at + q * chunk}, 1, {chunk})] = "
                              f"{self.shared_at(operand.upper(), buf, f'tq * {per} + {el + kh * half}', col, chunk)}")

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

    def compute_wgmma(self, buf: int, slot: int = 0) -> None:
        """One k step on Hopper's tensor cores: per 64-column slab one asynchronous wgmma of the
        whole warpgroup, N = the block's rows. Its A operand is the slab's data (the im2col tile),
        from registers in the layout of :class:`WgmmaShape` (where groups stay in flight, the set
        of ring slot `slot`, gathered there two steps before); its B operand the weights' tile,
        which the tensor cores read from shared memory through a descriptor: of buffer `buf` (in
        flight: of the ring's slot `buf`). The caller waits for the group before the tile or
        registers change."""
        t, e, wg = self.t, self.e, self.t.wgmma_shape
        half = wg.k // 2
        base = self.fragment_base(slot)
        desc = f"desc[{buf}]"
        if self.plan.wgmma_in_flight:  # the start address (16-byte units, the low bits) moved to the slot
            desc = f"desc[0] + T.uint64({buf * t.weight_words * 4 // 16})"
        if not self.plan.gathers_fragments:
            per = wg.per_reg
            with e.block(f"for sl in T.unroll({t.slabs}):"):
                # A[16 warp + g + 8 (j % 2)][t per + e + k/2 (j // 2)]
                with e.block("for j in T.unroll(4):"):
                    at = [self.shared_at("B", buf, f"tq{f' * {per} + {el}' if per > 1 else ''} + j // 2 * {half}",
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

    def stage_accumulators(self) -> None:
        """Each thread's accumulators into the block's output tile in shared memory."""
        t, e = self.t, self.e
        if t.wgmma is not None:  # D[16 warp + g + 8h][8c + 2t + b] of slab sl: row = channel
            with e.block(f"for sl, c, h, b in T.grid({t.slabs}, {t.rows // 8}, 2, 2):"):
                e(f"O_sh[c * 8 + tq * 2 + b, sl * 64 + warp * 16 + gq + h * 8] = "
                  f"acc[sl * {t.rows // 2} + c * 4 + h * 2 + b]")
            return
        if t.mma is not None:
            mt, nt = t.mma_tiles
            with e.block(f"for mi, ni, h, b in T.grid({mt}, {nt}, 2, 2):"):  # C[g + 8h][2t + b] of tile (mi, ni)
                e(f"O_sh[warp * {t.warp_rows} + {t.mma_row('mi * 2 + h', 'gq')}, {t.mma_col('ni', 'tq * 2 + b')}] = "
                  f"acc[(mi * {nt} + ni) * 4 + h * 2 + b]")
            return
        tt = t.thread_tile()
        for i in range(tt.rows):
            row = f"ty * {t.vec} + {i // t.vec * tt.row_gap + i % t.vec}"
            for h in range(tt.cols // t.vec):
                e(f"O_sh[{row}, T.ramp(tx * {t.vec} + {h * tt.col_gap}, 1, {t.vec})] = "
                  f"acc[{i}, T.ramp({h * t.vec}, 1, {t.vec})]")

    def step(self, kt: str, buf: int, prefetch: bool, at: tuple[str | None, str] | None = None,
             when: str | None = None) -> None:
        """One k step on buffer `buf`; with `prefetch`, the next step's loads overlap it (only
        where the condition `when` holds, if given; `at`: see :meth:`load_global`)."""
        if prefetch:
            with self.only_if(when):
                self.load_global(f"({kt} + 1)", at)
        source = self.source_buffer(buf, 1 - buf)
        if self.t.wgmma is not None:
            self.compute_wgmma(source)
        elif self.t.mma is not None:
            self.compute_mma(source)
        else:
            self.compute(source, f"update{len(self.updates)}")
            self.updates.append(f"update{len(self.updates)}")
        if prefetch:
            self.store_prefetched(1 - buf, f"({kt} + 1)", when)
        if self.t.wgmma is not None:  # the tensor cores worked through the store;
            self.e('T.ptx["wgmma.wait_group.sync.aligned"](0)')  # the buffer and registers are free now
        self.sync()

    def step_in_flight(self, kt: str, slot: int) -> None:
        """One k step (`kt`, in ring slot `slot` = its index in the slice modulo
        :data:`WGMMA_RING`) with wgmma groups in flight (:attr:`MaxDNNPlan.wgmma_in_flight`):
        issue its group on the slot's fragments and weights' tile; wait for the group before
        (whose registers and slot are then free in this thread, and by the barrier in all);
        gather step k + 2's fragments into the registers that group read and load its weights;
        store step k + 1's weights (loaded a step ago) into its slot, which the group before
        last read; barrier. Every register a wgmma reads is written only after the group that
        read it last is waited for, with no copies: ptxas serializes every wgmma (C7513) when a
        register of one is defined while a group is in flight between the copy and the issue."""
        e, ring = self.e, self.ring
        end = self.slice_end()
        self.compute_wgmma(self.source_buffer(slot, (slot + 1) % ring), slot)
        e('T.ptx["wgmma.wait_group.sync.aligned"](1)')
        with self.only_if(f"{kt} + 2 < {end}"):
            self.load_global(f"({kt} + 2)", regs=(slot + 2) % ring)
            self.load_packed_weights(f"({kt} + 2)", (slot + 2) % ring)
        self.store_prefetched((slot + 1) % ring, f"({kt} + 1)", f"{kt} + 1 < {end}")
        self.sync()

    def source_buffer(self, filled: int, filling: int) -> int:
        """The buffer (ring slot) a k step computes on: `filled`, the one filled last step, not
        `filling`, the one its prefetch is filling."""
        return filled

    def store_prefetched(self, buf: int, kt: str, when: str | None) -> None:
        """The prefetched tiles of k step `kt` into shared buffer (ring slot) `buf`, where the
        condition `when` holds (always, if None)."""
        with self.only_if(when):
            self.store_shared(buf, kt)

    def k_loop(self) -> None:
        """Every k step after the prologue's, each computing on one buffer while the next step's
        loads fill the other."""
        plan, e = self.plan, self.e
        first = self.first_step()
        if plan.wgmma_in_flight:
            self.k_loop_in_flight()
            return
        if plan.tap_loop:
            taps, per_tap = self.wl.KH * self.wl.KW // plan.splits, plan.steps_per_tap
            tap = f"({first} + rs)"
            with e.block(f"for rs in range({taps}):"):
                if per_tap > 2:
                    # kept a loop: nvcc would unroll a short one, spilling the tensor-core tiles
                    with e.block(f"for c2 in T.serial(0, {per_tap // 2 - 1}, unroll=False):"):
                        self.step(f"{tap} * {per_tap} + c2 * 2", 0, True, (None, "(c2 * 2 + 1)"))
                        self.step(f"{tap} * {per_tap} + c2 * 2 + 1", 1, True, (None, "(c2 * 2 + 2)"))
                self.step(f"{tap} * {per_tap} + {per_tap - 2}", 0, True, (None, str(per_tap - 1)))
                self.step(f"{tap} * {per_tap} + {per_tap - 1}", 1, True, (f"({tap} + 1)", "0"),
                          when=f"rs < {taps - 1}")
            return
        steps = self.slice_steps()
        pairs = (steps - 1) // 2  # pairs of steps that both prefetch
        if pairs:
            with e.block(f"for kt2 in range({pairs}):"):
                self.step(f"{first} + kt2 * 2", 0, True)
                self.step(f"{first} + kt2 * 2 + 1", 1, True)
        tail = steps - 2 * pairs  # 1 or 2 steps; only the last has nothing to prefetch
        if tail == 2:
            self.step(f"{first} + {2 * pairs}", 0, True)
            self.step(f"{first} + {2 * pairs + 1}", 1, False)
        else:
            self.step(f"{first} + {2 * pairs}", 0, False)

    def k_loop_in_flight(self) -> None:
        """The slice's k steps, :data:`WGMMA_RING` at a time so each step's ring slot and
        register sets are constants (registers cannot be indexed at run time), then the rest.
        The fragments' gather keeps a running tap of its own, two steps ahead of the steps."""
        e, ring = self.e, self.ring
        first, steps = self.first_kt(), self.slice_steps()
        if steps // ring:
            # kept a loop: nvcc would unroll a short one, spilling the tensor-core tiles
            with e.block(f"for kr in T.serial(0, {steps // ring}, unroll=False):"):
                for slot in range(ring):
                    self.step_in_flight(f"{first} + kr * {ring} + {slot}", slot)
        for slot in range(steps % ring):
            self.step_in_flight(f"{first} + {steps // ring * ring + slot}", slot)

    def first_kt(self) -> str:
        """This block's first k step (see :meth:`first_step`)."""
        plan = self.plan
        return f"{self.first_step()} * {plan.steps_per_tap}" if plan.tap_loop else self.first_step()

    def slice_steps(self) -> int:
        """The k steps of this block's share of the reduction."""
        return self.plan.k_steps // self.plan.splits

    def slice_end(self) -> str:
        """The k step after this block's share of the reduction (see :meth:`first_step`)."""
        return f"{self.first_kt()} + {self.slice_steps()}"

    def first_step(self) -> str:
        """Where this block's share of the reduction starts: its slice's first tap (with
        :attr:`MaxDNNPlan.tap_loop`) or k step; 0 without split-K."""
        plan = self.plan
        if plan.splits == 1:
            return "0"
        _, count = plan.split_slices
        return f"(sp * {count // plan.splits})"

    def keep_tiles_live(self) -> None:
        """Mark the operand tiles used after the k loop, so that TVM keeps each allocated
        through all of it. TVM's StorageRewrite lays a buffer over another whose last access it
        sees before the first of its own, and only a loop joins the double buffers' lifetimes;
        a slice of a few k steps has none (or one of a single iteration, which TVM unrolls), and
        there it merged them: for mma.sync and FFMA a second barrier a step, for wgmma, whose
        tensor cores read the weights' tile through a descriptor TVM does not see, a tile
        stored over the one a wgmma was reading. (wgmma in flight has one ring, always live.)
        The mark is a pure call, which RemoveNoOp drops after StorageRewrite: it emits no code
        (the k loops' SASS is unchanged where there was a loop)."""
        if self.plan.wgmma_in_flight:
            return
        for buf in range(min(self.slice_steps(), 2)):
            for name in self.plan.operand_tiles:
                at = self.shared_at(name, buf, "0", "0", self.t.vec)
                self.e(f'T.evaluate(T.call_pure_extern("void", "(void)", {at}))')

    # -- output ----------------------------------------------------------------------------
    def write_output(self) -> None:
        """The block's tile through shared memory to the output with the epilogue; with split-K,
        the slice's raw sums to `partial` (the reduce kernel applies the epilogue)."""
        t, e, ep = self.t, self.e, self.plan.epilogue
        M, NC = self.M, self.NCOLS
        split = self.plan.splits > 1
        if split:
            ep = Epilogue()
        if self.plan.wgmma_in_flight:  # the last step's group, in every thread before the output
            e('T.ptx["wgmma.wait_group.sync.aligned"](0)')  # tile (TVM may lay it over the ring)
            self.sync()
        self.stage_accumulators()
        e('T.evaluate(T.tvm_storage_sync("shared"))')
        per_row = t.cols // t.vec
        vec = t.vec if self.plan.vector_y else 1
        for s, _ in self.slots(t.rows * per_row):
            f = f"(tid + {s * t.threads})"
            e(f"oo{s}: T.let = by * {t.rows} + {f} // {per_row}")
            e(f"oc{s}: T.let = bx * {t.cols} + {f} % {per_row} * {t.vec}")
            for lane in range(0, t.vec, vec):
                sidx = (f"T.ramp({f} % {per_row} * {t.vec} + {lane}, 1, {vec})" if vec > 1
                        else f"{f} % {per_row} * {t.vec} + {lane}")
                value = f"O_sh[{f} // {per_row}, {sidx}]"
                yaddr = (f"((sp * {self.wl.groups} + g) * {M} + oo{s}) * {NC} + " if split
                         else f"(g * {M} + oo{s}) * {NC} + ")
                yidx = (f"T.ramp({yaddr}oc{s} + {lane}, 1, {vec})" if vec > 1 else f"{yaddr}oc{s} + {lane}")
                if ep.bias:
                    b = f"bias[g * {M} + oo{s}]"
                    value = f"{value} + " + (f"T.Broadcast({b}, {vec})" if vec > 1 else b)
                if ep.residual:
                    value = f"{value} + Rf[{yidx}]"
                with e.block(f"if oo{s} < {M} and oc{s} + {lane} < {NC}:"):
                    if ep.activation in ("relu", "relu6"):  # selects: a NaN stays NaN (fmaxf drops it)
                        e(f"v{s}_{lane}: T.let = {value}")
                        value = _clamp_text(f"v{s}_{lane}", vec, 6.0 if ep.activation == "relu6" else None)
                    e(f"{'Pf' if split else 'Yf'}[{yidx}] = {value}")

    # -- the whole function ----------------------------------------------------------------
    def text(self, symbol: str) -> str:
        plan, t, e = self.plan, self.t, self.e
        shapes = plan.shapes()
        self.updates: list[str] = []
        params = list(shapes)
        e("# from tvm.script import tirx as T")
        e("@T.prim_func(s_tir=True)")
        e("def main(" + ", ".join(f'{n}: T.Buffer({shapes[n]}, "float32")' for n in params) + "):")
        e.depth += 1
        e(f'T.func_attr({{"global_symbol": "{symbol}", "tirx.noalias": True, '
          f'"{KERNEL_ATTR}": "{KERNEL_NAME}"}})')
        # The explicit root block comes first: a statement before it would make it a child of an
        # implicit root whose inferred reads name the buffers allocated here (ill-formed TIR).
        with e.block('with T.sblock("root"):'):
            # explicit regions: inference cannot read the tensor-core calls' raw buffer pointers
            out = params[-1]  # y, or with split-K the slices' partial sums
            e("T.reads(" + ", ".join(f"{n}[{', '.join(f'0:{d}' for d in shapes[n])}]" for n in params[:-1]) + ")")
            e(f"T.writes({out}[{', '.join(f'0:{d}' for d in shapes[out])}])")
            flat = FLAT_PARAMS
            sizes = {n: math.prod(shape) for n, shape in shapes.items()}
            for n in params:
                if flat[n] != n:
                    e(f'{flat[n]} = T.decl_buffer(({sizes[n]},), "float32", data={n}.data)')
            gx, gy, gz = plan.grid
            e(f'for {"gz" if plan.splits > 1 else "g"} in T.thread_binding({gz}, thread="blockIdx.z"):')
            e.depth += 1
            e(f'for by in T.thread_binding({gy}, thread="blockIdx.y"):')
            e.depth += 1
            e(f'for bx in T.thread_binding({gx}, thread="blockIdx.x"):')
            e.depth += 1
            e(f'for tid in T.thread_binding({t.threads}, thread="threadIdx.x"):')
            e.depth += 1
            # Declared (allocated) here, under the thread loops: block allocations would be
            # hoisted out of the kernel, and a block here would hide `tid` from blockize.
            self.declare_shared()
            if t.wgmma is not None:
                e(f'acc = T.decl_buffer(({t.slabs * t.rows // 2},), "float32", scope="local")')
                sets = self.ring if plan.wgmma_in_flight else 1  # one per ring slot
                e(f'af = T.decl_buffer(({sets * t.slabs * 4},), "uint32", scope="local")')
                if plan.gathers_fragments:  # a step's gathered values, before the dead columns' zeros
                    e(f'fv = T.decl_buffer(({t.slabs * 4 * t.wgmma.per_reg},), "float32", scope="local")')
                e(f'desc = T.decl_buffer(({1 if plan.wgmma_in_flight else 2},), "uint64", scope="local")')
            elif t.mma is not None:
                mt, nt = t.mma_tiles
                reg = "float32" if t.mma.per_reg == 1 else "uint32"
                e(f'acc = T.decl_buffer(({mt * nt * 4},), "float32", scope="local")')
                e(f'af = T.decl_buffer(({mt * 4},), "{reg}", scope="local")')
                e(f'bf = T.decl_buffer(({nt * 2},), "{reg}", scope="local")')
                # the fragments' values as loaded from shared memory (bf16: before packing)
                e(f'a_val = T.decl_buffer(({2 * t.mma.per_reg * 2 * mt},), "float32", scope="local")')
                if t.mma.per_reg > 1:
                    e(f'b_val = T.decl_buffer(({2 * t.mma.per_reg * nt},), "float32", scope="local")')
            else:  # FFMA
                tt = t.thread_tile()
                e(f'acc = T.decl_buffer(({tt.rows}, {tt.cols}), "float32", scope="local")')
            nb = len(self.slots(t.k_step * t.cols // t.vec))
            sets = self.ring if plan.wgmma_in_flight else 1  # the weights two steps ahead: per ring slot
            e(f'a_pre = T.decl_buffer(({sets * self.weight_regs},), "float32", scope="local")')
            if not plan.gathers_fragments:
                e(f'b_pre = T.decl_buffer(({nb * t.vec},), "float32", scope="local")')
            if plan.splits > 1:  # blockIdx.z: the group and the slice of the reduction
                e(f"g: T.let = gz // {plan.splits}")
                e(f"sp: T.let = gz % {plan.splits}")
            if t.mma is not None or t.wgmma is not None:
                e("warp: T.let = tid // 32")
                e("gq: T.let = tid % 32 // 4")
                e("tq: T.let = tid % 4")
                accumulators = t.slabs * t.rows // 2 if t.wgmma is not None else t.mma_tiles[0] * t.mma_tiles[1] * 4
                with e.block(f"for i in T.serial({accumulators}):"):
                    e("acc[i] = T.float32(0)")
                if t.wgmma is not None:  # LBO and SBO in 16-byte units, no swizzle
                    # the ring's, moved per slot; else each buffer's (a single step uses one)
                    tiles = ["A_ring"] if plan.wgmma_in_flight else ["A_sh0", "A_sh1"][:self.slice_steps()]
                    for buf, tile in enumerate(tiles):
                        e(f"T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc[{buf}]), "
                          f"T.address_of({tile}[0]), {t.wgmma.lbo // 16}, {t.wgmma.sbo // 16}, 0)")
            else:
                e(f"ty: T.let = tid // {t.threads_n}")
                e(f"tx: T.let = tid % {t.threads_n}")
                tt = t.thread_tile()
                with e.block(f"for i, j in T.grid({tt.rows}, {tt.cols}):"):
                    e("acc[i, j] = T.float32(0)")
            self.b_columns()
            first = self.first_step()
            first_kt = self.first_kt()
            if plan.wgmma_in_flight:  # the weights of the first step, and of the next into set 1
                self.load_packed_weights(first_kt, 0)
            if plan.tap_loop and not plan.gathers_fragments:
                self.load_global(first_kt, (first, "0"), first=True)
            else:
                self.load_global(first, first=True)
            self.store_shared(0, first_kt)
            if plan.wgmma_in_flight:  # and the next step's weights and fragments into set 1
                with self.only_if(f"{first_kt} + 1 < {self.slice_end()}"):
                    self.load_packed_weights(f"({first_kt} + 1)", 1)
                    self.load_global(f"({first_kt} + 1)", regs=1)
            self.sync()
            self.k_loop()
            self.keep_tiles_live()
            self.write_output()
        return "\n".join(e.lines) + "\n"


def maxdnn_conv2d_func(plan: MaxDNNPlan, symbol: str = "maxdnn_conv2d", *, tensorize: bool = True,
                       generator: type[Generator] = Generator) -> tvm.tirx.PrimFunc:
    """The CUDA PrimFunc of `plan`, its 8x8 updates tensorized onto the thread-tile intrinsic.

    Parameters are (x, w[, bias][, residual], y) in the layouts of :meth:`MaxDNNPlan.shapes`.
    `generator` writes the kernel's text: :class:`Generator`, or a subclass (the tests' broken
    kernels, :data:`tvm_ext.testing.maxdnn.FAULTS`).
    """
    gen = generator(plan)
    func = script.from_source(gen.text(symbol))
    if not tensorize or not gen.updates:  # the tensor-core engines issue mma.sync themselves
        return func
    intrin = get_outer_product_intrin(plan.tile.thread_tile())
    sch = s_tir.Schedule(func)
    for name in gen.updates:
        sch.tensorize(sch.get_loops(sch.get_sblock(name))[-5], intrin)
    return sch.mod["main"]


def plan_module(plan: MaxDNNPlan, symbol: str = KERNEL_NAME, *,
                generator: type[Generator] = Generator) -> tvm.IRModule:
    """The plan's kernels: the convolution (written by `generator`), and with split-K the reduce
    kernel after it."""
    funcs = {"main": maxdnn_conv2d_func(plan, symbol, generator=generator)}
    if plan.splits > 1:
        funcs["reduce"] = split_reduce_func(plan, symbol + REDUCE_SUFFIX)
    return tvm.IRModule(funcs)


def cuda_source(plan: MaxDNNPlan, target="nvidia/nvidia-h100", *, generator: type[Generator] = Generator) -> str:
    """The CUDA C that TVM generates for `plan` (no GPU needed): its kernels, in launch order."""
    return generate_source(plan_module(plan, generator=generator), resolve_target(target))
