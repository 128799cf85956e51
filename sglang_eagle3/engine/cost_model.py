"""Sizing each step's tree by what a verify costs on this machine and what each node is expected to yield.

A speculative step emits 1 + (accepted draft tokens) per row and costs a draft (zero for context proposals) plus one
target forward over the tree. With each candidate node's chance to be accepted (the draft's path probability, or
the calibrated chance of a context continuation), the expected tokens of the N best nodes are 1 + the sum of their
chances, and `choose_tree_size` picks the N (1: no speculation) that maximises expected tokens per second.

The costs are measured on the machine that decodes (`measure_costs`: a few seconds of target and draft forwards,
cached per machine, kernel build, model and dtype) and kept up to date from the steps the engine runs.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from sglang_eagle3.fileio import write_json
from sglang_eagle3.kernels import extension
from sglang_eagle3.paths import cache_dir

COSTS_FORMAT = "sglang_eagle3.step_costs/1"
TREE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
CONTEXTS = (128, 1024)


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (sorted xs), linear extrapolation past both ends."""
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class StepCosts:
    """Seconds per step part. verify[B][T]: one target forward over T tokens for each of B rows after
    CONTEXTS[0] cached tokens; per_context[T]: the extra seconds per cached token of one row (attention grows with
    the context); draft_level[B]: one draft level (forward over B * topk nodes, its head and top-k); draft_extend[B]:
    running B rows' held pairs through the draft (one extend of a step's accepted tokens)."""
    verify: dict[int, dict[int, float]]
    per_context: dict[int, float]
    draft_level: dict[int, float] = field(default_factory=dict)
    draft_extend: dict[int, float] = field(default_factory=dict)
    source: str = ""

    def verify_s(self, batch: int, tree_size: int, context: int = CONTEXTS[0]) -> float:
        bs = sorted(self.verify)
        by_b = [_interp(sorted(self.verify[b]), [self.verify[b][t] for t in sorted(self.verify[b])], tree_size)
                for b in bs]
        base = _interp(bs, by_b, batch)
        ts = sorted(self.per_context)
        slope = _interp(ts, [self.per_context[t] for t in ts], tree_size) if ts else 0.0
        return base + max(0.0, slope) * max(0, context - CONTEXTS[0]) * batch

    def draft_s(self, batch: int, levels: int) -> float:
        """Drafting `levels` levels of a tree for `batch` rows, with the extend of their held pairs."""
        if not self.draft_level:
            return 0.0
        bs = sorted(self.draft_level)
        level = _interp(bs, [self.draft_level[b] for b in bs], batch)
        extend = _interp(bs, [self.draft_extend.get(b, 0.0) for b in bs], batch) if self.draft_extend else 0.0
        return levels * level + extend

    def to_json(self) -> dict:
        def keyed(table: dict) -> dict:
            return {str(k): keyed(v) if isinstance(v, dict) else v for k, v in table.items()}
        return {"format": COSTS_FORMAT, "verify": keyed(self.verify), "per_context": keyed(self.per_context),
                "draft_level": keyed(self.draft_level), "draft_extend": keyed(self.draft_extend), "source": self.source}

    @classmethod
    def from_json(cls, d: dict) -> "StepCosts":
        if d.get("format") != COSTS_FORMAT:
            raise ValueError(f"not a {COSTS_FORMAT} file")

        def ints(x: dict) -> dict:
            return {int(k): (ints(v) if isinstance(v, dict) else float(v)) for k, v in x.items()}
        return cls(ints(d["verify"]), ints(d["per_context"]), ints(d.get("draft_level", {})),
                   ints(d.get("draft_extend", {})), d.get("source", ""))


def choose_tree_size(scores: list[list[float]], costs: StepCosts, batch: int, max_nodes: int, draft_s: float = 0.0,
                     context: int = CONTEXTS[0]) -> tuple[int, float, float]:
    """scores: per row, its candidates' log acceptance chances, best first (the order the tree takes them in).
    -> (N, expected tokens, expected seconds) of the tree size N in 1..max_nodes (N - 1 candidates per row, the root
    included in N) with the most expected tokens per second; N = 1 is one token per row, no speculation. draft_s:
    seconds already spent drafting this step (counted at every N: the rate is the step's)."""
    cap = min(max_nodes, 1 + min((len(s) for s in scores), default=0))
    chances = [[math.exp(x) for x in s[:cap - 1]] for s in scores]
    best = (1, float(batch), draft_s + costs.verify_s(batch, 1, context))
    tokens = float(batch)
    for n in range(2, cap + 1):
        tokens += sum(c[n - 2] for c in chances)
        seconds = draft_s + costs.verify_s(batch, n, context)
        if tokens / seconds > best[1] / best[2]:
            best = (n, tokens, seconds)
    return best


# ---- the per-step decision ------------------------------------------------------------------------------
class TreePlanner:
    """Decides, each step, whether to run the draft and how many nodes to verify, from the machine's costs (a prior
    from measure_costs, corrected by every verify the engine times) and the nodes' chances.

    Drafting is worth it when the tokens per second that drafted steps actually delivered lately (their emitted tokens
    over their draft and verify time, an average over recent drafted steps) beat what the context's proposals alone
    promise now (their calibrated chances over a verify's cost, no draft). A rate that stopped being refreshed would
    hold its last value for good (one bad stretch would switch the draft off for the rest of the engine's life), so
    after EXPLORE_EVERY undrafted steps at a batch size the draft runs once more to measure it again."""

    EMA = 0.2
    EXPLORE_EVERY = 8
    IDLE_SKIP = 8            # after this many steps in a row without speculation, look for proposals 1 step in 8

    def __init__(self, costs: StepCosts, max_nodes: int, has_draft: bool):
        self.costs, self.max_nodes, self.has_draft = costs, max_nodes, has_draft
        self.verify_factor: dict[int, float] = {}     # batch -> observed / predicted verify seconds
        self.draft_rate: dict[int, float] = {}        # batch -> tokens/s drafted steps delivered lately
        self.undrafted: dict[int, int] = {}           # batch -> steps since the draft last ran at it
        self.idle: dict[int, int] = {}                # batch -> steps in a row that verified the root alone
        self.steps = {"draft": 0, "context": 0, "none": 0}

    def _bucket(self, table: dict, batch: int) -> Optional[float]:
        keys = [b for b in table if b <= batch]
        return table[max(keys)] if keys else (table[min(table)] if table else None)

    def verify_s(self, batch: int, nodes: int, context: int) -> float:
        return self.costs.verify_s(batch, nodes, context) * (self._bucket(self.verify_factor, batch) or 1.0)

    def size(self, scores: list[list[float]], batch: int, context: int, draft_s: float = 0.0) -> tuple[int, float]:
        """The tree size (1 = the root alone) and its predicted tokens per second."""
        n, tokens, seconds = choose_tree_size(scores, self, batch, self.max_nodes, draft_s, context)
        return n, tokens / seconds

    def wants_draft(self, context_scores: Optional[list[list[float]]], batch: int, context: int) -> bool:
        """Run the draft this step? Always while its rate is unknown; else when its recent drafted trees promised
        more tokens per second than the context's proposals alone (or than no speculation) do now."""
        if not self.has_draft:
            return False
        rate = self._bucket(self.draft_rate, batch)
        if rate is None:
            return True
        alone = self.size(context_scores, batch, context)[1] if context_scores else \
            batch / self.verify_s(batch, 1, context)
        if rate > alone:
            return True
        self.undrafted[batch] = self.undrafted.get(batch, 0) + 1
        if self.undrafted[batch] < self.EXPLORE_EVERY:
            return False
        self.undrafted[batch] = 0                                # measure the draft's rate again now and then
        return True

    def wants_proposals(self, batch: int) -> bool:
        """Look up the context's proposals this step? Not on most steps of a stretch where nothing was speculated
        (large batches, where a verify of more than the root never pays): the lookups cost per row and step. A
        skipped step counts as idle; every IDLE_SKIP-th step looks again."""
        idle = self.idle.get(batch, 0)
        if idle < self.IDLE_SKIP or idle % self.IDLE_SKIP == 0:
            return True
        self.idle[batch] = idle + 1
        return False

    def observe_size(self, batch: int, nodes: int, drafted: bool) -> None:
        """A step's tree: the root alone and no draft counts toward an idle stretch, anything else ends it."""
        self.idle[batch] = self.idle.get(batch, 0) + 1 if nodes <= 1 and not drafted else 0

    def observe_verify(self, batch: int, nodes: int, context: int, seconds: float) -> None:
        predicted = self.costs.verify_s(batch, nodes, context)
        if predicted > 0 and seconds > 0:
            self._ema(self.verify_factor, batch, seconds / predicted)

    def observe_step(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A finished step: its emitted tokens (all rows) and its draft + verify seconds."""
        if drafted and seconds > 0:
            self._ema(self.draft_rate, batch, tokens / seconds)
            self.undrafted[batch] = 0

    def _ema(self, table: dict, key: int, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else (1 - self.EMA) * old + self.EMA * value


# ---- measuring ---------------------------------------------------------------------------------------------
def prepared_forward(target, context: int, tree_size: int, batch: int = 1):
    """A callable timing one target forward over tree_size new tokens per row (a chain) after `context` cached
    tokens (its own cache, filled once; the new tokens are never committed, so every call does the same work).
    bench_decode times its step part with it too."""
    cache = target.new_cache(batch, context + tree_size + 1)
    dev = target.device
    rows = torch.arange(batch, device=dev)
    ids = torch.randint(0, target.vocab_size, (batch, context), device=dev)
    target(cache, ids, torch.arange(context, device=dev).expand(batch, -1), want_aux=False)
    cache.commit_prefix(rows, torch.full((batch,), context, device=dev))
    new = torch.randint(0, target.vocab_size, (batch, tree_size), device=dev)
    pos = (context + torch.arange(tree_size, device=dev)).expand(batch, tree_size)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def forward() -> float:
        sync()
        t0 = time.perf_counter()
        target(cache, new, pos, want_aux=True)
        sync()
        return time.perf_counter() - t0
    return forward


def _median_time(fn, repeats: int) -> float:
    times = sorted(fn() for _ in range(repeats + 1))[:repeats]       # the slowest (first, cold) call dropped
    return times[len(times) // 2]


def tree_sizes_for(batch: int, max_tree: int) -> list[int]:
    """The tree sizes measured at a batch size: larger batches afford smaller trees (at most 128 tokens a verify)."""
    return [t for t in TREE_SIZES if t <= max_tree and (t <= 2 or batch * t <= 128)]


def measure_costs(target, max_batch: int = 1, max_tree: int = 16, repeats: int = 3) -> StepCosts:
    """Time target forwards on this machine: B rows x T tokens at a short context, and T tokens of one row at a
    long one (about a second at batch 1 on 2 CPU cores; the draft's costs are learnt from the steps it runs)."""
    bs = [b for b in BATCH_SIZES if b <= max_batch] or [1]
    verify = {b: {t: _median_time(prepared_forward(target, CONTEXTS[0], t, b), repeats)
                  for t in tree_sizes_for(b, max_tree)} for b in bs}
    longest = max(verify[1])
    far = {t: _median_time(prepared_forward(target, CONTEXTS[1], t, 1), repeats) for t in sorted({1, longest})}
    per_context = {t: max(0.0, far[t] - verify[1][t]) / (CONTEXTS[1] - CONTEXTS[0]) for t in far}
    return StepCosts(verify, per_context, source=f"measured {time.strftime('%Y-%m-%d %H:%M')}")


def load_or_measure_costs(target, max_batch: int = 1, max_tree: int = 16, refresh: bool = False) -> StepCosts:
    """This machine's costs for this target: from the cache if measured before for at least these batch and tree
    sizes, else measured now (for the largest sizes asked for so far) and cached (per CPU model, kernel build,
    threads, target, dtype and torch)."""
    key = {"cpu": extension.cpu_model(), "kernel": extension.few_row_kernel(), "isa": extension.kernel_isa(),
           "threads": torch.get_num_threads(), "target": f"{getattr(target.hf_config, '_name_or_path', '')}:"
                     f"{target.num_layers}x{target.hidden_size}",
           "dtype": str(target.dtype), "device": str(target.device), "torch": torch.__version__}
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir(), "step_costs", f"{digest}.json")
    if os.path.isfile(path):
        try:
            with open(path) as f:
                cached = json.load(f)
            costs = StepCosts.from_json(cached)
            covered = cached["max_batch"], cached["max_tree"]
            if not refresh and covered[0] >= max_batch and covered[1] >= max_tree:
                return costs
            max_batch, max_tree = max(max_batch, covered[0]), max(max_tree, covered[1])
        except (ValueError, KeyError, TypeError):
            pass                                             # a stale or torn file: measure again
    costs = measure_costs(target, max_batch, max_tree)
    write_json(path, {**costs.to_json(), "key": key, "max_batch": max_batch, "max_tree": max_tree})
    return costs
