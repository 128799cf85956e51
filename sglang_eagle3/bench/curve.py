"""Learning curve of a training run: what a token budget buys.

For the run's kept checkpoints (`eagle3 train --keep-every N`), the draft is exported and its acceptance length
τ measured in our engine (greedy, bf16, the default tree, MT-bench with its second turn and GSM8K, a few prompts
each; τ as bench_acceptance defines it), beside the trainer's held-out acc_0..acc_6 and simulated τ from
metrics.jsonl. Writes JSON and a PNG of τ and acc_0 against training tokens.

Rerunning with the same --out, tree, prompts and dtype measures only checkpoints it has not measured yet (a run
that went on keeps its earlier points, also those whose checkpoints were rotated away since; a checkpoint rewritten
since, e.g. by a run trained again with --overwrite, is measured again); --fresh measures all.

Runs live in caches that a move to another machine loses, so the curve is kept in --out: a --run whose folder is
gone keeps the points and held-out evals --out has for it, and `--run DIR=DRAFT:TOKENS` adds the end of a run
whose checkpoints are gone but whose final draft was kept (DRAFT, e.g. the shipped one, TOKENS into that run):
one point, measured once, at the run's end.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

from sglang_eagle3.bench import report, run_cli

FORMAT = "sglang_eagle3.learning_curve/1"


def build_parser():
    from sglang_eagle3.engine.settings import add_dtype_arg, add_spec_args
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="append", required=True,
                   help="training run folder (repeatable: runs continued with --init-from, in order); a folder that "
                        "is gone keeps its points from --out; DIR=DRAFT:TOKENS: the run ended as the exported draft "
                        "DRAFT after TOKENS tokens (one point, for a run whose checkpoints are gone)")
    p.add_argument("--target", default="testbed")
    p.add_argument("--data", default=None)
    p.add_argument("--datasets", default="mt_bench,gsm8k")
    p.add_argument("--n", type=int, default=3, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=128)
    add_dtype_arg(p)
    p.add_argument("--out", required=True, help="JSON; the PNG goes next to it")
    p.add_argument("--goal", type=float, default=3.0, help="τ the trend line is extrapolated to (default 3.0)")
    p.add_argument("--fresh", action="store_true", help="measure every checkpoint again (default: reuse the points "
                   "of --out measured with the same settings)")
    add_spec_args(p, profile=False)
    return p


def measure_tau(target, draft_dir: str, spec, prompts: dict, max_new_tokens: int, dtype: str) -> dict:
    from sglang_eagle3.bench.acceptance import run_conversation
    from sglang_eagle3.engine.engine import SpeculativeEngine
    from sglang_eagle3.engine.loader import load_draft
    from sglang_eagle3.engine.settings import DTYPES, Settings
    from sglang_eagle3.engine.verify import SamplingParams
    eng = SpeculativeEngine(target, load_draft(draft_dir, DTYPES[dtype]), Settings(dtype, tree=spec))
    params = SamplingParams(max_new_tokens=max_new_tokens)
    out = {}
    for name, convs in prompts.items():
        steps = []
        for turns in convs:
            asked = turns if name == "mt_bench" else turns[:1]
            steps += run_conversation(eng, asked, lambda k: params)["accept_lengths"]
        out[name] = sum(steps) / max(1, len(steps))
    return out


def run(argv=None) -> int:
    from sglang_eagle3.bench.acceptance import resolve_sets
    from sglang_eagle3.engine.prompts import load_prompts
    from sglang_eagle3.engine.settings import DTYPES, fixed_tree, resolve_dtype
    from sglang_eagle3.errors import UserError
    from sglang_eagle3.models.target import TargetModel
    from sglang_eagle3.models.testbed import resolve_target
    from sglang_eagle3.paths import data_dir
    from sglang_eagle3.training.trainer.export import export_checkpoint
    from sglang_eagle3.training.trainer.logs import read_metrics
    from sglang_eagle3.training.trainer.run_folder import STATE_FILE
    a = build_parser().parse_args(argv)
    a.dtype = resolve_dtype(a.dtype)
    spec = fixed_tree(a.num_steps, a.topk, a.num_draft_tokens)     # one tree for every checkpoint (flags, else 5/4/16)
    sets = resolve_sets(a.datasets.split(","), a.data or data_dir())
    prompts = {k: load_prompts(p, limit=a.n) for k, p in sets.items()}
    target = TargetModel.from_pretrained(resolve_target(a.target), dtype=DTYPES[a.dtype])
    settings = {"tree": {"num_steps": spec.num_steps, "topk": spec.topk, "num_draft_tokens": spec.num_draft_tokens},
                "n": a.n, "max_new_tokens": a.max_new_tokens, "dtype": a.dtype, "datasets": sorted(sets)}
    old = read_earlier(a.out)
    cached = {} if a.fresh else earlier_points(old, settings)
    old_evals = earlier_evals(old)
    points, evals, offset = [], [], 0
    for arg in a.run:
        run_dir, final = parse_run_arg(arg)
        key = shareable_path(run_dir)
        ckpt = os.path.join(run_dir, "checkpoints")
        metrics = os.path.join(run_dir, "metrics.jsonl")
        if os.path.isfile(metrics):
            recs = [r for r in read_metrics(metrics) if r.get("split") == "eval"]
        else:                                             # the run folder is gone: its evals as --out kept them
            recs = old_evals.get(key, [])
        evals += [{**r, "tokens_total": offset + r.get("tokens_seen", 0), "run": key} for r in recs]
        if final is not None and not os.path.isdir(ckpt):   # only the run's final draft is left
            draft_dir, tokens = final
            known = [p for p in cached.get(key, []) if p["tokens_seen"] == tokens]
            if known:
                tau = known[-1]["tau"]
            else:
                if not os.path.isfile(os.path.join(draft_dir, "config.json")):
                    raise UserError(f"--run {arg}: {draft_dir} is not a draft folder (no config.json)")
                tau = measure_tau(target, draft_dir, spec, prompts, a.max_new_tokens, a.dtype)
            points.append({"run": key, "step": "end", "tokens_seen": tokens, "tokens_total": offset + tokens,
                           "tau": tau, "written": None, "draft": shareable_path(draft_dir)})
            print(f"{run_dir} end ({draft_dir}): {offset + tokens:,} tokens, τ "
                  + ", ".join(f"{k} {v:.2f}" for k, v in tau.items()) + (" (earlier)" if known else ""),
                  file=sys.stderr, flush=True)
            offset += tokens
            continue
        if not os.path.isdir(ckpt):                       # gone (another machine): the points --out has for it
            if not cached.get(key):
                raise UserError(f"--run {run_dir}: no checkpoints/ folder, and {a.out} has no points of that run "
                                f"measured with these settings")
            for p in cached[key]:
                points.append({"run": key, **p, "tokens_total": offset + p["tokens_seen"]})
            print(f"{run_dir}: folder gone, {len(cached[key])} earlier points kept", file=sys.stderr, flush=True)
            offset += cached[key][-1]["tokens_seen"]
            continue
        on_disk = {int(d.split("_")[1]): d for d in os.listdir(ckpt) if d.startswith("step_")}
        known = {p["step"]: p for p in cached.get(key, []) if p["step"] != "end"}
        last = 0
        for step in sorted(set(on_disk) | set(known)):
            written = os.stat(os.path.join(ckpt, on_disk[step], STATE_FILE)).st_mtime_ns if step in on_disk else None
            reuse = step in known and (written is None                  # rotated away since it was measured
                                       or known[step].get("written") in (None, written))   # None: stamp not kept yet
            if reuse:                                     # measured by an earlier call with these settings
                p = known[step]
                last, tau = p["tokens_seen"], p["tau"]
            else:
                with tempfile.TemporaryDirectory() as tmp:
                    out = os.path.join(tmp, "draft")
                    state = export_checkpoint(os.path.join(ckpt, on_disk[step]), out)
                    tau = measure_tau(target, out, spec, prompts, a.max_new_tokens, a.dtype)
                last = state.get("tokens_seen", 0)
            points.append({"run": key, "step": step, "tokens_seen": last,
                           "tokens_total": offset + last, "tau": tau, "written": written or known[step].get("written")})
            print(f"{run_dir} step {step}: {offset + last:,} tokens, τ "
                  + ", ".join(f"{k} {v:.2f}" for k, v in tau.items())
                  + (" (earlier)" if reuse else ""), file=sys.stderr, flush=True)
        offset += last
    trends = {k: trend(points, k, a.goal) for k in sets}
    home = os.path.expanduser("~") + os.sep
    result = {"format": FORMAT, "runs": [r.replace(home, "~/") for r in a.run], **settings, "points": points,
              "evals": evals, "trend": trends,
              "meta": report.run_metadata()}
    report.write_json_atomic(a.out, result)
    png = plot(result, report.sibling(a.out, ".png"))
    rows = [[f"{p['tokens_total']:,}", p["step"]] + [f"{p['tau'][k]:.2f}" for k in sets] for p in points]
    text = report.format_table(["training tokens", "step"] + [f"τ {k}" for k in sets], rows)
    text += "\n\n" + trend_text(trends, a.goal)
    print(text)
    report.write_text_atomic(report.sibling(a.out, ".md"), text + "\n")
    print(f"wrote {os.path.abspath(a.out)}\n      {png}")
    return 0


def trend(points: list[dict], name: str, goal: float) -> dict:
    """Least-squares line τ = a + b * log2(tokens) through the points of the later half of the budget (the recent
    trend; the first runs trained on other data): b is the gain per doubling of the budget, and tokens_for_goal
    where the line reaches `goal` (None when it does not rise)."""
    import numpy as np
    if not points:
        return {"points_fitted": 0}
    half = points[-1]["tokens_total"] / 2
    pts = [p for p in points if p["tokens_total"] >= half and p["tokens_total"] > 0]
    out = {"points_fitted": len(pts), "from_tokens": pts[0]["tokens_total"] if pts else None}
    if len(pts) < 3:
        return out
    x = np.log2([p["tokens_total"] for p in pts])
    y = np.array([p["tau"][name] for p in pts])
    b, a = np.polyfit(x, y, 1)
    now = float(a + b * x[-1])
    out.update(gain_per_doubling=float(b), tau_fit_at_end=now, residual_std=float(np.std(y - (a + b * x))),
               tokens_for_goal=float(2 ** ((goal - a) / b)) if b > 0 else None)
    return out


def trend_text(trends: dict, goal: float) -> str:
    lines = []
    for name, t in trends.items():
        if "gain_per_doubling" not in t:
            lines.append(f"{name}: too few points for a trend")
            continue
        need = (f"τ {goal} at ~{t['tokens_for_goal']:.3g} tokens" if t["tokens_for_goal"] is not None
                else f"τ {goal} not reached: the trend does not rise")
        lines.append(f"{name}: trend over the last {t['points_fitted']} points (from {t['from_tokens']:,} tokens): "
                     f"{t['gain_per_doubling']:+.3f} τ per doubling of the tokens (residual ±{t['residual_std']:.2f}), "
                     f"τ {t['tau_fit_at_end']:.2f} at the end; {need}")
    return "\n".join(lines)


def parse_run_arg(arg: str):
    """'DIR' -> (DIR, None); 'DIR=DRAFT:TOKENS' -> (DIR, (DRAFT, TOKENS))."""
    from sglang_eagle3.errors import UserError
    if "=" not in arg:
        return arg, None
    run_dir, _, rest = arg.partition("=")
    draft_dir, _, tokens = rest.rpartition(":")
    try:
        n = int(tokens.replace(",", "").replace("_", ""))
    except ValueError:
        n = -1
    if not run_dir or not draft_dir or n <= 0:
        raise UserError(f"--run {arg}: expected DIR=DRAFT:TOKENS (the run's final draft and its tokens, > 0)")
    return run_dir, (draft_dir, n)


def read_earlier(path: str) -> dict:
    """An earlier --out (this format), or {} if there is none or it is unreadable."""
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return {}
    return old if isinstance(old, dict) and old.get("format") == FORMAT else {}


def shareable_path(path: str) -> str:
    """A run or draft folder as the curve file stores it: under the home folder as ~/..., inside the repository
    relative to it, else absolute (the file ships with a draft; '~' keeps the user's name and machine out of it and
    reads back the same on any account)."""
    from sglang_eagle3.paths import REPO_ROOT

    full = os.path.abspath(os.path.expanduser(path))
    rel = os.path.relpath(full, REPO_ROOT)
    if not rel.startswith(".."):
        return rel
    home = os.path.expanduser("~")
    return "~" + full[len(home):] if full == home or full.startswith(home + os.sep) else full


def earlier_evals(old: dict) -> dict[str, list[dict]]:
    """{run dir (shareable_path): held-out eval records} of an earlier --out (any settings: they come from the
    trainer)."""
    out = {}
    for r in old.get("evals", []):
        rec = {k: v for k, v in r.items() if k not in ("run", "tokens_total")}
        out.setdefault(shareable_path(r.get("run", "")), []).append(rec)
    return out


def earlier_points(old: dict, settings: dict) -> dict[str, list[dict]]:
    """{run dir (shareable_path): points} of an earlier --out (read_earlier) measured with the same settings; {} if
    none or different."""
    if not old or old.get("dtype", settings["dtype"]) != settings["dtype"] or any(
            old.get(k) != settings[k] for k in ("tree", "n", "max_new_tokens")):
        return {}
    by_run, offset, prev_run, prev_total = {}, 0, None, 0
    for p in old.get("points", []):
        if sorted(p.get("tau", {})) != settings["datasets"]:
            return {}
        run = shareable_path(p["run"])
        if run != prev_run and prev_run is not None:          # tokens_total counts on from the previous run's end
            offset = prev_total
        prev_run, prev_total = run, p["tokens_total"]
        seen = p.get("tokens_seen", p["tokens_total"] - offset)  # files written before tokens_seen was stored
        by_run.setdefault(run, []).append({"step": p["step"], "tokens_seen": seen, "tau": p["tau"],
                                           "written": p.get("written"),
                                           **({"draft": p["draft"]} if "draft" in p else {})})
    return by_run


def plot(r: dict, path: str) -> str:
    fig, (ax1, ax2) = report.subplots(1, 2, figsize=(11, 4))
    for name in (r["points"][0]["tau"] if r["points"] else {}):
        line, = ax1.plot([p["tokens_total"] for p in r["points"]], [p["tau"][name] for p in r["points"]], "o-",
                         label=f"measured τ, {name}")
        t = r.get("trend", {}).get(name, {})
        if "gain_per_doubling" in t:                      # the fitted line over the fitted range
            x0, x1 = t["from_tokens"], r["points"][-1]["tokens_total"]
            y1 = t["tau_fit_at_end"]
            y0 = y1 - t["gain_per_doubling"] * math.log2(x1 / x0)
            ax1.plot([x0, x1], [y0, y1], ":", color=line.get_color(),
                     label=f"trend {name}: {t['gain_per_doubling']:+.2f} τ per doubling")
    ev = r["evals"]
    if ev:
        ax1.plot([e["tokens_total"] for e in ev], [e["accept_length"] for e in ev], "--", color="gray",
                 label="simulated τ (held-out, chain of 7)")
        steps = sorted({int(key[4:]) for e in ev for key in e if key.startswith("acc_")})
        for k in sorted({steps[0], steps[len(steps) // 2], steps[-1]}) if steps else []:   # first, middle, last
            ax2.plot([e["tokens_total"] for e in ev], [e[f"acc_{k}"] for e in ev], "o-", ms=3, label=f"acc_{k}")
    t = r["tree"]
    ax1.set(xlabel="training tokens", ylabel="τ (tokens per target forward)",
            title=f"Acceptance vs budget (tree {t['num_steps']}/{t['topk']}/{t['num_draft_tokens']})")
    ax1.legend(fontsize=7)
    ax2.set(xlabel="training tokens", ylabel="held-out accuracy", title="Per-step accuracy (held-out rows)")
    ax2.legend(fontsize=7)
    return report.save_figure(fig, path)


def main(argv=None) -> int:
    return run_cli("learning_curve", run, argv)
