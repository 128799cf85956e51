"""The decode step's kernels: each a wrapper over the C++ extension (csrc/) with a plain-PyTorch twin.

The rest of the package calls these, never the extension itself. Where the extension is off or missing
(`extension.set_mode("off")`, EAGLE3_KERNELS=off, no compiler) the twins run: the eager reference.

- `PackedLinear`: a linear whose bf16 weight is packed once for csrc's few-row kernel (AMX tiles, AVX-512 BF16 dot
  products, or bf16 widened to fp32 on AVX-512F / AVX2) and, where oneDNN's bf16 is native, reordered for oneDNN's
  prefill products. A row's result does not depend on how many rows come with it (lossless bf16 greedy needs it).
- attention over the row-indexed KV pool with a tree mask (`tree_attention`, `qkv_attention` with the rotary
  embedding fused in), RMSNorm, residual add + RMSNorm, SiLU * up;
- whole decoder layers in one call (`layer_step` for the target, `draft_layer` for the EAGLE-3 draft), each over
  one layer's `layer_weights` built when the model is prepared; their twins are the same layers op by op in
  models/target.py and models/draft.py;
- the draft tree's bookkeeping (`topk_logprobs`, `build_tree`) and acceptance (`accept_greedy`, `accept_sampling`):
  at batch 1 these small tensor ops cost more than the draft's levels themselves.
Training's kernels are in kernels/training.py.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from sglang_eagle3.kernels.extension import cpu_has_bf16, few_row_kernel, load, mode


# ---- linear ----------------------------------------------------------------------------------------
def packing_supported(dtype: torch.dtype) -> bool:
    """oneDNN bf16 prepacking pays on CPUs with AVX-512 BF16 (or AMX); fp32 stays on F.linear (the
    reference path: prepacked fp32 matmuls reorder the sums)."""
    if dtype != torch.bfloat16 or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return torch.backends.mkldnn.is_available() and cpu_has_bf16()


SMALL_M = 32       # rows up to which csrc's AVX-512 BF16 kernel beats oneDNN (more: prefill; steps pass any_rows)
ALL_ROWS = 1 << 62  # no native bf16: csrc's widening kernel serves every product (oneDNN's bf16 is emulated there)
SMALL_M_AMX = 128  # the same for its AMX tile kernel
WIDENING = ("avx512f", "avx2")   # csrc's kernels that widen bf16 weights to fp32 in registers (no bf16 instructions)


def small_m(kernel: Optional[str] = None) -> int:
    """Rows up to which a few-row kernel (default: the one PackedLinears built now use) serves a product."""
    kernel = kernel or few_row_kernel()
    if kernel == "amx":
        return SMALL_M_AMX
    return ALL_ROWS if kernel in WIDENING and not cpu_has_bf16() else SMALL_M


class PackedLinear:
    """y = x @ W^T + b with W [N, K], decided when built (set_mode / using_amx / using_few_row before loading a
    model): bf16 on a CPU with AMX (unless EAGLE3_AMX=off): up to SMALL_M_AMX rows, csrc's tile kernel
    (amx_linear.cpp: 16 rows cost what one does); with AVX-512 BF16 only: up to SMALL_M rows, csrc's dot-product
    kernel (45-70 GB/s at one row on 2 cores, but bound by its dot products from ~4 rows on). Either way over
    weights packed for it, and a row's result does not depend on how many rows come with it;
    more rows (prefill), oneDNN over its own prepacked copy (2x the weight memory, for the faster prefill).
    any_rows=True (the target's decode and verify forwards) keeps every row count on the few-row kernel: a
    verified token's logits then come from the sums a one-token step computes, however many rows a batch of trees
    has (oneDNN's sums for a row depend on the product's shape, which broke greedy equality at batch 8 with
    8-token trees).
    bf16 on a CPU without native bf16: csrc's widening kernel for every row count (AVX-512F, else AVX2 + FMA: bf16
    weights widened in registers, fp32 FMAs, the same sums in the same order: decode reads half fp32's bytes;
    PyTorch's emulated bf16 products run 3-100x slower), no other copy.
    Otherwise F.linear on the weight itself."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, pack: Optional[bool] = None):
        weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.out_features, self.in_features = weight.shape
        on_cpu_bf16 = mode() != "off" and weight.device.type == "cpu" and weight.dtype == torch.bfloat16
        self.kernel = few_row_kernel() if on_cpu_bf16 and (pack is None or pack) else None
        only_copy = pack is None and self.kernel in WIDENING and not cpu_has_bf16()   # the few-row kernel serves all
        if pack is None:
            pack = mode() != "off" and weight.device.type == "cpu" and packing_supported(weight.dtype)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1) if pack else None
        ext = load() if (pack or only_copy) and self.kernel else None
        if ext is None:
            self.kernel, self.small = None, None
        else:
            self.small = ext.pack_amx(weight) if self.kernel == "amx" else ext.pack_bf16(weight, self.kernel)
        self.small_m = small_m(self.kernel) if self.small is not None else 0
        self.bias32 = None if self.bias is None else self.bias.float()
        self.weight = None if pack or only_copy else weight  # no unpacked copy when packed

    @property
    def sums_depend_on_threads(self) -> bool:
        """Some row count goes to oneDNN or F.linear, whose sums may follow the thread count; the few-row kernels
        split by output columns and give the same sums on any count (a widening-only copy serves every row count)."""
        return self.packed is not None or self.weight is not None

    def __call__(self, x: torch.Tensor, any_rows: bool = False) -> torch.Tensor:
        if self.weight is not None:
            return F.linear(x, self.weight, self.bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.packed is None:                         # no native bf16: the few-row kernel holds the only copy
            y = load().linear_bf16(x2.to(torch.bfloat16), self.small, self.out_features, self.bias32).to(x.dtype)
        elif self.small is not None and x2.dtype == torch.bfloat16 and (any_rows or x2.shape[0] <= self.small_m):
            y = load().linear_bf16(x2, self.small, self.out_features, self.bias32)
        else:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return y.view(*shape[:-1], self.out_features)


# ---- element-wise -----------------------------------------------------------------------------------
_EXT_DTYPES = (torch.float32, torch.bfloat16)


def _use_ext(*tensors) -> bool:
    return all(t.device.type == "cpu" and t.is_contiguous() and t.dtype == tensors[0].dtype for t in tensors) \
        and tensors[0].dtype in _EXT_DTYPES


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1), the first maximum on ties. On CPU torch's bf16 argmax is 3-5x slower than max(-1) (same
    indices: the first maximum), and a cast to fp32 first costs a copy of x; fp32 argmax is the faster one."""
    return x.max(-1).indices if x.dtype == torch.bfloat16 else x.argmax(-1)


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of log_softmax(logits.float()) over the last dim (fp32 [..., k], larger first) and their
    indices. On CPU one pass of the extension (ties: the smaller index first); elsewhere the PyTorch ops."""
    ext = load()
    if ext is not None and logits.device.type == "cpu" and logits.dtype in _EXT_DTYPES:
        vals, ids = ext.topk_logprobs(logits, k)
        return vals, ids
    return topk_logprobs_ref(logits, k)


def topk_logprobs_ref(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    vals, ids = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)
    return vals, ids


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ext = load()
    if ext is not None and _use_ext(x, weight):
        return ext.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += residual (in place: x is the residual stream); returns rms_norm(x)."""
    ext = load()
    if ext is not None and _use_ext(x, residual, weight):
        return ext.add_rms_norm(x, residual, weight, eps)
    x.add_(residual)
    return rms_norm_ref(x, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    ext = load()
    if ext is not None and _use_ext(gate_up):
        return ext.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- attention ---------------------------------------------------------------------------------------
def tree_attention(q, k_new, v_new, k_cache, v_cache, rows, lens, write_start, new_mask, scale: float):
    """Store k_new/v_new [B, nKV, T, D] at slots write_start[b] + t of pool rows rows[b], then attend.

    q [B, nH, T, D]; k_cache/v_cache [R, nKV, S, D] (one layer of the pool); rows, lens, write_start [B] int64
    (lens = committed slots, all visible); new_mask [B, T, F] bool: query t sees uncommitted slot lens + f.
    -> [B, nH, T, D].
    """
    ext = load()
    if ext is not None and _use_ext(k_cache, v_cache) and q.dtype == k_cache.dtype:
        return ext.tree_attention(q.contiguous(), k_new.contiguous(), v_new.contiguous(), k_cache, v_cache,
                                  rows, lens, write_start, new_mask.contiguous(), scale)
    if k_cache.is_cuda:
        return tree_attention_static(q, k_new, v_new, k_cache, v_cache, rows, lens, write_start, new_mask, scale)
    return tree_attention_ref(q, k_new, v_new, k_cache, v_cache, rows, lens, write_start, new_mask, scale)


def qkv_attention(qkv, cos, sin, num_heads: int, num_kv_heads: int, k_cache, v_cache, rows, lens, write_start,
                  new_mask, scale: float):
    """Rotary embedding of q and k fused with tree_attention, straight from the fused projection.

    qkv [B, T, (nH + 2 nKV) * D]; cos, sin [B, T, D] (transformers' rotary embedding, in qkv's dtype).
    -> [B, T, nH * D], ready for o_proj."""
    ext = load()
    if ext is not None and _use_ext(qkv, cos, sin, k_cache, v_cache):
        return ext.qkv_attention(qkv, cos, sin, num_heads, num_kv_heads, k_cache, v_cache, rows, lens, write_start,
                                 new_mask.contiguous(), scale, None)
    return qkv_attention_ref(qkv, cos, sin, num_heads, num_kv_heads, k_cache, v_cache, rows, lens, write_start,
                             new_mask, scale, attention=tree_attention_static if k_cache.is_cuda else None)


def split_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int):
    """[B, T, (nH + 2 nKV) * D] -> q [B, T, nH, D], k, v [B, T, nKV, D] (views)."""
    B, T, W = qkv.shape
    D = W // (num_heads + 2 * num_kv_heads)
    q = qkv[..., :num_heads * D].view(B, T, num_heads, D)
    k = qkv[..., num_heads * D:(num_heads + num_kv_heads) * D].view(B, T, num_kv_heads, D)
    v = qkv[..., (num_heads + num_kv_heads) * D:].view(B, T, num_kv_heads, D)
    return q, k, v


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, T, D]; cos, sin [B, 1, T, D] -> x * cos + rotate_half(x) * sin (transformers' formula)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def qkv_attention_ref(qkv, cos, sin, num_heads, num_kv_heads, k_cache, v_cache, rows, lens, write_start, new_mask,
                      scale, attention=None):
    B, T, _ = qkv.shape
    q, k, v = (x.transpose(1, 2) for x in split_heads(qkv, num_heads, num_kv_heads))
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    attend = attention or tree_attention_ref
    o = attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, k_cache, v_cache, rows, lens,
                           write_start, new_mask, scale)
    return o.transpose(1, 2).reshape(B, T, -1)


def tree_attention_static(q, k_new, v_new, k_cache, v_cache, rows, lens, write_start, new_mask, scale: float):
    """tree_attention with shapes that depend only on the pool (no host sync): every row attends over the whole
    KV window with a mask from its length, through SDPA. What CUDA graphs capture on GPUs."""
    B, nH, T, D = q.shape
    S, F_ = k_cache.shape[2], new_mask.shape[2]
    slot = write_start.view(B, 1) + torch.arange(T, device=q.device).view(1, T)            # [B, T]
    r = rows.view(B, 1).expand(B, T)
    k_cache[r, :, slot] = k_new.transpose(1, 2)
    v_cache[r, :, slot] = v_new.transpose(1, 2)
    rel = torch.arange(S, device=q.device).view(1, 1, S) - lens.view(B, 1, 1)               # slot - committed
    seen = torch.gather(new_mask, 2, rel.clamp(0, max(F_ - 1, 0)).expand(B, T, S)) & (rel >= 0) & (rel < F_)
    mask = ((rel < 0) | seen).unsqueeze(1)                                                  # [B, 1, T, S]
    return F.scaled_dot_product_attention(q, k_cache[rows], v_cache[rows], attn_mask=mask, scale=scale,
                                          enable_gqa=True)


def tree_attention_ref(q, k_new, v_new, k_cache, v_cache, rows, lens, write_start, new_mask, scale: float):
    B, nH, T, D = q.shape
    nKV, F_ = k_cache.shape[1], new_mask.shape[2]
    slot = write_start.view(B, 1) + torch.arange(T, device=q.device).view(1, T)            # [B, T]
    r = rows.view(B, 1).expand(B, T)
    k_cache[r, :, slot] = k_new.transpose(1, 2)
    v_cache[r, :, slot] = v_new.transpose(1, 2)
    S = int((lens + F_).max())
    k, v = k_cache[rows, :, :S], v_cache[rows, :, :S]                                          # [B, nKV, S, D]
    pos = torch.arange(S, device=q.device).view(1, 1, S)
    rel = pos - lens.view(B, 1, 1)
    seen = torch.gather(new_mask, 2, rel.clamp(0, max(F_ - 1, 0)).expand(B, T, S)) if F_ else \
        torch.zeros(B, T, S, dtype=torch.bool, device=q.device)
    mask = (rel < 0) | (seen & (rel < F_))                                                      # [B, T, S]
    g = nH // nKV
    scores = torch.matmul(q.float().reshape(B, nKV, g * T, D), k.float().transpose(-1, -2)).view(B, nKV, g, T, S)
    scores = scores.mul_(scale).masked_fill_(~mask.view(B, 1, 1, T, S), float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(B, nKV, g * T, S)
    return torch.matmul(probs, v.float()).view(B, nH, T, D).to(q.dtype)


# ---- whole layers (their twins: the layers op by op in models/) ------------------------------------------------
def fused_layers_available() -> bool:
    """csrc's whole-layer kernels (layer_step, draft_layer over a LayerWeights) are built here."""
    ext = load()
    return ext is not None and all(hasattr(ext, name) for name in ("LayerWeights", "layer_step", "draft_layer"))


def layer_weights(input_norm: torch.Tensor, post_norm: torch.Tensor, eps: float, wqkv: PackedLinear,
                  wo: PackedLinear, w_gate_up: PackedLinear, w_down: PackedLinear, num_heads: int,
                  num_kv_heads: int, hidden_norm: Optional[torch.Tensor] = None):
    """One decoder layer's weights as csrc's whole-layer kernels take them (a LayerWeights: the norms, eps, the
    few-row copies of the fused linears, their fp32 biases and sizes), built once when a model is prepared; None
    where those kernels cannot serve the layer (no extension, a linear without a few-row copy, norms not bf16): its
    model then runs it op by op. hidden_norm: the EAGLE-3 draft's norm of the fed hidden state."""
    linears, norms = (wqkv, wo, w_gate_up, w_down), (input_norm, post_norm, hidden_norm)
    if any(lin.small is None for lin in linears) or any(n is not None and n.dtype != torch.bfloat16 for n in norms) \
            or not fused_layers_available():          # last: a GPU model never loads the CPU extension
        return None
    return load().LayerWeights(input_norm=input_norm, post_norm=post_norm, eps=eps, wqkv=wqkv.small, wo=wo.small,
                               w_gate_up=w_gate_up.small, w_down=w_down.small, qkv_features=wqkv.out_features,
                               gate_up_features=w_gate_up.out_features, num_heads=num_heads,
                               num_kv_heads=num_kv_heads, hidden_norm=hidden_norm, wqkv_bias=wqkv.bias32,
                               wo_bias=wo.bias32)


def layer_step(x, delta, capture: bool, weights, cos, sin, k_cache, v_cache, rows, lens, write_start, new_mask,
               scale: float, packed: Optional[torch.Tensor] = None, row_tokens: Optional[torch.Tensor] = None) -> list:
    """One target decoder layer of a decode / verify step (bf16; weights: its layer_weights): x += delta, then
    attention and MLP over the KV pool (the arguments of qkv_attention); returns [the layer's MLP output (the next
    delta), the residual stream x when capture]. A ragged step: x [1, M, H] holds only the real tokens, row b's
    first row_tokens[b] of new_mask's [B, T] layout, at flat indices packed [M] (padding costs nothing)."""
    return load().layer_step(x, delta, capture, weights, cos, sin, k_cache, v_cache, rows, lens, write_start,
                             new_mask, scale, packed, row_tokens)


def draft_layer(embeds, hidden, weights, cos, sin, k_cache, v_cache, rows, lens, write_start, new_mask,
                scale: float) -> torch.Tensor:
    """The EAGLE-3 draft's decoder layer over its KV pool (bf16; weights: its layer_weights, with hidden_norm)
    -> the pre-norm hidden [B, T, H]."""
    return load().draft_layer(embeds, hidden, weights, cos, sin, k_cache, v_cache, rows, lens, write_start, new_mask,
                              scale)


# ---- draft tree and acceptance ---------------------------------------------------------------------------------
def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents [B, N] (-1 = root) -> [B, N, N] bool, row i = ancestors of i plus i (pointer doubling)."""
    B, N = parents.shape
    eye = torch.eye(N, dtype=torch.bool, device=parents.device)
    step = torch.zeros(B, N, N + 1, dtype=torch.bool, device=parents.device)
    step.scatter_(2, torch.where(parents < 0, N, parents).unsqueeze(-1), True)
    mask = step[..., :N] | eye                                                          # self + parent
    for _ in range(max(0, math.ceil(math.log2(max(N, 2))))):
        m = mask.float()
        mask = torch.bmm(m, m) > 0
    return mask


def build_tree(cand_tokens, cand_scores, cand_parents, root_tokens, root_positions, num_draft_tokens: int,
               row_nodes: Optional[torch.Tensor] = None):
    """Pick the num_draft_tokens - 1 best candidates [B, C] (creation order, parent -1 = the root; stable on ties,
    so the set is closed under ancestors) and lay out the tree -> (tokens, parents, depth, mask, positions), node 0
    the root. row_nodes [B] (each in 1..N): row b takes only its row_nodes[b] - 1 best, its nodes past them are
    padding (the root's token and position, parent -1: no walk reaches them; depth 0; they see only themselves).
    On CPU one call of the extension, else build_tree_ref: the same tree."""
    ext = load()
    if ext is not None and cand_tokens.device.type == "cpu":
        return tuple(ext.build_tree(cand_tokens, cand_scores.float(), cand_parents, root_tokens.reshape(-1),
                                    root_positions.reshape(-1), num_draft_tokens, row_nodes))
    return build_tree_ref(cand_tokens, cand_scores, cand_parents, root_tokens, root_positions, num_draft_tokens,
                          row_nodes)


def build_tree_ref(cand_tokens, cand_scores, cand_parents, root_tokens, root_positions, num_draft_tokens: int,
                   row_nodes: Optional[torch.Tensor] = None):
    B, C = cand_tokens.shape
    dev = cand_tokens.device
    n = min(num_draft_tokens - 1, C)
    order = torch.sort(cand_scores, dim=1, descending=True, stable=True).indices[:, :n]
    slot = torch.arange(n, device=dev).expand(B, n)
    real = slot < (row_nodes.view(B, 1) - 1) if row_nodes is not None else torch.ones_like(slot, dtype=torch.bool)
    chosen = torch.sort(torch.where(real, order, C), dim=1).values             # [B, n] creation order, padding last
    node_of = torch.full((B, C + 2), -1, dtype=torch.long, device=dev)         # candidate -> node
    node_of.scatter_(1, chosen, torch.arange(1, n + 1, device=dev).expand(B, n))
    node_of[:, C + 1] = 0                                                      # parent -1 (index C + 1) -> root
    chosen = chosen.clamp(max=C - 1)
    par_cand = torch.gather(cand_parents, 1, chosen)
    parents = torch.gather(node_of, 1, torch.where(par_cand < 0, C + 1, par_cand))
    if (parents[real] < 0).any():
        raise AssertionError("draft tree selection is not closed under ancestors")
    parents = torch.where(real, parents, -1)
    parents = torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=dev), parents], 1)   # [B, N]
    tokens = torch.where(real, torch.gather(cand_tokens, 1, chosen), root_tokens.view(B, 1))
    tokens = torch.cat([root_tokens.view(B, 1), tokens], 1)
    mask = ancestor_mask(parents)
    depth = mask.sum(-1) - 1
    return tokens, parents, depth, mask, root_positions.view(B, 1) + depth


def accept_greedy(tokens, parents, mask, logits):
    """Greedy acceptance of trees from the target's logits [B, N, V] -> (path, count, emitted) [B, N], [B], [B, N]
    (engine/verify.py defines them). On CPU one call of the extension, which takes the argmax only at the nodes the
    accepted walk visits; else accept_greedy_ref over the argmax of every node."""
    ext = load()
    if ext is not None and logits.device.type == "cpu" and logits.dtype in _EXT_DTYPES:
        return tuple(ext.accept_greedy(tokens, parents, logits))
    return accept_greedy_ref(tokens, parents, mask, argmax(logits))


def accept_greedy_ref(tokens, parents, mask, target_argmax):
    """tokens, parents [B, N]; mask [B, N, N] ancestors + self; target_argmax [B, N]: a node is accepted when it and
    all its ancestors match the target's argmax at their parents (siblings are distinct: one root path)."""
    B, N = tokens.shape
    want = torch.gather(target_argmax, 1, parents.clamp(min=0))                   # the target's pick at the parent
    root = torch.arange(N, device=tokens.device) == 0                             # (padding: parent -1, never)
    correct = ((tokens == want) & (parents >= 0)) | root
    accepted = ~(mask & ~correct.unsqueeze(1)).any(-1)                            # [B, N] whole root path correct
    count = accepted.sum(1)
    node = torch.arange(N, device=tokens.device).expand(B, N)
    path = torch.sort(torch.where(accepted, node, N), dim=1).values               # parents precede children
    path = torch.where(node < count.view(B, 1), path, node)                       # pad: identity (no KV move)
    last = torch.gather(path, 1, (count - 1).view(B, 1))
    bonus = torch.gather(target_argmax, 1, last)                                  # [B, 1]
    nxt = torch.gather(tokens, 1, torch.cat([path[:, 1:], path[:, -1:]], 1))     # token of the next path node
    emitted = torch.where(node == (count - 1).view(B, 1), bonus, nxt)
    return path, count, emitted


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The distribution decoding samples from: softmax(logits / temperature) cut to the top_k likeliest tokens
    (0: off) and to the smallest prefix reaching top_p, renormalised. logits [..., V] -> probs [..., V] (fp32)."""
    logits = logits.float() / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, idx, cum = nucleus_prefix(probs, top_p)
        drop = cum - sorted_p >= top_p                  # keep the smallest prefix reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


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


def sampling_in_extension(logits: torch.Tensor) -> bool:
    """Whether accept_sampling runs in the extension for these logits (on the CPU with the extension built)."""
    return logits.device.type == "cpu" and logits.dtype in _EXT_DTYPES and load() is not None


def accept_sampling(tokens, parents, logits, temperature: float, top_k: int, top_p: float,
                    uniforms: torch.Tensor) -> tuple[list[int], int]:
    """Tree speculative sampling of one row: tokens, parents [N] (parents precede children, siblings distinct),
    logits [N, V], uniforms [N] float64 in [0, 1) (one per child tried, then one for the bonus) -> (accepted nodes,
    starting with the root; the bonus token). At a node with distribution p the children are tried in order, each
    accepted with probability r(x) / sum(r), r starting as p with each rejected child zeroed; if none is, the bonus is
    drawn from r. csrc's version makes one exp pass per visited node and cuts top-k / top-p from a histogram of the
    values; accept_sampling_ref does the same walk with sampling_probs."""
    if sampling_in_extension(logits):
        nodes, bonus = load().accept_sampling(tokens, parents, logits, float(temperature), int(top_k), float(top_p),
                                              uniforms)
        return nodes.tolist(), int(bonus[0])
    return accept_sampling_ref(tokens, parents, logits, temperature, top_k, top_p, uniforms)


def accept_sampled_tree(tokens, parents, drawn_from, logits, temperature: float, top_k: int, top_p: float, draft_q,
                        draft_targets, uniforms: torch.Tensor) -> tuple[list[int], int]:
    """Recursive rejection sampling of one row's tree with sampled children (engine/sampled_tree.py's walk, csrc's
    version: one exp pass over the vocabulary per visited node, each rejected draw updating only the draft
    vocabulary's entries). drawn_from [N]: the q slot of draft_q [S, Vd] each node was drawn from (-1: a
    deterministic proposal); draft_targets [Vd]: target ids; uniforms [N] float64. Only where
    sampling_in_extension(logits): the PyTorch walk is sampled_tree.verify_sampled_tree."""
    nodes, bonus = load().accept_sampled_tree(tokens, parents, drawn_from, logits, float(temperature), int(top_k),
                                              float(top_p), draft_q, draft_targets, uniforms)
    return nodes.tolist(), int(bonus[0])


def draft_children(logits, temperature: float, top_k: int, top_p: float, k: int, excluded: torch.Tensor,
                   uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sampling row's draft children at M nodes (csrc's version of sampled_tree.DraftSampler's PyTorch path, the
    same law): logits [M, Vd] -> q [M, Vd] (sampling_probs with the `excluded` draft ids zeroed, renormalised), the
    log of its k largest values [M, k] and k draws without replacement [M, k] (inverse CDF at uniforms [M, k]
    float64; -1 with score -inf past q's tokens). Only where sampling_in_extension(logits)."""
    return tuple(load().draft_children(logits, float(temperature), int(top_k), float(top_p), int(k), excluded,
                                       uniforms))


def accept_sampling_ref(tokens, parents, logits, temperature: float, top_k: int, top_p: float,
                        uniforms: torch.Tensor) -> tuple[list[int], int]:
    toks, pars, u = tokens.tolist(), parents.tolist(), uniforms.tolist()
    node, nodes, k = 0, [0], 0
    while True:
        r = sampling_probs(logits[node], temperature, top_k, top_p).double()
        left = float(r.sum())
        nxt = None
        for c in range(node + 1, len(toks)):
            if pars[c] != node:
                continue
            rc = float(r[toks[c]])
            if u[k] * left < rc:
                k, nxt = k + 1, c
                break
            k += 1
            left -= rc
            r[toks[c]] = 0.0
        if nxt is not None:
            nodes.append(nxt)
            node = nxt
            continue
        if not float(r.sum()) > 0:                  # every token of p was drafted and rejected: p itself
            r = sampling_probs(logits[node], temperature, top_k, top_p).double()
        cdf = r.cumsum(0)
        j = int(torch.searchsorted(cdf, torch.tensor([u[k] * float(cdf[-1])], dtype=torch.float64), right=True))
        if j >= r.shape[0] or not r[j] > 0:         # u * total rounded up to the total: the last token with mass
            j = int(torch.nonzero(r > 0).max())
        return nodes, j
