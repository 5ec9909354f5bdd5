# Two user-facing targets, both from a fresh clone:
#   make demo   set up the trainer's environment if needed, then train a LangChain agent on the CPU: SFT on a teacher's traces, then RL
#   make test   set up or update the environments, then ruff, mypy --strict on agl_core, and every test suite
#
# Environments: .venv holds the whole repository editable with the core's test tools; each framework plugin
# is tested in its own .venvs/<plugin>, with the framework versions a user of that framework would have
# (tests/<plugin>/requirements.txt), because the frameworks' own pins conflict (crewai wants openai<3,
# openai-agents wants openai>=3). An environment is reinstalled only when its inputs are newer than its stamp.

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

.PHONY: help demo trace-demo test test-core install clean
# The venv stamps are files make builds on the way to test-%: keep them, or every run reinstalls every venv.
.SECONDARY:

help:
	@echo "make demo         set up .venvs/trainer and train a LangChain agent on the CPU: SFT, then RL (agl demo)"
	@echo "make trace-demo   set up .venv and trace an openai-client agent, printing its transitions"
	@echo "make test   set up .venv, then ruff check, mypy --strict src/agl_core, pytest"

$(VPY):
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "agl needs Python >= 3.11 as $(PYTHON); found " + sys.version.split()[0])'
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(VPY)
	$(VPY) -m pip install -e '.[dev]'
	@touch $@

install: $(STAMP)

# The main job: a tiny text model behind a LangChain agent, SFT on a teacher's traces then RL on this CPU
# (agl_trainer.demo); its environment is the trainer's.
demo: .venvs/trainer/.agl-installed
	.venvs/trainer/bin/agl demo

# Trace an agent on the plain openai client and print its transitions (no training): the core alone.
trace-demo: $(STAMP)
	$(VPY) examples/trace_openai_agent.py

# Plugins with a test suite of their own: tests/<plugin>/requirements.txt marks one.
PLUGIN_SUITES := $(patsubst tests/%/requirements.txt,%,$(wildcard tests/*/requirements.txt))

# pytest's exit 5 (nothing collected) must fail loudly, never pass as green.
define run_pytest
	@rc=0; $(1) -m pytest -q $(2) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: FAILED: pytest collected no tests in $(2) (exit 5)" >&2; fi; \
	exit $$rc
endef

.venvs/%/.agl-installed: tests/%/requirements.txt pyproject.toml
	$(PYTHON) -m venv .venvs/$*
	.venvs/$*/bin/python -m pip install -q -e '.[dev]' -r tests/$*/requirements.txt
	.venvs/$*/bin/python -m pip check
	@touch $@

test-core: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy --strict src/agl_core
	$(call run_pytest,$(VPY),tests/core)

# A suite may run another suite's tests against its own versions (an older framework release):
# tests/<suite>/testdir then names the folder to run.
test-%: .venvs/%/.agl-installed
	$(call run_pytest,.venvs/$*/bin/python,$(shell cat tests/$*/testdir 2>/dev/null || echo tests/$*))

# Every environment is set up first, several at once (pip waits on downloads and unpacking far more than on
# the CPU: one at a time, the fourteen took twenty minutes of CI's time), each one's output kept together (-O).
# The suites then run in two streams, one per core: the trainer's (twelve minutes) beside all the others one
# after another (as long again); each suite's output is printed whole when it ends, and -k runs every suite
# even after one fails, so one CI run names every failure.
ENV_JOBS ?= 4
# the two with torch take longest: they start first
HEAVY_ENVS := $(filter trainer verl,$(PLUGIN_SUITES))
ENV_STAMPS := $(addsuffix /.agl-installed,$(addprefix .venvs/,$(HEAVY_ENVS) $(filter-out $(HEAVY_ENVS),$(PLUGIN_SUITES)))) $(STAMP)
.PHONY: envs
envs:
	$(MAKE) --no-print-directory -j$(ENV_JOBS) -O $(ENV_STAMPS) chromium

test: envs
	$(MAKE) --no-print-directory -j2 -O -k test-trainer test-others

# every suite but the trainer's, one after another
.PHONY: test-others
test-others: test-core $(addprefix test-,$(filter-out trainer,$(PLUGIN_SUITES)))

# The dashboard's browser tests drive Debian's chromium (offline, headless): installed here when missing,
# as root (CI runs as root on a fresh Debian machine); otherwise the tests fail naming what to install.
CHROMIUM ?= /usr/bin/chromium
.PHONY: chromium
chromium:
	@if [ ! -x "$(CHROMIUM)" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	  else echo "make test-dashboard: no $(CHROMIUM); install Debian's chromium (apt-get install chromium)" >&2; fi; \
	fi
test-dashboard: chromium

clean:
	rm -rf $(VENV) .venvs build dist dists/*/dist
