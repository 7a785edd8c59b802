# The front door: every user and developer action is a target here (see the README).
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV    := .venv
PY      := $(VENV)/bin/python
CONFIG  ?= configs/default.yaml
RUN_DIR ?=
ARGS    ?=
# All local GPUs, or 2 CPU processes where there is none.
GPUS    := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')
NPROC   ?= $(if $(filter-out 0,$(GPUS)),$(GPUS),2)
OVERRIDES = $(if $(RUN_DIR),run_dir=$(RUN_DIR)) $(ARGS)

.PHONY: help venv run check test bench clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^[^:]*:([a-z-]+):.*## /\1\t/; s/^([a-z-]+):.*## /\1\t/'

# The venv is rebuilt when pyproject.toml changes. torch is asked for with a range, never ==2.13.0
# (see README, "Installing").
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

venv: $(VENV)/.installed ## create .venv with the trainer and its dependencies

check: venv ## validate CONFIG (+ARGS) for NPROC processes on this machine
	@$(PY) -m trainer.check --config $(CONFIG) --nproc $(NPROC) $(OVERRIDES)

run: check ## train CONFIG with torchrun on NPROC local processes (RUN_DIR=, ARGS="k=v ...")
	$(VENV)/bin/torchrun --standalone --nproc-per-node=$(NPROC) -m trainer --config $(CONFIG) $(OVERRIDES)

test: venv ## run the whole test suite
	$(PY) -m pytest tests $(PYTEST_ARGS)

clean: ## remove the venv and local runs
	rm -rf $(VENV) runs
