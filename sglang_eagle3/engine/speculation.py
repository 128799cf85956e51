"""What speculative decoding runs: the draft tree's shape (SpecConfig, SGLang's flag semantics) and the tuned
shapes per running batch size that a draft folder may carry (SpecProfile, spec_profile.json)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

from sglang_eagle3.kernels import extension
from sglang_eagle3.models.config import ConfigError


@dataclass(frozen=True)
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
            object.__setattr__(self, "num_draft_tokens", min(self.num_draft_tokens, self.num_steps + 1))
        if self.num_draft_tokens > self.max_tokens:
            raise ConfigError(f"--num-draft-tokens={self.num_draft_tokens} exceeds what num_steps={self.num_steps}, "
                              f"topk={self.topk} can draft ({self.max_tokens})")

    @property
    def max_tokens(self) -> int:
        """The largest tree this depth and branching can draft: the root, topk children, then topk children of
        each of the topk best nodes per further step."""
        return 1 + self.topk + (self.num_steps - 1) * self.topk * self.topk

    @property
    def draft_slots(self) -> int:
        """Draft KV slots one drafting pass writes per row (topk tokens a step)."""
        return self.num_steps * self.topk

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
                 drafting: Optional[dict] = None, target: Optional[str] = None):
        if not table:
            raise ConfigError(f"{source or 'profile'}: no batch sizes")
        self.table, self.source = dict(sorted(table.items())), source
        self.fastest = dict(fastest or {})    # batch size -> fastest measured tree where vanilla won
        self.sampled = sampled                # the table for steps with a sampling request, or None
        self.host = host                      # the by_host entry these tables came from (None: the profile's own)
        self.long_context = long_context      # (min_tokens, the table for steps at that context or more), or None
        self.drafting = dict(drafting or {})  # the drafter and tree sizing measured best here (Drafting's fields)
        self.target = target                  # the target it was measured for (its 'target'), if it says

    @classmethod
    def load(cls, path: str, host: Optional[str] = None) -> "SpecProfile":
        """The profile's tables; where it holds tables measured on this kind of host (by_host[host_kind()], or
        by_host[host]), those: tune_spec --host-table-into PROFILE adds them. Every table and drafting entry is
        checked, other hosts' too (one line naming the file and the field)."""
        if not os.path.isfile(path):
            raise ConfigError(f"speculation profile {path} does not exist (write one with bench/tune_spec.py)")
        try:
            with open(path) as f:
                prof = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(prof, dict):
            raise ConfigError(f"{path}: expected 'per_batch_size' with integer batch-size keys")
        by_host = prof.get("by_host")
        if by_host is not None and (not isinstance(by_host, dict) or
                                    not all(isinstance(v, dict) for v in by_host.values())):
            raise ConfigError(f"{path}: 'by_host' must map a host kind to an object with its own 'per_batch_size'")
        drafting = check_drafting(prof.get("drafting"), f"{path}: drafting")
        hosts = {kind: cls._host_entry(prof, entry, f"{path} [{kind}]", f"{path}: by_host.{kind}.drafting")
                 for kind, entry in (by_host or {}).items()}        # every host's entry checked, this host's used
        kind = (host or host_kind()) if by_host is not None else None
        mine, host_drafting = hosts.get(kind, (None, None))
        if kind in hosts and "drafting" in by_host[kind]:
            drafting = host_drafting                             # the drafter measured best on this kind of host
        top = cls._entry(prof, path) if mine is None or prof.get("per_batch_size") is not None else None
        profile = mine or top
        profile.host = kind if mine is not None else None
        profile.drafting = drafting or {}
        profile.target = prof.get("target") if isinstance(prof.get("target"), str) else None
        return profile

    @classmethod
    def _host_entry(cls, prof: dict, entry: dict, source: str, where: str):
        """(this host kind's tables, or None where its entry holds none; its drafting, or None)."""
        drafting = check_drafting(entry.get("drafting"), where)
        if entry.get("per_batch_size") is None:
            return None, drafting
        # the profile's own sampled table where the entry has none; a long-context table only from the entry itself
        # (measured on another kind of host, the profile's own is not for this one)
        merged = {"per_batch_size": entry["per_batch_size"], "sampled": entry.get("sampled", prof.get("sampled")),
                  "long_context": entry.get("long_context")}
        return cls._entry(merged, source), drafting

    @classmethod
    def _entry(cls, entry: dict, source: str) -> "SpecProfile":
        """The tables of one entry (the profile's own or a by_host one): per_batch_size, sampled, long_context."""
        sampled, long_context = entry.get("sampled"), entry.get("long_context")
        if sampled is not None:
            if not isinstance(sampled, dict):
                raise ConfigError(f"{source}: 'sampled' must be an object with its own 'per_batch_size'")
            sampled = cls._from_table(sampled.get("per_batch_size"), f"{source} (sampled)")
        profile = cls._from_table(entry.get("per_batch_size"), source, sampled)
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
MAX_NODES = 128                  # the largest per-step tree (--tree auto); cost_model times verifies up to 128 tokens
DRAFTING_COUNTS = ("max_nodes", "context_tokens", "context_branches", "min_match")


def check_drafting(entry, where: str) -> Optional[dict]:
    """A profile's `drafting` object (None: it has none) as Drafting's fields, each value checked; a bad one is a
    ConfigError naming `where` (the file and the entry) and the field. Other keys say what measured it."""
    if entry is None:
        return None
    if not isinstance(entry, dict) or not set(entry) & {"drafter", "tree", *DRAFTING_COUNTS}:
        raise ConfigError(f"{where} must be an object with drafter / tree / {' / '.join(DRAFTING_COUNTS)}")
    for name, choices in (("drafter", DRAFTERS), ("tree", TREE_SIZING)):
        if name in entry and (not isinstance(entry[name], str) or entry[name] not in choices):
            raise ConfigError(f"{where}.{name} must be one of {', '.join(choices)}, got {entry[name]!r}")
    for name in DRAFTING_COUNTS:
        value, top = entry.get(name, 1), MAX_NODES if name == "max_nodes" else None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1 or (top and value > top):
            raise ConfigError(f"{where}.{name} must be an integer " + (f"in 1..{top}" if top else ">= 1") +
                              f", got {value!r}")
    return {k: v for k, v in entry.items() if k in ("drafter", "tree", *DRAFTING_COUNTS)}


@dataclass(frozen=True)
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
        fields = {"drafter": self.drafter, "tree": self.tree}
        fields.update({name: getattr(self, name) for name in DRAFTING_COUNTS})
        check_drafting(fields, "drafting")
        if self.pool_tokens < 0:
            raise ConfigError(f"--pool-tokens must be >= 0, got {self.pool_tokens}")

    @property
    def uses_draft(self) -> bool:
        return self.drafter in ("eagle", "hybrid")

    @property
    def uses_context(self) -> bool:
        return self.drafter in ("suffix", "hybrid")

    def step_tree(self, spec: Optional[SpecConfig]) -> Optional[SpecConfig]:
        """The most a step drafts with the shape `spec`: the shape itself, or with the per-step tree (`auto`) its
        depth and branching and, as its size, the most a step may verify (max_nodes, at most what they can draft)."""
        if spec is None or self.tree != "auto":
            return spec
        return SpecConfig(spec.num_steps, spec.topk, min(self.max_nodes, spec.max_tokens))
