# sglang-eagle3: every target sets up what it needs (a project venv in .venv) by itself.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DATA   ?= $(or $(EAGLE3_DATA),../shared/data)
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: help venv test demo testbed bench-decode bench-acceptance tune-spec clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

$(STAMP): setup.py requirements.txt $(wildcard requirements-*.txt)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements.txt
	@if [ -f requirements-sglang.txt ]; then $(BIN)/pip install --quiet --disable-pip-version-check --no-deps -r requirements-sglang.txt; fi
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)  ## create/refresh the project venv (.venv)

testbed: $(STAMP)  ## prepare the embedded target (SmolLM2-135M-Instruct) and print its path
	$(BIN)/eagle3 testbed

test: $(STAMP)  ## run the whole test suite
	$(BIN)/eagle3 testbed >/dev/null
	$(BIN)/python -m pytest -q tests $(PYTEST_ARGS)

demo: $(STAMP)  ## speculative decoding on the embedded target: text + stats
	$(BIN)/eagle3 testbed
	$(BIN)/python -m sglang_eagle3.demo --data $(DATA)

bench-decode: $(STAMP)  ## bench/bench_decode.py: tokens/s of transformers vs our vanilla vs speculative
	$(BIN)/python bench/bench_decode.py --data $(DATA)

DRAFT ?= $(error set DRAFT=path/to/eagle3-draft)
bench-acceptance: $(STAMP)  ## bench/bench_acceptance.py: tau and speed-up per eval set (needs DRAFT=...)
	$(BIN)/python bench/bench_acceptance.py --draft $(DRAFT) --data $(DATA) --n 10 --out results/acceptance.json

tune-spec: $(STAMP)  ## bench/tune_spec.py: best tree per batch size -> profile + SGLang adaptive config (needs DRAFT=...)
	$(BIN)/python bench/tune_spec.py --draft $(DRAFT) --data $(DATA) --batch-sizes 1,2,4 --out results/spec_profile.json

clean:  ## remove the venv and caches (keeps ~/.cache/sglang_eagle3)
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
