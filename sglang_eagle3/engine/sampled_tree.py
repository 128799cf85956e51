"""Sampled draft trees verified exactly: recursive rejection sampling without replacement (Jeon et al. 2024).

Drafting: at temperature > 0 a node's draft children are samples of the draft's distribution q (target_probs of the
draft's logits, so the same temperature, top-k and top-p as the target's p) drawn without replacement by the
Gumbel-top-k trick: the k largest of log q + Gumbel noise are distributed as k sequential draws without replacement.

Verification at a node with target p: p_1 = p, q_1 = q. Child x_i is accepted with chance min(1, p_i(x_i) / q_i(x_i));
on rejection p_{i+1} = norm(max(0, p_i - q_i)) and q_{i+1} = q_i without x_i, renormalised (the law of the next draw
without replacement). If every child is rejected, the bonus token is drawn from the last p_i. An accepted child
continues the walk with its own p and q. Exact: given the children tried before it, x_i follows q_i, so step i emits
y with chance min(p_i, q_i)(y) + (1 - sum min(p_i, q_i)) p_{i+1}(y) = p_i(y) (p_{i+1} does not depend on x_i); by
induction back from the bonus draw the node emits p_1 = p.

Context proposals are deterministic children: q_i is a point mass on x, so the same rule accepts x with chance p_i(x)
and leaves p_i with x zeroed and renormalised (verify.py's rule). A node tries its deterministic children first, then
its sampled ones, which were drawn from q without the deterministic siblings (`sampled_children`); any q gives an
exact walk as long as the children were drawn from it.

A tree may keep only the first j of a node's sampled children (in draw order), with j chosen without looking at
the tokens drawn there or anything drawn below them: from the ranks, the Gumbel keys (given the earlier draws, the
next key says nothing about the next token) or other nodes' draws. Keeping, say, the children of highest q (EAGLE-2's
score) favours tokens the draft likes, and the output is no longer p.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from sglang_eagle3.engine.verify import children_of, sample_categorical
from sglang_eagle3.kernels import decode as K


def gumbel_top_k(log_q: torch.Tensor, k: int,
                 generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """k draws without replacement from softmax(log_q) ([..., V], unnormalised log-probs; -inf = never drawn):
    tokens [..., k] in draw order and their keys [..., k] (log_q + Gumbel noise, descending). Where fewer than k
    tokens have a finite log_q, the missing draws are token -1 with key -inf."""
    if not 0 < k <= log_q.shape[-1]:
        raise ValueError(f"k must be in [1, {log_q.shape[-1]}], got {k}")
    u = torch.rand(log_q.shape, dtype=torch.float64, device=log_q.device, generator=generator)
    e = u.clamp_(min=torch.finfo(torch.float64).tiny).log_().neg_()            # -log U is Exp(1) (faster than
    gumbel = e.clamp_(min=torch.finfo(torch.float64).tiny).log_().neg_()       # exponential_); -log Exp(1) Gumbel
    keys, tokens = (log_q.double() + gumbel).topk(k, dim=-1)                    # [..., k] largest first
    return tokens.masked_fill(keys == float("-inf"), -1), keys


def sampled_children(q: torch.Tensor, deterministic: Sequence[int], k: int,
                     generator: Optional[torch.Generator] = None) -> list[int]:
    """A node's sampled children: up to k draws without replacement from q [V] without the node's deterministic
    children (the q that `child_chances` verifies them against), in draw order."""
    log_q = q.double().log()
    if len(deterministic):
        log_q[list(deterministic)] = float("-inf")
    tokens, _ = gumbel_top_k(log_q, min(k, q.shape[-1]), generator)
    return [t for t in tokens.tolist() if t >= 0]


def _normalised(x: torch.Tensor) -> torch.Tensor:
    return x / x.sum()


def _try_sampled(target: torch.Tensor, draft: torch.Tensor, token: int) -> tuple[float, torch.Tensor, torch.Tensor]:
    """A sampled child against p_i = target and q_i = draft ([V], float64, normalised): its chance of acceptance,
    max(0, p_i - q_i) (p_{i+1} unnormalised) and q_{i+1} (q_i without the token)."""
    if not draft[token] > 0:
        raise ValueError(f"sampled child {token} has no chance under the draft's q")
    accept = min(1.0, float(target[token] / draft[token]))
    left = (target - draft).clamp_(min=0.0)
    draft = draft.clone()
    draft[token] = 0.0
    return accept, left, _normalised(draft) if draft.sum() > 0 else draft


def _try_deterministic(target: torch.Tensor, token: int) -> tuple[float, torch.Tensor]:
    """A deterministic child (q_i a point mass on it): its chance p_i(token), and p_i without it (unnormalised)."""
    left = target.clone()
    left[token] = 0.0
    return float(target[token]), left


def child_chances(p: torch.Tensor, tokens: Sequence[int], sampled: Sequence[bool],
                  q: Optional[torch.Tensor] = None) -> tuple[list[float], torch.Tensor]:
    """Trying one node's children (tokens, deterministic ones first, then the sampled ones in draw order) against
    the target's p [V] and the draft's q [V] (read when a child is sampled): chances[i] = the chance that child i
    is the accepted one, and the residual [V] (float64, sums to 1) the bonus is drawn from when all are rejected
    (chance 1 - sum(chances))."""
    target = _normalised(p.double())
    if any(sampled):
        draft = q.double().clone()
        draft[[t for t, s in zip(tokens, sampled) if not s]] = 0.0           # drawn without the deterministic ones
        draft = _normalised(draft)
    chances, reach, seen_sampled = [], 1.0, False
    for token, is_sampled in zip(tokens, sampled):
        if seen_sampled and not is_sampled:
            raise ValueError("a node's deterministic children must come before its sampled ones")
        seen_sampled = is_sampled
        if is_sampled:
            accept, left, draft = _try_sampled(target, draft, token)
        else:
            accept, left = _try_deterministic(target, token)
        chances.append(reach * accept)
        reach *= 1.0 - accept
        if left.sum() > 0:                  # else p_i == q_i: the child was accepted for sure, p_i stays
            target = _normalised(left)
    return chances, target


def accept_children(p: torch.Tensor, tokens: Sequence[int], sampled: Sequence[bool], q: Optional[torch.Tensor] = None,
                    generator: Optional[torch.Generator] = None) -> tuple[Optional[int], torch.Tensor]:
    """One node's verification: the index of the accepted child (None: all rejected) and the residual the bonus
    is drawn from (see child_chances). One uniform number from the generator."""
    chances, residual = child_chances(p, tokens, sampled, q)
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    total = 0.0
    for i, chance in enumerate(chances):
        total += chance
        if u < total:
            return i, residual
    return None, residual


def _children_in_trial_order(parents: Sequence[int], sampled: Sequence[bool]) -> list[list[int]]:
    """Each node's children: the deterministic ones, then the sampled ones, each group in node order."""
    return [sorted(k, key=lambda i: bool(sampled[i])) for k in children_of(parents)]


def verify_sampled_tree(tokens: Sequence[int], parents: Sequence[int], sampled: Sequence[bool], target, draft,
                        generator: Optional[torch.Generator] = None) -> tuple[list[int], int]:
    """One sequence's walk (verify_sampling's contract for trees with sampled children). tokens, parents [N] as
    there; sampled [N]: node i is a draft sample (else a deterministic proposal; the root's flag is unused); a
    node's sampled children are in draw order. target[n]: p at node n; draft[n]: q at node n, read where n has
    sampled children (tensors [N, V] or NodeProbs). Returns (accepted nodes from the root, bonus token): the
    emitted tokens are those of accepted[1:], then the bonus."""
    kids = _children_in_trial_order(parents, sampled)
    node, accepted = 0, [0]
    while True:
        children = kids[node]
        flags = [bool(sampled[c]) for c in children]
        q = draft[node] if any(flags) else None
        i, residual = accept_children(target[node], [tokens[c] for c in children], flags, q, generator)
        if i is None:
            return accepted, sample_categorical(residual, generator)
        node = children[i]
        accepted.append(node)


def acceptance_chances(p: torch.Tensor, q: torch.Tensor, deterministic: Sequence[int], k: int, draws: int = 256,
                       generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """The chance that each child of a node is the accepted one, before its sampled children are drawn: [m + k'] for
    its m deterministic children (first) and k' = min(k, tokens of q left) sampled ones, given p [V] and q [V].

    Deterministic child x: p(x), exactly (the rule emits x with chance p(x), and only by accepting it). Sampled
    child i: reach * E[(1 - b_1) ... (1 - b_{i-1}) b_i], with reach = 1 - p(deterministic) and b_j = sum min(p_j, q_j)
    the chance to accept child j once the earlier ones were rejected (p_1, q_1: p and q without the deterministic
    tokens, renormalised). Exact for i = 1: reach * sum min(p_1, q_1), the k = 1 rule. For i > 1 it is an unbiased
    estimate over `draws` histories of rejected children: a rejected x_j follows max(0, q_j - p_j) / (1 - b_j)."""
    p, q, det = p.double().clone(), q.double().clone(), list(deterministic)
    p = _normalised(p)
    fixed = p[det].clone()                                                       # [m]
    reach = max(0.0, 1.0 - float(fixed.sum()))
    p[det], q[det] = 0.0, 0.0
    k = min(k, int((q > 0).sum()))
    if k == 0 or reach == 0.0:
        return torch.cat([fixed, torch.zeros(k, dtype=torch.float64)])
    rows = torch.arange(draws)
    target = _normalised(p).expand(draws, -1).clone()                            # [n, V] p_j per history
    draft = _normalised(q).expand(draws, -1).clone()                             # [n, V] q_j per history
    weight = torch.full((draws,), reach, dtype=torch.float64)                    # [n] chance to reach child j
    chances = []
    for j in range(k):
        overlap = torch.minimum(target, draft).sum(-1)                           # [n] b_j
        chances.append((weight * overlap).mean())
        if j + 1 == k:
            break
        rejected = (draft - target).clamp(min=0.0)                               # [n, V] law of a rejected x_j
        live = rejected.sum(-1, keepdim=True) > 0                                # (else b_j = 1: weight drops to 0)
        x = torch.multinomial(torch.where(live, rejected, draft), 1, generator=generator).squeeze(-1)
        weight = weight * (1.0 - overlap).clamp(min=0.0)
        left = (target - draft).clamp(min=0.0)
        target = torch.where(live, left / left.sum(-1, keepdim=True).clamp(min=1e-300), target)
        draft[rows, x] = 0.0
        draft = draft / draft.sum(-1, keepdim=True)
    return torch.cat([fixed, torch.stack(chances)])


# ---- the step's side: drawing a batch's children, handing their q to the verify ---------------------------------
class DraftSampler:
    """A step's draft children, level by level (tree.draft_candidates calls `children`). A sampled row draws its
    children from q, the draft's distribution at the row's temperature, top-k and top-p (over the draft vocabulary),
    without replacement; a greedy row keeps EAGLE-2's k likeliest. Each child's score is its parent's plus the log
    of the rank-th largest q: a function of the parent and the child's rank, never of the token drawn, so a tree
    that keeps the best-scoring nodes keeps a prefix of each node's draws (and the shape EAGLE-2 would give the
    same parents). Every q a sampled row draws from is kept for the verify (slot s of `probs`). calibration
    (draft_calibration.DraftCalibration; None: q at the row's own temperature) sharpens each depth's q: the call for
    depth d draws at temperature T / scale[d]."""

    def __init__(self, params: Sequence, generators: Sequence, num_slots: int, excluded: Sequence[Sequence[int]] = (),
                 calibration=None):
        self.params, self.generators = list(params), list(generators)
        self.sampled = [not p.greedy for p in params]
        self.num_slots, self.excluded, self.calibration = num_slots, list(excluded), calibration
        self.probs: Optional[torch.Tensor] = None             # [B, num_slots, Vd] q at each expanded node
        self.used = 0
        self.depth = 0                                        # the depth of the nodes the next call expands

    def children(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """logits [B, M, Vd] of M expanded nodes per row -> each node's k children: scores [B, M, k] (log of the
        rank's q, larger first), draft ids [B, M, k] and the q slot each was drawn from [B, M, k] (-1: a greedy
        row's, not drawn). On the first call (the root) a row's `excluded` draft ids are never drawn: the root's
        deterministic children, which the verify tries first."""
        B, M, Vd = logits.shape
        if self.probs is None:
            self.probs = torch.zeros(B, self.num_slots, Vd, dtype=torch.float32, device=logits.device)
        first, slots = self.used == 0, torch.arange(self.used, self.used + M, device=logits.device)
        if self.used + M > self.num_slots:
            raise ValueError(f"{self.used + M} expanded nodes per row, room for {self.num_slots}")
        scores = torch.empty(B, M, k, dtype=torch.float32, device=logits.device)
        ids = torch.empty(B, M, k, dtype=torch.long, device=logits.device)
        greedy = [b for b, s in enumerate(self.sampled) if not s]
        if greedy:                                                                 # greedy rows' children
            at = torch.tensor(greedy, device=logits.device)
            top, top_ids = K.topk_logprobs(logits[at], k)
            scores[at], ids[at] = top.float(), top_ids.long()
        drawn_from = torch.full((B, M, k), -1, dtype=torch.long, device=logits.device)
        scale = self.calibration.at(self.depth) if self.calibration is not None else 1.0
        for b in (b for b, s in enumerate(self.sampled) if s):
            excluded = self.excluded[b] if first and b < len(self.excluded) else []
            q, scores[b], drawn = self.draw(logits[b], self.params[b], k, excluded, self.generators[b], scale)
            self.probs[b, slots] = q
            ids[b] = drawn.clamp(min=0)                                            # (-1: no draw, score -inf)
            drawn_from[b] = slots.view(M, 1)
        self.used += M
        self.depth += 1
        return scores, ids, drawn_from

    @staticmethod
    def draw(logits: torch.Tensor, params, k: int, excluded: Sequence[int], generator: Optional[torch.Generator],
             scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One row's nodes, logits [M, Vd] -> q [M, Vd] (at temperature params.temperature / scale, the request's
        top-k and top-p), the log of its k largest values [M, k] and k draws without replacement from q [M, k] (-1
        past its tokens): csrc's one pass per node where it runs, else Gumbel-top-k."""
        temperature = params.temperature / scale
        if K.sampling_in_extension(logits):
            u = torch.rand(logits.shape[0], k, dtype=torch.float64, device=logits.device, generator=generator)
            ex = torch.tensor(list(excluded), dtype=torch.long, device=logits.device)
            return K.draft_children(logits, temperature, params.top_k, params.top_p, k, ex, u)
        q = K.sampling_probs(logits, temperature, params.top_k, params.top_p)               # [M, Vd]
        if len(excluded):
            q[:, list(excluded)] = 0.0
            q = q / q.sum(-1, keepdim=True).clamp(min=torch.finfo(q.dtype).tiny)
        log_q = q.log()
        drawn, _ = gumbel_top_k(log_q, k, generator)                                        # [M, k] draw order
        return q, log_q.topk(k, dim=-1).values, drawn


class NodeDraftProbs:
    """q at the nodes of one row's tree that have sampled children, in the target's vocabulary (float64), built
    when the walk first needs it (verify_sampled_tree's `draft`)."""

    def __init__(self, probs: torch.Tensor, parents: Sequence[int], drawn_from: Sequence[int],
                 draft_targets: torch.Tensor, vocab_size: int):
        """probs [S, Vd]: the row's q slots; parents, drawn_from [N]: each node's parent and q slot (-1: not drawn);
        draft_targets [Vd]: the target id of each draft id."""
        self.probs, self.targets, self.vocab_size = probs, draft_targets, vocab_size
        self.slot_of = {int(parent): int(s) for parent, s in zip(parents, drawn_from) if s >= 0}   # node -> slot
        self.rows: dict[int, torch.Tensor] = {}

    def __getitem__(self, node: int) -> torch.Tensor:
        if node not in self.rows:
            q = torch.zeros(self.vocab_size, dtype=torch.float64, device=self.probs.device)
            q[self.targets] = self.probs[self.slot_of[node]].double()
            self.rows[node] = q
        return self.rows[node]


@dataclass
class SampledDraws:
    """What the verify needs of a step's sampled children: per tree node the q slot it was drawn from, the q."""
    drawn_from: torch.Tensor       # [B, N] per tree node (-1: the root, a greedy row's node or a context proposal)
    probs: torch.Tensor            # [B, S, Vd] q per slot
    draft_targets: torch.Tensor    # [Vd] the target id of each draft id

    def row(self, b: int, parents: Sequence[int], vocab_size: int) -> Optional[tuple[list[bool], NodeDraftProbs]]:
        """Row b's sampled flags [N] and its q per node; None where the row has no sampled node."""
        drawn = self.drawn_from[b].tolist()
        if max(drawn) < 0:
            return None
        return [d >= 0 for d in drawn], NodeDraftProbs(self.probs[b], parents, drawn, self.draft_targets, vocab_size)
