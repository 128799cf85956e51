"""`eagle3 generate`: the engine's command-line contract (prompts in, text and statistics out)."""
from __future__ import annotations

import json
import sys

from sglang_eagle3.engine.loader import load_engine
from sglang_eagle3.engine.prompts import load_prompts
from sglang_eagle3.engine.settings import (
    add_compile_arg,
    add_dtype_arg,
    add_spec_args,
    apply_compile_arg,
    settings_from_args,
)
from sglang_eagle3.engine.verify import SamplingParams
from sglang_eagle3.errors import UserError, check_at_least, flags_of


def add_cli(sub) -> None:
    p = sub.add_parser("generate", help="generate with the embedded engine (speculative or vanilla)")
    p.add_argument("--target", default="testbed", help="HF folder or hub id (default: the embedded SmolLM2)")
    p.add_argument("--draft", default=None, help="EAGLE-3 draft folder, or 'none' for vanilla decoding "
                                                 "(default: the shipped draft for the embedded target, else none)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts-file", help="jsonl: eval rows (turns), ShareGPT rows (conversations), or {prompt}")
    p.add_argument("--chat", action="store_true", help="wrap prompts as a user turn through the chat template; a row "
                                                       "with several turns is decoded as a conversation (each turn "
                                                       "asked after the model's own previous answers, as MT-bench)")
    p.add_argument("--first-turn-only", action="store_true", help="decode only the first turn of multi-turn rows")
    p.add_argument("--max-new-tokens", type=int, default=128, help="per turn")
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
    add_dtype_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object with outputs and stats")
    add_spec_args(p)
    add_compile_arg(p)
    p.set_defaults(func=run_generate)


def check_args(a) -> SamplingParams:
    """Every flag, before any file or model is read."""
    check_at_least(1, flags_of(a, "batch_size", "limit"))
    if a.prompt is not None and not a.prompt.strip():
        raise UserError("--prompt is empty")
    if a.prompt is not None:
        given = [flag for flag, v in (("--limit", a.limit is not None), ("--first-turn-only", a.first_turn_only)) if v]
        if given:
            raise UserError(f"{given[0]} applies to the rows of --prompts-file, not to one --prompt")
    return SamplingParams.from_flags(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
                                     top_k=a.top_k, stop=a.stop, ignore_eos=a.ignore_eos, seed=a.seed)


def conversations(a) -> list[list[str]]:
    """The user turns of each prompt; multi-turn rows need --chat (they are conversations) or --first-turn-only."""
    if a.prompt is not None:
        return [[a.prompt]]
    rows = load_prompts(a.prompts_file, limit=a.limit)
    if a.first_turn_only:
        return [turns[:1] for turns in rows]
    multi = next((i for i, turns in enumerate(rows) if len(turns) > 1), None)
    if multi is not None and not a.chat:
        raise UserError(f"--prompts-file {a.prompts_file}: row {multi + 1} has {len(rows[multi])} turns; decode them "
                        "as a conversation with --chat, or pass --first-turn-only")
    return rows


def decode_conversations(engine, rows: list[list[str]], params: SamplingParams, a) -> tuple[list[dict], object]:
    """Turn k of every row in one batch, asked after the row's own answers to turns 0..k-1."""
    outputs, stats = [], None
    history: list[list[dict]] = [[] for _ in rows]
    for k in range(max(len(t) for t in rows)):
        active = [i for i, turns in enumerate(rows) if k < len(turns)]
        if a.chat:
            prompts = [history[i] + [{"role": "user", "content": rows[i][k]}] for i in active]
        else:
            prompts = [rows[i][k] for i in active]
        outs, st = engine.generate(prompts, params, batch_size=a.batch_size, truncate=a.truncate_prompt)
        if stats is None:
            stats = st
        else:
            stats.add(st)
        for i, prompt, o in zip(active, prompts, outs):
            if a.chat:
                history[i] = prompt + [{"role": "assistant", "content": o.text}]
            outputs.append({"row": i, "turn": k, "prompt": o.prompt, "text": o.text, "token_ids": o.token_ids,
                            "finish_reason": o.finish_reason, "accept_length": o.accept_length})
    outputs.sort(key=lambda o: (o["row"], o["turn"]))
    return outputs, stats


def run_generate(a) -> int:
    params = check_args(a)
    apply_compile_arg(a)
    rows = conversations(a)
    settings = settings_from_args(a, a.draft, batch_size=a.batch_size, temperature=a.temperature)
    engine = load_engine(a.target, settings)
    outputs, stats = decode_conversations(engine, rows, params, a)
    tree = settings.step_tree                  # with --tree auto: its size is the most a step verifies
    d = settings.drafting
    drafting = {"drafter": d.drafter, "tree": d.tree, **({"max_nodes": d.max_nodes} if d.tree == "auto" else {}),
                "children": d.children, "calibration": list(settings.calibration.logit_scale)
                if settings.calibration is not None else None} if settings.speculates else None
    if a.json:
        json.dump({"outputs": outputs, "stats": stats.as_dict(), "draft": settings.draft or "none",
                   "dtype": settings.dtype, "source": settings.source, "drafting": drafting,
                   "tree": None if tree is None else
                   {"num_steps": tree.num_steps, "topk": tree.topk, "num_draft_tokens": tree.num_draft_tokens,
                    "source": settings.source, "adaptive": settings.profile is not None}}, sys.stdout)
        print()
        return 0
    for o in outputs:
        shown = o["prompt"] if isinstance(o["prompt"], str) else o["prompt"][-1]["content"]
        print(f">>> {shown}\n{o['text']}\n[{len(o['token_ids'])} tokens, {o['finish_reason']}, "
              f"accept length {o['accept_length']:.2f}]\n")
    draft = settings.draft or ("none" if settings.speculates else "none (vanilla)")     # suffix: the context drafts
    print(f"draft: {draft} | {settings.describe()} | {settings.dtype} | "
          f"tokens: {stats.generated_tokens} | verify steps: {stats.verify_steps} | "
          f"accept length: {stats.accept_length:.2f} | {stats.tokens_per_s:.1f} tok/s | "
          f"draft {stats.draft_time:.2f}s verify {stats.verify_time:.2f}s prefill {stats.prefill_time:.2f}s" +
          (f" | step costs measured in {stats.cost_measure_s:.1f}s (once per machine, not counted above)"
           if stats.cost_measure_s else ""))
    return 0
