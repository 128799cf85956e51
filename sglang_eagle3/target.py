"""Target runtime: a HF causal LM run as the verifier, in plain PyTorch.

The weights are transformers' (any Llama / Qwen2 / Qwen3 / Mistral checkpoint); the forward is ours:
fused qkv and gate_up matmuls, a static per-sequence KV cache, explicit positions and a tree
attention mask, and capture of EAGLE-3's auxiliary hidden states. Fewer, larger kernels than
transformers' generic path, which is what matters for memory-bound decoding.

A forward writes its T new tokens right after each sequence's committed KV slots; `KVCache.commit`
then keeps the accepted ones (see kvcache.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import ConfigError, default_aux_layer_ids
from .kvcache import KVCache, cache_attend, cache_attention_mask, causal_mask

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class TargetOutput:
    logits: torch.Tensor              # [B, T or K, vocab]
    aux_hidden_states: torch.Tensor   # [B, T, n_aux * H]: HF output_hidden_states[id + 1] per aux id, concatenated
    last_hidden: torch.Tensor         # [B, T, H]: after the final norm (logits = lm_head(last_hidden))


class _Layer(nn.Module):
    """One decoder layer's weights, re-packed: wqkv [(nH+2nKV)*D, H], w_gate_up [2I, H]."""

    def __init__(self, hf_layer):
        super().__init__()
        a, m = hf_layer.self_attn, hf_layer.mlp
        self.wqkv = nn.Parameter(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), requires_grad=False)
        bias = [p.bias for p in (a.q_proj, a.k_proj, a.v_proj)]
        self.bqkv = None if bias[0] is None else nn.Parameter(torch.cat(bias), requires_grad=False)
        self.wo = nn.Parameter(a.o_proj.weight, requires_grad=False)
        self.bo = a.o_proj.bias
        self.w_gate_up = nn.Parameter(torch.cat([m.gate_proj.weight, m.up_proj.weight]), requires_grad=False)
        self.w_down = nn.Parameter(m.down_proj.weight, requires_grad=False)
        self.input_norm, self.post_norm = hf_layer.input_layernorm, hf_layer.post_attention_layernorm
        self.q_norm, self.k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)   # Qwen3


class TargetModel(nn.Module):
    def __init__(self, hf_model, tokenizer=None, aux_layer_ids: Optional[list[int]] = None):
        super().__init__()
        cfg = hf_model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"target model_type={cfg.model_type!r} is not supported by the embedded runtime "
                              f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); serve it with SGLang instead")
        self.hf_config, self.tokenizer = cfg, tokenizer
        self.num_layers, self.hidden_size, self.vocab_size = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or self.hidden_size // self.num_heads
        self.aux_layer_ids = list(aux_layer_ids or default_aux_layer_ids(self.num_layers))
        bad = [i for i in self.aux_layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(f"aux layer ids {bad} out of range 0..{self.num_layers - 1} for a {self.num_layers}-layer "
                              "target (id i = HF output_hidden_states[i + 1])")
        if self.aux_layer_ids != sorted(set(self.aux_layer_ids)):
            raise ConfigError(f"aux layer ids {self.aux_layer_ids} must be strictly increasing (SGLang's order)")
        self.capture_at = {i + 1 for i in self.aux_layer_ids}   # layers whose *input* we keep
        inner = hf_model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = nn.ModuleList(_Layer(layer) for layer in inner.layers)
        self.norm = inner.norm
        self.rotary_emb = inner.rotary_emb
        self.lm_head = hf_model.lm_head
        self.requires_grad_(False)

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32, device="cpu",
                        aux_layer_ids: Optional[list[int]] = None) -> "TargetModel":
        from transformers import AutoModelForCausalLM, AutoTokenizer
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        tok = AutoTokenizer.from_pretrained(path)
        return cls(hf, tok, aux_layer_ids).eval()

    @property
    def device(self):
        return self.embed_tokens.weight.device

    @property
    def dtype(self):
        return self.embed_tokens.weight.dtype

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        return KVCache(self.num_layers, batch_size, self.num_kv_heads, max_len, self.head_dim, self.dtype, self.device)

    @torch.no_grad()
    def forward(self, cache: KVCache, input_ids: torch.Tensor, positions: torch.Tensor,
                tree_mask: Optional[torch.Tensor] = None, num_new: Optional[torch.Tensor] = None,
                logit_index: Optional[torch.Tensor] = None, want_aux: bool = True) -> TargetOutput:
        """input_ids, positions [B, T]; tree_mask [B, T, T] bool (row = ancestors + self) or None (causal);
        num_new [B]: valid new tokens per row (the rest is right padding); logit_index [B, K]: only these
        positions get logits (saves the vocab projection in prefill)."""
        B, T = input_ids.shape
        S = cache.check_room(T)
        mask = cache_attention_mask(cache.lens, tree_mask if tree_mask is not None else causal_mask(B, T, input_ids.device),
                                    S, num_new)
        slot = cache.lens.view(B, 1) + torch.arange(T, device=input_ids.device).view(1, T)   # [B, T]
        x = self.embed_tokens(input_ids)                                             # [B, T, H]
        cos, sin = self.rotary_emb(x, positions)                                     # [B, T, D]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        nq, nkv, D = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.head_dim
        captured = {}
        for i, layer in enumerate(self.layers):
            if want_aux and i in self.capture_at:
                captured[i] = x
            qkv = F.linear(layer.input_norm(x), layer.wqkv, layer.bqkv)
            q = qkv[..., :nq].view(B, T, -1, D)
            k = qkv[..., nq:nq + nkv].view(B, T, -1, D)
            v = qkv[..., nq + nkv:].view(B, T, -1, D)
            if layer.q_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)       # [B, h, T, D]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            o = cache_attend(cache, i, slot, mask)(q, k, v)                          # [B, nH, T, D]
            x = x + F.linear(o.transpose(1, 2).reshape(B, T, nq), layer.wo, layer.bo)
            gate, up = F.linear(layer.post_norm(x), layer.w_gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.w_down)
        last = self.norm(x)
        h = last if logit_index is None else torch.gather(last, 1, logit_index.unsqueeze(-1).expand(-1, -1, last.shape[-1]))
        captured[self.num_layers] = last            # id L-1: HF's last hidden state, after the norm ('top' ablation)
        aux_t = torch.cat([captured[i + 1] for i in self.aux_layer_ids], dim=-1) if want_aux else None
        return TargetOutput(self.lm_head(h).float(), aux_t, last)

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None):
        """Training features without a persistent cache. input_ids [B, T] right-padded, attention_mask [B, T].
        Returns (aux_hidden_states [B, T, n_aux*H], last_hidden [B, T, H] after the final norm)."""
        B, T = input_ids.shape
        num_new = attention_mask.sum(1).long() if attention_mask is not None else None
        cache = self.new_cache(B, T)
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        out = self.forward(cache, input_ids, positions, num_new=num_new, logit_index=torch.zeros(B, 1, dtype=torch.long, device=input_ids.device))
        return out.aux_hidden_states, out.last_hidden


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
