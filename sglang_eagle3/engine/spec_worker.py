"""The speculative worker: one decoding step for a set of pool rows, and the prefill of one request.

A step (SpecWorker.step), for rows at root token x_n (the last verified token of each request):
  propose: the context's chains (suffix.ContextDrafter), then the draft's candidates from its state at position n-1
           (DraftProposer), merged; the planner (--tree auto) decides whether the step speculates at all and
           whether the draft runs
  plan:    the tree to verify: each row's best candidates, how many decided in one place (row_sizes; under --tree
           auto one verify budget for the batch, so rows differ and the tree is ragged)
  verify:  one target forward over every row's tree with its ancestor mask (a ragged tree's padding not computed
           where csrc's layers run); acceptance (a greedy walk as tensor
           maths, or lossless tree sampling: verify.py); the accepted KV slots kept, the roots moved
  commit:  each proposer's hook: the draft holds the accepted pairs for its next extend, the context learns
Then its observers (the planner) see the step's record once. Without proposals the tree is the root alone: one
token per row and target forward.

State lives in fixed-size tensors indexed by pool row (the scheduler owns which request holds which row): the target's
KV pool, per row the root token and its position, and the draft's state (proposers.DraftProposer). Nothing is copied
when requests come and go.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch.profiler import record_function

from sglang_eagle3.engine.cost_model import TreePlanner
from sglang_eagle3.engine.proposers import DraftProposer, Proposer, StepBatch, VerifyOutput
from sglang_eagle3.engine.sampled_tree import SampledDraws, verify_sampled_tree
from sglang_eagle3.engine.speculation import SpecConfig
from sglang_eagle3.engine.step_record import StepClock, StepRecord, StepTimes
from sglang_eagle3.engine.threads import governor
from sglang_eagle3.engine.tree import (
    Candidates,
    DraftTree,
    build_draft_tree,
    chosen_candidates,
    gather_candidates,
    merge_candidates,
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
from sglang_eagle3.models.target import TargetOutput

MAX_CONTEXT_NODES = 16  # context-proposed nodes a fixed-size tree takes beside the draft's


@dataclass
class Proposal:
    """What the proposers offer this step."""
    candidates: Optional[Candidates]    # None: nothing proposed
    drafted: bool = False               # the draft ran
    draft_s: float = 0.0                # its seconds (the planner counts them in the step's rate)
    with_context: bool = False          # the context's are among them (the tree tells them apart)
    owed_s: float = 0.0                 # of draft_s, the extend work earlier steps held back (DraftProposer.owed_s)


@dataclass
class StepPlan:
    """The tree a step verifies."""
    tree: DraftTree
    from_context: Optional[torch.Tensor]   # [B, N] bool: the context alone proposed the node (None: no such node)
    drafted: bool
    draws: Optional[SampledDraws] = None   # the sampled children's q (None: no row sampled its children)

    def row_nodes(self, batch: int) -> list[int]:
        """Per row, the nodes its tree has (the root included)."""
        return self.tree.row_nodes.tolist() if self.tree.row_nodes is not None else [self.tree.num_nodes] * batch


@dataclass
class StepResult:
    rows: list[int]
    emitted: list[list[int]]            # tokens per row, in order (accepted draft tokens, then the bonus token)
    times: StepTimes = field(default_factory=StepTimes)
    logprobs: list[Optional[list[TokenLogprob]]] = field(default_factory=list)   # per row, rows that asked for them
    nodes: int = 1                      # tokens per row the verify's layout held (the largest tree, the root included)
    drafted: bool = False               # the draft ran this step
    from_context: list[list[bool]] = field(default_factory=list)   # per row, its accepted draft tokens in order:
                                                                   # proposed by the context alone
    row_nodes: list[int] = field(default_factory=list)   # per row, its tree's nodes (the root included): what the
                                                         # verify computed for it
    owed_s: float = 0.0                 # of times.draft, the extend work earlier steps held back (their pairs, prompts)


class SpecWorker:
    def __init__(self, target, draft=None, num_rows: int = 1, max_len: int = 256, draft_tree_slots: int = 0,
                 cuda_graphs: Optional[bool] = None, sampled_children: bool = True, calibration=None):
        """sampled_children: sampling rows draw the draft's children and verify them by recursive rejection sampling
        (else the draft's top-k, each accepted with the target's p); calibration (draft_calibration.DraftCalibration,
        None: none): the per-depth sharpening of the q they are drawn from."""
        self.target = target
        dev = target.device
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
        self.drafter = DraftProposer(draft, target, num_rows, max_len, draft_tree_slots, sampled_children,
                                     calibration) \
            if draft is not None else None

    def nbytes(self) -> int:
        return self.tpool.nbytes() + (self.drafter.nbytes() if self.drafter is not None else 0)

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
                          want_aux=self.drafter is not None)
        self.tpool.commit_prefix(rows, torch.tensor([T], device=dev))
        root = int(sample_tokens(out.logits[:, 0], [params], [generator])[0])
        lp = None if params.logprobs is None else \
            token_logprobs(out.logits[0, :1], torch.tensor([root], device=dev), params.logprobs)[0]
        self.roots[row], self.root_pos[row] = root, T
        if self.drafter is not None:
            d_in = torch.cat([ids[:, 1:], torch.tensor([[root]], device=dev)], 1)   # (feature t, token t+1)
            self.drafter.start(row, d_in, out.aux_hidden_states, pos)
        return root, time.perf_counter() - t0, lp

    # ---- one decoding step -------------------------------------------------------------------
    @torch.no_grad()
    def step(self, rows: list[int], params: list[SamplingParams], generators: list[Optional[torch.Generator]],
             spec: Optional[SpecConfig], keys: Sequence = (), context: int = 0,
             context_proposer: Optional[Proposer] = None, planner: Optional[TreePlanner] = None) -> StepResult:
        """propose -> plan -> verify -> commit for these rows. spec None: the draft does not run; keys: the rows'
        request ids (the streams of context_proposer, suffix.ContextDrafter); context: the longest row's tokens;
        planner: sizes the tree and decides the draft per step (--tree auto; else the fixed tree)."""
        clock = StepClock()
        batch = self.batch(rows, params, generators, spec, keys, context)
        proposal = self.propose(batch, context_proposer, planner)   # the context's candidates, the draft's, merged
        plan = self.plan(batch, proposal, planner)                  # the tree to verify
        clock.mark("verify")
        out = self.forward(batch, plan.tree)                        # the target over every row's tree
        clock.mark("forward")
        verified = self.verify(batch, plan, out)                    # accepted paths, their KV kept, the roots moved
        clock.mark("verified")
        self.commit(batch, verified, context_proposer)              # the draft holds its pairs, the context learns
        record = self.record(batch, plan, verified, clock, proposal.owed_s)
        if planner is not None:
            planner.observe(record)                                 # verify costs, the draft's rate, idle stretches
        return StepResult(rows, verified.emitted, record.times, verified.logprobs, plan.tree.num_nodes, plan.drafted,
                          accepted_from_context(plan, verified), row_nodes=plan.row_nodes(batch.size),
                          owed_s=record.owed_s)

    def batch(self, rows: list[int], params: list[SamplingParams], generators: list[Optional[torch.Generator]],
              spec: Optional[SpecConfig], keys: Sequence, context: int) -> StepBatch:
        """The step's rows with their roots."""
        index = torch.tensor(rows, device=self.target.device)
        return StepBatch(rows, params, generators, spec, keys, context, index, self.roots[index], self.root_pos[index])

    def propose(self, batch: StepBatch, context_proposer: Optional[Proposer],
                planner: Optional[TreePlanner]) -> Proposal:
        """The context's candidates (where it is looked up), then the draft's with them merged in (where it runs);
        nothing on a step the planner runs plain (TreePlanner.speculates)."""
        if planner is not None and not planner.speculates(batch.size):
            return Proposal(None)                                   # a plain step: the root alone
        looked = context_proposer is not None and (planner is None or planner.wants_proposals(batch.size))
        alone = context_proposer.propose(batch) if looked else None
        if not self.drafts(batch, alone, planner):
            return Proposal(alone, with_context=alone is not None)
        t0 = time.perf_counter()
        cands = self.drafter.propose(batch, beside=alone)
        cands = cands if alone is None else merge_candidates(cands, alone)
        return Proposal(cands, True, time.perf_counter() - t0, with_context=alone is not None,
                        owed_s=self.drafter.owed_s)

    def drafts(self, batch: StepBatch, alone: Optional[Candidates], planner: Optional[TreePlanner]) -> bool:
        """Run the draft this step? Where there is one and the step has a tree for it, when the planner (if any) expects
        more of it than of the context's candidates `alone`."""
        if self.drafter is None or batch.spec is None:
            return False
        return planner is None or planner.wants_draft(sorted_scores(alone) if alone is not None else None, batch.size,
                                                      batch.context)

    def plan(self, batch: StepBatch, proposal: Proposal, planner: Optional[TreePlanner]) -> StepPlan:
        """The tree of each row's row_sizes - 1 best candidates (ragged where the rows' sizes differ); the root alone
        where every row's size is 1 (or nothing was proposed)."""
        sizes, cands = self.row_sizes(batch, proposal, planner), proposal.candidates
        size = max(sizes)
        if size <= 1:
            return StepPlan(root_only_tree(batch.roots, batch.root_pos), None, proposal.drafted)
        ragged = sizes if min(sizes) < size else None
        # the candidates the tree takes [B, size - 1], where the context's nodes or the sampled draws need them
        counts = None if ragged is None else torch.tensor(ragged, device=cands.scores.device)
        chosen = chosen_candidates(cands, size, counts) if proposal.with_context or cands.drawn_from is not None \
            else None
        if proposal.with_context:              # the tree tells the context's nodes apart
            tree, from_context = tree_of(cands, batch.roots, batch.root_pos, size, ragged, chosen)
        else:
            tree = build_draft_tree(cands.tokens, cands.scores, cands.parents, batch.roots, batch.root_pos, size,
                                    ragged)
            from_context = None
        return StepPlan(tree, from_context, proposal.drafted, self.draws(cands, chosen))

    def draws(self, cands: Candidates, chosen: Optional[torch.Tensor]) -> Optional[SampledDraws]:
        """Where rows sampled their children: the q slot of each tree node and the q, for the verify. chosen
        [B, N - 1]: the candidates the tree took (chosen_candidates)."""
        if cands.drawn_from is None:
            return None
        drawn = gather_candidates(cands.drawn_from, chosen, -1)
        drawn = torch.cat([torch.full_like(drawn[:, :1], -1), drawn], 1)
        return SampledDraws(drawn, cands.draft_q, self.drafter.draft_targets)

    def row_sizes(self, batch: StepBatch, proposal: Proposal, planner: Optional[TreePlanner]) -> list[int]:
        """Per row, the nodes to verify, the root included (1: the root alone). The planner's choice under --tree
        auto (one verify budget for the batch: rows differ); else the fixed tree's nodes where the draft ran, plus
        the context's own up to MAX_CONTEXT_NODES, at most the row's candidates."""
        cands = proposal.candidates
        if cands is None:
            return [1] * batch.size
        if planner is not None:
            return planner.size(sorted_scores(cands), batch.size, batch.context, proposal.draft_s,
                                sampled=not all(batch.greedy))[0]
        drafted = batch.spec.num_draft_tokens if proposal.drafted else 1
        extra = min(cands.context_nodes(), MAX_CONTEXT_NODES) if proposal.with_context else 0
        return [min(1 + have, drafted + extra) for have in cands.finite()]

    def forward(self, batch: StepBatch, tree: DraftTree) -> TargetOutput:
        """One target forward over every row's tree with its ancestor mask (a captured CUDA graph where one fits;
        a ragged tree computes only each row's real nodes where csrc's layers run)."""
        with record_function("eagle3::verify_forward"):
            out = self.graphs.forward(batch.index, tree.tokens, tree.positions, tree.mask) \
                if self.graphs is not None else None
            return out if out is not None else self.target(self.tpool, tree.tokens, tree.positions, rows=batch.index,
                                                           tree_mask=tree.mask, want_aux=self.drafter is not None,
                                                           row_tokens=tree.row_nodes)

    def verify(self, batch: StepBatch, plan: StepPlan, out: TargetOutput) -> VerifyOutput:
        """Each row's accepted path (accept), its KV slots kept, its last token the row's next root; the log-probs of
        the emitted tokens for rows that ask for them."""
        tree = plan.tree
        with record_function("eagle3::accept"):
            acc = accept(tree, out.logits, batch.params, batch.generators, plan.draws)
            counts, emitted = acc.count.tolist(), acc.emitted.tolist()                 # the step's one sync
        path = acc.path[:, :max(counts)]
        with record_function("eagle3::kv_commit"):
            self.tpool.commit(batch.index, path, acc.count)
            last = torch.gather(acc.emitted, 1, (acc.count - 1).view(-1, 1)).view(-1)
            self.roots[batch.index], self.root_pos[batch.index] = last, batch.root_pos + acc.count
        logprobs = [None if p.logprobs is None else
                    token_logprobs(out.logits[b, path[b, :n]], acc.emitted[b, :n], p.logprobs)  # emitted[j]: at path[j]
                    for b, (p, n) in enumerate(zip(batch.params, counts))]
        return VerifyOutput(tree, acc, path, counts, [e[:n] for e, n in zip(emitted, counts)], out.aux_hidden_states,
                            logprobs)

    def commit(self, batch: StepBatch, verified: VerifyOutput, context_proposer: Optional[Proposer]) -> None:
        """Each proposer's hook after the verify: the draft holds the accepted pairs for its next extend (steps that do
        not draft included), the context learns from the chains it proposed."""
        for proposer in (self.drafter, context_proposer):
            if proposer is not None:
                proposer.commit(batch, verified)

    def record(self, batch: StepBatch, plan: StepPlan, verified: VerifyOutput, clock: StepClock,
               owed_s: float = 0.0) -> StepRecord:
        """The finished step for its observers. The forward's seconds are its cost only where it ran synchronously."""
        forward_s = clock.seconds("verify", "forward") if self.target.device.type == "cpu" else None
        return StepRecord(batch.size, plan.tree.mean_nodes, plan.drafted, batch.context, sum(verified.counts),
                          clock.times(), forward_s, owed_s)


def accepted_from_context(plan: StepPlan, verified: VerifyOutput) -> list[list[bool]]:
    """Per row, its accepted draft tokens in order: whether the context alone proposed each."""
    if plan.from_context is None:
        return [[] for _ in verified.counts]
    on_path = torch.gather(plan.from_context, 1, verified.path)[:, 1:].tolist()
    return [f[:n - 1] for f, n in zip(on_path, verified.counts)]


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


def accept_sampled_row(tokens: torch.Tensor, parents: torch.Tensor, drawn: torch.Tensor, logits: torch.Tensor,
                       params: SamplingParams, draws: SampledDraws, b: int,
                       generator: Optional[torch.Generator]) -> tuple[list[int], int]:
    """Row b of a tree with sampled children ([N] each; logits [N, V]), verified by recursive rejection sampling:
    csrc's walk where it runs, else sampled_tree's."""
    if sampling_in_extension(logits):
        u = torch.rand(tokens.shape[0], generator=generator, dtype=torch.float64, device=logits.device)
        return K.accept_sampled_tree(tokens, parents, drawn, logits, params.temperature, params.top_k, params.top_p,
                                     draws.probs[b], draws.draft_targets, u)
    flags, draft = draws.row(b, parents.tolist(), logits.shape[-1])
    return verify_sampled_tree(tokens.tolist(), parents.tolist(), flags, NodeProbs(logits, params), draft, generator)


def accept(tree: DraftTree, logits: torch.Tensor, params: list[SamplingParams],
           generators: list[Optional[torch.Generator]], draws: Optional[SampledDraws] = None) -> Acceptance:
    """Greedy rows as one tensor walk; sampling rows one by one (lossless tree speculative sampling: recursive
    rejection sampling where the row's children were drawn, sampled_tree.verify_sampled_tree)."""
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
        drawn = draws.drawn_from[b] if draws is not None else None
        if drawn is not None and bool((drawn >= 0).any()):
            nodes, bonus = accept_sampled_row(tree.tokens[b], tree.parents[b], drawn, logits[b], p, draws, b, g)
        elif sampling_in_extension(logits):       # one exp pass per visited node, no probability tensor
            nodes, bonus = accept_sampling_row(tree.tokens[b], tree.parents[b], logits[b], p, g)
        else:
            tokens = tree.tokens[b].tolist()
            nodes, bonus = verify_sampling(tokens, tree.parents[b].tolist(), NodeProbs(logits[b], p), g)
        paths.append(nodes)
        emitted.append([int(tree.tokens[b, i]) for i in nodes[1:]] + [bonus])
    return acceptance_from_lists(paths, emitted, logits.device)
