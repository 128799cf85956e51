"""Training rows, the held-out split, and a step-indexed data order that a restart reproduces exactly.

Offline mode reads a hidden-state dump (features stored per token); online mode reads token rows and
the target computes the features for each batch. Either way a row is a dict of per-token tensors.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from sglang_eagle3.models.config import ConfigError
from sglang_eagle3.training.dump_reader import MANIFEST, HiddenStateDump
from sglang_eagle3.training.hidden_dump import load_token_rows


class TokenRows:
    """Token rows for online training: row i -> {input_ids [n], loss_mask [n]}."""

    def __init__(self, rows: list[tuple[np.ndarray, np.ndarray]]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, mask = self.rows[i]
        return {"input_ids": torch.from_numpy(ids).long(), "loss_mask": torch.from_numpy(mask.astype(np.int64))}


def open_rows(path: str, verify: str = "sha256", progress: bool = False, part: tuple[int, int] = (0, 1)):
    """-> (dataset, "offline" | "online"): a dump dir (has manifest.json) or token rows (prepare-data dir / jsonl)."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return HiddenStateDump(path, verify=verify, progress=progress, part=part), "offline"
    return TokenRows(load_token_rows(path)), "online"


def token_rows(data, idx) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input_ids, loss_mask) numpy pairs of rows idx of either kind of dataset (features are not read)."""
    if isinstance(data, TokenRows):
        return [data.rows[int(i)] for i in idx]
    return [data.token_row(int(i)) for i in idx]


def split_indices(num_rows: int, eval_rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Hold out `eval_rows` rows chosen by a seeded permutation -> (train indices, eval indices), both sorted."""
    if not 0 <= eval_rows < num_rows:
        raise ValueError(f"--eval-rows {eval_rows}: --data has {num_rows} rows, so at most {num_rows - 1} can be "
                         "held out for eval (a lower --eval-rows, or --eval-data)")
    perm = np.random.default_rng(seed).permutation(num_rows)
    return np.sort(perm[eval_rows:]), np.sort(perm[:eval_rows])


class StepSampler:
    """Rows of every optimizer step: step s uses rows_per_step consecutive rows of the epoch's permutation.

    rows_per_step = world_size * micro_batch_size * grad_accum; micro-batch a of rank r takes the slice
    [(a * world + r) * micro, ...). The order depends only on (seed, epoch), so step s after a restart reads
    exactly what it would have read. A last partial step of an epoch is dropped. `start_step` shifts the whole
    order: step s reads what step start_step + s would have read (a run that continues another one on the same
    data, seed and rows per step reads the rows the first run did not reach).
    """

    def __init__(self, train_idx: np.ndarray, world_size: int, rank: int, micro_batch_size: int,
                 grad_accum: int, seed: int, start_step: int = 0):
        if start_step < 0:
            raise ValueError(f"--data-start-step {start_step} must be >= 0")
        self.idx, self.world, self.rank = np.asarray(train_idx), world_size, rank
        self.micro, self.accum, self.seed, self.start_step = micro_batch_size, grad_accum, seed, start_step
        self.rows_per_step = world_size * micro_batch_size * grad_accum
        self.steps_per_epoch = len(self.idx) // self.rows_per_step
        if self.steps_per_epoch == 0:
            raise ValueError(f"{len(self.idx)} training rows are fewer than one optimizer step needs "
                             f"({world_size} ranks x micro batch {micro_batch_size} x grad accum {grad_accum})")
        self._perm_epoch, self._perm = -1, None

    def epoch_of(self, step: int) -> int:
        return (self.start_step + step) // self.steps_per_epoch

    def micro_batches(self, step: int) -> list[list[int]]:
        epoch, k = divmod(self.start_step + step, self.steps_per_epoch)
        if epoch != self._perm_epoch:
            self._perm = self.idx[np.random.default_rng([self.seed, epoch]).permutation(len(self.idx))]
            self._perm_epoch = epoch
        chunk = self._perm[k * self.rows_per_step:(k + 1) * self.rows_per_step]
        out = []
        for a in range(self.accum):
            s = (a * self.world + self.rank) * self.micro
            out.append([int(i) for i in chunk[s:s + self.micro]])
        return out


@dataclass
class RowPlan:
    """Which rows a run trains and evaluates on: the data, its held-out rows and the step order."""
    data: object
    mode: str                    # "offline" (a hidden-state dump) | "online" (token rows)
    eval_data: object
    train_idx: np.ndarray
    eval_idx: np.ndarray
    sampler: StepSampler

    def total_steps(self, cfg) -> int:
        return cfg.max_steps or max(1, math.ceil(cfg.epochs * self.sampler.steps_per_epoch))


def plan_rows(cfg, world: int, rank: int, verify: str = "sha256", progress: bool = False) -> RowPlan:
    """Open --data (and --eval-data), hold out --eval-rows and lay out the steps; ValueError / ConfigError name the
    flag when the rows cannot serve (fewer rows than held out, fewer training rows than one step needs, ...)."""
    part = (rank, world)
    data, mode = open_rows(cfg.data, verify, progress, part)
    if cfg.eval_data:
        eval_data, eval_mode = open_rows(cfg.eval_data, verify, False, part)
        if eval_mode != mode:
            raise ConfigError(f"--eval-data {cfg.eval_data} is {eval_mode} data but --data is {mode}")
        train_idx, eval_idx = np.arange(len(data)), np.arange(len(eval_data))
    else:
        eval_data = data
        train_idx, eval_idx = split_indices(len(data), cfg.eval_rows, cfg.seed)
    sampler = StepSampler(train_idx, world, rank, cfg.micro_batch_size, cfg.grad_accum, cfg.seed,
                          cfg.data_start_step)
    return RowPlan(data, mode, eval_data, train_idx, eval_idx, sampler)


def check_dump_fits(dump, target_config, cfg) -> None:
    """A hidden-state dump must come from this target (hidden size, vocabulary) and, with fused features, hold the
    layers --aux-layer-ids names."""
    tc = getattr(target_config, "text_config", target_config)
    if (dump.hidden_size, dump.vocab_size) != (tc.hidden_size, tc.vocab_size):
        raise ConfigError(f"--data {cfg.data} was dumped from a target with hidden {dump.hidden_size}, vocab "
                          f"{dump.vocab_size}; --target {cfg.target} has {tc.hidden_size}, {tc.vocab_size}")
    if cfg.aux_layer_ids and list(cfg.aux_layer_ids) != dump.aux_layer_ids and cfg.features == "fused":
        raise ConfigError(f"--aux-layer-ids {cfg.aux_layer_ids} but the dump holds layers {dump.aux_layer_ids}")


def eval_rows_of_rank(eval_idx: np.ndarray, world_size: int, rank: int) -> list[tuple[int, bool]]:
    """(row, counts?) pairs; every rank gets the same number (ZeRO-3 forwards are collective): short ranks
    repeat a row that is not counted."""
    if len(eval_idx) == 0:
        return []
    per = -(-len(eval_idx) // world_size)
    mine = [int(i) for i in eval_idx[rank::world_size]]
    return [(i, True) for i in mine] + [(int(eval_idx[0]), False)] * (per - len(mine))


def collate(items: list[dict], max_length: Optional[int] = None) -> dict[str, torch.Tensor]:
    """Right-pad rows (truncated to max_length) -> input_ids, loss_mask, attention_mask [B, T] and, when present,
    aux_hidden_states [B, T, n_aux*H], last_hidden [B, T, H]."""
    if max_length is not None:
        items = [{k: v[:max_length] for k, v in it.items()} for it in items]
    T = max(len(it["input_ids"]) for it in items)
    B = len(items)
    out = {"input_ids": torch.zeros(B, T, dtype=torch.long), "loss_mask": torch.zeros(B, T, dtype=torch.long),
           "attention_mask": torch.zeros(B, T, dtype=torch.long)}
    for key in ("aux_hidden_states", "last_hidden"):
        if key in items[0]:
            x = items[0][key]
            out[key] = torch.zeros(B, T, x.shape[-1], dtype=x.dtype)
    for b, it in enumerate(items):
        n = len(it["input_ids"])
        out["attention_mask"][b, :n] = 1
        for k, v in it.items():
            out[k][b, :n] = v
    return out


def pack(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A right-padded batch [B, T, ...] -> its rows end to end in one sequence [1, sum of lengths, ...] (no padding)
    plus row_lengths [B]; ttt_forward keeps the rows apart (attention, chains, per-row loss)."""
    real = batch["attention_mask"].bool()                                  # [B, T]
    out = {k: v[real][None] for k, v in batch.items()}
    out["row_lengths"] = real.sum(1)
    return out
