"""Measuring tokens/s of decoding trees: in our engine (every tree per run) or on a SGLang server (its tree)."""
from __future__ import annotations

import os
import sys

from sglang_eagle3.bench import report
from sglang_eagle3.bench.tune_grid import tree_grid, tree_key


def _cycled(prompts: list, bs: int, n: int) -> list:
    """At least n prompts, a whole number of batches of bs."""
    total = -(-max(n, bs) // bs) * bs
    return [prompts[i % len(prompts)] for i in range(total)]


def measure_engine(a, prompts: list, done: set, on_rows) -> dict:
    """Vanilla + every grid tree at every batch size, in our engine. Returns the setup description."""
    import time

    from tqdm import tqdm

    from sglang_eagle3.engine.engine import SpeculativeEngine
    from sglang_eagle3.engine.loader import load_engine
    from sglang_eagle3.engine.settings import Settings
    from sglang_eagle3.engine.speculation import SpecConfig
    from sglang_eagle3.engine.verify import SamplingParams
    trees = tree_grid(a.steps, a.topks, a.ndts)
    incumbents = dict(getattr(a, "incumbents", None) or {})    # batch size -> the tree the profile holds now
    grid_keys = {tree_key(t) for t in trees}
    base = load_engine(a.target, Settings(a.dtype, a.draft, SpecConfig(**trees[0])))
    engines = {"vanilla": SpeculativeEngine(base.target, None, Settings(a.dtype))}
    for t in trees + list(incumbents.values()):
        engines.setdefault(tree_key(t), SpeculativeEngine(base.target, base.draft,
                                                          Settings(a.dtype, tree=SpecConfig(**t))))
    params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature, ignore_eos=a.ignore_eos,
                            seed=a.seed if a.temperature > 0 else None)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    for key in ("vanilla", tree_key(trees[0])):
        engines[key].generate(chats[:1], SamplingParams(max_new_tokens=8, ignore_eos=True))
    extra = {bs: [t] for bs, t in incumbents.items() if tree_key(t) not in grid_keys}   # measured at its bs only
    plan = {bs: [t for t in [None] + trees + extra.get(bs, []) if (bs, tree_key(t)) not in done]
            for bs in a.batch_sizes}
    confirm = a.confirm

    def held_in(bs: int, todo: list) -> bool:       # the profile's tree at bs is measured in this run
        return bs in incumbents and tree_key(incumbents[bs]) in {tree_key(t) for t in todo}

    def confirm_runs(bs: int, todo: list) -> int:   # vanilla, the fastest few, and the held tree (if not among them)
        specs = [t for t in todo if t is not None]
        return (min(confirm, len(specs)) + 1 + held_in(bs, todo)) * a.confirm_repeats if confirm and todo else 0
    bar = tqdm(total=sum(len(v) * a.repeats + confirm_runs(bs, v) for bs, v in plan.items()), desc="configs",
               unit="run", dynamic_ncols=True, file=sys.stderr)
    for bs, todo in plan.items():
        batch = _cycled(chats, bs, a.n)
        runs: dict[str, list] = {tree_key(t): [] for t in todo}

        def measure(ts: list, rounds: int) -> None:
            for _ in range(rounds):                # repeats outermost: drift hits every tree alike
                for t in ts:
                    bar.set_postfix_str(f"bs={bs} {tree_key(t)}")
                    t0 = time.perf_counter()
                    outs, st = engines[tree_key(t)].generate(batch, params, batch_size=bs)
                    runs[tree_key(t)].append((st.generated_tokens, time.perf_counter() - t0, st.verify_steps,
                                              [o.token_ids for o in outs]))
                    bar.update(1)
        measure(todo, a.repeats)
        confirmed: set[str] = set()
        incumbent = incumbents.get(bs) if held_in(bs, todo) else None
        if confirm and todo:                       # the fastest few again, close together in time, with vanilla
            tps = lambda t: report.median(r[0] / r[1] for r in runs[tree_key(t)])  # noqa: E731
            top = sorted((t for t in todo if t is not None), key=tps, reverse=True)[:confirm]
            if incumbent is not None:              # one noisy pass must not unseat the tree the profile holds
                if tree_key(incumbent) in {tree_key(t) for t in top}:
                    bar.total -= a.confirm_repeats
                else:
                    top.append(incumbent)
            measure(([None] if None in todo else []) + top, a.confirm_repeats)
            confirmed = {tree_key(t) for t in top}
        van_ids = runs["vanilla"][0][3] if "vanilla" in runs else None
        rows = []
        for t in todo:
            rs = runs[tree_key(t)]
            rows.append({"batch_size": bs, "tree": t, "prompts": len(batch), "repeats": len(rs),
                         "tokens": sum(r[0] for r in rs), "time_s": sum(r[1] for r in rs),
                         "tokens_per_s": report.median(r[0] / r[1] for r in rs),
                         "accept_length": report.safe_div(sum(r[0] for r in rs), sum(r[2] for r in rs)),
                         "accepted_drafts": None if t is None else sum(r[0] - r[2] for r in rs),
                         "identical_to_vanilla": (rs[0][3] == van_ids) if (van_ids is not None and t is not None
                                                                           and params.greedy) else None,
                         **({"confirmed": True} if tree_key(t) in confirmed else {}),
                         **({"incumbent": True} if incumbent is not None and tree_key(t) == tree_key(incumbent)
                            else {})})
        on_rows(rows)
    bar.close()
    return {"backend": "engine", "target": os.path.abspath(a.target) if os.path.isdir(a.target) else a.target,
            "draft": os.path.abspath(a.draft), "dtype": a.dtype}


def chat_texts(prompts: list[str], tokenizer_path: str | None) -> tuple[list[str], str]:
    """Prompts through the target's chat template when its tokenizer is here; else as raw text."""
    if tokenizer_path and os.path.isdir(tokenizer_path):
        from transformers import AutoTokenizer
        try:
            tok = AutoTokenizer.from_pretrained(tokenizer_path)
            return [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                            add_generation_prompt=True) for p in prompts], "chat"
        except (OSError, ValueError):
            pass
    return list(prompts), "raw"


def check_same_server_setup(info: dict, tree: dict | None, existing: list[dict]) -> None:
    """Rows of one grid must come from one target (and one draft for the speculative ones)."""
    from sglang_eagle3.bench.sglang_client import ServerError
    model, draft = info.get("model_path"), info.get("speculative_draft_model_path")
    for r in existing:
        if r.get("server_model", model) != model:
            raise ServerError(f"the grid file holds measurements of {r['server_model']}, this server runs {model}; "
                              f"use another --out or --fresh")
        if tree is not None and r["tree"] is not None and r.get("server_draft", draft) != draft:
            raise ServerError(f"the grid file holds measurements with draft {r['server_draft']}, this server uses "
                              f"{draft}; use another --out or --fresh")


def measure_server(a, prompts: list, on_rows, existing: list[dict] = ()) -> dict:
    """The server's current tree at every batch size (waves of batch_size concurrent requests)."""
    from tqdm import tqdm

    from sglang_eagle3.bench.sglang_client import SGLangClient, server_tree, summarize_meta
    client = SGLangClient(a.sglang_url, timeout=a.timeout)
    info = client.server_info()
    tree = server_tree(info)
    check_same_server_setup(info, tree, list(existing))
    texts, fmt = chat_texts(prompts, a.target if a.target != "testbed" else info.get("model_path"))
    sp = {"max_new_tokens": a.max_new_tokens, "temperature": a.temperature, "ignore_eos": a.ignore_eos}
    if a.temperature > 0:
        sp["sampling_seed"] = a.seed
    client.generate(texts[:1], {**sp, "max_new_tokens": 8})
    print(f"server {a.sglang_url}: {info.get('model_path')} | {tree_key(tree)} | prompts as {fmt} text",
          file=sys.stderr)
    rows = []
    for bs in tqdm(a.batch_sizes, desc="batch sizes", file=sys.stderr, dynamic_ncols=True):
        batch = _cycled(texts, bs, a.n)
        runs = []
        for _ in range(a.repeats):
            client.flush_cache()
            tokens, verify, accepted, wall = 0, 0, 0, 0.0
            for i in range(0, len(batch), bs):
                metas, dt = client.generate(batch[i:i + bs], sp)
                tok, ver, acc = summarize_meta(metas)
                tokens, wall = tokens + tok, wall + dt
                verify = None if ver is None or verify is None else verify + ver
                accepted = None if acc is None or accepted is None else accepted + acc
            runs.append((tokens, wall, verify, accepted))
        verify = None if any(r[2] is None for r in runs) else sum(r[2] for r in runs)
        accepted = None if any(r[3] is None for r in runs) else sum(r[3] for r in runs)
        rows.append({"batch_size": bs, "tree": tree, "prompts": len(batch), "repeats": len(runs),
                     "tokens": sum(r[0] for r in runs), "time_s": sum(r[1] for r in runs),
                     "tokens_per_s": report.median(r[0] / r[1] for r in runs if r[1] > 0),
                     "accept_length": report.safe_div(sum(r[0] for r in runs), verify) if verify else None,
                     "accepted_drafts": accepted if tree is not None else None,
                     "identical_to_vanilla": None, "server_model": info.get("model_path"),
                     "server_draft": info.get("speculative_draft_model_path")})
    on_rows(rows)
    return {"backend": "sglang", "url": a.sglang_url, "target": info.get("model_path"),
            "draft": info.get("speculative_draft_model_path"), "dtype": info.get("dtype"), "prompt_format": fmt}
