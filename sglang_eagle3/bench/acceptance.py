"""Acceptance length and speed-up per eval set, in the shape of the EAGLE-3 paper's main table.

For every prompt of a set we decode twice in the same engine runtime: vanilla (target only) and
speculative (target + EAGLE-3 draft), alternating which goes first so slow drift (thermal, other jobs)
hits both. Prompts are chats (the target's chat template). MT-bench's second turn is asked after the
run's OWN first answer, so the vanilla and speculative conversations can differ at temperature 1.

tau (mean acceptance length): tokens emitted per draft-and-verify cycle, bonus token included,
pooled over all decoding steps of the set; the token sampled at prefill is not a cycle and is left out. Sets with
more than one turn (MT-bench) also give τ per turn, pooled over the prompts that have that turn.
Speed-up: per prompt (speculative tokens/s over vanilla tokens/s, median over prompts) and the ratio of
the set's total tokens/s.

--baseline-draft B compares two drafts side by side: every prompt is decoded three times (vanilla, --draft,
B; the order rotated from prompt to prompt), so both drafts are measured against the same vanilla run in the
same spell of the machine, and their tokens/s ratio per prompt needs no second benchmark run.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections import Counter

from sglang_eagle3.bench import report, run_cli
from sglang_eagle3.bench.acceptance_report import TAU_DEFINITION, markdown_report, plot_histograms, tree_text
from sglang_eagle3.bench.contention import LOADS, start_busy
from sglang_eagle3.bench.drafters import turn_seed

FORMAT = "sglang_eagle3.bench_acceptance/1"


# ---- inputs ----------------------------------------------------------------------------------


EVAL_SETS = ["mt_bench", "humaneval", "gsm8k", "alpaca", "sum"]      # the eval sets under <data>/eval
BUILT_FROM = {"mt_bench_turn2": "mt_bench", "code_edit": "humaneval"}


def resolve_sets(names: list[str], data: str, built_ok: bool = False) -> dict[str, str]:
    """'mt_bench' -> <data>/eval/mt_bench.jsonl; a path ending in .jsonl is used as is (named by its stem); the sets
    built from others (built_ok, bench_acceptance --drafters: mt_bench_turn2, code_edit) name the file they are built
    from; elsewhere they are refused (the other set's prompts would run under their name)."""
    from sglang_eagle3.errors import UserError
    built = BUILT_FROM
    out = {}
    for name in names:
        if name in built and not built_ok:
            raise UserError(f"--datasets {name}: built from {built[name]} by bench_acceptance --drafters only; name "
                            f"{built[name]} here")
        path = name if name.endswith(".jsonl") else os.path.join(data, "eval", f"{built.get(name, name)}.jsonl")
        key = name if name in built else os.path.splitext(os.path.basename(path))[0]
        if not os.path.isfile(path):
            folder = os.path.dirname(path)
            have = sorted(f[:-6] for f in os.listdir(folder) if f.endswith(".jsonl")) if os.path.isdir(folder) else []
            raise UserError(f"--datasets {name}: {path} does not exist"
                            + (f" (available: {', '.join(have)})" if have else " (set EAGLE3_DATA or --data)"))
        if key in out:
            raise UserError(f"--datasets: {key} given twice")
        out[key] = path
    return out


# ---- one conversation ------------------------------------------------------------------------


def run_conversation(engine, turns: list[str], make_params) -> dict:
    """Ask each user turn after the run's own previous answers; time each generate call (wall clock)."""
    messages, texts, ids, steps_by_turn = [], [], [], []
    wall = 0.0
    for k, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        t0 = time.perf_counter()
        outs, _ = engine.generate([list(messages)], make_params(k), batch_size=1)
        wall += time.perf_counter() - t0
        o = outs[0]
        messages.append({"role": "assistant", "content": o.text})
        texts.append(o.text)
        ids.append(o.token_ids)
        steps_by_turn.append(list(o.accept_lengths[1:]))     # [0] is the prefill token
    return {"time_s": wall, "tokens": sum(len(t) for t in ids), "token_ids": ids, "texts": texts,
            "accept_lengths": [a for steps in steps_by_turn for a in steps], "accept_lengths_by_turn": steps_by_turn}


def bench_prompt(van_engine, spec_engine, turns, make_params, rotate: int = 0, in_draft_vocab=None,
                 baseline_engine=None) -> dict:
    """in_draft_vocab: [vocab] bool, the target ids the draft can propose (counts the vanilla tokens it holds).
    baseline_engine: a second draft's engine, run on the same turns (its numbers under "baseline").
    The runs go in the order vanilla, spec(, baseline) rotated left by `rotate` (the prompt's index: who goes first
    alternates from prompt to prompt)."""
    engines = {"vanilla": van_engine, "spec": spec_engine}
    if baseline_engine is not None:
        engines["baseline"] = baseline_engine
    order = list(engines)
    order = order[rotate % len(order):] + order[:rotate % len(order)]
    runs = {name: run_conversation(engines[name], turns, make_params) for name in order}
    v, s = runs["vanilla"], runs["spec"]
    row = {"turns": len(turns), "tokens_vanilla": v["tokens"], "time_vanilla_s": v["time_s"],
           **_spec_fields(v, s), "spec_first": order.index("spec") < order.index("vanilla"),
           "in_draft_vocab": None if in_draft_vocab is None else
           sum(int(in_draft_vocab[t].sum()) for t in v["token_ids"] if len(t)),
           "_accept_lengths_by_turn": s["accept_lengths_by_turn"]}
    if baseline_engine is not None:
        b = runs["baseline"]
        row["order"] = order
        row["baseline"] = _spec_fields(v, b)
        row["_baseline_accept_lengths_by_turn"] = b["accept_lengths_by_turn"]
    return row


def _spec_fields(v: dict, s: dict) -> dict:
    """A speculative run's numbers against the vanilla run of the same turns."""
    tps_v, tps_s = report.safe_div(v["tokens"], v["time_s"]), report.safe_div(s["tokens"], s["time_s"])
    return {"tokens_spec": s["tokens"], "time_spec_s": s["time_s"],
            "speedup": report.safe_div(tps_s, tps_v) if tps_v and tps_s else None,
            "decode_steps": len(s["accept_lengths"]), "accepted_tokens": sum(s["accept_lengths"]),
            "tau_by_turn": [report.safe_div(sum(t), len(t)) for t in s["accept_lengths_by_turn"]],
            "identical": v["token_ids"] == s["token_ids"]}


def baseline_rows(rows: list[dict]) -> list[dict]:
    """The rows as the baseline draft's: its speculative numbers in place of the main draft's."""
    return [{**{k: v for k, v in r.items() if k not in ("baseline", "order")}, **r["baseline"],
             "_accept_lengths_by_turn": r["_baseline_accept_lengths_by_turn"]} for r in rows]


def summarize_baseline(rows: list[dict], greedy: bool, max_accept: int) -> dict:
    """The baseline draft's set totals (per-prompt numbers stay in the main set's per_prompt[i]["baseline"]), and
    the median over prompts of the main draft's tokens/s over the baseline's (the same vanilla run divides both)."""
    out = summarize_set(baseline_rows(rows), greedy, max_accept)
    del out["per_prompt"]
    out["draft_over_baseline_median"] = report.median(
        r["speedup"] / r["baseline"]["speedup"] for r in rows if r["speedup"] and r["baseline"]["speedup"])
    return out


def summarize_set(rows: list[dict], greedy: bool, max_accept: int = 1) -> dict:
    """Set totals; the histogram has a bin for every possible step length 1..max_accept (num_steps + 1)."""
    hist = Counter(a for r in rows for steps in r["_accept_lengths_by_turn"] for a in steps)
    steps, acc = sum(r["decode_steps"] for r in rows), sum(r["accepted_tokens"] for r in rows)
    tok_v, tok_s = sum(r["tokens_vanilla"] for r in rows), sum(r["tokens_spec"] for r in rows)
    t_v, t_s = sum(r["time_vanilla_s"] for r in rows), sum(r["time_spec_s"] for r in rows)
    tps_v, tps_s = report.safe_div(tok_v, t_v), report.safe_div(tok_s, t_s)
    out = {"n_prompts": len(rows), "tau": report.safe_div(acc, steps),
           "speedup_median": report.median(r["speedup"] for r in rows if r["speedup"] is not None),
           "speedup_total": report.safe_div(tps_s, tps_v) if tps_v and tps_s else None,
           "tokens_per_s_vanilla": tps_v, "tokens_per_s_spec": tps_s,
           "tokens_vanilla": tok_v, "tokens_spec": tok_s, "time_vanilla_s": t_v, "time_spec_s": t_s,
           "decode_steps": steps,
           # share of the target's own (vanilla) tokens the draft vocabulary holds: no draft can be accepted on
           # the others, so it caps the acceptance rate
           "draft_vocab_coverage": report.safe_div(sum(r["in_draft_vocab"] for r in rows), tok_v)
           if all(r.get("in_draft_vocab") is not None for r in rows) else None,
           "accept_histogram": {str(k): hist[k] for k in range(1, max(max(hist, default=1), max_accept) + 1)}}
    if max((r["turns"] for r in rows), default=1) > 1:
        out["tau_by_turn"] = tau_by_turn(rows)
    if greedy:
        out["identical_to_vanilla"] = sum(r["identical"] for r in rows)
    out["per_prompt"] = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    return out


def tau_by_turn(rows: list[dict]) -> dict:
    """{"1": tau of the first turns, "2": of the second, ...}: steps pooled over the prompts that have that turn
    (MT-bench's second question comes after the run's own first answer, a longer context and a new request)."""
    by_turn: dict[int, list[int]] = {}
    for r in rows:
        for k, steps in enumerate(r["_accept_lengths_by_turn"], start=1):
            by_turn.setdefault(k, []).extend(steps)
    return {str(k): report.safe_div(sum(v), len(v)) for k, v in sorted(by_turn.items())}


def average_row(sets: dict) -> dict:
    def mean(key):
        xs = [s[key] for s in sets.values() if s.get(key) is not None]
        return sum(xs) / len(xs) if xs else None
    out = {"tau": mean("tau"), "speedup_median": mean("speedup_median"), "speedup_total": mean("speedup_total"),
           "tokens_per_s_vanilla": mean("tokens_per_s_vanilla"), "tokens_per_s_spec": mean("tokens_per_s_spec"),
           "draft_vocab_coverage": mean("draft_vocab_coverage"),
           "n_prompts": sum(s["n_prompts"] for s in sets.values()),
           "tokens_spec": sum(s["tokens_spec"] for s in sets.values())}
    if any("draft_over_baseline_median" in s for s in sets.values()):      # a baseline draft's sets
        out["draft_over_baseline_median"] = mean("draft_over_baseline_median")
    return out


# ---- driver ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from sglang_eagle3.engine.settings import add_compile_arg, add_dtype_arg, add_spec_args
    from sglang_eagle3.paths import data_dir
    p = argparse.ArgumentParser(prog="bench_acceptance.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="testbed", help="HF folder or hub id (default: the embedded SmolLM2)")
    p.add_argument("--draft", default=None, help="EAGLE-3 draft folder (default: the shipped draft, if any)")
    p.add_argument("--datasets", default=",".join(EVAL_SETS),
                   help="comma list of eval set names under $EAGLE3_DATA/eval, or .jsonl paths")
    p.add_argument("--data", default=data_dir(), help="data folder (default: $EAGLE3_DATA or ../shared/data)")
    p.add_argument("--n", type=int, default=10, help="prompts per set (default 10)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="per turn (default 256)")
    p.add_argument("--temperature", default="0",
                   help="sampling temperature (default 0: greedy); a comma list (0,0.7,1) runs the whole benchmark at "
                        "each, into OUT_T<t>.json, and writes OUT with them side by side")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling at temperature > 0 (default 1: off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed at temperature > 0 (default 0)")
    p.add_argument("--ignore-eos", action="store_true", help="always decode max-new-tokens per turn")
    add_dtype_arg(p)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--beside", default="idle", choices=LOADS,
                   help="run beside a busy process this benchmark starts and stops itself (bench/contention.py): "
                        "loop (1-thread busy loop), torch2 (2-thread torch job), generate (a second decode)")
    p.add_argument("--out", required=True, help="results JSON; the table goes to .md and the histogram to _hist.png")
    p.add_argument("--fresh", action="store_true", help="ignore sets already in --out (default: resume them "
                                                       "when the run settings match)")
    p.add_argument("--baseline-draft", default=None, metavar="DRAFT",
                   help="a second draft decoded on every prompt beside --draft (same target and tree, the vanilla "
                        "run shared, the order rotated): both drafts' τ and speed-ups side by side in one run")
    p.add_argument("--drafters", default=None, metavar="LIST",
                   help="compare drafters side by side instead (bench/drafters.py): comma list of eagle, suffix, "
                        "hybrid, each optionally -auto (the tree sized each step), e.g. "
                        "eagle,suffix,hybrid,hybrid-auto; --datasets may then also name mt_bench_turn2 and code_edit; "
                        "the tree flags and --profile shape the eagle and hybrid columns (suffix has no draft tree; "
                        "with -auto, --num-draft-tokens is the most a step verifies)")
    p.add_argument("--choose-into", default=None, metavar="PROFILE",
                   help="with --drafters: record the column with the best average speed-up as this host kind's "
                        "default drafter and tree in PROFILE (spec_profile.json: by_host[kind].drafting)")
    add_spec_args(p)
    add_compile_arg(p)
    return p


def _long_only(profile, spec):
    """A profile that runs `spec` below the long-context threshold and the profile's long-context table from it on
    (bench_acceptance decodes one prompt at a time, greedy: what the server runs for such a request)."""
    from sglang_eagle3.engine.profile import SpecProfile
    return SpecProfile({1: spec}, profile.source, long_context=profile.long_context)


def _config(a, target: str, draft: str) -> dict:
    """The settings a stored set must share to be reused (the list of sets may grow)."""
    baseline = {"baseline_draft": os.path.abspath(a.baseline_draft)} if a.baseline_draft else {}
    return {"target": target, "draft": draft, **baseline, "dtype": a.dtype, "temperature": a.temperature,
            "seed": a.seed if a.temperature > 0 else None, **({"top_p": a.top_p} if a.top_p < 1 else {}),
            "n": a.n, "max_new_tokens": a.max_new_tokens, **({"beside": a.beside} if a.beside != "idle" else {}),
            "ignore_eos": a.ignore_eos, "compile": a.compile,
            "spec": {"num_steps": a.num_steps, "topk": a.topk, "num_draft_tokens": a.num_draft_tokens},
            **({"long_context": a.long_context} if getattr(a, "long_context", None) else {})}


def _resumable(out: str, config: dict, fresh: bool) -> tuple[dict, dict]:
    """(finished sets, their baseline summaries) of an earlier run of the same settings."""
    if fresh or not os.path.isfile(out):
        return {}, {}
    try:
        old = report.read_json(out)
    except ValueError:
        return {}, {}
    if old.get("format") != FORMAT or old.get("config") != config:
        print(f"note: {out} was made with other settings; starting over", file=sys.stderr)
        return {}, {}
    return dict(old.get("sets", {})), dict((old.get("baseline") or {}).get("sets", {}))


def run(argv=None) -> int:
    import torch
    from tqdm import tqdm

    from sglang_eagle3.bench.temperatures import parse_temperatures, run_each
    from sglang_eagle3.engine.engine import SpeculativeEngine
    from sglang_eagle3.engine.loader import load_engine
    from sglang_eagle3.engine.prompts import load_prompts
    from sglang_eagle3.engine.settings import Settings, apply_compile_arg, resolve_dtype, settings_from_args
    from sglang_eagle3.engine.verify import SamplingParams
    from sglang_eagle3.errors import UserError, check_at_least, flags_of
    from sglang_eagle3.models.testbed import resolve_target
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    temperatures = parse_temperatures(a.temperature)
    if len(temperatures) > 1:
        if a.choose_into:
            raise UserError(f"--choose-into {a.choose_into} records one temperature's best column: give one "
                            "--temperature")
        check_mode(a)
        return run_each(run, argv, temperatures, a.out)
    a.temperature = temperatures[0]
    columns = check_mode(a)
    a.dtype = resolve_dtype(a.dtype)
    apply_compile_arg(a)
    check_at_least(1, flags_of(a, "n", "threads"))
    if a.threads:
        torch.set_num_threads(a.threads)
    draft = bench_draft(a, columns)
    start_busy(a.beside, resolve_target(a.target), a.dtype)       # killed at exit
    if a.baseline_draft:
        check_baseline(a.baseline_draft, draft)
    sets = resolve_sets([s.strip() for s in a.datasets.split(",") if s.strip()], a.data, built_ok=columns is not None)
    prompts = {k: load_prompts(path, limit=a.n) for k, path in sets.items()}
    try:
        base = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
                              ignore_eos=a.ignore_eos)
    except ValueError as e:
        raise UserError(f"{str(e).replace('top_p', '--top-p')}") from None
    if columns is not None:
        from sglang_eagle3.bench.drafters import run_drafters
        resolved = [(name, column_settings(a, draft, drafter, tree, children)) for name, drafter, tree, children
                    in columns]
        a.argv = argv
        return run_drafters(a, sets, resolve_target(a.target), draft, resolved)
    # batch 1: one prompt at a time; the draft model's tree (--drafters compares the others)
    settings = settings_from_args(argparse.Namespace(**{**vars(a), "drafter": "eagle", "tree": "profile"}), draft,
                                  temperature=a.temperature)
    spec, profile, source = settings.engine_tree, settings.profile, settings.source
    a.num_steps, a.topk, a.num_draft_tokens = spec.num_steps, spec.topk, spec.num_draft_tokens   # what ran is recorded
    # the profile's long-context table (greedy steps of rows that long), as the server runs it; flags: none
    long = profile.long_context if profile is not None and a.temperature == 0 else None
    a.long_context = None
    if long is not None:
        t = long[1].for_batch_size(1)
        a.long_context = {"min_tokens": long[0], **({"speculation": False} if t is None else dataclasses.asdict(t))}
    print(f"tree num_steps={spec.num_steps} topk={spec.topk} num_draft_tokens={spec.num_draft_tokens} (from {source})"
          + (f"; from {long[0]} tokens on: {tree_text(a.long_context)}" if long else ""), file=sys.stderr)
    target = resolve_target(a.target)
    config = _config(a, target, os.path.abspath(draft))
    done, done_base = _resumable(a.out, config, a.fresh)

    spec_engine = load_engine(target, Settings(a.dtype, draft, spec,
                                               _long_only(profile, spec) if long is not None else None))
    van_engine = SpeculativeEngine(spec_engine.target, None, Settings(a.dtype))
    base_engine = load_baseline(a.baseline_draft, spec_engine, spec) if a.baseline_draft else None
    in_draft_vocab = spec_engine.draft.t2d.cpu()                      # [vocab] bool
    warm = [[{"role": "user", "content": "Hello"}]]
    for eng in (van_engine, spec_engine, base_engine):    # first-call overheads out of the timings
        if eng is not None:
            eng.generate(warm, SamplingParams(max_new_tokens=8, ignore_eos=True))

    result = {"format": FORMAT, "config": config, "meta": report.run_metadata(), "tau_definition": TAU_DEFINITION,
              "datasets": sets, "sets": {}, "average": None}
    if base_engine is not None:
        result["baseline"] = {"draft": config["baseline_draft"], "sets": {}, "average": None}
    todo = sum(len(p) for k, p in prompts.items() if k not in done)
    bar = tqdm(total=todo, desc="prompts", unit="prompt", dynamic_ncols=True, file=sys.stderr)
    for si, (name, convs) in enumerate(prompts.items()):
        if name in done and (base_engine is None or name in done_base):
            result["sets"][name] = done[name]
            if base_engine is not None:
                result["baseline"]["sets"][name] = done_base[name]
            continue
        turns_kept = convs if name == "mt_bench" else [c[:1] for c in convs]
        rows = []
        for i, turns in enumerate(turns_kept):
            def make_params(k, i=i):
                from dataclasses import replace
                return replace(base, seed=turn_seed(a.seed, si, i, k)) if a.temperature > 0 else base
            rows.append(bench_prompt(van_engine, spec_engine, turns, make_params, rotate=i,
                                     in_draft_vocab=in_draft_vocab, baseline_engine=base_engine))
            tau = report.safe_div(sum(r["accepted_tokens"] for r in rows), sum(r["decode_steps"] for r in rows))
            bar.set_postfix_str(f"{name} τ={report.fmt_num(tau)}")
            bar.update(1)
        result["sets"][name] = summarize_set(rows, greedy=base.greedy, max_accept=spec.num_steps + 1)
        result["average"] = average_row(result["sets"])
        if base_engine is not None:
            result["baseline"]["sets"][name] = summarize_baseline(rows, base.greedy, spec.num_steps + 1)
            result["baseline"]["average"] = average_row(result["baseline"]["sets"])
        report.write_json_atomic(a.out, result)           # a finished set survives an interrupted run
    bar.close()
    result["average"] = average_row(result["sets"])
    if base_engine is not None:
        result["baseline"]["average"] = average_row(result["baseline"]["sets"])
    report.write_outputs(a.out, result, markdown_report(result), plot_histograms, "_hist.png")
    return 0


def check_mode(a):
    """--drafters' columns [(name, drafter, tree)], or None for the draft-against-vanilla benchmark; the flags the
    chosen mode would not read are refused (before anything loads)."""
    from sglang_eagle3.bench.drafters import check_choice_into, parse_drafters
    from sglang_eagle3.errors import UserError
    if a.drafters is None:
        if a.drafter not in (None, "eagle") or a.tree not in (None, "profile"):
            flag = f"--drafter {a.drafter}" if a.drafter not in (None, "eagle") else f"--tree {a.tree}"
            raise UserError(f"{flag}: this benchmark measures --draft's EAGLE tree against vanilla decoding; compare "
                            "drafters side by side with --drafters (e.g. --drafters eagle,suffix,hybrid-auto)")
        if a.choose_into:
            raise UserError(f"--choose-into {a.choose_into} records the best of the --drafters columns: pass "
                            "--drafters")
        return None
    for name, value in (("drafter", a.drafter), ("tree", a.tree)):
        if value is not None:
            raise UserError(f"--{name} {value}: --drafters names each column's drafter and tree (DRAFTER or "
                            "DRAFTER-auto); leave it out")
    if a.baseline_draft:
        raise UserError(f"--baseline-draft {a.baseline_draft} compares two drafts' EAGLE trees, not --drafters' "
                        "columns: run it without --drafters")
    columns = parse_drafters(a.drafters)
    if a.choose_into:
        check_choice_into(a.choose_into)
    return columns


def bench_draft(a, columns):
    """The draft folder the run measures (--draft, else the shipped one for the embedded target); None only where no
    column drafts with a draft model (--drafters suffix)."""
    from sglang_eagle3.engine.settings import default_draft
    from sglang_eagle3.errors import UserError
    draft = default_draft(a.draft, a.target in (None, "testbed"))
    if draft is not None:
        return draft
    why = "--draft none" if a.draft == "none" else \
        "no --draft given, and no shipped draft yet" if a.target in (None, "testbed") else \
        f"no --draft given for --target {a.target} (the shipped draft is the embedded target's)"
    if columns is None:
        raise UserError(f"this benchmark measures a draft against vanilla decoding, but there is no draft ({why}): "
                        "pass --draft D (`eagle3 init-draft --out D` writes a random one)")
    needs = [name for name, drafter, *_ in columns if drafter != "suffix"]
    if needs:
        raise UserError(f"--drafters {a.drafters}: {needs[0]} drafts with a draft model, but there is no draft "
                        f"({why}): pass --draft D, or leave it out")
    return None


def column_settings(a, draft, drafter: str, tree: str, children: str = "sampled"):
    """One --drafters column's settings: the shared flags, its drafter, tree and draft children; the context drafter
    (suffix) reads no draft, profile or tree shape (with -auto, --num-draft-tokens is still the most a step
    verifies)."""
    from sglang_eagle3.engine.settings import settings_from_args
    from sglang_eagle3.errors import UserError
    flags = {"drafter": drafter, "tree": tree, "draft_children": children}
    if drafter == "suffix":
        flags.update(num_steps=None, topk=None, profile=None, **({} if tree == "auto" else {"num_draft_tokens": None}))
    try:
        return settings_from_args(argparse.Namespace(**{**vars(a), **flags}), "none" if drafter == "suffix" else draft,
                                  temperature=a.temperature)
    except UserError as e:
        raise UserError(f"--drafters {drafter}{'-auto' if tree == 'auto' else ''}:{children}: {e}") from None


def check_baseline(path: str, draft: str) -> None:
    """Before anything loads: the baseline draft must read the same target features as --draft."""
    from sglang_eagle3.errors import UserError
    from sglang_eagle3.models.config import ConfigError, Eagle3Config
    try:
        base = Eagle3Config.load(path)
    except ConfigError as e:
        raise UserError(f"--baseline-draft {path}: {e}") from None
    try:
        mine = Eagle3Config.load(draft)
    except ConfigError:
        return                                    # --draft's own loader reports what is wrong with it
    for key in ("aux_layer_ids", "target_hidden_size"):
        if getattr(base, key) != getattr(mine, key):
            raise UserError(f"--baseline-draft {path}: {key} {getattr(base, key)} differs from --draft's "
                            f"{getattr(mine, key)} (both must read the same target features)")


def load_baseline(path: str, spec_engine, spec):
    """The baseline draft's engine on the main engine's target (loaded once)."""
    from sglang_eagle3.engine.engine import SpeculativeEngine
    from sglang_eagle3.engine.loader import load_draft
    from sglang_eagle3.engine.settings import Settings
    return SpeculativeEngine(spec_engine.target, load_draft(path, spec_engine.target.dtype, spec_engine.target.device),
                             Settings(spec_engine.settings.dtype, tree=spec))


def main(argv=None) -> int:
    return run_cli("bench_acceptance", run, argv)
