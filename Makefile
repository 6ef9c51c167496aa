# The two README commands: `make run` (set up + run the default pipeline) and `make test`.
# Installs into .venv with the tested versions from constraints.txt. torch is installed first:
# a bare torch requirement in an empty venv would pull a multi-GB CUDA build.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export DO_NOT_TRACK ?= true
export MLFLOW_DISABLE_TELEMETRY ?= true
export DVC_NO_ANALYTICS ?= 1
export TOKENIZERS_PARALLELISM ?= false
export HF_HOME ?= $(CURDIR)/.cache/hf
export DVC_SITE_CACHE_DIR ?= $(CURDIR)/.cache/dvc-site
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup run sft-base sft-agent distill-teacher test test-slow test-docs test-slow-docs fuzz stack clean-outputs

# The `dvc plots show` page template with Vega inlined, so the page draws offline
# (flows/plots_page.py; needs npm once; without it DVC's page loads Vega from its CDN).
PLOTS_PAGE := .cache/vega/dvc-plots.html

setup: $(STAMP) $(PLOTS_PAGE)

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 -c constraints.txt
	$(PY) -m pip install -q -e ".[test]" -c constraints.txt
	touch $@

$(PLOTS_PAGE): $(STAMP)
	-$(PY) -m flows.plots_page

run: setup
	finetune run

# The base of the DPO and GRPO examples (params/dpo-gsm8k.yaml, params/grpo-gsm8k.yaml): the
# default run's merged model, copied where their exports cannot overwrite it. Made once: with
# data/sft/gsm8k there, nothing runs (so GRPO after DPO starts from the same SFT model).
sft-base: data/sft/gsm8k

data/sft/gsm8k: | setup
	finetune run
	rm -rf $@.tmp && mkdir -p $(@D) && cp -r data/export $@.tmp && mv $@.tmp $@

# The base of the calculator agent (params/agent-gsm8k.yaml): params/agent-sft-gsm8k.yaml's
# six stages, its model copied to data/sft/gsm8k-agent. Made once, like sft-base.
sft-agent: data/sft/gsm8k-agent

data/sft/gsm8k-agent: | setup
	for stage in download format tokenize train evaluate export; do \
		finetune stage $$stage -p params/agent-sft-gsm8k.yaml || exit $$?; done
	rm -rf $@.tmp && mkdir -p $(@D) && cp -r data/export $@.tmp && mv $@.tmp $@

# The teacher of the distillation example (params/distill-gsm8k.yaml): params/gsm8k-teacher.yaml's
# full fine-tune of the shipped base, run in a temporary copy of the project by
# preprocess/gsm8k_teacher.py, its model copied to data/sft/gsm8k-teacher. Made once.
distill-teacher: data/sft/gsm8k-teacher

data/sft/gsm8k-teacher: | setup
	$(PY) -m preprocess.gsm8k_teacher

stack: setup
	finetune-stack

# The inner loop: every test whose runs are one process each (a real torchrun with one rank
# included). Test files run side by side on the cores (pytest-xdist; a whole file per worker,
# so module fixtures are built once), the longest first (tests/conftest.py LONGEST_FIRST); test
# runs use one torch thread per process (tests/conftest.py).
test: setup
	$(PY) -m pytest -n auto --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The second step of .ci/run: what `make test` leaves out, real components of minutes each.
# Runs of two or more processes under torchrun (marker distributed: DDP, FSDP2, DiLoCo,
# pipeline, two nodes on loopback); the whole pipeline through `dvc repro` and the pages a
# person sees (marker slow: tests/test_pipeline.py); `finetune reproduce` rebuilding a
# registered model from a fresh clone and the DVC remote (marker clean_room); the Prefect
# stack end to end (marker stack_e2e: a server on loopback, deployment runs, the schedule, a
# clean stop); the train stage on a real one-host SLURM cluster (marker slurm: needs Debian's
# slurm-wlm and munge, which .ci/run installs). Side by side, the longest files first.
test-slow: setup
	$(PY) -m pytest -m "slow or distributed or clean_room or stack_e2e or slurm" -n auto \
		--dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The third step of .ci/run: every command the README and docs/ show in a bash block, run on a
# fresh clone of the project, one test per block (tests/test_docs.py, marker docs_commands,
# which `make test` leaves out): a page's blocks run in reading order in one clone on one of two
# lanes (a test class each: --dist loadscope), every clone sharing one DVC cache as a team's do, so
# what one clone ran, DVC's run-cache restores in another; -rP prints each block's time. Runs
# the committed tree: commit first. The benchmark suite's smoke block runs only with
# FINETUNE_DOCS_BENCH=1 (about 4 minutes; not part of .ci/run).
test-docs: setup
	$(PY) -m pytest -m docs_commands -n 2 --dist loadscope -rP $(PYTEST_ARGS) tests/test_docs.py

# .ci/run's last step: `make test-slow` and `make test-docs` as one session on the two cores,
# the long units first and the short ones last (tests/conftest.py SLOW_LONGEST_FIRST): one
# step's tail and the docs lane's wait for the README's `make run` fill with the other's work
# instead of a core idling (the two apart: 19:32 + 14:45 on the 2-core Xeon). --dist
# loadscope keeps a slow file (no test class) on one worker, as loadfile does, and a docs
# lane (a class) on one worker in order.
test-slow-docs: setup
	$(PY) -m pytest -m "slow or distributed or clean_room or stack_e2e or slurm or docs_commands" \
		-n 2 --dist loadscope --no-loadscope-reorder -rP $(PYTEST_ARGS)

# The config fuzzer at length: FUZZ_EXAMPLES draws from the schema (tests/test_config_fuzz.py),
# seeded by FUZZ_SEED (default: the time; printed, so a failing run can be drawn again).
FUZZ_EXAMPLES ?= 2000
FUZZ_SEED ?= $(shell date +%s)
fuzz: setup
	@echo "fuzz: FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) FUZZ_SEED=$(FUZZ_SEED)"
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) FUZZ_SEED=$(FUZZ_SEED) $(PY) -m pytest -s -q tests/test_config_fuzz.py

clean-outputs:
	rm -rf data/raw data/formatted data/tokenized data/trained data/checkpoints data/export
