"""How the maxDNN kernel's operands move, built with TVM's IRBuilder: global memory -> prefetch
registers -> double-buffered shared tiles (and, for wgmma, fragments gathered straight into registers).

The base of the generator (:class:`~.codegen.Generator`, which adds the k loop, the output and,
through its engine (:mod:`.engines`), the compute): the data movement is half of the kernel and
has its own state (the per-tap gather offsets, the load sites' names), so it reads on its own.

The kernel is built statement by statement in an open IRBuilder frame (``T.*``), as the TVMScript
parser would build it from text: arithmetic with Python's operators (which fold constants),
comparisons, ``and`` and ``not`` as the plain nodes (:func:`lt`, :func:`all_of`, ...), a sum written
`a + b + c` as the left-nested adds it parses to (:func:`terms`). Names bound so far (variables,
buffers) are in :attr:`OperandWriter.v`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import tvm
from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from .plan import WGMMA_RING, MaxDNNPlan

Expr = Any  # a PrimExpr, or a Python int the expression folds to
Cond = Any  # a boolean PrimExpr, or a Python bool (a condition known when the kernel is built)


def _dtype(expr: Any) -> str:
    """The scalar dtype of a PrimExpr (a variable's, a load's)."""
    ty: Any = expr.ty if tvm.ir.is_prim_expr(expr) else None
    if not isinstance(ty, tvm.ir.PrimType):
        ty = expr.expr_ty()
    return str(ty.dtype)


def _cmp(op: Callable[[Any, Any], Any], a: Expr, b: Expr, python: Callable[[int, int], bool]) -> Cond:
    """A comparison as TVMScript parses it: a plain node, its int literal typed as the other side."""
    if isinstance(a, int) and isinstance(b, int):
        return python(a, b)
    if isinstance(a, int):
        a = tirx.IntImm(_dtype(b), a)
    if isinstance(b, int):
        b = tirx.IntImm(_dtype(a), b)
    return op(a, b)


def lt(a: Expr, b: Expr) -> Cond:
    return _cmp(tirx.LT, a, b, lambda x, y: x < y)


def le(a: Expr, b: Expr) -> Cond:
    return _cmp(tirx.LE, a, b, lambda x, y: x <= y)


def gt(a: Expr, b: Expr) -> Cond:
    return _cmp(tirx.GT, a, b, lambda x, y: x > y)


def eq(a: Expr, b: Expr) -> Cond:
    return _cmp(tirx.EQ, a, b, lambda x, y: x == y)


def all_of(*conditions: Cond) -> Cond:
    """`a and b and c`: And(And(a, b), c)."""
    value = conditions[0]
    for c in conditions[1:]:
        value = tirx.And(value, c)
    return value


def terms(*summands: Expr) -> Expr:
    """`a + b + c`: (a + b) + c."""
    value = summands[0]
    for s in summands[1:]:
        value = value + s
    return value


def ramp(base: Expr, lanes: int) -> Expr:
    return T.ramp(base, 1, lanes)


def zero(vec: int) -> Expr:
    return T.Broadcast(T.float32(0), vec)


def store(buffer: tirx.Buffer, value: Expr, *index: Expr) -> None:
    """buffer[index] = value (one index as it is, several as a list: as TVMScript passes them)."""
    T.buffer_store(buffer, value, index[0] if len(index) == 1 else list(index))


def evaluate(value: Any) -> None:
    """A call as a statement (the PTX builtins add theirs themselves)."""
    if value is not None:
        T.evaluate(value)


@contextlib.contextmanager
def only_if(condition: Cond | None) -> Iterator[None]:
    """A scope whose statements run where `condition` holds (always, if None or True; never, if
    False: they are built into a frame that is dropped, as TVMScript drops `if False:`)."""
    if condition is None or condition is True:
        yield
    elif condition is False:
        with IRBuilder(), T.prim_func(s_tir=True):
            yield
    else:
        with T.If(condition), T.Then():
            yield


def if_else(condition: Cond, then: Callable[[], None], otherwise: Callable[[], None]) -> None:
    with T.If(condition):
        with T.Then():
            then()
        with T.Else():
            otherwise()


def bf16_pair(low: Expr, high: Expr) -> Expr:
    """Two float32 expressions rounded to bf16 (nearest even) and packed into a uint32, `low` in
    the low half: one register of a bf16 tensor-core operand."""
    low, high = (T.Cast("uint32", T.reinterpret("uint16", T.Cast("bfloat16", v))) for v in (low, high))
    return low | (high << T.uint32(16))


class OperandWriter:
    """Builds the operands' loads and stores for one plan (the algorithm: :mod:`tvm_ext.kernels.cuda.maxdnn`)."""

    ring = WGMMA_RING  # wgmma in flight: the weights' ring's slots (the tests shrink it to show a race)

    def __init__(self, plan: MaxDNNPlan):
        self.plan, self.t, self.wl = plan, plan.tile, plan.wl
        self.M, self.NCOLS, self.K = plan.gemm
        self.v: dict[str, Any] = {}  # the names bound so far: variables, buffers
        self.load_sites = 0

    def let(self, name: str, value: Expr) -> Any:
        """`name: T.let = value`."""
        if isinstance(value, int):
            value = tirx.const(value)
        var = self.v[name] = IRBuilder.name(name, T.Bind(value))
        return var

    def buffer(self, name: str, shape: tuple, dtype: str = "float32", scope: str = "global", **kwargs: Any) -> Any:
        """`name = T.decl_buffer(shape, dtype, scope=scope)`, in scope until the enclosing frame ends."""
        buf = self.v[name] = IRBuilder.name(name, T.decl_buffer(shape, dtype, scope=scope, **kwargs))
        return buf

    def first_step(self) -> Expr:
        """Where this block's share of the reduction starts: the kernel's choice
        (:meth:`~.codegen.Generator.first_step`), which the tap state reads."""
        raise NotImplementedError

    def thread_slot(self, s: int) -> Expr:
        """`(tid + s * threads)`: this thread's float4 slot `s`."""
        return self.v["tid"] + s * self.t.threads

    # -- per-thread constants -------------------------------------------------------------
    def slots(self, count: int) -> list[tuple[int, bool]]:
        """(slot, guarded) for distributing `count` float4 slots over the block's threads."""
        n = -(-count // self.t.threads)
        return [(s, (s + 1) * self.t.threads > count) for s in range(n)]

    def b_columns(self) -> None:
        """Bind, per B load slot (and lane if scalar), the k-invariant part of the gather."""
        t, v = self.t, self.v
        if self.plan.gathers_fragments:
            self.fragment_columns()
            return
        per_row = t.cols // t.vec
        lanes = self.lanes
        for s, _ in self.slots(t.k_step * per_row):
            bf = self.let(f"bf{s}", self.thread_slot(s))
            for lane in lanes:
                self.bind_column("b", f"{s}_{lane}", v["bx"] * t.cols + bf % per_row * t.vec + lane)
        if self.plan.k_order == "rsc":
            self.declare_tap_state("b", len(self.slots(t.k_step * per_row)) * len(lanes))

    def bind_column(self, prefix: str, v: str, column: Expr) -> None:
        """Bind tile column `column`'s k-invariant gather: `{prefix}c{v}` the column, `{prefix}h{v}`
        and `{prefix}w{v}` the input row and column of its pixel at filter tap (0, 0) (padding
        subtracted), `{prefix}n{v}` its image."""
        wl = self.wl
        c = self.let(f"{prefix}c{v}", column)
        pq = self.let(f"{prefix}pq{v}", c // wl.N)
        self.let(f"{prefix}h{v}", pq // wl.OW * wl.stride[0] - wl.padding[0])
        self.let(f"{prefix}w{v}", pq % wl.OW * wl.stride[1] - wl.padding[1])
        self.let(f"{prefix}n{v}", c % wl.N)

    def declare_tap_state(self, prefix: str, count: int) -> None:
        """RSC order: the running (tap, channel step) where there is no tap loop or the fragments
        are gathered, and per gathered column its offset in the input at the current tap and
        whether it reads the input."""
        if not self.plan.tap_loop or self.plan.gathers_fragments:
            self.buffer("tap", (1,), "int32", scope="local")
            self.buffer("c0", (1,), "int32", scope="local")
        self.buffer(f"{prefix}_off", (count,), "int32", scope="local")
        if self.plan.gathers_fragments:  # as a mask: all ones where the column reads the input
            self.buffer(f"{prefix}_mask", (count,), "uint32", scope="local")
        else:
            self.buffer(f"{prefix}_live", (count,), "bool", scope="local")

    def tap_position(self, prefix: str, tap: Expr) -> Callable[[str], tuple[Cond, tuple, tuple]]:
        """Bind filter tap `tap`'s (row, column) offsets once per site; returns a function of a
        bound column's suffix giving (whether it reads the input, its input row, its input column),
        the row and column as the (start, offset) summands of their sums."""
        wl, v = self.wl, self.v
        z = f"_{self.load_sites}"
        r = self.let(f"{prefix}r{z}", tap // wl.KW * wl.dilation[0])
        s = self.let(f"{prefix}s{z}", tap % wl.KW * wl.dilation[1])

        def at(suffix: str) -> tuple[Cond, tuple, tuple]:
            h, w = (v[f"{prefix}h{suffix}"], r), (v[f"{prefix}w{suffix}"], s)
            live = all_of(lt(v[f"{prefix}c{suffix}"], self.NCOLS), le(0, terms(*h)), lt(terms(*h), wl.H),
                          le(0, terms(*w)), lt(terms(*w), wl.W))
            return live, h, w

        return at

    def fragment_columns(self) -> None:
        """Gathered wgmma fragments: per slab and row half h, the tile column this thread's A
        registers h and h + 2 read (row 16 warp + g + 8h of the slab), its k-invariant gather."""
        t, v = self.t, self.v
        for sl in range(t.slabs):
            for h in range(2):
                self.bind_column("f", f"{sl}_{h}", v["bx"] * t.cols + (sl * 64 + h * 8) + v["warp"] * 16 + v["gq"])
        self.declare_tap_state("f", 2 * t.slabs)

    def enter_tap_fragments(self, tap: Expr) -> None:
        """Gathered wgmma fragments, for filter tap `tap`: per column, where its k row t (channel
        t of the step) is in the input, and whether it is read at all (`f_mask`: all ones, or
        zeros). A dead column (padding, past the end) reads its channel's first element instead,
        and its loads are masked to zeros."""
        t, wl, v = self.t, self.wl, self.v
        cg = wl.C // wl.groups
        position = self.tap_position("f", tap)
        f_mask, f_off = v["f_mask"], v["f_off"]
        for sl in range(t.slabs):
            for h in range(2):
                suffix, i = f"{sl}_{h}", sl * 2 + h
                live, row, col = position(suffix)
                store(f_mask, T.Select(live, T.uint32(2**32 - 1), T.uint32(0)), i)
                per = t.wgmma_shape.per_reg
                chan = v["g"] * cg + (v["tq"] * per if per > 1 else v["tq"])
                store(f_off, T.Select(gt(f_mask[i], T.uint32(0)),
                                      terms(terms(chan * wl.H, *row) * wl.W, *col) * wl.N + v[f"fn{suffix}"],
                                      chan * (wl.H * wl.W * wl.N)), i)

    def load_fragments(self, chan: Expr, regs: int = 0) -> None:
        """Gathered wgmma fragments of channel step `chan` of the current tap, straight into the
        registers the wgmma reads (set `regs` of `af`): register h + 2j of a slab holds k rows
        t per_reg + e + k/2 j (channels) of the column of row half h (bf16: two, rounded and
        packed); scalar loads, 8 lanes of a warp reading 8 consecutive images or pixels, zeros
        for a dead column. Each load is unconditional (a dead column's offset is a safe one)
        and then masked: a load under a condition becomes a zeroing move and a predicated load,
        and a select a branch, after either of which ptxas (nvcc 13.0) serializes the wgmma
        (C7513) where the gather has no tap entry to keep it apart from the wait (1x1 filters)."""
        t, wl, v = self.t, self.wl, self.v
        plane = wl.H * wl.W * wl.N
        base = self.fragment_base(regs)
        per = t.wgmma_shape.per_reg
        fv, xf = v["fv"], v["Xf"]
        for sl in range(t.slabs):
            for h in range(2):
                i = sl * 2 + h
                for j in range(2):
                    r = sl * 4 + h + 2 * j
                    for el in range(per):
                        row = chan * t.k_step + (j * t.k_step // 2 + el)
                        store(fv, xf[v["f_off"][i] + row * plane], r * per + el)
                    bits = (T.reinterpret("uint32", fv[r]) if per == 1 else bf16_pair(fv[r * per], fv[r * per + 1]))
                    store(v["af"], bits & v["f_mask"][i], base + r)

    @property
    def lanes(self) -> list[int]:
        """The lanes of a B load slot gathered one by one (one float4 where the batch allows)."""
        return [0] if self.plan.vector_b else list(range(self.t.vec))

    # -- the RSC gather: per-tap state, loads with no index math ---------------------------
    def enter_tap(self, tap: Expr) -> None:
        """Per B load slot (and lane), for filter tap `tap`: where its rows start in the input at
        channel offset 0, and whether it reads the input at all (a padding border, a column past
        the end, a slot beyond the tile). A dead slot's registers are zeroed here and left alone
        by the tap's loads, so its shared row is zero without a select per step."""
        if self.plan.gathers_fragments:
            self.enter_tap_fragments(tap)
            return
        t, wl, v = self.t, self.wl, self.v
        per_row = t.cols // t.vec
        cg = wl.C // wl.groups
        position = self.tap_position("b", tap)
        vec = t.vec if self.plan.vector_b else 1
        b_live, b_pre = v["b_live"], v["b_pre"]
        for s, guarded in self.slots(t.k_step * per_row):
            bf = v[f"bf{s}"]
            for lane in self.lanes:
                suffix, i = f"{s}_{lane}", s * len(self.lanes) + lane
                live, h, w = position(suffix)
                if guarded:
                    live = all_of(live, lt(bf, t.k_step * per_row))
                store(b_live, live, i)
                # in units of the load's width, so that TVM sees the float4 loads aligned
                start = terms(terms((v["g"] * cg + bf // per_row) * wl.H, *h) * wl.W, *w)
                store(v["b_off"], start * (wl.N // vec) + v[f"bn{suffix}"] // vec, i)
                at = s * t.vec + lane
                with T.If(tirx.Not(b_live[i])), T.Then():
                    if vec > 1:
                        store(b_pre, zero(vec), ramp(at, vec))
                    else:
                        store(b_pre, T.float32(0), at)

    def advance_running_tap(self, first: bool) -> Expr:
        """Without :attr:`MaxDNNPlan.tap_loop` (or for gathered fragments, loaded two steps
        ahead of the loop's tap): move the running (tap, channel step) to the next k step,
        entering a new tap only when the channels run out (a runtime check; a 1x1 filter has one
        tap). Returns the channel step's expression."""
        wl, tap, c0 = self.wl, self.v["tap"], self.v["c0"]
        if first:  # a slice of split-K starts at its first tap, or a 1x1 filter's at its first channel step
            store(tap, self.first_step() if self.plan.tap_loop else 0, 0)
            store(c0, 0 if self.plan.tap_loop else self.first_step(), 0)
            self.enter_tap(tap[0])
        elif wl.KH * wl.KW == 1:
            store(c0, c0[0] + 1, 0)
        else:
            store(c0, c0[0] + 1, 0)
            with T.If(eq(c0[0], self.plan.steps_per_tap)), T.Then():
                store(c0, 0, 0)
                store(tap, tap[0] + 1, 0)
                self.enter_tap(tap[0])
        return c0[0]

    def load_b_rsc(self, chan: Expr) -> None:
        """The B loads of a k step in RSC order, channel step `chan` of the current tap: its 8
        rows are 8 channels of one tap, so each live slot reads at its tap's offset plus the
        channel offset, with no index math or bounds checks."""
        t, wl, v = self.t, self.wl, self.v
        per_row = t.cols // t.vec
        vec = t.vec if self.plan.vector_b else 1
        plane = wl.H * wl.W * wl.N // vec * t.k_step  # one channel step, in units of the load
        b_pre, xf = v["b_pre"], v["Xf"]
        for s, _ in self.slots(t.k_step * per_row):
            for lane in self.lanes:
                i, at = s * len(self.lanes) + lane, s * t.vec + lane
                addr = (v["b_off"][i] + chan * plane) * vec
                with T.If(v["b_live"][i]), T.Then():
                    if vec > 1:
                        store(b_pre, xf[ramp(addr, vec)], ramp(at, vec))
                    else:
                        store(b_pre, xf[addr], at)

    # -- global -> registers -> shared -----------------------------------------------------
    def load_global(self, kt: Expr, at: tuple[Expr | None, Expr] | None = None, first: bool = False,
                    regs: int = 0) -> None:
        """Issue the global loads of k step `kt` into the prefetch registers (gathered fragments:
        into set `regs`).

        In RSC order the B loads come from the per-tap state: `at` = (the tap to enter first, or
        None to stay; the channel step) where the k loop knows them (:attr:`MaxDNNPlan.tap_loop`);
        otherwise a running state moves one step per call (`first`: step 0), so calls come in k
        order. Gathered fragments always take the running state: they are loaded two steps
        ahead of the loop's tap."""
        t, wl, v = self.t, self.wl, self.v
        z = f"_{self.load_sites}"  # one name per site (as TVMScript text had to)
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
            bf = v[f"bf{s}"]
            bk = self.let(f"bk{s}{z}", kt * t.k_step + bf // per_row_b)
            bcin = self.let(f"bcin{s}{z}", v["g"] * cg + bk // rs)
            br = self.let(f"br{s}{z}", bk % rs // S * dh)
            bs = self.let(f"bs{s}{z}", bk % S * dw)
            k_live = [lt(bk, self.K)] + ([lt(bf, t.k_step * per_row_b)] if guarded else [])
            for lane in self.lanes:
                suffix = f"{s}_{lane}"
                bh, bw = v[f"bh{suffix}"], v[f"bw{suffix}"]
                live = all_of(*k_live, lt(v[f"bc{suffix}"], self.NCOLS), le(0, bh + br), lt(bh + br, wl.H),
                              le(0, bw + bs), lt(bw + bs, wl.W))
                addr = terms(terms(bcin * wl.H, bh, br) * wl.W, bw, bs) * wl.N + v[f"bn{suffix}"]
                vec = t.vec if self.plan.vector_b else 1
                self.guarded_load(v["b_pre"], s * t.vec + lane, live, v["Xf"], addr, vec)

    def load_weight_rows(self, kt: Expr, z: str) -> None:
        """k step `kt`'s k_step rows of the [groups, K, M] weights, guarded at the K and M edges
        (float4 where M allows); `z` names this load site's lets."""
        t, v = self.t, self.v
        M, K = self.M, self.K
        per_row_a = t.rows // t.vec
        for s, guarded in self.slots(t.k_step * per_row_a):
            ak = self.let(f"ak{s}{z}", kt * t.k_step + self.thread_slot(s) // per_row_a)
            ao = self.let(f"ao{s}{z}", v["by"] * t.rows + self.thread_slot(s) % per_row_a * t.vec)
            live = [lt(ak, K)] + ([lt(self.thread_slot(s), t.k_step * per_row_a)] if guarded else [])
            base = (v["g"] * K + ak) * M + ao
            if self.plan.vector_a:
                self.guarded_load(v["a_pre"], s * t.vec, all_of(*live, lt(ao, M)), v["Wf"], base, t.vec)
            else:
                for lane in range(t.vec):
                    self.guarded_load(v["a_pre"], s * t.vec + lane, all_of(*live, lt(ao + lane, M)), v["Wf"],
                                      base + lane, 1)

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

    def load_packed_weights(self, kt: Expr, regs: int = 0) -> None:
        """wgmma: k step `kt`'s chunk of the packed weights (:func:`pack_wgmma_weight`), contiguous
        and zero-padded: float4 loads with no guards (of bf16 pairs' bits for bf16), into register
        set `regs` (one per ring slot where the weights are loaded two steps ahead,
        :attr:`MaxDNNPlan.wgmma_in_flight`)."""
        t, v = self.t, self.v
        chunk = t.weight_words
        base = regs * self.weight_regs
        for s, guarded in self.slots(chunk // t.vec):
            f = self.thread_slot(s)
            addr = ((v["g"] * self.plan.grid[1] + v["by"]) * self.plan.k_steps + kt) * chunk + f * t.vec
            with only_if(lt(f, chunk // t.vec) if guarded else None):
                store(v["a_pre"], v["Wf"][ramp(addr, t.vec)], ramp(base + s * t.vec, t.vec))

    def guarded_load(self, reg: tirx.Buffer, at: int, live: Cond, src: tirx.Buffer, addr: Expr, vec: int) -> None:
        """reg[at : at + vec] = src[addr : addr + vec] where `live`, else zeros (a border, a tail)."""
        if vec == 1:
            store(reg, T.if_then_else(live, src[addr], T.float32(0)), at)
            return
        if_else(live, lambda: store(reg, src[ramp(addr, vec)], ramp(at, vec)),
                lambda: store(reg, zero(vec), ramp(at, vec)))

    def store_shared(self, buf: int, kt: Expr) -> None:
        """The prefetched tiles of k step `kt` into shared buffer `buf` (where wgmma stays in
        flight: the ring's slot `buf`, from the weights' register set of that slot)."""
        t, v = self.t, self.v
        if t.wgmma is not None:  # A: the packed chunk as it is, already in the descriptor's layout
            chunk = t.weight_words
            ring = self.plan.wgmma_in_flight
            tile = v["A_ring"] if ring else v[f"A_sh{buf}"]
            regs = buf * self.weight_regs if ring else 0
            for s, guarded in self.slots(chunk // t.vec):
                f = self.thread_slot(s)
                with only_if(lt(f, chunk // t.vec) if guarded else None):
                    store(tile, v["a_pre"][ramp(regs + s * t.vec, t.vec)],
                          ramp(buf * chunk + f * t.vec if ring else f * t.vec, t.vec))
        for name in self.staged_tiles:
            extent, reg = (t.rows, v["a_pre"]) if name == "A" else (t.cols, v["b_pre"])
            per_row = extent // t.vec
            for s, guarded in self.slots(t.k_step * per_row):
                f = self.thread_slot(s)
                with only_if(lt(f, t.k_step * per_row) if guarded else None):
                    tile, index = self.shared_at(name, buf, f // per_row, [f % per_row * t.vec], t.vec)
                    store(tile, reg[ramp(s * t.vec, t.vec)], *index)
        if t.wgmma is not None:
            self.fence_proxy_async()

    def fence_proxy_async(self) -> None:
        """The tensor cores read the weights' tile through the async proxy: without this fence
        they may see it as it was before the stores (NaN on an H200)."""
        evaluate(T.ptx["fence.proxy.async.shared::cta"]())

    def shared_at(self, name: str, buf: int, row: Expr, col: Sequence[Expr], lanes: int = 1) -> tuple[Any, list]:
        """(buffer, indices) of element (row, col) of operand tile `name` ("A", "B") in shared
        buffer `buf`, `lanes` consecutive columns as one vector; `col` the summands of the column.
        Padded tiles are declared flat and indexed with their padded row stride: TVM's
        CompactBufferAllocation trims a 2-D buffer to the columns it sees accessed, which drops
        the padding and, with it, the bank spread the padding is for."""
        tile = self.v[f"{name}_sh{buf}"]
        if self.t.pad:
            index = terms(row * self.shared_stride(name), *col)
            return tile, [ramp(index, lanes) if lanes > 1 else index]
        column = terms(*col)
        return tile, [row, ramp(column, lanes) if lanes > 1 else column]

    def load_shared(self, name: str, buf: int, row: Expr, col: Sequence[Expr], lanes: int = 1) -> Expr:
        """The value of :meth:`shared_at`."""
        tile, index = self.shared_at(name, buf, row, col, lanes)
        return tile[index[0] if len(index) == 1 else tuple(index)]

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
        t = self.t
        if self.plan.wgmma_in_flight:  # (only the weights' tile: the fragments are gathered)
            self.buffer("A_ring", (self.ring * self.plan.operand_tiles["A"],), scope="shared")
        else:
            for buf in (0, 1):
                for name, floats in self.plan.operand_tiles.items():
                    # flat: the descriptor's layout (WgmmaShape), or padded rows (see shared_at)
                    flat = name not in self.staged_tiles or t.pad
                    self.buffer(f"{name}_sh{buf}", (floats,) if flat else (t.k_step, self.shared_stride(name)),
                                scope="shared")
        self.buffer("O_sh", (t.rows, t.cols), scope="shared.dyn" if self.plan.dynamic_shared_bytes else "shared")
