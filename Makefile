# The front door: every user and developer action is a target here (see the README).
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV    := .venv
PY      := $(VENV)/bin/python
CONFIG  ?= configs/default.yaml
# CONFIG left at its default (not on the command line or in the environment): a resumed run's
# differences from that file are not the user's doing, and the trainer says nothing of them.
CONFIG_DEFAULT = $(if $(filter file,$(origin CONFIG)),--config-default)
RUN_DIR ?=
ARGS    ?=
# All local GPUs, or 2 CPU processes where there is none.
GPUS    := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')
NPROC   ?= $(if $(filter-out 0,$(GPUS)),$(GPUS),2)
OVERRIDES = $(if $(RUN_DIR),run_dir=$(RUN_DIR)) $(ARGS)
# make config: the processes for the batch where the user gave them (NPROC=, NODES=), else the printer's
# own default (the fewest that fit parallel.tp), not this machine's count.
given = $(filter command line environment environment override override,$(origin $(1)))
PRINT_PROCS = $(if $(call given,NPROC),--nproc $(NPROC)) $(if $(call given,NODES),--nnodes $(NODES))

CPU     ?=
# Docker (make image, make up): one image for GPUs and CPUs.
IMAGE      ?= fsdp-trainer:latest
IMAGE_ARGS ?=
# Slurm (make submit): empty values mean "not set": GPUS_PER_NODE and CPUS_PER_NODE then come from
# the partition's nodes (gres); an empty RUN_DIR takes ARGS' run_dir=, else the config's, else runs/<config>-<date>. DRY_RUN=1 prints the
# resources with the reason for each, and the batch script, and submits nothing.
NODES         ?= 1
# The fewest nodes the job may run on: Slurm gets --nodes=MIN_NODES-NODES, and a job whose node died
# is requeued on the nodes left; empty: exactly NODES.
MIN_NODES     ?=
GPUS_PER_NODE ?=
CPUS_PER_NODE ?=
TIME          ?=
PARTITION     ?=
CONTAINER     ?=
NET_IF        ?=
WARN          ?= 120
LAUNCHER      ?= sbatch
DRY_RUN       ?=
# Kubernetes (make submit-k8s; docs/kubernetes.md): NODES, GPUS_PER_NODE (empty: 8), IMAGE, CONFIG, RUN_DIR (in
# the pods, under /runs: empty, /runs/JOB_NAME) and GPU_MEM_GB as above; PVC: the ReadWriteMany claim of the run
# dirs; QUEUE: a Kueue LocalQueue (GANG=volcano: a Volcano queue); OUT: the manifest's file (empty: stdout);
# APPLY=1: kubectl apply -f it. RUN_DIR=s3://BUCKET/PREFIX: the run dir in a bucket (no PVC needed); S3_SECRET:
# the Secret of its AWS_* keys (empty: the pods' service account's credentials); AWS_ENDPOINT_URL=, given on
# the command line (not from the environment), the pods' endpoint (MinIO, Ceph).
KIND          ?= trainjob
PVC           ?=
JOB_NAME      ?=
NAMESPACE     ?=
QUEUE         ?=
GANG          ?= kueue
S3_SECRET     ?=
RUNTIME       ?= torch-distributed
GRACE         ?=
MAX_RESTARTS  ?= 5
OUT           ?=
APPLY         ?=
# Memory of one GPU in GB for the memory preflight (make check, make submit); empty: the local GPUs
# (check), the partition's GPU type from gres (submit).
GPU_MEM_GB    ?=

.PHONY: help venv venv-test config run check evaluate plot test test-fast test-compat test-gpu gpu-check lint format bench image up docker-engine submit submit-k8s slurm-up slurm-down clean

help: ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^[^:]*:([a-z0-9-]+):.*## /\1\t/; s/^([a-z0-9-]+):.*## /\1\t/'

# The venv is rebuilt when pyproject.toml changes. torch is asked for with a range, never ==2.13.0
# (see README, "Installing"). Two stamps: what running needs (the trainer and its dependencies: make
# run, check, submit, ...) and, on top, the test extra (pytest, ruff, transformers, wandb, mlflow,
# torchao, hadolint: make test, lint, format), so that a machine that only trains never installs them.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

venv: $(VENV)/.installed ## create .venv with the trainer and what running it needs (no test tools)

venv-test: $(VENV)/.installed-test ## venv, plus the test extra (pytest, ruff, transformers, ...): what test and lint use

check: venv ## validate CONFIG (+ARGS) for NPROC processes x NODES nodes; the plan; memory per GPU (GPU_MEM_GB=)
	@$(PY) -m trainer.check --config $(CONFIG) --nproc $(NPROC) --nnodes $(NODES) --gpu-mem-gb "$(GPU_MEM_GB)" $(OVERRIDES)

config: venv ## print every key of CONFIG (+ARGS, RUN_DIR=): its value, its default where that differs, its meaning
	@$(PY) -m trainer.config --print $(PRINT_PROCS) --config $(CONFIG) $(OVERRIDES)

run: venv ## train CONFIG on NPROC local processes (RUN_DIR=, ARGS="k=v ..."); checks the config first
	$(PY) -m trainer.launch --nproc-per-node=$(NPROC) --config $(CONFIG) $(CONFIG_DEFAULT) $(OVERRIDES)

evaluate: venv ## evaluate RUN_DIR's newest checkpoint without training (ARGS="--step N eval.batches=64"): one JSON row
	@test -n "$(RUN_DIR)" || { echo "error: give the run to evaluate: make evaluate RUN_DIR=runs/..." >&2; exit 2; }
	$(PY) -m trainer.evaluate $(RUN_DIR) $(ARGS)

plot: venv ## summarise runs and plot their loss: make plot RUN_DIR="runs/a runs/b" [PLOT=loss.png]
	$(PY) -m trainer.metrics $(RUN_DIR) --plot $(or $(PLOT),$(firstword $(RUN_DIR))/loss.png)

# Two tiers by folder (tests/conftest.py): tests/unit/ in this process; tests/system/ starts ranks,
# launchers, Slurm jobs and images (its tests are also marked slow: -m "not slow" selects tests/unit/).
test: venv-test ## run the whole test suite, unit tier first (what CI runs; 50 min on 2 cores, 2026-11-29)
	$(PY) -m pytest tests/unit tests/system $(PYTEST_ARGS)

test-fast: venv-test ## the unit tier, tests/unit/ (1 min 40 s on an idle 2-core machine, 2026-11-29): the edit-test loop
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

# The oldest torch the trainer supports (pyproject.toml's torch>=2.11), in a venv of its own with only
# what the selected tests import; never the trainer's extras. The tests: FSDP2, bf16 + activation
# checkpointing (full and selective), compile (CPU), DCP save and load 2 -> 3 ranks, the restricted
# unpickler, the launcher (a failure, a stop signal, the rendezvous' _delay), trainer/torch_compat.py's
# private names, the save planner that computes DCP's global plan from the layout (trainer/checkpoint/save_plan.py)
# and pipeline parallelism's refusals and stage assignment (its schedules ran on 2.11 by hand but zbv: docs/parallelism.md).
COMPAT_VENV  := .venv-compat
COMPAT_TORCH ?= 2.11.*
COMPAT_TESTS := \
	'tests/system/test_parallel.py::test_matches_single_process[fsdp2]' \
	tests/system/test_parallel.py::test_bf16_with_activation_checkpointing_runs_and_stays_close \
	tests/unit/test_activation_checkpointing.py::test_checkpointing_recomputes_what_it_should_and_matches \
	tests/system/test_parallel.py::test_compile_matches \
	'tests/system/test_checkpoint.py::test_resume_on_other_process_counts[2-3]' \
	tests/unit/test_shard_reader.py \
	tests/unit/test_load_plan.py \
	tests/unit/test_torch_compat.py \
	tests/system/test_launch.py::test_a_failing_rank_is_one_launcher_line_and_exit_1 \
	tests/system/test_launch.py::test_signal_to_the_launcher_alone_saves_exits_0_and_resumes \
	tests/unit/test_dist.py::test_the_launchers_rendezvous_polls_faster_only_while_it_runs \
	tests/system/test_tp.py::test_tp2_x_dp2_trains_as_dp4 \
	tests/unit/test_pp.py \
	tests/unit/test_save_plan.py \
	tests/system/test_save_plan.py

$(COMPAT_VENV)/.installed: Makefile
	python3 -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install --quiet "torch==$(COMPAT_TORCH)" pyyaml numpy xxhash safetensors pytest
	touch $@

test-compat: $(COMPAT_VENV)/.installed ## the oldest supported torch (2.11): a few tests in .venv-compat (about 1 min, 3 to build it)
	$(COMPAT_VENV)/bin/python -c 'import torch; print("test-compat: torch", torch.__version__)'
	$(COMPAT_VENV)/bin/python -m pytest -p no:cacheprovider $(COMPAT_TESTS) $(PYTEST_ARGS)

# No venv: the GPU machine's own python3 and torch, this checkout on PYTHONPATH (issue #33).
gpu-check: ## on one GPU, in at most 8 min: front door, test_gpu.py, AC bf16, memory calibration, 1b MFU -> bench/results/
	PYTHONPATH=. python3 bench/gpu_check.py $(GPU_CHECK_ARGS)

test-gpu: venv-test ## the CUDA-path tests on this machine's GPU (skipped without one; CI has none)
	$(PY) -m pytest tests/system/test_gpu.py $(PYTEST_ARGS)

# What lint checks: ruff's rules and format (pyproject.toml), and that every noqa says why on its line.
LINT_PATHS := trainer tests bench
NOQA_WITHOUT_REASON := \#[[:space:]]*noqa(:[[:space:]]*[A-Z]+[0-9]+([[:space:]]*,[[:space:]]*[A-Z]+[0-9]+)*)?[[:space:]]*$$

lint: venv-test ## ruff check and ruff format --check over trainer, tests and bench; a noqa needs its reason
	@status=0; \
	$(VENV)/bin/ruff check $(LINT_PATHS) tools || status=1; \
	$(VENV)/bin/ruff format --check $(LINT_PATHS) tools || status=1; \
	$(PY) tools/imports.py --quiet || status=1; \
	if grep -rnE --include='*.py' '$(NOQA_WITHOUT_REASON)' $(LINT_PATHS); then \
	    echo "lint: each noqa above needs its reason on its line: # noqa: E402 - why" >&2; status=1; fi; \
	exit $$status

format: venv-test ## apply ruff's safe fixes and its format to trainer, tests and bench (make lint: what is left)
	$(VENV)/bin/ruff check --fix-only $(LINT_PATHS)
	$(VENV)/bin/ruff format $(LINT_PATHS)

bench: venv ## side-by-side performance report -> bench/results/<date>-<host>.md/.json (about 20 min on CPU)
	$(PY) bench/run.py $(BENCH_ARGS)

image: ## build the image (CUDA torch from PyPI on Debian; runs on GPUs and CPUs): IMAGE=, IMAGE_ARGS="--build-arg ..."
	docker/build-image.sh $(IMAGE) $(IMAGE_ARGS)

up: ## train with Docker Compose in the foreground on all GPUs (CPU=1: on the CPU, same image); RUN_DIR, CONFIG, ARGS
	IMAGE="$(IMAGE)" RUN_DIR="$(RUN_DIR)" CONFIG="$(CONFIG)" ARGS='$(ARGS)' docker/up.sh $(if $(filter 1,$(CPU)),cpu)

docker-engine: ## start a local Docker engine (Debian, root; host networking)
	docker/engine-up.sh

submit: venv ## submit to Slurm: NODES=4 [MIN_NODES=3 GPU_MEM_GB= GPUS_PER_NODE= CONFIG= RUN_DIR= TIME= PARTITION= CONTAINER= NET_IF= LAUNCHER=submitit DRY_RUN=1 ARGS=]
	@$(PY) -m trainer.submit --nodes "$(NODES)" --min-nodes "$(MIN_NODES)" --gpus-per-node "$(GPUS_PER_NODE)" --cpus-per-node "$(CPUS_PER_NODE)" \
	    --config "$(CONFIG)" --run-dir "$(RUN_DIR)" --time "$(TIME)" --partition "$(PARTITION)" \
	    --container "$(CONTAINER)" --net-if "$(NET_IF)" --warn-seconds "$(WARN)" --launcher "$(LAUNCHER)" \
	    --gpu-mem-gb "$(GPU_MEM_GB)" \
	    $(if $(filter 1,$(DRY_RUN)),--dry-run) -- $(ARGS)

submit-k8s: venv ## a Kubernetes job from the image: NODES=4 PVC=claim IMAGE=reg/img:tag [KIND=trainjob|jobset|runtime GPUS_PER_NODE=8 QUEUE= GANG=kueue|volcano JOB_NAME= NAMESPACE= RUN_DIR=/runs/x|s3://bucket/prefix S3_SECRET= AWS_ENDPOINT_URL= RUNTIME= GRACE= MAX_RESTARTS= GPU_MEM_GB= OUT=file APPLY=1 CONFIG= ARGS=]
	@$(PY) -m trainer.launchers.k8s --nodes "$(NODES)" --gpus-per-node "$(or $(GPUS_PER_NODE),8)" --kind "$(KIND)" \
	    --image "$(IMAGE)" --pvc "$(PVC)" --name "$(JOB_NAME)" --namespace "$(NAMESPACE)" --config "$(CONFIG)" \
	    --run-dir "$(RUN_DIR)" --s3-secret "$(S3_SECRET)" \
	    --s3-endpoint "$(if $(filter command line,$(origin AWS_ENDPOINT_URL)),$(AWS_ENDPOINT_URL))" \
	    --queue "$(QUEUE)" --gang "$(GANG)" --runtime "$(RUNTIME)" --grace-seconds "$(GRACE)" \
	    --max-restarts "$(MAX_RESTARTS)" --gpu-mem-gb "$(GPU_MEM_GB)" --out "$(OUT)" $(if $(filter 1,$(APPLY)),--apply) -- $(ARGS)

# NODES for slurm-up only when given (make slurm-up NODES=8): its default is 4 nodes, not submit's 1.
slurm-up: ## start the local Slurm cluster, 4 nodes (NODES=8: 8; again without NODES: back to 4) for jobs and tests (root)
	bash slurm/local/up.sh $(if $(filter command line environment,$(origin NODES)),$(NODES))

slurm-down: ## stop the local Slurm cluster
	bash slurm/local/down.sh

clean: ## remove the venv and local runs
	rm -rf $(VENV) runs
