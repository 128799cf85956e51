"""Sizing each step's tree by what a verify costs on this machine and what each node is expected to yield.

A speculative step emits 1 + (accepted draft tokens) per row and costs a draft (zero for context proposals) plus one
target forward over the tree. With each candidate node's chance to be accepted (the draft's path probability, or
the calibrated chance of a context continuation), the expected tokens of the N best nodes are 1 + the sum of their
chances, `choose_row_sizes` gives each row the tree size that maximises the batch's expected tokens per second: the
rows' candidates compete for one verify by their chances, so a row in a long quotation gets many nodes, a row writing
free text none (1: the root alone), and a ragged verify computes just those.

The costs are measured on the machine that decodes (`MeasuredCosts`: target forwards, a batch size's row the first
time a step runs at it, within a time budget; cached per machine, kernel build, model and dtype) and kept up to date
from the steps the engine runs. A cached table is checked before it is used (`StepCosts.from_json`): a bad one is
measured again, with one warning line naming the file.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from sglang_eagle3.engine.step_record import StepRecord
from sglang_eagle3.errors import one_line
from sglang_eagle3.fileio import existing_ancestor, write_json
from sglang_eagle3.kernels import extension
from sglang_eagle3.paths import cache_dir

COSTS_FORMAT = "sglang_eagle3.step_costs/1"
TREE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
CONTEXTS = (128, 1024)
MEASURE_BUDGET_S = 30.0   # seconds of measuring per table at most (batch 1 aside); rows past it are extrapolated
NOISE = 0.1               # a larger tree may time this fraction below a smaller one's (timer noise), no more


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (sorted xs); proportional below the first point and never falling past the
    last one (a cost is positive and grows with its size, whatever the noise between two measured points)."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0] * x / xs[0]
    i = min(bisect.bisect_left(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    slope = (y1 - y0) / (x1 - x0)
    return y0 + slope * (x - x0) if x <= x1 else y1 + max(0.0, slope) * (x - x1)


def falls(row: dict[int, float]) -> list[tuple[int, int]]:
    """(smaller tree, larger tree) wherever a row's cost falls more than NOISE below a smaller tree's: a verify over
    more tokens never costs less, so such a row was timed while something else ran."""
    found, top = [], None
    for t in sorted(row):
        if top is not None and row[t] < (1 - NOISE) * row[top]:
            found.append((top, t))
        if top is None or row[t] > row[top]:
            top = t
    return found


def _keyed(name: str, table, nonempty: bool = False) -> dict:
    """A JSON table's entries by positive integer key; ValueError naming the table otherwise."""
    if not isinstance(table, dict):
        raise ValueError(f"{name} is missing" if table is None else f"{name} is a {type(table).__name__}, not a table")
    if nonempty and not table:
        raise ValueError(f"{name} is empty")
    bad = next((k for k in table if not (str(k).isdigit() and int(k) >= 1)), None)
    if bad is not None:
        raise ValueError(f"{name}: key {bad!r} is not a positive integer")
    return {int(k): v for k, v in table.items()}


def _seconds(name: str, value, positive: bool) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
        (value > 0 if positive else value >= 0)
    if not ok:
        raise ValueError(f"{name} = {value!r} is not a {'positive' if positive else 'non-negative'} finite number "
                         "of seconds")
    return float(value)


def _seconds_table(name: str, table, positive: bool = False, nonempty: bool = False) -> dict[int, float]:
    return {k: _seconds(f"{name}[{k}]", v, positive) for k, v in _keyed(name, table, nonempty).items()}


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
    measure_s = 0.0           # seconds spent measuring the table in this process (none: a given table)

    def ensure(self, batch: int) -> None:
        """Have the rows a step at `batch` reads: a given table has nothing to measure."""

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
    def from_json(cls, d) -> "StepCosts":
        """The costs a step_costs file holds, checked: ValueError naming the first table, key or value that is wrong
        (positive finite verify seconds, growing with the tree within NOISE; non-negative finite others)."""
        if not isinstance(d, dict):
            raise ValueError(f"holds a JSON {type(d).__name__}, not a {COSTS_FORMAT} object")
        if d.get("format") != COSTS_FORMAT:
            raise ValueError(f"format is {d.get('format')!r}, not {COSTS_FORMAT!r}")
        verify = {b: _seconds_table(f"verify[{b}]", row, positive=True, nonempty=True)
                  for b, row in _keyed("verify", d.get("verify"), nonempty=True).items()}
        for b, row in verify.items():
            fell = falls(row)
            if fell:
                small, large = fell[0]
                raise ValueError(f"verify[{b}]: {large} tokens cost {row[large]:.4g} s, less than {small} tokens' "
                                 f"{row[small]:.4g} s (a larger tree never costs less: timed while something else ran)")
        source = d.get("source", "")
        if not isinstance(source, str):
            raise ValueError(f"source is a {type(source).__name__}, not a string")
        return cls(verify, _seconds_table("per_context", d.get("per_context")),
                   _seconds_table("draft_level", d.get("draft_level", {})),
                   _seconds_table("draft_extend", d.get("draft_extend", {})), source)


def choose_row_sizes(scores: list[list[float]], costs: StepCosts, batch: int, max_nodes: int, draft_s: float = 0.0,
                     context: int = CONTEXTS[0], scale: float = 1.0) -> tuple[list[int], float, float]:
    """One verify budget for the whole batch: each row its own tree size. scores: per row, its candidates' log
    acceptance chances, best first (the order its tree takes them in; rows hold different numbers of them); each chance
    is read as min(1, scale * chance) (the planner's calibration); draft_s: seconds already spent drafting this step
    (counted at every size: the rate is the step's). The batch's candidates join in order of their chance (each row's
    best first), each adding its chance to the expected tokens and its token to the verify, which costs what a
    verify of that many tokens costs at this batch size (costs.verify_s at the rows' mean size; a ragged verify
    computes no padding). -> (per row its size in 1..max_nodes, expected tokens, expected seconds) at the number of
    candidates with the most expected tokens per second: all rows at 1 is no speculation."""
    per_row = max(0, max_nodes - 1)
    joined = sorted(((min(1.0, scale * math.exp(x)), b) for b, s in enumerate(scores) for x in s[:per_row]),
                    key=lambda c: -c[0])                       # stable: each row's candidates stay best first
    top = min(max_nodes, 2 + len(joined) // batch)             # the largest row size the joined ones can reach
    verify = [costs.verify_s(batch, n, context) for n in range(1, top + 1)]        # [n - 1]: n nodes per row
    best_m, best_tokens, best_s = 0, float(batch), draft_s + verify[0]
    tokens = float(batch)
    for m, (chance, _) in enumerate(joined, 1):
        tokens += chance
        whole, part = divmod(m, batch)                         # mean size 1 + m / batch, between two rows' sizes
        seconds = draft_s + verify[whole] + (part / batch) * (verify[min(whole + 1, top - 1)] - verify[whole])
        if tokens * best_s > best_tokens * seconds:
            best_m, best_tokens, best_s = m, tokens, seconds
    sizes = [1] * batch
    for _, b in joined[:best_m]:
        sizes[b] += 1
    return sizes, best_tokens, best_s


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
    CHANCE_SCALE = (0.25, 4.0)   # the calibration of sampled trees' chances stays within these
    RELAX = 0.02                 # per sampled root-only step, the calibration's drift back toward 1

    def __init__(self, costs: StepCosts, max_nodes: int, has_draft: bool):
        self.costs, self.max_nodes, self.has_draft = costs, max_nodes, has_draft
        self.verify_factor: dict[int, float] = {}     # batch -> observed / predicted verify seconds
        self.draft_rate: dict[int, float] = {}        # batch -> tokens/s drafted steps delivered lately
        self.step_factor: dict[int, float] = {}       # batch -> a root-only undrafted step's seconds over its
                                                      # predicted verify (what a whole step costs beyond its forward)
        self.undrafted: dict[int, int] = {}           # batch -> steps since the draft last ran at it
        self.idle: dict[int, int] = {}                # batch -> steps in a row that verified the root alone
        self.steps = {"draft": 0, "context": 0, "none": 0}
        self.choice = StepChoice()                    # speculate at all this step, or run a plain one
        # sampled steps: accepted draft tokens over the sum of their nodes' chances, both averaged (EMA); greedy
        # steps read the chances as they are
        self.chance_scale, self.accepted_avg, self.expected_avg = 1.0, None, None
        self.expected: Optional[float] = None     # the sum of the chances of the last sized sampled tree

    def _bucket(self, table: dict, batch: int) -> Optional[float]:
        keys = [b for b in table if b <= batch]
        return table[max(keys)] if keys else (table[min(table)] if table else None)

    def prepare(self, batch: int) -> None:
        """Before a step at `batch`: have its costs (a measured table measures their rows the first time)."""
        self.costs.ensure(batch)

    @property
    def measure_s(self) -> float:
        """Seconds its costs took to measure in this process (a one-off: not decoding time)."""
        return self.costs.measure_s

    def verify_s(self, batch: int, nodes: int, context: int) -> float:
        return self.costs.verify_s(batch, nodes, context) * (self._bucket(self.verify_factor, batch) or 1.0)

    def size(self, scores: list[list[float]], batch: int, context: int, draft_s: float = 0.0,
             sampled: bool = False) -> tuple[list[int], float]:
        """Each row's tree size (1 = the root alone; one verify budget for the batch, choose_row_sizes) and their
        predicted tokens per second. sampled: a step with sampling rows, whose chances (the sampled children's rank
        scores) are read through the calibration its verifies learn."""
        scale = self.chance_scale if sampled else 1.0
        sizes, tokens, seconds = choose_row_sizes(scores, self, batch, self.max_nodes, draft_s, context, scale)
        self.expected = sum(math.exp(x) for s, n in zip(scores, sizes) for x in s[:n - 1]) \
            if sampled and max(sizes) > 1 else None
        if sampled and max(sizes) == 1 and self.expected_avg is not None:
            self.relax_chance_scale()
        return sizes, tokens / seconds

    def relax_chance_scale(self) -> None:
        """A sampled step that verifies the root alone teaches the calibration nothing; without this a low stretch
        would keep sampled trees off for good. The scale drifts back toward 1 (RELAX of the gap per such step)
        until a tree pays again and its verifies are observed."""
        self.chance_scale += self.RELAX * (1.0 - self.chance_scale)
        self.accepted_avg = self.chance_scale * self.expected_avg

    def wants_draft(self, context_scores: Optional[list[list[float]]], batch: int, context: int) -> bool:
        """Run the draft this step? Always while its rate is unknown; else when its recent drafted steps delivered
        more tokens per second than the context's proposals alone (or than no speculation) promise now. Both are
        whole steps' rates: the draft's is observed so, the others' predicted forwards are scaled by what root-only
        steps took over their forwards (step_factor: acceptance, commit, bookkeeping)."""
        if not self.has_draft:
            return False
        rate = self._bucket(self.draft_rate, batch)
        if rate is None:
            return True
        alone = self.size(context_scores, batch, context)[1] if context_scores else \
            batch / self.verify_s(batch, 1, context)
        alone /= self._bucket(self.step_factor, batch) or 1.0   # as whole steps deliver it, like the draft's rate
        if rate > alone:
            return True
        self.undrafted[batch] = self.undrafted.get(batch, 0) + 1
        if self.undrafted[batch] < self.EXPLORE_EVERY:
            return False
        self.undrafted[batch] = 0                                # measure the draft's rate again now and then
        return True

    def speculates(self, batch: int) -> bool:
        """Speculate this step at all (look up proposals, maybe draft, size a tree), or run a plain step
        (StepChoice: whichever delivered more tokens per second lately at this batch size)."""
        return self.choice.speculates(batch)

    def wants_proposals(self, batch: int) -> bool:
        """Look up the context's proposals this step? Not on most steps of a stretch where nothing was speculated
        (large batches, where a verify of more than the root never pays): the lookups cost per row and step. A
        skipped step counts as idle; every IDLE_SKIP-th step looks again."""
        idle = self.idle.get(batch, 0)
        if idle < self.IDLE_SKIP or idle % self.IDLE_SKIP == 0:
            return True
        self.idle[batch] = idle + 1
        return False

    def observe(self, step: StepRecord) -> None:
        """A finished step (what the speculative worker tells its observer): its tree, its verify's cost
        (where timed) and, where the draft ran, the tokens per second it delivered."""
        self.observe_size(step.batch, step.nodes, step.drafted)
        if self.expected is not None and step.nodes > 1:
            self.observe_acceptance(step.tokens - step.batch, self.expected)
        self.expected = None
        if step.forward_s is not None:
            self.observe_verify(step.batch, step.nodes, step.context, step.forward_s)
        seconds = step.times.draft + step.times.verify
        if not step.drafted and step.nodes <= 1 and seconds > 0:
            self._ema(self.step_factor, step.batch, seconds / self.verify_s(step.batch, 1, step.context))
        # the rates without the extend work earlier undrafted steps left to this one: drafting every step would have
        # spread that work over them
        own_s = seconds - step.owed_s
        self.choice.observe(step.batch, step.tokens, own_s)
        self.observe_step(step.batch, step.drafted, step.tokens, own_s)

    def observe_size(self, batch: int, nodes: int, drafted: bool) -> None:
        """A step's tree: the root alone and no draft counts toward an idle stretch, anything else ends it."""
        self.idle[batch] = self.idle.get(batch, 0) + 1 if nodes <= 1 and not drafted else 0

    def observe_acceptance(self, accepted: int, expected: float) -> None:
        """A sampled step's accepted draft tokens against the sum of its tree's chances: the calibration
        (chance_scale, within CHANCE_SCALE) that makes the chances of later sampled trees match what verifies
        accept."""
        a, e = self.EMA, self.expected_avg
        self.accepted_avg = accepted if e is None else (1 - a) * self.accepted_avg + a * accepted
        self.expected_avg = expected if e is None else (1 - a) * e + a * expected
        if self.expected_avg > 0:
            low, high = self.CHANCE_SCALE
            self.chance_scale = min(high, max(low, self.accepted_avg / self.expected_avg))

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


class StepChoice:
    """Per batch size: speculate (proposals, the draft, a tree) or run plain steps (the root alone, nothing looked
    up), whichever delivered more tokens per second in whole steps lately: each choice's emitted tokens over its
    seconds, both sums decayed per step it ran (a ratio of sums: one speculative step emits 1 to 8 tokens a row, and
    an average of per-step rates would follow that noise). On a 2-core CPU a large batch's verify is compute-bound,
    and there proposals and the draft can cost more than they yield; a plain step is what vanilla decoding runs.

    Each choice is tried first. Then the other one runs for EXPLORE_STEPS steps every `every` steps, so a change
    (longer contexts, another mix of requests) is seen; `every` doubles (up to EVERY_MAX) each time such a try
    confirms the choice, and falls back to EVERY_MIN when it changes it. A switch costs: the first speculating step
    after plain ones runs the draft over what they held back. That work is left out of the rates (and the first step
    after a switch is not counted), and the tries' backing off keeps switches few where one choice wins."""

    DECAY = 0.9               # per counted step of a choice
    EVERY_MIN, EVERY_MAX = 32, 512
    EXPLORE_STEPS = 2
    MIN_BATCH = 5             # smaller batches always speculate (their verify is memory-bound: the tree is sized by
                              # the planner or the profile's measured table; on 2026-12-07 the choice's noise cost
                              # hybrid-auto 1.48x -> 1.32x at concurrency 1 on the Xeon with AMX)

    def __init__(self):
        self.sums: dict[int, dict[bool, list[float]]] = {}   # batch -> {speculated: [tokens, seconds]}
        self.state: dict[int, dict] = {}                       # batch -> its schedule (below)
        self.chosen: Optional[tuple[int, bool, bool]] = None   # (batch, speculates, counted) of the step under way

    def rate(self, batch: int, speculated: bool) -> Optional[float]:
        s = self.sums.get(batch, {}).get(speculated)
        return s[0] / s[1] if s and s[1] > 0 else None

    def best(self, batch: int) -> bool:
        yes, no = self.rate(batch, True), self.rate(batch, False)
        return True if no is None else False if yes is None else yes >= no

    @staticmethod
    def bucket(batch: int) -> int:
        """Batch sizes share their choice within powers of two (1, 2, 3-4, 5-8, ...): a batch that grows or drains
        one request at a time would otherwise try both choices afresh at every size."""
        return 1 << (batch - 1).bit_length()

    def speculates(self, batch: int) -> bool:
        if batch < self.MIN_BATCH:
            self.chosen = None
            return True
        batch = self.bucket(batch)
        st = self.state.setdefault(batch, {"n": 0, "every": self.EVERY_MIN, "explore": 0, "last": None,
                                           "before": None})
        st["n"] += 1
        sums = self.sums.setdefault(batch, {})
        if len(sums) < 2 and st["explore"] == 0:              # each choice first, speculating first
            choice = True not in sums
        elif st["explore"] > 0:
            choice = not st["before"]
        else:
            choice = self.best(batch)
            if st["before"] is not None:                      # a try just ended: did it change the choice?
                st["every"] = self.EVERY_MIN if choice != st["before"] else min(self.EVERY_MAX, 2 * st["every"])
                st["before"] = None
            if st["n"] % st["every"] == 0:                    # try the other one
                st["before"], st["explore"] = choice, self.EXPLORE_STEPS
                choice = not choice
        if st["explore"] > 0:
            st["explore"] -= 1
        counted = st["last"] == choice                        # not the first step after a switch
        st["last"] = choice
        self.chosen = (batch, choice, counted or choice not in sums)
        return choice

    def observe(self, batch: int, tokens: int, seconds: float) -> None:
        """The step under way finished: its emitted tokens, all rows, and its seconds without the draft's work over
        what earlier steps held back (a request's prompt, pairs of plain steps): the rates compared are those of
        staying with a choice."""
        chosen, self.chosen = self.chosen, None
        batch = self.bucket(batch)
        if chosen is None or chosen[0] != batch or seconds <= 0 or not chosen[2]:
            return
        old = self.sums[batch].get(chosen[1], [0.0, 0.0])
        self.sums[batch][chosen[1]] = [self.DECAY * old[0] + tokens, self.DECAY * old[1] + seconds]


# ---- measuring ---------------------------------------------------------------------------------------------
def prepared_forward(target, context: int, tree_size: int, batch: int = 1):
    """A callable timing one target forward over `tokens` (at most tree_size, default all) new tokens per row (a chain)
    after `context` cached tokens (its own cache, filled once; the new tokens are never committed, so every call does
    the same work). bench_decode times its step part with it too."""
    cache = target.new_cache(batch, context + tree_size + 1)
    dev = target.device
    rows = torch.arange(batch, device=dev)
    ids = torch.randint(0, target.vocab_size, (batch, context), device=dev)
    target(cache, ids, torch.arange(context, device=dev).expand(batch, -1), want_aux=False)
    cache.commit_prefix(rows, torch.full((batch,), context, device=dev))
    new = torch.randint(0, target.vocab_size, (batch, tree_size), device=dev)
    pos = (context + torch.arange(tree_size, device=dev)).expand(batch, tree_size)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def forward(tokens: int = tree_size) -> float:
        sync()
        t0 = time.perf_counter()
        target(cache, new[:, :tokens], pos[:, :tokens], want_aux=True)
        sync()
        return time.perf_counter() - t0
    return forward


def _median_time(fn, repeats: int) -> float:
    times = sorted(fn() for _ in range(repeats + 1))[:repeats]       # the slowest (first, cold) call dropped
    return times[len(times) // 2]


def tree_sizes_for(batch: int, max_tree: int) -> list[int]:
    """The tree sizes measured at a batch size: larger batches afford smaller trees (at most 128 tokens a verify)."""
    return [t for t in TREE_SIZES if t <= max_tree and (t <= 2 or batch * t <= 128)]


def rows_for(batch: int, max_batch: int) -> list[int]:
    """The rows a step at `batch` interpolates between: the BATCH_SIZES around it (none above max_batch: then the
    largest is max_batch; past the last of BATCH_SIZES, the batch itself)."""
    below = max(b for b in BATCH_SIZES if b <= batch)
    above = min([b for b in BATCH_SIZES if b >= batch] or [batch])
    return sorted({below, min(above, max(max_batch, batch))})


def cache_problem(path: str) -> Optional[str]:
    """Why the cache file at path cannot be written (None: as far as can be told before writing, it can)."""
    if os.path.isdir(path):
        return "is a directory"
    folder = existing_ancestor(path)
    if not os.path.isdir(folder):
        return f"{folder} is not a folder"
    if not os.access(folder, os.W_OK):
        return f"{folder} is not writable"
    return None


def _warn(text: str) -> None:
    """One line on stderr, on a line of its own while a progress bar shows."""
    from tqdm import tqdm
    tqdm.write(f"warning: {text}", file=sys.stderr)


def read_cached_costs(path: str) -> Optional[StepCosts]:
    """The table cached at path, checked; None when there is none, or (said in one line) when it is unreadable or
    wrong."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return StepCosts.from_json(json.load(f))
    except (OSError, ValueError) as e:                       # JSONDecodeError, UnicodeDecodeError: ValueErrors
        why = f"not JSON ({e})" if isinstance(e, json.JSONDecodeError) else one_line(e)
        _warn(f"{path}: {why}; measuring the step costs again")
        return None


class MeasuredCosts(StepCosts):
    """This machine's costs for a target, measured when the planner needs them: batch 1 at once, another batch size's
    rows (the BATCH_SIZES around it) the first time a step runs at it. Each point is the median of `repeats` timings;
    the points of a row that falls as trees grow are timed again, and a row that still falls is used with its running
    maximum (said once) and never cached. Past MEASURE_BUDGET_S seconds of measuring, the rows not measured are
    extrapolated from the measured ones (said once). Measured rows are written to the cache file; one that cannot be
    written is said once and the run goes on without it."""

    def __init__(self, target, path: str, cached: Optional[StepCosts] = None, max_batch: int = 1, max_tree: int = 16,
                 repeats: int = 3, key: Optional[dict] = None):
        table = cached or StepCosts({}, {})
        super().__init__(table.verify, table.per_context, table.draft_level, table.draft_extend, table.source)
        self.target, self.path, self.key = target, path, key or {}
        self.max_batch, self.max_tree, self.repeats = max_batch, max_tree, repeats
        self.budget_s = MEASURE_BUDGET_S
        self.measure_s = 0.0
        self.unkept: set[int] = set()             # rows that still fell when timed again: used, never cached
        self.extrapolated: set[int] = set()       # rows the budget left unmeasured
        problem = cache_problem(path)
        self.keep = problem is None
        if problem:
            _warn(f"{path}: {problem}; the step costs measured now are not kept")

    def ensure(self, batch: int) -> None:
        for b in rows_for(batch, self.max_batch):
            if self._missing(b):
                self._measure(b)

    def _missing(self, batch: int) -> bool:
        row = self.verify.get(batch)
        return batch not in self.extrapolated and (not row or max(row) < max(tree_sizes_for(batch, self.max_tree)))

    def _estimate(self, batch: int, sizes: list[int]) -> float:
        """Seconds measuring a row would take, from the rows measured: its cache's fill and its timed forwards."""
        return self.verify_s(batch, CONTEXTS[0]) + (self.repeats + 1) * sum(self.verify_s(batch, t) for t in sizes)

    def _measure(self, batch: int) -> None:
        from tqdm import tqdm
        sizes = tree_sizes_for(batch, self.max_tree)
        if self.verify and self._estimate(batch, sizes) > self.budget_s - self.measure_s:
            self._skip(batch)
            return
        start = time.perf_counter()
        far = self._far_context(max(sizes)) if batch == 1 else 0
        points = len(sizes) + (len({1, max(sizes)}) if far else 0)
        try:
            with tqdm(total=points, desc=f"measuring step costs at batch {batch}", unit=" point",
                      file=sys.stderr) as bar:
                row = self._time_row(batch, sizes, bar)
                per_context = self._time_context(far, row, bar) if far else self.per_context
        except RuntimeError as e:              # out of memory beside a server's KV pool, say: a step must not fail
            if not self.verify:
                raise
            self.extrapolated.add(batch)
            _warn(f"measuring step costs at batch {batch} failed ({one_line(e)}): extrapolated from the measured ones "
                  f"({', '.join(map(str, sorted(self.verify)))})")
            return
        finally:
            self.measure_s += time.perf_counter() - start
        self.verify[batch], self.per_context = row, per_context
        self.source = f"measured {time.strftime('%Y-%m-%d %H:%M')}"
        self._save()

    def _timer(self, forward, batch: int, context: int, bar):
        def time_at(tokens: int) -> float:
            bar.set_postfix_str(f"{batch} x {tokens} tokens after {context}", refresh=False)
            seconds = _median_time(lambda: forward(tokens), self.repeats)
            bar.update()
            return seconds
        return time_at

    def _time_row(self, batch: int, sizes: list[int], bar) -> dict[int, float]:
        time_at = self._timer(prepared_forward(self.target, CONTEXTS[0], max(sizes), batch), batch, CONTEXTS[0], bar)
        row = {t: time_at(t) for t in sizes}
        again = sorted({t for pair in falls(row) for t in pair})
        if again:                                         # noise, or something else ran meanwhile: time them again
            bar.total += len(again)
            row.update({t: time_at(t) for t in again})
        fell = falls(row)
        if fell:
            small, large = fell[0]
            _warn(f"step costs at batch {batch} fall as trees grow, also when timed again ({large} tokens "
                  f"{row[large]:.4g} s < {small} tokens {row[small]:.4g} s; is something else using the machine?): "
                  "using their running maximum for this run, not caching them")
            top = 0.0
            for t in sorted(row):
                row[t] = top = max(top, row[t])
            self.unkept.add(batch)
        return row

    def _far_context(self, longest: int) -> int:
        """The long context per_context is timed at: CONTEXTS[1], within the target's context (0: too short)."""
        limit = self.target.context_len or CONTEXTS[1] + longest + 1
        far = min(CONTEXTS[1], limit - longest - 1)
        return far if far > CONTEXTS[0] else 0

    def _time_context(self, far: int, row: dict[int, float], bar) -> dict[int, float]:
        """Extra seconds per cached token of one row, from T tokens timed after `far` cached tokens."""
        longest = max(row)
        time_at = self._timer(prepared_forward(self.target, far, longest, 1), 1, far, bar)
        return {t: max(0.0, time_at(t) - row[t]) / (far - CONTEXTS[0]) for t in sorted({1, longest})}

    def _skip(self, batch: int) -> None:
        self.extrapolated.add(batch)
        if len(self.extrapolated) == 1:
            _warn(f"the {self.budget_s:g} s budget for measuring step costs is spent: batch size {batch} and those not "
                  f"measured yet are extrapolated from the measured ones ({', '.join(map(str, sorted(self.verify)))})")

    def _save(self) -> None:
        kept = {b: row for b, row in self.verify.items() if b not in self.unkept}
        if not self.keep or not kept:
            return
        table = StepCosts(kept, self.per_context, self.draft_level, self.draft_extend, self.source)
        try:
            write_json(self.path, {**table.to_json(), "key": self.key})
        except OSError as e:
            self.keep = False
            _warn(f"{self.path}: {one_line(e)}; the step costs measured now are not kept")


def load_or_measure_costs(target, max_batch: int = 1, max_tree: int = 16, refresh: bool = False) -> MeasuredCosts:
    """This machine's costs for this target (cached per CPU model, kernel build, threads, target, dtype and torch):
    the cached table if it is sound (else measured again, said in one line), batch 1 measured now if it lacks it,
    other batch sizes up to max_batch when steps first run at them."""
    key = {"cpu": extension.cpu_model(), "kernel": extension.few_row_kernel(), "isa": extension.kernel_isa(),
           "threads": torch.get_num_threads(), "target": f"{getattr(target.hf_config, '_name_or_path', '')}:"
                     f"{target.num_layers}x{target.hidden_size}",
           "dtype": str(target.dtype), "device": str(target.device), "torch": torch.__version__}
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir(), "step_costs", f"{digest}.json")
    costs = MeasuredCosts(target, path, None if refresh else read_cached_costs(path), max_batch, max_tree, key=key)
    costs.ensure(1)
    return costs
