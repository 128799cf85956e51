"""A minimal client for a running SGLang server (stdlib HTTP only), for benchmarks.

What we read, as SGLang 0.5.23 reports it:
  GET  /server_info -> resolved server args, flat: model_path, speculative_algorithm,
       speculative_draft_model_path, speculative_num_steps, speculative_eagle_topk,
       speculative_num_draft_tokens, speculative_adaptive, max_running_requests, ...
  POST /generate {"text": [...], "sampling_params": {...}} -> one object per text with "meta_info":
       completion_tokens, e2e_latency and, when speculating, spec_verify_ct (verify passes),
       spec_accept_length (= completion_tokens / spec_verify_ct), spec_num_correct_drafts.
  POST /flush_cache -> empties the radix (prefix) cache so repeated prompts are not free.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request


class ServerError(RuntimeError):
    pass


class SGLangClient:
    def __init__(self, url: str, timeout: float = 600.0):
        self.url, self.timeout = url.rstrip("/"), timeout

    def _call(self, method: str, path: str, body=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise ServerError(f"{method} {self.url}{path}: HTTP {e.code}: {e.read()[:300]!r}") from None
        except (urllib.error.URLError, OSError) as e:
            raise ServerError(f"{method} {self.url}{path}: cannot reach the SGLang server ({e})") from None
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw.decode(errors="replace")

    def server_info(self) -> dict:
        info = self._call("GET", "/server_info")
        if not isinstance(info, dict):
            raise ServerError(f"GET {self.url}/server_info: expected a JSON object")
        return info

    def flush_cache(self) -> None:
        try:
            self._call("POST", "/flush_cache")
        except ServerError:
            pass                                    # best effort: an old server or a busy one

    def generate(self, texts: list[str], sampling_params: dict) -> tuple[list[dict], float]:
        """One batched request; returns (per-text meta_info, wall seconds)."""
        t0 = time.perf_counter()
        out = self._call("POST", "/generate", {"text": texts, "sampling_params": sampling_params})
        wall = time.perf_counter() - t0
        out = out if isinstance(out, list) else [out]
        if len(out) != len(texts) or not all(isinstance(o, dict) and "meta_info" in o for o in out):
            raise ServerError(f"POST {self.url}/generate: expected {len(texts)} results with meta_info")
        return [o["meta_info"] for o in out], wall


def server_tree(info: dict) -> dict | None:
    """The tree the server decodes with, in our SpecConfig terms; None = no speculation."""
    algo = info.get("speculative_algorithm")
    if algo in (None, "", "NONE", "None"):
        return None
    if str(algo).upper() not in ("EAGLE", "EAGLE3"):
        raise ServerError(f"server speculates with {algo}; this tool tunes EAGLE/EAGLE3 trees")
    if info.get("speculative_adaptive"):
        raise ServerError("server runs --speculative-adaptive: its tree changes at runtime, so its speed cannot be "
                          "attributed to one (num_steps, topk, num_draft_tokens); relaunch it without that flag")
    try:
        return {"num_steps": int(info["speculative_num_steps"]), "topk": int(info["speculative_eagle_topk"]),
                "num_draft_tokens": int(info["speculative_num_draft_tokens"])}
    except (KeyError, TypeError, ValueError):
        raise ServerError("server_info lacks speculative_num_steps / speculative_eagle_topk / "
                          "speculative_num_draft_tokens") from None


def summarize_meta(metas: list[dict]) -> tuple[int, int | None, int | None]:
    """(completion tokens, verify passes, accepted draft tokens); the last two None without speculation."""
    def total(key):
        vals = [m.get(key) for m in metas]
        return sum(int(v) for v in vals) if vals and all(v is not None for v in vals) else None
    return sum(int(m.get("completion_tokens", 0)) for m in metas), total("spec_verify_ct"), \
        total("spec_num_correct_drafts")
