"""The CPU emitter: tvm_ext's LLVM kernels as Relax calls, activations kept in the blocked
NCHW[x]c layout between them (the layout changes only at the graph's edges and around
fallbacks). Constant weights are packed here, at build time."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np
import tvm
from tvm import relax

from ..errors import UnsupportedError
from ..intrin.cpu import DOT_TYPES
from ..kernels import batch_norm as _batch_norm
from ..kernels import channel_affine as _affine
from ..kernels import conv2d as _conv
from ..kernels import conv2d_backward_data as _data_grad
from ..kernels import conv2d_backward_weight as _weight_grad
from ..kernels import conv2d_maxdnn as _maxdnn
from ..kernels import elementwise as _elementwise
from ..kernels import layer_norm as _layer_norm
from ..kernels import layout as _layout
from ..kernels import maxdnn_layout as _maxdnn_layout
from ..kernels import pool2d as _pool
from ..kernels import pool2d_backward as _pool_backward
from ..kernels import winograd as _winograd
from ..kernels.batch_loop import batch_loop
from ..kernels.conv2d import Epilogue
from ..kernels.conv2d_maxdnn import MaxDNNCpuPlan
from ..relax_info import image_shape, known_shape, static_shape, symbolic_batch
from ..target import vector_isa
from ..transform.gradients import BatchNormGradient, read_phase_interleave, read_phase_weight
from ..tuning import maxdnn_space as _maxdnn_space
from ..tuning import pool_space as _pool_space
from ..tuning.records import conv2d_kernel, tuned_kernel
from .base import (
    POOLS,
    Activation,
    Decision,
    add_kernel,
    alpha,
    bound_value,
    channel_scale_operands,
    emit_kernel_outputs,
    pool_tag,
    pool_workload,
    running_statistics,
    statistics_only_batch_norm,
    tuple_field,
)
from .cpu_engine import tile_out_block
from .decide import pool2d_backward_workload
from .fusion import mask_of

__all__ = ["CpuEmitter"]


def _workload_tag(wl: _conv.Conv2dWorkload) -> str:
    return (f"{wl.N}x{wl.C}x{wl.H}x{wl.W}_{wl.K}x{wl.KH}x{wl.KW}_s{wl.stride[0]}x{wl.stride[1]}"
            f"_p{'x'.join(map(str, wl.padding))}_d{wl.dilation[0]}x{wl.dilation[1]}_g{wl.groups}")


def _tag(plan: _conv.Conv2dPlan | _weight_grad.WeightGradPlan | MaxDNNCpuPlan) -> str:
    """A readable, deterministic name part that tells convolution shapes and blockings apart."""
    if isinstance(plan, MaxDNNCpuPlan):
        return f"{_workload_tag(plan.wl)}_r{plan.rows}c{plan.cols}k{plan.k_step}"
    data_bn = getattr(plan, "data_bn", 0)
    return (f"{_workload_tag(plan.wl)}_x{plan.ic_bn}y{plan.oc_bn}{f'_in{data_bn}' if data_bn else ''}"
            f"{'_nchw' if getattr(plan, 'nchw_in', False) else ''}")


def _cpu_plan(decision: Decision) -> _conv.Conv2dPlan:
    """The CPU plan of a convolution `decision` (:func:`~.decide.decide` on an LLVM target)."""
    plan = decision.conv_plan
    if not isinstance(plan, _conv.Conv2dPlan):
        raise UnsupportedError(f"{decision.op} {decision.shapes}: a {type(plan).__name__} is not a CPU plan")
    return plan


_UNPACK = "tvm_ext_unpack_nchwc"


def _pack_constant_weight(plan: _conv.Conv2dPlan, weight: np.ndarray) -> tvm.runtime.Tensor:
    """OIHW `weight` in `plan`'s blocked layout, packed now (at build time, in NumPy)."""
    return tvm.runtime.tensor(_conv.pack_weight_array(plan, weight))


class CpuEmitter:
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
        # padded blocked copies made (pad_nchwc), by (blocked tensor, border): a training graph's
        # forward convolution and its weight gradient read one
        self._padded: dict[tuple[relax.Var, tuple[int, ...]], relax.Var] = {}
        # blocked tensors rounded to bf16 (a bf16 convolution's input): one rounding for all the
        # convolutions that read a tensor (a stage's input: its first 1x1 and the strided shortcut)
        self._rounded: dict[relax.Var, relax.Var] = {}
        # interleaved stride phases (blocked output -> the phases' operands), for a mask after them
        self._interleaved: dict[relax.Var, tuple] = {}
        # a training-mode batch norm's statistics (blocked x -> mean, var), for its gradient
        self._batch_statistics: dict[relax.Var, tuple[relax.Var, relax.Var]] = {}

    def blocked(self, expr: relax.Expr, padded: bool = False) -> tuple[relax.Expr, int] | None:
        """(the blocked tensor, its channel block) behind an NCHW view, if there is one.

        `padded`: also one whose last block is filled up with channels past the view's (a
        convolution of 72 channels in blocks of 16 writes 80; those 8 hold finite values,
        zeros from a convolution). Only consumers that ignore them ask: a convolution (zero
        weights for them), pooling and activations (one channel at a time)."""
        expr = tuple_field(self.bb, expr)
        if not isinstance(expr, relax.Var):
            return None
        value = self.bb.lookup_binding(expr)
        if not (isinstance(value, relax.Call) and value.op == tvm.ir.Op.get("relax.call_tir")
                and value.args[0].name_hint.startswith(_UNPACK)):
            return None
        blocked = value.args[1].fields[0]
        _, blocks, _, _, block = known_shape(image_shape(blocked), "unpack_nchwc: the blocked tensor")
        channels = known_shape(image_shape(expr), "unpack_nchwc: the NCHW view")[1]
        if channels != blocks * block and not (padded and (blocks - 1) * block < channels < blocks * block):
            return None
        return blocked, block

    def new_block(self) -> None:
        """Forget the copies made so far (their variables are out of scope in a new block)."""
        self._padded.clear()
        self._rounded.clear()
        self._batch_statistics.clear()

    def _call_tir(self, func: tvm.tirx.PrimFunc, name: str, args: list, shape: tuple) -> relax.Call:
        """The call of kernel `func`, which writes `shape`. With a symbolic batch, `func` and
        `shape` are one image's, and the kernel runs over the batch (:func:`batch_loop`): the
        arguments with a symbolic batch and the output are batched, the others (weights) not."""
        batched = [i for i, arg in enumerate(args) if symbolic_batch(arg) is not None]
        if batched:
            shape = (symbolic_batch(args[batched[0]]), *shape[1:])
            func, name = batch_loop(func, [*batched, len(args)]), name + "_batched"
        return relax.call_tir(add_kernel(self.bb, func, name), args, relax.TensorType(shape, "float32"))

    def _call(self, func: tvm.tirx.PrimFunc, name: str, args: list, shape: tuple) -> relax.Var:
        return self.bb.emit(self._call_tir(func, name, args, shape))

    def unpack(self, blocked: relax.Expr, channels: int) -> relax.Call:
        shape = known_shape(image_shape(blocked), "unpack_nchwc: the blocked tensor")
        n, _, h, w, _ = shape
        return self._call_tir(_layout.unpack_nchwc_func(shape, channels), f"{_UNPACK}_{'x'.join(map(str, shape))}",
                              [blocked], (n, channels, h, w))

    def pack(self, data: relax.Expr, block: int, padding=(0, 0, 0, 0), padded: bool = False) -> relax.Var:
        """`data` in blocks of `block` channels with a zero border, from its blocked form if it has
        one. `padded`: the last block may be filled up with channels past data's (zeros, where
        this packs it; see :meth:`blocked`)."""
        shape = image_shape(data)
        known = self.blocked(data, padded)
        pads = tuple(int(p) for p in padding)
        if known is not None and known[1] == block:
            if not any(pads):
                return known[0]
            if (known[0], pads) in self._padded:
                return self._padded[known[0], pads]
            bshape = known_shape(image_shape(known[0]), "pad_nchwc: the blocked tensor")
            n, cb, h, w, c = bshape
            padded_copy = self._call(_layout.pad_nchwc_func(bshape, pads),
                                     f"tvm_ext_pad_nchwc_{'x'.join(map(str, bshape))}", [known[0]],
                                     (n, cb, h + pads[0] + pads[2], w + pads[1] + pads[3], c))
            self._padded[known[0], pads] = padded_copy
            return padded_copy
        shape = known_shape(shape, "pack_nchwc: the NCHW tensor")
        n, c, h, w = shape
        if (h, w) == (1, 1) and not any(pads) and c % block == 0 and symbolic_batch(data) is None:
            return self.bb.emit(relax.op.reshape(data, (n, c // block, 1, 1, block)))  # the same memory: a view
        return self._call(_layout.pack_nchwc_func(shape, block, pads, pad_channels=padded),
                          f"tvm_ext_pack_nchwc_{'x'.join(map(str, shape))}_{block}",
                          [data], (n, -(-c // block), h + pads[0] + pads[2], w + pads[1] + pads[3], block))

    def _plan(self, plan: _conv.Conv2dPlan, data: relax.Expr) -> _conv.Conv2dPlan:
        """The plan re-blocked to read `data` in the blocks its producer wrote, when it can."""
        known = self.blocked(data)
        if known is None or plan.kind == "direct":
            return plan
        wl, block = plan.wl, known[1]
        if plan.kind == "depthwise":
            return _conv.plan_conv2d(wl, self.isa, n_r=block)
        if plan.kind == "grouped":  # its blocks must hold whole groups and whole vectors
            whole = block % (wl.C // wl.groups) == 0 and block % self.isa.lanes == 0
            return _conv.plan_conv2d(wl, self.isa, n_r=block) if whole else plan
        if (wl.C // wl.groups) % block:  # groups narrower than the blocks: read within them where it can
            wide = _conv.data_block_reason(wl, self.isa, block) is None and plan.kind == "brgemm"
            return _conv.plan_conv2d(wl, self.isa, data_bn=block) if wide else plan
        if plan.kind == "winograd":
            return _winograd.winograd_plan(wl, self.isa, ic_bn=block)
        if block % DOT_TYPES[wl.dtype].group:  # (bf16 pairs, int8 fours: a block of 5 splits one)
            return plan
        return _conv.plan_conv2d(wl, self.isa, ic_bn=block, engine=plan.engine)

    def _read_padded(self, plan: _conv.Conv2dPlan, data: relax.Expr, weight: np.ndarray,
                     bias: np.ndarray | None) -> tuple[_conv.Conv2dPlan, np.ndarray, np.ndarray | None] | None:
        """The convolution of `plan` re-planned to read `data`'s blocked form whose last block is
        padded (:meth:`blocked`): as a convolution of the padded channels whose weights for them
        are zeros (a depthwise one computes them too: zero weights and bias), with the padded
        weights and bias. None where `data` has no such form or the convolution is grouped."""
        known = self.blocked(data, padded=True)
        wl = plan.wl
        if known is None or plan.kind == "direct":
            return None
        block = known[1]
        channels = known_shape(image_shape(known[0]), "conv2d: the blocked data")[1] * block
        if channels == wl.C or (wl.groups != 1 and not wl.depthwise):
            return None
        k, kh, kw = (wl.C, wl.KH, wl.KW) if wl.depthwise else (wl.K, wl.KH, wl.KW)
        groups = channels if wl.depthwise else 1
        k_padded = channels if wl.depthwise else k
        padded_weight = np.zeros((k_padded, channels // groups, kh, kw), np.float32)
        padded_weight[:k, : wl.C // wl.groups] = weight
        if bias is not None and wl.depthwise:
            bias = np.concatenate([bias.reshape(-1), np.zeros(channels - wl.C, np.float32)])
        padded = _conv.Conv2dWorkload.make((wl.N, channels, wl.H, wl.W), padded_weight.shape, wl.stride, wl.padding,
                                           wl.dilation, groups)
        if wl.depthwise:
            return _conv.plan_conv2d(padded, self.isa, n_r=block), padded_weight, bias
        if plan.kind == "winograd" and not _winograd.eligible(padded):
            return _winograd.winograd_plan(padded, self.isa, ic_bn=block), padded_weight, bias
        return _conv.plan_conv2d(padded, self.isa, ic_bn=block), padded_weight, bias

    def conv2d(self, call: relax.Call, data: relax.Expr, decision: Decision,
               bias: np.ndarray | relax.Expr | None = None, residual: relax.Expr | None = None,
               activation: Activation | None = None, suffix: str = "", padded_out: bool = False,
               mask: tuple[relax.Expr, Activation] | None = None) -> relax.Expr:
        """conv2d (+ bias + residual -> activation [-> an activation's gradient, `mask`]): blocked
        in and out wherever the layouts allow.

        Constant weights and biases are packed here; weights that are parameters are packed by
        a kernel call at run time. With `padded_out` (its readers take padded blocks), an output
        whose channels do not fill the last block is written blocked, padded past K with zeros
        (the epilogue writes them), as ONNX Runtime's NCHWc layout does: MobileNet's 72 or 120
        channels then run in whole vectors, read by the next convolution as they are. Without,
        such an output is written in NCHW.
        """
        if isinstance(decision.plan, MaxDNNCpuPlan):
            if mask is None:
                return self._maxdnn_conv2d(decision.plan, call, data, bias, residual, activation, suffix)
            # (an activation gradient's mask: the blocked kernel applies it)
            decision = dataclasses.replace(decision, plan=_conv.plan_conv2d(decision.plan.wl, self.isa))
        plan = _cpu_plan(decision)
        channels = plan.wl.K  # the NCHW view's: a depthwise convolution reading padded blocks computes more
        weight = call.args[1]
        constant = weight.value.numpy() if isinstance(weight, tvm.ir.Constant) else None
        if plan.wl.dtype == "bfloat16":
            if mask is None and constant is not None:
                return self._bf16_conv2d(plan, data, constant, bias, residual, activation, suffix, padded_out)
            # (an activation gradient's mask: fp32; the data's own channel count, not the paired one)
            channels_in = known_shape(image_shape(data), "conv2d: the data")[1]
            plan = _conv.plan_conv2d(dataclasses.replace(plan.wl, C=channels_in, dtype="float32"), self.isa)
        constant_bias = bias is None or isinstance(bias, np.ndarray)
        padded = None if constant is None or not constant_bias else self._read_padded(plan, data, constant, bias)
        if padded is not None:
            plan, constant, bias = padded
        else:
            plan = self._plan(plan, data)
        if plan.kind == "winograd" and mask is not None:  # its output transform applies no mask
            plan = self._plan(_conv.plan_conv2d(plan.wl, self.isa), data)
        if plan.kind == "winograd" and constant is not None:
            return self._winograd_conv2d(plan, constant, data, bias, residual, activation, suffix, channels)
        if self.blocked(data, padded=True) is None:
            plan = _conv.reading_nchw(plan)  # no blocked form to reuse: read as it is, no packing copy
        wl = plan.wl
        blocked_out = plan.K_pad == wl.K or (padded_out and plan.kind != "direct")  # direct: no zeros past K
        tag = _tag(plan)
        args = [data if plan.nchw_in else self.pack(data, plan.in_bn, wl.padding, padded=True),
                relax.const(_pack_constant_weight(plan, constant)) if constant is not None
                else self._pack_weight(plan, weight, tag)]
        operands, epilogue = self._epilogue(plan, bias, residual, activation, blocked_out, mask)
        args += operands
        name = f"tvm_ext_{plan.kind}_conv2d_{tag}{suffix}"
        func = self.conv_kernel(plan, epilogue)
        if not blocked_out:
            return self._call_tir(func, name, args, wl.out_shape)
        return self.unpack(self._call(func, name, args, plan.out_shape()), channels)

    def _maxdnn_conv2d(self, plan: MaxDNNCpuPlan, call: relax.Call, data: relax.Expr,
                       bias: np.ndarray | relax.Expr | None, residual: relax.Expr | None,
                       activation: Activation | None, suffix: str) -> relax.Expr:
        """A convolution on the maxDNN tile: the data from its blocked form (or NCHW) into the
        tile's layout (one pass), the kernel, and back to blocks with the epilogue applied (one
        pass): :mod:`tvm_ext.kernels.maxdnn_layout`."""
        wl = plan.wl
        weight = call.args[1]
        if not isinstance(weight, tvm.ir.Constant):
            raise UnsupportedError(f"maxdnn conv2d {wl}: run-time weights (decide() gives the tile constant ones)")
        tag = _tag(plan)
        known = self.blocked(data, padded=True)
        source, block = (data, None) if known is None else known
        source_shape = known_shape(image_shape(source), "maxdnn conv2d: the data")
        x = self._call(_maxdnn_layout.tile_input_func(plan, source_shape, block),
                       f"tvm_ext_maxdnn_tile_input_{tag}_b{block or 0}", [source], plan.data_shape())
        w = relax.const(_maxdnn.pack_weight(plan, weight.value.numpy()))
        sums = self._call(self.maxdnn_kernel(plan), f"tvm_ext_maxdnn_conv2d_{tag}", [x, w],
                          plan.out_shape())
        out_block = tile_out_block(_conv.plan_conv2d(wl, self.isa))
        args = [sums]
        if isinstance(bias, np.ndarray):
            args.append(relax.const(np.ascontiguousarray(bias.reshape(-1), np.float32)))
        elif bias is not None:  # K values computed at run time
            args.append(self.bb.emit(bias))
        if residual is not None:
            args.append(self.pack(residual, out_block, padded=True))
        epilogue = _maxdnn.Epilogue(bias=bias is not None, residual=residual is not None,
                                               activation=None if activation is None else activation.name,
                                               alpha=0.01 if activation is None else activation.alpha)
        out_shape = (wl.N, wl.K // out_block, wl.OH, wl.OW, out_block)
        out = self._call(_maxdnn_layout.tile_output_func(plan, out_block, epilogue),
                         f"tvm_ext_maxdnn_tile_output_{tag}_y{out_block}{suffix}", args, out_shape)
        return self.unpack(out, wl.K)

    def _bf16_conv2d(self, plan: _conv.Conv2dPlan, data: relax.Expr, weight: np.ndarray,
                     bias: np.ndarray | relax.Expr | None, residual: relax.Expr | None,
                     activation: Activation | None, suffix: str, padded_out: bool) -> relax.Expr:
        """A bfloat16 convolution (AMX, vdpbf16ps or emulated on FMA; `precision="bf16"`): the data
        packed in blocks as for fp32, then rounded to bf16 (one pass; emulated, kept in fp32), the
        weights rounded and packed here; the kernel accumulates and writes fp32 with the same
        epilogue, so its readers are unchanged."""
        if plan.engine != "amx":  # read the producer's blocks (32 channels: 16 pairs), not a re-blocked copy
            plan = self._plan(plan, data)
        wl = plan.wl
        if weight.shape[1] < wl.C:  # the zero channel that pairs an odd count (the pack adds the data's)
            weight = np.concatenate([weight, np.zeros((wl.K, wl.C - weight.shape[1], wl.KH, wl.KW), weight.dtype)], 1)
        blocked_out = plan.K_pad == wl.K or padded_out
        packed = self.pack(data, plan.in_bn, wl.padding, padded=True)
        rounded = self._rounded.get(packed)
        if rounded is None and plan.engine == "emulated":  # bf16 values in fp32
            shape = known_shape(image_shape(packed), "conv2d: the blocked data")
            rounded = self._call(_elementwise.bf16_round_func(shape, self.isa.lanes),
                                 f"tvm_ext_bf16_round_{'x'.join(map(str, shape))}", [packed], shape)
        elif rounded is None:
            rounded = self.bb.emit(relax.op.astype(packed, "bfloat16"))
        self._rounded[packed] = rounded
        args = [rounded, relax.const(_conv.pack_weight_array(plan, weight))]
        operands, epilogue = self._epilogue(plan, bias, residual, activation, blocked_out, None)
        name = f"tvm_ext_{plan.kind}_conv2d_{_tag(plan)}_bf16_{plan.engine}{suffix}"
        func = self.conv_kernel(plan, epilogue)
        if not blocked_out:
            return self._call_tir(func, name, args + operands, wl.out_shape)
        return self.unpack(self._call(func, name, args + operands, plan.out_shape()), wl.K)

    def _pack_weight(self, plan: _conv.Conv2dPlan, weight: relax.Expr, tag: str) -> relax.Var:
        """Run-time weights in `plan`'s blocks; a data gradient's phase weights
        (:func:`~tvm_ext.transform.gradients.read_phase_weight`) straight from the forward's."""
        phase = read_phase_weight(weight, self._value_of)
        if phase is not None and plan.wl.groups == 1 and plan.kind not in ("depthwise", "grouped"):
            w, taps_h, taps_w = phase
            w_shape = known_shape(static_shape(w), "pack_phase_weight: the weights")
            func = _data_grad.pack_phase_weight_func(plan, w_shape, taps_h, taps_w)
            taps = "x".join(map(str, taps_h)) + "_" + "x".join(map(str, taps_w))
            return self._call(func, f"tvm_ext_pack_phase_weight_{tag}_t{taps}", [w], plan.weight_shape())
        return self._call(_conv.pack_weight_func(plan), f"tvm_ext_pack_weight_{tag}", [weight], plan.weight_shape())

    def conv2d_backward_weight(self, call: relax.Call, decision: Decision,
                               bias: bool = False) -> relax.Expr | tuple[relax.Expr, relax.Expr]:
        """The weight gradient conv2d(x, dY) (:data:`~.decide.WEIGHT_GRADIENT_LAYOUTS`): x and dY in
        blocks (from their blocked forms where the graph has them), the X^T dY kernel writing dW
        in the forward's blocked weight layout, unpacked to OIHW. With `bias`, (dW, dB): the
        kernel also sums dY over images and pixels (dB, K values) while it reads it."""
        plan = decision.conv_plan
        if not isinstance(plan, _weight_grad.WeightGradPlan):
            raise UnsupportedError(f"{decision.op} {decision.shapes}: a {type(plan).__name__} is not a weight gradient")
        x, dy = call.args
        x, plan = self._uncropped(x, dataclasses.replace(plan, bias=bias))
        known_x, known_dy = self.blocked(x), self.blocked(dy, padded=True)
        if known_x is not None or known_dy is not None:  # read as the graph's kernels wrote them, if a tile fits
            with contextlib.suppress(ValueError):
                plan = _weight_grad.plan_conv2d_backward_weight(
                    plan.wl, self.isa, bias, ic_bn=known_x[1] if known_x else plan.ic_bn,
                    oc_bn=known_dy[1] if known_dy else plan.oc_bn)
        plan = self._in_forward_copy(x, plan)
        wl, tag = plan.wl, _tag(plan)
        args = [self.pack(x, plan.ic_bn, wl.padding, padded=True), self.pack(dy, plan.oc_bn, padded=True)]
        kernel = add_kernel(self.bb, _weight_grad.conv2d_backward_weight_kernel(plan, self.isa.lanes),
                            f"tvm_ext_conv2d_backward_weight_{tag}{'_bias' if bias else ''}")
        outputs = [relax.TensorType(plan.weight_shape(), "float32")]
        if bias:
            outputs.append(relax.TensorType((plan.OCB, plan.oc_bn), "float32"))
        results = self.bb.emit(relax.call_tir(kernel, args, outputs if bias else outputs[0]))
        blocked = self.bb.emit(relax.TupleGetItem(results, 0)) if bias else results
        dw = self._call_tir(_weight_grad.unpack_weight_func(plan), f"tvm_ext_unpack_weight_{tag}", [blocked],
                            (wl.K, wl.C, wl.KH, wl.KW))
        if not bias:
            return dw
        db = self.bb.emit(relax.op.reshape(relax.TupleGetItem(results, 1), (plan.OCB * plan.oc_bn,)))
        if plan.OCB * plan.oc_bn != wl.K:
            db = self.bb.emit(relax.op.strided_slice(db, axes=[0], begin=[0], end=[wl.K]))
        return dw, db

    def _in_forward_copy(self, x: relax.Expr,
                         plan: _weight_grad.WeightGradPlan) -> _weight_grad.WeightGradPlan:
        """The plan over a padded copy of x the forward pass already made, if one has the same top
        and left border and at least the bottom and right: a strided convolution's gradient needs
        no bottom or right border (no tap reads it), and its own copy would keep x alive in the
        backward pass. The output size decides that the taps read nothing more."""
        known = self.blocked(x, padded=True)
        if known is None or known[1] != plan.ic_bn:
            return plan
        top, left, bottom, right = plan.wl.padding
        for source, pads in self._padded:
            if (source.same_as(known[0]) and pads[:2] == (top, left) and pads[2] >= bottom and pads[3] >= right
                    and pads != tuple(plan.wl.padding)):
                wl = dataclasses.replace(plan.wl, padding=pads)
                if (wl.OH, wl.OW) == (plan.wl.OH, plan.wl.OW):
                    return dataclasses.replace(plan, wl=wl)
        return plan

    def _uncropped(self, x: relax.Expr,
                   plan: _weight_grad.WeightGradPlan) -> tuple[relax.Expr, _weight_grad.WeightGradPlan]:
        """x as it was before the gradient cropped the rows and columns no tap reads
        (:func:`~tvm_ext.transform.gradients.weight_gradient_input`), and the plan over it: the
        kernel reads only the taps' pixels, and the whole x is the tensor the forward kept in
        blocks (a strided convolution's x otherwise stays alive in NCHW for the crop)."""
        value = self.bb.lookup_binding(x) if isinstance(x, relax.Var) else None
        if value is None or not isinstance(value, relax.Call):
            return x, plan
        if value.op != tvm.ir.Op.get("relax.strided_slice") or len(value.args) != 4:
            return x, plan  # (a fifth argument: strides, not a crop)
        source = value.args[0]
        shape = image_shape(source)
        axes, begin = ([int(field.value) for field in arg.fields] for arg in value.args[1:3])
        if sorted(axes) != [2, 3] or any(begin) or shape is None or not all(isinstance(d, int) for d in shape):
            return x, plan
        wl = dataclasses.replace(plan.wl, H=shape[2], W=shape[3])
        # the reads stay inside the crop only if no border padding follows it
        grown_border = (wl.H > plan.wl.H and wl.padding[2]) or (wl.W > plan.wl.W and wl.padding[3])
        if grown_border or (wl.OH, wl.OW) != (plan.wl.OH, plan.wl.OW):
            return x, plan
        return source, dataclasses.replace(plan, wl=wl)

    def _winograd_conv2d(self, plan: _conv.Conv2dPlan, weight: np.ndarray, data: relax.Expr,
                         bias: np.ndarray | relax.Expr | None, residual: relax.Expr | None,
                         activation: Activation | None, suffix: str, channels: int) -> relax.Expr:
        """The three calls of a Winograd convolution: input transform, the a² GEMMs (the BRGEMM
        kernel, with the weights transformed and packed here), output transform + epilogue."""
        gemm, tag = _winograd.gemm_plan(plan, self.isa), _tag(plan)
        tiles = self._call(_winograd.input_transform_func(plan), f"tvm_ext_winograd_input_{tag}",
                           [self.pack(data, plan.ic_bn, _winograd.input_padding(plan), padded=True)], gemm.data_shape())
        weight = _pack_constant_weight(gemm, _winograd.transform_weight(plan, weight))
        products = self._call(self.conv_kernel(gemm, Epilogue()), f"tvm_ext_brgemm_conv2d_{_tag(gemm)}",
                              [tiles, relax.const(weight)], gemm.out_shape())
        operands, epilogue = self._epilogue(plan, bias, residual, activation)
        out = self._call(self.conv_kernel(plan, epilogue), f"tvm_ext_winograd_conv2d_{tag}{suffix}",
                         [products, *operands], plan.out_shape())
        return self.unpack(out, channels)

    def _epilogue(self, plan: _conv.Conv2dPlan, bias: np.ndarray | relax.Expr | None,
                  residual: relax.Expr | None, activation: Activation | None,
                  blocked_out: bool = True, mask: tuple[relax.Expr, Activation] | None = None) -> tuple[list, Epilogue]:
        """A convolution epilogue's operands (the bias in blocks, zero past K; the shortcut and
        the mask in the output's layout) and its description."""
        operands = []
        if isinstance(bias, np.ndarray):
            blocked = np.zeros(plan.K_pad, np.float32)
            blocked[: plan.wl.K] = bias.reshape(-1)
            operands.append(relax.const(blocked.reshape(plan.OCB, plan.oc_bn)))
        elif bias is not None:  # K values computed at run time
            if plan.K_pad != plan.wl.K:
                bias = relax.op.nn.pad(bias, [0, plan.K_pad - plan.wl.K])
            operands.append(self.bb.emit(relax.op.reshape(bias, (plan.OCB, plan.oc_bn))))
        for tensor in (residual, None if mask is None else mask[0]):
            if tensor is not None:
                operands.append(self.pack(tensor, plan.oc_bn, padded=True) if blocked_out else tensor)
        if activation is not None and mask is not None and activation.alpha != mask[1].alpha:
            raise UnsupportedError(f"conv2d epilogue: one slope, not {activation.alpha} and {mask[1].alpha}")
        alpha = activation.alpha if activation is not None else mask[1].alpha if mask is not None else 0.01
        return operands, Epilogue(bias=bias is not None, residual=residual is not None,
                                  activation=None if activation is None else activation.name,
                                  nchw_out=not blocked_out, alpha=alpha, mask=None if mask is None else mask[1].name)

    def conv_kernel(self, plan: _conv.Conv2dPlan, epilogue: Epilogue) -> tvm.tirx.PrimFunc:
        """The tuned schedule of this convolution if the database has one, else the analytic one."""
        return conv2d_kernel(plan, epilogue, self.isa, self.target, self.database)

    def maxdnn_kernel(self, plan: MaxDNNCpuPlan) -> tvm.tirx.PrimFunc:
        """The tuned blocking of this convolution on the maxDNN tile if the database has one, else
        the plan's."""
        if self.database is not None:
            tuned = tuned_kernel(self.database, _maxdnn_space.maxdnn_workload(plan), self.target)
            if tuned is not None:
                return tuned
        return _maxdnn_space.default_maxdnn_kernel(plan)

    def pool_kernel(self, wl: _pool.Pool2dWorkload, block: int | None) -> tvm.tirx.PrimFunc:
        """The tuned schedule of this pooling if the database has one, else the analytic one."""
        if self.database is not None:
            tuned = tuned_kernel(self.database, _pool_space.pool2d_workload(wl, block), self.target)
            if tuned is not None:
                return tuned
        return _pool_space.default_pool_kernel(wl, block)

    def _channel_scale(self, data: relax.Expr, scale: relax.Expr) -> relax.Expr:
        """data * scale, scale (N, C, 1, 1): in data's blocked layout where it has one."""
        known = self.blocked(data, padded=True)  # padded channels: scaled by the last channel's gate
        source = data if known is None else known[0]
        shape = known_shape(image_shape(source), "channel_scale: the data")
        channels = known_shape(image_shape(data), "channel_scale: the data")[1]
        func = _elementwise.channel_scale_func(shape, self.isa.lanes, channels)
        out = self._call(func, f"tvm_ext_channel_scale_{'x'.join(map(str, shape))}_{channels}", [source, scale], shape)
        return out if known is None else self.unpack(out, channels)

    def fake_quantize(self, data: relax.Expr, scale: float, zero_point: int, dtype: str, out_scale: float,
                      out_zero_point: int) -> relax.Expr:
        """dequantize(quantize(data)) in one pass (:func:`~tvm_ext.kernels.elementwise.fake_quantize_func`),
        on data's blocks where it has them (element by element: padded channels stay finite)."""
        known = self.blocked(data, padded=True)
        source = data if known is None else known[0]
        shape = known_shape(static_shape(source), "fake_quantize: the data")
        func = _elementwise.fake_quantize_func(shape, self.isa.lanes, scale, zero_point, dtype, out_scale,
                                               out_zero_point)
        out = self._call(func, f"tvm_ext_fake_quantize_{'x'.join(map(str, shape))}", [source], shape)
        return out if known is None else self.unpack(out, known_shape(image_shape(data), "fake_quantize: the data")[1])

    def channel_affine(self, inputs: list[relax.Expr], scale: np.ndarray | None = None,
                       shift: np.ndarray | None = None, activation: Activation | None = None) -> relax.Expr:
        """act(concat(inputs) * scale + shift) over channels (scale, shift: one value per channel
        or one for all; each part optional) in one blocked pass
        (:mod:`tvm_ext.kernels.channel_affine`). Inputs are read in the blocks their producers
        wrote; those without a blocked form are packed first. If none has one, all are read and
        the output written in NCHW (blocks of one channel: views, no copies)."""
        shapes = [known_shape(image_shape(x), "channel_affine: an input") for x in inputs]
        channels = [shape[1] for shape in shapes]
        n, _, h, w = shapes[0]
        known = [self.blocked(x) for x in inputs]
        planar = all(k is None for k in known)
        out_block = 1 if planar else _affine.choose_out_block(channels, [k[1] for k in known if k is not None],
                                                              self.isa.lanes)
        sources = []
        for x, k, c in zip(inputs, known, channels, strict=True):
            if planar:
                sources.append((self.bb.emit(relax.op.expand_dims(x, [4])), 1))
            else:
                sources.append(k if k is not None else (self.pack(x, math.gcd(c, out_block)), math.gcd(c, out_block)))
        total = sum(channels)
        affine = _affine.ChannelAffine(tuple((c, block) for c, (_, block) in zip(channels, sources, strict=True)),
                                       (n, h, w), out_block, scale is not None, shift is not None,
                                       None if activation is None else activation.name,
                                       0.01 if activation is None else activation.alpha)
        args = [source for source, _ in sources]
        args += [relax.const(np.broadcast_to(v.reshape(-1), (total,)).astype(np.float32))
                 for v in (scale, shift) if v is not None]
        func = _affine.channel_affine_func(affine, self.isa.lanes)
        out = self._call(func, f"tvm_ext_channel_affine_{affine.tag()}", args, affine.out_shape())
        return relax.op.squeeze(out, [4]) if planar else self.unpack(out, total)

    def _layer_norm(self, call: relax.Call) -> relax.Expr:
        """A layer norm over the channels of an NCHW tensor, on its blocked form (packed first
        where it has none): :mod:`tvm_ext.kernels.layer_norm`."""
        data, gamma, beta = call.args[:3]
        channels = known_shape(image_shape(data), "layer_norm: the data")[1]
        known = self.blocked(data)
        if known is None:
            block = _affine.choose_out_block([channels], [], self.isa.lanes)
            known = (self.pack(data, block), block)
        attrs = call.attrs
        norm = _layer_norm.LayerNorm(known_shape(image_shape(known[0]), "layer_norm: the blocked data"),
                                     float(attrs.epsilon), bool(attrs.scale), bool(attrs.center))
        args = [known[0], *([gamma] if norm.scale else []), *([beta] if norm.center else [])]
        out = self._call(_layer_norm.layer_norm_func(norm), f"tvm_ext_layer_norm_{norm.tag()}", args, norm.shape)
        return self.unpack(out, channels)

    def _batch_norm_input(self, data: relax.Expr) -> tuple[relax.Expr, int]:
        """x of a batch norm in blocks: its producer's (unpadded), else packed."""
        known = self.blocked(data)
        if known is None:
            channels = known_shape(image_shape(data), "batch_norm: the data")[1]
            block = _affine.choose_out_block([channels], [], self.isa.lanes)
            known = (self.pack(data, block), block)
        return known

    def _calls(self, func: tvm.tirx.PrimFunc, name: str, args: list, shapes: list[tuple]) -> list[relax.Var]:
        return emit_kernel_outputs(self.bb, func, name, args, shapes)

    def batch_norm_training(self, call: relax.Call, residual: relax.Expr | None = None,
                            relu: bool = False) -> relax.Expr:
        """A batch norm with batch statistics: (y, the new running mean, the new running variance)
        as TVM's batch_norm computes them, y and the statistics by one blocked kernel
        (:func:`~tvm_ext.kernels.batch_norm.batch_norm_forward_func`). With a `residual` or
        `relu` (a fused composite, whose running statistics nobody reads): relu(y + residual) alone."""
        data, gamma, beta = call.args[:3]
        attrs = call.attrs
        channels = known_shape(image_shape(data), "batch_norm: the data")[1]
        x, block = self._batch_norm_input(data)
        norm = _batch_norm.BatchNorm(known_shape(image_shape(x), "batch_norm: the blocked data"),
                                     float(attrs.epsilon), bool(attrs.scale), bool(attrs.center),
                                     residual=residual is not None, relu=relu)
        args = [x, *([gamma] if norm.scale else []), *([beta] if norm.center else []),
                *([self.pack(residual, block)] if residual is not None else [])]
        y, mean, var = self._calls(_batch_norm.batch_norm_forward_func(norm), f"tvm_ext_batch_norm_{norm.tag()}",
                                   args, [norm.shape, (channels,), (channels,)])
        self._batch_statistics[x] = self._batch_statistics[data] = (mean, var)
        if residual is not None or relu:
            return self.unpack(y, channels)
        return relax.Tuple([self.unpack(y, channels), *running_statistics(call, mean, var)])

    def _statistics_of(self, x: relax.Expr, channels: int, epsilon: float) -> tuple[relax.Var, relax.Var]:
        """The batch mean and variance of blocked `x`: those its forward kernel computed, else
        one statistics-only kernel's."""
        statistics = self._batch_statistics.get(x)
        if statistics is None:
            norm = _batch_norm.BatchNorm(known_shape(image_shape(x), "batch_norm: the blocked data"), epsilon,
                                         scale=False, center=False)
            mean, var = self._calls(_batch_norm.batch_norm_forward_func(norm, normalize=False),
                                    f"tvm_ext_batch_statistics_{norm.tag()}", [x], [(channels,), (channels,)])
            statistics = self._batch_statistics[x] = (mean, var)
        return statistics

    def batch_norm_statistics(self, call: relax.Call) -> relax.Expr:
        """The new running statistics alone (:func:`.base.statistics_only_batch_norm`)."""
        data = call.args[0]

        def computed() -> tuple[relax.Var, relax.Var]:  # (the shape is needed only where no kernel normalized x)
            channels = known_shape(image_shape(data), "batch_norm: the data")[1]
            return self._statistics_of(self._batch_norm_input(data)[0], channels, float(call.attrs.epsilon))

        return statistics_only_batch_norm(call, self._batch_statistics, computed)

    def batch_norm_backward(self, found: BatchNormGradient) -> tuple[relax.Expr, relax.Var, relax.Var]:
        """(dX, dgamma, dbeta) of a training-mode batch norm's gradient (`found`'s operands are
        the function's being built) on one blocked kernel
        (:func:`~tvm_ext.kernels.batch_norm.batch_norm_backward_func`), from the statistics the
        forward kernel computed for the same x (computed again where it did not run)."""
        channels = known_shape(image_shape(found.x), "batch_norm: the data")[1]
        x, block = self._batch_norm_input(found.x)
        shape = known_shape(image_shape(x), "batch_norm: the blocked data")
        dy = self.pack(tuple_field(self.bb, found.dy), block)
        statistics = self._statistics_of(x, channels, found.epsilon)
        norm = _batch_norm.BatchNorm(shape, found.epsilon, scale=found.gamma is not None)
        args = [x, dy, *statistics, *([found.gamma] if found.gamma is not None else [])]
        dx, dgamma, dbeta = self._calls(_batch_norm.batch_norm_backward_func(norm),
                                        f"tvm_ext_batch_norm_backward_{norm.tag()}", args,
                                        [shape, (channels,), (channels,)])
        return self.unpack(dx, channels), dgamma, dbeta

    def _value_of(self, expr: relax.Expr) -> relax.Expr | None:
        return bound_value(self.bb, expr)

    def interleaved_phases(self, call: relax.Call) -> relax.Expr | None:
        """A strided convolution's dX as :mod:`~tvm_ext.transform.gradients` writes it (its stride
        phases stacked, reshaped and cropped: :func:`~tvm_ext.transform.gradients.read_phase_interleave`),
        or where(y > 0, that, 0) after it (relu's gradient), as one blocked kernel reading the
        phases' convolutions as they wrote them
        (:func:`~tvm_ext.kernels.conv2d_backward_data.interleave_phases_func`); None otherwise."""
        if call.op == tvm.ir.Op.get("relax.where"):
            return self._masked_phases(call)
        found = read_phase_interleave(call, self._value_of)
        if found is None:
            return None
        phases, block = [], None
        for part in found.parts:
            known = None if part is None else self.blocked(part, padded=True)
            if part is not None and (known is None or known[1] != (block or known[1])):
                return None
            if known is not None:
                block = known[1]
            phases.append(None if known is None else known[0])
        n, channels, h, w = known_shape(image_shape(call), "interleave_phases: dX")
        if block is None or any(p is not None and (image_shape(p) or (0, 0))[1] != -(-channels // block)
                                for p in phases):
            return None
        return self._interleave(phases, found.stride, (n, -(-channels // block), h, w, block), channels)

    def _masked_phases(self, where: relax.Call) -> relax.Expr | None:
        """where(y > 0, interleaved phases, 0): the interleave again, masked (the plain one is
        dropped by dead-code elimination where nothing else reads it)."""
        def value_of(expr: relax.Expr) -> relax.Expr:
            value = self._value_of(expr)
            return expr if value is None else value

        condition, kept = value_of(where.args[0]), where.args[1]
        if not isinstance(condition, relax.Call) or condition.op != tvm.ir.Op.get("relax.greater"):
            return None
        found = mask_of(where, value_of)
        unpacked = value_of(kept)
        if found is None or found[1] != "relu" or not isinstance(unpacked, relax.Call):
            return None
        if unpacked.op != tvm.ir.Op.get("relax.call_tir") or not unpacked.args[0].name_hint.startswith(_UNPACK):
            return None
        blocked = unpacked.args[1].fields[0]
        if blocked not in self._interleaved or image_shape(found[0]) != image_shape(kept):
            return None
        phases, stride, out_shape, channels = self._interleaved[blocked]
        return self._interleave(phases, stride, out_shape, channels, relu_of=found[0])

    def _interleave(self, phases: list, stride: tuple[int, int], out_shape: tuple, channels: int,
                    relu_of: relax.Expr | None = None) -> relax.Expr:
        shapes = [None if p is None else known_shape(image_shape(p), "interleave_phases: a phase") for p in phases]
        func = _data_grad.interleave_phases_func(out_shape, stride, shapes, relu_of is not None)
        tag = "_".join("0" if shape is None else f"{shape[2]}x{shape[3]}" for shape in shapes)
        args = [p for p in phases if p is not None]
        if relu_of is not None:
            args.append(self.pack(relu_of, out_shape[4], padded=True))
        name = (f"tvm_ext_interleave_phases_{'x'.join(map(str, out_shape))}_s{stride[0]}x{stride[1]}_{tag}"
                f"{'_relu_mask' if relu_of is not None else ''}")
        out = self._call(func, name, args, out_shape)
        self._interleaved[out] = (phases, stride, out_shape, channels)
        return self.unpack(out, channels)

    def pool2d_backward(self, call: relax.Call, relu_mask: bool = False) -> relax.Expr:
        """{max,avg}_pool2d_backward(dY, x) in blocks (those x or dY were written in, else a
        vector's lanes); `relu_mask` (max pooling): also relu's gradient of x, where(x > 0, dX, 0)."""
        wl = pool2d_backward_workload(call)
        dy, x = call.args[:2]
        known = (self.blocked(x, padded=True) if wl.mode == "max" else None) or self.blocked(dy, padded=True)
        block = known[1] if known is not None else self.isa.lanes
        blocks = -(-wl.C // block)
        wl = dataclasses.replace(wl, C=blocks * block)  # padded channels: finite, their gradient ignored
        if wl.mode == "max":
            func = _pool_backward.max_pool2d_backward_blocked_func(wl, block, relu_mask)
            args = [self.pack(dy, block, padded=True), self.pack(x, block, padded=True)]
        else:  # the gradient of a mean reads no x
            func, args = _pool_backward.avg_pool2d_backward_blocked_func(wl, block), [self.pack(dy, block, padded=True)]
        name = (f"tvm_ext_{wl.mode}_pool2d_backward_{wl.N}x{blocks}x{wl.H}x{wl.W}x{block}_{pool_tag(wl)}"
                f"{'_relu_mask' if relu_mask else ''}")
        out = self._call(func, name, args, (wl.N, blocks, wl.H, wl.W, block))
        return self.unpack(out, known_shape(image_shape(x), f"{wl.mode}_pool2d_backward: the data")[1])

    def other_op(self, call: relax.Call, decision: Decision) -> relax.Expr:
        if decision.kernel in ("max_pool2d_backward", "avg_pool2d_backward"):
            return self.pool2d_backward(call)
        if decision.kernel == "channel_affine":  # a concatenation
            return self.channel_affine(list(call.args[0].fields))
        if decision.kernel == "layer_norm":
            return self._layer_norm(call)
        if decision.kernel == "batch_norm_training":
            return self.batch_norm_training(call)
        if decision.kernel == "channel_scale":
            operands = channel_scale_operands(call)
            if operands is None:  # decide() gives channel_scale to such multiplies only
                raise UnsupportedError(f"{decision.op} {decision.shapes}: not a multiply by one value per channel")
            return self._channel_scale(*operands)
        data = call.args[0]
        known = self.blocked(data, padded=True)  # one channel at a time: padded channels stay finite
        source, block = known if known is not None else (data, None)
        shape = known_shape(image_shape(source), f"{decision.op}: the data")
        data_shape = known_shape(image_shape(data), f"{decision.op}: the data")
        channels = data_shape[1]
        if decision.kernel == "global_avg_pool2d":
            func, out_shape = _pool.global_avg_pool2d_func(shape), (*shape[:2], 1, 1, *shape[4:])
        elif call.op.name in POOLS:
            padded_shape = data_shape if block is None else (data_shape[0], shape[1] * shape[4], *data_shape[2:])
            wl = pool_workload(call, padded_shape)
            func = self.pool_kernel(wl, block)
            out_shape = (*shape[:2], wl.OH, wl.OW, *shape[4:])
        else:
            func = _elementwise.activation_func(decision.chosen_kernel, shape, "float32", self.isa.lanes, alpha(call))
            out_shape = shape
        name = f"tvm_ext_{decision.kernel}_{'x'.join(map(str, shape))}"
        out = self._call(func, name, [source], out_shape)
        keeps_dims = call.op.name != "relax.mean" or len(call.ty.shape) == 4  # a mean may drop H and W
        if block is not None:
            out = self.unpack(out, channels)
            if keeps_dims:
                return out
            out = self.bb.emit(out)
        return out if keeps_dims else relax.op.reshape(out, call.ty.shape)
