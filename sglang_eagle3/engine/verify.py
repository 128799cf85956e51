"""Lossless verification of a draft tree against the target's distribution.

Greedy: follow, from the root, the child whose token equals the target's argmax; stop where none
does and emit the target's own argmax there (the bonus token). `accept_greedy` does it for a whole batch
with tensor operations: a node is accepted when it and all its ancestors match the target's argmax at
their parents; siblings are distinct tokens, so the accepted nodes form one root path.

Sampling, deterministic children (the context's proposals; every child under --draft-children top-k, the
EAGLE authors' scheme, where the draft's top-k tokens are taken as they are; sampled children are
sampled_tree.py's): tree speculative sampling. At a node with target distribution p, try its children x1, x2, ... in
order: accept x_i with probability r(x_i) / sum(r), where r starts as p and each rejected child is
zeroed out of r. If all are rejected, sample the bonus from r / sum(r). This yields exactly p: the
chance to emit x_i is prod_{j<i}(1 - P(x_j)) * p(x_i) / (1 - sum_{j<i} p(x_j)) = p(x_i), and the
residual covers the rest. Children are distinct tokens (top-k of the draft), which the proof needs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from sglang_eagle3.errors import UserError
from sglang_eagle3.kernels import decode as K

MAX_TOP_LOGPROBS = 20
SEED_SPACE = 2 ** 64                 # torch.Generator seeds: any int is taken modulo this


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0           # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                     # 0 = off
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    seed: Optional[int] = None
    logprobs: Optional[int] = None     # report each token's log-prob and this many top alternatives (None = off)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.seed is not None:
            if not isinstance(self.seed, int) or isinstance(self.seed, bool):
                raise ValueError(f"seed must be an integer, got {self.seed!r}")
            self.seed %= SEED_SPACE          # what torch's generator does with a negative seed; any int is one
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if any(not isinstance(x, str) or x == "" for x in self.stop):
            raise ValueError(f"stop strings must be non-empty, got {self.stop!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def derived(self, i: int) -> "SamplingParams":
        """The same parameters with the i-th seed derived from this one (None stays None): one random stream per
        prompt of a batch or choice of a request, repeatable for a seeded request."""
        return self if self.seed is None else replace(self, seed=derived_seed(self.seed, i))

    @classmethod
    def from_flags(cls, **values) -> "SamplingParams":
        """SamplingParams from a command line's values; a bad one is a UserError naming its flag (--top-p, ...)."""
        try:
            return cls(**values)
        except ValueError as e:
            msg = str(e)
            for name in ("max_new_tokens", "temperature", "top_p", "top_k", "seed"):
                msg = msg.replace(name, "--" + name.replace("_", "-"))
            raise UserError(msg.replace("stop strings", "--stop strings")) from None


def derived_seed(seed: int, i: int) -> int:
    """Seed i of a family derived from `seed` (choice i of a request, prompt i of a batch, batch i of a run)."""
    return (seed * 1_000_003 + i) % SEED_SPACE


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution decoding samples from: logits [..., V] -> probs [..., V] (fp32)."""
    return K.sampling_probs(logits, params.temperature, params.top_k, params.top_p)


class NodeProbs:
    """target_probs of one row's tree nodes (logits [N, V]), each computed when the sampling walk first visits its
    node: a walk visits about τ of the N nodes."""

    def __init__(self, logits: torch.Tensor, params: SamplingParams):
        self.logits, self.params, self.rows = logits, params, {}

    def __getitem__(self, node: int) -> torch.Tensor:
        if node not in self.rows:
            self.rows[node] = target_probs(self.logits[node], self.params)
        return self.rows[node]


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]       # the most likely tokens at this position and their log-probs, likeliest first


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_top: int) -> list[TokenLogprob]:
    """The target's log-probabilities of tokens [n] under logits [n, V]: log_softmax of the raw logits (before
    temperature, top-k and top-p, as vLLM reports them by default), each with its num_top likeliest tokens."""
    lp = torch.log_softmax(logits.float(), dim=-1)                       # [n, V]
    chosen = lp.gather(-1, tokens.view(-1, 1)).view(-1).tolist()
    if num_top:
        top_lp, top_ids = lp.topk(num_top, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_lp.tolist())]
    else:
        tops = [[] for _ in chosen]
    return [TokenLogprob(t, c, top) for t, c, top in zip(tokens.tolist(), chosen, tops)]


def sample_categorical(probs: torch.Tensor, generator: Optional[torch.Generator] = None) -> int:
    """One draw from probs [V] (>= 0, any positive total); see sample_rows."""
    return int(sample_rows(probs.view(1, -1), [generator])[0])


def sample_rows(probs: torch.Tensor, generators: list[Optional[torch.Generator]]) -> torch.Tensor:
    """One draw per row of probs [n, V] (>= 0, any positive total), row i with generators[i]: the inverse CDF at one
    uniform number per row, one cumulative sum (torch.multinomial draws V exponentials per row on CPU). A token of
    probability 0 is never drawn."""
    cdf = probs.double().cumsum(-1)                                                   # [n, V]
    u = torch.stack([torch.rand((), generator=g, device=probs.device, dtype=torch.float64) for g in generators])
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    over = idx >= probs.shape[-1]                                                     # u * total rounded up to it
    if bool(over.any()):
        last = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)            # last token of nonzero p
        idx = torch.where(over, last, idx)
    return idx


@dataclass
class Acceptance:
    """One verify step's outcome per row. path [B, N]: accepted node indices (root first), valid up to count;
    count [B]: accepted nodes incl. the root = tokens emitted; emitted [B, N]: the tokens, valid up to count
    (the accepted draft tokens, then the bonus token)."""
    path: torch.Tensor
    count: torch.Tensor
    emitted: torch.Tensor


def accept_greedy_logits(tokens: torch.Tensor, parents: torch.Tensor, mask: torch.Tensor,
                         logits: torch.Tensor) -> Acceptance:
    """Greedy acceptance of a batch of trees from the target's logits [B, N, V] (tokens, parents [B, N], mask
    [B, N, N] ancestors + self) as tensor maths: a node is accepted when it and all its ancestors match the
    target's argmax at their parents; siblings are distinct tokens, so the accepted nodes form one root path."""
    return Acceptance(*K.accept_greedy(tokens, parents, mask, logits))


def acceptance_from_lists(paths: list[list[int]], emitted: list[list[int]], device) -> Acceptance:
    """Per-row results (sampling) -> the batched form."""
    A = max(len(p) for p in paths)
    path = torch.tensor([p + list(range(len(p), A)) for p in paths], dtype=torch.long, device=device)
    tok = torch.tensor([e + [e[-1]] * (A - len(e)) for e in emitted], dtype=torch.long, device=device)
    return Acceptance(path, torch.tensor([len(p) for p in paths], device=device), tok)


def children_of(parents) -> list[list[int]]:
    """Each node's children, in node order (parents [N]: -1 at the root)."""
    kids = [[] for _ in parents]
    for i, p in enumerate(parents):
        if p >= 0:
            kids[p].append(i)
    return kids


def verify_greedy(tokens: list[int], parents: list[int], target_argmax: list[int]) -> tuple[list[int], int]:
    """One sequence. Returns (accepted node indices starting with the root, bonus token)."""
    kids = children_of(parents)
    node, accepted = 0, [0]
    while True:
        want = target_argmax[node]
        nxt = next((c for c in kids[node] if tokens[c] == want), None)
        if nxt is None:
            return accepted, want
        accepted.append(nxt)
        node = nxt


def verify_sampling(tokens: list[int], parents: list[int], probs: torch.Tensor,
                    generator: Optional[torch.Generator] = None) -> tuple[list[int], int]:
    """One sequence. probs [N, V]: target distribution at each node. Returns (accepted nodes, bonus token)."""
    kids = children_of(parents)
    node, accepted = 0, [0]
    while True:
        residual = probs[node].clone()
        moved = False
        for c in kids[node]:
            total = residual.sum()
            p_c = residual[tokens[c]] / total if total > 0 else residual.new_tensor(0.0)
            if torch.rand((), generator=generator, device=residual.device) < p_c:
                accepted.append(c)
                node, moved = c, True
                break
            residual[tokens[c]] = 0.0
        if not moved:
            if residual.sum() <= 0:              # every token of p was drafted and rejected: cannot happen
                residual = probs[node].clone()   # with exact arithmetic; fall back to p itself
            bonus = sample_categorical(residual, generator)
            return accepted, bonus


def accept_sampling_row(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor, params: SamplingParams,
                        generator: Optional[torch.Generator] = None) -> tuple[list[int], int]:
    """verify_sampling of one row straight from the target's logits [N, V] (kernels' accept_sampling: the same
    walk, p = target_probs(logits)). Draws N uniforms from the generator up front."""
    u = torch.rand(tokens.shape[0], generator=generator, dtype=torch.float64, device=logits.device)
    return K.accept_sampling(tokens, parents, logits, params.temperature, params.top_k, params.top_p, u)


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator] = None) -> int:
    """One draw from target_probs(logits [V], params) by accept_sampling_row (a tree of the root alone)."""
    root = torch.zeros(1, dtype=torch.long, device=logits.device)
    return accept_sampling_row(root, root - 1, logits.view(1, -1), params, generator)[1]
