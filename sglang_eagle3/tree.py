"""EAGLE-2 dynamic draft tree, with SGLang's parameter semantics.

num_steps: depth (levels of draft tokens below the root); topk: children expanded per frontier node;
num_draft_tokens: tokens verified per step *including* the root (the last verified token).

Step 1 uses the draft's output from the extend over the target's fused features; each later step
runs the draft on the `topk` best frontier nodes, feeding the draft's own hidden output with the
chosen token's embedding. Every expanded child is a candidate scored by its cumulative log-prob;
the best num_draft_tokens - 1 candidates (always closed under ancestors) form the tree.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import SpecConfig
from .kvcache import KVCache, cache_attend, cache_attention_mask


@dataclass
class DraftTree:
    tokens: torch.Tensor      # [B, N] target token ids; node 0 = root (last verified token)
    parents: torch.Tensor     # [B, N] parent node index, -1 for the root
    depth: torch.Tensor       # [B, N] 0 for the root
    mask: torch.Tensor        # [B, N, N] bool: row i = ancestors of i plus i
    positions: torch.Tensor   # [B, N] root position + depth
    paths: torch.Tensor       # [B, P, max_depth + 1] root-to-leaf node indices, -1 padded

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


def build_draft_tree(cand_tokens, cand_scores, cand_parents, root_tokens, root_positions, num_draft_tokens) -> DraftTree:
    """Select the best candidates and lay out the tree.

    cand_tokens, cand_scores, cand_parents [B, C]: candidates in creation order (a parent always comes
    before its children); parent -1 = the root. Picks the num_draft_tokens - 1 highest cumulative
    scores (stable: on ties the earlier candidate, hence the parent, wins, so the set is ancestor-closed).
    """
    B, C = cand_tokens.shape
    n = min(num_draft_tokens - 1, C)
    order = torch.sort(cand_scores, dim=1, descending=True, stable=True).indices[:, :n]
    chosen = torch.sort(order, dim=1).values                                   # [B, n] creation order
    node_of = torch.full((B, C + 1), -1, dtype=torch.long, device=cand_tokens.device)   # candidate -> node
    node_of.scatter_(1, chosen, torch.arange(1, n + 1, device=cand_tokens.device).expand(B, n))
    node_of[:, C] = 0                                                          # parent -1 (index C) -> root
    par_cand = torch.gather(cand_parents, 1, chosen)
    parents = torch.gather(node_of, 1, torch.where(par_cand < 0, C, par_cand))
    if (parents < 0).any():
        raise AssertionError("draft tree selection is not closed under ancestors")
    N = n + 1
    parents = torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=parents.device), parents], 1)
    tokens = torch.cat([root_tokens.view(B, 1), torch.gather(cand_tokens, 1, chosen)], 1)
    mask = torch.eye(N, dtype=torch.bool, device=tokens.device).repeat(B, 1, 1)
    depth = torch.zeros(B, N, dtype=torch.long, device=tokens.device)
    rows = torch.arange(B, device=tokens.device)
    for i in range(1, N):                                                      # parents precede children
        p = parents[:, i]
        mask[:, i] |= mask[rows, p]
        depth[:, i] = depth[rows, p] + 1
    return DraftTree(tokens, parents, depth, mask, root_positions.view(B, 1) + depth, _leaf_paths(parents, depth))


def _leaf_paths(parents: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    B, N = parents.shape
    is_parent = torch.zeros(B, N, dtype=torch.bool, device=parents.device)
    is_parent.scatter_(1, parents[:, 1:].clamp(min=0), True)
    leaves = ~is_parent
    P, Dm = int(leaves.sum(1).max()), int(depth.max()) + 1
    paths = torch.full((B, P, Dm), -1, dtype=torch.long)
    par, dep, lv = parents.tolist(), depth.tolist(), leaves.tolist()
    for b in range(B):
        for j, leaf in enumerate(i for i in range(N) if lv[b][i]):
            node = leaf
            while node >= 0:
                paths[b, j, dep[b][node]] = node
                node = par[b][node]
    return paths.to(parents.device)


@torch.no_grad()
def grow_tree(draft, cache: KVCache, first_hidden, first_logits, root_tokens, root_positions,
              spec: SpecConfig) -> DraftTree:
    """Draft a tree for each sequence.

    draft: Eagle3DraftModel. cache: its KV cache, committed up to the root's position (exclusive).
    first_hidden [B, H]: draft output at the root's previous position; first_logits [B, draft_vocab]: its logits.
    root_tokens, root_positions [B].
    """
    B, k = root_tokens.shape[0], spec.topk
    device = root_tokens.device
    logp = torch.log_softmax(first_logits.float(), -1)
    scores, draft_ids = logp.topk(k, dim=-1)                                   # [B, k]
    tokens = draft.draft_to_target(draft_ids)
    cand_tokens, cand_scores = [tokens], [scores]
    cand_parents = [torch.full((B, k), -1, dtype=torch.long, device=device)]
    frontier_ids = torch.arange(k, device=device).expand(B, k)                 # candidate index of each frontier node
    hidden = first_hidden.unsqueeze(1).expand(B, k, -1)                        # [B, k, H] parent hidden per node
    fwd_mask = torch.zeros(B, 0, 0, dtype=torch.bool, device=device)           # among forwarded nodes
    fwd_parent = torch.full((B, k), -1, dtype=torch.long, device=device)       # forwarded slot of each node's parent
    offset = k
    for step in range(1, spec.num_steps):
        F_prev = fwd_mask.shape[1]
        # new rows: parent's row + self
        rows = torch.zeros(B, k, F_prev + k, dtype=torch.bool, device=device)
        has_parent = fwd_parent >= 0
        if F_prev:
            rows[:, :, :F_prev] = torch.gather(fwd_mask, 1, fwd_parent.clamp(min=0).unsqueeze(-1).expand(B, k, F_prev)) \
                & has_parent.unsqueeze(-1)
        rows[:, :, F_prev:] = torch.eye(k, dtype=torch.bool, device=device)
        fwd_mask = torch.cat([torch.nn.functional.pad(fwd_mask, (0, k)), rows], 1)   # [B, F, F]
        slot = cache.lens.view(B, 1) + F_prev + torch.arange(k, device=device).view(1, k)
        S = cache.check_room(F_prev + k)
        mask = cache_attention_mask(cache.lens, rows, S)
        positions = (root_positions - 1 + step).view(B, 1).expand(B, k)
        out = draft(tokens, hidden, positions, attend=cache_attend(cache, 0, slot, mask), fuse=False)   # [B, k, H]
        logp = torch.log_softmax(draft.compute_logits(out).float(), -1)        # [B, k, Vd]
        child_lp, child_ids = logp.topk(k, dim=-1)                             # [B, k, k]
        child_scores = (scores.unsqueeze(-1) + child_lp).view(B, k * k)
        child_tokens = draft.draft_to_target(child_ids).view(B, k * k)
        cand_tokens.append(child_tokens)
        cand_scores.append(child_scores)
        cand_parents.append(frontier_ids.repeat_interleave(k, dim=1))
        # next frontier: the k best children
        scores, best = child_scores.topk(k, dim=-1)
        tokens = torch.gather(child_tokens, 1, best)
        frontier_ids = offset + best
        hidden = torch.gather(out, 1, (best // k).unsqueeze(-1).expand(B, k, out.shape[-1]))
        fwd_parent = F_prev + best // k
        offset += k * k
    return build_draft_tree(torch.cat(cand_tokens, 1), torch.cat(cand_scores, 1), torch.cat(cand_parents, 1),
                            root_tokens, root_positions, spec.num_draft_tokens)
