"""Side-by-side table of several drafts' bench_acceptance results (the EAGLE-3 paper's ablation table).

    python bench/ablation_table.py --row "EAGLE-3=results/abl_fused.json" --row "top layer only=results/abl_top.json" \
        --row "+ feature loss=results/abl_featloss.json" --sets mt_bench,gsm8k --out results/ablation.json

Every input is a bench_acceptance JSON. The rows are only comparable when they were measured the same way,
so the settings that shape τ (target, dtype, temperature, tree, max_new_tokens, prompts per set) must match;
a mismatch is refused with the file and the setting named. When a draft folder sits in a trainer output
(OUT/draft next to OUT/train_summary.json), its held-out per-step accuracy and simulated acceptance length
are added to the row.
"""
from __future__ import annotations

import argparse
import os

from sglang_eagle3.bench import report
from sglang_eagle3.bench.acceptance import FORMAT
from sglang_eagle3.bench.acceptance_report import PAPER_NAMES

SAME_SETTINGS = ("target", "dtype", "temperature", "seed", "max_new_tokens", "spec", "ignore_eos")


def parse_row(spec: str) -> tuple[str, str]:
    from sglang_eagle3.errors import UserError
    label, sep, path = spec.rpartition("=")          # labels may hold "=" (w=1); paths rarely do
    if not sep or not label.strip() or not path.strip():
        raise UserError(f"--row {spec!r}: expected LABEL=RESULTS.json")
    return label.strip(), path.strip()


def load_result(path: str) -> dict:
    from sglang_eagle3.errors import UserError
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such file (run bench/bench_acceptance.py --out {path} first)")
    try:
        result = report.read_json(path)
    except ValueError as e:
        raise UserError(str(e)) from None
    if not isinstance(result, dict) or result.get("format") != FORMAT:
        raise UserError(f"{path}: not a bench_acceptance result (format is not {FORMAT!r})")
    return result


def train_summary(draft_dir: str) -> dict | None:
    """The trainer's final held-out eval for a draft exported to OUT/draft, if that is where it lives."""
    path = os.path.join(os.path.dirname(os.path.abspath(draft_dir)), "train_summary.json")
    if not os.path.isfile(path):
        return None
    s = report.read_json(path)
    if os.path.abspath(s.get("export") or "") != os.path.abspath(draft_dir):
        return None
    c = s.get("config", {})
    return {"final_eval": s.get("final_eval") or {}, "steps": s.get("steps"), "train_tokens": s.get("train_tokens"),
            "features": c.get("features"), "feature_loss_weight": c.get("feature_loss_weight")}


def check_comparable(results: dict[str, dict], paths: dict[str, str], sets: list[str]) -> None:
    from sglang_eagle3.errors import UserError
    first = next(iter(results))
    for label, r in results.items():
        for name in sets:
            if name not in r["sets"]:
                raise UserError(f"{paths[label]}: no results for set {name!r} (has {sorted(r['sets'])})")
            n0, n = results[first]["sets"][name]["n_prompts"], r["sets"][name]["n_prompts"]
            if n != n0:
                raise UserError(f"{paths[label]}: {name} has {n} prompts but {paths[first]} has {n0}")
        for key in SAME_SETTINGS:
            a, b = results[first]["config"].get(key), r["config"].get(key)
            if a != b:
                raise UserError(f"{paths[label]}: {key}={b!r} but {paths[first]} has {key}={a!r}; "
                                "rows must be measured with the same settings")


def build(rows: list[tuple[str, str]], sets: list[str]) -> dict:
    from sglang_eagle3.errors import UserError
    if not rows:
        raise UserError("give at least one --row LABEL=RESULTS.json")
    paths = dict(rows)
    if len(paths) != len(rows):
        raise UserError("row labels must be distinct")
    results = {label: load_result(path) for label, path in rows}
    check_comparable(results, paths, sets)
    out_rows = []
    for label, r in results.items():
        row = {"label": label, "result": os.path.abspath(paths[label]), "draft": r["config"].get("draft"),
               "tau": {s: r["sets"][s]["tau"] for s in sets},
               "speedup_median": {s: r["sets"][s]["speedup_median"] for s in sets},
               "train": train_summary(r["config"]["draft"]) if r["config"].get("draft") else None}
        out_rows.append(row)
    return {"sets": sets, "settings": {k: next(iter(results.values()))["config"].get(k) for k in SAME_SETTINGS},
            "rows": out_rows}


def markdown(table: dict) -> str:
    sets = table["sets"]
    headers = ["Draft"] + [f"{PAPER_NAMES.get(s, s)} τ" for s in sets] + \
              [f"{PAPER_NAMES.get(s, s)} speed-up" for s in sets] + ["held-out acc_0", "simulated τ", "train tokens"]
    rows = []
    for r in table["rows"]:
        ev = (r["train"] or {}).get("final_eval") or {}
        rows.append([r["label"]] + [r["tau"][s] for s in sets] +
                    [report.fmt_speedup(r["speedup_median"][s]) for s in sets] +
                    [ev.get("acc_0"), ev.get("accept_length"), (r["train"] or {}).get("train_tokens")])
    st = table["settings"]
    sp = st.get("spec") or {}
    cap = (f"Temperature={st.get('temperature')}; dtype {st.get('dtype')}; tree num_steps={sp.get('num_steps')} "
           f"topk={sp.get('topk')} num_draft_tokens={sp.get('num_draft_tokens')}; max_new_tokens="
           f"{st.get('max_new_tokens')}. τ = mean acceptance length (bench_acceptance); held-out acc_0 and "
           f"simulated τ from the trainer's final eval.")
    return cap + "\n\n" + report.format_table(headers, rows) + "\n" + per_step_table(table["rows"])


def per_step_table(rows: list[dict]) -> str:
    """Held-out acc_0..acc_k of each row (the trainer's final eval), where the rows have them."""
    evals = [((r["train"] or {}).get("final_eval") or {}) for r in rows]
    steps = sorted({int(k[4:]) for ev in evals for k in ev if k.startswith("acc_") and k[4:].isdigit()})
    if not steps:
        return ""
    body = [[r["label"]] + [ev.get(f"acc_{k}") for k in steps] for r, ev in zip(rows, evals)]
    return ("\nHeld-out accuracy of each draft step (trainer's final eval; acc_k = draft step k predicts the "
            "target's token given that steps 0..k-1 were right):\n\n"
            + report.format_table(["Draft"] + [f"acc_{k}" for k in steps], body) + "\n")


def run(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ablation_table", description=__doc__.split("\n\n")[0])
    p.add_argument("--row", action="append", default=[], help="LABEL=bench_acceptance JSON (repeat, in order)")
    p.add_argument("--sets", default="mt_bench,gsm8k", help="comma list of set names present in every input")
    p.add_argument("--out", required=True, help="table JSON; the Markdown goes next to it (.md)")
    a = p.parse_args(argv)
    table = build([parse_row(r) for r in a.row], [s.strip() for s in a.sets.split(",") if s.strip()])
    report.write_outputs(a.out, table, markdown(table))
    return 0


def main(argv=None) -> int:
    from sglang_eagle3.bench import run_cli
    return run_cli("ablation_table", run, argv)
