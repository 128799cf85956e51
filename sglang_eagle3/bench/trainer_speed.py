"""Trainer throughput: one TTT optimizer step on real rows, fp32 vs bf16 autocast measured alternately.

Rows come from a prepare-data folder; the target computes their features once, up front (what a dump holds),
so only the trainer's own work is timed: the TTT forward and backward over `ttt_length` steps and the AdamW
step. Reported: tokens/s per precision (median over alternated rounds), model FLOP/s against the matmul peak
measured in the same run (a 2048 x 2048 matmul per dtype), and a torch.profiler breakdown of the "before"
configuration (fp32, the plain log_softmax loss, every chain grown) and the "after" one (bf16 autocast, the fused
loss), and of bf16 with --pack rows end to end per forward (the trainer's --pack-rows, make train's default). The packed
configuration runs three times: with csrc's loss kernels and only the chains a later step scores grown, with every
chain grown at every step (the trainer's --grow-chains auto picks this one on CPUs with AMX, the first elsewhere),
and with every chain and the loss in PyTorch ops. Model FLOPs count the
work each configuration does (fewer chains grown: fewer FLOPs for the same tokens).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from sglang_eagle3.bench import report
from sglang_eagle3.training.ttt import chains_to_grow


def matmul_peak_gflops(dtype: torch.dtype, n: int = 2048, repeats: int = 10, budget_s: float = 2.0) -> float:
    """Best of `repeats` n x n matmuls after a warm-up. Sizes grow from 256 to n only while one product stays
    quick: where a dtype has no native kernel (bf16 on a CPU without AVX-512 BF16: ~0.2 GFLOP/s) a 2048^3
    product takes minutes, and the peak of such a path is that of its small products anyway."""
    size = min(256, n)
    while True:
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        t0 = time.perf_counter()
        a @ b
        one = time.perf_counter() - t0
        if size >= n or one * 8 > budget_s / 4:          # the next size would cost 8x as much
            break
        size *= 2
    for _ in range(2):
        a @ b
    best, t_start = float("inf"), time.perf_counter()
    for i in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
        if i >= 1 and time.perf_counter() - t_start > budget_s:
            break
    return 2 * size ** 3 / best / 1e9


def ttt_flops(cfg, T: int, K: int, vocab: int, needed=None, grow_every_chain: bool = False) -> float:
    """Model FLOPs of one TTT row of T tokens (forward + backward = 3x forward for trained weights; the
    target's full-vocabulary head, forward only). needed [T] bool: the positions whose target distribution
    and draft logits are computed (the assistant tokens; default all): the heads run only there, and steps
    k >= 1 grow only the chains a later step scores (ttt.chains_to_grow; --grow-chains scored)."""
    H, I, Vd = cfg.hidden_size, cfg.intermediate_size, cfg.draft_vocab_size
    nH, nKV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    needed = np.ones(T, dtype=bool) if needed is None else np.asarray(needed, dtype=bool)
    grown = chains_to_grow(torch.from_numpy(np.ones_like(needed) if grow_every_chain else needed)[None], K)
    layer = 2 * H * (nH + 2 * nKV) * D + nH * D * H + 3 * H * I             # per token, multiply-adds
    total = 2 * int(needed.sum()) * cfg.target_hidden_size * vocab         # target distribution
    total += 3 * 2 * T * cfg.num_aux * cfg.target_hidden_size * H          # fc, once
    for k in range(K):
        n = T - k - 1
        if n <= 0:
            break
        cols = np.arange(n) if grown[k] is None else grown[k].numpy()     # base positions step k runs
        keys = float((cols + 1).sum()) + k * len(cols)                      # causal keys + the chain's own
        attn = 2 * 2 * keys * nH * D                                        # scores + weighted sum
        head = 2 * int(needed[k + 1:].sum()) * H * Vd                       # draft lm_head where scored
        total += 3 * (2 * len(cols) * layer + attn + head)
    return total


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="testbed")
    p.add_argument("--data", required=True, help="prepare-data folder, or a jsonl of {input_ids, loss_mask} rows")
    p.add_argument("--rows", type=int, default=6, help="rows per round")
    p.add_argument("--min-len", type=int, default=400)
    p.add_argument("--max-len", type=int, default=900)
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds per precision")
    p.add_argument("--ttt-length", type=int, default=7)
    p.add_argument("--pack", type=int, default=4, help="rows per forward in the packed configuration (--pack-rows)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--profile", action="store_true", help="also profile the before/after configurations")
    p.add_argument("--out", default="results/bench_trainer.json")
    return p


def run(argv=None) -> int:
    from sglang_eagle3.errors import UserError
    from sglang_eagle3.kernels import extension
    from sglang_eagle3.models.config import Eagle3Config
    from sglang_eagle3.models.draft import Eagle3DraftModel
    from sglang_eagle3.models.target import TargetModel
    from sglang_eagle3.models.testbed import resolve_target
    from sglang_eagle3.training.hidden_dump import load_token_rows
    from sglang_eagle3.training.trainer.backend import adamw
    from sglang_eagle3.training.ttt import TTTBatch, TTTSettings, ttt_forward
    a = build_parser().parse_args(argv)
    torch.set_num_threads(a.threads)
    fits = [r for r in load_token_rows(a.data) if a.min_len <= len(r[0]) <= a.max_len]
    rows = fits[::max(1, len(fits) // max(a.rows, 1))][:a.rows]          # spread over the data, not its head
    if len(rows) < a.rows:
        raise UserError(f"--data {a.data}: fewer than {a.rows} rows of {a.min_len}..{a.max_len} tokens")
    tm = TargetModel.from_pretrained(resolve_target(a.target), dtype=torch.bfloat16)
    draft_vocab = min(8192, tm.vocab_size)                               # the recipe's draft vocabulary
    cfg = Eagle3Config.for_target(tm.hf_config, draft_vocab)
    torch.manual_seed(0)
    draft = Eagle3DraftModel(cfg)
    draft.set_vocab_mapping(torch.arange(draft_vocab))
    draft.set_embedding(tm.embed_tokens)
    opt = adamw(draft.parameters(), lr=1e-5)                              # the trainer's optimizer
    feats = []
    for ids, mask in rows:
        x = torch.from_numpy(ids).long()[None]
        aux, last = tm.features(x)
        feats.append((x, torch.from_numpy(mask.astype(np.int64))[None], aux, last))
    tokens = sum(f[0].shape[1] for f in feats)
    flops = {grow_all: sum(ttt_flops(cfg, f[0].shape[1], a.ttt_length, tm.vocab_size, f[1][0].numpy() > 0, grow_all)
                           for f in feats) for grow_all in (False, True)}
    packed_name = f"bf16 autocast, {a.pack} rows packed per forward"
    # (autocast, fused loss, online, rows per forward, csrc's loss kernels for bf16 logits: soft CE, target side,
    #  every chain grown at every step)
    configs = {"fp32 (before)": (False, False, False, 1, True, True), "fp32": (False, True, False, 1, True, False),
               "bf16 autocast (after)": (True, True, False, 1, True, False),
               "bf16 autocast, online (target features each step)": (True, True, True, 1, True, False),
               f"{packed_name}, loss in PyTorch ops (no csrc kernels), every chain grown":
                   (True, True, False, a.pack, False, True),
               f"{packed_name}, every chain grown": (True, True, False, a.pack, True, True),
               packed_name: (True, True, False, a.pack, True, False),
               f"{packed_name}, online (`make train ONLINE=1`)": (True, True, True, a.pack, True, False)}

    def one_round(autocast: bool, fused: bool, online: bool, pack: int, kernel: bool, grow_all: bool) -> float:
        with extension.using("auto" if kernel else "off"):
            return _round(autocast, fused, online, pack, grow_all)

    def _round(autocast: bool, fused: bool, online: bool, pack: int, grow_all: bool) -> float:
        t0 = time.perf_counter()
        for i in range(0, len(feats), pack):
            group = feats[i:i + pack]
            if online:                                                   # what training without a dump pays
                with torch.no_grad():
                    group = [(x, m, *tm.features(x)) for x, m, _, _ in group]
            x, m, aux, last = group[0] if pack == 1 else (torch.cat(parts, 1) for parts in zip(*group))
            lengths = [g[0].shape[1] for g in group] if pack > 1 else None
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                batch = TTTBatch(x, m, last, aux_hidden_states=aux, row_lengths=lengths)
                out = ttt_forward(draft, batch, tm.lm_head,
                                  TTTSettings(ttt_length=a.ttt_length, fused_ce=fused, grow_every_chain=grow_all))
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for cfg_flags in configs.values():                                   # warm-up
        one_round(*cfg_flags)
    times = {name: [] for name in configs}
    for _ in range(a.rounds):
        for name, cfg_flags in configs.items():                          # alternated
            times[name].append(one_round(*cfg_flags))
    peak = {"bfloat16": matmul_peak_gflops(torch.bfloat16), "float32": matmul_peak_gflops(torch.float32)}
    result = {"format": "sglang_eagle3.bench_trainer/1", "rows": len(feats), "tokens_per_round": tokens,
              "ttt_length": a.ttt_length, "threads": a.threads, "model_gflop_per_round": flops[False] / 1e9,
              "model_gflop_per_round_every_chain_grown": flops[True] / 1e9,
              "matmul_peak_gflops": peak, "configs": {}, "meta": report.run_metadata()}
    for name, ts in times.items():
        t = statistics.median(ts)
        dt = "bfloat16" if "bf16" in name else "float32"
        work = flops[configs[name][5]]                                   # the FLOPs this configuration does
        result["configs"][name] = {"tokens_per_s": tokens / t, "gflops": work / t / 1e9,
                                   "fraction_of_peak": work / t / 1e9 / peak[dt], "seconds": ts}
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        result["profile"] = {}
        for name in ("fp32 (before)", "bf16 autocast (after)", packed_name):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                one_round(*configs[name])
            top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
            result["profile"][name] = [{"op": e.key, "self_ms_per_row": e.self_cpu_time_total / 1e3 / len(feats),
                                        "calls": e.count} for e in top]
    report.write_outputs(a.out, result, render(result))
    return 0


def render(r: dict) -> str:
    rows = [[name, f"{c['tokens_per_s']:.0f}", f"{c['gflops']:.0f}", f"{100 * c['fraction_of_peak']:.0f}%"]
            for name, c in r["configs"].items()]
    out = [f"TTT training step ({r['rows']} rows, {r['tokens_per_round']} tokens per round, {r['ttt_length']} steps, "
           f"{r['threads']} threads), median of alternated rounds; matmul peak bf16 "
           f"{r['matmul_peak_gflops']['bfloat16']:.0f} GFLOP/s, fp32 {r['matmul_peak_gflops']['float32']:.0f} GFLOP/s",
           report.format_table(["configuration", "tokens/s", "model GFLOP/s", "of peak"], rows)]
    for name, ops in (r.get("profile") or {}).items():
        out += ["", f"Top ops, {name} (ms per row)",
                report.format_table(["op", "ms/row", "calls"], [[o["op"], f"{o['self_ms_per_row']:.1f}", o["calls"]]
                                                                for o in ops])]
    return "\n".join(out)


def main(argv=None) -> int:
    from sglang_eagle3.bench import run_cli
    return run_cli("bench_trainer", run, argv)


if __name__ == "__main__":
    sys.exit(main())
