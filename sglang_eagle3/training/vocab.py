"""Draft vocabulary: the target tokens the draft can propose, chosen by frequency in the training answers.

EAGLE-3 drafts predict over a reduced vocabulary. We count the loss-masked (assistant) tokens of a prepared
dataset, keep the `draft_vocab_size` most frequent target ids (ties -> lower id), and store them sorted:
  draft_to_target [D] int64   target id of draft id j (ascending)
  d2t             [D] int64   draft_to_target - arange(D)   (SGLang/EAGLE convention: target = j + d2t[j])
  t2d             [V] bool    True where a target id is in the draft vocab
These match `Eagle3DraftModel.set_vocab_mapping`. Saved as `draft_vocab.safetensors` (+ `draft_vocab.json` report).
"""
from __future__ import annotations

import os
from typing import Iterable, Optional

import numpy as np
import torch

from sglang_eagle3.errors import UserError, check_at_least
from sglang_eagle3.fileio import atomic_write, write_json

VOCAB_FILE, REPORT_FILE = "draft_vocab.safetensors", "draft_vocab.json"
CANDIDATE_SIZES = (1024, 2048, 4096, 8192, 16384, 32000, 32768)


def count_tokens(rows: Iterable[tuple[np.ndarray, np.ndarray]], vocab_size: int) -> np.ndarray:
    """rows of (input_ids [n], loss_mask [n]) -> counts [vocab_size] int64 of loss-masked token ids."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in rows:
        ids = np.asarray(ids, dtype=np.int64)[np.asarray(mask).astype(bool)]
        if ids.size and (ids.max() >= vocab_size or ids.min() < 0):
            raise ValueError(f"token id {int(ids.max())} is outside the target vocab of {vocab_size}; "
                             "was the data tokenized for another target?")
        counts += np.bincount(ids, minlength=vocab_size)
    return counts


def rank_ids(counts: np.ndarray) -> np.ndarray:
    """All ids ordered by count (descending), ties and unseen ids by id (ascending)."""
    return np.lexsort((np.arange(counts.size), -counts))


def select_draft_vocab(counts: np.ndarray, draft_vocab_size: int) -> tuple[torch.Tensor, dict]:
    """-> draft_to_target [D] int64 (ascending), info {seen, filled, coverage}."""
    V = counts.size
    if not 0 < draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size must be in [1, {V}] (the target vocab), got {draft_vocab_size}")
    chosen = rank_ids(counts)[:draft_vocab_size]
    seen = int((counts > 0).sum())
    total = int(counts.sum())
    info = {"draft_vocab_size": draft_vocab_size, "target_vocab_size": V, "distinct_assistant_tokens": seen,
            "assistant_tokens": total,
            "filled_with_unseen_ids": max(0, draft_vocab_size - seen),
            "coverage": float(counts[chosen].sum() / total) if total else 0.0}
    return torch.from_numpy(np.sort(chosen).astype(np.int64)), info


def vocab_mapping(draft_to_target: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_to_target [D] -> (d2t [D] int64, t2d [V] bool)."""
    d2t = draft_to_target.long() - torch.arange(draft_to_target.numel(), dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_to_target.long()] = True
    return d2t, t2d


def coverage_table(counts: np.ndarray, sizes=CANDIDATE_SIZES) -> list[dict]:
    """Fraction of assistant tokens covered by the top-k ids, for each candidate size k <= vocab."""
    total = counts.sum()
    cum = np.cumsum(np.sort(counts)[::-1])
    return [{"size": k, "coverage": float(cum[k - 1] / total) if total else 0.0}
            for k in sorted(set(sizes)) if k <= counts.size]


def save_vocab(directory: str, draft_to_target: torch.Tensor, counts: np.ndarray, report: dict) -> str:
    """The vocabulary file and its report, each written atomically with the umask's permissions (fileio)."""
    from safetensors.torch import save
    d2t, t2d = vocab_mapping(draft_to_target, counts.size)
    tensors = {"draft_to_target": draft_to_target.contiguous(), "d2t": d2t, "t2d": t2d,
               "token_counts": torch.from_numpy(counts)}
    path = atomic_write(os.path.join(directory, VOCAB_FILE), lambda f: f.write(save(tensors)))
    write_json(os.path.join(directory, REPORT_FILE), report)
    return path


class VocabError(UserError, ValueError):
    """A draft vocabulary file that cannot be used; the message names the flag, the file and the bad id."""


def read_draft_to_target(path: str, vocab_size: int, flag: str = "--draft-vocab") -> torch.Tensor:
    """draft_to_target [D] of a draft vocabulary file (or a folder holding draft_vocab.safetensors), checked before
    any model loads: a readable safetensors file with a non-empty 1-D integer draft_to_target whose ids are
    distinct tokens of the target's vocabulary [0, vocab_size)."""
    from safetensors import safe_open
    if os.path.isdir(path):
        path = os.path.join(path, VOCAB_FILE)
    if not os.path.isfile(path):
        raise VocabError(f"{flag} {path}: no such file; build one with `eagle3 build-vocab`")
    try:
        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
            ids = f.get_tensor("draft_to_target") if "draft_to_target" in names else None
    except Exception as e:  # safetensors raises several types for a file that is not one
        raise VocabError(f"{flag} {path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    if ids is None:
        raise VocabError(f"{flag} {path}: no draft_to_target tensor (it holds {', '.join(names) or 'nothing'}); "
                         "`eagle3 build-vocab` writes draft vocabularies")
    if ids.ndim != 1 or ids.numel() == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise VocabError(f"{flag} {path}: draft_to_target is {str(ids.dtype).replace('torch.', '')} "
                         f"{list(ids.shape)}; expected a non-empty list of integer target token ids")
    ids = ids.long()
    outside = ((ids < 0) | (ids >= vocab_size)).nonzero().flatten()
    if len(outside):
        i = int(outside[0])
        raise VocabError(f"{flag} {path}: draft_to_target[{i}] = {int(ids[i])} is not a token of the target "
                         f"vocabulary [0, {vocab_size}) ({len(outside)} such ids)")
    uniq, counts = ids.unique(return_counts=True)
    if (counts > 1).any():
        dup = int(uniq[counts > 1][0])
        where = (ids == dup).nonzero().flatten().tolist()
        raise VocabError(f"{flag} {path}: target id {dup} appears {len(where)} times in draft_to_target (at "
                         f"{where[:4]}); a draft vocabulary lists distinct tokens")
    return ids


def load_vocab(path: str) -> dict[str, torch.Tensor]:
    """A draft_vocab.safetensors file (or a dir holding one) -> {draft_to_target, d2t, t2d, token_counts}."""
    from safetensors.torch import load_file
    if os.path.isdir(path):
        path = os.path.join(path, VOCAB_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no draft vocab; build it with `eagle3 build-vocab`")
    return load_file(path)


def check_vocab_out(out_dir: str, overwrite: bool) -> None:
    """Where a draft vocabulary goes: a folder (made if missing) without one already, unless it is to be replaced."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise VocabError(f"--out {out_dir} is a file, not a folder")
    there = [f for f in (VOCAB_FILE, REPORT_FILE) if os.path.exists(os.path.join(out_dir, f))]
    if there and not overwrite:
        raise VocabError(f"{out_dir} already holds a draft vocabulary ({', '.join(there)}); pass --force to replace "
                         "it, or --out another folder")


def build_vocab(data_dir: str, draft_vocab_size: int, vocab_size: Optional[int] = None,
                out_dir: Optional[str] = None, overwrite: bool = False) -> dict:
    """Count a prepared dataset's assistant tokens, choose the draft vocab, save it; returns the report. An existing
    vocabulary in the output folder is replaced only with overwrite (`--force`)."""
    from sglang_eagle3.training.data.build import STATS_FILE, iter_tokenized, read_stats
    if not os.path.isfile(os.path.join(data_dir, STATS_FILE)):
        raise VocabError(f"{data_dir}: not a prepare-data folder (no {STATS_FILE}); run `eagle3 prepare-data` first")
    check_at_least(1, {"--draft-vocab-size": draft_vocab_size, "--vocab-size": vocab_size}, VocabError)
    check_vocab_out(out_dir or data_dir, overwrite)
    if vocab_size is None:
        vocab_size = read_stats(data_dir).get("target_vocab_size")
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise VocabError(f"{os.path.join(data_dir, STATS_FILE)}: target_vocab_size={vocab_size!r} is not a "
                             "positive integer (pass --vocab-size)")
    if draft_vocab_size > vocab_size:
        raise VocabError(f"--draft-vocab-size {draft_vocab_size} exceeds the target vocabulary of {vocab_size}")
    counts = count_tokens(iter_tokenized(data_dir), vocab_size)
    if counts.sum() == 0:
        raise ValueError(f"{data_dir}: no assistant tokens to count")
    draft_to_target, info = select_draft_vocab(counts, draft_vocab_size)
    report = {**info, "coverage_table": coverage_table(counts, CANDIDATE_SIZES + (draft_vocab_size,)),
              "data": os.path.abspath(data_dir),
              "file": os.path.abspath(os.path.join(out_dir or data_dir, VOCAB_FILE))}
    save_vocab(out_dir or data_dir, draft_to_target, counts, report)
    return report


def format_report(report: dict) -> str:
    lines = [f"draft vocab {report['draft_vocab_size']} of {report['target_vocab_size']} target ids covers "
             f"{100 * report['coverage']:.2f}% of {report['assistant_tokens']} assistant tokens "
             f"({report['distinct_assistant_tokens']} distinct)"]
    if report["filled_with_unseen_ids"]:
        lines.append(f"note: only {report['distinct_assistant_tokens']} distinct tokens in the data; "
                     f"{report['filled_with_unseen_ids']} unseen ids (lowest first) fill the rest")
    lines.append("  size   coverage")
    lines += [f"{row['size']:>6}   {100 * row['coverage']:7.2f}%" for row in report["coverage_table"]]
    return "\n".join(lines)


def remap_lm_head(old_head: torch.Tensor, old_ids: torch.Tensor, new_ids: torch.Tensor,
                  target_head: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """A trained draft's output rows moved to a new draft vocabulary (e.g. a larger one).

    old_head [D_old, H] rows of old_ids [D_old]; new_ids [D_new] target ids; target_head [V, H_t] the target's
    output rows. Tokens in both vocabularies keep their trained row. A new token's row is predicted from the
    target's row of that token by a least-squares affine map fitted on the shared tokens (target row -> draft
    row; the two heads live in different spaces, but one linear map relates them closely: held-out cosine 0.94
    on the SmolLM2 draft). -> (new_head [D_new, H], info {kept, new, dropped, fit_cosine}).
    """
    old_ids, new_ids = old_ids.long(), new_ids.long()
    row_of = {int(t): j for j, t in enumerate(old_ids.tolist())}
    kept = [(i, row_of[int(t)]) for i, t in enumerate(new_ids.tolist()) if int(t) in row_of]
    if len(kept) < 2:
        raise ValueError(f"the new draft vocabulary shares {len(kept)} tokens with the old one: nothing to map from")
    new_pos = torch.tensor(sorted(set(range(len(new_ids))) - {i for i, _ in kept}), dtype=torch.long)
    k_new, k_old = (torch.tensor(c, dtype=torch.long) for c in zip(*kept))
    src = target_head.float()
    x = torch.cat([src[old_ids[k_old]], torch.ones(len(kept), 1)], dim=1)           # [K, H_t + 1]
    y = old_head.float()[k_old]                                                      # [K, H]
    affine = torch.linalg.lstsq(x, y, driver="gelsd").solution                       # [H_t + 1, H]
    fit_cos = torch.nn.functional.cosine_similarity(x @ affine, y, dim=1).mean().item()
    out = torch.empty(len(new_ids), old_head.shape[1], dtype=torch.float32)
    out[k_new] = y
    if len(new_pos):
        out[new_pos] = torch.cat([src[new_ids[new_pos]], torch.ones(len(new_pos), 1)], dim=1) @ affine
    info = {"kept": len(kept), "new": len(new_pos), "dropped": len(old_ids) - len(kept), "fit_cosine": fit_cos}
    return out.to(old_head.dtype), info
