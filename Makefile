# The course in two commands:  make lab   (learn)   and   make test   (what CI runs).
# Both create .venv and install the course into it the first time.

PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# JupyterLab listens on this machine only unless told otherwise: make lab LAB_IP=0.0.0.0
LAB_IP   ?= 127.0.0.1
LAB_PORT ?= 8888
# The Pythons the pinned torch (2.14.1) has wheels for; pyproject.toml says the same.
PYTHON_VERSION = import sys; print("%d.%d" % sys.version_info[:2])
SUPPORTED      = 3.11 3.12 3.13

# The Pythons on this machine, for a PYTHON= that names none or an unsupported one: those on
# PATH, pyenv's versions (its shims answer only for the version pyenv has active) and the
# usual system folders; each that runs, once, with its version.
FIND_PYTHONS = seen=" "; \
	for p in $$(IFS=:; for d in $$PATH; do ls -d "$$d"/python3.[0-9]* 2>/dev/null; done) \
	         $${PYENV_ROOT:-$$HOME/.pyenv}/versions/*/bin/python3 /usr/bin/python3.* /usr/local/bin/python3.* \
	         /opt/homebrew/bin/python3.*; do \
	  case "$$p" in *-config|*[!0-9]) continue;; esac; \
	  real=$$(readlink -f "$$p" 2>/dev/null || echo "$$p"); \
	  case "$$seen" in *" $$real "*) continue;; esac; seen="$$seen$$real "; \
	  v=$$("$$p" -c '$(PYTHON_VERSION)' 2>/dev/null) || continue; \
	  case " $(SUPPORTED) " in *" $$v "*) echo "  $$p  (Python $$v)";; *) echo "  $$p  (Python $$v, not supported)";; esac; \
	done
NAME_ONE = found=$$($(FIND_PYTHONS)); echo "Pythons found here:"; echo "$${found:-  none}"; \
	supported=$$(echo "$$found" | grep -v -e "not supported" -e /shims/); \
	wanted=$$(basename "$(PYTHON)" | sed -n 's/^python\(3\.[0-9][0-9]*\)$$/\1/p'); \
	usable=$$( (echo "$$supported" | grep -F "(Python $$wanted)"; echo "$$supported") | head -n 1 | awk '{print $$1}'); \
	if [ -n "$$usable" ]; then echo "name one by its full path: make $(MAKECMDGOALS) PYTHON=$$usable"; \
	else echo "install Python 3.11, 3.12 or 3.13 (python.org, your package manager, or pyenv install 3.12), then name it: make $(MAKECMDGOALS) PYTHON=/path/to/python3.12"; fi

.PHONY: lab test quick exercises html run-times workers gpu-check flakiness clean FORCE

# Made again when pyproject.toml changes, when the last install did not finish, when .venv no
# longer runs (the Python that made it was removed), and when PYTHON= on the command line
# names another version than the one that made .venv: the recipe then replaces it (it says so).
# Without PYTHON= an existing .venv is kept, whatever `python3` is today.
VENV_VERSION := $(shell $(BIN)/python -c '$(PYTHON_VERSION)' 2>/dev/null)
ifneq ($(wildcard $(BIN)/spike-course),)
  ifeq ($(VENV_VERSION),)
    REMAKE_VENV = FORCE
  else ifeq ($(origin PYTHON),command line)
    ifneq ($(VENV_VERSION),$(shell $(PYTHON) -c '$(PYTHON_VERSION)' 2>/dev/null))
      REMAKE_VENV = FORCE
    endif
  endif
endif

$(BIN)/spike-course: pyproject.toml $(REMAKE_VENV)
	@version=$$($(PYTHON) -c '$(PYTHON_VERSION)' 2>/dev/null) || { echo "no $(PYTHON) runs here (not on PATH, or a pyenv shim for a version pyenv has not made active)"; $(NAME_ONE); exit 1; }; \
	case " $(SUPPORTED) " in *" $$version "*) ;; *) echo "$(PYTHON) is Python $$version; the course needs 3.11, 3.12 or 3.13 (the pinned torch has wheels for those)"; $(NAME_ONE); exit 1;; esac; \
	if [ -e $(VENV) ]; then \
	  made="$(VENV_VERSION)"; \
	  if [ -z "$$made" ]; then \
	    echo "$(VENV) does not run (was the Python that made it removed?): removing $(VENV) and making it again"; \
	    rm -rf $(VENV); \
	  elif [ "$$made" != "$$version" ]; then \
	    echo "$(VENV) was made by Python $$made, and $(PYTHON) is $$version: removing $(VENV) and making it again"; \
	    rm -rf $(VENV); \
	  fi; \
	fi
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e ".[test]"
	touch $@

lab: $(BIN)/spike-course
	$(BIN)/spike-course lab --ip $(LAB_IP) --port $(LAB_PORT)

# Two tests at a time: most of a test's time is spent waiting for the ranks, kernels or
# torchrun it started, so one test at a time kept only one of two cores busy.
# --dist loadfile keeps a notebook's cells, and a module's shared launches, on one worker.
# Tests use the synthetic digits: the same data on every machine, no download. (Not the
# lab: there a learner's MNIST, in data/MNIST/raw/, is used when it is there.)
test quick flakiness: export SPIKE_COURSE_DATA = synthetic

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

# The README's run times, measured: every lecture executed afresh by make html (the cache
# emptied first; about 10 minutes on 2 cores), recorded in notebooks/run_times.json with the
# machine, then written into README.md. pytest's time: SPIKE_COURSE_RECORD_RUN_TIMES=1 make test.
run-times: $(BIN)/spike-course
	rm -rf _build/edition
	SPIKE_COURSE_RECORD_RUN_TIMES=1 $(BIN)/spike-course html --out _build/html
	$(BIN)/spike-course run-times

# Every chapter's worker scripts in one folder, to copy to the cluster (no notebook runs).
workers: $(BIN)/spike-course
	$(BIN)/spike-course workers --out cluster_workers

# On a GPU node: run every lecture and solution (or CHAPTERS="03 solutions/11"), print what
# each notebook's ranks used (backend, device, GPU, precision), seconds, and pass or every
# failing cell. With 2 GPUs or more each notebook runs with a GPU per rank and with the ranks
# sharing one (PLACEMENT=per-gpu or PLACEMENT=shared for one of them).
# Not part of `make test` (CI has no GPU).
PLACEMENT ?= auto
gpu-check: $(BIN)/spike-course
	$(BIN)/spike-course gpu-check --placement $(PLACEMENT) $(CHAPTERS)

# How often each chosen test fails in N runs: make flakiness RUNS=10 ITEMS="..."
RUNS  ?= 10
ITEMS ?= notebooks/00_welcome_and_setup.ipynb notebooks/07_launching_at_scale.ipynb solutions/07_launching_at_scale.ipynb tests/test_browser.py
flakiness: $(BIN)/spike-course
	$(BIN)/python benchmarks/flakiness.py --runs $(RUNS) $(ITEMS)

exercises: $(BIN)/spike-course
	$(BIN)/spike-course exercises

clean:
	rm -rf cluster_workers notebooks/workers solutions/workers exercises/workers notebooks/data solutions/data exercises/data _build

FORCE:
