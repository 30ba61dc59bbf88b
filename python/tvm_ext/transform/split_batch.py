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

Late in the trunk the balance turns: the images are small (ResNet-50's 14 x 14 and 7 x 7 stages
hand on 0.2-0.8 MB an image) and the weights large (4-38 MB a layer as Winograd GEMMs), read again
for every call. From the first convolution or pooling before which one tensor is all that flows
on and after which no tensor of the trunk exceeds :data:`LATE_IMAGE_BYTES` an image, the trunk
runs :data:`LATE_IMAGES` images at a time (`main_late`, each call fed by as many `main_image`
calls), and its kernels with small outputs run the images inside each output block
(:data:`tvm_ext.kernels.conv2d.IMAGES_INSIDE_BLOCKS`): each of their weights is read once for all
of them. ResNet-50 at batch 16, 1 thread, on a Zen 1: 1.03x end to end.
"""

from __future__ import annotations

import collections
import logging
import math

import tvm
from tvm import relax

from ..target import usable_cores

logger = logging.getLogger("tvm_ext")

# The late stage: this many images per call (a divisor of the batch, at least the early stage's),
# from where no tensor of the trunk is over this many bytes an image. With 4 images the late
# stage's largest tensors (ResNet-50's 1024 x 14 x 14, 0.8 MB an image) stay in a last-level cache
# of 8 MB; at 8 its kernels gained at most 5% more, and some lost
# (:data:`~tvm_ext.kernels.conv2d.IMAGES_INSIDE_BLOCKS`).
LATE_IMAGES = 4
LATE_IMAGE_BYTES = 1 << 20

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


def _live_after(bindings: list, cut: int, body: relax.Expr) -> list[list[relax.Var]]:
    """For each binding of the trunk (`bindings[:cut]`), the trunk variables used after it."""
    last_use = {}
    for i, binding in enumerate(bindings):
        for var in _uses(binding.value):
            last_use[var] = i
    for var in _uses(body):
        last_use[var] = len(bindings)
    defined = {b.var: i for i, b in enumerate(bindings[:cut])}
    return [[v for v, d in defined.items() if d <= p < last_use.get(v, -1)] for p in range(cut)]


def _image_bytes(var: relax.Var) -> int | None:
    """Bytes of one image of a tensor with a static shape (None for anything else)."""
    shape = getattr(var.ty, "shape", None)
    if shape is None:
        return None
    try:
        dims = [int(d) for d in shape][1:]
    except (TypeError, ValueError):
        return None
    return math.prod(dims) * tvm.runtime.DataType(var.ty.dtype).bits // 8


def _op_name(binding) -> str:
    value = binding.value
    return value.op.name if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) else ""


# A stage starts at one of these, never between an op and the epilogue that is fused into it.
_LAYER_STARTS = {"relax.nn.conv2d", "relax.nn.max_pool2d", "relax.nn.avg_pool2d", "relax.nn.adaptive_avg_pool2d"}


def _late_start(trunk: list, live: list, batch: int) -> int | None:
    """Where the late stage starts (None: nowhere): the first convolution or pooling before which
    one batch tensor is all that flows on, and from where no tensor of the trunk is over
    LATE_IMAGE_BYTES an image; a convolution must follow."""
    sizes = [_image_bytes(b.var) or 0 for b in trunk]  # 0: not a tensor (a batch norm's tuple)
    for p in range(len(trunk) - 1):
        if max(sizes[p:]) > LATE_IMAGE_BYTES:
            continue
        if (_op_name(trunk[p + 1]) in _LAYER_STARTS and len(live[p]) == 1 and _first_dim(live[p][0]) == batch
                and _image_bytes(live[p][0]) is not None):
            return p + 1 if any(_op_name(b) == "relax.nn.conv2d" for b in trunk[p + 1:]) else None
    return None


def _stage(name: str, param: relax.Var, bindings: list, out: relax.Var, chunk: int) -> relax.Function:
    """`bindings` as the function `name` of `param` at `chunk` images, returning `out`."""
    image = relax.Var("image", relax.TensorType((chunk, *list(param.ty.shape)[1:]), param.ty.dtype))
    remap = {param: image}
    bb = relax.BlockBuilder()
    with bb.function(name, [image]):
        with bb.dataflow():
            for binding in bindings:
                remap[binding.var] = bb.emit(_substitute(binding.value, remap, batch=chunk))
            result = bb.emit_output(remap[out])
        bb.emit_func_output(result)
    return bb.get()[name]


def split_batch(images_per_call: int | None = None) -> tvm.transform.Pass:
    """The pass; a graph it cannot split is returned unchanged.

    `images_per_call` (default: the cores this process may use, as a divisor of the batch): with
    one image per core, each thread of the pool works on an image of its own (the rows of the
    first image go to the first thread) while all of them still fit in cache. The late stage runs
    the largest divisor of the batch up to max(LATE_IMAGES, images_per_call) that is a multiple of
    it, if that is more than `images_per_call` and at least LATE_IMAGES; where it is the whole
    batch, the late ops stay in `main`.
    """

    @tvm.transform.module_pass(opt_level=0, name="tvm_ext.SplitBatch")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if "main" not in [gvar.name_hint for gvar in mod.get_global_vars()]:  # e.g. a training module
            return mod
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
        cut = next((i for i, b in enumerate(bindings) if _op_name(b) == "relax.matmul"), len(bindings))
        for binding in bindings[:cut]:
            reason = _not_per_image(binding.value, batch)
            if reason is not None:
                logger.info("tvm_ext: the batch runs whole: %s", reason)
                return mod
        trunk = bindings[:cut]
        live = _live_after(bindings, cut, func.body.body)
        if cut == 0 or len(live[-1]) != 1 or _first_dim(live[-1][0]) != batch:
            return mod
        late_chunk = max(d for d in range(chunk, min(max(LATE_IMAGES, chunk), batch) + 1)
                         if batch % d == 0 and d % chunk == 0)
        # Fewer than LATE_IMAGES images a call would keep every image outer: no late stage then.
        late = _late_start(trunk, live, batch) if late_chunk > chunk and late_chunk >= LATE_IMAGES else None
        early_end = cut if late is None else late
        early_out, trunk_out = live[early_end - 1][0], live[-1][0]

        bb = relax.BlockBuilder(tvm.IRModule({gv: f for gv, f in mod.functions_items() if gv.name_hint != "main"}))
        param = func.params[0]
        early_gv = bb.add_func(_stage("main_image", param, trunk[:early_end], early_out, chunk), "main_image")
        late_gv = None
        if late is not None and late_chunk < batch:
            late_gv = bb.add_func(_stage("main_late", early_out, trunk[late:], trunk_out, late_chunk), "main_late")
        x = relax.Var(str(param.name), param.ty)
        attrs = {str(k): v for k, v in (func.attrs or {}).items()}
        with bb.function("main", [x], attrs=attrs or None):
            with bb.dataflow():
                def early(first: int, images: int) -> relax.Var:
                    calls = [bb.emit(relax.Call(early_gv, [bb.emit(relax.op.strided_slice(x, [0], [i], [i + chunk]))]))
                             for i in range(first, first + images, chunk)]
                    return bb.emit(relax.op.concat(calls, axis=0))

                if late_gv is None:  # the late ops, if any, run at the whole batch
                    remap, rest = {early_out: early(0, batch)}, bindings[early_end:]
                else:
                    groups = [bb.emit(relax.Call(late_gv, [early(i, late_chunk)])) for i in range(0, batch, late_chunk)]
                    remap, rest = {trunk_out: bb.emit(relax.op.concat(groups, axis=0))}, bindings[cut:]
                for binding in rest:
                    remap[binding.var] = bb.emit(_substitute(binding.value, remap))
                out = bb.emit_output(_substitute(func.body.body, remap))
            bb.emit_func_output(out)
        logger.info("tvm_ext: the first %d ops run %d image(s) at a time (%d calls)", early_end, chunk, batch // chunk)
        if late is not None:
            logger.info("tvm_ext: the next %d ops run %d images at a time (%d calls)", cut - late, late_chunk,
                        batch // late_chunk)
        return bb.get()

    return _pass


def runs_per_inference(mod: tvm.IRModule) -> collections.Counter:
    """How often one call of `main` runs each function it reaches: a Relax function (`main_image`
    once per slice of the batch) as often as its callers call it, a PrimFunc as often as its
    `call_tir`s in each Relax function run."""
    relax_funcs = {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, relax.Function)}
    calls: dict[str, collections.Counter] = {}
    for name, func in relax_funcs.items():
        counter = calls[name] = collections.Counter()

        def visit(e, counter=counter) -> None:
            if not isinstance(e, relax.Call):
                return
            if isinstance(e.op, tvm.ir.Op) and e.op.name == "relax.call_tir":
                counter[e.args[0].name_hint] += 1
            elif isinstance(e.op, tvm.ir.GlobalVar) and e.op.name_hint in relax_funcs:
                counter[e.op.name_hint] += 1

        relax.analysis.post_order_visit(func, visit)
    runs: collections.Counter = collections.Counter()

    def walk(name: str, times: int) -> None:
        for callee, n in calls[name].items():
            runs[callee] += times * n
            if callee in calls:
                walk(callee, times * n)

    walk("main", 1)
    return runs
