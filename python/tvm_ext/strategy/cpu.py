"""Which tvm_ext kernel serves which Relax op on LLVM CPUs, or why none does.

The strategy is a legalization map (`relax.transform.LegalizeOps(customize_legalize_map)`): a
dispatch pass that runs before stock legalization would have to re-derive every op's attributes
and shapes the way legalization does anyway, and ops we decline fall through to stock TVM's rule
simply by being returned unchanged to the default map. :func:`decide` is the single place that
takes the decision, used both by legalization and by the dispatch report.

This first version lowers each conv2d through the eager-style kernel chain (pack data, pack
weights, blocked convolution writing NCHW): weights that are constants are packed at build time
by FoldConstant. Keeping activations blocked across ops is the next step of the graph issue.
"""

from __future__ import annotations

import dataclasses
import logging

import tvm
from tvm import relax

from ..kernels import conv2d as _conv
from ..target import vector_isa

logger = logging.getLogger("tvm_ext")

# Relax's FuseOps must leave our scheduled kernels alone: kOpaque.
_OPAQUE = 8


@dataclasses.dataclass(frozen=True)
class Decision:
    """The dispatch of one op: the tvm_ext kernel serving it, or None and the reason."""

    op: str
    shapes: tuple
    kernel: str | None
    reason: str = ""
    plan: _conv.Conv2dPlan | None = None


def _static_shape(expr: relax.Expr) -> tuple | None:
    ty = expr.ty if hasattr(expr, "ty") else None
    shape = getattr(ty, "shape", None)
    if shape is None:
        return None
    try:
        return tuple(int(v) for v in shape)
    except (TypeError, ValueError):
        return None


def _dtype(expr: relax.Expr) -> str:
    return str(getattr(expr.ty, "dtype", ""))


def decide(call: relax.Call, target: tvm.target.Target) -> Decision:
    """The kernel for `call` on `target`, or why stock TVM keeps it."""
    op = call.op.name if isinstance(call.op, tvm.ir.Op) else str(call.op)
    shapes = tuple(_static_shape(arg) for arg in call.args if isinstance(arg.ty, relax.TensorType))
    if op != "relax.nn.conv2d":
        return Decision(op, shapes, None, "no tvm_ext kernel for this op yet")
    attrs = call.attrs
    if (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout)) != ("NCHW", "OIHW", "NCHW"):
        return Decision(op, shapes, None, f"layout {attrs.data_layout}/{attrs.kernel_layout} is not NCHW/OIHW")
    out_dtype = str(attrs.out_dtype)
    out_dtype = _dtype(call.args[0]) if out_dtype in ("", "None", "void") else out_dtype
    dtypes = {_dtype(call.args[0]), _dtype(call.args[1]), out_dtype}
    if dtypes != {"float32"}:
        return Decision(op, shapes, None, f"dtype {sorted(dtypes)} is not float32")
    if any(s is None for s in shapes[:2]):
        return Decision(op, shapes, None, "dynamic shape")
    if target.kind.name != "llvm":
        return Decision(op, shapes, None, f"target {target.kind.name} has no tvm_ext conv2d yet")
    try:
        wl = _conv.Conv2dWorkload.make(shapes[0], shapes[1], [int(s) for s in attrs.strides],
                                       [int(p) for p in attrs.padding], [int(d) for d in attrs.dilation],
                                       int(attrs.groups))
    except ValueError as err:
        return Decision(op, shapes, None, str(err))
    plan = _conv.plan_conv2d(wl, vector_isa(target))
    return Decision(op, shapes, f"{plan.kind}_conv2d", plan.reason, plan)


def _add_kernel(bb: relax.BlockBuilder, func: tvm.tirx.PrimFunc, name: str) -> tvm.ir.GlobalVar:
    return bb.add_func(func.with_attr("op_pattern", _OPAQUE), name)


def legalize_map(target: tvm.target.Target) -> dict:
    """The customize map for `relax.transform.LegalizeOps` on `target`."""
    lanes = vector_isa(target).lanes

    def conv2d(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        decision = decide(call, target)
        if decision.kernel is None:
            logger.info("tvm_ext: %s %s stays with stock TVM: %s", decision.op, decision.shapes, decision.reason)
            return tvm.ir.Op.get("relax.nn.conv2d").get_attr("FLegalize")(bb, call)
        plan = decision.plan
        wl = plan.wl
        tag = f"{wl.C}x{wl.H}x{wl.W}_{wl.K}x{wl.KH}x{wl.KW}"
        pack_x = _add_kernel(bb, _conv.pack_data_func(plan), f"tvm_ext_pack_data_{tag}")
        pack_w = _add_kernel(bb, _conv.pack_weight_func(plan), f"tvm_ext_pack_weight_{tag}")
        conv = _add_kernel(bb, _conv.conv2d_blocked_kernel(plan, lanes, _conv.Epilogue(nchw_out=True)),
                           f"tvm_ext_{decision.kernel}_{tag}")
        xb = bb.emit(relax.call_tir(pack_x, [call.args[0]], relax.TensorType(plan.data_shape(), "float32")))
        wb = bb.emit(relax.call_tir(pack_w, [call.args[1]], relax.TensorType(plan.weight_shape(), "float32")))
        return relax.call_tir(conv, [xb, wb], relax.TensorType((wl.N, wl.K, wl.OH, wl.OW), "float32"))

    return {"relax.nn.conv2d": conv2d}
