"""`dispatch_report`: which tvm_ext kernel serves each op of a network, or why stock TVM does.

It reads the decisions (:func:`tvm_ext.strategy.decide.decide`) on the module as the pipeline
fuses it (:func:`tvm_ext.strategy.fusion.fusion_passes`), so that it names the kernels a
:func:`tvm_ext.build` of the same module runs, fused epilogues included.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TypeGuard

import tvm
from tvm import relax

from .errors import UnsupportedError
from .pipeline import check_images_per_call, check_precision, quantized_rewrites
from .relax_info import static_shape
from .strategy.base import Decision
from .strategy.cpu_engine import check_maxdnn
from .strategy.cuda_engine import engine_for
from .strategy.decide import decide
from .strategy.dispatch import batch_norm_gradients, weight_and_bias_gradients
from .strategy.fusion import fusion_passes, mask_of
from .strategy.quantized import FUSED_ADD, int8_kernel, lower_quantized_conv2d, quantized_conv2d_decisions
from .strategy.quantized_norms import QUANTIZED_LAYER_NORM_KERNEL
from .strategy.quantized_tables import LOOKUP_KERNEL
from .target import TargetLike, resolve_target
from .transform.gradients import read_phase_interleave
from .transform.split_batch import runs_per_inference, split_batch

logger = logging.getLogger("tvm_ext")


@dataclasses.dataclass(frozen=True)
class DispatchRow:
    op: str
    shapes: tuple
    kernel: str
    reason: str
    runs: int = 1  # calls per inference: a batch's trunk runs once per slice of images (split_batch)


class DispatchReport(list):
    """One row per op the build lowers: what serves it. Prints as a table (with a "runs" column
    where the batch is split)."""

    def __str__(self) -> str:
        split = any(r.runs > 1 for r in self)
        header = ("op", "input shapes", *(("runs",) if split else ()), "kernel", "reason")
        rows = [header] + [(r.op, " ".join(str(s) for s in r.shapes), *((f"x{r.runs}",) if split else ()),
                            r.kernel, r.reason) for r in self]
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
        return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                         for row in rows)


def _is_call(expr) -> TypeGuard[relax.Call]:
    return isinstance(expr, relax.Call)


def _is_call_to(expr, op: str) -> TypeGuard[relax.Call]:
    return _is_call(expr) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == op


def _quantized_matmul_shapes(found, values: dict) -> tuple | None:
    """((M, K), (K, N)) of a quantized convolution that quantized_matmul_as_conv2d made of a
    dense layer (its image a 2-D matrix, transposed or not, reshaped to (1, K, 1, M)), else None."""
    value = values.get(found.data) if isinstance(found.data, relax.Var) else None
    if not _is_call_to(value, "relax.reshape"):
        return None
    source = value.args[0]
    inner = values.get(source) if isinstance(source, relax.Var) else None
    source = inner.args[0] if _is_call_to(inner, "relax.permute_dims") else source
    image, matrix = static_shape(found.data), static_shape(source)
    if image is None or matrix is None or len(matrix) != 2 or image[0] != 1 or image[2] != 1:
        return None
    _, k, _, m = image
    return (m, k), (k, found.weight.shape[0])


def dispatch_report(mod: tvm.IRModule, target: TargetLike = None, *, images_per_call: int | None = None,
                    tensor_cores: bool | str = False, winograd: bool = True,
                    function: str = "main", precision: str = "fp32", maxdnn: str = "auto") -> DispatchReport:
    """Which tvm_ext kernel serves each op of `mod[function]` on `target`, or why stock TVM does
    (`function`: e.g. "main_adjoint", the forward and backward pass relax.transform.Gradient adds).

    Ops fused into a convolution's epilogue are reported as served by that kernel.
    `images_per_call`, `tensor_cores`, `winograd`, `precision`, `maxdnn`: as for :func:`build`, so the report names the
    kernels the build uses. On CPUs a batch's trunk runs a few images a call
    (:mod:`tvm_ext.transform.split_batch`): its ops are reported with the shapes of one call and
    how many calls an inference makes (`runs`); the slicing and concatenation the split adds
    are not reported.
    """
    check_images_per_call(images_per_call)
    check_precision(precision)
    check_maxdnn(maxdnn)
    resolved = resolve_target(target)
    engine = engine_for(tensor_cores, resolved if resolved.kind.name == "cuda" else None)
    if tensor_cores and resolved.kind.name != "cuda":
        raise UnsupportedError("dispatch_report: tensor_cores applies to CUDA targets")
    int8_rows = []  # the quantized convolutions the int8 kernels run, in program order
    if resolved.kind.name == "llvm" and function in [gvar.name_hint for gvar in mod.get_global_vars()]:
        mod = tvm.transform.Sequential(quantized_rewrites(resolved))(mod)
        values = relax.analysis.get_var2val(mod[function])
        for found, reason in quantized_conv2d_decisions(mod[function], resolved).values():
            if reason is None:
                matmul = _quantized_matmul_shapes(found, values)
                int8_rows.append((DispatchRow("matmul" if matmul else "nn.conv2d",
                                              matmul or (static_shape(found.data), found.weight.shape),
                                              int8_kernel(found, resolved),
                                              f"quantized (QDQ): uint8 data, int8 weights, {found.out_dtype} out"
                                              + (" (a dense layer as a 1x1 convolution)" if matmul else "")),
                                  found.residual is not None))
            else:
                logger.info("tvm_ext: a quantized conv2d stays in float: %s", reason)
        with resolved:
            mod = lower_quantized_conv2d(resolved)(mod)
    if resolved.kind.name != "cuda":  # the pipeline splits the batch on CPUs only
        mod = split_batch(images_per_call)(mod)
    with resolved:
        fused = tvm.transform.Sequential(fusion_passes(resolved))(mod)
    report = DispatchReport()
    if function not in [gvar.name_hint for gvar in fused.get_global_vars()]:
        raise ValueError(f"dispatch_report: the module has no function {function!r}")
    stages = _stage_runs(fused) if function == "main" else {function: 1}

    def report_function(name: str, runs: int) -> None:
        func = fused[name]
        bindings = relax.analysis.get_var2val(func)
        plumbing = _split_plumbing(func, bindings, stages) if name == "main" else []
        pairs = weight_and_bias_gradients(func, resolved) if resolved.kind.name == "llvm" else {}
        bias_sums = [bindings[db_var] for _, db_var, _ in pairs.values()]
        interleaves = _phase_interleaves(bindings, fused, resolved)
        # (each chain is listed under its three results)
        chains = {dx: chain for chain, dx in batch_norm_gradients(func).values()}
        norm_gradients = [call for chain in chains.values() for call in chain.calls]

        def reshaped_matrix(expr: relax.Expr, transposed: bool) -> bool:
            """Whether `expr` is a reshape of a 2-D tensor (of a transposed one, if `transposed`)."""
            value = bindings.get(expr) if isinstance(expr, relax.Var) else None
            source = value.args[0] if _is_call_to(value, "relax.reshape") else None
            if transposed:
                value = bindings.get(source) if isinstance(source, relax.Var) else None
                source = value.args[0] if _is_call_to(value, "relax.permute_dims") else None
            return source is not None and len(source.ty.shape) == 2

        def matmul_shapes(data: relax.Expr, weight: relax.Expr) -> tuple | None:
            """((M, K), (K, N)) of a convolution matmul_as_conv2d made, else None: the image a
            (M, K) matrix transposed and reshaped to (1, K, 1, M) and the weights a constant, or
            the image a (K, N) matrix reshaped to (1, K, 1, N) and the weights an (M, K) one
            reshaped. (ShuffleNet's channel shuffle, a reshape of a transposed 5-D tensor, is an
            image: reported as a matmul before.)"""
            dims, w_dims = static_shape(data), static_shape(weight)
            if dims is None or w_dims is None or len(dims) != 4 or dims[0] != 1 or dims[2] != 1:
                return None
            (_, k, _, pixels), (filters, *_) = dims, w_dims
            if isinstance(weight, tvm.ir.Constant) and reshaped_matrix(data, transposed=True):
                return (pixels, k), (k, filters)
            if reshaped_matrix(data, transposed=False) and reshaped_matrix(weight, transposed=False):
                return (filters, k), (k, pixels)
            return None

        def row(call: relax.Call, fused_into: str | None = None, matmul: tuple | None = None) -> None:
            decision = decide(call, resolved, engine, winograd, precision, maxdnn)
            if matmul is not None:
                reason = "as a 1x1 convolution (a GEMM is a batch-reduce of one)"
                decision = Decision("relax.matmul", matmul, decision.kernel,
                                    reason if decision.kernel else decision.reason)
            if fused_into is not None and call.op.name not in ("relax.nn.conv2d", "relax.nn.batch_norm"):
                decision = Decision(decision.op, decision.shapes, f"{fused_into} epilogue", "fused")
            report.append(DispatchRow(decision.op.removeprefix("relax."), decision.shapes,
                                      decision.kernel or "fallback", decision.reason, runs))

        def visit(expr) -> None:
            if not isinstance(expr, relax.Call) or any(expr.same_as(p) for p in plumbing):
                return
            if _is_call_to(expr, "relax.call_tir"):  # the quantized ops' kernels (strategy.quantized)
                callee = expr.args[0].name_hint
                if callee.startswith("tvm_ext_int8_conv2d") and int8_rows:
                    int8_row, float_add = int8_rows.pop(0)
                    report.append(dataclasses.replace(int8_row, runs=runs))
                    # (FUSED_ADD ends the name, before the number a repeated kernel's name gets)
                    blocked = static_shape(expr.args[1].fields[-1]) if FUSED_ADD in callee else None
                    if blocked is not None:
                        n, blocks, h, w, block = blocked
                        report.append(DispatchRow("add", ((n, blocks * block, h, w),), "int8_conv2d epilogue", (
                            "fused: the add of this convolution's float output and a dequantized tensor, then "
                            "quantized (PT2E)" if float_add else "fused: the quantized (QDQ) add of this output "
                            "and the other operand, ONNX Runtime's QLinearAdd"), runs))
                if callee.startswith(LOOKUP_KERNEL):
                    shape = static_shape(expr.args[1].fields[0])
                    report.append(DispatchRow("elementwise", (shape,), "quantized_lookup",
                                              "an element-wise chain between quantized tensors: one lookup a value "
                                              "in a 256-entry table" + (" (on an int8 kernel's blocks)"
                                                                        if shape is not None and len(shape) == 5
                                                                        else ""), runs))
                if callee.startswith(QUANTIZED_LAYER_NORM_KERNEL):
                    report.append(DispatchRow("nn.layer_norm", (static_shape(expr.args[1].fields[0]),),
                                              "quantized_layer_norm", "between a dequantize and a quantize: on the "
                                              "quantized values, integer statistics", runs))
                for prefix, op in (("tvm_ext_quantized_add", "add"), ("tvm_ext_quantized_max_pool", "nn.max_pool2d")):
                    blocked = static_shape(expr.args[1].fields[0])
                    if callee.startswith(prefix) and blocked is not None:
                        n, blocks, h, w, block = blocked
                        report.append(DispatchRow(op, ((n, blocks * block, h, w),), prefix.removeprefix("tvm_ext_"),
                                                  "quantized (QDQ): on the int8 kernels' blocked uint8 outputs", runs))
                return
            if any(expr.same_as(part) for part in interleaves):
                report.append(DispatchRow(expr.op.name.removeprefix("relax."), (static_shape(expr),),
                                          "interleave_phases",
                                          "a strided convolution's dX from its stride phases, one kernel", runs))
            elif any(expr.same_as(part) for part in norm_gradients):
                report.append(DispatchRow(expr.op.name.removeprefix("relax."), (static_shape(expr),),
                                          "batch_norm_backward",
                                          "a training-mode batch norm's dX, dgamma and dbeta, one kernel", runs))
            elif isinstance(expr.op, tvm.ir.Op) and any(expr.same_as(summed) for summed in bias_sums):
                shapes = (static_shape(expr.args[0]), static_shape(expr))
                report.append(DispatchRow(expr.op.name.removeprefix("relax."), shapes, "conv2d_backward_weight",
                                          "the bias gradient: dY summed by its weight gradient's kernel", runs))
            elif isinstance(expr.op, tvm.ir.Op):
                row(expr, matmul=matmul_shapes(*expr.args) if expr.op.name == "relax.nn.conv2d" else None)
            elif isinstance(expr.op, tvm.ir.GlobalVar) and "Composite" in (fused[expr.op].attrs or {}):
                calls = []
                relax.analysis.post_order_visit(fused[expr.op].body,
                                                lambda e: calls.append(e) if isinstance(e, relax.Call) else None)
                if str(fused[expr.op].attrs["Composite"]).startswith("tvm_ext.channel_affine"):
                    head, *rest = calls  # post order: the concatenation (or the scale, or shift) first
                    shapes = decide(head, resolved, engine, winograd, precision, maxdnn).shapes
                    report.append(DispatchRow(head.op.name.removeprefix("relax."), shapes, "channel_affine",
                                              "", runs))
                    for call in rest:
                        row(call, "channel_affine")
                    return
                if str(fused[expr.op].attrs["Composite"]).startswith("tvm_ext.fake_quantize"):
                    for call in calls:  # (post order: the quantize, then the dequantize)
                        report.append(DispatchRow(call.op.name.removeprefix("relax."), (static_shape(call),),
                                                  "fake_quantize", "a float tensor's quantize -> dequantize in one "
                                                  "pass, on its producer's blocks where it wrote them", runs))
                    return
                heads = ("relax.nn.conv2d", "relax.grad.max_pool2d_backward", "relax.nn.batch_norm")  # the kernel
                conv = next(c for c in calls if isinstance(c.op, tvm.ir.Op) and c.op.name in heads)
                kernel = decide(conv, resolved, engine, winograd, precision, maxdnn).kernel
                params = list(fused[expr.op].params)
                matmul = matmul_shapes(*[expr.args[params.index(arg)] if arg in params else arg for arg in conv.args]
                                       ) if conv.op.name == "relax.nn.conv2d" else None
                for call in calls:
                    if isinstance(call.op, tvm.ir.Op):
                        row(call, kernel, matmul=matmul if call.same_as(conv) else None)

        relax.analysis.post_order_visit(func, visit)

    for name, runs in stages.items():
        report_function(name, runs)
    return report


def _phase_interleaves(bindings: dict, mod: tvm.IRModule, target: tvm.target.Target) -> list[relax.Call]:
    """The calls of each strided convolution's dX that the lowering turns into one
    interleave_phases kernel (`CpuEmitter.interleaved_phases`, `CudaEmitter.interleaved_phases`):
    the chain :func:`~tvm_ext.transform.gradients.read_phase_interleave` reads, and on CPUs a relu
    mask after it, where every phase with taps is a convolution on a tvm_ext kernel (fused or not)."""
    def value_of(expr):
        return bindings.get(expr) if isinstance(expr, relax.Var) else None

    def on_kernel(part) -> bool:
        call = value_of(part)
        if _is_call_to(call, "relax.nn.conv2d"):
            return decide(call, target).kernel is not None
        return (_is_call(call) and isinstance(call.op, tvm.ir.GlobalVar)
                and str((mod[call.op].attrs or {}).get("Composite", "")).startswith("tvm_ext.conv2d"))

    found: list[relax.Call] = []
    for crop in bindings.values():
        chain = read_phase_interleave(crop, value_of)
        parts = [] if chain is None else [part for part in chain.parts if part is not None]
        if chain is not None and parts and all(on_kernel(part) for part in parts):
            found += chain.calls
    if target.kind.name != "llvm":
        return found
    crops = [call for call in found if _is_call_to(call, "relax.strided_slice")]
    for where in list(bindings.values()):  # where(y > 0, dX, 0) after one: the kernel's mask
        kept = value_of(where.args[1]) if _is_call_to(where, "relax.where") else None
        if kept is None or not any(crop.same_as(kept) for crop in crops):
            continue
        condition = value_of(where.args[0])
        mask = mask_of(where, lambda e: e if value_of(e) is None else value_of(e)) if _is_call_to(
            condition, "relax.greater") else None
        if mask is not None and mask[1] == "relu":
            found += [where, condition]
    return found


def _stage_runs(mod: tvm.IRModule) -> dict[str, int]:
    """The functions a split batch runs (:mod:`~tvm_ext.transform.split_batch`), in order, with
    their calls per inference: `main_image`, `main_late`, then the rest of `main`."""
    runs = runs_per_inference(mod)
    return {**{name: runs[name] for name in ("main_image", "main_late") if runs[name]}, "main": 1}


def _split_plumbing(main: relax.Function, bindings: dict, stages: dict[str, int]) -> list[relax.Call]:
    """The calls split_batch added to `main`: the slices of the input and the concatenations of
    the stages' results (none where the batch is whole)."""
    if len(stages) == 1:
        return []
    param = main.params[0]

    def stage_result(var) -> bool:
        value = bindings.get(var) if isinstance(var, relax.Var) else None
        return _is_call(value) and isinstance(value.op, tvm.ir.GlobalVar) and value.op.name_hint in stages

    added = []
    for value in bindings.values():
        if _is_call_to(value, "relax.strided_slice") and value.args[0].same_as(param):
            added.append(value)
        elif _is_call_to(value, "relax.concat") and isinstance(value.args[0], relax.Tuple) and \
                all(stage_result(field) for field in value.args[0].fields):
            added.append(value)
    return added
