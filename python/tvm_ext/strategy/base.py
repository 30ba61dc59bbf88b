"""What every part of the strategy shares: the Decision it takes per op, the tables of the ops it
serves, and the small readers of their attributes."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import TYPE_CHECKING, Protocol

import numpy as np
import tvm
from tvm import relax

from ..errors import UnsupportedError
from ..kernels import pool2d as _pool
from ..kernels.common import KERNEL_ATTR
from ..relax_info import prim_value, same_extent
from ..transform.quantized_movement import replay_moves

logger = logging.getLogger("tvm_ext")

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import TypeAlias

    from ..kernels.conv2d import Conv2dPlan
    from ..kernels.conv2d_backward_weight import WeightGradPlan
    from ..kernels.conv2d_maxdnn import MaxDNNCpuPlan
    from ..kernels.cuda.maxdnn import MaxDNNPlan
    from ..kernels.cuda.winograd import WinogradPlan

    # A convolution's plan: a kernels.conv2d.Conv2dPlan (direct, BRGEMM, depthwise or Winograd)
    # or a MaxDNNCpuPlan (the maxDNN tile) on CPUs, a kernels.cuda MaxDNNPlan or WinogradPlan on
    # CUDA; a weight gradient's WeightGradPlan (CPUs).
    ConvPlan: TypeAlias = Conv2dPlan | MaxDNNCpuPlan | MaxDNNPlan | WinogradPlan | WeightGradPlan

# Relax's FuseOps must leave our scheduled kernels alone: kOpaque.
OPAQUE = 8


@dataclasses.dataclass(frozen=True)
class Decision:
    """The dispatch of one op: the tvm_ext kernel serving it, or None and the reason."""

    op: str
    shapes: tuple
    kernel: str | None
    reason: str = ""
    # the convolution's plan: a kernels.conv2d.Conv2dPlan or kernels.winograd plan on CPUs, a
    # kernels.cuda MaxDNNPlan or WinogradPlan on CUDA, a weight gradient's WeightGradPlan; None
    # for other ops
    plan: ConvPlan | None = None

    @property
    def chosen_kernel(self) -> str:
        """:attr:`kernel`, for an emitter: it is only given decisions that have one."""
        if self.kernel is None:
            raise UnsupportedError(f"{self.op} {self.shapes}: no tvm_ext kernel to emit ({self.reason})")
        return self.kernel

    @property
    def conv_plan(self) -> ConvPlan:
        """:attr:`plan`, for a convolution given a kernel (whose decision always carries one)."""
        if self.plan is None:
            raise UnsupportedError(f"{self.op} {self.shapes}: no convolution plan ({self.reason})")
        return self.plan


ACTIVATION_OPS = {"relax.nn.relu": "relu", "relax.sigmoid": "sigmoid", "relax.clip": "relu6", "relax.nn.silu": "silu",
                   "relax.nn.gelu": "gelu", "relax.nn.leakyrelu": "leaky_relu"}


POOLS = {"relax.nn.max_pool2d": "max", "relax.nn.avg_pool2d": "avg", "relax.nn.adaptive_avg_pool2d": "global"}


@dataclasses.dataclass(frozen=True)
class Activation:
    """An activation a convolution's epilogue applies: a name of
    :data:`tvm_ext.kernels.conv2d.ACTIVATIONS` and leaky_relu's slope."""

    name: str
    alpha: float = 0.01


def scalar_constant(expr: relax.Expr) -> float | None:
    """The value of a constant holding one number, else None."""
    if not isinstance(expr, tvm.ir.expr.GenericConst):
        return None
    value = expr.value.numpy()
    return float(value.reshape(-1)[0]) if value.size == 1 else None


def activation_at(expr: relax.Expr, value_of) -> tuple[Activation, relax.Expr] | None:
    """The activation `expr` computes and its input, if it is one: an activation op, or the
    decompositions importers write for hardsigmoid (clip(x + 3, 0, 6) / 6), hardswish
    (x * hardsigmoid(x), or torch.export's (x * clip(x + 3, 0, 6)) / 6, operands in either
    order, the clip also as clip(clip(., 0, inf), -inf, 6)) and SiLU (x * sigmoid(x): a PT2E
    graph's, which the quantized lowering reads before `recognise_silu` runs). `value_of` looks
    through bindings."""
    def is_op(e: relax.Expr, name: str) -> bool:
        return isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == name

    def bounds(clip: relax.Call) -> tuple:
        return prim_value(clip.args[1]), prim_value(clip.args[2])

    def relu6_of_x_plus_3(e: relax.Expr) -> relax.Expr | None:
        """x, if `e` is clip(x + 3, 0, 6), the clip whole or as two one-sided clips."""
        e = value_of(e)
        if not is_op(e, "relax.clip"):
            return None
        if bounds(e) != (0.0, 6.0):
            inner = value_of(e.args[0])
            if not is_op(inner, "relax.clip") or {bounds(e), bounds(inner)} != {(0.0, math.inf), (-math.inf, 6.0)}:
                return None
            e = inner
        shifted = value_of(e.args[0])
        if not (is_op(shifted, "relax.add") and scalar_constant(shifted.args[1]) == 3.0):
            return None
        return shifted.args[0]

    def hardsigmoid_input(e: relax.Expr) -> relax.Expr | None:
        e = value_of(e)
        if not (is_op(e, "relax.divide") and scalar_constant(e.args[1]) == 6.0):
            return None
        return relu6_of_x_plus_3(e.args[0])

    def same(a: relax.Expr, b: relax.Expr | None) -> bool:
        return b is not None and value_of(a).same_as(value_of(b))

    expr = value_of(expr)
    if not isinstance(expr, relax.Call) or not isinstance(expr.op, tvm.ir.Op):
        return None
    name = expr.op.name
    if name in ACTIVATION_OPS and (name != "relax.clip" or is_relu6(expr)):
        return Activation(ACTIVATION_OPS[name], alpha(expr)), expr.args[0]
    x = hardsigmoid_input(expr)
    if x is not None:
        return Activation("hardsigmoid"), x
    if is_op(expr, "relax.multiply"):
        for this, other in (expr.args, expr.args[::-1]):
            if same(this, hardsigmoid_input(other)):
                return Activation("hardswish"), this
            sigmoid = value_of(other)
            if is_op(sigmoid, "relax.sigmoid") and same(this, sigmoid.args[0]):
                return Activation("silu"), this
    if is_op(expr, "relax.divide") and scalar_constant(expr.args[1]) == 6.0:
        product = value_of(expr.args[0])
        if is_op(product, "relax.multiply"):
            for this, other in (product.args, product.args[::-1]):
                if same(this, relu6_of_x_plus_3(other)):
                    return Activation("hardswish"), this
    return None


def channel_scale_operands(call: relax.Call) -> tuple[relax.Expr, relax.Expr] | None:
    """(x, s) of a multiply of an NCHW tensor x by s of shape (N, C, 1, 1), either operand order
    (squeeze-excitation's gate); None for any other multiply."""
    args = list(call.args)
    if len(args) != 2 or not all(isinstance(a.ty, relax.TensorType) for a in args):
        return None
    for x, s in (args, args[::-1]):
        xs, ss = x.ty.shape, s.ty.shape
        if xs is None or ss is None or len(xs) != 4 or len(ss) != 4:
            continue
        spatial = [isinstance(v, tvm.tirx.IntImm) and int(v) == 1 for v in (ss[2], ss[3])]
        if all(spatial) and not all(isinstance(v, tvm.tirx.IntImm) and int(v) == 1 for v in (xs[2], xs[3])):
            if same_extent(xs[0], ss[0]) and same_extent(xs[1], ss[1]):
                return x, s
    return None


def alpha(activation: relax.Call | None) -> float:
    """leaky_relu's negative slope (the other activations have none)."""
    if activation is None or activation.op.name != "relax.nn.leakyrelu":
        return 0.01
    return float(activation.attrs.alpha)


def is_relu6(clip: relax.Call) -> bool:
    """Whether a clip is relu6's (0, 6), the one clip the kernels apply."""
    return (prim_value(clip.args[1]), prim_value(clip.args[2])) == (0.0, 6.0)


def pool_workload(call: relax.Call, shape: tuple) -> _pool.Pool2dWorkload:
    """The pooling workload of a max/avg pool call on NCHW data of `shape` (raises ValueError)."""
    attrs = call.attrs
    mode = POOLS[call.op.name]
    return _pool.Pool2dWorkload.make(shape, mode, [int(v) for v in attrs.pool_size], [int(v) for v in attrs.strides],
                                     [int(v) for v in attrs.padding], [int(v) for v in attrs.dilation],
                                     bool(attrs.ceil_mode), bool(attrs.count_include_pad))


def called_kernel(mod: tvm.IRModule, value, kind: str | None = None) -> tvm.tirx.PrimFunc | None:
    """The PrimFunc `value` calls if it is a call_tir (and, given `kind`, a tvm_ext kernel of
    that kind: its KERNEL_ATTR), else None."""
    if not (isinstance(value, relax.Call) and value.op == tvm.ir.Op.get("relax.call_tir")):
        return None
    func = mod[value.args[0]]
    if not isinstance(func, tvm.tirx.PrimFunc):
        return None
    return func if kind is None or str((func.attrs or {}).get(KERNEL_ATTR, "")) == kind else None


def readers_of(func: relax.Function) -> dict[relax.Var, list]:
    """Each variable of `func` and what reads it, once a read: the value of a binding, or None
    for the function's result."""
    readers: dict[relax.Var, list] = {}

    def reads(value, reader) -> None:
        relax.analysis.post_order_visit(
            value, lambda e: readers.setdefault(e, []).append(reader) if isinstance(e, relax.Var) else None)

    body = func.body
    for block in body.blocks:
        for binding in block.bindings:
            reads(binding.value, binding.value)
    reads(body.body, None)
    return readers


def pool_tag(wl: _pool.Pool2dWorkload) -> str:
    """A pooling's window, stride, padding, dilation, rounding and count, as a kernel name's part."""
    return (f"k{wl.kernel[0]}x{wl.kernel[1]}_s{wl.stride[0]}x{wl.stride[1]}_p{'x'.join(map(str, wl.padding))}"
            f"_d{wl.dilation[0]}x{wl.dilation[1]}{'_ceil' if wl.ceil_mode else ''}"
            f"{'' if wl.count_include_pad else '_exclude_pad'}")


def bound_value(bb: relax.BlockBuilder, expr: relax.Expr) -> relax.Expr | None:
    """The value bound to variable `expr` in the function `bb` is building, else None."""
    return bb.lookup_binding(expr) if isinstance(expr, relax.Var) else None


def tuple_field(bb: relax.BlockBuilder, expr: relax.Expr) -> relax.Expr:
    """`expr`, or the tuple field it names (Gradient passes a tuple-valued op's adjoint as a
    tuple, of which dY is a field; a batch norm's y is its tuple's first), so that an emitter
    finds the field's own layout."""
    return field_of(expr, lambda e: bound_value(bb, e))


def field_of(expr: relax.Expr, value_of) -> relax.Expr:
    """`expr`, or the field of a tuple bound in the function that it names, through TupleGetItems
    (`value_of`: a variable's bound value, or None). PyTorch's max_pool2d_with_indices imports as
    a tuple (the pooling, zeros) and a TupleGetItem of it."""
    value = value_of(expr) if isinstance(expr, relax.Var) else None
    while value is not None and isinstance(value, relax.TupleGetItem):
        tuple_value = value.tuple_value
        if isinstance(tuple_value, relax.Var):
            tuple_value = value_of(tuple_value)
        if tuple_value is None or not isinstance(tuple_value, relax.Tuple):
            break
        expr = tuple_value.fields[value.index]
        value = value_of(expr) if isinstance(expr, relax.Var) else None
    return expr


def add_kernel(bb: relax.BlockBuilder, func: tvm.tirx.PrimFunc, name: str) -> tvm.ir.GlobalVar:
    """`func` added to the module as an opaque kernel (FuseOps leaves it alone)."""
    return bb.add_func(func.with_attr("op_pattern", OPAQUE), name)


def rebind_to_kernels(mod: tvm.IRModule, gvar: tvm.ir.GlobalVar, func: relax.Function,
                      calls: dict[relax.Var, tuple[list[relax.Expr], tvm.tirx.PrimFunc, str]],
                      moved: dict[relax.Var, tuple[relax.TensorType, list[relax.Call]]] | None = None) -> tvm.IRModule:
    """`mod` with `func` (bound to `gvar`) computing each variable of `calls` by one kernel call,
    (its arguments, the kernel, its name), and what nothing reads any more dropped: a rewrite of
    lowered Relax (a few passes replaced by one, a kernel reading another tensor). A variable of
    `moved` -> (the type its kernel writes, data moves) is the kernel's output moved so (an
    element-wise kernel run before the moves its input had: quantized_tables)."""
    moves_of = moved or {}

    @relax.expr_functor.mutator
    class _Mutator(relax.PyExprMutator):
        def visit_var_binding_(self, binding: relax.VarBinding) -> None:
            if binding.var not in calls:
                super().visit_var_binding_(binding)
                return
            args, kernel, name = calls[binding.var]
            written, moves = moves_of.get(binding.var, (binding.var.ty, []))
            call = relax.call_tir(add_kernel(self.builder_, kernel, name), [self.visit_expr(arg) for arg in args],
                                  written)
            if moves:
                self.set_var_remap(binding.var, replay_moves(self.builder_, self.builder_.emit(call), moves))
            else:
                self.set_var_remap(binding.var, self.builder_.emit(call, binding.var.name))

    mutator = _Mutator(mod)
    mutator.builder_.update_func(gvar, mutator.visit_expr(func))
    return relax.transform.DeadCodeElimination()(mutator.builder_.get())


def rebind_each_function(mod: tvm.IRModule, replacements: Callable[[tvm.IRModule, relax.Function], dict],
                         what: str) -> tvm.IRModule:
    """:func:`rebind_to_kernels` of each Relax function of lowered `mod` (composites aside) with
    the calls `replacements(mod, func)` finds; `what` names them in the debug log."""
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function) and "Composite" not in (func.attrs or {}):
            found = replacements(mod, func)
            if found:
                mod = rebind_to_kernels(mod, gvar, func, found)
                logger.debug("tvm_ext: %d %s", len(found), what)
    return mod


def emit_kernel_outputs(bb: relax.BlockBuilder, func: tvm.tirx.PrimFunc, name: str, args: list,
                        shapes: list[tuple]) -> list[relax.Var]:
    """The float32 outputs of kernel `func`, which writes several tensors of `shapes`."""
    out = bb.emit(relax.call_tir(add_kernel(bb, func, name), args,
                                 [relax.TensorType(shape, "float32") for shape in shapes]))
    return [bb.emit(relax.TupleGetItem(out, i)) for i in range(len(shapes))]


def running_statistics(batch_norm: relax.Call, mean: relax.Expr, var: relax.Expr) -> list[relax.Expr]:
    """The new running mean and variance of a training-mode `batch_norm` whose batch statistics are
    `mean` and `var`, as TVM's batch_norm defines them: (1 - momentum) * old + momentum * new."""
    momentum = float(batch_norm.attrs.momentum)
    keep, take = relax.const(1 - momentum, "float32"), relax.const(momentum, "float32")
    return [relax.op.add(relax.op.multiply(keep, old), relax.op.multiply(take, new))
            for old, new in ((batch_norm.args[3], mean), (batch_norm.args[4], var))]


def statistics_only_batch_norm(call: relax.Call, known: dict, compute: Callable[[], tuple]) -> relax.Expr:
    """A training-mode batch norm whose y nobody reads, only the new running statistics (the copy
    :func:`~tvm_ext.transform.split_running_statistics` makes): those, from the batch statistics
    `known` for the same data (a kernel that normalized it; keyed by the NCHW view too, since an
    input's blocked copy is new each time), else from `compute()`. y's place holds x (unread)."""
    data = call.args[0]
    statistics = known.get(data)
    return relax.Tuple([data, *running_statistics(call, *(statistics if statistics is not None else compute()))])


class Emitter(Protocol):
    """What :mod:`.dispatch` asks of a target's emitter (:class:`.cpu.CpuEmitter`,
    :class:`.cuda.CudaEmitter`): the calls that replace one op, given the decision taken for it.
    Each keeps activations in its kernels' layout between them, and hands the rest of the graph
    a view in NCHW."""

    def conv2d(self, call: relax.Call, data: relax.Expr, decision: Decision,
               bias: np.ndarray | relax.Expr | None = None, residual: relax.Expr | None = None,
               activation: Activation | None = None, suffix: str = "", padded_out: bool = False,
               mask: tuple[relax.Expr, Activation] | None = None) -> relax.Expr:
        """conv2d (+ bias + residual -> activation) as kernel calls (`bias`: K values, constant or
        computed at run time; `padded_out`: its readers take blocks padded past its channels,
        where the target's layout has such blocks; `mask`: an activation's output and the
        activation whose gradient the epilogue applies last, :attr:`~tvm_ext.kernels.conv2d.Epilogue.mask`)."""

    def conv2d_backward_weight(self, call: relax.Call, decision: Decision) -> relax.Expr:
        """A weight gradient, conv2d(x, dY) in :data:`~.decide.WEIGHT_GRADIENT_LAYOUTS`, as kernel
        calls giving dW in OIHW."""

    def new_block(self) -> None:
        """Forget what was emitted for earlier blocks (their dataflow variables are out of scope)."""

    def batch_norm_training(self, call: relax.Call, residual: relax.Expr | None = None,
                            relu: bool = False) -> relax.Expr:
        """A training-mode batch norm: (y, the new running mean, the new running variance), or
        relu(y + residual) alone for a fused composite."""

    def batch_norm_statistics(self, call: relax.Call) -> relax.Expr:
        """A training-mode batch norm of which only the new running statistics are read: (an
        unread placeholder for y, the new running mean, the new running variance)."""

    def batch_norm_backward(self, found) -> tuple[relax.Expr, relax.Var, relax.Var]:
        """(dX, dgamma, dbeta) of a training-mode batch norm's gradient (a
        :class:`~tvm_ext.transform.gradients.BatchNormGradient` over the function being built)."""
        ...

    def interleaved_phases(self, call: relax.Call) -> relax.Expr | None:
        """A strided convolution's dX from its stride phases' convolutions
        (:func:`~tvm_ext.transform.gradients.read_phase_interleave`, ending at `call`) as a
        kernel call; None where `call` ends no such chain or its phases are not our kernels'."""

    def pool2d_backward(self, call: relax.Call, relu_mask: bool = False) -> relax.Expr:
        """{max,avg}_pool2d_backward(dY, x) as kernel calls; `relu_mask` (max pooling): also
        relu's gradient of x, where(x > 0, dX, 0)."""

    def other_op(self, call: relax.Call, decision: Decision) -> relax.Expr:
        """Any other op :func:`~.decide.decide` gives a kernel (a pooling, global pooling, mean
        over H and W, activation, channel scale (a squeeze-excitation gate), concatenation or
        layer norm over channels) as a kernel call."""
