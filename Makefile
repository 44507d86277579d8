# The course in two commands:  make lab   (learn)   and   make test   (what CI runs).
# Both create .venv and install the course into it the first time.

PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# JupyterLab listens on this machine only unless told otherwise: make lab LAB_IP=0.0.0.0
LAB_IP   ?= 127.0.0.1
LAB_PORT ?= 8888
# Tests use the synthetic digits: same data on every machine, no download.
export SPIKE_COURSE_DATA ?= synthetic

.PHONY: lab test quick exercises html workers gpu-check flakiness clean

$(BIN)/spike-course: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e ".[test]"
	touch $@

lab: $(BIN)/spike-course
	$(BIN)/spike-course lab --ip $(LAB_IP) --port $(LAB_PORT)

# Two tests at a time: most of a test's time is spent waiting for the ranks, kernels or
# torchrun it started, so one test at a time kept only one of two cores busy.
# --dist loadfile keeps a notebook's cells, and a module's shared launches, on one worker.
test: $(BIN)/spike-course
	$(BIN)/spike-course exercises --check
	$(BIN)/python -m pytest -n 2 --dist loadfile

# For whoever changes the course: every test that starts no process (rank, kernel, torchrun),
# in seconds. CI runs `make test`.
quick: $(BIN)/spike-course
	$(BIN)/python -m pytest tests -m "not processes" -q

html: $(BIN)/spike-course
	$(BIN)/spike-course html --out _build/html
	@echo "open _build/html/index.html"

# Every chapter's worker scripts in one folder, to copy to the cluster (no notebook runs).
workers: $(BIN)/spike-course
	$(BIN)/spike-course workers --out cluster_workers

# On a GPU node: run every lecture and solution, print backend, seconds and pass/fail.
# Not part of `make test` (CI has no GPU).
gpu-check: $(BIN)/spike-course
	$(BIN)/spike-course gpu-check

# How often each chosen test fails in N runs: make flakiness RUNS=10 ITEMS="..."
RUNS  ?= 10
ITEMS ?= notebooks/00_welcome_and_setup.ipynb notebooks/07_launching_at_scale.ipynb solutions/07_launching_at_scale.ipynb tests/test_browser.py
flakiness: $(BIN)/spike-course
	$(BIN)/python benchmarks/flakiness.py --runs $(RUNS) $(ITEMS)

exercises: $(BIN)/spike-course
	$(BIN)/spike-course exercises

clean:
	rm -rf cluster_workers notebooks/workers solutions/workers exercises/workers notebooks/data solutions/data exercises/data _build
