"""bench_acceptance --drafters: every drafter side by side on the same prompts, in one run.

Columns: `vanilla` and each name of --drafters, DRAFTER[-auto] with DRAFTER one of eagle (the draft model's tree),
suffix (continuations of the context, no draft model) and hybrid (both in one tree); `-auto` sizes the tree each step
by the cost model (engine/cost_model.py) instead of the profile's fixed tree. Every prompt is decoded by each column
in an order rotated from prompt to prompt, all on one target runtime, so a slow spell of the machine hits all alike.

Besides the five eval sets, two repetition-heavy sets built from them: `mt_bench_turn2` (MT-bench's second turns,
asked after the target's own greedy first answer, which every column is given the same) and `code_edit`
(HumanEval's functions with their reference bodies, asked to be rewritten with a small change).

Per set and column: tokens/s, speed-up over vanilla (median over prompts, and of the totals), τ (tokens per decoding
step), the share of accepted draft tokens that the context alone proposed, the added cost per step (draft and
proposals, ms) and, greedy, how many outputs equal vanilla's.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from typing import Optional

from sglang_eagle3.bench import report

FORMAT = "sglang_eagle3.bench_drafters/1"
BUILT_SETS = ("mt_bench_turn2", "code_edit")
EDITS = ("Rewrite this function so that every variable has a longer, descriptive name. Keep everything else as it is.",
         "Rewrite this function with a comment above each line that says what the line does.",
         "Rewrite this function with type hints on its arguments and its return value. Change nothing else.")


def turn_seed(seed: int, set_index: int, prompt_index: int, turn: int) -> int:
    """Per (set, prompt, turn) seed: both runs of a prompt get the same one, and reruns repeat."""
    return (seed * 1_000_003 + set_index * 10_007 + prompt_index * 101 + turn) % (2 ** 62)


def parse_drafters(text: str) -> list[tuple[str, str, str, str]]:
    """'eagle,hybrid-auto,eagle:top-k' -> [(column, drafter, tree, draft children)]; a column's `:top-k` picks the
    draft's children as the EAGLE authors do at temperature > 0 (default: sampled)."""
    from sglang_eagle3.engine.speculation import DRAFT_CHILDREN, DRAFTERS
    from sglang_eagle3.errors import UserError
    out = []
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise UserError(f"--drafters {text!r}: name at least one drafter ({', '.join(DRAFTERS)}, each optionally "
                        "-auto)")
    for name in names:
        column, _, children = name.partition(":")
        drafter, _, tree = column.partition("-")
        if drafter not in DRAFTERS or tree not in ("", "auto") or children not in ("", *DRAFT_CHILDREN):
            raise UserError(f"--drafters {name}: expected DRAFTER or DRAFTER-auto, optionally :top-k or :sampled, "
                            f"with DRAFTER one of {', '.join(DRAFTERS)}")
        out.append((name, drafter, tree or "profile", children or "sampled"))
    if len({c for c, *_ in out}) != len(out):
        raise UserError(f"--drafters {text!r}: name each drafter once")
    return out


def check_choice_into(path: str) -> None:
    """--choose-into before the run (it was found only after it): a readable profile, in a folder this run can
    write its new version into."""
    from sglang_eagle3.engine.profile import check_rewritable
    from sglang_eagle3.errors import UserError
    from sglang_eagle3.models.config import ConfigError
    try:
        check_rewritable(path)
    except ConfigError as e:
        raise UserError(f"--choose-into {path}: {e}") from None


def code_edit_prompts(path: str, n: int) -> list[list[str]]:
    """HumanEval's prompts with their reference bodies as whole functions, each asked to be rewritten."""
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if len(out) >= n:
                break
            row = json.loads(line)
            code = row["turns"][0].split("\n", 1)[1] if row["turns"][0].startswith("Complete the code") else \
                row["turns"][0]
            code = code.strip("\n") + "\n" + (row.get("reference") or [""])[0]
            out.append([f"{EDITS[i % len(EDITS)]}\n\n```python\n{code.rstrip()}\n```"])
    return out


def conversation(engine, history: list[dict], turns: list[str], make_params) -> dict:
    """Each user turn after the run's own previous answers (the fixed history first); totals over the turns."""
    messages = list(history)
    out = {"tokens": 0, "time_s": 0.0, "prefill_s": 0.0, "steps": 0, "accepted": 0, "context": 0, "draft_s": 0.0,
           "drafted": 0, "token_ids": []}
    for k, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        t0 = time.perf_counter()
        outs, st = engine.generate([list(messages)], make_params(k), batch_size=1)
        out["time_s"] += time.perf_counter() - t0
        o = outs[0]
        messages.append({"role": "assistant", "content": o.text})
        out["token_ids"].append(o.token_ids)
        out["tokens"] += len(o.token_ids)
        out["steps"] += len(o.accept_lengths) - 1                 # [0] is the prefill's token
        out["accepted"] += len(o.token_ids) - len(o.accept_lengths)   # draft tokens accepted (no bonus, no prefill)
        out["context"] += o.context_tokens
        out["draft_s"] += st.draft_time
        out["prefill_s"] += st.prefill_time
        out["drafted"] += st.drafted_steps
    return out


def decode_s(run: dict) -> float:
    """A run's seconds after its prefills (0 where a result file predates prefill_s: no decode-only figure)."""
    return run["time_s"] - run["prefill_s"] if "prefill_s" in run else 0.0


def summarize(rows: list[dict], columns: list[str], greedy: bool) -> dict:
    out = {}
    van = [r["vanilla"] for r in rows]
    tps_v = report.safe_div(sum(v["tokens"] for v in van), sum(v["time_s"] for v in van))
    for c in ["vanilla", *columns]:
        runs = [r[c] for r in rows]
        tokens, secs = sum(x["tokens"] for x in runs), sum(x["time_s"] for x in runs)
        steps, accepted = sum(x["steps"] for x in runs), sum(x["accepted"] for x in runs)
        tps = report.safe_div(tokens, secs)
        s = {"tokens": tokens, "time_s": secs, "tokens_per_s": tps, "decode_steps": steps,
             "tau": report.safe_div(accepted + steps, steps),
             "speedup_median": report.median(report.safe_div(x["tokens"] / x["time_s"], v["tokens"] / v["time_s"])
                                             for x, v in zip(runs, van) if x["time_s"] and v["time_s"]),
             "speedup_total": report.safe_div(tps, tps_v) if tps and tps_v else None,
             # the same without the prompt's prefill (identical work in every column): the decoding's own speed-up
             "decode_speedup_median": report.median(
                 report.safe_div(x["tokens"] / decode_s(x), v["tokens"] / decode_s(v))
                 for x, v in zip(runs, van) if decode_s(x) and decode_s(v)),
             "prefill_share": report.safe_div(sum(v.get("prefill_s", 0.0) for v in van), sum(v["time_s"] for v in van)),
             "context_share": report.safe_div(sum(x["context"] for x in runs), accepted) if accepted else 0.0,
             "added_ms_per_step": 1e3 * report.safe_div(sum(x["draft_s"] for x in runs), steps) if steps else 0.0,
             "drafted_steps": sum(x["drafted"] for x in runs)}
        if greedy:
            s["identical_to_vanilla"] = sum(x["token_ids"] == v["token_ids"] for x, v in zip(runs, van))
        out[c] = s
    out["n_prompts"] = len(rows)
    return out


def markdown(result: dict) -> str:
    cols = result["columns"]
    sets = list(result["sets"])
    head = ["set"] + [f"{c} speed-up" for c in cols] + [f"{c} τ" for c in ["vanilla", *cols][1:]]
    rows = []
    for name in sets + ["average"]:
        s = result["sets"].get(name) or result["average"]
        rows.append([name] + [report.fmt_speedup(s[c]["speedup_median"]) for c in cols] +
                    [report.fmt_num(s[c]["tau"]) for c in cols])
    detail_head = ["set", "column", "tokens/s", "speed-up (totals)", "decode-only speed-up", "τ", "context share",
                   "added ms/step", "drafted steps"] + (["identical"] if result["config"]["temperature"] == 0 else [])
    detail = []
    for name in sets:
        s = result["sets"][name]
        for c in ["vanilla", *cols]:
            x = s[c]
            detail.append([name, c, report.fmt_num(x["tokens_per_s"], 1), report.fmt_speedup(x["speedup_total"]),
                           report.fmt_speedup(x.get("decode_speedup_median")), report.fmt_num(x["tau"]),
                           f"{100 * x['context_share']:.0f}%",
                           report.fmt_num(x["added_ms_per_step"], 2), str(x["drafted_steps"])] +
                          ([f"{x['identical_to_vanilla']}/{s['n_prompts']}"]
                           if result["config"]["temperature"] == 0 else []))
    cfg = result["config"]
    return "\n".join([
        f"Drafters side by side at T={cfg['temperature']} (batch 1, {cfg['max_new_tokens']} new tokens per turn, "
        f"{cfg['dtype']}; speed-up = median over prompts of tokens/s over vanilla's, each prompt decoded by every "
        f"column in a rotated order; τ = tokens per decoding step). Host: {result['meta'].get('cpu')}.", "",
        report.format_table(head, rows), "",
        "Context share = accepted draft tokens that the context alone proposed; added ms/step = draft and "
        "proposal time per decoding step; decode-only speed-up = the median speed-up without the prompts' prefills "
        "(the same work in every column; long prompts, as CNN/DM's, spend a large share of the time there).", "",
        report.format_table(detail_head, detail)])


def plot(result: dict, path: str) -> str:
    fig, (ax,) = report.subplots(1, 1, figsize=(12, 4.5))
    cols, sets = result["columns"], list(result["sets"])
    width = 0.8 / len(cols)
    for j, c in enumerate(cols):
        ax.bar([i + j * width for i in range(len(sets))], [result["sets"][s][c]["speedup_median"] or 0 for s in sets],
               width, label=c)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sets))], sets)
    ax.set(ylabel="speed-up over vanilla (median)", title=f"Drafters side by side, T={result['config']['temperature']}")
    ax.legend()
    return report.save_figure(fig, path)


def run_drafters(a, sets: dict[str, str], target: str, base_draft: Optional[str], columns: list) -> int:
    """a: bench_acceptance's arguments; sets: name -> jsonl; columns: [(name, its Settings)] (resolved before
    anything loads); base_draft: None where no column drafts with a draft model."""
    import torch  # noqa: F401  (the engines' dtype)
    from tqdm import tqdm

    from sglang_eagle3.engine.engine import SpeculativeEngine
    from sglang_eagle3.engine.loader import load_engine
    from sglang_eagle3.engine.prompts import load_prompts
    from sglang_eagle3.engine.settings import Settings
    from sglang_eagle3.engine.verify import SamplingParams

    first = next((st for _, st in columns if st.draft), columns[0][1])     # loads the draft where a column uses it
    base_engine = load_engine(target, first)
    tm, draft = base_engine.target, base_engine.draft
    engines = {"vanilla": SpeculativeEngine(tm, None, Settings(first.dtype))}
    for name, st in columns:
        engines[name] = SpeculativeEngine(tm, draft if st.draft else None, st)
    base = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
                          ignore_eos=a.ignore_eos)
    warm = [[{"role": "user", "content": "Hello"}]]
    for eng in engines.values():
        eng.generate(warm, SamplingParams(max_new_tokens=8, ignore_eos=True))
    data = {}
    for name, path in sets.items():                      # in --datasets' order
        if name == "code_edit":
            data[name] = code_edit_prompts(path, a.n)
        elif name == "mt_bench_turn2":
            data[name] = [t for t in load_prompts(path, limit=a.n) if len(t) > 1]
        else:
            data[name] = load_prompts(path, limit=a.n)
    config = {"target": target, "draft": os.path.abspath(base_draft) if base_draft else None, "drafters": a.drafters,
              "dtype": first.dtype, "temperature": a.temperature, "n": a.n, "max_new_tokens": a.max_new_tokens,
              "seed": a.seed}
    result = {"format": FORMAT, "config": config, "meta": report.run_metadata(),
              "columns": [c for c, _ in columns], "sets": {}, "average": None}
    bar = tqdm(total=sum(len(v) for v in data.values()), desc="prompts", unit="prompt", dynamic_ncols=True)
    order = list(engines)
    for si, (name, convs) in enumerate(data.items()):
        rows = []
        for i, turns in enumerate(convs):
            def make_params(k, i=i):
                return replace(base, seed=turn_seed(a.seed, si, i, k)) if a.temperature > 0 else base
            history, asked = [], turns if name == "mt_bench" else turns[:1]
            if name == "mt_bench_turn2":                     # the target's own first answer, the same for all
                first_out, _ = engines["vanilla"].generate([[{"role": "user", "content": turns[0]}]],
                                                           replace(base, temperature=0.0), batch_size=1)
                history = [{"role": "user", "content": turns[0]},
                           {"role": "assistant", "content": first_out[0].text}]
                asked = turns[1:2]
            rot = order[i % len(order):] + order[:i % len(order)]
            rows.append({c: conversation(engines[c], history, asked, make_params) for c in rot})
            bar.update(1)
        result["sets"][name] = summarize(rows, result["columns"], a.temperature == 0)
        result["average"] = average(result)
        report.write_json_atomic(a.out, result)
    bar.close()
    report.write_outputs(a.out, result, markdown(result), plot, ".png")
    if a.choose_into:
        print(f"chosen into {a.choose_into}: {record_choice(a.choose_into, result, a.argv)}")
    return 0


def record_choice(path: str, result: dict, argv: list[str]) -> str:
    """PROFILE['by_host'][this host's kind]['drafting'] = the column with the best average speed-up of this run (the
    drafter and tree sizing `generate` and `serve` then run by default on such a host), with what measured it."""
    from sglang_eagle3.engine.profile import host_kind, set_drafting
    speedups = {c: result["average"][c]["speedup_median"] for c in result["columns"]}
    best = max(speedups, key=lambda c: speedups[c] or 0.0)
    drafter, _, tree = best.partition("-")
    kind = host_kind("cpu")
    set_drafting(path, kind, {"drafter": drafter, "tree": tree or "profile",
                              "measured": {"datasets": list(result["sets"]), "speedup_average": speedups,
                                           "temperature": result["config"]["temperature"],
                                           "cpu": result["meta"].get("cpu"),
                                           "command": "bench/bench_acceptance.py " + " ".join(argv)}})
    return f"{kind}: {best} ({speedups[best]:.2f}x average)"


def average(result: dict) -> dict:
    """Per column, the mean over sets of each number."""
    sets = list(result["sets"].values())
    out = {}
    for c in ["vanilla", *result["columns"]]:
        keys = [k for k, v in sets[0][c].items() if isinstance(v, (int, float))]
        out[c] = {k: sum(vals) / len(vals) for k in keys
                  if (vals := [s[c][k] for s in sets if s[c].get(k) is not None])}
    return out
