"""GGUF export for llama.cpp: the target's GGUF and the draft's (architecture `eagle3`).

Both files are written by llama.cpp's own converter from the pinned source (llamacpp.py: the llama.cpp tree
vendored in llama-cpp-python 0.3.36, with its gguf-py), so names, metadata and the d2t convention are
exactly what that llama.cpp reads:

    convert_hf_to_gguf.py TARGET --outtype bf16                                  -> target.gguf
    convert_hf_to_gguf.py DRAFT --target-model-dir TARGET --outtype bf16         -> draft.gguf

Layer ids: llama.cpp captures the *inputs* of `eagle3.target_layers` (its converter takes a top-level
`eagle_aux_hidden_state_layer_ids` in that convention, else [2, N//2, N-3]); our ids are SGLang's layer
*outputs*, so the draft is converted from a copy of its folder whose config states [i + 1 for i in ours]
explicitly, whatever they are. The pinned llama.cpp runs EAGLE-3 drafts (and `norm_before_fc`), not
EAGLE-3.1's fc_norm / norm_output: such drafts are refused.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Optional

from sglang_eagle3.errors import UserError
from sglang_eagle3.formats.gguf_file import read_gguf  # noqa: F401  (re-exported: the reader lives with the checks)

GGUF_FILES = ("target.gguf", "draft.gguf")


class GGUFExportError(UserError, ValueError):
    pass


def llamacpp_layer_ids(our_ids: list[int]) -> list[int]:
    """SGLang's 'output of layer i' -> llama.cpp's 'input of layer i + 1'."""
    return [i + 1 for i in our_ids]


def draft_source(draft_dir: str, work: str) -> str:
    """A copy of the draft folder whose config.json names the layers in llama.cpp's convention."""
    from sglang_eagle3.models.config import Eagle3Config
    cfg = Eagle3Config.load(draft_dir)
    if cfg.fc_norm or cfg.norm_output:
        raise GGUFExportError(f"{draft_dir}: an EAGLE-3.1 draft (fc_norm / norm_output); the pinned llama.cpp "
                              "(llama-cpp-python 0.3.36) runs EAGLE-3 drafts only: export an EAGLE-3 draft for it")
    out = os.path.join(work, "draft")
    os.makedirs(out)
    for name in os.listdir(draft_dir):
        if name.endswith((".safetensors", ".json")):
            shutil.copy2(os.path.join(draft_dir, name), out)
    with open(os.path.join(out, "config.json")) as f:
        raw = json.load(f)
    raw["eagle_aux_hidden_state_layer_ids"] = llamacpp_layer_ids(cfg.aux_layer_ids)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    return out


def convert(src: str, outfile: str, target_dir: Optional[str] = None, outtype: str = "bf16",
            llamacpp_root: Optional[str] = None) -> None:
    """Run the pinned llama.cpp converter (its gguf-py first on the path); atomic: OUT.tmp then rename."""
    from sglang_eagle3.formats import llamacpp
    root = llamacpp.fetch_source(llamacpp_root or llamacpp.root_dir())
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "gguf-py") + os.pathsep + os.environ.get("PYTHONPATH", ""),
               NO_LOCAL_GGUF="")
    tmp = outfile + ".tmp"
    cmd = [sys.executable, os.path.join(root, "convert_hf_to_gguf.py"), src, "--outfile", tmp, "--outtype", outtype]
    if target_dir:
        cmd += ["--target-model-dir", target_dir]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        if os.path.exists(tmp):
            os.remove(tmp)
        last = [ln for ln in (r.stderr or r.stdout).strip().splitlines() if ln.strip()][-1:] or ["no output"]
        raise GGUFExportError(f"llama.cpp's converter failed on {src}: {last[0]}")
    os.replace(tmp, outfile)


def export_gguf(draft_dir: str, target_dir: str, out: str, overwrite: bool = False, outtype: str = "bf16",
                llamacpp_root: Optional[str] = None) -> dict:
    """DRAFT + TARGET -> OUT/draft.gguf (+ OUT/target.gguf, reused when already there). Returns a summary."""
    from sglang_eagle3.fileio import check_apart
    from sglang_eagle3.formats.check_draft import ERROR, check_draft
    check_apart({"--out": out}, {"--draft": draft_dir, "--target": target_dir}, GGUFExportError)
    if target_dir is None or not os.path.isdir(target_dir):
        raise GGUFExportError("--format gguf needs --target: a local HF folder (llama.cpp's converter reads its "
                              "config, tokenizer and, for target.gguf, its weights)")
    errors = [f for f in check_draft(draft_dir, target_dir) if f.status == ERROR]
    if errors:
        raise GGUFExportError(f"{draft_dir} fails check-draft against {target_dir}: {errors[0].check}: "
                              f"{errors[0].detail}")
    os.makedirs(out, exist_ok=True)
    dfile, tfile = os.path.join(out, "draft.gguf"), os.path.join(out, "target.gguf")
    if os.path.exists(dfile) and not overwrite:
        raise GGUFExportError(f"{dfile} already exists (pass --force to replace it)")
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=out) as work:
        convert(draft_source(draft_dir, work), dfile, target_dir, outtype, llamacpp_root)
    if not os.path.exists(tfile) or overwrite:
        convert(target_dir, tfile, None, outtype, llamacpp_root)
    from sglang_eagle3.models.config import Eagle3Config
    ids = Eagle3Config.load(draft_dir).aux_layer_ids
    summary = {"draft": os.path.abspath(draft_dir), "target": os.path.abspath(target_dir), "outtype": outtype,
               "files": [dfile, tfile], "our_layer_ids": ids, "llamacpp_target_layers": llamacpp_layer_ids(ids)}
    from sglang_eagle3.fileio import write_json
    write_json(os.path.join(out, "gguf_export.json"), summary)
    return summary
