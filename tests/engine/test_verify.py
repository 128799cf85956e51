"""Verification: greedy walk, and sampling that keeps the target's distribution exactly."""
import math

import pytest
import torch
from conftest import force_ragged_trees, random_draft, tiny_target

from sglang_eagle3.engine import spec_worker as engine_mod
from sglang_eagle3.engine.engine import SpeculativeEngine
from sglang_eagle3.engine.sampled_tree import DraftSampler
from sglang_eagle3.engine.sampled_tree import _try_sampled as exact_try_sampled
from sglang_eagle3.engine.settings import Settings
from sglang_eagle3.engine.speculation import SpecConfig
from sglang_eagle3.engine.verify import SamplingParams, target_probs, verify_greedy, verify_sampling
from sglang_eagle3.kernels import decode as decode_kernels
from sglang_eagle3.kernels import extension


def test_greedy_walk_takes_longest_matching_path_and_bonus():
    #        0
    #      /   \
    #     1(a)  2(b)
    #    /  \     \
    #  3(c) 4(d)   5(e)
    tokens, parents = [9, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 2]
    argmax = [2, 0, 5, 0, 0, 8]        # target wants b after root, then e, then 8
    assert verify_greedy(tokens, parents, argmax) == ([0, 2, 5], 8)
    assert verify_greedy(tokens, parents, [7, 0, 0, 0, 0, 0]) == ([0], 7)


def test_target_probs_top_k_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert p[0, 2:].sum() == 0 and p[0].sum().item() == pytest.approx(1.0)
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.6))
    assert (p[0] > 0).tolist() == [True, False, False, False]
    full = torch.softmax(logits, -1)
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.9))
    assert p[0, 3] == 0 and p[0, :3].sum().item() == pytest.approx(1.0)
    assert p[0, 0].item() == pytest.approx((full[0, 0] / full[0, :3].sum()).item(), rel=1e-5)


@pytest.mark.parametrize("scale,top_p", [(8.0, 0.95), (3.0, 0.95),     # nucleus within the first 256 tokens,
                                         (1.2, 0.5), (1.5, 0.5),       # within the first 2,048,
                                         (2.0, 0.95), (0.3, 0.5)])     # neither: the full sort
def test_top_p_from_a_partial_top_k_equals_the_full_sort(scale, top_p):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 20000, generator=g) * scale          # fp32, no ties
    params = SamplingParams(temperature=0.7, top_p=top_p)
    probs = torch.softmax(logits / 0.7, -1)
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    cum = sorted_p.cumsum(-1)
    want = torch.zeros_like(probs).scatter_(-1, idx, sorted_p.masked_fill(cum - sorted_p >= top_p, 0.0))
    want = want / want.sum(-1, keepdim=True)
    got = target_probs(logits, params)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def biased_verify_sampling(tokens, parents, probs, generator=None):
    """A common bug: rejected children are not removed from the residual before the bonus draw."""
    kids = [[i for i, p in enumerate(parents) if p == n] for n in range(len(parents))]
    node, accepted = 0, [0]
    while True:
        for c in kids[node]:
            if torch.rand((), generator=generator) < probs[node][tokens[c]]:
                accepted.append(c)
                node = c
                break
        else:
            return accepted, int(torch.multinomial(probs[node], 1, generator=generator))


def tv(counts, p):
    emp = counts / counts.sum()
    return 0.5 * (emp - p).abs().sum().item()


def ext_verify_sampling(tokens, parents, probs, generator=None):
    """csrc's accept_sampling on logits whose softmax is probs (log 0 = -inf)."""
    from sglang_eagle3.engine.verify import accept_sampling_row
    return accept_sampling_row(torch.tensor(tokens), torch.tensor(parents), probs.log(), SamplingParams(temperature=1.0),
                               generator)


def needs_ext(verify):
    if verify is ext_verify_sampling and extension.load() is None:
        pytest.skip("the C++ extension is not built here")


@pytest.mark.parametrize("verify,ok", [(verify_sampling, True), (ext_verify_sampling, True),
                                       (biased_verify_sampling, False)])
def test_sampling_walk_preserves_distribution(verify, ok):
    """First emitted token over 20k trials vs p at the root (TV tolerance 0.02; sampling noise is ~0.007)."""
    needs_ext(verify)
    g = torch.Generator().manual_seed(0)
    V = 6
    p_root = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05, 0.0])
    probs = torch.stack([p_root] + [torch.softmax(torch.randn(V, generator=g), -1) for _ in range(3)])
    tokens, parents = [0, 0, 1, 4], [-1, 0, 0, 0]          # root's children draft tokens 0, 1 and 4
    counts = torch.zeros(V)
    for _ in range(20000):
        acc, bonus = verify(tokens, parents, probs, g)
        counts[tokens[acc[1]] if len(acc) > 1 else bonus] += 1
    assert (tv(counts, p_root) < 0.02) == ok


@pytest.mark.parametrize("verify", [verify_sampling, ext_verify_sampling])
def test_sampling_walk_continues_with_the_accepted_childs_distribution(verify):
    """Two levels: given that the root's child c was accepted, the next token follows p at c (drafted grandchildren
    or the bonus), and the first token follows p at the root (chi-square p > 1e-4 over 20k trials, which a walk
    that forgot the rejected children fails)."""
    needs_ext(verify)
    g = torch.Generator().manual_seed(1)
    V = 8
    probs = torch.stack([torch.softmax(torch.randn(V, generator=g) * 1.5, -1) for _ in range(6)])
    tokens, parents = [0, 2, 5, 1, 3, 6], [-1, 0, 0, 1, 1, 2]     # root -> (2, 5); node 1 -> (1, 3); node 2 -> (6)
    first, second = torch.zeros(V), {1: torch.zeros(V), 2: torch.zeros(V)}
    for _ in range(20000):
        acc, bonus = verify(tokens, parents, probs, g)
        emitted = [tokens[i] for i in acc[1:]] + [bonus]
        first[emitted[0]] += 1
        if len(acc) > 1:
            second[acc[1]][emitted[1]] += 1
    assert chi2_pvalue(first, probs[0]) > 1e-4
    for node, counts in second.items():
        assert counts.sum() > 1000 and chi2_pvalue(counts, probs[node]) > 1e-4, node


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_p=0.7), SamplingParams(temperature=1.0, top_k=5),
                                    SamplingParams(temperature=0.9, top_k=8, top_p=0.8),
                                    SamplingParams(temperature=0.6, top_p=0.999)], ids=str)
def test_extension_draws_what_target_probs_says(params):
    """csrc's top-k / top-p cut (a histogram of the values, no sort) against target_probs: 20k draws of one token,
    nothing outside the kept set, chi-square p > 1e-4."""
    if extension.load() is None:
        pytest.skip("the C++ extension is not built here")
    from sglang_eagle3.engine.verify import sample_token
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(40, generator=g) * 2.5
    p = target_probs(logits, params)
    counts = torch.zeros(40)
    for _ in range(20000):
        counts[sample_token(logits, params, g)] += 1
    assert counts[p == 0].sum() == 0 and (p > 0).sum() < 40
    assert chi2_pvalue(counts, p) > 1e-4


def exact_marginals(hf, prompt, steps, params):
    """Exact distribution of each of the first `steps` tokens under the target (enumerating prefixes)."""
    V = hf.config.vocab_size
    seqs, weights = torch.tensor([prompt]), torch.ones(1)
    marginals = []
    for _ in range(steps):
        with torch.no_grad():
            probs = target_probs(hf(seqs).logits[:, -1], params)             # [n, V]
        joint = weights.view(-1, 1) * probs
        marginals.append(joint.sum(0))
        keep = joint.flatten() > 1e-7
        idx = torch.nonzero(keep).flatten()
        seqs = torch.cat([seqs[idx // V], (idx % V).view(-1, 1)], 1)
        weights = joint.flatten()[idx]
    return marginals


def chi2_pvalue(counts, p):
    """Pearson chi-square p-value (Wilson-Hilferty approximation), cells with expected >= 5."""
    n = counts.sum()
    exp = p * n
    m = exp >= 5
    stat = (((counts[m] - exp[m]) ** 2) / exp[m]).sum().item() + 0.0
    k = int(m.sum()) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def accept_with_p(target, draft, token):
    """A planted bias in recursive rejection sampling: a sampled child accepted with p instead of min(1, p / q)."""
    _, left, draft = exact_try_sampled(target, draft, token)
    return float(target[token]), left, draft


def stale_q_draw(logits, params, k, excluded, generator, scale=1.0):
    """A planted bias in a calibrated draft: the children drawn from the sharpened q, the verify handed q at the
    request's own temperature."""
    _, scores, drawn = REAL_DRAW(logits, params, k, excluded, generator, scale)
    q, _, _ = REAL_DRAW(logits, params, k, excluded, torch.Generator().manual_seed(0), 1.0)
    return q, scores, drawn


REAL_DRAW = DraftSampler.draw


@pytest.mark.parametrize("biased,top_p,top_k,ext,drafter", [
    (False, 0.95, 0, True, "eagle"), (False, 1.0, 0, True, "eagle"), (False, 0.95, 6, False, "eagle"),
    (True, 0.95, 0, False, "eagle"), (False, 0.95, 0, True, "hybrid"), (False, 0.9, 6, False, "hybrid"),
    (True, 0.95, 0, False, "hybrid"), (False, 0.95, 0, True, "suffix"), (False, 0.95, 0, True, "hybrid-ragged"),
    (True, 0.95, 0, False, "eagle-ragged"), (False, 0.95, 0, True, "eagle-calibrated"),
    (False, 0.9, 6, False, "hybrid-calibrated"), (True, 1.0, 0, False, "eagle-calibrated")])
def test_engine_sampling_matches_target_distribution(biased, top_p, top_k, ext, drafter, monkeypatch):
    """Tokens 1..3 of 3000 seeded runs (batch 1000) vs the target's exact marginals: the real verifier
    passes a chi-square test at p > 1e-3; the biased one must fail it (p < 1e-6). The draft's children are sampled
    (recursive rejection sampling verifies them; the planted bias accepts with p instead of min(1, p / q)). ext:
    csrc draws the children and walks the trees (where the extension is built), else PyTorch does (Gumbel-top-k,
    sampled_tree's walk). hybrid / suffix: trees that hold nodes the context proposed (deterministic proposals
    beside the draft's samples, or alone) stay exact too. -ragged: the rows of a step hold trees of different sizes
    (one verify budget for the batch; forced here). -calibrated: the children are drawn from q sharpened at depth 0
    and flattened at depth 1 (a draft calibration); its planted bias hands the verify the unsharpened q."""
    from sglang_eagle3.engine import sampled_tree
    from sglang_eagle3.engine.draft_calibration import DraftCalibration
    from sglang_eagle3.engine.speculation import Drafting
    drafter, _, variant = drafter.partition("-")
    ragged, calibration = variant == "ragged", DraftCalibration((2.5, 0.4)) if variant == "calibrated" else None
    if ragged:
        ragged_steps = force_ragged_trees(monkeypatch)
    tm, hf = tiny_target("llama", vocab_size=16, logit_scale=3.0)
    params = SamplingParams(max_new_tokens=3, temperature=0.8, top_p=top_p, top_k=top_k, ignore_eos=True)
    prompt = [3, 7, 1, 12, 5, 9, 0, 2, 4, 6, 8, 10, 11, 13, 14, 15, 3]   # every token once: each proposes
    exact = exact_marginals(hf, prompt, 3, params)
    if not ext:                                  # the PyTorch draws (Gumbel-top-k) and walks
        monkeypatch.setattr(engine_mod, "sampling_in_extension", lambda *a: False)
        monkeypatch.setattr(decode_kernels, "sampling_in_extension", lambda *a: False)
    if biased and calibration is not None:
        monkeypatch.setattr(sampled_tree.DraftSampler, "draw", staticmethod(stale_q_draw))
    elif biased:
        monkeypatch.setattr(engine_mod, "verify_sampling", biased_verify_sampling)
        monkeypatch.setattr(sampled_tree, "_try_sampled", accept_with_p)
        if drafter == "suffix":
            monkeypatch.setattr(engine_mod, "sampling_in_extension", lambda *a: False)
    walks = []
    real_walk = engine_mod.accept_sampled_row
    monkeypatch.setattr(engine_mod, "accept_sampled_row", lambda *a: walks.append(int((a[2] >= 0).sum())) or
                        real_walk(*a))
    drafting = Drafting(drafter, context_tokens=3, context_branches=2, min_match=1)
    eng = SpeculativeEngine(tm, random_draft(tm, seed=4), Settings(tree=SpecConfig(2, 3, 6), drafting=drafting,
                                                                   calibration=calibration))
    counts = torch.zeros(3, 16)
    from_context = 0
    for seed in range(3):
        outs, st = eng.generate([" ".join(map(str, prompt))] * 1000, SamplingParams(**{**params.__dict__, "seed": seed}))
        from_context += st.context_tokens
        for o in outs:
            for i, t in enumerate(o.token_ids):
                counts[i, t] += 1
    assert (from_context > 100) == (drafter != "eagle")       # the mixed trees were there, and accepted from
    assert (sum(walks) > 1000) == (drafter != "suffix")       # and the draft's sampled children
    assert not ragged or len(ragged_steps) >= 6               # and trees of different sizes in one step
    pvals = [chi2_pvalue(counts[i], exact[i]) for i in range(3)]
    assert pvals[0] > 1e-3                       # first token comes from the prefill, never from the tree
    if biased:
        assert min(pvals[1:]) < 1e-6, pvals
    else:
        assert min(pvals[1:]) > 1e-3, pvals


def test_sample_categorical_draws_the_distribution():
    """The inverse-CDF sampler: frequencies match p (within 4.5 standard deviations each), zero-probability tokens never
    come up (also at the edges of the vocabulary), and unnormalised weights are read as their normalised distribution."""
    from sglang_eagle3.engine.verify import sample_categorical
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    n = 6000
    counts = torch.zeros(6)
    for _ in range(n):
        counts[sample_categorical(p * 7.0, g)] += 1
    assert counts[[0, 2, 5]].sum() == 0
    sd = (n * p * (1 - p)).sqrt()
    assert ((counts - n * p).abs() <= 4.5 * sd).all(), counts
    assert sample_categorical(torch.tensor([0.0, 0.0, 1.0]), g) == 2
    assert sample_categorical(torch.tensor([1.0, 0.0, 0.0]), g) == 0


def test_sample_rows_draws_each_row_with_its_own_generator():
    from sglang_eagle3.engine.verify import sample_rows
    probs = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.25, 0.25, 0.25, 0.25], [0.0, 3.0, 0.0, 1.0]])
    draws = [sample_rows(probs, [torch.Generator().manual_seed(s) for s in (0, 1, 2)]) for _ in range(2)]
    assert torch.equal(draws[0], draws[1])                         # seeded per row: reproducible
    seen = torch.stack([sample_rows(probs, [None, None, None]) for _ in range(200)])
    assert (seen[:, 0] == 2).all() and set(seen[:, 2].tolist()) == {1, 3} and len(set(seen[:, 1].tolist())) == 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_takes_the_first_maximum_like_fp32_argmax(dtype):
    """Greedy picks read the target's logits in its own dtype (kernels.argmax): on ties (common in bf16) the
    first maximum wins, exactly as argmax over the fp32 cast that transformers' greedy decoding takes."""
    from sglang_eagle3.kernels import decode as kernels
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 3, 4096, generator=g) * 2).round().to(dtype)          # many exact ties per row
    x[0, 0, :] = 0                                                              # a row of nothing but ties
    got = kernels.argmax(x)
    assert torch.equal(got, x.float().argmax(-1))
    assert int(got[0, 0]) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_accept_from_logits_equals_the_tensor_walk(dtype):
    """On CPU greedy acceptance is one extension call that takes the argmax only along the accepted walk: the same
    path, count and emitted tokens (padding included) as accept_greedy over the argmax of every node."""
    from sglang_eagle3.engine.tree import DraftTree
    from sglang_eagle3.engine.verify import accept_greedy_logits
    from sglang_eagle3.kernels import decode as kernels
    from sglang_eagle3.kernels import extension
    if extension.load() is None:
        pytest.skip(f"C++ extension unavailable: {extension.status()['extension_error']}")
    g = torch.Generator().manual_seed(0)
    V = 50
    for trial in range(200):
        B, C = 3, int(torch.randint(1, 14, (1,), generator=g))
        parents = torch.stack([torch.tensor([int(torch.randint(-1, i, (1,), generator=g)) for i in range(C)])
                               for _ in range(B)])
        tokens = torch.stack([torch.randperm(V, generator=g)[:C] for _ in range(B)])   # siblings distinct
        scores = -torch.rand(B, C, generator=g)
        for i in range(C):                                                              # children score lower
            p = parents[:, i]
            scores[:, i] += torch.where(p >= 0, scores.gather(1, p.clamp(min=0).view(B, 1)).view(B), 0)
        tree = DraftTree(*kernels.build_tree_ref(tokens, scores, parents, torch.tensor([1, 2, 3]),
                                                 torch.tensor([5, 0, 9]), int(torch.randint(1, C + 2, (1,), generator=g))))
        N = tree.num_nodes
        logits = torch.randn(B, N, V, generator=g)
        want = tree.tokens.clone()                      # make the target agree with some drafted children
        for b in range(B):
            for i in range(1, N):
                if torch.rand((), generator=g) < 0.7:
                    logits[b, int(tree.parents[b, i]), int(want[b, i])] = 10 + float(torch.rand((), generator=g))
        if trial % 3 == 0:
            logits = logits.round()                     # ties: the first maximum wins in both
        logits = logits.to(dtype)
        got = accept_greedy_logits(tree.tokens, tree.parents, tree.mask, logits)
        ref = kernels.accept_greedy_ref(tree.tokens, tree.parents, tree.mask, kernels.argmax(logits))
        for a, r in ((got.path, ref[0]), (got.count, ref[1]), (got.emitted, ref[2])):
            assert torch.equal(a, r), trial
