"""The EAGLE-3 draft model: one definition for the trainer, the engine and the exporters.

Weight names equal SGLang's `LlamaForCausalLMEagle3` checkpoint names (and the official EAGLE-3 ones):

    fc.weight                                   [H, n_aux * H_target]   fuses low/mid/high target features
    fc_norm.{0,1,2}.weight                      [H_target]              EAGLE-3.1 only: RMSNorm per feature
    midlayer.hidden_norm.weight                 [H]                     RMSNorm of the fed hidden state
    midlayer.input_layernorm.weight             [H]                     RMSNorm of the token embedding
    midlayer.self_attn.{q,k,v}_proj.weight      [heads * head_dim, 2H]  reads norm(embed) ++ hidden_norm(hidden)
    midlayer.self_attn.o_proj.weight            [H, heads * head_dim]
    midlayer.post_attention_layernorm.weight    [H]
    midlayer.mlp.{gate,up}_proj.weight          [I, H];  down_proj [H, I]
    norm.weight                                 [H]
    lm_head.weight                              [draft_vocab_size, H]
    d2t                                         [draft_vocab_size] int64   target_id = draft_id + d2t[draft_id]
    t2d                                         [vocab_size] bool          target token is in the draft vocab

The token embedding is the target's, frozen and never saved (`set_embedding`).
EAGLE-3.1 (config `fc_norm`, `norm_output`): fc reads cat(N0(low), N1(mid), N2(high)), and the next draft
step reads the draft's final-normed output instead of its pre-norm hidden state (`next_hidden`).
Attention is delegated to a callable, so inference (KV cache + tree mask) and training-time test
(causal + per-step diagonal keys) run the very same layer code. Writing, reading and the load-time checks of
a checkpoint: `draft_checkpoint`.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang_eagle3.kernels import decode as kernels
from sglang_eagle3.models import draft_checkpoint
from sglang_eagle3.models.config import Eagle3Config
from sglang_eagle3.models.draft_checkpoint import CheckpointError

# attend(q [B, nH, T, D], k [B, nKV, T, D], v [B, nKV, T, D]) -> [B, nH, T, D]
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fast = False                     # inference: the fused kernel (same rounding)

    def forward(self, x):
        if self.fast and not self.training and x.dtype == self.weight.dtype:
            return kernels.rms_norm(x.contiguous(), self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


ROW_BUCKET = 64   # bf16 matrix products on CPU in training: rows padded to a multiple of this (linear_rows)


def linear_rows(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """layer(x). In bf16 on CPU (autocast, or bf16 under autograd) the rows are zero-padded to a multiple of
    ROW_BUCKET first and cut after: oneDNN builds a kernel for every new matrix shape (3x a cached shape's time
    for [~1500, 576] x [576, 8192]), and TTT's row counts change with every batch and step. Zero rows change no
    product and no gradient."""
    if x.device.type != "cpu" or not (torch.is_autocast_enabled("cpu") or
                                      (x.dtype == torch.bfloat16 and torch.is_grad_enabled())):
        return layer(x)
    x2 = x.reshape(-1, x.shape[-1])
    pad = (-x2.shape[0]) % ROW_BUCKET
    if pad == 0:
        return layer(x)
    return layer(F.pad(x2, (0, 0, 0, pad)))[:x2.shape[0]].view(*x.shape[:-1], -1)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    """x [B, h, T, D]; cos/sin [B, T, D]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def sdpa_attend(mask: Optional[torch.Tensor]) -> AttendFn:
    """Plain attention over the given keys; mask [B, 1|nH, T, S] bool (True = attend) or None = causal."""
    def attend(q, k, v):
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    return attend


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.fused = None                                        # inference: (qkv, o) PackedLinears

    def forward(self, x, cos, sin, attend: AttendFn):
        B, T, _ = x.shape
        if self.fused is not None and not self.training and hasattr(attend, "qkv"):   # rotary inside the kernel
            return self.fused[1](attend.qkv(self.fused[0](x), cos, sin, self.num_heads, self.num_kv_heads))
        if self.fused is not None and not self.training:
            q, k, v = kernels.split_heads(self.fused[0](x), self.num_heads, self.num_kv_heads)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        else:
            q = linear_rows(self.q_proj, x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
            k = linear_rows(self.k_proj, x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = linear_rows(self.v_proj, x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attend(q, k, v).transpose(1, 2).reshape(B, T, -1)  # [B, T, nH * D]
        return self.fused[1](out) if self.fused is not None and not self.training else linear_rows(self.o_proj, out)


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.fused = None                                        # inference: (gate_up, down) PackedLinears

    def forward(self, x):
        if self.fused is not None and not self.training:
            return self.fused[1](kernels.silu_and_mul(self.fused[0](x)))
        return linear_rows(self.down_proj, F.silu(linear_rows(self.gate_proj, x)) * linear_rows(self.up_proj, x))


class Eagle3DecoderLayer(nn.Module):
    """SGLang's first (input) draft layer: attention reads norm(embed) ++ hidden_norm(hidden)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg)
        self.layer_weights = None                                # inference: csrc's draft_layer takes these

    def forward(self, embeds, hidden, cos, sin, attend: AttendFn):
        fused = self._fused_layer(embeds, hidden, cos, sin, attend)
        if fused is not None:
            return fused
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)   # [B, T, 2H]
        hidden = residual + self.self_attn(x, cos, sin, attend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))   # pre-norm output [B, T, H]

    def _fused_layer(self, embeds, hidden, cos, sin, attend):
        """The same layer as one csrc call (draft_layer: the same kernels in the same order, bit-identical) when
        inference runs over the draft's KV pool (attend.pool) in bf16 on a CPU with the few-row kernel
        (layer_weights, built by prepare_inference); else None."""
        a, m = self.self_attn, self.mlp
        pool = getattr(attend, "pool", None)
        if pool is None or self.layer_weights is None or self.training or embeds.dtype != torch.bfloat16 or \
                hidden.dtype != torch.bfloat16 or embeds.device.type != "cpu" or \
                embeds.shape[0] * embeds.shape[1] > min(lin.small_m for lin in (*a.fused, *m.fused)):
            return None
        if not kernels.fused_layers_available():
            return None
        return kernels.draft_layer(embeds, hidden, self.layer_weights, cos.contiguous(), sin.contiguous(), *pool)


class RotaryEmbedding(nn.Module):
    """Llama RoPE (any rope_scaling transformers knows), cos/sin for explicit positions."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        rope = cfg.rope_parameters()
        lc = cfg.llama_config()           # transformers' checks, as a ConfigError
        if rope["rope_type"] == "default":
            inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
            self.attention_scaling = 1.0
        else:
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](lc, None)
        self.inv_freq = inv_freq.float()   # a plain attribute: Module.to(bfloat16) must not round RoPE angles
        self._table = None                 # inference: (cos, sin) [positions, head_dim] per dtype, see forward

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [B, T] -> cos, sin [B, T, head_dim] (angles in fp32). Outside autograd, rows of a table
        computed once (the same element-wise formula, so the same values) instead of six ops per CPU step."""
        if self.inv_freq.device != positions.device:
            self.inv_freq, self._table = self.inv_freq.to(positions.device), None
        if torch.is_grad_enabled() or positions.device.type != "cpu":    # GPUs: no host sync (CUDA graphs)
            return self._compute(positions, dtype)
        t = self._table
        if t is None or t[0].dtype != dtype or t[0].shape[0] <= int(positions.max()):
            n = max(4096, 2 * int(positions.max()) + 2)
            t = self._table = self._compute(torch.arange(n, device=positions.device), dtype)
        return t[0][positions], t[1][positions]

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


class Eagle3DraftModel(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.fc_norm = nn.ModuleList(RMSNorm(config.target_hidden_size, config.rms_norm_eps)
                                     for _ in range(config.num_aux)) if config.fc_norm else None
        self.fc = nn.Linear(config.num_aux * config.target_hidden_size, H, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.embed_tokens: Optional[nn.Embedding] = None   # the target's, set by set_embedding; not saved
        self._fused_fc = self._fused_lm_head = None         # prepare_inference
        if config.draft_vocab_size == config.vocab_size:     # the identity map: d2t stays 0, every t2d is set
            self.t2d.fill_(True)

    # ---- vocabulary ---------------------------------------------------------------------
    def set_vocab_mapping(self, draft_to_target: torch.Tensor) -> None:
        """draft_to_target [draft_vocab_size]: sorted-or-not unique target ids of the draft vocab."""
        ids = draft_to_target.long().cpu()
        if ids.shape != (self.config.draft_vocab_size,) or ids.unique().numel() != ids.numel():
            raise CheckpointError(f"draft_to_target must be {self.config.draft_vocab_size} unique target ids, "
                                  f"got shape {tuple(ids.shape)}")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def set_embedding(self, embedding: nn.Embedding) -> None:
        """Use the target's token embedding (frozen, shared, not part of the checkpoint)."""
        if embedding.weight.shape != (self.config.vocab_size, self.config.hidden_size):
            raise CheckpointError(f"target embedding is {tuple(embedding.weight.shape)} but the draft expects "
                                  f"[vocab_size={self.config.vocab_size}, hidden_size={self.config.hidden_size}]")
        embedding.weight.requires_grad_(False)
        object.__setattr__(self, "embed_tokens", embedding)   # not a submodule: never saved or trained

    # ---- forward -------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, hidden_states: torch.Tensor, positions: torch.Tensor,
                attend: Optional[AttendFn] = None, fuse: Optional[bool] = None) -> torch.Tensor:
        """One draft step.

        input_ids [B, T]: the token at each position's *next* slot (x_{t+1} paired with feature t);
        hidden_states [B, T, n_aux*H_target] (target features, step 0) or [B, T, H] (draft's own output);
        positions [B, T]; fuse: apply fc to hidden_states (default: when it is wider than H, as SGLang decides).
        Returns the pre-norm hidden [B, T, H]; logits come from `compute_logits`.
        """
        if self.embed_tokens is None:
            raise RuntimeError("draft has no token embedding: call set_embedding(target.embed_tokens) first")
        embeds = self.embed_tokens(input_ids).to(self.fc.weight.dtype)
        if fuse is None:                                        # SGLang's rule: target features are wider
            fuse = hidden_states.shape[-1] != embeds.shape[-1]
        if fuse:                                                # step 0: g = fc([l; m; h])
            hidden_states = self.project(hidden_states)
        cos, sin = self.rotary(positions, embeds.dtype)
        return self.midlayer(embeds, hidden_states, cos, sin, attend or sdpa_attend(None))

    # ---- inference fast path -------------------------------------------------------------
    @torch.no_grad()
    def prepare_inference(self) -> "Eagle3DraftModel":
        """Fused and prepacked weights for decoding (kernels.PackedLinear: q/k/v and gate/up as one matmul each,
        oneDNN-prepacked in bf16 on CPU) and the fused RMSNorm kernel. Training (`.train()`) drops them; call
        again after the weights change."""
        a, m = self.midlayer.self_attn, self.midlayer.mlp
        a.fused = (kernels.PackedLinear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),
                   kernels.PackedLinear(a.o_proj.weight))
        m.fused = (kernels.PackedLinear(torch.cat([m.gate_proj.weight, m.up_proj.weight])),
                   kernels.PackedLinear(m.down_proj.weight))
        layer = self.midlayer
        layer.layer_weights = kernels.layer_weights(
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight, layer.input_layernorm.eps, *a.fused,
            *m.fused, a.num_heads, a.num_kv_heads, hidden_norm=layer.hidden_norm.weight)
        self._fused_fc = kernels.PackedLinear(self.fc.weight)
        self._fused_lm_head = kernels.PackedLinear(self.lm_head.weight)
        for mod in self.modules():
            if isinstance(mod, RMSNorm):
                mod.fast = True
        return self.eval()

    def train(self, mode: bool = True):
        if mode:
            self.midlayer.self_attn.fused = self.midlayer.mlp.fused = self.midlayer.layer_weights = None
            self._fused_fc = self._fused_lm_head = None
            for mod in self.modules():
                if isinstance(mod, RMSNorm):
                    mod.fast = False
        return super().train(mode)

    def project(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """Fused features g = fc([l; m; h]) (EAGLE-3.1: fc([N0(l); N1(m); N2(h)])): [.., n_aux*H_target] -> [.., H]."""
        x = aux_hidden_states.to(self.fc.weight.dtype)
        if self.fc_norm is not None:
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, x.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        if self._fused_fc is not None and not self.training:
            return self._fused_fc(x)
        return linear_rows(self.fc, x)

    def next_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the next draft step reads: the pre-norm output (EAGLE-3) or the normed one (norm_output)."""
        return self.norm(hidden) if self.config.norm_output else hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[.., H] -> draft-vocab logits [.., draft_vocab_size]."""
        if self._fused_lm_head is not None and not self.training:
            return self._fused_lm_head(self.norm(hidden))
        return linear_rows(self.lm_head, self.norm(hidden))

    # ---- checkpoint ----------------------------------------------------------------------
    def expected_shapes(self) -> dict[str, tuple]:
        return {k: tuple(v.shape) for k, v in self.state_dict().items()}

    def save_pretrained(self, directory: str, dtype: Optional[torch.dtype] = None) -> None:
        draft_checkpoint.save_draft(self, directory, dtype)

    @classmethod
    def on_meta(cls, config: Eagle3Config) -> "Eagle3DraftModel":
        """A draft of this config whose tensors have shapes but no data (checks and size estimates, nothing
        allocated)."""
        with torch.device("meta"):
            return cls(config)

    @classmethod
    def check_files(cls, directory: str, flag: str = "") -> Eagle3Config:
        """What from_pretrained would refuse, read from config.json and the safetensors headers alone (no weights
        load): returns the config."""
        config = Eagle3Config.load(directory, flag)
        draft_checkpoint.check_draft_headers(directory, cls.on_meta(config).expected_shapes())
        return config

    @classmethod
    def from_pretrained(cls, directory: str, dtype: Optional[torch.dtype] = None,
                        device: Optional[torch.device | str] = None) -> "Eagle3DraftModel":
        config = Eagle3Config.load(directory)
        model = cls(config)
        model.load_state_dict(draft_checkpoint.load_draft_state(directory, model.expected_shapes()))
        if dtype is None:
            dtype = getattr(torch, config.torch_dtype, torch.float32)
        return model.to(device=device, dtype=dtype).eval()

    def check_runtime(self) -> None:
        """The cheap checks check-draft makes, run when an engine loads the draft (draft_checkpoint)."""
        draft_checkpoint.check_runtime(self)

    def check_target(self, target_config, aux_layer_ids: Optional[list[int]] = None) -> None:
        """Refuse a draft that cannot work with this target (vocab, hidden size, layer ids)."""
        draft_checkpoint.check_target(self, target_config, aux_layer_ids)
