"""`eagle3 dump-hidden-states` and `eagle3 train` (also train/dump_hidden_states.py and train/train_eagle3.py)."""
from __future__ import annotations

import argparse
import contextlib
import os
from typing import Optional

from sglang_eagle3.errors import UserError, check_at_least, flags_of
from sglang_eagle3.fileio import check_apart

DTYPE_NAMES = ("bfloat16", "float16", "float32")     # torch is imported only when a command runs


def add_dump_args(p) -> None:
    p.add_argument("--target", required=True, help="target HF folder (or id)")
    p.add_argument("--data", required=True, help="`prepare-data` directory or .jsonl of {input_ids, loss_mask}")
    p.add_argument("--out", required=True, help="dump directory (resumed if it holds a partial dump)")
    p.add_argument("--aux-layer-ids", default=None,
                   help="comma-separated target layer ids (SGLang convention; default 1,L//2-1,L-4)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16", help="stored feature dtype")
    p.add_argument("--target-dtype", choices=["auto", *DTYPE_NAMES], default="auto",
                   help="dtype the target runs in (auto: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK if available, else cpu), cpu, cuda:N")
    p.add_argument("--rows-per-shard", type=int, default=256)
    p.add_argument("--batch-tokens", type=int, default=8192, help="padded tokens per target forward")
    p.add_argument("--max-rows", type=int, default=None, help="dump only the first N rows")
    p.add_argument("--rank", type=int, default=None, help="this process's rank (default $RANK or 0)")
    p.add_argument("--world-size", type=int, default=None, help="number of processes (default $WORLD_SIZE or 1)")
    p.add_argument("--reuse", action="append", default=[], metavar="DUMP",
                   help="a finished dump of the same target and settings: rows it holds (same token ids) are "
                        "copied instead of recomputed, so a grown dataset costs only its new rows (repeatable)")
    p.add_argument("--overwrite", action="store_true", help="delete the dump in --out first (its shards, config and "
                                                            "manifest; other files are kept; single process only)")
    p.add_argument("--no-disk-check", action="store_true", help="start even if the estimate exceeds free space")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def resolve_device(device: str):
    import torch
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")
    return torch.device(device)


def parse_layer_ids(text: Optional[str]) -> Optional[list[int]]:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"--aux-layer-ids must be comma-separated integers, got {text!r}") from None


def run_dump(args) -> int:
    import torch

    from sglang_eagle3.engine.settings import check_device
    from sglang_eagle3.models.target import TargetModel
    from sglang_eagle3.training.hidden_dump import (
        DTYPES,
        MANIFEST,
        DumpError,
        check_dump_args,
        dump_hidden_states,
        human_bytes,
        load_token_rows,
    )
    from sglang_eagle3.training.trainer.preflight import check_aux_layers, target_text_config
    rank = args.rank if args.rank is not None else int(os.environ.get("RANK", 0))
    world = args.world_size if args.world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
    check_apart({"--out": args.out}, {"--target": args.target})
    check_dump_args(args.out, args.rows_per_shard, args.batch_tokens, rank, world, args.overwrite, args.reuse,
                    args.data)
    check_at_least(1, flags_of(args, "max_rows"))
    device = resolve_device(check_device(args.device))
    aux = parse_layer_ids(args.aux_layer_ids)
    check_aux_layers(aux, target_text_config(args.target))
    tdtype = DTYPES[args.target_dtype] if args.target_dtype != "auto" else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    rows = load_token_rows(args.data, args.max_rows)
    target = TargetModel.from_pretrained(args.target, dtype=tdtype, device=device, aux_layer_ids=aux)
    bad = [i for i, (ids, _) in enumerate(rows) if ids.max() >= target.vocab_size]
    if bad:
        raise DumpError(f"{args.data}: row {bad[0]} has token id {int(rows[bad[0]][0].max())} >= the target's "
                        f"vocab_size {target.vocab_size} (tokenized for another target?)")
    manifest = dump_hidden_states(target, rows, args.out, source=args.data, rows_per_shard=args.rows_per_shard,
                                  batch_tokens=args.batch_tokens, dtype=DTYPES[args.dtype], rank=rank,
                                  world_size=world, overwrite=args.overwrite, check_disk=not args.no_disk_check,
                                  progress=not args.quiet, reuse=args.reuse)
    if manifest is not None:
        size = sum(s["bytes"] for s in manifest["shards"])
        print(f"dump: complete: {manifest['rows']} rows, {manifest['tokens']:,} tokens, "
              f"{len(manifest['shards'])} shards, {human_bytes(size)} -> {os.path.join(args.out, MANIFEST)}")
    return 0




# ---- training ----------------------------------------------------------------------------------
RESUMABLE = " (may change on --resume)"     # cadence and runtime flags; the others are the checkpoint's (run_folder)


def add_train_args(p) -> None:
    g = p.add_argument_group("data and model")
    g.add_argument("--target", required=True, help="target HF folder: its embedding and lm_head (frozen) are used; "
                   "the whole target runs only in online mode")
    g.add_argument("--data", required=True, help="a hidden-state dump (offline) or token rows: a prepare-data dir "
                   "or .jsonl of {input_ids, loss_mask} (online: the target computes features on the fly)")
    g.add_argument("--out", required=True, help="output dir: checkpoints/, metrics.jsonl, tensorboard/, draft/")
    g.add_argument("--eval-data", default=None, help="held-out data of the same kind (default: --eval-rows of --data)")
    g.add_argument("--eval-rows", type=int, default=None,
                   help="rows of --data held out for eval (default 64; not with --eval-data)")
    g.add_argument("--draft-vocab", default=None, help="draft_vocab.safetensors from `eagle3 build-vocab`")
    g.add_argument("--draft-vocab-size", type=int, default=None,
                   help="build a draft vocab of this size from the training rows (default: the full target vocab)")
    g.add_argument("--draft-config", default=None, help="draft config.json to take the shape from")
    g.add_argument("--init-from", default=None, help="a trained draft folder: start from its weights and vocabulary "
                   "with a fresh optimizer and schedule (spread a long training over several runs)")
    g.add_argument("--fc-norm", action="store_true", help="EAGLE-3.1: an RMSNorm per aux feature before fc")
    g.add_argument("--norm-output", action="store_true",
                   help="EAGLE-3.1: each later draft step reads the draft's final-normed output")
    g.add_argument("--aux-layer-ids", default=None, help="online mode: comma-separated target layer ids")
    g.add_argument("--features", choices=["fused", "top"], default="fused",
                   help="fused: EAGLE-3 low/mid/high features; top: only the last hidden state (ablation)")
    g.add_argument("--head-init", choices=["random", "target"], default="random",
                   help="the draft's lm_head and final norm: random (the authors', SpecForge's) or copied from the "
                        "target (its lm_head rows for the draft vocabulary, its final norm)")
    g.add_argument("--feature-loss-weight", type=float, default=0.0,
                   help="add w * smooth-L1(step-0 draft hidden, target last hidden) (EAGLE/HASS-style ablation)")
    g = p.add_argument_group("training-time test")
    g.add_argument("--target-temperature", type=float, default=1.0,
                   help="each step learns softmax(target logits / T) over the draft vocab: 1 (default) the target's "
                        "own distribution, as the references; < 1 sharper; 0 the target's greedy pick (hard labels)")
    g.add_argument("--ttt-length", type=int, default=7, help="unrolled draft steps (default 7)")
    g.add_argument("--step-decay", type=float, default=0.8, help="weight of step k is decay^k (default 0.8)")
    g.add_argument("--loss-mask-offset", type=int, choices=[0, 1], default=1,
                   help="step k at base position t is scored where loss_mask[t+k+OFFSET] is set: 1 (default) scores "
                        "exactly the chains the engine drafts; 0 is the EAGLE-3 authors' and SpecForge's convention")
    g.add_argument("--grow-chains", choices=["auto", "scored", "all"], default="auto",
                   help="steps >= 1 grow only the chains a later step scores (scored) or every chain (all); the "
                        "same loss and gradients, different speed. auto (default): all on CPUs with AMX, else scored" +
                        RESUMABLE)
    g.add_argument("--max-length", type=int, default=2048, help="tokens per row (longer rows are truncated)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--micro-batch-size", type=int, default=1, help="rows per rank per forward")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--pack-rows", action="store_true",
                   help="put a micro-batch's rows end to end in one sequence instead of padding them: attention and "
                        "draft chains stay inside each row and each row's loss is averaged over its own positions, so "
                        "--micro-batch-size R --pack-rows trains exactly like --grad-accum R, with R-times larger "
                        "matrix products (faster on CPU); a resume may switch between the two")
    g.add_argument("--epochs", type=float, default=1.0)
    g.add_argument("--max-steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    g.add_argument("--lr", type=float, default=5e-5)
    g.add_argument("--warmup-ratio", type=float, default=0.02, help="linear warm-up share of the steps")
    g.add_argument("--min-lr-ratio", type=float, default=0.0, help="cosine decays to lr * this")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--grad-clip", type=float, default=0.5)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--data-start-step", type=int, default=0,
                   help="start reading the (seeded) data order at this step: continue where an earlier run on the "
                        "same data, seed and rows per step stopped (e.g. with --init-from its draft)")
    g = p.add_argument_group("runtime")
    g.add_argument("--backend", choices=["auto", "deepspeed", "ddp"], default="auto",
                   help="auto: DeepSpeed if importable, else PyTorch DDP")
    g.add_argument("--deepspeed-config", default=None, help="train/ds_zero{1,2,3}.json (ZeRO settings)")
    g.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None,
                   help="ZeRO stage (overrides the config file; default 2)")
    g.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="compute dtype; bfloat16 = autocast over fp32 master weights. auto: bfloat16 on GPUs and on "
                        "CPUs with AVX-512 BF16 or AMX, else float32" + RESUMABLE)
    g.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK if available), cpu" + RESUMABLE)
    g.add_argument("--eval-every", type=int, default=500, help="evaluate every N steps" + RESUMABLE)
    g.add_argument("--save-every", type=int, default=500,
                   help="checkpoint every N steps and at the end (0: only at the end)" + RESUMABLE)
    g.add_argument("--log-every", type=int, default=10, help="log the training metrics every N steps" + RESUMABLE)
    g.add_argument("--keep-checkpoints", type=int, default=2, help="newest checkpoints kept" + RESUMABLE)
    g.add_argument("--keep-every", type=int, default=0, help="also keep every checkpoint at a multiple of this step "
                   "(for learning curves: bench/learning_curve.py)" + RESUMABLE)
    g.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints/latest if present; every "
                   "flag that sets the data order, loss, draft or schedule must be the checkpoint's (a changed one is "
                   "refused, naming it); only those marked 'may change on --resume' may differ")
    g.add_argument("--no-disk-check", action="store_true",
                   help="start even if --out lacks room for the checkpoints the run keeps and its draft")
    g.add_argument("--overwrite", action="store_true", help="OUT holds an earlier run: delete its checkpoints, "
                   "metrics and draft and start again")
    g.add_argument("--check-only", action="store_true", help="check every input as the run will (target, data rows and "
                   "the held-out split for $WORLD_SIZE ranks, draft vocabulary, --init-from, run folder, resume, free "
                   "space) and exit: what `make train` runs before launching workers")
    g.add_argument("--verify-dumps", choices=["sha256", "size", "none"], default="sha256", help="how a dump's shards "
                   "are checked when the run opens them" + RESUMABLE)
    g.add_argument("--no-tensorboard", action="store_true", help="no TensorBoard logs" + RESUMABLE)
    g.add_argument("--quiet", action="store_true", help="no progress bar" + RESUMABLE)
    g.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher


def train_config(args):
    from sglang_eagle3.training.trainer.run_config import TrainConfig
    check_at_least(1, flags_of(args, "micro_batch_size", "grad_accum", "ttt_length", "max_length", "log_every",
                               "eval_every", "keep_checkpoints"))
    check_at_least(0, flags_of(args, "save_every", "keep_every", "weight_decay", "feature_loss_weight"))
    checks = [("--lr", args.lr, args.lr > 0, "> 0"),
              ("--warmup-ratio", args.warmup_ratio, 0 <= args.warmup_ratio < 1, "in [0, 1)"),
              ("--min-lr-ratio", args.min_lr_ratio, 0 <= args.min_lr_ratio <= 1, "in [0, 1]"),
              ("--step-decay", args.step_decay, args.step_decay > 0, "> 0"),
              ("--target-temperature", args.target_temperature, args.target_temperature >= 0, ">= 0"),
              ("--grad-clip", args.grad_clip, args.grad_clip > 0, "> 0"),
              ("--epochs", args.epochs, args.epochs > 0, "> 0"),
              ("--eval-rows", args.eval_rows, args.eval_rows is None or args.eval_rows >= 0, ">= 0"),
              ("--max-steps", args.max_steps, args.max_steps is None or args.max_steps >= 1, ">= 1"),
              ("--data-start-step", args.data_start_step, args.data_start_step >= 0, ">= 0")]
    for flag, value, ok, rule in checks:
        if not ok:
            raise UserError(f"{flag} must be {rule}, got {value}")
    check_train_flags_agree(args)
    return TrainConfig(
        target=args.target, data=args.data, out=args.out, eval_data=args.eval_data,
        eval_rows=64 if args.eval_rows is None else args.eval_rows,
        draft_vocab=args.draft_vocab, draft_vocab_size=args.draft_vocab_size, draft_config=args.draft_config,
        aux_layer_ids=parse_layer_ids(args.aux_layer_ids), features=args.features, init_from=args.init_from,
        fc_norm=args.fc_norm, norm_output=args.norm_output, loss_mask_offset=args.loss_mask_offset,
        grow_chains=args.grow_chains,
        overwrite=args.overwrite,
        feature_loss_weight=args.feature_loss_weight, target_temperature=args.target_temperature,
        head_init=args.head_init, ttt_length=args.ttt_length, step_decay=args.step_decay,
        max_length=args.max_length, micro_batch_size=args.micro_batch_size, grad_accum=args.grad_accum,
        pack_rows=args.pack_rows,
        epochs=args.epochs, max_steps=args.max_steps, lr=args.lr, warmup_ratio=args.warmup_ratio,
        min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
        backend=args.backend, zero_stage=args.zero_stage, deepspeed_config=args.deepspeed_config,
        dtype=args.dtype, device=args.device, eval_every=args.eval_every, save_every=args.save_every,
        log_every=args.log_every, keep_checkpoints=args.keep_checkpoints, keep_every=args.keep_every,
        resume=args.resume, seed=args.seed,
        data_start_step=args.data_start_step,
        verify_dumps=args.verify_dumps, check_disk=not args.no_disk_check, tensorboard=not args.no_tensorboard,
        progress=not args.quiet)


def check_train_flags_agree(args) -> None:
    """Two flags one of which the run would silently ignore: refused, naming both."""
    if args.eval_data and args.eval_rows is not None:
        raise UserError(f"--eval-rows {args.eval_rows} holds rows of --data out for eval, but --eval-data "
                        f"{args.eval_data} is the eval set: give one of them")
    if args.keep_every and (not args.save_every or args.keep_every % args.save_every):
        raise UserError(f"--keep-every {args.keep_every} keeps the checkpoints at its multiples, but --save-every "
                        f"{args.save_every} writes {'only the last one' if not args.save_every else 'none at some'}: "
                        "give a multiple of --save-every")
    if args.init_from and args.head_init == "target":
        raise UserError(f"--head-init target starts a new draft's output head from the target's, but --init-from "
                        f"{args.init_from} starts from that draft's trained weights: give one of them")


def run_train(args) -> int:
    from sglang_eagle3.training.trainer.preflight import check_inputs
    cfg = train_config(args)
    with value_errors_as_user_errors():
        check_inputs(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    if args.check_only:
        print(f"train: inputs ok ({cfg.data} -> {cfg.out})")
        return 0
    from sglang_eagle3.training.trainer.loop import Trainer
    with value_errors_as_user_errors():
        Trainer(cfg).run()
    return 0


@contextlib.contextmanager
def value_errors_as_user_errors():
    """Bad shapes / sizes found while setting up (a ValueError naming the input): one line, no traceback."""
    try:
        yield
    except ValueError as e:
        if isinstance(e, UserError):
            raise
        raise UserError(str(e)) from None


def add_cli(sub) -> None:
    p = sub.add_parser("dump-hidden-states", help="run the target over a tokenized dataset and store draft features")
    add_dump_args(p)
    p.set_defaults(func=run_dump)
    p = sub.add_parser("train", help="train an EAGLE-3 draft (training-time test; DeepSpeed or DDP)")
    add_train_args(p)
    p.set_defaults(func=run_train)
    p = sub.add_parser("remap-vocab", help="move a trained draft to another draft vocabulary (no training)",
                       description="Shared tokens keep their trained output rows; a new token's row is an affine "
                       "map of the target's row, fitted on the shared tokens. Other weights are copied.")
    p.add_argument("--draft", required=True, help="trained draft folder")
    p.add_argument("--draft-vocab", required=True, help="draft_vocab.safetensors (prepare-data or train writes it)")
    p.add_argument("--target", required=True, help="the draft's target (its output rows seed new tokens)")
    p.add_argument("--out", required=True, help="new draft folder (must not exist)")
    p.set_defaults(func=run_remap_vocab)


def run_remap_vocab(args) -> int:
    from sglang_eagle3.training.trainer.draft_init import remap_vocab
    check_apart({"--out": args.out}, {"--draft": args.draft, "--draft-vocab": args.draft_vocab,
                                      "--target": args.target})
    with value_errors_as_user_errors():
        print(f"wrote {remap_vocab(args.draft, args.draft_vocab, args.target, args.out)}")
    return 0
