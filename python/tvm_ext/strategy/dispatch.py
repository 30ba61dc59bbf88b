"""Lowering to tvm_ext kernels: :func:`lower_to_kernels` replaces, in program order, each fused
composite and each op :func:`~.decide.decide` gives a kernel with the calls the target's emitter
makes (so each kernel can read its producer's output in its own layout); :func:`legalize_map`
hands what is left to stock TVM with the reason logged."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import tvm
from tvm import relax

from ..kernels.common import KERNEL_ATTR
from ..relax_info import known_shape, static_shape
from ..transform.gradients import BatchNormGradient, read_batch_norm_gradient
from .base import ACTIVATION_OPS, POOLS, Activation, Emitter, readers_of
from .bf16_activations import write_bf16_activations
from .borders import read_masks_padded, write_borders, write_dequantized_borders
from .cpu import CpuEmitter
from .cuda import CudaEmitter
from .cuda_engine import engine_for
from .decide import decide, is_weight_gradient
from .fusion import affine_of, batch_norm_epilogue_of, epilogue_of, fake_quantize_of, pool_gradient_of
from .quantized_blocks import quantize_fp32_blocks
from .quantized_rows import quantized_dense_rows

logger = logging.getLogger("tvm_ext")

__all__ = ["batch_norm_gradients", "legalize_map", "lower_to_kernels", "make_emitter", "weight_and_bias_gradients"]


def make_emitter(bb: relax.BlockBuilder, target: tvm.target.Target, database=None, tensor_cores: bool | str = False,
                 winograd: bool = True):
    """The emitter of `target`'s kernels: blocked NCHW[x]c on CPUs, CHWN on CUDA (`tensor_cores`,
    `winograd`: see :func:`tvm_ext.pipeline`)."""
    if target.kind.name == "cuda":
        return CudaEmitter(bb, target, database, engine=engine_for(tensor_cores, target),
                                 winograd=winograd)
    return CpuEmitter(bb, target, database, winograd)


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
        if is_weight_gradient(call):
            return emitter.conv2d_backward_weight(call, decision)
        if decision.plan is not None:
            return emitter.conv2d(call, call.args[0], decision)
        return emitter.other_op(call, decision)

    return {op: legalize for op in ("relax.nn.conv2d", "relax.mean", "relax.concat", "relax.nn.layer_norm", *POOLS,
                                    *ACTIVATION_OPS)}


def lower_to_kernels(target: tvm.target.Target, database=None, tensor_cores: bool | str = False,
                     winograd: bool = True, precision: str = "fp32", maxdnn: str = "auto") -> tvm.transform.Pass:
    """Replace the composite functions of :func:`fusion_patterns` and every op :func:`decide`
    gives a kernel with tvm_ext kernel calls, in program order, so that each kernel can read
    its producer's blocked output (see :class:`~.cpu.CpuEmitter`); `precision`, `maxdnn`: see
    :func:`~.decide.decide`."""

    @relax.expr_functor.mutator
    class _Lower(relax.PyExprMutator):
        def __init__(self, mod: tvm.IRModule):
            super().__init__(mod)
            self.mod_ = mod
            self.emitter: Emitter = make_emitter(self.builder_, target, database, tensor_cores, winograd)
            self.engine = engine_for(tensor_cores, target) if target.kind.name == "cuda" else "ffma"
            self.padded_readers: set = set()  # of the function being lowered (_padded_readers)
            self.padded_out = False  # whether the binding being lowered may be written padded
            self.binding: relax.VarBinding | None = None  # the binding being lowered
            # weight and bias gradients computed by one kernel (weight_and_bias_gradients)
            self.gradient_pairs: dict[relax.Var, tuple[relax.Var, relax.Var, relax.Call]] = {}
            self.gradients: dict[relax.Var, tuple[relax.Expr, relax.Expr]] = {}
            # training-mode batch norm gradients (batch_norm_gradients): binding -> (the chain, its dX)
            self.norm_gradients: dict[relax.Var, tuple[BatchNormGradient, relax.Var]] = {}
            self.norm_outputs: dict[relax.Var, tuple] = {}  # dX's variable -> (dX, dgamma, dbeta) emitted
            self.statistics_only: set[relax.Var] = set()  # batch norms read for their running statistics only

        def visit_binding_block_(self, block: relax.BindingBlock) -> relax.BindingBlock:
            self._new_block()
            return super().visit_binding_block_(block)

        def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.BindingBlock:
            self._new_block()
            return super().visit_dataflow_block_(block)

        def _new_block(self) -> None:
            """A block's dataflow variables are not seen past it: the emitter reuses no copy of them."""
            self.emitter.new_block()

        def visit_var_binding_(self, binding: relax.VarBinding) -> None:
            self.padded_out = binding.var in self.padded_readers
            self.binding = binding
            super().visit_var_binding_(binding)

        def _paired_gradient(self, call: relax.Call) -> relax.Expr | None:
            """dW or dB of a pair found by weight_and_bias_gradients: the kernel that computes
            both is emitted at the first of the two bindings, where x and dY are both defined."""
            if self.binding is None or not call.same_as(self.binding.value):
                return None
            var = self.binding.var
            pair = self.gradient_pairs.get(var)
            if pair is None:
                return None
            dw_var, _, dw_call = pair
            if dw_var not in self.gradients:
                remapped = relax.Call(dw_call.op, [self.visit_expr(arg) for arg in dw_call.args], dw_call.attrs)
                emitter = self.emitter
                assert isinstance(emitter, CpuEmitter)
                self.gradients[dw_var] = emitter.conv2d_backward_weight(  # type: ignore[assignment]
                    remapped, decide(dw_call, target), bias=True)
            dw, db = self.gradients[dw_var]
            if var.same_as(dw_var):
                return dw
            return relax.op.reshape(db, known_shape(static_shape(call), "collapse_sum_to"))

        def _norm_gradient(self, call: relax.Call) -> relax.Expr | None:
            """dX, dgamma or dbeta of a batch norm gradient found by batch_norm_gradients: one
            kernel computes all three, emitted at the first of their bindings (dbeta's)."""
            if self.binding is None or not call.same_as(self.binding.value):
                return None
            entry = self.norm_gradients.get(self.binding.var)
            if entry is None:
                return None
            found, dx_var = entry
            if dx_var not in self.norm_outputs:
                remapped = dataclasses.replace(
                    found, x=self.visit_expr(found.x), dy=self.visit_expr(found.dy),
                    gamma=None if found.gamma is None else self.visit_expr(found.gamma))
                self.norm_outputs[dx_var] = self.emitter.batch_norm_backward(remapped)
            dx, dgamma, dbeta = self.norm_outputs[dx_var]
            var = self.binding.var
            return dx if var.same_as(dx_var) else dgamma if var.same_as(found.dgamma) else dbeta

        def visit_call_(self, call: relax.Call) -> relax.Expr:
            paired = self._paired_gradient(call)
            if paired is None:
                paired = self._norm_gradient(call)
            if paired is not None:
                return paired
            statistics_only = (self.binding is not None and call.same_as(self.binding.value)
                               and self.binding.var in self.statistics_only)
            call = super().visit_call_(call)
            if isinstance(call.op, tvm.ir.Op):
                interleaved = self.emitter.interleaved_phases(call)  # a strided convolution's dX, from its phases
                if interleaved is not None:
                    return interleaved
                decision = decide(call, target, self.engine, winograd, precision, maxdnn)
                if decision.kernel is None:
                    return call
                if is_weight_gradient(call):
                    return self.emitter.conv2d_backward_weight(call, decision)
                if decision.plan is not None:
                    return self.emitter.conv2d(call, call.args[0], decision, padded_out=self.padded_out)
                if statistics_only and decision.kernel == "batch_norm_training":
                    return self.emitter.batch_norm_statistics(call)
                return self.emitter.other_op(call, decision)
            if not isinstance(call.op, tvm.ir.GlobalVar):
                return call
            func = self.mod_[call.op]
            if not isinstance(func, relax.Function) or "Composite" not in (func.attrs or {}):
                return call
            composite = str(func.attrs["Composite"])
            if composite.startswith("tvm_ext.channel_affine") and isinstance(self.emitter, CpuEmitter):
                inputs, scale, shift, activation = affine_of(func)
                return self.emitter.channel_affine([call.args[i] for i in inputs],
                                                   None if scale is None else scale.value.numpy(),
                                                   None if shift is None else shift.value.numpy(), activation)
            if composite.startswith("tvm_ext.fake_quantize") and isinstance(self.emitter, CpuEmitter):
                return self.emitter.fake_quantize(call.args[0], *fake_quantize_of(func))
            if composite.startswith("tvm_ext.max_pool2d_backward"):
                return self.emitter.pool2d_backward(_outside(pool_gradient_of(func), func, call), relu_mask=True)
            if composite.startswith("tvm_ext.batch_norm_training"):
                norm, residual, relu = batch_norm_epilogue_of(func)
                return self.emitter.batch_norm_training(
                    _outside(norm, func, call), None if residual is None else call.args[residual], relu)
            if not composite.startswith("tvm_ext.conv2d"):
                return call
            conv, bias, residual, activation, mask = epilogue_of(func)
            conv = _outside(conv, func, call)
            suffix = "_" + str(func.attrs["Composite"]).split(".")[-1]
            out_channels = known_shape(static_shape(conv.args[1]), "conv2d: the weight")[:1]
            if isinstance(bias, int):  # computed at run time: one value per output channel, as an expression
                bias = relax.op.broadcast_to(relax.op.reshape(call.args[bias], (-1,)), out_channels)
            elif bias is not None:  # one value per output channel, from one per channel or one for all
                bias = np.broadcast_to(bias.value.numpy().reshape(-1), out_channels).copy()
            return self.emitter.conv2d(
                conv, conv.args[0], decide(conv, target, self.engine, winograd, precision, maxdnn), bias=bias,
                residual=None if residual is None else call.args[residual], activation=activation,
                suffix=suffix, padded_out=self.padded_out,
                mask=None if mask is None else (call.args[mask.param], Activation(mask.name, mask.alpha)))

    @tvm.transform.module_pass(opt_level=0, name="tvm_ext.LowerToKernels")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        lowering = _Lower(mod)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function) and "Composite" not in (func.attrs or {}):
                lowering.padded_readers = _padded_readers(mod, func)
                if isinstance(lowering.emitter, CpuEmitter):
                    lowering.gradient_pairs = weight_and_bias_gradients(func, target)
                lowering.norm_gradients = batch_norm_gradients(func)
                lowering.statistics_only = statistics_only_norms(func)
                lowering.builder_.update_func(gvar, lowering.visit_expr(func))
        lowered = relax.transform.DeadCodeElimination()(lowering.builder_.get())
        if isinstance(lowering.emitter, CpuEmitter):  # blocked CPU layouts: no padded copies, no rounding passes
            make_kernel = lowering.emitter.conv_kernel
            lowered = write_bf16_activations(write_borders(read_masks_padded(lowered, make_kernel), make_kernel),
                                             make_kernel)
            # between int8 and fp32 kernels: an int8 input quantized from fp32 blocks, a dequantize
            # that writes its fp32 reader's border (one pass each, not three and two); a quantized
            # dense layer's rows packed and unpacked in one pass each (not two)
            lowered = quantized_dense_rows(write_dequantized_borders(quantize_fp32_blocks(lowered)))
        return _drop_unused_kernels(lowered)

    return _pass


def _outside(inner: relax.Call, composite: relax.Function, call: relax.Call) -> relax.Call:
    """A call inside a composite function, with the composite's params replaced by the
    arguments `call` passes it (constants bound inside stay)."""
    params = list(composite.params)
    return relax.Call(inner.op, [call.args[params.index(arg)] if arg in params else arg for arg in inner.args],
                      inner.attrs)


def weight_and_bias_gradients(func: relax.Function, target: tvm.target.Target) -> dict:
    """The weight gradients (conv2d(x, dY) in :data:`~.decide.WEIGHT_GRADIENT_LAYOUTS` on the X^T
    dY kernel) whose dY is also summed to a bias gradient (collapse_sum_to(dY, (1, K, 1, 1)), as
    relax.transform.Gradient writes a bias add's): each of the two bindings' variables -> (dW's
    variable, dB's, dW's call). One kernel computes both: dY is read once, not also by a stock
    reduction over an NCHW copy. Only where x is defined before both bindings."""
    position: dict[relax.Var, int] = {param: -1 for param in func.params}
    dw_of: dict[relax.Var, list[tuple[relax.Var, relax.Call]]] = {}  # dY -> [(dW's variable, its call)]
    sums: list[tuple[relax.Var, relax.Call]] = []
    for block in func.body.blocks:
        for binding in block.bindings:
            position[binding.var] = len(position)
            value = binding.value
            if not isinstance(binding, relax.VarBinding) or not isinstance(value, relax.Call):
                continue
            if not isinstance(value.op, tvm.ir.Op):
                continue
            if value.op.name == "relax.nn.conv2d" and decide(value, target).kernel == "conv2d_backward_weight":
                dw_of.setdefault(value.args[1], []).append((binding.var, value))
            elif value.op.name == "relax.collapse_sum_to" and isinstance(value.args[0], relax.Var):
                sums.append((binding.var, value))
    pairs = {}
    for db_var, summed in sums:  # (a residual block's dY: its last convolution's and its shortcut's)
        dy = summed.args[0]
        shape, dy_shape = static_shape(summed), static_shape(dy)
        if shape is None or dy_shape is None or (1,) * (4 - len(shape)) + tuple(shape) != (1, dy_shape[1], 1, 1):
            continue
        for dw_var, dw_call in dw_of.get(dy, []):
            x = dw_call.args[0]
            if (dw_var not in pairs and isinstance(x, relax.Var)
                    and position.get(x, len(position)) < min(position[dw_var], position[db_var])):
                pairs[dw_var] = pairs[db_var] = (dw_var, db_var, dw_call)
                break
    return pairs


def batch_norm_gradients(func: relax.Function) -> dict[relax.Var, tuple[BatchNormGradient, relax.Var]]:
    """The training-mode batch norm gradients of `func` that one kernel computes
    (:func:`~tvm_ext.transform.gradients.read_batch_norm_gradient`): the variables of dX, dgamma
    and dbeta -> (the chain read, dX's variable)."""
    values: dict[relax.Var, relax.Expr] = {}
    found: dict[relax.Var, tuple[BatchNormGradient, relax.Var]] = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            if not isinstance(binding, relax.VarBinding):
                continue
            values[binding.var] = binding.value
            value = binding.value
            if isinstance(value, relax.Call) and value.op == tvm.ir.Op.get("relax.multiply"):
                chain = read_batch_norm_gradient(value, values.get)
                if chain is not None:
                    for var in (binding.var, chain.dgamma, chain.dbeta):
                        found[var] = (chain, binding.var)
    return found


def statistics_only_norms(func: relax.Function) -> set[relax.Var]:
    """The variables of `func`'s batch norms that are read only for their new running statistics
    (outputs 1 and 2; :func:`~tvm_ext.transform.split_running_statistics` makes them)."""
    norm = tvm.ir.Op.get("relax.nn.batch_norm")
    norms = {binding.var for block in func.body.blocks for binding in block.bindings
             if isinstance(binding, relax.VarBinding) and isinstance(binding.value, relax.Call)
             and binding.value.op.same_as(norm)}
    return {var for var, readers in readers_of(func).items()
            if var in norms and all(isinstance(r, relax.TupleGetItem) and r.index in (1, 2) for r in readers)}


# ops that read a padded blocked tensor as it is (CpuEmitter.blocked(padded=True))
_PADDED_READERS = {"relax.nn.conv2d", "relax.mean", "relax.multiply", *POOLS, *ACTIVATION_OPS}


def _padded_readers(mod: tvm.IRModule, func: relax.Function) -> set:
    """The variables of `func` that only ops reading padded blocks read (convolutions, fused or
    not, pooling, activations, a squeeze-excitation's scale): a convolution whose output channels
    do not fill its last block writes those padded. The others (a classifier's output, which a
    reshape reads, or the graph's) it writes in NCHW itself, saving the unpack."""
    def accepts(user) -> bool:
        if not isinstance(user, relax.Call):
            return False
        if isinstance(user.op, tvm.ir.Op):
            return user.op.name in _PADDED_READERS
        attrs = getattr(mod[user.op], "attrs", None) if isinstance(user.op, tvm.ir.GlobalVar) else None
        return attrs is not None and str(attrs.get("Composite", "")).startswith("tvm_ext.conv2d")

    return {var for var, readers in readers_of(func).items() if all(accepts(reader) for reader in readers)}


def _drop_unused_kernels(mod: tvm.IRModule) -> tvm.IRModule:
    """Remove our PrimFuncs that no Relax function calls any more (layout views nobody read):
    DeadCodeElimination drops their calls but keeps the functions, which would still be compiled."""
    used = set()
    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(
                func, lambda e: used.add(e.name_hint) if isinstance(e, tvm.ir.GlobalVar) else None)
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, tvm.tirx.PrimFunc) and KERNEL_ATTR in func.attrs and gvar.name_hint not in used:
            del mod[gvar]
    return mod
