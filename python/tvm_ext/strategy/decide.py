"""The one decision: which tvm_ext kernel serves a Relax op on a target, or why stock TVM keeps
it. Fusion, lowering, legalization and the dispatch report all ask it."""

from __future__ import annotations

import dataclasses

import tvm
from tvm import relax

from ..kernels import conv2d as _conv
from ..kernels import conv2d_backward_weight as _weight_grad
from ..kernels import pool2d as _pool
from ..kernels import winograd as _winograd
from ..kernels.common import ACTIVATIONS
from ..relax_info import DATA_MOVEMENT_OPS, dtype, image_shape, known_shape, shape_text, static_shape, symbolic_batch
from ..target import amx_permitted, bf16_dot_doubles_fma, has_amx_bf16, has_avx512_bf16, vector_isa
from .base import ACTIVATION_OPS, POOLS, Decision, channel_scale_operands, is_relu6, pool_workload
from .cpu_engine import maxdnn_decision
from .cuda_engine import FUSED_ACTIVATIONS, conv2d_decision

__all__ = ["PRECISIONS", "bf16_conv2d_reason", "channel_affine_reason", "decide", "emulation_reason",
           "epilogue_activation", "is_weight_gradient"]


PRECISIONS = ("fp32", "bf16")


def decide(call: relax.Call, target: tvm.target.Target, engine: str = "ffma", winograd: bool = True,
           precision: str = "fp32", maxdnn: str = "auto") -> Decision:
    """The kernel for `call` on `target`, or why stock TVM keeps it (`engine`: CUDA's
    convolution engine, see :func:`tvm_ext.strategy.cuda_engine.engine_for`; `winograd`: whether a
    convolution with constant weights may run as Winograd, :mod:`tvm_ext.kernels.winograd` and
    :mod:`tvm_ext.kernels.cuda.winograd`; `precision` "bf16": a CPU convolution may run in
    bfloat16 (AMX, AVX512-BF16 where it beats fp32, else emulated on FMA: :func:`bf16_engine`),
    :func:`bf16_conv2d_reason`; `maxdnn`:
    whether a CPU convolution may run on the maxDNN tile,
    :func:`tvm_ext.strategy.cpu_engine.maxdnn_decision`)."""
    op = call.op.name if isinstance(call.op, tvm.ir.Op) else str(call.op)
    tensors = [arg for arg in call.args if isinstance(arg.ty, relax.TensorType)]
    shapes = tuple(shape_text(arg) for arg in tensors)
    if op in POOLS or op in ACTIVATION_OPS or op == "relax.mean":
        return _decide_pool_or_activation(call, op, shapes, tensors, target)
    scaled = channel_scale_operands(call) if op == "relax.multiply" else None
    if scaled is not None:
        return _decide_channel_scale(scaled, shapes, target)
    if op == "relax.concat":
        return _decide_concat(call, target)
    if op in POOL_GRADIENTS:
        return _decide_pool2d_backward(call, shapes, target)
    if op == "relax.nn.layer_norm":
        return _decide_layer_norm(call, shapes, target)
    if op == "relax.nn.batch_norm" and bool(call.attrs.training):
        return _decide_batch_norm_training(call, shapes, target)
    if op in DATA_MOVEMENT_OPS:
        return Decision(op, shapes, None, "data movement only (a reshape is a view): stock TVM")
    if op != "relax.nn.conv2d":
        return Decision(op, shapes, None, "no tvm_ext kernel for this op yet")
    attrs = call.attrs
    layouts = (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout))
    if layouts == WEIGHT_GRADIENT_LAYOUTS:
        return _decide_weight_gradient(call, shapes, target, engine)
    if layouts != ("NCHW", "OIHW", "NCHW"):
        return Decision(op, shapes, None, f"layout {attrs.data_layout}/{attrs.kernel_layout} is not NCHW/OIHW")
    out_dtype = str(attrs.out_dtype)
    out_dtype = dtype(call.args[0]) if out_dtype in ("", "None", "void") else out_dtype
    dtypes = {dtype(call.args[0]), dtype(call.args[1]), out_dtype}
    if dtypes != {"float32"}:
        return Decision(op, shapes, None, f"dtype {sorted(dtypes)} is not float32")
    static = [_shape_on(target, tensors[0]), static_shape(tensors[1])]
    if any(s is None for s in static):
        return Decision(op, shapes, None, _SYMBOLIC)
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
        kernel, reason, cuda_plan = conv2d_decision(wl, engine, winograd)
        return Decision(op, shapes, kernel, reason, cuda_plan)
    bf16 = None
    if precision == "bf16":
        bf16 = bf16_conv2d_reason(wl, call.args[1], target)
        bf16_on = bf16_engine(target)
        if bf16 is None and bf16_on != "amx" and winograd and not _winograd.eligible(wl):
            # (ResNet-50 on Zen 4, batch 1 and 8: 8% and 5% faster with its 3x3 layers so; on FMA
            # emulated bf16 runs at fp32's rate)
            bf16 = f"Winograd's fewer multiplies beat {BF16_ENGINES[bf16_on]}"
        if bf16 is None:  # an odd channel count (an RGB stem) gets a zero channel: pairs
            paired = dataclasses.replace(wl, C=wl.C + wl.C % 2, dtype="bfloat16")
            plan = _conv.plan_conv2d(paired, vector_isa(target), engine=bf16_on)
            why = "" if bf16_on != "emulated" else f" ({emulation_reason(target)})"
            return Decision(op, shapes, f"{plan.kind}_conv2d",
                            f"{BF16_ENGINES[bf16_on]}{why}, fp32 accumulation and output", plan)
        bf16 = f"fp32 ({bf16})"
    plan = _conv.plan_conv2d(wl, vector_isa(target))
    winograd_plan = _winograd.winograd_plan(wl, vector_isa(target)) if winograd and not _winograd.eligible(wl) else None
    why = ""
    if symbolic_batch(tensors[0]) is None:
        tile, why = maxdnn_decision(wl, vector_isa(target), plan, winograd_plan,
                                    isinstance(call.args[1], tvm.ir.Constant), maxdnn)
        if tile is not None:
            return Decision(op, shapes, "maxdnn_conv2d", "; ".join(p for p in (bf16, why) if p), tile)
    plan = winograd_plan or plan
    reason = "; ".join(part for part in (bf16, plan.reason, why, _per_image(tensors[0])) if part)
    return Decision(op, shapes, f"{plan.kind}_conv2d", reason, plan)


# the bfloat16 convolution's engines, as dispatch_report names them
BF16_ENGINES = {"amx": "bf16 on AMX tiles", "fma": "bf16 on AVX512-BF16 vdpbf16ps",
                "emulated": "bf16 emulated on fp32 FMA"}


def bf16_engine(target: tvm.target.Target) -> str:
    """The engine a bfloat16 convolution runs on for `target`: AMX tiles where the CPU has them
    and the OS grants them, else `vdpbf16ps` vectors where they beat fp32
    (:func:`~tvm_ext.target.bf16_dot_doubles_fma`: Zen 4 and later), else "emulated": the same
    bf16 arithmetic on FMA (:data:`~tvm_ext.intrin.cpu.EMULATED_BF16`), at about fp32's rate."""
    if has_amx_bf16(target) and amx_permitted():
        return "amx"
    return "fma" if bf16_dot_doubles_fma(target) else "emulated"


def emulation_reason(target: tvm.target.Target) -> str:
    """Why bfloat16 is emulated on `target` (:func:`bf16_engine` says "emulated")."""
    if has_amx_bf16(target):
        return "the OS does not let this process use AMX tiles (arch_prctl refused)"
    if has_avx512_bf16(target):
        return "the CPU has no AMX-BF16, and its AVX512-BF16 is no faster than fp32"
    return "the CPU has neither AMX-BF16 nor AVX512-BF16"


def bf16_conv2d_reason(wl: _conv.Conv2dWorkload, weight: relax.Expr, target: tvm.target.Target) -> str | None:
    """Why the float32 convolution `wl` does not run in bfloat16 on `target` (`precision="bf16"`),
    or None: the kernel (on :func:`bf16_engine`'s engine) needs a dense convolution (an odd
    channel count gets a zero channel) and constant weights (rounded and packed at build time)."""
    if not isinstance(weight, tvm.ir.Constant):
        return "run-time weights"
    if wl.groups == 1 and wl.C % 2:  # (a zero channel pairs the last one)
        wl = dataclasses.replace(wl, C=wl.C + 1)
    return _conv.low_precision_reason(dataclasses.replace(wl, dtype="bfloat16"), vector_isa(target),
                                      bf16_engine(target))


POOL_GRADIENTS = {"relax.grad.max_pool2d_backward": "max", "relax.grad.avg_pool2d_backward": "avg"}


def pool2d_backward_workload(call: relax.Call) -> _pool.Pool2dWorkload:
    """The pooling whose gradient `call` (relax.grad.{max,avg}_pool2d_backward(dY, X, ...)) is."""
    attrs, mode = call.attrs, POOL_GRADIENTS[call.op.name]
    shape = known_shape(static_shape(call.args[1]), f"{mode}_pool2d_backward: the data")
    return _pool.Pool2dWorkload.make(shape, mode, [int(v) for v in attrs.pool_size], [int(v) for v in attrs.strides],
                                     [int(v) for v in attrs.padding], [int(v) for v in attrs.dilation],
                                     bool(attrs.ceil_mode), mode == "max" or bool(attrs.count_include_pad))


def _decide_pool2d_backward(call: relax.Call, shapes: tuple, target: tvm.target.Target) -> Decision:
    op, attrs = call.op.name, call.attrs
    if target.kind.name not in ("llvm", "cuda"):
        return Decision(op, shapes, None, f"no tvm_ext pooling gradient on {target.kind.name}")
    if (str(attrs.layout), str(attrs.out_layout)) != ("NCHW", "NCHW"):
        return Decision(op, shapes, None, f"layout {attrs.layout} is not NCHW")
    if {dtype(arg) for arg in call.args} != {"float32"}:
        return Decision(op, shapes, None, "not float32")
    if static_shape(call.args[0]) is None or static_shape(call.args[1]) is None:
        return Decision(op, shapes, None, _SYMBOLIC)
    try:
        wl = pool2d_backward_workload(call)
    except ValueError as err:
        return Decision(op, shapes, None, str(err))
    if (wl.N, wl.C, wl.OH, wl.OW) != static_shape(call.args[0]):
        return Decision(op, shapes, None, f"dY {static_shape(call.args[0])} is not the pooling's output")
    return Decision(op, shapes, f"{wl.mode}_pool2d_backward")


# conv2d(x, dY) with these layouts is the weight gradient of the convolution of x that gave dY
# (relax.transform.Gradient's form, and tvm_ext's, see transform.gradients): x read as CNHW
# (the images are the reduced channels), dY as IOHW, the output (K, C, KH, KW) as CNHW; its strides
# are the convolution's dilation and its dilation the convolution's strides.
WEIGHT_GRADIENT_LAYOUTS = ("CNHW", "IOHW", "CNHW")


def is_weight_gradient(call: relax.Call) -> bool:
    """Whether `call` is a conv2d in :data:`WEIGHT_GRADIENT_LAYOUTS` (a weight gradient)."""
    if not isinstance(call.op, tvm.ir.Op) or call.op.name != "relax.nn.conv2d":
        return False
    attrs = call.attrs
    return (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout)) == WEIGHT_GRADIENT_LAYOUTS


def _decide_weight_gradient(call: relax.Call, shapes: tuple, target: tvm.target.Target,
                            engine: str = "ffma") -> Decision:
    """A conv2d in the weight gradient's layouts: tvm_ext's X^T dY kernel (CPUs) or the maxDNN
    tile on its forward reading (CUDA) where it computes exactly this, the reason otherwise."""
    op, attrs = "relax.nn.conv2d", call.attrs
    if target.kind.name == "cuda":
        return _decide_cuda_weight_gradient(call, shapes, engine)
    if target.kind.name != "llvm":
        return Decision(op, shapes, None, f"the weight gradient has no tvm_ext kernel on {target.kind.name}")
    out_dtype = str(attrs.out_dtype)
    dtypes = {dtype(call.args[0]), dtype(call.args[1]), *([] if out_dtype in ("", "None", "void") else [out_dtype])}
    if dtypes != {"float32"}:
        return Decision(op, shapes, None, f"dtype {sorted(dtypes)} is not float32")
    if int(attrs.groups) != 1:
        return Decision(op, shapes, None, f"a weight gradient of {int(attrs.groups)} groups (the kernel takes 1)")
    x, dy, dw = static_shape(call.args[0]), static_shape(call.args[1]), static_shape(call)
    if x is None or dy is None or dw is None:
        return Decision(op, shapes, None, _SYMBOLIC)
    try:
        wl = _conv.Conv2dWorkload.make(x, dw, [int(d) for d in attrs.dilation], [int(p) for p in attrs.padding],
                                       [int(s) for s in attrs.strides], 1)
    except ValueError as err:
        return Decision(op, shapes, None, str(err))
    if wl.out_shape != tuple(dy):  # its filter taps would read rows of dY the convolution does not have
        return Decision(op, shapes, None, f"a weight gradient of {dw[2]}x{dw[3]} taps for a dY of {dy}: "
                                          "more taps than the convolution's")
    plan = _weight_grad.plan_conv2d_backward_weight(wl, vector_isa(target))
    return Decision(op, shapes, "conv2d_backward_weight", "the weight gradient: X^T dY on the BRGEMM", plan)


def _weight_gradient_workload(call: relax.Call) -> _conv.Conv2dWorkload:
    """The NCHW/OIHW reading of a conv2d in the weight gradient's layouts: x^T (x's channels as
    images of its images as channels) convolved with dY^T (K filters over the images, dY's pixels
    as taps), giving dW^T. A GEMM engine without an X^T dY kernel runs dW as this forward
    convolution (its reduction: images x dY's pixels). Raises ValueError if it is not valid."""
    attrs = call.attrs
    x, dy = (known_shape(static_shape(arg), name) for arg, name in zip(call.args, ("the data", "dY"), strict=True))
    return _conv.Conv2dWorkload.make((x[1], x[0], x[2], x[3]), (dy[1], dy[0], dy[2], dy[3]),
                                     [int(s) for s in attrs.strides], [int(p) for p in attrs.padding],
                                     [int(d) for d in attrs.dilation], int(attrs.groups))


def _decide_cuda_weight_gradient(call: relax.Call, shapes: tuple, engine: str) -> Decision:
    """A weight gradient on CUDA: the maxDNN tile on its forward reading (_weight_gradient_workload)."""
    op = "relax.nn.conv2d"
    dtypes = {dtype(call.args[0]), dtype(call.args[1]), dtype(call)}
    if dtypes != {"float32"}:
        return Decision(op, shapes, None, f"dtype {sorted(dtypes)} is not float32")
    if int(call.attrs.groups) != 1:
        return Decision(op, shapes, None, f"a weight gradient of {int(call.attrs.groups)} groups (the kernel takes 1)")
    if static_shape(call.args[0]) is None or static_shape(call.args[1]) is None:
        return Decision(op, shapes, None, _SYMBOLIC)
    try:
        wl = _weight_gradient_workload(call)
    except ValueError as err:
        return Decision(op, shapes, None, str(err))
    kernel, reason, plan = conv2d_decision(wl, engine)
    return Decision(op, shapes, kernel, f"the weight gradient as a forward convolution of x^T and dY^T "
                                        f"({wl.N * wl.OH * wl.OW} columns, a reduction of {wl.C * wl.KH * wl.KW}): "
                                        + reason, plan)


def epilogue_activation(name: str, target: tvm.target.Target) -> Decision:
    """Whether a convolution's epilogue on `target` applies activation `name` (a name of
    :data:`tvm_ext.kernels.conv2d.ACTIVATIONS`): the Decision names the epilogue's kernel, or
    is None with the reason the activation stays a separate op. CPU epilogues apply every
    activation (GELU's erf vectorized: :func:`tvm_ext.kernels.vector_math.vector_erf`); CUDA's
    maxDNN epilogue applies relu and relu6 only (:data:`.cuda_engine.FUSED_ACTIVATIONS`), the
    others (GELU, SiLU, ...) run as the activation kernel after the convolution."""
    op = f"epilogue {name}"
    if target.kind.name == "cuda" and name not in FUSED_ACTIVATIONS:
        return Decision(op, (), None, f"the CUDA convolution epilogue applies {', '.join(FUSED_ACTIVATIONS)} only: "
                                      f"{name} runs as a separate activation kernel")
    if name not in ACTIVATIONS:
        return Decision(op, (), None, f"no epilogue applies {name}")
    return Decision(op, (), "conv2d epilogue")


_SYMBOLIC = ("symbolic shape: tvm_ext kernels are generated per static shape (on CPUs a symbolic batch is run "
             "image by image; a symbolic height or width is not)")


def _shape_on(target: tvm.target.Target, tensor: relax.Expr) -> tuple | None:
    """The shape a kernel is generated for: the static shape, or on CPUs one image of a symbolic
    batch (the kernel then runs over the batch: :mod:`tvm_ext.kernels.batch_loop`)."""
    return image_shape(tensor) if target.kind.name == "llvm" else static_shape(tensor)


def _per_image(tensor: relax.Expr) -> str:
    batch = symbolic_batch(tensor)
    return "" if batch is None else f"per image over the symbolic batch {batch}"


def channel_affine_reason(data: relax.Expr) -> str | None:
    """Why :mod:`tvm_ext.kernels.channel_affine` cannot take tensor `data` (None if it can): an
    NCHW tensor (:func:`_nchw_reason`) whose channels fill float32 vectors of 8 (fewer make
    narrow vectors: ShuffleNet's 58-channel halves stay with stock TVM)."""
    reason = _nchw_reason(data)
    if reason is None and known_shape(image_shape(data), "an NCHW tensor")[1] % 8:
        return f"{known_shape(image_shape(data), 'an NCHW tensor')[1]} channels are not a multiple of 8"
    return reason


def _nchw_reason(data: relax.Expr) -> str | None:
    """Why `data` is not a float32 NCHW tensor of static shape (or a symbolic batch) with
    elements, which the blocked kernels take; None if it is."""
    shape = image_shape(data) if isinstance(data.ty, relax.TensorType) else None
    if shape is None:
        return _SYMBOLIC if isinstance(data.ty, relax.TensorType) else "not a tensor"
    if dtype(data) != "float32":
        return f"dtype {dtype(data)} is not float32"
    if len(shape) != 4:
        return f"a {len(shape)}-D tensor (NCHW only)"
    if 0 in shape:
        return "empty tensor (a dimension is 0): nothing to compute"
    return None


def _decide_concat(call: relax.Call, target: tvm.target.Target) -> Decision:
    op, fields = "relax.concat", call.args[0]
    if not isinstance(fields, relax.Tuple):
        return Decision(op, (), None, "a concatenation of a tuple value, not of listed tensors")
    shapes = tuple(shape_text(field) for field in fields.fields)
    if target.kind.name != "llvm":
        return Decision(op, shapes, None, "no CUDA concatenation kernel yet (data movement: stock TVM)")
    if call.attrs.axis is None or int(call.attrs.axis) % 4 != 1:
        return Decision(op, shapes, None, "a concatenation along an axis other than the channels")
    for field in fields.fields:
        reason = channel_affine_reason(field)
        if reason is not None:
            return Decision(op, shapes, None, f"an input: {reason}")
    images = {_image_of(field) for field in (*fields.fields, call)}
    batches = {str(symbolic_batch(field)) for field in (*fields.fields, call)}
    if len(images) != 1 or len(batches) != 1:
        return Decision(op, shapes, None, "inputs of different batches or images")
    return Decision(op, shapes, "channel_affine", _per_image(fields.fields[0]))


def _decide_layer_norm(call: relax.Call, shapes: tuple, target: tvm.target.Target) -> Decision:
    op, data = "relax.nn.layer_norm", call.args[0]
    if target.kind.name != "llvm":
        return Decision(op, shapes, None, "no CUDA layer norm kernel yet")
    reason = _nchw_reason(data)
    if reason is not None:
        return Decision(op, shapes, None, reason)
    if [int(a) % 4 for a in call.attrs.axes] != [1]:
        return Decision(op, shapes, None, "a layer norm over other axes than the channels "
                                          "(ConvNeXt's channels-last one is moved to them on CPUs)")
    channels = known_shape(image_shape(data), "layer_norm: the data")[1]
    if any(dtype(arg) != "float32" or static_shape(arg) != (channels,) for arg in call.args[1:3]):
        return Decision(op, shapes, None, "gamma and beta are not float32 vectors of one value per channel")
    return Decision(op, shapes, "layer_norm", _per_image(data))


def _decide_batch_norm_training(call: relax.Call, shapes: tuple, target: tvm.target.Target) -> Decision:
    """A batch norm with batch statistics (training mode): tvm_ext's blocked kernel
    (:mod:`tvm_ext.kernels.batch_norm`; on CUDA :mod:`tvm_ext.kernels.cuda.batch_norm`) for a
    static NCHW float32 tensor."""
    op, data = "relax.nn.batch_norm", call.args[0]
    if target.kind.name not in ("llvm", "cuda"):
        return Decision(op, shapes, None, f"no training-mode batch norm kernel on {target.kind.name}")
    reason = _nchw_reason(data)
    if reason is None and static_shape(data) is None:  # the statistics reduce over the batch: not per image
        reason = _SYMBOLIC
    if reason is not None:
        return Decision(op, shapes, None, reason)
    if int(call.attrs.axis) % 4 != 1:
        return Decision(op, shapes, None, f"a batch norm over axis {int(call.attrs.axis)}, not the channels")
    channels = known_shape(image_shape(data), "batch_norm: the data")[1]
    if any(dtype(arg) != "float32" or static_shape(arg) != (channels,) for arg in call.args[1:5]):
        return Decision(op, shapes, None, "gamma, beta and the running statistics are not float32 vectors of "
                                          "one value per channel")
    return Decision(op, shapes, "batch_norm_training")


def _image_of(tensor: relax.Expr) -> tuple | None:
    """(N, H, W) of a 4-D tensor (one image's N for a symbolic batch)."""
    shape = image_shape(tensor)
    return None if shape is None or len(shape) != 4 else (shape[0], *shape[2:])


def _decide_channel_scale(operands: tuple[relax.Expr, relax.Expr], shapes: tuple,
                          target: tvm.target.Target) -> Decision:
    op = "relax.multiply"
    x, s = operands
    if {dtype(x), dtype(s)} != {"float32"}:
        return Decision(op, shapes, None, f"dtype {sorted({dtype(x), dtype(s)})} is not float32")
    x_shape = _shape_on(target, x)
    if target.kind.name != "llvm" or x_shape is None or _shape_on(target, s) is None:
        return Decision(op, shapes, None, _SYMBOLIC if target.kind.name == "llvm" else "no CUDA channel scale yet")
    if 0 in x_shape:
        return Decision(op, shapes, None, "empty tensor (a dimension is 0): nothing to compute")
    return Decision(op, shapes, "channel_scale", _per_image(x))


def _decide_pool_or_activation(call: relax.Call, op: str, shapes: tuple, tensors: list,
                               target: tvm.target.Target) -> Decision:
    static = _shape_on(target, tensors[0])
    if dtype(tensors[0]) != "float32":
        return Decision(op, shapes, None, f"dtype {dtype(tensors[0])} is not float32")
    if static is None:
        return Decision(op, shapes, None, _SYMBOLIC)
    if 0 in static:
        return Decision(op, shapes, None, "empty tensor (a dimension is 0): nothing to compute")
    if op == "relax.mean":
        axes = sorted(int(a) % len(static) for a in (call.attrs.axis or []))
        if len(static) != 4 or axes != [2, 3]:
            return Decision(op, shapes, None, "mean over axes other than H and W of a 4-D tensor")
        return Decision(op, shapes, "global_avg_pool2d", _per_image(tensors[0]))
    if op in ACTIVATION_OPS:
        if op == "relax.clip" and not is_relu6(call):
            return Decision(op, shapes, None, "clip other than relu6 (0, 6)")
        return Decision(op, shapes, ACTIVATION_OPS[op], _per_image(tensors[0]))
    attrs = call.attrs
    if str(attrs.layout) != "NCHW" or str(attrs.out_layout) != "NCHW" or len(static) != 4:
        return Decision(op, shapes, None, f"layout {attrs.layout} is not NCHW")
    if POOLS[op] == "global":
        if [int(v) for v in attrs.output_size or []] != [1, 1]:
            return Decision(op, shapes, None, "adaptive pooling to a size other than 1x1")
        return Decision(op, shapes, "global_avg_pool2d", _per_image(tensors[0]))
    if POOLS[op] == "avg" and bool(attrs.ceil_mode):
        return Decision(op, shapes, None, "avg_pool2d with ceil_mode (divisor rules differ between frameworks)")
    try:
        pool_workload(call, static)
    except ValueError as err:
        return Decision(op, shapes, None, str(err))
    return Decision(op, shapes, f"{POOLS[op]}_pool2d", _per_image(tensors[0]))
