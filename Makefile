# Two user-facing targets, both from a fresh clone:
#   make demo   set up .venv if needed, then run the example agent under agl
#   make test   set up or update .venv, then ruff, mypy --strict on agl_core, pytest
# .venv is (re)installed only when pyproject.toml is newer than the install stamp.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.agl-installed

# Tests and the demo never reach a model hub, and stay on one BLAS thread on small machines.
export HF_HUB_OFFLINE := 1
export OMP_NUM_THREADS := 1
# Hash randomisation stays on: tests must not depend on set or dict-of-str ordering.
unexport PYTHONHASHSEED

.PHONY: help demo test install clean

help:
	@echo "make demo   set up .venv and run examples/trace_openai_agent.py"
	@echo "make test   set up .venv, then ruff check, mypy --strict src/agl_core, pytest"

$(VPY):
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "agl needs Python >= 3.11 as $(PYTHON); found " + sys.version.split()[0])'
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(VPY)
	$(VPY) -m pip install -e '.[dev]'
	@touch $@

install: $(STAMP)

demo: $(STAMP)
	$(VPY) examples/trace_openai_agent.py

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy --strict src/agl_core
	@rc=0; $(VPY) -m pytest -q || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: FAILED: pytest collected no tests (exit 5)" >&2; fi; \
	exit $$rc

clean:
	rm -rf $(VENV) build dist dists/*/dist
