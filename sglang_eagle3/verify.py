"""Lossless verification of a draft tree against the target's distribution.

Greedy: follow, from the root, the child whose token equals the target's argmax; stop where none
does and emit the target's own argmax there (the bonus token). `accept_greedy` does it for a whole batch
with tensor operations: a node is accepted when it and all its ancestors match the target's argmax at
their parents; siblings are distinct tokens, so the accepted nodes form one root path.

Sampling: tree speculative sampling with the draft treated as deterministic (its children are the
top-k tokens, not samples). At a node with target distribution p, try its children x1, x2, ... in
order: accept x_i with probability r(x_i) / sum(r), where r starts as p and each rejected child is
zeroed out of r. If all are rejected, sample the bonus from r / sum(r). This yields exactly p: the
chance to emit x_i is prod_{j<i}(1 - P(x_j)) * p(x_i) / (1 - sum_{j<i} p(x_j)) = p(x_i), and the
residual covers the rest. Children are distinct tokens (top-k of the draft), which the proof needs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


MAX_TOP_LOGPROBS = 20


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
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
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


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution decoding samples from: logits [..., V] -> probs [..., V] (fp32)."""
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        kth = logits.topk(min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx, cum = nucleus_prefix(probs, params.top_p)
        drop = cum - sorted_p >= params.top_p           # keep the smallest prefix reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


class NodeProbs:
    """target_probs of one row's tree nodes (logits [N, V]), each computed when the sampling walk first visits its
    node: a walk visits about τ of the N nodes."""

    def __init__(self, logits: torch.Tensor, params: SamplingParams):
        self.logits, self.params, self.rows = logits, params, {}

    def __getitem__(self, node: int) -> torch.Tensor:
        if node not in self.rows:
            self.rows[node] = target_probs(self.logits[node], self.params)
        return self.rows[node]


def nucleus_prefix(probs: torch.Tensor, top_p: float):
    """The largest probabilities of each row in descending order (values, indices, cumulative sums), as many as
    every row's top-p nucleus needs (every token past them is dropped anyway): from a top-k of 256, then 2,048, and
    only then a sort of the whole vocabulary (4 x 49,152 took 6 ms; a peaked row's nucleus is a few hundred)."""
    V = probs.shape[-1]
    for k in (256, 2048):
        if k >= V // 4:
            break
        vals, idx = probs.topk(k, dim=-1)                                     # sorted, largest first
        cum = vals.cumsum(-1)
        if bool((cum[..., -1] >= top_p).all()):
            return vals, idx, cum
    vals, idx = probs.sort(dim=-1, descending=True)
    return vals, idx, vals.cumsum(-1)


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
    uniform number per row. torch.multinomial draws V exponentials per row on CPU (~0.9 ms at V = 49,152, as long as
    the 135M target's whole batch-64 decode step takes per row); this is one cumulative sum. A token of probability
    0 is never drawn."""
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


def accept_greedy(tokens: torch.Tensor, parents: torch.Tensor, mask: torch.Tensor,
                  target_argmax: torch.Tensor) -> Acceptance:
    """tokens, parents [B, N]; mask [B, N, N] ancestors + self; target_argmax [B, N]."""
    B, N = tokens.shape
    want = torch.gather(target_argmax, 1, parents.clamp(min=0))                   # the target's pick at the parent
    correct = (tokens == want) | (parents < 0)
    accepted = ~(mask & ~correct.unsqueeze(1)).any(-1)                            # [B, N] whole root path correct
    count = accepted.sum(1)
    node = torch.arange(N, device=tokens.device).expand(B, N)
    path = torch.sort(torch.where(accepted, node, N), dim=1).values               # parents precede children
    path = torch.where(node < count.view(B, 1), path, node)                       # pad: identity (no KV move)
    last = torch.gather(path, 1, (count - 1).view(B, 1))
    bonus = torch.gather(target_argmax, 1, last)                                  # [B, 1]
    nxt = torch.gather(tokens, 1, torch.cat([path[:, 1:], path[:, -1:]], 1))     # token of the next path node
    emitted = torch.where(node == (count - 1).view(B, 1), bonus, nxt)
    return Acceptance(path, count, emitted)


def accept_greedy_logits(tokens: torch.Tensor, parents: torch.Tensor, mask: torch.Tensor,
                         logits: torch.Tensor) -> Acceptance:
    """accept_greedy from the target's logits [B, N, V]: on CPU one call of the extension, which takes the argmax
    only at the nodes the accepted walk visits; elsewhere accept_greedy(argmax of every node)."""
    from . import kernels as K
    ext = K.extension()
    if ext is not None and logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16):
        return Acceptance(*ext.accept_greedy(tokens, parents, logits))
    return accept_greedy(tokens, parents, mask, K.argmax(logits))


def acceptance_from_lists(paths: list[list[int]], emitted: list[list[int]], device) -> Acceptance:
    """Per-row results (sampling) -> the batched form."""
    B, A = len(paths), max(len(p) for p in paths)
    path = torch.tensor([p + list(range(len(p), A)) for p in paths], dtype=torch.long, device=device)
    tok = torch.tensor([e + [e[-1]] * (A - len(e)) for e in emitted], dtype=torch.long, device=device)
    return Acceptance(path, torch.tensor([len(p) for p in paths], device=device), tok)


def _children(parents: list[int]) -> list[list[int]]:
    kids = [[] for _ in parents]
    for i, p in enumerate(parents):
        if p >= 0:
            kids[p].append(i)
    return kids


def verify_greedy(tokens: list[int], parents: list[int], target_argmax: list[int]) -> tuple[list[int], int]:
    """One sequence. Returns (accepted node indices starting with the root, bonus token)."""
    kids = _children(parents)
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
    kids = _children(parents)
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


def sampling_in_extension(logits: torch.Tensor) -> bool:
    """Whether accept_sampling_ext serves rows of these logits (any sampling parameters): on the CPU with the
    extension built."""
    from . import kernels as K
    return (logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16)
            and K.extension() is not None)


def accept_sampling_ext(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor, params: SamplingParams,
                        generator: Optional[torch.Generator] = None) -> tuple[list[int], int]:
    """verify_sampling of one row straight from the target's logits [N, V] (csrc's accept_sampling: the same walk,
    p = target_probs(logits), one exp pass per visited node and top-k / top-p cuts from a histogram of the values,
    instead of a softmax over every node, a sort for top-p and a cumulative sum per bonus draw). Draws N uniforms
    from the generator up front."""
    from . import kernels as K
    u = torch.rand(tokens.shape[0], generator=generator, dtype=torch.float64, device=logits.device)
    nodes, bonus = K.extension().accept_sampling(tokens, parents, logits, float(params.temperature), int(params.top_k),
                                                 float(params.top_p), u)
    return nodes.tolist(), int(bonus[0])


def sample_token_ext(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator] = None) -> int:
    """One draw from target_probs(logits [V], params) by csrc's accept_sampling (a tree of the root alone)."""
    root = torch.zeros(1, dtype=torch.long, device=logits.device)
    return accept_sampling_ext(root, root - 1, logits.view(1, -1), params, generator)[1]
