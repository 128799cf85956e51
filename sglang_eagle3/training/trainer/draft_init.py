"""How a training run's draft starts: its draft vocabulary (given, or chosen from the training rows), random
weights, the target's output head (`--head-init target`), or an earlier draft's weights (`--init-from`), whose
output rows move to a new vocabulary when one is asked for."""
from __future__ import annotations

import json
import os
from typing import Optional

import torch
from torch import nn

from sglang_eagle3.models.config import ConfigError, Eagle3Config
from sglang_eagle3.models.draft import Eagle3DraftModel
from sglang_eagle3.training.trainer import backend as B
from sglang_eagle3.training.trainer.data import token_rows

_log = B.log


def init_head_from_target(draft: Eagle3DraftModel, lm_head: nn.Module, d2t_ids: torch.Tensor, target_path: str,
                          target=None) -> None:
    """Start the draft's output head where the target's is: lm_head = the target's rows for the draft vocabulary,
    final norm = the target's final norm. The draft then only has to learn to produce the target's last hidden
    state, not a new output space (measured faster at small budgets; see the draft README's recipe table)."""
    from sglang_eagle3.models.target_head import load_target_final_norm
    with torch.no_grad():
        draft.lm_head.weight.copy_(lm_head.weight[d2t_ids.to(lm_head.weight.device)].float())
        norm = target.norm.weight.detach() if target is not None and hasattr(target, "norm") else \
            load_target_final_norm(target_path)
        if norm is not None:
            draft.norm.weight.copy_(norm.float())


def check_init_compatible(init: Eagle3Config, dc: Eagle3Config, path: str, new_vocab: bool = False) -> None:
    """--init-from's config must be a draft of the same shape, layers, variant and vocabulary as the one trained (the
    vocabulary may differ where a new one was asked for: its output rows are then remapped)."""
    a, b = init.to_dict(), dc.to_dict()
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "vocab_size", "target_hidden_size") + (() if new_vocab else ("draft_vocab_size",))
    diff = [f"{k}: {a.get(k)} vs {b.get(k)}" for k in keys if a.get(k) != b.get(k)]
    if init.aux_layer_ids != dc.aux_layer_ids:
        diff.append(f"aux layers: {init.aux_layer_ids} vs {dc.aux_layer_ids}")
    for flag in ("fc_norm", "norm_output"):
        if getattr(init, flag) != getattr(dc, flag):
            diff.append(f"{flag}: {getattr(init, flag)} vs {getattr(dc, flag)} (pass --{flag.replace('_', '-')} "
                        "to match)")
    if diff:
        raise ConfigError(f"--init-from {path} does not match the draft being trained: " + "; ".join(diff))


def read_draft_vocab(path: str, vocab_size: int) -> torch.Tensor:
    """--draft-vocab FILE -> draft_to_target [D]: distinct tokens of the target's vocabulary (vocab.py checks)."""
    from sglang_eagle3.training.vocab import read_draft_to_target
    return read_draft_to_target(path, vocab_size, "--draft-vocab")


def given_draft_vocab(cfg, vocab_size: int) -> Optional[torch.Tensor]:
    """--draft-vocab's ids (checked, and against --draft-vocab-size), else None; --draft-vocab-size must be a size
    of the target's vocabulary. The run and `train --check-only` both check through here."""
    if cfg.draft_vocab_size is not None and not 1 <= cfg.draft_vocab_size <= vocab_size:
        raise ConfigError(f"--draft-vocab-size must be in [1, {vocab_size}] (the target's vocabulary), got "
                          f"{cfg.draft_vocab_size}")
    if not cfg.draft_vocab:
        return None
    ids = read_draft_vocab(cfg.draft_vocab, vocab_size)
    if cfg.draft_vocab_size and cfg.draft_vocab_size != ids.numel():
        raise ConfigError(f"--draft-vocab {cfg.draft_vocab} has {ids.numel()} ids, --draft-vocab-size "
                          f"says {cfg.draft_vocab_size}")
    return ids


def draft_vocab_ids(cfg, data, train_idx, vocab_size: int, rank: int) -> torch.Tensor:
    """-> draft_to_target [D]: --draft-vocab's ids, or the --draft-vocab-size most frequent ids of the training
    rows (chosen on rank 0, saved in the run folder and reused on resume), or the full vocabulary."""
    from sglang_eagle3.training.vocab import count_tokens, format_report, load_vocab, save_vocab, select_draft_vocab
    ids = given_draft_vocab(cfg, vocab_size)
    if ids is not None:
        return ids
    if not cfg.draft_vocab_size or cfg.draft_vocab_size == vocab_size:
        return torch.arange(vocab_size)
    path = os.path.join(cfg.out, "draft_vocab.safetensors")
    if rank == 0 and not (cfg.resume and os.path.isfile(path)):
        counts = count_tokens(token_rows(data, train_idx), vocab_size)
        ids, info = select_draft_vocab(counts, cfg.draft_vocab_size)
        save_vocab(cfg.out, ids, counts, {**info, "data": os.path.abspath(cfg.data)})
        _log(format_report({**info, "coverage_table": []}).splitlines()[0])
    B.barrier()
    ids = load_vocab(path)["draft_to_target"].long()
    if ids.numel() != cfg.draft_vocab_size:
        raise ConfigError(f"{path} has {ids.numel()} ids but --draft-vocab-size is {cfg.draft_vocab_size}")
    return ids


def remapped_state(init: Eagle3DraftModel, new: Eagle3DraftModel, target_head: torch.Tensor) -> dict:
    """init's weights for `new`, a draft of the same shape whose vocabulary mapping is already set: the output rows
    move with their tokens (vocab.remap_lm_head; target_head [V, H_t] the target's output rows)."""
    from sglang_eagle3.training.vocab import remap_lm_head
    old_ids = init.draft_to_target(torch.arange(init.config.draft_vocab_size))
    new_ids = new.draft_to_target(torch.arange(new.config.draft_vocab_size))
    head, info = remap_lm_head(init.state_dict()["lm_head.weight"], old_ids, new_ids, target_head)
    _log(f"draft vocabulary {len(old_ids)} -> {len(new_ids)} tokens: {info['kept']} rows kept, {info['new']} new rows "
         f"from the target's head (affine fit cosine {info['fit_cosine']:.3f}), {info['dropped']} dropped")
    return {**init.state_dict(), "lm_head.weight": head, "d2t": new.d2t, "t2d": new.t2d}


def load_init(draft: Eagle3DraftModel, init: Eagle3DraftModel, lm_head: nn.Module, new_vocab: bool) -> None:
    """--init-from's weights into `draft`; with a new vocabulary its output rows are remapped to it."""
    draft.load_state_dict(remapped_state(init, draft, lm_head.weight.detach().cpu()) if new_vocab else
                          init.state_dict())


def run_draft_config(cfg, hf_config, aux_ids: list[int], draft_vocab_size: int) -> Eagle3Config:
    """The config of the draft a run trains: --draft-config's shape (with the run's vocabulary size and aux layers)
    or one layer shaped like the target, and the run's EAGLE-3.1 flags. The run and `train --check-only` both build
    it through here."""
    if cfg.features == "top":                  # one feature: the last hidden state (after the final norm)
        aux_ids = [getattr(hf_config, "text_config", hf_config).num_hidden_layers - 1]
    if cfg.draft_config:
        path = os.path.join(cfg.draft_config, "config.json") if os.path.isdir(cfg.draft_config) else cfg.draft_config
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--draft-config {path}: not a readable JSON file ({e})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"--draft-config {path}: expected a JSON object, got {type(d).__name__}")
        dc = Eagle3Config.from_dict({**d, "draft_vocab_size": draft_vocab_size, "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(aux_ids)}}, where=path)
    else:
        dc = Eagle3Config.for_target(hf_config, draft_vocab_size, aux_ids)
    dc.fc_norm, dc.norm_output = cfg.fc_norm, cfg.norm_output
    return dc


def build_draft(cfg, hf_config, aux_ids: list[int], embed: nn.Module, lm_head: nn.Module, data, train_idx,
                rank: int, target=None) -> Eagle3DraftModel:
    """The draft a run starts from (fp32, on the CPU): its config (for the target, or --draft-config's shape, with
    the run's EAGLE-3.1 flags), its vocabulary, then its weights: seeded random, --head-init target, or
    --init-from's; the target's embedding attached (frozen)."""
    tc = getattr(hf_config, "text_config", hf_config)
    init = Eagle3DraftModel.from_pretrained(cfg.init_from, dtype=torch.float32) if cfg.init_from else None
    new_vocab = init is not None and bool(cfg.draft_vocab or cfg.draft_vocab_size)   # --init-from + a vocab
    if init is None or new_vocab:
        d2t_ids = draft_vocab_ids(cfg, data, train_idx, tc.vocab_size, rank)
    else:
        d2t_ids = init.draft_to_target(torch.arange(init.config.draft_vocab_size))
    dc = run_draft_config(cfg, hf_config, aux_ids, len(d2t_ids))
    if init is not None:
        check_init_compatible(init.config, dc, cfg.init_from, new_vocab)
    torch.manual_seed(cfg.seed)                # identical initial weights on every rank
    draft = Eagle3DraftModel(dc)
    draft.set_vocab_mapping(d2t_ids)
    if init is not None:
        load_init(draft, init, lm_head, new_vocab)
    if cfg.features == "fused":       # "top" uses id L-1 = the last hidden state, which runtimes do not capture
        draft.check_target(hf_config, aux_ids)
    if init is None and cfg.head_init == "target":
        init_head_from_target(draft, lm_head, d2t_ids, cfg.target, target)
    draft.set_embedding(embed)
    return draft


def remap_vocab(draft_dir: str, vocab_path: str, target: str, out: str) -> str:
    """`eagle3 remap-vocab`: a trained draft moved to another draft vocabulary without training (e.g. cut back to
    its most frequent tokens: a smaller output head costs less per draft step). Every input is checked before any
    weights load: --out new, --draft a draft, --draft-vocab's ids, --target's vocabulary."""
    import copy

    from transformers import AutoConfig

    from sglang_eagle3.models.target_head import load_target_head
    if os.path.exists(out):
        raise ConfigError(f"--out {out} exists; give a new folder (a draft is never overwritten)")
    if not os.path.isdir(draft_dir):
        raise ConfigError(f"--draft {draft_dir}: no such folder")
    config = Eagle3Config.load(draft_dir, "--draft")
    ids = read_draft_vocab(vocab_path, config.vocab_size)
    tc = AutoConfig.from_pretrained(target)
    target_vocab = getattr(getattr(tc, "text_config", tc), "vocab_size", None)
    if target_vocab != config.vocab_size:
        raise ConfigError(f"--target {target} has a vocabulary of {target_vocab} tokens; the draft {draft_dir} was "
                          f"trained for {config.vocab_size}")
    stored = Eagle3DraftModel.from_pretrained(draft_dir)
    dtype, init = stored.fc.weight.dtype, stored.float()                # the folder's own dtype is kept
    _, _, lm_head = load_target_head(target, torch.float32, torch.device("cpu"))
    config = copy.deepcopy(init.config)
    config.draft_vocab_size = len(ids)
    new = Eagle3DraftModel(config)
    new.set_vocab_mapping(ids)
    try:
        state = remapped_state(init, new, lm_head.weight.detach())
    except ValueError as e:
        raise ConfigError(f"--draft-vocab {vocab_path}: {e}") from None
    new.load_state_dict(state)
    new.save_pretrained(out, dtype=dtype)
    return out
