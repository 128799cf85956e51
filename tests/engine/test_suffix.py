"""Drafts from the context (engine/suffix.py), hybrid trees (engine/tree.py merge_candidates) and the per-step tree
size (engine/cost_model.py): against brute force, and lossless in the engine."""
from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from conftest import fake_step_costs, linear_cost, random_draft, tiny_target

from sglang_eagle3.engine.cost_model import StepCosts, TreePlanner, choose_row_sizes
from sglang_eagle3.engine.engine import SpeculativeEngine
from sglang_eagle3.engine.settings import Settings
from sglang_eagle3.engine.speculation import Drafting, SpecConfig
from sglang_eagle3.engine.suffix import ContextDrafter, MatchCalibration, SuffixIndex, SuffixPool
from sglang_eagle3.engine.tree import Candidates, chain_candidates, merge_candidates, tree_of
from sglang_eagle3.engine.verify import SamplingParams


# ---- the index against brute force --------------------------------------------------------------------------
def brute_longest(tokens: list[int], max_n: int, min_match: int = 1):
    """(match length, the latest earlier end) of the longest suffix of `tokens` (up to max_n) seen before."""
    L = len(tokens)
    for n in range(min(max_n, L), min_match - 1, -1):
        suffix = tokens[L - n:]
        ends = [e for e in range(n, L) if tokens[e - n:e] == suffix]
        if ends:
            return n, max(ends)
    return 0, None


def extended(tokens: list[int], end: int, k: int) -> list[int]:
    s = list(tokens)
    for i in range(k):
        s.append(s[end + i])
    return s[len(tokens):]


@pytest.mark.parametrize("seed", range(6))
def test_the_longest_match_and_its_continuation_equal_brute_force(seed):
    rng = random.Random(seed)
    alphabet = rng.randint(2, 6)
    tokens = [rng.randrange(alphabet) for _ in range(rng.randint(20, 120))]
    index = SuffixIndex(max_n=6, keep=10_000)
    for L in range(1, len(tokens) + 1):
        index.extend(tokens[L - 1:L])
        n, end = brute_longest(tokens[:L], 6)
        got = index.propose(8, max_branches=1)
        if end is None:
            assert got == []
            continue
        assert (got[0].match_len, got[0].tokens) == (n, extended(tokens[:L], end, 8)), L


def test_branches_are_the_distinct_next_tokens_from_the_longest_matches_down():
    #           0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 1, 2, 7, 9, 1, 2, 8, 3, 3, 1, 2]
    index = SuffixIndex(tokens, max_n=4, keep=8)
    got = index.propose(2, max_branches=3)
    # "1 2" was followed by 8 (latest, ends at 7) and by 7 (ends at 3); "2" adds nothing new
    assert [(p.tokens, p.match_len) for p in got] == [([8, 3], 2), ([7, 9], 2)]
    assert index.propose(2, max_branches=3, min_match=3) == []


def test_a_loop_at_the_end_continues_itself():
    index = SuffixIndex([4, 1, 2, 3, 1, 2, 3, 1, 2], max_n=8)
    (p,) = index.propose(7)
    assert p.tokens == [3, 1, 2, 3, 1, 2, 3] and p.match_len == 5


def test_keep_bounds_the_positions_per_ngram():
    index = SuffixIndex([1] * 50, max_n=3, keep=2)
    assert all(len(v) <= 2 for table in index.ends for v in table.values())


def test_the_pool_finds_the_longest_match_a_brute_force_search_finds():
    """One index over all pooled streams: the match length equals a brute-force scan's, its continuation is one
    a longest match has, and the newest stream wins a tie."""
    import random
    rng = random.Random(0)
    pool = SuffixPool(max_tokens=400, max_n=5, keep=64)
    streams = {}
    for k in range(40):                                             # more than fit: the oldest go
        streams[k] = [rng.randrange(6) for _ in range(rng.randrange(5, 30))]
        pool.add(k, streams[k])
    live = [streams[k] for k in pool.streams]
    assert sum(map(len, live)) <= 400 and list(pool.streams)[-1] == 39
    for _ in range(200):
        suffix = [rng.randrange(6) for _ in range(rng.randrange(1, 7))]
        best, conts = 0, set()
        for toks in live:
            for end in range(1, len(toks)):
                n = 0
                while n < min(5, end, len(suffix)) and toks[end - 1 - n] == suffix[-1 - n]:
                    n += 1
                if n > best:
                    best, conts = n, set()
                if n == best and n >= 2:
                    conts.add(tuple(toks[end:end + 3]))
        got = pool.propose(suffix, 3, min_match=2)
        if best < 2:
            assert got is None
        else:
            assert got.match_len == best and (tuple(got.tokens[:len(got.tokens)]) in conts or
                                              any(c == tuple(got.tokens[:len(c)]) for c in conts))
    pool.add("x", [9, 9, 1, 2, 7])
    pool.add("y", [3, 1, 2, 8])
    assert pool.propose([1, 2], 1, min_match=2).tokens == [8]                   # the newest stream first
    pool.add("y", [5])                                              # re-adding replaces the stream
    assert pool.propose([1, 2], 1, min_match=2).tokens == [7]


def test_the_pool_finds_other_streams_and_forgets_the_oldest():
    pool = SuffixPool(max_tokens=12, max_n=4)
    pool.add("a", [1, 2, 3, 4, 5, 6])
    pool.add("b", [7, 8, 9, 10])
    got = pool.propose([0, 2, 3], 3, min_match=2)
    assert (got.tokens, got.match_len) == ([4, 5, 6], 2)
    pool.add("c", [11, 12, 13, 14, 15])                       # 15 tokens > 12: "a" goes
    assert pool.propose([0, 2, 3], 3, min_match=2) is None and set(pool.streams) == {"b", "c"}
    assert pool.propose([8, 9], 2, min_match=2).tokens == [10, 10]         # its end repeats (a loop of one)


def test_calibration_learns_from_what_was_accepted():
    cal = MatchCalibration(max_n=4)
    before = cal.chance(2)
    for _ in range(200):
        cal.observe(2, 3, 3)                                   # every proposed token accepted
    assert cal.chance(2) > 0.9 > before and cal.chance(4) > cal.PRIOR[4]
    logs = cal.chain_log_chances(2, 3)
    assert logs == sorted(logs, reverse=True) and all(x <= 0 for x in logs)


# ---- hybrid trees -------------------------------------------------------------------------------------------
def test_proposals_merge_into_the_drafts_candidates():
    #                    root's children: 10, 11; 10's children: 12, 13
    c = Candidates(torch.tensor([[10, 11, 12, 13]]), torch.tensor([[-0.5, -1.0, -1.2, -3.0]]),
                   torch.tensor([[-1, -1, 0, 0]]), torch.zeros(1, 4, dtype=torch.bool))
    chain = ([10, 13, 20], [math.log(0.9), math.log(0.8), math.log(0.7)])
    m = merge_candidates(c, chain_candidates([[chain]], "cpu"))
    assert m.tokens.tolist() == [[10, 11, 12, 13, 20]] and m.parents.tolist() == [[-1, -1, 0, 0, 3]]
    assert m.scores[0, 0] == pytest.approx(math.log(0.9)) and m.scores[0, 3] == pytest.approx(math.log(0.8))  # raised
    assert m.from_context.tolist() == [[False, False, False, False, True]]
    tree, ctx = tree_of(m, torch.tensor([1]), torch.tensor([7]), 4)          # the 3 best: 10, 13, 20
    assert tree.tokens.tolist() == [[1, 10, 13, 20]] and tree.parents.tolist() == [[-1, 0, 1, 2]]
    assert ctx.tolist() == [[False, False, False, True]] and tree.positions.tolist() == [[7, 8, 9, 10]]
    with pytest.raises(ValueError, match="needs 6 candidates in row 0, it has 5"):
        tree_of(m, torch.tensor([1]), torch.tensor([7]), 7)


@pytest.mark.parametrize("seed", range(20))
def test_merged_candidates_keep_trees_closed_under_ancestors_and_siblings_distinct(seed):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    B, k = 2, 3
    tokens = [rng.sample(range(8), k) for _ in range(B)]                # the draft's: distinct siblings
    scores = torch.sort(-torch.rand(B, k, generator=g) * 3, descending=True).values
    cands = Candidates(torch.tensor(tokens), scores, torch.full((B, k), -1), torch.zeros(B, k, dtype=torch.bool))
    props = []
    for _ in range(B):
        chains = []
        for _ in range(rng.randint(0, 3)):
            n = rng.randint(1, 5)
            chains.append(([rng.randrange(8) for _ in range(n)], [math.log(0.9 ** (j + 1)) for j in range(n)]))
        props.append(chains)
    m = merge_candidates(cands, chain_candidates(props, "cpu"))
    for size in range(1, min(m.finite()) + 2):
        tree, _ = tree_of(m, torch.tensor([0, 0]), torch.tensor([3, 4]), size)
        for b in range(B):
            par, tok = tree.parents[b].tolist(), tree.tokens[b].tolist()
            assert all(0 <= par[i] < i for i in range(1, len(par)))
            kids = {}
            for i in range(1, len(par)):
                kids.setdefault(par[i], []).append(tok[i])
            assert all(len(v) == len(set(v)) for v in kids.values())


def walk_chains(cands: Candidates, proposals) -> list[tuple]:
    """Reference for a hybrid step's candidates: each chain walked into the draft's candidates token by token (follow
    the candidate holding the token, raising its score to the chain's where higher, else add one)."""
    out = []
    for (tokens, scores, parents, context), chains in zip(zip(cands.tokens.tolist(), cands.scores.tolist(),
                                                              cands.parents.tolist(), cands.from_context.tolist()),
                                                          proposals):
        for chain, chances in chains:
            at = -1
            for token, score in zip(chain, chances):
                i = next((i for i in range(len(tokens)) if (parents[i], tokens[i]) == (at, token)), None)
                if i is None:
                    tokens, scores, parents, context = tokens + [token], scores + [score], parents + [at], context + [True]
                    i = len(tokens) - 1
                else:
                    scores[i] = max(scores[i], torch.tensor(score).item())
                at = i
        out.append((tokens, torch.tensor(scores).tolist(), parents, context))
    return out


def chain_of(rng: random.Random, n: int) -> tuple[list[int], list[float]]:
    """A chain of n tokens (from a small alphabet: chains share starts) with falling cumulative log chances."""
    logs = list(itertools.accumulate(math.log(rng.uniform(0.1, 0.99)) for _ in range(n)))
    return [rng.randrange(6) for _ in range(n)], logs


@pytest.mark.parametrize("seed", range(20))
def test_merging_the_contexts_candidates_equals_walking_its_chains_into_the_drafts(seed):
    """merge_candidates(draft, chain_candidates(chains)), what a hybrid step proposes, holds exactly the candidates,
    scores, parents and flags of walking every chain into the draft's candidates, in that order (chains sharing a
    start, and chains through the draft's nodes, included)."""
    rng = random.Random(seed)
    B, k = 2, 3
    rows = []
    for _ in range(B):                                  # k children of the root, k of its first child: distinct
        scores = sorted((-2 * rng.random() for _ in range(k)), reverse=True)
        rows.append((rng.sample(range(6), k) + rng.sample(range(6), k), scores + [scores[0] - rng.random()] * k,
                     [-1] * k + [0] * k))
    draft = Candidates(torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows]),
                       torch.tensor([r[2] for r in rows]), torch.zeros(B, 2 * k, dtype=torch.bool))
    props = [[chain_of(rng, rng.randint(1, 4)) for _ in range(rng.randint(0, 3))] for _ in range(B)]
    m = merge_candidates(draft, chain_candidates(props, "cpu"))
    for b, (tokens, scores, parents, context) in enumerate(walk_chains(draft, props)):
        n = len(tokens)
        assert m.tokens[b, :n].tolist() == tokens and m.parents[b, :n].tolist() == parents
        assert m.scores[b, :n].tolist() == scores and m.from_context[b, :n].tolist() == context
        assert bool(torch.isinf(m.scores[b, n:]).all())                         # the rest: padding


# ---- the per-step size ---------------------------------------------------------------------------------------
def flat_costs(step=0.01, per_token=0.001) -> StepCosts:
    return StepCosts({1: {1: step, 32: step + 31 * per_token}, 8: {1: 8 * step, 32: 8 * (step + 31 * per_token)}},
                     {1: 0.0})


def test_the_size_maximises_expected_tokens_per_second():
    costs = flat_costs()
    sure = [[math.log(0.95)] * 10]
    (n,), tokens, seconds = choose_row_sizes(sure, costs, 1, 16)
    assert n == 11 and tokens == pytest.approx(1 + 10 * 0.95)
    assert choose_row_sizes([[math.log(0.01)] * 10], costs, 1, 16)[0] == [1]      # not worth a bigger verify
    assert choose_row_sizes([[]], costs, 1, 16)[0] == [1]
    assert choose_row_sizes(sure, flat_costs(per_token=0.02), 1, 16)[0] == [1]     # verifies too dear
    assert choose_row_sizes(sure, costs, 1, 4)[0] == [4]                           # capped
    # the draft's seconds count: a tree that barely pays without them loses with them
    weak = [[math.log(0.3)] * 3]
    assert choose_row_sizes(weak, costs, 1, 16)[0][0] > 1
    (n,), tokens, seconds = choose_row_sizes(weak, costs, 1, 16, draft_s=0.02)
    assert seconds == pytest.approx(0.02 + costs.verify_s(1, n))


def test_one_verify_budget_gives_each_row_its_own_tree():
    """At batch 8 the rows' candidates compete for one verify: a row in a sure long quotation gets many nodes, rows
    whose candidates are weak get none (the ragged verify computes no padding for them), and the step's expected
    tokens and seconds are those of the chosen nodes at the rows' mean size."""
    costs = StepCosts({8: {1: 0.08, 2: 0.09, 4: 0.11, 8: 0.2, 16: 0.4}}, {1: 0.0})
    sure, weak = [math.log(0.95)] * 12, [math.log(0.05)] * 12
    sizes, tokens, seconds = choose_row_sizes([sure] + [weak] * 7, costs, 8, 16)
    assert sizes[0] > 8 and sizes[1:] == [1] * 7
    assert tokens == pytest.approx(8 + 0.95 * (sizes[0] - 1))
    assert seconds == pytest.approx(costs.verify_s(8, sum(sizes) / 8))
    # one size for every row (the same candidates in every row) is the per-row choice too
    (n,), *_ = choose_row_sizes([sure], flat_costs(), 1, 16)
    assert choose_row_sizes([sure] * 8, flat_costs(), 8, 16)[0] == [n] * 8
    # rows with fewer candidates than others take what they have: the others are not held to them
    sizes = choose_row_sizes([sure, sure[:2]] + [weak] * 6, costs, 8, 16)[0]
    assert sizes[1] == 3 and sizes[0] > 8 and set(sizes[2:]) == {1}


def test_the_planner_compares_whole_steps_with_whole_steps():
    """wants_draft weighs the draft's observed rate (whole drafted steps, without the extend work that undrafted steps
    held back for them) against what root-only steps really deliver (their forwards' prediction scaled by what such
    steps took): a step's fixed bookkeeping does not count against the draft alone."""
    from sglang_eagle3.engine.step_record import StepRecord, StepTimes
    costs = flat_costs()                                      # batch 1: a root-only forward 10 ms
    planner = TreePlanner(costs, 16, has_draft=True)
    planner.observe(StepRecord(1, 4, True, 128, 2, StepTimes(draft=0.004, verify=0.02), None, owed_s=0.004))
    assert planner.draft_rate[1] == pytest.approx(2 / 0.02)   # 100 tokens/s: the owed extend left out
    assert not planner.wants_draft(None, 1, 128)              # against a predicted 100 tokens/s root-only
    for _ in range(40):                                       # root-only steps take 25 ms, not 10: 40 tokens/s
        planner.observe(StepRecord(1, 1, False, 128, 1, StepTimes(draft=0.001, verify=0.024), None))
    assert planner.step_factor[1] == pytest.approx(2.5, rel=0.01)
    assert planner.wants_draft(None, 1, 128)


@pytest.mark.step_choice
def test_step_choice_keeps_to_what_delivers_and_tries_the_other_now_and_then():
    """Per batch size: both choices tried first, then the one whose whole steps delivered more tokens per second;
    the other is tried for 2 steps every 32, then every 64, 128, ... while the tries confirm the choice, every 32 again
    once one changes it; the first step after a switch is not counted (it pays for the switch)."""
    from sglang_eagle3.engine.cost_model import StepChoice
    choice = StepChoice()

    def run(steps, spec_rate, plain_rate, batch=16, switch_cost=0.0):
        picks, last = [], None
        for _ in range(steps):
            c = choice.speculates(batch)
            extra = switch_cost if c and last is False else 0.0
            picks.append(c)
            choice.observe(batch, 100, 100 / (spec_rate if c else plain_rate) + extra)
            last = c
        return picks
    assert run(2, 300, 200) == [True, False]
    picks = run(1000, 300, 200, switch_cost=10.0)     # a switch to speculating costs 20 plain steps: not counted
    tries = [i for i in range(1, len(picks)) if not picks[i] and picks[i - 1]]
    assert picks.count(False) == 2 * len(tries) and 3 <= len(tries) <= 5   # at 32, 64, 128, 256, 512 steps
    picks = run(400, 150, 200)                        # speculation now costs more than it yields: followed
    assert picks[-300:].count(True) <= 2 * 3 and not picks[-1]
    assert choice.speculates(8)                       # another batch size: its own, tried afresh
    choice.observe(9, 10, 1.0)                        # a step of another batch size is not counted
    assert choice.sums[8] == {} and choice.rate(8, True) is None
    assert all(choice.speculates(b) for b in range(1, StepChoice.MIN_BATCH) for _ in range(100))   # small: always
    # a ratio of sums: steps of 1 and 7 tokens in the same seconds average 4 tokens a step, not their rates' mean
    steady = StepChoice()
    steady.speculates(16)
    for t in (1, 7) * 20:
        steady.chosen = (16, True, True)
        steady.observe(16, t, 0.01)
    assert 350 < steady.rate(16, True) < 450


def test_a_fixed_trees_greedy_steps_may_run_plain_its_sampling_steps_never(monkeypatch):
    """With a fixed tree the scheduler's StepChoice may run greedy steps plain (here always): no draft runs, output
    stays vanilla's. Steps with a sampling row keep their tree: a seeded request's draws must not depend on timings."""
    from sglang_eagle3.engine.cost_model import StepChoice
    monkeypatch.setattr(StepChoice, "speculates", lambda self, batch: False)
    tm, _ = tiny_target("llama", vocab_size=64, logit_scale=2.0)
    eng = SpeculativeEngine(tm, random_draft(tm, seed=3), Settings(tree=SpecConfig(2, 2, 4)))
    van, _ = SpeculativeEngine(tm, None, Settings()).generate(REPETITIVE, SamplingParams(max_new_tokens=12))
    outs, stats = eng.generate(REPETITIVE, SamplingParams(max_new_tokens=12), batch_size=3)
    assert [o.token_ids for o in outs] == [o.token_ids for o in van] and stats.drafted_steps == 0
    _, stats = eng.generate(REPETITIVE, SamplingParams(max_new_tokens=12, temperature=0.8, seed=1), batch_size=3)
    assert stats.drafted_steps == stats.decode_steps > 0


def test_the_planner_drafts_only_while_it_pays_and_learns_the_verify_costs():
    planner = TreePlanner(flat_costs(), 16, has_draft=True)
    assert planner.wants_draft(None, 1, 0)                        # its rate unknown yet
    planner.observe_step(1, True, 5, 0.01)                       # drafted steps delivered 500 tokens/s
    assert planner.wants_draft([[math.log(0.2)]], 1, 0)           # a weak proposal: the draft promises more
    assert not planner.wants_draft([[0.0] * 12], 1, 0)            # a sure long proposal: no draft this step
    assert not TreePlanner(flat_costs(), 16, has_draft=False).wants_draft(None, 1, 0)
    for _ in range(30):
        planner.observe_verify(1, 4, 0, 2 * flat_costs().verify_s(1, 4))
    assert planner.verify_s(1, 4, 0) == pytest.approx(2 * flat_costs().verify_s(1, 4), rel=0.05)


def test_a_planner_looks_for_proposals_rarely_while_nothing_is_speculated():
    """After IDLE_SKIP steps in a row that verified the root alone, the context is searched 1 step in IDLE_SKIP
    (per batch size); a step that speculates again ends the stretch."""
    planner = TreePlanner(flat_costs(), 16, has_draft=False)
    k = TreePlanner.IDLE_SKIP
    looks = []
    for _ in range(5 * k):
        looks.append(planner.wants_proposals(4))
        if looks[-1]:
            planner.observe_size(4, 1, False)                    # searched, but the root alone was verified
    assert all(looks[:k]) and 4 <= looks.count(True) - k <= 6
    assert planner.wants_proposals(1)                            # another batch size: its own count
    while not planner.wants_proposals(4):
        pass
    planner.observe_size(4, 5, False)                            # a step that speculated
    assert all(planner.wants_proposals(4) for _ in range(k))
    planner.observe_size(4, 1, True)                             # drafted, even if nothing was kept: not idle
    assert planner.idle[4] == 0


def cache_file(tmp_path):
    (file,) = (tmp_path / "step_costs").iterdir()
    return file


def warnings_of(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning:")]


def test_step_costs_are_measured_when_first_needed_once_per_machine(tmp_path, monkeypatch, capsys):
    """Batch 1 at once (with a progress bar saying what is measured), another batch size's rows (the BATCH_SIZES
    around it) the first time a step runs at it, each kept in the cache: `serve --tree auto` measured batch 1..32 for
    12 minutes, silently, before it listened."""
    from sglang_eagle3.engine import cost_model
    calls = fake_step_costs(monkeypatch, tmp_path)
    tm, _ = tiny_target("llama", vocab_size=64)
    costs = cost_model.load_or_measure_costs(tm, 32, 16)
    assert sorted(costs.verify) == [1] and sorted(costs.verify[1]) == [1, 2, 3, 4, 6, 8, 12, 16]
    assert "measuring step costs at batch 1" in capsys.readouterr().err
    costs.ensure(3)                                                       # interpolated between batch 2 and 4
    assert sorted(costs.verify) == [1, 2, 4] and costs.measure_s > 0
    assert costs.verify[2][4] == pytest.approx(linear_cost(2, 4, 128))
    n = len(calls)
    again = cost_model.load_or_measure_costs(tm, 32, 16)                  # cached: nothing measured
    again.ensure(4)
    assert len(calls) == n and again.verify == costs.verify and again.measure_s == 0
    cost_model.load_or_measure_costs(tm, 1, 24)                           # larger trees: batch 1 measured again
    assert len(calls) > n and max(cost_model.read_cached_costs(str(cache_file(tmp_path))).verify[1]) == 24
    cost_model.load_or_measure_costs(tm, 1, 16, refresh=True)
    (tmp_path / "step_costs").joinpath(cache_file(tmp_path).name).write_text("{torn")
    n = len(calls)
    cost_model.load_or_measure_costs(tm, 1, 16)
    assert len(calls) > n


def test_step_cost_measuring_keeps_to_its_time_budget(tmp_path, monkeypatch, capsys):
    """Rows the budget cannot afford are extrapolated from the measured ones, said once."""
    from sglang_eagle3.engine import cost_model
    fake_step_costs(monkeypatch, tmp_path)
    monkeypatch.setattr(cost_model, "MEASURE_BUDGET_S", 0.0, raising=False)
    tm, _ = tiny_target("llama", vocab_size=64)
    costs = cost_model.load_or_measure_costs(tm, 32, 16)                  # batch 1: always measured
    for batch in (8, 16, 32):
        costs.ensure(batch)
    assert sorted(costs.verify) == [1]
    (line,) = warnings_of(capsys.readouterr().err)
    assert "budget for measuring step costs is spent" in line and "extrapolated from the measured ones (1)" in line
    assert 0 < costs.verify_s(8, 4) < costs.verify_s(16, 4) < math.inf


def test_a_step_cost_row_that_falls_as_trees_grow_is_timed_again(tmp_path, monkeypatch, capsys):
    """A point timed while something else ran (batch 1, 8 tokens: 3.96 s, 16 tokens: 0.80 s) is timed again; a row
    that still falls is used with its running maximum, said once, and never cached."""
    from sglang_eagle3.engine import cost_model
    glitches = {"left": 4}                                                # one median's worth of slow calls

    def glitchy(batch, tokens, context):
        if (batch, tokens, context) == (1, 8, 128) and glitches["left"] > 0:
            glitches["left"] -= 1
            return 3.96
        return linear_cost(batch, tokens, context)
    fake_step_costs(monkeypatch, tmp_path, glitchy)
    tm, _ = tiny_target("llama", vocab_size=64)
    good = cost_model.load_or_measure_costs(tm, 1, 16)
    assert good.verify[1][8] == pytest.approx(linear_cost(1, 8, 128))
    assert cost_model.read_cached_costs(str(cache_file(tmp_path))).verify == good.verify
    assert not warnings_of(capsys.readouterr().err)
    glitches["left"] = 10 ** 9                                            # still there when timed again
    costs = cost_model.load_or_measure_costs(tm, 1, 16, refresh=True)
    (line,) = warnings_of(capsys.readouterr().err)
    assert "step costs at batch 1 fall as trees grow, also when timed again" in line and "running maximum" in line
    assert [costs.verify[1][t] for t in (8, 12, 16)] == [3.96, 3.96, 3.96]
    assert cost_model.read_cached_costs(str(cache_file(tmp_path))).verify == good.verify      # the good row stays


def test_a_step_cost_row_that_fails_to_measure_is_extrapolated(tmp_path, monkeypatch, capsys):
    """Measuring a row mid-serving (lazily) must not fail the step that asked for it, nor every later one: a forward
    that raises (out of memory beside the KV pool, say) leaves that row extrapolated, said once."""
    from sglang_eagle3.engine import cost_model

    def failing(batch, tokens, context):
        if batch == 4:
            raise RuntimeError("CUDA out of memory")
        return linear_cost(batch, tokens, context)
    fake_step_costs(monkeypatch, tmp_path, failing)
    tm, _ = tiny_target("llama", vocab_size=64)
    planner = TreePlanner(cost_model.load_or_measure_costs(tm, 8, 16), 16, has_draft=False)
    for _ in range(3):
        planner.prepare(4)
    (line,) = warnings_of(capsys.readouterr().err)
    assert "measuring step costs at batch 4 failed (CUDA out of memory): extrapolated" in line
    assert sorted(planner.costs.verify) == [1] and 0 < planner.verify_s(4, 2, 128) < math.inf


BAD_CACHES = {
    "all zero": ({"verify": {"1": {"1": 0.0, "16": 0.0}}, "per_context": {"1": 0.0}}, "verify[1][1] = 0.0 is not a "
                                                                                        "positive finite number"),
    "empty verify": ({"verify": {}, "per_context": {}}, "verify is empty"),
    "negative": ({"verify": {"1": {"1": -0.01, "16": 0.02}}, "per_context": {}}, "verify[1][1] = -0.01"),
    "NaN": ({"verify": {"1": {"1": float("nan"), "16": 0.02}}, "per_context": {}}, "verify[1][1] = nan"),
    "infinite": ({"verify": {"1": {"1": 0.01, "16": 0.02}}, "per_context": {"1": float("inf")}},
                 "per_context[1] = inf"),
    "falling": ({"verify": {"1": {"1": 0.01, "8": 3.96, "16": 0.8}}, "per_context": {}},
                "verify[1]: 16 tokens cost 0.8 s, less than 8 tokens' 3.96 s"),
    "a list": ([], "holds a JSON list, not a sglang_eagle3.step_costs/1 object"),
    "a bad key": ({"verify": {"one": {"1": 0.01}}, "per_context": {}}, "verify: key 'one' is not a positive integer"),
}


@pytest.mark.parametrize("case", list(BAD_CACHES))
def test_a_bad_step_cost_cache_is_measured_again_in_one_warning(tmp_path, monkeypatch, capsys, case):
    """Never trusted blindly: all-zero costs divided by zero in `generate` (and made the server answer 500), an empty
    verify table raised IndexError, a list AttributeError, negative / NaN / inf costs were used without a word."""
    import json

    from sglang_eagle3.engine import cost_model
    fake_step_costs(monkeypatch, tmp_path)
    tm, _ = tiny_target("llama", vocab_size=64)
    good = cost_model.load_or_measure_costs(tm, 1, 16)
    file = cache_file(tmp_path)
    contents, phrase = BAD_CACHES[case]
    if isinstance(contents, dict):
        contents = {"format": cost_model.COSTS_FORMAT, **contents, "max_batch": 64, "max_tree": 32}
    file.write_text(json.dumps(contents))
    capsys.readouterr()
    costs = cost_model.load_or_measure_costs(tm, 1, 16)
    (line,) = warnings_of(capsys.readouterr().err)
    assert line.startswith(f"warning: {file}: ") and phrase in line and "measuring the step costs again" in line
    assert costs.verify == good.verify and cost_model.read_cached_costs(str(file)).verify == good.verify


def test_generate_with_an_all_zero_step_cost_cache_measures_again(tmp_path, monkeypatch, capsys):
    """All-zero costs in the cache made `generate --tree auto` divide by zero."""
    import json

    from sglang_eagle3.engine import cost_model
    fake_step_costs(monkeypatch, tmp_path)
    tm, _ = tiny_target("llama", vocab_size=64)
    cost_model.load_or_measure_costs(tm, 1, 16)
    file = cache_file(tmp_path)
    zero = json.loads(file.read_text())
    zero["verify"] = {b: {t: 0.0 for t in row} for b, row in zero["verify"].items()}
    file.write_text(json.dumps(zero))
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    van, _ = SpeculativeEngine(tm, None, Settings()).generate(REPETITIVE[:1], params)
    eng = SpeculativeEngine(tm, random_draft(tm, seed=3),
                            Settings(tree=SpecConfig(2, 2, 4), drafting=Drafting("hybrid", "auto", max_nodes=8)))
    outs, _ = eng.generate(REPETITIVE[:1], params)
    assert outs[0].token_ids == van[0].token_ids
    (line,) = warnings_of(capsys.readouterr().err)
    assert f"{file}: verify[1][1] = 0.0 is not a positive finite number of seconds" in line


def test_an_unwritable_step_cost_cache_is_warned_about_once_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """The cache is optional: a directory where the file goes ([Errno 21]) or a read-only file system ([Errno 30])
    aborted the run after its measuring."""
    import errno

    from sglang_eagle3.engine import cost_model
    fake_step_costs(monkeypatch, tmp_path)
    tm, _ = tiny_target("llama", vocab_size=64)
    cost_model.load_or_measure_costs(tm, 1, 16)
    file = cache_file(tmp_path)
    file.unlink()
    file.mkdir()
    capsys.readouterr()
    costs = cost_model.load_or_measure_costs(tm, 4, 16)
    costs.ensure(4)
    (line,) = warnings_of(capsys.readouterr().err)
    assert line == f"warning: {file}: is a directory; the step costs measured now are not kept"
    assert sorted(costs.verify) == [1, 4] and file.is_dir()

    def read_only(path, obj):
        raise OSError(errno.EROFS, "Read-only file system", path)
    monkeypatch.setattr(cost_model, "write_json", read_only)
    file.rmdir()
    costs = cost_model.load_or_measure_costs(tm, 4, 16)
    costs.ensure(2)
    costs.ensure(4)
    (line,) = warnings_of(capsys.readouterr().err)
    assert line.startswith(f"warning: {file}: ") and "Read-only file system" in line and "not kept" in line
    assert sorted(costs.verify) == [1, 2, 4] and not file.exists()


def test_a_planner_that_stopped_drafting_measures_the_draft_again():
    """One bad stretch must not switch the draft off for good: after EXPLORE_EVERY undrafted steps it runs once, and
    a better rate it then measures turns drafting back on."""
    planner = TreePlanner(flat_costs(), 16, has_draft=True)
    planner.observe_step(1, True, 1, 1.0)                         # drafted steps delivered 1 token/s: hopeless
    sure = [[0.0] * 12]
    choices = [planner.wants_draft(sure, 1, 0) for _ in range(3 * TreePlanner.EXPLORE_EVERY)]
    assert choices.count(True) == 3 and choices[TreePlanner.EXPLORE_EVERY - 1]
    assert not any(choices[:TreePlanner.EXPLORE_EVERY - 1])
    for _ in range(20):                                           # the draft got good (new text, new prompt)
        planner.observe_step(1, True, 20, 0.01)
    assert planner.wants_draft([[math.log(0.2)]], 1, 0)
    planner.undrafted.clear()
    planner.observe_step(2, True, 1, 1.0)                         # per batch size: batch 2's count is its own
    assert [planner.wants_draft(sure, 2, 0) for _ in range(TreePlanner.EXPLORE_EVERY)].count(True) == 1


# ---- lossless in the engine ---------------------------------------------------------------------------------
REPETITIVE = ["3 4 5 6 7 3 4 5 6 7 3 4 5", "9 8 9 8 9 8 9", "11 12 13 14 15 16 17 18 19 20 11 12 13"]


@pytest.mark.parametrize("drafter,tree", [("suffix", "profile"), ("hybrid", "profile"), ("suffix", "auto"),
                                          ("hybrid", "auto")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_output_equals_vanilla_with_context_proposals(drafter, tree, dtype):
    tm, _ = tiny_target("llama", dtype=dtype, vocab_size=64, logit_scale=2.0)
    draft = random_draft(tm, seed=3)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    van, _ = SpeculativeEngine(tm, None, Settings()).generate(REPETITIVE, params, batch_size=1)
    eng = SpeculativeEngine(tm, draft, Settings(tree=SpecConfig(2, 2, 4), drafting=Drafting(drafter, tree, max_nodes=12)),
                            costs=flat_costs(per_token=0.0002))
    for bs in (1, 3):
        outs, stats = eng.generate(REPETITIVE, params, batch_size=bs)
        assert [o.token_ids for o in outs] == [o.token_ids for o in van], (drafter, tree, bs)
        assert stats.generated_tokens == sum(len(o.token_ids) for o in van)
    assert stats.context_tokens > 0                       # the loops were proposed by the context and accepted
    if drafter == "suffix":
        assert stats.drafted_steps == 0


def test_context_drafter_proposes_and_observes():
    d = ContextDrafter(max_tokens=3, max_branches=1, min_match=2, pool_tokens=0)
    d.start("r", [1, 2, 3, 1, 2])
    (chains,) = d.proposals(["r"], [True])
    assert chains[0][0] == [3, 1, 2] and len(chains[0][1]) == 3
    before2, before3 = d.calibration[True].chance(2), d.calibration[True].chance(3)
    # the tree held the chain's first two tokens; the target accepted one, then emitted 9
    d.observe(["r"], [True], [[3, 9]], [[2, 3, 1, 5]], [[-1, 0, 1, 0]])
    assert d.calibration[True].chance(2) > before2 and d.calibration[True].chance(3) < before3
    assert d.calibration[True].tries[3] > d.calibration[False].tries[3]                 # greedy and sampled apart
    d.finish("r")
    assert "r" not in d.streams


def test_what_was_learnt_carries_over_when_the_engine_grows_its_pools():
    tm, _ = tiny_target("llama", vocab_size=64)
    eng = SpeculativeEngine(tm, random_draft(tm, seed=3),
                            Settings(tree=SpecConfig(2, 2, 4), drafting=Drafting("hybrid", "auto", max_nodes=8)),
                            costs=flat_costs())
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    eng.generate(["3 4 5"], params)
    first = eng._scheduler
    context, planner = first.context, first.planner
    assert sum(context.calibration[True].tries.values()) > sum(MatchCalibration().tries.values())   # it observed
    eng.generate([" ".join(["3 4 5 6"] * 20)], params)                  # a longer prompt: larger pools
    assert eng._scheduler is not first
    assert eng._scheduler.context is context and eng._scheduler.planner is planner
