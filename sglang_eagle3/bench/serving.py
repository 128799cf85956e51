"""Serving benchmark: one OpenAI-API client for our server and for SGLang's, a sweep over concurrency.

For each concurrency level and each server (e.g. vanilla and EAGLE-3), the same requests (eval prompts
through the chat API, streaming, greedy by default) are sent with that many in flight; measured: output
tokens/s and requests/s over the level's wall time, time to first token and inter-token latency (p50, p99;
ITL = gaps between streamed chunks, divided among the tokens a chunk carries, as a speculative server sends
several tokens at once), and the acceptance length the server reports (our `spec_stats`; SGLang's
/server_info when that is what is running). From our server's /metrics, per level: the share of rows whose tree
held more than the root, the rows' mean tree size and the draft's share of the steps' time. Levels alternate
between the servers to spread drift. `--temperature 0,default` sweeps greedy requests and requests that send no
temperature (the server's default, OpenAI's 1.0) on the same servers, each level with its own prompts.

--start builtin launches our server twice (vanilla: no draft; EAGLE-3: the draft with its speculation
profile) on free local ports, runs the sweep and stops them. Outputs JSON, a Markdown table and a PNG.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from typing import Optional

from sglang_eagle3.bench import report
from sglang_eagle3.bench.contention import LOAD_TEXT, LOADS, start_busy, stop_busy
from sglang_eagle3.bench.drafters import parse_drafters
from sglang_eagle3.errors import UserError, check_at_least, flags_of

DEFAULT_LEVELS = "1,2,4,8,16,32,64"


def percentile(xs: list[float], q: float) -> Optional[float]:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def sse_lines(response):
    """The lines of an event stream, split at LF only (SSE's line end; CR LF too): text in an event may hold characters
    that str.splitlines, and so httpx's aiter_lines, would also split at (U+2028, NEL)."""
    buffer = b""
    async for chunk in response.aiter_bytes():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode("utf-8", errors="replace")
    if buffer:
        yield buffer.rstrip(b"\r").decode("utf-8", errors="replace")


async def one_request(client, url: str, model: str, prompt: str, max_tokens: int, temperature: Optional[float],
                      ignore_eos: bool) -> dict:
    """One streamed chat request; temperature None leaves the field out (the server's default: OpenAI's 1.0)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    if temperature is not None:
        body["temperature"] = temperature
    if ignore_eos:
        body["ignore_eos"] = True
    import httpx
    t0 = time.perf_counter()
    first, last, gaps, chunks, usage, spec = None, None, [], 0, None, None
    try:
        async with client.stream("POST", url + "/chat/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")[:300]
                return {"ok": False, "status": r.status_code, "error": text}
            async for line in sse_lines(r):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                now = time.perf_counter()
                if msg.get("usage"):
                    usage = msg["usage"]
                if msg.get("spec_stats"):
                    spec = msg["spec_stats"]
                ch = (msg.get("choices") or [{}])[0]
                if (ch.get("delta") or {}).get("content"):
                    chunks += 1
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
    except httpx.HTTPError as e:               # past --timeout, or the server went away: this request failed
        return {"ok": False, "status": type(e).__name__, "error": str(e) or type(e).__name__}
    end = time.perf_counter()
    tokens = (usage or {}).get("completion_tokens", chunks)
    # tokens after the first chunk arrive in (chunks - 1) gaps: spread them evenly over the gaps
    per_gap = (tokens - 1) / len(gaps) if gaps and tokens > 1 else 1.0
    return {"ok": True, "tokens": tokens, "ttft": (first or end) - t0, "latency": end - t0,
            "itl": [g / per_gap for g in gaps for _ in range(1)], "spec": spec}


async def run_level(url: str, model: str, prompts: list[str], concurrency: int, n: int, max_tokens: int,
                    temperature: Optional[float], ignore_eos: bool, timeout: float) -> dict:
    import httpx
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        async def go(i):
            async with sem:
                return await one_request(client, url, model, prompts[i % len(prompts)], max_tokens, temperature,
                                         ignore_eos)
        t0 = time.perf_counter()
        results = await asyncio.gather(*[go(i) for i in range(n)])
        wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    itl = [g for r in ok for g in r["itl"]]
    ttft = [r["ttft"] for r in ok]
    specs = [r["spec"] for r in ok if r["spec"]]
    accept = report.safe_div(sum(s["accept_length"] * s["verify_steps"] for s in specs),
                             sum(s["verify_steps"] for s in specs)) if specs else None
    return {"concurrency": concurrency, "requests": n, "completed": len(ok), "failed": n - len(ok),
            "errors": sorted({f"{r['status']}: {r['error'][:80]}" for r in results if not r["ok"]})[:3],
            "wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "requests_per_s": len(ok) / wall, "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "itl_p50_s": percentile(itl, 0.5), "itl_p99_s": percentile(itl, 0.99), "accept_length": accept}


def server_model(url: str, what: str) -> str:
    """The model the server at url serves (GET url/models); what: the server as the user named it (--url NAME=URL),
    for the one-line error when nothing, or no OpenAI server, answers there."""
    import httpx
    try:
        r = httpx.get(url + "/models", timeout=30)
    except httpx.HTTPError as e:
        raise UserError(f"{what}: no server answers there ({type(e).__name__}: {e})") from None
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, LookupError, TypeError):
        raise UserError(f"{what}: GET {url}/models answered {r.status_code}, not an OpenAI model list (the URL "
                        "should end in the API's /v1)") from None


STEP_METRICS = {"eagle3_step_rows_total": "row_steps", "eagle3_speculated_rows_total": "speculated_rows",
                "eagle3_verified_tokens_total": "verified_tokens", 'eagle3_step_seconds_total{part="draft"}': "draft_s",
                'eagle3_step_seconds_total{part="verify"}': "verify_s"}


def step_counters(url: str) -> Optional[dict]:
    """Our server's decoding counters (GET /metrics, STEP_METRICS); None where the server has no such metrics
    (another engine)."""
    import httpx
    try:
        r = httpx.get(url.rsplit("/v1", 1)[0] + "/metrics", timeout=30)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    found = {}
    for line in r.text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in STEP_METRICS:
            found[STEP_METRICS[name]] = float(value)
    return found if len(found) == len(STEP_METRICS) else None


def step_shares(before: Optional[dict], after: Optional[dict]) -> dict:
    """What a level's decoding steps did, from the counters before and after it: the share of rows that speculated
    (a tree of more than the root), the rows' mean tree size (the root included) and the draft's share of the
    steps' seconds (proposing, sizing and the draft model, against the verifies). None where not reported."""
    if before is None or after is None:
        return {"speculated_share": None, "mean_tree": None, "draft_share": None}
    d = {k: after[k] - before[k] for k in STEP_METRICS.values()}
    return {"speculated_share": report.safe_div(d["speculated_rows"], d["row_steps"]),
            "mean_tree": report.safe_div(d["verified_tokens"], d["row_steps"]),
            "draft_share": report.safe_div(d["draft_s"], d["draft_s"] + d["verify_s"])}


def check_warm_up(server: dict, level: dict) -> None:
    """A server that failed every warm-up request would fail the sweep's too (a model it does not serve, a
    --max-tokens over its context): one line with the first error instead of a table of zeros."""
    if level["completed"] == 0:
        raise UserError(f"server {server['name']} ({server['url']}): all {level['requests']} warm-up requests "
                        f"failed ({level['errors'][0] if level['errors'] else 'no answer'})")


# ---- our servers ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """`eagle3 serve --engine builtin` in a subprocess, up until stopped."""

    def __init__(self, args: list[str], log_path: str):
        import httpx
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        exe = os.path.join(os.path.dirname(sys.executable), "eagle3")
        cmd = [exe if os.path.exists(exe) else "eagle3", "serve", "--engine", "builtin", "--port", str(self.port),
               *args]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited (rc={self.proc.returncode}); see {log_path}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server did not start within 10 min; see {log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


# ---- outputs ------------------------------------------------------------------------------------
def table(result: dict, temperature: str) -> str:
    """The Markdown table of one temperature's levels (temperature: its key in result["levels"][server])."""
    names = [s["name"] for s in result["servers"]]
    base, others = names[0], names[1:]
    head = ["concurrency"] + [f"{n} tok/s" for n in names] + [f"{n}/{base}" for n in others] + \
        [f"{n} req/s" for n in names] + [f"{n} TTFT p50/p99 ms" for n in names] + \
        [f"{n} ITL p50/p99 ms" for n in names] + [f"{n} accept len" for n in others] + \
        [f"{n} speculated rows / mean tree / draft share" for n in others]
    rows, ratios = [], {n: speedups(result, temperature, n) for n in others}
    for i, c in enumerate(result["concurrency"]):
        lv = {n: result["levels"][n][temperature][str(c)] for n in names}
        ms = lambda a, b: f"{a * 1e3:.0f} / {b * 1e3:.0f}" if a is not None and b is not None else "-"  # noqa: E731
        row = [str(c)] + [f"{lv[n]['output_tokens_per_s']:.1f}" for n in names]
        row += [report.fmt_speedup(ratios[n][i]) for n in others]
        row += [f"{lv[n]['requests_per_s']:.2f}" for n in names]
        row += [ms(lv[n]["ttft_p50_s"], lv[n]["ttft_p99_s"]) for n in names]
        row += [ms(lv[n]["itl_p50_s"], lv[n]["itl_p99_s"]) for n in names]
        row += [f"{lv[n]['accept_length']:.2f}" if lv[n]["accept_length"] else "-" for n in others]
        row += [steps_text(lv[n].get("steps") or {}) for n in others]
        rows.append(row)
    return report.format_table(head, rows)


def steps_text(steps: dict) -> str:
    if steps.get("speculated_share") is None:
        return "-"
    return f"{steps['speculated_share']:.0%} / {steps['mean_tree']:.2f} / {steps['draft_share']:.0%}"


def speedups(result: dict, temperature: str, other: str) -> list[Optional[float]]:
    base = result["servers"][0]["name"]
    lv = result["levels"]
    return [report.safe_div(lv[other][temperature][str(c)]["output_tokens_per_s"],
                            lv[base][temperature][str(c)]["output_tokens_per_s"]) for c in result["concurrency"]]


def plot(result: dict, path: str) -> str:
    """Per temperature: output tokens/s of each server and each server's speed-up over the first, by concurrency."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    cs = result["concurrency"]
    for t in result["temperatures"]:
        for s in result["servers"]:
            lv = [result["levels"][s["name"]][t][str(c)] for c in cs]
            ax[0].plot(cs, [x["output_tokens_per_s"] for x in lv], "o-", label=f"{s['name']}, T={t}")
            ax[2].plot(cs, [(x["itl_p50_s"] or 0) * 1e3 for x in lv], "o-", label=f"{s['name']}, T={t}")
        for s in result["servers"][1:]:
            ax[1].plot(cs, [r or 0 for r in speedups(result, t, s["name"])], "o-", label=f"{s['name']}, T={t}")
    ax[1].axhline(1.0, color="grey", lw=0.8)
    for a, title in zip(ax, ["output tokens/s", f"speed-up over {result['servers'][0]['name']}",
                             "inter-token latency p50 (ms)"]):
        a.set_xscale("log", base=2)
        a.set_xlabel("concurrency")
        a.set_title(title)
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.suptitle(result.get("title", "serving benchmark"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- command line ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from sglang_eagle3.engine.settings import MAX_RUNNING, add_dtype_arg
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", action="append", default=[], metavar="NAME=URL",
                   help="a running OpenAI-compatible server, e.g. vanilla=http://127.0.0.1:30000/v1 (repeatable; "
                        "the first is the baseline)")
    p.add_argument("--start", choices=["builtin"], default=None,
                   help="start our server twice (vanilla and EAGLE-3) for the sweep, then stop them")
    p.add_argument("--target", default="testbed")
    p.add_argument("--draft", default=None, help="with --start: the draft (default: the shipped one)")
    p.add_argument("--profile", default=None, help="with --start: speculation profile (default: the draft's own)")
    add_dtype_arg(p, " (with --start: the servers' dtype)")
    p.add_argument("--max-running", type=int, default=MAX_RUNNING,
                   help="with --start: the servers' running-batch limit")
    p.add_argument("--drafters", default=None, metavar="LIST",
                   help="with --start: one server per drafter beside vanilla (bench_acceptance --drafters names, e.g. "
                        "eagle,hybrid-auto); default: one EAGLE-3 server with the draft's own settings")
    p.add_argument("--data", default=None)
    p.add_argument("--datasets", default="mt_bench,gsm8k,humaneval,alpaca,sum")
    p.add_argument("--concurrency", default=DEFAULT_LEVELS)
    p.add_argument("--requests", type=int, default=None, help="requests per level (default max(16, 2 x concurrency))")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=request_temperatures, default=[0.0],
                   help="sent with every request (default 0); `default`: left out, as most clients do, so the "
                        "server's default applies (OpenAI's 1.0). A comma list (e.g. 0,0.7,default) sweeps each on the "
                        "same servers, side by side")
    p.add_argument("--ignore-eos", action="store_true", help="every request generates max_tokens")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a request may take (default 1800)")
    p.add_argument("--beside", default="idle", choices=LOADS,
                   help="measure beside a busy process this benchmark starts once the servers are up and stops at the "
                        "end (bench/contention.py): loop, torch2 or generate")
    p.add_argument("--out", default="results/bench_serving.json")
    return p


def request_temperature(text: str) -> Optional[float]:
    """--temperature: a number >= 0, or `default` (None: the requests carry none)."""
    if text == "default":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0 or 'default', got {text!r}") from None


def request_temperatures(text: str) -> list[Optional[float]]:
    """--temperature: a comma list of request_temperature values."""
    return [request_temperature(t.strip()) for t in text.split(",")]


def temperature_text(temperature: Optional[float]) -> str:
    return "server default (none sent)" if temperature is None else f"{temperature:g}"


def temperature_key(temperature: Optional[float]) -> str:
    """A temperature's key in the result's levels: its value, or `default`."""
    return "default" if temperature is None else f"{temperature:g}"


def load_prompt_texts(data: Optional[str], datasets: str) -> list[str]:
    from sglang_eagle3.bench.acceptance import resolve_sets
    from sglang_eagle3.engine.prompts import load_prompts
    from sglang_eagle3.paths import data_dir
    sets = resolve_sets(datasets.split(","), data or data_dir())
    per = [[t[0] for t in load_prompts(path)] for path in sets.values()]
    return [p for group in zip(*per) for p in group]                     # interleave the sets


def level_prompts(prompts: list[str], sizes: list[int], warm: int) -> list[list[str]]:
    """Each level's own prompts: consecutive slices from the front, the warm-up's from the back. A server that
    searches earlier requests' text (--pool-tokens) would otherwise find a level's answers in the previous level's
    and predict them whole; they repeat only where the sets run out (prompts_repeated in the result)."""
    fresh = prompts[:max(len(prompts) - warm, 1)]
    out, at = [], 0
    for n in sizes:
        out.append([fresh[(at + i) % len(fresh)] for i in range(n)])
        at += n
    return out


def run(argv=None) -> int:
    a = build_parser().parse_args(argv)
    check_at_least(1, flags_of(a, "requests", "max_tokens", "max_running"))
    bad = [t for t in a.temperature if t is not None and not t >= 0]
    if bad:
        raise UserError(f"--temperature must be >= 0, got {bad[0]:g} (a number >= 0 or `default` each)")
    keys = [temperature_key(t) for t in a.temperature]
    if len(set(keys)) < len(keys):
        raise UserError(f"--temperature names a temperature twice: {','.join(keys)}")
    if not a.timeout > 0:
        raise UserError(f"--timeout must be > 0, got {a.timeout:g}")
    try:
        levels = [int(x) for x in a.concurrency.split(",")]
    except ValueError:
        raise UserError(f"--concurrency must be comma-separated integers, got {a.concurrency!r}") from None
    if not levels or min(levels) < 1:
        raise UserError("--concurrency levels must be >= 1")
    if bool(a.url) == bool(a.start):
        raise UserError("give --url NAME=URL (one or more running servers) or --start builtin")
    servers, started, load = [], [], None
    for item in a.url:                         # each one answers before any data is read
        name, _, url = item.partition("=")
        if not url:
            raise UserError(f"--url {item!r}: expected NAME=URL")
        url = url.rstrip("/")
        servers.append({"name": name, "url": url, "model": server_model(url, f"--url {item}")})
    prompts = load_prompt_texts(a.data, a.datasets)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)) or ".", exist_ok=True)
    try:
        if a.start:
            common = ["--target", a.target, "--dtype", a.dtype, "--batch-size", str(a.max_running)]
            van = LocalServer([*common, "--draft", "none"], report.sibling(a.out, ".vanilla.log"))
            started.append(van)
            draft_args = (["--draft", a.draft] if a.draft else []) + (["--profile", a.profile] if a.profile else [])
            servers = [{"name": "vanilla", "url": van.url}]
            columns = parse_drafters(a.drafters) if a.drafters else [("EAGLE-3", None, None, None)]
            for name, drafter, tree, children in columns:
                how = ["--drafter", drafter, "--tree", tree, "--draft-children", children] if drafter else []
                # the context drafter reads no draft and no profile (serve refuses them beside --drafter suffix)
                uses = [] if drafter == "suffix" else draft_args
                srv = LocalServer([*common, *uses, *how], report.sibling(a.out, f".{name}.log"))
                started.append(srv)
                servers.append({"name": name, "url": srv.url})
            for s in servers:
                s["model"] = server_model(s["url"], f"the {s['name']} server started here")
        load = start_busy(a.beside, a.target if a.start else "testbed", a.dtype)
        temps = ", ".join(temperature_text(t) for t in a.temperature)
        result = {"format": "sglang_eagle3.bench_serving/2", "servers": servers, "concurrency": levels,
                  "max_tokens": a.max_tokens, "temperatures": keys, "datasets": a.datasets,   # "default": none sent
                  "beside": a.beside,
                  "levels": {s["name"]: {k: {} for k in keys} for s in servers}, "meta": report.run_metadata(),
                  "title": f"{servers[0]['model']}: " + " vs ".join(s["name"] for s in servers) +
                           f", max_tokens {a.max_tokens}, T={temps}"
                           + ("" if a.beside == "idle" else f", beside {LOAD_TEXT[a.beside]}")}
        warm = max(4, 2 * levels[0])
        for s in servers:          # warm-up: a full first level, not kept (a cold server is not a steady state)
            check_warm_up(s, asyncio.run(run_level(s["url"], s["model"], prompts[::-1][:warm], levels[0], warm,
                                                   a.max_tokens, a.temperature[0], a.ignore_eos, a.timeout)))
        sizes = [a.requests or max(16, 2 * c) for c in levels]
        batches = level_prompts(prompts, sizes * len(keys), warm)       # every level of every temperature its own
        result["prompts_repeated"] = sum(len(b) for b in batches) + warm > len(prompts)
        for i, (temperature, key) in enumerate(zip(a.temperature, keys)):
            for j, c in enumerate(levels):
                batch = batches[i * len(levels) + j]
                order = servers if j % 2 == 0 else servers[::-1]
                for s in order:
                    before = step_counters(s["url"])
                    lv = asyncio.run(run_level(s["url"], s["model"], batch, c, len(batch), a.max_tokens, temperature,
                                               a.ignore_eos, a.timeout))
                    lv["steps"] = step_shares(before, step_counters(s["url"]))
                    result["levels"][s["name"]][key][str(c)] = lv
                    print(f"{s['name']:>10} T={key} concurrency {c:>3}: {lv['output_tokens_per_s']:8.1f} tok/s, "
                          f"{lv['completed']}/{lv['requests']} ok, accept {lv['accept_length'] or 0:.2f}, "
                          f"steps {steps_text(lv['steps'])}", file=sys.stderr, flush=True)
                report.write_json_atomic(a.out, result)
    finally:
        stop_busy(load)
        for srv in started:
            srv.stop()
    text = f"{result['title']}\n"
    for key in keys:
        text += f"\nT={key}" + (" (none sent: the server's default)" if key == "default" else "") + \
            f"\n\n{table(result, key)}\n"
        for other in servers[1:]:
            text += (f"\n{other['name']} / {servers[0]['name']} output tokens/s at T={key}: "
                     + ", ".join(f"{c}: {report.fmt_speedup(r)}" for c, r in zip(levels,
                                                                                speedups(result, key, other["name"])))
                     + "\n")
    md = report.write_text_atomic(report.sibling(a.out, ".md"), text)
    png = plot(result, report.sibling(a.out, ".png"))
    print(text)
    print(f"wrote {os.path.abspath(a.out)}\n      {md}\n      {png}")
    return 0


def main(argv=None) -> int:
    from sglang_eagle3.bench import run_cli
    return run_cli("bench_serving", run, argv, extra_errors=(RuntimeError,))
