"""`make demo`: speculative decoding on the embedded target, vanilla alongside, text plus stats."""
from __future__ import annotations

import argparse
import os

import torch

from . import kernels
from .generate_cli import AUTO_DTYPE_HELP, DTYPE_CHOICES, add_compile_arg, add_spec_args, apply_compile_arg, load_engine, resolve_dtype, resolve_spec, resolve_target, shipped_draft
from .prompts import data_dir, load_prompts
from .verify import SamplingParams

FALLBACK_PROMPTS = ["Give me three tips for staying focused while studying.",
                    "Write a short poem about autumn leaves.",
                    "Explain what a hash table is in two sentences."]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", default=data_dir())
    ap.add_argument("--n", type=int, default=3, help="MT-bench prompts to run")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=AUTO_DTYPE_HELP)
    ap.add_argument("--draft", default=None, help="default: the shipped draft, else a random one (untrained)")
    add_spec_args(ap)
    add_compile_arg(ap)
    a = ap.parse_args(argv)
    a.dtype = resolve_dtype(a.dtype)
    apply_compile_arg(a)
    import time as _time
    t0 = _time.perf_counter()
    ext = kernels.extension()
    ext_s = _time.perf_counter() - t0

    mt = os.path.join(a.data, "eval", "mt_bench.jsonl")
    if os.path.isfile(mt):
        prompts = [t[0] for t in load_prompts(mt, limit=a.n)]
    else:
        prompts = FALLBACK_PROMPTS[:a.n]
        print(f"note: {mt} not found (DATA={a.data}): using {len(prompts)} built-in prompts instead of MT-bench\n")
    draft, note = a.draft or shipped_draft(), ""
    if draft is None:
        from .cli import main as cli_main
        draft = os.path.join(os.path.dirname(resolve_target(None)), "random-draft")
        if not os.path.isdir(draft):
            cli_main(["init-draft", "--out", draft, "--seed", "0", "--draft-vocab-size", "8192"])
        note = " (no trained draft shipped yet: a RANDOM draft, so expect accept length ~1)"
    chats = [[{"role": "user", "content": p}] for p in prompts]
    params = SamplingParams(max_new_tokens=a.max_new_tokens)
    spec, profile, source = resolve_spec(a, draft, len(chats))
    spec_engine = load_engine(None, draft, spec, a.dtype)
    spec_engine.profile = profile                 # the tuned shape for each running batch size
    vanilla = load_engine(None, "none", spec, a.dtype)
    few = kernels.status()["few_row_kernel"]
    linears = {"amx": "AMX tile", "avx512_bf16": "AVX-512 BF16", "avx2": "AVX2 + FMA (bf16 weights widened in registers)"}
    runtime = (f"compiled CPU path: {linears.get(few, 'oneDNN')} bf16 linears + C++ attention/norm kernels "
               f"(extension loaded in {ext_s:.1f} s; built once at install)" if ext is not None else
               "eager PyTorch" + (f" (C++ extension unavailable: {kernels.status()['extension_error']})"
                                  if a.compile == "auto" else " (--compile off)"))
    print(f"target: {resolve_target(None)}\ndraft:  {draft}{note}\ntree:   num_steps={spec.num_steps} topk={spec.topk} "
          f"num_draft_tokens={spec.num_draft_tokens} at batch {len(chats)} (from {source})\ndtype:  {a.dtype}, threads: {torch.get_num_threads()}\n"
          f"engine: {runtime}\n")
    van_out, van = vanilla.generate(chats, params)
    spec_out, spec_stats = spec_engine.generate(chats, params)
    for p, o, v in zip(prompts, spec_out, van_out):
        same = "identical to vanilla" if o.token_ids == v.token_ids else "DIFFERS from vanilla (bf16 near-tie)"
        print(f">>> {p}\n{o.text}\n[{len(o.token_ids)} tokens, accept length {o.accept_length:.2f}, {same}]\n")
    print(f"{'':12}{'tokens':>8}{'steps':>8}{'accept len':>12}{'tok/s':>9}")
    for name, st in (("vanilla", van), ("speculative", spec_stats)):
        print(f"{name:12}{st.generated_tokens:>8}{st.verify_steps:>8}{st.accept_length:>12.2f}{st.tokens_per_s:>9.1f}")
    print(f"speed-up: {spec_stats.tokens_per_s / van.tokens_per_s:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
