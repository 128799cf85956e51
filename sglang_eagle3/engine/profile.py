"""The speculation profile (spec_profile.json, bench/tune_spec.py measures it): the draft tree per running batch size
that a draft folder may carry. Read into SpecProfile with every field checked (one line naming the file and the
field), written and merged in place atomically.

A table maps a batch size to a tree {num_steps, topk, num_draft_tokens}, to {"speculation": false} where vanilla
decoding measured faster (its fastest tree tried as "best_tree"), or to null. The fields read:

    per_batch_size                            the table
    sampled.per_batch_size                    the table for steps with a sampling request
    long_context.{min_tokens, per_batch_size} the table for greedy steps whose longest row holds min_tokens or more
    drafting                                  the drafter and tree sizing measured best (speculation.Drafting's)
    by_host.KIND.{the four above}             the same measured on one kind of host (host_kind()); a host without
                                              its own sampled table takes the profile's, never its long_context
    target                                    the target the tables were measured for

Every other key says what measured the tables and is kept as written.
"""
from __future__ import annotations

import json
import os
from typing import Callable, NamedTuple, Optional

from sglang_eagle3.engine.speculation import SpecConfig, check_drafting
from sglang_eagle3.fileio import write_text_atomic
from sglang_eagle3.kernels import extension
from sglang_eagle3.models.config import ConfigError

PROFILE_FORMAT = "sglang_eagle3.spec_profile/1"
PROFILE_FILE = "spec_profile.json"
TREE_FIELDS = ("num_steps", "topk", "num_draft_tokens")


def host_kind(device: str = "cpu") -> str:
    """The kind of machine a profile's per-host tables ('by_host') are keyed by: 'cuda' on GPUs, else the CPU's
    few-row bf16 kernel (extension.few_row_kernel(): 'amx' on Intel Xeons with AMX, 'avx512_bf16' with AVX-512 BF16
    only (Zen 4, Cooper Lake), 'avx512f' with AVX-512F and no BF16 (Skylake-SP, Cascade Lake, Ice Lake Xeons),
    'avx2' with AVX2 + FMA only (Zen 2/3)), else 'cpu' (no C++ extension). The best tree follows from what a wider
    verify costs, and that differs by kind (AMX tiles verify 8 tokens for ~1.2x a 1-token step, the AVX2 kernel 3
    tokens for ~1.5x)."""
    if str(device).startswith("cuda"):
        return "cuda"
    return extension.few_row_kernel() or "cpu"


def draft_profile_path(draft: Optional[str]) -> Optional[str]:
    """The speculation profile stored with a draft folder (spec_profile.json from tune_spec.py), if it has one."""
    path = os.path.join(draft, PROFILE_FILE) if draft and draft != "none" else None
    return path if path and os.path.isfile(path) else None


class SpecProfile:
    """Tree shape (or no speculation) per running batch size, from a profile file (SpecProfile.load).

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
        doc = read_profile(path)
        own, hosts = check_profile(doc, path)
        kind = (host or host_kind()) if doc.get("by_host") is not None else None
        written = (doc.get("by_host") or {}).get(kind) or {}   # this host's entry as written (null values too)
        mine = hosts.get(kind, {})
        chosen = mine if "per_batch_size" in mine else own
        if "per_batch_size" not in chosen:
            raise ConfigError(f"{path}: per_batch_size must be an object with integer batch-size keys")

        def host_first(name):                # the host's own value where its entry has the key, else the profile's
            return (mine if name in written else own).get(name)
        table = chosen["per_batch_size"]
        return cls(table.table, table.source, table.fastest,
                   sampled=host_first("sampled") if chosen is mine else own.get("sampled"),
                   host=kind if chosen is mine else None, long_context=chosen.get("long_context"),
                   drafting=host_first("drafting"),
                   target=doc.get("target") if isinstance(doc.get("target"), str) else None)

    def _key(self, batch_size: int) -> int:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        keys = list(self.table)
        below = [k for k in keys if k <= batch_size]
        return below[-1] if below else keys[0]

    def _routed(self, sampled: bool, context: int, batch_size: int) -> Optional["SpecProfile"]:
        """The table a step uses instead of this one: the sampled table for a step with a sampling request (where
        the profile has one), else the long-context table once the step's longest row holds enough tokens, at the
        batch sizes it measured (up to its largest: past it, one long row would otherwise give every row of a large
        batch the long-context tree of batch 1)."""
        if sampled and self.sampled is not None:
            return self.sampled
        if self.long_context is not None and context >= self.long_context[0] \
                and batch_size <= max(self.long_context[1].table):
            return self.long_context[1]
        return None

    def for_batch_size(self, batch_size: int, sampled: bool = False, context: int = 0) -> Optional[SpecConfig]:
        """The tree to run at this batch size, or None where vanilla decoding measured faster; sampled: a step
        with a sampling request (the sampled table where the profile has one); context: the tokens the step's
        longest row holds (the long-context table from its min_tokens on)."""
        other = self._routed(sampled, context, batch_size)
        return other.for_batch_size(batch_size) if other is not None else self.table[self._key(batch_size)]

    def measured_tree(self, batch_size: int, sampled: bool = False, context: int = 0) -> Optional[SpecConfig]:
        """The tree to measure speculation with: the chosen one, else the fastest tree tried (vanilla won)."""
        other = self._routed(sampled, context, batch_size)
        if other is not None:
            return other.measured_tree(batch_size)
        key = self._key(batch_size)
        return self.table[key] or self.fastest.get(key)

    def trees(self) -> list[SpecConfig]:
        """Every tree a step may run (what the KV pools must have room for)."""
        return [t for t in self.table.values() if t is not None] + (self.sampled.trees() if self.sampled else []) \
            + (self.long_context[1].trees() if self.long_context else [])


# ---- reading: a reader per field ---------------------------------------------------------------------------


class Field(NamedTuple):
    """Where a value sits: the file, its dotted field, and the name its table goes by (SpecProfile.source)."""
    path: str
    name: str
    source: str

    def sub(self, key: str, table: str = "") -> "Field":
        return Field(self.path, f"{self.name}.{key}" if self.name else key,
                     f"{self.source} ({table})" if table else self.source)

    def error(self, problem: str) -> ConfigError:
        return ConfigError(f"{self.path}: {self.name} {problem}")


def _tree(value, at: Field) -> SpecConfig:
    try:
        return SpecConfig(*(int(value[k]) for k in TREE_FIELDS))
    except (KeyError, TypeError, ValueError, ConfigError) as e:
        raise at.error(f"is not a valid tree ({e})") from None


def _table(value, at: Field) -> SpecProfile:
    """{batch size: a tree, {"speculation": false} (with the fastest tree tried as "best_tree"), or null}."""
    if not isinstance(value, dict) or not value or not all(str(k).isdigit() for k in value):
        raise at.error("must be an object with integer batch-size keys")
    table, fastest = {}, {}
    for k, entry in value.items():
        row = at._replace(name=f"{at.name}[{k}]")
        if entry is not None and not (isinstance(entry, dict) and entry.get("speculation") is False):
            table[int(k)] = _tree(entry, row)
            continue
        table[int(k)] = None
        if entry is not None and isinstance(entry.get("best_tree"), dict):
            fastest[int(k)] = _tree(entry["best_tree"], row.sub("best_tree"))
    return SpecProfile(table, at.source, fastest)


def _sampled(value, at: Field) -> SpecProfile:
    if not isinstance(value, dict):
        raise at.error("must be an object with its own per_batch_size")
    return _table(value.get("per_batch_size"), at.sub("per_batch_size", "sampled"))


def _long_context(value, at: Field) -> tuple[int, SpecProfile]:
    if not isinstance(value, dict):
        raise at.error("must be an object with an integer min_tokens >= 1 and its own per_batch_size")
    min_tokens = value.get("min_tokens")
    if not isinstance(min_tokens, int) or isinstance(min_tokens, bool) or min_tokens < 1:
        raise at.sub("min_tokens").error(f"must be an integer >= 1, got {min_tokens!r}")
    return min_tokens, _table(value.get("per_batch_size"), at.sub("per_batch_size", "long_context"))


def _drafting(value, at: Field) -> dict:
    return check_drafting(value, f"{at.path}: {at.name}")


ENTRY = {"per_batch_size": _table, "sampled": _sampled, "long_context": _long_context, "drafting": _drafting}


def _entry(entry: dict, at: Field) -> dict:
    """One entry (the profile's own or a by_host one): {field: what it reads as} for each field it holds."""
    return {name: read(entry[name], at.sub(name)) for name, read in ENTRY.items() if entry.get(name) is not None}


def read_profile(path: str) -> dict:
    """A profile file's JSON as written (one line where it is missing or not JSON; check_profile checks it)."""
    if not os.path.isfile(path):
        raise ConfigError(f"speculation profile {path} does not exist (write one with bench/tune_spec.py)")
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def check_profile(doc, path: str) -> tuple[dict, dict[str, dict]]:
    """Every field of a profile checked, every host's entry too: (its own entry, {host kind: its entry}), each as
    _entry reads it. A bad field is a ConfigError naming the file and the field."""
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a JSON object with 'per_batch_size' (integer batch-size keys)")
    by_host = doc.get("by_host")
    if by_host is not None and not (isinstance(by_host, dict) and all(isinstance(v, dict) for v in by_host.values())):
        raise ConfigError(f"{path}: by_host must map a host kind to an object with its own per_batch_size")
    hosts = {kind: _entry(entry, Field(path, f"by_host.{kind}", f"{path} [{kind}]"))
             for kind, entry in (by_host or {}).items()}
    return _entry(doc, Field(path, "", path)), hosts


# ---- writing and merging -----------------------------------------------------------------------------------


def tree_entry(tree: dict, **measured) -> dict:
    """A per_batch_size entry that speculates with `tree` ({num_steps, topk, num_draft_tokens}), then what measured
    it."""
    return {"speculation": True, **tree, **measured}


def vanilla_entry(best_tree: Optional[dict] = None, **measured) -> dict:
    """A per_batch_size entry where vanilla decoding won, with what measured it; best_tree: the fastest tree tried
    (what the engine measures speculation with there)."""
    return {"speculation": False, **measured, **({"best_tree": best_tree} if best_tree is not None else {})}


def write_profile(path: str, doc: dict) -> str:
    """Write a profile atomically (a kill leaves the old file or the new one) once every field reads
    (check_profile); returns the absolute path."""
    check_profile(doc, path)
    return write_text_atomic(path, json.dumps(doc, indent=2, allow_nan=False) + "\n")


def check_rewritable(path: str) -> None:
    """Before a run that ends by rewriting the profile at path: every field reads and this process may replace
    the file (one line otherwise)."""
    check_profile(read_profile(path), path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.access(folder, os.W_OK | os.X_OK) or not os.access(path, os.W_OK):
        raise ConfigError(f"{path}: no permission to write it (or in {folder})")


def _rewrite(path: str, change: Callable[[dict], None]) -> None:
    """The profile at path, read and checked, changed in place by `change`, checked and written back."""
    doc = read_profile(path)
    check_profile(doc, path)
    change(doc)
    write_profile(path, doc)


def _host_entry(doc: dict, kind: str) -> dict:
    """doc's by_host[kind], made where missing."""
    doc["by_host"] = doc.get("by_host") or {}
    return doc["by_host"].setdefault(kind, {})


def _merged(before: dict, table: dict) -> dict:
    """{batch size: entry}: `table` where it has the batch size, `before` elsewhere (ordered by size)."""
    out = {**{str(k): v for k, v in before.items()}, **{str(k): v for k, v in table.items()}}
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def add_host_table(path: str, kind: str, table: dict, measured: dict, sampling: Optional[dict] = None,
                   long_context: Optional[int] = None) -> None:
    """by_host[kind] takes `table` ({batch size: entry}) and `measured` (what measured it): as its per_batch_size;
    with `sampling` ({temperature, seed}) as its sampled table, with `long_context` (min_tokens) as its long-context
    table, each beside the host's greedy table, which must be there. Batch sizes `table` lacks keep the tree this
    kind of host ran before (its table, else the profile's own), so re-tuning batch 1 alone leaves the others as
    they were."""
    def change(doc: dict) -> None:
        entry = _host_entry(doc, kind)
        entry.pop("grid", None)                            # an older run's machine path
        if (sampling or long_context is not None) and "per_batch_size" not in entry:
            raise ConfigError(f"{path}: by_host.{kind} has no per_batch_size for a sampled or long-context table to "
                              "go beside")
        if long_context is not None:
            before = (entry.get("long_context") or {}).get("per_batch_size") or {}
            entry["long_context"] = {"min_tokens": long_context, **measured, "per_batch_size": _merged(before, table)}
        elif sampling:
            before = (entry.get("sampled") or doc.get("sampled") or {}).get("per_batch_size") or {}
            entry["sampled"] = {**sampling, **measured, "per_batch_size": _merged(before, table)}
        else:
            before = entry.get("per_batch_size") or doc.get("per_batch_size") or {}
            entry.update(measured, per_batch_size=_merged(before, table))
    _rewrite(path, change)


def set_sampled_table(path: str, table: dict, sampling: dict, measured: dict) -> None:
    """The profile's own sampled table becomes `table`, measured with `sampling` ({temperature, seed}) as
    `measured` says; the rest stays as it is."""
    def change(doc: dict) -> None:
        doc["sampled"] = {**sampling, **measured, "per_batch_size": table}
    _rewrite(path, change)


def set_drafting(path: str, kind: str, drafting: dict) -> None:
    """by_host[kind].drafting = drafting: the drafter and tree sizing `generate` and `serve` run by default on that
    kind of host (Drafting's fields, and what measured them)."""
    def change(doc: dict) -> None:
        _host_entry(doc, kind)["drafting"] = drafting
    _rewrite(path, change)
