"""The speculative worker: one decoding step for a set of pool rows, and the prefill of one request.

One step for rows at root token x_n (the last verified token of each request):
  1. draft:   grow a tree from the draft's state at position n-1           (tree.grow_tree)
  2. verify:  one target forward over the tree with its ancestor mask      (TargetModel.forward)
  3. accept:  greedy walk as tensor maths, or lossless tree sampling       (verify.py)
  4. commit:  keep the accepted KV slots; draft-extend over the accepted tokens with the target's
              fused features, which also gives the draft state for the next tree.
With draft=None (or a step without speculation) the tree is the root alone: one token per target forward.

The draft-extend pairs of each step are held per row and run just before that row's next tree is drafted:
steps without speculation (the profile turns it off at large batch sizes) then cost the draft nothing
until it is needed again, or until PENDING_MAX pairs have piled up.

State lives in fixed-size tensors indexed by pool row (the scheduler owns which request holds which row):
the target's and the draft's KV pools, and per row the root token, its position and the draft's last
hidden state / logits. Nothing is copied when requests come and go.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch.profiler import record_function

from sglang_eagle3.engine.cost_model import TreePlanner
from sglang_eagle3.engine.speculation import SpecConfig
from sglang_eagle3.engine.threads import governor
from sglang_eagle3.engine.tree import (
    DraftTree,
    add_proposals,
    build_draft_tree,
    draft_candidates,
    pool_attend,
    root_only_tree,
    sorted_scores,
    tree_of,
)
from sglang_eagle3.engine.verify import (
    Acceptance,
    NodeProbs,
    SamplingParams,
    TokenLogprob,
    accept_greedy_logits,
    accept_sampling_row,
    acceptance_from_lists,
    sample_rows,
    sample_token,
    target_probs,
    token_logprobs,
    verify_sampling,
)
from sglang_eagle3.kernels import decode as K
from sglang_eagle3.kernels import extension
from sglang_eagle3.kernels.decode import sampling_in_extension
from sglang_eagle3.models.kvcache import KVPool, prefill_attention, tree_new_mask
from sglang_eagle3.models.target import PREFILL_T

PENDING_MAX = 64      # draft-extend pairs a row may hold back (steps without speculation)
MAX_CONTEXT_NODES = 16  # context-proposed nodes a fixed-size tree takes beside the draft's


@dataclass
class StepTimes:
    draft: float = 0.0      # tree growth + draft extend
    verify: float = 0.0     # target forward + acceptance + commit
    prefill: float = 0.0

    def add(self, other: "StepTimes") -> None:
        self.draft, self.verify, self.prefill = (self.draft + other.draft, self.verify + other.verify,
                                                 self.prefill + other.prefill)


@dataclass
class StepResult:
    rows: list[int]
    emitted: list[list[int]]            # tokens per row, in order (accepted draft tokens, then the bonus token)
    times: StepTimes = field(default_factory=StepTimes)
    logprobs: list[Optional[list[TokenLogprob]]] = field(default_factory=list)   # per row, rows that asked for them
    nodes: int = 1                      # tokens per row the verify ran (tree size, the root included)
    drafted: bool = False               # the draft ran this step
    context_accepted: list[list[bool]] = field(default_factory=list)   # per row, its accepted draft nodes in order:
                                                                       # proposed by the context alone
    tree_tokens: Optional[list[list[int]]] = None    # the tree (with proposals): node tokens per row
    tree_parents: Optional[list[list[int]]] = None   # and node parents


class SpecWorker:
    def __init__(self, target, draft=None, num_rows: int = 1, max_len: int = 256, draft_tree_slots: int = 0,
                 cuda_graphs: Optional[bool] = None):
        self.target, self.draft = target, draft
        dev, dtype = target.device, target.dtype
        self.num_rows, self.max_len = num_rows, max_len
        use_graphs = (dev.type == "cuda" and extension.mode() != "off") if cuda_graphs is None else cuda_graphs
        # on CUDA one extra pool row pads batches up to a captured graph's bucket (cuda_graphs.py)
        self.tpool = target.new_cache(num_rows + (1 if use_graphs else 0), max_len)
        self.graphs = None
        if use_graphs:
            from sglang_eagle3.engine.cuda_graphs import CudaGraphRunner
            self.graphs = CudaGraphRunner(target, self.tpool, spare_row=num_rows, want_aux=draft is not None)
        self.roots = torch.zeros(num_rows, dtype=torch.long, device=dev)        # last verified token per row
        self.root_pos = torch.zeros(num_rows, dtype=torch.long, device=dev)     # its position
        self.dpool = None
        if draft is not None:
            c = draft.config
            self.dpool = KVPool(1, num_rows, c.num_key_value_heads, max_len + draft_tree_slots + 2, c.head_dim,
                                dtype, dev)
            self.d_hidden = torch.zeros(num_rows, c.hidden_size, dtype=dtype, device=dev)
            self.d_logits = torch.zeros(num_rows, c.draft_vocab_size, dtype=dtype, device=dev)
            self.scale = c.head_dim ** -0.5
            # (target feature t, token t+1, position t) pairs not yet run through the draft, per row
            n_feat = len(target.aux_layer_ids) * target.hidden_size
            self.pend_feats = torch.zeros(num_rows, PENDING_MAX, n_feat, dtype=dtype, device=dev)
            self.pend_ids = torch.zeros(num_rows, PENDING_MAX, dtype=torch.long, device=dev)
            self.pend_pos = torch.zeros(num_rows, PENDING_MAX, dtype=torch.long, device=dev)
            self.pend_count = [0] * num_rows     # pairs held per row, on the host (the step syncs its counts anyway)

    def nbytes(self) -> int:
        return self.tpool.nbytes() + (self.dpool.nbytes() if self.dpool is not None else 0)

    # ---- prefill -----------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, row: int, prompt_ids: Sequence[int], params: SamplingParams,
                generator: Optional[torch.Generator] = None) -> tuple[int, float, Optional[TokenLogprob]]:
        """Run the prompt into `row`; returns (first token, seconds, its log-prob entry if params ask for one)."""
        fixed = governor().all_threads() if self.target.prefill_depends_on_threads else nullcontext()
        with fixed:                               # a prompt's numbers must not depend on the thread count
            return self._prefill(row, prompt_ids, params, generator)

    def _prefill(self, row: int, prompt_ids: Sequence[int], params: SamplingParams,
                 generator: Optional[torch.Generator]) -> tuple[int, float, Optional[TokenLogprob]]:
        t0 = time.perf_counter()
        dev = self.target.device
        rows = torch.tensor([row], device=dev)
        T = len(prompt_ids)
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=dev)
        pos = torch.arange(T, device=dev).view(1, T)
        self.tpool.reset(rows)
        out = self.target(self.tpool, ids, pos, rows=rows, logit_index=torch.tensor([[T - 1]], device=dev),
                          want_aux=self.draft is not None)
        self.tpool.commit_prefix(rows, torch.tensor([T], device=dev))
        root = int(sample_tokens(out.logits[:, 0], [params], [generator])[0])
        lp = None if params.logprobs is None else \
            token_logprobs(out.logits[0, :1], torch.tensor([root], device=dev), params.logprobs)[0]
        self.roots[row], self.root_pos[row] = root, T
        if self.draft is not None:
            self.dpool.reset(rows)
            self.pend_count[row] = 0
            d_in = torch.cat([ids[:, 1:], torch.tensor([[root]], device=dev)], 1)   # (feature t, token t+1)
            self._draft_extend(rows, d_in, out.aux_hidden_states, pos, torch.tensor([T], device=dev))
        return root, time.perf_counter() - t0, lp

    # ---- one decoding step -------------------------------------------------------------------
    @torch.no_grad()
    def step(self, rows: list[int], params: list[SamplingParams], generators: list[Optional[torch.Generator]],
             spec: Optional[SpecConfig], proposals: Optional[list[list[tuple]]] = None,
             planner: Optional[TreePlanner] = None, context: int = 0) -> StepResult:
        """One draft -> verify -> accept -> commit -> extend step for these rows. spec None: the draft does not run.
        proposals[b]: row b's chains from the context, (tokens, cumulative log chances), merged into its tree;
        planner: decides per step whether to draft and how many nodes to verify (else spec.num_draft_tokens nodes
        plus the context's); context: the longest row's tokens (what a verify's attention reads)."""
        t0 = time.perf_counter()
        r = torch.tensor(rows, device=self.target.device)
        root_pos = self.root_pos[r]
        tree, from_context, drafted = self._tree(rows, r, spec, proposals, planner, context)
        if planner is not None:
            planner.observe_size(len(rows), tree.num_nodes, drafted)
        t1 = time.perf_counter()
        with record_function("eagle3::verify_forward"):
            tv = self.graphs.forward(r, tree.tokens, tree.positions, tree.mask) if self.graphs is not None else None
            if tv is None:
                tv = self.target(self.tpool, tree.tokens, tree.positions, rows=r, tree_mask=tree.mask,
                                 want_aux=self.draft is not None)
        if planner is not None and self.target.device.type == "cpu":
            planner.observe_verify(len(rows), tree.num_nodes, context, time.perf_counter() - t1)
        with record_function("eagle3::accept"):
            acc = accept(tree, tv.logits, params, generators)
            counts, emitted = acc.count.tolist(), acc.emitted.tolist()                 # the step's one sync
        A = max(counts)
        path = acc.path[:, :A]
        with record_function("eagle3::kv_commit"):
            self.tpool.commit(r, path, acc.count)
            last = torch.gather(acc.emitted, 1, (acc.count - 1).view(-1, 1)).view(-1)
            self.roots[r], self.root_pos[r] = last, root_pos + acc.count
        logprobs = [None if p.logprobs is None else
                    token_logprobs(tv.logits[b, path[b, :n]], acc.emitted[b, :n], p.logprobs)   # emitted[j]: at path[j]
                    for b, (p, n) in enumerate(zip(params, counts))]
        t2 = time.perf_counter()
        if self.draft is not None:
            with record_function("eagle3::draft_hold"):
                self._hold(rows, acc.emitted, tv.aux_hidden_states, tree.positions, path, counts)
        times = StepTimes(draft=(t1 - t0) + (time.perf_counter() - t2), verify=t2 - t1)
        if planner is not None:
            planner.observe_step(len(rows), drafted, sum(counts), times.draft + times.verify)
        context_accepted = [[] for _ in rows]
        if from_context is not None:
            on_path = torch.gather(from_context, 1, path)[:, 1:].tolist()              # accepted draft nodes
            context_accepted = [f[:n - 1] for f, n in zip(on_path, counts)]
        return StepResult(rows, [e[:n] for e, n in zip(emitted, counts)], times, logprobs, tree.num_nodes, drafted,
                          context_accepted, tree.tokens.tolist() if proposals else None,
                          tree.parents.tolist() if proposals else None)

    def _tree(self, rows: list[int], r: torch.Tensor, spec: Optional[SpecConfig], proposals, planner,
              context: int) -> tuple[DraftTree, Optional[torch.Tensor], bool]:
        """This step's tree, whether the context alone proposed each node ([B, N] bool, or None) and whether the
        draft ran."""
        roots, root_pos = self.roots[r], self.root_pos[r]
        dev, B = r.device, len(rows)
        has_proposals = bool(proposals) and any(proposals)
        if spec is None and not has_proposals:
            return root_only_tree(roots, root_pos), None, False
        alone = add_proposals(None, proposals, dev) if has_proposals else None
        drafted = self.draft is not None and spec is not None and (planner is None or planner.wants_draft(
            sorted_scores(alone) if alone is not None else None, B, context))
        t0 = time.perf_counter()
        if drafted:
            with record_function("eagle3::draft_extend"):
                self._catch_up(rows)
            with record_function("eagle3::draft_tree"):
                cands = draft_candidates(self.draft, self.dpool, r, self.d_hidden[r], self.d_logits[r], roots,
                                         root_pos, spec)
                cands = add_proposals(cands, proposals, dev) if has_proposals else cands
        else:
            cands = alone
        if cands is None:
            return root_only_tree(roots, root_pos), None, False
        room = 1 + min(cands.finite())
        if planner is not None:
            draft_s = time.perf_counter() - t0 if drafted else 0.0
            size, _ = planner.size(sorted_scores(cands), B, context, draft_s)
        else:                                   # the fixed tree's nodes, plus the context's own
            extra = int(cands.from_context.logical_and(torch.isfinite(cands.scores)).sum(1).max())
            size = min(room, (spec.num_draft_tokens if drafted else 1) + min(extra, MAX_CONTEXT_NODES))
        if size <= 1:
            return root_only_tree(roots, root_pos), None, drafted
        if not has_proposals:                   # the draft's nodes alone: nothing to tell apart
            return build_draft_tree(cands.tokens, cands.scores, cands.parents, roots, root_pos, size), None, drafted
        tree, from_context = tree_of(cands, roots, root_pos, size)
        return tree, from_context, drafted

    def _hold(self, rows: list[int], emitted, aux, tree_positions, path, counts: list[int]) -> None:
        """Queue this step's pairs for the draft: per row b the accepted path[b, :counts[b]] of the verified tree,
        its target features aux [B, N, F] and positions, with the emitted tokens [B, N] (the token after each).
        Rows that would overflow catch up first."""
        full = [r for r, c in zip(rows, counts) if self.pend_count[r] + c > PENDING_MAX]
        if full:
            self._catch_up(full)
        if len(rows) == 1:                                    # batch 1: slices, no index tensors
            r, s, c = rows[0], self.pend_count[rows[0]], counts[0]
            nodes = path[0, :c]
            self.pend_ids[r, s:s + c] = emitted[0, :c]
            self.pend_pos[r, s:s + c] = tree_positions[0, nodes]
            self.pend_feats[r, s:s + c] = aux[0, nodes].to(self.pend_feats.dtype)
            self.pend_count[r] = s + c
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

    def _catch_up(self, rows: list[int]) -> None:
        """Run the held pairs of these rows through the draft (one batched extend)."""
        todo = [r for r in rows if self.pend_count[r] > 0]
        if not todo:
            return
        n = [self.pend_count[r] for r in todo]
        A, dev = max(n), self.pend_ids.device
        t = torch.tensor(todo, device=dev)
        if len(todo) == 1:                                    # batch 1: views, no gathered copies
            r = todo[0]
            ids, feats, pos = self.pend_ids[r:r + 1, :A], self.pend_feats[r:r + 1, :A], self.pend_pos[r:r + 1, :A]
        else:
            ids, feats, pos = self.pend_ids[t, :A], self.pend_feats[t, :A], self.pend_pos[t, :A]
        self._draft_extend(t, ids, feats, pos, torch.tensor(n, device=dev))
        for r in todo:
            self.pend_count[r] = 0

    def _draft_extend(self, rows: torch.Tensor, input_ids, aux, positions, num_new) -> None:
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


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams],
                  generators: list[Optional[torch.Generator]]) -> torch.Tensor:
    """logits [B, V] -> one token per row, each row with its own sampling parameters and generator (rows that
    share their parameters are turned into probabilities and sampled together)."""
    out = K.argmax(logits)
    groups: dict[tuple, list[int]] = {}
    for b, p in enumerate(params):
        if not p.greedy:
            groups.setdefault((p.temperature, p.top_p, p.top_k), []).append(b)
    for rows in groups.values():
        if sampling_in_extension(logits):                          # one exp pass per row, no probability tensor
            for b in rows:
                out[b] = sample_token(logits[b], params[b], generators[b])
            continue
        idx = torch.tensor(rows, device=logits.device)
        out[idx] = sample_rows(target_probs(logits[idx], params[rows[0]]), [generators[b] for b in rows])
    return out


def accept(tree: DraftTree, logits: torch.Tensor, params: list[SamplingParams],
           generators: list[Optional[torch.Generator]]) -> Acceptance:
    """Greedy rows as one tensor walk; sampling rows one by one (lossless tree speculative sampling)."""
    if all(p.greedy for p in params):
        return accept_greedy_logits(tree.tokens, tree.parents, tree.mask, logits)
    if tree.num_nodes == 1:                       # no draft: every row emits one token, sampled rows together
        greedy = accept_greedy_logits(tree.tokens, tree.parents, tree.mask, logits)
        greedy.emitted[:, 0] = sample_tokens(logits[:, 0], params, generators)
        return greedy
    paths, emitted = [], []
    greedy = accept_greedy_logits(tree.tokens, tree.parents, tree.mask, logits) \
        if any(p.greedy for p in params) else None
    for b, (p, g) in enumerate(zip(params, generators)):
        if p.greedy:
            n = int(greedy.count[b])
            paths.append(greedy.path[b, :n].tolist())
            emitted.append(greedy.emitted[b, :n].tolist())
            continue
        if sampling_in_extension(logits):         # one exp pass per visited node, no probability tensor
            nodes, bonus = accept_sampling_row(tree.tokens[b], tree.parents[b], logits[b], p, g)
        else:
            tokens = tree.tokens[b].tolist()
            nodes, bonus = verify_sampling(tokens, tree.parents[b].tolist(), NodeProbs(logits[b], p), g)
        paths.append(nodes)
        emitted.append([int(tree.tokens[b, i]) for i in nodes[1:]] + [bonus])
    return acceptance_from_lists(paths, emitted, logits.device)
