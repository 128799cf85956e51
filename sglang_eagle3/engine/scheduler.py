"""The scheduler: request queue, per-request state, pool rows, stop checks, incremental detokenization.

Its loop (`step`): admit waiting requests into free rows (prefill; the first token comes from it) ->
one speculative step for every running row -> append the emitted tokens to each request, checking EOS,
max_tokens and stop strings -> free the rows of finished requests. Requests join and leave at step
boundaries (continuous batching); each keeps its own sampling parameters, generator and stop strings.
`SpeculativeEngine.generate` (offline) and the HTTP server both drive this one path.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from sglang_eagle3.engine.cost_model import StepChoice, StepCosts, TreePlanner, load_or_measure_costs
from sglang_eagle3.engine.settings import Settings
from sglang_eagle3.engine.spec_worker import MAX_CONTEXT_NODES, SpecWorker, StepTimes
from sglang_eagle3.engine.speculation import SpecConfig
from sglang_eagle3.engine.suffix import ContextDrafter
from sglang_eagle3.engine.threads import governor
from sglang_eagle3.engine.verify import SamplingParams, TokenLogprob
from sglang_eagle3.errors import UserError


class RequestError(UserError, ValueError):
    """A request that cannot be served as asked (too long for the context, empty prompt, ...)."""


class QueueFull(RuntimeError):
    """Too many requests waiting; the caller should retry later."""


class IncrementalDetokenizer:
    """Text deltas from a growing list of token ids, decoding only a short window each time (the offsets
    scheme of TGI / vLLM): an incomplete UTF-8 sequence at the end is held back until it completes."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.text = ""

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip)
        if full.endswith("\ufffd") or len(full) < len(prefix):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta


_ids = itertools.count()


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    prompt: Any = None
    rid: str = field(default_factory=lambda: f"req-{next(_ids)}")
    listener: Optional[Callable[["Request", str], None]] = None   # called with each text delta, "" at the end
    # state
    output_ids: list[int] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)     # tokens kept per target forward (prefill: 1)
    context_tokens: int = 0                                     # accepted tokens the context alone proposed
    output_logprobs: Optional[list[TokenLogprob]] = None        # one per output token when params.logprobs is set
    text: str = ""
    finish_reason: Optional[str] = None                         # eos | length | stop | cancelled | error
    error: Optional[str] = None
    row: Optional[int] = None
    generator: Optional[torch.Generator] = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    detok: Optional[IncrementalDetokenizer] = None
    cancelled: bool = False                                    # set from any thread; honoured at a step boundary
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def verify_steps(self) -> int:
        return len(self.accept_lengths)

    @property
    def accept_length(self) -> float:
        return len(self.output_ids) / max(1, self.verify_steps)


@dataclass
class SchedulerStats:
    generated_tokens: int = 0
    verify_steps: int = 0          # target forwards per request that produced tokens (prefill included)
    steps: int = 0                 # batched decoding steps
    finished: int = 0
    times: StepTimes = field(default_factory=StepTimes)
    drafted_steps: int = 0         # steps the draft model ran in
    tree_nodes: int = 0            # sum over steps of the tokens per row each verify ran
    context_tokens: int = 0        # accepted tokens that the context alone proposed
    row_steps: int = 0             # rows over all steps (a step of 4 rows counts 4)
    speculated_rows: int = 0       # among them, rows whose tree held more than the root
    verified_nodes: int = 0        # nodes the verifies computed, all rows (a row's tree, the root included)


def tree_slots(settings: Settings, has_draft: bool) -> int:
    """Target KV slots one verify writes per row at most: the largest tree any step may run."""
    drafting = settings.drafting
    if drafting.tree == "auto" and (has_draft or drafting.uses_context):
        return drafting.max_nodes
    drafted = max((t.num_draft_tokens for t in settings.trees(has_draft)), default=1)
    return drafted + (MAX_CONTEXT_NODES if drafting.uses_context else 0)


def check_fits(num_prompt: int, max_new_tokens: int, tree_slots: int, context_len: Optional[int],
               max_len: Optional[int] = None, hint: str = "") -> None:
    """RequestError naming the limit a request exceeds: the target's context, or max_len (the KV slots a request
    may hold, eagle3 serve --max-len; None: no such limit) where that is lower. hint: what the caller can do about a
    prompt too long for the context."""
    if num_prompt == 0:
        raise RequestError("empty prompt (no tokens after tokenization)")
    need = num_prompt + max_new_tokens + tree_slots
    limits = [n for n in (context_len, max_len) if n]
    if not limits or need <= min(limits):
        return
    what = f"prompt of {num_prompt} tokens + max_new_tokens {max_new_tokens} + {tree_slots} draft slots = {need}"
    if context_len and (max_len is None or context_len <= max_len):
        raise RequestError(f"{what} exceeds the target's context of {context_len} tokens{hint}")
    raise RequestError(f"{what} exceeds the {max_len} tokens a request may hold here (max_len: eagle3 serve --max-len"
                       + (f"; the target's context is {context_len}" if context_len else "") + ")")


@dataclass
class Learnt:
    """What a scheduler learnt while it ran, which a larger scheduler of the same engine starts from (else the
    priors): the context drafter's calibration (and pool), the planner's step costs."""
    context: Optional[ContextDrafter] = None
    planner: Optional[TreePlanner] = None


class Scheduler:
    def __init__(self, target, draft, settings: Settings, max_running: int, max_len: int, max_queue: Optional[int],
                 eos_ids: set[int], costs: Optional[StepCosts] = None, learnt: Optional[Learnt] = None):
        """settings: what resolve_settings decided (tree, adaptive table, drafting); max_queue: waiting requests
        beyond which submit raises QueueFull (None: no limit); costs: the step costs --tree auto plans with (None:
        this machine's, measured once and cached)."""
        self.drafting = drafting = settings.drafting
        draft = draft if drafting.uses_draft else None               # `suffix`: the draft model is not used
        self.target, self.draft, self.tokenizer = target, draft, target.tokenizer
        self.spec = settings.engine_tree if draft is not None else None
        self.profile = settings.profile if draft is not None else None
        self.tree_slots = tree_slots(settings, draft is not None)
        draft_slots = max((t.draft_slots for t in settings.trees(draft is not None)), default=0)
        self.worker = SpecWorker(target, draft, max_running, max_len, draft_slots,
                                 sampled_children=drafting.children != "top-k", calibration=settings.calibration)
        learnt = learnt or Learnt()
        self.context = learnt.context
        if self.context is None and drafting.uses_context:
            self.context = ContextDrafter(drafting.context_tokens, drafting.context_branches, drafting.min_match,
                                          drafting.pool_tokens)
        self.planner = learnt.planner
        if self.planner is None and drafting.tree == "auto" and (draft is not None or self.context is not None):
            costs = costs or load_or_measure_costs(target, max_running, drafting.max_nodes)
            self.planner = TreePlanner(costs, drafting.max_nodes, draft is not None)
        # a fixed tree's greedy steps: speculate or run plain, whichever delivers more lately (the planner has its own)
        self.choice = StepChoice() if self.planner is None and (draft is not None or self.context is not None) \
            else None
        self.max_running, self.max_len, self.max_queue = max_running, max_len, max_queue
        self.eos_ids = eos_ids
        self.free_rows = list(range(max_running - 1, -1, -1))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self.cond = threading.Condition()
        self._stop = False

    @property
    def learnt(self) -> Learnt:
        return Learnt(self.context, self.planner)

    # ---- requests ------------------------------------------------------------------------------
    @property
    def limit(self) -> int:
        """Tokens one request may hold (prompt + answer + draft slots): the KV slots per request (max_len; eagle3
        serve --max-len), at most the target's context."""
        return min(self.max_len, self.target.context_len or self.max_len)

    def check_fits(self, num_prompt: int, max_new_tokens: int) -> None:
        """RequestError naming the limit a request exceeds: the target's context, or max_len where that is lower."""
        check_fits(num_prompt, max_new_tokens, self.tree_slots, self.target.context_len, self.max_len)

    def submit(self, req: Request) -> Request:
        self.check_fits(len(req.prompt_ids), req.params.max_new_tokens)
        if not req.params.greedy:
            req.generator = torch.Generator(device=self.target.device)
            req.generator.manual_seed(req.params.seed if req.params.seed is not None else torch.seed())
        req.detok = IncrementalDetokenizer(self.tokenizer)
        req.output_logprobs = None if req.params.logprobs is None else []
        with self.cond:
            if self.max_queue is not None and len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting (limit {self.max_queue})")
            self.waiting.append(req)
            self.cond.notify_all()
        return req

    def cancel(self, req: Request) -> None:
        """Stop a request at the next step boundary (a client went away); its row is freed there."""
        with self.cond:
            req.cancelled = True
            self.cond.notify_all()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def idle(self) -> bool:
        """Nothing queued or running and every row free (a leak would show here)."""
        return not self.has_work() and len(self.free_rows) == self.max_running

    def load(self) -> dict:
        """What /metrics reports: the queue now, and the decoding steps' counters since the start."""
        st = self.stats
        return {"running": len(self.running), "waiting": len(self.waiting), "free_rows": len(self.free_rows),
                "max_running": self.max_running, "steps": st.steps, "row_steps": st.row_steps,
                "speculated_rows": st.speculated_rows, "verified_nodes": st.verified_nodes,
                "draft_seconds": st.times.draft, "verify_seconds": st.times.verify}

    # ---- the loop ------------------------------------------------------------------------------
    def spec_for(self, batch_size: int, sampled: bool = False, context: int = 0) -> Optional[SpecConfig]:
        """The step's draft tree: the profile's for this many running requests (its sampled table when one of them
        samples, its long-context table when the longest holds `context` tokens or more), else the fixed tree;
        None: the draft does not run (no draft, or vanilla decoding measured faster). With the per-step tree
        (`auto`) the shape's depth and branching stay and its size is the most a step may verify."""
        if self.draft is None:
            return None
        spec = self.profile.for_batch_size(batch_size, sampled, context) if self.profile else self.spec
        return spec if self.planner is None else self.drafting.step_tree(spec)

    def step(self) -> None:
        """Admit -> one step for all running rows -> process results -> free rows."""
        governor().update()                       # threads fit the cores other processes leave free
        for req in self.running:
            if req.cancelled and not req.finished:
                req.finish_reason = "cancelled"
        self._release()
        self._admit()
        active = [r for r in self.running if not r.finished]
        if active:
            context = max(len(r.prompt_ids) + len(r.output_ids) for r in active)      # the longest row's tokens
            if self.planner is not None:
                self.planner.prepare(len(active))          # this batch size's costs: measured the first time
            greedy = all(r.params.greedy for r in active)
            spec, proposer = self.spec_for(len(active), not greedy, context), self.context
            # only all-greedy steps may go plain: a seeded sampling request's draws must not depend on timings
            chosen = self.choice is not None and greedy and (spec is not None or proposer is not None)
            if chosen and not self.choice.speculates(len(active)):
                spec, proposer = None, None
            res = self.worker.step([r.row for r in active], [r.params for r in active], [r.generator for r in active],
                                   spec, [r.rid for r in active], context, proposer, self.planner)
            if chosen:
                self.choice.observe(len(active), sum(map(len, res.emitted)),
                                    res.times.draft + res.times.verify - res.owed_s)
            self._count(res)
            for req, tokens, logprobs, from_context in zip(active, res.emitted, res.logprobs, res.from_context):
                kept = self._emit(req, tokens, logprobs)
                counted = sum(from_context[:max(0, kept - 1)])    # among the kept tokens but the last (the bonus)
                req.context_tokens += counted
                self.stats.context_tokens += counted
        self._release()

    def _count(self, res) -> None:
        st = self.stats
        st.steps += 1
        st.times.add(res.times)
        st.drafted_steps += int(res.drafted)
        st.tree_nodes += res.nodes
        st.row_steps += len(res.row_nodes)
        st.speculated_rows += sum(n > 1 for n in res.row_nodes)
        st.verified_nodes += sum(res.row_nodes)

    def _admit(self) -> None:
        while self.free_rows:
            with self.cond:
                if not self.waiting:
                    return
                req = self.waiting.popleft()
            if req.cancelled:                     # cancelled before it started
                req.finish_reason = "cancelled"
                self._finish(req)
                continue
            req.row = self.free_rows.pop()
            self.running.append(req)
            if self.context is not None:
                self.context.start(req.rid, req.prompt_ids)
            try:
                first, dt, first_logprob = self.worker.prefill(req.row, req.prompt_ids, req.params, req.generator)
            except Exception as e:                # a request must never take the loop down
                req.finish_reason, req.error = "error", f"{type(e).__name__}: {e}"
                continue
            self.stats.times.prefill += dt
            req.first_token_time = time.perf_counter()
            self._emit(req, [first], [first_logprob] if first_logprob else None)

    def _emit(self, req: Request, tokens: list[int], logprobs: Optional[list[TokenLogprob]] = None) -> int:
        """Append tokens (and their log-prob entries) until EOS / max_new_tokens / a stop string; stream the text
        delta."""
        p = req.params
        kept = []
        for t in tokens:
            kept.append(t)
            if not p.ignore_eos and t in self.eos_ids:
                req.finish_reason = "eos"
                break
            if len(req.output_ids) + len(kept) >= p.max_new_tokens:
                req.finish_reason = "length"
                break
        before = len(req.output_ids)
        req.output_ids.extend(kept)
        if self.context is not None:
            self.context.append(req.rid, kept)
        if req.output_logprobs is not None and logprobs:
            req.output_logprobs.extend(logprobs[:len(kept)])
        req.accept_lengths.append(len(kept))
        self.stats.generated_tokens += len(kept)
        self.stats.verify_steps += 1
        delta = req.detok.push(kept)
        if p.stop and delta:
            start = max(0, len(req.detok.text) - len(delta) - max(len(s) for s in p.stop) + 1)
            hits = [i for i in (req.detok.text.find(s, start) for s in p.stop) if i >= 0]
            if hits:
                cut = min(hits)
                delta = delta[:max(0, len(delta) - (len(req.detok.text) - cut))]
                req.detok.text = req.detok.text[:cut]
                req.finish_reason = "stop"
                self._cut_at_stop(req, before)
        if delta and req.listener:
            req.listener(req, delta)
        return len(req.output_ids) - before

    def _cut_at_stop(self, req: Request, before: int) -> None:
        """Keep the tokens up to the one that completed a stop string."""
        stops = req.params.stop
        for n in range(before + 1, len(req.output_ids) + 1):
            text = self.tokenizer.decode(req.output_ids[:n], skip_special_tokens=True)
            if any(s in text for s in stops):
                dropped = len(req.output_ids) - n
                del req.output_ids[n:]
                if req.output_logprobs is not None:
                    del req.output_logprobs[n:]
                req.accept_lengths[-1] -= dropped
                self.stats.generated_tokens -= dropped
                return

    def _release(self) -> None:
        still = []
        for req in self.running:
            if req.finished:
                self._finish(req)
            else:
                still.append(req)
        self.running = still

    def _finish(self, req: Request) -> None:
        if self.context is not None:
            self.context.finish(req.rid)
        if req.row is not None:
            self.free_rows.append(req.row)
            req.row = None
        if req.finish_reason in ("eos", "length"):
            req.text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        else:
            req.text = req.detok.text if req.detok else ""
        req.finish_time = time.perf_counter()
        self.stats.finished += 1
        req.done.set()                      # before the last callback: a listener seeing "" finds it done
        if req.listener:
            req.listener(req, "")

    def run_until_idle(self) -> None:
        while self.has_work():
            self.step()

    # ---- serving thread ------------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Run steps while there is work; sleep on the condition otherwise (the server's scheduler thread).
        A failing step fails the requests it ran, not the loop."""
        while True:
            with self.cond:
                while not self._stop and not self.has_work():
                    self.cond.wait()
                if self._stop:
                    return
            try:
                self.step()
            except Exception as e:              # noqa: BLE001 - reported to every affected request
                for req in self.running:
                    if not req.finished:
                        req.finish_reason, req.error = "error", f"{type(e).__name__}: {e}"
                self._release()

    def shutdown(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
