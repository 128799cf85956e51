"""llama.cpp with and without our draft, beside our engine (bench/bench_llamacpp.py; a row of bench_decode).

Uses the pinned build (`make llamacpp`) and GGUFs written by `eagle3 export --format gguf` (cached per draft).
llama-speculative-simple is run greedy (--temp 0) on each prompt's chat-template text with --spec-type
draft-eagle3 and a draft length; its own report gives the drafted and accepted counts and the decode speed.
For the same draft, prompts and chain length our engine runs a chain (topk 1, num_steps = draft length)
and reports τ and its speed-up, so the two engines are compared on equal terms.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from typing import Optional

from sglang_eagle3.bench import report
from sglang_eagle3.formats import llamacpp


def gguf_dir(draft: Optional[str]) -> str:
    from sglang_eagle3.paths import cache_dir
    name = os.path.basename(os.path.normpath(draft)) if draft else "no-draft"
    return os.path.join(cache_dir(), "gguf", name)


def ensure_ggufs(target: str, draft: Optional[str]) -> tuple[str, Optional[str]]:
    """(target.gguf, draft.gguf) for these folders, converted once (the draft again when it changed)."""
    from sglang_eagle3.formats.gguf import convert, export_gguf
    out = gguf_dir(draft)
    tfile = os.path.join(out, "target.gguf")
    if draft is None:
        if not os.path.exists(tfile):
            os.makedirs(out, exist_ok=True)
            convert(target, tfile)
        return tfile, None
    dfile = os.path.join(out, "draft.gguf")
    weights = os.path.join(draft, "model.safetensors")
    stale = not os.path.exists(dfile) or (os.path.exists(weights)
                                          and os.path.getmtime(weights) > os.path.getmtime(dfile))
    if stale:
        export_gguf(draft, target, out, overwrite=True)
    return tfile, dfile


def vanilla_decode_tps(target: str, threads: int, n: int = 128) -> dict:
    """llama-bench's decode speed (tg N, batch 1) of the target's bf16 GGUF; skipped without the build."""
    if not llamacpp.is_built():
        return {"skipped": "no llama.cpp build (make llamacpp)"}
    tfile, _ = ensure_ggufs(target, None)
    cmd = [llamacpp.tool("llama-bench"), "-m", tfile, "-p", "0", "-n", str(n), "-t", str(threads), "-r", "5",
           "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return {"skipped": f"llama-bench failed: {r.stderr.strip()[-300:]}"}
    import json
    rows = json.loads(r.stdout)
    tg = [x for x in rows if x.get("n_gen") == n]
    return {"tokens_per_s": float(tg[0]["avg_ts"]), "stddev": float(tg[0].get("stddev_ts", 0.0)), "threads": threads,
            "command": " ".join(cmd)}


STATS = {"n_drafted": r"n_drafted\s*=\s*(\d+)", "n_accept": r"n_accept\s*=\s*(\d+)",
         "n_predict": r"n_predict\s*=\s*(\d+)",
         "decode_tps": r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s",
         "decode_s": r"decoded\s+\d+ tokens in\s+([\d.]+) seconds"}


def run_speculative(target_gguf: str, draft_gguf: str, prompt_text: str, n_predict: int, draft_max: int,
                    threads: int, p_min: float = 0.0, timeout: float = 900, keep_text: bool = False) -> dict:
    """One greedy generation with llama-speculative-simple and our EAGLE-3 draft; its report parsed."""
    cmd = [llamacpp.tool("llama-speculative-simple"), "-m", target_gguf, "-md", draft_gguf, "--spec-type",
           "draft-eagle3", "--spec-draft-n-max", str(draft_max), "--spec-draft-n-min", "0", "--spec-draft-p-min",
           str(p_min), "-p", prompt_text, "-n", str(n_predict), "--temp", "0", "-t", str(threads), "-td", str(threads),
           "-c", "4096", "-s", "0"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    text = r.stdout + r.stderr
    if r.returncode != 0:
        raise RuntimeError(f"llama-speculative-simple failed (rc {r.returncode}): {text.strip()[-400:]}")
    out = {"wall_s": wall}
    if keep_text:
        out["text"] = r.stdout                              # the prompt, then the generated text
    for k, pat in STATS.items():
        m = re.search(pat, text)
        out[k] = float(m.group(1)) if m else None
    return out


def chat_text(tokenizer, prompt: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


# ---- the benchmark ------------------------------------------------------------------------------------
def build_parser():
    import argparse

    from sglang_eagle3.engine.settings import add_dtype_arg
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="testbed")
    p.add_argument("--draft", default=None, help="EAGLE-3 draft folder (default: the shipped one)")
    p.add_argument("--data", default=None)
    p.add_argument("--datasets", default="mt_bench,humaneval,gsm8k,alpaca,sum")
    p.add_argument("--n", type=int, default=2, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--draft-lengths", default="1,2,3,4", help="llama.cpp --spec-draft-n-max values (our chain length)")
    p.add_argument("--threads", type=int, default=2)
    add_dtype_arg(p)
    p.add_argument("--out", default="results/bench_llamacpp.json")
    return p


def run(argv=None) -> int:
    import statistics

    import torch

    from sglang_eagle3.bench.acceptance import resolve_sets
    from sglang_eagle3.engine.engine import SpeculativeEngine
    from sglang_eagle3.engine.loader import load_engine
    from sglang_eagle3.engine.prompts import load_prompts
    from sglang_eagle3.engine.settings import Settings, resolve_dtype
    from sglang_eagle3.engine.speculation import SpecConfig
    from sglang_eagle3.engine.verify import SamplingParams
    from sglang_eagle3.errors import UserError
    from sglang_eagle3.models.testbed import resolve_target
    from sglang_eagle3.paths import data_dir, shipped_draft
    a = build_parser().parse_args(argv)
    a.dtype = resolve_dtype(a.dtype)
    try:
        lengths = [int(x) for x in a.draft_lengths.split(",")]
    except ValueError:
        raise UserError(f"--draft-lengths must be comma-separated integers, got {a.draft_lengths!r}") from None
    if min(lengths) < 1:
        raise UserError(f"--draft-lengths must all be >= 1, got {a.draft_lengths!r}")
    if not llamacpp.is_built():
        raise UserError("no llama.cpp build: run `make llamacpp` first (~20 min on 2 cores)")
    torch.set_num_threads(a.threads)
    target = resolve_target(a.target)
    draft = a.draft or shipped_draft()
    sets = resolve_sets(a.datasets.split(","), a.data or data_dir())
    prompts = [(name, t[0]) for name, path in sets.items() for t in load_prompts(path, limit=a.n)]
    tgg, dgg = ensure_ggufs(target, draft)
    eng = load_engine(target, Settings(a.dtype, draft, SpecConfig(1, 1, 2)))
    tok = eng.tokenizer
    vanilla = SpeculativeEngine(eng.target, None, Settings(a.dtype))
    params = SamplingParams(max_new_tokens=a.max_new_tokens)
    chats = [[{"role": "user", "content": p}] for _, p in prompts]
    vanilla.generate(chats[:1], SamplingParams(max_new_tokens=8))
    result = {"format": "sglang_eagle3.bench_llamacpp/2", "target": target, "draft": draft, "target_gguf": tgg,
              "draft_gguf": dgg, "threads": a.threads, "max_new_tokens": a.max_new_tokens, "prompts": len(prompts),
              "rows": [], "meta": report.run_metadata(),
              "note": "each row measures its own vanilla beside it: llama-bench right before llama.cpp's speculative "
                      "runs; ours alternated with the speculative run prompt by prompt (speed-up = median of the "
                      "per-prompt ratios). The host's speed drifts; rows are comparable within themselves."}
    tps = lambda st: st.generated_tokens / st.total_time          # noqa: E731
    for n in lengths:
        van_tps = vanilla_decode_tps(target, a.threads, a.max_new_tokens)       # llama.cpp vanilla, beside this row
        lc = [run_speculative(tgg, dgg, chat_text(tok, p), a.max_new_tokens, n, a.threads) for _, p in prompts]
        drafted, accepted = sum(x["n_drafted"] or 0 for x in lc), sum(x["n_accept"] or 0 for x in lc)
        steps = sum((x["n_predict"] or 0) - (x["n_accept"] or 0) for x in lc)
        lc_tps = statistics.median(x["decode_tps"] for x in lc if x["decode_tps"])
        spec = SpeculativeEngine(eng.target, eng.draft, Settings(a.dtype, tree=SpecConfig(n, 1, n + 1)))
        spec.generate(chats[:1], SamplingParams(max_new_tokens=8))
        ours, ours_van = [], []
        for i, c in enumerate(chats):                                  # alternate who goes first
            order = [(ours_van, vanilla), (ours, spec)]
            for sink, e in (order if i % 2 == 0 else order[::-1]):
                sink.append(e.generate([c], params)[1])
        o_tokens, o_steps = sum(s.generated_tokens - 1 for s in ours), sum(s.verify_steps - 1 for s in ours)
        row = {"draft_length": n, "llamacpp_drafted": drafted, "llamacpp_accepted": accepted,
               "llamacpp_accept_rate": report.safe_div(accepted, drafted),
               "llamacpp_tau": report.safe_div(accepted + steps, steps), "llamacpp_tokens_per_s": lc_tps,
               "llamacpp_vanilla_tokens_per_s": van_tps.get("tokens_per_s"),
               "llamacpp_speedup": report.safe_div(lc_tps, van_tps.get("tokens_per_s")),
               "ours_tau": o_tokens / o_steps, "ours_accept_rate": (o_tokens - o_steps) / (n * o_steps),
               "ours_tokens_per_s": statistics.median(map(tps, ours)),
               "ours_vanilla_tokens_per_s": statistics.median(map(tps, ours_van)),
               "ours_speedup": statistics.median(tps(s) / tps(v) for s, v in zip(ours, ours_van))}
        result["rows"].append(row)
        print(f"draft length {n}: llama.cpp accepted {accepted}/{drafted} (τ {row['llamacpp_tau']:.2f}, "
              f"{lc_tps:.1f} tok/s); ours τ {row['ours_tau']:.2f}, {row['ours_tokens_per_s']:.1f} tok/s",
              file=sys.stderr, flush=True)
        report.write_json_atomic(a.out, result)
    report.write_outputs(a.out, result, render(result), plot)
    return 0


def render(r: dict) -> str:
    head = ["draft length", "llama.cpp accepted/drafted", "llama.cpp τ", "llama.cpp vanilla tok/s", "llama.cpp tok/s",
            "llama.cpp speed-up", "ours τ", "ours vanilla tok/s", "ours tok/s", "ours speed-up"]
    fmt = lambda v: "-" if v is None else f"{v:.1f}"           # noqa: E731
    rows = [[x["draft_length"], f"{x['llamacpp_accepted']:.0f}/{x['llamacpp_drafted']:.0f} "
                                f"({100 * (x['llamacpp_accept_rate'] or 0):.0f}%)",
             f"{x['llamacpp_tau']:.2f}", fmt(x.get("llamacpp_vanilla_tokens_per_s")),
             f"{x['llamacpp_tokens_per_s']:.1f}",
             report.fmt_speedup(x["llamacpp_speedup"]), f"{x['ours_tau']:.2f}", fmt(x.get("ours_vanilla_tokens_per_s")),
             f"{x['ours_tokens_per_s']:.1f}", f"{x['ours_speedup']:.2f}x"] for x in r["rows"]]
    best_lc = max(r["rows"], key=lambda x: x["llamacpp_tokens_per_s"])
    best_ours = max(r["rows"], key=lambda x: x["ours_tokens_per_s"])
    return (f"llama.cpp (pinned, bf16 GGUF, {r['threads']} threads) vs our engine, batch 1, greedy, "
            f"{r['prompts']} prompts x {r['max_new_tokens']} tokens; draft {r['draft']}\n"
            "each row's vanilla measured beside it (llama.cpp: llama-bench tg right before; ours: alternated per "
            "prompt, speed-up = median of per-prompt ratios)\n\n"
            + report.format_table(head, rows) +
            f"\n\nFastest: llama.cpp {best_lc['llamacpp_tokens_per_s']:.1f} tok/s (draft length "
            f"{best_lc['draft_length']}), ours {best_ours['ours_tokens_per_s']:.1f} tok/s (chain of "
            f"{best_ours['draft_length']}).")


def plot(r: dict, path: str) -> str:
    fig, (ax1, ax2) = report.subplots(1, 2, figsize=(11, 4))
    n = [x["draft_length"] for x in r["rows"]]
    ax1.plot(n, [x["llamacpp_tau"] for x in r["rows"]], "o-", label="llama.cpp")
    ax1.plot(n, [x["ours_tau"] for x in r["rows"]], "s-", label="ours")
    ax1.set(xlabel="draft length (chain)", ylabel="τ (tokens per target forward)", title="Acceptance, same draft")
    ax1.legend()
    ax2.plot(n, [x["llamacpp_tokens_per_s"] for x in r["rows"]], "o-", label="llama.cpp + draft")
    ax2.plot(n, [x["ours_tokens_per_s"] for x in r["rows"]], "s-", label="ours + draft")
    ax2.plot(n, [x.get("llamacpp_vanilla_tokens_per_s") or 0 for x in r["rows"]], "o--", color="C0",
             label="llama.cpp vanilla (beside)")
    ax2.plot(n, [x.get("ours_vanilla_tokens_per_s") or 0 for x in r["rows"]], "s--", color="C1",
             label="ours vanilla (beside)")
    ax2.set(xlabel="draft length (chain)", ylabel="tokens/s", title="Decode speed, batch 1")
    ax2.legend(fontsize=7)
    return report.save_figure(fig, path)


def main(argv=None) -> int:
    from sglang_eagle3.bench import run_cli
    return run_cli("bench_llamacpp", run, argv, extra_errors=(RuntimeError,))
