"""Everything a training run is told: one dataclass, filled by `eagle3 train`'s flags (trainer/cli.py) and saved
whole in the run's train_summary.json."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


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
    grow_chains: str = "auto"                # TTT steps >= 1 grow: scored (chains a later step scores) | all | auto
    aux_layer_ids: Optional[list] = None
    features: str = "fused"
    feature_loss_weight: float = 0.0
    target_temperature: float = 1.0          # learn softmax(target logits / T); 0: the target's greedy pick
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
    check_disk: bool = True                  # refuse to start without room for the checkpoints (run_folder)
    tensorboard: bool = True
    progress: bool = True
    extra: dict = field(default_factory=dict)
