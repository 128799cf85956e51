"""Target runtime: a HF causal LM run as the verifier, in plain PyTorch.

The weights are transformers' (any Llama / Qwen2 / Qwen3 / Mistral checkpoint); the forward is ours:
fused qkv and gate_up matmuls (prepacked for oneDNN in bf16, kernels.PackedLinear), a KV pool of fixed
rows indexed per request, explicit positions and a tree attention mask, fused RMSNorm / residual /
SiLU kernels, and capture of EAGLE-3's auxiliary hidden states.

Two attention paths: up to PREFILL_T new tokens per row (decode, tree verify, draft extend) go through
kernels.tree_attention straight over the pool; longer inputs (prefill) use SDPA per row.
A forward writes its T new tokens right after each row's committed KV slots; `KVPool.commit` then keeps
the accepted ones (see kvcache.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from sglang_eagle3.kernels import decode as K
from sglang_eagle3.kernels import extension
from sglang_eagle3.models.config import ConfigError, context_length, default_aux_layer_ids
from sglang_eagle3.models.kvcache import KVPool, prefill_attention, tree_new_mask

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
PREFILL_T = 64          # more new tokens per row than this: the SDPA prefill path


@dataclass
class TargetOutput:
    logits: torch.Tensor              # [B, T or K, vocab] in the target's dtype (a cast to fp32 is exact)
    aux_hidden_states: torch.Tensor   # [B, T, n_aux * H]: HF output_hidden_states[id + 1] per aux id, concatenated
    last_hidden: torch.Tensor         # [B, T, H]: after the final norm (logits = lm_head(last_hidden))


def unpacked(out: TargetOutput, packed: torch.Tensor, B: int, T: int) -> TargetOutput:
    """A ragged forward's outputs ([1, M, .] at flat indices packed [M] of the [B, T] layout) laid out as [B, T, .];
    the padding's entries are left unset."""
    def lay(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if t is None:
            return None
        full = t.new_empty(B * T, t.shape[-1])
        return full.index_copy_(0, packed, t.view(-1, t.shape[-1])).view(B, T, -1)
    return TargetOutput(lay(out.logits), lay(out.aux_hidden_states), lay(out.last_hidden))


def _eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


class _Layer(nn.Module):
    """One decoder layer's weights, re-packed: wqkv [(nH+2nKV)*D, H], w_gate_up [2I, H]; and all of them as csrc's
    layer_step takes them (layer_weights, None: the layer runs op by op)."""

    def __init__(self, hf_layer, num_heads: int, num_kv_heads: int):
        super().__init__()
        a, m = hf_layer.self_attn, hf_layer.mlp
        bias = [p.bias for p in (a.q_proj, a.k_proj, a.v_proj)]
        self.wqkv = K.PackedLinear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                                   None if bias[0] is None else torch.cat(bias))
        self.wo = K.PackedLinear(a.o_proj.weight, a.o_proj.bias)
        self.w_gate_up = K.PackedLinear(torch.cat([m.gate_proj.weight, m.up_proj.weight]))
        self.w_down = K.PackedLinear(m.down_proj.weight)
        self.input_norm, self.post_norm = hf_layer.input_layernorm, hf_layer.post_attention_layernorm
        self.eps = _eps(self.input_norm)
        self.q_norm, self.k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)   # Qwen3
        self.layer_weights = None if self.q_norm is not None else \
            K.layer_weights(self.input_norm.weight, self.post_norm.weight, self.eps, self.wqkv, self.wo,
                            self.w_gate_up, self.w_down, num_heads, num_kv_heads)


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
            raise ConfigError(f"aux layer ids {bad} out of range 0..{self.num_layers - 1} for a "
                              f"{self.num_layers}-layer target (id i = HF output_hidden_states[i + 1])")
        if self.aux_layer_ids != sorted(set(self.aux_layer_ids)):
            raise ConfigError(f"aux layer ids {self.aux_layer_ids} must be strictly increasing (SGLang's order)")
        self.capture_at = {i + 1 for i in self.aux_layer_ids}   # layers whose *input* we keep
        inner = hf_model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = nn.ModuleList(_Layer(layer, self.num_heads, self.num_kv_heads) for layer in inner.layers)
        self.norm = inner.norm
        self.final_eps = _eps(inner.norm)
        self.rotary_emb = inner.rotary_emb
        self.lm_head = hf_model.lm_head                      # the module (training reads it); decoding uses:
        self.lm_head_packed = K.PackedLinear(self.lm_head.weight, getattr(self.lm_head, "bias", None))
        # a prompt's forward runs a product whose sums may follow the thread count (oneDNN or F.linear for many
        # rows): the engine then runs it on a fixed count
        linears = [lin for ly in self.layers for lin in (ly.wqkv, ly.wo, ly.w_gate_up, ly.w_down)]
        self.prefill_depends_on_threads = any(lin.sums_depend_on_threads for lin in linears + [self.lm_head_packed])
        self._layer_step_ok: dict[str, bool] = {}          # kernel mode -> csrc's layer_step serves decode steps
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

    @property
    def context_len(self) -> Optional[int]:
        """The tokens a sequence may hold (the config's max_position_embeddings), None where it does not say."""
        return context_length(self.hf_config)

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every layer's matrices and norms, the final norm, the lm_head."""
        el = self.embed_tokens.weight.element_size()
        c = self.hf_config
        inter = c.intermediate_size
        per_layer = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim * self.hidden_size \
            + self.num_heads * self.head_dim * self.hidden_size + 3 * inter * self.hidden_size + 2 * self.hidden_size
        return el * (self.num_layers * per_layer + self.hidden_size + self.vocab_size * self.hidden_size)

    def forward_flops(self, context: int, T: int) -> int:
        """FLOPs of one forward over T new tokens per row after `context` cached ones (batch 1): every layer's
        linears and the head over T rows, and attention's scores and weighted sums (each query against the cached
        keys and, at most, the T new ones)."""
        linears = sum(lin.out_features * lin.in_features for layer in self.layers
                      for lin in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down))
        linears += self.lm_head_packed.out_features * self.lm_head_packed.in_features
        attention = self.num_layers * self.num_heads * T * (context + T) * self.head_dim * 4
        return 2 * T * linears + attention

    def new_cache(self, num_rows: int, max_len: int) -> KVPool:
        return KVPool(self.num_layers, num_rows, self.num_kv_heads, max_len, self.head_dim, self.dtype, self.device)

    @torch.no_grad()
    def forward(self, cache: KVPool, input_ids: torch.Tensor, positions: torch.Tensor,
                tree_mask: Optional[torch.Tensor] = None, num_new: Optional[torch.Tensor] = None,
                logit_index: Optional[torch.Tensor] = None, want_aux: bool = True,
                rows: Optional[torch.Tensor] = None, row_tokens: Optional[torch.Tensor] = None) -> TargetOutput:
        """input_ids, positions [B, T]; rows [B]: pool rows (default 0..B-1); tree_mask [B, T, T] bool (row =
        ancestors + self) or None (causal); num_new [B]: valid new tokens per row (the rest is right padding);
        logit_index [B, K]: only these positions get logits (saves the vocab projection in prefill).
        row_tokens [B] (a ragged verify; with tree_mask): row b's tree is its first row_tokens[b] nodes, the rest
        padding that no real node sees. Where csrc's layers run, padding is not computed and its outputs are left
        unset (nothing may read them); elsewhere it is computed like any node.
        Nothing is committed: the caller keeps what it accepts (cache.commit / commit_prefix)."""
        B, T = input_ids.shape
        if rows is None:
            rows = torch.arange(B, device=input_ids.device)
        cache.check_room(rows, T)
        x = self.embed_tokens(input_ids)                                             # [B, T, H] residual stream
        cos, sin = self.rotary_emb(x, positions)                                     # [B, T, D]
        captured, delta = {}, None
        if self._fused_layers_apply(x, T, tree_mask):      # one C++ call per layer (decode, verify, draft trees)
            lens, new_mask = self._pool_slots(cache, rows, T, tree_mask)
            cos, sin = cos.contiguous(), sin.contiguous()
            step, scale = K.layer_step, self.head_dim ** -0.5
            packed = None
            if row_tokens is not None and logit_index is None and bool((row_tokens < T).any()):
                packed = torch.nonzero((torch.arange(T, device=x.device) < row_tokens.view(B, 1)).view(-1)).view(-1)
                x = x.view(B * T, -1).index_select(0, packed).view(1, -1, x.shape[-1])   # [1, M, H] real tokens
                row_tokens = row_tokens.contiguous()
            for i, layer in enumerate(self.layers):
                cap = want_aux and i in self.capture_at
                out = step(x, delta, cap, layer.layer_weights, cos, sin, cache.k[i], cache.v[i], rows, lens, lens,
                           new_mask, scale, packed, None if packed is None else row_tokens)
                delta = out[0]
                if cap:
                    captured[i] = out[1]
            out = self._finish(x, delta, logit_index, captured, want_aux, True)
            return out if packed is None else unpacked(out, packed, B, T)
        attend = self._attention(cache, rows, T, tree_mask, num_new)
        step = self._over_pool(T, tree_mask)     # decode / verify: the few-row kernels at any row count (lossless)
        for i, layer in enumerate(self.layers):
            w = layer.input_norm.weight
            h = K.rms_norm(x, w, layer.eps) if delta is None else K.add_rms_norm(x, delta, w, layer.eps)   # x += delta
            if want_aux and i in self.capture_at:
                captured[i] = x.clone()
            o = attend(i, layer, layer.wqkv(h, step), cos, sin)                      # [B, T, nH * D]
            h = K.add_rms_norm(x, layer.wo(o, step), layer.post_norm.weight, layer.eps)    # x += attention
            delta = layer.w_down(K.silu_and_mul(layer.w_gate_up(h, step)), step)
        return self._finish(x, delta, logit_index, captured, want_aux, step)

    def _fused_layers_apply(self, x: torch.Tensor, T: int, tree_mask) -> bool:
        """csrc's layer_step serves this forward: bf16 on a CPU with the extension, every layer's layer_weights
        built (every linear packed for the few-row kernel, bf16 norms, no q/k norms), few tokens over the KV pool
        (not a prefill), at any batch size (the few-row kernels serve every row count of a step, so a row's sums
        never depend on the batch)."""
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or not self._over_pool(T, tree_mask):
            return False
        ok = self._layer_step_ok.get(extension.mode())
        if ok is None:                                     # the weights never change: decide once per kernel mode
            ok = self._layer_step_ok[extension.mode()] = K.fused_layers_available() and \
                all(layer.layer_weights is not None for layer in self.layers)
        return ok

    def _finish(self, x, delta, logit_index, captured: dict, want_aux: bool, step: bool) -> TargetOutput:
        last = K.add_rms_norm(x, delta, self.norm.weight, self.final_eps)
        h = last if logit_index is None else \
            torch.gather(last, 1, logit_index.unsqueeze(-1).expand(-1, -1, last.shape[-1]))
        captured[self.num_layers] = last            # id L-1: HF's last hidden state, after the norm ('top' ablation)
        aux_t = torch.cat([captured[i + 1] for i in self.aux_layer_ids], dim=-1) if want_aux else None
        return TargetOutput(self.lm_head_packed(h, step), aux_t, last)

    def _attention(self, cache: KVPool, rows, T, tree_mask, num_new):
        """attend(layer index, layer, qkv [B, T, W], cos, sin) -> [B, T, nH * D] for this forward: the pool kernel
        for few new tokens (rotary embedding fused in), SDPA per row for prefill."""
        scale, nH, nKV = self.head_dim ** -0.5, self.num_heads, self.num_kv_heads
        B = len(rows)
        if self._over_pool(T, tree_mask):
            lens, new_mask = self._pool_slots(cache, rows, T, tree_mask)

            def attend(i, layer, qkv, cos, sin):
                if layer.q_norm is None:
                    return K.qkv_attention(qkv, cos, sin, nH, nKV, cache.k[i], cache.v[i], rows, lens, lens,
                                           new_mask, scale)
                q, k, v = self._heads(layer, qkv, cos, sin)
                o = K.tree_attention(q, k, v, cache.k[i], cache.v[i], rows, lens, lens, new_mask, scale)
                return o.transpose(1, 2).reshape(B, T, -1)
            return attend
        counts = [T] * B if num_new is None else num_new.tolist()
        starts = cache.lens[rows].tolist()

        def attend_prefill(i, layer, qkv, cos, sin):
            q, k, v = self._heads(layer, qkv, cos, sin)
            return prefill_attention(cache, i, rows, starts, counts, q, k, v, scale).transpose(1, 2).reshape(B, T, -1)
        return attend_prefill

    @staticmethod
    def _over_pool(T: int, tree_mask) -> bool:
        """Few new tokens (decode, verify, a draft tree) attend over the KV pool; longer causal inputs are a prefill."""
        return T <= PREFILL_T or tree_mask is not None

    @staticmethod
    def _pool_slots(cache: KVPool, rows, T: int, tree_mask):
        """(lens [B]: committed slots per row, new_mask [B, T, T]: what each new token sees among the new ones)."""
        return cache.lens[rows].clone(), tree_new_mask(len(rows), T, rows.device, tree_mask).contiguous()

    def _heads(self, layer, qkv, cos, sin):
        """q [B, nH, T, D], k, v [B, nKV, T, D] with the rotary embedding (and Qwen3's q/k norms) applied."""
        q, k, v = K.split_heads(qkv, self.num_heads, self.num_kv_heads)
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return K.apply_rope(q.transpose(1, 2), cos, sin), K.apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None):
        """Training features without a persistent cache. input_ids [B, T] right-padded, attention_mask [B, T].
        Returns (aux_hidden_states [B, T, n_aux*H], last_hidden [B, T, H] after the final norm)."""
        B, T = input_ids.shape
        num_new = attention_mask.sum(1).long() if attention_mask is not None else None
        cache = self.new_cache(B, T)
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        out = self.forward(cache, input_ids, positions, num_new=num_new,
                           logit_index=torch.zeros(B, 1, dtype=torch.long, device=input_ids.device))
        return out.aux_hidden_states, out.last_hidden
