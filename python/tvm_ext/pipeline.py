"""Whole-network compilation through tvm_ext: `build`, `pipeline` and `dispatch_report`.

The pipeline is TVM's CPU pipeline (relax/backend/cpu_generic) with tvm_ext's strategy in front
of legalization. A batch's convolutional trunk first becomes one call per image
(:mod:`tvm_ext.transform.split_batch`: activations stay in cache). Then
:mod:`tvm_ext.transform` and :mod:`tvm_ext.strategy` fold batch norms into convolution weights, fuses conv + bias +
shortcut + activation into one kernel call, and lowers convolutions, dense layers, pooling and
activations to our kernels (stock TVM, with a reason, for the rest). Every PrimFunc left
unscheduled gets a default schedule (dlight's CPU rules, then
:class:`tvm_ext.dlight.cpu.ParallelVectorize`) instead of stock TVM's naive loops.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import TypeGuard

import tvm
from tvm import relax
from tvm.relax.backend.cpu_generic import pipeline as cpu_pipeline
from tvm.relax.backend.cuda import pipeline as cuda_pipeline
from tvm.s_tir import dlight

from .dlight import Guarded
from .dlight.cpu import ParallelVectorize
from .errors import UnsupportedError
from .kernels.common import KERNEL_ATTR
from .relax_info import static_shape
from .strategy.base import Decision
from .strategy.cuda_engine import engine_for
from .strategy.decide import decide
from .strategy.dispatch import legalize_map, lower_to_kernels
from .strategy.fusion import fusion_passes
from .target import TargetLike, resolve_target
from .transform.split_batch import runs_per_inference, split_batch


def _is_empty(func: tvm.tirx.PrimFunc) -> bool:
    """Whether a buffer of `func` has a static extent of 0 (a batch of 0 images): no iteration
    to schedule, and dlight's Reduction rule fails on one (compute_at: "not a stage pipeline")."""
    return any(isinstance(extent, tvm.tirx.IntImm) and extent.value == 0
               for param in func.params for extent in getattr(param, "shape", None) or ())


def _mark_tvm_ext_scheduled() -> tvm.transform.Pass:
    """tvm_ext kernels arrive scheduled, and empty functions need none: keep dlight away."""

    @tvm.transform.module_pass(opt_level=0, name="tvm_ext.MarkScheduled")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for gvar, func in mod.functions_items():
            if isinstance(func, tvm.tirx.PrimFunc) and (KERNEL_ATTR in func.attrs or _is_empty(func)):
                mod[gvar] = func.with_attr("tirx.is_scheduled", True)
        return mod

    return _pass


def _lowering_passes(target: tvm.target.Target, lower: tvm.transform.Pass, default_rules: list) -> list:
    """tvm_ext's kernels first (`lower`), stock legalization for what is left, fusion, then a
    default schedule (dlight `default_rules`) for every PrimFunc that has none."""
    return [
        lower,
        relax.transform.LegalizeOps(legalize_map(target)),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        _mark_tvm_ext_scheduled(),
        dlight.ApplyDefaultSchedule(*default_rules),
    ]


def check_images_per_call(images_per_call: int | None) -> None:
    """None or a positive int, checked before anything compiles (the batch split that uses it
    fails deep in tvm.compile with `max() arg is an empty sequence` otherwise)."""
    if images_per_call is not None and (isinstance(images_per_call, bool) or not isinstance(
            images_per_call, numbers.Integral) or images_per_call < 1):
        raise ValueError(f"images_per_call must be a positive int or None, got {images_per_call!r}")


def pipeline(target: TargetLike = None, database=None, images_per_call: int | None = None, *,
             tensor_cores: bool | str = False, winograd: bool = True) -> tvm.transform.Pass:
    """The Relax pipeline for `tvm.compile(mod, target, relax_pipeline=...)`.

    `images_per_call`: how many images of a batch the convolutional trunk runs at a time
    (default: one per core this process may use; best when the runtime uses that many threads,
    as TVM does by default. With 1 runtime thread, 1 is best). Its late layers, where images are
    small and weights large, run 4 images at a time (:mod:`tvm_ext.transform.split_batch`).

    `database`: tuning records (`tvm_ext.tune`'s work_dir, or a MetaSchedule Database): each
    convolution uses its best record, the others the analytic schedule. Without one, the
    records shipped for this target (tvm_ext/schedules/<target key>/) are used if there are any.

    `tensor_cores` (CUDA): convolutions run a tensor-core tile instead of the fp32 FFMA one: True
    or "tf32" (inputs read as tf32, as cuDNN does with TF32 allowed), "bf16" (inputs rounded to
    bf16; fp32 accumulation and outputs), both with mma.sync (sm_80+); "wgmma_tf32" and
    "wgmma_bf16": the same with Hopper's asynchronous warpgroup wgmma (sm_90a targets only;
    checked on the emulator and in SASS, not yet timed on a GPU).

    `winograd`: stride-1 3x3 and 5x5 convolutions with constant weights run as Winograd
    F(4x4, rxr) or F(2x2, rxr): 2.25-6x fewer multiplies, and a float32 error of about 1e-5 of
    the output's range instead of 4e-7. On CPUs (:mod:`tvm_ext.kernels.winograd`) from 32
    channels; on CUDA (:mod:`tvm_ext.kernels.cuda.winograd`, FFMA engine only) where its
    estimate beats the direct tile's. False keeps every convolution direct.
    """
    from .tuning.records import open_database, shipped_database

    check_images_per_call(images_per_call)
    resolved = resolve_target(target)
    if resolved.kind.name == "cuda":
        engine_for(tensor_cores, resolved)  # a bad value fails here, not inside the pass
        if database is not None:
            raise UnsupportedError("pipeline: tuning records apply to CPU targets only (the CUDA kernels use "
                                   "their analytic tiles)")
        return _cuda_pipeline(resolved, tensor_cores, winograd)
    if resolved.kind.name != "llvm":
        raise UnsupportedError(f"pipeline: target {resolved.kind.name} is not supported (LLVM CPUs and CUDA)")
    if tensor_cores:
        raise UnsupportedError("pipeline: tensor_cores applies to CUDA targets")
    database = shipped_database(resolved) if database is None else open_database(database)

    @tvm.transform.module_pass(opt_level=0, name="tvm_ext.Pipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with resolved:
            passes = (
                [split_batch(images_per_call)]
                + cpu_pipeline.library_dispatch_passes(resolved)
                + fusion_passes(resolved)
                + _lowering_passes(resolved, lower_to_kernels(resolved, database, winograd=winograd),
                                   [Guarded(dlight.cpu.GEMV()), Guarded(dlight.cpu.Reduction()), ParallelVectorize()])
                + cpu_pipeline.dataflow_lower_passes(resolved)
                + cpu_pipeline.finalize_passes(resolved)
            )
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def _cuda_pipeline(target: tvm.target.Target, tensor_cores: bool | str, winograd: bool) -> tvm.transform.Pass:
    """TVM's CUDA pipeline (relax/backend/cuda) with tvm_ext's strategy in front of legalization;
    what is left gets dlight's GPU schedules."""

    @tvm.transform.module_pass(opt_level=0, name="tvm_ext.CudaPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            passes = (
                cuda_pipeline.library_dispatch_passes(target)
                + fusion_passes(target)
                + _lowering_passes(target, lower_to_kernels(target, tensor_cores=tensor_cores,
                                                                             winograd=winograd),
                                   [*map(Guarded, (dlight.gpu.Matmul(), dlight.gpu.GEMV(), dlight.gpu.Reduction(),
                                                   dlight.gpu.GeneralReduction())), dlight.gpu.Fallback()])
                + cuda_pipeline.dataflow_lower_passes(target)
                + cuda_pipeline.finalize_passes(target)
            )
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def build(mod: tvm.IRModule, target: TargetLike = None, database=None,
          images_per_call: int | None = None, *, tensor_cores: bool | str = False,
          winograd: bool = True) -> relax.VMExecutable:
    """Compile a Relax module through tvm_ext; run it with `relax.VirtualMachine(ex, tvm.cpu())`
    (`tvm.cuda()` for a CUDA target; without a GPU a CUDA build still compiles, and its executable
    carries the kernels' CUDA C for inspection).

    `database`, `images_per_call`, `tensor_cores` and `winograd`: see :func:`pipeline`.
    """
    resolved = resolve_target(target)
    relax_pipeline = pipeline(resolved, database, images_per_call, tensor_cores=tensor_cores, winograd=winograd)
    if resolved.kind.name == "llvm":
        with _without_gpu_passes():
            return tvm.compile(mod, resolved, relax_pipeline=relax_pipeline)
    if resolved.kind.name == "cuda":
        from .kernels.cuda.toolchain import cuda_source_only, prepare_device_compile

        if not tvm.cuda(0).exist:
            with cuda_source_only():  # no GPU: the executable carries the kernels' CUDA C, to inspect
                return tvm.compile(mod, resolved, relax_pipeline=relax_pipeline)
        prepare_device_compile()
    return tvm.compile(mod, resolved, relax_pipeline=relax_pipeline)


# TIR passes of TVM's default pipeline that act on GPU constructs only (permuted shared-memory
# layouts, virtual threads), yet walk every expression: with GELU's erf in an epilogue each took
# 0.24-0.28 s of a convolution's 2.2 s to lower (ConvNeXt: four such kernels).
_GPU_ONLY_TIR_PASSES = ("s_tir.InjectPermutedLayout", "s_tir.InjectVirtualThread")


def _without_gpu_passes() -> tvm.transform.PassContext:
    """The current PassContext (opt level, config, instruments kept) with the GPU-only TIR passes
    disabled, for an LLVM CPU build."""
    current = tvm.transform.PassContext.current()
    return tvm.transform.PassContext(
        opt_level=current.opt_level, required_pass=list(current.required_pass),
        disabled_pass=[*current.disabled_pass, *_GPU_ONLY_TIR_PASSES], instruments=list(current.instruments),
        config=dict(current.config))


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


def dispatch_report(mod: tvm.IRModule, target: TargetLike = None, *, images_per_call: int | None = None,
                    tensor_cores: bool | str = False, winograd: bool = True) -> DispatchReport:
    """Which tvm_ext kernel serves each op of `mod["main"]` on `target`, or why stock TVM does.

    Ops fused into a convolution's epilogue are reported as served by that kernel.
    `images_per_call`, `tensor_cores`, `winograd`: as for :func:`build`, so the report names the
    kernels the build uses. On CPUs a batch's trunk runs a few images a call
    (:mod:`tvm_ext.transform.split_batch`): its ops are reported with the shapes of one call and
    how many calls an inference makes (`runs`); the slicing and concatenation the split adds
    are not reported.
    """
    check_images_per_call(images_per_call)
    resolved = resolve_target(target)
    engine = engine_for(tensor_cores, resolved if resolved.kind.name == "cuda" else None)
    if tensor_cores and resolved.kind.name != "cuda":
        raise UnsupportedError("dispatch_report: tensor_cores applies to CUDA targets")
    if resolved.kind.name != "cuda":  # the pipeline splits the batch on CPUs only
        mod = split_batch(images_per_call)(mod)
    with resolved:
        fused = tvm.transform.Sequential(fusion_passes(resolved))(mod)
    report = DispatchReport()
    stages = _stage_runs(fused)

    def report_function(name: str, runs: int) -> None:
        func = fused[name]
        bindings = relax.analysis.get_var2val(func)
        plumbing = _split_plumbing(func, bindings, stages) if name == "main" else []

        def from_matmul(data: relax.Expr) -> bool:
            """Whether a convolution of `data` is one matmul_as_conv2d made: its image is a (K, M)
            matrix transposed and reshaped to (1, K, 1, M). (ShuffleNet's channel shuffle, a
            reshape of a transposed 5-D tensor, is an image: reported as a matmul before.)"""
            image = bindings.get(data) if isinstance(data, relax.Var) else None
            source = image.args[0] if _is_call_to(image, "relax.reshape") else None
            transposed = bindings.get(source) if isinstance(source, relax.Var) else None
            if not _is_call_to(transposed, "relax.permute_dims") or len(transposed.args[0].ty.shape) != 2:
                return False
            dims = static_shape(data)
            return dims is not None and len(dims) == 4 and dims[0] == 1 and dims[2] == 1

        def row(call: relax.Call, fused_into: str | None = None, matmul: bool = False) -> None:
            decision = decide(call, resolved, engine, winograd)
            if matmul:
                (_, k, _, m), (n, *_) = decision.shapes
                reason = "as a 1x1 convolution (a GEMM is a batch-reduce of one)"
                decision = Decision("relax.matmul", ((m, k), (k, n)), decision.kernel,
                                                 reason if decision.kernel else decision.reason)
            if fused_into is not None and call.op.name != "relax.nn.conv2d":
                decision = Decision(decision.op, decision.shapes, f"{fused_into} epilogue", "fused")
            report.append(DispatchRow(decision.op.removeprefix("relax."), decision.shapes,
                                      decision.kernel or "fallback", decision.reason, runs))

        def visit(expr) -> None:
            if not isinstance(expr, relax.Call) or any(expr.same_as(p) for p in plumbing):
                return
            if isinstance(expr.op, tvm.ir.Op):
                row(expr, matmul=expr.op.name == "relax.nn.conv2d" and from_matmul(expr.args[0]))
            elif isinstance(expr.op, tvm.ir.GlobalVar) and "Composite" in (fused[expr.op].attrs or {}):
                calls = []
                relax.analysis.post_order_visit(fused[expr.op].body,
                                                lambda e: calls.append(e) if isinstance(e, relax.Call) else None)
                if str(fused[expr.op].attrs["Composite"]).startswith("tvm_ext.channel_affine"):
                    head, *rest = calls  # post order: the concatenation (or the scale, or shift) first
                    shapes = decide(head, resolved, engine, winograd).shapes
                    report.append(DispatchRow(head.op.name.removeprefix("relax."), shapes, "channel_affine",
                                              "", runs))
                    for call in rest:
                        row(call, "channel_affine")
                    return
                conv = next(c for c in calls if isinstance(c.op, tvm.ir.Op) and c.op.name == "relax.nn.conv2d")
                kernel = decide(conv, resolved, engine, winograd).kernel
                matmul = from_matmul(expr.args[list(fused[expr.op].params).index(conv.args[0])])
                for call in calls:
                    if isinstance(call.op, tvm.ir.Op):
                        row(call, kernel, matmul=matmul and call.same_as(conv))

        relax.analysis.post_order_visit(func, visit)

    for name, runs in stages.items():
        report_function(name, runs)
    return report


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
