"""What speculative decoding runs: the draft tree's shape (SpecConfig, SGLang's flag semantics) and where a step's
tree comes from (Drafting). The tuned shapes per running batch size are engine/profile.py's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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


DRAFTERS = ("eagle", "suffix", "hybrid")
DRAFT_CHILDREN = ("sampled", "sampled-raw", "top-k")   # how a sampling request's draft children are picked
                                                       # (Drafting.children)
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
    children: str = "sampled"        # at temperature > 0: the draft's children drawn from its distribution and
                                     # verified by recursive rejection sampling (sampled_tree.py), sharpened per
                                     # depth by the draft's calibration where it has one (sampled-raw: never), or
                                     # its top-k accepted with the target's p (top-k: the EAGLE authors' scheme)

    def __post_init__(self):
        fields = {"drafter": self.drafter, "tree": self.tree}
        fields.update({name: getattr(self, name) for name in DRAFTING_COUNTS})
        check_drafting(fields, "drafting")
        if self.children not in DRAFT_CHILDREN:
            raise ConfigError(f"--draft-children must be one of {', '.join(DRAFT_CHILDREN)}, got {self.children!r}")
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
