"""`eagle3 calibrate`: fit a draft's per-depth sharpening (engine/draft_calibration.py) on held-out text.

The text: the target's own answers, sampled at --sample-temperature, to prompts no benchmark reads (each of the five
eval sets from index --first on; bench_acceptance reads the first --n). Each answer is unrolled as training-time
test does (ttt.draft_step: the answer's tokens fed, the draft's own hidden states carried from depth to depth), so
at depth d and every answer position there are the draft's logits z [Vd] and the target's logits.

At a node of depth d a sampled child is accepted with chance sum_x min(p(x), q(x)). The fit keeps, per depth, the
scale s (of a geometric grid) that maximises its mean over the positions and the --temperatures, with
q = softmax(s * z / T) and p the target's softmax(logits / T) over the whole vocabulary, read at the draft vocabulary's
tokens (the mass outside it can never be accepted: the report gives it as the vocabulary's coverage).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from sglang_eagle3.errors import UserError, check_at_least
from sglang_eagle3.training.ttt import TTTBatch, TTTSettings, _features, draft_step, step_inputs

SETS = ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum")
SCALES = tuple(float(x) for x in np.round(np.geomspace(0.5, 4.0, 31), 4))   # the grid (ratio ~1.07)
TEMPERATURES = (0.7, 1.0)


@dataclass
class AcceptanceGrid:
    """Per temperature, depth and grid scale: the summed chance that a node accepts one sampled child; per
    temperature and depth the summed mass of p inside the draft vocabulary; per depth the positions counted."""
    scales: Sequence[float]
    temperatures: Sequence[float]
    depths: int
    accept: torch.Tensor = field(init=False)      # [nT, D, G]
    coverage: torch.Tensor = field(init=False)    # [nT, D]
    count: torch.Tensor = field(init=False)       # [D]

    def __post_init__(self):
        nT, G = len(self.temperatures), len(self.scales)
        self.accept = torch.zeros(nT, self.depths, G, dtype=torch.float64)
        self.coverage = torch.zeros(nT, self.depths, dtype=torch.float64)
        self.count = torch.zeros(self.depths, dtype=torch.float64)

    @torch.no_grad()
    def add(self, depth: int, draft_logits: torch.Tensor, target_logits: torch.Tensor, draft_ids: torch.Tensor):
        """draft_logits [S, Vd], target_logits [S, V] at the same S positions; draft_ids [Vd] (target ids)."""
        z, zt = draft_logits.float(), target_logits.float()
        for i, T in enumerate(self.temperatures):
            p = torch.softmax(zt / T, -1)[:, draft_ids]                  # [S, Vd] the target's mass in the vocab
            self.coverage[i, depth] += float(p.sum())
            for g, s in enumerate(self.scales):
                q = torch.softmax(z * (s / T), -1)                       # [S, Vd]
                self.accept[i, depth, g] += float(torch.minimum(p, q).sum())
        self.count[depth] += z.shape[0]

    def mean(self) -> torch.Tensor:
        """[nT, D, G] the mean chance per position (0 where a depth counted none)."""
        return self.accept / self.count.clamp(min=1).view(1, -1, 1)

    def best_scales(self) -> list[float]:
        """Per depth the grid scale with the most acceptance, averaged over the temperatures; a depth no position
        reached takes the one before it."""
        best, mean = [], self.mean().mean(0)                             # [D, G]
        for d in range(self.depths):
            if self.count[d] == 0:
                best.append(best[-1] if best else 1.0)
            else:
                best.append(float(self.scales[int(mean[d].argmax())]))
        return best

    def report(self) -> dict:
        """Per temperature and depth: positions, acceptance at scale 1 and at the fitted one, coverage."""
        mean, best = self.mean(), self.best_scales()
        one = min(range(len(self.scales)), key=lambda g: abs(self.scales[g] - 1.0))
        rows = []
        for i, T in enumerate(self.temperatures):
            for d in range(self.depths):
                n = int(self.count[d])
                g = self.scales.index(best[d])
                rows.append({"temperature": T, "depth": d, "positions": n, "scale": best[d],
                             "accept_raw": round(float(mean[i, d, one]), 4),
                             "accept_fitted": round(float(mean[i, d, g]), 4),
                             "best_scale_at_this_temperature": float(self.scales[int(mean[i, d].argmax())]),
                             "vocab_coverage": round(float(self.coverage[i, d]) / max(1, n), 4)})
        return {"scales": best, "rows": rows}


def heldout_prompts(eval_dir: str, first: int, per_set: int) -> list[list[dict]]:
    """The first turn of each eval set's prompts first .. first + per_set - 1, as chat messages."""
    from sglang_eagle3.engine.prompts import PromptFileError, load_prompts
    out = []
    for name in SETS:
        path = os.path.join(eval_dir, f"{name}.jsonl")
        try:
            turns = load_prompts(path, limit=first + per_set)[first:]
        except PromptFileError as e:
            raise UserError(f"--data: {e}") from None
        out.extend([[{"role": "user", "content": t[0]}] for t in turns])
    if not out:
        raise UserError(f"--data {eval_dir}: no prompts from index --first {first} on")
    return out


def sampled_rows(engine, prompts, max_new_tokens: int, temperature: float, seed: int,
                 batch_size: int) -> list[tuple[torch.Tensor, int]]:
    """The target's answers to the prompts (sampled, exact under speculation): per prompt (prompt + answer ids [n],
    the answer's first index)."""
    from sglang_eagle3.engine.verify import SamplingParams
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    outputs, _ = engine.generate(prompts, params, batch_size=batch_size, truncate=True)
    rows = []
    for prompt, out in zip(prompts, outputs):
        ids = engine.encode(prompt, True, max_new_tokens)
        if len(out.token_ids) >= 2:
            rows.append((torch.tensor(ids + list(out.token_ids)), len(ids)))
    return rows


@torch.no_grad()
def add_row(grid: AcceptanceGrid, target, draft, ids: torch.Tensor, answer_from: int) -> None:
    """One row's chains, TTT-style, into the grid: depth k at every answer position the chain reaches."""
    dev = target.device
    ids = ids.to(dev)[None]                                                    # [1, T]
    mask = torch.zeros_like(ids)
    mask[:, answer_from:] = 1
    aux, last = target.features(ids)
    batch = TTTBatch(ids, mask, last, aux)
    settings = TTTSettings(ttt_length=grid.depths, grow_every_chain=True)
    inputs = step_inputs(draft, batch, target.lm_head, settings)
    # the target's logits at the answer's positions, once: every depth predicts at those (the loss mask's)
    target_logits = target.lm_head(last[0, answer_from:].to(target.lm_head.weight.dtype))   # [T - answer_from, V]
    index = torch.arange(ids.shape[1], device=dev).view(1, -1)                 # [1, T] position ids
    hidden, alive = _features(draft, batch, "fused"), None
    for k in range(grid.depths):
        st = draft_step(draft, k, hidden, alive, inputs)
        if st is None:
            break
        at = st.at.ahead(index)[st.sel]                                        # [S] the positions it predicts
        grid.add(k, st.logits, target_logits[at - answer_from], inputs.targets.draft_ids)
        hidden, alive = draft.next_hidden(st.h), torch.ones_like(st.sel)


def run(args) -> int:
    from tqdm import tqdm

    from sglang_eagle3.engine.draft_calibration import FILE, DraftCalibration
    from sglang_eagle3.engine.loader import load_engine
    from sglang_eagle3.engine.settings import is_embedded, resolve_settings
    from sglang_eagle3.fileio import write_json
    from sglang_eagle3.paths import data_dir
    check_at_least(1, {"--per-set": args.per_set, "--max-new-tokens": args.max_new_tokens, "--depths": args.depths,
                       "--batch-size": args.batch_size})
    check_at_least(0, {"--first": args.first})
    if not args.temperatures or any(not (t > 0 and math.isfinite(t)) for t in args.temperatures):
        raise UserError(f"--temperatures {args.temperatures}: each must be a number > 0")
    settings = resolve_settings(args.draft, embedded_target=is_embedded(args), target=args.target, dtype=args.dtype,
                                temperature=args.sample_temperature, draft_children="sampled-raw",
                                batch_size=args.batch_size)
    if settings.draft is None:
        raise UserError("--draft: name the draft folder to calibrate (the embedded target's shipped draft is the "
                        "default)")
    out = args.out or os.path.join(settings.draft, FILE)
    if os.path.exists(out) and not args.overwrite:
        raise UserError(f"{out} exists: pass --overwrite to replace it, or --out another path")
    eval_dir = args.data or os.path.join(data_dir(), "eval")
    prompts = heldout_prompts(eval_dir, args.first, args.per_set)
    engine = load_engine(args.target, settings)
    t0 = time.perf_counter()
    print(f"sampling {len(prompts)} answers at T={args.sample_temperature:g} ({args.max_new_tokens} tokens each)",
          file=sys.stderr)
    rows = sampled_rows(engine, prompts, args.max_new_tokens, args.sample_temperature, args.seed, args.batch_size)
    grid = AcceptanceGrid(SCALES, tuple(args.temperatures), args.depths)
    for ids, answer_from in tqdm(rows, desc="chains", unit="row", file=sys.stderr, disable=args.quiet):
        add_row(grid, engine.target, engine.draft, ids, answer_from)
    report = grid.report()
    calibration = DraftCalibration(tuple(report["scales"]))
    about = {"fitted_on": {"data": "eval sets " + ", ".join(SETS), "first": args.first, "per_set": args.per_set,
                           "rows": len(rows), "positions_per_depth": [int(c) for c in grid.count],
                           "sample_temperature": args.sample_temperature, "max_new_tokens": args.max_new_tokens,
                           "seed": args.seed, "temperatures": list(args.temperatures), "grid": list(SCALES)},
             "by_depth": report["rows"], "seconds": round(time.perf_counter() - t0, 1)}
    write_json(out, calibration.as_json(**about))
    print(json.dumps({"logit_scale": report["scales"], "rows": report["rows"]}, indent=1))
    print(f"wrote {out}")
    return 0


def add_cli(sub) -> None:
    from sglang_eagle3.engine.settings import add_dtype_arg
    p = sub.add_parser("calibrate", help="fit the draft's per-depth sharpening for sampled children "
                                         "(draft_calibration.json beside the draft)")
    p.add_argument("--draft", default=None, help="draft folder (default: the shipped draft, with the embedded target)")
    p.add_argument("--target", default=None, help="target folder ('testbed' or none: the embedded SmolLM2)")
    add_dtype_arg(p)
    p.add_argument("--data", default=None, help="the eval sets' folder (default: $EAGLE3_DATA/eval)")
    p.add_argument("--first", type=int, default=40,
                   help="each set's first prompt used (default 40: benchmarks read the first 10-40)")
    p.add_argument("--per-set", type=int, default=20, help="prompts per set (default 20)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--sample-temperature", type=float, default=1.0, help="the answers' temperature (default 1)")
    p.add_argument("--temperatures", type=float, nargs="+", default=list(TEMPERATURES),
                   help="the sampling temperatures the fit averages over (default 0.7 1)")
    p.add_argument("--depths", type=int, default=7, help="tree depths fitted (default 7; deeper take the last)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8, help="answers sampled together (default 8)")
    p.add_argument("--out", default=None, help="where to write (default: DRAFT/draft_calibration.json)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
