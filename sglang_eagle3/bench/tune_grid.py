"""tune_spec's grid and choice: the trees to measure, the best tree per batch size, SGLang's adaptive config."""
from __future__ import annotations

from sglang_eagle3.bench import report
from sglang_eagle3.engine.profile import tree_entry, vanilla_entry
from sglang_eagle3.errors import UserError

ADAPTIVE_NOTE = (
    "SGLang 0.5.23 --speculative-adaptive-config: integer batch-size keys, each with candidate_steps; a batch "
    "size uses the slot of the largest key <= it. Adaptive speculation supports topk=1 chains only "
    "(num_draft_tokens = steps + 1) and picks among candidate_steps at runtime from the acceptance it sees; "
    "0 means no speculation. Trees with topk > 1 cannot be expressed here: each slot holds the measured chain "
    "lengths within the tolerance of the best chain (and 0 where vanilla decoding is as fast or faster).")


class ProfileError(UserError, ValueError):
    pass


# ---- grid ------------------------------------------------------------------------------------


def parse_ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not vals or min(vals) < 1:
        raise UserError(f"{flag} {text!r}: expected integers >= 1")
    return sorted(set(vals))


def tree_grid(steps: list[int], topks: list[int], ndts: list[int]) -> list[dict]:
    """Distinct valid trees; num_draft_tokens is capped at what (steps, topk) can draft, and num_steps at
    num_draft_tokens - 1 (the deepest node such a tree can hold: deeper levels are drafted for nothing)."""
    from sglang_eagle3.engine.speculation import SpecConfig
    seen, out = set(), []
    for s in steps:
        for k in topks:
            cap = s + 1 if k == 1 else 1 + k + (s - 1) * k * k
            for n in ndts:
                n = min(n, cap)
                c = SpecConfig(min(s, n - 1), k, n)
                key = (c.num_steps, c.topk, c.num_draft_tokens)
                if key not in seen:
                    seen.add(key)
                    out.append({"num_steps": key[0], "topk": key[1], "num_draft_tokens": key[2]})
    return out


def tree_key(tree: dict | None) -> str:
    if tree is None:
        return "vanilla"
    return f"steps={tree['num_steps']} topk={tree['topk']} ndt={tree['num_draft_tokens']}"


# ---- selection -------------------------------------------------------------------------------


def by_batch_size(rows: list[dict]) -> dict[int, tuple[dict | None, list[dict]]]:
    out: dict[int, tuple] = {}
    for bs in sorted({r["batch_size"] for r in rows}):
        mine = [r for r in rows if r["batch_size"] == bs]
        van = next((r for r in mine if r["tree"] is None), None)
        out[bs] = (van, [r for r in mine if r["tree"] is not None])
    return out


def _useful(r: dict) -> bool:
    """A tree none of whose drafted tokens was accepted cannot beat vanilla: a measured gain is noise."""
    return r.get("accepted_drafts") != 0


def select_best(rows: list[dict], min_speedup: float = 1.0) -> dict[str, dict]:
    """Per batch size, the profile's entry: the fastest tree, or speculation: false when vanilla is at least as good
    (with the fastest tree tried as its best_tree). Where trees were run again after the grid (confirmed), the
    choice is among those: a tree measured once more than the others would otherwise win on its luck."""
    best = {}
    for bs, (van, specs) in by_batch_size(rows).items():
        specs = [r for r in specs if r.get("confirmed")] or specs
        fastest = max(specs, key=lambda r: r["tokens_per_s"], default=None)
        top = max(filter(_useful, specs), key=lambda r: r["tokens_per_s"], default=None)
        van_tps = van["tokens_per_s"] if van else None
        spd = report.safe_div(top["tokens_per_s"], van_tps) if top and van_tps else None
        if top is None or (spd is not None and spd < min_speedup):
            tried = None if fastest is None else {
                **fastest["tree"], "tokens_per_s": fastest["tokens_per_s"],
                "speedup": report.safe_div(fastest["tokens_per_s"], van_tps) if van_tps else None,
                "accepted_drafts": fastest.get("accepted_drafts")}
            entry = vanilla_entry(tried, tokens_per_s=van_tps, speedup=1.0)
        else:
            entry = tree_entry(top["tree"], tokens_per_s=top["tokens_per_s"], speedup=spd,
                               accept_length=top.get("accept_length"), vanilla_tokens_per_s=van_tps)
            if van is None:
                entry["note"] = "no vanilla baseline measured at this batch size"
        best[str(bs)] = entry
    return best


def adaptive_config(rows: list[dict], min_speedup: float = 1.0, tolerance: float = 0.05) -> dict:
    """SGLang's --speculative-adaptive-config from the topk=1 (chain) measurements."""
    cfg: dict = {"_comment": ADAPTIVE_NOTE}
    for bs, (van, specs) in by_batch_size(rows).items():
        all_chains = [r for r in specs if r["tree"]["topk"] == 1]
        if not all_chains:
            continue
        chains = [r for r in all_chains if _useful(r)]
        top = max(chains, key=lambda r: r["tokens_per_s"], default=None)
        floor = (1 - tolerance) * top["tokens_per_s"] if top else 0.0
        if top is None or (van is not None and top["tokens_per_s"] < min_speedup * van["tokens_per_s"]):
            steps = [0]
        else:
            steps = sorted({r["tree"]["num_steps"] for r in chains if r["tokens_per_s"] >= floor})
            if van is not None and van["tokens_per_s"] >= floor:
                steps = [0] + steps
        cfg[str(bs)] = {"candidate_steps": steps}
    if len(cfg) == 1:
        raise ProfileError("no topk=1 tree was measured: add 1 to --topk-grid to write the SGLang adaptive config")
    validate_adaptive_config(cfg)
    return cfg


def validate_adaptive_config(cfg: dict, where: str = "adaptive config") -> None:
    """The rules SGLang 0.5.23 applies when it loads the file (adaptive_spec_params._load_adaptive_config)."""
    keys = [k for k in cfg if k.isdigit()]
    if not keys:
        raise ProfileError(f"{where}: needs at least one integer batch-size key")
    for k in keys:
        steps = cfg[k].get("candidate_steps") if isinstance(cfg[k], dict) else None
        if not isinstance(steps, list) or not steps or not all(isinstance(s, int) and s >= 0 for s in steps):
            raise ProfileError(f"{where}: batch size {k}: candidate_steps must be a non-empty list of ints >= 0")


def launch_flags(best: dict, adaptive_path: str | None, adaptive: dict | None) -> dict:
    """SGLang flags that reproduce the choice for batch size 1 (static) and the adaptive setup."""
    flags = {}
    first = best.get(min(best, key=int)) if best else None
    if first and first.get("speculation"):
        flags["static_bs1"] = (f"--speculative-algorithm EAGLE3 --speculative-num-steps {first['num_steps']} "
                               f"--speculative-eagle-topk {first['topk']} "
                               f"--speculative-num-draft-tokens {first['num_draft_tokens']}")
    if not any(e.get("speculation") for e in best.values()):
        flags["note"] = "no tree beat vanilla decoding at any batch size: launch without --speculative-* flags"
    steps = max((s for k, v in (adaptive or {}).items() if k.isdigit() for s in v["candidate_steps"]), default=0)
    if adaptive and adaptive_path and steps > 0:
        flags["adaptive"] = (f"--speculative-algorithm EAGLE3 --speculative-eagle-topk 1 --speculative-num-steps "
                             f"{steps} --speculative-num-draft-tokens {steps + 1} "
                             f"--speculative-adaptive --speculative-adaptive-config {adaptive_path}")
    return flags
