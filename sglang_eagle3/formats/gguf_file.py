"""GGUF files as `eagle3 check-draft` sees them (`eagle3 export --format gguf` writes them): the metadata and tensor
list the `gguf` package reads, and what can be said from those alone. The tensor-level checks (names, shapes, dtypes,
the d2t/t2d map, the config against the target) run on the safetensors draft folder a GGUF was converted from.
"""
from __future__ import annotations

import json
import os
from typing import Optional

from sglang_eagle3.formats.findings import ERROR, OK, WARN, Finding, Report

MAGIC = b"GGUF"
DRAFT_FILE, EXPORT_RECORD = "draft.gguf", "gguf_export.json"      # what export_gguf writes (with target.gguf)


def is_gguf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def gguf_draft_file(path: str) -> Optional[str]:
    """The GGUF file a --draft names: the file itself, or the draft.gguf of an export folder (one without a
    config.json); None for anything else."""
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        path = os.path.join(path, DRAFT_FILE)
    return path if os.path.isfile(path) and is_gguf(path) else None


def read_gguf(path: str) -> dict:
    """Architecture, metadata and tensor shapes of a GGUF file (the `gguf` package's reader)."""
    from gguf import GGUFReader
    r = GGUFReader(path)

    def value(field):
        if not field.types:
            return None
        from gguf import GGUFValueType
        if field.types[0] == GGUFValueType.STRING:
            return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
        if field.types[0] == GGUFValueType.ARRAY:
            if len(field.types) > 1 and field.types[1] == GGUFValueType.STRING:
                return None                                             # token lists: not needed here
            return [int(field.parts[i][0]) if field.parts[i].dtype.kind in "iu" else float(field.parts[i][0])
                    for i in field.data]
        x = field.parts[field.data[0]][0]
        return bool(x) if field.types[0] == GGUFValueType.BOOL else (int(x) if x.dtype.kind in "iu" else float(x))
    meta = {k: value(f) for k, f in r.fields.items() if not k.startswith("tokenizer.ggml.")}
    tensors = {t.name: {"shape": [int(x) for x in t.shape], "type": t.tensor_type.name} for t in r.tensors}
    return {"architecture": meta.get("general.architecture"), "metadata": meta, "tensors": tensors}


def _exported_from(path: str) -> Optional[str]:
    """The draft folder an export's gguf_export.json (beside the file) records as its source."""
    try:
        with open(os.path.join(os.path.dirname(os.path.abspath(path)), EXPORT_RECORD)) as f:
            return json.load(f).get("draft")
    except (OSError, ValueError, AttributeError):
        return None


def _against_target(r: Report, layers: list, hidden: int, target) -> None:
    from sglang_eagle3.formats.files import TargetError, load_target_config
    try:
        _, tc = load_target_config(target)
    except TargetError as e:
        r.add(ERROR, "target", str(e))
        return
    n, h = int(tc.num_hidden_layers), int(tc.hidden_size)
    if hidden != h:
        r.add(ERROR, "target", f"eagle3.target_hidden_size={hidden} but the target's hidden_size is {h}")
    elif not all(0 <= i <= n for i in layers):
        r.add(ERROR, "target", f"eagle3.target_layers {layers} are not layer inputs of the target's {n} layers")
    else:
        r.add(OK, "target", f"hidden size {h} and target layers fit the target's {n} layers")


def gguf_findings(path: str, target=None) -> list[Finding]:
    """What check-draft can say about a GGUF draft: readable, llama.cpp's eagle3 architecture, its metadata (and
    against --target its hidden size and layers); a WARN says what only the safetensors folder can show."""
    r = Report()
    try:
        g = read_gguf(path)
    except Exception as e:  # the reader raises several types for a damaged file
        r.add(ERROR, "gguf", f"{path}: unreadable GGUF file ({type(e).__name__}: {e})")
        return r.findings
    meta, tensors = g["metadata"], g["tensors"]
    if g["architecture"] != "eagle3":
        r.add(ERROR, "architecture", f"{path}: GGUF architecture {g['architecture']!r}, not llama.cpp's eagle3 draft "
                                     f"(a target's GGUF? `export --format gguf` writes the draft as {DRAFT_FILE})")
        return r.findings
    r.add(OK, "format", f"GGUF file {path}: architecture eagle3, {len(tensors)} tensors")
    layers, hidden = meta.get("eagle3.target_layers"), meta.get("eagle3.target_hidden_size")
    if not layers or not hidden:
        r.add(ERROR, "eagle3 metadata", "no eagle3.target_layers / eagle3.target_hidden_size: llama.cpp cannot "
                                        "connect the draft to the target")
    else:
        vocab = tensors.get("d2t", {}).get("shape", ["?"])[0]
        r.add(OK, "eagle3 metadata", f"target_layers {layers} (layer inputs; SGLang's ids {[i - 1 for i in layers]}), "
                                     f"target_hidden_size {hidden}, draft vocabulary {vocab}")
        if target is not None:
            _against_target(r, layers, hidden, target)
    source = _exported_from(path)
    r.add(WARN, "not checked", "tensor names, shapes and dtypes, the d2t/t2d map and the draft config against the "
                               "target are checked on the safetensors draft folder the GGUF was exported from: "
                               f"`eagle3 check-draft --draft {source or 'DRAFT_FOLDER'}`")
    return r.findings
