"""Property tests of the dynamic draft tree."""
import torch
from conftest import random_draft, tiny_target
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_eagle3.engine.speculation import SpecConfig
from sglang_eagle3.engine.tree import build_draft_tree, draft_candidates
from sglang_eagle3.models.kvcache import KVPool


def drafted_tree(draft, pool, rows, first_hidden, root_tokens, root_positions, spec, prune=True):
    """The engine's path for a draft-only step of the fixed tree: the draft's candidates (DraftProposer.propose),
    then the best spec.num_draft_tokens - 1 of them (SpecWorker.plan)."""
    c = draft_candidates(draft, pool, rows, first_hidden, draft.compute_logits(first_hidden), root_tokens,
                         root_positions, spec, prune)
    return build_draft_tree(c.tokens, c.scores, c.parents, root_tokens, root_positions, spec.num_draft_tokens)


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
def test_drafted_tree_with_a_draft(num_steps, topk, budget, B):
    budget = min(budget, 1 + topk + (num_steps - 1) * topk * topk)
    spec = SpecConfig(num_steps, topk, budget)
    tm, _ = tiny_target("llama")
    draft = random_draft(tm, draft_vocab_size=48)
    draft.set_embedding(tm.embed_tokens)
    cache = KVPool(1, B, draft.config.num_key_value_heads, 64, draft.config.head_dim, torch.float32, "cpu")
    cache.lens[:] = torch.arange(B) + 5
    hidden = torch.randn(B, draft.config.hidden_size)
    tree = drafted_tree(draft, cache, torch.arange(B), hidden, torch.arange(B), cache.lens.clone(), spec)
    check_tree(tree, cache.lens, spec.num_draft_tokens)
    assert int(tree.depth.max()) <= num_steps
    assert bool(draft.t2d[tree.tokens[:, 1:]].all())         # drafted tokens come from the draft vocab
    for b in range(B):                                      # siblings are distinct tokens (needed for lossless sampling)
        par = tree.parents[b].tolist()
        for p in set(par):
            kids = [tree.tokens[b, i].item() for i in range(len(par)) if par[i] == p and i]
            assert len(kids) == len(set(kids))
    assert torch.equal(cache.lens, torch.arange(B) + 5)     # drafting never commits draft KV


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 5), st.integers(1, 4), st.integers(2, 12), st.integers(1, 3), st.floats(0.0, 4.0),
       st.integers(0, 99))
def test_skipped_levels_leave_the_tree_unchanged(num_steps, topk, budget, B, sharpness, seed):
    """Drafting skips a level's draft forward once no node below the frontier can enter the tree: the tree
    (tokens, parents, mask, positions) is exactly the one every level's forward gives."""
    budget = min(budget, 1 + topk + (num_steps - 1) * topk * topk)
    spec = SpecConfig(num_steps, topk, budget)
    tm, _ = tiny_target("llama")
    torch.manual_seed(seed)
    draft = random_draft(tm, draft_vocab_size=48)
    with torch.no_grad():
        draft.lm_head.weight.mul_(sharpness)                 # flat (0) to peaked draft distributions
    draft.set_embedding(tm.embed_tokens)
    hidden = torch.randn(B, draft.config.hidden_size)
    trees, forwards = [], []
    for prune in (False, True):
        cache = KVPool(1, B, draft.config.num_key_value_heads, 64, draft.config.head_dim, torch.float32, "cpu")
        cache.lens[:] = torch.arange(B) + 5
        calls = []
        forward = draft.forward
        draft.forward = lambda *a, **kw: calls.append(1) or forward(*a, **kw)
        try:
            trees.append(drafted_tree(draft, cache, torch.arange(B), hidden, torch.arange(B), cache.lens.clone(), spec,
                                      prune=prune))
        finally:
            del draft.forward
        forwards.append(len(calls))
    full, pruned = trees
    assert forwards[0] == num_steps - 1 and forwards[1] <= forwards[0]
    for name in ("tokens", "parents", "depth", "mask", "positions"):
        assert torch.equal(getattr(full, name), getattr(pruned, name)), name
    SKIPPED.append(forwards[0] - forwards[1])


SKIPPED: list[int] = []


def test_skipped_levels_do_skip():
    """The comparison above saw levels skipped (else it compared a tree with itself); levels_needed on hand-made
    scores."""
    if not SKIPPED:
        test_skipped_levels_leave_the_tree_unchanged()
    assert sum(SKIPPED) > 0, SKIPPED
    from sglang_eagle3.engine.tree import levels_needed
    assert levels_needed([torch.tensor([[-0.1]]), torch.tensor([[-0.2]])], torch.tensor([[-0.2]]), 4)
    # 3 candidates at least as good as the best frontier node (score -1.0; an equal earlier score wins the tie)
    scores = [torch.tensor([[-0.5, -1.0]]), torch.tensor([[-0.7, -1.5, -3.0, -4.0]])]
    assert not levels_needed(scores, torch.tensor([[-1.0, -3.0]]), 4)
    assert levels_needed(scores, torch.tensor([[-1.0, -3.0]]), 5)
    assert levels_needed(scores + [torch.tensor([[-9.0]])], torch.tensor([[-0.6, -3.0]]), 4)   # a better frontier
    # two rows: drafting goes on while one of them still needs it
    assert levels_needed([torch.cat([s, s]) for s in scores], torch.tensor([[-1.0, -3.0], [-0.6, -3.0]]), 4)


def test_topk1_is_a_chain_of_num_steps_plus_one():
    spec = SpecConfig(num_steps=5, topk=1, num_draft_tokens=99)
    assert spec.num_draft_tokens == 6
    tm, _ = tiny_target("llama")
    draft = random_draft(tm)
    draft.set_embedding(tm.embed_tokens)
    cache = KVPool(1, 1, draft.config.num_key_value_heads, 64, draft.config.head_dim, torch.float32, "cpu")
    cache.lens[:] = 3
    h = torch.randn(1, draft.config.hidden_size)
    tree = drafted_tree(draft, cache, torch.arange(1), h, torch.tensor([1]), torch.tensor([3]), spec)
    assert tree.parents[0].tolist() == [-1, 0, 1, 2, 3, 4]
    assert tree.positions[0].tolist() == [3, 4, 5, 6, 7, 8]


def test_fused_draft_layer_equals_the_layer_by_layer_path(monkeypatch):
    """bf16 draft steps over the pool through csrc's draft_layer (one call per step) give exactly the hidden
    states, KV entries and trees of the layer-by-layer path: the same kernels in the same order."""
    import pytest

    from sglang_eagle3.engine.tree import pool_attend
    from sglang_eagle3.models.draft import Eagle3DecoderLayer
    from sglang_eagle3.models.kvcache import tree_new_mask
    tm, _ = tiny_target("llama", dtype=torch.bfloat16)
    draft = random_draft(tm, draft_vocab_size=48)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" in name:                                   # not all ones: each norm's weight must be its own
                p.uniform_(0.5, 1.5)
    draft = draft.to(torch.bfloat16)
    draft.set_embedding(tm.embed_tokens)
    draft.prepare_inference()
    a = draft.midlayer.self_attn
    if a.fused[0].small is None:
        pytest.skip("csrc's bf16 few-row kernels are not available on this CPU")
    B, T, F_ = 2, 3, 3
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(B, T, F_)   # a small tree
    torch.manual_seed(3)
    ids = torch.randint(0, tm.vocab_size, (B, T))
    hidden = torch.randn(B, T, draft.config.hidden_size).to(torch.bfloat16)
    first = torch.randn(B, draft.config.hidden_size).to(torch.bfloat16)
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(Eagle3DecoderLayer, "_fused_layer", lambda self, *args: None)
        cache = KVPool(1, B, draft.config.num_key_value_heads, 64, draft.config.head_dim, torch.bfloat16, "cpu")
        cache.lens[:] = torch.tensor([4, 6])
        g = torch.Generator().manual_seed(4)
        cache.k.copy_(torch.randn(cache.k.shape, generator=g)), cache.v.copy_(torch.randn(cache.v.shape, generator=g))
        rows = torch.arange(B)
        positions = cache.lens.view(B, 1) + torch.tensor([0, 1, 1])
        attend = pool_attend(cache, rows, cache.lens.clone(), tree_new_mask(B, T, "cpu", mask).contiguous(),
                             draft.config.head_dim ** -0.5)
        out = draft(ids, hidden, positions, attend=attend, fuse=False)
        tree = drafted_tree(draft, cache, rows, first, ids[:, 0], cache.lens.clone(), SpecConfig(3, 2, 6))
        results.append((out, cache.k.clone(), cache.v.clone(), tree.tokens, tree.parents))
    for i, (got, want) in enumerate(zip(*results)):
        assert torch.equal(got, want), (i, (got.float() - want.float()).abs().max())


@settings(max_examples=150, deadline=None)
@given(candidates(), st.integers(0, 50))
def test_cpu_tree_selection_equals_the_tensor_ops(cands, root_pos):
    """build_draft_tree's one-call CPU selection (csrc/tree_ops.cpp) lays out exactly the tree of the tensor
    ops (kernels' build_tree_ref, what other devices run), ties in the scores included."""
    from sglang_eagle3.engine.tree import DraftTree
    from sglang_eagle3.kernels import decode as kernels
    from sglang_eagle3.kernels import extension
    if extension.load() is None:
        return
    tokens, scores, parents, budget = cands
    B = tokens.shape[0]
    roots, rpos = torch.arange(B) + 3, torch.full((B,), root_pos)
    got = build_draft_tree(tokens, scores, parents, roots, rpos, budget)
    ref = DraftTree(*kernels.build_tree_ref(tokens, scores, parents, roots, rpos, budget))
    for name in ("tokens", "parents", "depth", "mask", "positions"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name


@settings(max_examples=100, deadline=None)
@given(candidates(), st.integers(0, 50), st.data())
def test_a_ragged_tree_is_each_rows_own_tree_then_padding(cands, root_pos, data):
    """row_nodes: row b's nodes are those of a tree of row_nodes[b] nodes (the same tokens, parents, depths, mask and
    positions), then padding that no walk reaches (parent -1, the root's token and position, seeing only itself);
    the CPU call and the tensor ops agree; the greedy walks (csrc's and the tensor one) never accept padding, even
    where its token is the target's pick at the root."""
    from sglang_eagle3.engine.tree import DraftTree, chosen_candidates
    from sglang_eagle3.kernels import decode as kernels
    tokens, scores, parents, budget = cands
    B, C = tokens.shape
    N = min(budget - 1, C) + 1
    sizes = data.draw(st.lists(st.integers(1, N), min_size=B, max_size=B))
    roots, rpos = torch.arange(B) + 3, torch.full((B,), root_pos)
    got = build_draft_tree(tokens, scores, parents, roots, rpos, N, sizes)
    ref = DraftTree(*kernels.build_tree_ref(tokens, scores, parents, roots, rpos, N, torch.tensor(sizes)))
    for name in ("tokens", "parents", "depth", "mask", "positions"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    chosen = chosen_candidates(type("C", (), {"scores": scores})(), N, torch.tensor(sizes))
    for b, n in enumerate(sizes):
        own = build_draft_tree(tokens[b:b + 1], scores[b:b + 1], parents[b:b + 1], roots[b:b + 1], rpos[b:b + 1], n)
        for name in ("tokens", "parents", "depth", "positions"):
            assert torch.equal(getattr(got, name)[b, :n], getattr(own, name)[0]), (b, name)
        assert torch.equal(got.mask[b, :n, :n], own.mask[0]) and not got.mask[b, :n, n:].any()
        assert got.parents[b, n:].eq(-1).all() and got.tokens[b, n:].eq(roots[b]).all()
        assert torch.equal(got.mask[b, n:, n:], torch.eye(N - n, dtype=torch.bool))
        assert chosen[b, n - 1:].eq(-1).all() and chosen[b, :n - 1].ge(0).all()
        mine = [x for x in got.paths[b].tolist() if max(x) >= 0]           # root-to-leaf paths: the row's own
        theirs = [x[:got.paths.shape[2]] for x in own.paths[0].tolist() if max(x) >= 0]
        assert sorted(mine) == sorted(x + [-1] * (got.paths.shape[2] - len(x)) for x in theirs), b
    logits = torch.zeros(B, N, 64)
    logits[torch.arange(B), 0, roots] = 1.0                  # the target picks the root's own token: padding's
    for walk in (kernels.accept_greedy, lambda t, p, m, z: kernels.accept_greedy_ref(t, p, m, z.argmax(-1))):
        path, count, emitted = walk(got.tokens, got.parents, got.mask, logits)
        for b, n in enumerate(sizes):
            assert path[b, :int(count[b])].lt(n).all()


def test_topk_logprobs_equals_log_softmax_topk():
    """The per-level top-k of the draft's log-probabilities in one pass: the indices of log_softmax + topk, the
    values to fp32 rounding; on ties the smaller index first."""
    from sglang_eagle3.kernels import decode as kernels
    from sglang_eagle3.kernels import extension
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for shape, k in (((3, 2, 8192), 2), ((5, 1000), 4), ((1, 17), 3), ((2, 3, 31), 1)):
            x = (torch.randn(*shape, generator=g) * 4).to(dtype)
            vals, ids = kernels.topk_logprobs(x, k)
            rv, ri = kernels.topk_logprobs_ref(x, k)
            assert vals.dtype == torch.float32 and ids.dtype == torch.long and vals.shape == rv.shape
            torch.testing.assert_close(vals, rv, rtol=0, atol=1e-5)
            assert torch.equal(torch.gather(x.float(), -1, ids), torch.gather(x.float(), -1, ri))
            if dtype == torch.float32:
                assert torch.equal(ids, ri)         # no ties in random fp32 values
    x = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0]])
    vals, ids = kernels.topk_logprobs(x, 3)
    if extension.load() is not None:
        assert ids.tolist() == [[1, 3, 4]]
    torch.testing.assert_close(vals, torch.log_softmax(x, -1)[:, [1, 3, 4]])
