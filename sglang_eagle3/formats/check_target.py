"""`eagle3 check-draft`, part two: the draft's config against its target's.

Vocabulary and hidden size (the draft shares the target's embedding and reads 3 x its hidden states), the aux
layer ids (within the target's layers), RoPE and context length, and a speculators draft's named verifier.
"""
from __future__ import annotations

from typing import Optional

from sglang_eagle3.formats.findings import ERROR, OK, WARN, Report, positive_int


def eagle_config(c: dict) -> dict:
    return c["eagle_config"] if isinstance(c.get("eagle_config"), dict) else {}


def _aux_ids(c: dict):
    return eagle_config(c).get("eagle_aux_hidden_state_layer_ids")


def _rope(d: dict) -> tuple:
    """(theta, rope_type, other parameters) from a config dict, whichever way transformers wrote it."""
    as_dict = lambda x: x if isinstance(x, dict) else {}  # noqa: E731
    params = as_dict(d.get("rope_parameters"))
    if "full_attention" in params:                       # per-layer-type rope (Gemma-style)
        params = as_dict(params["full_attention"])
    theta = d.get("rope_theta") or params.get("rope_theta") or 10000.0
    scaling = as_dict(d.get("rope_scaling")) or {k: v for k, v in params.items() if k != "rope_theta"}
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    rest = {k: v for k, v in scaling.items() if k not in ("rope_type", "type", "rope_theta")}
    return (float(theta) if isinstance(theta, (int, float)) else theta), rope_type, rest


def _fmt_rope(r: tuple) -> str:
    theta, kind, rest = r
    return f"rope_theta={theta}, rope_type={kind}" + (f", {rest}" if rest else "")


def target_findings(r: Report, c: dict, keys: dict, tensors: dict, fmt: str, raw: dict, top, tc) -> None:
    """Add the findings of the draft config `c` against the target config `tc` to `r`. Unlike the loader's
    draft_checkpoint.check_target (which raises, and lets aux id L-1 through for this toolkit's 'top' ablation),
    this grades portability: ids must be <= L-2, since SGLang and vLLM capture id i at layer i+1's input."""
    where = lambda k: keys.get(k, k)  # noqa: E731
    V, H, L = (getattr(tc, k, None) for k in ("vocab_size", "hidden_size", "num_hidden_layers"))
    if not all(positive_int(x) for x in (V, H, L)):
        r.add(ERROR, "target", f"target config lacks vocab_size/hidden_size/num_hidden_layers (got {V}, {H}, {L})")
        return
    if c.get("vocab_size") != V:
        r.add(ERROR, "vocab size", f"draft {where('vocab_size')}={c.get('vocab_size')} (t2d rows) but target "
                                   f"vocab_size={V}")
    else:
        r.add(OK, "vocab size", f"{V} = target vocab_size")
    Ht = c.get("target_hidden_size") or c.get("hidden_size")
    if Ht != H:
        key = "target_hidden_size" if c.get("target_hidden_size") else "hidden_size"
        fc = list(tensors["fc.weight"].shape) if "fc.weight" in tensors else "?"
        r.add(ERROR, "hidden size", f"draft {where(key)}={Ht} (fc.weight {fc} reads 3 x {Ht}) but target "
                                    f"hidden_size={H}")
    elif c.get("hidden_size") != H:
        status = WARN if "embed_tokens.weight" in tensors else ERROR
        r.add(status, "hidden size", f"draft hidden_size={c.get('hidden_size')} but target hidden_size={H}: the "
              "draft cannot share the target embedding" + (" (it carries its own; this toolkit cannot run it)"
                                                             if status == WARN else ""))
    else:
        r.add(OK, "hidden size", f"{H} = target hidden_size")
    check_aux_ids(r, c, keys, L)
    draft_rope, target_rope = _rope(c), _rope({"rope_theta": getattr(tc, "rope_theta", None),
                                               "rope_scaling": getattr(tc, "rope_scaling", None),
                                               "rope_parameters": getattr(tc, "rope_parameters", None)})
    if draft_rope != target_rope:
        r.add(WARN, "rope", f"draft {_fmt_rope(draft_rope)} vs target {_fmt_rope(target_rope)}: engines build the "
                            "draft's RoPE from the draft config, so this is fine if the draft was trained that way")
    else:
        r.add(OK, "rope", _fmt_rope(draft_rope))
    d_ctx, t_ctx = c.get("max_position_embeddings"), getattr(tc, "max_position_embeddings", None)
    if isinstance(d_ctx, int) and isinstance(t_ctx, int) and d_ctx < t_ctx:
        r.add(WARN, "context length", f"draft max_position_embeddings={d_ctx} < target's {t_ctx}: SGLang refuses "
                                      "a draft whose context is shorter than the target's unless "
                                      "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 or --context-length is lower")
    if fmt == "speculators":
        verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("architectures")
        archs = list(getattr(top, "architectures", None) or [])
        if verifier and archs and list(verifier) != archs:
            r.add(WARN, "verifier", f"speculators_config.verifier.architectures={verifier} but the target is {archs}")


def check_aux_ids(r: Report, c: dict, keys: dict, num_layers: Optional[int]) -> None:
    key = keys.get("eagle_config.eagle_aux_hidden_state_layer_ids", "eagle_config.eagle_aux_hidden_state_layer_ids")
    ids = _aux_ids(c)
    L = num_layers
    if ids is None:
        default = f" = [2, {L // 2}, {L - 3}] for this target" if L else ""
        r.add(WARN, "aux layer ids", f"missing {key}: SGLang then captures the inputs of layers [2, L//2, L-3]"
                                     f"{default} (ids [1, L//2-1, L-4]), which is also this toolkit's default")
        return
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        r.add(ERROR, "aux layer ids", f"{key}={ids!r} is not a list of integers")
        return
    if len(ids) != 3:
        r.add(ERROR, "aux layer ids", f"{key}={ids} has {len(ids)} ids; SGLang's and vLLM's fc reads exactly 3 "
                                      "target layers")
    hi = L - 2 if L else None
    bad = [i for i in ids if i < 0 or (hi is not None and i > hi)]
    if bad:
        rng = f"[0, {hi}] for a {L}-layer target" if L else "non-negative"
        r.add(ERROR, "aux layer ids", f"{key}={ids}: ids {bad} out of range; they must be {rng} (id i = output of "
                                      "layer i, captured at layer i+1's input)")
    elif len(set(ids)) != len(ids):
        r.add(WARN, "aux layer ids", f"{key}={ids} repeats a layer")
    elif len(ids) == 3:
        r.add(OK, "aux layer ids", f"{ids}" + (f" within the target's {L} layers" if L else
                                               " (range not checked: no target)"))
