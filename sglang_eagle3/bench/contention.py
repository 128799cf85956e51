"""bench_decode's contention part: decoding beside other busy processes that the benchmark starts and stops itself.

Each load runs vanilla and speculative decoding (batch 1, alternated per prompt) and an 8-token verify forward, and
reports each as a share of its idle speed. Loads:
  idle      nothing else started (what else runs shows as the governor's reading of the others' cores); here the
            governor is also switched off and on alternately, to measure its own cost
  loop      one single-threaded Python busy loop
  torch2    a two-thread torch matmul loop (another model computing on the machine)
  generate  a second process decoding with this package's engine (vanilla, batch 1) in a loop
The thread governor (engine/threads.py) is on unless EAGLE3_ADAPT_THREADS=0; the threads it chose and the cores it
saw the others take are recorded.
"""
from __future__ import annotations

import atexit
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Optional

LOADS = ("idle", "loop", "torch2", "generate")
LOAD_TEXT = {"idle": "idle", "loop": "a 1-thread busy loop", "torch2": "a 2-thread torch job",
             "generate": "a second eagle3 decode"}
_BUSY_CODE = {
    "loop": "while True: pass",
    "torch2": ("import torch\ntorch.set_num_threads(2)\na = torch.randn(512, 512)\n"
               "while True:\n    a = (a @ a).clamp_(-1, 1)"),
    "generate": ("import sys, torch\nfrom sglang_eagle3.engine.loader import load_engine\n"
                 "from sglang_eagle3.engine.settings import Settings\n"
                 "from sglang_eagle3.engine.verify import SamplingParams\n"
                 "e = load_engine(sys.argv[1], Settings(sys.argv[2]))\n"
                 "p = SamplingParams(max_new_tokens=64, ignore_eos=True)\n"
                 "print('ready', flush=True)\n"
                 "while True:\n    e.generate([[{'role': 'user', 'content': 'Tell me about the moon.'}]], p)"),
}


def start_busy(load: str, target: str, dtype: str) -> Optional[subprocess.Popen]:
    """Start the load's process (None for idle) and return once it computes; it is killed at exit at the latest
    (bench_acceptance / bench_serving --beside)."""
    if load == "idle":
        return None
    args = [sys.executable, "-c", _BUSY_CODE[load]] + ([target, dtype] if load == "generate" else [])
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    atexit.register(stop_busy, proc)
    if load == "generate":
        proc.stdout.readline()                            # "ready": the model is loaded and decoding starts
    time.sleep(1.5)                                       # long enough for the governor's readings
    return proc


def stop_busy(proc: Optional[subprocess.Popen]) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


@contextmanager
def busy(load: str, target: str, dtype: str):
    proc = start_busy(load, target, dtype)
    try:
        yield
    finally:
        stop_busy(proc)


def _decode(engine, chat, params) -> tuple[float, list[int]]:
    out, st = engine.generate([chat], params)
    return (st.generated_tokens - 1) / max(st.total_time - st.prefill_time, 1e-9), out[0].token_ids


def _verify_s(forward, repeats: int) -> float:
    from sglang_eagle3.engine.threads import governor
    times = []
    for _ in range(repeats):
        governor().update()                               # as the scheduler does before each step
        times.append(forward())
    return statistics.median(times)


def bench_contention(target_model, draft, spec, target_path: str, dtype: str, prompts: list[str],
                     max_new_tokens: int, context: int, repeats: int, loads: list[str]) -> dict:
    from tqdm import tqdm

    from sglang_eagle3.engine.cost_model import prepared_forward
    from sglang_eagle3.engine.engine import SpeculativeEngine
    from sglang_eagle3.engine.settings import Settings
    from sglang_eagle3.engine.threads import governor
    from sglang_eagle3.engine.verify import SamplingParams
    chats = [[{"role": "user", "content": p}] for p in prompts]
    params = SamplingParams(max_new_tokens=max_new_tokens)
    engines = {"vanilla": SpeculativeEngine(target_model, None, Settings(dtype)),
               "speculative": SpeculativeEngine(target_model, draft, Settings(dtype, tree=spec))}
    for e in engines.values():
        e.generate(chats[:1], SamplingParams(max_new_tokens=8))          # warm-up
    forward = prepared_forward(target_model, context, 8)
    out = {"loads": {}, "prompts": len(prompts), "max_new_tokens": max_new_tokens,
           "governor": governor().available, "cores": governor().cores}
    idle_tokens, g = {}, governor()
    for load in tqdm(loads, desc="contention", unit="load"):
        with busy(load, target_path, dtype):
            runs = [(k, True) for k in engines] + ([(k, False) for k in engines] if load == "idle" else [])
            tps = {run: [] for run in runs}
            same = {k: 0 for k in engines}                # outputs equal to the same engine's idle ones
            for i, chat in enumerate(chats):
                for k, governed in (runs if i % 2 == 0 else runs[::-1]):     # alternated per prompt
                    g.enabled = governed and g.available
                    t, toks = _decode(engines[k], chat, params)
                    tps[(k, governed)].append(t)
                    if governed:
                        idle_tokens.setdefault((k, i), toks)
                        same[k] += toks == idle_tokens[(k, i)]
            g.enabled = g.available
            verify = _verify_s(forward, repeats)
            row = {"vanilla_tokens_per_s": statistics.median(tps[("vanilla", True)]),
                   "speculative_tokens_per_s": statistics.median(tps[("speculative", True)]),
                   "verify8_s": verify, "threads": g.threads, "other_cores": g.other_cores,
                   "identical_to_idle": same}
            if load == "idle":        # the governor's own cost on an idle machine, measured alternately
                row.update({f"{k}_tokens_per_s_governor_off": statistics.median(tps[(k, False)]) for k in engines})
            out["loads"][load] = row
    idle = out["loads"].get("idle")
    if idle:
        for r in out["loads"].values():
            r["vanilla_share"] = r["vanilla_tokens_per_s"] / idle["vanilla_tokens_per_s"]
            r["speculative_share"] = r["speculative_tokens_per_s"] / idle["speculative_tokens_per_s"]
            r["verify8_share"] = idle["verify8_s"] / r["verify8_s"]
            r["speedup"] = r["speculative_tokens_per_s"] / r["vanilla_tokens_per_s"]
        if "vanilla_tokens_per_s_governor_off" in idle:
            out["idle_governor_on_over_off"] = {k: idle[f"{k}_tokens_per_s"] / idle[f"{k}_tokens_per_s_governor_off"]
                                                for k in ("vanilla", "speculative")}
    return out
