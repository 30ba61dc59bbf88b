"""Whole-network compilation through tvm_ext: `build` and `pipeline` (what serves each op:
:func:`tvm_ext.report.dispatch_report`).

The pipeline is TVM's CPU pipeline (relax/backend/cpu_generic) with tvm_ext's strategy in front
of legalization. A batch's convolutional trunk first becomes one call per image
(:mod:`tvm_ext.transform.split_batch`: activations stay in cache). Then
:mod:`tvm_ext.transform` and :mod:`tvm_ext.strategy` fold batch norms into convolution weights, fuses conv + bias +
shortcut + activation into one kernel call, and lowers convolutions, dense layers, pooling and
activations to our kernels (stock TVM, with a reason, for the rest). Every PrimFunc left
unscheduled gets a default schedule (:class:`tvm_ext.dlight.cpu.RowDotProducts` for
matrix-vector products, dlight's CPU Reduction rule, then
:class:`tvm_ext.dlight.cpu.ParallelVectorize`) instead of stock TVM's naive loops.
"""

from __future__ import annotations

import numbers

import tvm
from tvm import relax
from tvm.relax.backend.cpu_generic import pipeline as cpu_pipeline
from tvm.relax.backend.cuda import pipeline as cuda_pipeline
from tvm.s_tir import dlight

from .dlight import Guarded, OnAlignedAccesses
from .dlight.cpu import ParallelVectorize, RowDotProducts
from .errors import UnsupportedError
from .kernels.common import KERNEL_ATTR
from .link import compile_relax
from .strategy.cpu_engine import check_maxdnn
from .strategy.cuda_engine import engine_for
from .strategy.decide import PRECISIONS
from .strategy.dispatch import legalize_map, lower_to_kernels
from .strategy.fusion import fusion_passes
from .strategy.quantized import lower_quantized_conv2d
from .strategy.quantized_norms import quantized_layer_norms
from .strategy.quantized_tables import quantized_lookup_tables
from .target import TargetLike, resolve_target
from .transform.arena import plan_arena
from .transform.matmul_as_conv2d import quantized_matmul_as_conv2d
from .transform.quantized_movement import quantized_data_movement, undone_moves
from .transform.split_batch import split_batch


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


def _lowering_passes(target: tvm.target.Target, lower: list, default_rules: list) -> list:
    """tvm_ext's kernels first (the passes `lower`), stock legalization for what is left, fusion,
    then a default schedule (dlight `default_rules`) for every PrimFunc that has none."""
    return [
        *lower,
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


def check_precision(precision: str) -> None:
    """"fp32" or "bf16", checked before anything compiles."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def pipeline(target: TargetLike = None, database=None, images_per_call: int | None = None, *,
             tensor_cores: bool | str = False, winograd: bool = True, precision: str = "fp32",
             maxdnn: str = "auto") -> tvm.transform.Pass:
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

    `precision` "bf16" (CPUs): convolutions with constant weights run in bfloat16 on AMX tiles
    (Sapphire Rapids and later; :mod:`tvm_ext.intrin.cpu_amx`), or on AVX512-BF16's `vdpbf16ps`
    where it does twice the FMA's work (Zen 4 and later; there Winograd's 3x3 layers stay fp32,
    fewer multiplies still): their input rounded to bf16 as it is packed for them, their weights
    at build time, fp32 accumulation and output (so the activations between kernels stay fp32;
    an odd channel count, an RGB stem's, gets a zero channel); those that cannot (no engine or
    the OS refusing AMX tiles, depthwise or grouped, run-time weights) stay fp32, and
    `dispatch_report` says which and why.

    `maxdnn` (CPUs): "auto" runs a convolution on the maxDNN tile (the images in the vector lanes,
    :mod:`tvm_ext.kernels.conv2d_maxdnn`) where its cost model expects it faster than the blocked
    kernel for the images of a call; "always" wherever it can (constant weights, not grouped);
    "never" keeps the blocked kernels (:func:`tvm_ext.strategy.cpu_engine.maxdnn_decision`).

    Quantized models in QDQ form (ONNX Runtime's `quantize_static`: each convolution between a
    dequantize and a quantize) run their convolutions on the int8 kernels (AMX or VNNI), whatever
    `precision` says (:mod:`tvm_ext.strategy.quantized`); the ops between them stay as imported.
    """
    from .tuning.records import open_database, shipped_database

    check_images_per_call(images_per_call)
    check_precision(precision)
    check_maxdnn(maxdnn)
    resolved = resolve_target(target)
    if resolved.kind.name == "cuda":
        engine_for(tensor_cores, resolved)  # a bad value fails here, not inside the pass
        if precision != "fp32":
            raise UnsupportedError("pipeline: precision applies to CPU targets (CUDA: tensor_cores='bf16')")
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
                _lowering_passes(resolved, cpu_kernel_passes(resolved, database, images_per_call, winograd=winograd,
                                                             precision=precision, maxdnn=maxdnn),
                                 [Guarded(RowDotProducts()), Guarded(OnAlignedAccesses(dlight.cpu.Reduction())),
                                  ParallelVectorize()])
                + cpu_pipeline.dataflow_lower_passes(resolved)
                + _with_arena(cpu_pipeline.finalize_passes(resolved))
            )
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def cpu_kernel_passes(target: tvm.target.Target, database=None, images_per_call: int | None = None, *,
                      winograd: bool = True, precision: str = "fp32", maxdnn: str = "auto") -> list:
    """The CPU pipeline's passes up to tvm_ext's kernel calls: a quantized graph's rewrites
    (:func:`quantized_rewrites`) and int8 kernels, the batch split, fusion, then every kernel the strategy gives. What
    :func:`tvm_ext.tuning.extract_tasks` runs too, so that tasks are the kernels a build runs.
    `database`: a MetaSchedule Database or None; the rest as :func:`pipeline` takes them."""
    return (quantized_rewrites(target) + [lower_quantized_conv2d(target, database), split_batch(images_per_call)]
            + cpu_pipeline.library_dispatch_passes(target)
            + fusion_passes(target)
            + [lower_to_kernels(target, database, winograd=winograd, precision=precision, maxdnn=maxdnn)])


def quantized_rewrites(target: tvm.target.Target) -> list[tvm.transform.Pass]:
    """The rewrites of a quantized graph before its int8 lowering for `target` (the pipeline's
    and dispatch_report's): quantized tensors moved in their dtype, dense layers as 1x1
    convolutions, element-wise chains between quantized tensors as table lookups before their
    moves (after the dense layers: their rows' transposes then meet), moves that undo each other,
    layer norms on quantized values."""
    return [quantized_data_movement(), quantized_matmul_as_conv2d(), quantized_lookup_tables(target), undone_moves(),
            quantized_layer_norms()]


def _with_arena(passes: list) -> list:
    """TVM's finalizing passes with :func:`~tvm_ext.transform.arena.plan_arena` right after its
    memory planner."""
    names = [p.info.name for p in passes]
    if "StaticPlanBlockMemory" not in names:
        raise RuntimeError(f"tvm_ext: TVM's finalize passes no longer plan memory: {names}")
    at = names.index("StaticPlanBlockMemory") + 1
    return passes[:at] + [plan_arena()] + passes[at:]


def _cuda_pipeline(target: tvm.target.Target, tensor_cores: bool | str, winograd: bool) -> tvm.transform.Pass:
    """TVM's CUDA pipeline (relax/backend/cuda) with tvm_ext's strategy in front of legalization;
    what is left gets dlight's GPU schedules."""

    @tvm.transform.module_pass(opt_level=0, name="tvm_ext.CudaPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            passes = (
                cuda_pipeline.library_dispatch_passes(target)
                + fusion_passes(target)
                + _lowering_passes(target, [lower_to_kernels(target, tensor_cores=tensor_cores, winograd=winograd)],
                                   [*map(Guarded, (dlight.gpu.Matmul(), dlight.gpu.GEMV(), dlight.gpu.Reduction(),
                                                   dlight.gpu.GeneralReduction())), dlight.gpu.Fallback()])
                + cuda_pipeline.dataflow_lower_passes(target)
                + cuda_pipeline.finalize_passes(target)
            )
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def build(mod: tvm.IRModule, target: TargetLike = None, database=None,
          images_per_call: int | None = None, *, tensor_cores: bool | str = False,
          winograd: bool = True, precision: str = "fp32", maxdnn: str = "auto") -> relax.VMExecutable:
    """Compile a Relax module through tvm_ext; run it with `relax.VirtualMachine(ex, tvm.cpu())`
    (`tvm.cuda()` for a CUDA target; without a GPU a CUDA build still compiles, and its executable
    carries the kernels' CUDA C for inspection).

    `database`, `images_per_call`, `tensor_cores`, `winograd`, `precision` and `maxdnn`: see :func:`pipeline`.
    """
    resolved = resolve_target(target)
    relax_pipeline = pipeline(resolved, database, images_per_call, tensor_cores=tensor_cores, winograd=winograd,
                              precision=precision, maxdnn=maxdnn)
    if resolved.kind.name == "llvm":
        with _without_gpu_passes():
            return compile_relax(mod, resolved, relax_pipeline)
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
