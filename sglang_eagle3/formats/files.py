"""Reading and writing draft folders: config.json, weight files, atomic folder writes.

Weights may be one `model.safetensors`, shards listed in `model.safetensors.index.json`, bare
`*.safetensors` shards, or the `pytorch_model.bin` the released EAGLE-3 checkpoints ship (read with
`torch.load(weights_only=True)`: tensors only, no code execution). The target is only ever read
through its config.json (`load_target_config`).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from types import SimpleNamespace
from typing import Callable

import torch

from sglang_eagle3.errors import UserError
from sglang_eagle3.fileio import existing_ancestor, usual_permissions


class FolderError(UserError, ValueError):
    """A draft folder whose files cannot be read; the message names the file."""


def read_config(directory: str) -> dict:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise FolderError(f"{directory}: no config.json")
    try:
        with open(path) as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FolderError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise FolderError(f"{path}: expected a JSON object, got {type(d).__name__}")
    return d


def weight_files(directory: str) -> list[str]:
    """The weight files of a folder, preferring safetensors, following an index if there is one."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = os.path.join(directory, index_name)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise FolderError(f"{index}: unreadable index ({e!r})") from None
            return sorted(set(weight_map.values()))
    names = sorted(os.listdir(directory))
    shards = [n for n in names if n.endswith(".safetensors")]
    if shards:
        return shards
    return [n for n in names if n.endswith(".bin") and n.startswith("pytorch_model")]


def _load_one(path: str) -> dict[str, torch.Tensor]:
    if not os.path.isfile(path):
        raise FolderError(f"{path}: listed weight file is missing")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file
        try:
            return load_file(path)
        except Exception as e:  # safetensors raises several types for a damaged header
            raise FolderError(f"{path}: unreadable safetensors file ({type(e).__name__}: {e})") from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise FolderError(f"{path}: unreadable PyTorch file ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise FolderError(f"{path}: expected a dict of tensors")
    return state


def read_weights(directory: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """All tensors of the folder (name -> tensor) and the files they came from."""
    files = weight_files(directory)
    if not files:
        raise FolderError(f"{directory}: no weights (model.safetensors or pytorch_model.bin)")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        for key, value in _load_one(os.path.join(directory, name)).items():
            if key in state:
                raise FolderError(f"{directory}: tensor {key} appears in more than one weight file")
            state[key] = value
    return state, files


def save_safetensors(state: dict[str, torch.Tensor], path: str) -> None:
    from safetensors.torch import save_file
    save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, path, metadata={"format": "pt"})


def save_torch_bin(state: dict[str, torch.Tensor], path: str) -> None:
    torch.save({k: v.detach().cpu().contiguous().clone() for k, v in state.items()}, path)


def save_json(d: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(d, f, indent=2)
        f.write("\n")


def check_out(out: str, overwrite: bool = False) -> None:
    """The folder a conversion will write, checked before any work: new, or a folder (not a file) whose draft files
    (config.json, weights) --force replaces, keeping its other files, and that holds no other kind of model; and
    writable: its parent (or the nearest folder above that exists) and, when written into, the folder itself, so a
    conversion never fails at its last step."""
    from sglang_eagle3.models.config import check_replaceable
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise FolderError(f"--out {out} is a file, not a folder")
        if not overwrite:
            raise FolderError(f"--out {out} already exists (pass --force to replace its config.json and weights; "
                              "its other files are kept)")
        check_replaceable(out, "--out")
    above = existing_ancestor(out)
    if not os.path.isdir(above):
        raise FolderError(f"--out {out}: {above} is a file, not a folder")
    unwritable = [above] if not os.access(above, os.W_OK | os.X_OK) else []
    if os.path.isdir(out) and not os.access(out, os.W_OK | os.X_OK):
        unwritable.append(out)
    if unwritable:
        raise FolderError(f"--out {out}: no permission to write in {unwritable[0]}" +
                          (" (the folder being replaced)" if unwritable[0] != above else ""))


def write_folder_atomic(out: str, fill: Callable[[str], None], overwrite: bool = False,
                        validate: Callable[[str], None] | None = None) -> list[str]:
    """Build the folder in a temporary sibling, validate it, then move it to `out`.

    fill(tmp_dir) writes the files; validate(tmp_dir) may raise to abandon the write.
    A new `out` arrives in one rename. An existing one is written into only with overwrite=True (`--force`): its draft
    files (config.json, weights) are replaced, every other file stays (as `init-draft --force` does); returns their
    names. On any failure nothing is left behind: no temporary folder, and the old `out` as it was.
    """
    from sglang_eagle3.fileio import move_in
    from sglang_eagle3.models.config import draft_file
    check_out(out, overwrite)
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    except OSError as e:
        raise FolderError(f"--out {out}: cannot write in {parent} ({e.strerror or e})") from None
    try:
        fill(tmp)
        _usual_permissions(tmp)
        if validate is not None:
            validate(tmp)
        if not os.path.exists(out):
            os.replace(tmp, out)
            return []
        return move_in(tmp, out, draft_file)
    except BaseException as e:
        if isinstance(e, OSError) and not isinstance(e, UserError):
            raise FolderError(f"--out {out}: cannot write it ({e.strerror or e}"
                              f"{': ' + str(e.filename) if e.filename else ''})") from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _usual_permissions(directory: str) -> None:
    """mkdtemp makes 0700 folders: give the folder and its files what the umask allows (as a plain mkdir would)."""
    usual_permissions(directory)
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            usual_permissions(path)


class TargetError(UserError, ValueError):
    """A target whose config.json cannot be read."""


def load_target_config(target):
    """target: HF folder, hub id, a transformers config, or (top, text) -> (top config, text config)."""
    if isinstance(target, tuple):
        return target
    if not isinstance(target, (str, os.PathLike)):
        cfg = target
    else:
        target = str(target)
        try:
            from transformers import AutoConfig
            cfg = AutoConfig.from_pretrained(target)
        except Exception as e:   # unknown model_type, remote code, offline hub id, ...
            path = os.path.join(target, "config.json")
            if not os.path.isfile(path):
                raise TargetError(f"cannot read the target config {target!r}: {type(e).__name__}: {e}") from None
            try:
                cfg = SimpleNamespace(**read_config(target))
            except FolderError as e2:
                raise TargetError(str(e2)) from None
    if hasattr(cfg, "get_text_config"):
        text = cfg.get_text_config()
    else:
        text = getattr(cfg, "text_config", None) or cfg
        text = SimpleNamespace(**text) if isinstance(text, dict) else text
    return cfg, text
