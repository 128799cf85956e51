"""Converting draft folders between layouts (layouts.py): every layout is read into one canonical view (our
config.json keys, our tensor names) that `check_draft` validates; `import_draft` / `export_draft` convert through it
and write atomically, validating the new folder before it replaces anything.
"""
from __future__ import annotations

import os
import shutil
from typing import Optional

import torch

from sglang_eagle3.fileio import check_apart
from sglang_eagle3.formats import eagle, files, speculators
from sglang_eagle3.formats.check_draft import check_draft
from sglang_eagle3.formats.files import FolderError  # noqa: F401  (re-exported for callers)
from sglang_eagle3.formats.layouts import FORMATS, DraftFolder, FormatError, layout, read_folder  # noqa: F401


def _dominant_float_dtype(tensors) -> Optional[str]:
    counts: dict[torch.dtype, int] = {}
    for t in tensors.values():
        if t.is_floating_point():
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    return str(max(counts, key=counts.get)).replace("torch.", "") if counts else None


def _num_layers(text_config) -> int:
    return int(text_config.num_hidden_layers)


def to_ours(folder: DraftFolder, target=None):
    """-> (Eagle3Config, tensors in our layout, notes). target: (top, text) configs or None."""
    from sglang_eagle3.formats.files import load_target_config
    from sglang_eagle3.models.config import Eagle3Config, default_aux_layer_ids

    notes: list[str] = []
    if folder.format == "speculators":
        reason = speculators.unsupported_reason(folder.raw_config)
        if reason:
            raise FormatError(f"{folder.path}: {reason}")
    c = dict(folder.config)
    if not isinstance(c.get("eagle_config") or {}, dict):
        raise FormatError(f"{folder.path}/config.json: eagle_config={c['eagle_config']!r} is not an object")
    eagle_cfg = dict(c.get("eagle_config") or {})
    if eagle_cfg.get("eagle_aux_hidden_state_layer_ids") is None:
        if target is None and folder.format == "speculators":
            verifier = (folder.raw_config.get("speculators_config") or {}).get("verifier") or {}
            if verifier.get("name_or_path"):
                try:
                    target = load_target_config(verifier["name_or_path"])
                except Exception:
                    target = None
        if target is None:
            raise FormatError(f"{folder.path}: config has no eagle_aux_hidden_state_layer_ids (serving engines "
                              "then capture their default target layers); pass --target so they can be written "
                              "explicitly")
        eagle_cfg["eagle_aux_hidden_state_layer_ids"] = default_aux_layer_ids(_num_layers(target[1]))
        c["eagle_config"] = eagle_cfg
        notes.append(f"no aux layer ids in the source: wrote the engines' default "
                     f"{eagle_cfg['eagle_aux_hidden_state_layer_ids']} for the target's "
                     f"{_num_layers(target[1])} layers")
    tensors = dict(folder.tensors)
    if "torch_dtype" not in c and _dominant_float_dtype(tensors):
        c["torch_dtype"] = _dominant_float_dtype(tensors)
    cfg = Eagle3Config.from_dict(c, where=os.path.join(folder.path, "config.json"))
    if tensors.pop("embed_tokens.weight", None) is not None:
        notes.append("dropped embed_tokens.weight: SGLang and this toolkit use the target's embedding")
    _complete_vocab_map(folder, cfg, tensors, notes)
    return cfg, tensors, notes


def _complete_vocab_map(folder: DraftFolder, cfg, tensors, notes) -> None:
    """d2t int64 and t2d bool, rebuilt when a layout leaves them out (full vocab, or t2d unused)."""
    V, Vd = cfg.vocab_size, cfg.draft_vocab_size
    if "d2t" not in tensors:
        if Vd != V:
            raise FormatError(f"{folder.path}: no d2t tensor but draft_vocab_size={Vd} < vocab_size={V}: "
                              "the draft->target token map is missing")
        tensors["d2t"] = torch.zeros(Vd, dtype=torch.int64)
        notes.append("no d2t: wrote the identity map (draft vocabulary = target vocabulary)")
    d2t = tensors["d2t"]
    if d2t.is_floating_point() or d2t.dtype == torch.bool or d2t.shape != (Vd,):
        raise FormatError(f"{folder.path}: tensor {folder.names.get('d2t', 'd2t')} is {d2t.dtype} "
                          f"{list(d2t.shape)}, expected int64 [{Vd}]")
    tensors["d2t"] = d2t.to(torch.int64)
    if "t2d" not in tensors:
        ids = torch.arange(Vd) + tensors["d2t"]
        if ids.min() < 0 or ids.max() >= V:
            raise FormatError(f"{folder.path}: d2t maps draft ids outside the target vocabulary [0, {V})")
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
        notes.append("no t2d: rebuilt it from d2t")
    tensors["t2d"] = tensors["t2d"].to(torch.bool)


def _target_view(target):
    return files.load_target_config(target) if target is not None else None


class _Validate:
    """check_draft on the freshly written (still temporary) folder; keeps the findings for the caller."""

    def __init__(self, target_view):
        self.target_view, self.findings = target_view, []

    def __call__(self, directory: str) -> None:
        self.findings = check_draft(directory, self.target_view)
        errors = [f for f in self.findings if f.status == "ERROR"]
        if errors:
            raise FormatError("the converted draft fails check-draft: " +
                              "; ".join(f"{f.check}: {f.detail}" for f in errors))


PROFILE_FILE = "spec_profile.json"      # the draft's tuned tree shapes (engine/speculation.py reads it)


def _companions(src: str, fmt: str, notes: list[str]) -> list[str]:
    """Files beside the weights that go with the draft into a `fmt` folder: its tuned profile into our (SGLang)
    layout, which our engine and `eagle3 serve` read; other layouts' runtimes do not read it (a note says so)."""
    path = os.path.join(src, PROFILE_FILE)
    if not os.path.isfile(path):
        return []
    if fmt == "sglang":
        return [path]
    notes.append(f"{PROFILE_FILE} was not copied: the {fmt} layout's runtimes do not read it")
    return []


def _write_with(write, companions: list[str]):
    """fill(tmp) for write_folder_atomic: the converted files, then the companion files copied beside them."""
    def fill(directory: str) -> None:
        write(directory)
        for path in companions:
            shutil.copyfile(path, os.path.join(directory, os.path.basename(path)))
    return fill


def _kept_note(out: str, kept: list[str]) -> list[str]:
    """What --force left in a folder it wrote a draft into (as `init-draft --force` says it)."""
    return [f"replaced the config.json and weights in {out}; kept {', '.join(kept)} (they may describe the old "
            "weights)"] if kept else []


def _inputs(src_flag: str, src: str, target) -> dict:
    return {src_flag: src, "--target": target if isinstance(target, (str, os.PathLike)) else None}


def import_draft(src: str, out: str, fmt: str = "auto", target=None, overwrite: bool = False):
    """Convert any supported layout into ours at `out`. Returns (check-draft findings, notes)."""
    check_apart({"--out": out}, _inputs("--src", src, target), FormatError)
    files.check_out(out, overwrite)
    folder = read_folder(src, fmt)
    tview = _target_view(target)
    cfg, tensors, notes = to_ours(folder, tview)
    config, tensors, weights = eagle.from_ours("sglang", cfg.to_dict(), tensors)
    validate = _Validate(tview)
    write = _write_with(lambda d: eagle.write(d, config, tensors, weights), _companions(src, "sglang", notes))
    kept = files.write_folder_atomic(out, write, overwrite, validate)
    return validate.findings, [f"read {folder.format} layout from {src}"] + notes + _kept_note(out, kept)


def _with_official_embedding(cfg, tensors: dict, target) -> dict:
    """The authors' EAGLE-3 code loads this layout non-strictly and would keep a random embedding: write the
    target's (in the draft's dtype). Their code cannot run EAGLE-3.1 drafts at all."""
    if cfg.fc_norm or cfg.norm_output:
        raise FormatError("the eagle-official layout cannot express EAGLE-3.1 (fc_norm / norm_output): the authors' "
                          "EAGLE-3 code would run it as EAGLE-3; export --format sglang or speculators instead")
    if target is None or not isinstance(target, (str, os.PathLike)):
        raise FormatError("--format eagle-official needs --target: the authors' loader reads the token embedding "
                          "from the draft (strict=False) and silently keeps a random one when it is missing")
    from sglang_eagle3.models.target_head import load_target_head
    dtype = next(t.dtype for t in tensors.values() if t.is_floating_point())
    try:
        _, embed, _ = load_target_head(str(target), dtype, "cpu")
    except (OSError, ValueError) as e:
        raise FormatError(f"--target {target}: cannot read its token embedding ({e})") from None
    if tuple(embed.weight.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise FormatError(f"--target {target}: embedding {list(embed.weight.shape)} does not fit the draft "
                          f"(vocab_size {cfg.vocab_size}, hidden_size {cfg.hidden_size})")
    return {**tensors, "embed_tokens.weight": embed.weight.detach().clone()}


def _verifier_name(target) -> Optional[str]:
    if not isinstance(target, str):
        return getattr(target, "_name_or_path", None) or getattr(target, "name_or_path", None)
    return os.path.abspath(target) if os.path.isdir(target) else target


def export_draft(src: str, fmt: str, out: str, target=None, speculative_tokens: int = 3,
                 overwrite: bool = False):
    """Write the draft at `src` (any supported layout) as `fmt` at `out`. Returns (findings, notes)."""
    from sglang_eagle3.models.config import default_aux_layer_ids
    if fmt not in FORMATS:
        raise FormatError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    check_apart({"--out": out}, _inputs("--draft", src, target), FormatError)
    files.check_out(out, overwrite)
    folder = read_folder(src, "auto")
    tview = _target_view(target)
    cfg, tensors, notes = to_ours(folder, tview)
    if fmt == "eagle-official":
        tensors = _with_official_embedding(cfg, tensors, target)
    if fmt == "speculators":
        name = _verifier_name(target) if target is not None else None
        archs = list(getattr(tview[0], "architectures", None) or []) if tview else []
        if name is None:
            notes.append("no --target: speculators_config.verifier.name_or_path is null, so `vllm serve <out>` "
                         "cannot find the target; pass --target")
        config, tensors, weights = speculators.from_ours(cfg.to_dict(), tensors, name, archs, speculative_tokens)
    else:
        config, tensors, weights = eagle.from_ours(fmt, cfg.to_dict(), tensors)
        if fmt == "eagle-official" and tview is not None:
            default = default_aux_layer_ids(_num_layers(tview[1]))
            if list(cfg.aux_layer_ids) != default:
                notes.append(f"aux layer ids {cfg.aux_layer_ids} differ from {default}: SGLang reads them from "
                             "eagle_config, but SafeAILab/EAGLE's own runtime always captures its default layers")
    validate = _Validate(tview)
    write = _write_with(lambda d: layout(fmt).write(d, config, tensors, weights), _companions(src, fmt, notes))
    kept = files.write_folder_atomic(out, write, overwrite, validate)
    return validate.findings, notes + _kept_note(out, kept)
