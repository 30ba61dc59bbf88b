"""Channels-last blocks (ConvNeXt's permute -> LayerNorm(C) -> Linear -> GELU -> Linear ->
permute) rewritten around NCHW convolutions: the Linear layers' 1x1 convolutions take the bias
and GELU (first) and the layer scale (second) in their epilogues and weights, and the transposes
between them and back to NCHW disappear; the layer norm stays channels-last."""

from __future__ import annotations

import functools
import math
import operator

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from ..relax_info import dtype, image_shape, is_channel_bias, known_shape, static_shape

__all__ = ["channels_last_as_nchw", "is_view"]

_MOVEMENT = ("relax.reshape", "relax.permute_dims")
# unary elementwise ops: f(move(x)) == move(f(x)) for any reshape or permute
_ELEMENTWISE_UNARY = ("relax.nn.relu", "relax.nn.gelu", "relax.nn.gelu_tanh", "relax.nn.silu", "relax.sigmoid",
                      "relax.nn.leakyrelu", "relax.clip")
_MAX_ROUNDS = 8
# is_view runs the chain on an index array of the tensor: above this many elements (a 128 MB
# array) the chain is left as it is, which is always correct
_MAX_VIEW_ELEMENTS = 1 << 24


def _is_op(expr: relax.Expr, *names: str) -> bool:
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name in names


def _step(call: relax.Call) -> tuple[str, tuple[int, ...] | None]:
    """A reshape (its output shape) or permute_dims (its axes), as a hashable step."""
    if call.op.name == "relax.reshape":
        return "reshape", static_shape(call)
    axes = call.attrs.axes
    return "permute", None if axes is None else tuple(int(a) for a in axes)


@functools.lru_cache(maxsize=4096)
def _steps_are_view(source_shape: tuple[int, ...], steps: tuple) -> bool:
    """Run the steps on the element indices of a tensor of `source_shape` (a network repeats its
    chains: cached)."""
    index = np.arange(math.prod(source_shape), dtype=np.int64).reshape(source_shape)
    for kind, value in steps:
        index = index.reshape(value) if kind == "reshape" else index.transpose(value)
    return bool(np.array_equal(index.reshape(-1), np.arange(index.size)))


def _permutation_is_view(shape: tuple, axes) -> bool:
    """Whether permute_dims(axes) of a tensor of `shape` keeps its elements in order: its axes
    longer than 1 stay in their order."""
    order = range(len(shape) - 1, -1, -1) if axes is None else [int(a) % len(shape) for a in axes]
    moved = [axis for axis in order if shape[axis] != 1]
    return moved == sorted(moved)


def is_view(source_shape: tuple, chain: list[relax.Call]) -> bool:
    """Whether the reshapes and permute_dims of `chain`, applied in order to a tensor of
    `source_shape`, keep its elements in row-major order (the chain is one reshape). One op is
    decided from its attributes; a chain by running it on the tensor's element indices, once per
    chain of shapes (the indices of every chain took 1 s of ConvNeXt's build)."""
    if len(chain) == 1:
        call = chain[0]
        return call.op.name == "relax.reshape" or _permutation_is_view(tuple(source_shape), call.attrs.axes)
    return _steps_are_view(tuple(int(v) for v in source_shape), tuple(_step(call) for call in chain))


def channels_last_as_nchw(layer_norm_over_channels: bool = False) -> tvm.transform.Pass:
    """Local rewrites, repeated until none applies (static float32 shapes only; each keeps the
    value it rewrites, element for element):

    - a chain of reshapes and permute_dims that keeps its source's element order, with
      transposes in it that cancel, or reshapes back to its source's shape  ==>  one reshape of
      the source (or the source itself);
    - an elementwise activation of a reshape or permute  ==>  the reshape or permute of the
      activation (it moves up to the convolution whose epilogue can apply it);
    - a 1x1, stride-1, unpadded convolution of reshape(x, (1, C, 1, H * W)), x of shape
      (1, C, H, W)  ==>  the reshape of the convolution of x (a dense layer over the pixels of an
      image is a 1x1 convolution of the image);
    - add or multiply of a reshape of y by one constant per channel, the reshape keeping the
      batch and channel axes of a 4-D tensor  ==>  the reshape of the add or multiply of y;
    - (conv2d(x, W) + b) * s, s one constant per output channel (ConvNeXt's layer scale)  ==>
      conv2d(x, W * s) + b * s, in float64.

    - with `layer_norm_over_channels` (where tvm_ext has the kernel: LLVM CPUs), layer_norm over
      the last axis of permute(x, NCHW -> NHWC)  ==>  the permute of layer_norm over axis 1 of x
      (:mod:`tvm_ext.kernels.layer_norm`, in the blocked layout; the permutes then cancel).

    Without it the layer norm stays channels-last (permute, layer_norm over the last axis, on
    stock TVM): moved to NCHW it took 27 ms instead of 1 ms on 1x96x56x56 (stock TVM's
    reduction over a strided axis), 1.1 s in ConvNeXt-tiny against 0.15 s.
    """
    from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

    def movement():
        return is_op("relax.reshape")(wildcard(), wildcard()) | is_op("relax.permute_dims")(wildcard())

    def run(func: relax.Function) -> relax.Function:
        values = relax.analysis.get_var2val(func)

        def value_of(expr: relax.Expr) -> relax.Expr:
            while isinstance(expr, relax.Var) and expr in values:
                expr = values[expr]
            return expr

        def source_and_chain(call: relax.Call) -> tuple[relax.Expr, list[relax.Call]]:
            """The first input of the data movement ending at `call`, and that movement in order."""
            chain = [call]
            source = call.args[0]
            while _is_op(value_of(source), *_MOVEMENT):
                chain.append(value_of(source))
                source = chain[-1].args[0]
            return source, chain[::-1]

        def collapse(orig: relax.Expr, _matched: dict) -> relax.Expr:
            if not isinstance(orig, relax.Call):  # a binding the pattern matched through
                return orig
            source, chain = source_and_chain(orig)
            shape, out = static_shape(source), static_shape(orig)
            if shape is None or out is None:
                return orig
            if shape == out and all(c.op.name == "relax.reshape" for c in chain):
                return source  # reshapes back to where they started (a 1x1 convolution of an image)
            if len(chain) == 1 and orig.op.name == "relax.reshape":
                return orig
            # only transposes that cancel: a chain of views is one already (and a classifier's
            # flatten -> matmul_as_conv2d image stays recognisable as a dense layer in the report)
            if math.prod(shape) > _MAX_VIEW_ELEMENTS or all(
                    c.op.name == "relax.reshape" or is_view(known_shape(static_shape(c.args[0]), "a view's input"), [c])
                    for c in chain):
                return orig
            if not is_view(shape, chain):
                return orig
            return source if shape == out else relax.op.reshape(source, out)

        act_input = movement()
        act = is_op("relax.clip")(act_input, wildcard(), wildcard())
        for name in _ELEMENTWISE_UNARY[:-1]:
            act = act | is_op(name)(act_input)

        def activation_up(orig: relax.Expr, matched: dict) -> relax.Expr:
            if not isinstance(orig, relax.Call):  # a binding the pattern matched through
                return orig
            move = matched[act_input]
            if static_shape(move) is None or static_shape(move.args[0]) is None:
                return orig
            inner = relax.Call(orig.op, [move.args[0], *orig.args[1:]], orig.attrs)
            return relax.Call(move.op, [inner, *move.args[1:]], move.attrs)

        conv_input = is_op("relax.reshape")(wildcard(), wildcard())
        conv = is_op("relax.nn.conv2d")(conv_input, is_const())

        def conv_of_image(orig: relax.Expr, matched: dict) -> relax.Expr:
            if not isinstance(orig, relax.Call):  # a binding the pattern matched through
                return orig
            x = matched[conv_input].args[0]
            shape, flat, w = static_shape(x), static_shape(matched[conv_input]), static_shape(orig.args[1])
            attrs = orig.attrs
            if shape is None or flat is None or w is None or len(shape) != 4 or dtype(x) != "float32":
                return orig
            plain = ([int(v) for v in attrs.strides], [int(v) for v in attrs.padding], [int(v) for v in attrs.dilation],
                     int(attrs.groups), str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout))
            if plain != ([1, 1], [0, 0, 0, 0], [1, 1], 1, "NCHW", "OIHW", "NCHW") or w[2:] != (1, 1):
                return orig
            if shape[0] != 1 or flat != (1, shape[1], 1, shape[2] * shape[3]) or shape[2] == 1:
                return orig
            image = relax.Call(orig.op, [x, orig.args[1]], attrs)
            return relax.op.reshape(image, static_shape(orig))

        ch_input, ch_const = is_op("relax.reshape")(wildcard(), wildcard()), is_const()
        channel_op = is_op("relax.add")(ch_input, ch_const) | is_op("relax.multiply")(ch_input, ch_const)

        def channel_op_up(orig: relax.Expr, matched: dict) -> relax.Expr:
            if not isinstance(orig, relax.Call):  # a binding the pattern matched through
                return orig
            y = matched[ch_input].args[0]
            shape, out, const = static_shape(y), static_shape(orig), matched[ch_const]
            if shape is None or out is None or len(shape) != 4 or len(out) != 4 or shape[:2] != out[:2]:
                return orig
            per_channel = ((1, shape[1], 1, 1), (shape[1], 1, 1))
            if not is_channel_bias(const, shape[1]) or static_shape(const) not in per_channel:
                return orig
            return relax.op.reshape(relax.Call(orig.op, [y, const], orig.attrs), out)

        s_conv, s_bias, s_scale = is_op("relax.nn.conv2d")(wildcard(), is_const()), is_const(), is_const()
        scaled = is_op("relax.multiply")(is_op("relax.add")(s_conv, s_bias), s_scale)

        def fold_scale(orig: relax.Expr, matched: dict) -> relax.Expr:
            if not isinstance(orig, relax.Call):  # a binding the pattern matched through
                return orig
            conv_call, bias, scale = matched[s_conv], matched[s_bias], matched[s_scale]
            w_shape = static_shape(conv_call.args[1])
            k = int(w_shape[0]) if w_shape else None
            layouts = (str(conv_call.attrs.data_layout), str(conv_call.attrs.kernel_layout),
                       str(conv_call.attrs.out_layout))
            if k is None or layouts != ("NCHW", "OIHW", "NCHW") or static_shape(bias) != (1, k, 1, 1):
                return orig
            if static_shape(scale) not in ((1, k, 1, 1), (k, 1, 1)) or dtype(scale) != "float32":
                return orig
            s = scale.value.numpy().astype(np.float64).reshape(-1)
            w = conv_call.args[1].value.numpy().astype(np.float64)
            b = bias.value.numpy().astype(np.float64).reshape(-1)
            folded = relax.Call(conv_call.op, [conv_call.args[0],
                                               relax.const((w * s[:, None, None, None]).astype(np.float32))],
                                conv_call.attrs)
            return relax.op.add(folded, relax.const((b * s).astype(np.float32).reshape(1, k, 1, 1)))

        ln_input = is_op("relax.permute_dims")(wildcard())
        norm = is_op("relax.nn.layer_norm")(ln_input, wildcard(), wildcard())

        def layer_norm_to_channels(orig: relax.Expr, matched: dict) -> relax.Expr:
            if not isinstance(orig, relax.Call):  # a binding the pattern matched through
                return orig
            move = matched[ln_input]
            x, axes = move.args[0], move.attrs.axes
            shape = image_shape(x)  # static, or a symbolic batch (the kernel runs image by image)
            if shape is None or len(shape) != 4 or dtype(x) != "float32" or axes is None:
                return orig
            if [int(a) for a in axes] != [0, 2, 3, 1] or [int(a) % 4 for a in orig.attrs.axes] != [3]:
                return orig
            attrs = orig.attrs
            normed = relax.op.nn.layer_norm(x, orig.args[1], orig.args[2], axes=[1], epsilon=float(attrs.epsilon),
                                            center=bool(attrs.center), scale=bool(attrs.scale))
            return relax.op.permute_dims(normed, [0, 2, 3, 1])

        rules = [(norm, layer_norm_to_channels)] if layer_norm_over_channels else []
        rules += [(movement(), collapse), (act, activation_up), (conv, conv_of_image), (channel_op, channel_op_up),
                  (scaled, fold_scale)]

        def first_rule(orig: relax.Expr, matched: dict) -> relax.Expr:
            """The first rule that matched and rewrites: one pass over the function for all of
            them (a rewrite_call a rule took 0.12 s a call on ConvNeXt, 3.4 s of its build)."""
            for pattern, rewriter in rules:
                if pattern in matched:
                    new = rewriter(orig, matched)
                    if not new.same_as(orig):
                        return new
            return orig

        return rewrite_call(functools.reduce(operator.or_, (pattern for pattern, _ in rules)), first_rule, func)

    @tvm.transform.module_pass(opt_level=0, name="tvm_ext.ChannelsLastAsNCHW")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = mod.clone()  # the caller's module stays as it was
        for gvar, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            for _ in range(_MAX_ROUNDS):
                new = relax.transform.CanonicalizeBindings()(tvm.IRModule({gvar: run(func)}))[gvar]
                if tvm_ffi.structural_equal(new, func):
                    break
                func = new
            mod[gvar] = func
        return mod

    return _pass
