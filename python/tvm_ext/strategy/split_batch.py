"""Run the convolutional trunk of a batch one image at a time (CPU inference).

Layer by layer, a batch's activations outgrow the caches: at batch 16 a ResNet-50 layer hands
the next one up to 51 MB, which no longer sits in L3, and its 1x1 convolutions become memory
bound (55-80 GFLOP/s instead of 100-110). One image at a time, every activation stays in L3.
The dense layers that follow keep the whole batch: there a batch is what amortizes reading the
weights (VGG-16's classifier reads 480 MB of them).

So `main(x: (N, ...))` becomes N / c calls of `main_image` (the ops before the first matmul, on
a slice of c images: one per core), a concatenation, and the rest of `main` at batch N. It applies only when every op
before the cut computes each image from that image alone; otherwise the graph is left whole,
with the reason logged.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax

from ..target import usable_cores

logger = logging.getLogger("tvm_ext")

# Ops that compute each image from that image alone (given batch-free constant operands).
_PER_IMAGE = {
    "relax.nn.conv2d", "relax.nn.max_pool2d", "relax.nn.avg_pool2d", "relax.nn.adaptive_avg_pool2d",
    "relax.nn.relu", "relax.nn.silu", "relax.nn.gelu", "relax.nn.leakyrelu", "relax.sigmoid", "relax.clip",
    "relax.add", "relax.multiply", "relax.subtract", "relax.divide", "relax.nn.batch_norm", "relax.reshape",
    "relax.flatten", "relax.mean", "relax.nn.dropout",
}


def _first_dim(expr: relax.Expr) -> int | None:
    shape = getattr(expr.ty, "shape", None)
    try:
        return int(shape[0]) if shape is not None and len(shape) else None
    except (TypeError, ValueError):
        return None


def _not_per_image(value: relax.Expr, batch: int) -> str | None:
    """Why `value` may mix images (None: it does not)."""
    if isinstance(value, (relax.TupleGetItem, relax.Var)):
        return None
    if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)):
        return f"{type(value).__name__} is not an op call"
    name, attrs = value.op.name, value.attrs
    if name not in _PER_IMAGE:
        return f"{name} may mix images"
    if name == "relax.mean" and (attrs.axis is None or 0 in [int(a) for a in attrs.axis]):
        return "mean over the batch axis"
    if name == "relax.nn.batch_norm" and bool(attrs.training):
        return "training-mode batch norm"
    if name == "relax.reshape" and (_first_dim(value.args[0]) != batch or int(value.args[1].values[0]) != batch):
        return "reshape that moves the batch axis"
    if any(isinstance(a, relax.Var) and _first_dim(a) not in (None, batch) for a in value.args):
        return f"{name} reads a tensor whose first axis is not the batch"
    rank = len(getattr(value.ty, "shape", None) or [])
    # A convolution's weight (OIHW) has no batch axis: its first axis is the output channels,
    # which may equal the batch (MobileNet-v2's 16-channel layer at batch 16).
    operands = value.args[:1] if name == "relax.nn.conv2d" else value.args
    for a in operands:
        shape = getattr(a.ty, "shape", None) if isinstance(a, tvm.ir.expr.GenericConst) else None
        if shape is not None and len(shape) == rank and _first_dim(a) == batch:
            return f"{name} reads a constant with one entry per image"
    return None


def _uses(expr: relax.Expr) -> set:
    found = set()
    relax.analysis.post_order_visit(expr, lambda e: found.add(e) if isinstance(e, relax.Var) else None)
    return found


def _substitute(expr: relax.Expr, remap: dict, batch: int | None = None) -> relax.Expr:
    """`expr` with the variables of `remap` replaced (calls, tuples, tuple items); with `batch`,
    a reshape's target shape gets that batch too."""
    if isinstance(expr, relax.Var):
        return remap.get(expr, expr)
    if isinstance(expr, relax.ShapeExpr) and batch is not None:
        return relax.ShapeExpr([batch, *list(expr.values)[1:]])
    if isinstance(expr, relax.Tuple):
        return relax.Tuple([_substitute(f, remap, batch) for f in expr.fields])
    if isinstance(expr, relax.TupleGetItem):
        return relax.TupleGetItem(_substitute(expr.tuple_value, remap, batch), expr.index)
    if isinstance(expr, relax.Call):
        return relax.Call(expr.op, [_substitute(a, remap, batch) for a in expr.args], expr.attrs, expr.ty_args)
    return expr


def split_batch(images_per_call: int | None = None) -> tvm.transform.Pass:
    """The pass; a graph it cannot split is returned unchanged.

    `images_per_call` (default: the cores this process may use, as a divisor of the batch): with
    one image per core, each thread of the pool works on an image of its own (the rows of the
    first image go to the first thread) while all of them still fit in cache.
    """

    @tvm.transform.module_pass(opt_level=0, name="tvm_ext.SplitBatch")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        func = mod["main"]
        if len(func.params) != 1 or not isinstance(func.body, relax.SeqExpr):
            return mod
        batch = _first_dim(func.params[0])
        if batch is None or batch < 2:
            return mod
        wanted = images_per_call or usable_cores()
        chunk = max(d for d in range(1, min(wanted, batch) + 1) if batch % d == 0)
        if chunk == batch:
            return mod
        bindings = [b for block in func.body.blocks for b in block.bindings]
        cut = next((i for i, b in enumerate(bindings) if isinstance(b.value, relax.Call)
                    and isinstance(b.value.op, tvm.ir.Op) and b.value.op.name == "relax.matmul"), len(bindings))
        for binding in bindings[:cut]:
            reason = _not_per_image(binding.value, batch)
            if reason is not None:
                logger.info("tvm_ext: the batch runs whole: %s", reason)
                return mod
        trunk_vars = {b.var for b in bindings[:cut]}
        used_later = set().union(*(_uses(b.value) for b in bindings[cut:]), _uses(func.body.body))
        live = [v for v in trunk_vars if v in used_later]
        if len(live) != 1 or _first_dim(live[0]) != batch or cut == 0:
            return mod
        trunk_out = live[0]

        bb = relax.BlockBuilder()
        param = func.params[0]
        image = relax.Var("image", relax.TensorType((chunk, *list(param.ty.shape)[1:]), param.ty.dtype))
        remap = {param: image}

        with bb.function("main_image", [image]):
            with bb.dataflow():
                for binding in bindings[:cut]:
                    remap[binding.var] = bb.emit(_substitute(binding.value, remap, batch=chunk))
                out = bb.emit_output(remap[trunk_out])
            bb.emit_func_output(out)
        per_image = bb.get()["main_image"]

        bb = relax.BlockBuilder(tvm.IRModule({gv: f for gv, f in mod.functions_items() if gv.name_hint != "main"}))
        image_gv = bb.add_func(per_image, "main_image")
        x = relax.Var(str(param.name), param.ty)
        attrs = {str(k): v for k, v in (func.attrs or {}).items()}
        with bb.function("main", [x], attrs=attrs or None):
            with bb.dataflow():
                outs = [bb.emit(relax.Call(image_gv, [bb.emit(relax.op.strided_slice(x, [0], [i], [i + chunk]))]))
                        for i in range(0, batch, chunk)]
                remap = {trunk_out: bb.emit(relax.op.concat(outs, axis=0))}
                for binding in bindings[cut:]:
                    remap[binding.var] = bb.emit(_substitute(binding.value, remap))
                out = bb.emit_output(_substitute(func.body.body, remap))
            bb.emit_func_output(out)
        logger.info("tvm_ext: the first %d ops run %d image(s) at a time (%d calls)", cut, chunk, batch // chunk)
        return bb.get()

    return _pass
