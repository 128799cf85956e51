"""The two layouts that share SGLang's tensor names: ours (`sglang`) and the released EAGLE-3 one.

Both store the draft as

    fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d   (+ embed_tokens.weight, sometimes)

with a Llama-style config.json plus `draft_vocab_size` (and `target_hidden_size`,
`eagle_config.eagle_aux_hidden_state_layer_ids` when set). They differ only in

    sglang          architectures ["LlamaForCausalLMEagle3"], model.safetensors (also SpecForge's exports)
    eagle-official  architectures ["LlamaForCausalLM"], pytorch_model.bin (SafeAILab/EAGLE's
                    `eagle/traineagle3/config.json`; SGLang maps a draft's LlamaForCausalLM to its
                    LlamaForCausalLMEagle3 class, and `EaModel` reads pytorch_model.bin first)

vLLM loads these names too (it maps `midlayer.` to `layers.0.`), but it reads
`eagle_aux_hidden_state_layer_ids` as layer *inputs* where SGLang reads layer outputs, so explicit
ids are off by one there: give vLLM the `speculators` export, which shifts them.
"""
from __future__ import annotations

import torch

from sglang_eagle3.formats import files

SGLANG_ARCH = "LlamaForCausalLMEagle3"
OFFICIAL_ARCH = "LlamaForCausalLM"
WEIGHTS = {"sglang": "model.safetensors", "eagle-official": "pytorch_model.bin"}


def config_to_ours(raw: dict):
    """-> (config in our schema, {our key: key in the file}, format notes [(status, check, detail)])."""
    c = dict(raw)
    keys = {k: k for k in c}
    if "torch_dtype" not in c and "dtype" in c:            # transformers 5 writes `dtype`
        c["torch_dtype"] = c.pop("dtype")
        keys["torch_dtype"] = "dtype"
    return c, keys, []


def file_name(ours: str) -> str:
    return ours


def tensors_to_ours(state: dict[str, torch.Tensor]):
    """Strip a `model.` prefix if present. -> (tensors, {our name: name in the file}, notes)."""
    tensors, names, notes = {}, {}, []
    prefixed = sorted(k for k in state if k.startswith("model."))
    for k, v in state.items():
        ours = k[len("model."):] if k.startswith("model.") else k
        tensors[ours], names[ours] = v, k
    if "model.lm_head.weight" in prefixed:
        notes.append(("ERROR", "tensor names", "model.lm_head.weight: SGLang looks for lm_head.weight (or a "
                      "model.-prefixed name it owns) and silently skips this one, keeping a random lm_head; "
                      "rename it to lm_head.weight (`eagle3 import` does)"))
    elif prefixed:
        notes.append(("WARN", "tensor names", f"{len(prefixed)} tensors carry a 'model.' prefix (e.g. {prefixed[0]}): "
                      "SGLang accepts them, vLLM's loader does not; `eagle3 import` strips it"))
    return tensors, names, notes


def from_ours(fmt: str, config: dict, tensors: dict[str, torch.Tensor]):
    """Our config dict + tensors -> (config.json dict, tensors, weights file name) for `fmt`."""
    d = dict(config)
    d["architectures"] = [SGLANG_ARCH if fmt == "sglang" else OFFICIAL_ARCH]
    return d, dict(tensors), WEIGHTS[fmt]


def write(directory: str, config: dict, tensors: dict[str, torch.Tensor], weights_name: str) -> None:
    if weights_name.endswith(".bin"):
        files.save_torch_bin(tensors, f"{directory}/{weights_name}")
    else:
        files.save_safetensors(tensors, f"{directory}/{weights_name}")
    files.save_json(config, f"{directory}/config.json")
