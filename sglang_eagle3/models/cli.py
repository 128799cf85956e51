"""`eagle3 init-draft`: a randomly initialised EAGLE-3 draft shaped for a target (the start of training, and the
draft tests and benchmarks use where no trained one exists)."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile

import torch

from sglang_eagle3.errors import UserError
from sglang_eagle3.fileio import check_apart, move_in, usual_permissions
from sglang_eagle3.models.config import Eagle3Config, check_replaceable, draft_file
from sglang_eagle3.models.testbed import resolve_target

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def replaced_files(folder: str) -> list[str]:
    """What --force replaces in an existing draft folder: the weights and the config, nothing else."""
    return sorted(f for f in os.listdir(folder) if draft_file(f))


def add_cli(sub) -> None:
    q = sub.add_parser("init-draft", help="write a randomly initialised EAGLE-3 draft for a target")
    q.add_argument("--target", default="testbed")
    q.add_argument("--out", required=True)
    q.add_argument("--draft-vocab-size", type=int, default=None, help="default: the target's vocab size")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--dtype", default="bfloat16", choices=list(DTYPES),
                   help="the dtype the draft's weights are written in (default bfloat16)")
    q.add_argument("--force", action="store_true", help="replace the weights and config.json of a draft in --out "
                                                        "(every other file there is kept)")
    q.set_defaults(func=run_init_draft)


def init_draft(target: str, out: str, draft_vocab_size=None, seed: int = 0, dtype: str = "bfloat16") -> str:
    """Write a random draft for `target` into `out` (its weights and config.json, written beside and moved in)."""
    from transformers import AutoConfig

    from sglang_eagle3.models.draft import Eagle3DraftModel
    tc = AutoConfig.from_pretrained(resolve_target(target))
    vocab = getattr(getattr(tc, "text_config", tc), "vocab_size", None)
    if draft_vocab_size is not None and vocab and draft_vocab_size > vocab:
        raise UserError(f"--draft-vocab-size {draft_vocab_size} exceeds the target vocabulary of {vocab}")
    cfg = Eagle3Config.for_target(tc, draft_vocab_size=draft_vocab_size)
    torch.manual_seed(seed)
    model = Eagle3DraftModel(cfg)
    # An untrained draft's vocabulary: the lowest target ids (BPE vocabularies put frequent tokens first).
    model.set_vocab_mapping(torch.arange(cfg.draft_vocab_size))
    os.makedirs(out, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".init-draft-", dir=os.path.dirname(os.path.abspath(out)))
    try:
        model.save_pretrained(staging, dtype=DTYPES[dtype])
        move_in(staging, out, draft_file)                   # the old weights go only once the new ones are in
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    usual_permissions(out)
    return out


def run_init_draft(a) -> int:
    check_apart({"--out": a.out}, {"--target": a.target})
    if a.draft_vocab_size is not None and a.draft_vocab_size < 1:
        raise UserError(f"--draft-vocab-size must be >= 1, got {a.draft_vocab_size}")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        raise UserError(f"--out {a.out} is a file, not a folder")
    kept = []
    if os.path.isdir(a.out) and os.listdir(a.out):
        check_replaceable(a.out, "--out")
        if not replaced_files(a.out) and not a.force:
            raise UserError(f"--out {a.out} is not empty and holds no draft; choose an empty or new folder "
                            "(or --force to add a draft beside its files)")
        if not a.force:
            raise UserError(f"--out {a.out} holds a draft ({', '.join(replaced_files(a.out))}); pass --force to "
                            "replace its weights and config.json (its other files are kept)")
        kept = sorted(set(os.listdir(a.out)) - set(replaced_files(a.out)))
    init_draft(a.target, a.out, a.draft_vocab_size, a.seed, a.dtype)
    if kept:
        print(f"eagle3 init-draft: replaced the weights and config.json; kept {', '.join(kept)} (they may describe "
              "the old weights)", file=sys.stderr)
    print(a.out)
    return 0
