"""The EAGLE-3 training loop: setup, TTT steps, evaluation, atomic checkpoints, resume, export.

Launch on GPUs with `deepspeed --num_gpus N train/train_eagle3.py ...` (ZeRO 1/2/3, bf16), on CPU with
`torchrun --nproc_per_node N train/train_eagle3.py ...` (gloo, fp32), or as one plain process.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..config import ConfigError, Eagle3Config
from ..draft import Eagle3DraftModel
from ..fileio import write_text_atomic
from ..ttt import FEATURES, TTTOutput, metrics_from_counters, ttt_batch
from . import backend as B
from .data import StepSampler, collate, eval_rows_of_rank, open_rows, pack, split_indices
from .draft_init import check_init_compatible, draft_vocab_ids, init_head_from_target, load_init
from .logs import PLOT_FILE, MetricsLogger, plot_curves
from .target_head import load_target_head

STATE_FILE, LATEST, EXPORT_DIR, SUMMARY_FILE = "trainer_state.json", "latest", "draft", "train_summary.json"
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


@dataclass
class TrainConfig:
    target: str
    data: str
    out: str
    eval_data: Optional[str] = None
    eval_rows: int = 64                      # held out of --data when --eval-data is not given
    draft_vocab: Optional[str] = None        # draft_vocab.safetensors (or its dir)
    draft_vocab_size: Optional[int] = None   # build the draft vocab from the training rows
    draft_config: Optional[str] = None       # a draft config.json to start from (shape only)
    init_from: Optional[str] = None          # a trained draft folder: start from its weights (fresh optimizer)
    fc_norm: bool = False                    # EAGLE-3.1 per-feature RMSNorm before fc
    norm_output: bool = False                # EAGLE-3.1: later TTT steps read the normed output
    loss_mask_offset: int = 1                # 1: ours (t+k+1); 0: the authors' / SpecForge's (t+k)
    grow_chains: str = "auto"                # TTT steps >= 1 grow: scored (only chains a later step scores) | all | auto
    aux_layer_ids: Optional[list] = None
    features: str = "fused"
    feature_loss_weight: float = 0.0
    head_init: str = "random"                # random (the authors', SpecForge) | target: lm_head rows + final norm
    ttt_length: int = 7
    step_decay: float = 0.8
    max_length: int = 2048
    micro_batch_size: int = 1
    grad_accum: int = 1
    pack_rows: bool = False                  # a micro-batch's rows end to end in one sequence (no padding)
    epochs: float = 1.0
    max_steps: Optional[int] = None
    lr: float = 5e-5
    warmup_ratio: float = 0.02
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    backend: str = "auto"                    # auto | deepspeed | ddp
    zero_stage: Optional[int] = None
    deepspeed_config: Optional[str] = None
    dtype: str = "auto"                      # auto: bf16 compute where the hardware has it (GPU, AVX-512 BF16 CPU)
    device: str = "auto"
    eval_every: int = 500
    save_every: int = 500
    log_every: int = 10
    keep_checkpoints: int = 2
    keep_every: int = 0                      # checkpoints at multiples of this step are never pruned (curves)
    resume: bool = False
    overwrite: bool = False                  # start again in a run folder that holds checkpoints
    seed: int = 0
    data_start_step: int = 0                 # read the data order from this step on (continue another run's data)
    verify_dumps: str = "sha256"
    tensorboard: bool = True
    progress: bool = True
    extra: dict = field(default_factory=dict)


class TTTModule(nn.Module):
    """What the backends train: the draft, with the target's frozen lm_head kept out of its parameters."""

    def __init__(self, draft: Eagle3DraftModel, lm_head: nn.Module, **ttt_kwargs):
        super().__init__()
        self.draft = draft
        object.__setattr__(self, "lm_head", lm_head)
        self.ttt_kwargs = ttt_kwargs

    def forward(self, batch: dict) -> TTTOutput:
        return ttt_batch(self.draft, batch, self.lm_head, **self.ttt_kwargs)


_log = B.log


def init_distributed(use_deepspeed: bool, device: torch.device) -> None:
    if B.is_dist():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if use_deepspeed:
        import deepspeed
        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(k, v)
        if "MASTER_PORT" not in os.environ:
            import socket
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    elif int(os.environ.get("WORLD_SIZE", 1)) > 1:
        dist.init_process_group(backend)


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """bfloat16 (autocast compute, fp32 master weights and optimizer) or float32. auto: bf16 on GPUs and on
    CPUs with AVX-512 BF16 / AMX (a TTT step measured ~1.6x faster than fp32 on 2 such cores), else fp32."""
    if name == "auto":
        from ..kernels import cpu_has_bf16
        return torch.bfloat16 if device.type == "cuda" or cpu_has_bf16() else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def pick_device(name: str) -> torch.device:
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "tensorboard", EXPORT_DIR, SUMMARY_FILE, PLOT_FILE,
               "draft_vocab.safetensors", "draft_vocab.json")


def existing_checkpoints(out: str) -> list[str]:
    ckpt = os.path.join(out, "checkpoints")
    return sorted(d for d in os.listdir(ckpt) if d.startswith("step_")) if os.path.isdir(ckpt) else []


def check_run_folder(cfg: "TrainConfig") -> None:
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


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*")   # DeepSpeed on recent torch
        if cfg.features not in FEATURES:
            raise ConfigError(f"--features must be one of {FEATURES}, got {cfg.features!r}")
        self.device = pick_device(cfg.device)
        if self.device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        else:
            torch.cuda.set_device(self.device)
        self.backend_name = cfg.backend if cfg.backend != "auto" else (
            "deepspeed" if B.deepspeed_available() else "ddp")
        if self.backend_name == "deepspeed" and not B.deepspeed_available():
            raise ConfigError("--backend deepspeed but `import deepspeed` fails; pip install deepspeed "
                              "or use --backend ddp")
        init_distributed(self.backend_name == "deepspeed", self.device)
        self.rank, self.world = B.rank(), B.world_size()
        self.dtype = compute_dtype(cfg.dtype, self.device)     # bf16: autocast over fp32 master weights
        self.ckpt_dir = os.path.join(cfg.out, "checkpoints")
        check_run_folder(cfg)                       # every rank refuses alike (nothing is deleted before a barrier)
        B.barrier()
        if self.rank == 0:
            if cfg.overwrite:
                clear_run_folder(cfg.out)
            os.makedirs(self.ckpt_dir, exist_ok=True)
        B.barrier()
        self._setup_data()
        self._setup_model()
        self._setup_backend()

    # ---- setup -------------------------------------------------------------------------------
    def _setup_data(self) -> None:
        cfg = self.cfg
        part = (self.rank, self.world)
        self.data, self.mode = open_rows(cfg.data, cfg.verify_dumps, self.rank == 0 and cfg.progress, part)
        if cfg.eval_data:
            self.eval_data, eval_mode = open_rows(cfg.eval_data, cfg.verify_dumps, False, part)
            if eval_mode != self.mode:
                raise ConfigError(f"--eval-data {cfg.eval_data} is {eval_mode} data but --data is {self.mode}")
            self.train_idx, self.eval_idx = np.arange(len(self.data)), np.arange(len(self.eval_data))
        else:
            self.eval_data = self.data
            self.train_idx, self.eval_idx = split_indices(len(self.data), cfg.eval_rows, cfg.seed)
        self.sampler = StepSampler(self.train_idx, self.world, self.rank, cfg.micro_batch_size, cfg.grad_accum,
                                   cfg.seed, cfg.data_start_step)
        self.total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * self.sampler.steps_per_epoch))
        self.eval_plan = eval_rows_of_rank(self.eval_idx, self.world, self.rank)

    def _setup_model(self) -> None:
        cfg = self.cfg
        if self.mode == "online":
            from ..target import TargetModel
            self.target = TargetModel.from_pretrained(cfg.target, dtype=self.dtype, device=self.device,
                                                      aux_layer_ids=cfg.aux_layer_ids)
            hf_config, embed, lm_head = self.target.hf_config, self.target.embed_tokens, self.target.lm_head
            aux_ids = self.target.aux_layer_ids
        else:
            self.target = None
            hf_config, embed, lm_head = load_target_head(cfg.target, self.dtype, self.device)
            aux_ids = self.data.aux_layer_ids
            tc = getattr(hf_config, "text_config", hf_config)
            if (self.data.hidden_size, self.data.vocab_size) != (tc.hidden_size, tc.vocab_size):
                raise ConfigError(f"--data {cfg.data} was dumped from a target with hidden {self.data.hidden_size}, "
                                  f"vocab {self.data.vocab_size}; --target {cfg.target} has {tc.hidden_size}, "
                                  f"{tc.vocab_size}")
            if cfg.aux_layer_ids and list(cfg.aux_layer_ids) != aux_ids and cfg.features == "fused":
                raise ConfigError(f"--aux-layer-ids {cfg.aux_layer_ids} but the dump holds layers {aux_ids}")
        tc = getattr(hf_config, "text_config", hf_config)
        if cfg.features == "top":                  # one feature: the last hidden state (after the final norm)
            aux_ids = [tc.num_hidden_layers - 1]
        init = Eagle3DraftModel.from_pretrained(cfg.init_from, dtype=torch.float32) if cfg.init_from else None
        new_vocab = init is not None and bool(cfg.draft_vocab or cfg.draft_vocab_size)   # --init-from + a vocab
        if init is None or new_vocab:
            d2t_ids = draft_vocab_ids(cfg, self.data, self.train_idx, tc.vocab_size, self.rank)
        else:
            d2t_ids = init.draft_to_target(torch.arange(init.config.draft_vocab_size))
        if cfg.draft_config:
            path = cfg.draft_config
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                dc = Eagle3Config.from_dict({**json.load(f), "draft_vocab_size": len(d2t_ids), "eagle_config": {
                    "eagle_aux_hidden_state_layer_ids": list(aux_ids)}}, where=path)
        else:
            dc = Eagle3Config.for_target(hf_config, len(d2t_ids), aux_ids)
        dc.fc_norm, dc.norm_output = cfg.fc_norm, cfg.norm_output
        if init is not None:
            check_init_compatible(init, dc, cfg.init_from, new_vocab)
        self.draft_config = dc
        torch.manual_seed(cfg.seed)                # identical initial weights on every rank
        draft = Eagle3DraftModel(dc)
        draft.set_vocab_mapping(d2t_ids)
        if init is not None:
            load_init(draft, init, lm_head, new_vocab)
        if cfg.features == "fused":       # "top" uses id L-1 = the last hidden state, which runtimes do not capture
            draft.check_target(hf_config, aux_ids)
        if init is None and cfg.head_init == "target":
            init_head_from_target(draft, lm_head, d2t_ids, cfg.target, self.target)
        draft.set_embedding(embed)
        lm_head.requires_grad_(False)
        self.module = TTTModule(draft.to(self.device), lm_head, ttt_length=cfg.ttt_length,
                                step_decay=cfg.step_decay, features=cfg.features,
                                feature_loss_weight=cfg.feature_loss_weight, loss_mask_offset=cfg.loss_mask_offset,
                                grow_every_chain={"auto": None, "all": True, "scored": False}[cfg.grow_chains])

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
            ds_cfg = B.load_ds_config(cfg.deepspeed_config, cfg.zero_stage if cfg.zero_stage is not None else
                                      (None if cfg.deepspeed_config else 2), cfg.micro_batch_size, cfg.grad_accum,
                                      cfg.grad_clip, ds_bf16)
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
        self.backend.train(False)
        K = self.cfg.ttt_length
        acc = torch.zeros(2 * K + 4, dtype=torch.float64)        # counters, loss sum, rows
        for row, counted in self.eval_plan:
            out = self.backend.eval_batch(self.make_batch(self.eval_data, [row]))
            if counted:
                acc[:2 * K + 2] += out.counters().cpu()
                acc[2 * K + 2] += float(out.loss)
                acc[2 * K + 3] += 1
        acc = B.all_reduce_sum(acc.to(self.device)).cpu()
        self.backend.train(True)
        m = metrics_from_counters(acc[:2 * K + 2])
        m["loss"] = float(acc[2 * K + 2] / acc[2 * K + 3]) if acc[2 * K + 3] else float("nan")
        m["rows"] = int(acc[2 * K + 3])
        return m

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
        state = {"step": step, "total_steps": self.total_steps, "world_size": self.world,
                 "micro_batch_size": c.micro_batch_size, "grad_accum": c.grad_accum, "pack_rows": c.pack_rows,
                 "seed": c.seed, "data_start_step": c.data_start_step, "backend": self.backend_name,
                 "zero_stage": self.zero_stage, "eval_rows": c.eval_rows,
                 "data": os.path.abspath(c.data), "draft_config": self.draft_config.to_dict(),
                 "tokens_seen": self.tokens_seen, "init_from": os.path.abspath(c.init_from) if c.init_from else None}
        return {**state, **step_rows(state)}

    def save_checkpoint(self, step: int) -> str:
        """All ranks write into checkpoints/.tmp-step_N; rank 0 renames it to step_N and updates `latest`."""
        name = f"step_{step:07d}"
        tmp, final = os.path.join(self.ckpt_dir, f".tmp-{name}"), os.path.join(self.ckpt_dir, name)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        B.barrier()
        self.backend.save(tmp)
        B.barrier()
        if self.rank == 0:
            with open(os.path.join(tmp, STATE_FILE), "w") as f:
                json.dump(self._state(step), f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
            write_text_atomic(os.path.join(self.ckpt_dir, LATEST), name + "\n")
            keep_every = self.cfg.keep_every
            older = [d for d in existing_checkpoints(self.cfg.out) if d != name        # never the one just written
                     and not (keep_every and int(d.split("_")[1]) % keep_every == 0)]
            for old in older[:max(0, len(older) - (max(1, self.cfg.keep_checkpoints) - 1))]:
                shutil.rmtree(os.path.join(self.ckpt_dir, old), ignore_errors=True)
        B.barrier()
        return final

    def try_resume(self) -> int:
        latest = os.path.join(self.ckpt_dir, LATEST)
        if not (self.cfg.resume and os.path.isfile(latest)):
            return 0
        with open(latest) as f:
            path = os.path.join(self.ckpt_dir, f.read().strip())
        state_file = os.path.join(path, STATE_FILE)
        if not os.path.isfile(state_file):
            raise ConfigError(f"{latest} points to {path}, which has no {STATE_FILE}")
        with open(state_file) as f:
            state = json.load(f)
        now = self._state(state["step"])
        if state.get("total_steps") != now["total_steps"] and state["step"] >= state.get("total_steps", 0):
            raise ConfigError(f"{path}: that run finished its planned {state['total_steps']} steps; its warm-up + cosine "
                              f"schedule cannot be stretched to {now['total_steps']}. Continue training from its draft "
                              f"in a new folder: --init-from {os.path.join(self.cfg.out, EXPORT_DIR)} --out NEW_RUN")
        state = {"data_start_step": 0, **state, **step_rows(state)}     # checkpoints from before the key: 0
        diff = [f"{k}: checkpoint {state.get(k)} vs now {now[k]}" for k in RESUME_KEYS if state.get(k) != now[k]]
        if diff:
            raise ConfigError(f"cannot resume {path} with the same data order and schedule: " + "; ".join(diff))
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
    def run(self) -> dict:
        from tqdm import tqdm
        cfg = self.cfg
        self.tokens_seen = 0                                     # training tokens since step 0 (resumes with it)
        start = self.try_resume()
        logger = MetricsLogger(cfg.out, start, cfg.tensorboard) if self.rank == 0 else None
        n_params = sum(p.numel() for p in self.module.draft.parameters())
        _log(f"train: {self.mode} data, {len(self.train_idx)} train / {len(self.eval_idx)} eval rows, "
             f"{n_params / 1e6:.2f}M draft params, vocab {self.draft_config.draft_vocab_size}, "
             f"features {cfg.features}, backend {self.backend_name}"
             f"{'' if self.zero_stage is None else f' ZeRO-{self.zero_stage}'} x {self.world} "
             f"({self.device.type}, {str(self.dtype).replace('torch.', '')}), steps {start}->{self.total_steps}")
        K = cfg.ttt_length
        bar = tqdm(total=self.total_steps, initial=start, unit="step", disable=self.rank != 0 or not cfg.progress,
                   dynamic_ncols=True)
        win = torch.zeros(2 * K + 4, dtype=torch.float64)       # counters, loss sum, tokens
        win_steps, win_time, total_tokens, total_time = 0, 0.0, 0, 0.0
        last_eval = None
        if start == 0 and cfg.init_from and len(self.eval_idx):
            self._log_eval(0, logger, bar)       # the warm start's own score on this run's held-out rows
        self.backend.train(True)
        for step in range(start, self.total_steps):
            t0 = time.perf_counter()
            micro = self.sampler.micro_batches(step)
            local = torch.zeros(2 * K + 4, dtype=torch.float64)
            for a, rows in enumerate(micro):
                batch = self.make_batch(self.data, rows)
                out = self.backend.train_micro(batch, boundary=a == len(micro) - 1)
                local[:2 * K + 2] += out.counters().cpu()
                local[2 * K + 2] += float(out.loss.detach()) / len(micro)
                local[2 * K + 3] += float(batch["attention_mask"].sum())
            local = B.all_reduce_sum(local.to(self.device)).cpu()
            dt = time.perf_counter() - t0
            win += local
            win_steps, win_time = win_steps + 1, win_time + dt
            total_tokens, total_time = total_tokens + int(local[2 * K + 3]), total_time + dt
            self.tokens_seen += int(local[2 * K + 3])
            done = step + 1
            if done % cfg.log_every == 0 or done == self.total_steps:
                rec = {"step": done, "split": "train", "epoch": self.sampler.epoch_of(step), "tokens_seen": self.tokens_seen,
                       "loss": float(win[2 * K + 2] / (win_steps * self.world)), "lr": self.backend.lr(),
                       "grad_norm": self.backend.grad_norm(), "tokens_per_s": float(win[2 * K + 3] / win_time),
                       **metrics_from_counters(win[:2 * K + 2])}
                if logger:
                    logger.log(rec)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", acc0=f"{rec['acc_0']:.3f}",
                                tok_s=f"{rec['tokens_per_s']:.0f}")
                win.zero_()
                win_steps, win_time = 0, 0.0
            if len(self.eval_idx) and (done % cfg.eval_every == 0 or done == self.total_steps):
                last_eval = self._log_eval(done, logger, bar)
            if cfg.save_every and (done % cfg.save_every == 0 or done == self.total_steps):
                self.save_checkpoint(done)
            bar.update(1)
        bar.close()
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
