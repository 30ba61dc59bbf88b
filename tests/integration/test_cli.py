"""`python -m tvm_ext`: every argument is checked before anything is loaded or built, each
subcommand takes only the options it uses, and a bad ONNX file is named, not a traceback."""

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import tvm_ext
from tvm_ext import cli, models

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def nothing_built(monkeypatch):
    """Whatever loads, builds, tunes or benchmarks a network fails the test if it is reached."""

    def reached(*args, **kwargs):
        raise AssertionError("the CLI loaded or built something before rejecting its arguments")

    for owner, name in ((models, "get"), (models, "load_onnx"), (tvm_ext, "build"), (tvm_ext, "dispatch_report"),
                        (tvm_ext, "tune"), (tvm_ext.tuning, "extract_tasks"), (subprocess, "call")):
        monkeypatch.setattr(owner, name, reached, raising=False)


def _onnx_file(path: Path) -> Path:
    """A conv + relu ONNX model (16 -> 32 channels, 12 x 12)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((32, 16, 3, 3)).astype("float32"), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])],
        "net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 12, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32, 12, 12])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize("argv, message", [
    (["demo", "--threads", "1000"], "--threads: 1000 is out of range"),  # TVM's pool took > 4 min to exit
    (["demo", "--threads", "-1"], "--threads: -1 is out of range"),
    (["bench", "--threads", "two"], "--threads: 'two' is not an integer"),
    (["demo", "--repeat", "0"], "--repeat: 0 is out of range"),
    (["demo", "--batch", "0"], "--batch: 0 is out of range"),
    (["tune", "--trials", "-5"], "--trials: -5 is out of range"),
    (["tune", "--trials-per-task", "-1"], "--trials-per-task: -1 is out of range"),
    (["tune", "--rpc", "localhost:9190"], "is not host:port:key"),
    (["demo", "--model", "resnet51"], "--model: invalid choice: 'resnet51'"),
    (["demo", "--target", "nonsense"], "--target: cannot read target 'nonsense'"),
    (["tune", "--target", "cuda"], "runs on the CPU (LLVM targets)"),
    (["report", "--tensor-cores", "tf32"], "--tensor-cores applies to CUDA targets"),
    (["report", "--target", "cuda", "--precision", "bf16"], "--precision applies to CPU targets"),
    (["demo", "--precision", "fp16"], "--precision: invalid choice: 'fp16'"),
    (["bench", "--precision", "bf16"], "unrecognized arguments for bench: --precision"),
    (["tune", "--ship", "--work-dir", "records"], "--ship writes into tvm_ext/schedules"),
    # Options a subcommand does not use are rejected, not ignored.
    (["demo", "--tensor-cores", "tf32"], "unrecognized arguments for demo: --tensor-cores"),
    (["demo", "--trials", "8"], "unrecognized arguments for demo: --trials"),
    (["report", "--threads", "2"], "unrecognized arguments for report: --threads"),
    (["report", "--repeat", "3"], "unrecognized arguments for report: --repeat"),
    (["bench", "--direct"], "unrecognized arguments for bench: --direct"),
    (["tune", "--repeat", "3"], "unrecognized arguments for tune: --repeat"),
    ([], "the following arguments are required"),
])
def test_bad_arguments_exit_2_with_one_line_before_anything_is_built(argv, message, nothing_built, capsys):
    start = time.perf_counter()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert time.perf_counter() - start < 10


def test_onnx_file_arguments_are_checked_up_front(tmp_path, nothing_built, capsys):
    net = _onnx_file(tmp_path / "net.onnx")
    for argv, message in ((["tune", "--onnx", str(tmp_path / "missing.onnx")], "missing.onnx: no such file"),
                          (["report", "--onnx", str(net), "--model", "resnet18"], "--model and --onnx"),
                          (["tune", "--onnx", str(net), "--batch", "2"], "--batch applies to --model networks"),
                          (["demo", "--onnx", str(net)], "unrecognized arguments for demo: --onnx")):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def test_report_with_bf16_precision_says_which_convolutions_run_in_bf16(capsys):
    import tvm_ext
    from tvm_ext.strategy.decide import bf16_engine

    assert cli.main(["report", "--model", "resnet18", "--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    engine = bf16_engine(tvm_ext.resolve_target("llvm"))
    if engine == "amx":
        assert out.count("bf16 on AMX tiles") >= 20  # every convolution, the stem with a zero channel
    elif engine == "fma":  # (Zen 4) the stem, 1x1 and strided layers; Winograd's 3x3 stay fp32
        assert out.count("bf16 on AVX512-BF16 vdpbf16ps") >= 5 and "fp32 (Winograd's fewer multiplies" in out
    else:  # emulated on FMA at fp32's rate: the same layers as Zen 4's
        assert out.count("bf16 emulated on fp32 FMA") >= 5 and "fp32 (Winograd's fewer multiplies" in out


def test_options_each_subcommand_takes_are_accepted():
    args = cli._parse(["demo", "--threads", "1", "--repeat", "1", "--batch", "2", "--direct", "--no-stock"])
    assert (args.threads, args.repeat, args.batch, args.direct, args.no_stock) == (1, 1, 2, True, True)
    args = cli._parse(["tune", "--trials", "4", "--trials-per-task", "0", "--rpc", "127.0.0.1:9190:key", "--direct"])
    assert (args.model, args.batch, args.work_dir, args.trials, args.rpc) == ("resnet50", 1, "tuning", 4,
                                                                            "127.0.0.1:9190:key")
    assert cli._parse(["tune", "--precision", "bf16"]).precision == "bf16"  # (tasks: the bf16 kernels)
    args = cli._parse(["report", "--target", "cuda", "--tensor-cores", "bf16", "--model", "vgg16"])
    assert (args.tensor_cores, args.model) == ("bf16", "vgg16")
    assert cli._parse(["bench", "--no-stock", "--threads", str(os.cpu_count())]).no_stock


def test_tune_into_a_work_dir_it_cannot_create_fails_before_loading_the_model(tmp_path, nothing_built, capsys):
    (tmp_path / "file").write_text("")
    assert cli.main(["tune", "--model", "resnet18", "--work-dir", str(tmp_path / "file" / "records")]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot be created" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("content", [b"", b"garbage\x00\xff\x12 not an onnx model"])
def test_a_file_that_is_not_onnx_is_named(tmp_path, content, capsys):
    path = tmp_path / "broken.onnx"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="broken.onnx"):
        models.load_onnx(path)
    for command in ("report", "tune"):
        argv = [command, "--onnx", str(path)] + (["--work-dir", str(tmp_path / "records")] if command == "tune" else [])
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert str(path) in err and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_report_honours_onnx(tmp_path, capsys):
    """`report --onnx` reports that file's network (it reported ResNet-50, silently)."""
    assert cli.main(["report", "--onnx", str(_onnx_file(tmp_path / "net.onnx"))]) == 0
    out = capsys.readouterr().out
    assert "nn.conv2d  (1, 16, 12, 12) (32, 16, 3, 3)  brgemm_conv2d" in out, out


def test_bench_without_the_repository_names_the_missing_script(tmp_path, monkeypatch, nothing_built, capsys):
    """An installed wheel has no bench/layers.py: `bench` says which file is missing, exit status 2."""
    assert cli._bench_script() == ROOT / "bench" / "layers.py" and cli._bench_script().is_file()
    monkeypatch.setattr(cli, "_bench_script", lambda: tmp_path / "bench" / "layers.py")
    assert cli.main(["bench", "--model", "resnet18", "--threads", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert str(tmp_path / "bench" / "layers.py") in err and "clone" in err and len(err.splitlines()) == 1, err


def test_python_m_rejects_a_bad_argument_at_once():
    """As a command: exit status 2 and one line on stderr, in the time it takes to import tvm_ext."""
    for argv, message in ((["demo", "--threads", "1000"], "--threads"), (["tune", "--trials", "-5"], "--trials")):
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "tvm_ext", *argv], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out
        assert out.stdout == "" and time.perf_counter() - start < 60
