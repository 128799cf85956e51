"""What decides speculative decoding speed on one machine, measured in one process.

Two runtimes on the same weights: `eager` (plain PyTorch: F.linear, torch attention and norms; what
`--compile off` runs) and `fused` (the default: on CPU oneDNN-prepacked bf16 linears and the C++ kernels of
kernels/csrc/, built once at install; on CUDA the decode/verify forwards replayed as CUDA graphs). Parts:
  speed    batch 1, per prompt alternately: transformers `generate`, ours eager, ours fused (tokens/s);
           llama.cpp's own decode of the same model (llama-bench) when the pinned build is present.
  step     one decode step vs its memory floor (weight bytes / measured read bandwidth), and the cost of one
           verify forward over T tokens relative to T = 1, both runtimes.
  trees    with a trained draft, per tree shape: draft cost per step relative to one target step, verify
           cost, the break-even acceptance length (draft + verify) / vanilla step, and the acceptance the
           draft actually reaches with that shape (and the measured speed-up).
  profile  torch.profiler breakdown of a vanilla and a speculative step (draft tree, draft extend, verify
           forward, acceptance, KV commit) at batch 1 and 8, both runtimes.
  compile  torch.compile (inductor, static shapes, gpt-fast style) of a plain decode step, for comparison.
  divergence  bf16: how often speculative and vanilla greedy outputs differ (numerical near-ties).
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Optional

import torch

from sglang_eagle3.bench.acceptance import EVAL_SETS
from sglang_eagle3.engine.cost_model import prepared_forward
from sglang_eagle3.engine.engine import SpeculativeEngine
from sglang_eagle3.engine.loader import load_draft
from sglang_eagle3.engine.prompts import load_prompts
from sglang_eagle3.engine.settings import DTYPES, Settings
from sglang_eagle3.engine.speculation import SpecConfig
from sglang_eagle3.engine.verify import SamplingParams
from sglang_eagle3.kernels import decode as kernels
from sglang_eagle3.kernels import extension
from sglang_eagle3.models.target import TargetModel

PHASES = ("draft_extend", "draft_tree", "verify_forward", "accept", "kv_commit", "draft_hold")


def read_bandwidth_gbs(nbytes: int = 1 << 29, repeats: int = 7) -> float:
    """Best-of-N read bandwidth of this machine (sum over a buffer much larger than the caches)."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def peak_matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    """Best-of-N GFLOP/s of torch's fp32 n x n matmul on this machine's threads: the compute peak a kernel can be
    measured against (oneDNN's fp32 GEMM on the widest FMA units the CPU has)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


class Runtimes:
    """transformers' model and our runtimes (eager, fused, and fused with another few-row kernel where the build has
    one to compare: fused-amx / fused-avx512 on AMX CPUs, fused-avx2 where AVX-512F is the default) over the same
    weights."""

    def __init__(self, target_path: str, dtype_name: str, device: str = "cpu"):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.hf = AutoModelForCausalLM.from_pretrained(target_path, dtype=DTYPES[dtype_name]).to(device).eval()
        tok = AutoTokenizer.from_pretrained(target_path)
        t0 = time.perf_counter()
        self.extension_ready = extension.load() is not None
        self.extension_load_s = time.perf_counter() - t0
        with extension.using("off"):
            self.eager = TargetModel(self.hf, tok)
        self.fused = TargetModel(self.hf, tok)
        self.mode = {"eager": "off", "fused": "auto", "fused-avx512": "auto", "fused-amx": "auto", "fused-avx2": "auto"}
        self.fused_other, self.other_name = None, None   # the few-row kernel fused does not use, to compare
        if extension.amx_usable():
            amx = not extension.amx_active()
            with extension.using_amx(amx):
                self.fused_other = TargetModel(self.hf, tok)
            self.other_name = "fused-amx" if amx else "fused-avx512"
        elif extension.few_row_kernel() == "avx512f":   # a CPU with AVX-512F and no BF16: the AVX2 kernel beside it
            with extension.using_few_row("avx2"):
                self.fused_other = TargetModel(self.hf, tok)
            self.other_name = "fused-avx2"
        self.kernels = {name: self.target(name).layers[0].wqkv.kernel for name in self.step_runtimes()}   # or None

    def target(self, name: str) -> TargetModel:
        return {"eager": self.eager, "fused": self.fused, self.other_name: self.fused_other}[name]

    def step_runtimes(self) -> list[str]:
        return ["eager", "fused"] + ([self.other_name] if self.fused_other is not None else [])


def time_forward(tm: TargetModel, context: int, T: int, repeats: int, batch: int = 1) -> float:
    """Median seconds of one target forward over T new tokens per row after `context` cached tokens."""
    forward = prepared_forward(tm, context, T, batch)
    times = [forward() for _ in range(repeats + 2)]
    return statistics.median(times[2:])


def hf_generate(hf, ids: list[int], max_new_tokens: int) -> list[int]:
    x = torch.tensor([ids], device=hf.device)
    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def _same(ours: list[int], ref: list[int]) -> bool:
    """Equal, allowing transformers to omit a final EOS that we keep (or the reverse)."""
    k = min(len(ours), len(ref))
    return ours[:k] == ref[:k] and abs(len(ours) - len(ref)) <= 1


# ---- speed ---------------------------------------------------------------------------------------
def bench_speed(rt: Runtimes, prompts: list[str], max_new_tokens: int) -> dict:
    from tqdm import tqdm
    params = SamplingParams(max_new_tokens=max_new_tokens)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    engines = {n: SpeculativeEngine(rt.target(n), None, Settings()) for n in ("eager", "fused")}
    variants = ["transformers", "eager", "fused"]
    runs = {v: [] for v in variants}
    same = {"fused_vs_transformers": 0, "fused_vs_eager": 0}
    ids0 = engines["fused"].encode(chats[0])
    hf_generate(rt.hf, ids0, 8)                                        # warm-up of every path
    for n, e in engines.items():
        with extension.using(rt.mode[n]):
            e.generate(chats[:1], SamplingParams(max_new_tokens=8))
    for i, chat in enumerate(tqdm(chats, desc="decode speed", unit="prompt")):
        order = variants[i % 3:] + variants[:i % 3]                     # rotate who goes first
        toks = {}
        for v in order:
            t0 = time.perf_counter()
            if v == "transformers":
                toks[v] = hf_generate(rt.hf, engines["fused"].encode(chat), max_new_tokens)
            else:
                with extension.using(rt.mode[v]):
                    toks[v] = engines[v].generate([chat], params)[0][0].token_ids
            dt = time.perf_counter() - t0
            runs[v].append({"tokens": len(toks[v]), "seconds": dt, "tokens_per_s": len(toks[v]) / dt})
        same["fused_vs_transformers"] += _same(toks["fused"], toks["transformers"])
        same["fused_vs_eager"] += toks["fused"] == toks["eager"]
    med = {v: statistics.median(r["tokens_per_s"] for r in runs[v]) for v in variants}
    ratio = lambda x, y: statistics.median(a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs[x], runs[y]))  # noqa: E731
    return {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "median_tokens_per_s": med,
            "ratio_fused_over_transformers": ratio("fused", "transformers"),
            "ratio_eager_over_transformers": ratio("eager", "transformers"),
            "ratio_fused_over_eager": ratio("fused", "eager"), "identical": same, "runs": runs}


# ---- step cost --------------------------------------------------------------------------------------
def bench_step(rt: Runtimes, context: int, tree_sizes: list[int], repeats: int) -> dict:
    """Every runtime's forward over T tokens, for each T, timed in turn within each repeat (runtimes and sizes
    alternated, medians over repeats): a slow spell of a shared host then hits every runtime alike, where timing
    one runtime's repeats in a block let one spell decide a kernel comparison (the Xeon with AMX: one-token steps
    of the two few-row kernels measured 16.7 vs 12.1 ms in one blocked run, 12.1 vs 12.4 in the next)."""
    tree_sizes = sorted({1, *tree_sizes})                         # costs are relative to one token
    bw = read_bandwidth_gbs()
    nbytes = rt.fused.weight_bytes()
    flops = {T: rt.fused.forward_flops(context, T) for T in tree_sizes}
    out = {"read_bandwidth_gbs": bw, "weight_bytes": nbytes, "floor_s": nbytes / (bw * 1e9), "context": context,
           "peak_gflops": peak_matmul_gflops(), "peak_note": "torch fp32 2048 x 2048 matmul, best of 5",
           "forward_flops": {str(T): f for T, f in flops.items()}, "alternated": True, "repeats": repeats}
    forwards = {}
    for name in rt.step_runtimes():
        with extension.using(rt.mode[name]):
            forwards[name] = {T: prepared_forward(rt.target(name), context, T) for T in tree_sizes}
    times = {name: {T: [] for T in tree_sizes} for name in forwards}
    for r in range(repeats + 2):                                   # the first two: warm-up, not kept
        for name, by_t in forwards.items():
            with extension.using(rt.mode[name]):
                for T, forward in by_t.items():
                    t = forward()
                    if r >= 2:
                        times[name][T].append(t)
    for name in forwards:
        cost = {T: statistics.median(ts) for T, ts in times[name].items()}
        out[name] = {"step_s": cost[1], "floor_over_step": out["floor_s"] / cost[1],
                     "step_over_floor": cost[1] / out["floor_s"], "few_row_kernel": rt.kernels.get(name),
                     "verify_s": {str(T): c for T, c in cost.items()},
                     "verify_relative": {str(T): c / cost[1] for T, c in cost.items()},
                     "verify_gflops": {str(T): flops[T] / c / 1e9 for T, c in cost.items()}}
    return out


# ---- trees ----------------------------------------------------------------------------------------
def parse_trees(text: str) -> list[SpecConfig]:
    out = []
    for part in text.split(";"):
        s, k, n = (int(x) for x in part.split(","))
        out.append(SpecConfig(s, k, n))
    return out


def bench_trees(rt: Runtimes, draft_path: str, dtype_name: str, prompts: list[str], trees: list[SpecConfig],
                max_new_tokens: int) -> dict:
    """Per tree shape: per-step draft and verify cost, break-even and measured acceptance, speed-up (fused)."""
    from tqdm import tqdm
    chats = [[{"role": "user", "content": p}] for p in prompts]
    params = SamplingParams(max_new_tokens=max_new_tokens)
    draft = load_draft(draft_path, DTYPES[dtype_name])
    vanilla = SpeculativeEngine(rt.fused, None, Settings(dtype_name))
    vanilla.generate(chats[:1], SamplingParams(max_new_tokens=8))
    engines = [SpeculativeEngine(rt.fused, draft, Settings(dtype_name, tree=t)) for t in trees]
    engines[0].generate(chats[:1], SamplingParams(max_new_tokens=8))
    van = {"tokens": 0, "steps": 0, "time": 0.0}
    per = [{"tokens": 0, "steps": 0, "time": 0.0, "draft": 0.0, "verify": 0.0} for _ in trees]
    for chat in tqdm(chats, desc="tree shapes", unit="prompt"):
        _, st = vanilla.generate([chat], params)
        van["tokens"] += st.generated_tokens - 1
        van["steps"] += st.verify_steps - 1
        van["time"] += st.verify_time + st.draft_time
        for p, eng in zip(per, engines):
            _, st = eng.generate([chat], params)
            p["tokens"] += st.generated_tokens - 1                     # decode steps only (prefill excluded)
            p["steps"] += st.verify_steps - 1
            p["time"] += st.verify_time + st.draft_time
            p["draft"] += st.draft_time
            p["verify"] += st.verify_time
    step = van["time"] / van["steps"]
    rows = []
    for t, p in zip(trees, per):
        draft_s, verify_s = p["draft"] / p["steps"], p["verify"] / p["steps"]
        tau = p["tokens"] / p["steps"]
        breakeven = (draft_s + verify_s) / step
        rows.append({"tree": {"num_steps": t.num_steps, "topk": t.topk, "num_draft_tokens": t.num_draft_tokens},
                     "draft_over_step": draft_s / step, "verify_over_step": verify_s / step,
                     "draft_over_verify": draft_s / verify_s, "breakeven_accept_length": breakeven,
                     "accept_length": tau, "predicted_speedup": tau / breakeven,
                     "measured_speedup": (p["tokens"] / p["time"]) / (van["tokens"] / van["time"])})
    return {"draft": os.path.abspath(draft_path), "prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "vanilla_step_s": step, "trees": rows,
            "note": "per decode step, prefill excluded; accept_length = tokens emitted per target forward"}


# ---- profile ---------------------------------------------------------------------------------------
def bench_profile(rt: Runtimes, draft_path: Optional[str], dtype_name: str, prompt: str, spec: SpecConfig,
                  batches: list[int], steps: int = 20) -> dict:
    """ms per step of each phase (torch.profiler record_function scopes in the speculative worker)."""
    from torch.profiler import ProfilerActivity, profile

    from sglang_eagle3.engine.spec_worker import SpecWorker
    draft = load_draft(draft_path, DTYPES[dtype_name]) if draft_path else None
    out = {}
    for name in ("eager", "fused"):
        with extension.using(rt.mode[name]):
            tm = rt.target(name)
            # prepares the draft for this runtime (mode off: plain weights and PyTorch norms)
            eng = SpeculativeEngine(tm, draft, Settings(dtype_name, tree=spec)) if draft is not None else None
            ids = SpeculativeEngine(tm, None, Settings(dtype_name)).encode([{"role": "user", "content": prompt}])
            for B in batches:
                for kind, use in (("vanilla", None), ("speculative", spec)):
                    if kind == "speculative" and draft is None:
                        continue
                    w = SpecWorker(tm, draft if use else None, B, len(ids) + (steps + 4) * spec.num_draft_tokens + 8,
                                   spec.draft_slots)
                    params = [SamplingParams(max_new_tokens=10 ** 6, ignore_eos=True)] * B
                    for r in range(B):
                        w.prefill(r, ids, params[0])
                    for _ in range(2):
                        w.step(list(range(B)), params, [None] * B, use)
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        t0 = time.perf_counter()
                        for _ in range(steps):
                            w.step(list(range(B)), params, [None] * B, use)
                        wall = (time.perf_counter() - t0) / steps
                    phases = {e.key.split("::")[1]: e.cpu_time_total / 1e3 / steps
                              for e in prof.key_averages() if e.key.startswith("eagle3::")}
                    out[f"{name}/{kind}/b{B}"] = {"step_ms": wall * 1e3, "phases_ms": phases}
            del eng
    return out


# ---- torch.compile ----------------------------------------------------------------------------------
def bench_compile(rt: Runtimes, context: int, tokens: int = 64) -> dict:
    """A gpt-fast-style decode step (static KV window, SDPA with a position mask, plain F.linear) compiled by
    inductor with fixed shapes, against our fused step: compile time and step time."""
    import torch.nn.functional as F
    tm = rt.eager                                     # plain weights
    S = context + tokens + 8
    L, nH, nKV, D = tm.num_layers, tm.num_heads, tm.num_kv_heads, tm.head_dim
    kc = torch.zeros(L, 1, nKV, S, D, dtype=tm.dtype)
    vc = torch.zeros_like(kc)
    layers = [(ly.wqkv.weight, ly.wo.weight, ly.w_gate_up.weight, ly.w_down.weight, ly.input_norm.weight,
               ly.post_norm.weight, ly.eps) for ly in tm.layers]

    def norm(x, w, eps):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def step(ids, pos):                                # ids [1, 1], pos [1] int64
        x = tm.embed_tokens(ids)
        cos, sin = tm.rotary_emb(x, pos.view(1, 1))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        mask = (torch.arange(S) <= pos).view(1, 1, 1, S)
        for i, (wqkv, wo, wgu, wd, n1, n2, eps) in enumerate(layers):
            q, k, v = F.linear(norm(x, n1, eps), wqkv).split([nH * D, nKV * D, nKV * D], -1)
            q = kernels.apply_rope(q.view(1, 1, nH, D).transpose(1, 2), cos, sin)
            k = kernels.apply_rope(k.view(1, 1, nKV, D).transpose(1, 2), cos, sin)
            kc[i].index_copy_(2, pos, k)
            vc[i].index_copy_(2, pos, v.view(1, 1, nKV, D).transpose(1, 2))
            o = F.scaled_dot_product_attention(q, kc[i], vc[i], attn_mask=mask, enable_gqa=True)
            x = x + F.linear(o.transpose(1, 2).reshape(1, 1, nH * D), wo)
            g, u = F.linear(norm(x, n2, eps), wgu).chunk(2, -1)
            x = x + F.linear(F.silu(g) * u, wd)
        return tm.lm_head(norm(x, tm.norm.weight, tm.final_eps)).float()

    compiled = torch.compile(step, dynamic=False, fullgraph=True)
    ids = torch.tensor([[5]])
    t0 = time.perf_counter()
    with torch.no_grad():
        for p in range(context):                       # fill the window (the first calls compile)
            compiled(ids, torch.tensor([p]))
        compile_s = time.perf_counter() - t0
        times = []
        for p in range(context, context + tokens):
            t1 = time.perf_counter()
            compiled(ids, torch.tensor([p]))
            times.append(time.perf_counter() - t1)
    with extension.using("auto"):
        fused = time_forward(rt.fused, context, 1, 20)
    return {"mode": "torch.compile(dynamic=False, fullgraph=True), inductor defaults", "context": context,
            "compile_and_warmup_s": compile_s, "step_s": statistics.median(times), "fused_step_s": fused,
            "compiled_over_fused": statistics.median(times) / fused}


# ---- divergence (bf16 near-ties) ---------------------------------------------------------------------
def divergence(target_path: str, draft_path: Optional[str], dtype_name: str, prompts: list[str], tokens: int,
               batch: int) -> dict:
    """How many prompts' greedy outputs differ between speculative and vanilla decoding (per 100).
    A correctness count, not a timing: it may run while the machine does other work."""
    from tqdm import tqdm

    from sglang_eagle3.engine.loader import load_engine
    spec_engine = load_engine(target_path, Settings(dtype_name, draft_path))
    vanilla = SpeculativeEngine(spec_engine.target, None, Settings(dtype_name))
    chats = [[{"role": "user", "content": p}] for p in prompts]
    params = SamplingParams(max_new_tokens=tokens)
    differ, first_diff = 0, []
    for i in tqdm(range(0, len(chats), batch), desc=f"{dtype_name} divergence", unit="batch"):
        van, _ = vanilla.generate(chats[i:i + batch], params, batch_size=batch)
        spc, _ = spec_engine.generate(chats[i:i + batch], params, batch_size=batch)
        for v, s in zip(van, spc):
            if v.token_ids != s.token_ids:
                differ += 1
                first_diff.append(next((j for j, (x, y) in enumerate(zip(v.token_ids, s.token_ids)) if x != y),
                                       min(len(v.token_ids), len(s.token_ids))))
    return {"dtype": dtype_name, "draft": draft_path, "prompts": len(prompts), "tokens_each": tokens,
            "differ": differ, "per_100": 100.0 * differ / len(prompts), "first_differing_token": first_diff}


def eval_prompts(data: str, n_mt: int, n_mixed: int) -> tuple[list[str], list[str]]:
    mt = [t[0] for t in load_prompts(os.path.join(data, "eval", "mt_bench.jsonl"), limit=n_mt)]
    pool = []
    for name in EVAL_SETS:
        path = os.path.join(data, "eval", f"{name}.jsonl")
        if os.path.isfile(path):
            pool.append([t[0] for t in load_prompts(path)])
    mixed = [p for group in zip(*pool) for p in group] if pool else []   # interleave the sets
    return mt, mixed[:n_mixed]
