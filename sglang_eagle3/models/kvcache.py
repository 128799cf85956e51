"""The KV pool shared by the target runtime and the draft: fixed rows, fixed slots, per-row lengths.

Layout: k, v [num_layers, num_rows, n_kv_heads, max_len, head_dim]; `lens[r]` slots of row r are committed.
A request owns one row for its lifetime (the scheduler hands rows out and takes them back); nothing is
ever copied when other requests finish. A forward writes its new tokens right after the committed slots
(uncommitted); `commit` keeps the accepted ones, moved to contiguous slots, and the rest is simply
overwritten later. Attention reads each row only up to its own length (kernels.tree_attention).
"""
from __future__ import annotations

from typing import Optional

import torch


class KVPool:
    def __init__(self, num_layers, num_rows, num_kv_heads, max_len, head_dim, dtype, device):
        shape = (num_layers, num_rows, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lens = torch.zeros(num_rows, dtype=torch.long, device=device)   # committed slots per row

    @property
    def num_rows(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def all_rows(self) -> torch.Tensor:
        return torch.arange(self.num_rows, device=self.lens.device)

    def reset(self, rows: torch.Tensor) -> None:
        """Forget what the rows hold (a new request takes them over)."""
        self.lens[rows] = 0

    def check_room(self, rows: torch.Tensor, extra: int) -> None:
        """Raise if a forward writing `extra` slots past the committed ones would run off a row (skipped while a
        CUDA graph is being captured: it reads lengths on the host; the scheduler bounds lengths anyway)."""
        if self.k.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        need = int(self.lens[rows].max()) + extra if rows.numel() else 0
        if need > self.max_len:
            raise RuntimeError(f"KV cache of {self.max_len} slots per row is full (needs {need}); raise max_len")

    def commit(self, rows: torch.Tensor, keep: torch.Tensor, num_keep: torch.Tensor) -> None:
        """Keep, per row, uncommitted slot offsets keep[b, :num_keep[b]] (increasing), moved to the front.

        rows [B]; keep [B, A] int64 (entries past num_keep[b] are ignored); num_keep [B].
        """
        B, A = keep.shape
        if B == 0:
            return
        if B == 1 and not self.k.is_cuda:          # one row on CPU: a strided copy per moved slot, no gathers
            self._commit_one(int(rows[0]), keep[0, :int(num_keep[0])].tolist())
            return
        start = self.lens[rows]                                                        # [B]
        src = start.view(B, 1) + keep                                                  # [B, A]
        if not torch.equal(keep, torch.arange(A, device=keep.device).expand(B, A)):    # compaction needed
            r = rows.view(B, 1).expand(B, A)
            dst = start.view(B, 1) + torch.arange(A, device=keep.device).view(1, A)
            for cache in (self.k, self.v):                                             # gather first: src >= dst
                moved = cache[:, r, :, src]                                            # [L, B, A, nKV, D]
                cache[:, r, :, dst] = moved
        self.lens[rows] = start + num_keep

    def _commit_one(self, row: int, keep: list[int]) -> None:
        """commit for one row: slot start+keep[j] -> start+j, in increasing j (a later source is never a
        destination already written: start+keep[j'] >= start+j' > start+j)."""
        start = int(self.lens[row])
        for j, s in enumerate(keep):
            if s != j:
                for cache in (self.k, self.v):
                    cache[:, row, :, start + j].copy_(cache[:, row, :, start + s])     # [L, nKV, D]
        self.lens[row] = start + len(keep)

    def commit_prefix(self, rows: torch.Tensor, num_new: torch.Tensor) -> None:
        """Keep the first num_new[b] uncommitted slots of each row (prefill, draft extend)."""
        self.lens[rows] += num_new


def prefill_attention(pool: KVPool, layer: int, rows: torch.Tensor, starts: list[int], counts: list[int],
                      q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Long inputs (prefill): store k/v [B, nKV, T, D] at slots starts[b].. of each row and attend causally over
    the row's committed slots plus its first counts[b] new tokens with SDPA. q [B, nH, T, D] -> [B, nH, T, D]
    (padded query positions get zeros)."""
    import torch.nn.functional as F
    out = torch.zeros_like(q)
    for b, (r, start, n) in enumerate(zip(rows.tolist(), starts, counts)):
        pool.k[layer, r, :, start:start + n] = k[b, :, :n]
        pool.v[layer, r, :, start:start + n] = v[b, :, :n]
        if start == 0:
            keys, values, mask = k[b:b + 1, :, :n], v[b:b + 1, :, :n], None
        else:
            keys, values = pool.k[layer, r:r + 1, :, :start + n], pool.v[layer, r:r + 1, :, :start + n]
            slot = torch.arange(start + n, device=q.device)
            mask = slot.view(1, -1) <= (start + torch.arange(n, device=q.device)).view(-1, 1)
        out[b:b + 1, :, :n] = F.scaled_dot_product_attention(q[b:b + 1, :, :n], keys, values, attn_mask=mask,
                                                             is_causal=mask is None, scale=scale, enable_gqa=True)
    return out


def tree_new_mask(B: int, T: int, device, tree_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Which of the T new slots each new query sees: the tree mask [B, T, T] or causal."""
    if tree_mask is not None:
        return tree_mask.contiguous()
    return torch.ones(T, T, dtype=torch.bool, device=device).tril().expand(B, T, T).contiguous()
