"""Tuning records on disk: a damaged database never crashes the process. Each line either loads
or is a ValueError naming its file and line; blank lines are not records; a damaged shipped
database is skipped with a warning."""

import json
import logging
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_ext
from tvm_ext.tuning.records import open_database, read_database, shipped_database

SHIPPED = Path(__file__).resolve().parents[2] / "python" / "tvm_ext" / "schedules" / "llvm-znver4"
WORKLOADS, RECORDS = "database_workload.json", "database_tuning_record.json"


@pytest.fixture(scope="module")
def small_database(tmp_path_factory) -> Path:
    """The shipped records of the first 6 workloads: a valid database that reads fast."""
    path = tmp_path_factory.mktemp("records")
    workloads = (SHIPPED / WORKLOADS).read_text().splitlines()[:6]
    records = [line for line in (SHIPPED / RECORDS).read_text().splitlines() if json.loads(line)[0] < 6]
    (path / WORKLOADS).write_text("".join(w + "\n" for w in workloads))
    (path / RECORDS).write_text("".join(r + "\n" for r in records))
    return path


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _records(database) -> int:
    return len(database.get_all_tuning_records())


@pytest.mark.parametrize("tail", ["\n", "\n\n", "   \n", "\n\n\n"])
def test_blank_lines_are_not_records(small_database, tmp_path, tail):
    """The issue's segfault: a blank line (what deleting a truncated line in an editor leaves)."""
    db = _copy(small_database, tmp_path / "db")
    expected = _records(open_database(db))
    with open(db / RECORDS, "a") as f:
        f.write(tail)
    with open(db / WORKLOADS, "r+") as f:
        text = f.read()
        f.seek(0)
        f.write(text.replace("\n", "\n" + tail, 1))
    assert _records(open_database(db)) == expected
    assert _records(open_database(db, create=True)) == expected  # tuning: the blank lines dropped
    assert "\n\n" not in (db / RECORDS).read_text() and "\n\n" not in (db / WORKLOADS).read_text()


def _record(small_database: Path, **change) -> str:
    index, (trace, run_secs, target, args) = json.loads((small_database / RECORDS).read_text().splitlines()[0])
    fields = {"index": index, "trace": trace, "run_secs": run_secs, "target": target, "args": args, **change}
    return json.dumps([fields["index"], [fields["trace"], fields["run_secs"], fields["target"], fields["args"]]])


BAD_RECORDS = {
    "null": lambda db: "null", "object": lambda db: "{}", "[0]": lambda db: "[0]", "[]": lambda db: "[]",
    "number": lambda db: "7", "string": lambda db: '"record"', "truncated": lambda db: '[0, [[], [1.0',
    "target is a list": lambda db: _record(db, target=["llvm"]),
    "index out of range": lambda db: _record(db, index=6),
    "negative index": lambda db: _record(db, index=-1),
    "index is a bool": lambda db: _record(db, index=True),
    "trace is a string": lambda db: _record(db, trace="trace"),
    "trace of one list": lambda db: _record(db, trace=[[]]),
    "run_secs are strings": lambda db: _record(db, run_secs=["fast"]),
    "run_secs negative": lambda db: _record(db, run_secs=[-1.0]),
    "args is a dict": lambda db: _record(db, args={}),
    "unknown instruction": lambda db: _record(db, trace=[[["NoSuchInstruction", [], [], []]], []]),
    "record of three fields": lambda db: json.dumps([0, [[[], []], [1e-3], {"kind": "llvm"}]]),
}


@pytest.mark.parametrize("damage", list(BAD_RECORDS))
def test_a_record_of_the_wrong_shape_names_its_file_and_line(small_database, tmp_path, damage):
    db = _copy(small_database, tmp_path / "db")
    lines = (db / RECORDS).read_text().splitlines()
    lines.insert(2, BAD_RECORDS[damage](small_database))
    (db / RECORDS).write_text("\n".join(lines) + "\n")
    for create in (False, True):
        with pytest.raises(ValueError, match=rf"{RECORDS}:3: corrupt tuning record"):
            open_database(db, create=create)


@pytest.mark.parametrize("workloads", ["", "\n", "null\n", '["1", "2", "3"]\n', '[1, "x"]\n', '["12", "not base64"]\n'])
def test_a_workload_file_of_the_wrong_shape_names_its_file_and_line(small_database, tmp_path, workloads):
    """An empty workload file beside records, or workload lines that are not workloads."""
    db = _copy(small_database, tmp_path / "db")
    (db / WORKLOADS).write_text(workloads)
    name = RECORDS if not workloads.strip() else WORKLOADS
    with pytest.raises(ValueError, match=rf"{name}:\d+: corrupt tuning record"):
        open_database(db)


def test_random_damage_never_crashes(small_database, tmp_path):
    """Byte-level damage (flips, deletions, insertions, truncation, duplicated lines) at random
    places: either the valid records load or the error names a file and line."""
    rng = random.Random(20261204)
    outcomes = {"loaded": 0, "error": 0}
    for trial in range(40):
        db = _copy(small_database, tmp_path / f"db{trial}")
        name = rng.choice([RECORDS, RECORDS, WORKLOADS])
        data = bytearray((db / name).read_bytes())
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(data))
            action = rng.choice(["flip", "delete", "insert", "truncate", "newline", "duplicate"])
            if action == "flip":
                data[at] = rng.randrange(256)
            elif action == "delete":
                del data[at: at + rng.randint(1, 40)]
            elif action == "insert":
                data[at:at] = bytes(rng.choice(b'[]{}",:0123456789 \nnulltrue') for _ in range(rng.randint(1, 8)))
            elif action == "truncate":
                del data[at:]
            elif action == "newline":
                data[at:at] = b"\n"
            else:
                lines = bytes(data).split(b"\n")
                lines.insert(rng.randrange(len(lines)), rng.choice(lines))
                data = bytearray(b"\n".join(lines))
        (db / name).write_bytes(bytes(data))
        try:
            read_database(db)
            outcomes["loaded"] += 1
        except ValueError as err:
            assert f"{name}:" in str(err) and "corrupt tuning record" in str(err), str(err)
            outcomes["error"] += 1
    assert outcomes["error"] > 0


def test_a_database_is_decoded_once_until_it_changes(small_database, tmp_path, monkeypatch):
    """Every build reads the shipped records: the second read of unchanged files decodes nothing
    (0.26 s a build before), a file changed since (same size, same instant) is read again."""
    from tvm.s_tir import meta_schedule as ms

    db = _copy(small_database, tmp_path / "db")
    decode = ms.database.TuningRecord.from_json
    calls = []
    monkeypatch.setattr(ms.database.TuningRecord, "from_json",
                        staticmethod(lambda *args: calls.append(1) or decode(*args)))
    workloads, records = read_database(db)
    first = len(calls)
    assert first == len(records) > 0
    again = read_database(db)
    assert len(calls) == first and [len(v) for v in again] == [len(workloads), len(records)]
    again[1].clear()  # the caller's lists are its own
    assert len(read_database(db)[1]) == len(records) and _records(open_database(db)) == len(records)
    # one record's index (a digit) changed in place: the same size, the next read must see it
    data = (db / RECORDS).read_bytes()
    (db / RECORDS).write_bytes(b"[9" + data[2:])
    with pytest.raises(ValueError, match=rf"{RECORDS}:1: corrupt tuning record"):
        read_database(db)


def _relu_module() -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 16, 8, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.relu(x))
        bb.emit_func_output(out)
    return bb.get()


def test_a_damaged_shipped_database_is_skipped_with_a_warning(tmp_path, monkeypatch, caplog):
    """The issue's reproducer: every default build for that CPU loads the shipped records."""
    root = tmp_path / "schedules"
    _copy(SHIPPED, root / SHIPPED.name)
    bad_line = len((root / SHIPPED.name / RECORDS).read_text().splitlines()) + 2  # after a blank one
    with open(root / SHIPPED.name / RECORDS, "a") as f:
        f.write("\n{}\n")
    monkeypatch.setenv("TVM_EXT_SCHEDULES", str(root))
    target = tvm_ext.resolve_target({"kind": "llvm", "mcpu": "znver4"})
    with caplog.at_level(logging.WARNING, logger="tvm_ext"):
        assert shipped_database(target) is None
    assert f"{RECORDS}:{bad_line}: corrupt" in caplog.text
    with pytest.raises(ValueError, match=rf"{RECORDS}:{bad_line}"):  # named explicitly: the user's own records
        tvm_ext.build(_relu_module(), target, database=root / SHIPPED.name)
    x = np.random.default_rng(0).standard_normal((1, 16, 8, 8)).astype("float32")
    ex = tvm_ext.build(_relu_module(), "llvm")  # this host's records (if shipped) still load
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_array_equal(out, np.maximum(x, 0))


def test_tuning_into_a_work_dir_it_cannot_write_fails_before_measuring(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="cannot be created"):
        open_database(blocker / "work", create=True)
    read_only = tmp_path / "ro"
    read_only.mkdir(mode=0o500)
    if os.access(read_only, os.W_OK):
        return  # root writes anywhere: the permission check cannot be seen failing here
    with pytest.raises(ValueError, match="not writable"):
        open_database(read_only, create=True)


def test_refresh_moves_records_to_the_workloads_this_version_generates(tmp_path, monkeypatch):
    """A change of what a kernel computes (relu keeping NaN) changes its workload: refresh moves
    the records tuned for the old one, so builds still find them."""
    import tvm_ffi
    from tvm.s_tir import meta_schedule as ms

    from tvm_ext.kernels import common
    from tvm_ext.kernels import conv2d as _conv
    from tvm_ext.target import AVX2
    from tvm_ext.tuning import space
    from tvm_ext.tuning.records import refresh_database, tuned_kernel

    plan = _conv.plan_conv2d(_conv.Conv2dWorkload.make((1, 16, 14, 14), (32, 16, 3, 3), 1, 1, 1, 1), AVX2)
    epilogue = _conv.Epilogue(bias=True, activation="relu")
    monkeypatch.setitem(common.ACTIVATIONS, "relu", "T.max({v}, T.float32(0))")  # 0.5.11's relu
    _conv.conv2d_blocked_func.cache_clear()
    old = space.conv2d_workload(plan, epilogue, AVX2)
    monkeypatch.undo()
    _conv.conv2d_blocked_func.cache_clear()
    current = space.conv2d_workload(plan, epilogue, AVX2)
    assert not tvm_ffi.structural_equal(old, current)
    target = tvm.target.Target({"kind": "llvm", "mcpu": "znver3"})
    database = ms.database.JSONDatabase(work_dir=str(tmp_path))
    database.commit_tuning_record(ms.database.TuningRecord(
        space.default_trace(old), database.commit_workload(tvm.IRModule({"main": old})), [1e-3], target,
        ms.arg_info.ArgInfo.from_prim_func(old)))
    assert tuned_kernel(open_database(tmp_path), current, target) is None  # orphaned
    assert refresh_database(tmp_path) == (1, 0)
    assert tuned_kernel(open_database(tmp_path), current, target) is not None
    assert refresh_database(tmp_path) == (1, 0)  # current already: kept as it is


def test_shipped_records_are_package_data_found_without_the_repository(tmp_path, monkeypatch):
    """The shipped records live in the package (an installed wheel has them, tests/integration/test_packaging.py);
    $TVM_EXT_SCHEDULES replaces them."""
    from tvm_ext.tuning.records import schedules_root, shipped_records_dir, shipped_target_keys

    monkeypatch.delenv("TVM_EXT_SCHEDULES", raising=False)
    assert schedules_root() == Path(tvm_ext.__file__).parent / "schedules"
    assert "llvm-znver4" in shipped_target_keys()
    assert shipped_records_dir({"kind": "llvm", "mcpu": "znver4"}) == SHIPPED
    monkeypatch.setenv("TVM_EXT_SCHEDULES", str(tmp_path))
    assert schedules_root() == tmp_path and shipped_target_keys() == []
    assert shipped_records_dir({"kind": "llvm", "mcpu": "znver4"}) is None
