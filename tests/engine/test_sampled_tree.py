"""Sampled draft trees: Gumbel-top-k draws without replacement, and recursive rejection sampling that keeps the
target's distribution exactly (every draw and outcome enumerated; Monte Carlo runs that catch planted biases)."""
import itertools
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from test_verify import chi2_pvalue

from sglang_eagle3.engine import sampled_tree as st
from sglang_eagle3.engine.sampled_tree import (
    acceptance_chances,
    child_chances,
    gumbel_top_k,
    sampled_children,
    verify_sampled_tree,
)
from sglang_eagle3.engine.verify import NodeProbs, SamplingParams, target_probs

V = 5
PARAMS = {"t0.7-topk4-topp0.9": SamplingParams(temperature=0.7, top_k=4, top_p=0.9),
          "t1.3-topp0.95": SamplingParams(temperature=1.3, top_p=0.95),
          "t1.0": SamplingParams(temperature=1.0)}
LAYOUTS = {"sampled": lambda context: [],                                       # the draft's samples only
           "mixed": lambda context: [(sum(context) + 2) % V] if len(context) < 1 or context[-1] % 2 else []}


def normalised(probs: torch.Tensor) -> torch.Tensor:
    return probs / probs.sum(-1, keepdim=True)          # fp32 probabilities summing to 1 in float64


@dataclass
class Bigram:
    """A target and a draft whose next token depends on the last one: logits [V + 1, V], row V at the root."""
    target_logits: torch.Tensor
    draft_logits: torch.Tensor
    params: SamplingParams
    k: int                                          # sampled children per node
    deterministic: Callable                         # context (tokens after the root) -> deterministic children
    depth: int = 2                                  # levels drafted below the root

    def __post_init__(self):
        self.p, self.q = (normalised(target_probs(x, self.params).double()) for x in (self.target_logits,
                                                                                      self.draft_logits))

    def row(self, context) -> int:
        return context[-1] if context else V

    def joint(self) -> torch.Tensor:
        """The target's law of the first two tokens [V, V]."""
        return self.p[V].unsqueeze(1) * self.p[:V]


def bigram(params, k, layout, seed, scale=1.5) -> Bigram:
    g = torch.Generator().manual_seed(seed)
    return Bigram(torch.randn(V + 1, V, generator=g) * scale, torch.randn(V + 1, V, generator=g) * scale,
                  params, k, LAYOUTS[layout])


# -- exact enumeration ---------------------------------------------------------------------------------------------

def draws(q: torch.Tensor, deterministic, k):
    """Every ordered draw of k children without replacement from q without the deterministic tokens (or of all its
    tokens, when fewer), with its chance: prod q(x_i) / (1 - q(x_1) - ... - q(x_{i-1}))."""
    q = q.clone()
    q[list(deterministic)] = 0.0
    q = q / q.sum()
    support = [t for t in range(V) if q[t] > 0]
    for seq in itertools.permutations(support, min(k, len(support))):
        chance, left = 1.0, 1.0
        for x in seq:
            chance *= float(q[x]) / left
            left -= float(q[x])
        yield list(seq), chance


def node_outcomes(m: Bigram, context, level):
    """(chance of the draw, children tokens, each child's chance to be accepted, bonus residual) for every draw of
    the children of the node at `context`; a leaf has no children and its bonus comes from p."""
    p, q = m.p[m.row(context)], m.q[m.row(context)]
    if level == m.depth:
        yield 1.0, [], [], p
        return
    det = m.deterministic(context)
    for seq, chance in draws(q, det, m.k):
        chances, residual = child_chances(p, det + seq, [False] * len(det) + [True] * len(seq), q)
        yield chance, det + seq, chances, residual


def first_token(m: Bigram, context, level, cache) -> torch.Tensor:
    """The exact law [V] of the first token the walk emits from the node at `context`."""
    if context not in cache:
        out = torch.zeros(V, dtype=torch.float64)
        for chance, tokens, chances, residual in node_outcomes(m, context, level):
            for t, c in zip(tokens, chances):
                out[t] += chance * c
            out += chance * (1.0 - sum(chances)) * residual
        cache[context] = out
    return cache[context]


def first_two(m: Bigram) -> torch.Tensor:
    """The exact law [V, V] of the first two tokens: an accepted root child t and what its node emits next, or a
    bonus token y and the next step's first token (from p after y)."""
    joint, cache = torch.zeros(V, V, dtype=torch.float64), {}
    for chance, tokens, chances, residual in node_outcomes(m, (), 0):
        for t, c in zip(tokens, chances):
            joint[t] += chance * c * first_token(m, (t,), 1, cache)
        joint += chance * (1.0 - sum(chances)) * residual.unsqueeze(1) * m.p[:V]
    return joint


exact_try_sampled = st._try_sampled


def accept_with_p(target, draft, token):
    """Planted bias: verify.py's chance p_i(x) with the recursive residual max(0, p_i - q_i)."""
    _, left, draft = exact_try_sampled(target, draft, token)
    return float(target[token]), left, draft


def keep_tried_in_q(target, draft, token):
    """Planted bias: the next child's q still holds the rejected one (as if drawn with replacement)."""
    accept, left, _ = exact_try_sampled(target, draft, token)
    return accept, left, draft


def zeroed_residual(target, draft, token):
    """Planted bias: min(1, p_i / q_i) with verify.py's residual (p_i without the token)."""
    accept, _, draft = exact_try_sampled(target, draft, token)
    left = target.clone()
    left[token] = 0.0
    return accept, left, draft


BIASES = {"accept_with_p": accept_with_p, "keep_tried_in_q": keep_tried_in_q, "zeroed_residual": zeroed_residual}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("params", list(PARAMS))
def test_enumeration_emits_the_targets_first_two_tokens_exactly(params, k, layout):
    """Depth-2 trees on V = 5, every draw of every node's sampled children and every accept/reject outcome summed
    with its exact chance: the first token follows p at the root and the first two follow p(t1) p(t2 | t1), to
    1e-12, for temperature != 1, top-k and top-p cuts on both sides, with and without deterministic children."""
    for seed in range(4):
        m = bigram(PARAMS[params], k, layout, seed)
        joint = first_two(m)
        assert (joint.sum(1) - m.p[V]).abs().max() < 1e-12, seed
        assert (joint - m.joint()).abs().max() < 1e-12, seed
        for t in range(V):                                  # each root child's node emits p after its token
            assert (first_token(m, (t,), 1, {}) - m.p[t]).abs().max() < 1e-12, (seed, t)


@pytest.mark.parametrize("bias", list(BIASES))
def test_enumeration_exposes_each_planted_bias(bias, monkeypatch):
    """The same sums with a planted bias are off by far more than rounding (each variant moves at least one case by
    > 1e-3)."""
    monkeypatch.setattr(st, "_try_sampled", BIASES[bias])
    worst = max(float((first_two(bigram(PARAMS[params], 2, layout, seed)) - bigram(PARAMS[params], 2, layout, seed)
                       .joint()).abs().max()) for params in PARAMS for layout in LAYOUTS for seed in range(2))
    assert worst > 1e-3, worst


def test_deterministic_children_alone_are_verify_sampling():
    """With no sampled child a node is verify.py's rule: child i has chance p(x_i), the residual is p without them."""
    p = torch.tensor([0.1, 0.4, 0.2, 0.3], dtype=torch.float64)
    chances, residual = child_chances(p, [1, 3], [False, False])
    assert chances == pytest.approx([0.4, 0.3], abs=1e-15)
    assert torch.allclose(residual, torch.tensor([1 / 3, 0.0, 2 / 3, 0.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="before its sampled"):
        child_chances(p, [1, 3], [True, False], p)


# -- Monte Carlo with the real sampling code -------------------------------------------------------------------------

def sample_tree(m: Bigram, g: torch.Generator):
    """A tree drawn as the engine would: each node's sampled children (sampled_children from q without its
    deterministic ones), appended before the deterministic ones (the walk reorders them). -> tokens, parents,
    sampled flags and each node's logits row."""
    tokens, parents, sampled, rows = [0], [-1], [False], [V]
    frontier = [(0, ())]
    for _ in range(m.depth):
        nxt = []
        for node, context in frontier:
            det = m.deterministic(context)
            drawn = sampled_children(m.q[m.row(context)], det, m.k, g)
            for t, is_sampled in [(t, True) for t in drawn] + [(t, False) for t in det]:
                tokens.append(t)
                parents.append(node)
                sampled.append(is_sampled)
                rows.append(t)
                nxt.append((len(tokens) - 1, context + (t,)))
        frontier = nxt
    return tokens, parents, sampled, rows


def monte_carlo_first_two(m: Bigram, trials: int, seed: int) -> torch.Tensor:
    """Counts [V, V] of the first two tokens over seeded walks (after a lone bonus, the next step's token from p)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    for _ in range(trials):
        tokens, parents, sampled, rows = sample_tree(m, g)
        target = NodeProbs(m.target_logits[rows], m.params)
        draft = NodeProbs(m.draft_logits[rows], m.params)
        accepted, bonus = verify_sampled_tree(tokens, parents, sampled, target, draft, g)
        emitted = [tokens[i] for i in accepted[1:]] + [bonus]
        if len(emitted) == 1:
            emitted.append(int(torch.multinomial(m.p[bonus], 1, generator=g)))
        counts[emitted[0], emitted[1]] += 1
    return counts


MC_MODEL = dict(params="t0.7-topk4-topp0.9", k=3, layout="mixed", seed=5)


@pytest.mark.parametrize("bias", [None] + list(BIASES))
def test_monte_carlo_walk_matches_the_target_and_catches_planted_biases(bias, monkeypatch):
    """4,000 seeded draws of a depth-2 mixed tree (k = 3) walked by verify_sampled_tree: the first two tokens pass a
    chi-square test against p(t1) p(t2 | t1) at p > 1e-3 and never hit an impossible pair; each planted bias fails
    it (p < 1e-6, or an impossible pair)."""
    m = bigram(PARAMS[MC_MODEL["params"]], MC_MODEL["k"], MC_MODEL["layout"], MC_MODEL["seed"])
    if bias is not None:
        monkeypatch.setattr(st, "_try_sampled", BIASES[bias])
    counts = monte_carlo_first_two(m, 4000, seed=1)
    want = m.joint().float()
    pvalue, impossible = chi2_pvalue(counts.flatten(), want.flatten()), int(counts[want == 0].sum())
    tv = 0.5 * float((counts / counts.sum() - want).abs().sum())
    print(f"bias={bias}: chi-square p={pvalue:.3g}, impossible pairs={impossible}, TV={tv:.4f}")
    if bias is None:
        assert pvalue > 1e-3 and impossible == 0, (pvalue, impossible, tv)
    else:
        assert pvalue < 1e-6 or impossible > 0, (pvalue, impossible, tv)


@pytest.mark.parametrize("keep,exact", [("first", True), ("key_above", True), ("highest_q", False)])
def test_which_sampled_children_a_tree_keeps(keep, exact):
    """Two children drawn, the tree keeps some: the first in draw order, or the second too only when its Gumbel key
    clears a bar (a choice that does not look at the token) stay exact; keeping the child the draft likes best
    (EAGLE-2's score) does not. First token of 8,000 walks, chi-square against p."""
    g = torch.Generator().manual_seed(7)
    m = bigram(PARAMS["t1.0"], 2, "sampled", seed=3, scale=2.0)
    p, q = m.p[V], m.q[V]
    counts = torch.zeros(V)
    for _ in range(8000):
        tokens, keys = gumbel_top_k(q.log(), 2, g)
        drawn = tokens.tolist()
        if keep == "first":
            kept = drawn[:1]
        elif keep == "key_above":
            kept = drawn if float(keys[1]) > -1.0 else drawn[:1]
        else:
            kept = [max(drawn, key=lambda t: float(q[t]))]
        accepted, bonus = verify_sampled_tree([0] + kept, [-1] + [0] * len(kept), [False] + [True] * len(kept),
                                              p.expand(len(kept) + 1, V), q.expand(len(kept) + 1, V), g)
        counts[kept[accepted[1] - 1] if len(accepted) > 1 else bonus] += 1
    pvalue = chi2_pvalue(counts, p.float())
    print(f"keep={keep}: chi-square p={pvalue:.3g}")
    assert (pvalue > 1e-3) == exact, pvalue


def test_gumbel_top_k_draws_without_replacement():
    """20,000 batched draws of 3 of 5 tokens (one of them at q = 0): every ordered triple with the chance of
    sequential draws without replacement (chi-square p > 1e-3), never the q = 0 token, and -1 past q's support."""
    q = torch.tensor([0.4, 0.0, 0.3, 0.2, 0.1], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    tokens, keys = gumbel_top_k(q.log().expand(20000, V), 3, g)
    assert (keys[:, :-1] >= keys[:, 1:]).all() and not (tokens == 1).any()
    index = {tuple(seq): i for i, (seq, _) in enumerate(draws(q, [], 3))}
    want = torch.tensor([c for _, c in draws(q, [], 3)])
    counts = torch.bincount(torch.tensor([index[tuple(t)] for t in tokens.tolist()]), minlength=len(index))
    assert chi2_pvalue(counts.double(), want) > 1e-3
    few, _ = gumbel_top_k(torch.tensor([0.5, 0.5, 0.0, 0.0]).log(), 3, g)
    assert sorted(few[:2].tolist()) == [0, 1] and few[2] == -1
    assert sampled_children(q, [0, 2], 3, g) in ([3, 4], [4, 3])
    with pytest.raises(ValueError):
        gumbel_top_k(q.log(), 6, g)


# -- expected acceptance ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("k", [1, 2, 3])
def test_acceptance_chances_against_enumeration(k, layout):
    """acceptance_chances vs the exact chance of each child being accepted (every draw enumerated): deterministic
    children and the first sampled one to 1e-12 (p(x); sum min(p', q')), later ones within 0.01 (2,000 draws)."""
    for seed in range(3):
        m = bigram(PARAMS["t1.3-topp0.95"], k, layout, seed)
        p, q, det = m.p[V], m.q[V], m.deterministic(())
        exact = torch.zeros(len(det) + k, dtype=torch.float64)
        for chance, tokens, chances, _ in node_outcomes(m, (), 0):
            exact[:len(chances)] += chance * torch.tensor(chances, dtype=torch.float64)
        got = acceptance_chances(p, q, det, k, draws=2000, generator=torch.Generator().manual_seed(seed))
        n = len(got)
        assert (exact[n:] == 0).all()
        assert (got[:len(det) + 1] - exact[:len(det) + 1]).abs().max() < 1e-12, (got, exact)
        assert (got - exact[:n]).abs().max() < 0.01, (got, exact)


def test_acceptance_chances_for_one_sampled_child_is_the_overlap():
    g = torch.Generator().manual_seed(0)
    p, q = (normalised(torch.softmax(torch.randn(50, generator=g, dtype=torch.float64), -1)) for _ in range(2))
    got = acceptance_chances(p, q, [], 1)
    assert float(got[0]) == pytest.approx(float(torch.minimum(p, q).sum()), abs=1e-12)


# -- the gain --------------------------------------------------------------------------------------------------------

def entropy(p: torch.Tensor) -> float:
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def flattened(p: torch.Tensor, ratio: float) -> torch.Tensor:
    """p ** t renormalised, t chosen (bisection) so that its entropy is ratio times p's."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        t = (lo + hi) / 2
        if entropy(normalised(p ** t)) > ratio * entropy(p):
            lo = t
        else:
            hi = t
    return normalised(p ** lo)


@pytest.mark.parametrize("draft", ["flattened", "noisy"])
def test_sampled_children_accept_more_than_top_k_deterministic_ones(draft):
    """A node's chance to accept one of k children, V = 4,096, p of entropy ~2 nats (T = 1 text): k draft samples
    verified by recursive rejection (mean over 400 draws of the exact chance given the draw) beat the draft's top-k
    accepted with p(x) (sum of p over them), by more than 4 standard errors, for a draft whose q is p flattened to
    twice its entropy and for one with log-normal noise on p; acceptance_chances agrees with the measured means."""
    g = torch.Generator().manual_seed(0)
    p = normalised(torch.softmax(torch.randn(4096, generator=g, dtype=torch.float64) * 6.0, -1))
    q = flattened(p, 2.0) if draft == "flattened" else normalised(torch.softmax(
        p.log() + torch.randn(4096, generator=g, dtype=torch.float64), -1))
    rows = []
    for k in (1, 2, 4):
        top_k = float(p[q.topk(k).indices].sum())
        drawn, _ = gumbel_top_k(q.log().expand(400, -1), k, g)                 # [400, k] draws of k children
        per_draw = torch.tensor([sum(child_chances(p, row, [True] * k, q)[0]) for row in drawn.tolist()],
                                dtype=torch.float64)
        sampled, se = float(per_draw.mean()), float(per_draw.std() / 20)
        estimate = float(acceptance_chances(p, q, [], k, draws=512, generator=g).sum())
        rows.append((k, top_k, sampled, se, estimate))
    report = (f"H(p)={entropy(p):.2f} H(q)={entropy(q):.2f}: " +
              "; ".join(f"k={k} top-k {d:.3f} sampled {s:.3f}±{e:.3f} (estimate {x:.3f})" for k, d, s, e, x in rows))
    print(report)
    assert all(s - 4 * e > d for _, d, s, e, _ in rows), report
    assert all(abs(x - s) < 4 * e + 0.01 for _, _, s, e, x in rows), report


@pytest.mark.parametrize("params", list(PARAMS))
def test_the_extensions_walk_has_the_exact_chances_of_one_node(params):
    """csrc's accept_sampled_tree at one node (two deterministic children, then three draws of a q over a draft
    vocabulary that leaves some target tokens out): 20,000 walks land on each child, or on each bonus token, as often
    as child_chances says (chi-square p > 1e-4), and never where it gives no chance."""
    from sglang_eagle3.kernels import decode as K
    from sglang_eagle3.kernels import extension
    if extension.load() is None:
        pytest.skip("the C++ extension is not built here")
    g = torch.Generator().manual_seed(11)
    V, targets = 12, torch.tensor([0, 2, 3, 5, 6, 8, 9, 11])             # the draft vocabulary's target ids
    likely = torch.zeros(V)
    likely[[0, 2, 3, 4, 9]] = 2.0                                           # where p and q overlap (top-k 4 cuts)
    logits = torch.randn(6, V, generator=g) * 0.5 + likely
    sp = PARAMS[params]
    q_draft = target_probs(torch.randn(1, len(targets), generator=g) * 0.5 + likely[targets], sp)[0]
    det = [4, 9]                                                            # deterministic children, one in Vd
    q_draft[(targets.view(-1, 1) == torch.tensor(det)).any(1)] = 0.0        # drawn without them
    q_draft /= q_draft.sum()
    drawn = [int(targets[i]) for i in torch.multinomial(q_draft, 3, generator=g).tolist()]
    tokens = [7] + det + drawn
    parents, from_slot = [-1] + [0] * 5, [-1, -1, -1, 0, 0, 0]
    q_target = torch.zeros(V, dtype=torch.float64)
    q_target[targets] = q_draft.double()
    p = target_probs(logits[0], sp).double()
    chances, residual = child_chances(p, tokens[1:], [False, False, True, True, True], q_target)
    want = torch.cat([torch.tensor(chances), (1 - sum(chances)) * residual])   # child i, or bonus token y
    assert sum(c > 0.02 for c in chances) >= 2 and (want > 0.02).sum() >= 3      # a case worth testing
    counts = torch.zeros(5 + V, dtype=torch.float64)
    args = [torch.tensor(x) for x in (tokens, parents, from_slot)]
    for _ in range(20000):
        u = torch.rand(6, generator=g, dtype=torch.float64)
        nodes, bonus = K.accept_sampled_tree(*args, logits, sp.temperature, sp.top_k, sp.top_p, q_draft.view(1, -1),
                                             targets, u)
        counts[nodes[1] - 1 if len(nodes) > 1 else 5 + bonus] += 1
    assert counts[want == 0].sum() == 0
    assert chi2_pvalue(counts, want) > 1e-4, (counts.tolist(), want.tolist())


@pytest.mark.parametrize("params", list(PARAMS))
def test_the_extensions_draft_children_are_draws_without_replacement_from_q(params):
    """csrc's draft_children on 6 draft tokens, one excluded: q is sampling_probs with it zeroed and renormalised,
    the scores are the log of q's largest values, and the first two of 3 draws follow q_a q_b / (1 - q_a) over
    30,000 runs (chi-square p > 1e-4; never an excluded or zero-chance token, never a repeat)."""
    from sglang_eagle3.kernels import decode as K
    from sglang_eagle3.kernels import extension
    if extension.load() is None:
        pytest.skip("the C++ extension is not built here")
    sp, g, n = PARAMS[params], torch.Generator().manual_seed(5), 30000
    logits = (torch.randn(1, 6, generator=g) * 0.8).expand(n, 6).contiguous()
    q, scores, draws = K.draft_children(logits, sp.temperature, sp.top_k, sp.top_p, 3, torch.tensor([1]),
                                        torch.rand(n, 3, generator=g, dtype=torch.float64))
    want_q = target_probs(logits[0], sp)
    want_q[1] = 0.0
    want_q /= want_q.sum()
    assert torch.allclose(q[0], want_q, atol=1e-6)
    top = want_q.topk(3).values
    assert torch.allclose(scores[0], top.log(), atol=1e-5) or bool((top == 0).any())
    live = int((want_q > 0).sum())
    assert (draws[:, live:] == -1).all() and (draws[:, :min(live, 3)] >= 0).all()
    first_two = draws[:, :2]
    assert not (first_two == 1).any() and (first_two[:, 0] != first_two[:, 1]).all()
    assert want_q[draws[:, :min(live, 3)]].gt(0).all()
    if live < 2:
        return
    pairs = want_q.double().view(6, 1) * want_q.double().view(1, 6) / (1 - want_q.double()).view(6, 1)
    pairs.fill_diagonal_(0.0)
    counts = torch.zeros(36, dtype=torch.float64)
    counts.index_add_(0, first_two[:, 0] * 6 + first_two[:, 1], torch.ones(n, dtype=torch.float64))
    assert chi2_pvalue(counts, pairs.flatten() / pairs.sum()) > 1e-4
