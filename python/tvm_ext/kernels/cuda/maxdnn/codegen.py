"""The maxDNN kernel built with TVM's IRBuilder (:class:`Generator`), tensorized into a PrimFunc
(:func:`maxdnn_conv2d_func`) and lowered to CUDA C (:func:`cuda_source`).

The generator builds the kernel statement by statement rather than scheduling a compute
definition because the kernel is a fixed, hand-placed schedule (which buffer each k step reads,
where each barrier and wgmma wait goes) that reads best as the loop nest it is. It used to write
that loop nest as TVMScript text and parse it (0.1-0.3 s a kernel); it now builds the same IR
(structurally equal) in the IRBuilder directly. Its steps are methods so that a subclass can
change one: the tests' broken kernels (:mod:`tvm_ext.testing.maxdnn`) override
:meth:`Generator.source_buffer`, :meth:`Generator.store_prefetched` and
:meth:`~.operands.OperandWriter.fence_proxy_async`.
"""

from __future__ import annotations

import contextlib
import math

import tvm
from tvm import s_tir, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from ....intrin.cuda import get_outer_product_intrin
from ....target import resolve_target
from ...conv2d import KERNEL_ATTR
from ..toolchain import generate_source
from .engines import Engine, engine_for
from .operands import Cond, Expr, OperandWriter, all_of, evaluate, gt, lt, only_if, ramp, store, terms
from .plan import FLAT_PARAMS, KERNEL_NAME, Epilogue, MaxDNNPlan
from .split_k import REDUCE_SUFFIX, split_reduce_func


def _clamp(value: Expr, vec: int, upper: float | None) -> Expr:
    """relu (`upper` None) or relu6 of `value` (a variable: it is read twice), as selects that keep
    a NaN, as PyTorch does."""
    def const(c: float) -> Expr:
        return T.Broadcast(T.float32(c), vec) if vec > 1 else T.float32(c)

    clamped = value if upper is None else T.Select(gt(value, const(upper)), const(upper), value)
    return T.Select(lt(value, const(0)), const(0), clamped)


class Generator(OperandWriter):
    """Builds the kernel for one plan (the algorithm: :mod:`tvm_ext.kernels.cuda.maxdnn`); what
    its compute engine builds (FFMA, mma.sync or wgmma) is its :attr:`engine`'s
    (:mod:`.engines`), chosen once from the plan's tile."""

    def __init__(self, plan: MaxDNNPlan):
        super().__init__(plan)
        self.updates: list[str] = []  # the FFMA updates' blocks, tensorized by maxdnn_conv2d_func
        self.engine: Engine = engine_for(self)

    def sync(self) -> None:
        evaluate(T.tvm_storage_sync("shared"))

    def step(self, kt: Expr, buf: int, prefetch: bool, at: tuple[Expr | None, Expr] | None = None,
             when: Cond | None = None) -> None:
        """One k step (`kt`) on buffer `buf`; with `prefetch`, the next step's loads overlap it
        (only where the condition `when` holds, if given; `at`: see :meth:`load_global`)."""
        if prefetch:
            with only_if(when):
                self.load_global(kt + 1, at)
        self.engine.compute(self.source_buffer(buf, 1 - buf))
        if prefetch:
            self.store_prefetched(1 - buf, kt + 1, when)
        self.engine.end_step()
        self.sync()

    def step_in_flight(self, kt: Expr, slot: int) -> None:
        """One k step (`kt`, in ring slot `slot` = its index in the slice modulo
        :data:`WGMMA_RING`) with wgmma groups in flight (:attr:`MaxDNNPlan.wgmma_in_flight`):
        issue its group on the slot's fragments and weights' tile; wait for the group before
        (whose registers and slot are then free in this thread, and by the barrier in all);
        gather step k + 2's fragments into the registers that group read and load its weights;
        store step k + 1's weights (loaded a step ago) into its slot, which the group before
        last read; barrier. Every register a wgmma reads is written only after the group that
        read it last is waited for, with no copies: ptxas serializes every wgmma (C7513) when a
        register of one is defined while a group is in flight between the copy and the issue."""
        ring = self.ring
        end = self.slice_end()
        self.engine.compute(self.source_buffer(slot, (slot + 1) % ring), slot)
        evaluate(T.ptx["wgmma.wait_group.sync.aligned"](1))
        with only_if(lt(kt + 2, end)):
            self.load_global(kt + 2, regs=(slot + 2) % ring)
            self.load_packed_weights(kt + 2, (slot + 2) % ring)
        self.store_prefetched((slot + 1) % ring, kt + 1, lt(kt + 1, end))
        self.sync()

    def source_buffer(self, filled: int, filling: int) -> int:
        """The buffer (ring slot) a k step computes on: `filled`, the one filled last step, not
        `filling`, the one its prefetch is filling."""
        return filled

    def store_prefetched(self, buf: int, kt: Expr, when: Cond | None) -> None:
        """The prefetched tiles of k step `kt` into shared buffer (ring slot) `buf`, where the
        condition `when` holds (always, if None)."""
        with only_if(when):
            self.store_shared(buf, kt)

    def k_loop(self) -> None:
        """Every k step after the prologue's, each computing on one buffer while the next step's
        loads fill the other."""
        plan = self.plan
        first = self.first_step()
        if plan.wgmma_in_flight:
            self.k_loop_in_flight()
            return
        if plan.tap_loop:
            taps, per_tap = self.wl.KH * self.wl.KW // plan.splits, plan.steps_per_tap
            with T.serial(0, taps) as rs:
                IRBuilder.name("rs", rs)
                tap = first + rs
                if per_tap > 2:
                    # kept a loop: nvcc would unroll a short one, spilling the tensor-core tiles
                    with T.serial(0, per_tap // 2 - 1, unroll=False) as c2:
                        IRBuilder.name("c2", c2)
                        self.step(tap * per_tap + c2 * 2, 0, True, (None, c2 * 2 + 1))
                        self.step(tap * per_tap + c2 * 2 + 1, 1, True, (None, c2 * 2 + 2))
                self.step(tap * per_tap + (per_tap - 2), 0, True, (None, per_tap - 1))
                self.step(tap * per_tap + (per_tap - 1), 1, True, (tap + 1, 0), when=lt(rs, taps - 1))
            return
        steps = self.slice_steps()
        pairs = (steps - 1) // 2  # pairs of steps that both prefetch
        if pairs:
            with T.serial(0, pairs) as kt2:
                IRBuilder.name("kt2", kt2)
                self.step(first + kt2 * 2, 0, True)
                self.step(first + kt2 * 2 + 1, 1, True)
        tail = steps - 2 * pairs  # 1 or 2 steps; only the last has nothing to prefetch
        if tail == 2:
            self.step(first + 2 * pairs, 0, True)
            self.step(first + (2 * pairs + 1), 1, False)
        else:
            self.step(first + 2 * pairs, 0, False)

    def k_loop_in_flight(self) -> None:
        """The slice's k steps, :data:`WGMMA_RING` at a time so each step's ring slot and
        register sets are constants (registers cannot be indexed at run time), then the rest.
        The fragments' gather keeps a running tap of its own, two steps ahead of the steps."""
        ring = self.ring
        first, steps = self.first_kt(), self.slice_steps()
        if steps // ring:
            # kept a loop: nvcc would unroll a short one, spilling the tensor-core tiles
            with T.serial(0, steps // ring, unroll=False) as kr:
                IRBuilder.name("kr", kr)
                for slot in range(ring):
                    self.step_in_flight(first + kr * ring + slot, slot)
        for slot in range(steps % ring):
            self.step_in_flight(first + (steps // ring * ring + slot), slot)

    def first_kt(self) -> Expr:
        """This block's first k step (see :meth:`first_step`)."""
        plan = self.plan
        return self.first_step() * plan.steps_per_tap if plan.tap_loop else self.first_step()

    def slice_steps(self) -> int:
        """The k steps of this block's share of the reduction."""
        return self.plan.k_steps // self.plan.splits

    def slice_end(self) -> Expr:
        """The k step after this block's share of the reduction (see :meth:`first_step`)."""
        return self.first_kt() + self.slice_steps()

    def first_step(self) -> Expr:
        """Where this block's share of the reduction starts: its slice's first tap (with
        :attr:`MaxDNNPlan.tap_loop`) or k step; 0 without split-K."""
        plan = self.plan
        if plan.splits == 1:
            return 0
        _, count = plan.split_slices
        return self.v["sp"] * (count // plan.splits)

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
                evaluate(T.call_pure_extern("void", "(void)", self.load_shared(name, buf, 0, [0], self.t.vec)))

    # -- output ----------------------------------------------------------------------------
    def write_output(self) -> None:
        """The block's tile through shared memory to the output with the epilogue; with split-K,
        the slice's raw sums to `partial` (the reduce kernel applies the epilogue)."""
        t, v, ep = self.t, self.v, self.plan.epilogue
        M, NC = self.M, self.NCOLS
        split = self.plan.splits > 1
        if split:
            ep = Epilogue()
        self.engine.end_k_loop()
        self.engine.stage_accumulators()
        self.sync()
        per_row = t.cols // t.vec
        vec = t.vec if self.plan.vector_y else 1
        g = v["g"]
        for s, _ in self.slots(t.rows * per_row):
            f = self.thread_slot(s)
            oo = self.let(f"oo{s}", v["by"] * t.rows + f // per_row)
            oc = self.let(f"oc{s}", v["bx"] * t.cols + f % per_row * t.vec)
            for lane in range(0, t.vec, vec):
                column = f % per_row * t.vec + lane
                value = v["O_sh"][f // per_row, ramp(column, vec) if vec > 1 else column]
                row = ((v["sp"] * self.wl.groups + g) * M + oo) * NC if split else (g * M + oo) * NC
                y = terms(row, oc, lane)
                yidx = ramp(y, vec) if vec > 1 else y
                if ep.bias:
                    b = v["bias"][g * M + oo]
                    value = value + (T.Broadcast(b, vec) if vec > 1 else b)
                if ep.residual:
                    value = value + v["Rf"][yidx]
                with T.If(all_of(lt(oo, M), lt(oc + lane, NC))), T.Then():
                    if ep.activation in ("relu", "relu6"):  # selects: a NaN stays NaN (fmaxf drops it)
                        value = _clamp(self.let(f"v{s}_{lane}", value), vec,
                                       6.0 if ep.activation == "relu6" else None)
                    store(v["Pf" if split else "Yf"], value, yidx)

    # -- the whole function ----------------------------------------------------------------
    def build(self, symbol: str) -> tirx.PrimFunc:
        """The kernel, untensorized (the FFMA updates' blocks named in :attr:`updates`)."""
        plan, t, v = self.plan, self.t, self.v
        shapes = plan.shapes()
        self.updates.clear()
        params = list(shapes)
        with IRBuilder() as builder, T.prim_func(s_tir=True):
            T.func_name("main")
            for n in params:
                v[n] = T.arg(n, T.Buffer(shapes[n], "float32"))
            T.func_attr({"global_symbol": symbol, "tirx.noalias": True, KERNEL_ATTR: KERNEL_NAME})
            # The explicit root block comes first: a statement before it would make it a child of an
            # implicit root whose inferred reads name the buffers allocated here (ill-formed TIR).
            with T.sblock("root"), contextlib.ExitStack() as scopes:
                # explicit regions: inference cannot read the tensor-core calls' raw buffer pointers
                out = params[-1]  # y, or with split-K the slices' partial sums

                def region(n: str):
                    at = [slice(0, d) for d in shapes[n]]
                    return v[n][at[0] if len(at) == 1 else tuple(at)]

                T.reads(*(region(n) for n in params[:-1]))
                T.writes(region(out))
                flat = FLAT_PARAMS
                for n in params:
                    if flat[n] != n:
                        self.buffer(flat[n], (math.prod(shapes[n]),), data=v[n].data)
                gx, gy, gz = plan.grid
                for name, extent, thread in (("gz" if plan.splits > 1 else "g", gz, "blockIdx.z"),
                                             ("by", gy, "blockIdx.y"), ("bx", gx, "blockIdx.x"),
                                             ("tid", t.threads, "threadIdx.x")):
                    v[name] = IRBuilder.name(name, scopes.enter_context(T.thread_binding(extent, thread=thread)))
                # Declared (allocated) here, under the thread loops: block allocations would be
                # hoisted out of the kernel, and a block here would hide `tid` from blockize.
                self.declare_shared()
                self.engine.declare_registers()
                nb = len(self.slots(t.k_step * t.cols // t.vec))
                sets = self.ring if plan.wgmma_in_flight else 1  # the weights two steps ahead: per ring slot
                self.buffer("a_pre", (sets * self.weight_regs,), scope="local")
                if not plan.gathers_fragments:
                    self.buffer("b_pre", (nb * t.vec,), scope="local")
                if plan.splits > 1:  # blockIdx.z: the group and the slice of the reduction
                    self.let("g", v["gz"] // plan.splits)
                    self.let("sp", v["gz"] % plan.splits)
                self.engine.prologue()
                self.b_columns()
                first = self.first_step()
                first_kt = self.first_kt()
                if plan.wgmma_in_flight:  # the weights of the first step, and of the next into set 1
                    self.load_packed_weights(first_kt, 0)
                if plan.tap_loop and not plan.gathers_fragments:
                    self.load_global(first_kt, (first, 0), first=True)
                else:
                    self.load_global(first, first=True)
                self.store_shared(0, first_kt)
                if plan.wgmma_in_flight:  # and the next step's weights and fragments into set 1
                    with only_if(lt(first_kt + 1, self.slice_end())):
                        self.load_packed_weights(first_kt + 1, 1)
                        self.load_global(first_kt + 1, regs=1)
                self.sync()
                self.k_loop()
                self.keep_tiles_live()
                self.write_output()
        return builder.get()


def maxdnn_conv2d_func(plan: MaxDNNPlan, symbol: str = "maxdnn_conv2d", *, tensorize: bool = True,
                       generator: type[Generator] = Generator) -> tvm.tirx.PrimFunc:
    """The CUDA PrimFunc of `plan`, its 8x8 updates tensorized onto the thread-tile intrinsic.

    Parameters are (x, w[, bias][, residual], y) in the layouts of :meth:`MaxDNNPlan.shapes`.
    `generator` builds the kernel: :class:`Generator`, or a subclass (the tests' broken kernels,
    :data:`tvm_ext.testing.maxdnn.FAULTS`).
    """
    gen = generator(plan)
    func = gen.build(symbol)
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
