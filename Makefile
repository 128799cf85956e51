# sglang-eagle3: every target sets up what it needs (a project venv in .venv) by itself.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DATA   ?= $(or $(EAGLE3_DATA),../shared/data)
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: help venv test demo serve testbed regenerate data dump train bench-decode bench-acceptance bench-serving \
        bench-llamacpp bench-fidelity tune-spec llamacpp ablation clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

$(STAMP): setup.py requirements.txt $(wildcard requirements-*.txt)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements.txt
	@if [ -f requirements-sglang.txt ]; then $(BIN)/pip install --quiet --disable-pip-version-check --no-deps -r requirements-sglang.txt; fi
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -e .
	$(BIN)/python -m sglang_eagle3.kernels.extension
	touch $(STAMP)

venv: $(STAMP)  ## create/refresh the project venv (.venv)

testbed: $(STAMP)  ## prepare the embedded target (SmolLM2-135M-Instruct) and print its path
	$(BIN)/eagle3 testbed

test: $(STAMP)  ## run the whole test suite: import contracts (.importlinter), ruff, then pytest
	$(BIN)/lint-imports
	$(BIN)/ruff check .
	$(BIN)/eagle3 testbed >/dev/null
	$(BIN)/python -m pytest -q tests $(PYTEST_ARGS)

demo: $(STAMP)  ## speculative decoding on the embedded target: text + stats
	$(BIN)/eagle3 testbed
	$(BIN)/python -m sglang_eagle3.bench.demo --data $(DATA)

serve: $(STAMP)  ## OpenAI-compatible server on 127.0.0.1:30000: embedded target + shipped draft (our engine)
	$(BIN)/eagle3 testbed
	$(BIN)/eagle3 serve --engine builtin --host $(or $(HOST),127.0.0.1) --port $(or $(PORT),30000)

bench-serving: $(STAMP)  ## starts our server (vanilla and EAGLE-3), sweeps concurrency 1..64, stops it
	$(BIN)/python bench/bench_serving.py --start builtin --data $(DATA) --out results/bench_serving.json

llamacpp: $(STAMP)  ## build the pinned llama.cpp (llama-cpp-python 0.3.36's vendored tree) into the cache (~20 min)
	$(BIN)/python -m sglang_eagle3.formats.llamacpp

bench-llamacpp: $(STAMP)  ## llama.cpp with and without the shipped draft vs our engine (needs make llamacpp)
	$(BIN)/python bench/bench_llamacpp.py --data $(DATA) --out results/bench_llamacpp.json

bench-decode: $(STAMP)  ## bench/bench_decode.py: tokens/s of transformers vs our vanilla vs speculative
	$(BIN)/python bench/bench_decode.py --data $(DATA)

bench-fidelity: $(STAMP)  ## each bf16 decode path's greedy argmax vs transformers fp32, by the reference's margin
	$(BIN)/python bench/bench_fidelity.py --data $(DATA) --out results/bench_fidelity.json

# The embedded draft's recipe, one resumable stage per target (each prints progress + ETA; rerun to resume).
RUN    ?= $(HOME)/.cache/sglang_eagle3/runs/smollm2-v3
GSM8K_ROWS ?= 2500
SHAREGPT1K_ROWS ?= 1000
SHAREGPT_PROMPT_CHARS ?= 6000
# TARGET_DTYPE: the target's dtype while it answers and is dumped (the shipped draft's data: bfloat16)
TARGET_DTYPE ?= bfloat16
REGEN  = $(BIN)/eagle3 regenerate --target testbed --dtype $(TARGET_DTYPE) --max-new-tokens 512 --batch-size 32 --write-every 384
# SAMPLED_ROWS: the first ShareGPT prompts (3808: all of them) answered once more, sampled at SAMPLED_T (seeded): more distinct
# contexts drawn from the target's own distribution (0: none)
SAMPLED_ROWS ?= 3808
SAMPLED_T ?= 0.7
# SAMPLED_PROMPT_CHARS: only prompts up to this many characters get a sampled answer (answered shortest first)
SAMPLED_PROMPT_CHARS ?= $(SHAREGPT_PROMPT_CHARS)
SAMPLED_OUT = $(if $(filter-out 0,$(SAMPLED_ROWS)),$(RUN)/regen_sharegpt_t$(SAMPLED_T).jsonl)
# SYNTH_ROWS: user prompts written by the target itself (`eagle3 synthesize-prompts`: its chat template up to where a
# user's text begins, sampled; no 13-word run of an eval prompt), answered at SAMPLED_T (0: none); SYNTH_TURNS: user
# turns per conversation, at most (the target answers, then writes the next one)
SYNTH_ROWS ?= 0
SYNTH_TURNS ?= 1
SYNTH_OUT = $(if $(filter-out 0,$(SYNTH_ROWS)),$(RUN)/regen_synth.jsonl)
REGEN_OUT = $(RUN)/regen_sharegpt.jsonl $(RUN)/regen_alpaca.jsonl $(RUN)/regen_gsm8k.jsonl $(RUN)/regen_sharegpt1k.jsonl \
	    $(SAMPLED_OUT) $(SYNTH_OUT)
MAX_LEN ?= 2048
STEPS  ?= 2000
LR     ?= 1e-3
ROWS   ?= 4
# PACK=1: the ROWS rows of a step end to end in one sequence (same loss and gradients as one row per forward, 1.6x faster here)
PACK   ?= 1
NPROC  ?= 1
THREADS ?= 2
FEATURES ?= fused
FEATURE_LOSS ?= 0
EAGLE31 ?= 0
INIT   ?=
# DATA_START: read the data order from this step on (a run continuing INIT's run on the same data reads new rows)
DATA_START ?= 0
# VOCAB_SIZE: re-select a draft vocabulary of this size from the training rows (with INIT: the draft's output rows
# are carried over to it, new tokens start from the target's rows); empty: the data's (or INIT's) vocabulary
VOCAB_SIZE ?=
WARMUP ?= 0.02
# LOOPS: what to do with answers stuck in a loop (fewer than half of their 8-grams distinct; 2,016 of 5,016
# regenerated rows, 62% of the tokens): cut (default: keep each row up to where its loop begins), drop, keep.
# keep writes data/dump/train (the first run's folders); cut and drop write data_<LOOPS>/dump_<LOOPS>/train_<LOOPS>.
LOOPS  ?= cut
SUFFIX := $(if $(filter keep,$(LOOPS)),,_$(LOOPS))
LOOP_FLAGS := $(if $(filter keep,$(LOOPS)),,--min-distinct-ngrams 0.5) $(if $(filter cut,$(LOOPS)),--cut-loops)
DATA_OUT ?= $(RUN)/data$(SUFFIX)
DUMP_OUT ?= $(RUN)/dump$(SUFFIX)
TRAIN_OUT ?= $(RUN)/train$(SUFFIX)
TRAIN_FLAGS ?=
KEEP_EVERY ?= 250
regenerate: $(STAMP)  ## every training prompt answered by the embedded target itself (greedy, bf16; resumable)
	$(REGEN) $(DATA)/train/sharegpt_prompts.jsonl --max-prompt-chars $(SHAREGPT_PROMPT_CHARS) --out $(RUN)/regen_sharegpt.jsonl
	$(REGEN) $(DATA)/train/alpaca_en_demo.json --out $(RUN)/regen_alpaca.jsonl
	$(REGEN) $(DATA)/train/gsm8k_train.jsonl --max-rows $(GSM8K_ROWS) --out $(RUN)/regen_gsm8k.jsonl
	$(REGEN) $(DATA)/train/sharegpt_1k.jsonl --max-rows $(SHAREGPT1K_ROWS) --max-turns 2 --out $(RUN)/regen_sharegpt1k.jsonl
	$(if $(SAMPLED_OUT),$(REGEN) $(DATA)/train/sharegpt_prompts.jsonl --max-rows $(SAMPLED_ROWS) \
	    --max-prompt-chars $(SAMPLED_PROMPT_CHARS) --temperature $(SAMPLED_T) --seed 0 --out $(SAMPLED_OUT))
	$(if $(SYNTH_OUT),$(BIN)/eagle3 synthesize-prompts --target testbed --dtype $(TARGET_DTYPE) --n $(SYNTH_ROWS) --seed 0 \
	    --turns $(SYNTH_TURNS) --exclude $(wildcard $(DATA)/eval/*.jsonl) --out $(RUN)/synth_prompts.jsonl)
	$(if $(SYNTH_OUT),$(REGEN) $(RUN)/synth_prompts.jsonl --temperature $(SAMPLED_T) --seed 3 --out $(SYNTH_OUT))

data: $(STAMP)  ## tokenize the regenerated answers (rows up to MAX_LEN tokens; LOOPS=cut|drop|keep) + draft vocab
	@for f in $(REGEN_OUT); do test -f $$f || { echo "missing $$f: run 'make regenerate' first"; exit 2; }; done
	$(BIN)/eagle3 prepare-data $(REGEN_OUT) --target testbed --out $(DATA_OUT) --max-length $(MAX_LEN) \
	    --length-policy drop --draft-vocab-size 8192 $(LOOP_FLAGS) --overwrite

# REUSE: finished dumps (same target and settings) whose rows are copied, e.g. REUSE=$(RUN)/dump_v5 after data grew
REUSE  ?=
dump: $(STAMP)  ## target features of the training data, bf16 safetensors shards (resumable)
	@test -f $(DATA_OUT)/stats.json || { echo "missing $(DATA_OUT): run 'make data' first"; exit 2; }
	$(BIN)/python train/dump_hidden_states.py --target testbed --data $(DATA_OUT) --out $(DUMP_OUT) \
	    --target-dtype $(TARGET_DTYPE) --dtype bfloat16 --rows-per-shard 128 --batch-tokens 4096 $(foreach d,$(REUSE),--reuse $(d))

# ONLINE=1: train from DATA_OUT's token rows, the target computing the features in each step (no dump)
ONLINE ?= 0
TRAIN_DATA = $(if $(filter 1,$(ONLINE)),$(DATA_OUT),$(DUMP_OUT))
TRAIN_ARGS = --target testbed --data $(TRAIN_DATA) --out $(TRAIN_OUT) \
	    $(if $(VOCAB_SIZE),--draft-vocab-size $(VOCAB_SIZE),$(if $(INIT),,--draft-vocab $(DATA_OUT)/draft_vocab.safetensors)) \
	    --max-length $(MAX_LEN) --lr $(LR) --warmup-ratio $(WARMUP) --min-lr-ratio 0.1 $(if $(filter 1,$(PACK)),--micro-batch-size $(ROWS) --pack-rows,--grad-accum $(ROWS)) \
	    --max-steps $(STEPS) --eval-every 100 --save-every 25 --keep-every $(KEEP_EVERY) --eval-rows 32 --features $(FEATURES) \
	    --feature-loss-weight $(FEATURE_LOSS) $(if $(filter 1,$(EAGLE31)),--fc-norm --norm-output) \
	    $(if $(INIT),--init-from $(INIT)) --data-start-step $(DATA_START) --resume $(TRAIN_FLAGS)
train: $(STAMP)  ## train the draft from the dump (ONLINE=1: from the token rows; resumes); NPROC=2: 2 ranks with DeepSpeed ZeRO-2 over gloo
ifeq ($(ONLINE),1)
	@test -f $(DATA_OUT)/stats.json || { echo "missing $(DATA_OUT): run 'make data' first"; exit 2; }
else
	@test -f $(DUMP_OUT)/manifest.json || { echo "missing $(DUMP_OUT): run 'make dump' first (or ONLINE=1)"; exit 2; }
endif
ifeq ($(NPROC),1)
	OMP_NUM_THREADS=$(THREADS) $(BIN)/eagle3 train $(TRAIN_ARGS) --backend ddp
else
	WORLD_SIZE=$(NPROC) $(BIN)/eagle3 train $(TRAIN_ARGS) --check-only
	OMP_NUM_THREADS=$(THREADS) $(BIN)/torchrun --standalone --nproc_per_node $(NPROC) train/train_eagle3.py \
	    $(TRAIN_ARGS) --deepspeed-config train/ds_zero2.json
endif

# The ablation: four drafts trained from scratch on the same data (DATA_OUT/DUMP_OUT, LOOPS as above), the same
# seed and ABL_STEPS steps each (same tokens), then tau and speed-up on MT-bench and GSM8K, side by side.
ABL_STEPS ?= 300
ABL_DIR ?= $(RUN)/ablation
ABL_TREE ?= --num-steps 3 --topk 2 --num-draft-tokens 6
ABL_NAMES = eagle3 eagle31 top featloss
abl_flags_eagle31 = EAGLE31=1
abl_flags_top = FEATURES=top
abl_flags_featloss = FEATURE_LOSS=1
define abl_train
	+$(MAKE) --no-print-directory train STEPS=$(ABL_STEPS) LR=1e-3 KEEP_EVERY=0 INIT= TRAIN_OUT=$(ABL_DIR)/$(1) $(abl_flags_$(1))

endef
define abl_bench
	$(BIN)/python bench/bench_acceptance.py --draft $(ABL_DIR)/$(1)/draft --data $(DATA) --datasets mt_bench,gsm8k \
	    --n 10 --max-new-tokens 128 --threads $(THREADS) $(ABL_TREE) --out results/ablation_$(1).json

endef
ablation: $(STAMP)  ## EAGLE-3 vs EAGLE-3.1 vs top layer only vs + feature loss at one budget -> results/ablation.{json,md}
	@test -f $(DUMP_OUT)/manifest.json || { echo "missing $(DUMP_OUT): run 'make dump' first"; exit 2; }
	$(foreach n,$(ABL_NAMES),$(call abl_train,$(n)))
	$(foreach n,$(ABL_NAMES),$(call abl_bench,$(n)))
	$(BIN)/python bench/ablation_table.py --row "EAGLE-3 (fused, token loss)=results/ablation_eagle3.json" \
	    --row "EAGLE-3.1 (fc_norm + norm_output)=results/ablation_eagle31.json" --row "top layer only=results/ablation_top.json" \
	    --row "fused + feature loss (w=1)=results/ablation_featloss.json" --sets mt_bench,gsm8k --out results/ablation.json

DRAFT ?= $(error set DRAFT=path/to/eagle3-draft)
bench-acceptance: $(STAMP)  ## bench/bench_acceptance.py: tau and speed-up per eval set (needs DRAFT=...)
	$(BIN)/python bench/bench_acceptance.py --draft $(DRAFT) --data $(DATA) --n 10 --out results/acceptance.json

tune-spec: $(STAMP)  ## bench/tune_spec.py: best tree per batch size -> profile + SGLang adaptive config (needs DRAFT=...)
	$(BIN)/python bench/tune_spec.py --draft $(DRAFT) --data $(DATA) --batch-sizes 1,2,4 --out results/spec_profile.json

clean:  ## remove the venv and caches (keeps ~/.cache/sglang_eagle3)
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
