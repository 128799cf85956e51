"""CUDA graphs for the target's decode / verify forward (GPU only; CPU decoding never comes here).

One graph per (batch-size bucket, tokens per row): TargetModel.forward over static input buffers (tokens,
positions, tree mask, pool rows), with attention through `kernels.tree_attention_static` (SDPA over the
row's whole KV window, masked by its length: shapes fixed by the pool, no host synchronisation). A step pads
its rows up to the bucket with a spare pool row that no request owns, copies its inputs into the buffers and
replays the graph; the outputs are static tensors, read before the next replay. Shapes that no bucket covers
run eagerly.
"""
from __future__ import annotations

from typing import Optional

import torch

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class CudaGraphRunner:
    def __init__(self, target, pool, spare_row: int, buckets=BUCKETS, want_aux: bool = True):
        if not pool.k.is_cuda:
            raise ValueError("CUDA graphs need the KV pool on a CUDA device")
        self.target, self.pool, self.spare = target, pool, spare_row
        self.buckets = tuple(b for b in buckets if b <= pool.num_rows - 1)
        self.want_aux = want_aux
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.pool_mem = None

    def bucket(self, batch: int) -> Optional[int]:
        return next((b for b in self.buckets if b >= batch), None)

    @torch.no_grad()
    def _capture(self, B: int, T: int):
        dev = self.pool.k.device
        tokens = torch.zeros(B, T, dtype=torch.long, device=dev)
        positions = torch.zeros(B, T, dtype=torch.long, device=dev)
        mask = torch.eye(T, dtype=torch.bool, device=dev).expand(B, T, T).contiguous()
        rows = torch.full((B,), self.spare, dtype=torch.long, device=dev)
        lens = self.pool.lens[self.spare].clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):                          # warm-up outside the graph (allocator, kernels)
            for _ in range(2):
                self.target(self.pool, tokens, positions, rows=rows, tree_mask=mask, want_aux=self.want_aux)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool_mem):
            out = self.target(self.pool, tokens, positions, rows=rows, tree_mask=mask, want_aux=self.want_aux)
        self.pool_mem = graph.pool()
        self.pool.lens[self.spare] = lens                        # the warm-up wrote nothing committed
        return graph, tokens, positions, mask, rows, out

    @torch.no_grad()
    def forward(self, rows: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor):
        """Like target(pool, tokens, positions, rows=rows, tree_mask=tree_mask, want_aux=...); None when no bucket
        fits (the caller runs eagerly)."""
        B, T = tokens.shape
        Bb = self.bucket(B)
        if Bb is None:
            return None
        key = (Bb, T)
        if key not in self.graphs:
            self.graphs[key] = self._capture(Bb, T)
        graph, tok_buf, pos_buf, mask_buf, rows_buf, out = self.graphs[key]
        tok_buf[:B].copy_(tokens)
        pos_buf[:B].copy_(positions)
        mask_buf[:B].copy_(tree_mask)
        rows_buf[:B].copy_(rows)
        rows_buf[B:].fill_(self.spare)
        pos_buf[B:].copy_(self.pool.lens[self.spare] + torch.arange(T, device=pos_buf.device))
        graph.replay()
        from sglang_eagle3.models.target import TargetOutput
        aux = out.aux_hidden_states[:B] if out.aux_hidden_states is not None else None
        return TargetOutput(out.logits[:B], aux, out.last_hidden[:B])
