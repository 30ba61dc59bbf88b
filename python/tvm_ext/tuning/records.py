"""Tuning records on disk: reading and writing MetaSchedule's JSON database safely, the best
record of a kernel, and the records shipped per target (tvm_ext/schedules/<target key>/, package
data: an installed wheel has them).

Below the build and the search: a build that uses records imports this module, not the tuner.
MetaSchedule's JSON reader aborts the process on a blank line, `null` or a line of the wrong
shape, and names no file or line for what it rejects. So every line is read and checked here,
and TVM only ever sees one line at a time, of a shape it accepts: a damaged file gives a
ValueError naming its file and line (a damaged shipped database a warning), never a crash.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import threading
from importlib import resources
from pathlib import Path

import tvm
import tvm_ffi
from tvm.s_tir import Schedule
from tvm.s_tir import meta_schedule as ms

from ..intrin.cpu import register_named
from ..kernels.conv2d import Conv2dPlan, Epilogue
from ..target import TargetLike, VectorISA, resolve_target
from . import space as _space
from .known_kinds import kind_of, task_kind

logger = logging.getLogger("tvm_ext")

_WORKLOADS, _RECORDS = "database_workload.json", "database_tuning_record.json"


def open_database(database: str | os.PathLike | ms.Database, create: bool = False) -> ms.Database:
    """A Database as given, or the JSON database in a work_dir (which must exist unless `create`).

    Without `create` the records are read into memory, every line checked (a build reads, never
    writes). With `create` (tuning) the work_dir must be writable, its lines are checked the same
    way, blank lines are dropped from the files (MetaSchedule's reader crashes on them) and
    MetaSchedule's JSONDatabase appends each new record as it is measured.
    """
    if isinstance(database, ms.Database):
        return database
    path = Path(database)
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"tune: work_dir {path} cannot be created: {err.strerror}") from None
        if not os.access(path, os.W_OK | os.X_OK) or any(
                (path / name).exists() and not os.access(path / name, os.W_OK) for name in (_WORKLOADS, _RECORDS)):
            raise ValueError(f"tune: work_dir {path} is not writable (tuning records are written there)")
    elif not (path / _RECORDS).is_file():
        raise FileNotFoundError(f"tuning database: {path} has no {_RECORDS} (run tvm_ext.tune)")
    workloads, records = read_database(path)
    if not create:
        memory = ms.database.MemoryDatabase()
        for record in records:
            memory.commit_tuning_record(ms.database.TuningRecord(
                record.trace, memory.commit_workload(record.workload.mod), record.run_secs, record.target,
                record.args_info))
        return memory
    for name in (_WORKLOADS, _RECORDS):
        _drop_blank_lines(path / name)
    return ms.database.JSONDatabase(work_dir=str(path))


# Decoded databases by directory, with a digest of their two files' bytes when read: every build
# reads the shipped records, and decoding them (0.26 s for 69 records on a Zen 4) was a third of a
# small network's build. Hashing the bytes costs well under a millisecond, and a file rewritten
# within the file system's timestamp granularity is still seen as changed.
_DECODED: dict[Path, tuple[bytes, tuple[list, list]]] = {}
_DECODED_LOCK = threading.Lock()
_DECODED_MAX = 16


def _digest(path: Path) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    for name in (_WORKLOADS, _RECORDS):
        try:
            digest.update((path / name).read_bytes())
        except OSError:
            digest.update(b"\0missing")
        digest.update(b"\0")
    return digest.digest()


def read_database(path: Path) -> tuple[list[ms.database.Workload], list[ms.database.TuningRecord]]:
    """The workloads and records of the JSON database in `path`, every line checked.

    A line that is not a record (bad JSON, the wrong shape, a workload index out of range, what
    TVM cannot decode) is a ValueError naming its file and line; blank lines are skipped. The
    decoded records are kept for the next read while neither file changes (new lists each call:
    the records themselves are immutable).
    """
    key, stamps = Path(path).resolve(), _digest(Path(path))
    with _DECODED_LOCK:
        known = _DECODED.get(key)
    if known is not None and known[0] == stamps:
        return list(known[1][0]), list(known[1][1])
    workloads, records = _decode_database(Path(path))
    with _DECODED_LOCK:
        if len(_DECODED) >= _DECODED_MAX:
            _DECODED.pop(next(iter(_DECODED)))
        _DECODED[key] = (stamps, (workloads, records))
    return list(workloads), list(records)


def _decode_database(path: Path) -> tuple[list[ms.database.Workload], list[ms.database.TuningRecord]]:
    workloads = _checked_lines(path / _WORKLOADS, _check_workload, ms.database.Workload.from_json)
    text = (path / _RECORDS).read_text(errors="replace") if (path / _RECORDS).is_file() else ""
    # Records name the microkernels their traces tensorize with, registered on demand by the
    # process that tuned; a trace is replayed as it is decoded, so register them first.
    register_named(text)
    records = _checked_lines(path / _RECORDS, lambda value: _check_record(value, len(workloads)),
                             lambda value: ms.database.TuningRecord.from_json(value[1], workloads[value[0]]))
    return workloads, records


def _checked_lines(path: Path, check, decode) -> list:
    """`decode` (TVM's reader) of each non-blank line of `path`, once `check` found the line's
    JSON of the right shape; a ValueError naming the file and line otherwise."""
    if not path.is_file():
        return []
    decoded = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
            problem = check(value)
        except ValueError as err:
            problem = str(err)
        if not problem:
            try:
                decoded.append(decode(value))
            except (RuntimeError, ValueError, TypeError, KeyError, IndexError) as err:  # TVM raises RuntimeErrors
                problem = f"TVM cannot read it: {(str(err).strip() or repr(err)).splitlines()[-1]}"
        if problem:
            raise ValueError(f"{path}:{number}: corrupt tuning record ({problem}); the other lines are intact: "
                             "delete or repair this one (a run interrupted while writing leaves a "
                             "truncated last line)")
    return decoded


def _check_workload(value) -> str:
    """What is wrong with a workload line's shape: [structural hash, the module in JSON]."""
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value)):
        return "a workload is a list of two strings"
    if not value[0].lstrip("-").isdigit():
        return "a workload's first string is its structural hash, a number"
    return ""


def _check_record(value, workloads: int) -> str:
    """What is wrong with a record line's shape: [workload index, [trace, run_secs, target, args_info]]."""
    if not (isinstance(value, list) and len(value) == 2):
        return "a record is a list of a workload index and the record"
    index, record = value
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < workloads:
        return f"workload index {index!r} is not one of the {workloads} workloads in {_WORKLOADS}"
    if not (isinstance(record, list) and len(record) == 4):
        return "a record is [trace, run_secs, target, args_info]"
    trace, run_secs, target, args_info = record
    if not (isinstance(trace, list) and len(trace) == 2 and all(isinstance(t, list) for t in trace)
            and all(isinstance(i, list) and len(i) == 4 and isinstance(i[0], str)
                    and all(isinstance(f, list) for f in i[1:]) for i in trace[0])
            and all(isinstance(d, list) and len(d) == 2 and isinstance(d[0], int) for d in trace[1])):
        return "its trace is not [[instructions], [decisions]]"
    if run_secs is not None and not (isinstance(run_secs, list) and all(
            isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t >= 0
            for t in run_secs)):
        return "run_secs is not a list of times"
    if not (isinstance(target, dict) and isinstance(target.get("kind"), str)):
        return "its target is not a target's JSON object"
    if not isinstance(args_info, list) or not all(isinstance(a, list) and a for a in args_info):
        return "args_info is not a list of argument descriptions"
    return ""


def _drop_blank_lines(path: Path) -> None:
    """Rewrite `path` without its blank lines (atomically), if it has any."""
    if not path.is_file():
        return
    text = path.read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    kept = "".join(line + "\n" for line in lines)
    if kept == text:
        return
    logger.warning("tvm_ext: %s: dropping its blank lines (MetaSchedule's reader cannot read them)", path)
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(kept)
    os.replace(staging, path)


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
    best = [records[0] for records in (database.get_top_k(w, 1) for w in workloads) if records]
    return _rewrite(path, [(r.trace.simplified(remove_postproc=True), r.workload.mod, r) for r in best])


def _rewrite(path: Path, records: list[tuple[tvm.s_tir.Trace, tvm.IRModule, ms.database.TuningRecord]]) -> int:
    """Replace the JSON database in `path` by `records`, each a (trace, workload module, record
    whose run_secs, target and args_info it keeps); written aside, then moved into place.
    Returns the number of records written."""
    staging = path / ".rewrite"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    rewritten = ms.database.JSONDatabase(work_dir=str(staging))
    for trace, mod, record in records:
        rewritten.commit_tuning_record(ms.database.TuningRecord(
            trace, rewritten.commit_workload(mod), record.run_secs, record.target, record.args_info))
    for name in (_WORKLOADS, _RECORDS):
        os.replace(staging / name, path / name)
    shutil.rmtree(staging, ignore_errors=True)
    return len(records)


def refresh_database(work_dir: str | os.PathLike) -> tuple[int, int]:
    """Rewrite each record of a JSON database against its workload as this version generates it.

    A workload is the kernel's unscheduled TensorIR, so a change of what a kernel computes (say,
    an epilogue that keeps NaN) changes its structural hash and orphans the records tuned for the
    old one: the build then silently falls back to the analytic schedule. A workload describes
    its plan (:data:`~tvm_ext.tuning.space.PLAN_ATTR`), so it is generated again here; a record
    whose trace still replays on the new workload moves to it, one that does not is dropped.
    Returns (records kept, records dropped).
    """
    path = Path(work_dir)
    _, records = read_database(path)
    kept = []
    for record in records:
        workload = _current_workload(record.workload.mod["main"])
        if workload is not None and (tvm_ffi.structural_equal(workload, record.workload.mod["main"])
                                     or _replayed(record.trace, workload) is not None):
            kept.append((record.trace, tvm.IRModule({"main": workload}), record))
    _rewrite(path, kept)
    return len(kept), len(records) - len(kept)


@dataclasses.dataclass(frozen=True)
class _RecordedISA:
    """The vector ISA as a convolution workload records it (a :class:`~.kinds.VectorShape`)."""

    lanes: int
    registers: int


def _current_workload(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc | None:
    """The workload this version generates for the plan `func` describes (None: no kind)."""
    from .space import describe_kernel

    kind = kind_of(func)
    if kind is None:
        return None
    described = describe_kernel(func)
    isa = None if described is None else _RecordedISA(lanes=described[2], registers=described[3])
    return kind.task_of(func, isa)


def _replayed(trace: tvm.s_tir.Trace, workload: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc | None:
    """The kernel of `trace` replayed on `workload` (postprocessed), or None if it does not apply."""
    sch = Schedule(tvm.IRModule({"main": workload}))
    try:
        # The sampled decisions replay; the tensorize step runs again here, registering the
        # microkernels it names (a fresh process has none).
        trace.apply_to_schedule(sch, remove_postproc=True)
        return task_kind(workload).finish(sch)
    except RuntimeError as err:  # (TVM errors) decisions that no longer fit the workload
        logger.info("tvm_ext: a tuning record does not replay: %s", str(err).strip().splitlines()[-1:])
        return None


def tuned_kernel(database: ms.Database, workload: tvm.tirx.PrimFunc, target: tvm.target.Target,
                 replay_on: tvm.tirx.PrimFunc | None = None) -> tvm.tirx.PrimFunc | None:
    """The best record's schedule of `workload` in `database` (replayed on `replay_on`, a workload
    of the same loops, where given), or None when it has none."""
    mod = tvm.IRModule({"main": workload})
    record = database.query_tuning_record(mod, target, "main")
    if record is None:
        return None
    kernel = _replayed(record.trace, workload if replay_on is None else replay_on)
    if kernel is None:
        logger.warning("tvm_ext: a tuning record of %s does not apply; using the analytic schedule",
                       workload.attrs[task_kind(workload).attr])
        return None
    return kernel.with_attr(TUNED_ATTR, True)


TUNED_ATTR = "tvm_ext.tuned"  # on kernels whose schedule came from a tuning record


def conv2d_kernel(plan: Conv2dPlan, epilogue: Epilogue, isa: VectorISA, target: tvm.target.Target,
                  database: ms.Database | None) -> tvm.tirx.PrimFunc:
    """A blocked convolution's kernel (:mod:`tvm_ext.kernels.conv2d` `plan` and `epilogue`, for
    `isa`): its best record's schedule where `database` has one, else the analytic one."""
    if database is not None and _space.tunable(plan, epilogue):
        tuned = tuned_kernel(database, _space.conv2d_task(plan, epilogue, isa), target,
                             replay_on=_space.conv2d_workload(plan, epilogue, isa))
        if tuned is not None:
            return tuned
    return _space.default_kernel(plan, epilogue, isa)


def target_key(target: TargetLike) -> str:
    """The folder name of a target's shipped records: kind and CPU (e.g. llvm-znver4)."""
    resolved = resolve_target(target)
    cpu = str(resolved.attrs.get("mcpu", "")) or "generic"
    return f"{resolved.kind.name}-{cpu}"


def schedules_root() -> Path:
    """Where shipped records live: $TVM_EXT_SCHEDULES, else the package's data folder schedules/
    (tvm_ext/schedules, in a clone and in an installed wheel alike)."""
    override = os.environ.get("TVM_EXT_SCHEDULES")
    if override:
        return Path(override)
    # A folder on disk: setuptools installs packages unzipped, and TVM's JSONDatabase reads a path.
    return Path(str(resources.files("tvm_ext").joinpath("schedules")))


def shipped_records_dir(target: TargetLike) -> Path | None:
    """tvm_ext/schedules/<target key>/ when records are shipped for `target`, else None."""
    path = schedules_root() / target_key(target)
    return path if (path / _RECORDS).is_file() else None


def shipped_target_keys() -> list[str]:
    """The target keys (e.g. llvm-znver4) that have shipped records, sorted."""
    root = schedules_root()
    if not root.is_dir():
        return []
    return sorted(path.name for path in root.iterdir() if (path / _RECORDS).is_file())


def shipped_database(target: TargetLike) -> ms.Database | None:
    """The records shipped for `target` (tvm_ext/schedules/<target key>/), or None when there are none."""
    path = shipped_records_dir(target)
    if path is None:
        return None
    try:
        database = open_database(path)
    except (ValueError, OSError) as err:  # a damaged shipped database must not take a build down
        logger.warning("tvm_ext: the tuning records shipped in %s are not used: %s", path, err)
        return None
    logger.info("tvm_ext: using the tuning records shipped in %s", path)
    return database
