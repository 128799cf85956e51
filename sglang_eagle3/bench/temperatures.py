"""bench_acceptance --temperature 0,0.7,1: the whole benchmark at each temperature in turn, then side by side.

Each temperature is a complete run of its own (its own JSON, table and PNG, OUT_T<t>.json, resumable as any run);
OUT then holds every column's speed-up and τ per set at each temperature, in one table and one chart.
"""
from __future__ import annotations

import math
import os

from sglang_eagle3.bench import report

FORMAT = "sglang_eagle3.bench_acceptance_temperatures/1"


def parse_temperatures(text) -> list[float]:
    """'0,0.7,1' -> [0.0, 0.7, 1.0]; a bad entry is a one-line error naming it."""
    from sglang_eagle3.errors import UserError
    out = []
    for part in str(text).split(","):
        try:
            t = float(part)
        except ValueError:
            raise UserError(f"--temperature {text}: {part.strip()!r} is not a number (a number >= 0, or a comma "
                            "list of them)") from None
        if not (t >= 0 and math.isfinite(t)):
            raise UserError(f"--temperature {text}: {part.strip()} must be a finite number >= 0")
        out.append(t)
    if len(set(out)) != len(out):
        raise UserError(f"--temperature {text}: name each temperature once")
    return out


def per_temperature_out(out: str, t: float) -> str:
    stem, ext = os.path.splitext(out)
    return f"{stem}_T{t:g}{ext or '.json'}"


def with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """argv without `flag` (as `flag V` or `flag=V`), then `flag value`."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x == flag:
            skip = True
        elif not x.startswith(flag + "="):
            out.append(x)
    return out + [flag, value]


def columns_of(result: dict) -> dict[str, dict]:
    """A run's {column: {set: (median speed-up, τ)}} in either mode (--drafters' columns, or the draft's `eagle`)."""
    sets = {**result["sets"], "average": result["average"]}
    if "columns" in result:
        return {c: {s: (v[c]["speedup_median"], v[c]["tau"]) for s, v in sets.items()} for c in result["columns"]}
    return {"eagle": {s: (v.get("speedup_median"), v.get("tau")) for s, v in sets.items()}}


def combine(results: dict[float, dict]) -> dict:
    first = next(iter(results.values()))
    return {"format": FORMAT, "meta": first["meta"], "config": {k: v for k, v in first["config"].items()
                                                                  if k not in ("temperature", "seed")},
            "seed": first["config"].get("seed"),
            "temperatures": {f"{t:g}": {"out": r["_out"], "columns": columns_of(r)} for t, r in results.items()}}


def markdown(combined: dict) -> str:
    temps = combined["temperatures"]
    cols = list(next(iter(temps.values()))["columns"])
    sets = list(next(iter(next(iter(temps.values()))["columns"].values())))
    head = ["set"] + [f"{c} T={t}" for t in temps for c in cols]
    def cell(t, c, s):
        speedup, tau = temps[t]["columns"][c][s]
        return f"{report.fmt_speedup(speedup)} (τ {report.fmt_num(tau)})"
    rows = [[s] + [cell(t, c, s) for t in temps for c in cols] for s in sets]
    return "\n".join([
        f"Speed-up over vanilla (median over prompts) and τ per set at each temperature (batch 1, "
        f"{combined['config'].get('max_new_tokens')} new tokens per turn, {combined['config'].get('dtype')}, seed "
        f"{combined['seed']}). Host: {combined['meta'].get('cpu')}. Each temperature's full table: "
        + ", ".join(os.path.basename(v["out"]) for v in temps.values()) + ".", "",
        report.format_table(head, rows)])


def plot(combined: dict, path: str) -> str:
    temps = combined["temperatures"]
    cols = list(next(iter(temps.values()))["columns"])
    fig, (ax,) = report.subplots(1, 1, figsize=(10, 4.5))
    labels = [f"{c} T={t}" for t in temps for c in cols]
    values = [temps[t]["columns"][c]["average"][0] or 0.0 for t in temps for c in cols]
    ax.bar(range(len(labels)), values, color=[f"C{i % len(cols)}" for i in range(len(labels))])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set(ylabel="average speed-up over vanilla", title="Speed-up per temperature (mean over sets of the medians)")
    return report.save_figure(fig, path)


def run_each(run, argv: list[str], temps: list[float], out: str) -> int:
    """run(argv) once per temperature, into OUT_T<t>.json each; then OUT side by side."""
    import json
    results = {}
    for t in temps:
        path = per_temperature_out(out, t)
        code = run(with_flag(with_flag(argv, "--temperature", f"{t:g}"), "--out", path))
        if code:
            return code
        with open(path) as f:
            results[t] = {**json.load(f), "_out": path}
    combined = combine(results)
    report.write_outputs(out, combined, markdown(combined), plot, ".png")
    return 0
