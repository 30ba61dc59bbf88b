"""The tutorials run, and the benchmark scripts still work (smoke runs; speed is not tested)."""

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: int = 600, env: dict | None = None) -> str:
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                         env=None if env is None else {**os.environ, **env})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def test_tutorial_01_brgemm_microkernel():
    out = _run("tutorials/01_brgemm_microkernel.py", "--small")
    assert "relative error against float64 NumPy" in out and "spilled stack slots: 0" in out


def test_tutorial_04_cuda_maxdnn_tile():
    out = _run("tutorials/04_cuda_maxdnn_tile.py", "--small")
    assert "64 FFMA per k, 4 float4" in out and "128 FFMA per k, 6 float4" in out
    assert "tile 128x128, 128 threads of 16x8" in out and "relative error against float64 NumPy" in out
    err = float(out.split("relative error against float64 NumPy ")[1].split()[0])
    assert err < 1e-4
    assert "ops served by tvm_ext kernels" in out
    assert "6. OverFeat L3 at batch 128 for CUDA: winograd_conv2d, Winograd F(4x4, 3x3)" in out
    assert float(out.split("F(4x4, 3x3) on the small layer")[1].split("NumPy ")[1].split()[0]) < 1e-4
    step7 = out.split("7. The CPU")[1]  # the same tile description generating the CPU kernel
    assert "C[vi1, vj1] = C[vi1, vj1] + A[vb0, vb1, vk, vi1] * B[vb0, vb1, vk, vj1]" in step7
    assert " 0 spills" in step7
    assert float(step7.split("relative error against float64 NumPy ")[1].split(";")[0]) < 1e-5
    for engine in ("wgmma_tf32", "wgmma_bf16"):  # tensor-core reads: about 1e-4 and 1e-3 off fp32
        assert 1e-5 < float(out.split(f"the {engine} tile on the emulator: relative error ")[1].split()[0]) < 1e-2
    from tvm_ext.kernels.cuda import toolchain

    if toolchain.have_nvcc() and toolchain.find_nvdisasm():  # the k loop's SASS: FFMA-bound
        share = float(out.split("in SASS: ")[1].split("(")[1].split("%")[0])
        assert share >= 93.5  # 16 x 8 threads (8 x 8: 91%)


def test_gpu_check_base_engine():
    """The arithmetic (and so the reference's rounding and the baseline's precision) behind each
    exported variant's engine name."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_check

    names = {"ffma": "ffma", "ffma_maxdnn": "ffma", "mma_tf32_w64": "mma_tf32", "mma_bf16": "mma_bf16",
             "wgmma_tf32_shared": "wgmma_tf32", "wgmma_tf32_static": "wgmma_tf32", "wgmma_bf16": "wgmma_bf16"}
    assert {name: gpu_check.base_engine({"engine": name}) for name in names} == names
    assert gpu_check.base_engine({"engine": "winograd", "winograd": {}}) == "ffma"


def test_gpu_check_error_bound_grows_with_the_reduction():
    """The tensor cores' bound grows with the reduction (they add with truncation): an H200's
    OverFeat conv5 (9,216 terms) erred by 2.3e-5 on mma.sync and wgmma, right kernels; a bug
    errs by 1e-3 or more at any length."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_check

    assert gpu_check.error_bound("ffma", 9216) == gpu_check.error_bound("ffma", 27) == 1e-4
    for engine in ("mma_tf32", "wgmma_tf32", "wgmma_bf16"):
        assert gpu_check.error_bound(engine, 27) == gpu_check.error_bound(engine, 1152) == 1e-5
        assert 2.3e-5 < gpu_check.error_bound(engine, 9216) < 1e-4
        assert 9.1e-6 < gpu_check.error_bound(engine, 3456) < 1e-4


def test_peak_quick(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import peak

    result = peak.measure(quick=True)
    assert result["peak_gflops_1thread"] > 1 and result["bandwidth_gbs_1thread"] > 0.1
    # the dot products the CPU has are measured too (the int8 and bf16 kernels' ceilings)
    from tvm_ext.target import amx_permitted, has_amx_int8, has_vnni, resolve_target

    host = resolve_target("llvm")
    expected = {"int8_vnni512": has_vnni(host, 16), "int8_amx": has_amx_int8(host) and amx_permitted()}
    for dot, present in expected.items():
        assert (dot in result["dot_peaks"]) == present, (dot, result["dot_peaks"])
    assert all(v["1thread"] > 1 for v in result["dot_peaks"].values())


def test_layers_bench_smoke(tmp_path):
    csv = tmp_path / "layers.csv"
    out = _run("bench/layers.py", "--set", "resnet50", "--layers", "2", "--repeat", "2", "--no-stock",
               "--csv", str(csv))
    assert "median %peak" in out
    lines = csv.read_text().splitlines()
    assert lines[0].startswith("layer,") and len(lines) == 3
    assert json.loads((ROOT / "bench" / "workloads.json").read_text())["resnet50"]


@pytest.mark.slow
@pytest.mark.long
def test_layers_bench_compares_the_engines(tmp_path):
    out = _run("bench/layers.py", "--set", "vgg16", "--layers", "1", "--batch", "2", "--repeat", "1", "--engine",
               "auto", "--csv", str(tmp_path / "engines.csv"))
    header = next(line for line in out.splitlines() if line.startswith("layer |"))
    assert header.split(" | ")[2:6] == ["maxdnn", "brgemm", "onednn", "auto"]
    row = next(line for line in out.splitlines() if line.startswith("conv1_2 |")).split(" | ")
    assert " + " in row[2] and " = " in row[2]  # the tile's kernel + its layout passes
    assert row[5].split()[0] in ("maxdnn", "brgemm") and row[5].endswith("x best")
    for engine in ("maxdnn", "brgemm"):
        assert f"# {engine}: kernel median " in out and "x oneDNN" in out
    assert "# auto: geomean " in out


def test_layers_bench_bf16_smoke():
    """--dtype bf16: the stem's 3 channels are skipped with the reason; the next layer is timed
    (where the CPU has AVX512-BF16) against our fp32 kernel and PyTorch's bf16."""
    from tvm_ext.target import has_avx512_bf16

    out = _run("bench/layers.py", "--set", "resnet50", "--layers", "2", "--repeat", "2", "--dtype", "bf16")
    assert "stem_7x7s2 | skipped: " in out
    if has_avx512_bf16("llvm"):
        assert "3 input channels: not groups of 2" in out and "s2_1x1_64-64 | 64x56x56->64" in out
        assert "# geomean: " in out and "x PyTorch bf16" in out and "of its peak" in out


def test_layers_bench_int8_smoke():
    """--dtype int8: the stem's 3 channels are skipped with the reason; the next layer is timed
    (where the CPU has VNNI or AMX-INT8) against our fp32 kernel and PyTorch's quantized conv."""
    from tvm_ext.target import has_vnni

    out = _run("bench/layers.py", "--set", "resnet50", "--layers", "2", "--repeat", "2", "--dtype", "int8")
    assert "stem_7x7s2 | skipped: " in out
    if has_vnni("llvm", 16):
        assert "3 input channels: not groups of 4" in out and "s2_1x1_64-64 | 64x56x56->64" in out
        assert "# geomean: " in out and "x_vnni_vs_fp32" in out and "median %peak: " in out
        assert "vnni_%peak" in out and "vnni n/a" not in out  # measured against the VNNI peak


def test_tutorial_02_compile_a_network():
    out = _run("tutorials/02_compile_a_network.py")
    assert "relative error against PyTorch" in out and "brgemm_conv2d epilogue" in out


def test_tutorial_06_bf16():
    import tvm_ext
    from tvm_ext.strategy.decide import bf16_engine

    out = _run("tutorials/06_bf16.py")
    assert "bf16 against fp32: relative error" in out and "same top-5 classes: True" in out
    engine = bf16_engine(tvm_ext.resolve_target("llvm"))
    assert f"bf16 engine: {engine}" in out
    if engine == "amx":
        assert "20 of 20 convolutions in bf16" in out
    else:  # vdpbf16ps or emulated: Winograd's 3x3 layers (stride 1, >= 32 channels) stay fp32
        assert "7 of 20 convolutions in bf16" in out, out  # the stem, 3 strided 3x3, 3 strided 1x1


@pytest.mark.long
def test_int8_zoo_bench_smoke():
    out = _run("bench/int8_zoo.py", "--models", "resnet18", "--size", "32", "--inputs", "1", "--repeat", "2")
    assert "within 1 step" in out and "resnet18" in out


@pytest.mark.long
def test_pt2e_bench_smoke():
    pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
    out = _run("bench/pt2e.py", "--models", "resnet18", "--size", "32", "--inputs", "1", "--rounds", "1",
               "--repeat", "2")
    assert "fused adds" in out and "resnet18" in out


def test_tutorial_07_int8():
    from tvm_ext.strategy.quantized import int8_engine

    out = _run("tutorials/07_int8.py", "--size", "64")
    assert "against ONNX Runtime int8: " in out and "against the float32 network" in out
    quantized = next(line for line in out.splitlines() if line.startswith("tvm_ext.quantize: "))
    assert float(quantized.split("relative error to float32 ")[1].split(",")[0]) < 0.1, quantized
    if int8_engine(tvm_ext_target()) is not None:
        assert "20 of 20 convolutions in int8" in out and "100.00% of the outputs within one quantization step" in out


def tvm_ext_target():
    from tvm_ext.target import resolve_target

    return resolve_target("llvm")


@pytest.mark.slow
@pytest.mark.long
def test_tutorial_03_autotune(tmp_path):
    out = _run("tutorials/03_autotune.py", "--trials", "8", "--work-dir", str(tmp_path / "records"))
    assert "called 3x" in out and "tvm_ext.brgemm_float32" in out
    assert "relative error against stock TVM" in out and "latency: tuned" in out
    err = float(out.split("relative error against stock TVM ")[1].split()[0])
    assert err <= 1e-4


@pytest.mark.long
@pytest.mark.slow
def test_cli_tune_an_onnx_model(tmp_path):
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((32, 16, 3, 3)).astype("float32"), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["r"]),
         helper.make_node("MaxPool", ["r"], ["y"], kernel_shape=[2, 2], strides=[2, 2])],
        "net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 12, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32, 6, 6])], [w])
    path = tmp_path / "net.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    work_dir = tmp_path / "records"
    out = _run("-m", "tvm_ext", "tune", "--onnx", str(path), "--trials", "4", "--work-dir", str(work_dir))
    assert "2 tasks" in out and "GFLOP/s" in out and "tuned in" in out  # the convolution and the pooling
    assert "max_pool2d" in out
    assert (work_dir / "database_tuning_record.json").read_text().strip()
    assert (work_dir / "tuning_curve.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.long
def test_zoo_bench_smoke(tmp_path):
    """bench/zoo.py on a torchvision model and a video one (clips of --frames): all three
    runtimes, outputs agree, a README table."""
    out = _run("bench/zoo.py", "--models", "squeezenet1_1,mc3_18", "--size", "64", "--frames", "4", "--threads", "1",
               "--repeat", "2", "--rounds", "1", env={"TMPDIR": str(tmp_path)})
    for model in ("squeezenet1_1", "mc3_18"):
        row = next(line for line in out.splitlines() if line.startswith(f"| {model} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert all(float(c.rstrip("x")) > 0 for c in cells[1:]), row  # every runtime ran
        line = next(line for line in out.splitlines() if line.strip().startswith(model))
        assert float(line.split()[-1]) <= 1e-4  # tvm_ext's output against ONNX Runtime's
    assert "geometric mean vs ONNX Runtime" in out and not list(tmp_path.glob("tvm_ext_zoo_*"))


def test_zoo_bench_rejects_an_unknown_model():
    out = subprocess.run([sys.executable, "bench/zoo.py", "--models", "lenet"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "lenet not in the zoo" in out.stderr


def test_timm_zoo_bench_smoke():
    """bench/timm_zoo.py: one small timm network's row where timm is installed (it is no
    dependency); without it, exit status 2 and what to install."""
    out = subprocess.run([sys.executable, "bench/timm_zoo.py", "--models", "lcnet_050", "--size", "64"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    if "needs timm" in out.stderr:
        assert out.returncode == 2 and "pip install timm" in out.stderr
        return
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    (row,) = [line for line in out.stdout.splitlines() if line.startswith("| lcnet_050 |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[1]) <= 1e-4 and cells[2] == "yes" and cells[3] == "0", row


@pytest.mark.long
def test_dynamic_batch_bench_smoke():
    out = _run("bench/dynamic_batch.py", "--model", "resnet18", "--size", "64", "--batches", "1,2", "--repeat", "1",
               "--rounds", "1")
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0] in ("1", "2")]
    assert [r[0] for r in rows] == ["1", "2"] and all(float(r[4]) <= 1e-4 and float(r[5]) <= 1e-4 for r in rows)


def test_fuzz_bench_smoke():
    out = _run("bench/fuzz.py", "--graphs", "3", "--first", "11")
    assert "3 graphs (seeds 11..13): 0 failed" in out


@pytest.mark.long
@pytest.mark.slow
def test_e2e_bench_smoke(tmp_path):
    table, scratch = tmp_path / "e2e.csv", tmp_path / "tmp"
    scratch.mkdir()
    out = _run("bench/e2e.py", "--models", "mobilenet_v2", "--batches", "1", "--threads", "1", "--repeat", "2",
               "--rounds", "2", "--runtimes", "tvm_ext,onnxruntime", "--csv", str(table), env={"TMPDIR": str(scratch)})
    assert "onnxruntime" in out and "tvm_ext" in out
    # The models it built (2-7 GB a model) went to a temporary folder, now gone, not to its cwd.
    assert not list(scratch.glob("tvm_ext_e2e_*")) and not (ROOT / "mobilenet_v2_b1").exists()
    rows = list(csv.DictReader(table.open()))
    assert len(rows) == 2
    ours, ort = (next(r for r in rows if r["runtime"] == name) for name in ("tvm_ext", "onnxruntime"))
    assert float(ours["err_vs_ort"]) <= 1e-4
    # The speed-up is the median of two paired round ratios, inside their range.
    low, high = (float(v) for v in ort["speedup_range"].split("-"))
    assert low <= float(ort["tvm_ext_speedup"]) <= high and ours["speedup_range"] == "1.00-1.00"


@pytest.mark.long
def test_e2e_bench_bf16_smoke(tmp_path):
    """--precision bf16 adds tvm_ext_bf16 and pytorch_bf16 to the rounds; their outputs differ from
    fp32 by bf16 rounding, not more (MobileNet-v2's 1x1 layers in bf16 where the CPU has AMX)."""
    table = tmp_path / "e2e.csv"
    _run("bench/e2e.py", "--models", "mobilenet_v2", "--batches", "1", "--threads", "1", "--repeat", "2",
         "--rounds", "1", "--runtimes", "onnxruntime", "--precision", "bf16", "--csv", str(table))
    rows = {row["runtime"]: row for row in csv.DictReader(table.open())}
    assert set(rows) == {"onnxruntime", "tvm_ext_bf16", "pytorch_bf16"}
    assert float(rows["tvm_ext_bf16"]["err_vs_ort"]) <= 5e-2


@pytest.mark.long
@pytest.mark.slow
def test_tune_bench_smoke():
    out = _run("bench/tune.py", "--layers", "1", "--trials", "4", "--no-stock")
    row = out.strip().splitlines()[-1].split(" | ")
    assert row[0] == "stem_7x7s2" and float(row[1]) > 0 and float(row[2]) > 0


@pytest.mark.slow
@pytest.mark.long
def test_gpu_check_pipeline_without_gpu(tmp_path):
    """What the GPU check does before it needs a GPU: export the CUDA C, compile it with nvcc."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed")
    from tvm_ext.kernels.cuda import toolchain

    args = ["--out", str(tmp_path), "--sets", "overfeat", "--batch", "4", "--layers", "1", "--train-sets"]
    sass = toolchain.find_nvdisasm() is not None
    out = _run("bench/gpu_export.py", *args, *(["--sass"] if sass else []))
    assert "overfeat_conv1_ffma" in out and "tile 96x128 grid (98, 1, 1) threads 12x8" in out  # 96 filters
    assert "overfeat_conv1_ffma_maxdnn" in out and "tile 64x64 grid (196, 2, 1) threads 8x8" in out
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    entries = manifest["layers"]
    # 11x11 stride 4: no Winograd
    assert [e["engine"] for e in entries] == ["ffma", "ffma_maxdnn", "mma_tf32", "mma_tf32_w64", "wgmma_tf32"]
    for entry in entries:
        [launch] = entry["launches"]
        assert sorted(launch["cuda_args"]) == ["w", "x", "y"] and entry["params"]["y"] == [96, 56, 56, 4]
    if sass:  # each k loop's SASS mix: FFMA for the FFMA tile, mma for the tensor-core ones
        loops = [e["sass_loop"] for e in entries]
        assert all(loop["ffma"] > 0.8 * loop["instructions"] and loop["hmma"] == 0 for loop in loops[:2])
        assert all(loop["hmma"] > 0 and loop["ffma"] == 0 for loop in loops[2:4])
        assert loops[4]["hgmma"] > 0 and loops[4]["arch"] == "sm_90a"  # wgmma: Hopper's own target
        assert "% FFMA (" in out and "% HMMA (" in out and "% HGMMA (" in out
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_check

    cubins = gpu_check.compile_all([tmp_path / e["file"] for e in entries], "sm_90")
    for cubin in cubins.values():
        assert not isinstance(cubin, Exception), cubin
        assert cubin.read_bytes()[:4] == b"\x7fELF"
    assert cubins[tmp_path / entries[4]["file"]].name.endswith(".sm_90a.cubin")
    out = subprocess.run([sys.executable, "bench/gpu_check.py", "--kernels", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and "gpu_check:" in out.stderr  # no GPU (or no CuPy) here: says so
    # the whole script, kernels on the CPU emulator: layouts, argument order and checks are right
    env = {**os.environ, "KERNELS": str(tmp_path), "PYTHON": sys.executable, "OUT": str(tmp_path / "report"),
           # CRS order, and RSC with split-K (AlexNet conv2 at batch 2: 69 blocks, 5 slices of taps),
           # and conv2 (5x5) as Winograd F(4x4, 5x5): three kernels; both on wgmma (conv2's A fragments
           # gathered from the input, or from a shared tile), tf32 and bf16 (weights packed in pairs);
           # and mma.sync tf32; the training gradients on the FFMA tile: conv1's dW (its input is
           # the images: no dX), conv2's dX (stride 1: one phase, split-K) and dW.
           "EXPORT_ARGS": "--sets alexnet --batch 2 --layers 2 --engines ffma ffma:maxdnn winograd "
                          "mma_tf32 wgmma_tf32 wgmma_tf32:shared wgmma_bf16 --train-sets alexnet"}
    result = subprocess.run(["bash", "bench/gpu_check.sh", "--emulate", "--repeat", "0"], cwd=ROOT,
                            capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "16/16 layers correct" in result.stdout
    report = json.loads((tmp_path / "report" / "gpu_check.json").read_text())
    wgmma = ["wgmma_tf32", "wgmma_tf32_shared", "wgmma_bf16"]
    ffma = ["ffma", "ffma_maxdnn"]  # choose_tile's (16 x 8 threads) and maxDNN's 64 x 64
    assert [row["engine"] for row in report["layers"]] == [*ffma, "mma_tf32", *wgmma, "ffma", *ffma, "winograd",
                                                            "mma_tf32", *wgmma, "ffma", "ffma"]
    assert all(row["ok"] for row in report["layers"])
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert [e.get("pass", "forward") for e in manifest["layers"]] == [
        *["forward"] * 6, "weight_gradient", *["forward"] * 7, "data_gradient", "weight_gradient"]
    assert [e.get("splits") for e in manifest["layers"]] == [*[1] * 7, 5, 5, 1, 5, 5, 5, 5, 25, 1]
    assert [len(e["launches"]) for e in manifest["layers"]] == [*[1] * 7, 2, 2, 3, 2, 2, 2, 2, 2, 1]
    # dW of conv1 is x^T (3 images of 2 channels) convolved with dY^T (64 filters, 55 x 55 taps;
    # the padding row below the image no tap reads dropped: (2, 2, 1, 1))
    assert manifest["layers"][6]["x_nchw"] == [3, 2, 224, 224] and manifest["layers"][6]["w_oihw"] == [64, 2, 55, 55]
    assert manifest["layers"][6]["padding"] == [2, 2, 1, 1] and manifest["layers"][6]["dilation"] == [4, 4]
    assert "| alexnet conv2 | ffma dX | " in result.stdout and "| alexnet conv2 | dW | 1 | " in result.stdout
    assert "| alexnet conv2 | ffma | 96x64 (12x8), K/5 |" in result.stdout  # 1458 columns: 64 wide
    # wgmma: conv1's 64 x 128 tile fits 48 KB in tf32 (bf16's k steps of 16 double the data tile);
    # conv2's 96 x 128 (192 filters) has its output tile in dynamic shared memory, which the check
    # launches with
    assert [e["launches"][0]["shared_bytes"] for e in manifest["layers"] if "wgmma" in e["engine"]] == [
        0, 0, 4 * 64 * 128, *[4 * 96 * 128] * 3]
    assert "| alexnet conv2 | winograd | F(4x4), 64x128 (16x8), est. " in result.stdout and "% eff." in result.stdout


def test_tutorial_05_training(tmp_path):
    plot = tmp_path / "loss.png"
    out = _run("tutorials/05_training.py", "--steps", "20", "--plot", str(plot))
    assert "conv2d_backward_weight" in out and "max_pool2d_backward" in out
    assert float(out.split("from PyTorch's losses: ")[1].split()[0]) < 1e-3
    assert plot.stat().st_size > 10_000


def test_bench_train_runs():
    out = _run("bench/train.py", "--set", "resnet50", "--batch", "1", "--layers", "1", "--repeat", "1",
               env={"TVM_NUM_THREADS": "1"})
    assert "stem_7x7s2" in out and "dw: median" in out


def test_bench_train_times_the_blocked_kernels():
    """--blocked: the kernels alone; a strided layer's dX is its phases and their interleave; the
    network's first layer has no dX."""
    out = _run("bench/train.py", "--set", "resnet50", "--batch", "1", "--only", "stem_7x7s2,s3_3x3_128-128_s2",
               "--repeat", "1", "--blocked", env={"TVM_NUM_THREADS": "1"})
    rows = {line.split(" | ")[0]: line.split(" | ") for line in out.splitlines() if " | " in line}
    assert set(rows) == {"layer", "stem_7x7s2", "s3_3x3_128-128_s2"} and "kernels alone" in out
    assert rows["stem_7x7s2"][6:10] == ["-"] * 4 and float(rows["s3_3x3_128-128_s2"][7]) > 0


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("batch_norm", ["inference", "training"])
def test_bench_train_times_whole_steps(batch_norm):
    """(training: the running statistics are states, fed back step after step, also from the library)"""
    out = _run("bench/train.py", "--model", "resnet18", "--size", "32", "--batch", "2", "--repeat", "1",
               "--no-compile", "--batch-norm", batch_norm, env={"TVM_NUM_THREADS": "1"})
    rows = {line.split(" | ")[0]: line.split(" | ") for line in out.splitlines() if " | " in line}
    assert set(rows) == {"side", "tvm_ext", "torch"}
    assert rows["tvm_ext"][2] == "1.00x" and float(rows["torch"][3]) > 100  # peak MiB of a process of its own
    in_process, library = (float(mib) for mib in rows["tvm_ext"][3].split(" / "))  # built there / loaded
    assert in_process > 100 and library > 100


@pytest.mark.slow
@pytest.mark.long
def test_bench_profile_step_sums_the_kernels():
    out = _run("bench/profile_step.py", "--model", "resnet18", "--size", "32", "--batch", "2", "--threads", "1",
               "--repeat", "1", "--top", "5")
    rows = [line.split(" | ") for line in out.splitlines() if " | " in line]
    split = rows.index(["kernel", "ms", "calls", "kind"])
    kinds = {row[0]: float(row[1]) for row in rows[1:split]}
    assert {"convolution", "weight gradient", "batch norm forward", "batch norm backward"} <= set(kinds), out
    assert len(rows) - split - 1 == 5 and all(row[3] in kinds for row in rows[split + 1:]), out
