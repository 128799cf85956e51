"""How one micro-batch is trained: DeepSpeed ZeRO 1/2/3, or plain PyTorch (DDP over NCCL/gloo, or one process).

Both backends take the same module (forward(batch) -> TTTOutput), the same AdamW and LR schedule, and
step the optimizer once every `grad_accum` micro-batches with gradient clipping; both save/load a checkpoint
directory holding model, optimizer and scheduler state.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from typing import Optional

import torch
import torch.distributed as dist

from sglang_eagle3.models.config import ConfigError

CONFIG_KEYS_WE_SET = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                      "gradient_clipping", "bf16", "fp16")


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


def log(msg: str) -> None:
    """Print on rank 0 only."""
    if rank() == 0:
        print(msg, flush=True)


def world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def barrier() -> None:
    if is_dist():
        dist.barrier()


def init_distributed(use_deepspeed: bool, device: torch.device) -> None:
    """One process group per run: DeepSpeed's (it sets the env a single process lacks), or torch's under torchrun."""
    if is_dist():
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
        from sglang_eagle3.kernels.decode import cpu_has_bf16
        return torch.bfloat16 if device.type == "cuda" or cpu_has_bf16() else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def pick_device(name: str) -> torch.device:
    """auto: this rank's GPU (LOCAL_RANK) where CUDA is available, else the CPU (and DeepSpeed's CPU accelerator,
    which it would otherwise guess with a warning)."""
    if name != "auto":
        device = torch.device(name)
    elif torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    else:
        device = torch.device("cpu")
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return device


def adamw(params, lr: float, weight_decay: float = 0.0, device: torch.device = torch.device("cpu")):
    """The trainer's optimizer. On CPU the fused AdamW (one pass over each tensor: 4.7 ms a step for the SmolLM2
    draft against 46 ms for torch's per-tensor loop, the same weights to ~1e-8 after 30 steps); GPUs keep torch's
    default."""
    fused = {"fused": True} if device.type == "cpu" else {}
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay, **fused)


def warmup_cosine(total_steps: int, warmup_steps: int, min_ratio: float = 0.0):
    """LR multiplier: linear warm-up from 1/warmup to 1, then cosine decay to min_ratio at total_steps."""
    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def deepspeed_available() -> bool:
    try:
        import deepspeed  # noqa: F401
        return True
    except Exception:
        return False


def backend_name(name: str) -> str:
    """--backend: auto = deepspeed where it imports, else ddp; deepspeed asked for but missing: a ConfigError."""
    if name == "auto":
        return "deepspeed" if deepspeed_available() else "ddp"
    if name == "deepspeed" and not deepspeed_available():
        raise ConfigError("--backend deepspeed but `import deepspeed` fails; pip install deepspeed or use "
                          "--backend ddp")
    return name


def load_ds_config(path: Optional[str], zero_stage: int, micro_batch_size: int, grad_accum: int,
                   grad_clip: float, bf16: bool) -> dict:
    """A DeepSpeed config: the JSON file's ZeRO settings + the batch, clipping and precision we train with."""
    cfg: dict = {}
    if path:
        try:
            with open(path) as f:
                cfg = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--deepspeed-config {path}: {e}") from None
        for key in ("optimizer", "scheduler"):
            if key in cfg:
                raise ValueError(f"--deepspeed-config {path}: remove the {key!r} section; the trainer builds AdamW "
                                 "and the warm-up + cosine schedule from --lr/--warmup-ratio so that the DeepSpeed "
                                 "and plain-PyTorch paths train identically")
    cfg = {k: v for k, v in cfg.items() if k not in CONFIG_KEYS_WE_SET}
    cfg.setdefault("zero_optimization", {})
    if zero_stage is not None:
        cfg["zero_optimization"]["stage"] = zero_stage
    cfg.update({"train_micro_batch_size_per_gpu": micro_batch_size, "gradient_accumulation_steps": grad_accum,
                "gradient_clipping": grad_clip, "bf16": {"enabled": bool(bf16)}, "steps_per_print": 10 ** 9})
    cfg.setdefault("wall_clock_breakdown", False)
    return cfg


def run_ds_config(cfg, bf16: bool) -> dict:
    """The DeepSpeed config a run trains with: --deepspeed-config's ZeRO settings (ZeRO-2 without a file),
    --zero-stage over them, and the run's batch, clipping and precision."""
    stage = cfg.zero_stage if cfg.zero_stage is not None else (None if cfg.deepspeed_config else 2)
    return load_ds_config(cfg.deepspeed_config, stage, cfg.micro_batch_size, cfg.grad_accum, cfg.grad_clip, bf16)


def zero_stage_of(ds_config: dict) -> int:
    return int(ds_config["zero_optimization"].get("stage", 0))


def autocast(module, dtype: Optional[torch.dtype]):
    """bf16 compute over fp32 weights (or nothing)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(next(module.parameters()).device.type, dtype=dtype)


class DeepSpeedBackend:
    name = "deepspeed"

    def __init__(self, module, optimizer, scheduler, ds_config: dict, autocast_dtype: Optional[torch.dtype] = None):
        import deepspeed
        self.autocast_dtype = autocast_dtype
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=module, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
        self.zero_stage = zero_stage_of(ds_config)
        self.module = self.engine.module

    def train_micro(self, batch: dict, boundary: bool):
        with autocast(self.module, self.autocast_dtype):
            out = self.engine(batch)
        self.engine.backward(out.loss)       # DeepSpeed scales by 1/grad_accum
        self.engine.step()                   # optimizer + scheduler step only at the accumulation boundary
        return out

    def eval_batch(self, batch: dict):
        with autocast(self.module, self.autocast_dtype):
            return self.engine(batch)

    def grad_norm(self) -> float:
        g = self.engine.get_global_grad_norm()
        return float(g) if g is not None else float("nan")

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def train(self, mode: bool = True):
        self.engine.train(mode)

    def save(self, directory: str) -> None:
        self.engine.save_checkpoint(directory, tag="engine", save_latest=False)

    def load(self, directory: str) -> None:
        path, _ = self.engine.load_checkpoint(directory, tag="engine", load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if path is None:
            raise FileNotFoundError(f"{directory}: DeepSpeed found no checkpoint (tag 'engine')")

    @contextlib.contextmanager
    def gathered(self):
        """Full parameters on every rank (ZeRO-3 keeps only a shard)."""
        if self.zero_stage == 3:
            import deepspeed
            with deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None):
                yield
        else:
            yield


class TorchBackend:
    """Plain PyTorch: DistributedDataParallel when torch.distributed is initialised, else one process."""
    name = "ddp"

    def __init__(self, module, optimizer, scheduler, grad_accum: int, grad_clip: float,
                 autocast_dtype: Optional[torch.dtype] = None):
        self.module, self.optimizer, self.scheduler = module, optimizer, scheduler
        self.grad_accum, self.grad_clip, self.autocast_dtype = grad_accum, grad_clip, autocast_dtype
        if is_dist():
            from torch.nn.parallel import DistributedDataParallel
            dev = next(module.parameters()).device
            self.model = DistributedDataParallel(module, device_ids=[dev.index] if dev.type == "cuda" else None)
        else:
            self.model = module
        self._norm = float("nan")


    def train_micro(self, batch: dict, boundary: bool):
        sync = boundary or not hasattr(self.model, "no_sync")
        with (contextlib.nullcontext() if sync else self.model.no_sync()):
            with autocast(self.module, self.autocast_dtype):
                out = self.model(batch)
            (out.loss / self.grad_accum).backward()
        if boundary:
            self._norm = float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.grad_clip))
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        return out

    def eval_batch(self, batch: dict):
        with autocast(self.module, self.autocast_dtype):
            return self.model(batch)

    def grad_norm(self) -> float:
        return self._norm

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def train(self, mode: bool = True):
        self.model.train(mode)

    def save(self, directory: str) -> None:
        if rank() == 0:
            torch.save({"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict()}, os.path.join(directory, "state.pt"))

    def load(self, directory: str) -> None:
        path = os.path.join(directory, "state.pt")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: missing (checkpoint written by another backend?)")
        state = torch.load(path, map_location=next(self.module.parameters()).device, weights_only=False)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    @contextlib.contextmanager
    def gathered(self):
        yield
