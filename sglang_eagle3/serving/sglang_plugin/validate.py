"""Refuse, at SGLang start-up, an EAGLE-3 draft that does not fit the target.

SGLang loads such a draft without complaint in several cases and then serves at an acceptance length
of about 1.0 (every draft token rejected): a draft trained for another tokenizer (vocab_size), for a
target of another width (the draft shares the target's embedding, and `fc` reads n_aux x the target's
hidden size), or aux layer ids beyond the target's layers. `draft_config_problems` compares the two
config.json files; `check_server_args_draft` runs it from `ServerArgs.check_server_args`, which SGLang
calls in the launching process after argument resolution and before any GPU work.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Mapping, Optional

logger = logging.getLogger(__name__)

CHECK_ENV = "SGLANG_EAGLE3_DRAFT_CHECK"   # "0" skips the check (the rest of the plugin stays on)


class DraftMismatchError(ValueError):
    """The draft given by --speculative-draft-model-path cannot work with --model-path."""


def _get(config: Any, key: str, default=None):
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def _has_own_embedding(draft_dir: str) -> Optional[bool]:
    """Whether a local draft checkpoint carries embed_tokens (None: cannot tell)."""
    if not os.path.isdir(draft_dir):
        return None
    files = [f for f in os.listdir(draft_dir) if f.endswith(".safetensors")]
    if not files:
        return None
    from safetensors import safe_open
    for name in files:
        with safe_open(os.path.join(draft_dir, name), "pt") as f:
            if any(k.endswith("embed_tokens.weight") for k in f.keys()):
                return True
    return False


def draft_config_problems(draft: Mapping, target: Any, draft_dir: Optional[str] = None) -> list[str]:
    """What makes this draft config unusable with this target config; [] when nothing is wrong.

    draft: the draft's config.json as a dict. target: the target's (text) config, object or dict.
    Keys a config does not state are not checked (SGLang's defaults then apply).
    """
    problems = []
    V, H, L = (_get(target, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers"))
    dV, dH = draft.get("vocab_size"), draft.get("hidden_size")
    dHt = draft.get("target_hidden_size") or dH
    if dV is not None and V is not None and dV != V:
        problems.append(f"vocab_size: the draft was built for a {dV}-token vocabulary, the target has {V} "
                        "(a draft trained for another tokenizer proposes the wrong tokens)")
    dVd = draft.get("draft_vocab_size")
    if dVd is not None and dV is not None and dVd > dV:
        problems.append(f"draft_vocab_size={dVd} exceeds the draft's vocab_size={dV}")
    if dHt is not None and H is not None and dHt != H:
        key = "target_hidden_size" if draft.get("target_hidden_size") else "hidden_size"
        problems.append(f"hidden size: the draft's fc reads features of width {key}={dHt}, the target's "
                        f"hidden_size is {H}")
    elif dH is not None and H is not None and dH != H and draft_dir and _has_own_embedding(draft_dir) is False:
        problems.append(f"hidden size: draft hidden_size={dH} differs from the target's {H}, so SGLang cannot "
                        "share the target's embedding, and the draft checkpoint has no embed_tokens.weight")
    eagle = draft.get("eagle_config") if isinstance(draft.get("eagle_config"), Mapping) else {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            problems.append(f"eagle_config.eagle_aux_hidden_state_layer_ids={ids!r} is not a list of integers")
        elif L is not None:
            bad = [i for i in ids if not 0 <= i <= L - 2]
            if bad:
                problems.append(f"aux layers: eagle_config.eagle_aux_hidden_state_layer_ids={ids} has {bad} "
                                f"outside [0, {L - 2}] for this {L}-layer target (id i = output of layer i)")
    return problems


def read_config_dict(path: str, revision: Optional[str] = None) -> dict:
    """config.json of a local folder or a hub repository, as a dict."""
    if os.path.isdir(path):
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f)
    from transformers import PretrainedConfig
    config, _ = PretrainedConfig.get_config_dict(path, revision=revision)
    return config


def _target_text_config(server_args, cfg):
    try:
        from sglang.srt.arg_groups.model_override_base import model_config_of
        return model_config_of(server_args).hf_text_config
    except Exception:   # an SGLang without the helper: read it the transformers way
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(cfg.model_path, trust_remote_code=bool(cfg.trust_remote_code),
                                            revision=cfg.revision)
        return config.get_text_config()


def check_server_args_draft(server_args) -> None:
    """Raise DraftMismatchError when an EAGLE-3 draft does not fit the target of these ServerArgs."""
    if os.environ.get(CHECK_ENV, "1") == "0":
        return
    from sglang.srt.arg_groups.overrides import resolving_view
    cfg = resolving_view(server_args)
    if str(cfg.speculative_algorithm or "").upper() != "EAGLE3" or not cfg.speculative_draft_model_path:
        return
    draft_path = str(cfg.speculative_draft_model_path)
    try:
        draft = read_config_dict(draft_path, cfg.speculative_draft_model_revision)
        target = _target_text_config(server_args, cfg)
    except Exception as e:   # unreadable configs are SGLang's to report; never block start-up on our side
        logger.warning("sglang_eagle3: draft check skipped, cannot read the configs (%s: %s)", type(e).__name__, e)
        return
    problems = draft_config_problems(draft, target, draft_dir=draft_path)
    if problems:
        raise DraftMismatchError(
            f"EAGLE-3 draft {draft_path} does not fit target {cfg.model_path}; SGLang would serve it at an "
            "acceptance length of about 1.0:\n  - " + "\n  - ".join(problems) +
            f"\n(checked by the sglang_eagle3 plugin; run `eagle3 check-draft --draft {draft_path} --target "
            f"{cfg.model_path}` for details, or set {CHECK_ENV}=0 to start anyway)")
    logger.info("sglang_eagle3: draft %s fits target %s", draft_path, cfg.model_path)


def _after_check_server_args(result, server_args, *args, **kwargs):
    check_server_args_draft(server_args)
    return result


CHECK_HOOK_TARGET = "sglang.srt.server_args.ServerArgs.check_server_args"


def register_draft_check() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    HookRegistry.register(CHECK_HOOK_TARGET, _after_check_server_args, HookType.AFTER)
