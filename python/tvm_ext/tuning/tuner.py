"""`tvm_ext.tune`: MetaSchedule tuning of a whole Relax network's tvm_ext kernels.

Tasks are the graph's BRGEMM convolution, pooling and maxDNN-tile convolution kernels as tvm_ext
lowers them (layouts included), identical ones merged and weighted by how often the network calls
them. Each is tuned over its design space (:func:`tvm_ext.tuning.space.conv2d_space`,
:func:`tvm_ext.tuning.pool_space.pool2d_space`, :func:`tvm_ext.tuning.maxdnn_space.maxdnn_space`)
with MetaSchedule's evolutionary search and XGBoost cost model; records go to a JSON database in
`work_dir` (one line per measured candidate, so an interrupted run keeps what it measured and a
rerun continues from it). `tvm_ext.build(mod,
target, database=work_dir)` then uses the best record of each kernel and the analytic schedule
for the others: tuning is never required.

Two hazards of MetaSchedule on TVM 0.27 are absorbed here: its default builder and TuneContext
import `tvm.s_tir.tensor_intrin` (25-55 s, in every builder worker: candidates time out), so the
builder gets a build function of ours and contexts are made without that import.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import os
import shutil
import sys
from collections.abc import Callable

import tvm
from tvm.s_tir import Schedule
from tvm.s_tir import meta_schedule as ms

from ..errors import UnsupportedError
from ..target import TargetLike, resolve_target, usable_cores, vector_isa
from .kinds import TaskKind
from .known_kinds import kind_of, task_kind
from .records import open_database

logger = logging.getLogger("tvm_ext")


@dataclasses.dataclass(frozen=True)
class Task:
    """One kernel to tune: its workload (unscheduled, self-describing) and how often it runs."""

    name: str
    workload: tvm.tirx.PrimFunc
    weight: int

    @property
    def kind(self) -> TaskKind:
        return task_kind(self.workload)

    @property
    def flops(self) -> int:
        """Operations of one run of the kernel (what progress lines turn into GFLOP/s)."""
        return self.kind.flops(self.workload)


def extract_tasks(mod: tvm.IRModule, target: TargetLike = None, winograd: bool = True,
                  images_per_call: int | None = None, maxdnn: str = "auto", precision: str = "fp32") -> list[Task]:
    """The tunable tvm_ext kernels of `mod` on `target`, identical ones merged (weight = how
    often one inference runs them). They are the kernels the build runs: the batch is split as
    :func:`tvm_ext.build` splits it (`images_per_call`, `winograd`: as there; a Winograd
    convolution's task is its GEMM), so a batch-16 network's trunk is tuned at the images per
    call it runs with, not at 16; `maxdnn` and `precision` as there: which convolutions run on the
    maxDNN tile, in bf16). A quantized network's tasks include its int8 kernels."""
    from ..pipeline import check_images_per_call, check_precision, cpu_kernel_passes
    from ..strategy.cpu_engine import check_maxdnn
    from ..transform.split_batch import runs_per_inference

    check_images_per_call(images_per_call)
    check_maxdnn(maxdnn)
    check_precision(precision)
    resolved = resolve_target(target)
    isa = vector_isa(resolved)
    with resolved:
        lowered = tvm.transform.Sequential(cpu_kernel_passes(resolved, None, images_per_call, winograd=winograd,
                                                             precision=precision, maxdnn=maxdnn))(mod)
    runs = runs_per_inference(lowered)
    tasks: dict[str, Task] = {}  # by the workload's self-description: equal kernels, one task
    for gvar, func in lowered.functions_items():
        if not isinstance(func, tvm.tirx.PrimFunc) or gvar.name_hint not in runs:
            continue
        kind = kind_of(func)
        if kind is None:
            continue
        workload = kind.task_of(func, isa)
        if workload is None:
            continue
        key = str(workload.attrs[kind.attr])
        if key in tasks:
            tasks[key] = dataclasses.replace(tasks[key], weight=tasks[key].weight + runs[gvar.name_hint])
        else:
            tasks[key] = Task(gvar.name_hint, workload, runs[gvar.name_hint])
    return list(tasks.values())


def _build(mod: tvm.IRModule, target: tvm.target.Target, _params) -> tvm.runtime.Module:
    """MetaSchedule's build step without its wholesale tensor_intrin import."""
    from tvm.driver import build as tir_build

    return tir_build(mod, target=target)


def _tune_context(task: Task, target: tvm.target.Target, seed: int) -> ms.TuneContext:
    """A TuneContext, made as TuneContext.__init__ makes it minus `import tvm.s_tir.tensor_intrin`."""
    from tvm.s_tir.meta_schedule import _ffi_api
    from tvm.s_tir.meta_schedule.logging import get_logger, get_logging_func

    generator = ms.space_generator.ScheduleFn(task.kind.design_space, sch_rules=[],
                                              postprocs=task.kind.postprocessors(),
                                              mutator_probs={ms.mutator.MutateTileSize(): 1.0})
    context = ms.TuneContext.__new__(ms.TuneContext)
    context.__init_handle_by_constructor__(
        _ffi_api.TuneContext, tvm.IRModule({"main": task.workload}), target, generator,
        _search_strategy(), task.name, usable_cores(), seed,
        get_logging_func(get_logger("tvm_ext.tuning")))
    _ffi_api.TuneContextInitialize(context)
    return context


def _search_strategy() -> ms.search_strategy.SearchStrategy:
    """Evolutionary search sized for tvm_ext's design spaces.

    A space is the row blocking, register tiles and unroll factors of one kernel. Its blocking
    decisions are perfect tiles, which MetaSchedule's tile-size mutator evolves; the tile and
    unroll decisions are categorical, which no mutator changes, so the initial sample covers
    them (9-42 valid combinations per task of ResNet-50 and VGG-16). MetaSchedule's default
    population (512 schedules, each generated and tensorized in Python) made the search take
    most of a round; 128 is enough for such a space.
    """
    return ms.search_strategy.EvolutionarySearch(population_size=128, init_min_unmeasured=16)


def tune(mod: tvm.IRModule, target: TargetLike, work_dir: str | os.PathLike, max_trials: int = 64,
         trials_per_task: int | None = None, *, num_trials_per_iter: int = 16, cost_model: str = "xgb",
         seed: int = 1, tasks: list[Task] | None = None, measure_callbacks: list | None = None,
         rpc: str | None = None, images_per_call: int | None = None, maxdnn: str = "auto",
         precision: str = "fp32") -> ms.Database:
    """Tune the tvm_ext convolutions and poolings of `mod` for `target`; records go to `work_dir`.

    Each task new to the database first gets its analytic schedule measured and recorded (one
    measurement more per task), so no record is ever preferred that measured slower than it.
    `max_trials` is the budget over all tasks (the task scheduler spends it where the weighted
    latency falls fastest; a batch of up to `num_trials_per_iter` begun under it is measured
    whole, so up to that many - 1 more may run), `trials_per_task` caps each (default:
    max_trials). Bad arguments and a work_dir that cannot be written fail before any worker
    starts or anything is measured. `cost_model`:
    "xgb" (default) or "random". `tasks`: those of :func:`extract_tasks` (extracted if not given,
    with `images_per_call`, `maxdnn` and `precision`: the build's, default one image per core,
    "auto" and "fp32");
    `measure_callbacks`: MetaSchedule measure callbacks run after MetaSchedule's own (e.g.
    :class:`tvm_ext.tuning.progress.TuningProgress`). `rpc`: "host:port:key" of a TVM RPC
    tracker (`python -m tvm.exec.rpc_tracker`) whose servers (`python -m tvm.exec.rpc_server
    --tracker host:port --key key`) run the candidates; a server that dies fails only the
    candidates it held.
    """
    from ..pipeline import check_images_per_call, check_precision
    from ..strategy.cpu_engine import check_maxdnn

    resolved = resolve_target(target)
    if resolved.kind.name != "llvm":
        raise UnsupportedError(f"tune: target {resolved.kind.name} is not supported yet (LLVM CPUs only)")
    for name, value, low in (("max_trials", max_trials, 1), ("trials_per_task", trials_per_task, 1),
                             ("num_trials_per_iter", num_trials_per_iter, 1)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low):
            raise ValueError(f"tune: {name} must be an int of at least {low}, got {value!r}")
    check_images_per_call(images_per_call)
    check_maxdnn(maxdnn)
    check_precision(precision)
    tracker = None if rpc is None else _tracker(rpc)
    # Everything that can fail on the arguments fails above or here, before workers start, the
    # tasks are extracted (seconds for a large network) or anything is measured.
    database = open_database(work_dir, create=True)
    runner = _runner(tracker)
    if tasks is None:
        tasks = extract_tasks(mod, resolved, images_per_call=images_per_call, maxdnn=maxdnn, precision=precision)
    if not tasks:
        raise UnsupportedError("tune: the module has no tvm_ext convolution or pooling with a design space")
    logger.info("tvm_ext.tune: %d tasks, %d kernel calls", len(tasks), sum(t.weight for t in tasks))
    workers = usable_cores()
    builder = ms.builder.LocalBuilder(f_build=_build, max_workers=workers, timeout_sec=60,
                                      initializer=_die_with_this_process())
    _measure_defaults(tasks, resolved, database, builder, runner)
    ms.tune_tasks(
        tasks=[_tune_context(task, resolved, seed + i) for i, task in enumerate(tasks)],
        task_weights=[float(task.weight) for task in tasks],
        work_dir=str(work_dir),
        max_trials_global=int(max_trials),
        max_trials_per_task=int(trials_per_task or max_trials),
        num_trials_per_iter=int(num_trials_per_iter),
        builder=builder,
        runner=runner,
        database=database,
        cost_model=cost_model,
        measure_callbacks=list(ms.measure_callback.MeasureCallback.create("default")) + list(measure_callbacks or []),
    )
    return database


def _measure_defaults(tasks: list[Task], target: tvm.target.Target, database: ms.Database,
                      builder: ms.builder.Builder, runner: ms.runner.Runner) -> None:
    """Measure each new task's analytic schedule as tuning measures candidates, and record it.

    Then the best record of a task is never a candidate that measured slower than the schedule
    a build uses without records (measured here: without this, ResNet-50's records ran 9% slower
    on one thread than no records). Tasks that have records already (a resumed run) are skipped.
    """
    todo, traces, kernels = [], [], []
    for task in tasks:
        if database.has_workload(tvm.IRModule({"main": task.workload})):
            continue
        trace = task.kind.default_trace(task.workload)
        sch = Schedule(tvm.IRModule({"main": task.workload}))
        trace.apply_to_schedule(sch, remove_postproc=True)
        kernel = task.kind.finish(sch)
        if kernel is None:
            logger.warning("tvm_ext.tune: the analytic schedule of %s does not postprocess", task.name)
            continue
        todo.append(task)
        traces.append(trace)
        kernels.append(kernel)
    if not todo:
        return
    built = builder.build([ms.builder.BuilderInput(tvm.IRModule({"main": k}), target) for k in kernels])
    args = [ms.arg_info.ArgInfo.from_prim_func(task.workload) for task in todo]
    inputs = [ms.runner.RunnerInput(b.artifact_path, "cpu", a)  # tune() takes LLVM CPU targets only
              for b, a in zip(built, args, strict=True) if b.error_msg is None]
    results = iter([future.result() for future in runner.run(inputs)])
    for b in built:
        if b.artifact_path:
            shutil.rmtree(os.path.dirname(b.artifact_path), ignore_errors=True)
    for task, trace, b, a in zip(todo, traces, built, args, strict=True):
        if b.error_msg is not None:
            logger.warning("tvm_ext.tune: the analytic schedule of %s did not build: %s", task.name, b.error_msg)
            continue
        result = next(results)
        if result.error_msg is not None or not result.run_secs:
            logger.warning("tvm_ext.tune: the analytic schedule of %s did not run: %s", task.name, result.error_msg)
            continue
        workload = database.commit_workload(tvm.IRModule({"main": task.workload}))
        database.commit_tuning_record(ms.database.TuningRecord(trace, workload, result.run_secs, target, a))


_EVALUATOR = ms.runner.EvaluatorConfig(number=3, repeat=3, min_repeat_ms=20)


def _tracker(rpc: str) -> tuple[str, int, str]:
    """(host, port, key) of an RPC tracker's "host:port:key"; a ValueError saying so otherwise."""
    try:
        host, port, key = rpc.rsplit(":", 2)
        return host, int(port), key
    except ValueError:
        raise ValueError(f"tune: rpc must be 'host:port:key' (a TVM RPC tracker), got {rpc!r}") from None


def _runner(tracker: tuple[str, int, str] | None) -> ms.runner.Runner:
    """The local runner, or MetaSchedule's RPC runner on the tracker (host, port, key)."""
    if tracker is None:
        return ms.runner.LocalRunner(evaluator_config=_EVALUATOR, initializer=_die_with_this_process())
    host, port, key = tracker
    config = ms.runner.RPCConfig(tracker_host=host, tracker_port=port, tracker_key=key, session_timeout_sec=60)
    return ms.runner.RPCRunner(rpc_config=config, evaluator_config=_EVALUATOR, max_workers=usable_cores(),
                               initializer=_die_with_this_process())


def _die_with_this_process() -> Callable[[], None] | None:
    """An initializer for MetaSchedule's popen workers that makes each die with this process.

    The workers are separate Python processes; a worker busy with a build or a measurement when
    the tuning process is killed (SIGKILL, the OOM killer) would otherwise run on, re-parented to
    init, until its task ends (builds may take a minute). On Linux each asks the kernel to
    SIGKILL it when the thread that started it exits (prctl PR_SET_PDEATHSIG); that thread is a
    pool thread of this process that lives as long as the worker's pool, so in effect when this
    process dies. Elsewhere: None (no initializer).

    The initializer is made here, a closure, so that cloudpickle sends it by value: a worker
    does not import tvm_ext to run it.
    """
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()

    def initializer() -> None:
        import ctypes
        import os
        import signal

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl: nobody would signal us
            os._exit(1)

    return initializer
