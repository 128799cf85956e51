"""What a training run will check, checked before any worker starts or any model loads: `eagle3 train
--check-only` (which `make train` runs before torchrun) and every worker before its backend's set-up run it, so a
mistake is one line naming the flag instead of a worker's traceback after the DeepSpeed set-up.

The checks are the run's own functions (plan_rows, check_dump_fits, given_draft_vocab, check_resumable, ...), called
on what is cheap to read: the data's rows and a dump's manifest and shard sizes (their sha256 is left to the run),
the target's config.json, the draft vocabulary file, --init-from's config.json and safetensors headers, the free
space under --out.
"""
from __future__ import annotations

import os

from sglang_eagle3.engine.settings import check_device
from sglang_eagle3.errors import UserError
from sglang_eagle3.fileio import check_apart
from sglang_eagle3.models.config import ConfigError, default_aux_layer_ids
from sglang_eagle3.models.draft import Eagle3DraftModel
from sglang_eagle3.training.dump_reader import MANIFEST
from sglang_eagle3.training.trainer import backend as B
from sglang_eagle3.training.trainer.data import check_dump_fits, plan_rows
from sglang_eagle3.training.trainer.draft_init import check_init_compatible, given_draft_vocab, run_draft_config
from sglang_eagle3.training.trainer.run_folder import (
    check_checkpoint_space,
    check_resumable,
    check_run_folder,
    latest_checkpoint,
    run_state,
)


def check_paths(cfg) -> None:
    """The files and folders the flags name exist, lie apart from --out, and --data is a kind of data the trainer
    reads."""
    check_apart({"--out": cfg.out}, {"--data": cfg.data, "--eval-data": cfg.eval_data, "--init-from": cfg.init_from,
                                     "--draft-vocab": cfg.draft_vocab, "--draft-config": cfg.draft_config,
                                     "--deepspeed-config": cfg.deepspeed_config, "--target": cfg.target})
    if not os.path.exists(cfg.data):
        raise UserError(f"--data {cfg.data}: no such file or folder (make data / make dump first?)")
    if os.path.isdir(cfg.data) and not (os.path.isfile(os.path.join(cfg.data, MANIFEST)) or
                                        os.path.isfile(os.path.join(cfg.data, "data.arrow"))):
        raise UserError(f"--data {cfg.data}: neither a hidden-state dump ({MANIFEST}) nor a prepare-data folder")
    for flag, path in (("--draft-vocab", cfg.draft_vocab), ("--init-from", cfg.init_from),
                       ("--eval-data", cfg.eval_data), ("--draft-config", cfg.draft_config),
                       ("--deepspeed-config", cfg.deepspeed_config)):
        if path and not os.path.exists(path):
            raise UserError(f"{flag} {path}: no such file or folder")


def target_text_config(target: str):
    from transformers import AutoConfig
    try:
        cfg = AutoConfig.from_pretrained(target)
    except (OSError, ValueError) as e:
        raise UserError(f"--target {target}: cannot read its config.json ({e})") from None
    return getattr(cfg, "text_config", cfg)


def check_draft_inputs(cfg, tc, aux_ids: list[int]) -> Eagle3DraftModel:
    """The draft vocabulary, --init-from (its config and safetensors headers) and --draft-config against the target;
    returns the draft the run will train, on the meta device (its shapes, no weights)."""
    ids = given_draft_vocab(cfg, tc.vocab_size)
    init = Eagle3DraftModel.check_files(cfg.init_from, "--init-from") if cfg.init_from else None
    if init and (init.vocab_size, init.target_hidden_size) != (tc.vocab_size, tc.hidden_size):
        raise ConfigError(f"--init-from {cfg.init_from} is a draft for a target with vocabulary "
                          f"{init.vocab_size} and hidden size {init.target_hidden_size}; --target {cfg.target} "
                          f"has {tc.vocab_size} and {tc.hidden_size}")
    new_vocab = init is not None and bool(cfg.draft_vocab or cfg.draft_vocab_size)
    vocab_size = len(ids) if ids is not None else init.draft_vocab_size if init and not new_vocab else \
        cfg.draft_vocab_size or tc.vocab_size
    dc = run_draft_config(cfg, tc, aux_ids, vocab_size)
    if init:
        check_init_compatible(init, dc, cfg.init_from, new_vocab)
    draft = Eagle3DraftModel.on_meta(dc)
    if cfg.features == "fused":
        draft.check_target(tc, aux_ids)
    return draft


def check_aux_layers(aux_layer_ids, tc) -> None:
    """--aux-layer-ids (when given) name layers of the target, in increasing order, as the target runtime captures
    them (online training, dump-hidden-states)."""
    if not aux_layer_ids:
        return
    bad = [i for i in aux_layer_ids if not 0 <= i < tc.num_hidden_layers]
    if bad:
        raise ConfigError(f"--aux-layer-ids {aux_layer_ids}: ids {bad} are not layers of the target's "
                          f"{tc.num_hidden_layers} (0..{tc.num_hidden_layers - 1})")
    if list(aux_layer_ids) != sorted(set(aux_layer_ids)):
        raise ConfigError(f"--aux-layer-ids {aux_layer_ids} must be strictly increasing (SGLang's order)")


def check_backend_flags(cfg, backend: str) -> None:
    """The DeepSpeed flags need the DeepSpeed backend (PyTorch DDP would ignore them)."""
    given = [f"{flag} {value}" for flag, value in (("--zero-stage", cfg.zero_stage),
                                                   ("--deepspeed-config", cfg.deepspeed_config)) if value is not None]
    if given and backend != "deepspeed":
        raise ConfigError(f"{given[0]} is a DeepSpeed setting, but the run trains with PyTorch DDP ("
                          f"{'--backend ddp' if cfg.backend == 'ddp' else '--backend auto: `import deepspeed` fails'})"
                          ": pass --backend deepspeed, or drop it")


def check_inputs(cfg, world_size: int) -> None:
    """Every input of the run, as the run will check it, for `world_size` ranks, and the room its checkpoints need."""
    check_paths(cfg)
    check_run_folder(cfg)
    B.pick_device(check_device(cfg.device))
    backend = B.backend_name(cfg.backend)
    check_backend_flags(cfg, backend)
    zero_stage = B.zero_stage_of(B.run_ds_config(cfg, False)) if backend == "deepspeed" else None
    tc = target_text_config(cfg.target)
    plan = plan_rows(cfg, world_size, 0, verify="size")
    if plan.mode == "offline":
        check_dump_fits(plan.data, tc, cfg)
        aux_ids = plan.data.aux_layer_ids
    else:
        check_aux_layers(cfg.aux_layer_ids, tc)
        aux_ids = cfg.aux_layer_ids or default_aux_layer_ids(tc.num_hidden_layers)
    draft = check_draft_inputs(cfg, tc, aux_ids)
    found = latest_checkpoint(os.path.join(cfg.out, "checkpoints")) if cfg.resume else None
    if found:
        path, state = found
        check_resumable(path, state, run_state(cfg, plan.total_steps(cfg), world_size, backend, zero_stage), cfg.out)
    if cfg.check_disk:
        check_checkpoint_space(cfg, sum(t.numel() for t in draft.state_dict().values()), plan.total_steps(cfg))
