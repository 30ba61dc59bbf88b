# Every target bootstraps .venv on a fresh clone; rerunning is cheap (a stamp file guards pip).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pytest-xdist workers: one per core of the CI machine (each gets one TVM thread, tests/conftest.py).
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=25

.PHONY: demo test test-long test-all test-fast check lint typecheck bench clean aarch64

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m tvm_ext demo --model resnet50 --batch 1

# The suite (what CI runs, .ci/run), the NEON kernels' emulated runs included when the AArch64
# sysroot can be prepared (else those tests skip and say why). The 32 tests marked `long`
# (tuning's crash recovery over RPC and three more tuning runs, the autotuning tutorial, the bench
# scripts' smoke runs, the zoo's four biggest builds, VGG-16 and OverFeat against float64, the
# wheel's install, the eager cache's 500 shapes: 10 s to three minutes each) run in
# `make test-long`, which keeps CI under its 25 minutes on 2 cores.
test: $(STAMP)
	$(PY) -m tvm_ext.testing.aarch64_sysroot || echo "aarch64: no emulator (see above); the NEON run tests will skip"
	$(PYTEST) -m 'not long' tests

test-long: $(STAMP)
	$(PYTEST) -m long tests

test-all: test test-long

# qemu-user and the AArch64 linker (apt-get, as root, when missing) and an AArch64 Python with
# NumPy, tvm-ffi and TVM's runtime in .aarch64/: tests/integration/test_aarch64.py runs in it.
aarch64: $(STAMP)
	$(PY) -m tvm_ext.testing.aarch64_sysroot

# The developer loop: the suite without the tests marked slow (tuning, networks, the wheel).
test-fast: $(STAMP)
	$(PYTEST) -m 'not slow' tests

# Lint, types and the fast tests: run before pushing.
check: lint typecheck test-fast

lint: $(STAMP)
	$(VENV)/bin/ruff check python tests bench tutorials

# basedpyright in basic mode ([tool.basedpyright] in pyproject.toml) on the package. The errors
# it found when it came in (0.5.14) are listed in .basedpyright/baseline.json, to burn down: it
# fails on any new one. After fixing some: basedpyright --writebaseline shrinks the list.
typecheck: $(STAMP)
	$(VENV)/bin/basedpyright --pythonpath $(PY) python/tvm_ext

bench: $(STAMP)
	$(PY) bench/peak.py
	$(PY) bench/layers.py --set resnet50 --batch 1 --threads 1

clean:
	rm -rf $(VENV) .aarch64 build *.egg-info python/*.egg-info
