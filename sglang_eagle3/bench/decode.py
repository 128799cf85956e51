"""Decode-speed benchmark on one target: transformers `generate` vs our runtime (vanilla) vs our
runtime with a random EAGLE-3 draft, batch 1, run alternately prompt by prompt in one process.

Also measured, per dtype: how close one decode step comes to its memory floor (bytes of weights read
per token / measured read bandwidth), the cost of one verify forward over trees of T tokens relative
to one token, and (bf16) how often speculative and vanilla outputs differ at all (numerical near-ties).
"""
from __future__ import annotations

import os
import statistics
import time

import torch
from tqdm import tqdm

from ..config import Eagle3Config, SpecConfig
from ..draft import Eagle3DraftModel
from ..engine import SpeculativeEngine
from ..generate_cli import DTYPES
from ..prompts import load_prompts
from ..target import TargetModel
from ..verify import SamplingParams

EVAL_SETS = ["mt_bench", "humaneval", "gsm8k", "alpaca", "sum"]


def read_bandwidth_gbs(nbytes: int = 1 << 29, repeats: int = 7) -> float:
    """Best-of-N read bandwidth of this machine (sum over a buffer much larger than the caches)."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def decode_bytes(tm: TargetModel) -> int:
    """Bytes one decode step must read: every layer's weights, the final norm and the lm_head."""
    n = sum(p.numel() * p.element_size() for p in tm.layers.parameters())
    n += sum(p.numel() * p.element_size() for p in tm.norm.parameters())
    return n + tm.lm_head.weight.numel() * tm.lm_head.weight.element_size()


def time_forward(tm: TargetModel, context: int, T: int, repeats: int) -> float:
    """Median seconds of one target forward over T new tokens (a chain) after `context` cached tokens."""
    cache = tm.new_cache(1, context + T + 1)
    ids = torch.randint(0, tm.vocab_size, (1, context))
    tm(cache, ids, torch.arange(context).view(1, -1), want_aux=False)
    cache.commit([list(range(context))])
    new = torch.randint(0, tm.vocab_size, (1, T))
    pos = (context + torch.arange(T)).view(1, T)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        tm(cache, new, pos, want_aux=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def hf_generate(hf, ids: list[int], max_new_tokens: int) -> list[int]:
    x = torch.tensor([ids])
    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def load_models(target_path: str, dtype_name: str, a):
    """transformers model, and our vanilla and random-draft engines on the same weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    hf = AutoModelForCausalLM.from_pretrained(target_path, dtype=DTYPES[dtype_name]).eval()
    tm = TargetModel(hf, AutoTokenizer.from_pretrained(target_path))
    torch.manual_seed(0)
    cfg = Eagle3Config.for_target(hf.config, draft_vocab_size=a.draft_vocab_size)
    draft = Eagle3DraftModel(cfg)
    draft.set_vocab_mapping(torch.arange(cfg.draft_vocab_size))
    spec = SpeculativeEngine(tm, draft, SpecConfig(a.num_steps, a.topk, a.num_draft_tokens))
    return hf, tm, SpeculativeEngine(tm, None), spec


def bench_dtype(target_path: str, dtype_name: str, prompts: list[str], a) -> dict:
    hf, tm, vanilla, spec = load_models(target_path, dtype_name, a)
    params = SamplingParams(max_new_tokens=a.max_new_tokens)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    variants = ["transformers", "vanilla", "speculative"]
    runs = {v: [] for v in variants}
    identical = {"vanilla_vs_transformers": 0, "speculative_vs_vanilla": 0}
    accept = []
    hf_generate(hf, vanilla.encode(chats[0]), 8)                  # warm-up of both paths
    vanilla.generate(chats[:1], SamplingParams(max_new_tokens=8))
    for i, chat in enumerate(tqdm(chats, desc=f"decode {dtype_name}", unit="prompt")):
        order = variants[i % 3:] + variants[:i % 3]               # rotate who goes first
        toks = {}
        for v in order:
            t0 = time.perf_counter()
            if v == "transformers":
                toks[v] = hf_generate(hf, vanilla.encode(chat), a.max_new_tokens)
            else:
                outs, st = (vanilla if v == "vanilla" else spec).generate([chat], params)
                toks[v] = outs[0].token_ids
                if v == "speculative":
                    accept.append(st.accept_length)
            dt = time.perf_counter() - t0
            runs[v].append({"tokens": len(toks[v]), "seconds": dt, "tokens_per_s": len(toks[v]) / dt})
        identical["vanilla_vs_transformers"] += _same(toks["vanilla"], toks["transformers"])
        identical["speculative_vs_vanilla"] += toks["speculative"] == toks["vanilla"]

    med = {v: statistics.median(r["tokens_per_s"] for r in runs[v]) for v in variants}
    ratio = lambda x, y: statistics.median(rx["tokens_per_s"] / ry["tokens_per_s"] for rx, ry in zip(runs[x], runs[y]))
    bw = read_bandwidth_gbs()
    step = time_forward(tm, a.context, 1, a.repeats)
    floor = decode_bytes(tm) / (bw * 1e9)
    tree_cost = {T: time_forward(tm, a.context, T, a.repeats) for T in a.tree_sizes}
    result = {
        "dtype": dtype_name, "prompts": len(prompts), "max_new_tokens": a.max_new_tokens,
        "median_tokens_per_s": med,
        "ratio_vanilla_over_transformers": ratio("vanilla", "transformers"),
        "ratio_speculative_over_vanilla": ratio("speculative", "vanilla"),
        "identical_outputs": identical, "random_draft_accept_length": statistics.mean(accept),
        "runs": runs,
        "decode_step": {"measured_s": step, "weight_bytes": decode_bytes(tm), "read_bandwidth_gbs": bw,
                        "floor_s": floor, "floor_over_measured": floor / step},
        "verify_cost_relative_to_1": {str(T): tree_cost[T] / tree_cost[1] for T in a.tree_sizes},
        "verify_cost_s": {str(T): tree_cost[T] for T in a.tree_sizes},
    }
    return result


def _same(ours: list[int], ref: list[int]) -> bool:
    """Equal, allowing transformers to omit a final EOS that we keep (or the reverse)."""
    k = min(len(ours), len(ref))
    return ours[:k] == ref[:k] and abs(len(ours) - len(ref)) <= 1


def divergence(target_path: str, dtype_name: str, prompts: list[str], a) -> dict:
    """How many prompts' greedy outputs differ between speculative and vanilla decoding (per 100).
    A correctness count, not a timing: it may run while the machine does other work."""
    _, _, vanilla, spec = load_models(target_path, dtype_name, a)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    params = SamplingParams(max_new_tokens=a.divergence_tokens)
    differ, first_diff = 0, []
    bs = a.divergence_batch
    for i in tqdm(range(0, len(chats), bs), desc="bf16 divergence", unit="batch"):
        van, _ = vanilla.generate(chats[i:i + bs], params)
        spc, _ = spec.generate(chats[i:i + bs], params)
        for v, s in zip(van, spc):
            if v.token_ids != s.token_ids:
                differ += 1
                first_diff.append(next((j for j, (x, y) in enumerate(zip(v.token_ids, s.token_ids)) if x != y),
                                       min(len(v.token_ids), len(s.token_ids))))
    return {"dtype": dtype_name, "prompts": len(prompts), "tokens_each": a.divergence_tokens, "differ": differ,
            "per_100": 100.0 * differ / len(prompts), "first_differing_token": first_diff}


def eval_prompts(data: str, n_mt: int, n_div: int) -> tuple[list[str], list[str]]:
    mt = [t[0] for t in load_prompts(os.path.join(data, "eval", "mt_bench.jsonl"), limit=n_mt)]
    pool = []
    for name in EVAL_SETS:
        path = os.path.join(data, "eval", f"{name}.jsonl")
        if os.path.isfile(path):
            pool.append([t[0] for t in load_prompts(path)])
    mixed = [p for group in zip(*pool) for p in group] if pool else []   # interleave the sets
    return mt, mixed[:n_div]
