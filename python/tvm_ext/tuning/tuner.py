"""`tvm_ext.tune`: MetaSchedule tuning of a whole Relax network's tvm_ext kernels.

Tasks are the graph's BRGEMM convolution and pooling kernels as tvm_ext lowers them (layouts
included), identical ones merged and weighted by how often the network calls them. Each is tuned
over its design space (:func:`tvm_ext.tuning.space.conv2d_space`,
:func:`tvm_ext.tuning.pool_space.pool2d_space`) with MetaSchedule's evolutionary search and XGBoost
cost model; records go to a JSON database in `work_dir` (one line per measured candidate, so an
interrupted run keeps what it measured and a rerun continues from it). `tvm_ext.build(mod,
target, database=work_dir)` then uses the best record of each kernel and the analytic schedule
for the others: tuning is never required.

Two hazards of MetaSchedule on TVM 0.27 are absorbed here: its default builder and TuneContext
import `tvm.s_tir.tensor_intrin` (25-55 s, in every builder worker: candidates time out), so the
builder gets a build function of ours and contexts are made without that import.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path

import tvm
from tvm.s_tir import Schedule
from tvm.s_tir import meta_schedule as ms

from ..errors import UnsupportedError
from ..intrin.cpu import register_named
from ..target import TargetLike, resolve_target, usable_cores, vector_isa
from .kinds import TaskKind, kind_of

logger = logging.getLogger("tvm_ext")


@dataclasses.dataclass(frozen=True)
class Task:
    """One kernel to tune: its workload (unscheduled, self-describing) and how often it runs."""

    name: str
    workload: tvm.tirx.PrimFunc
    weight: int

    @property
    def kind(self) -> TaskKind:
        return kind_of(self.workload)

    @property
    def flops(self) -> int:
        """Operations of one run of the kernel (what progress lines turn into GFLOP/s)."""
        return self.kind.flops(self.workload)


def extract_tasks(mod: tvm.IRModule, target: TargetLike = None, winograd: bool = True,
                  images_per_call: int | None = None) -> list[Task]:
    """The tunable tvm_ext kernels of `mod` on `target`, identical ones merged (weight = how
    often one inference runs them). They are the kernels the build runs: the batch is split as
    :func:`tvm_ext.build` splits it (`images_per_call`, `winograd`: as there; a Winograd
    convolution's task is its GEMM), so a batch-16 network's trunk is tuned at the images per
    call it runs with, not at 16."""
    from ..strategy import cpu as cpu_strategy
    from ..strategy.split_batch import runs_per_inference, split_batch

    target = resolve_target(target)
    isa = vector_isa(target)
    with target:
        lowered = tvm.transform.Sequential([split_batch(images_per_call)] + cpu_strategy.fusion_passes(target)
                                           + [cpu_strategy.lower_to_kernels(target, winograd=winograd)])(mod)
    runs = runs_per_inference(lowered)
    tasks: dict[str, Task] = {}  # by the workload's self-description: equal kernels, one task
    for gvar, func in lowered.functions_items():
        if not isinstance(func, tvm.tirx.PrimFunc) or gvar.name_hint not in runs:
            continue
        kind = kind_of(func)
        workload = None if kind is None else kind.task_of(func, isa)
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


def open_database(database: str | os.PathLike | ms.Database, create: bool = False) -> ms.Database:
    """A Database as given, or the JSON database in a work_dir (which must exist unless `create`)."""
    if isinstance(database, ms.Database):
        return database
    path = Path(database)
    if create:
        path.mkdir(parents=True, exist_ok=True)
    elif not (path / _RECORDS).is_file():
        raise FileNotFoundError(f"tuning database: {path} has no {_RECORDS} (run tvm_ext.tune)")
    _check_json_lines(path / _WORKLOADS)
    # Records name the microkernels their traces tensorize with, registered on demand by the
    # process that tuned; JSONDatabase replays every trace when it loads, so register them first.
    register_named(_check_json_lines(path / _RECORDS))
    return ms.database.JSONDatabase(work_dir=str(path))


_WORKLOADS, _RECORDS = "database_workload.json", "database_tuning_record.json"


def compact_database(work_dir: str | os.PathLike) -> int:
    """Rewrite a JSON database to what builds use: each workload's best record, without its
    postprocessing (the tensorize steps). Returns the number of records kept.

    For shipped records. Loading a JSON database replays every trace, and a trace that
    tensorizes needs its microkernels registered first (about 0.1 s each, a TVMScript parse):
    the 991 records first shipped for ResNet-50 and VGG-16 named 542 of them and took 39 s to load.
    Builds replay records without postprocessing and tensorize again, so they lose nothing; a
    later tuning run starts from these records.
    """
    path = Path(work_dir)
    database = open_database(path)
    workloads: list = []
    for record in database.get_all_tuning_records():
        if not any(record.workload.same_as(w) for w in workloads):
            workloads.append(record.workload)
    staging = path / ".compact"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    compacted = ms.database.JSONDatabase(work_dir=str(staging))
    for workload in workloads:
        best = database.get_top_k(workload, 1)
        if not best:
            continue
        record = best[0]
        compacted.commit_tuning_record(ms.database.TuningRecord(
            record.trace.simplified(remove_postproc=True), compacted.commit_workload(workload.mod),
            record.run_secs, record.target, record.args_info))
    for name in (_WORKLOADS, _RECORDS):
        os.replace(staging / name, path / name)
    shutil.rmtree(staging, ignore_errors=True)
    return len(compacted.get_all_tuning_records())


def _check_json_lines(path: Path) -> str:
    """Name the file and line of a corrupt record (MetaSchedule's own reader aborts without it).

    Returns the file's text ("" when there is none). Nothing is rewritten: the valid records
    stay as they are for the user to keep.
    """
    if not path.is_file():
        return ""
    text = path.read_text()
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            json.loads(line)
        except ValueError as err:
            raise ValueError(f"{path}:{number}: corrupt tuning record ({err}); the other lines are intact: "
                             "delete or repair this one (a run interrupted while writing leaves a "
                             "truncated last line)") from None
    return text


def tune(mod: tvm.IRModule, target: TargetLike, work_dir: str | os.PathLike, max_trials: int = 64,
         trials_per_task: int | None = None, *, num_trials_per_iter: int = 16, cost_model: str = "xgb",
         seed: int = 1, tasks: list[Task] | None = None, measure_callbacks: list | None = None,
         rpc: str | None = None, images_per_call: int | None = None) -> ms.Database:
    """Tune the tvm_ext convolutions and poolings of `mod` for `target`; records go to `work_dir`.

    Each task new to the database first gets its analytic schedule measured and recorded (one
    measurement more per task), so no record is ever preferred that measured slower than it.
    `max_trials` is the budget over all tasks (the task scheduler spends it where the weighted
    latency falls fastest), `trials_per_task` caps each (default: max_trials). `cost_model`:
    "xgb" (default) or "random". `tasks`: those of :func:`extract_tasks` (extracted if not given,
    with `images_per_call`: the build's, default one image per core);
    `measure_callbacks`: MetaSchedule measure callbacks run after MetaSchedule's own (e.g.
    :class:`tvm_ext.tuning.progress.TuningProgress`). `rpc`: "host:port:key" of a TVM RPC
    tracker (`python -m tvm.exec.rpc_tracker`) whose servers (`python -m tvm.exec.rpc_server
    --tracker host:port --key key`) run the candidates; a server that dies fails only the
    candidates it held.
    """
    target = resolve_target(target)
    if target.kind.name != "llvm":
        raise UnsupportedError(f"tune: target {target.kind.name} is not supported yet (LLVM CPUs only)")
    runner = _runner(rpc)  # before the task extraction: a bad address fails at once
    tasks = extract_tasks(mod, target, images_per_call=images_per_call) if tasks is None else tasks
    if not tasks:
        raise UnsupportedError("tune: the module has no tvm_ext convolution or pooling with a design space")
    logger.info("tvm_ext.tune: %d tasks, %d kernel calls", len(tasks), sum(t.weight for t in tasks))
    database = open_database(work_dir, create=True)
    workers = usable_cores()
    builder = ms.builder.LocalBuilder(f_build=_build, max_workers=workers, timeout_sec=60)
    _measure_defaults(tasks, target, database, builder, runner)
    ms.tune_tasks(
        tasks=[_tune_context(task, target, seed + i) for i, task in enumerate(tasks)],
        task_weights=[float(task.weight) for task in tasks],
        work_dir=str(work_dir),
        max_trials_global=max_trials,
        max_trials_per_task=trials_per_task or max_trials,
        num_trials_per_iter=num_trials_per_iter,
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


def _runner(rpc: str | None) -> ms.runner.Runner:
    """The local runner, or MetaSchedule's RPC runner on the tracker `rpc` ("host:port:key")."""
    if rpc is None:
        return ms.runner.LocalRunner(evaluator_config=_EVALUATOR)
    try:
        host, port, key = rpc.rsplit(":", 2)
        port = int(port)
    except ValueError:
        raise ValueError(f"tune: rpc must be 'host:port:key' (a TVM RPC tracker), got {rpc!r}") from None
    config = ms.runner.RPCConfig(tracker_host=host, tracker_port=port, tracker_key=key, session_timeout_sec=60)
    return ms.runner.RPCRunner(rpc_config=config, evaluator_config=_EVALUATOR, max_workers=usable_cores())


def tuned_kernel(database: ms.Database, workload: tvm.tirx.PrimFunc,
                 target: tvm.target.Target) -> tvm.tirx.PrimFunc | None:
    """The best record's schedule of `workload` in `database`, or None when it has none."""
    mod = tvm.IRModule({"main": workload})
    record = database.query_tuning_record(mod, target, "main")
    if record is None:
        return None
    sch = Schedule(mod)
    # Replay the sampled decisions; the tensorize step runs again here, registering the
    # microkernels it names (a fresh process has none).
    record.trace.apply_to_schedule(sch, remove_postproc=True)
    kind = kind_of(workload)
    kernel = kind.finish(sch)
    if kernel is None:
        logger.warning("tvm_ext: a tuning record of %s does not apply; using the analytic schedule",
                       workload.attrs[kind.attr])
        return None
    return kernel.with_attr(TUNED_ATTR, True)


TUNED_ATTR = "tvm_ext.tuned"  # on kernels whose schedule came from a tuning record


def target_key(target: TargetLike) -> str:
    """The folder name of a target's shipped records: kind and CPU (e.g. llvm-znver4)."""
    target = resolve_target(target)
    cpu = str(target.attrs.get("mcpu", "")) or "generic"
    return f"{target.kind.name}-{cpu}"


def schedules_root() -> Path:
    """Where shipped records live: $TVM_EXT_SCHEDULES, else the repository's schedules/."""
    return Path(os.environ.get("TVM_EXT_SCHEDULES") or Path(__file__).resolve().parents[3] / "schedules")


def shipped_records_dir(target: TargetLike) -> Path | None:
    """schedules/<target key>/ when records are shipped for `target`, else None."""
    path = schedules_root() / target_key(target)
    return path if (path / _RECORDS).is_file() else None


def shipped_database(target: TargetLike) -> ms.Database | None:
    """The records shipped for `target` (schedules/<target key>/), or None when there are none."""
    path = shipped_records_dir(target)
    if path is None:
        return None
    logger.info("tvm_ext: using the tuning records shipped in %s", path)
    return open_database(path)
