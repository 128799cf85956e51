"""Static KV cache shared by the target runtime and the draft, plus the attention it implies.

Layout: k, v [num_layers, B, n_kv_heads, S_max, head_dim]; `lens[b]` slots are committed.
A forward writes its new tokens right after the committed slots (uncommitted); `commit` keeps
the accepted ones, moved to contiguous slots, and the rest is simply overwritten later.
"""
from __future__ import annotations

from typing import Optional

import torch


class KVCache:
    def __init__(self, num_layers, batch_size, num_kv_heads, max_len, head_dim, dtype, device):
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lens = torch.zeros(batch_size, dtype=torch.long, device=device)   # committed tokens per sequence

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def commit(self, accepted: list[list[int]]) -> None:
        """Keep, per sequence, the listed uncommitted slot offsets (in order); drop the others."""
        for b, idx in enumerate(accepted):
            if not idx:
                continue
            start, n = int(self.lens[b]), len(idx)
            if list(idx) != list(range(n)):          # compaction: move accepted slots to the front
                src = torch.tensor(idx, device=self.k.device) + start
                self.k[:, b, :, start:start + n] = self.k[:, b, :, src]
                self.v[:, b, :, start:start + n] = self.v[:, b, :, src]
            self.lens[b] = start + n

    def select(self, rows: torch.Tensor) -> "KVCache":
        """A new cache holding only these rows (a copy; done when sequences finish, not per step)."""
        out = object.__new__(KVCache)
        out.k, out.v, out.lens = self.k[:, rows].clone(), self.v[:, rows].clone(), self.lens[rows].clone()
        return out

    def check_room(self, extra: int) -> int:
        """Slots a forward may touch (max committed + extra); raises if the cache is too small."""
        S = int(self.lens.max()) + extra
        if S > self.max_len:
            raise RuntimeError(f"KV cache of {self.max_len} slots is full (needs {S}); raise max_len")
        return S


def causal_mask(B: int, T: int, device) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool, device=device).tril().expand(B, T, T)


def cache_attention_mask(lens: torch.Tensor, new_mask: torch.Tensor, S: int,
                         num_new: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention mask over the first S cache slots -> [B, 1, T, S] bool (True = attend).

    lens [B]: committed slots (all visible). new_mask [B, T, F]: which of the F uncommitted slots
    lens[b] .. lens[b]+F-1 each of the T queries sees (tree: ancestors + self). num_new [B]: valid query
    rows; padded rows see only slot 0 so the softmax stays finite (their output is never used).
    """
    B, T, Fn = new_mask.shape
    slots = torch.arange(S, device=lens.device).view(1, 1, S)
    rel = slots - lens.view(B, 1, 1)                                             # slot -> uncommitted offset
    in_new = (rel >= 0) & (rel < Fn)
    mask = torch.gather(new_mask, 2, rel.clamp(0, Fn - 1).expand(B, T, S)) & in_new
    mask = mask | (rel < 0)
    if num_new is not None:
        pad = torch.arange(T, device=lens.device).view(1, T, 1) >= num_new.view(B, 1, 1)
        mask = torch.where(pad, slots == 0, mask)
    return mask.unsqueeze(1)


def cache_attend(cache: KVCache, layer: int, slot: torch.Tensor, mask: torch.Tensor):
    """An `attend(q, k, v)` that stores k, v [B, h, T, D] at slot [B, T] and attends over the cache."""
    B, T = slot.shape
    batch = torch.arange(B, device=slot.device).view(B, 1).expand(B, T)
    S = mask.shape[-1]

    def attend(q, k, v):
        cache.k[layer][batch, :, slot] = k.transpose(1, 2)
        cache.v[layer][batch, :, slot] = v.transpose(1, 2)
        return grouped_attention(q, cache.k[layer, :, :, :S], cache.v[layer, :, :, :S], mask)
    return attend


def grouped_attention(q, k, v, mask):
    """Masked attention with grouped KV heads, as plain matmuls (for a few query tokens this beats the
    CPU SDPA kernels by a wide margin). q [B, nH, T, D]; k, v [B, nKV, S, D]; mask [B, 1, T, S] bool."""
    B, nH, T, D = q.shape
    nKV, S = k.shape[1], k.shape[2]
    g = nH // nKV
    scores = torch.matmul(q.reshape(B, nKV, g * T, D), k.transpose(-1, -2)).view(B, nKV, g, T, S)
    scores = scores.float().mul_(D ** -0.5).masked_fill_(~mask.view(B, 1, 1, T, S), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(B, nKV, g * T, S)
    return torch.matmul(probs, v).view(B, nH, T, D)
