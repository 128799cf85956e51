"""Training-time test (TTT): EAGLE-3's multi-step draft loss in one pass per step.

Notation for one sequence x_0 .. x_{T-1}. The target gives, at every position t, fused features
aux_t (the inputs of three layers) and its last hidden state h_t *after the final norm*, so that
logits_t = lm_head(h_t) is the target's distribution of x_{t+1}.

Step 0 pairs feature t with the next data token x_{t+1} (RoPE position t) and predicts x_{t+2},
i.e. it is trained against the target's softmax at position t+1. Step k feeds, at the same base
position t, the draft's own step k-1 output (pre-norm hidden) with the data token x_{t+k+1} at RoPE
position t+k and is trained against the target's softmax at position t+k+1. This is exactly what
the draft sees at inference after the target verified x_{t+1}: the chain grows one token per step
(engine/tree.py uses position root-1+depth), except that training feeds data tokens, not samples.

Attention of step k at base position t: the step-0 keys at positions <= t (causal, real features)
plus the keys of steps 1..k at position t only (the chain's own earlier steps). The second part is a
"diagonal": it is scored with one einsum against the stacked per-step keys, concatenated to the
causal scores and normalised with a single softmax, so memory is O(T*T + T*steps) per step instead
of O(T*T*steps) for an explicit [T*steps, T*steps] mask. Step 0 runs every position (its keys are the
context of every later query); steps k >= 1 run only the chains some step >= k still scores, so a chain that
would end inside a prompt costs one step, not seven (a third fewer draft-layer positions on real chat rows).

Step loss: soft cross-entropy against the target's softmax restricted to the draft vocabulary
(target logits gathered at the draft's target ids, then softmax), over positions whose loss_mask
is set and whose target argmax is in the draft vocabulary; total = sum_k decay^k * loss_k.
target_temperature (sharpen_target) trains against softmax(target logits / T) instead: 0 is the hard label,
the target's greedy pick (what T=0 serving accepts), 1 (default) the references' soft target.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang_eagle3.kernels import decode as kernels
from sglang_eagle3.kernels import extension
from sglang_eagle3.kernels.training import draft_vocab_distribution, soft_cross_entropy, wide_dtype
from sglang_eagle3.models.draft import linear_rows

FEATURES = ("fused", "top")


@torch.no_grad()
def target_distribution(last_hidden: torch.Tensor, lm_head: nn.Module, draft_ids: torch.Tensor):
    """last_hidden [..., Ht] (post final norm) -> (p [..., Vd] softmax over the draft vocab, top [...] target ids)."""
    w = lm_head.weight
    return draft_vocab_distribution(linear_rows(lm_head, last_hidden.to(w.dtype)), draft_ids)   # bf16 under autocast


def sharpen_target(p: torch.Tensor, temperature: float) -> torch.Tensor:
    """p [N, Vd] (softmax of the target's logits) -> softmax(logits / temperature) = softmax(log p / T) (log p is
    the logits up to a per-row constant; in log space, so a small T cannot underflow every entry of p^(1/T) to 0);
    temperature 0: one-hot at p's argmax (the target's greedy pick); 1: p itself."""
    if temperature < 0:
        raise ValueError(f"target_temperature must be >= 0, got {temperature}")
    if temperature == 1:
        return p
    if temperature == 0:
        return torch.zeros_like(p).scatter_(-1, p.argmax(-1, keepdim=True), 1.0)
    return torch.softmax(p.log() / temperature, -1)         # p == 0 -> -inf -> 0; the row's max is finite


class TTTAttention:
    """attend(q, k, v) for TTT: call once per step, in order (step 0 first).

    Step 0 receives q/k/v for every base position. Step k >= 1 receives them for the base positions
    `select(cols)` named before its call (sorted; shrinking with k: a chain that no later step scores is not
    grown further; without select, every base position). key_valid [B, T] bool: real (non-padding) keys of step 0.
    row_lengths (B == 1 only):
    the lengths of the rows packed into the sequence; attention stays inside each row (one block each,
    so memory is the sum of the rows' squares, as when they run one by one).
    """

    def __init__(self, key_valid: torch.Tensor, row_lengths: Optional[list[int]] = None):
        self.key_valid = key_valid.bool()
        self.keys: list[torch.Tensor] = []     # per step [B, nKV, T_j, D] (T_j: step j's base positions)
        self.values: list[torch.Tensor] = []
        self.cols: list[Optional[torch.Tensor]] = []   # per step: its base positions [T_j] (None: all, step 0)
        self.query_cols: Optional[torch.Tensor] = None
        T = key_valid.shape[1]
        ends = torch.tensor(row_lengths or [T]).cumsum(0).tolist()
        self.bounds = list(zip([0] + ends[:-1], ends))     # [start, end) of each packed row
        self._blocked: dict[int, torch.Tensor] = {}    # row start -> ~causal_allowed, built once per row

    def select(self, cols: torch.Tensor) -> None:
        """The next step's queries are the base positions cols [T_k] (sorted, a subset of the last step's)."""
        self.query_cols = cols

    def blocked(self, start: int, end: int) -> torch.Tensor:
        """~causal_allowed(start, end), built at step 0; later steps read its top-left corner (their queries
        and keys end earlier, and a prefix of a row's mask is the mask of the prefix)."""
        full = self._blocked.get(start)
        if full is None or full.shape[-1] < end - start:
            full = ~self.causal_allowed(start, end)
            self._blocked[start] = full
        L = end - start
        return full[..., :L, :L]

    def causal_allowed(self, start: int, end: int) -> torch.Tensor:
        """[B, 1, 1, L, L] bool over positions start..end-1: key s <= query t and s is a real token (a query
        always sees itself)."""
        L = end - start
        idx = torch.arange(L, device=self.key_valid.device)
        causal = idx.view(L, 1) >= idx.view(1, L)
        allowed = causal & (self.key_valid[:, None, start:end] | torch.eye(L, dtype=torch.bool, device=idx.device))
        return allowed[:, None, None]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cols = None
        if self.keys:                                                      # step >= 1: selected (default all)
            cols = self.query_cols if self.query_cols is not None else torch.arange(q.shape[2], device=q.device)
        self.keys.append(k)
        self.values.append(v)
        self.cols.append(cols)
        if cols is None:                                                   # step 0: every base position
            T = q.shape[2]
            blocks = [self._attend(q[:, :, s:min(e, T)], s, min(e, T)) for s, e in self.bounds if s < T]
            return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)
        # Earlier steps' keys at these base positions: their rows in each step's own (larger) selection.
        at = [torch.searchsorted(c, cols) for c in self.cols[1:-1]] + [torch.arange(len(cols), device=cols.device)]
        edges = torch.searchsorted(cols, torch.tensor([b for se in self.bounds for b in se], device=cols.device))
        edges = edges.view(-1, 2).tolist()                                 # [rows, 2] query range per packed row
        blocks = [self._attend(q[:, :, i0:i1], s, int(cols[i1 - 1]) + 1, cols[i0:i1] - s,
                               [a[i0:i1] for a in at])
                  for (s, _), (i0, i1) in zip(self.bounds, edges) if i1 > i0]
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)

    def _attend(self, q: torch.Tensor, start: int, end: int, rows: Optional[torch.Tensor] = None,
                diag_at: Optional[list] = None) -> torch.Tensor:
        """Queries [B, nH, Lq, D] of base positions start..end-1 (rows: which of them, relative to start;
        None: all) against the step-0 keys of start..end-1 and, at their own position, the later steps' keys
        (diag_at: per step >= 1, the rows of its keys for these queries; None at step 0)."""
        B, nH, Lq, D = q.shape
        L = end - start
        nKV = self.keys[0].shape[1]
        q = q.reshape(B, nKV, nH // nKV, Lq, D) * D ** -0.5                # [B, nKV, g, Lq, D]
        k0, v0 = self.keys[0][:, :, start:end], self.values[0][:, :, start:end]   # [B, nKV, L, D]
        scores = torch.einsum("bngtd,bnsd->bngts", q, k0)                     # [B, nKV, g, Lq, L]
        blocked = self.blocked(start, end)
        scores = scores.masked_fill(blocked if rows is None else blocked[..., rows, :], float("-inf"))
        if diag_at:
            # [B, nKV, k, Lq, D]
            kd = torch.stack([kj.index_select(2, a) for kj, a in zip(self.keys[1:], diag_at)], dim=2)
            vd = torch.stack([vj.index_select(2, a) for vj, a in zip(self.values[1:], diag_at)], dim=2)
            diag = torch.einsum("bngtd,bnjtd->bngtj", q, kd)                  # [B, nKV, g, Lq, k]
            scores = torch.cat([scores, diag], dim=-1)                        # [B, nKV, g, Lq, L + k]
        probs = scores.softmax(-1, dtype=wide_dtype(q.dtype)).to(q.dtype)
        out = torch.einsum("bngts,bnsd->bngtd", probs[..., :L], v0)
        if diag_at:
            out = out + torch.einsum("bngtj,bnjtd->bngtd", probs[..., L:], vd)
        return out.reshape(B, nH, Lq, D)




@dataclass
class TTTOutput:
    """Loss plus summable counters (add them over batches / ranks, then call `metrics`)."""
    loss: torch.Tensor            # scalar, differentiable
    step_loss: torch.Tensor       # [K] detached per-step losses (0 where a step had no valid position)
    step_correct: torch.Tensor    # [K] positions where draft argmax == target argmax
    step_count: torch.Tensor      # [K] positions scored for accuracy (loss_mask at the predicted token)
    accept_sum: torch.Tensor      # scalar: sum over chain starts of consecutive correct steps
    accept_count: torch.Tensor    # scalar: number of chain starts
    feature_loss: Optional[torch.Tensor] = None

    def counters(self) -> torch.Tensor:
        """[2K + 2] float64 vector for all-reduce: correct, count, accept_sum, accept_count."""
        return torch.cat([self.step_correct, self.step_count,
                          self.accept_sum.view(1), self.accept_count.view(1)]).double()


def metrics_from_counters(c: torch.Tensor) -> dict:
    """acc_0..acc_{K-1} and the simulated acceptance length (1 bonus token + accepted draft tokens)."""
    K = (c.numel() - 2) // 2
    correct, count = c[:K], c[K:2 * K]
    out = {f"acc_{k}": float(correct[k] / count[k]) if count[k] > 0 else float("nan") for k in range(K)}
    out["accept_length"] = 1.0 + float(c[2 * K] / c[2 * K + 1]) if c[2 * K + 1] > 0 else float("nan")
    return out


def _features(draft, aux_hidden_states, last_hidden, features: str) -> torch.Tensor:
    if features not in FEATURES:
        raise ValueError(f"features={features!r}; expected one of {FEATURES}")
    x = last_hidden if features == "top" else aux_hidden_states
    if x.shape[-1] != draft.fc.in_features:
        name = "last_hidden" if features == "top" else "aux_hidden_states"
        raise ValueError(f"{name} has {x.shape[-1]} features but the draft's fc reads {draft.fc.in_features} "
                         f"(aux_layer_ids={draft.config.aux_layer_ids}, features={features!r})")
    # Always project here: with one aux layer and Ht == H the draft could not tell features from hidden.
    return draft.project(x)                                     # [B, T, H]


def ttt_forward(draft, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux_hidden_states: Optional[torch.Tensor],
                last_hidden: torch.Tensor, attention_mask: Optional[torch.Tensor], lm_head: nn.Module,
                ttt_length: int = 7, step_decay: float = 0.8, features: str = "fused",
                feature_loss_weight: float = 0.0, loss_mask_offset: int = 1, fused_ce: bool = True,
                row_lengths: Optional[list[int]] = None, grow_every_chain: Optional[bool] = None,
                target_temperature: float = 1.0) -> TTTOutput:
    """EAGLE-3 training-time test on one batch.

    input_ids, loss_mask, attention_mask [B, T] (right padding); aux_hidden_states [B, T, n_aux*Ht];
    last_hidden [B, T, Ht] after the target's final norm; lm_head: the target's (frozen).
    features="top" feeds last_hidden instead of the fused aux features (the draft's fc must read Ht).
    feature_loss_weight > 0 adds smooth-L1(step-0 draft hidden at t, target last hidden at t+1).
    fused_ce: the one-pass soft cross-entropy (False: log_softmax, multiply, sum; same values, slower).
    loss_mask_offset: step k at base position t is scored where loss_mask[t + k + offset] is set. 1 (ours):
    the mask of the position whose target distribution is learned, i.e. exactly the chains the engine drafts
    after an accepted assistant token; 0: the EAGLE-3 authors' and SpecForge's convention (one earlier).
    row_lengths: B == 1 holds these rows packed end to end (no padding). Each row keeps its own RoPE positions
    and attention, chains never cross into the next row, and the loss is the mean over rows of each row's own
    loss: the same loss and gradients as the rows run one by one and averaged (gradient accumulation), with
    R times larger matrix products.
    Steps k >= 1 grow only the chains some later step scores (chains_to_grow: a chain ending in a prompt is
    dropped after step 0); grow_every_chain=True grows all of them (the same loss, more FLOPs, no gathers);
    None: grow_every_chain_default(device).
    target_temperature: the distribution each step learns is softmax(target logits / T) over the draft vocab
    (sharpen_target; 0: one-hot at the target's pick); accuracies always count the target's own argmax.
    """
    B, T = input_ids.shape
    dev = input_ids.device
    if T < 2:
        raise ValueError(f"training rows need at least 2 tokens (a feature and the next token), got T={T}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if loss_mask_offset not in (0, 1):
        raise ValueError(f"loss_mask_offset must be 0 or 1, got {loss_mask_offset}")
    valid = loss_mask.bool() & attention_mask.bool()                       # [B, T] token may be predicted
    row_id, positions = _packed_rows(row_lengths, B, T, dev)               # [B, T] each, row_id None: unpacked
    # Only positions some step scores or counts need the target's distribution and the draft's logits
    # (prompt tokens, padding and the tail of cut rows do not): gather them once, skip the rest.
    needed = valid.clone()                                                 # [B, T] target position s
    if loss_mask_offset == 0:
        needed[:, 1:] |= valid[:, :-1]                                     # gated by the mask one earlier
    draft_ids = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size, device=dev))
    p_needed, top_needed = target_distribution(last_hidden[needed], lm_head, draft_ids)   # [N, Vd], [N]
    p_needed = sharpen_target(p_needed, target_temperature)
    row_of = torch.zeros(B, T, dtype=torch.long, device=dev)               # [B, T] -> row of p_needed
    row_of[needed] = torch.arange(p_needed.shape[0], device=dev)
    top = torch.full((B, T), -1, dtype=torch.long, device=dev)             # target's pick (-1: not needed)
    top[needed] = top_needed
    in_vocab = torch.zeros(B, T, dtype=torch.bool, device=dev)             # target's pick is draftable
    in_vocab[needed] = draft.t2d[top_needed]

    hidden = _features(draft, aux_hidden_states, last_hidden, features)    # [B, T, H]
    attend = TTTAttention(attention_mask.bool(), row_lengths)
    num_rows = len(row_lengths) if row_lengths is not None else B
    zero = torch.zeros((), device=dev)
    total, feat_loss = zero, None
    step_loss, step_correct, step_count = [], [], []
    alive = None                                                           # [B, T_k] chain still accepted
    accept_sum, accept_count = zero.clone(), zero.clone()
    if grow_every_chain is None:
        grow_every_chain = grow_every_chain_default(dev)
    grown = chains_to_grow(torch.ones_like(needed) if grow_every_chain else needed, ttt_length)   # step k's bases
    for k in range(ttt_length):
        n = T - k - 1                                                      # base positions with a token x_{t+k+1}
        cols = grown[k]                                                    # [T_k] (None: all n, step 0)
        if n <= 0 or (cols is not None and cols.numel() == 0):
            step_loss.append(zero), step_correct.append(zero), step_count.append(zero)
            continue
        if cols is None:
            pick = slice(None, n)                                          # base positions of this step
        else:
            prev = cols if grown[k - 1] is None else torch.searchsorted(grown[k - 1], cols)   # rows of step k-1
            hidden, alive = hidden.index_select(1, prev), alive[:, prev]   # index_select: a fast backward
            attend.select(cols)
            pick = cols
        h = draft(input_ids[:, k + 1:][:, pick], hidden[:, :n] if cols is None else hidden,
                  positions[:, pick] + k, attend=attend)                   # [B, T_k, H]
        sel, v = needed[:, k + 1:][:, pick], valid[:, k + 1:][:, pick]     # [B, T_k] positions with logits / counted
        row_of_base = None
        if row_id is not None:                                             # packed: no chain runs into the next row
            row_of_base = row_id[:, pick]
            in_row = row_of_base == row_id[:, k + 1:][:, pick]
            sel, v = sel & in_row, v & in_row
        logits = draft.compute_logits(h[sel])                              # [S, Vd]
        p_rows = row_of[:, k + 1:][:, pick][sel]                           # [S] rows of p_needed
        if fused_ce:
            ce = soft_cross_entropy(logits, p_needed, p_rows)              # [S]
        else:
            ce = -(p_needed[p_rows] * logits.to(wide_dtype(logits.dtype)).log_softmax(-1)).sum(-1)
        off = k + loss_mask_offset
        m = (valid[:, off:off + n] & in_vocab[:, k + 1:])[:, pick][sel].float()   # [S] positions the loss scores
        loss_k = _mean_loss(ce * m, m, None if row_of_base is None else row_of_base[sel], num_rows)
        total = total + step_decay ** k * loss_k
        if k == 0 and feature_loss_weight > 0:
            wide = wide_dtype(h.dtype)
            fl = F.smooth_l1_loss(h.to(wide), last_hidden[:, 1:].to(wide), reduction="none").mean(-1)   # [B, n]
            feat_loss = _mean_loss(fl[v], torch.ones_like(fl[v]), None if row_of_base is None else row_of_base[v],
                                   num_rows)
            total = total + feature_loss_weight * feat_loss
        with torch.no_grad():
            ok = torch.zeros_like(sel)                                     # [B, T_k] draft's pick == target's
            ok[sel] = draft_ids[kernels.argmax(logits)] == top[:, k + 1:][:, pick][sel]
            step_loss.append(loss_k.detach())
            step_correct.append((ok & v).sum().float())
            step_count.append(v.sum().float())
            alive = (ok & v) if alive is None else (alive & ok & v)
            if k == 0:
                accept_count = v.sum().float()
            accept_sum = accept_sum + alive.sum().float()
        hidden = draft.next_hidden(h)                                       # EAGLE-3.1: normed
    return TTTOutput(total, torch.stack(step_loss), torch.stack(step_correct), torch.stack(step_count),
                     accept_sum, accept_count, None if feat_loss is None else feat_loss.detach())


def grow_every_chain_default(device: torch.device) -> bool:
    """Whether TTT's later steps grow every chain by default: on CPUs with AMX (oneDNN's tile kernels make the
    extra matrix products cheap, and selecting the scored chains costs gathers and scatters that do not get
    faster; bench_trainer: packed bf16 936 vs 746 tokens/s) yes; elsewhere (AVX-512 CPUs, GPUs) only the
    chains a later step scores (1.13x faster than every chain on a 2-core AVX-512 BF16 CPU)."""
    return device.type == "cpu" and "amx_bf16" in extension.cpu_flags()


def chains_to_grow(needed: torch.Tensor, ttt_length: int) -> list[Optional[torch.Tensor]]:
    """needed [B, T] (positions whose target distribution a step may score) -> per step k the base positions
    [T_k] whose chain step k must grow: some step j >= k scores position t + j + 1 (in any row of the batch).
    Step 0 (None) runs every position: its keys are every later query's context. The sets shrink with k, and
    a chain no later step scores is dropped: prompt tokens cost step 0 only."""
    T = needed.shape[1]
    grown: list[Optional[torch.Tensor]] = [None] * ttt_length
    later = None                                                           # [B, T_{k+1}] scored at a step > k
    for k in range(ttt_length - 1, 0, -1):
        n = T - k - 1
        if n <= 0:
            continue
        scored = needed[:, k + 1:].clone()                                 # [B, n] step k's own
        if later is not None:
            scored[:, :later.shape[1]] |= later
        later = scored
        grown[k] = scored.any(0).nonzero().squeeze(1)
    return grown


def _packed_rows(row_lengths: Optional[list[int]], B: int, T: int, dev) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """-> (row_id [B, T] or None when unpacked, RoPE positions [B, T] restarting at every packed row)."""
    if row_lengths is None:
        return None, torch.arange(T, device=dev).expand(B, T)
    if B != 1 or sum(row_lengths) != T or min(row_lengths) < 2:
        raise ValueError(f"row_lengths {list(row_lengths)} must be >= 2 each and sum to T={T} of one packed row "
                         f"(B={B})")
    lengths = torch.tensor(row_lengths, device=dev)
    row_id = torch.repeat_interleave(torch.arange(len(row_lengths), device=dev), lengths)          # [T]
    starts = lengths.cumsum(0) - lengths
    return row_id.view(1, T), (torch.arange(T, device=dev) - starts[row_id]).view(1, T)


def _mean_loss(weighted: torch.Tensor, weight: torch.Tensor, row_of: Optional[torch.Tensor] = None,
               num_rows: int = 1) -> torch.Tensor:
    """sum(weighted) / sum(weight) [S] -> scalar; packed rows (row_of [S] in 0..num_rows-1): the mean over all rows
    of each row's own (a row with nothing scored counts 0, as when it runs alone)."""
    if row_of is None:
        return weighted.sum() / weight.sum().clamp(min=1.0)
    num = torch.zeros(num_rows, dtype=weighted.dtype, device=weighted.device).index_add(0, row_of, weighted)
    den = torch.zeros(num_rows, dtype=weight.dtype, device=weight.device).index_add(0, row_of, weight)
    return (num / den.clamp(min=1.0)).mean()


def ttt_batch(draft, batch: dict, lm_head: nn.Module, **kw) -> TTTOutput:
    """ttt_forward on a collated batch dict (input_ids, loss_mask, attention_mask, aux_hidden_states, last_hidden,
    and row_lengths [R] when the rows are packed into one sequence)."""
    lengths = batch.get("row_lengths")
    return ttt_forward(draft, batch["input_ids"], batch["loss_mask"], batch.get("aux_hidden_states"),
                       batch["last_hidden"], batch.get("attention_mask"), lm_head,
                       row_lengths=None if lengths is None else lengths.tolist(), **kw)
