"""The EAGLE-3 training loop: setup, TTT steps, evaluation, checkpoints and resume (run_folder.py), export.

Launch on GPUs with `deepspeed --num_gpus N train/train_eagle3.py ...` (ZeRO 1/2/3, bf16), on CPU with
`torchrun --nproc_per_node N train/train_eagle3.py ...` (gloo, fp32), or as one plain process.
"""
from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import asdict
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from sglang_eagle3.engine.threads import governor
from sglang_eagle3.models.config import ConfigError
from sglang_eagle3.models.draft import Eagle3DraftModel
from sglang_eagle3.models.target_head import load_target_head
from sglang_eagle3.training.trainer import backend as B
from sglang_eagle3.training.trainer.backend import compute_dtype, init_distributed, pick_device
from sglang_eagle3.training.trainer.data import check_dump_fits, collate, eval_rows_of_rank, pack, plan_rows
from sglang_eagle3.training.trainer.draft_init import build_draft
from sglang_eagle3.training.trainer.logs import PLOT_FILE, MetricsLogger, plot_curves
from sglang_eagle3.training.trainer.run_config import TrainConfig
from sglang_eagle3.training.trainer.run_folder import (
    EXPORT_DIR,
    SUMMARY_FILE,
    check_resumable,
    check_run_folder,
    clear_run_folder,
    latest_checkpoint,
    run_state,
    write_checkpoint,
)
from sglang_eagle3.training.ttt import FEATURES, TTTBatch, TTTCounters, TTTOutput, TTTSettings, ttt_forward

__all__ = ["TrainConfig", "Trainer", "TTTModule"]


class TTTModule(nn.Module):
    """What the backends train: the draft, with the target's frozen lm_head kept out of its parameters."""

    def __init__(self, draft: Eagle3DraftModel, lm_head: nn.Module, settings: TTTSettings):
        super().__init__()
        self.draft = draft
        object.__setattr__(self, "lm_head", lm_head)
        self.settings = settings

    def forward(self, batch: dict) -> TTTOutput:
        return ttt_forward(self.draft, TTTBatch.from_dict(batch), self.lm_head, self.settings)


def ttt_settings(cfg: TrainConfig) -> TTTSettings:
    return TTTSettings(ttt_length=cfg.ttt_length, step_decay=cfg.step_decay, features=cfg.features,
                       feature_loss_weight=cfg.feature_loss_weight, loss_mask_offset=cfg.loss_mask_offset,
                       target_temperature=cfg.target_temperature,
                       grow_every_chain={"auto": None, "all": True, "scored": False}[cfg.grow_chains])


_log = B.log


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*")   # DeepSpeed on recent torch
        if cfg.features not in FEATURES:
            raise ConfigError(f"--features must be one of {FEATURES}, got {cfg.features!r}")
        self.device = pick_device(cfg.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.backend_name = B.backend_name(cfg.backend)
        init_distributed(self.backend_name == "deepspeed", self.device)
        self.rank, self.world = B.rank(), B.world_size()
        self.dtype = compute_dtype(cfg.dtype, self.device)     # bf16: autocast over fp32 master weights
        self.ckpt_dir = os.path.join(cfg.out, "checkpoints")
        check_run_folder(cfg)                       # every rank refuses alike (nothing is deleted before a barrier)
        B.barrier()
        if self.rank == 0 and cfg.overwrite:
            clear_run_folder(cfg.out)               # checkpoints/ is made by the first checkpoint written
        B.barrier()
        self._setup_data()
        self._setup_model()
        self._setup_backend()

    # ---- setup -------------------------------------------------------------------------------
    def _setup_data(self) -> None:
        cfg = self.cfg
        plan = plan_rows(cfg, self.world, self.rank, cfg.verify_dumps, self.rank == 0 and cfg.progress)
        self.data, self.mode, self.eval_data = plan.data, plan.mode, plan.eval_data
        self.train_idx, self.eval_idx, self.sampler = plan.train_idx, plan.eval_idx, plan.sampler
        self.total_steps = plan.total_steps(cfg)
        self.eval_plan = eval_rows_of_rank(self.eval_idx, self.world, self.rank)

    def _setup_model(self) -> None:
        cfg = self.cfg
        if self.mode == "online":
            from sglang_eagle3.models.target import TargetModel
            self.target = TargetModel.from_pretrained(cfg.target, dtype=self.dtype, device=self.device,
                                                      aux_layer_ids=cfg.aux_layer_ids)
            hf_config, embed, lm_head = self.target.hf_config, self.target.embed_tokens, self.target.lm_head
            aux_ids = self.target.aux_layer_ids
        else:
            self.target = None
            hf_config, embed, lm_head = load_target_head(cfg.target, self.dtype, self.device)
            aux_ids = self.data.aux_layer_ids
            check_dump_fits(self.data, hf_config, cfg)
        draft = build_draft(cfg, hf_config, aux_ids, embed, lm_head, self.data, self.train_idx, self.rank,
                            self.target)
        self.draft_config = draft.config
        lm_head.requires_grad_(False)
        self.module = TTTModule(draft.to(self.device), lm_head, ttt_settings(cfg))

    def _setup_backend(self) -> None:
        cfg = self.cfg
        params = [p for p in self.module.parameters() if p.requires_grad]
        optimizer = B.adamw(params, cfg.lr, cfg.weight_decay, self.device)
        warmup = max(1, round(cfg.warmup_ratio * self.total_steps))
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, B.warmup_cosine(self.total_steps, warmup, cfg.min_lr_ratio))
        bf16 = self.dtype == torch.bfloat16
        if self.backend_name == "deepspeed":
            # GPU: DeepSpeed's own bf16 (bf16 weights, fp32 master copy); CPU: fp32 engine under torch autocast
            ds_bf16 = bf16 and self.device.type == "cuda"
            ds_cfg = B.run_ds_config(cfg, ds_bf16)
            self.backend = B.DeepSpeedBackend(self.module, optimizer, scheduler, ds_cfg,
                                              torch.bfloat16 if bf16 and not ds_bf16 else None)
            self.zero_stage = self.backend.zero_stage
        else:
            self.backend = B.TorchBackend(self.module, optimizer, scheduler, cfg.grad_accum, cfg.grad_clip,
                                          torch.bfloat16 if bf16 else None)
            self.zero_stage = None

    # ---- batches -------------------------------------------------------------------------------
    def make_batch(self, data, rows: list[int]) -> dict:
        want_aux = self.cfg.features == "fused"
        if self.mode == "offline":
            items = [data.read(i, aux=want_aux) for i in rows]
        elif self.device.type == "cpu":          # compute-bound: the target runs on each row alone, not on padding
            items = [self.with_target_features(data[i]) for i in rows]
        else:
            items = [data[i] for i in rows]
        batch = {k: v.to(self.device, non_blocking=True) for k, v in collate(items, self.cfg.max_length).items()}
        if self.mode == "online" and "last_hidden" not in batch:     # GPU: one padded target forward for the batch
            with torch.no_grad():
                batch["aux_hidden_states"], batch["last_hidden"] = self.target.features(
                    batch["input_ids"], batch["attention_mask"])
        return pack(batch) if self.cfg.pack_rows else batch

    @torch.no_grad()
    def with_target_features(self, item: dict) -> dict:
        """Online mode on CPU: a token row (cut to max_length) plus the target's aux_hidden_states [n, n_aux*H]
        and last_hidden [n, H], computed on the row alone."""
        item = {k: v[:self.cfg.max_length] for k, v in item.items()}
        aux, last = self.target.features(item["input_ids"][None])
        return {**item, "aux_hidden_states": aux[0], "last_hidden": last[0]}

    # ---- evaluation ------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        """The held-out rows' accuracies, acceptance length and mean loss, over every rank's share."""
        self.backend.train(False)
        counts = TTTCounters.zeros(self.cfg.ttt_length)
        for row, counted in self.eval_plan:
            out = self.backend.eval_batch(self.make_batch(self.eval_data, [row]))
            if counted:                         # a short rank repeats a row (ZeRO-3 forwards are collective)
                counts += out.counters.cpu()
                counts.loss_sum += float(out.loss)
                counts.losses += 1
        counts = counts.all_reduced(self.device)
        self.backend.train(True)
        return {**counts.metrics(), "loss": counts.mean_loss(), "rows": int(counts.losses)}

    def _log_eval(self, step: int, logger, bar) -> dict:
        rec = {"step": step, "split": "eval", "tokens_seen": self.tokens_seen, **self.evaluate()}
        if logger:
            logger.log(rec)
            bar.write(f"eval @ {step}: loss {rec['loss']:.4f} " + " ".join(
                f"acc_{k} {rec[f'acc_{k}']:.3f}" for k in range(self.cfg.ttt_length)) +
                f" accept_len {rec['accept_length']:.3f}")
        return rec

    # ---- checkpoints -----------------------------------------------------------------------------
    def _state(self, step: int) -> dict:
        c = self.cfg
        return {"step": step, **run_state(c, self.total_steps, self.world, self.backend_name, self.zero_stage),
                "draft_config": self.draft_config.to_dict(), "tokens_seen": self.tokens_seen}

    def save_checkpoint(self, step: int) -> str:
        return write_checkpoint(self.ckpt_dir, step, self.backend.save, self._state(step),
                                self.cfg.keep_checkpoints, self.cfg.keep_every)

    def try_resume(self) -> int:
        """With --resume: load the newest checkpoint (refusing one from a different run) and return its step."""
        found = latest_checkpoint(self.ckpt_dir) if self.cfg.resume else None
        if found is None:
            return 0
        path, state = found
        check_resumable(path, state, self._state(state["step"]), self.cfg.out)
        self.backend.load(path)
        self.tokens_seen = int(state.get("tokens_seen", 0))
        _log(f"resumed from {path} (step {state['step']}/{self.total_steps})")
        return int(state["step"])

    # ---- export ----------------------------------------------------------------------------------
    def param_checksum(self) -> float:
        with self.backend.gathered():
            return float(sum(p.detach().double().sum() + p.detach().double().abs().sum()
                             for p in self.module.draft.parameters()))

    def export(self) -> Optional[str]:
        """Save the draft (bf16, SGLang layout, d2t/t2d inside) to OUT/draft; returns the path on rank 0."""
        with self.backend.gathered():
            state = {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype).clone()
                     for k, v in self.module.draft.state_dict().items()} if self.rank == 0 else None
        if self.rank != 0:
            return None
        draft = Eagle3DraftModel(self.draft_config)
        draft.load_state_dict(state)
        path = os.path.join(self.cfg.out, EXPORT_DIR)
        draft.save_pretrained(path, dtype=torch.bfloat16)
        return path

    # ---- the loop --------------------------------------------------------------------------------
    def train_step(self, step: int) -> TTTCounters:
        """One optimizer step over this rank's micro-batches -> the counts of every rank: accuracies and acceptance,
        the step's loss (one per rank: the mean over its micro-batches) and the tokens trained on."""
        micro = self.sampler.micro_batches(step)
        counts = TTTCounters.zeros(self.cfg.ttt_length)
        for a, rows in enumerate(micro):
            batch = self.make_batch(self.data, rows)
            out = self.backend.train_micro(batch, boundary=a == len(micro) - 1)
            counts += out.counters.cpu()
            counts.loss_sum += float(out.loss.detach()) / len(micro)
            counts.tokens += float(batch["attention_mask"].sum())
        counts.losses = 1.0
        return counts.all_reduced(self.device)

    def run(self) -> dict:
        from tqdm import tqdm
        cfg = self.cfg
        self.tokens_seen = 0                                     # training tokens since step 0 (resumes with it)
        start = self.try_resume()
        logger = MetricsLogger(cfg.out, start, cfg.tensorboard) if self.rank == 0 else None
        self._log_start(start)
        bar = tqdm(total=self.total_steps, initial=start, unit="step", disable=self.rank != 0 or not cfg.progress,
                   dynamic_ncols=True)
        window, window_time = TTTCounters.zeros(cfg.ttt_length), 0.0     # summed since the last log line
        total_tokens, total_time = 0, 0.0
        last_eval = None
        if start == 0 and cfg.init_from and len(self.eval_idx):
            self._log_eval(0, logger, bar)       # the warm start's own score on this run's held-out rows
        self.backend.train(True)
        for step in range(start, self.total_steps):
            if self.device.type == "cpu":
                governor().update()          # threads fit the cores other processes leave free
            t0 = time.perf_counter()
            counts = self.train_step(step)
            dt = time.perf_counter() - t0
            window, window_time = window + counts, window_time + dt
            total_tokens, total_time = total_tokens + int(counts.tokens), total_time + dt
            self.tokens_seen += int(counts.tokens)
            done = step + 1
            if done % cfg.log_every == 0 or done == self.total_steps:
                self._log_train(done, self.sampler.epoch_of(step), window, window_time, logger, bar)
                window, window_time = TTTCounters.zeros(cfg.ttt_length), 0.0
            if len(self.eval_idx) and (done % cfg.eval_every == 0 or done == self.total_steps):
                last_eval = self._log_eval(done, logger, bar)
            if done == self.total_steps or (cfg.save_every and done % cfg.save_every == 0):
                self.save_checkpoint(done)
            bar.update(1)
        bar.close()
        return self._finish(start, last_eval, total_tokens, total_time, logger)

    def _log_start(self, start: int) -> None:
        cfg = self.cfg
        n_params = sum(p.numel() for p in self.module.draft.parameters())
        _log(f"train: {self.mode} data, {len(self.train_idx)} train / {len(self.eval_idx)} eval rows, "
             f"{n_params / 1e6:.2f}M draft params, vocab {self.draft_config.draft_vocab_size}, "
             f"features {cfg.features}, backend {self.backend_name}"
             f"{'' if self.zero_stage is None else f' ZeRO-{self.zero_stage}'} x {self.world} "
             f"({self.device.type}, {str(self.dtype).replace('torch.', '')}), steps {start}->{self.total_steps}")

    def _log_train(self, step: int, epoch: int, window: TTTCounters, seconds: float, logger, bar) -> None:
        """One train record over the steps since the last: the mean loss over steps and ranks, the throughput."""
        rec = {"step": step, "split": "train", "epoch": epoch, "tokens_seen": self.tokens_seen,
               "loss": window.mean_loss(), "lr": self.backend.lr(), "grad_norm": self.backend.grad_norm(),
               "tokens_per_s": window.tokens / seconds, **window.metrics()}
        if logger:
            logger.log(rec)
        bar.set_postfix(loss=f"{rec['loss']:.3f}", acc0=f"{rec['acc_0']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}")

    def _finish(self, start: int, last_eval: Optional[dict], total_tokens: int, total_time: float, logger) -> dict:
        """Export the draft, write the summary and the curves (rank 0); -> the summary."""
        cfg = self.cfg
        checksums = [None] * self.world
        local_sum = self.param_checksum()
        if B.is_dist():
            dist.all_gather_object(checksums, local_sum)
        else:
            checksums = [local_sum]
        path = self.export()
        summary = {"steps": self.total_steps, "resumed_from": start, "backend": self.backend_name,
                   "zero_stage": self.zero_stage, "world_size": self.world, "device": self.device.type,
                   "dtype": str(self.dtype).replace("torch.", ""), "final_eval": last_eval,
                   "train_tokens": total_tokens, "tokens_seen": self.tokens_seen, "train_time_s": total_time,
                   "tokens_per_s": total_tokens / total_time if total_time else None,
                   "param_checksums": checksums, "export": path, "config": asdict(cfg)}
        if logger:
            logger.close()
            plot_curves(logger.path, os.path.join(cfg.out, PLOT_FILE), title=f"EAGLE-3 draft: {cfg.target}")
            with open(os.path.join(cfg.out, SUMMARY_FILE), "w") as f:
                json.dump(summary, f, indent=2)
            _log(f"train: done; draft -> {path}; {summary['tokens_per_s'] or 0:.0f} tokens/s; "
                 f"curves -> {os.path.join(cfg.out, PLOT_FILE)}")
        B.barrier()
        return summary
