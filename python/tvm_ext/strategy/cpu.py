"""Which tvm_ext kernel serves which Relax op on LLVM CPUs, or why none does.

(CUDA targets go through the same framework, `decide`, the fusion patterns and
`lower_to_kernels`, with :mod:`tvm_ext.strategy.cuda` deciding convolutions and emitting calls.)

The strategy is a dispatch pass, :func:`lower_to_kernels`, rather than a legalization map: it
must see ops in program order and look through their producers' bindings to keep activations
blocked, which legalization (one op at a time) cannot. Ops it leaves go through
`relax.transform.LegalizeOps` with :func:`legalize_map`, which logs why and hands them to stock
TVM's own rule (FLegalize). Before it, the rewrites of :mod:`tvm_ext.transform` fold inference
batch norms (and per-channel scales) into the weights, turn dense layers into 1x1 convolutions
and recognise SiLU written as x * sigmoid(x); then :func:`fusion_patterns` groups conv2d + bias
+ shortcut + activation into one kernel call that reads and writes activations in the blocked
layout (see :class:`_Emitter`: layouts change only at the graph's edges and around fallbacks).
Constant weights are packed at build time. :func:`decide` is the single place that takes the decision, used by
all of them and by the dispatch report.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import tvm
from tvm import relax

from ..kernels import conv2d as _conv
from ..kernels import elementwise as _elementwise
from ..kernels import layout as _layout
from ..kernels import pool2d as _pool
from ..kernels import winograd as _winograd
from ..kernels.conv2d import Epilogue
from ..relax_info import dtype, is_channel_bias, prim_value, shape_text, static_shape
from ..target import vector_isa
from ..transform import fold_batch_norm, matmul_as_conv2d, recognise_silu
from ..tuning import pool_space as _pool_space
from ..tuning import space as _space
from . import cuda as _cuda
from .borders import write_borders

logger = logging.getLogger("tvm_ext")

# Relax's FuseOps must leave our scheduled kernels alone: kOpaque.
_OPAQUE = 8


@dataclasses.dataclass(frozen=True)
class Decision:
    """The dispatch of one op: the tvm_ext kernel serving it, or None and the reason."""

    op: str
    shapes: tuple
    kernel: str | None
    reason: str = ""
    plan: _conv.Conv2dPlan | None = None


def decide(call: relax.Call, target: tvm.target.Target, engine: str = "ffma", winograd: bool = True) -> Decision:
    """The kernel for `call` on `target`, or why stock TVM keeps it (`engine`: CUDA's
    convolution engine, see :func:`tvm_ext.strategy.cuda.engine_for`; `winograd`: whether a
    convolution with constant weights may run as Winograd, :mod:`tvm_ext.kernels.winograd` and
    :mod:`tvm_ext.kernels.cuda.winograd`)."""
    op = call.op.name if isinstance(call.op, tvm.ir.Op) else str(call.op)
    tensors = [arg for arg in call.args if isinstance(arg.ty, relax.TensorType)]
    shapes = tuple(shape_text(arg) for arg in tensors)
    if op in _POOLS or op in _ACTIVATION_OPS or op == "relax.mean":
        return _decide_pool_or_activation(call, op, shapes, tensors)
    if op in _DATA_MOVEMENT_OPS:
        return Decision(op, shapes, None, "data movement only (a reshape is a view): stock TVM")
    if op != "relax.nn.conv2d":
        return Decision(op, shapes, None, "no tvm_ext kernel for this op yet")
    attrs = call.attrs
    if (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout)) != ("NCHW", "OIHW", "NCHW"):
        return Decision(op, shapes, None, f"layout {attrs.data_layout}/{attrs.kernel_layout} is not NCHW/OIHW")
    out_dtype = str(attrs.out_dtype)
    out_dtype = dtype(call.args[0]) if out_dtype in ("", "None", "void") else out_dtype
    dtypes = {dtype(call.args[0]), dtype(call.args[1]), out_dtype}
    if dtypes != {"float32"}:
        return Decision(op, shapes, None, f"dtype {sorted(dtypes)} is not float32")
    static = [static_shape(arg) for arg in tensors[:2]]
    if any(s is None for s in static):
        return Decision(op, shapes, None, "symbolic shape: tvm_ext kernels are generated per static shape")
    if target.kind.name not in ("llvm", "cuda"):
        return Decision(op, shapes, None, f"target {target.kind.name} has no tvm_ext conv2d")
    try:
        wl = _conv.Conv2dWorkload.make(static[0], static[1], [int(s) for s in attrs.strides],
                                       [int(p) for p in attrs.padding], [int(d) for d in attrs.dilation],
                                       int(attrs.groups))
    except ValueError as err:
        return Decision(op, shapes, None, str(err))
    winograd = winograd and isinstance(call.args[1], tvm.ir.Constant)  # transformed at build time
    if target.kind.name == "cuda":
        kernel, reason, cuda_plan = _cuda.conv2d_decision(wl, engine, winograd)
        return Decision(op, shapes, kernel, reason, cuda_plan)
    if winograd and not _winograd.eligible(wl):
        plan = _winograd.winograd_plan(wl, vector_isa(target))
    else:
        plan = _conv.plan_conv2d(wl, vector_isa(target))
    return Decision(op, shapes, f"{plan.kind}_conv2d", plan.reason, plan)


_DATA_MOVEMENT_OPS = {"relax.reshape", "relax.flatten", "relax.permute_dims", "relax.squeeze", "relax.expand_dims"}

_POOLS = {"relax.nn.max_pool2d": "max", "relax.nn.avg_pool2d": "avg", "relax.nn.adaptive_avg_pool2d": "global"}


def _pool_workload(call: relax.Call, shape: tuple) -> _pool.Pool2dWorkload:
    attrs = call.attrs
    mode = _POOLS[call.op.name]
    return _pool.Pool2dWorkload.make(shape, mode, [int(v) for v in attrs.pool_size], [int(v) for v in attrs.strides],
                                     [int(v) for v in attrs.padding], [int(v) for v in attrs.dilation],
                                     bool(attrs.ceil_mode), bool(attrs.count_include_pad))


def _decide_pool_or_activation(call: relax.Call, op: str, shapes: tuple, tensors: list) -> Decision:
    static = static_shape(tensors[0])
    if dtype(tensors[0]) != "float32":
        return Decision(op, shapes, None, f"dtype {dtype(tensors[0])} is not float32")
    if static is None:
        return Decision(op, shapes, None, "symbolic shape: tvm_ext kernels are generated per static shape")
    if 0 in static:
        return Decision(op, shapes, None, "empty tensor (a dimension is 0): nothing to compute")
    if op == "relax.mean":
        axes = sorted(int(a) % len(static) for a in (call.attrs.axis or []))
        if len(static) != 4 or axes != [2, 3]:
            return Decision(op, shapes, None, "mean over axes other than H and W of a 4-D tensor")
        return Decision(op, shapes, "global_avg_pool2d")
    if op in _ACTIVATION_OPS:
        if op == "relax.clip" and not _is_relu6(call):
            return Decision(op, shapes, None, "clip other than relu6 (0, 6)")
        return Decision(op, shapes, _ACTIVATION_OPS[op])
    attrs = call.attrs
    if str(attrs.layout) != "NCHW" or str(attrs.out_layout) != "NCHW" or len(static) != 4:
        return Decision(op, shapes, None, f"layout {attrs.layout} is not NCHW")
    if _POOLS[op] == "global":
        if [int(v) for v in attrs.output_size or []] != [1, 1]:
            return Decision(op, shapes, None, "adaptive pooling to a size other than 1x1")
        return Decision(op, shapes, "global_avg_pool2d")
    if _POOLS[op] == "avg" and bool(attrs.ceil_mode):
        return Decision(op, shapes, None, "avg_pool2d with ceil_mode (divisor rules differ between frameworks)")
    try:
        _pool_workload(call, static)
    except ValueError as err:
        return Decision(op, shapes, None, str(err))
    return Decision(op, shapes, f"{_POOLS[op]}_pool2d")


def _add_kernel(bb: relax.BlockBuilder, func: tvm.tirx.PrimFunc, name: str) -> tvm.ir.GlobalVar:
    return bb.add_func(func.with_attr("op_pattern", _OPAQUE), name)


def _tag(plan: _conv.Conv2dPlan) -> str:
    """A readable, deterministic name part that tells convolution shapes and blockings apart."""
    wl = plan.wl
    return (f"{wl.N}x{wl.C}x{wl.H}x{wl.W}_{wl.K}x{wl.KH}x{wl.KW}_s{wl.stride[0]}x{wl.stride[1]}"
            f"_p{'x'.join(map(str, wl.padding))}_d{wl.dilation[0]}x{wl.dilation[1]}_g{wl.groups}"
            f"_x{plan.ic_bn}y{plan.oc_bn}")


_UNPACK = "tvm_ext_unpack_nchwc"


def _pack_constant_weight(plan: _conv.Conv2dPlan, weight: np.ndarray) -> tvm.runtime.Tensor:
    """OIHW `weight` in `plan`'s blocked layout, packed now (at build time, in NumPy)."""
    return tvm.runtime.tensor(_conv.pack_weight_array(plan, weight))


class _Emitter:
    """Emits tvm_ext kernel calls for one op, keeping activations blocked between our kernels.

    A tensor one of our kernels produced is bound to `unpack_nchwc(blocked)`: the NCHW view
    that ops outside tvm_ext (and the graph's outputs) read. Our kernels look through that
    binding and read the blocked tensor itself, so layouts change only at the graph's edges and
    around fallbacks; DeadCodeElimination then drops every unpack nobody reads.
    """

    def __init__(self, bb: relax.BlockBuilder, target: tvm.target.Target, database=None, winograd: bool = True):
        self.bb = bb
        self.target = target
        self.isa = vector_isa(target)
        self.database = database  # a MetaSchedule Database of tuned kernels, or None
        self.winograd = winograd

    def blocked(self, expr: relax.Expr) -> tuple[relax.Expr, int] | None:
        """(the blocked tensor, its channel block) behind an NCHW view, if there is one."""
        if not isinstance(expr, relax.Var):
            return None
        value = self.bb.lookup_binding(expr)
        if not (isinstance(value, relax.Call) and value.op == tvm.ir.Op.get("relax.call_tir")
                and value.args[0].name_hint.startswith(_UNPACK)):
            return None
        blocked = value.args[1].fields[0]
        _, blocks, _, _, block = static_shape(blocked)
        if static_shape(expr)[1] != blocks * block:  # channels filling the last block: not the same tensor
            return None
        return blocked, block

    def _call(self, func: tvm.tirx.PrimFunc, name: str, args: list, shape: tuple) -> relax.Var:
        kernel = _add_kernel(self.bb, func, name)
        return self.bb.emit(relax.call_tir(kernel, args, relax.TensorType(shape, "float32")))

    def unpack(self, blocked: relax.Expr, channels: int) -> relax.Call:
        shape = static_shape(blocked)
        n, _, h, w, _ = shape
        kernel = _add_kernel(self.bb, _layout.unpack_nchwc_func(shape, channels),
                             f"{_UNPACK}_{'x'.join(map(str, shape))}")
        return relax.call_tir(kernel, [blocked], relax.TensorType((n, channels, h, w), "float32"))

    def pack(self, data: relax.Expr, block: int, padding=(0, 0, 0, 0)) -> relax.Var:
        """`data` in blocks of `block` channels with a zero border, from its blocked form if it has one."""
        shape = static_shape(data)
        known = self.blocked(data)
        pads = tuple(int(p) for p in padding)
        if known is not None and known[1] == block:
            if not any(pads):
                return known[0]
            bshape = static_shape(known[0])
            n, cb, h, w, c = bshape
            return self._call(_layout.pad_nchwc_func(bshape, pads), f"tvm_ext_pad_nchwc_{'x'.join(map(str, bshape))}",
                              [known[0]], (n, cb, h + pads[0] + pads[2], w + pads[1] + pads[3], c))
        n, c, h, w = shape
        return self._call(_layout.pack_nchwc_func(shape, block, pads),
                          f"tvm_ext_pack_nchwc_{'x'.join(map(str, shape))}_{block}",
                          [data], (n, c // block, h + pads[0] + pads[2], w + pads[1] + pads[3], block))

    def _plan(self, plan: _conv.Conv2dPlan, data: relax.Expr) -> _conv.Conv2dPlan:
        """The plan re-blocked to read `data` in the blocks its producer wrote, when it can."""
        known = self.blocked(data)
        if known is None or plan.kind == "direct":
            return plan
        wl, block = plan.wl, known[1]
        if plan.kind == "depthwise":
            return _conv.plan_conv2d(wl, self.isa, n_r=block)
        if (wl.C // wl.groups) % block:
            return plan
        if plan.kind == "winograd":
            return _winograd.winograd_plan(wl, self.isa, ic_bn=block)
        return _conv.plan_conv2d(wl, self.isa, ic_bn=block)

    def conv2d(self, call: relax.Call, data: relax.Expr, bias: np.ndarray | None = None,
               residual: relax.Expr | None = None, activation: relax.Call | None = None,
               suffix: str = "") -> relax.Expr:
        """conv2d (+ bias + residual -> activation): blocked in and out wherever the layouts allow.

        Constant weights and biases are packed here; weights that are parameters are packed by
        a kernel call at run time.
        """
        plan = self._plan(decide(call, self.target, winograd=self.winograd).plan, data)
        if plan.kind == "winograd":
            return self._winograd_conv2d(plan, call.args[1].value.numpy(), data, bias, residual, activation, suffix)
        wl = plan.wl
        blocked_out = plan.K_pad == wl.K  # padded channels would reach the next layer's reduction
        tag = _tag(plan)
        weight = call.args[1]
        args = [self.pack(data, plan.ic_bn, wl.padding),
                relax.const(_pack_constant_weight(plan, weight.value.numpy())) if isinstance(weight, tvm.ir.Constant)
                else self._call(_conv.pack_weight_func(plan), f"tvm_ext_pack_weight_{tag}", [weight],
                                plan.weight_shape())]
        operands, epilogue = self._epilogue(plan, bias, residual, activation, blocked_out)
        args += operands
        name = f"tvm_ext_{plan.kind}_conv2d_{tag}{suffix}"
        func = self.conv_kernel(plan, epilogue)
        if not blocked_out:
            return relax.call_tir(_add_kernel(self.bb, func, name), args, relax.TensorType(wl.out_shape, "float32"))
        return self.unpack(self._call(func, name, args, plan.out_shape()), wl.K)

    def _winograd_conv2d(self, plan: _conv.Conv2dPlan, weight: np.ndarray, data: relax.Expr,
                         bias: np.ndarray | None, residual: relax.Expr | None, activation: relax.Call | None,
                         suffix: str) -> relax.Expr:
        """The three calls of a Winograd convolution: input transform, the a² GEMMs (the BRGEMM
        kernel, with the weights transformed and packed here), output transform + epilogue."""
        wl, gemm, tag = plan.wl, _winograd.gemm_plan(plan, self.isa), _tag(plan)
        tiles = self._call(_winograd.input_transform_func(plan), f"tvm_ext_winograd_input_{tag}",
                           [self.pack(data, plan.ic_bn, _winograd.input_padding(plan))], gemm.data_shape())
        weight = _pack_constant_weight(gemm, _winograd.transform_weight(plan, weight))
        products = self._call(self.conv_kernel(gemm, Epilogue()), f"tvm_ext_brgemm_conv2d_{_tag(gemm)}",
                              [tiles, relax.const(weight)], gemm.out_shape())
        operands, epilogue = self._epilogue(plan, bias, residual, activation)
        out = self._call(self.conv_kernel(plan, epilogue), f"tvm_ext_winograd_conv2d_{tag}{suffix}",
                         [products, *operands], plan.out_shape())
        return self.unpack(out, wl.K)

    def _epilogue(self, plan: _conv.Conv2dPlan, bias: np.ndarray | None, residual: relax.Expr | None,
                  activation: relax.Call | None, blocked_out: bool = True) -> tuple[list, Epilogue]:
        """A convolution epilogue's operands (the bias in blocks, zero past K; the shortcut in the
        output's layout) and its description."""
        operands = []
        if bias is not None:
            blocked = np.zeros(plan.K_pad, np.float32)
            blocked[: plan.wl.K] = bias.reshape(-1)
            operands.append(relax.const(blocked.reshape(plan.OCB, plan.oc_bn)))
        if residual is not None:
            operands.append(self.pack(residual, plan.oc_bn) if blocked_out else residual)
        return operands, Epilogue(bias=bias is not None, residual=residual is not None,
                                  activation=None if activation is None else _ACTIVATION_OPS[activation.op.name],
                                  nchw_out=not blocked_out, alpha=_alpha(activation))

    def conv_kernel(self, plan: _conv.Conv2dPlan, epilogue: Epilogue) -> tvm.tirx.PrimFunc:
        """The tuned schedule of this convolution if the database has one, else the analytic one."""
        if self.database is not None and _space.tunable(plan, epilogue):
            from ..tuning.records import tuned_kernel

            tuned = tuned_kernel(self.database, _space.conv2d_workload(plan, epilogue, self.isa), self.target)
            if tuned is not None:
                return tuned
        return _space.default_kernel(plan, epilogue, self.isa)

    def pool_kernel(self, wl: _pool.Pool2dWorkload, block: int | None) -> tvm.tirx.PrimFunc:
        """The tuned schedule of this pooling if the database has one, else the analytic one."""
        if self.database is not None:
            from ..tuning.records import tuned_kernel

            tuned = tuned_kernel(self.database, _pool_space.pool2d_workload(wl, block), self.target)
            if tuned is not None:
                return tuned
        return _pool_space.default_pool_kernel(wl, block)

    def pool_or_activation(self, call: relax.Call, decision: Decision) -> relax.Expr:
        data = call.args[0]
        known = self.blocked(data)
        source, block = known if known is not None else (data, None)
        shape = static_shape(source)
        channels = static_shape(data)[1]
        if decision.kernel == "global_avg_pool2d":
            func, out_shape = _pool.global_avg_pool2d_func(shape), (*shape[:2], 1, 1, *shape[4:])
        elif call.op.name in _POOLS:
            wl = _pool_workload(call, static_shape(data))
            func = self.pool_kernel(wl, block)
            out_shape = (*shape[:2], wl.OH, wl.OW, *shape[4:])
        else:
            func = _elementwise.activation_func(decision.kernel, shape, "float32", self.isa.lanes, _alpha(call))
            out_shape = shape
        name = f"tvm_ext_{decision.kernel}_{'x'.join(map(str, shape))}"
        out = self._call(func, name, [source], out_shape)
        if block is not None:
            out = self.unpack(out, channels)
            if call.op.name != "relax.mean":
                return out
            out = self.bb.emit(out)
        if call.op.name == "relax.mean":  # mean over H, W: a global pool without the unit axes
            return relax.op.reshape(out, static_shape(call))
        return out


def make_emitter(bb: relax.BlockBuilder, target: tvm.target.Target, database=None, tensor_cores=False,
                 winograd: bool = True):
    """The emitter of `target`'s kernels: blocked NCHW[x]c on CPUs, CHWN on CUDA (`tensor_cores`,
    `winograd`: see :func:`tvm_ext.pipeline`)."""
    if target.kind.name == "cuda":
        return _cuda.CudaEmitter(bb, target, database, engine=_cuda.engine_for(tensor_cores, target),
                                 winograd=winograd)
    return _Emitter(bb, target, database, winograd)


def legalize_map(target: tvm.target.Target) -> dict:
    """The customize map for `relax.transform.LegalizeOps` on `target`: ops :func:`lower_to_kernels`
    left go to stock TVM's rule with the reason logged. (In the pipeline none of them has a
    kernel; used on its own, the map lowers those that do, in NCHW, one op at a time.)"""

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        decision = decide(call, target)
        if decision.kernel is None:
            logger.info("tvm_ext: %s %s stays with stock TVM: %s", decision.op, decision.shapes, decision.reason)
            return call.op.get_attr("FLegalize")(bb, call)
        emitter = make_emitter(bb, target)
        if decision.plan is not None:
            return emitter.conv2d(call, call.args[0])
        return emitter.pool_or_activation(call, decision)

    return {op: legalize for op in ("relax.nn.conv2d", "relax.mean", *_POOLS, *_ACTIVATION_OPS)}


# ---------------------------------------------------------------------------------------------
# Epilogue fusion: conv2d [+ bias] [+ residual] [-> activation] becomes one kernel call.

_ACTIVATION_OPS = {"relax.nn.relu": "relu", "relax.sigmoid": "sigmoid", "relax.clip": "relu6", "relax.nn.silu": "silu",
                   "relax.nn.gelu": "gelu", "relax.nn.leakyrelu": "leaky_relu"}


def _alpha(activation: relax.Call | None) -> float:
    """leaky_relu's negative slope (the other activations have none)."""
    if activation is None or activation.op.name != "relax.nn.leakyrelu":
        return 0.01
    return float(activation.attrs.alpha)


def _is_relu6(clip: relax.Call) -> bool:
    return (prim_value(clip.args[1]), prim_value(clip.args[2])) == (0.0, 6.0)


def _reads_inside_or_leaks(ctx) -> bool:
    """Whether a match cannot become one kernel call: a value computed inside it is read outside
    it (EfficientNet's (conv + b) * sigmoid(conv + b)), or its shortcut is a value computed
    inside it (y + y). TVM's `has_leaking_intermediate_variables` refuses every match outside a
    dataflow block; reading the uses serves those too."""
    inside = set(ctx.matched_bindings.keys())
    output = ctx.value_to_bound_var.get(ctx.matched_expr)
    for var in inside:
        if not var.same_as(output) and any(user not in inside for user in ctx.var_usages.get(var, [])):
            return True
    residual = ctx.annotated_expr.get("residual")
    if residual is None:
        return False
    return residual in inside or any(residual.same_as(value) for value in ctx.matched_bindings.values())


def fusion_patterns(target: tvm.target.Target) -> list:
    """FuseOpsByPattern patterns grouping a conv2d with the epilogue our kernel applies itself.

    Longest chains first; `check` accepts a match only when decide() gives the conv a kernel,
    the bias is per output channel and the residual has the output's shape.
    """
    from tvm.relax.dpl import is_const, is_op, wildcard

    def check(ctx) -> bool:
        if _reads_inside_or_leaks(ctx):
            return False
        conv = ctx.annotated_expr["conv"]
        decision = decide(conv, target)
        if decision.kernel is None:
            return False
        out_shape = decision.plan.wl.out_shape
        bias = ctx.annotated_expr.get("bias")
        if bias is not None and not is_channel_bias(bias, out_shape[1]):
            return False
        residual = ctx.annotated_expr.get("residual")
        if residual is not None and (static_shape(residual) != out_shape or dtype(residual) != "float32"
                                     or isinstance(residual, tvm.ir.expr.GenericConst)):
            return False  # a constant of the output's shape (a 1x1 output's bias) is a bias
        act = ctx.annotated_expr.get("activation")
        cuda = target.kind.name == "cuda"
        if act is not None and cuda and _ACTIVATION_OPS[act.op.name] not in _cuda.FUSED_ACTIVATIONS:
            return False  # the maxDNN epilogue applies relu and relu6 only
        return act is None or act.op.name != "relax.clip" or _is_relu6(act)

    patterns = []
    for act in (*_ACTIVATION_OPS, None):
        for residual in (True, False):
            for bias in (True, False):
                if not (bias or residual or act):
                    continue
                conv = is_op("relax.nn.conv2d")(wildcard(), is_const())
                annotations = {"conv": conv}
                out = conv
                if bias:
                    annotations["bias"] = is_const()
                    out = is_op("relax.add")(out, annotations["bias"])
                if residual:
                    annotations["residual"] = wildcard()
                    out = is_op("relax.add")(out, annotations["residual"])
                if act == "relax.clip":
                    out = is_op(act)(out, wildcard(), wildcard())
                elif act is not None:
                    out = is_op(act)(out)
                if act is not None:
                    annotations["activation"] = out
                name = "tvm_ext.conv2d" + "_bias" * bias + "_residual" * residual
                name += f"_{_ACTIVATION_OPS[act]}" if act else ""
                patterns.append(relax.transform.FusionPattern(name, out, annotations, check))
    patterns.sort(key=lambda p: -p.name.count("_"))
    return patterns


def _epilogue_of(func: relax.Function) -> tuple[relax.Call, tvm.ir.expr.GenericConst | None, int | None, str | None]:
    """Read a fused composite function: its conv call, bias constant, residual param, activation call.

    Walked from the output, so an add's operands may come in either order (TVM matches add as
    commutative: RegNet's `x + f(x)` puts the shortcut first). Anything else is an error, never
    a dropped operand."""
    values = relax.analysis.get_var2val(func)
    params = list(func.params)

    def value_of(expr: relax.Expr) -> relax.Expr:
        while isinstance(expr, relax.Var) and expr in values:
            expr = values[expr]
        return expr

    def is_op(expr: relax.Expr, *names: str) -> bool:
        return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name in names

    body = func.body.body if isinstance(func.body, relax.SeqExpr) else func.body
    expr, bias, residual, activation = value_of(body), None, None, None
    if is_op(expr, *_ACTIVATION_OPS):
        activation, expr = expr, value_of(expr.args[0])
    while is_op(expr, "relax.add"):
        chain = [arg for arg in expr.args if is_op(value_of(arg), "relax.add", "relax.nn.conv2d")
                 and not isinstance(arg, tvm.ir.expr.GenericConst) and arg not in params]
        if len(chain) != 1:
            raise ValueError(f"tvm_ext: a fused epilogue add has {len(chain)} operands computed inside it: {expr}")
        other = expr.args[1] if expr.args[0].same_as(chain[0]) else expr.args[0]
        if isinstance(other, tvm.ir.expr.GenericConst) and bias is None:
            bias = other
        elif other in params and residual is None:
            residual = params.index(other)
        else:
            raise ValueError(f"tvm_ext: a fused epilogue adds an operand it cannot read: {other}")
        expr = value_of(chain[0])
    if not is_op(expr, "relax.nn.conv2d"):
        raise ValueError(f"tvm_ext: a fused epilogue does not start at a convolution: {expr}")
    return expr, bias, residual, activation


def fusion_passes(target: tvm.target.Target) -> list[tvm.transform.Pass]:
    """Constant folding, batch-norm folding and epilogue grouping: the graph as tvm_ext sees it.

    The pipeline runs these before lowering; the dispatch report runs them to say what fuses.
    FoldConstant first turns importer biases such as reshape(const) into constants.
    """
    return [relax.transform.FoldConstant(), fold_batch_norm(), matmul_as_conv2d(), recognise_silu(),
            relax.transform.FuseOpsByPattern(fusion_patterns(target), bind_constants=True)]


def lower_to_kernels(target: tvm.target.Target, database=None, tensor_cores=False,
                     winograd: bool = True) -> tvm.transform.Pass:
    """Replace the composite functions of :func:`fusion_patterns` and every op :func:`decide`
    gives a kernel with tvm_ext kernel calls, in program order, so that each kernel can read
    its producer's blocked output (see :class:`_Emitter`)."""

    @relax.expr_functor.mutator
    class _Lower(relax.PyExprMutator):
        def __init__(self, mod: tvm.IRModule):
            super().__init__(mod)
            self.mod_ = mod
            self.emitter = make_emitter(self.builder_, target, database, tensor_cores, winograd)

        def visit_call_(self, call: relax.Call) -> relax.Expr:
            call = super().visit_call_(call)
            if isinstance(call.op, tvm.ir.Op):
                decision = decide(call, target, winograd=winograd)
                if decision.kernel is None:
                    return call
                if decision.plan is not None:
                    return self.emitter.conv2d(call, call.args[0])
                return self.emitter.pool_or_activation(call, decision)
            if not isinstance(call.op, tvm.ir.GlobalVar):
                return call
            func = self.mod_[call.op]
            if not isinstance(func, relax.Function) or "Composite" not in (func.attrs or {}):
                return call
            if not str(func.attrs["Composite"]).startswith("tvm_ext.conv2d"):
                return call
            conv, bias, residual, activation = _epilogue_of(func)
            params = list(func.params)
            conv = relax.Call(conv.op, [call.args[params.index(conv.args[0])], conv.args[1]], conv.attrs)
            suffix = "_" + str(func.attrs["Composite"]).split(".")[-1]
            if bias is not None:  # one value per output channel, from one per channel or one for all
                bias = np.broadcast_to(bias.value.numpy().reshape(-1), static_shape(conv.args[1])[:1]).copy()
            return self.emitter.conv2d(
                conv, conv.args[0], bias=bias,
                residual=None if residual is None else call.args[residual], activation=activation,
                suffix=suffix)

    @tvm.transform.module_pass(opt_level=0, name="tvm_ext.LowerToKernels")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        lowering = _Lower(mod)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function) and "Composite" not in (func.attrs or {}):
                lowering.builder_.update_func(gvar, lowering.visit_expr(func))
        lowered = relax.transform.DeadCodeElimination()(lowering.builder_.get())
        if isinstance(lowering.emitter, _Emitter):  # blocked CPU layouts: no padded copies
            lowered = write_borders(lowered, lowering.emitter.conv_kernel)
        return _drop_unused_kernels(lowered)

    return _pass


def _drop_unused_kernels(mod: tvm.IRModule) -> tvm.IRModule:
    """Remove our PrimFuncs that no Relax function calls any more (layout views nobody read):
    DeadCodeElimination drops their calls but keeps the functions, which would still be compiled."""
    used = set()
    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(
                func, lambda e: used.add(e.name_hint) if isinstance(e, tvm.ir.GlobalVar) else None)
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, tvm.tirx.PrimFunc) and _conv.KERNEL_ATTR in func.attrs and gvar.name_hint not in used:
            del mod[gvar]
    return mod
