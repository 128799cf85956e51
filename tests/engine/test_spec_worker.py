"""The speculative step's phases (engine/spec_worker.py): the one place a tree is sized, the root-only tree of a step
with nothing proposed, the proposers' hooks after the verify and the record the planner observes."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import random_draft, tiny_target

from sglang_eagle3.engine.cost_model import StepCosts, TreePlanner
from sglang_eagle3.engine.proposers import StepBatch, VerifyOutput
from sglang_eagle3.engine.spec_worker import MAX_CONTEXT_NODES, Proposal, SpecWorker
from sglang_eagle3.engine.speculation import SpecConfig
from sglang_eagle3.engine.step_record import StepRecord, StepTimes
from sglang_eagle3.engine.suffix import ContextDrafter
from sglang_eagle3.engine.tree import Candidates, DraftTree, chain_candidates, merge_candidates, root_only_tree
from sglang_eagle3.engine.verify import SamplingParams

SPEC = SpecConfig(2, 2, 4)


def batch_of(worker: SpecWorker, rows: list[int], spec=SPEC, keys=()) -> StepBatch:
    return worker.batch(rows, [SamplingParams()] * len(rows), [None] * len(rows), spec, keys, 0)


def draft_candidates_of(B: int) -> Candidates:
    """6 candidates a row, the way the draft makes them: 2 children of the root, 2 of each (scores falling)."""
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15]]).expand(B, 6)
    scores = torch.tensor([[-0.1, -0.5, -0.3, -0.9, -0.7, -1.2]]).expand(B, 6)
    parents = torch.tensor([[-1, -1, 0, 0, 1, 1]]).expand(B, 6)
    return Candidates(tokens, scores, parents, torch.zeros(B, 6, dtype=torch.bool))


def context_chain(n: int) -> tuple[list[int], list[float]]:
    return [40 + j for j in range(n)], [math.log(0.9) * (j + 1) for j in range(n)]


@pytest.fixture(scope="module")
def worker():
    tm, _ = tiny_target("llama", vocab_size=64)
    return SpecWorker(tm, random_draft(tm), num_rows=2, max_len=64, draft_tree_slots=SPEC.num_steps * SPEC.topk)


def test_the_fixed_tree_is_the_drafts_nodes_plus_the_contexts_up_to_a_cap(worker):
    """Without a planner: spec.num_draft_tokens where the draft ran, plus the nodes the context alone proposed (at most
    MAX_CONTEXT_NODES), never more than the row's own candidates; 1 where nothing was proposed."""
    batch = batch_of(worker, [0, 1])
    draft = draft_candidates_of(2)
    n = SPEC.num_draft_tokens
    assert worker.row_sizes(batch, Proposal(draft, drafted=True), None) == [n, n]
    hybrid = merge_candidates(draft, chain_candidates([[context_chain(3)], [context_chain(1)]], "cpu"))
    assert worker.row_sizes(batch, Proposal(hybrid, drafted=True, with_context=True), None) == [n + 3] * 2
    alone = chain_candidates([[context_chain(MAX_CONTEXT_NODES + 4)], [context_chain(MAX_CONTEXT_NODES + 2)]], "cpu")
    assert worker.row_sizes(batch, Proposal(alone, with_context=True), None) == [1 + MAX_CONTEXT_NODES] * 2
    short = chain_candidates([[context_chain(5)], [context_chain(2)]], "cpu")
    assert worker.row_sizes(batch, Proposal(short, with_context=True), None) == [6, 3]    # each row's own, + root
    assert worker.row_sizes(batch, Proposal(None), None) == [1, 1]


def test_a_hybrid_plan_marks_the_nodes_the_context_alone_proposed(worker):
    batch = batch_of(worker, [0])
    hybrid = merge_candidates(draft_candidates_of(1), chain_candidates([[([10, 99], [-0.05, -0.2])]], "cpu"))
    plan = worker.plan(batch, Proposal(hybrid, drafted=True, with_context=True), None)
    assert plan.drafted and plan.tree.num_nodes == SPEC.num_draft_tokens + 1
    tokens = plan.tree.tokens[0].tolist()
    assert 10 in tokens and 99 in tokens                    # 10: the draft's (its score raised), 99: the context's
    assert plan.from_context[0].tolist() == [t == 99 for t in tokens]


def test_nothing_proposed_is_the_root_alone(worker):
    """The one root-only exit: no candidates (a proposer with nothing to propose), or a planner that sizes the tree
    to 1."""
    batch = batch_of(worker, [0, 1])
    plan = worker.plan(batch, Proposal(None), None)
    want = root_only_tree(batch.roots, batch.root_pos)
    assert not plan.drafted and plan.from_context is None
    assert all(torch.equal(getattr(plan.tree, f), getattr(want, f)) for f in ("tokens", "parents", "mask", "positions"))
    dear = TreePlanner(StepCosts({1: {1: 0.01, 32: 10.0}, 2: {1: 0.02, 32: 20.0}}, {1: 0.0}), 16, has_draft=True)
    plan = worker.plan(batch, Proposal(draft_candidates_of(2), drafted=True, draft_s=0.001), dear)
    assert plan.tree.num_nodes == 1 and plan.drafted


def test_a_context_with_no_match_gives_one_token_per_step():
    """suffix drafting (no draft model) on a prompt that never repeats: the context proposes nothing, every step
    verifies the root alone and emits one token."""
    tm, _ = tiny_target("llama", vocab_size=64)
    worker = SpecWorker(tm, None, num_rows=1, max_len=64)
    context = ContextDrafter(max_tokens=8, max_branches=2, min_match=8, pool_tokens=0)
    prompt = [5, 9, 3, 7, 2]
    context.start("r", prompt)
    worker.prefill(0, prompt, SamplingParams())
    for _ in range(3):
        res = worker.step([0], [SamplingParams()], [None], None, ["r"], len(prompt), context)
        assert res.nodes == 1 and [len(e) for e in res.emitted] == [1] and res.from_context == [[]]
        assert not res.drafted
        context.append("r", res.emitted[0])


def verified_of(tokens: list[int], parents: list[int], emitted: list[int]) -> VerifyOutput:
    """A verify of one row's tree (its tokens and parents: what the context reads) that emitted `emitted`."""
    t, n = torch.tensor([tokens]), len(tokens)
    tree = DraftTree(t, torch.tensor([parents]), torch.zeros_like(t), torch.ones(1, n, n, dtype=torch.bool),
                     torch.zeros_like(t))
    return VerifyOutput(tree, None, None, [len(emitted)], [emitted], None, [None])


def test_the_context_learns_only_from_a_step_it_proposed_for(worker):
    d = ContextDrafter(max_tokens=3, max_branches=1, min_match=2, pool_tokens=0)
    d.start("r", [1, 2, 3, 1, 2])
    batch = batch_of(worker, [0], keys=["r"])
    cands = d.propose(batch)
    assert cands.tokens.tolist() == [[3, 1, 2]] and cands.parents.tolist() == [[-1, 0, 1]]
    before = dict(d.calibration[True].tries)
    verified = verified_of([2, 3, 1, 5], [-1, 0, 1, 0], [3, 9])     # the chain's first two in the tree, one accepted
    d.commit(batch, verified)
    after = dict(d.calibration[True].tries)
    assert after != before
    d.commit(batch, verified)                                          # no lookup since: nothing to learn
    assert d.calibration[True].tries == after


def test_the_planner_observes_a_steps_record_as_its_three_observations():
    costs = StepCosts({1: {1: 0.01, 32: 0.05}}, {1: 0.0})
    a, b = TreePlanner(costs, 16, has_draft=True), TreePlanner(costs, 16, has_draft=True)
    for drafted, nodes, forward_s in ((True, 4, 0.02), (False, 1, None), (True, 6, 0.03)):
        a.observe(StepRecord(1, nodes, drafted, 200, 3, StepTimes(draft=0.004, verify=0.021), forward_s))
        b.observe_size(1, nodes, drafted)
        if forward_s is not None:
            b.observe_verify(1, nodes, 200, forward_s)
        b.observe_step(1, drafted, 3, 0.004 + 0.021)
    assert (a.idle, a.verify_factor, a.draft_rate, a.undrafted) == (b.idle, b.verify_factor, b.draft_rate, b.undrafted)
    assert a.verify_factor and a.draft_rate


def test_the_planner_calibrates_sampled_trees_by_what_their_verifies_accept():
    """Sampled steps whose verifies accept twice what their nodes' chances promised raise the chances of later sampled
    trees (a larger tree pays), within CHANCE_SCALE; greedy steps read the chances as they are and teach nothing."""
    costs = StepCosts({1: {n: 0.01 + 0.0005 * n * n for n in range(1, 17)}}, {1: 0.0})    # best: 3 nodes, 4 at 2x
    planner = TreePlanner(costs, 16, has_draft=True)
    scores = [[math.log(0.3)] * 15]
    n_before = planner.size(scores, 1, 200, sampled=True)[0][0]
    assert planner.expected == pytest.approx(0.3 * (n_before - 1))
    planner.size(scores, 1, 200)                                       # greedy: nothing to calibrate
    assert planner.expected is None
    for _ in range(40):
        planner.size(scores, 1, 200, sampled=True)
        expected = planner.expected
        planner.observe(StepRecord(1, n_before, True, 200, 1 + round(2 * expected), StepTimes(0.001, 0.02), None))
    assert 1.7 < planner.chance_scale < 2.4                           # 2, up to rounding the tokens
    assert planner.size(scores, 1, 200, sampled=True)[0][0] > n_before
    assert planner.size(scores, 1, 200)[0][0] == n_before                 # greedy trees keep their size
    for _ in range(40):                                                # verifies that accept nothing
        n = planner.size(scores, 1, 200, sampled=True)[0][0]
        planner.observe(StepRecord(1, n, True, 200, 1, StepTimes(0.001, 0.02), None))
    assert planner.size(scores, 1, 200, sampled=True)[0][0] == 1 and planner.chance_scale < 0.9
    owed = 0.0
    for _ in range(300):                        # root-only steps: the scale drifts back; then 0.3 per node again
        n = planner.size(scores, 1, 200, sampled=True)[0][0]
        owed += 0.3 * (n - 1)
        accepted, owed = int(owed), owed - int(owed)
        planner.observe(StepRecord(1, n, True, 200, 1 + accepted, StepTimes(0.001, 0.02), None))
    assert planner.size(scores, 1, 200, sampled=True)[0][0] == n_before and 0.8 < planner.chance_scale < 1.2
