"""EAGLE-3 draft checkpoint layouts: detect one and read it into ours.

    sglang          ours = SGLang's LlamaForCausalLMEagle3 layout (also what SpecForge exports)
    eagle-official  the released yuhuili/EAGLE3-* layout (architectures LlamaForCausalLM, pytorch_model.bin)
    speculators     vllm-project/speculators' layout, which vLLM serves directly
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from sglang_eagle3.errors import UserError
from sglang_eagle3.formats import eagle, files, speculators

FORMATS = ("sglang", "eagle-official", "speculators")


class FormatError(UserError, ValueError):
    """A draft that cannot be converted; the message names the file, key or tensor."""


def first_architecture(config: dict) -> Optional[str]:
    archs = config.get("architectures")
    return archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None


def detect_format(config: dict) -> Optional[str]:
    if "speculators_config" in config or "speculators_model_type" in config:
        return "speculators"
    arch = first_architecture(config)
    if arch == eagle.SGLANG_ARCH:
        return "sglang"
    if arch == eagle.OFFICIAL_ARCH:
        return "eagle-official"
    return None


def layout(fmt: str):
    return speculators if fmt == "speculators" else eagle


@dataclass
class DraftFolder:
    """A draft folder seen through our names. `names`/`keys` map back to what the files call things."""
    path: str
    format: str
    raw_config: dict
    config: dict                                  # our config.json schema
    keys: dict[str, str]                          # our config key -> key in the file
    tensors: dict[str, torch.Tensor]              # our tensor names
    names: dict[str, str]                         # our tensor name -> name in the file
    files: list[str]
    notes: list[tuple[str, str, str]] = field(default_factory=list)   # (status, check, detail)


def read_folder(path: str, fmt: str = "auto") -> DraftFolder:
    raw = files.read_config(path)
    if fmt == "auto":
        fmt = detect_format(raw)
        if fmt is None:
            raise FormatError(f"{path}/config.json: architectures={raw.get('architectures')!r} and no "
                              "speculators_config: not an EAGLE-3 draft layout this tool knows (pass --format)")
    elif fmt not in FORMATS:
        raise FormatError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)} or auto")
    else:
        found = detect_format(raw)
        if found != fmt and not (found is None and fmt != "speculators"):
            raise FormatError(f"{path}: --format {fmt}, but config.json is " +
                              (f"the {found} layout" if found else "no EAGLE-3 draft layout this tool knows") +
                              " (use --format auto)")
    config, keys, notes = layout(fmt).config_to_ours(raw)
    state, weight_files = files.read_weights(path)
    tensors, names, tnotes = layout(fmt).tensors_to_ours(state)
    return DraftFolder(path, fmt, raw, config, keys, tensors, names, weight_files, notes + tnotes)
