# sglang-eagle3: every target sets up what it needs (a project venv in .venv) by itself.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DATA   ?= $(or $(EAGLE3_DATA),../shared/data)
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: help venv test demo testbed regenerate data dump train bench-decode bench-acceptance tune-spec clean

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

# The embedded draft's recipe, one resumable stage per target (each prints progress + ETA; rerun to resume).
RUN    ?= $(HOME)/.cache/sglang_eagle3/runs/smollm2-v2
REGEN_ROWS ?= 320
TRAIN_INPUTS ?= $(DATA)/train/sharegpt_1k.jsonl $(DATA)/train/alpaca_en_demo.json $(DATA)/train/gsm8k_train.jsonl \
                $(DATA)/train/glaive_toolcall_en_demo.json $(RUN)/regen_sharegpt.jsonl
STEPS  ?= 180
LR     ?= 1e-3
NPROC  ?= 1
THREADS ?= 2
FEATURES ?= fused
FEATURE_LOSS ?= 1
TRAIN_OUT ?= $(RUN)/train
regenerate: $(STAMP)  ## answer REGEN_ROWS ShareGPT prompts with the embedded target itself (resumable)
	$(BIN)/eagle3 regenerate $(DATA)/train/sharegpt_prompts.jsonl --target testbed --dtype bfloat16 \
	    --out $(RUN)/regen_sharegpt.jsonl --max-new-tokens 256 --batch-size 32 --max-rows $(REGEN_ROWS)

data: $(STAMP)  ## tokenize the training mix (+ regenerated answers) and build the draft vocab (coverage table)
	@test -f $(RUN)/regen_sharegpt.jsonl || { echo "run 'make regenerate' first"; exit 2; }
	$(BIN)/eagle3 prepare-data $(TRAIN_INPUTS) --target testbed --out $(RUN)/data --max-length 768 \
	    --max-rows 400 --draft-vocab-size 8192 --overwrite

dump: $(STAMP)  ## target features of the training data, bf16 safetensors shards (resumable; ~3.1 GB)
	$(BIN)/python train/dump_hidden_states.py --target testbed --data $(RUN)/data --out $(RUN)/dump \
	    --target-dtype bfloat16 --dtype bfloat16 --rows-per-shard 128 --batch-tokens 4096

train: $(STAMP)  ## train the draft from the dump (resumes); NPROC=2: 2 ranks with DeepSpeed ZeRO-2 over gloo
	OMP_NUM_THREADS=$(THREADS) $(BIN)/torchrun --standalone --nproc_per_node $(NPROC) train/train_eagle3.py \
	    --target testbed --data $(RUN)/dump --out $(TRAIN_OUT) --draft-vocab $(RUN)/data/draft_vocab.safetensors \
	    --max-length 768 --lr $(LR) --warmup-ratio 0.03 --min-lr-ratio 0.1 --grad-accum 4 --max-steps $(STEPS) \
	    --eval-every 50 --save-every 25 --eval-rows 16 --features $(FEATURES) --feature-loss-weight $(FEATURE_LOSS) \
	    $(if $(filter 1,$(NPROC)),--backend ddp,--deepspeed-config train/ds_zero2.json) --resume

DRAFT ?= $(error set DRAFT=path/to/eagle3-draft)
bench-acceptance: $(STAMP)  ## bench/bench_acceptance.py: tau and speed-up per eval set (needs DRAFT=...)
	$(BIN)/python bench/bench_acceptance.py --draft $(DRAFT) --data $(DATA) --n 10 --out results/acceptance.json

tune-spec: $(STAMP)  ## bench/tune_spec.py: best tree per batch size -> profile + SGLang adaptive config (needs DRAFT=...)
	$(BIN)/python bench/tune_spec.py --draft $(DRAFT) --data $(DATA) --batch-sizes 1,2,4 --out results/spec_profile.json

clean:  ## remove the venv and caches (keeps ~/.cache/sglang_eagle3)
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
