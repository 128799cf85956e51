"""A training run's folder: what it holds, checkpoints written atomically and pruned, and what a resumed run must
share with the checkpoint it continues.

    OUT/checkpoints/step_NNNNNNN/   model, optimizer, scheduler (backend.save) + trainer_state.json
    OUT/checkpoints/latest          the newest complete checkpoint's name
    OUT/draft/                      the exported draft (bf16, SGLang layout)
    OUT/metrics.jsonl, OUT/train_summary.json, OUT/training_curves.png, OUT/tensorboard/
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Callable, Optional

from sglang_eagle3.fileio import write_text_atomic
from sglang_eagle3.models.config import ConfigError
from sglang_eagle3.training.trainer import backend as B
from sglang_eagle3.training.trainer.logs import PLOT_FILE

STATE_FILE, LATEST, EXPORT_DIR, SUMMARY_FILE = "trainer_state.json", "latest", "draft", "train_summary.json"
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "tensorboard", EXPORT_DIR, SUMMARY_FILE, PLOT_FILE,
               "draft_vocab.safetensors", "draft_vocab.json")
# what a resumed run must share with its checkpoint: the same rows per step in the same order, the same loss
# (rows_per_step and per_row_loss, not how a step is split: --micro-batch-size R --pack-rows == --grad-accum R)
RESUME_KEYS = ("world_size", "rows_per_step", "per_row_loss", "seed", "data_start_step", "total_steps", "backend",
               "eval_rows", "data")


def step_rows(state: dict) -> dict:
    """rows_per_step and per_row_loss (each row's loss averaged over its own positions: one row per forward, or
    packed rows) of a trainer state; older states have only micro_batch_size and grad_accum."""
    micro = state.get("micro_batch_size", 1)
    return {"rows_per_step": state.get("world_size", 1) * micro * state.get("grad_accum", 1),
            "per_row_loss": micro == 1 or bool(state.get("pack_rows"))}


def run_state(cfg, total_steps: int, world_size: int, backend: str) -> dict:
    """What this run writes into each checkpoint's trainer state about its data order and schedule (RESUME_KEYS and
    what step_rows derives them from): a resume compares them with the checkpoint's."""
    state = {"total_steps": total_steps, "world_size": world_size, "micro_batch_size": cfg.micro_batch_size,
             "grad_accum": cfg.grad_accum, "pack_rows": cfg.pack_rows, "seed": cfg.seed,
             "data_start_step": cfg.data_start_step, "backend": backend, "eval_rows": cfg.eval_rows,
             "data": os.path.abspath(cfg.data)}
    return {**state, **step_rows(state)}


def checkpoint_names(ckpt_dir: str) -> list[str]:
    """The step_N folders in ckpt_dir, oldest first."""
    return sorted(d for d in os.listdir(ckpt_dir) if d.startswith("step_")) if os.path.isdir(ckpt_dir) else []


def existing_checkpoints(out: str) -> list[str]:
    return checkpoint_names(os.path.join(out, "checkpoints"))


def check_run_folder(cfg) -> None:
    """A run folder holding checkpoints is continued (--resume) or replaced (--overwrite), never trained over."""
    if cfg.resume and cfg.overwrite:
        raise ConfigError("--resume and --overwrite exclude each other")
    found = existing_checkpoints(cfg.out)
    if found and not (cfg.resume or cfg.overwrite):
        raise ConfigError(f"--out {cfg.out} already holds checkpoints of a run (newest {found[-1]}); pass --resume "
                          "to continue it, or --overwrite to delete them and start again")


def clear_run_folder(out: str) -> None:
    for name in RUN_OUTPUTS:
        path = os.path.join(out, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def write_checkpoint(ckpt_dir: str, step: int, save: Callable[[str], None], state: dict, keep_checkpoints: int,
                     keep_every: int = 0) -> str:
    """Every rank's save(tmp) writes into ckpt_dir/.tmp-step_N; rank 0 adds the trainer state, renames the folder
    to step_N, points `latest` at it, and prunes older checkpoints down to keep_checkpoints (those at multiples of
    keep_every stay). An interrupted write leaves the previous checkpoint and `latest` as they were."""
    rank = B.rank()
    name = f"step_{step:07d}"
    tmp, final = os.path.join(ckpt_dir, f".tmp-{name}"), os.path.join(ckpt_dir, name)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    B.barrier()
    save(tmp)
    B.barrier()
    if rank == 0:
        with open(os.path.join(tmp, STATE_FILE), "w") as f:
            json.dump(state, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_text_atomic(os.path.join(ckpt_dir, LATEST), name + "\n")
        older = [d for d in checkpoint_names(ckpt_dir) if d != name          # never the one just written
                 and not (keep_every and int(d.split("_")[1]) % keep_every == 0)]
        for old in older[:max(0, len(older) - (max(1, keep_checkpoints) - 1))]:
            shutil.rmtree(os.path.join(ckpt_dir, old), ignore_errors=True)
    B.barrier()
    return final


def latest_checkpoint(ckpt_dir: str) -> Optional[tuple[str, dict]]:
    """(path, trainer state) of the checkpoint `latest` names, or None when the run has none yet."""
    latest = os.path.join(ckpt_dir, LATEST)
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        path = os.path.join(ckpt_dir, f.read().strip())
    state_file = os.path.join(path, STATE_FILE)
    if not os.path.isfile(state_file):
        raise ConfigError(f"{latest} points to {path}, which has no {STATE_FILE}")
    with open(state_file) as f:
        return path, json.load(f)


def check_resumable(path: str, state: dict, now: dict, out: str) -> None:
    """Refuse to resume a checkpoint whose run differs from this one in data order or schedule (`now`: this run's
    state at the checkpoint's step), or whose run already finished its planned steps."""
    if state.get("total_steps") != now["total_steps"] and state["step"] >= state.get("total_steps", 0):
        raise ConfigError(f"{path}: that run finished its planned {state['total_steps']} steps; its warm-up + cosine "
                          f"schedule cannot be stretched to {now['total_steps']}. Continue training from its draft "
                          f"in a new folder: --init-from {os.path.join(out, EXPORT_DIR)} --out NEW_RUN")
    state = {"data_start_step": 0, **state, **step_rows(state)}     # checkpoints from before the key: 0
    diff = [f"{k}: checkpoint {state.get(k)} vs now {now[k]}" for k in RESUME_KEYS if state.get(k) != now[k]]
    if diff:
        raise ConfigError(f"cannot resume {path} with the same data order and schedule: " + "; ".join(diff))
