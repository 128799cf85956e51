"""`make demo`: speculative decoding on the embedded target, vanilla alongside, text plus stats."""
from __future__ import annotations

import argparse
import os
import time

import torch

from sglang_eagle3.engine.engine import SpeculativeEngine
from sglang_eagle3.engine.loader import load_engine
from sglang_eagle3.engine.prompts import load_prompts
from sglang_eagle3.engine.settings import (
    Settings,
    add_compile_arg,
    add_dtype_arg,
    add_spec_args,
    apply_compile_arg,
    settings_from_args,
)
from sglang_eagle3.engine.verify import SamplingParams
from sglang_eagle3.errors import check_at_least
from sglang_eagle3.kernels import extension
from sglang_eagle3.models.testbed import resolve_target
from sglang_eagle3.paths import data_dir, shipped_draft

FALLBACK_PROMPTS = ["Give me three tips for staying focused while studying.",
                    "Write a short poem about autumn leaves.",
                    "Explain what a hash table is in two sentences."]


def main(argv=None) -> int:
    from sglang_eagle3.bench import run_cli
    return run_cli("demo", run, argv)


def random_draft() -> str:
    """An untrained draft for the embedded target (made once), where no trained one is shipped."""
    from sglang_eagle3.models.cli import init_draft
    path = os.path.join(os.path.dirname(resolve_target(None)), "random-draft")
    if not os.path.isdir(path):
        init_draft("testbed", path, draft_vocab_size=8192)
    return path


def median_run(runs: list) -> tuple:
    """The (outputs, stats) of the round with the median tokens/s (the upper middle one of an even count)."""
    return sorted(runs, key=lambda r: r[1].tokens_per_s)[len(runs) // 2]


def run(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", default=data_dir())
    ap.add_argument("--n", type=int, default=3, help="MT-bench prompts to run")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per engine, alternated (default 3)")
    add_dtype_arg(ap)
    ap.add_argument("--draft", default=None, help="default: the shipped draft, else a random one (untrained)")
    add_spec_args(ap)
    add_compile_arg(ap)
    ap.set_defaults(target="testbed")                   # the embedded target, always
    a = ap.parse_args(argv)
    check_at_least(1, {"--n": a.n, "--max-new-tokens": a.max_new_tokens, "--rounds": a.rounds})
    apply_compile_arg(a)
    t0 = time.perf_counter()
    ext = extension.load()
    ext_s = time.perf_counter() - t0

    mt = os.path.join(a.data, "eval", "mt_bench.jsonl")
    if os.path.isfile(mt):
        prompts = [t[0] for t in load_prompts(mt, limit=a.n)]
    else:
        prompts = FALLBACK_PROMPTS[:a.n]
        print(f"note: {mt} not found (DATA={a.data}): using {len(prompts)} built-in prompts instead of MT-bench\n")
    chats = [[{"role": "user", "content": p}] for p in prompts]
    params = SamplingParams(max_new_tokens=a.max_new_tokens)
    draft, note = a.draft, ""
    if draft is None and shipped_draft() is None and a.drafter != "suffix":     # suffix: no draft model to stand in
        draft, note = random_draft(), " (no trained draft shipped: a RANDOM draft, so expect accept length ~1)"
    settings = settings_from_args(a, draft, batch_size=len(chats))
    spec_engine = load_engine(a.target, settings)
    vanilla = SpeculativeEngine(spec_engine.target, None, Settings(settings.dtype))
    few = extension.status()["few_row_kernel"]
    linears = {"amx": "AMX tile", "avx512_bf16": "AVX-512 BF16",
               "avx512f": "AVX-512F (bf16 weights widened in registers)",
               "avx2": "AVX2 + FMA (bf16 weights widened in registers)"}
    runtime = (f"compiled CPU path: {linears.get(few, 'oneDNN')} bf16 linears + C++ attention/norm kernels "
               f"(extension loaded in {ext_s:.1f} s; built once at install)" if ext is not None else
               "eager PyTorch" + (f" (C++ extension unavailable: {extension.status()['extension_error']})"
                                  if a.compile == "auto" else " (--compile off)"))
    shown = settings.draft or ("none (the context drafts)" if settings.speculates else "none")
    print(f"target: {resolve_target(None)}\ndraft:  {shown}{note}\ntree:   {settings.describe()}\n"
          f"dtype:  {settings.dtype}, threads: {torch.get_num_threads()}\nengine: {runtime}\n")
    # warm-up, not timed: first calls allocate the KV pools, and with --tree auto the first run on a machine measures
    # its step costs (a few seconds, cached after), which the comparison must not count
    print("warming up (the first run on a machine also measures its step costs for --tree auto; cached after)\n",
          flush=True)
    warm = SamplingParams(max_new_tokens=4)
    vanilla.generate(chats, warm)
    spec_engine.generate(chats, warm)
    # rounds alternate which engine goes first; each engine's median round is printed (one round of a few seconds
    # moves by 10-15% on a 2-core machine)
    runs = {"vanilla": [], "speculative": []}
    for r in range(a.rounds):
        order = (("vanilla", vanilla), ("speculative", spec_engine))
        for name, engine in (order if r % 2 == 0 else order[::-1]):
            runs[name].append(engine.generate(chats, params))
    (van_out, van), (spec_out, spec_stats) = (median_run(runs[k]) for k in ("vanilla", "speculative"))
    for p, o, v in zip(prompts, spec_out, van_out):
        same = "identical to vanilla" if o.token_ids == v.token_ids else "DIFFERS from vanilla (bf16 near-tie)"
        print(f">>> {p}\n{o.text}\n[{len(o.token_ids)} tokens, accept length {o.accept_length:.2f}, {same}]\n")
    print(f"{'':12}{'tokens':>8}{'steps':>8}{'accept len':>12}{'tok/s':>9}   (the median of {a.rounds} rounds; each "
          "round's tok/s)")
    for name, st in (("vanilla", van), ("speculative", spec_stats)):
        each = " ".join(f"{x.tokens_per_s:.0f}" for _, x in runs[name])
        print(f"{name:12}{st.generated_tokens:>8}{st.verify_steps:>8}{st.accept_length:>12.2f}"
              f"{st.tokens_per_s:>9.1f}   ({each})")
    print(f"speed-up: {spec_stats.tokens_per_s / van.tokens_per_s:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
