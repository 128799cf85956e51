#!/usr/bin/env python
"""What decides speculative decoding speed on this machine (see sglang_eagle3/bench/decode.py for the parts).

    python bench/bench_decode.py [--target testbed] [--draft checkpoints/smollm2-135m-eagle3] [--n 6]
        [--parts speed,step,trees,profile,compile,divergence] [--out results/bench_decode.json]

Writes JSON (partial results survive a kill), a Markdown report with the issue's targets marked met / not
met, and a PNG (tokens/s per runtime, verify cost vs tree size, break-even vs measured acceptance).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sglang_eagle3.bench import decode as D  # noqa: E402
from sglang_eagle3.bench import run_cli  # noqa: E402
from sglang_eagle3.bench.report import (format_table, run_metadata, save_figure, sibling, subplots,  # noqa: E402
                                        write_json_atomic, write_text_atomic)
from sglang_eagle3.config import SpecConfig  # noqa: E402
from sglang_eagle3.generate_cli import AUTO_DTYPE_HELP, DTYPE_CHOICES, resolve_dtype, resolve_target, shipped_draft  # noqa: E402
from sglang_eagle3.prompts import data_dir  # noqa: E402

PARTS = ("speed", "step", "trees", "profile", "llamacpp", "compile", "divergence")
FALLBACK_DEMO_TREE = SpecConfig(3, 2, 6)
STEP_RUNTIMES = ("eager", "fused", "fused-avx512", "fused-amx")   # on AMX CPUs: the few-row kernel fused does not use


def demo_tree(draft) -> SpecConfig:
    """The tree the engine uses by default at batch 1: the draft's tuned profile entry (the fastest tree measured
    where vanilla won), else 3/2/6."""
    from sglang_eagle3.generate_cli import draft_profile
    prof = draft_profile(draft) if draft else None
    return (prof.measured_tree(1) if prof else None) or FALLBACK_DEMO_TREE


def parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="testbed")
    ap.add_argument("--draft", default=None, help="trained draft for the tree part (default: the shipped one)")
    ap.add_argument("--data", default=data_dir())
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=AUTO_DTYPE_HELP)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the GPU path: CUDA graphs vs eager)")
    ap.add_argument("--n", type=int, default=6, help="MT-bench first turns for the speed part (batch 1)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--parts", default="speed,step,trees,profile,llamacpp",
                    help=f"comma-separated of {', '.join(PARTS)} (compile takes minutes; divergence is a count)")
    ap.add_argument("--context", type=int, default=256, help="cached tokens before the timed forwards")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--tree-sizes", default="1,2,4,6,8,16,32")
    ap.add_argument("--trees", default="1,1,2;2,1,3;3,1,4;3,2,6;4,2,8;5,4,16",
                    help="num_steps,topk,num_draft_tokens;... for the tree part (3,2,6 is the demo tree)")
    ap.add_argument("--tree-prompts", type=int, default=4, help="MT-bench prompts per tree shape")
    ap.add_argument("--profile-batches", default="1,8")
    ap.add_argument("--divergence-prompts", type=int, default=100)
    ap.add_argument("--divergence-tokens", type=int, default=64)
    ap.add_argument("--divergence-batch", type=int, default=8)
    ap.add_argument("--out", default="results/bench_decode.json")
    return ap


def run(argv=None) -> int:
    from sglang_eagle3.cli import UserError
    a = parser().parse_args(argv)
    a.dtype = resolve_dtype(a.dtype, a.device)
    parts = a.parts.split(",")
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise UserError(f"--parts {','.join(bad)}: choose from {', '.join(PARTS)}")
    torch.set_num_threads(a.threads)
    target = resolve_target(a.target)
    draft = a.draft or shipped_draft()
    prompts, mixed = D.eval_prompts(a.data, max(a.n, a.tree_prompts), a.divergence_prompts)
    demo = demo_tree(draft)
    res = {"meta": {**run_metadata(), "target": target, "draft": draft, "dtype": a.dtype, "device": a.device,
                    "threads": a.threads, "demo_tree": [demo.num_steps, demo.topk, demo.num_draft_tokens],
                    "args": vars(a)}}
    rt = D.Runtimes(target, a.dtype, a.device) if set(parts) - {"divergence", "llamacpp"} else None
    if rt is not None:
        res["extension"] = {"built": rt.extension_ready, "load_s": rt.extension_load_s, **D.kernels.status()}

    def save():
        write_json_atomic(a.out, res)
    if "speed" in parts:
        res["speed"] = D.bench_speed(rt, prompts[:a.n], a.max_new_tokens)
        save()
    if "step" in parts:
        res["step"] = D.bench_step(rt, a.context, [int(x) for x in a.tree_sizes.split(",")], a.repeats)
        save()
    if "trees" in parts and draft:
        trees = D.parse_trees(a.trees)
        if demo.key not in {t.key for t in trees}:
            trees.append(demo)
        res["trees"] = D.bench_trees(rt, draft, a.dtype, prompts[:a.tree_prompts], trees, a.max_new_tokens)
        save()
    if "profile" in parts:
        res["profile"] = D.bench_profile(rt, draft, a.dtype, prompts[0], demo,
                                         [int(x) for x in a.profile_batches.split(",")])
        save()
    if "llamacpp" in parts:
        from sglang_eagle3.bench.llamacpp import vanilla_decode_tps
        res["llamacpp"] = vanilla_decode_tps(target, a.threads, a.max_new_tokens)
        save()
    if "compile" in parts:
        res["compile"] = D.bench_compile(rt, a.context)
        save()
    if "divergence" in parts and a.dtype != "float32":
        res["divergence"] = D.divergence(target, draft, a.dtype, mixed, a.divergence_tokens, a.divergence_batch)
        save()
    text = render(res, a)
    print(text)
    write_text_atomic(sibling(a.out, ".md"), text + "\n")
    plot(res, sibling(a.out, ".png"))
    print(f"\nwrote {a.out}, {sibling(a.out, '.md')}, {sibling(a.out, '.png')}")
    return 0


def _ms(x):
    return f"{x * 1e3:.1f}"


def render(res, a) -> str:
    out, checks = [], []
    m = res["meta"]
    out.append(f"Target {m['target']}, {m['dtype']}, batch 1, {m['threads']} threads. eager = plain PyTorch "
               f"(--compile off); fused = prepacked oneDNN linears + C++ kernels (default); on CPUs with AMX, "
               f"fused-avx512 / fused-amx = the same with the few-row kernel the default does not use.")
    if "extension" in res:
        e = res["extension"]
        out.append(f"C++ extension: {'built' if e['built'] else 'NOT built: ' + str(e['extension_error'])}"
                   f"{' (few-row linears: ' + str(e.get('few_row_kernel')) + ')' if e['built'] else ''}, "
                   f"loaded in {e['load_s']:.2f} s (compiled once into the cache at install; ~20 s the first time)")
    s = res.get("speed")
    if s:
        med = s["median_tokens_per_s"]
        rows = [[name, f"{med[name]:.1f}"] for name in ("transformers", "eager", "fused")]
        lc = res.get("llamacpp") or {}
        if lc.get("tokens_per_s"):
            rows.append(["llama.cpp (llama-bench tg)", f"{lc['tokens_per_s']:.1f}"])
        out += ["", f"Decode tokens/s, median over {s['prompts']} MT-bench prompts, {s['max_new_tokens']} new tokens "
                    f"(alternated per prompt)", format_table(["runtime", "tokens/s"], rows),
                f"fused / transformers {s['ratio_fused_over_transformers']:.2f}x, eager / transformers "
                f"{s['ratio_eager_over_transformers']:.2f}x, fused / eager {s['ratio_fused_over_eager']:.2f}x; "
                f"fused identical to transformers on {s['identical']['fused_vs_transformers']}/{s['prompts']}, "
                f"to eager on {s['identical']['fused_vs_eager']}/{s['prompts']} prompts (bf16 near-ties can differ)"]
        checks.append(("vanilla >= 2.5x transformers' generate", s["ratio_fused_over_transformers"] >= 2.5,
                       f"{s['ratio_fused_over_transformers']:.2f}x"))
        if lc.get("tokens_per_s"):
            r = med["fused"] / lc["tokens_per_s"]
            checks.append(("vanilla >= 0.6x llama.cpp's decode", r >= 0.6, f"{r:.2f}x ({med['fused']:.1f} vs "
                                                                             f"{lc['tokens_per_s']:.1f} tok/s)"))
        elif lc:
            out.append(f"llama.cpp: {lc.get('skipped')}")
    st = res.get("step")
    if st:
        rows = [[n, _ms(st[n]["step_s"]), f"{st['weight_bytes'] / 1e6:.0f}", f"{st['read_bandwidth_gbs']:.1f}",
                 _ms(st["floor_s"]), f"{st[n]['step_over_floor']:.2f}x"] for n in STEP_RUNTIMES if n in st]
        out += ["", f"One decode step at context {st['context']} vs its memory floor (weight bytes / read bandwidth)",
                format_table(["runtime", "step ms", "weight MB", "read GB/s", "floor ms", "step / floor"], rows)]
        sizes = list(st["fused"]["verify_relative"])
        rows = [[n] + [f"{st[n]['verify_relative'][T]:.2f}" for T in sizes] for n in STEP_RUNTIMES if n in st]
        out += ["", "Verify forward over T tokens, cost relative to T = 1",
                format_table(["runtime"] + [f"T={T}" for T in sizes], rows)]
        checks.append(("decode step <= 2x its floor", st["fused"]["step_over_floor"] <= 2.0,
                       f"{st['fused']['step_over_floor']:.2f}x"))
        if "8" in st["fused"]["verify_relative"]:
            v8 = st["fused"]["verify_relative"]["8"]
            checks.append(("verify of 8 tokens <= 1.3x a 1-token step", v8 <= 1.3, f"{v8:.2f}x"))
    tr = res.get("trees")
    if tr:
        rows = []
        for r in tr["trees"]:
            t = r["tree"]
            rows.append([f"{t['num_steps']}/{t['topk']}/{t['num_draft_tokens']}", f"{r['draft_over_step']:.2f}",
                         f"{r['verify_over_step']:.2f}", f"{r['draft_over_verify']:.2f}",
                         f"{r['breakeven_accept_length']:.2f}", f"{r['accept_length']:.2f}",
                         f"{r['predicted_speedup']:.2f}x", f"{r['measured_speedup']:.2f}x"])
        out += ["", f"Tree shapes with draft {tr['draft']} ({tr['prompts']} MT-bench prompts, {tr['max_new_tokens']} "
                    f"tokens; per decode step, relative to one vanilla step of {_ms(tr['vanilla_step_s'])} ms)",
                format_table(["steps/topk/tokens", "draft", "verify", "draft/verify", "break-even τ", "τ reached",
                              "τ / break-even", "measured speed-up"], rows)]
        dt = m.get("demo_tree") or [3, 2, 6]
        demo = next((r for r in tr["trees"] if [r["tree"]["num_steps"], r["tree"]["topk"],
                                                r["tree"]["num_draft_tokens"]] == dt), None)
        name = "/".join(map(str, dt))
        if demo:
            checks.append((f"drafting the demo tree ({name}) <= 30% of one verify", demo["draft_over_verify"] <= 0.3,
                           f"{100 * demo['draft_over_verify']:.0f}%"))
            checks.append((f"break-even τ <= 1.4 for the demo tree ({name})", demo["breakeven_accept_length"] <= 1.4,
                           f"{demo['breakeven_accept_length']:.2f}"))
    pr = res.get("profile")
    if pr:
        keys = list(pr)
        phases = [p for p in D.PHASES if any(p in pr[k]["phases_ms"] for k in keys)]
        rows = [[k, _ms(pr[k]["step_ms"] / 1e3)] + [f"{pr[k]['phases_ms'].get(p, 0):.2f}" for p in phases]
                for k in keys]
        out += ["", f"Where a step's time goes (ms per step, torch.profiler; tree "
                    f"{'/'.join(map(str, m.get('demo_tree') or [3, 2, 6]))})",
                format_table(["runtime/step/batch", "step ms"] + phases, rows)]
    cp = res.get("compile")
    if cp:
        out += ["", f"torch.compile of a plain decode step ({cp['mode']}): {_ms(cp['step_s'])} ms per step after "
                    f"{cp['compile_and_warmup_s']:.0f} s of compiling and warm-up, vs {_ms(cp['fused_step_s'])} ms for "
                    f"the fused step ({cp['compiled_over_fused']:.2f}x): "
                    + ("the fused kernels are kept." if cp["compiled_over_fused"] >= 1 else
                       "torch.compile is faster here.")]
    dv = res.get("divergence")
    if dv:
        out += ["", f"{dv['dtype']}: speculative vs vanilla greedy outputs differ on {dv['differ']}/{dv['prompts']} "
                    f"prompts ({dv['per_100']:.1f} per 100, {dv['tokens_each']} tokens each; numerical near-ties)"]
    if checks:
        out += ["", "Targets", format_table(["target", "met", "measured"],
                                            [[n, "yes" if ok else "NO", v] for n, ok, v in checks])]
    return "\n".join(out)


def plot(res, path):
    fig, axes = subplots(1, 3, figsize=(16, 4.2))
    s = res.get("speed")
    if s:
        names = ["transformers", "eager", "fused"]
        vals = [s["median_tokens_per_s"][n] for n in names]
        if (res.get("llamacpp") or {}).get("tokens_per_s"):
            names.append("llama.cpp")
            vals.append(res["llamacpp"]["tokens_per_s"])
        axes[0].bar(names, vals)
        axes[0].set(ylabel="tokens/s (median)", title="Vanilla decode, batch 1")
    st = res.get("step")
    if st:
        for n in (n for n in STEP_RUNTIMES if n in st):
            sizes = [int(T) for T in st[n]["verify_relative"]]
            axes[1].plot(sizes, list(st[n]["verify_relative"].values()), marker="o", label=n)
        axes[1].set(xscale="log", xlabel="tokens in the verify forward", ylabel="cost / one-token forward",
                    title="Verify cost vs tree size")
        axes[1].legend()
    tr = res.get("trees")
    if tr:
        labels = [f"{r['tree']['num_steps']}/{r['tree']['topk']}/{r['tree']['num_draft_tokens']}" for r in tr["trees"]]
        x = list(range(len(labels)))
        axes[2].bar([i - 0.2 for i in x], [r["breakeven_accept_length"] for r in tr["trees"]], 0.4, label="break-even τ")
        axes[2].bar([i + 0.2 for i in x], [r["accept_length"] for r in tr["trees"]], 0.4, label="τ reached")
        axes[2].set_xticks(x, labels)
        axes[2].set(xlabel="num_steps/topk/num_draft_tokens", ylabel="tokens per target forward",
                    title="Break-even vs reached acceptance")
        axes[2].legend()
    save_figure(fig, path)


def main(argv=None) -> int:
    return run_cli("bench_decode", run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
