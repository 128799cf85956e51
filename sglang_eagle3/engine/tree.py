"""EAGLE-2 dynamic draft tree, with SGLang's parameter semantics.

num_steps: depth (levels of draft tokens below the root); topk: children expanded per frontier node;
num_draft_tokens: tokens verified per step *including* the root (the last verified token).

Step 1 uses the draft's output from the extend over the target's fused features; each later step
runs the draft once on the `topk` best frontier nodes of every row (one batched forward per level),
feeding the draft's own hidden output with the chosen token's embedding. Every expanded child is a
candidate scored by its cumulative log-prob; the best num_draft_tokens - 1 candidates (always closed
under ancestors) form the tree. A level is not drafted once no node below the frontier could be among them
(levels_needed: the same tree for fewer draft forwards). Mask, depths, positions and retrieve paths are tensor
operations (on CPU the selection and layout are one call of csrc/tree_ops.cpp, with the same result).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from sglang_eagle3.engine.speculation import SpecConfig
from sglang_eagle3.kernels import decode as K
from sglang_eagle3.models.kvcache import KVPool


@dataclass
class DraftTree:
    tokens: torch.Tensor      # [B, N] target token ids; node 0 = root (last verified token)
    parents: torch.Tensor     # [B, N] parent node index, -1 for the root; parents precede children
    depth: torch.Tensor       # [B, N] 0 for the root
    mask: torch.Tensor        # [B, N, N] bool: row i = ancestors of i plus i
    positions: torch.Tensor   # [B, N] root position + depth
    row_nodes: Optional[torch.Tensor] = None   # [B] a ragged tree: row b's real nodes (its first, the root included),
                                               # then padding (parent -1, never reached); None: every row has N

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def mean_nodes(self) -> float:
        """Nodes per row the verify computes (the root included): what it costs."""
        return self.num_nodes if self.row_nodes is None else float(self.row_nodes.float().mean())

    @property
    def paths(self) -> torch.Tensor:
        """Retrieve paths [B, P, max_depth + 1]: root-to-leaf node indices per leaf, -1 padded (a ragged tree's
        padding is no leaf)."""
        B, N = self.parents.shape
        Dm = int(self.depth.max()) + 1
        by_depth = torch.full((B, N, Dm + 1), -1, dtype=torch.long, device=self.parents.device)
        slot = torch.where(self.mask, self.depth.unsqueeze(1), Dm)                      # [B, N, N]
        by_depth.scatter_(2, slot, torch.arange(N, device=slot.device).expand(B, N, N))
        by_depth = by_depth[..., :Dm]                                                    # [B, N, Dm] ancestors of i
        children = torch.zeros(B, N, dtype=torch.long, device=self.parents.device)     # [B, N] each node's children
        children.scatter_add_(1, self.parents.clamp(min=0), (self.parents >= 0).long())  # (a sum: the root's -1
        leaf = children == 0                                                             # and padding's add 0)
        if self.row_nodes is not None:                                                   # padding: no leaf
            leaf &= torch.arange(N, device=leaf.device) < self.row_nodes.view(B, 1)
        P = int(leaf.sum(1).max())
        order = torch.sort((~leaf).long(), dim=1, stable=True).indices[:, :P]          # leaves first, in order
        paths = torch.gather(by_depth, 1, order.unsqueeze(-1).expand(B, P, Dm))
        return torch.where(torch.gather(leaf, 1, order).unsqueeze(-1), paths, -1)


def build_draft_tree(cand_tokens, cand_scores, cand_parents, root_tokens, root_positions,
                     num_draft_tokens: int, row_nodes: Optional[list[int]] = None) -> DraftTree:
    """Select the best candidates and lay out the tree.

    cand_tokens, cand_scores, cand_parents [B, C]: candidates in creation order (a parent always comes
    before its children); parent -1 = the root. Picks the num_draft_tokens - 1 highest cumulative
    scores (stable: on ties the earlier candidate, hence the parent, wins, so the set is ancestor-closed).
    row_nodes (a ragged tree): row b takes its row_nodes[b] - 1 best, num_draft_tokens = max(row_nodes).
    """
    counts = None
    if row_nodes is not None and min(row_nodes) < num_draft_tokens:
        counts = torch.tensor(row_nodes, dtype=torch.long, device=cand_tokens.device)
    return DraftTree(*K.build_tree(cand_tokens, cand_scores, cand_parents, root_tokens, root_positions,
                                   num_draft_tokens, counts), row_nodes=counts)


def root_only_tree(root_tokens: torch.Tensor, root_positions: torch.Tensor) -> DraftTree:
    """Vanilla decoding: the tree is the last verified token alone."""
    B = root_tokens.shape[0]
    z = torch.zeros(B, 1, dtype=torch.long, device=root_tokens.device)
    return DraftTree(root_tokens.view(B, 1), z - 1, z, torch.ones(B, 1, 1, dtype=torch.bool, device=z.device),
                     root_positions.view(B, 1))


def pool_attend(pool: KVPool, rows: torch.Tensor, write_start: torch.Tensor, new_mask: torch.Tensor, scale: float):
    """attend(q, k, v) for the draft's single layer: store k/v at write_start.. of each row, attend over the
    row's committed slots plus the uncommitted ones new_mask [B, T, F] allows. attend.qkv(qkv, cos, sin, nH, nKV)
    does the same from the fused projection with the rotary embedding inside the kernel, and attend.pool holds
    these arguments for csrc's whole draft layer (the draft's fast paths)."""
    lens = pool.lens[rows]

    def attend(q, k, v):
        return K.tree_attention(q, k, v, pool.k[0], pool.v[0], rows, lens, write_start, new_mask, scale)

    def attend_qkv(qkv, cos, sin, num_heads: int, num_kv_heads: int):
        return K.qkv_attention(qkv, cos, sin, num_heads, num_kv_heads, pool.k[0], pool.v[0], rows, lens,
                               write_start, new_mask, scale)
    attend.qkv = attend_qkv
    attend.pool = (pool.k[0], pool.v[0], rows, lens, write_start, new_mask.contiguous(), scale)   # csrc's draft_layer
    return attend


def levels_needed(cand_scores: list[torch.Tensor], frontier_scores: torch.Tensor, num_draft_tokens: int) -> bool:
    """Can a deeper level still put a node into the tree? A node's score (cumulative log-prob) is at most its
    frontier ancestor's, and on equal scores the earlier candidate wins; so once every row has
    num_draft_tokens - 1 candidates scoring at least its best frontier node, nothing drafted below the frontier
    is ever selected: the tree is the same without the deeper levels (and their draft forwards).
    cand_scores: [B, k], [B, k*k], ... per level; frontier_scores [B, k]."""
    best = frontier_scores.max(-1, keepdim=True).values                        # [B, 1]
    ahead = sum((c >= best).sum(-1) for c in cand_scores)                      # [B] candidates it cannot beat
    return bool((ahead < num_draft_tokens - 1).any())


@dataclass
class Candidates:
    """Nodes a tree may take, per row, in creation order (a parent before its children)."""
    tokens: torch.Tensor        # [B, C] target token ids
    scores: torch.Tensor        # [B, C] log chance of acceptance (the draft's cumulative log-prob)
    parents: torch.Tensor       # [B, C] candidate index of the parent, -1 = the root
    from_context: torch.Tensor  # [B, C] bool: proposed by the context alone (not by the draft)
    drawn_from: Optional[torch.Tensor] = None   # [B, C] the q slot a sampled child was drawn from (-1: not drawn;
                                                # None: no row sampled its children)
    draft_q: Optional[torch.Tensor] = None      # [B, S, Vd] those q (sampled_tree.DraftSampler.probs)

    def finite(self) -> list[int]:
        """Real candidates per row (the rest is padding at -inf)."""
        return torch.isfinite(self.scores).sum(1).tolist()

    def context_nodes(self) -> int:
        """The most real candidates a row has that the context alone proposed."""
        return int(self.from_context.logical_and(torch.isfinite(self.scores)).sum(1).max())


@torch.no_grad()
def draft_candidates(draft, pool: KVPool, rows: torch.Tensor, first_hidden, first_logits, root_tokens,
                     root_positions, spec: SpecConfig, prune: bool = True, sampler=None) -> Candidates:
    """EAGLE-2's candidates for each row: the topk children of the spec.topk best frontier nodes, level by level.

    draft: Eagle3DraftModel. pool: its KV pool; rows [B] committed up to the root's position (exclusive).
    first_hidden [B, H]: draft output at the root's previous position; first_logits [B, draft_vocab]: its logits.
    root_tokens, root_positions [B]. prune (CPU): skip the levels that cannot change a tree of
    spec.num_draft_tokens nodes (levels_needed). sampler (sampled_tree.DraftSampler; None: every row greedy):
    picks each level's children instead of the topk likeliest (sampled rows draw theirs).
    """
    B, k = root_tokens.shape[0], spec.topk
    device = root_tokens.device
    scale = draft.config.head_dim ** -0.5
    if sampler is None:
        scores, draft_ids = K.topk_logprobs(first_logits, k)                   # [B, k] log-probs, draft ids
        cand_drawn = None
    else:
        scores, draft_ids, drawn = (x.view(B, k) for x in sampler.children(first_logits.unsqueeze(1), k))
        cand_drawn = [drawn]
    tokens = draft.draft_to_target(draft_ids)
    cand_tokens, cand_scores = [tokens], [scores]
    cand_parents = [torch.full((B, k), -1, dtype=torch.long, device=device)]
    frontier_ids = torch.arange(k, device=device).expand(B, k)                 # candidate index of each frontier node
    hidden = first_hidden.unsqueeze(1).expand(B, k, -1)                        # [B, k, H] parent hidden per node
    F = (spec.num_steps - 1) * k                                               # nodes the draft runs on
    if F:                                                                      # (none for a one-level tree)
        pool.check_room(rows, F)
        # fwd_mask [B, F, F]: forwarded node i sees forwarded node j (its ancestors and itself; the diagonal is
        # set now, each level fills its rows from its parents' rows)
        fwd_mask = torch.eye(F, dtype=torch.bool, device=device).expand(B, F, F).clone()
        batch = torch.arange(B, device=device).view(B, 1)
        lens = pool.lens[rows]
    offset, fwd_parent = k, None                                               # fwd_parent: set per level
    prune = prune and device.type == "cpu"                                     # (a host sync per level on GPUs)
    for step in range(1, spec.num_steps):
        if prune and not levels_needed(cand_scores, scores, spec.num_draft_tokens):
            break
        f0 = (step - 1) * k                                                    # this level's first forwarded slot
        if step > 1:
            fwd_mask[:, f0:f0 + k, :f0] = fwd_mask[batch, fwd_parent, :f0]     # parent's row (ancestors + parent)
        attend = pool_attend(pool, rows, lens + f0, fwd_mask[:, f0:f0 + k, :f0 + k], scale)
        positions = (root_positions + (step - 1)).view(B, 1).expand(B, k)
        out = draft(tokens, hidden, positions, attend=attend, fuse=False)      # [B, k, H] pre-norm
        if sampler is None:
            child_lp, child_ids = K.topk_logprobs(draft.compute_logits(out), k)  # [B, k, k] of [B, k, Vd] logits
        else:
            child_lp, child_ids, drawn = sampler.children(draft.compute_logits(out), k)
            cand_drawn.append(drawn.view(B, k * k))
        child_scores = (scores.unsqueeze(-1) + child_lp).view(B, k * k)
        child_tokens = draft.draft_to_target(child_ids).view(B, k * k)
        cand_tokens.append(child_tokens)
        cand_scores.append(child_scores)
        cand_parents.append(frontier_ids.unsqueeze(-1).expand(B, k, k).reshape(B, k * k))
        # next frontier: the k best children
        scores, best = child_scores.topk(k, dim=-1)
        tokens = torch.gather(child_tokens, 1, best)
        frontier_ids = offset + best
        parent = best // k                                                     # [B, k] index in this level
        hidden = draft.next_hidden(out)[batch, parent]                         # what the children read
        fwd_parent = f0 + parent
        offset += k * k
    tokens = torch.cat(cand_tokens, 1)
    return Candidates(tokens, torch.cat(cand_scores, 1), torch.cat(cand_parents, 1),
                      torch.zeros_like(tokens, dtype=torch.bool),
                      None if sampler is None else torch.cat(cand_drawn, 1), None if sampler is None else sampler.probs)


def chain_candidates(proposals: list[list[tuple[list[int], list[float]]]], device) -> Candidates:
    """Candidates of chains proposed by the context. proposals[b]: row b's chains, each (tokens after the root, the
    cumulative log chance of each). Chains that share a start share its candidates (each at the higher of their
    scores: scores still fall from parent to child); siblings stay distinct."""
    rows = []
    for chains in proposals:
        tokens, scores, parents, child = [], [], [], {}
        for chain, chances in chains:
            at = -1
            for token, score in zip(chain, chances):
                at = _add_child(tokens, scores, parents, child, at, token, score)
        rows.append((tokens, scores, parents, [True] * len(tokens), [-1] * len(tokens)))
    return _padded(rows, device)


def merge_candidates(base: Candidates, extra: Candidates) -> Candidates:
    """base's candidates with extra's merged in (a hybrid step: the draft's and the context's). An extra node whose
    path base already holds raises that candidate's score to its own where higher (any top-N set stays closed under
    ancestors); the others follow base's, keeping extra's from_context flag; siblings stay distinct. A sampled
    child of base is never merged into: its score must not depend on the token drawn (sampled_tree), so extra's
    nodes stay beside it (extra must not be sampled)."""
    merged = []
    for (tokens, scores, parents, context, drawn), extra_row in zip(_lists(base), _lists(extra)):
        child = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if math.isfinite(scores[i])
                 and drawn[i] < 0}
        at: dict[int, int] = {-1: -1}                                     # extra's index -> merged index
        for j, (token, score, parent, flag, _) in enumerate(zip(*extra_row)):
            if math.isfinite(score):                                      # (not padding)
                at[j] = _add_child(tokens, scores, parents, child, at[parent], token, score)
                if at[j] == len(context):                                 # a new candidate
                    context.append(flag)
                    drawn.append(-1)
        merged.append((tokens, scores, parents, context, drawn))
    return _padded(merged, base.tokens.device, base.draft_q)


def _add_child(tokens: list, scores: list, parents: list, child: dict, parent: int, token: int, score: float) -> int:
    """The candidate for `token` under `parent`: the one already there (its score raised to `score` where lower), else
    a new one. -> its index."""
    i = child.get((parent, token))
    if i is None:
        i = child[(parent, token)] = len(tokens)
        tokens.append(token)
        scores.append(score)
        parents.append(parent)
    else:
        scores[i] = max(scores[i], score)
    return i


def _lists(c: Candidates) -> list[tuple[list, list, list, list, list]]:
    drawn = c.drawn_from if c.drawn_from is not None else torch.full_like(c.tokens, -1)
    return list(zip(c.tokens.tolist(), c.scores.tolist(), c.parents.tolist(), c.from_context.tolist(),
                    drawn.tolist()))


def _padded(rows: list[tuple[list, list, list, list, list]], device,
            draft_q: Optional[torch.Tensor] = None) -> Candidates:
    """Per-row lists -> Candidates, rows padded to one width with candidates at -inf (drawn_from kept where draft_q
    holds the q they were drawn from)."""
    width = max(1, max(len(r[0]) for r in rows))
    pad = [(t + [0] * (width - len(t)), s + [-math.inf] * (width - len(s)), p + [-1] * (width - len(p)),
            c + [True] * (width - len(c)), d + [-1] * (width - len(d))) for t, s, p, c, d in rows]
    return Candidates(torch.tensor([r[0] for r in pad], dtype=torch.long, device=device),
                      torch.tensor([r[1] for r in pad], dtype=torch.float32, device=device),
                      torch.tensor([r[2] for r in pad], dtype=torch.long, device=device),
                      torch.tensor([r[3] for r in pad], dtype=torch.bool, device=device),
                      None if draft_q is None else torch.tensor([r[4] for r in pad], dtype=torch.long, device=device),
                      draft_q)


def sorted_scores(cands: Candidates) -> list[list[float]]:
    """Each row's real candidates' scores, best first (the order a tree takes them in)."""
    return [[x for x in row if math.isfinite(x)] for row in torch.sort(cands.scores, dim=1, descending=True)
            .values.tolist()]


def chosen_candidates(cands: Candidates, num_nodes: int, row_nodes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The candidates a tree of num_nodes nodes takes (build_draft_tree's choice), [B, num_nodes - 1] in creation
    order: tree node i + 1 is candidate [b, i]. row_nodes [B] (a ragged tree): row b's first row_nodes[b] - 1, then
    -1 for its padding."""
    order = torch.sort(cands.scores, dim=1, descending=True, stable=True).indices[:, :num_nodes - 1]
    if row_nodes is None:
        return torch.sort(order, dim=1).values
    C = cands.scores.shape[1]
    real = torch.arange(order.shape[1], device=order.device).view(1, -1) < (row_nodes.view(-1, 1) - 1)
    chosen = torch.sort(torch.where(real, order, C), dim=1).values
    return torch.where(real, chosen, -1)


def gather_candidates(values: torch.Tensor, chosen: torch.Tensor, padding) -> torch.Tensor:
    """values [B, C] of the chosen candidates [B, n] (-1: padding, which gets `padding`)."""
    return torch.where(chosen >= 0, torch.gather(values, 1, chosen.clamp(min=0)), padding)


def tree_of(cands: Candidates, root_tokens, root_positions, num_nodes: int, row_nodes: Optional[list[int]] = None,
            chosen: Optional[torch.Tensor] = None) -> tuple[DraftTree, torch.Tensor]:
    """The tree of the num_nodes - 1 best candidates (num_nodes - 1 <= every row's real candidates; a ragged tree:
    row b's row_nodes[b] - 1 best, num_nodes = max(row_nodes)) and, per node, whether the context alone proposed it
    ([B, num_nodes] bool; the root and padding: False). chosen: chosen_candidates' answer, where the caller has it."""
    have = cands.finite()
    wanted = [num_nodes] * len(have) if row_nodes is None else row_nodes
    short = [b for b, n in enumerate(wanted) if n - 1 > have[b]]
    if short:
        b = short[0]
        raise ValueError(f"a tree of {wanted[b]} nodes needs {wanted[b] - 1} candidates in row {b}, it has {have[b]}")
    tree = build_draft_tree(cands.tokens, cands.scores, cands.parents, root_tokens, root_positions, num_nodes,
                            row_nodes)
    if chosen is None:
        chosen = chosen_candidates(cands, num_nodes, tree.row_nodes)
    context = gather_candidates(cands.from_context, chosen, False)
    return tree, torch.cat([torch.zeros_like(context[:, :1]), context], 1)
