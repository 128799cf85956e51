"""The two frozen target pieces offline training needs: the token embedding and the lm_head.

Reading them straight from the checkpoint's safetensors avoids loading a large target just to train from
dumps; anything unusual (other weight names, .bin checkpoints) falls back to loading the whole model.
"""
from __future__ import annotations

import json
import os

import torch
from torch import nn

EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight")
HEAD_NAMES = ("lm_head.weight", "model.lm_head.weight")
NORM_NAMES = ("model.norm.weight", "model.language_model.norm.weight", "norm.weight")


def _tensor_files(path: str) -> dict[str, str]:
    """tensor name -> safetensors file, from model.safetensors or model.safetensors.index.json."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        from safetensors import safe_open
        with safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    return {}


def _read(files: dict[str, str], names) -> torch.Tensor | None:
    from safetensors import safe_open
    for n in names:
        if n in files:
            with safe_open(files[n], framework="pt") as f:
                return f.get_tensor(n)
    return None


def load_target_head(path: str, dtype: torch.dtype, device) -> tuple[object, nn.Embedding, nn.Linear]:
    """-> (hf_config, embedding [V, H], lm_head [V, H]); both frozen."""
    from transformers import AutoConfig
    hf_config = AutoConfig.from_pretrained(path)
    tc = getattr(hf_config, "text_config", hf_config)
    files = _tensor_files(path) if os.path.isdir(path) else {}
    emb = _read(files, EMBED_NAMES)
    head = emb if getattr(hf_config, "tie_word_embeddings", False) else _read(files, HEAD_NAMES)
    if emb is None or head is None:
        from sglang_eagle3.models.target import TargetModel
        t = TargetModel.from_pretrained(path, dtype=dtype, device=device)
        emb, head = t.embed_tokens.weight.detach(), t.lm_head.weight.detach()
    if emb.shape != (tc.vocab_size, tc.hidden_size) or head.shape != (tc.vocab_size, tc.hidden_size):
        raise ValueError(f"{path}: embedding {tuple(emb.shape)} / lm_head {tuple(head.shape)} do not match "
                         f"config.json (vocab {tc.vocab_size}, hidden {tc.hidden_size})")
    embedding = nn.Embedding(tc.vocab_size, tc.hidden_size, device="meta")
    embedding.weight = nn.Parameter(emb.to(device, dtype), requires_grad=False)
    lm_head = nn.Linear(tc.hidden_size, tc.vocab_size, bias=False, device="meta")
    lm_head.weight = nn.Parameter(head.to(device, dtype), requires_grad=False)
    return hf_config, embedding, lm_head


def load_target_final_norm(path: str) -> torch.Tensor | None:
    """The target's final RMSNorm weight [H] from its safetensors, or None when it is not found there."""
    files = _tensor_files(path) if os.path.isdir(path) else {}
    return _read(files, NORM_NAMES)
