"""The tutorials run, and the benchmark scripts still work (smoke runs; speed is not tested)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str, timeout: int = 600) -> str:
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def test_tutorial_01_brgemm_microkernel():
    out = _run("tutorials/01_brgemm_microkernel.py", "--small")
    assert "relative error against float64 NumPy" in out and "spilled stack slots: 0" in out


def test_peak_quick(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import peak

    result = peak.measure(quick=True)
    assert result["peak_gflops_1thread"] > 1 and result["bandwidth_gbs_1thread"] > 0.1


def test_layers_bench_smoke(tmp_path):
    csv = tmp_path / "layers.csv"
    out = _run("bench/layers.py", "--set", "resnet50", "--layers", "2", "--repeat", "2", "--no-stock",
               "--csv", str(csv))
    assert "median %peak" in out
    lines = csv.read_text().splitlines()
    assert lines[0].startswith("layer,") and len(lines) == 3
    assert json.loads((ROOT / "bench" / "workloads.json").read_text())["resnet50"]


def test_tutorial_02_compile_a_network():
    out = _run("tutorials/02_compile_a_network.py")
    assert "relative error against PyTorch" in out and "brgemm_conv2d epilogue" in out
