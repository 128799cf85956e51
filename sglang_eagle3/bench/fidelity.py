"""bf16 fidelity of the target's decode paths: how close each kernel path's logits stay to the fp32 reference.

bf16 decodes are not fp32 decodes: every product rounds, and where the target's two best next tokens are nearly
tied, any two bf16 paths (transformers' own included) may pick different ones, after which their texts part
ways. So "output differs from transformers" alone cannot tell a broken kernel from a near-tie. This measures it:

- reference: transformers in float32, greedy, `tokens` new tokens per chat prompt;
- each path decodes that same token sequence one token per step (teacher forcing: prefill the prompt, then feed
  the reference tokens), exactly as the engine's vanilla decode does, and keeps every step's logits;
- per path: how often its argmax is the reference token, split by the reference's top-1/top-2 logit margin
  (a sound path misses only near-ties), the logit error against fp32 (max over the vocabulary, per step), and
  the prompts whose greedy output would equal the reference's (no miss before the end: the first miss is where
  a free-running greedy decode of that path leaves the reference).

Paths: "amx" (csrc's AMX tile kernel, where the CPU and OS allow it), "avx512" (csrc's AVX-512 BF16 kernel),
"avx512f" / "avx2" (csrc's kernels that widen bf16 to fp32 on 512-bit / 256-bit vectors: the same sums, so the same
logits; where the build has them), "eager" (no csrc extension: PyTorch's bf16 F.linear),
"transformers" (transformers' bf16 model with its own cache), "float32" (our runtime in fp32: should agree everywhere).
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional

import torch

from sglang_eagle3.bench import report

FORMAT = "sglang_eagle3.bench_fidelity/1"
PATHS = ("amx", "avx512", "avx512f", "avx2", "eager", "transformers", "float32")
KERNEL_OF_PATH = {"amx": "amx", "avx512": "avx512_bf16", "avx512f": "avx512f", "avx2": "avx2"}   # csrc's few-row
MARGIN_BINS = (0.0, 0.1, 0.25, 0.5, 1.0, float("inf"))      # fp32 top-1 minus top-2 logit


def chat_ids(tokenizer, prompt: str) -> torch.Tensor:
    """[1, P]: the prompt as one user turn, encoded as the engine encodes it."""
    from sglang_eagle3.engine.engine import encode_prompt
    return torch.tensor([encode_prompt(tokenizer, [{"role": "user", "content": prompt}])])


@torch.no_grad()
def reference(hf32, prompt_ids: torch.Tensor, tokens: int) -> tuple[list[int], torch.Tensor]:
    """fp32 greedy continuation (stops at eos) and the fp32 logits that chose each of its tokens [n, V]."""
    out = hf32.generate(prompt_ids, max_new_tokens=tokens, do_sample=False, output_logits=True,
                        return_dict_in_generate=True, pad_token_id=hf32.generation_config.eos_token_id)
    new = out.sequences[0, prompt_ids.shape[1]:].tolist()
    return new, torch.cat([lg.float() for lg in out.logits])[:len(new)]


@torch.no_grad()
def teacher_forced_ours(target, prompt_ids: torch.Tensor, ref_tokens: list[int]) -> torch.Tensor:
    """Our runtime's logits [n, V] (fp32 copies) for each reference position: prefill, then one token per step."""
    P = prompt_ids.shape[1]
    cache = target.new_cache(1, P + len(ref_tokens) + 1)
    rows = torch.zeros(1, dtype=torch.long)
    out = target.forward(cache, prompt_ids, torch.arange(P).unsqueeze(0), want_aux=False,
                         logit_index=torch.tensor([[P - 1]]))
    cache.commit_prefix(rows, torch.tensor([P]))
    logits = [out.logits[0, -1].float()]
    for j, tok in enumerate(ref_tokens[:-1]):
        out = target.forward(cache, torch.tensor([[tok]]), torch.tensor([[P + j]]), want_aux=False)
        cache.commit_prefix(rows, torch.tensor([1]))
        logits.append(out.logits[0, -1].float())
    return torch.stack(logits)


@torch.no_grad()
def teacher_forced_hf(hf, prompt_ids: torch.Tensor, ref_tokens: list[int]) -> torch.Tensor:
    """transformers' logits [n, V] the same way, through its own KV cache."""
    out = hf(prompt_ids, use_cache=True)
    past, logits = out.past_key_values, [out.logits[0, -1].float()]
    for tok in ref_tokens[:-1]:
        out = hf(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits.append(out.logits[0, -1].float())
    return torch.stack(logits)


def compare(ref_logits: torch.Tensor, ref_tokens: list[int], got: torch.Tensor) -> dict:
    """One prompt: per-step misses, fp32 margins and logit errors of a path against the reference."""
    top2 = ref_logits.topk(2, dim=-1).values                                            # [n, 2]
    margin = (top2[:, 0] - top2[:, 1]).tolist()
    miss = (got.argmax(-1) != torch.tensor(ref_tokens)).tolist()
    err = (got - ref_logits).abs().amax(-1).tolist()
    first = next((j for j, m in enumerate(miss) if m), None)
    return {"margin": margin, "miss": miss, "max_abs_logit_error": err, "first_miss": first}


def summarize(per_prompt: list[dict]) -> dict:
    margins = [m for p in per_prompt for m in p["margin"]]
    misses = [x for p in per_prompt for x in p["miss"]]
    errs = sorted(e for p in per_prompt for e in p["max_abs_logit_error"])
    bins = []
    for lo, hi in zip(MARGIN_BINS, MARGIN_BINS[1:]):
        sel = [x for m, x in zip(margins, misses) if lo <= m < hi]
        bins.append({"margin_from": lo, "margin_to": None if hi == float("inf") else hi, "steps": len(sel),
                     "misses": sum(sel)})
    firsts = [p["first_miss"] for p in per_prompt]
    return {"steps": len(misses), "misses": sum(misses), "agreement": 1 - sum(misses) / max(1, len(misses)),
            "misses_by_margin": bins, "max_margin_missed": max((m for m, x in zip(margins, misses) if x), default=None),
            "median_max_abs_logit_error": errs[len(errs) // 2] if errs else None,
            "p99_max_abs_logit_error": errs[min(len(errs) - 1, int(0.99 * len(errs)))] if errs else None,
            "prompts_equal_to_reference": sum(f is None for f in firsts), "prompts": len(per_prompt),
            "first_miss": firsts,
            "margin_at_first_miss": [None if f is None else p["margin"][f] for p, f in zip(per_prompt, firsts)]}


def available_paths() -> list[str]:
    """The paths this machine runs by default: AMX where usable, the build's default vector kernel (avx512 needs
    AVX-512 BF16), eager, transformers, float32 (--paths may name any kernel the build has)."""
    from sglang_eagle3.kernels import extension
    out = ["amx"] if extension.amx_usable() else []
    default = extension.few_row_isa()
    out += [path for path, kernel in KERNEL_OF_PATH.items() if kernel == default]
    return out + ["eager", "transformers", "float32"]


def path_logits(name: str, target_path: str) -> Callable[[torch.Tensor, list[int]], torch.Tensor]:
    """Load the model for one path; returns a teacher-forcing function (prompt_ids, ref_tokens) -> logits."""
    from sglang_eagle3.kernels import extension
    from sglang_eagle3.models.target import TargetModel
    if name == "transformers":
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.bfloat16).eval()
        return lambda ids, ref: teacher_forced_hf(hf, ids, ref)
    dtype = torch.float32 if name == "float32" else torch.bfloat16
    mode = "off" if name == "eager" else "auto"
    with extension.using(mode), extension.using_few_row(KERNEL_OF_PATH.get(name, "auto")):
        target = TargetModel.from_pretrained(target_path, dtype=dtype)

    def run(ids, ref):
        with extension.using(mode):
            return teacher_forced_ours(target, ids, ref)
    return run


def measure(target_path: str, prompts: list[str], tokens: int, paths: list[str], progress: bool = True) -> dict:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(target_path)
    hf32 = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    refs = []
    for p in tqdm(prompts, desc="fp32 reference", unit="prompt", disable=not progress):
        ids = chat_ids(tok, p)
        refs.append((ids, *reference(hf32, ids, tokens)))
    del hf32
    result = {}
    for name in paths:
        fn = path_logits(name, target_path)
        per_prompt = [compare(ref_logits, ref_tokens, fn(ids, ref_tokens))
                      for ids, ref_tokens, ref_logits in tqdm(refs, desc=name, unit="prompt", disable=not progress)]
        result[name] = summarize(per_prompt)
    return {"reference_tokens": [r[1] for r in refs], "paths": result}


def render(r: dict) -> str:
    rows = []
    for name, s in r["paths"].items():
        bins = " / ".join(f"{b['misses']}/{b['steps']}" for b in s["misses_by_margin"])
        rows.append([name, f"{100 * s['agreement']:.2f}%", f"{s['misses']}/{s['steps']}", bins,
                     report.fmt_num(s["max_margin_missed"], 3), report.fmt_num(s["median_max_abs_logit_error"], 3),
                     report.fmt_num(s["p99_max_abs_logit_error"], 3),
                     f"{s['prompts_equal_to_reference']}/{s['prompts']}"])
    edges = ", ".join(f"[{lo:g}, {hi:g})" for lo, hi in zip(MARGIN_BINS, MARGIN_BINS[1:]))
    head = (f"Greedy fidelity against transformers float32 ({r['prompts']} chat prompts, up to {r['tokens']} tokens "
            f"each, teacher-forced one token per step; {r['meta'].get('cpu')}, {r['threads']} threads)\n"
            f"misses by fp32 top-1/top-2 margin, bins {edges}")
    return head + "\n" + report.format_table(
        ["path", "argmax = fp32", "misses", "misses per margin bin", "largest margin missed",
         "median max |Δlogit|", "p99 max |Δlogit|", "outputs = fp32"], rows)


def figure(r: dict, path: str) -> str:
    fig, (ax0, ax1) = report.subplots(1, 2, figsize=(10, 3.6))
    names = list(r["paths"])
    labels = [f"<{b['margin_to']:g}" if b["margin_to"] is not None else f"≥{b['margin_from']:g}"
              for b in r["paths"][names[0]]["misses_by_margin"]]
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        rates = [100 * b["misses"] / b["steps"] if b["steps"] else 0 for b in r["paths"][name]["misses_by_margin"]]
        ax0.bar([x + i * width for x in range(len(labels))], rates, width, label=name)
    ax0.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels)
    ax0.set_xlabel("fp32 top-1 minus top-2 logit")
    ax0.set_ylabel("argmax ≠ fp32 (% of steps)")
    ax0.legend(fontsize=7)
    for name in names:
        m = [x for x in r["paths"][name]["margin_at_first_miss"] if x is not None]
        steps = [f for f in r["paths"][name]["first_miss"] if f is not None]
        ax1.scatter(steps, m, label=name, s=14)
    ax1.set_xlabel("step of the first miss (where greedy leaves fp32)")
    ax1.set_ylabel("fp32 margin there")
    ax1.legend(fontsize=7)
    return report.save_figure(fig, path)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_fidelity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="testbed", help="HF folder or 'testbed' (default)")
    ap.add_argument("--datasets", default="mt_bench,gsm8k,humaneval,alpaca,sum",
                    help="eval sets under $EAGLE3_DATA/eval (first turns), interleaved")
    ap.add_argument("--data", default=None, help="data folder (default: $EAGLE3_DATA or ../shared/data)")
    ap.add_argument("--n", type=int, default=20, help="prompts in all (default 20)")
    ap.add_argument("--tokens", type=int, default=64, help="reference tokens per prompt (default 64)")
    ap.add_argument("--paths", default=None, help=f"comma list of {', '.join(PATHS)} (default: all this CPU runs)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", required=True, help="results JSON; the table goes to .md, the figure to .png")
    return ap


def eval_prompts(datasets: list[str], n: int, data: Optional[str] = None) -> list[str]:
    """The first turns of n prompts, the sets interleaved."""
    from sglang_eagle3.bench.acceptance import resolve_sets
    from sglang_eagle3.engine.prompts import load_prompts
    from sglang_eagle3.paths import data_dir
    sets = resolve_sets(datasets, data or data_dir())
    pools = [[t[0] for t in load_prompts(path)] for path in sets.values()]
    return [p for group in zip(*pools) for p in group][:n]


def run(argv=None) -> int:
    from sglang_eagle3.errors import UserError
    from sglang_eagle3.models.testbed import resolve_target
    a = parser().parse_args(argv)
    if a.n < 1 or a.tokens < 1:
        raise UserError(f"--n and --tokens must be >= 1 (got {a.n}, {a.tokens})")
    if a.threads:
        torch.set_num_threads(a.threads)
    can = available_paths()
    paths = can if a.paths is None else [p.strip() for p in a.paths.split(",") if p.strip()]
    bad = [p for p in paths if p not in can]
    if bad:
        raise UserError(f"--paths {','.join(bad)}: not available on this machine (it runs: {', '.join(can)})")
    target = resolve_target(a.target)
    prompts = eval_prompts([s.strip() for s in a.datasets.split(",") if s.strip()], a.n, a.data)
    r = measure(target, prompts, a.tokens, paths)
    r.update({"format": FORMAT, "target": target, "prompts": len(prompts), "tokens": a.tokens,
              "threads": torch.get_num_threads(), "meta": report.run_metadata()})
    report.write_outputs(a.out, r, render(r), figure)
    return 0


def main(argv=None) -> int:
    from sglang_eagle3.bench import run_cli
    return run_cli("bench_fidelity", run, argv)


if __name__ == "__main__":
    sys.exit(main())
