"""Epilogue fusion: conv2d [+ bias] [+ residual] [-> activation] grouped into one composite
function, which :mod:`.dispatch` lowers to one kernel call; and the reader of such a composite."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeGuard

import tvm
from tvm import relax

from ..relax_info import dtype, image_shape, is_channel_bias, known_shape, same_extent, static_shape, symbolic_batch
from ..transform import (
    channels_last_as_nchw,
    conv3d_as_conv2d,
    drop_padding_taps,
    fold_batch_norm,
    fold_constants_in_numpy,
    matmul_as_conv2d,
    recognise_silu,
    split_running_statistics,
    unique_constants,
)
from .base import ACTIVATION_OPS, Activation, activation_at, scalar_constant
from .decide import channel_affine_reason, decide, epilogue_activation

__all__ = ["Mask", "affine_of", "epilogue_of", "fake_quantize_of", "fusion_passes", "fusion_patterns", "mask_of",
           "pool_gradient_of"]


def reads_inside_or_leaks(ctx) -> bool:
    """Whether a match cannot become one kernel call: a value computed inside it is read outside
    it (EfficientNet's (conv + b) * sigmoid(conv + b)), or its shortcut or mask is a value
    computed inside it (y + y; where(y > 0, y, 0), a relu written out). TVM's
    `has_leaking_intermediate_variables` refuses every match outside a dataflow block; reading
    the uses serves those too."""
    inside = set(ctx.matched_bindings.keys())
    output = ctx.value_to_bound_var.get(ctx.matched_expr)
    for var in inside:
        if not var.same_as(output) and any(user not in inside for user in ctx.var_usages.get(var, [])):
            return True
    for name in ("residual", "mask"):  # operands the kernel reads: computed before it
        tensor = ctx.annotated_expr.get(name)
        if tensor is not None and (tensor in inside or any(tensor.same_as(v) for v in ctx.matched_bindings.values())):
            return True
    return False


def _same_batch(a: relax.Expr, b: relax.Expr) -> bool:
    """Whether two tensors have the same batch: both static, or the same symbolic extent (a
    residual of batch 1 added to a symbolic batch would broadcast, not be a shortcut)."""
    x, y = symbolic_batch(a), symbolic_batch(b)
    if x is None or y is None:
        return x is None and y is None
    return same_extent(x, y)


def _activation_pattern(x, act: str):
    """The pattern of activation `act` (a key of ACTIVATION_OPS, "hardsigmoid" or "hardswish")
    applied to pattern `x`; :func:`~.base.activation_at` checks the constants of a match."""
    from tvm.relax.dpl import is_const, is_op, wildcard

    def relu6_of_x_plus_3(x):  # clip(x + 3, 0, 6), or torch.export's two one-sided clips
        clip = is_op("relax.clip")(is_op("relax.add")(x, is_const()), wildcard(), wildcard())
        return clip | is_op("relax.clip")(clip, wildcard(), wildcard())

    def hardsigmoid(x):  # clip(x + 3, 0, 6) / 6
        return is_op("relax.divide")(relu6_of_x_plus_3(x), is_const())

    if act == "relax.clip":
        return is_op(act)(x, wildcard(), wildcard())
    if act == "hardsigmoid":
        return hardsigmoid(x)
    if act == "hardswish":  # x * hardsigmoid(x), or torch.export's (x * clip(x + 3, 0, 6)) / 6
        return (is_op("relax.multiply")(x, hardsigmoid(x))  # multiply matches either operand order
                | is_op("relax.divide")(is_op("relax.multiply")(x, relu6_of_x_plus_3(x)), is_const()))
    return is_op(act)(x)


@dataclasses.dataclass(frozen=True)
class Mask:
    """An activation's gradient a convolution's epilogue applies (:attr:`Epilogue.mask
    <tvm_ext.kernels.conv2d.Epilogue.mask>`): the kernel input holding the activation's output
    (the index of the composite's param), the activation and leaky_relu's slope."""

    param: int
    name: str
    alpha: float = 0.01


def _mask_pattern(x, name: str):
    """where(y > 0, x, 0) (relu's gradient as tvm_ext writes it) or where(y > 0, x, x * alpha)
    (leaky_relu's), of pattern `x`: (the pattern, the pattern of y)."""
    from tvm.relax.dpl import is_const, is_op, wildcard

    y = wildcard()
    below = is_const() if name == "relu" else is_op("relax.multiply")(x, is_const())
    return is_op("relax.where")(is_op("relax.greater")(y, is_const()), x, below), y


def mask_of(where: relax.Call, value_of) -> tuple[relax.Expr, str, float] | None:
    """(y, activation, slope) of a mask `where` as :func:`_mask_pattern` matches it, if its
    constants make it one: 0 in the comparison, 0 below (relu) or one positive slope."""
    condition, kept, below = where.args[0], where.args[1], where.args[2]
    condition, below_value = value_of(condition), value_of(below)
    if scalar_constant(condition.args[1]) != 0.0:
        return None
    if scalar_constant(below) == 0.0:
        return condition.args[0], "relu", 0.01
    if not (isinstance(below_value, relax.Call) and below_value.op.name == "relax.multiply"):
        return None
    operands = below_value.args if below_value.args[0].same_as(kept) else below_value.args[::-1]
    slope = scalar_constant(operands[1])
    if not operands[0].same_as(kept) or slope is None or slope <= 0:
        return None
    return condition.args[0], "leaky_relu", slope


def fusion_patterns(target: tvm.target.Target) -> list:
    """FuseOpsByPattern patterns grouping a conv2d with the epilogue our kernel applies itself.

    Longest chains first; `check` accepts a match only when decide() gives the conv a kernel,
    the bias is per output channel and the residual has the output's shape.
    """
    from tvm.relax.dpl import is_op, wildcard

    def check(ctx) -> bool:
        if reads_inside_or_leaks(ctx):
            return False
        conv = ctx.annotated_expr["conv"]
        decision = decide(conv, target)
        if decision.kernel is None or decision.kernel == "conv2d_backward_weight":  # no epilogue
            return False
        out_shape = decision.conv_plan.wl.out_shape
        bias = ctx.annotated_expr.get("bias")
        if bias is not None and not is_channel_bias(bias, out_shape[1]):
            return False
        if target.kind.name != "llvm" and not all(isinstance(e, tvm.ir.Constant) for e in (conv.args[1], bias)
                                                  if e is not None):
            return False  # CUDA's kernels take constant weights and biases
        for name in ("residual", "mask"):  # tensors of the output's shape, read in its layout
            tensor = ctx.annotated_expr.get(name)
            same_batch = tensor is None or _same_batch(tensor, conv.args[0])
            if tensor is not None and (image_shape(tensor) != out_shape or not same_batch or dtype(tensor) != "float32"
                                       or isinstance(tensor, tvm.ir.expr.GenericConst)):
                return False  # a constant of the output's shape (a 1x1 output's bias) is a bias
        if "mask" in ctx.annotated_expr:
            bindings = ctx.matched_bindings
            value_of = lambda e: bindings.get(e, e) if isinstance(e, relax.Var) else e  # noqa: E731
            return (target.kind.name == "llvm" and not isinstance(conv.args[1], tvm.ir.Constant)  # (Winograd's)
                    and mask_of(value_of(ctx.annotated_expr["mask_out"]), value_of) is not None)
        act = ctx.annotated_expr.get("activation")
        if act is None:
            return True
        bindings = ctx.matched_bindings
        found = activation_at(act, lambda e: bindings.get(e, e) if isinstance(e, relax.Var) else e)
        if found is None:  # a clip other than relu6, a shifted or scaled look-alike of hardswish
            return False
        return epilogue_activation(found[0].name, target).kernel is not None  # CUDA's maxDNN: relu, relu6

    def chain(bias: bool, residual: bool) -> tuple:
        """conv2d [+ bias] [+ residual]: its pattern, annotations and composite name. The weights
        and bias may be computed at run time (a training graph's parameters)."""
        conv = is_op("relax.nn.conv2d")(wildcard(), wildcard())
        annotations = {"conv": conv}
        out = conv
        for name, present in (("bias", bias), ("residual", residual)):
            if present:
                annotations[name] = wildcard()
                out = is_op("relax.add")(out, annotations[name])
        return out, annotations, "tvm_ext.conv2d" + "_bias" * bias + "_residual" * residual

    patterns = []
    for act in (*ACTIVATION_OPS, "hardsigmoid", "hardswish", None):
        for residual in (True, False):
            for bias in (True, False):
                if not (bias or residual or act):
                    continue
                out, annotations, name = chain(bias, residual)
                if act is not None:
                    out = annotations["activation"] = _activation_pattern(out, act)
                name += f"_{ACTIVATION_OPS.get(act, act)}" if act else ""
                patterns.append(relax.transform.FusionPattern(name, out, annotations, check))
    for mask in ("relu", "leaky_relu"):  # an activation's gradient after a data-gradient convolution
        for residual in (True, False):
            out, annotations, name = chain(False, residual)
            out, annotations["mask"] = _mask_pattern(out, mask)
            annotations["mask_out"] = out
            patterns.append(relax.transform.FusionPattern(f"{name}_{mask}_mask", out, annotations, check))
    patterns.sort(key=lambda p: -p.name.count("_"))
    return (patterns + _affine_patterns(target) + _pool_gradient_patterns(target) + _batch_norm_patterns(target)
            + _fake_quantize_patterns(target))


def _fake_quantization(dequantize: relax.Call, quantize: relax.Call) -> tuple[float, int, str, float, int] | None:
    """(scale, zero point, dtype, the dequantize's scale and zero point) of dequantize(quantize(x))
    on a float32 x of static shape, per tensor (scalar constants), else None."""
    scale, zero = scalar_constant(quantize.args[1]), scalar_constant(quantize.args[2])
    out_scale, out_zero = scalar_constant(dequantize.args[1]), scalar_constant(dequantize.args[2])
    quantized = str(quantize.attrs.out_dtype)
    if (None in (scale, zero, out_scale, out_zero) or quantized not in ("uint8", "int8")
            or str(dequantize.attrs.out_dtype) != "float32" or dtype(quantize.args[0]) != "float32"
            or static_shape(quantize.args[0]) is None):
        return None
    return float(scale), int(zero), quantized, float(out_scale), int(out_zero)  # type: ignore[arg-type]


def _fake_quantize_patterns(target: tvm.target.Target) -> list:
    """dequantize(quantize(x)) of a float tensor, the quantized tensor read by nothing else (PT2E's
    fake quantization before the float ops that read a quantized value): one
    :func:`~tvm_ext.kernels.elementwise.fake_quantize_func` call, on x's blocks where a kernel
    wrote them. CPUs only (what the int8 lowering left: it runs first)."""
    from tvm.relax.dpl import is_const, is_op, wildcard

    def check(ctx) -> bool:
        if target.kind.name != "llvm" or reads_inside_or_leaks(ctx):
            return False
        return _fake_quantization(ctx.annotated_expr["dequantize"], ctx.annotated_expr["quantize"]) is not None

    quantize = is_op("relax.quantize")(wildcard(), is_const(), is_const())
    dequantize = is_op("relax.dequantize")(quantize, is_const(), is_const())
    return [relax.transform.FusionPattern("tvm_ext.fake_quantize", dequantize,
                                          {"quantize": quantize, "dequantize": dequantize}, check)]


def fake_quantize_of(func: relax.Function) -> tuple[float, int, str, float, int]:
    """Read a fake-quantize composite: (scale, zero point, dtype, out scale, out zero point)."""
    params, value_of, expr, _ = _read_from_output(func)
    if _is_op(expr, "relax.dequantize"):
        quantize = value_of(expr.args[0])
        if _is_op(quantize, "relax.quantize") and quantize.args[0] in params:
            found = _fake_quantization(expr, quantize)
            if found is not None:
                return found
    raise ValueError(f"tvm_ext: not a fake-quantize composite: {func}")


def _pool_gradient_patterns(target: tvm.target.Target) -> list:
    """where(x > 0, max_pool2d_backward(dY, x), 0): a max pooling's gradient and the gradient of
    the relu whose output x it pooled (ResNet's stem), one blocked kernel call
    (:func:`~tvm_ext.kernels.pool2d_backward.max_pool2d_backward_blocked_func`; on CUDA
    :func:`~tvm_ext.kernels.cuda.memory_bound.pool2d_backward_chwn_func`)."""
    from tvm.relax.dpl import is_op, wildcard

    def check(ctx) -> bool:
        if target.kind.name not in ("llvm", "cuda") or reads_inside_or_leaks(ctx):
            return False
        pool, mask = ctx.annotated_expr["pool"], ctx.annotated_expr["mask"]
        mask = ctx.value_to_bound_var.get(mask, mask)  # (the matcher gives a bound variable's value)
        if decide(pool, target).kernel != "max_pool2d_backward" or not mask.same_as(pool.args[1]):
            return False  # the mask must be the pooling's own input
        bindings = ctx.matched_bindings
        value_of = lambda e: bindings.get(e, e) if isinstance(e, relax.Var) else e  # noqa: E731
        found = mask_of(value_of(ctx.annotated_expr["mask_out"]), value_of)
        return found is not None and found[1] == "relu"

    pool = is_op("relax.grad.max_pool2d_backward")(wildcard(), wildcard())
    out, y = _mask_pattern(pool, "relu")
    return [relax.transform.FusionPattern("tvm_ext.max_pool2d_backward_relu_mask", out,
                                          {"pool": pool, "mask": y, "mask_out": out}, check)]


def _batch_norm_patterns(target: tvm.target.Target) -> list:
    """batch_norm(x, ...)[0] [+ shortcut] [-> relu] of a training-mode batch norm (ResNet's
    bn -> relu and bn -> + identity -> relu): one forward kernel writes the result
    (:func:`~tvm_ext.kernels.batch_norm.batch_norm_forward_func`), not y and then stock NCHW ops.
    Not where the running statistics are read (they leak out of the match). CPUs only."""
    from tvm.relax.dpl import is_op, is_tuple_get_item, wildcard

    def check(ctx) -> bool:
        if target.kind.name not in ("llvm", "cuda") or reads_inside_or_leaks(ctx):
            return False
        norm = ctx.annotated_expr["norm"]
        if decide(norm, target).kernel != "batch_norm_training":
            return False
        residual = ctx.annotated_expr.get("residual")
        return residual is None or (static_shape(residual) == static_shape(norm.args[0])
                                    and dtype(residual) == "float32")

    patterns = []
    for residual, relu in ((True, True), (True, False), (False, True)):
        norm = is_op("relax.nn.batch_norm")(wildcard(), wildcard(), wildcard(), wildcard(), wildcard())
        annotations = {"norm": norm}
        out = is_tuple_get_item(norm, 0)
        if residual:
            out = is_op("relax.add")(out, annotations.setdefault("residual", wildcard()))
        if relu:
            out = is_op("relax.nn.relu")(out)
        name = "tvm_ext.batch_norm_training" + "_residual" * residual + "_relu" * relu
        patterns.append(relax.transform.FusionPattern(name, out, annotations, check))
    return patterns


def batch_norm_epilogue_of(func: relax.Function) -> tuple[relax.Call, int | None, bool]:
    """Read a composite of :func:`_batch_norm_patterns`: (its batch_norm call, the param index of
    the shortcut or None, whether it ends in a relu). The add's operands may come in either
    order (TVM matches add as commutative)."""
    params, value_of, expr, activation = _read_from_output(func)
    residual = None
    if _is_op(expr, "relax.add"):
        others = [i for i, arg in enumerate(expr.args) if arg in params]
        inner = [arg for arg in expr.args if isinstance(value_of(arg), relax.TupleGetItem)]
        if len(inner) != 1 or len(others) != 1:
            raise ValueError(f"tvm_ext: a fused batch norm's add is not y + shortcut: {expr}")
        residual, expr = params.index(expr.args[others[0]]), value_of(inner[0])
    norm = value_of(expr.tuple_value) if isinstance(expr, relax.TupleGetItem) and expr.index == 0 else None
    if not _is_op(norm, "relax.nn.batch_norm") or (activation is not None and activation.name != "relu"):
        raise ValueError(f"tvm_ext: a fused batch norm is not batch_norm(...)[0] [+ shortcut] [-> relu]: {func}")
    return norm, residual, activation is not None


def pool_gradient_of(func: relax.Function) -> relax.Call:
    """Read a composite of :func:`_pool_gradient_patterns`: its max_pool2d_backward call (whose
    arguments are the composite's params, or constants bound into it)."""
    _, value_of, expr, _ = _read_from_output(func)
    pool = value_of(expr.args[1]) if _is_op(expr, "relax.where") else None
    if not _is_op(pool, "relax.grad.max_pool2d_backward"):
        raise ValueError(f"tvm_ext: a fused pooling gradient is not where(x > 0, max_pool2d_backward(dY, x), 0): "
                         f"{expr}")
    return pool


def _affine_patterns(target: tvm.target.Target) -> list:
    """[concat ->] [* scale] [+ shift] [-> activation], scale and shift one constant per channel
    (DenseNet's concat -> batch norm -> relu; a batch norm after no convolution is a scale and
    shift by then): one :mod:`tvm_ext.kernels.channel_affine` call. Tried after the convolution
    patterns, so a convolution keeps its epilogue. CPUs only."""
    from tvm.relax.dpl import is_const, is_op, wildcard

    def check(ctx) -> bool:
        if target.kind.name not in ("llvm", "cuda") or reads_inside_or_leaks(ctx):
            return False
        head = ctx.annotated_expr["head"]
        if isinstance(head, relax.Call) and isinstance(head.op, tvm.ir.Op) and head.op.name == "relax.concat":
            if decide(head, target).kernel is None:
                return False
        elif channel_affine_reason(head) is not None:
            return False
        else:
            n, _, h, w = known_shape(image_shape(head), "channel_affine: the data")
            if n * h * w == 1:  # one value per channel (a batch norm gradient's statistics): nothing to gain
                return False
        channels = known_shape(image_shape(head), "channel_affine: the data")[1]
        for name in ("scale", "shift"):
            constant = ctx.annotated_expr.get(name)
            if constant is not None and not is_channel_bias(constant, channels):
                return False
        act = ctx.annotated_expr.get("activation")
        bindings = ctx.matched_bindings
        return act is None or activation_at(act, lambda e: bindings.get(e, e) if isinstance(e, relax.Var) else e) \
            is not None

    patterns = []
    for concat in (True, False):
        for scale, shift in ((True, True), (True, False), (False, True), (False, False)):
            for act in (*ACTIVATION_OPS, None):
                if not (scale or shift or (concat and act)):
                    continue  # a concatenation alone is lowered as an op; an activation alone too
                head = is_op("relax.concat")(wildcard()) if concat else wildcard()
                annotations = {"head": head}
                out = head
                if scale:
                    out = is_op("relax.multiply")(out, annotations.setdefault("scale", is_const()))
                if shift:
                    out = is_op("relax.add")(out, annotations.setdefault("shift", is_const()))
                if act is not None:
                    out = annotations["activation"] = _activation_pattern(out, act)
                name = ("tvm_ext.channel_affine" + "_concat" * concat + "_scale" * scale + "_shift" * shift
                        + (f"_{ACTIVATION_OPS[act]}" if act else ""))
                patterns.append(relax.transform.FusionPattern(name, out, annotations, check))
    patterns.sort(key=lambda p: -p.name.count("_"))
    return patterns


def affine_of(func: relax.Function) -> tuple[list[int], tvm.ir.expr.GenericConst | None,
                                             tvm.ir.expr.GenericConst | None, Activation | None]:
    """Read a channel-affine composite: the params it concatenates (one if it does not), its
    scale and shift constants and its activation. Either operand order of the multiply and the
    add; anything else is an error, never a dropped operand."""
    params, value_of, expr, activation = _read_from_output(func)
    scale = shift = None

    def constant_operand(call: relax.Call) -> tuple[tvm.ir.expr.GenericConst, relax.Expr]:
        for const, other in (call.args, call.args[::-1]):
            if isinstance(const, tvm.ir.expr.GenericConst) and not isinstance(other, tvm.ir.expr.GenericConst):
                return const, other
        raise ValueError(f"tvm_ext: a channel-affine {call.op.name} has no one constant operand: {call}")

    if _is_op(expr, "relax.add"):
        shift, expr = constant_operand(expr)
        expr = value_of(expr)
    if _is_op(expr, "relax.multiply"):
        scale, expr = constant_operand(expr)
        expr = value_of(expr)
    if _is_op(expr, "relax.concat"):
        fields = expr.args[0].fields if isinstance(expr.args[0], relax.Tuple) else [expr.args[0]]
        inputs = [params.index(field) if field in params else -1 for field in fields]
    else:
        inputs = [params.index(expr) if expr in params else -1]
    if -1 in inputs:
        raise ValueError(f"tvm_ext: a channel-affine composite reads a value it does not take: {func}")
    return inputs, scale, shift, activation


def _is_op(expr: relax.Expr, *names: str) -> TypeGuard[relax.Call]:
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name in names


def _read_from_output(func: relax.Function) -> tuple[list, Callable[[relax.Expr], relax.Expr], relax.Expr,
                                                     Activation | None]:
    """A composite's params, a reader looking through its bindings, and what it returns: the
    activation it ends with (if any) and that activation's input (else the returned value)."""
    values = relax.analysis.get_var2val(func)

    def value_of(expr: relax.Expr) -> relax.Expr:
        while isinstance(expr, relax.Var) and expr in values:
            expr = values[expr]
        return expr

    body = func.body.body if isinstance(func.body, relax.SeqExpr) else func.body
    expr = value_of(body)
    found = activation_at(expr, value_of)
    if found is None:
        return list(func.params), value_of, expr, None
    return list(func.params), value_of, value_of(found[1]), found[0]


def epilogue_of(func: relax.Function) -> tuple[relax.Call, tvm.ir.expr.GenericConst | int | None, int | None,
                                               Activation | None, Mask | None]:
    """Read a fused composite function: its conv call, bias (a constant, or the index of the
    param that holds it), residual param, activation, mask.

    Walked from the output, so an add's operands may come in either order (TVM matches add as
    commutative: RegNet's `x + f(x)` puts the shortcut first); the composite's name says which
    adds it has, and the bias is the one next to the convolution. Anything else is an error,
    never a dropped operand."""
    params, value_of, expr, activation = _read_from_output(func)
    name = str(func.attrs["Composite"]).split(".")[-1].split("_")
    mask = None
    if "mask" in name:
        found = mask_of(expr, value_of) if _is_op(expr, "relax.where") else None
        if found is None or found[0] not in params:
            raise ValueError(f"tvm_ext: a fused mask epilogue is not where(y > 0, ., 0 or . * slope): {expr}")
        mask = Mask(params.index(found[0]), found[1], found[2])
        expr = value_of(expr.args[1])
    others = []  # the adds' operands from the output inwards
    while _is_op(expr, "relax.add"):
        chain = [arg for arg in expr.args if _is_op(value_of(arg), "relax.add", "relax.nn.conv2d")
                 and not isinstance(arg, tvm.ir.expr.GenericConst) and arg not in params]
        if len(chain) != 1:
            raise ValueError(f"tvm_ext: a fused epilogue add has {len(chain)} operands computed inside it: {expr}")
        others.append(expr.args[1] if expr.args[0].same_as(chain[0]) else expr.args[0])
        expr = value_of(chain[0])
    if not _is_op(expr, "relax.nn.conv2d"):
        raise ValueError(f"tvm_ext: a fused epilogue does not start at a convolution: {expr}")
    if len(others) != ("bias" in name) + ("residual" in name):
        raise ValueError(f"tvm_ext: a fused {'_'.join(name)} epilogue has {len(others)} adds: {func}")
    bias = others.pop() if "bias" in name else None
    if bias is not None and not isinstance(bias, tvm.ir.expr.GenericConst):
        if bias not in params:
            raise ValueError(f"tvm_ext: a fused epilogue adds a bias it cannot read: {bias}")
        bias = params.index(bias)
    residual = None
    if others:
        if others[0] not in params:
            raise ValueError(f"tvm_ext: a fused epilogue adds a shortcut it cannot read: {others[0]}")
        residual = params.index(others[0])
    return expr, bias, residual, activation, mask


def fusion_passes(target: tvm.target.Target) -> list[tvm.transform.Pass]:
    """Constant folding, batch-norm folding and epilogue grouping: the graph as tvm_ext sees it.

    The pipeline runs these before lowering; the dispatch report runs them to say what fuses.
    Arithmetic on constants is folded in NumPy first (weights computed in the graph: NFNet's
    standardization), then bindings are canonicalized and dead ones dropped (an importer's tuples around a
    training-mode batch norm, (y, mean, var, ...)[0], would otherwise hide y from its epilogue's
    pattern); FoldConstant then turns importer biases such as reshape(const) into constants.
    """
    return [fold_constants_in_numpy(), relax.transform.CanonicalizeBindings(), relax.transform.DeadCodeElimination(),
            relax.transform.FoldConstant(), *([conv3d_as_conv2d()] if target.kind.name == "llvm" else []),
            drop_padding_taps(), fold_batch_norm(), matmul_as_conv2d(),
            channels_last_as_nchw(layer_norm_over_channels=target.kind.name == "llvm"),
            recognise_silu(), unique_constants(), split_running_statistics(),
            relax.transform.FuseOpsByPattern(fusion_patterns(target), bind_constants=True)]


