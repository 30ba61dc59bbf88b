"""The installed package stands alone: a wheel built from this tree, installed into a fresh venv
that sees the dependencies (TVM, NumPy, PyTorch, ...) but not this checkout, runs the demo from
outside the repository and finds the tuning records it ships."""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _dependencies_only(site: Path, farm: Path) -> Path:
    """`farm`: links to everything in the environment's site-packages except tvm_ext (the
    editable install's finder, .pth and dist-info, and anything named tvm_ext)."""
    farm.mkdir()
    for entry in site.iterdir():
        if "tvm_ext" not in entry.name:
            (farm / entry.name).symlink_to(entry)
    return farm


@pytest.mark.slow
@pytest.mark.long
def test_wheel_installs_and_runs_the_demo_outside_the_repository(tmp_path):
    # A copy of what the wheel is built from: the build writes build/ and *.egg-info next to its
    # sources, and a stale build/lib of the checkout must not leak into the wheel.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "python", src / "python",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc", "tuning_curve.png"))
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(src)], check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = dist.glob("tvm_ext-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    farm = _dependencies_only(Path(sysconfig.get_paths()["purelib"]), tmp_path / "deps")
    # addsitedir, not a bare path: the dependencies' own .pth files are read too
    (site / "deps.pth").write_text(f"import site; site.addsitedir({str(farm)!r})\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TVM_EXT_SCHEDULES")}

    def run(*args: str) -> str:
        out = subprocess.run([str(python), *args], cwd=elsewhere, env=env, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    installed = site / "tvm_ext"
    probe = run("-c", "import tvm_ext; from tvm_ext.tuning.records import shipped_records_dir as d; "
                      "print(tvm_ext.__file__); print(d({'kind': 'llvm', 'mcpu': 'znver4'}))")
    assert probe.split() == [str(installed / "__init__.py"), str(installed / "schedules" / "llvm-znver4")]
    assert all((installed / "testing" / name).is_file() for name in ("cuda_emulator.h", "cuda_emulator.cc"))

    out = run("-m", "tvm_ext", "demo", "--model", "alexnet", "--batch", "1", "--repeat", "1", "--threads", "1",
              "--no-stock")
    line = next(line for line in out.splitlines() if "tuning records for" in line)
    if f"shipped ({installed / 'schedules'}" in line:  # this CPU has records of its own (a Zen 4)
        assert "llvm-znver4" in line
    else:  # another CPU: the analytic schedules, and the demo names the targets the wheel has records for
        assert "none (analytic schedules; records are shipped for llvm-znver4)" in line, line
