"""The TTT loss's pieces that read the target: its distribution over the draft vocabulary (target_distribution),
the distribution a step learns from it (sharpen_target), and the one-pass soft cross-entropy against it
(soft_cross_entropy). ttt.py unrolls the draft steps and calls these."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from . import kernels
from .draft import linear_rows


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax / loss precision: fp32 for half types, else the input's own (fp64 stays fp64 in tests)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class SoftCrossEntropy(torch.autograd.Function):
    """Per-position soft cross-entropy -sum_v p_v log_softmax(z)_v = logsumexp(z) - <p, z> (p sums to 1),
    with the gradient softmax(z) - p written in one pass: far less memory traffic over [S, vocab] than
    log_softmax + multiply + sum and their autograd backward. z [S, V] any float dtype; p [N, V] fp32 read
    through rows [S] (position i is scored against p[rows[i]]).

    bf16 z on CPU (autocast training) runs csrc's kernel: it reads p's rows in place instead of gathering an
    [S, V] copy, and fuses the max, exp, dot and gradient passes (the PyTorch ops below and the gather took ~16% of a
    packed TTT step); fp32 and fp64 z keep these ops, so reference comparisons stay exact."""

    @staticmethod
    def forward(ctx, z, p, rows):
        ext = _soft_ce_extension(z, p, rows)
        ctx.use_ext = ext is not None
        if ext is not None:
            loss, lse = ext.soft_ce_forward(z, p, rows)
            ctx.save_for_backward(z, p, rows, lse)
            return loss
        pr = p[rows]                                                      # [S, V]
        zf = z.to(wide_dtype(z.dtype))
        lse = torch.logsumexp(zf, -1)                                     # [S]
        loss = lse - (pr * zf).sum(-1)     # not a matmul: autocast would run it as a slow bf16 bmm
        ctx.save_for_backward(z, pr)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.use_ext:
            z, p, rows, lse = ctx.saved_tensors
            return kernels.extension().soft_ce_backward(z, p, rows, lse, grad_loss.float().contiguous()), None, None
        z, pr = ctx.saved_tensors
        grad = torch.softmax(z, -1, dtype=wide_dtype(z.dtype))                 # one fused pass (1.6x exp(z - lse))
        grad.sub_(pr).mul_(grad_loss.unsqueeze(-1))
        return grad.to(z.dtype), None, None


def _soft_ce_extension(z: torch.Tensor, p: torch.Tensor, rows: torch.Tensor):
    """csrc's soft cross-entropy where it applies (bf16 logits on CPU, kernels not switched off), else None."""
    if z.dtype != torch.bfloat16 or z.device.type != "cpu" or p.dtype != torch.float32:
        return None
    if not (z.is_contiguous() and p.is_contiguous() and rows.is_contiguous()):
        return None
    return kernels.extension()


def soft_cross_entropy(logits: torch.Tensor, p: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """logits [S, V]; p [S, V], or p [N, V] with rows [S] (position i against p[rows[i]]) -> [S]."""
    if rows is None:
        if p.shape != logits.shape:
            raise ValueError(f"soft_cross_entropy: p {tuple(p.shape)} must match logits {tuple(logits.shape)}")
        rows = torch.arange(logits.shape[0], device=logits.device)
    return SoftCrossEntropy.apply(logits, p, rows.long())


@torch.no_grad()
def target_distribution(last_hidden: torch.Tensor, lm_head: nn.Module, draft_ids: torch.Tensor):
    """last_hidden [..., Ht] (post final norm) -> (p [..., Vd] softmax over the draft vocab, top [...] target ids)."""
    w = lm_head.weight
    logits = linear_rows(lm_head, last_hidden.to(w.dtype))      # [..., V] (bf16 under autocast)
    ext = kernels.extension() if logits.dtype == torch.bfloat16 and logits.device.type == "cpu" else None
    if ext is not None:                                          # csrc: one pass per row, no gathered copy
        p, top = ext.target_distribution(logits.reshape(-1, logits.shape[-1]).contiguous(), draft_ids.contiguous())
        return p.view(*logits.shape[:-1], -1), top.view(logits.shape[:-1])
    top = kernels.argmax(logits)                                        # a cast to fp32 is exact: same argmax
    return logits[..., draft_ids].to(wide_dtype(logits.dtype)).softmax(-1), top


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
