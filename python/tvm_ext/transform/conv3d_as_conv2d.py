"""3-D convolution networks (video: torchvision's R3D, MC3, R(2+1)D, S3D) as 2-D ones over frames.

A video tensor (N, C, D, H, W) is held as its frames, (N * D, C, H, W) in the order (N, D): a
3-D convolution of kernel (kD, kH, kW) is then one 2-D convolution over the frames whose input
channels are the kD frames its temporal taps read, concatenated (a temporal gather, the only copy:
kD times the input, no spatial im2col), and its weight (K, C, kD, kH, kW) becomes (K, kD * C, kH,
kW) at build time. The ops between the convolutions keep the frames layout (batch norms, which
then fold into the convolutions, activations, residual adds, per-channel constants, spatial-only
pooling, channel concatenations), so the tvm_ext kernels run the whole network and fuse their
epilogues as in 2-D; a value read by anything else is moved back to NCDHW where it is read.
Stock TVM ran R3D-18 on 8 frames of 112x112 in 22 s (PyTorch: 0.3 s).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tvm
from tvm import relax

from ..relax_info import (
    constant_array,
    dtype,
    image_shape,
    known_shape,
    op_name,
    same_extent,
    static_shape,
    symbolic_batch,
)
from .padding_taps import used_taps

__all__ = ["conv3d_as_conv2d"]

# unary elementwise ops: they apply to the frames as to the video
_UNARY = frozenset({"relax.nn.relu", "relax.sigmoid", "relax.nn.silu", "relax.nn.gelu", "relax.nn.gelu_tanh",
                    "relax.clip", "relax.nn.leakyrelu", "relax.tanh", "relax.exp", "relax.negative"})
_BINARY = frozenset({"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum",
                     "relax.minimum"})
_POOLS = {"relax.nn.max_pool3d": relax.op.nn.max_pool2d, "relax.nn.avg_pool3d": relax.op.nn.avg_pool2d}


@dataclasses.dataclass(frozen=True)
class _Frames:
    """A video value held as frames: the (N * D, C, H, W) expression and its N (static, or a
    symbolic batch) and D."""

    value: relax.Expr
    batch: int | tvm.tirx.PrimExpr
    depth: int

    @property
    def image(self) -> tuple[int, ...]:
        """(C, H, W) of a frame."""
        return known_shape(image_shape(self.value), "frames")[1:]

    def same_video(self, other: _Frames) -> bool:
        """Whether `other` holds a video of the same shape (an elementwise op of the two is one of
        their frames)."""
        return (self.depth, self.image) == (other.depth, other.image) and same_extent(self.batch, other.batch)


def _video_shape(expr: relax.Expr) -> tuple | None:
    """The shape of a 5-D float32 tensor, static or with a symbolic batch (a PrimExpr first)."""
    shape = image_shape(expr)
    if dtype(expr) != "float32" or shape is None or len(shape) != 5:
        return None
    batch = symbolic_batch(expr)
    return shape if batch is None else (batch, *shape[1:])


def _ints(values) -> list[int]:
    return [int(v) for v in values]


def conv3d_as_conv2d() -> tvm.transform.Pass:
    """The pass: each float32 NCDHW 3-D convolution of static shape becomes a 2-D convolution over
    frames, and the ops listed in the module docstring that read frames keep them (one pass over
    each function, in binding order)."""

    @relax.expr_functor.mutator
    class _Rewriter(relax.PyExprMutator):
        def __init__(self, mod: tvm.IRModule):
            super().__init__(mod)
            self.frames: dict[relax.Var, _Frames] = {}
            self.originals: dict[relax.Var, relax.Expr] = {}  # a tuple held as frames: its 5-D call
            self.videos: dict[relax.Var, relax.Expr] = {}  # frames moved back to NCDHW, once each

        # a variable held as frames, read by an op that does not take frames: its NCDHW value
        # (any other: the mutator's, which renames a binding whose value changed)
        def visit_var_(self, var: relax.Var) -> relax.Expr:
            return self._video(var) if var in self.frames else super().visit_var_(var)

        def visit_dataflow_var_(self, var: relax.DataflowVar) -> relax.Expr:
            return self._video(var) if var in self.frames else super().visit_dataflow_var_(var)

        def _video(self, var: relax.Var) -> relax.Expr:
            if var not in self.videos:
                self.videos[var] = self.builder_.emit(self._video_value(var))
            return self.videos[var]

        def _video_value(self, var: relax.Var) -> relax.Expr:
            """The NCDHW value of a variable held as frames."""
            if var in self.originals:  # a batch norm's tuple read whole: the 5-D call again
                return self.visit_expr(self.originals[var])
            held = self.frames[var]
            frames = self.builder_.emit(relax.op.reshape(held.value, (held.batch, held.depth, *held.image)))
            return relax.op.permute_dims(frames, [0, 2, 1, 3, 4])

        def _as_frames(self, expr: relax.Expr) -> _Frames:
            """`expr` (a 5-D float32 tensor of static shape) as frames: held so already, or moved there."""
            if isinstance(expr, relax.Var) and expr in self.frames:
                return self.frames[expr]
            shape = _video_shape(expr)
            if shape is None:
                raise ValueError("conv3d_as_conv2d: a video of unknown shape")  # _conv checked it
            n, c, d, h, w = shape
            moved = relax.op.reshape(relax.op.permute_dims(self.visit_expr(expr), [0, 2, 1, 3, 4]), (n * d, c, h, w))
            return _Frames(self.builder_.emit(moved), n, d)

        def _held(self, expr: relax.Expr) -> _Frames | None:
            return self.frames.get(expr) if isinstance(expr, relax.Var) else None

        def visit_var_binding_(self, binding: relax.VarBinding) -> None:
            value = binding.value
            held = self._rewritten(value) if isinstance(value, (relax.Call, relax.TupleGetItem)) else None
            if held is None:
                super().visit_var_binding_(binding)
                return
            var = binding.var
            self.frames[var] = _Frames(self.builder_.emit(held.value), held.batch, held.depth)
            if op_name(binding.value) == "relax.nn.batch_norm":
                self.originals[var] = binding.value
            if not isinstance(var, relax.DataflowVar):  # a block's output: bound to its NCDHW value
                self.builder_.emit_normalized(relax.VarBinding(var, self.builder_.normalize(self._video_value(var))))
                self.videos[var] = var

        def _rewritten(self, value: relax.Expr) -> _Frames | None:
            """`value` computed on frames, or None where it is computed as it is."""
            if isinstance(value, relax.TupleGetItem):
                held = self._held(value.tuple_value)
                if held is None or value.index != 0:
                    return None
                return _Frames(relax.TupleGetItem(held.value, 0), held.batch, held.depth)
            name = op_name(value)
            if name == "relax.nn.conv3d":
                return self._conv(value)
            args = value.args
            if name == "relax.concat":
                return self._concat(value)
            if name in _BINARY:
                return self._binary(value)
            held = self._held(args[0]) if args else None
            if held is None:
                return None
            if name in _UNARY:
                return dataclasses.replace(held, value=relax.Call(value.op, [held.value, *args[1:]], value.attrs))
            if name == "relax.nn.batch_norm":
                if int(value.attrs.axis) % 5 != 1:
                    return None
                call = relax.Call(value.op, [held.value, *(self.visit_expr(a) for a in args[1:])], value.attrs)
                return dataclasses.replace(held, value=call)
            if name in _POOLS:
                return self._pool(value, held)
            return None

        def _binary(self, call: relax.Call) -> _Frames | None:
            """Both operands frames of one video, or one of them and a value per channel (or one
            value), in either order."""
            first, second = (self._held(a) for a in call.args)
            if first is not None and second is not None:
                if not first.same_video(second):
                    return None  # a broadcast between videos (over frames, say)
                return dataclasses.replace(first, value=relax.Call(call.op, [first.value, second.value], call.attrs))
            frames = first if first is not None else second
            if frames is None:
                return None
            side = 0 if first is not None else 1
            other = call.args[1 - side]
            shape = static_shape(other)
            channels = frames.image[0]
            if shape is None or dtype(other) != "float32" or len(shape) > 5:
                return None
            aligned = (1,) * (5 - len(shape)) + tuple(shape)
            if aligned[0] != 1 or aligned[2:] != (1, 1, 1) or aligned[1] not in (1, channels):
                return None  # only one value per channel (or one) is the same on every frame
            per_channel = self._per_channel(other, aligned[1])
            operands = [frames.value, per_channel] if side == 0 else [per_channel, frames.value]
            return dataclasses.replace(frames, value=relax.Call(call.op, operands, call.attrs))

        def _per_channel(self, value: relax.Expr, channels: int) -> relax.Expr:
            """A value per channel (or one) of a video as one of its frames: a constant stays one
            (the epilogue patterns take constants), a scalar stays as it is."""
            array = constant_array(value)
            if array is not None:
                return relax.const(np.ascontiguousarray(array.reshape(1, channels, 1, 1)))
            if static_shape(value) == ():
                return self.visit_expr(value)
            return relax.op.reshape(self.visit_expr(value), (1, channels, 1, 1))

        def _pool(self, call: relax.Call, held: _Frames) -> _Frames | None:
            attrs = call.attrs
            size, strides, padding, dilation = (_ints(attrs.pool_size), _ints(attrs.strides), _ints(attrs.padding),
                                                _ints(attrs.dilation))
            if (size[0], strides[0], padding[0], padding[3], dilation[0]) != (1, 1, 0, 0, 1):
                return None  # a pooling over frames
            if str(attrs.layout) != "NCDHW" or str(attrs.out_layout) != "NCDHW":
                return None
            pooled = _POOLS[call.op.name](held.value, size[1:], strides[1:], [*padding[1:3], *padding[4:6]],
                                          dilation[1:], bool(attrs.ceil_mode), bool(attrs.count_include_pad))
            return dataclasses.replace(held, value=pooled)

        def _concat(self, call: relax.Call) -> _Frames | None:
            parts = call.args[0]
            if not isinstance(parts, relax.Tuple) or int(call.attrs.axis) % 5 != 1:
                return None
            held = [h for h in (self._held(p) for p in parts.fields) if h is not None]
            if len(held) != len(parts.fields):
                return None
            first = held[0]  # the parts differ in their channels only
            if not all(h.depth == first.depth and h.image[1:] == first.image[1:] and same_extent(h.batch, first.batch)
                       for h in held):
                return None
            return dataclasses.replace(held[0], value=relax.op.concat([h.value for h in held], axis=1))

        def _conv(self, call: relax.Call) -> _Frames | None:
            attrs = call.attrs
            x, weight = call.args
            shape, out_shape = _video_shape(x), _video_shape(call)
            layouts = (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout))
            if shape is None or out_shape is None or layouts != ("NCDHW", "OIDHW", "NCDHW"):
                return None
            w_shape = static_shape(weight)
            if w_shape is None or len(w_shape) != 5:
                return None
            strides, padding, dilation = _ints(attrs.strides), _ints(attrs.padding), _ints(attrs.dilation)
            groups = int(attrs.groups)
            depth = out_shape[2]
            # a short clip's outer taps read only the zero frames around it: left out (where the
            # weights are constants and finite: an inf times a zero frame is NaN)
            taps = list(range(w_shape[2]))
            array = constant_array(weight)
            if array is not None and np.isfinite(array).all():
                taps = used_taps(shape[2], depth, w_shape[2], strides[0], dilation[0], padding[0]) or taps
            held = self._as_frames(x)
            frames = self._gather(held, taps, strides[0], padding[0], padding[3], dilation[0], depth, groups)
            conv = relax.op.nn.conv2d(frames, self._filters(weight, array, taps), strides[1:],
                                      [*padding[1:3], *padding[4:6]], dilation[1:], groups)
            return _Frames(conv, held.batch, depth)

        def _filters(self, weight: relax.Expr, array: np.ndarray | None, taps: list[int]) -> relax.Expr:
            """(K, C/g, kD, kH, kW) -> (K, len(taps) * C/g, kH, kW), the temporal `taps` only: a
            group's channels tap by tap, as gathered; a constant's (its `array`) at build time
            (batch-norm folding reads it as a constant)."""
            k, c_group, kd, kh, kw = (int(v) for v in weight.ty.shape)
            if array is not None:
                filters = array[:, :, taps].transpose(0, 2, 1, 3, 4).reshape(k, len(taps) * c_group, kh, kw)
                return relax.const(np.ascontiguousarray(filters))
            weight = self.visit_expr(weight)
            if len(taps) < kd:
                weight = relax.op.take(weight, relax.const(np.array(taps, "int64")), axis=2)
            moved = relax.op.permute_dims(weight, [0, 2, 1, 3, 4])
            return relax.op.reshape(moved, (k, len(taps) * c_group, kh, kw))

        def _gather(self, held: _Frames, taps: list[int], stride: int, before: int, after: int, dilation: int,
                    depth: int, groups: int) -> relax.Expr:
            """The frames each output frame's temporal `taps` read, as channels (N * D_out, g *
            len(taps) * C/g, H, W): a group's channels tap by tap."""
            n, d = held.batch, held.depth
            c, h, w = held.image
            if len(taps) == 1 and stride == 1 and taps[0] * dilation == before and depth == d:
                return held.value  # the frames themselves
            video = relax.op.reshape(held.value, (n, d, c, h, w))
            if before or after:
                video = relax.op.nn.pad(video, [0, 0, before, after, 0, 0, 0, 0, 0, 0])
            span = (depth - 1) * stride + 1
            tapped = [relax.op.strided_slice(video, [1], [t * dilation], [t * dilation + span], [stride])
                      for t in taps]
            if len(taps) == 1:
                return relax.op.reshape(tapped[0], (n * depth, c, h, w))
            stacked = relax.op.concat(tapped, axis=2)  # (N, D_out, kD * C, H, W)
            if groups > 1:  # (kD, g, C/g) -> (g, kD, C/g)
                stacked = relax.op.reshape(stacked, (n, depth, len(taps), groups, c // groups, h, w))
                stacked = relax.op.permute_dims(stacked, [0, 1, 3, 2, 4, 5, 6])
            return relax.op.reshape(stacked, (n * depth, len(taps) * c, h, w))

    @tvm.transform.module_pass(opt_level=0, name="tvm_ext.Conv3dAsConv2d")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not any(isinstance(f, relax.Function) and "relax.nn.conv3d" in _ops(f) for _, f in mod.functions_items()):
            return mod
        rewriter = _Rewriter(mod)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
        return relax.transform.DeadCodeElimination()(rewriter.builder_.get())

    return _pass


def _ops(func: relax.Function) -> set[str]:
    names: set[str] = set()
    relax.analysis.post_order_visit(func, lambda e: names.add(op_name(e) or ""))
    return names
