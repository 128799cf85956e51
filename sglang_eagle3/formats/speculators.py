"""The `speculators` layout (vllm-project/speculators), which `vllm serve <folder>` runs directly.

config.json (as `Eagle3SpeculatorConfig` serializes it and vLLM's `SpeculatorsConfig` reads it):

    speculators_model_type        "eagle3"
    speculators_config            {algorithm, proposal_methods [{proposal_type, speculative_tokens, ...}],
                                   default_proposal_method, verifier {name_or_path, architectures}}
    transformer_layer_config      the draft layer as a Llama config; vocab_size = the target's vocabulary
    draft_vocab_size, target_hidden_size, eagle_aux_hidden_state_layer_ids
    norm_before_residual          vLLM assumes true when absent; SGLang-style drafts are false
    fc_norm, norm_output          EAGLE-3.1 (SGLang 0.5.23 and this toolkit run them)
    norm_before_fc                a variant SGLang's draft cannot run

tensors: `midlayer.` is `layers.0.`; fc.weight, norm.weight, lm_head.weight, d2t, t2d (absent when the
draft vocabulary is the full one), sometimes embed_tokens.weight.

Layer ids: vLLM (and speculators) capture the *input* of layer i (HF hidden_states[i]); SGLang's
`eagle_aux_hidden_state_layer_ids` mean the *output* of layer i (it captures layer i + 1's input).
So speculators id = our id + 1.
"""
from __future__ import annotations

import torch

from sglang_eagle3.formats import files

ARCH = "Eagle3Speculator"
TOP_LEVEL = ("architectures", "draft_vocab_size", "target_hidden_size", "eagle_config")
VARIANT_FLAGS = ("norm_before_fc",)            # speculators variants SGLang's draft cannot run
EAGLE31_FLAGS = ("fc_norm", "norm_output")     # EAGLE-3.1: carried over both ways
LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "vocab_size", "num_hidden_layers", "rms_norm_eps", "hidden_act", "tie_word_embeddings",
              "max_position_embeddings", "model_type", "rope_theta", "rope_scaling", "torch_dtype")


def _is_int_list(x) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)


def _schema_notes(raw: dict) -> list[tuple[str, str, str]]:
    notes = []
    if raw.get("speculators_model_type") != "eagle3":
        notes.append(("ERROR", "speculators_model_type",
                      f"speculators_model_type={raw.get('speculators_model_type')!r}, expected 'eagle3'"))
    sc = raw.get("speculators_config")
    if not isinstance(sc, dict):
        return notes + [("ERROR", "speculators_config", "missing config key speculators_config (vLLM needs it "
                         "to recognise the folder and to find the verifier)")]
    if sc.get("algorithm") != "eagle3":
        notes.append(("ERROR", "speculators_config", f"speculators_config.algorithm={sc.get('algorithm')!r}, "
                      "expected 'eagle3'"))
    methods = sc.get("proposal_methods")
    if not (isinstance(methods, list) and methods and isinstance(methods[0], dict)
            and isinstance(methods[0].get("speculative_tokens"), int) and methods[0]["speculative_tokens"] >= 1):
        notes.append(("ERROR", "speculators_config", "speculators_config.proposal_methods[0].speculative_tokens "
                      f"must be an integer >= 1 (vLLM reads it), got proposal_methods={methods!r}"))
    elif sc.get("default_proposal_method") not in [m.get("proposal_type") for m in methods]:
        notes.append(("WARN", "speculators_config", f"default_proposal_method={sc.get('default_proposal_method')!r}"
                      " names none of proposal_methods' proposal_type"))
    verifier = sc.get("verifier")
    if not isinstance(verifier, dict) or "name_or_path" not in verifier:
        notes.append(("ERROR", "speculators_config", "missing config key speculators_config.verifier.name_or_path"))
    elif not verifier["name_or_path"]:
        notes.append(("WARN", "speculators_config", "speculators_config.verifier.name_or_path is empty: "
                      "`vllm serve <folder>` cannot find the target (pass the target explicitly)"))
    if not isinstance(raw.get("transformer_layer_config"), dict):
        notes.append(("ERROR", "transformer_layer_config", "missing config key transformer_layer_config"))
    if "norm_before_residual" not in raw:
        notes.append(("WARN", "norm_before_residual", "norm_before_residual absent: vLLM then assumes true "
                      "(residual = hidden_norm(hidden)); SGLang's draft always uses false"))
    elif raw["norm_before_residual"]:
        notes.append(("WARN", "norm_before_residual", "norm_before_residual=true: vLLM runs it, but SGLang's "
                      "LlamaForCausalLMEagle3 and this toolkit add the un-normalized hidden state"))
    for flag in VARIANT_FLAGS:
        if raw.get(flag):
            notes.append(("WARN", flag, f"{flag}=true: a speculators variant vLLM runs but SGLang's "
                          "LlamaForCausalLMEagle3 and this toolkit cannot"))
    return notes


def config_to_ours(raw: dict):
    """-> (config in our schema, {our key: key in the file}, format notes)."""
    notes = _schema_notes(raw)
    tl = raw.get("transformer_layer_config") if isinstance(raw.get("transformer_layer_config"), dict) else {}
    c = {k: v for k, v in tl.items() if k != "eagle_config"}
    keys = {k: f"transformer_layer_config.{k}" for k in set(c) | set(LAYER_KEYS)}
    if "torch_dtype" not in c and "dtype" in c:
        c["torch_dtype"] = c.pop("dtype")
        keys["torch_dtype"] = "transformer_layer_config.dtype"
    c["architectures"] = [ARCH]
    for k in ("draft_vocab_size", "target_hidden_size", *EAGLE31_FLAGS):
        if raw.get(k) is not None:
            c[k], keys[k] = raw[k], k
    eagle = dict(tl["eagle_config"]) if isinstance(tl.get("eagle_config"), dict) else {}
    # vLLM reads the top-level ids first, then the layer config's eagle_config
    nested = eagle.pop("eagle_aux_hidden_state_layer_ids", None)
    ids, where = raw.get("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids"
    if ids is None and nested is not None:
        ids, where = nested, "transformer_layer_config.eagle_config.eagle_aux_hidden_state_layer_ids"
    if ids is not None:
        shifted = _is_int_list(ids)
        eagle["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in ids] if shifted else ids
        keys["eagle_config.eagle_aux_hidden_state_layer_ids"] = (
            f"{where} {list(ids)} minus 1 (vLLM ids are layer inputs)" if shifted else where)
    if eagle:
        c["eagle_config"] = eagle
    return c, keys, notes


def variant_tensors(raw: dict) -> set[str]:
    """Tensor names a declared speculators variant adds (allowed, but not runnable by SGLang)."""
    names = set()
    if raw.get("norm_before_fc"):
        names.add("input_norm.weight")
    return names


def unsupported_reason(raw: dict) -> str | None:
    """Why this speculators draft cannot become an SGLang-layout draft (None if it can)."""
    if raw.get("norm_before_residual", True):
        return ("norm_before_residual is true (or absent, which vLLM reads as true): the draft adds "
                "hidden_norm(hidden) to the residual, which SGLang's LlamaForCausalLMEagle3 cannot reproduce")
    for flag in VARIANT_FLAGS:
        if raw.get(flag):
            return f"{flag}=true is a speculators variant SGLang's LlamaForCausalLMEagle3 cannot run"
    model_type = (raw.get("transformer_layer_config") or {}).get("model_type", "llama")
    if model_type != "llama":
        return f"transformer_layer_config.model_type={model_type!r}: only Llama-style draft layers are supported"
    return None


def file_name(ours: str) -> str:
    return "layers.0." + ours[len("midlayer."):] if ours.startswith("midlayer.") else ours


def tensors_to_ours(state: dict[str, torch.Tensor]):
    tensors, names = {}, {}
    for k, v in state.items():
        ours = "midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k
        tensors[ours], names[ours] = v, k
    return tensors, names, []


def from_ours(config: dict, tensors: dict[str, torch.Tensor], verifier_name=None, verifier_archs=None,
              speculative_tokens: int = 3):
    """Our config dict + tensors -> (config.json dict, tensors, weights file name)."""
    d = dict(config)
    eagle = dict(d.get("eagle_config") or {})
    aux = eagle.pop("eagle_aux_hidden_state_layer_ids")
    layer = {k: v for k, v in d.items() if k not in TOP_LEVEL + EAGLE31_FLAGS}
    if eagle:
        layer["eagle_config"] = eagle          # e.g. use_aux_hidden_state, which vLLM reads; ids stay top-level
    out = {
        "architectures": [ARCH],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name, "architectures": list(verifier_archs or [])},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": d["draft_vocab_size"],
        "target_hidden_size": d["target_hidden_size"],
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in aux],
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": bool(d.get("fc_norm", False)),
        "norm_output": bool(d.get("norm_output", False)),
    }
    renamed = {file_name(k): v for k, v in tensors.items()}
    return out, renamed, "model.safetensors"


def write(directory: str, config: dict, tensors: dict[str, torch.Tensor], weights_name: str) -> None:
    files.save_safetensors(tensors, f"{directory}/{weights_name}")
    files.save_json(config, f"{directory}/config.json")
