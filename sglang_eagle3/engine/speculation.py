"""What speculative decoding runs: the draft tree's shape (SpecConfig, SGLang's flag semantics) and the tuned
shapes per running batch size that a draft folder may carry (SpecProfile, spec_profile.json)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

from sglang_eagle3.kernels import extension
from sglang_eagle3.models.config import ConfigError


@dataclass
class SpecConfig:
    """Tree shape, with SGLang's flag semantics.

    num_steps: tree depth (draft forward passes); topk: branching per step;
    num_draft_tokens: tokens verified per step including the root (the last verified token).
    topk=1 gives a chain of num_steps + 1 tokens.
    """
    num_steps: int = 5
    topk: int = 4
    num_draft_tokens: int = 16

    def __post_init__(self):
        for name in ("num_steps", "topk", "num_draft_tokens"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.topk == 1:
            self.num_draft_tokens = min(self.num_draft_tokens, self.num_steps + 1)
        max_tokens = 1 + self.topk + (self.num_steps - 1) * self.topk * self.topk
        if self.num_draft_tokens > max_tokens:
            raise ConfigError(f"--num-draft-tokens={self.num_draft_tokens} exceeds what num_steps={self.num_steps}, "
                              f"topk={self.topk} can draft ({max_tokens})")

    @property
    def key(self) -> str:
        return f"steps{self.num_steps}_topk{self.topk}_ndt{self.num_draft_tokens}"


PROFILE_FORMAT = "sglang_eagle3.spec_profile/1"


def host_kind(device: str = "cpu") -> str:
    """The kind of machine a speculation profile's per-host tables ('by_host') are keyed by: 'cuda' on GPUs, else
    the CPU's few-row bf16 kernel (extension.few_row_kernel(): 'amx' on Intel Xeons with AMX, 'avx512_bf16' with
    AVX-512 BF16 only (Zen 4, Cooper Lake), 'avx512f' with AVX-512F and no BF16 (Skylake-SP, Cascade Lake, Ice Lake
    Xeons), 'avx2' with AVX2 + FMA only (Zen 2/3)), else 'cpu' (no C++ extension). The best tree follows from what a
    wider verify costs, and that differs by kind (AMX tiles verify 8 tokens for ~1.2x a 1-token step, the AVX2
    kernel 3 tokens for ~1.5x)."""
    if str(device).startswith("cuda"):
        return "cuda"
    return extension.few_row_kernel() or "cpu"


def draft_profile_path(draft: Optional[str]) -> Optional[str]:
    """The speculation profile stored with a draft folder (spec_profile.json from tune_spec.py), if it has one."""
    path = os.path.join(draft, "spec_profile.json") if draft and draft != "none" else None
    return path if path and os.path.isfile(path) else None


class SpecProfile:
    """Tree shape (or no speculation) per running batch size, from bench/tune_spec.py's profile JSON.

    A batch size without its own entry uses the largest measured one below it (the smallest above it if
    none is below), the routing SGLang applies to its adaptive config. A profile may also hold a table measured
    with sampling (`sampled`: tune_spec --temperature T --sampled-into PROFILE); steps with a sampling request
    use it (sampled acceptance is lower, so its best tree is shallower). And a table for long contexts
    (`long_context`: {"min_tokens": N, "per_batch_size": ...}, tune_spec --long-context N --host-table-into
    PROFILE over long prompts): greedy steps whose longest row holds at least N tokens use it (a verify's attention
    grows with the context, so long prompts pay for a smaller tree)."""

    def __init__(self, table: dict[int, Optional[SpecConfig]], source: str = "",
                 fastest: Optional[dict[int, SpecConfig]] = None, sampled: Optional["SpecProfile"] = None,
                 host: Optional[str] = None, long_context: Optional[tuple[int, "SpecProfile"]] = None,
                 drafting: Optional[dict] = None):
        if not table:
            raise ConfigError(f"{source or 'profile'}: no batch sizes")
        self.table, self.source = dict(sorted(table.items())), source
        self.fastest = dict(fastest or {})    # batch size -> fastest measured tree where vanilla won
        self.sampled = sampled                # the table for steps with a sampling request, or None
        self.host = host                      # the by_host entry these tables came from (None: the profile's own)
        self.long_context = long_context      # (min_tokens, the table for steps at that context or more), or None
        self.drafting = dict(drafting or {})  # the drafter and tree sizing measured best here (Drafting's fields)

    @classmethod
    def load(cls, path: str, host: Optional[str] = None) -> "SpecProfile":
        """The profile's tables; where it holds tables measured on this kind of host (by_host[host_kind()], or
        by_host[host]), those: tune_spec --host-table-into PROFILE adds them."""
        if not os.path.isfile(path):
            raise ConfigError(f"speculation profile {path} does not exist (write one with bench/tune_spec.py)")
        try:
            with open(path) as f:
                prof = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        table = prof.get("per_batch_size") if isinstance(prof, dict) else None
        sampled = prof.get("sampled") if isinstance(prof, dict) else None
        long_context = prof.get("long_context") if isinstance(prof, dict) else None
        drafting = prof.get("drafting") if isinstance(prof, dict) else None
        by_host = prof.get("by_host") if isinstance(prof, dict) else None
        source, kind = path, None
        if by_host is not None:
            if not isinstance(by_host, dict) or not all(isinstance(v, dict) for v in by_host.values()):
                raise ConfigError(f"{path}: 'by_host' must map a host kind to an object with its own 'per_batch_size'")
            kind = host or host_kind()
            entry = by_host.get(kind) or {}
            drafting = entry.get("drafting", drafting)     # the drafter measured best on this kind of host
            if entry.get("per_batch_size") is not None:
                table, sampled, source = entry.get("per_batch_size"), entry.get("sampled", sampled), f"{path} [{kind}]"
                long_context = entry.get("long_context")   # measured on another kind of host: not for this one
            else:
                kind = None
        if sampled is not None:
            if not isinstance(sampled, dict):
                raise ConfigError(f"{source}: 'sampled' must be an object with its own 'per_batch_size'")
            sampled = cls._from_table(sampled.get("per_batch_size"), f"{source} (sampled)")
        profile = cls._from_table(table, source, sampled)
        profile.host = kind
        if drafting is not None:
            fields = {"drafter", "tree", "max_nodes", "context_tokens", "context_branches", "min_match"}
            if not isinstance(drafting, dict) or not set(drafting) & fields:
                raise ConfigError(f"{source}: 'drafting' must be an object with drafter / tree / max_nodes / "
                                  "context_tokens / context_branches / min_match")
            profile.drafting = {k: v for k, v in drafting.items() if k in fields}    # (the rest: what measured it)
        if long_context is not None:
            min_tokens = long_context.get("min_tokens") if isinstance(long_context, dict) else None
            if not isinstance(min_tokens, int) or isinstance(min_tokens, bool) or min_tokens < 1:
                raise ConfigError(f"{source}: 'long_context' must be an object with an integer 'min_tokens' >= 1 "
                                  "and its own 'per_batch_size'")
            profile.long_context = (min_tokens, cls._from_table(long_context.get("per_batch_size"),
                                                                f"{source} (long_context)"))
        return profile

    @classmethod
    def _from_table(cls, table, path: str, sampled: Optional["SpecProfile"] = None) -> "SpecProfile":
        if not isinstance(table, dict) or not table or not all(str(k).isdigit() for k in table):
            raise ConfigError(f"{path}: expected 'per_batch_size' with integer batch-size keys")
        out, fastest = {}, {}
        for k, entry in table.items():
            if entry is None or (isinstance(entry, dict) and entry.get("speculation") is False):
                out[int(k)] = None
                best = entry.get("best_tree") if isinstance(entry, dict) else None
                try:
                    if isinstance(best, dict):
                        fastest[int(k)] = SpecConfig(int(best["num_steps"]), int(best["topk"]),
                                                     int(best["num_draft_tokens"]))
                except (KeyError, TypeError, ValueError, ConfigError) as e:
                    raise ConfigError(f"{path}: per_batch_size[{k}].best_tree: not a valid tree ({e})") from None
                continue
            try:
                out[int(k)] = SpecConfig(int(entry["num_steps"]), int(entry["topk"]), int(entry["num_draft_tokens"]))
            except (KeyError, TypeError, ValueError, ConfigError) as e:
                raise ConfigError(f"{path}: per_batch_size[{k}]: not a valid tree ({e})") from None
        return cls(out, path, fastest, sampled)

    def _key(self, batch_size: int) -> int:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        keys = list(self.table)
        below = [k for k in keys if k <= batch_size]
        return below[-1] if below else keys[0]

    def _routed(self, sampled: bool, context: int) -> Optional["SpecProfile"]:
        """The table a step uses instead of this one: the sampled table for a step with a sampling request (where
        the profile has one), else the long-context table once the step's longest row holds enough tokens."""
        if sampled and self.sampled is not None:
            return self.sampled
        if self.long_context is not None and context >= self.long_context[0]:
            return self.long_context[1]
        return None

    def for_batch_size(self, batch_size: int, sampled: bool = False, context: int = 0) -> Optional[SpecConfig]:
        """The tree to run at this batch size, or None where vanilla decoding measured faster; sampled: a step
        with a sampling request (the sampled table where the profile has one); context: the tokens the step's
        longest row holds (the long-context table from its min_tokens on)."""
        other = self._routed(sampled, context)
        return other.for_batch_size(batch_size) if other is not None else self.table[self._key(batch_size)]

    def measured_tree(self, batch_size: int, sampled: bool = False, context: int = 0) -> Optional[SpecConfig]:
        """The tree to measure speculation with: the chosen one, else the fastest tree tried (vanilla won)."""
        other = self._routed(sampled, context)
        if other is not None:
            return other.measured_tree(batch_size)
        key = self._key(batch_size)
        return self.table[key] or self.fastest.get(key)

    def trees(self) -> list[SpecConfig]:
        """Every tree a step may run (what the KV pools must have room for)."""
        return [t for t in self.table.values() if t is not None] + (self.sampled.trees() if self.sampled else []) \
            + (self.long_context[1].trees() if self.long_context else [])


DRAFTERS = ("eagle", "suffix", "hybrid")
TREE_SIZING = ("profile", "auto")


@dataclass
class Drafting:
    """Where a step's tree comes from and how big it is.

    drafter: `eagle` (the draft model's EAGLE-2 tree), `suffix` (continuations of the context's earlier text, no draft
    model: any target), `hybrid` (both, merged into one tree). tree: `profile` (the fixed shape per batch size, plus
    the context's nodes) or `auto` (each step, the size that maximises expected tokens per second on this machine,
    drafting only when it pays: engine/cost_model.py)."""
    drafter: str = "eagle"
    tree: str = "profile"
    max_nodes: int = 16              # auto: the largest tree a step may verify
    context_tokens: int = 8          # the longest chain a context proposal adds
    context_branches: int = 2        # distinct continuations proposed per step (where earlier text disagrees)
    min_match: int = 2               # shortest suffix match that proposes
    pool_tokens: int = 0             # tokens of recent requests searched too (the server; 0: none)

    def __post_init__(self):
        if self.drafter not in DRAFTERS:
            raise ConfigError(f"--drafter {self.drafter!r}: choose one of {', '.join(DRAFTERS)}")
        if self.tree not in TREE_SIZING:
            raise ConfigError(f"--tree {self.tree!r}: choose one of {', '.join(TREE_SIZING)}")
        for name in ("max_nodes", "context_tokens", "context_branches", "min_match"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.pool_tokens < 0:
            raise ConfigError(f"--pool-tokens must be >= 0, got {self.pool_tokens}")

    @property
    def uses_draft(self) -> bool:
        return self.drafter in ("eagle", "hybrid")

    @property
    def uses_context(self) -> bool:
        return self.drafter in ("suffix", "hybrid")
