"""How the maxDNN kernel's operands move, as TVMScript text: global memory -> prefetch registers ->
double-buffered shared tiles (and, for wgmma, fragments gathered straight into registers).

The base of the generator (:class:`~.codegen.Generator`, which adds the k loop, the output and,
through its engine (:mod:`.engines`), the compute): the data movement is half of the kernel's text
and has its own state (the per-tap gather offsets, the load sites' names), so it reads on its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from .plan import WGMMA_RING, MaxDNNPlan


class Emitter:
    """Builds the kernel's TVMScript text line by line (indentation tracked)."""

    def __init__(self):
        self.lines: list[str] = []
        self.depth = 0

    def __call__(self, line: str) -> None:
        self.lines.append("    " * self.depth + line)

    def block(self, header: str):
        emitter = self

        class _Scope:
            def __enter__(self):
                emitter(header)
                emitter.depth += 1

            def __exit__(self, *exc):
                emitter.depth -= 1

        return _Scope()


def _zero(vec: int) -> str:
    return f"T.Broadcast(T.float32(0), {vec})"


def bf16_pair_text(low: str, high: str) -> str:
    """Two float32 expressions rounded to bf16 (nearest even) and packed into a uint32, `low` in
    the low half: one register of a bf16 tensor-core operand."""
    low, high = (f'T.Cast("uint32", T.reinterpret("uint16", T.Cast("bfloat16", {v})))' for v in (low, high))
    return f"{low} | ({high} << T.uint32(16))"


class OperandWriter:
    """Emits the operands' loads and stores for one plan (the algorithm: :mod:`tvm_ext.kernels.cuda.maxdnn`)."""

    ring = WGMMA_RING  # wgmma in flight: the weights' ring's slots (the tests shrink it to show a race)

    def __init__(self, plan: MaxDNNPlan):
        self.plan, self.t, self.wl = plan, plan.tile, plan.wl
        self.M, self.NCOLS, self.K = plan.gemm
        self.e = Emitter()
        self.load_sites = 0

    def first_step(self) -> str:
        """Where this block's share of the reduction starts: the kernel's choice
        (:meth:`~.codegen.Generator.first_step`), which the tap state reads."""
        raise NotImplementedError

    # -- per-thread constants -------------------------------------------------------------
    def slots(self, count: int) -> list[tuple[int, bool]]:
        """(slot, guarded) for distributing `count` float4 slots over the block's threads."""
        n = -(-count // self.t.threads)
        return [(s, (s + 1) * self.t.threads > count) for s in range(n)]

    def b_columns(self) -> None:
        """Bind, per B load slot (and lane if scalar), the k-invariant part of the gather."""
        t, e = self.t, self.e
        if self.plan.gathers_fragments:
            self.fragment_columns()
            return
        per_row = t.cols // t.vec
        lanes = self.lanes
        for s, _ in self.slots(t.k_step * per_row):
            e(f"bf{s}: T.let = tid + {s * t.threads}")
            for lane in lanes:
                self.bind_column("b", f"{s}_{lane}", f"bx * {t.cols} + bf{s} % {per_row} * {t.vec} + {lane}")
        if self.plan.k_order == "rsc":
            self.declare_tap_state("b", len(self.slots(t.k_step * per_row)) * len(lanes))

    def bind_column(self, prefix: str, v: str, column: str) -> None:
        """Bind tile column `column`'s k-invariant gather: `{prefix}c{v}` the column, `{prefix}h{v}`
        and `{prefix}w{v}` the input row and column of its pixel at filter tap (0, 0) (padding
        subtracted), `{prefix}n{v}` its image."""
        wl, e = self.wl, self.e
        e(f"{prefix}c{v}: T.let = {column}")
        e(f"{prefix}pq{v}: T.let = {prefix}c{v} // {wl.N}")
        e(f"{prefix}h{v}: T.let = {prefix}pq{v} // {wl.OW} * {wl.stride[0]} - {wl.padding[0]}")
        e(f"{prefix}w{v}: T.let = {prefix}pq{v} % {wl.OW} * {wl.stride[1]} - {wl.padding[1]}")
        e(f"{prefix}n{v}: T.let = {prefix}c{v} % {wl.N}")

    def declare_tap_state(self, prefix: str, count: int) -> None:
        """RSC order: the running (tap, channel step) where there is no tap loop or the fragments
        are gathered, and per gathered column its offset in the input at the current tap and
        whether it reads the input."""
        e = self.e
        if not self.plan.tap_loop or self.plan.gathers_fragments:
            e('tap = T.decl_buffer((1,), "int32", scope="local")')
            e('c0 = T.decl_buffer((1,), "int32", scope="local")')
        e(f'{prefix}_off = T.decl_buffer(({count},), "int32", scope="local")')
        if self.plan.gathers_fragments:  # as a mask: all ones where the column reads the input
            e(f'{prefix}_mask = T.decl_buffer(({count},), "uint32", scope="local")')
        else:
            e(f'{prefix}_live = T.decl_buffer(({count},), "bool", scope="local")')

    def tap_position(self, prefix: str, tap: str) -> Callable[[str], tuple[str, str, str]]:
        """Bind filter tap `tap`'s (row, column) offsets once per site; returns a function of a
        bound column's suffix giving (whether it reads the input, its input row, its input column)."""
        wl, e = self.wl, self.e
        z = f"_{self.load_sites}"
        e(f"{prefix}r{z}: T.let = {tap} // {wl.KW} * {wl.dilation[0]}")
        e(f"{prefix}s{z}: T.let = {tap} % {wl.KW} * {wl.dilation[1]}")

        def at(v: str) -> tuple[str, str, str]:
            h, w = f"{prefix}h{v} + {prefix}r{z}", f"{prefix}w{v} + {prefix}s{z}"
            live = f"{prefix}c{v} < {self.NCOLS} and 0 <= {h} and {h} < {wl.H} and 0 <= {w} and {w} < {wl.W}"
            return live, h, w

        return at

    def fragment_columns(self) -> None:
        """Gathered wgmma fragments: per slab and row half h, the tile column this thread's A
        registers h and h + 2 read (row 16 warp + g + 8h of the slab), its k-invariant gather."""
        t = self.t
        for sl in range(t.slabs):
            for h in range(2):
                self.bind_column("f", f"{sl}_{h}", f"bx * {t.cols} + {sl * 64 + h * 8} + warp * 16 + gq")
        self.declare_tap_state("f", 2 * t.slabs)

    def enter_tap_fragments(self, tap: str) -> None:
        """Gathered wgmma fragments, for filter tap `tap`: per column, where its k row t (channel
        t of the step) is in the input, and whether it is read at all (`f_mask`: all ones, or
        zeros). A dead column (padding, past the end) reads its channel's first element instead,
        and its loads are masked to zeros."""
        t, wl, e = self.t, self.wl, self.e
        cg = wl.C // wl.groups
        position = self.tap_position("f", tap)
        for sl in range(t.slabs):
            for h in range(2):
                v, i = f"{sl}_{h}", sl * 2 + h
                live, row, col = position(v)
                e(f"f_mask[{i}] = T.Select({live}, T.uint32({2**32 - 1}), T.uint32(0))")
                per = t.wgmma_shape.per_reg
                chan = f"(g * {cg} + tq{f' * {per}' if per > 1 else ''})"
                e(f"f_off[{i}] = T.Select(f_mask[{i}] > T.uint32(0), (({chan} * {wl.H} + {row}) * {wl.W} + "
                  f"{col}) * {wl.N} + fn{v}, {chan} * {wl.H * wl.W * wl.N})")

    def load_fragments(self, chan: str, regs: int = 0) -> None:
        """Gathered wgmma fragments of channel step `chan` of the current tap, straight into the
        registers the wgmma reads (set `regs` of `af`): register h + 2j of a slab holds k rows
        t per_reg + e + k/2 j (channels) of the column of row half h (bf16: two, rounded and
        packed); scalar loads, 8 lanes of a warp reading 8 consecutive images or pixels, zeros
        for a dead column. Each load is unconditional (a dead column's offset is a safe one)
        and then masked: a load under a condition becomes a zeroing move and a predicated load,
        and a select a branch, after either of which ptxas (nvcc 13.0) serializes the wgmma
        (C7513) where the gather has no tap entry to keep it apart from the wait (1x1 filters)."""
        t, wl, e = self.t, self.wl, self.e
        plane = wl.H * wl.W * wl.N
        base = self.fragment_base(regs)
        per = t.wgmma_shape.per_reg
        for sl in range(t.slabs):
            for h in range(2):
                i = sl * 2 + h
                for j in range(2):
                    r = sl * 4 + h + 2 * j
                    for el in range(per):
                        e(f"fv[{r * per + el}] = Xf[f_off[{i}] + ({chan} * {t.k_step} + {j * t.k_step // 2 + el}) * "
                          f"{plane}]")
                    bits = (f'T.reinterpret("uint32", fv[{r}])' if per == 1
                            else f'({bf16_pair_text(f"fv[{r * per}]", f"fv[{r * per + 1}]")})')
                    e(f"af[{base + r}] = {bits} & f_mask[{i}]")

    @property
    def lanes(self) -> list[int]:
        """The lanes of a B load slot gathered one by one (one float4 where the batch allows)."""
        return [0] if self.plan.vector_b else list(range(self.t.vec))

    # -- the RSC gather: per-tap state, loads with no index math ---------------------------
    def enter_tap(self, tap: str) -> None:
        """Per B load slot (and lane), for filter tap `tap`: where its rows start in the input at
        channel offset 0, and whether it reads the input at all (a padding border, a column past
        the end, a slot beyond the tile). A dead slot's registers are zeroed here and left alone
        by the tap's loads, so its shared row is zero without a select per step."""
        if self.plan.gathers_fragments:
            self.enter_tap_fragments(tap)
            return
        t, wl, e = self.t, self.wl, self.e
        per_row = t.cols // t.vec
        cg = wl.C // wl.groups
        position = self.tap_position("b", tap)
        vec = t.vec if self.plan.vector_b else 1
        for s, guarded in self.slots(t.k_step * per_row):
            for lane in self.lanes:
                v, i = f"{s}_{lane}", s * len(self.lanes) + lane
                live, h, w = position(v)
                live += f" and bf{s} < {t.k_step * per_row}" if guarded else ""
                e(f"b_live[{i}] = {live}")
                # in units of the load's width, so that TVM sees the float4 loads aligned
                e(f"b_off[{i}] = (((g * {cg} + bf{s} // {per_row}) * {wl.H} + {h}) * {wl.W} + {w}) * {wl.N // vec}"
                  f" + bn{v} // {vec}")
                at = s * t.vec + lane
                with e.block(f"if not b_live[{i}]:"):
                    e(f"b_pre[T.ramp({at}, 1, {vec})] = {_zero(vec)}" if vec > 1 else f"b_pre[{at}] = T.float32(0)")

    def advance_running_tap(self, first: bool) -> str:
        """Without :attr:`MaxDNNPlan.tap_loop` (or for gathered fragments, loaded two steps
        ahead of the loop's tap): move the running (tap, channel step) to the next k step,
        entering a new tap only when the channels run out (a runtime check; a 1x1 filter has one
        tap). Returns the channel step's expression."""
        wl, e = self.wl, self.e
        if first:  # a slice of split-K starts at its first tap, or a 1x1 filter's at its first channel step
            e(f"tap[0] = {self.first_step() if self.plan.tap_loop else 0}")
            e(f"c0[0] = {0 if self.plan.tap_loop else self.first_step()}")
            self.enter_tap("tap[0]")
        elif wl.KH * wl.KW == 1:
            e("c0[0] = c0[0] + 1")
        else:
            e("c0[0] = c0[0] + 1")
            with e.block(f"if c0[0] == {self.plan.steps_per_tap}:"):
                e("c0[0] = 0")
                e("tap[0] = tap[0] + 1")
                self.enter_tap("tap[0]")
        return "c0[0]"

    def load_b_rsc(self, chan: str) -> None:
        """The B loads of a k step in RSC order, channel step `chan` of the current tap: its 8
        rows are 8 channels of one tap, so each live slot reads at its tap's offset plus the
        channel offset, with no index math or bounds checks."""
        t, wl, e = self.t, self.wl, self.e
        per_row = t.cols // t.vec
        vec = t.vec if self.plan.vector_b else 1
        plane = wl.H * wl.W * wl.N // vec * t.k_step  # one channel step, in units of the load
        for s, _ in self.slots(t.k_step * per_row):
            for lane in self.lanes:
                i, at = s * len(self.lanes) + lane, s * t.vec + lane
                addr = f"(b_off[{i}] + {chan} * {plane}) * {vec}"
                with e.block(f"if b_live[{i}]:"):
                    if vec > 1:
                        e(f"b_pre[T.ramp({at}, 1, {vec})] = Xf[T.ramp({addr}, 1, {vec})]")
                    else:
                        e(f"b_pre[{at}] = Xf[{addr}]")

    # -- global -> registers -> shared -----------------------------------------------------
    def load_global(self, kt: str, at: tuple[str | None, str] | None = None, first: bool = False,
                    regs: int = 0) -> None:
        """Issue the global loads of k step `kt` into the prefetch registers (gathered fragments:
        into set `regs`).

        In RSC order the B loads come from the per-tap state: `at` = (the tap to enter first, or
        None to stay; the channel step) where the k loop knows them (:attr:`MaxDNNPlan.tap_loop`);
        otherwise a running state moves one step per call (`first`: step 0), so calls come in k
        order. Gathered fragments always take the running state: they are loaded two steps
        ahead of the loop's tap."""
        t, wl, e = self.t, self.wl, self.e
        z = f"_{self.load_sites}"  # TVMScript lets are scoped to the function: one name per site
        self.load_sites += 1
        if t.wgmma is None:
            self.load_weight_rows(kt, z)
        elif not self.plan.wgmma_in_flight:  # (in flight, they are loaded two steps ahead: step)
            self.load_packed_weights(kt)
        if self.plan.gathers_fragments:
            self.load_fragments(self.advance_running_tap(first), regs)
            return
        if self.plan.k_order == "rsc":
            load = self.load_b_rsc
            if at is None:
                load(self.advance_running_tap(first))
                return
            tap, chan = at
            if tap is not None:
                self.enter_tap(tap)
            load(chan)
            return
        per_row_b = t.cols // t.vec
        rs, S = wl.KH * wl.KW, wl.KW
        dh, dw = wl.dilation
        cg = wl.C // wl.groups
        for s, guarded in self.slots(t.k_step * per_row_b):  # k = (c * R + r) * S + s
            e(f"bk{s}{z}: T.let = {kt} * {t.k_step} + bf{s} // {per_row_b}")
            e(f"bcin{s}{z}: T.let = g * {cg} + bk{s}{z} // {rs}")
            e(f"br{s}{z}: T.let = bk{s}{z} % {rs} // {S} * {dh}")
            e(f"bs{s}{z}: T.let = bk{s}{z} % {S} * {dw}")
            k_live = f"bk{s}{z} < {self.K}" + (f" and bf{s} < {t.k_step * per_row_b}" if guarded else "")
            for lane in self.lanes:
                v = f"{s}_{lane}"
                h, w = f"bh{v} + br{s}{z}", f"bw{v} + bs{s}{z}"
                live = (f"{k_live} and bc{v} < {self.NCOLS} and 0 <= {h} and {h} < {wl.H} "
                        f"and 0 <= {w} and {w} < {wl.W}")
                addr = f"((bcin{s}{z} * {wl.H} + {h}) * {wl.W} + {w}) * {wl.N} + bn{v}"
                vec = t.vec if self.plan.vector_b else 1
                self.guarded_load("b_pre", s * t.vec + lane, live, "Xf", addr, vec)

    def load_weight_rows(self, kt: str, z: str) -> None:
        """k step `kt`'s k_step rows of the [groups, K, M] weights, guarded at the K and M edges
        (float4 where M allows); `z` names this load site's lets."""
        t, e = self.t, self.e
        M, K = self.M, self.K
        per_row_a = t.rows // t.vec
        for s, guarded in self.slots(t.k_step * per_row_a):
            f = f"(tid + {s * t.threads})"
            e(f"ak{s}{z}: T.let = {kt} * {t.k_step} + {f} // {per_row_a}")
            e(f"ao{s}{z}: T.let = by * {t.rows} + {f} % {per_row_a} * {t.vec}")
            live = f"ak{s}{z} < {K}" + (f" and {f} < {t.k_step * per_row_a}" if guarded else "")
            base = f"(g * {K} + ak{s}{z}) * {M} + ao{s}{z}"
            if self.plan.vector_a:
                self.guarded_load("a_pre", s * t.vec, f"{live} and ao{s}{z} < {M}", "Wf", base, t.vec)
            else:
                for lane in range(t.vec):
                    self.guarded_load("a_pre", s * t.vec + lane, f"{live} and ao{s}{z} + {lane} < {M}", "Wf",
                                      f"{base} + {lane}", 1)

    @property
    def weight_regs(self) -> int:
        """Words of one set of the weights' prefetch registers (`a_pre`): the thread's float4
        slots of a k step's rows x k_step tile (:attr:`BlockTile.weight_words`)."""
        t = self.t
        return len(self.slots(t.weight_words // t.vec)) * t.vec

    def fragment_base(self, slot: int) -> int:
        """Where the fragment registers (`af`) of a step in ring slot `slot` start: one set per
        slot where wgmma groups stay in flight (:attr:`MaxDNNPlan.wgmma_in_flight`), else one."""
        return slot * 4 * self.t.slabs if self.plan.wgmma_in_flight else 0

    def load_packed_weights(self, kt: str, regs: int = 0) -> None:
        """wgmma: k step `kt`'s chunk of the packed weights (:func:`pack_wgmma_weight`), contiguous
        and zero-padded: float4 loads with no guards (of bf16 pairs' bits for bf16), into register
        set `regs` (one per ring slot where the weights are loaded two steps ahead,
        :attr:`MaxDNNPlan.wgmma_in_flight`)."""
        t, e = self.t, self.e
        chunk = t.weight_words
        base = regs * self.weight_regs
        for s, guarded in self.slots(chunk // t.vec):
            f = f"(tid + {s * t.threads})"
            addr = f"((g * {self.plan.grid[1]} + by) * {self.plan.k_steps} + {kt}) * {chunk} + {f} * {t.vec}"
            with self.only_if(f"{f} < {chunk // t.vec}" if guarded else None):
                e(f"a_pre[T.ramp({base + s * t.vec}, 1, {t.vec})] = Wf[T.ramp({addr}, 1, {t.vec})]")

    def guarded_load(self, reg: str, at: int, live: str, src: str, addr: str, vec: int) -> None:
        """reg[at : at + vec] = src[addr : addr + vec] where `live`, else zeros (a border, a tail)."""
        e = self.e
        if vec == 1:
            e(f"{reg}[{at}] = T.if_then_else({live}, {src}[{addr}], T.float32(0))")
            return
        with e.block(f"if {live}:"):
            e(f"{reg}[T.ramp({at}, 1, {vec})] = {src}[T.ramp({addr}, 1, {vec})]")
        with e.block("else:"):
            e(f"{reg}[T.ramp({at}, 1, {vec})] = {_zero(vec)}")

    def store_shared(self, buf: int, kt: str) -> None:
        """The prefetched tiles of k step `kt` into shared buffer `buf` (where wgmma stays in
        flight: the ring's slot `buf`, from the weights' register set of that slot)."""
        t, e = self.t, self.e
        if t.wgmma is not None:  # A: the packed chunk as it is, already in the descriptor's layout
            chunk = t.weight_words
            tile, at = (("A_ring", f"{buf * chunk} + ") if self.plan.wgmma_in_flight else (f"A_sh{buf}", ""))
            regs = buf * self.weight_regs if self.plan.wgmma_in_flight else 0
            for s, guarded in self.slots(chunk // t.vec):
                f = f"(tid + {s * t.threads})"
                with self.only_if(f"{f} < {chunk // t.vec}" if guarded else None):
                    e(f"{tile}[T.ramp({at}{f} * {t.vec}, 1, {t.vec})] = a_pre[T.ramp({regs + s * t.vec}, 1, {t.vec})]")
        for name in self.staged_tiles:
            extent, reg = (t.rows, "a_pre") if name == "A" else (t.cols, "b_pre")
            per_row = extent // t.vec
            for s, guarded in self.slots(t.k_step * per_row):
                f = f"(tid + {s * t.threads})"
                store = (f"{self.shared_at(name, buf, f'{f} // {per_row}', f'{f} % {per_row} * {t.vec}', t.vec)} = "
                         f"{reg}[T.ramp({s * t.vec}, 1, {t.vec})]")
                if guarded:
                    with e.block(f"if {f} < {t.k_step * per_row}:"):
                        e(store)
                else:
                    e(store)
        if t.wgmma is not None:
            self.fence_proxy_async()

    def fence_proxy_async(self) -> None:
        """The tensor cores read the weights' tile through the async proxy: without this fence
        they may see it as it was before the stores (NaN on an H200)."""
        self.e('T.ptx["fence.proxy.async.shared::cta"]()')

    def shared_at(self, name: str, buf: int, row: str, col: str, lanes: int = 1) -> str:
        """Element (row, col) of operand tile `name` ("A", "B") in shared buffer `buf`, `lanes`
        consecutive columns as one vector. Padded tiles are declared flat and indexed with their
        padded row stride: TVM's CompactBufferAllocation trims a 2-D buffer to the columns it
        sees accessed, which drops the padding and, with it, the bank spread the padding is for."""
        if self.t.pad:
            index = f"({row}) * {self.shared_stride(name)} + {col}"
            return f"{name}_sh{buf}[T.ramp({index}, 1, {lanes})]" if lanes > 1 else f"{name}_sh{buf}[{index}]"
        return f"{name}_sh{buf}[{row}, {f'T.ramp({col}, 1, {lanes})' if lanes > 1 else col}]"

    @property
    def staged_tiles(self) -> tuple[str, ...]:
        """The operand tiles staged as k_step rows: all but wgmma's weights, which come already
        in the descriptor's layout."""
        return tuple(name for name in self.plan.operand_tiles if self.t.wgmma is None or name != "A")

    def shared_stride(self, name: str) -> int:
        """Floats per shared row of operand tile `name`, padding included."""
        return (self.t.rows if name == "A" else self.t.cols) + self.t.pad

    def declare_shared(self) -> None:
        """The operand tiles, double-buffered (:meth:`MaxDNNPlan.operand_tiles`), as `__shared__`
        arrays, and the output tile: one too, or where the block needs more than a kernel may
        declare statically, the launch's dynamic shared memory (:attr:`MaxDNNPlan.dynamic_shared_bytes`).
        Separate allocations, not views into one arena: TVM's barrier planner tells buffers apart
        by allocation, and would put a second barrier in every k step between the compute on
        one buffer and the stores to the other."""
        t, e = self.t, self.e
        if self.plan.wgmma_in_flight:  # (only the weights' tile: the fragments are gathered)
            e(f'A_ring = T.decl_buffer(({self.ring * self.plan.operand_tiles["A"]},), "float32", scope="shared")')
        else:
            for buf in (0, 1):
                for name, floats in self.plan.operand_tiles.items():
                    # flat: the descriptor's layout (WgmmaShape), or padded rows (see shared_at)
                    flat = name not in self.staged_tiles or t.pad
                    shape = f"({floats},)" if flat else f"({t.k_step}, {self.shared_stride(name)})"
                    e(f'{name}_sh{buf} = T.decl_buffer({shape}, "float32", scope="shared")')
        scope = "shared.dyn" if self.plan.dynamic_shared_bytes else "shared"
        e(f'O_sh = T.decl_buffer(({t.rows}, {t.cols}), "float32", scope="{scope}")')

    def only_if(self, condition: str | None):
        """A scope whose statements run where `condition` holds (always, if None)."""
        return self.e.block(f"if {condition}:") if condition else contextlib.nullcontext()
