"""Pick the draft tree (num_steps, topk, num_draft_tokens) per batch size by measured tokens/s.

Two backends:
  engine (default): our SpeculativeEngine on this machine; every tree of the grid and vanilla decoding
      are measured at every batch size in one run (the tree is a per-call setting here).
  --sglang-url: a running SGLang server. Its tree is fixed at launch (--speculative-num-steps,
      --speculative-eagle-topk, --speculative-num-draft-tokens), so one run measures the server's current
      tree (read from /server_info) at every batch size, and adds the rows to the grid file. Relaunch
      the server with the next tree (and once without speculation, for the baseline) and run again with
      the same --out: the profile is rebuilt from all rows gathered so far.

Outputs (from --out PROFILE.json): PROFILE.json (engine/profile.py reads it), PROFILE.grid.json
(every measurement; also the resume state), PROFILE.md (tables), PROFILE.png (speed-up heatmap), and the
SGLang --speculative-adaptive-config file (--adaptive-out, default PROFILE.sglang_adaptive.json).

The best tree depends on the host: on a CPU with AMX tiles a verify of 8 tokens costs ~1.2x a one-token step, with
the AVX-512 BF16 kernel 1.2-1.5x, with the AVX2 + FMA kernel ~1.08x for 2 tokens, 1.1x for 4 and ~1.7x for 8 (a Zen
3, context 256; more at longer contexts), so a draft's profile can hold a table per kind of host (by_host, keyed by
engine/profile.host_kind(): amx, avx512_bf16, avx512f, avx2, cpu, cuda). --host-table-into PROFILE stores this
run's table there (with
--temperature > 0 that host's sampled table); the engine and server take it on such a host and the profile's own
table elsewhere. With --long-context TOKENS it stores the run's trees as that host's long-context table instead
(greedy steps whose longest row holds TOKENS or more use it: a verify's attention grows with the context); tune it
over prompts that long (--dataset sum: CNN/DM articles, median 690 tokens with SmolLM2's chat template).

Re-tuning (engine): the tree the current profile holds at each batch size (--host-table-into PROFILE's, else the
draft's spec_profile.json's) is measured beside the grid and always run again in the confirmation, so that one noisy
pass over the grid (±0.1x per tree on a 2-core VM) cannot replace it by a tree that is not faster (--no-incumbent:
the grid alone).
"""
from __future__ import annotations

import argparse
import os
import sys

from sglang_eagle3.bench import report, run_cli
from sglang_eagle3.bench.tune_grid import (
    ADAPTIVE_NOTE,
    ProfileError,
    adaptive_config,
    by_batch_size,
    launch_flags,
    parse_ints,
    select_best,
    tree_key,
)
from sglang_eagle3.engine.profile import PROFILE_FORMAT

GRID_FORMAT = "sglang_eagle3.tune_grid/1"


# ---- reading a profile -----------------------------------------------------------------------


def profile_tree_at(path: str, batch_size: int):
    """The tree a profile file runs at batch_size (SpecConfig), or None for vanilla decoding (SpecProfile's routing:
    a batch size without its own entry uses the largest measured one below it, else the smallest above);
    FileNotFoundError where there is no such file, ProfileError where it does not read."""
    from sglang_eagle3.engine.profile import SpecProfile
    from sglang_eagle3.models.config import ConfigError
    if not os.path.isfile(path):
        raise FileNotFoundError(f"speculation profile {path} does not exist (write one with bench/tune_spec.py)")
    try:
        return SpecProfile.load(path).for_batch_size(batch_size)
    except ConfigError as e:
        raise ProfileError(str(e)) from None


# ---- outputs ---------------------------------------------------------------------------------


def grid_table(rows: list[dict], best: dict) -> str:
    groups = by_batch_size(rows)
    trees = sorted({tree_key(r["tree"]) for r in rows}, key=lambda k: (k != "vanilla", k))
    headers = ["tree"] + [f"bs={bs}" for bs in groups]
    lines = []
    for t in trees:
        cells = [t]
        for bs, (van, specs) in groups.items():
            r = next((x for x in ([van] if van else []) + specs if tree_key(x["tree"]) == t), None)
            if r is None:
                cells.append("-")
                continue
            spd = report.safe_div(r["tokens_per_s"], van["tokens_per_s"]) if van else None
            b = best.get(str(bs), {})
            chosen = (tree_key(r["tree"]) == tree_key(b if b.get("speculation") else None))
            cells.append(f"{r['tokens_per_s']:.1f} ({report.fmt_speedup(spd)})" + (" *" if chosen else ""))
        lines.append(cells)
    return report.format_table(headers, lines)


def best_table(best: dict) -> str:
    rows = []
    for bs, e in best.items():
        tree = tree_key(e) if e.get("speculation") else "vanilla (no speculation)"
        rows.append([bs, tree, e.get("tokens_per_s"), report.fmt_speedup(e.get("speedup")),
                     report.fmt_num(e.get("accept_length"))])
    return report.format_table(["batch size", "best", "tok/s", "speed-up", "accept len"], rows,
                               align=["r", "l", "r", "r", "r"])


def plot_grid(rows: list[dict], best: dict, path: str) -> str:
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm
    groups = by_batch_size(rows)
    trees = sorted({tree_key(r["tree"]) for r in rows}, key=lambda k: (k != "vanilla", k))
    val = np.full((len(trees), len(groups)), np.nan)
    for j, (bs, (van, specs)) in enumerate(groups.items()):
        for r in ([van] if van else []) + specs:
            val[trees.index(tree_key(r["tree"])), j] = (r["tokens_per_s"] / van["tokens_per_s"]) if van \
                else r["tokens_per_s"]
    fig, (ax,) = report.subplots(1, 1, figsize=(2.0 + 1.3 * len(groups), 1.2 + 0.32 * len(trees)))
    finite = val[np.isfinite(val)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.5, 1.5)
    norm = TwoSlopeNorm(vcenter=1.0, vmin=min(lo, 0.99), vmax=max(hi, 1.01))
    im = ax.imshow(val, cmap="RdYlGn", norm=norm, aspect="auto")
    for i in range(len(trees)):
        for j, bs in enumerate(groups):
            if np.isfinite(val[i, j]):
                b = best.get(str(bs), {})
                mark = "*" if trees[i] == tree_key(b if b.get("speculation") else None) else ""
                ax.text(j, i, f"{val[i, j]:.2f}{mark}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(groups)), [f"bs={b}" for b in groups])
    ax.set_yticks(range(len(trees)), trees, fontsize=7)
    ax.set_title("speed-up over vanilla (* = chosen)")
    fig.colorbar(im, ax=ax, fraction=0.05)
    return report.save_figure(fig, path)



# ---- driver ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from sglang_eagle3.engine.settings import add_dtype_arg
    from sglang_eagle3.paths import data_dir
    p = argparse.ArgumentParser(prog="tune_spec.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="testbed", help="HF folder or hub id (default: the embedded SmolLM2); "
                                                       "with --sglang-url only its tokenizer is used")
    p.add_argument("--draft", default=None, help="EAGLE-3 draft folder (engine backend)")
    p.add_argument("--sglang-url", default=None, help="measure a running SGLang server instead (its current tree)")
    p.add_argument("--dataset", default="mt_bench", help="eval set name under $EAGLE3_DATA/eval or a .jsonl path")
    p.add_argument("--data", default=data_dir())
    p.add_argument("--n", type=int, default=4, help="prompts per measurement (rounded up to whole batches)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="decode exactly max-new-tokens per prompt")
    p.add_argument("--batch-sizes", default="1,2,4")
    p.add_argument("--num-steps-grid", default="1,3,5")
    p.add_argument("--topk-grid", default="1,2,4")
    p.add_argument("--num-draft-tokens-grid", default="4,8,16", help="capped at what each (steps, topk) can draft")
    p.add_argument("--repeats", type=int, default=1, help="runs per measurement; the median tokens/s is kept")
    p.add_argument("--confirm", type=int, default=3,
                   help="engine: the N fastest trees of each batch size and vanilla are run --confirm-repeats more "
                        "times, alternated, after the grid (the best of one noisy pass over many trees is biased "
                        "upwards); 0: none")
    p.add_argument("--confirm-repeats", type=int, default=3)
    p.add_argument("--no-incumbent", action="store_true",
                   help="engine: do not measure the tree the current profile holds for each batch size (that of "
                        "--host-table-into PROFILE, else the draft's spec_profile.json, for this kind of host) beside "
                        "the grid and in the confirmation runs; by default it competes there, so that one noisy "
                        "pass over the grid cannot replace it by a tree that is not faster")
    p.add_argument("--min-speedup", type=float, default=1.0,
                   help="speculate at a batch size only if the best tree beats vanilla by this factor")
    p.add_argument("--adaptive-tolerance", type=float, default=0.05,
                   help="chain lengths within this fraction of the best chain become SGLang candidate_steps")
    add_dtype_arg(p, " (what eagle3 serve runs by default)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per SGLang request")
    p.add_argument("--out", required=True, help="profile JSON; .grid.json/.md/.png are written next to it")
    p.add_argument("--adaptive-out", default=None, help="SGLang adaptive config (default PROFILE.sglang_adaptive.json)")
    p.add_argument("--fresh", action="store_true", help="drop the measurements already in PROFILE.grid.json")
    p.add_argument("--sampled-into", default=None, metavar="PROFILE",
                   help="with --temperature > 0: also store this run's best trees in PROFILE (a greedy profile) as "
                        "its table for sampling requests ('sampled'), which the engine and server then use")
    p.add_argument("--host-table-into", default=None, metavar="PROFILE",
                   help="also store this run's best trees in PROFILE as the table for this kind of host "
                        "(by_host[amx|avx512_bf16|avx512f|avx2|cpu]; with --temperature > 0 that host's sampled "
                        "table), which the engine and server use on such hosts; the rest of PROFILE stays as it is")
    p.add_argument("--long-context", type=int, default=None, metavar="TOKENS",
                   help="with --host-table-into PROFILE, at --temperature 0: store this run's best trees as that "
                        "host's table for steps whose longest row holds at least TOKENS tokens (long_context), which "
                        "the engine and server then use there; measure it over prompts that long (e.g. --dataset sum)")
    return p


def incumbent_trees(a) -> tuple[dict[int, dict], str | None]:
    """{batch size: tree} that the profile this run may replace holds now (--host-table-into PROFILE, else the
    draft's spec_profile.json; this host kind's table where it has one; the sampled table at --temperature > 0),
    and where they came from. Batch sizes without speculation there give their fastest measured tree."""
    from sglang_eagle3.engine.profile import SpecProfile, host_kind
    from sglang_eagle3.engine.settings import load_profile
    from sglang_eagle3.errors import UserError
    from sglang_eagle3.models.config import ConfigError
    if a.no_incumbent:
        return {}, None
    try:
        prof = SpecProfile.load(a.host_table_into, host=host_kind("cpu")) if a.host_table_into else \
            load_profile(None, a.draft)[0]
    except ConfigError as e:
        raise UserError(str(e)) from None
    if prof is None:
        return {}, None
    trees = {}
    for bs in a.batch_sizes:
        t = prof.measured_tree(bs, sampled=a.temperature > 0, context=getattr(a, "long_context", None) or 0)
        if t is not None:
            trees[bs] = {"num_steps": t.num_steps, "topk": t.topk, "num_draft_tokens": t.num_draft_tokens}
    return trees, prof.source


def portable_path(path: str | None) -> str | None:
    """A path without the machine in it: inside the repository relative to it, elsewhere its file name (a profile
    ships with a draft: it records what was run, not where)."""
    from sglang_eagle3.paths import REPO_ROOT

    if not path or not os.path.isabs(path):
        return path
    rel = os.path.relpath(path, REPO_ROOT)
    return rel if not rel.startswith("..") else os.path.basename(path.rstrip(os.sep)) or path


def portable_command(argv: list[str]) -> str:
    """This run's command line without machine paths (portable_path on each argument)."""
    return " ".join(["python bench/tune_spec.py", *(portable_path(a) for a in argv)])


def table_provenance(setup: dict, dataset_name: str, command: str) -> dict:
    """What a table stored into a profile records about its measurement: the eval set's name, the tokens per
    prompt, the dtype, the CPU and the command (no paths: the grid file and the data stay on the machine)."""
    return {"dataset": dataset_name, "max_new_tokens": setup["max_new_tokens"], "cpu": report.run_metadata().get("cpu"),
            **({"dtype": setup["dtype"]} if setup.get("dtype") else {}), "command": command}


def check_long_prompts(target: str, prompts: list[str], min_tokens: int, dataset: str) -> None:
    """A long-context table must be measured where it will be used: refuse prompts whose chat-encoded median
    length is below min_tokens (one line naming the set)."""
    from transformers import AutoTokenizer

    from sglang_eagle3.engine.engine import encode_prompt
    from sglang_eagle3.errors import UserError
    tok = AutoTokenizer.from_pretrained(target)
    lengths = sorted(len(encode_prompt(tok, [{"role": "user", "content": p}])) for p in prompts)   # as tune runs them
    median = lengths[len(lengths) // 2]
    if median < min_tokens:
        raise UserError(f"--long-context {min_tokens}: the prompts of --dataset {dataset} have a median of {median} "
                        "tokens; measure the long-context table over prompts at least that long (e.g. --dataset sum)")


def _load_grid(path: str, setup: dict, fresh: bool) -> list[dict]:
    if fresh or not os.path.isfile(path):
        return []
    old = report.read_json(path)
    if old.get("format") != GRID_FORMAT or old.get("setup") != setup:
        print(f"note: {path} holds measurements made with other settings; starting over", file=sys.stderr)
        return []
    return list(old.get("rows", []))


def _differs(best: dict, adaptive: dict | None) -> list[int]:
    """Batch sizes where the adaptive file cannot say what the profile chose."""
    out = []
    for bs, e in best.items():
        steps = (adaptive or {}).get(bs, {}).get("candidate_steps")
        same = (steps == [0]) if not e.get("speculation") else (steps is not None and e["topk"] == 1
                                                                and e["num_steps"] in steps)
        if not same:
            out.append(int(bs))
    return out



def parse_args(argv) -> argparse.Namespace:
    """The flags, parsed and checked before anything loads (one line each)."""
    from sglang_eagle3.engine.settings import resolve_dtype
    from sglang_eagle3.errors import UserError
    a = build_parser().parse_args(argv)
    a.dtype = resolve_dtype(a.dtype)
    a.batch_sizes = parse_ints(a.batch_sizes, "--batch-sizes")
    a.steps, a.topks = parse_ints(a.num_steps_grid, "--num-steps-grid"), parse_ints(a.topk_grid, "--topk-grid")
    a.ndts = parse_ints(a.num_draft_tokens_grid, "--num-draft-tokens-grid")
    for flag, v, lo in (("--n", a.n, 1), ("--repeats", a.repeats, 1), ("--min-speedup", a.min_speedup, 0),
                        ("--confirm", a.confirm, 0), ("--confirm-repeats", a.confirm_repeats, 1)):
        if v < lo:
            raise UserError(f"{flag} must be >= {lo}, got {v}")
    check_into_flags(a)
    if not 0 <= a.adaptive_tolerance < 1:
        raise UserError(f"--adaptive-tolerance must be in [0, 1), got {a.adaptive_tolerance}")
    return a


def check_into_flags(a) -> None:
    """--sampled-into, --host-table-into and --long-context: what each needs, and profiles this run can read and
    rewrite when it ends."""
    from sglang_eagle3.engine.profile import check_rewritable
    from sglang_eagle3.errors import UserError
    from sglang_eagle3.models.config import ConfigError
    if a.sampled_into is not None and a.temperature <= 0:
        raise UserError("--sampled-into needs --temperature > 0 (it stores a table for sampling requests)")
    if a.sampled_into is not None and not os.path.isfile(a.sampled_into):
        raise UserError(f"--sampled-into {a.sampled_into}: no such profile (write the greedy one first)")
    if a.host_table_into is not None and (a.sglang_url or not os.path.isfile(a.host_table_into)):
        raise UserError(f"--host-table-into {a.host_table_into}: " + ("our engine's tables only (not --sglang-url)"
                        if a.sglang_url else "no such profile (write the profile first)"))
    if a.long_context is not None and (a.long_context < 1 or a.host_table_into is None or a.temperature > 0):
        raise UserError(f"--long-context {a.long_context}: " + (
            "must be >= 1" if a.long_context < 1 else "needs --host-table-into PROFILE (it adds a table to that host's)"
            if a.host_table_into is None else "greedy tables only (--temperature 0)"))
    for flag, path in (("--sampled-into", a.sampled_into), ("--host-table-into", a.host_table_into)):
        if path is None:
            continue
        try:
            check_rewritable(path)
        except ConfigError as e:
            raise UserError(f"{flag} {path}: {e}") from None


def check_host_table(a) -> None:
    """--host-table-into at --temperature > 0 or with --long-context: that table goes beside this kind of host's
    greedy one, which must be in the profile already (refused before anything is measured)."""
    from sglang_eagle3.engine.profile import SpecProfile, host_kind
    from sglang_eagle3.errors import UserError
    if a.host_table_into is None or (a.long_context is None and a.temperature <= 0):
        return
    kind = host_kind("cpu")
    if SpecProfile.load(a.host_table_into, host=kind).host == kind:
        return
    raise UserError(f"--host-table-into {a.host_table_into}: " + (
        f"no table for host kind {kind!r} yet (tune it first, without --long-context)" if a.long_context is not None
        else f"no greedy table for host kind {kind!r} yet (measure it first at --temperature 0)"))


def read_prompts(a) -> tuple[str, str, list[str]]:
    """--dataset's name and file, and its prompts this run measures (enough for the largest batch); refused where
    they are shorter than --long-context."""
    from sglang_eagle3.bench.acceptance import resolve_sets
    from sglang_eagle3.engine.prompts import load_prompts
    from sglang_eagle3.models.testbed import resolve_target
    ((name, path),) = resolve_sets([a.dataset], a.data).items()
    prompts = [t[0] for t in load_prompts(path, limit=max(a.n, max(a.batch_sizes)))]
    if a.long_context is not None:
        check_long_prompts(resolve_target(a.target), prompts, a.long_context, a.dataset)
    return name, path, prompts


def run_setup(a, dataset: str) -> tuple[dict, str | None]:
    """What the measurements depend on (the grid file resumes only under the same setup) and, with our engine,
    where the trees the profile holds now came from (a.incumbents); resolves --target and --draft."""
    import torch

    from sglang_eagle3.errors import UserError
    from sglang_eagle3.models.testbed import resolve_target
    from sglang_eagle3.paths import shipped_draft
    setup = {"dataset": os.path.abspath(dataset), "n": a.n, "max_new_tokens": a.max_new_tokens,
             "temperature": a.temperature, "seed": a.seed if a.temperature > 0 else None, "ignore_eos": a.ignore_eos}
    if a.sglang_url:
        setup.update(backend="sglang", url=a.sglang_url)
        return setup, None
    a.target = resolve_target(a.target)
    a.draft = a.draft or shipped_draft()
    if not a.draft or a.draft == "none" or not os.path.isdir(a.draft):
        raise UserError(f"--draft {a.draft}: need an EAGLE-3 draft folder (`eagle3 init-draft` makes a random one)")
    setup.update(backend="engine", target=os.path.abspath(a.target), draft=os.path.abspath(a.draft),
                 dtype=a.dtype, threads=torch.get_num_threads())
    a.incumbents, source = incumbent_trees(a)
    return setup, source


def measure(a, prompts: list[str], setup: dict, grid_path: str) -> tuple[list[dict], dict]:
    """Every (batch size, tree) the grid file lacks, measured, the file rewritten after each; all its rows (sorted)
    and what ran them (backend, target, draft, dtype)."""
    from sglang_eagle3.bench.measure import measure_engine, measure_server
    from sglang_eagle3.errors import UserError
    rows = _load_grid(grid_path, setup, a.fresh)
    state = {"format": GRID_FORMAT, "setup": setup, "rows": rows, "meta": report.run_metadata()}

    def on_rows(new):                                   # replace same (batch size, tree), keep the rest
        keys = {(r["batch_size"], tree_key(r["tree"])) for r in new}
        state["rows"] = [r for r in state["rows"] if (r["batch_size"], tree_key(r["tree"])) not in keys] + new
        report.write_json_atomic(grid_path, state)

    if a.sglang_url:
        from sglang_eagle3.bench.sglang_client import ServerError
        try:
            where = measure_server(a, prompts, on_rows, existing=rows)
        except ServerError as e:
            raise UserError(str(e)) from None
    else:
        where = measure_engine(a, prompts, {(r["batch_size"], tree_key(r["tree"])) for r in rows}, on_rows)
    return sorted(state["rows"], key=lambda r: (r["batch_size"], tree_key(r["tree"]))), where


def write_adaptive(a, rows: list[dict]) -> tuple[dict | None, str, str]:
    """SGLang's adaptive config from the chains measured, written to --adaptive-out (None where it cannot be
    written), its path, and the note the profile records (why there is none, where none)."""
    path = a.adaptive_out or report.sibling(a.out, ".sglang_adaptive.json")
    try:
        adaptive = adaptive_config(rows, a.min_speedup, a.adaptive_tolerance)
    except ProfileError as e:
        return None, path, str(e)
    report.write_json_atomic(path, adaptive)
    return adaptive, path, ADAPTIVE_NOTE


def profile_document(a, where: dict, dataset_name: str, best: dict, adaptive: dict | None, adaptive_path: str,
                     note: str) -> dict:
    """The profile --out holds: the best entry per batch size, what measured them, SGLang's equivalents."""
    adaptive_at = portable_path(os.path.abspath(adaptive_path))
    return {"format": PROFILE_FORMAT, "target": portable_path(where.get("target")),
            "draft": portable_path(where.get("draft")), "backend": where["backend"], "dtype": where.get("dtype"),
            "dataset": dataset_name, "temperature": a.temperature, "max_new_tokens": a.max_new_tokens,
            "min_speedup": a.min_speedup, "per_batch_size": best,
            "sglang_adaptive": {"path": adaptive_at if adaptive else None, "note": note,
                                "differs_from_profile_at_batch_sizes": _differs(best, adaptive)},
            "launch_flags": launch_flags(best, adaptive_at, adaptive), "meta": report.run_metadata()}


def store_tables(a, best: dict, setup: dict, measured: dict) -> str | None:
    """This run's best trees, with `measured` (table_provenance), into the profiles --sampled-into (its sampled
    table) and --host-table-into (this kind of host's table) name; the kind where it stored one."""
    from sglang_eagle3.engine.profile import add_host_table, host_kind, set_sampled_table
    sampling = {"temperature": setup["temperature"], "seed": setup["seed"]}
    if a.sampled_into is not None:
        set_sampled_table(a.sampled_into, best, sampling, measured)
    if a.host_table_into is None:
        return None
    kind = host_kind("cpu")
    add_host_table(a.host_table_into, kind, best, measured, sampling if setup["temperature"] > 0 else None,
                   a.long_context)
    return kind


def report_text(a, rows: list[dict], best: dict, where: dict, adaptive: dict | None,
                incumbent_source: str | None) -> str:
    """The Markdown report: every tree's speed per batch size, the choice, and how it was made."""
    text = (f"tokens/s (speed-up over vanilla) per tree and batch size; * = chosen. backend {where['backend']}, "
            f"target {where.get('target')}, draft {where.get('draft')}, T={a.temperature:g}, "
            f"max_new_tokens={a.max_new_tokens}\n\n{grid_table(rows, best)}\n\nBest per batch size:\n\n"
            f"{best_table(best)}\n")
    extra = sorted({(r["batch_size"], tree_key(r["tree"]), r["repeats"]) for r in rows if r.get("confirmed")})
    if extra:
        text += ("\nRun again after the grid, alternated with vanilla (medians over all runs), and chosen among: "
                 + ", ".join(f"bs {bs} {k} ({n} runs)" for bs, k, n in extra) + ".\n")
    held = sorted((r["batch_size"], tree_key(r["tree"])) for r in rows if r.get("incumbent"))
    if held:
        source = f" ({incumbent_source})" if incumbent_source else ""   # rows resumed from an earlier run's grid
        text += (f"\nThe trees the profile held{source} competed beside the grid and in the "
                 "confirmation runs: " + ", ".join(f"bs {bs} {k}" for bs, k in held) + ".\n")
    checked = [r["identical_to_vanilla"] for r in rows if r.get("identical_to_vanilla") is not None]
    if checked:
        text += f"\nGreedy outputs identical to vanilla in {sum(checked)}/{len(checked)} speculative runs.\n"
    if adaptive:
        steps = ", ".join(f"bs {k}: {v['candidate_steps']}" for k, v in adaptive.items() if k.isdigit())
        text += f"\nSGLang adaptive candidate_steps: {steps}\n"
    return text


def files_note(a, files: list[str], adaptive: dict | None, adaptive_path: str, note: str, host: str | None) -> str:
    """What the run wrote, and where it added tables."""
    return (f"wrote {os.path.abspath(a.out)}" + "".join(f"\n      {f}" for f in files)
            + (f"\n      {os.path.abspath(adaptive_path)}" if adaptive else f"\n(no SGLang adaptive config: {note})")
            + (f"\nadded the sampled table to {os.path.abspath(a.sampled_into)}" if a.sampled_into else "")
            + (f"\nadded the table for {host} hosts" + (f" at {a.long_context}+ tokens" if a.long_context else "")
               + f" to {os.path.abspath(a.host_table_into)}" if host else ""))


def run(argv=None) -> int:
    import torch

    from sglang_eagle3.engine.profile import write_profile
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    dataset_name, dataset, prompts = read_prompts(a)
    check_host_table(a)
    setup, incumbent_source = run_setup(a, dataset)
    grid_path = report.sibling(a.out, ".grid.json")
    rows, where = measure(a, prompts, setup, grid_path)
    best = select_best(rows, a.min_speedup)
    adaptive, adaptive_path, note = write_adaptive(a, rows)
    write_profile(a.out, profile_document(a, where, dataset_name, best, adaptive, adaptive_path, note))
    measured = table_provenance(setup, dataset_name, portable_command(sys.argv[1:] if argv is None else argv))
    host = store_tables(a, best, setup, measured)
    text = report_text(a, rows, best, where, adaptive, incumbent_source)
    md = report.write_text_atomic(report.sibling(a.out, ".md"), text)
    png = plot_grid(rows, best, report.sibling(a.out, ".png"))
    print(text)
    print(files_note(a, [grid_path, md, png], adaptive, adaptive_path, note, host))
    return 0


def main(argv=None) -> int:
    return run_cli("tune_spec", run, argv, extra_errors=(ProfileError,))
