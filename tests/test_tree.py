"""Property tests of the dynamic draft tree."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import random_draft, tiny_target
from sglang_eagle3.config import SpecConfig
from sglang_eagle3.kvcache import KVPool
from sglang_eagle3.tree import build_draft_tree, grow_tree


def check_tree(tree, root_positions, budget):
    B, N = tree.tokens.shape
    assert N == budget
    for b in range(B):
        par = tree.parents[b].tolist()
        assert par[0] == -1 and all(0 <= p < i for i, p in enumerate(par) if i)
        for i in range(N):
            anc, j = {i}, par[i]
            while j >= 0:
                anc.add(j)
                j = par[j]
            assert set(torch.nonzero(tree.mask[b, i]).flatten().tolist()) == anc   # ancestors + self, exactly
            assert int(tree.depth[b, i]) == len(anc) - 1
            assert int(tree.positions[b, i]) == int(root_positions[b]) + len(anc) - 1
        leaves = {i for i in range(N) if i not in par}
        seen = set()
        for path in tree.paths[b].tolist():
            nodes = [x for x in path if x >= 0]
            if not nodes:
                continue
            assert nodes[0] == 0 and nodes[-1] in leaves and path[len(nodes):] == [-1] * (len(path) - len(nodes))
            assert all(par[nodes[k + 1]] == nodes[k] for k in range(len(nodes) - 1))
            seen.add(nodes[-1])
        assert seen == leaves


@st.composite
def candidates(draw):
    B = draw(st.integers(1, 3))
    C = draw(st.integers(1, 30))
    parents, scores, tokens = [], [], []
    for b in range(B):
        par, sc = [], []
        for i in range(C):
            p = draw(st.integers(-1, i - 1))
            lp = draw(st.sampled_from([0.0, -0.1, -0.5, -1.0, -2.0, -3.0]))   # ties included
            par.append(p)
            sc.append((sc[p] if p >= 0 else 0.0) + lp)
        parents.append(par)
        scores.append(sc)
        tokens.append(draw(st.lists(st.integers(0, 99), min_size=C, max_size=C)))
    budget = draw(st.integers(1, C + 1))
    return torch.tensor(tokens), torch.tensor(scores), torch.tensor(parents), budget


@settings(max_examples=150, deadline=None)
@given(candidates(), st.integers(0, 50))
def test_selected_tree_properties(cands, root_pos):
    tokens, scores, parents, budget = cands
    B = tokens.shape[0]
    roots, rpos = torch.full((B,), 7), torch.full((B,), root_pos)
    tree = build_draft_tree(tokens, scores, parents, roots, rpos, budget)
    check_tree(tree, rpos, budget)
    # the kept candidates are the best ones: nothing dropped scores higher than something kept
    for b in range(B):
        if budget > 1:
            kept_scores = sorted(scores[b].tolist(), reverse=True)[:budget - 1]
            assert min(kept_scores) >= sorted(scores[b].tolist(), reverse=True)[budget - 2]


@settings(max_examples=12, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(2, 24), st.integers(1, 3))
def test_grow_tree_with_a_draft(num_steps, topk, budget, B):
    budget = min(budget, 1 + topk + (num_steps - 1) * topk * topk)
    spec = SpecConfig(num_steps, topk, budget)
    tm, _ = tiny_target("llama")
    draft = random_draft(tm, draft_vocab_size=48)
    draft.set_embedding(tm.embed_tokens)
    cache = KVPool(1, B, draft.config.num_key_value_heads, 64, draft.config.head_dim, torch.float32, "cpu")
    cache.lens[:] = torch.arange(B) + 5
    hidden = torch.randn(B, draft.config.hidden_size)
    tree = grow_tree(draft, cache, torch.arange(B), hidden, draft.compute_logits(hidden), torch.arange(B),
                     cache.lens.clone(), spec)
    check_tree(tree, cache.lens, spec.num_draft_tokens)
    assert int(tree.depth.max()) <= num_steps
    assert bool(draft.t2d[tree.tokens[:, 1:]].all())         # drafted tokens come from the draft vocab
    for b in range(B):                                      # siblings are distinct tokens (needed for lossless sampling)
        par = tree.parents[b].tolist()
        for p in set(par):
            kids = [tree.tokens[b, i].item() for i in range(len(par)) if par[i] == p and i]
            assert len(kids) == len(set(kids))
    assert torch.equal(cache.lens, torch.arange(B) + 5)     # drafting never commits draft KV


def test_topk1_is_a_chain_of_num_steps_plus_one():
    spec = SpecConfig(num_steps=5, topk=1, num_draft_tokens=99)
    assert spec.num_draft_tokens == 6
    tm, _ = tiny_target("llama")
    draft = random_draft(tm)
    draft.set_embedding(tm.embed_tokens)
    cache = KVPool(1, 1, draft.config.num_key_value_heads, 64, draft.config.head_dim, torch.float32, "cpu")
    cache.lens[:] = 3
    h = torch.randn(1, draft.config.hidden_size)
    tree = grow_tree(draft, cache, torch.arange(1), h, draft.compute_logits(h), torch.tensor([1]), torch.tensor([3]), spec)
    assert tree.parents[0].tolist() == [-1, 0, 1, 2, 3, 4]
    assert tree.positions[0].tolist() == [3, 4, 5, 6, 7, 8]
