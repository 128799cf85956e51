"""A training run's folder: what it holds, checkpoints written atomically and pruned, and what a resumed run must
share with the checkpoint it continues.

    OUT/checkpoints/step_NNNNNNN/   model, optimizer, scheduler (backend.save) + trainer_state.json
    OUT/checkpoints/latest          the newest complete checkpoint's name
    OUT/draft/                      the exported draft (bf16, SGLang layout)
    OUT/metrics.jsonl, OUT/train_summary.json, OUT/training_curves.png, OUT/tensorboard/
"""
from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import shutil
from typing import Callable, Optional

from sglang_eagle3.errors import UserError
from sglang_eagle3.fileio import write_text_atomic
from sglang_eagle3.models.config import ConfigError
from sglang_eagle3.training.hidden_dump import free_bytes, human_bytes
from sglang_eagle3.training.trainer import backend as B
from sglang_eagle3.training.trainer.logs import PLOT_FILE

STATE_FILE, LATEST, EXPORT_DIR, SUMMARY_FILE = "trainer_state.json", "latest", "draft", "train_summary.json"
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "tensorboard", EXPORT_DIR, SUMMARY_FILE, PLOT_FILE,
               "draft_vocab.safetensors", "draft_vocab.json")
# what a resumed run must share with its checkpoint, each named by the flags that set it: its data order (the same
# rows per step in the same order), its loss, its draft and its optimizer and schedule (restored from the checkpoint:
# another --lr would be silently ignored). rows_per_step and per_row_loss, not how a step is split: --micro-batch-size
# R --pack-rows == --grad-accum R. The cadence and runtime flags (--eval-every, --save-every, --log-every,
# --keep-checkpoints, --keep-every, --grow-chains, --dtype, --device, --verify-dumps) may change on resume.
RESUME_FLAGS = {"world_size": "ranks ($WORLD_SIZE)", "rows_per_step": "rows per step (ranks x --micro-batch-size x "
                "--grad-accum)", "per_row_loss": "per-row loss (--micro-batch-size 1 or --pack-rows)",
                "total_steps": "total steps (--max-steps / --epochs)", "zero_stage": "ZeRO stage (--zero-stage / "
                "--deepspeed-config)", "draft_config_file": "--draft-config"}
FLAG_KEYS = ("seed", "data_start_step", "eval_rows", "max_length", "draft_vocab_size", "head_init", "fc_norm",
             "norm_output", "aux_layer_ids", "features", "ttt_length", "step_decay", "target_temperature",
             "feature_loss_weight", "loss_mask_offset", "lr", "warmup_ratio", "min_lr_ratio", "weight_decay",
             "grad_clip")                                            # TrainConfig fields, stored as given
PATH_KEYS = {"data": "data", "eval_data": "eval_data", "draft_vocab": "draft_vocab", "init_from": "init_from",
             "draft_config_file": "draft_config"}       # state key: TrainConfig field, stored as an absolute path
RESUME_KEYS = ("world_size", "rows_per_step", "per_row_loss", "total_steps", "backend", "zero_stage", "target",
               *PATH_KEYS, *FLAG_KEYS)


CHECKPOINT_BYTES_PER_VALUE = 16      # fp32 weights and AdamW's two moments (DeepSpeed adds its own copy of the weights)


class CheckpointWriteError(UserError):
    """A checkpoint that could not be written (a full disk)."""


def step_rows(state: dict) -> dict:
    """rows_per_step and per_row_loss (each row's loss averaged over its own positions: one row per forward, or
    packed rows) of a trainer state; older states have only micro_batch_size and grad_accum."""
    micro = state.get("micro_batch_size", 1)
    return {"rows_per_step": state.get("world_size", 1) * micro * state.get("grad_accum", 1),
            "per_row_loss": micro == 1 or bool(state.get("pack_rows"))}


def run_state(cfg, total_steps: int, world_size: int, backend: str, zero_stage: Optional[int] = None) -> dict:
    """What this run writes into each checkpoint's trainer state about its data order, loss, draft and schedule
    (RESUME_KEYS and what step_rows derives them from): a resume compares them with the checkpoint's."""
    state = {"total_steps": total_steps, "world_size": world_size, "micro_batch_size": cfg.micro_batch_size,
             "grad_accum": cfg.grad_accum, "pack_rows": cfg.pack_rows, "backend": backend, "zero_stage": zero_stage,
             "target": os.path.abspath(cfg.target) if os.path.exists(cfg.target) else cfg.target,   # or a hub id
             **{k: os.path.abspath(getattr(cfg, f)) if getattr(cfg, f) else None for k, f in PATH_KEYS.items()},
             **{k: getattr(cfg, k) for k in FLAG_KEYS}}
    return {**state, **step_rows(state)}


def resume_flag(key: str) -> str:
    """The flag (or what derives from flags) a RESUME_KEYS entry of the trainer state holds."""
    return RESUME_FLAGS.get(key, "--" + key.replace("_", "-"))


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


def check_checkpoint_space(cfg, draft_values: int, total_steps: int) -> None:
    """Free space under --out for the checkpoints the run holds at once (--keep-checkpoints, those at multiples of
    --keep-every, and the one being written; a resume's own ones are already on the disk) and the exported draft, so
    that a full disk is found before anything loads rather than at a checkpoint. draft_values: the draft's numbers."""
    one = draft_values * CHECKPOINT_BYTES_PER_VALUE
    saves = -(-total_steps // cfg.save_every) if cfg.save_every else 1        # the last step is always saved
    kept = cfg.keep_checkpoints + 1 + (total_steps // cfg.keep_every if cfg.keep_every else 0)
    copies = max(1, min(saves, kept) - (len(existing_checkpoints(cfg.out)) if cfg.resume else 0))
    need, free = copies * one + 2 * draft_values, free_bytes(cfg.out)       # + the bf16 export
    if need > free:
        raise CheckpointWriteError(f"--out {cfg.out}: the run needs ~{human_bytes(need)} ({copies} checkpoints of "
                                   f"~{human_bytes(one)} at once, and the exported draft) but only {human_bytes(free)} "
                                   "are free (lower --keep-checkpoints or --keep-every, free some space, or pass "
                                   "--no-disk-check to try anyway)")


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
    keep_every stay). An interrupted write leaves the previous checkpoint and `latest` as they were; a failed one
    (a full disk) also removes its temporary folder."""
    rank = B.rank()
    name = f"step_{step:07d}"
    tmp, final = os.path.join(ckpt_dir, f".tmp-{name}"), os.path.join(ckpt_dir, name)
    if rank == 0:
        for leftover in glob.glob(os.path.join(ckpt_dir, ".tmp-step_*")):      # writes a kill interrupted
            shutil.rmtree(leftover, ignore_errors=True)
        os.makedirs(tmp)
    B.barrier()
    with removed_on_failure(tmp):
        save(tmp)
    B.barrier()
    if rank == 0:
        with removed_on_failure(tmp):
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


def disk_full(e: BaseException) -> bool:
    """A write that failed for want of space: ENOSPC / EDQUOT, or torch's serializer reporting it."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(e, RuntimeError) and any(s in str(e) for s in ("No space left", "file write failed"))


@contextlib.contextmanager
def removed_on_failure(tmp: str):
    """A checkpoint write that fails removes its temporary folder (a half-written checkpoint would keep the disk
    full); a full disk is one line naming the folder and the free space."""
    try:
        yield
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if disk_full(e):
            raise CheckpointWriteError(f"{tmp}: no space left on the device while writing the checkpoint "
                                       f"({human_bytes(free_bytes(tmp))} free; the partial checkpoint was removed): "
                                       "free some space or lower --keep-checkpoints, then rerun with --resume") \
                from None
        raise


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
    """Refuse to resume a checkpoint whose run differs from this one in data order, loss, draft or schedule (`now`:
    this run's state at the checkpoint's step), naming each flag with the checkpoint's value and the given one, or
    whose run already finished its planned steps. Keys a checkpoint predates are not compared."""
    if state.get("total_steps") != now["total_steps"] and state["step"] >= state.get("total_steps", 0):
        raise ConfigError(f"{path}: that run finished its planned {state['total_steps']} steps; its warm-up + cosine "
                          f"schedule cannot be stretched to {now['total_steps']}. Continue training from its draft "
                          f"in a new folder: --init-from {os.path.join(out, EXPORT_DIR)} --out NEW_RUN")
    state = {"data_start_step": 0, **state, **step_rows(state)}     # checkpoints from before the key: 0
    diff = [f"{resume_flag(k)}: checkpoint {state[k]}, given {now[k]}" for k in RESUME_KEYS
            if k in state and k in now and state[k] != now[k]]
    drafts = state.get("draft_config"), now.get("draft_config")
    if not diff and all(drafts):          # the draft the flags built (--draft-config's file, the target's shape)
        diff = [f"draft config {k}: checkpoint {drafts[0].get(k)}, given {drafts[1].get(k)}"
                for k in sorted(set(drafts[0]) | set(drafts[1])) if k != "torch_dtype" and
                drafts[0].get(k) != drafts[1].get(k)]
    if diff:
        raise ConfigError(f"cannot resume {path}: its run was started with other settings (" + "; ".join(diff) +
                          "); resume with the checkpoint's values, or start a new run (--overwrite, or another "
                          "--out)")
