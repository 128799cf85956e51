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
would end inside a prompt costs one step, not seven.

Step loss: soft cross-entropy against the target's softmax restricted to the draft vocabulary
(target logits gathered at the draft's target ids, then softmax), over positions whose loss_mask
is set and whose target argmax is in the draft vocabulary; total = sum_k decay^k * loss_k.
target_temperature (sharpen_target) trains against softmax(target logits / T) instead: 0 is the hard label,
the target's greedy pick (what T=0 serving accepts), 1 (default) the references' soft target.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sglang_eagle3.kernels import decode as kernels
from sglang_eagle3.kernels import extension
from sglang_eagle3.kernels.training import draft_vocab_distribution, soft_cross_entropy, wide_dtype
from sglang_eagle3.models.draft import linear_rows

FEATURES = ("fused", "top")


@dataclass(frozen=True)
class TTTSettings:
    """How TTT trains a draft; one per run (the trainer fills it from its flags)."""
    ttt_length: int = 7                      # draft steps per chain (K)
    step_decay: float = 0.8                  # the loss is sum_k step_decay^k * loss_k
    features: str = "fused"                  # step 0's input: "fused" aux_hidden_states, "top" last_hidden
    feature_loss_weight: float = 0.0         # > 0: + smooth-L1(step-0 draft hidden at t, target last_hidden at t+1)
    # Step k at base position t is scored where loss_mask[t + k + offset] is set. 1 (ours): the mask of the position
    # whose distribution is learned, i.e. the chains the engine drafts after an accepted assistant token; 0: the
    # EAGLE-3 authors' and SpecForge's convention (one earlier).
    loss_mask_offset: int = 1
    # Each step learns softmax(target logits / T) over the draft vocabulary (sharpen_target; 0: one-hot at the
    # target's pick); accuracies always count the target's own argmax.
    target_temperature: float = 1.0
    fused_ce: bool = True                    # one-pass soft cross-entropy (False: log_softmax, multiply, sum; slower)
    # Steps k >= 1 grow every chain (True: the same loss, more FLOPs, no gathers) or only those a later step scores
    # (False: chains_to_grow); None: grow_every_chain_default(device).
    grow_every_chain: Optional[bool] = None


@dataclass
class TTTBatch:
    """One TTT batch: rows right-padded to T, or (row_lengths) rows packed end to end in one sequence (B == 1,
    no padding). Packed rows keep their own RoPE positions and attention, chains never cross into the next row,
    and the loss is the mean over rows of each row's own: the same loss and gradients as the rows run one by one
    and averaged (gradient accumulation), with R times larger matrix products."""
    input_ids: torch.Tensor                              # [B, T]
    loss_mask: torch.Tensor                              # [B, T] 1: a token the draft learns (assistant)
    last_hidden: torch.Tensor                            # [B, T, Ht] the target's, after its final norm
    aux_hidden_states: Optional[torch.Tensor] = None     # [B, T, n_aux*Ht] the target's aux layers' inputs
    attention_mask: Optional[torch.Tensor] = None        # [B, T] 0: padding (None: no padding)
    row_lengths: Optional[list[int]] = None              # [R] the lengths of the rows packed into B == 1

    @classmethod
    def from_dict(cls, batch: dict) -> TTTBatch:
        """A collated batch dict (trainer/data.py: collate, pack; row_lengths [R] when packed)."""
        lengths = batch.get("row_lengths")
        return cls(batch["input_ids"], batch["loss_mask"], batch["last_hidden"], batch.get("aux_hidden_states"),
                   batch.get("attention_mask"), None if lengths is None else lengths.tolist())


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
class TTTCounters:
    """Summable counts of TTT runs: add them over micro-batches and steps (+) and over ranks (all_reduced), then read
    metrics(). ttt_forward fills the accuracy and acceptance counts; the trainer adds its losses and tokens."""
    step_correct: torch.Tensor    # [K] positions where the draft's argmax == the target's argmax, per step
    step_count: torch.Tensor      # [K] positions counted for accuracy (a token the draft learns), per step
    accept_sum: torch.Tensor      # [] over chain starts: the consecutive correct steps from each
    accept_count: torch.Tensor    # [] chain starts
    loss_sum: float = 0.0         # summed losses (a training step's: the mean over its micro-batches; eval: a row's)
    losses: float = 0.0           # how many losses loss_sum holds
    tokens: float = 0.0           # tokens trained on

    @classmethod
    def zeros(cls, ttt_length: int) -> TTTCounters:
        return cls.unpacked(torch.zeros(2 * ttt_length + 5, dtype=torch.float64))

    def packed(self) -> torch.Tensor:
        """[2K + 5] float64 on the counts' device: every field end to end, one tensor to copy or all-reduce."""
        steps = torch.cat([self.step_correct, self.step_count, self.accept_sum.view(1), self.accept_count.view(1)])
        scalars = torch.tensor([self.loss_sum, self.losses, self.tokens], dtype=torch.float64, device=steps.device)
        return torch.cat([steps.double(), scalars])

    @classmethod
    def unpacked(cls, flat: torch.Tensor) -> TTTCounters:
        K = (flat.numel() - 5) // 2
        correct, count, accept, scalars = flat.split([K, K, 2, 3])
        return cls(correct, count, accept[0], accept[1], *scalars.tolist())

    def __add__(self, other: TTTCounters) -> TTTCounters:
        return TTTCounters.unpacked(self.packed() + other.packed())

    def cpu(self) -> TTTCounters:
        """float64 on the CPU, in one device-to-host copy."""
        return TTTCounters.unpacked(self.packed().cpu())

    def all_reduced(self, device: torch.device) -> TTTCounters:
        """The sum over all ranks, on the CPU: one all_reduce of the packed counts on device (NCCL reduces GPU
        tensors only); without torch.distributed, these counts."""
        flat = self.packed().to(device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flat)
        return TTTCounters.unpacked(flat.cpu())

    def metrics(self) -> dict:
        """acc_0..acc_{K-1} and the simulated acceptance length (1 bonus token + accepted draft tokens)."""
        out = {f"acc_{k}": float(correct / count) if count > 0 else float("nan")
               for k, (correct, count) in enumerate(zip(self.step_correct, self.step_count))}
        out["accept_length"] = (1.0 + float(self.accept_sum / self.accept_count) if self.accept_count > 0
                                else float("nan"))
        return out

    def mean_loss(self) -> float:
        return self.loss_sum / self.losses if self.losses else float("nan")


@dataclass
class TTTOutput:
    """ttt_forward's result: the loss to train and what to log."""
    loss: torch.Tensor                            # [] differentiable: sum_k decay^k loss_k (+ the feature loss)
    step_loss: torch.Tensor                       # [K] detached per-step losses (0 where a step had no position)
    counters: TTTCounters                         # accuracy and acceptance counts of this batch
    feature_loss: Optional[torch.Tensor] = None   # [] detached


@dataclass
class BatchRows:
    """The rows of a batch: B right-padded ones, or rows packed end to end into B == 1."""
    row_id: Optional[torch.Tensor]   # [B, T] the packed row of each position (None: not packed)
    positions: torch.Tensor          # [B, T] RoPE positions, restarting at every packed row
    count: int                       # rows (B, or the packed rows)


@dataclass
class TTTTargets:
    """What the steps learn at the N positions some step scores, and the target's own pick there."""
    p: torch.Tensor           # [N, Vd] softmax over the draft vocabulary (sharpened by target_temperature)
    p_row: torch.Tensor       # [B, T] position -> its row of p (0 where no step scores it)
    top: torch.Tensor         # [B, T] the target's argmax, a target id (-1 where no step scores it)
    in_vocab: torch.Tensor    # [B, T] the target's argmax is in the draft vocabulary
    draft_ids: torch.Tensor   # [Vd] draft id -> target id


@dataclass
class StepInputs:
    """What every TTT step of one batch reads."""
    settings: TTTSettings
    input_ids: torch.Tensor               # [B, T]
    last_hidden: torch.Tensor             # [B, T, Ht]
    valid: torch.Tensor                   # [B, T] a token the draft learns (loss_mask, not padding)
    needed: torch.Tensor                  # [B, T] a position some step scores
    rows: BatchRows
    targets: TTTTargets
    attend: TTTAttention
    grown: list[Optional[torch.Tensor]]   # per step: the base positions [T_k] it grows (None: all, step 0)


@dataclass
class StepPositions:
    """Step k's base positions t, those with a token x_{t+k+1} that a chain reaches: pick indexes dim 1."""
    k: int
    n: int                                # T - k - 1: base positions with a token x_{t+k+1}
    pick: Union[slice, torch.Tensor]      # step 0: slice(None, n); later: the chains it grows, cols [T_k] (sorted)

    @classmethod
    def of(cls, k: int, grown: list[Optional[torch.Tensor]], T: int) -> Optional[StepPositions]:
        """None: no chain reaches step k (the sets shrink with k, so none reaches a later step either)."""
        n, cols = T - k - 1, grown[k]
        if n <= 0 or (cols is not None and cols.numel() == 0):
            return None
        return cls(k, n, slice(None, n) if cols is None else cols)

    def shifted(self, x: torch.Tensor, by: int) -> torch.Tensor:
        """x [B, T, ...] at t + by for the base positions t: [B, T_k, ...]."""
        return x[:, by:by + self.n][:, self.pick]

    def ahead(self, x: torch.Tensor) -> torch.Tensor:
        """x at t + k + 1: the step's input token and the position whose distribution it learns."""
        return self.shifted(x, self.k + 1)


@dataclass
class StepResult:
    """One TTT step's loss and counts."""
    loss: torch.Tensor                            # [] differentiable
    correct: torch.Tensor                         # [] positions where the draft's argmax == the target's
    count: torch.Tensor                           # [] positions counted for accuracy
    accepted: torch.Tensor                        # [] chains accepted at every step so far
    feature_loss: Optional[torch.Tensor] = None   # [] step 0 with feature_loss_weight > 0


def ttt_forward(draft, batch: TTTBatch, lm_head: nn.Module, settings: TTTSettings = TTTSettings()) -> TTTOutput:
    """EAGLE-3 training-time test on one batch: settings.ttt_length draft steps from every base position, their
    loss and their accuracy and acceptance counts. lm_head: the target's (frozen)."""
    inputs = step_inputs(draft, batch, lm_head, settings)
    hidden = _features(draft, batch, settings.features)                 # [B, T, H] step 0's hidden inputs
    alive = None                                                        # [B, T_k] chains accepted at every step
    steps = []
    for k in range(settings.ttt_length):
        step, hidden, alive = ttt_step(draft, k, hidden, alive, inputs)
        steps.append(step)
    return ttt_output(steps, settings)


def step_inputs(draft, batch: TTTBatch, lm_head: nn.Module, settings: TTTSettings) -> StepInputs:
    """Checks the batch; -> its masks, rows, the target's distributions, the attention and the chains each step
    grows."""
    B, T = batch.input_ids.shape
    dev = batch.input_ids.device
    if T < 2:
        raise ValueError(f"training rows need at least 2 tokens (a feature and the next token), got T={T}")
    if settings.loss_mask_offset not in (0, 1):
        raise ValueError(f"loss_mask_offset must be 0 or 1, got {settings.loss_mask_offset}")
    key_valid = batch.attention_mask if batch.attention_mask is not None else torch.ones_like(batch.input_ids)
    valid = batch.loss_mask.bool() & key_valid.bool()                   # [B, T] token may be predicted
    rows = _packed_rows(batch.row_lengths, B, T, dev)
    # Only positions some step scores or counts need the target's distribution and the draft's logits
    # (prompt tokens, padding and the tail of cut rows do not): gather them once, skip the rest.
    needed = valid.clone()                                              # [B, T] target position s
    if settings.loss_mask_offset == 0:
        needed[:, 1:] |= valid[:, :-1]                                  # gated by the mask one earlier
    targets = learned_targets(draft, lm_head, batch.last_hidden, needed, settings.target_temperature)
    grow_all = settings.grow_every_chain
    if grow_all is None:
        grow_all = grow_every_chain_default(dev)
    grown = chains_to_grow(torch.ones_like(needed) if grow_all else needed, settings.ttt_length)
    return StepInputs(settings, batch.input_ids, batch.last_hidden, valid, needed, rows, targets,
                      TTTAttention(key_valid.bool(), batch.row_lengths), grown)


def learned_targets(draft, lm_head: nn.Module, last_hidden: torch.Tensor, needed: torch.Tensor,
                    temperature: float) -> TTTTargets:
    """The target's distribution over the draft vocabulary at the needed [B, T] positions only."""
    B, T = needed.shape
    dev = needed.device
    draft_ids = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size, device=dev))
    p, top_needed = target_distribution(last_hidden[needed], lm_head, draft_ids)   # [N, Vd], [N]
    p = sharpen_target(p, temperature)
    p_row = torch.zeros(B, T, dtype=torch.long, device=dev)
    p_row[needed] = torch.arange(p.shape[0], device=dev)
    top = torch.full((B, T), -1, dtype=torch.long, device=dev)
    top[needed] = top_needed
    in_vocab = torch.zeros(B, T, dtype=torch.bool, device=dev)
    in_vocab[needed] = draft.t2d[top_needed]
    return TTTTargets(p, p_row, top, in_vocab, draft_ids)


@dataclass
class DraftStep:
    """Step k's draft forward over the chains it grows."""
    at: StepPositions
    h: torch.Tensor                  # [B, T_k, H] the draft's output (pre-norm)
    alive: Optional[torch.Tensor]    # [B, T_{k-1}] step k-1's alive chains pruned to this step's (None at step 0)
    sel: torch.Tensor                # [B, T_k] positions with logits (some step scores them)
    counted: torch.Tensor            # [B, T_k] positions counted for accuracy
    base_row: Optional[torch.Tensor]  # [B, T_k] packed: each base position's row
    logits: torch.Tensor             # [S, Vd] the draft's logits at sel


def draft_step(draft, k: int, hidden: torch.Tensor, alive: Optional[torch.Tensor],
               s: StepInputs) -> Optional[DraftStep]:
    """Step k's forward: at base position t it feeds the data token x_{t+k+1} (RoPE position t+k) with step k-1's
    hidden -> its output and its logits where some step scores them; None where no chain reaches step k.
    hidden [B, T_{k-1}, H] (step 0: the features [B, T, H]), alive [B, T_{k-1}] (step 0: None)."""
    at = StepPositions.of(k, s.grown, s.input_ids.shape[1])
    if at is None:
        return None
    if k == 0:
        hidden = hidden[:, :at.n]
    else:
        hidden, alive = prune_chains(hidden, alive, s.grown[k - 1], at.pick)
        s.attend.select(at.pick)
    h = draft(at.ahead(s.input_ids), hidden, at.shifted(s.rows.positions, 0) + k, attend=s.attend)   # [B, T_k, H]
    sel, counted, base_row = step_masks(at, s)                          # [B, T_k] each
    return DraftStep(at, h, alive, sel, counted, base_row, draft.compute_logits(h[sel]))


def ttt_step(draft, k: int, hidden: torch.Tensor, alive: Optional[torch.Tensor],
             s: StepInputs) -> tuple[Optional[StepResult], torch.Tensor, Optional[torch.Tensor]]:
    """Step k grows each chain by one token (draft_step) and learns the target's distribution at t+k+1.
    hidden [B, T_{k-1}, H] (step 0: the features [B, T, H]), alive [B, T_{k-1}] (step 0: None) -> (the step's loss
    and counts, None where no chain reaches it; hidden [B, T_k, H] and alive [B, T_k] for step k+1)."""
    st = draft_step(draft, k, hidden, alive, s)
    if st is None:
        return None, hidden, alive
    loss = step_loss(st.logits, st.at, st.sel, st.base_row, s)
    feat = None
    if k == 0 and s.settings.feature_loss_weight > 0:
        feat = feature_loss(st.h, s.last_hidden, st.counted, st.base_row, s.rows.count)
    correct, alive = step_accuracy(st.logits, st.at, st.sel, st.counted, st.alive, s.targets)
    return StepResult(loss, correct, st.counted.sum().float(), alive.sum().float(), feat), draft.next_hidden(st.h), \
        alive


def prune_chains(hidden: torch.Tensor, alive: torch.Tensor, grown_before: Optional[torch.Tensor],
                 cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [B, T_{k-1}, H], alive [B, T_{k-1}] of step k-1's chains (grown_before [T_{k-1}]; None: every base
    position) -> those of the chains step k grows, cols [T_k] (a subset): [B, T_k, H], [B, T_k]."""
    rows = cols if grown_before is None else torch.searchsorted(grown_before, cols)   # cols' rows at step k-1
    return hidden.index_select(1, rows), alive[:, rows]                 # index_select: a fast backward


def step_masks(at: StepPositions, s: StepInputs) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """-> sel [B, T_k] (positions with logits: some step scores them), counted [B, T_k] (counted for accuracy),
    base_row [B, T_k] (packed: the row of each base position; else None). Packed, no chain runs into the next row."""
    sel, counted = at.ahead(s.needed), at.ahead(s.valid)
    if s.rows.row_id is None:
        return sel, counted, None
    base_row = at.shifted(s.rows.row_id, 0)
    in_row = base_row == at.ahead(s.rows.row_id)
    return sel & in_row, counted & in_row, base_row


def step_loss(logits: torch.Tensor, at: StepPositions, sel: torch.Tensor, base_row: Optional[torch.Tensor],
              s: StepInputs) -> torch.Tensor:
    """Soft cross-entropy of logits [S, Vd] (at sel) against the target's distribution, averaged over the positions
    the loss scores: the loss mask at t + k + offset set and the target's argmax draftable (packed: per row)."""
    p_rows = at.ahead(s.targets.p_row)[sel]                             # [S] rows of targets.p
    if s.settings.fused_ce:
        ce = soft_cross_entropy(logits, s.targets.p, p_rows)            # [S]
    else:
        ce = -(s.targets.p[p_rows] * logits.to(wide_dtype(logits.dtype)).log_softmax(-1)).sum(-1)
    gate = at.shifted(s.valid, at.k + s.settings.loss_mask_offset) & at.ahead(s.targets.in_vocab)
    m = gate[sel].float()                                               # [S] positions the loss scores
    return _mean_loss(ce * m, m, None if base_row is None else base_row[sel], s.rows.count)


def feature_loss(h: torch.Tensor, last_hidden: torch.Tensor, counted: torch.Tensor, base_row: Optional[torch.Tensor],
                 num_rows: int) -> torch.Tensor:
    """Step 0's draft hidden h [B, T-1, H] against the target's last hidden at t+1 [B, T, Ht]: smooth-L1, averaged
    over the counted positions (packed: per row)."""
    wide = wide_dtype(h.dtype)
    fl = F.smooth_l1_loss(h.to(wide), last_hidden[:, 1:].to(wide), reduction="none").mean(-1)   # [B, T-1]
    return _mean_loss(fl[counted], torch.ones_like(fl[counted]), None if base_row is None else base_row[counted],
                      num_rows)


@torch.no_grad()
def step_accuracy(logits: torch.Tensor, at: StepPositions, sel: torch.Tensor, counted: torch.Tensor,
                  alive: Optional[torch.Tensor], targets: TTTTargets) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (positions where the draft's argmax == the target's [], the chains right at every step so far [B, T_k])."""
    ok = torch.zeros_like(sel)                                          # [B, T_k] the draft's pick == the target's
    ok[sel] = targets.draft_ids[kernels.argmax(logits)] == at.ahead(targets.top)[sel]
    ok &= counted
    return ok.sum().float(), ok if alive is None else alive & ok


def ttt_output(steps: list[Optional[StepResult]], settings: TTTSettings) -> TTTOutput:
    """The steps' results (None: no chain reached it) -> the loss sum_k decay^k loss_k (+ the weighted feature loss)
    and the counts; step 0 always runs, and its counted positions are the chain starts."""
    zero = torch.zeros((), device=steps[0].loss.device)
    total, accept_sum = zero, zero.clone()
    for k, step in enumerate(steps):
        if step is None:
            continue
        total = total + settings.step_decay ** k * step.loss
        if step.feature_loss is not None:
            total = total + settings.feature_loss_weight * step.feature_loss
        accept_sum = accept_sum + step.accepted
    with torch.no_grad():
        step_loss = torch.stack([zero if s is None else s.loss.detach() for s in steps])
        counters = TTTCounters(torch.stack([zero if s is None else s.correct for s in steps]),
                               torch.stack([zero if s is None else s.count for s in steps]), accept_sum, steps[0].count)
    feat = steps[0].feature_loss
    return TTTOutput(total, step_loss, counters, None if feat is None else feat.detach())


def _features(draft, batch: TTTBatch, features: str) -> torch.Tensor:
    if features not in FEATURES:
        raise ValueError(f"features={features!r}; expected one of {FEATURES}")
    x = batch.last_hidden if features == "top" else batch.aux_hidden_states
    if x.shape[-1] != draft.fc.in_features:
        name = "last_hidden" if features == "top" else "aux_hidden_states"
        raise ValueError(f"{name} has {x.shape[-1]} features but the draft's fc reads {draft.fc.in_features} "
                         f"(aux_layer_ids={draft.config.aux_layer_ids}, features={features!r})")
    # Always project here: with one aux layer and Ht == H the draft could not tell features from hidden.
    return draft.project(x)                                     # [B, T, H]


def grow_every_chain_default(device: torch.device) -> bool:
    """Whether TTT's later steps grow every chain by default: on CPUs with AMX yes (oneDNN's tile kernels make the
    extra matrix products cheap, while the gathers and scatters that select the scored chains do not get faster);
    elsewhere (AVX-512 CPUs, GPUs) only the chains a later step scores."""
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


def _packed_rows(row_lengths: Optional[list[int]], B: int, T: int, dev) -> BatchRows:
    """Row ids and RoPE positions of unpacked rows (row_lengths None) or of rows packed end to end."""
    if row_lengths is None:
        return BatchRows(None, torch.arange(T, device=dev).expand(B, T), B)
    if B != 1 or sum(row_lengths) != T or min(row_lengths) < 2:
        raise ValueError(f"row_lengths {list(row_lengths)} must be >= 2 each and sum to T={T} of one packed row "
                         f"(B={B})")
    lengths = torch.tensor(row_lengths, device=dev)
    row_id = torch.repeat_interleave(torch.arange(len(row_lengths), device=dev), lengths)          # [T]
    starts = lengths.cumsum(0) - lengths
    return BatchRows(row_id.view(1, T), (torch.arange(T, device=dev) - starts[row_id]).view(1, T), len(row_lengths))


def _mean_loss(weighted: torch.Tensor, weight: torch.Tensor, row_of: Optional[torch.Tensor] = None,
               num_rows: int = 1) -> torch.Tensor:
    """sum(weighted) / sum(weight) [S] -> scalar; packed rows (row_of [S] in 0..num_rows-1): the mean over all rows
    of each row's own (a row with nothing scored counts 0, as when it runs alone)."""
    if row_of is None:
        return weighted.sum() / weight.sum().clamp(min=1.0)
    num = torch.zeros(num_rows, dtype=weighted.dtype, device=weighted.device).index_add(0, row_of, weighted)
    den = torch.zeros(num_rows, dtype=weight.dtype, device=weight.device).index_add(0, row_of, weight)
    return (num / den.clamp(min=1.0)).mean()
