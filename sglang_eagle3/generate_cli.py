"""`eagle3 generate` and `eagle3 init-draft`: the engine's command-line contract."""
from __future__ import annotations

import json
import os
import sys

import torch

from .cli import UserError
from .config import Eagle3Config, SpecConfig
from .prompts import load_prompts
from .testbed import resolve_target

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ["auto", *DTYPES]
AUTO_DTYPE_HELP = ("auto (default): bfloat16 on GPUs and on CPUs where the engine has a bf16 kernel (AVX-512 BF16, "
                   "AMX, or AVX2 + FMA with the C++ extension built), else float32")


def resolve_dtype(name: str, device: str = "cpu") -> str:
    """--dtype auto: bfloat16 on GPUs and on CPUs where our engine computes bf16 products fast: natively (AVX-512
    BF16, AMX) or with csrc's AVX2 kernel (bf16 weights widened to fp32 in registers: decode reads half the
    bytes). float32 elsewhere: PyTorch's emulated bf16 products run 3-100x slower than fp32 there."""
    if name != "auto":
        return name
    if str(device).startswith("cuda"):
        return "bfloat16"
    from . import kernels
    fast = kernels.cpu_has_bf16() or (kernels.mode() != "off" and kernels.few_row_isa() == "avx2")
    return "bfloat16" if fast else "float32"


def shipped_draft() -> str | None:
    """The draft shipped in the repo for the embedded target, if present."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "checkpoints", "smollm2-135m-eagle3")
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def load_engine(target: str | None, draft: str | None, spec: SpecConfig, dtype: str = "float32", device: str = "cpu",
                profile=None):
    from .engine import SpeculativeEngine
    from .target import TargetModel
    dtype = resolve_dtype(dtype, device)
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPE_CHOICES)}")
    target_path = resolve_target(target)
    draft_model = load_draft(draft, DTYPES[dtype], device) if draft and draft != "none" else None
    aux = draft_model.config.aux_layer_ids if draft_model is not None else None
    tm = TargetModel.from_pretrained(target_path, dtype=DTYPES[dtype], device=device, aux_layer_ids=aux)
    return SpeculativeEngine(tm, draft_model, spec, profile)


def load_draft(path: str, dtype, device="cpu"):
    """A draft folder for the engine; unreadable files and invalid configs become one-line errors."""
    from .draft import CheckpointError, Eagle3DraftModel
    from .formats import files
    if not os.path.isdir(path):
        raise UserError(f"--draft {path}: no such folder")
    for name in files.weight_files(path):             # a damaged file: the same message check-draft gives
        if name.endswith(".safetensors"):
            files.read_weights(path)
            break
    try:
        return Eagle3DraftModel.from_pretrained(path, dtype=dtype, device=device)
    except (TypeError, ValueError, KeyError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise UserError(f"--draft {path}: config.json is not a valid EAGLE-3 draft config ({type(e).__name__}: "
                        f"{e})") from None


def add_compile_arg(p) -> None:
    p.add_argument("--compile", choices=["auto", "off"], default="auto",
                   help="auto (default): the compiled CPU path (oneDNN-prepacked bf16 linears, the C++ attention and "
                        "norm kernels built at install); off: plain eager PyTorch (the reference)")


def apply_compile_arg(args) -> None:
    from . import kernels
    kernels.set_mode(getattr(args, "compile", "auto") or "auto")


def add_spec_args(p) -> None:
    g = p.add_argument_group("draft tree (SGLang semantics; default: the draft folder's spec_profile.json, the shapes "
                             "tuned for this CPU by bench/tune_spec.py, else 5/4/16 as SGLang)")
    g.add_argument("--num-steps", type=int, default=None, help="tree depth")
    g.add_argument("--topk", type=int, default=None, help="branching per step")
    g.add_argument("--num-draft-tokens", type=int, default=None, help="tokens verified per step incl. the root")


def draft_profile(draft: str | None, device: str = "cpu"):
    """The speculation profile stored with a draft (spec_profile.json), or None; its table for this kind of host
    where it has one (config.host_kind(device))."""
    from .config import ConfigError, SpecProfile, draft_profile_path, host_kind
    path = draft_profile_path(draft)
    if path is None:
        return None
    try:
        return SpecProfile.load(path, host=host_kind(device))
    except ConfigError as e:
        raise UserError(str(e)) from None


def resolve_spec(a, draft: str | None, batch_size: int = 1):
    """(tree, profile, where it came from): explicit --num-steps/--topk/--num-draft-tokens win; otherwise the
    draft's tuned profile (its tree for `batch_size`, and the whole profile for an engine that adapts to its running
    batch size); otherwise SGLang's default 5/4/16. A flag given alone fills in the rest from that base."""
    explicit = {k: getattr(a, k) for k in ("num_steps", "topk", "num_draft_tokens") if getattr(a, k, None) is not None}
    profile = None if explicit else draft_profile(draft, getattr(a, "device", None) or "cpu")
    base, source = SpecConfig(), "default tree"
    if profile is not None:
        sampled = (getattr(a, "temperature", None) or 0) > 0 and profile.sampled is not None
        tuned, measured = profile.for_batch_size(batch_size, sampled), profile.measured_tree(batch_size, sampled)
        source = f"{profile.source} ({'sampled, ' if sampled else ''}batch {batch_size}: " + (
            "tuned" if tuned is not None else "vanilla measured faster; its fastest tree" if measured is not None
            else "no speculation; default tree") + ")"
        base = measured or base
    if explicit:
        source = "flags"
    try:
        spec = SpecConfig(**{"num_steps": base.num_steps, "topk": base.topk,
                             "num_draft_tokens": base.num_draft_tokens, **explicit})
    except ValueError as e:
        raise UserError(str(e)) from None
    for k in ("num_steps", "topk", "num_draft_tokens"):
        setattr(a, k, getattr(spec, k))                   # what ran is what gets recorded
    return spec, profile, source


def add_cli(sub) -> None:
    p = sub.add_parser("generate", help="generate with the embedded engine (speculative or vanilla)")
    p.add_argument("--target", default="testbed", help="HF folder or hub id (default: the embedded SmolLM2)")
    p.add_argument("--draft", default=None, help="EAGLE-3 draft folder, or 'none' for vanilla decoding "
                                                 "(default: the shipped draft for the embedded target, else none)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts-file", help="jsonl: eval rows (turns), ShareGPT rows (conversations), or {prompt}")
    p.add_argument("--chat", action="store_true", help="wrap prompts as a user turn through the chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--batch-size", type=int, default=1, help="requests decoded together (continuous batching)")
    p.add_argument("--truncate-prompt", action="store_true",
                   help="drop the oldest prompt tokens when prompt + max_new_tokens exceeds the target's context "
                        "(default: refuse such a prompt)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts of the file")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--json", action="store_true", help="print one JSON object with outputs and stats")
    add_spec_args(p)
    add_compile_arg(p)
    p.set_defaults(func=run_generate)

    q = sub.add_parser("init-draft", help="write a randomly initialised EAGLE-3 draft for a target")
    q.add_argument("--target", default="testbed")
    q.add_argument("--out", required=True)
    q.add_argument("--draft-vocab-size", type=int, default=None, help="default: the target's vocab size")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    q.add_argument("--force", action="store_true", help="replace a non-empty --out")
    q.set_defaults(func=run_init_draft)


def run_generate(a) -> int:
    from .verify import SamplingParams
    apply_compile_arg(a)
    if a.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {a.batch_size}")
    try:
        params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
                                top_k=a.top_k, stop=a.stop, ignore_eos=a.ignore_eos, seed=a.seed)
    except ValueError as e:
        raise UserError(str(e)) from None
    if a.prompt is not None and not a.prompt.strip():
        raise UserError("--prompt is empty")
    prompts = [a.prompt] if a.prompt is not None else [t[0] for t in load_prompts(a.prompts_file, limit=a.limit)]
    if a.chat:
        prompts = [[{"role": "user", "content": p}] for p in prompts]
    embedded = getattr(a, "embedded_target", False) or a.target in (None, "testbed")
    draft = a.draft if a.draft is not None else (shipped_draft() if embedded else None)
    spec, profile, source = resolve_spec(a, draft, a.batch_size)
    engine = load_engine(a.target, draft, spec, a.dtype)
    engine.profile = profile                              # tuned shapes follow the running batch size
    outputs, stats = engine.generate(prompts, params, batch_size=a.batch_size, truncate=a.truncate_prompt)
    if a.json:
        json.dump({"outputs": [{"prompt": o.prompt, "text": o.text, "token_ids": o.token_ids,
                                "finish_reason": o.finish_reason, "accept_length": o.accept_length}
                               for o in outputs],
                   "stats": stats.as_dict(), "draft": draft or "none",
                   "tree": {"num_steps": spec.num_steps, "topk": spec.topk, "num_draft_tokens": spec.num_draft_tokens,
                            "source": source, "adaptive": profile is not None}}, sys.stdout)
        print()
        return 0
    for o in outputs:
        shown = o.prompt if isinstance(o.prompt, str) else o.prompt[-1]["content"]
        print(f">>> {shown}\n{o.text}\n[{len(o.token_ids)} tokens, {o.finish_reason}, accept length {o.accept_length:.2f}]\n")
    print(f"draft: {draft or 'none (vanilla)'} | tokens: {stats.generated_tokens} | verify steps: {stats.verify_steps} | "
          f"accept length: {stats.accept_length:.2f} | {stats.tokens_per_s:.1f} tok/s | "
          f"draft {stats.draft_time:.2f}s verify {stats.verify_time:.2f}s prefill {stats.prefill_time:.2f}s")
    return 0


def run_init_draft(a) -> int:
    from transformers import AutoConfig
    from .draft import Eagle3DraftModel
    if a.draft_vocab_size is not None and a.draft_vocab_size < 1:
        raise UserError(f"--draft-vocab-size must be >= 1, got {a.draft_vocab_size}")
    if os.path.isdir(a.out) and os.listdir(a.out) and not a.force:
        raise UserError(f"--out {a.out} is not empty (it may hold a trained draft); pass --force to replace its weights")
    target_cfg = AutoConfig.from_pretrained(resolve_target(a.target))
    cfg = Eagle3Config.for_target(target_cfg, draft_vocab_size=a.draft_vocab_size)
    if a.force and os.path.isdir(a.out):
        import shutil
        shutil.rmtree(a.out)                    # nothing of the old draft (README, plots) may describe the new one
    torch.manual_seed(a.seed)
    model = Eagle3DraftModel(cfg)
    # An untrained draft's vocabulary: the lowest target ids (BPE vocabularies put frequent tokens first).
    model.set_vocab_mapping(torch.arange(cfg.draft_vocab_size))
    model.save_pretrained(a.out, dtype=DTYPES[a.dtype])
    print(a.out)
    return 0
