"""bench_acceptance's report: the paper-shaped table, the side-by-side table, τ by turn and the histograms."""
from __future__ import annotations

import math

from sglang_eagle3.bench import report

PAPER_NAMES = {"mt_bench": "MT-bench", "humaneval": "HumanEval", "gsm8k": "GSM8K", "alpaca": "Alpaca",
               "sum": "CNN/DM"}
TAU_DEFINITION = ("tokens emitted per draft-and-verify cycle (accepted drafts + 1 bonus token), pooled over all "
                  "decoding steps of the set; the prefill token is not counted as a cycle")


TABLE_HEADERS = ["Set", "Speed-up", "τ", "n", "tokens", "vanilla tok/s", "EAGLE-3 tok/s", "speed-up (totals)",
                 "in draft vocab"]


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def table_rows(result: dict) -> list[list]:
    rows = []
    for name, s in list(result["sets"].items()) + [("Average", result["average"])]:
        rows.append([PAPER_NAMES.get(name, name), report.fmt_speedup(s["speedup_median"]), s["tau"],
                     s["n_prompts"], s["tokens_spec"], s["tokens_per_s_vanilla"], s["tokens_per_s_spec"],
                     report.fmt_speedup(s["speedup_total"]), _pct(s.get("draft_vocab_coverage"))])
    return rows


def tree_text(t: dict) -> str:
    """A profile entry as steps/topk/tokens, or 'vanilla' where it does not speculate."""
    return "vanilla" if t.get("speculation") is False else f"{t['num_steps']}/{t['topk']}/{t['num_draft_tokens']}"


def _long_text(long: dict | None) -> str:
    return f" (from {long['min_tokens']} tokens on, the profile's long-context tree {tree_text(long)})" if long else ""


def caption(result: dict) -> str:
    c = result["config"]
    sp = c["spec"]
    top_p = f", top_p={c['top_p']:g}" if c.get("top_p", 1) < 1 else ""
    return (f"Temperature={c['temperature']:g}{top_p}; target {c['target']}; draft {c['draft']}; dtype {c['dtype']}; "
            f"tree num_steps={sp['num_steps']} topk={sp['topk']} num_draft_tokens={sp['num_draft_tokens']}"
            f"{_long_text(c.get('long_context'))}; "
            f"max_new_tokens={c['max_new_tokens']}; speed-up = median over prompts of speculative/vanilla tokens/s "
            f"(same engine, alternated runs); τ = {TAU_DEFINITION}; in draft vocab = share of the vanilla run's tokens "
            f"the draft vocabulary holds (no draft token is accepted on the others).")


COMPARE_HEADERS = ["Set", "τ draft", "τ baseline", "speed-up draft", "speed-up baseline",
                   "draft / baseline tokens/s"]


def compare_rows(result: dict) -> list[list]:
    base = result["baseline"]
    rows = []
    for name, s in result["sets"].items():
        b = base["sets"][name]
        rows.append([PAPER_NAMES.get(name, name), s["tau"], b["tau"], report.fmt_speedup(s["speedup_median"]),
                     report.fmt_speedup(b["speedup_median"]), report.fmt_speedup(b["draft_over_baseline_median"])])
    a, b = result["average"], base["average"]
    rows.append(["Average", a["tau"], b["tau"], report.fmt_speedup(a["speedup_median"]),
                 report.fmt_speedup(b["speedup_median"]), report.fmt_speedup(b["draft_over_baseline_median"])])
    return rows


def identical_counts(sets: dict) -> str:
    """'mt_bench 10/10, gsm8k 9/10': greedy outputs identical to vanilla, per set."""
    return ", ".join(f"{k} {s['identical_to_vanilla']}/{s['n_prompts']}" for k, s in sets.items())


def turn_lines(sets: dict, who: str) -> list[str]:
    """'τ by turn: MT-bench turn 1 1.95, turn 2 1.84.' for the multi-turn sets (none: no line)."""
    parts = [f"{PAPER_NAMES.get(name, name)} " + ", ".join(f"turn {k} {report.fmt_num(t)}"
                                                            for k, t in s["tau_by_turn"].items())
             for name, s in sets.items() if s.get("tau_by_turn")]
    return ["", f"{who}τ by turn: {'; '.join(parts)}."] if parts else []


def markdown_report(result: dict) -> str:
    lines = [caption(result), "", report.format_table(TABLE_HEADERS, table_rows(result))]
    greedy = result["config"]["temperature"] == 0
    if greedy:
        lines += ["", f"Greedy outputs identical to vanilla: {identical_counts(result['sets'])}."]
    lines += turn_lines(result["sets"], "")
    if result.get("baseline"):
        base = result["baseline"]
        lines += ["", f"Side by side with the baseline draft {base['draft']} (decoded on every prompt in the same "
                      "run, beside the same vanilla run, the order of the three rotated; the last column is the "
                      "median over prompts of the two drafts' tokens/s ratio):", "",
                  report.format_table(COMPARE_HEADERS, compare_rows(result))]
        if greedy:
            lines += ["", f"Baseline greedy outputs identical to vanilla: {identical_counts(base['sets'])}."]
        lines += turn_lines(base["sets"], "Baseline ")
    return "\n".join(lines) + "\n"


def plot_histograms(result: dict, path: str) -> str:
    sets = result["sets"]
    ncols = min(3, len(sets))
    nrows = math.ceil(len(sets) / ncols)
    fig, axes = report.subplots(nrows, ncols)
    for ax, (name, s) in zip(axes, sets.items()):
        ks = [int(k) for k in s["accept_histogram"]]
        total = max(1, sum(s["accept_histogram"].values()))
        ax.bar(ks, [s["accept_histogram"][str(k)] / total for k in ks], width=0.7, color="tab:blue")
        ax.set_xlim(0.4, max(ks) + 0.6)
        tau = report.fmt_num(s["tau"])
        ax.set_title(f"{PAPER_NAMES.get(name, name)}  (τ={tau}, {report.fmt_speedup(s['speedup_median'])})")
        ax.set_xlabel("tokens per verify step")
        ax.set_ylabel("fraction of steps")
        ax.set_xticks(ks)
    for ax in axes[len(sets):]:
        ax.axis("off")
    return report.save_figure(fig, path)
