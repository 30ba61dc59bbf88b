"""Which tvm_ext CUDA kernel serves which Relax op, and how the calls are emitted.

The dispatch framework is shared (:mod:`.decide`, :mod:`.fusion`, :mod:`.dispatch`; the CUDA
convolution rule is :mod:`.cuda_engine`); this module is the CUDA emitter:

- convolutions run the maxDNN kernel (:mod:`tvm_ext.kernels.cuda.maxdnn`), with bias, residual
  and relu/relu6 fused into its output write (FFMA, or tensor cores with `tensor_cores=`);
  other activations stay separate kernels. A stride-1 3x3 or 5x5 FFMA convolution with constant
  weights runs as Winograd (:mod:`tvm_ext.kernels.cuda.winograd`: the same tile for its GEMMs,
  the epilogue in its output transform) where its estimate beats the direct tile's;
- activations travel between our kernels in CHWN, the convolution's layout: a tensor one of our
  kernels produced is bound to `chwn_to_nchw(y)`, the view the rest of the graph reads, and our
  kernels look through that binding, so layouts change only at the graph's edges and around
  fallbacks (DeadCodeElimination drops the views nobody reads);
- constant weights are re-laid out (OIHW -> CRSK; for wgmma also packed per block and k step,
  for bf16 wgmma rounded and packed in pairs) or transformed (Winograd's U) here, at build time,
  in NumPy; weights that are inputs are re-laid out by graph ops (and a pairing kernel);
- pooling, global pooling and activations run the memory-bound kernels of
  :mod:`tvm_ext.kernels.cuda.memory_bound`, in CHWN where their input is.

Depthwise convolutions stay with stock TVM: one filter per group leaves 63 of a tile's 64 rows
empty, which is a correct but poor use of the maxDNN tile.
"""

from __future__ import annotations

import functools

import numpy as np
import tvm
from tvm import relax

from ..errors import UnsupportedError
from ..kernels import batch_norm as _batch_norm
from ..kernels.cuda import batch_norm as _cuda_batch_norm
from ..kernels.cuda import maxdnn as _maxdnn
from ..kernels.cuda import memory_bound as _memory_bound
from ..kernels.cuda import winograd as _winograd
from ..transform.gradients import BatchNormGradient, read_phase_interleave
from .base import (
    Activation,
    Decision,
    add_kernel,
    alpha,
    bound_value,
    emit_kernel_outputs,
    pool_tag,
    pool_workload,
    running_statistics,
    statistics_only_batch_norm,
    tuple_field,
)
from .decide import pool2d_backward_workload

_TO_NCHW = "tvm_ext_chwn_to_nchw"


def _shape(expr: relax.Expr) -> tuple[int, ...]:
    return tuple(int(v) for v in expr.ty.shape)


def _cuda_plan(decision: Decision) -> _maxdnn.MaxDNNPlan | _winograd.WinogradPlan:
    """The CUDA plan of a convolution `decision` (:func:`~.cuda_engine.conv2d_decision`)."""
    plan = decision.conv_plan
    if not isinstance(plan, (_maxdnn.MaxDNNPlan, _winograd.WinogradPlan)):
        raise UnsupportedError(f"{decision.op} {decision.shapes}: a {type(plan).__name__} is not a CUDA plan")
    return plan


def _name(kind: str, *parts) -> str:
    return "tvm_ext_" + kind + "_" + "_".join("x".join(map(str, p)) if isinstance(p, tuple) else str(p) for p in parts)


class CudaEmitter:
    """Emits tvm_ext CUDA kernel calls for one op (:class:`.base.Emitter`; the CPU's is
    :class:`.cpu.CpuEmitter`)."""

    def __init__(self, bb: relax.BlockBuilder, target: tvm.target.Target, database=None, engine: str = "ffma",
                 winograd: bool = True):
        if database is not None:
            raise ValueError("tuning records apply to CPU targets only; the CUDA kernels use their analytic tiles")
        self.bb = bb
        self.target = target
        self.engine = engine  # "ffma" (fp32), or a tensor-core engine: engine_for()
        self.winograd = winograd  # constant-weight 3x3/5x5 stride-1 layers may run as Winograd
        # a training-mode batch norm's statistics (CHWN x -> mean, var), for its gradient
        self._batch_statistics: dict[relax.Expr, tuple[relax.Var, relax.Var]] = {}

    def new_block(self) -> None:
        self._batch_statistics.clear()

    def _call(self, func: tvm.tirx.PrimFunc, name: str, args: list, shape: tuple) -> relax.Var:
        return self.bb.emit(relax.call_tir(add_kernel(self.bb, func, name), args, relax.TensorType(shape, "float32")))

    def _calls(self, func: tvm.tirx.PrimFunc, name: str, args: list, shapes: list[tuple]) -> list[relax.Var]:
        return emit_kernel_outputs(self.bb, func, name, args, shapes)

    def produced_chwn(self, expr: relax.Expr) -> relax.Expr | None:
        """The CHWN tensor behind `expr` if `expr` is the NCHW view of one of our kernels' results
        (or a tuple's field that is one)."""
        expr = tuple_field(self.bb, expr)
        if not isinstance(expr, relax.Var):
            return None
        value = self.bb.lookup_binding(expr)
        if (isinstance(value, relax.Call) and value.op == tvm.ir.Op.get("relax.call_tir")
                and value.args[0].name_hint.startswith(_TO_NCHW)):
            return value.args[1].fields[0]
        return None

    def chwn(self, expr: relax.Expr) -> relax.Expr:
        """`expr` (NCHW) in CHWN: the tensor behind it if one of our kernels made it, else a transpose."""
        known = self.produced_chwn(expr)
        if known is not None:
            return known
        shape = _shape(expr)
        out = tuple(shape[a] for a in _memory_bound.NCHW_TO_CHWN)
        func = _memory_bound.transpose_func(shape, _memory_bound.NCHW_TO_CHWN, "nchw_to_chwn")
        return self._call(func, _name("nchw_to_chwn", shape), [expr], out)

    def nchw(self, chwn: relax.Expr) -> relax.Call:
        """The NCHW view of a CHWN result (a call the caller binds; our kernels look through it)."""
        shape = _shape(chwn)
        out = tuple(shape[a] for a in _memory_bound.CHWN_TO_NCHW)
        name = _name(_TO_NCHW.removeprefix("tvm_ext_"), shape)
        func = _memory_bound.transpose_func(shape, _memory_bound.CHWN_TO_NCHW, "chwn_to_nchw")
        return relax.call_tir(add_kernel(self.bb, func, name), [chwn], relax.TensorType(out, "float32"))

    def _weight(self, weight: relax.Expr, plan: _maxdnn.MaxDNNPlan) -> relax.Expr:
        """OIHW -> the plan's weights (:attr:`~tvm_ext.kernels.cuda.maxdnn.MaxDNNPlan.weight_shape`):
        [groups, I*H*W, O/groups] in its reduction order, packed for wgmma; in NumPy for a
        constant, else in the graph."""
        groups, k_order = plan.wl.groups, plan.k_order
        if isinstance(weight, tvm.ir.expr.GenericConst):
            crsk = _maxdnn.weight_to_crsk(weight.value.numpy(), groups, k_order)
            return relax.const(crsk if plan.tile.wgmma is None else _maxdnn.pack_wgmma_weight(crsk, plan))
        k, cg, r, s = _shape(weight)
        if k_order == "crs":
            grouped = relax.op.reshape(weight, (groups, k // groups, cg * r * s))
            crsk = self.bb.emit(relax.op.permute_dims(grouped, [0, 2, 1]))
        else:
            grouped = relax.op.reshape(weight, (groups, k // groups, cg, r * s))
            crsk = self.bb.emit(relax.op.reshape(relax.op.permute_dims(grouped, [0, 3, 2, 1]),
                                                 (groups, r * s * cg, k // groups)))
        return crsk if plan.tile.wgmma is None else self._pack_wgmma_weight(crsk, plan)

    def _pack_wgmma_weight(self, crsk: relax.Expr, plan: _maxdnn.MaxDNNPlan) -> relax.Expr:
        """:func:`~tvm_ext.kernels.cuda.maxdnn.pack_wgmma_weight` as graph ops, for weights that
        are not constants."""
        m, _, k = plan.gemm
        (_, padded_k, padded_m), tiles = _maxdnn.wgmma_pack_tiles(plan)
        padded = relax.op.nn.pad(crsk, [0, 0, 0, padded_k - k, 0, padded_m - m])
        packed = relax.op.permute_dims(relax.op.reshape(padded, tiles), list(_maxdnn.WGMMA_PACK_AXES))
        per = plan.tile.wgmma_shape.per_reg
        if per == 1:
            return self.bb.emit(relax.op.reshape(packed, plan.weight_shape))
        values = self.bb.emit(relax.op.reshape(packed, (*plan.weight_shape[:-1], plan.weight_shape[-1] * per)))
        func = _memory_bound.bf16_pairs_func(_shape(values))
        return self._call(func, _name("bf16_pairs", _shape(values)), [values], plan.weight_shape)

    def conv2d(self, call: relax.Call, data: relax.Expr, decision: Decision,
               bias: np.ndarray | relax.Expr | None = None, residual: relax.Expr | None = None,
               activation: Activation | None = None, suffix: str = "", padded_out: bool = False,
               mask: tuple[relax.Expr, Activation] | None = None) -> relax.Expr:
        if mask is not None:
            raise UnsupportedError("cuda: the maxDNN epilogue applies no activation gradient (mask)")
        decided = _cuda_plan(decision)  # the plan the report names
        wl = decided.wl
        act = None if activation is None else activation.name
        epilogue = _maxdnn.Epilogue(bias=bias is not None, residual=residual is not None, activation=act)
        epilogue_args = []
        if isinstance(bias, np.ndarray):
            epilogue_args.append(relax.const(np.ascontiguousarray(bias.reshape(-1), dtype=np.float32)))
        elif bias is not None:  # K values computed at run time
            epilogue_args.append(bias)
        if residual is not None:
            epilogue_args.append(self.chwn(residual))
        shape = ((wl.N, wl.C, wl.H, wl.W), (wl.K, wl.KH, wl.KW),
                 f"s{wl.stride[0]}x{wl.stride[1]}_p{'x'.join(map(str, wl.padding))}"
                 f"_d{wl.dilation[0]}x{wl.dilation[1]}_g{wl.groups}")
        if isinstance(decided, _winograd.WinogradPlan):
            plan = _winograd.WinogradPlan.make(wl, decided.m, epilogue)
            return self._winograd_conv2d(plan, call.args[1], data, epilogue_args, _name("winograd_conv2d", *shape)
                                         + suffix)
        plan = _maxdnn.MaxDNNPlan.make(wl, decided.tile, epilogue, decided.splits)
        args = [self.chwn(data), self._weight(call.args[1], plan)]
        return self.nchw(self._maxdnn(plan, args, epilogue_args, _name("maxdnn_conv2d", *shape) + suffix))

    def _maxdnn(self, plan: _maxdnn.MaxDNNPlan, args: list, epilogue_args: list, name: str) -> relax.Var:
        """The maxDNN kernel of `plan` on CHWN data and laid-out weights (`args`): its CHWN result."""
        if plan.splits == 1:
            return self._call(_maxdnn.maxdnn_conv2d_func(plan, symbol=name), name, args + epilogue_args, plan.y_shape)
        # split-K: the slices' partial sums, then their sum with the epilogue
        sliced = name + f"_split{plan.splits}"
        func = _maxdnn.maxdnn_conv2d_func(plan, symbol=sliced)
        partial = self._call(func, sliced, args, plan.shapes()["partial"])
        reduce = _maxdnn.split_reduce_func(plan, symbol=name + _maxdnn.REDUCE_SUFFIX)
        return self._call(reduce, name + _maxdnn.REDUCE_SUFFIX, [partial] + epilogue_args, plan.y_shape)

    def _permuted(self, expr: relax.Expr, axes: tuple[int, ...], kernel: str) -> relax.Var:
        """permute_dims(`expr`, `axes`) (axes of its NCHW view) in one pass, from the CHWN tensor
        behind it where one of our kernels made it."""
        known = self.produced_chwn(expr)
        if known is not None:  # CHWN axis of each NCHW one: N=3, C=0, H=1, W=2
            expr, axes = known, tuple(_memory_bound.NCHW_TO_CHWN.index(a) for a in axes)
        shape = _shape(expr)
        out = tuple(shape[a] for a in axes)
        return self._call(_memory_bound.transpose_func(shape, axes, kernel), _name(kernel, shape, axes), [expr], out)

    def conv2d_backward_weight(self, call: relax.Call, decision: Decision) -> relax.Expr:
        """dW = conv2d(x, dY) in the weight gradient's layouts (:data:`~.decide.WEIGHT_GRADIENT_LAYOUTS`)
        on the maxDNN tile, as the forward convolution those layouts describe
        (:func:`~tvm_ext.transform.gradients.weight_gradient_as_conv2d`): its CHWN data is x as
        NHWC, its weights dY as (OH, OW, N, K) (RSC order) or (N, OH, OW, K),
        and its CHWN output (K, KH, KW, C) is dW transposed to OIHW. Each is one transpose (dY's
        and x's from the CHWN tensor our kernels wrote, where they did): the kernel reduces over
        images x dY's pixels with split-K where its grid is small."""
        plan = _cuda_plan(decision)
        if not isinstance(plan, _maxdnn.MaxDNNPlan):
            raise UnsupportedError(f"{decision.op} {decision.shapes}: the weight gradient runs on the direct tile")
        wl = plan.wl  # images: x's channels; channels: x's images; filters: dY's channels
        x, dy = call.args
        data = self._permuted(x, (0, 2, 3, 1), "weight_gradient_data")
        weight = self._permuted(dy, (2, 3, 0, 1) if plan.k_order == "rsc" else (0, 2, 3, 1), "weight_gradient_dy")
        weight = self.bb.emit(relax.op.reshape(weight, (1, wl.C * wl.KH * wl.KW, wl.K)))
        if plan.tile.wgmma is not None:
            weight = self._pack_wgmma_weight(weight, plan)
        name = _name("maxdnn_conv2d_backward_weight", (wl.C, wl.N, wl.H, wl.W), (wl.K, wl.KH, wl.KW),
                     f"s{wl.stride[0]}x{wl.stride[1]}_p{'x'.join(map(str, wl.padding))}"
                     f"_d{wl.dilation[0]}x{wl.dilation[1]}")
        dw_t = self._maxdnn(plan, [data, weight], [], name)  # (K, KH, KW, C): dW's O, H, W, I
        shape, axes = _shape(dw_t), (0, 3, 1, 2)
        return self._call(_memory_bound.transpose_func(shape, axes, "weight_gradient_out"),
                          _name("weight_gradient_out", shape), [dw_t], tuple(shape[a] for a in axes))

    def _winograd_conv2d(self, plan: _winograd.WinogradPlan, weight: relax.Constant, data: relax.Expr,
                         epilogue_args: list, name: str) -> relax.Expr:
        """The three calls of a Winograd convolution: input transform, the a² GEMMs (on weights
        transformed here, at build time), output transform with the epilogue."""
        shapes = plan.shapes()
        v = self._call(_winograd.input_transform_func(plan, name + "_input"), name + "_input", [self.chwn(data)],
                       shapes["v"])
        u = relax.const(_winograd.transform_weight(plan, weight.value.numpy()))
        mm = self._call(_maxdnn.maxdnn_conv2d_func(plan.gemm, name + "_gemm"), name + "_gemm", [v, u], shapes["mm"])
        out = _winograd.output_transform_func(plan, name + "_output")
        return self.nchw(self._call(out, name + "_output", [mm, *epilogue_args], plan.y_shape))

    def batch_norm_training(self, call: relax.Call, residual: relax.Expr | None = None,
                            relu: bool = False) -> relax.Expr:
        """A batch norm with batch statistics in CHWN: (y, the new running mean, the new running
        variance) as TVM's batch_norm computes them, y and the statistics by one kernel
        (:func:`~tvm_ext.kernels.cuda.batch_norm.batch_norm_forward_chwn_func`). With a `residual`
        or `relu` (a fused composite, whose running statistics nobody reads): relu(y + residual)."""
        data, gamma, beta = call.args[:3]
        attrs = call.attrs
        x = self.chwn(data)
        norm = _batch_norm.BatchNorm(_shape(x), float(attrs.epsilon), bool(attrs.scale), bool(attrs.center),
                                     residual=residual is not None, relu=relu, layout="CHWN")
        args = [x, *([gamma] if norm.scale else []), *([beta] if norm.center else []),
                *([self.chwn(residual)] if residual is not None else [])]
        y, mean, var = self._calls(_cuda_batch_norm.batch_norm_forward_chwn_func(norm),
                                   _name("batch_norm_chwn", norm.tag()), args,
                                   [norm.shape, (norm.channels,), (norm.channels,)])
        self._batch_statistics[x] = self._batch_statistics[data] = (mean, var)
        if residual is not None or relu:
            return self.nchw(y)
        return relax.Tuple([self.bb.emit(self.nchw(y)), *running_statistics(call, mean, var)])

    def _statistics_of(self, x: relax.Expr, epsilon: float) -> tuple[relax.Var, relax.Var]:
        """The batch mean and variance of CHWN `x`: those its forward kernel computed, else one
        statistics-only kernel's."""
        statistics = self._batch_statistics.get(x)
        if statistics is None:
            norm = _batch_norm.BatchNorm(_shape(x), epsilon, scale=False, center=False, layout="CHWN")
            mean, var = self._calls(_cuda_batch_norm.batch_norm_forward_chwn_func(norm, normalize=False),
                                    _name("batch_statistics_chwn", norm.tag()), [x],
                                    [(norm.channels,), (norm.channels,)])
            statistics = self._batch_statistics[x] = (mean, var)
        return statistics

    def batch_norm_statistics(self, call: relax.Call) -> relax.Expr:
        """The new running statistics alone (:func:`.base.statistics_only_batch_norm`)."""
        return statistics_only_batch_norm(call, self._batch_statistics, lambda: self._statistics_of(
            self.chwn(call.args[0]), float(call.attrs.epsilon)))

    def batch_norm_backward(self, found: BatchNormGradient) -> tuple[relax.Expr, relax.Var, relax.Var]:
        """(dX, dgamma, dbeta) of a training-mode batch norm's gradient in CHWN, one kernel
        (:func:`~tvm_ext.kernels.cuda.batch_norm.batch_norm_backward_chwn_func`), from the
        statistics the forward kernel computed for the same x (computed again where it did not run)."""
        x = self.chwn(found.x)
        shape = _shape(x)
        statistics = self._statistics_of(x, found.epsilon)
        norm = _batch_norm.BatchNorm(shape, found.epsilon, scale=found.gamma is not None, layout="CHWN")
        args = [x, self.chwn(found.dy), *statistics, *([found.gamma] if found.gamma is not None else [])]
        dx, dgamma, dbeta = self._calls(_cuda_batch_norm.batch_norm_backward_chwn_func(norm),
                                        _name("batch_norm_backward_chwn", norm.tag()), args,
                                        [shape, (norm.channels,), (norm.channels,)])
        return self.bb.emit(self.nchw(dx)), dgamma, dbeta

    def interleaved_phases(self, call: relax.Call) -> relax.Expr | None:
        """A strided convolution's dX as :mod:`~tvm_ext.transform.gradients` writes it (its stride
        phases stacked, reshaped and cropped: :func:`~tvm_ext.transform.gradients.read_phase_interleave`)
        as one CHWN kernel reading the phases' convolutions as they wrote them
        (:func:`~tvm_ext.kernels.cuda.memory_bound.interleave_phases_chwn_func`); None otherwise."""
        found = read_phase_interleave(call, functools.partial(bound_value, self.bb))
        if found is None:
            return None
        phases = [None if part is None else self.produced_chwn(part) for part in found.parts]
        if any(part is not None and phase is None for part, phase in zip(found.parts, phases, strict=True)):
            return None
        n, c, h, w = _shape(call)
        shapes = [None if phase is None else _shape(phase) for phase in phases]
        tag = "_".join("0" if shape is None else f"{shape[1]}x{shape[2]}" for shape in shapes)
        name = _name("interleave_phases_chwn", (c, h, w, n), f"s{found.stride[0]}x{found.stride[1]}", tag)
        func = _memory_bound.interleave_phases_chwn_func((c, h, w, n), found.stride, shapes)
        return self.nchw(self._call(func, name, [phase for phase in phases if phase is not None], (c, h, w, n)))

    def pool2d_backward(self, call: relax.Call, relu_mask: bool = False) -> relax.Expr:
        """{max,avg}_pool2d_backward(dY, x) in CHWN, reading dY and x as our kernels wrote them
        (:func:`~tvm_ext.kernels.cuda.memory_bound.pool2d_backward_chwn_func`); `relu_mask`
        (max pooling): relu's gradient of x too."""
        wl = pool2d_backward_workload(call)
        dy, x = call.args[:2]
        args = [self.chwn(dy)] + ([self.chwn(x)] if wl.mode == "max" else [])
        out = (wl.C, wl.H, wl.W, wl.N)
        name = _name(f"{wl.mode}_pool2d_backward", out, pool_tag(wl)) + ("_relu_mask" if relu_mask else "")
        func = _memory_bound.pool2d_backward_chwn_func(wl, relu_mask)
        return self.nchw(self._call(func, name, args, out))

    def other_op(self, call: relax.Call, decision: Decision) -> relax.Expr:
        if decision.kernel in ("max_pool2d_backward", "avg_pool2d_backward"):
            return self.pool2d_backward(call)
        if decision.kernel == "batch_norm_training":
            return self.batch_norm_training(call)
        data = call.args[0]
        if decision.kernel in ("global_avg_pool2d", "max_pool2d", "avg_pool2d"):
            source = self.chwn(data)
            shape = _shape(source)
            if decision.kernel == "global_avg_pool2d":
                func, out = _memory_bound.global_avg_pool2d_chwn_func(shape), (shape[0], 1, 1, shape[3])
            else:
                wl = pool_workload(call, _shape(data))
                func, out = _memory_bound.pool2d_chwn_func(wl), (wl.C, wl.OH, wl.OW, wl.N)
            result = self.nchw(self._call(func, _name(decision.kernel, shape, out), [source], out))
            if call.op.name == "relax.mean":  # mean over H, W: a global pool without the unit axes
                return relax.op.reshape(self.bb.emit(result), _shape(call))
            return result
        chwn = self.produced_chwn(data)  # an activation works in any layout: stay in the producer's
        source = chwn if chwn is not None else data
        shape = _shape(source)
        kernel = decision.chosen_kernel
        func = _memory_bound.activation_func(kernel, shape, alpha(call))
        out = self._call(func, _name(kernel, shape), [source], shape)
        return self.nchw(out) if chwn is not None else out
