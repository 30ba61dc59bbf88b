# Every target bootstraps .venv on a fresh clone; rerunning is cheap (a stamp file guards pip).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pytest-xdist workers: one per core of the CI machine (each gets one TVM thread, tests/conftest.py).
TEST_WORKERS ?= 2

.PHONY: demo test bench lint clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m tvm_ext demo --model resnet50 --batch 1

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests

bench: $(STAMP)
	$(PY) bench/peak.py
	$(PY) bench/layers.py --set resnet50 --batch 1 --threads 1

lint: $(STAMP)
	$(VENV)/bin/ruff check python tests bench tutorials

clean:
	rm -rf $(VENV) build *.egg-info python/*.egg-info
