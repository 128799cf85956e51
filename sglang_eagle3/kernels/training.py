"""Training's kernels: TTT's soft cross-entropy and the target's distribution over the draft vocabulary, each a
wrapper over the C++ extension (csrc/train_ops.cpp) with its plain-PyTorch twin.

bf16 logits on the CPU (autocast training) run csrc's versions: one pass per row, reading the target's rows in place
instead of gathering an [S, V] copy (the PyTorch ops and the gather took ~16% of a packed TTT step). fp32 and fp64
keep the twins, so reference comparisons stay exact."""
from __future__ import annotations

from typing import Optional

import torch

from sglang_eagle3.kernels.decode import argmax
from sglang_eagle3.kernels.extension import load


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax / loss precision: fp32 for half types, else the input's own (fp64 stays fp64 in tests)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class SoftCrossEntropy(torch.autograd.Function):
    """Per-position soft cross-entropy -sum_v p_v log_softmax(z)_v = logsumexp(z) - <p, z> (p sums to 1),
    with the gradient softmax(z) - p written in one pass: far less memory traffic over [S, vocab] than
    log_softmax + multiply + sum and their autograd backward. z [S, V] any float dtype; p [N, V] fp32 read
    through rows [S] (position i is scored against p[rows[i]])."""

    @staticmethod
    def forward(ctx, z, p, rows):
        ext = soft_ce_extension(z, p, rows)
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
            return load().soft_ce_backward(z, p, rows, lse, grad_loss.float().contiguous()), None, None
        z, pr = ctx.saved_tensors
        grad = torch.softmax(z, -1, dtype=wide_dtype(z.dtype))                 # one fused pass (1.6x exp(z - lse))
        grad.sub_(pr).mul_(grad_loss.unsqueeze(-1))
        return grad.to(z.dtype), None, None


def soft_ce_extension(z: torch.Tensor, p: torch.Tensor, rows: torch.Tensor):
    """csrc's soft cross-entropy where it applies (bf16 logits on CPU, kernels not switched off), else None."""
    if z.dtype != torch.bfloat16 or z.device.type != "cpu" or p.dtype != torch.float32:
        return None
    if not (z.is_contiguous() and p.is_contiguous() and rows.is_contiguous()):
        return None
    return load()


def soft_cross_entropy(logits: torch.Tensor, p: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """logits [S, V]; p [S, V], or p [N, V] with rows [S] (position i against p[rows[i]]) -> [S]."""
    if rows is None:
        if p.shape != logits.shape:
            raise ValueError(f"soft_cross_entropy: p {tuple(p.shape)} must match logits {tuple(logits.shape)}")
        rows = torch.arange(logits.shape[0], device=logits.device)
    return SoftCrossEntropy.apply(logits, p, rows.long())


def draft_vocab_distribution(logits: torch.Tensor, draft_ids: torch.Tensor):
    """The target's logits [..., V] -> (p [..., Vd] softmax over the draft vocabulary draft_ids, top [...] the
    target's argmax over the whole vocabulary)."""
    ext = load() if logits.dtype == torch.bfloat16 and logits.device.type == "cpu" else None
    if ext is not None:                                          # csrc: one pass per row, no gathered copy
        p, top = ext.target_distribution(logits.reshape(-1, logits.shape[-1]).contiguous(), draft_ids.contiguous())
        return p.view(*logits.shape[:-1], -1), top.view(logits.shape[:-1])
    top = argmax(logits)                                         # a cast to fp32 is exact: same argmax
    return logits[..., draft_ids].to(wide_dtype(logits.dtype)).softmax(-1), top
