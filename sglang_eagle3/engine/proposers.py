"""What proposes a step's tree nodes, behind one interface: `propose` the candidates of a batch's rows, `commit` after
the verify (what the proposer keeps or learns from it). The draft model is `DraftProposer`; the context's proposer is
suffix.ContextDrafter; a hybrid step merges the two (tree.merge_candidates).

DraftProposer holds the draft's state per pool row (its KV pool, its last hidden state and logits) and its lazy
draft-extend: the prompt's (target feature, next token) pairs and those of each verified step are held per row and
run through the draft just before that row's next candidates are drafted, so a request that is never speculated
(large batches, where the planner verifies the root alone) costs the draft nothing, its prompt included; a row that
speculates again catches up in one extend. A row holds at most PENDING_MAX step pairs: past them its oldest are
dropped (forget), and the draft reads the prompt and the newest pairs only.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch
from torch.profiler import record_function

from sglang_eagle3.engine.sampled_tree import DraftSampler
from sglang_eagle3.engine.speculation import SpecConfig
from sglang_eagle3.engine.tree import Candidates, DraftTree, draft_candidates, pool_attend
from sglang_eagle3.engine.verify import Acceptance, SamplingParams, TokenLogprob
from sglang_eagle3.models.kvcache import KVPool, prefill_attention, tree_new_mask
from sglang_eagle3.models.target import PREFILL_T

PENDING_MAX = 32      # draft-extend pairs a row may hold back (steps without speculation); past them its oldest go
PENDING_KEEP = 8      # the newest pairs a row keeps when it drops its oldest (what a draft after the stretch runs)
PROMPT_KEEP = 256     # and the last prompt pairs it keeps then, where the draft has not run over its prompt yet


@dataclass
class StepBatch:
    """The rows one step decodes and what its phases read of them."""
    rows: list[int]                                   # pool rows
    params: list[SamplingParams]
    generators: list[Optional[torch.Generator]]
    spec: Optional[SpecConfig]                        # the draft's tree this step (None: the draft does not run)
    keys: Sequence                                    # the rows' request ids (the context's streams)
    context: int                                      # the longest row's tokens (what a verify's attention reads)
    index: torch.Tensor                               # [B] the rows on the device
    roots: torch.Tensor                               # [B] last verified token per row
    root_pos: torch.Tensor                            # [B] its position

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def greedy(self) -> list[bool]:
        return [p.greedy for p in self.params]


@dataclass
class VerifyOutput:
    """What a verify hands the commit: each row's accepted path through the verified tree."""
    tree: DraftTree
    acceptance: Acceptance                            # path, count, emitted [B, N] on the device
    path: torch.Tensor                                # [B, A] accepted nodes, root first (A: the longest path)
    counts: list[int]                                 # accepted nodes per row, the root included = tokens emitted
    emitted: list[list[int]]                          # the tokens per row: accepted draft tokens, then the bonus
    aux_hidden_states: Optional[torch.Tensor]         # [B, N, F] the target's features at the tree's nodes
    logprobs: list[Optional[list[TokenLogprob]]]      # per row, for rows that ask for them


class Proposer(Protocol):
    def propose(self, batch: StepBatch) -> Optional[Candidates]:
        """Candidates for each row of the batch (None: nothing to propose)."""

    def commit(self, batch: StepBatch, verified: VerifyOutput) -> None:
        """After the verify: keep or learn what it accepted."""


class DraftProposer:
    """The EAGLE-3 draft: its candidates from its state at each row's root, and its pairs held until they are
    needed. State in fixed-size tensors indexed by pool row."""

    def __init__(self, draft, target, num_rows: int, max_len: int, tree_slots: int, sampled_children: bool = True,
                 calibration=None):
        c, dev, dtype = draft.config, target.device, target.dtype
        self.draft, self.sampled_children = draft, sampled_children
        self.calibration = calibration          # draft_calibration.DraftCalibration of sampled children (None: raw q)
        self.dpool = KVPool(1, num_rows, c.num_key_value_heads, max_len + tree_slots + 2, c.head_dim, dtype, dev)
        self.d_hidden = torch.zeros(num_rows, c.hidden_size, dtype=dtype, device=dev)
        self.d_logits = torch.zeros(num_rows, c.draft_vocab_size, dtype=dtype, device=dev)
        self.scale = c.head_dim ** -0.5
        # (target feature t, token t+1, position t) pairs not yet run through the draft, per row
        n_feat = len(target.aux_layer_ids) * target.hidden_size
        self.pend_feats = torch.zeros(num_rows, PENDING_MAX, n_feat, dtype=dtype, device=dev)
        self.pend_ids = torch.zeros(num_rows, PENDING_MAX, dtype=torch.long, device=dev)
        self.pend_pos = torch.zeros(num_rows, PENDING_MAX, dtype=torch.long, device=dev)
        self.pend_count = [0] * num_rows     # pairs held per row, on the host (the step syncs its counts anyway)
        self.prompt_pairs: dict[int, tuple] = {}   # row -> its prompt's pairs (ids, features, positions [1, T]),
                                                   # held until the row's first extend
        self.newest = [0] * num_rows         # per row, how many of its held pairs its latest step added
        self.owed_s = 0.0                    # of the last propose's extend, the seconds earlier steps owed (their
                                             # pairs and prompts, held back while they did not draft)
        self.draft_targets = torch.arange(c.draft_vocab_size, device=dev) + draft.d2t.to(dev)   # [Vd] target ids
        self.to_draft = torch.full((target.vocab_size,), -1, dtype=torch.long, device=dev)       # [V] draft id, -1
        self.to_draft[self.draft_targets] = torch.arange(c.draft_vocab_size, device=dev)

    def nbytes(self) -> int:
        return self.dpool.nbytes()

    def start(self, row: int, input_ids, aux, positions) -> None:
        """A fresh row with its prompt's pairs (feature t, token t+1) [1, T], held: they run through the draft with
        the row's first extend (catch_up), so a request that never drafts never runs its prompt through the draft."""
        self.dpool.reset(torch.tensor([row], device=self.pend_ids.device))
        self.pend_count[row] = 0
        self.prompt_pairs[row] = (input_ids, aux.to(self.pend_feats.dtype), positions)

    def held(self, row: int) -> int:
        """Pairs the row holds (its prompt's, until its first extend, and its steps')."""
        prompt = self.prompt_pairs.get(row)
        return self.pend_count[row] + (prompt[0].shape[1] if prompt is not None else 0)

    def propose(self, batch: StepBatch, beside: Optional[Candidates] = None) -> Candidates:
        """EAGLE-2's candidates for each row, from the draft's state after the row's held pairs. Sampled rows draw
        their children (sampled_tree.DraftSampler), the root's never among the tokens `beside` proposes there (the
        context's, tried first by the verify)."""
        with record_function("eagle3::draft_extend"):
            t0 = time.perf_counter()
            owed = self.catch_up(batch.rows)
            self.owed_s = owed * (time.perf_counter() - t0)
        sampler = None
        if self.sampled_children and not all(batch.greedy):
            slots = 1 + (batch.spec.num_steps - 1) * batch.spec.topk               # the root and the forwarded nodes
            sampler = DraftSampler(batch.params, batch.generators, slots, self.root_children(beside),
                                   self.calibration)
        with record_function("eagle3::draft_tree"):
            return draft_candidates(self.draft, self.dpool, batch.index, self.d_hidden[batch.index],
                                    self.d_logits[batch.index], batch.roots, batch.root_pos, batch.spec,
                                    sampler=sampler)

    def root_children(self, cands: Optional[Candidates]) -> list[list[int]]:
        """Per row, the draft ids of the real candidates cands holds right below the root (none outside the draft
        vocabulary)."""
        if cands is None:
            return []
        at_root = torch.isfinite(cands.scores) & (cands.parents < 0)
        ids = torch.where(at_root, self.to_draft[cands.tokens], -1).tolist()
        return [[i for i in row if i >= 0] for row in ids]

    def commit(self, batch: StepBatch, verified: VerifyOutput) -> None:
        """Hold each row's accepted pairs for its next extend."""
        with record_function("eagle3::draft_hold"):
            self.hold(batch.rows, verified.acceptance.emitted, verified.aux_hidden_states, verified.tree.positions,
                      verified.path, verified.counts)

    def hold(self, rows: list[int], emitted, aux, tree_positions, path, counts: list[int]) -> None:
        """Queue a step's pairs: per row b the accepted path[b, :counts[b]] of the verified tree, its target features
        aux [B, N, F] and positions, with the emitted tokens [B, N] (the token after each). A row that would
        overflow drops its oldest held pairs first (forget)."""
        for r, c in zip(rows, counts):
            if self.pend_count[r] + c > PENDING_MAX:
                self.forget(r, PENDING_KEEP)
        if len(rows) == 1:                                    # batch 1: slices, no index tensors
            r, s, c = rows[0], self.pend_count[rows[0]], counts[0]
            nodes = path[0, :c]
            self.pend_ids[r, s:s + c] = emitted[0, :c]
            self.pend_pos[r, s:s + c] = tree_positions[0, nodes]
            self.pend_feats[r, s:s + c] = aux[0, nodes].to(self.pend_feats.dtype)
            self.pend_count[r], self.newest[r] = s + c, c
            return
        dev = emitted.device
        src_b = torch.tensor([b for b, c in enumerate(counts) for _ in range(c)], device=dev)
        src_j = torch.tensor([j for c in counts for j in range(c)], device=dev)
        row = torch.tensor([r for r, c in zip(rows, counts) for _ in range(c)], device=dev)
        slot = torch.tensor([self.pend_count[r] + j for r, c in zip(rows, counts) for j in range(c)], device=dev)
        nodes = path[src_b, src_j]
        self.pend_ids[row, slot] = emitted[src_b, src_j]
        self.pend_pos[row, slot] = tree_positions[src_b, nodes]
        self.pend_feats[row, slot] = aux[src_b, nodes].to(self.pend_feats.dtype)
        for r, c in zip(rows, counts):
            self.pend_count[r] += c
            self.newest[r] = c

    def forget(self, row: int, keep: int) -> None:
        """Drop a row's held pairs but its newest `keep`: a row that has not drafted for PENDING_MAX tokens (a large
        batch, where the planner verifies the root alone) would otherwise run them all through the draft every
        PENDING_MAX steps, for proposals it may never make, and a step that tries drafting again would run them for
        every row. A prompt the draft has not run over yet keeps its last PROMPT_KEEP pairs. When the row drafts
        again the draft has (the end of) its prompt and the newest pairs, not the dropped ones: its proposals may be
        a little worse there, never its output (lossless verification)."""
        prompt = self.prompt_pairs.get(row)
        if prompt is not None and prompt[0].shape[1] > PROMPT_KEEP:
            self.prompt_pairs[row] = tuple(x[:, -PROMPT_KEEP:] for x in prompt)
        n = self.pend_count[row]
        if n <= keep:
            return
        for held in (self.pend_ids, self.pend_pos, self.pend_feats):
            held[row, :keep] = held[row, n - keep:n].clone()
        self.pend_count[row] = keep
        self.newest[row] = min(self.newest[row], keep)

    def catch_up(self, rows: list[int]) -> float:
        """Run the held pairs of these rows through the draft: a row still holding its prompt alone (the prompt, then
        its steps' pairs, as one extend), the others in one batched extend. -> the share of the pairs run that
        earlier steps than the latest held back (prompts included): work a step that drafts every time would not
        have left to this one."""
        total = sum(self.held(r) for r in rows)
        newest = sum(min(self.newest[r], self.pend_count[r]) for r in rows)
        for r in rows:
            self.newest[r] = 0
        for r in [r for r in rows if r in self.prompt_pairs]:
            ids, feats, pos = self.prompt_pairs.pop(r)
            n = self.pend_count[r]
            if n:
                ids = torch.cat([ids, self.pend_ids[r:r + 1, :n]], 1)
                feats = torch.cat([feats, self.pend_feats[r:r + 1, :n]], 1)
                pos = torch.cat([pos, self.pend_pos[r:r + 1, :n]], 1)
                self.pend_count[r] = 0
            self._extend(torch.tensor([r], device=ids.device), ids, feats, pos,
                         torch.tensor([ids.shape[1]], device=ids.device))
        todo = [r for r in rows if self.pend_count[r] > 0]
        owed = 1.0 - newest / total if total else 0.0
        if not todo:
            return owed
        n = [self.pend_count[r] for r in todo]
        A, dev = max(n), self.pend_ids.device
        t = torch.tensor(todo, device=dev)
        if len(todo) == 1:                                    # batch 1: views, no gathered copies
            r = todo[0]
            ids, feats, pos = self.pend_ids[r:r + 1, :A], self.pend_feats[r:r + 1, :A], self.pend_pos[r:r + 1, :A]
        else:
            ids, feats, pos = self.pend_ids[t, :A], self.pend_feats[t, :A], self.pend_pos[t, :A]
        self._extend(t, ids, feats, pos, torch.tensor(n, device=dev))
        for r in todo:
            self.pend_count[r] = 0
        return owed

    def _extend(self, rows: torch.Tensor, input_ids, aux, positions, num_new) -> None:
        """Draft forward over (feature t, token t+1) pairs; commit them; keep the last valid hidden/logits."""
        B, T = input_ids.shape
        self.dpool.check_room(rows, T)
        if T <= PREFILL_T:
            attend = pool_attend(self.dpool, rows, self.dpool.lens[rows], tree_new_mask(B, T, rows.device), self.scale)
        else:
            starts, counts = self.dpool.lens[rows].tolist(), num_new.tolist()

            def attend(q, k, v):
                return prefill_attention(self.dpool, 0, rows, starts, counts, q, k, v, self.scale)
        h = self.draft(input_ids, aux, positions, attend=attend, fuse=True)           # [B, T, H]
        self.dpool.commit_prefix(rows, num_new)
        # [B, H] pre-norm (B = 1: all T are new)
        last = h[:, -1] if B == 1 else h[torch.arange(B, device=h.device), num_new - 1]
        self.d_hidden[rows] = self.draft.next_hidden(last).to(self.d_hidden.dtype)
        self.d_logits[rows] = self.draft.compute_logits(last).to(self.d_logits.dtype)
