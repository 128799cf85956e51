"""Decode speed on the embedded target: transformers generate vs our vanilla vs speculative (random draft).

    python bench/bench_decode.py [--target testbed] [--n 6] [--max-new-tokens 128] [--dtypes float32,bfloat16]

Writes results/bench_decode.json, a Markdown table next to it, and a PNG of verify cost vs tree size.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sglang_eagle3.bench.decode import bench_dtype, divergence, eval_prompts  # noqa: E402
from sglang_eagle3.bench.report import (format_table, run_metadata, save_figure, sibling, subplots,  # noqa: E402
                                        write_json_atomic, write_text_atomic)
from sglang_eagle3.generate_cli import resolve_target  # noqa: E402
from sglang_eagle3.prompts import data_dir  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="testbed")
    ap.add_argument("--data", default=data_dir())
    ap.add_argument("--n", type=int, default=6, help="MT-bench first turns (batch 1)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--num-steps", type=int, default=5)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--num-draft-tokens", type=int, default=16)
    ap.add_argument("--context", type=int, default=256, help="cached tokens before the timed forwards")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--tree-sizes", default="1,4,8,16,32,64")
    ap.add_argument("--divergence-prompts", type=int, default=100, help="bf16: prompts for the near-tie count (0 = skip)")
    ap.add_argument("--only", choices=["speed", "divergence"], default=None,
                    help="run one part (each writes its own JSON; divergence is a count, not a timing)")
    ap.add_argument("--divergence-tokens", type=int, default=64)
    ap.add_argument("--divergence-batch", type=int, default=8)
    ap.add_argument("--out", default="results/bench_decode.json")
    a = ap.parse_args(argv)
    a.tree_sizes = [int(x) for x in a.tree_sizes.split(",")]
    torch.set_num_threads(a.threads)
    target = resolve_target(a.target)
    prompts, div_prompts = eval_prompts(a.data, a.n, a.divergence_prompts)

    meta = {**run_metadata(), "target": target, "threads": a.threads, "args": vars(a)}
    if a.only != "divergence":
        results = []
        for d in a.dtypes.split(","):
            results.append(bench_dtype(target, d, prompts, a))
            write_json_atomic(a.out, {"meta": meta, "results": results})    # partial results survive a kill
        report = render(results, a)
        print(report)
        write_text_atomic(sibling(a.out, ".md"), report + "\n")
        plot(results, sibling(a.out, ".png"))
        print(f"\nwrote {a.out}, {sibling(a.out, '.md')}, {sibling(a.out, '.png')}")
    if a.only != "speed" and div_prompts:
        div = [divergence(target, d, div_prompts, a) for d in a.dtypes.split(",") if d != "float32"]
        out = sibling(a.out, "_divergence.json")
        write_json_atomic(out, {"meta": meta, "divergence": div})
        for d in div:
            print(f"{d['dtype']}: speculative vs vanilla greedy outputs differ on {d['differ']}/{d['prompts']} prompts "
                  f"({d['per_100']:.1f} per 100; {d['tokens_each']} tokens each; first differing token index: "
                  f"{d['first_differing_token']})")
        print(f"wrote {out}")


def render(results, a) -> str:
    rows = []
    for r in results:
        m = r["median_tokens_per_s"]
        rows.append([r["dtype"], f"{m['transformers']:.1f}", f"{m['vanilla']:.1f}", f"{m['speculative']:.1f}",
                     f"{r['ratio_vanilla_over_transformers']:.2f}x", f"{r['ratio_speculative_over_vanilla']:.2f}x",
                     f"{r['random_draft_accept_length']:.2f}",
                     f"{r['identical_outputs']['speculative_vs_vanilla']}/{r['prompts']}",
                     f"{r['identical_outputs']['vanilla_vs_transformers']}/{r['prompts']}"])
    out = [f"Decode, batch 1, {results[0]['prompts']} MT-bench prompts, max_new_tokens={a.max_new_tokens}, "
           f"{a.threads} threads (median tokens/s; ratios are medians of per-prompt ratios)",
           format_table(["dtype", "transformers", "ours vanilla", "ours + random draft", "vanilla/transformers",
                         "spec/vanilla", "accept len", "spec==vanilla", "vanilla==transformers"], rows)]
    rows = [[r["dtype"], f"{r['decode_step']['measured_s'] * 1e3:.1f}", f"{r['decode_step']['weight_bytes'] / 1e6:.0f}",
             f"{r['decode_step']['read_bandwidth_gbs']:.1f}", f"{r['decode_step']['floor_s'] * 1e3:.1f}",
             f"{100 * r['decode_step']['floor_over_measured']:.0f}%"] for r in results]
    out += ["", f"One decode step at context {a.context} vs its memory floor",
            format_table(["dtype", "step ms", "weight MB", "read GB/s", "floor ms", "floor/step"], rows)]
    rows = [[r["dtype"]] + [f"{r['verify_cost_relative_to_1'][str(T)]:.2f}" for T in a.tree_sizes] for r in results]
    out += ["", "Verify forward cost relative to one token (tree of T tokens)",
            format_table(["dtype"] + [f"T={T}" for T in a.tree_sizes], rows)]
    return "\n".join(out)


def plot(results, path):
    fig, (ax1, ax2) = subplots(1, 2, figsize=(11, 4))
    for r in results:
        sizes = [int(T) for T in r["verify_cost_relative_to_1"]]
        ax1.plot(sizes, list(r["verify_cost_relative_to_1"].values()), marker="o", label=r["dtype"])
    ax1.set(xscale="log", xlabel="tokens in the verify forward", ylabel="cost / one-token forward",
            title="Verify cost vs tree size")
    ax1.legend()
    names = ["transformers", "vanilla", "speculative"]
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        ax2.bar([j + i * width for j in range(3)], [r["median_tokens_per_s"][n] for n in names], width, label=r["dtype"])
    ax2.set_xticks([j + width * (len(results) - 1) / 2 for j in range(3)], names)
    ax2.set(ylabel="tokens/s (median)", title="Decode throughput, batch 1")
    ax2.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
