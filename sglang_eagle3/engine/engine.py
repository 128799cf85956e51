"""SpeculativeEngine: offline batched EAGLE-3 decoding (and the vanilla baseline) on one target runtime.

A thin client of the scheduler (scheduler.py), which the HTTP server drives too: `generate` tokenizes the
prompts, submits them all, runs the scheduler's loop until every request finished and returns the outputs
in prompt order. `batch_size` is the number of requests decoded together (continuous batching: a finished
request's row is taken by the next waiting prompt at once).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from sglang_eagle3.engine.cost_model import StepCosts
from sglang_eagle3.engine.scheduler import Request, RequestError, Scheduler, SchedulerStats, check_fits, tree_slots
from sglang_eagle3.engine.settings import Settings
from sglang_eagle3.engine.verify import SamplingParams, TokenLogprob

Prompt = Union[str, list]   # plain text, chat messages [{"role", "content"}], or token ids [int] (used as they are)


@dataclass
class RequestOutput:
    prompt: Prompt
    text: str
    token_ids: list[int]
    finish_reason: str                         # "eos" | "length" | "stop"
    verify_steps: int                          # target forwards that produced tokens (prefill included)
    accept_lengths: list[int] = field(default_factory=list)   # tokens emitted per forward ([0] = prefill)
    logprobs: Optional[list[TokenLogprob]] = None             # per token, when SamplingParams.logprobs is set
    context_tokens: int = 0                                   # accepted tokens the context alone proposed

    @property
    def accept_length(self) -> float:
        return len(self.token_ids) / max(1, self.verify_steps)


@dataclass
class BatchStats:
    generated_tokens: int = 0
    verify_steps: int = 0
    draft_time: float = 0.0
    verify_time: float = 0.0
    prefill_time: float = 0.0
    total_time: float = 0.0
    drafted_steps: int = 0           # decoding steps the draft model ran in
    decode_steps: int = 0            # batched decoding steps
    tree_nodes: int = 0              # tokens per row the verifies ran, summed over steps
    context_tokens: int = 0          # accepted tokens the context alone proposed
    cost_measure_s: float = 0.0      # measuring this machine's step costs (--tree auto, once): not in total_time

    @property
    def accept_length(self) -> float:
        return self.generated_tokens / max(1, self.verify_steps)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / max(self.total_time, 1e-9)

    def add(self, other: "BatchStats") -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))

    def as_dict(self) -> dict:
        return {"accept_length": self.accept_length, "tokens_per_s": self.tokens_per_s,
                "verify_steps": self.verify_steps, "generated_tokens": self.generated_tokens,
                "draft_time_s": self.draft_time, "verify_time_s": self.verify_time,
                "prefill_time_s": self.prefill_time, "total_time_s": self.total_time,
                "decode_steps": self.decode_steps, "drafted_steps": self.drafted_steps,
                "tree_nodes": self.tree_nodes, "context_tokens": self.context_tokens,
                "cost_measure_s": self.cost_measure_s}


def eos_ids_of(target) -> set[int]:
    ids = set()
    gen = getattr(target, "generation_config", None)
    for src in (getattr(target.hf_config, "eos_token_id", None), getattr(gen, "eos_token_id", None),
                getattr(target.tokenizer, "eos_token_id", None)):
        if src is not None:
            ids.update(src if isinstance(src, (list, tuple)) else [src])
    return ids


def is_token_ids(prompt) -> bool:
    """A non-empty list of ints (bools excluded): a prompt given as token ids."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) and not isinstance(t, bool)
                                                              for t in prompt)


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Text as is (with the tokenizer's special tokens), chat messages through the chat template, token ids as
    they are."""
    if is_token_ids(prompt):
        return list(prompt)
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    return list(ids)


class SpeculativeEngine:
    def __init__(self, target, draft, settings: Settings, costs: Optional[StepCosts] = None):
        """target and draft (None: vanilla decoding) loaded already; settings: what resolve_settings decided (the
        tree, the adaptive table, the drafting); costs: the step costs --tree auto plans with (None: this machine's,
        measured once and cached)."""
        self.target, self.draft, self.settings, self.costs = target, draft, settings, costs
        self.tokenizer = target.tokenizer
        if draft is not None:
            draft.check_target(target.hf_config, target.aux_layer_ids)
            draft.to(device=target.device, dtype=target.dtype).eval()
            draft.set_embedding(target.embed_tokens)
            draft.check_runtime()
            draft.prepare_inference()
        self.eos_ids = eos_ids_of(target)
        self.tree_slots = tree_slots(settings, draft is not None)    # target KV slots a verify writes per row
        self._scheduler: Optional[Scheduler] = None

    def encode(self, prompt: Prompt, truncate: bool = False, max_new_tokens: int = 0) -> list[int]:
        """Token ids of a prompt; with truncate, the oldest tokens are dropped to leave room for the answer."""
        ids = encode_prompt(self.tokenizer, prompt)
        context = self.target.context_len
        if truncate and context:
            room = context - max_new_tokens - self.tree_slots
            if room < 1:
                raise RequestError(f"max_new_tokens {max_new_tokens} leaves no room for a prompt in the target's "
                                   f"context of {context} tokens")
            ids = ids[-room:]
        return ids

    def check_fits(self, num_prompt: int, max_new_tokens: int) -> None:
        """RequestError when a prompt of this many tokens plus its answer cannot fit the target's context."""
        check_fits(num_prompt, max_new_tokens, self.tree_slots, self.target.context_len,
                   hint=" (--truncate-prompt drops the oldest prompt tokens instead)")

    def cost_measure_s(self) -> float:
        """Seconds spent so far measuring the step costs its planner uses (a one-off per machine, not decoding)."""
        s = self._scheduler
        return s.planner.measure_s if s is not None and s.planner is not None else 0.0

    def scheduler(self, max_running: int, max_len: int, max_queue: Optional[int] = None) -> Scheduler:
        """A scheduler with at least these rows and slots (kept between calls; grown when needed); max_queue: waiting
        requests beyond which it refuses more (None: no limit)."""
        s = self._scheduler
        if s is None or s.max_running < max_running or s.max_len < max_len or s.max_queue != max_queue:
            learnt = s.learnt if s is not None else None         # calibration and costs carry over
            self._scheduler = None                              # free the old pools first
            s = self._scheduler = Scheduler(self.target, self.draft, self.settings, max_running, max_len, max_queue,
                                            self.eos_ids, self.costs, learnt)
        return s

    # ---- public API ----------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[Prompt], params: Optional[SamplingParams] = None,
                 batch_size: Optional[int] = None, truncate: bool = False) -> tuple[list[RequestOutput], BatchStats]:
        """Decode every prompt; raises RequestError (naming the prompt) if one cannot fit the context."""
        params = params or SamplingParams()
        t0, measured = time.perf_counter(), self.cost_measure_s()
        ids = []
        for i, p in enumerate(prompts):
            x = self.encode(p, truncate, params.max_new_tokens)
            try:
                self.check_fits(len(x), params.max_new_tokens)
            except RequestError as e:
                raise RequestError(f"prompt {i}: {e}") from None
            ids.append(x)
        bs = max(1, min(batch_size or len(prompts), len(prompts)))
        max_len = max(len(x) for x in ids) + params.max_new_tokens + self.tree_slots + 1
        sched = self.scheduler(bs, max_len)
        reqs = []
        for i, (p, x) in enumerate(zip(prompts, ids)):
            seeded = params if len(prompts) == 1 else params.derived(i)     # one random stream per prompt
            reqs.append(sched.submit(Request(x, seeded, prompt=p)))
        sched.stats = SchedulerStats()
        sched.run_until_idle()
        st = sched.stats
        failed = [r for r in reqs if r.finish_reason == "error"]
        if failed:
            raise RuntimeError(f"request failed: {failed[0].error}")
        measured = self.cost_measure_s() - measured
        stats = BatchStats(st.generated_tokens, st.verify_steps, st.times.draft, st.times.verify, st.times.prefill,
                           time.perf_counter() - t0 - measured, st.drafted_steps, st.steps, st.tree_nodes,
                           st.context_tokens, measured)
        outputs = [RequestOutput(r.prompt, r.text, r.output_ids, r.finish_reason, r.verify_steps, r.accept_lengths,
                                 r.output_logprobs, r.context_tokens) for r in reqs]
        return outputs, stats
