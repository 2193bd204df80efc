# blockgen: one command sets up and runs the embedded default, one runs the tests.
#   make demo    set up .venv and train the embedded demo models offline on CPU
#   make test    set up .venv and run the test suite
#   make bench   print the benchmark ratios quoted in the README

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test bench clean

setup: $(VENV)/.installed

# torch==2.13.0 is pinned in pyproject.toml: its CPU build lies on disk here, an open range would
# download a CUDA build of several GB.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

demo: setup
	$(PY) -m blockgen.harness.cli demo --out-dir runs/demo

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) bench/bench_train.py

clean:
	rm -rf runs build dist *.egg-info
