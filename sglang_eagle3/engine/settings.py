"""What a decoding run uses, settled once before anything loads (anchor: SGLang's ServerArgs).

`resolve_settings` turns the flags every entry point shares (`--dtype`, `--draft`, `--profile`, `--num-steps`,
`--topk`, `--num-draft-tokens`, `--drafter`, `--tree`; the builtin server's limits), the draft folder's tuned
profile, the kind of host and the expected batch size into one frozen `Settings`: the dtype, the draft, the tree,
the adaptive table, the drafting and the server's limits. `eagle3 generate`, `eagle3 serve` (our engine and the
SGLang launch), `make demo` and every benchmark call it, so they all run the same thing by default, and nothing
downstream applies a default again:

- dtype `auto`: bfloat16 on GPUs and on CPUs where the engine has a fast bf16 product, else float32;
- draft: `--draft`, else the shipped draft for the embedded target, else none; `none`: vanilla decoding;
- tree: explicit `--num-steps/--topk/--num-draft-tokens` fix it (a flag given alone fills in the rest from the
  profile's tree at this batch size, else SGLang's 5/4/16); otherwise the profile (`--profile`, else the draft's
  own spec_profile.json, its table for this kind of host) picks the tree per running batch size; a profile that
  never speculates drops the draft; with no profile, SGLang's default 5/4/16. A profile that names another target
  than --target is refused;
- drafting: --drafter / --tree, else the profile's choice for this host, else eagle with fixed trees. Flags that
  contradict each other or that the drafter would never read are refused, not rewritten: --draft, --profile and the
  tree flags under --drafter suffix (no draft model); --drafter eagle / hybrid, --tree or tree flags without a draft.
  With --tree auto, --num-draft-tokens is the most a step verifies;
- the builtin server: MAX_RUNNING requests decoded together, MAX_QUEUE waiting, KV slots per request up to the
  target's context (at most MAX_LEN_CAP), and a context drafter searches the last POOL_TOKENS tokens of recent
  requests too (--pool-tokens; refused where no context drafter runs). One batch of prompts (generate) has no pool.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Optional

import torch

from sglang_eagle3.engine.draft_calibration import DraftCalibration, calibration_path
from sglang_eagle3.engine.profile import SpecProfile, draft_profile_path, host_kind
from sglang_eagle3.engine.speculation import DRAFT_CHILDREN, DRAFTERS, MAX_NODES, TREE_SIZING, Drafting, SpecConfig
from sglang_eagle3.errors import UserError, check_at_least
from sglang_eagle3.kernels import extension
from sglang_eagle3.models.config import ConfigError
from sglang_eagle3.models.testbed import MODEL_DIRNAME
from sglang_eagle3.paths import shipped_draft

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_DTYPE = "auto"
DTYPE_CHOICES = [DEFAULT_DTYPE, *DTYPES]
AUTO_DTYPE_HELP = ("auto (default): bfloat16 on GPUs and on CPUs where the engine has a bf16 kernel (AVX-512 BF16, "
                   "AMX, AVX-512F or AVX2 + FMA with the C++ extension built), else float32")
TREE_FLAGS = ("num_steps", "topk", "num_draft_tokens")
SGLANG_TREE = SpecConfig()          # SGLang's default tree, where neither flags nor a profile give one
SGLANG_TREE_SOURCE = "default tree (SGLang's 5/4/16)"
MAX_RUNNING = 32                    # the builtin server: requests decoded together (--max-running-requests)
MAX_QUEUE = 256                     # waiting requests beyond which it answers 503 (--max-queue)
MAX_LEN_CAP = 4096                  # KV slots per request: the target's context, at most this (--max-len)
POOL_TOKENS = 1 << 16               # tokens of recent requests its context drafter searches too (--pool-tokens)


@dataclass(frozen=True)
class Settings:
    """What a run decodes with, decided once (resolve_settings) and read, never changed, downstream. The defaults
    fit an engine around models already loaded: no draft folder (the engine takes the draft model it is given),
    SGLang's tree, the eagle drafter with fixed trees."""
    dtype: str = "float32"              # "bfloat16" | "float32" | "float16": what the loader loads the models in
    draft: Optional[str] = None         # draft folder or hub id the loader loads; None: none (vanilla, or suffix)
    tree: Optional[SpecConfig] = SGLANG_TREE    # the tree at `batch_size`; None: no speculation there
    profile: Optional[SpecProfile] = None       # per-batch-size trees the engine adapts with; None: `tree` is fixed
    source: str = "given"               # where the tree came from (banners, JSON outputs)
    batch_size: int = 1                 # the running batch the tree is chosen for
    drafting: Drafting = field(default_factory=Drafting)   # drafter (eagle | suffix | hybrid), tree sizing, pool
    device: str = "cpu"                 # where the models load and decode
    # the builtin server (eagle3 serve --engine builtin)
    max_running: int = MAX_RUNNING      # requests decoded together at most
    max_queue: int = MAX_QUEUE          # waiting requests beyond which a new one is refused (503)
    max_len: Optional[int] = None       # KV slots per request (--max-len); None: see slots_per_request
    # the draft folder's draft_calibration.json, read where sampled children use it (None: none, or not used)
    calibration: Optional[DraftCalibration] = None

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise UserError(f"settings dtype {self.dtype!r}: one of {', '.join(DTYPES)} (resolve_dtype resolves "
                            "'auto')")

    @property
    def engine_tree(self) -> SpecConfig:
        """The tree an engine is built with: the fixed tree, else the fastest tree the profile measured at this
        batch size (the profile still decides per step), else SGLang's default."""
        measured = self.profile.measured_tree(self.batch_size) if self.profile is not None else None
        return self.tree or measured or SGLANG_TREE

    def trees(self, has_draft: bool) -> list[SpecConfig]:
        """Every tree the draft model may run in a step (the KV pools make room for the largest): the profile's,
        else the engine's tree; none without a draft model, or where the context alone drafts."""
        if not (has_draft and self.drafting.uses_draft):
            return []
        return self.profile.trees() if self.profile is not None else [self.engine_tree]

    def slots_per_request(self, context_len: Optional[int]) -> int:
        """The server's KV slots per request: --max-len, else the target's context up to MAX_LEN_CAP; never more
        than the context (a target that names none: MAX_LEN_CAP)."""
        context = context_len or MAX_LEN_CAP
        return min(self.max_len or min(context, MAX_LEN_CAP), context)

    @property
    def speculates(self) -> bool:
        return self.draft is not None or self.drafting.uses_context

    @property
    def step_tree(self) -> Optional[SpecConfig]:
        """The draft model's tree as a step runs it (None: no draft): with --tree auto, its size is the most a step
        verifies."""
        return self.drafting.step_tree(self.engine_tree) if self.draft is not None else None

    def describe(self) -> str:
        d = self.drafting
        auto = d.tree == "auto"
        how = f"drafter {d.drafter}" + (", tree sized each step" if auto else "")
        if self.draft is None:
            return f"{how}{f' up to {d.max_nodes} tokens' if auto else ''} (no draft model)" if d.uses_context else \
                "no speculation"
        t = d.step_tree(self.tree)
        shape = f"{'up to' if auto else 'tree'} num_steps={t.num_steps} topk={t.topk} " \
                f"num_draft_tokens={t.num_draft_tokens}" if t else "no speculation at this batch size"
        return f"{how}, {shape} ({self.source})"


def resolve_dtype(name: str, device: str = "cpu") -> str:
    """--dtype auto: bfloat16 on GPUs and on CPUs where our engine computes bf16 products fast: natively (AVX-512
    BF16, AMX) or with csrc's AVX-512F / AVX2 kernels (bf16 weights widened to fp32 in registers: decode reads half
    the bytes). float32 elsewhere: PyTorch's emulated bf16 products run 3-100x slower than fp32 there."""
    if name != "auto":
        if name not in DTYPES:
            raise UserError(f"--dtype {name!r}: choose one of {', '.join(DTYPE_CHOICES)}")
        return name
    if str(device).startswith("cuda"):
        return "bfloat16"
    fast = extension.cpu_has_bf16() or (extension.mode() != "off" and extension.few_row_isa() in ("avx512f", "avx2"))
    return "bfloat16" if fast else "float32"


def check_device(name: str, flag: str = "--device") -> str:
    """A --device before any model loads: auto, cpu, or cuda[:N] with that GPU visible (one line otherwise)."""
    if name == "auto":
        return name
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise UserError(f"{flag} {name!r}: expected auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise UserError(f"{flag} {name}: only cpu and cuda devices are supported")
    if dev.type == "cuda":
        n = torch.cuda.device_count()
        if n == 0:
            raise UserError(f"{flag} {name}: no CUDA GPU is visible on this machine")
        if dev.index is not None and dev.index >= n:
            raise UserError(f"{flag} {name}: this machine has {n} CUDA GPU(s) (cuda:0..cuda:{n - 1})")
    return name


def default_draft(draft: Optional[str], embedded_target: bool) -> Optional[str]:
    """--draft as given ('none': no draft), else the shipped draft when the target is the embedded one."""
    if draft is not None:
        return None if draft == "none" else draft
    return shipped_draft() if embedded_target else None


def resolve_settings(draft: Optional[str], *, embedded_target: bool = False, dtype: str = DEFAULT_DTYPE,
                     num_steps: Optional[int] = None, topk: Optional[int] = None,
                     num_draft_tokens: Optional[int] = None, profile: Optional[str] = None, batch_size: int = 1,
                     temperature: float = 0.0, device: str = "cpu", drafter: Optional[str] = None,
                     tree: Optional[str] = None, target: Optional[str] = None, server: bool = False,
                     max_running: Optional[int] = None, max_queue: Optional[int] = None,
                     max_len: Optional[int] = None, pool_tokens: Optional[int] = None,
                     draft_children: str = "sampled") -> Settings:
    """The one place that decides what a run decodes with (see the module docstring for the rules). target: the
    --target as given ('testbed': the embedded one), which a profile that names its own target must match. server:
    the builtin server's run, whose limits and pool are the flags given (None: not given, the default)."""
    if batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {batch_size}")
    explicit = {k: v for k, v in (("num_steps", num_steps), ("topk", topk), ("num_draft_tokens", num_draft_tokens))
                if v is not None}
    check_at_least(1, {"--" + k.replace("_", "-"): v for k, v in explicit.items()})
    check_drafting_flags(draft, embedded_target, explicit, profile, drafter, tree)
    dtype = resolve_dtype(dtype, device)
    found = _resolve_tree(draft, embedded_target, explicit, profile, batch_size, temperature, device, drafter, target)
    drafting = resolve_drafting(found.draft, drafter, tree, explicit, found.table)
    if draft_children != drafting.children:
        try:
            drafting = replace(drafting, children=draft_children)
        except ConfigError as e:
            raise UserError(str(e)) from None
    if server:
        drafting = replace(drafting, pool_tokens=server_pool(pool_tokens, drafting, found.draft is not None))
    limits = {"max_running": MAX_RUNNING if max_running is None else max_running,
              "max_queue": MAX_QUEUE if max_queue is None else max_queue, "max_len": max_len} if server else {}
    kept = found.draft if drafting.uses_draft else None     # suffix: context proposals only, no draft model loaded
    return Settings(dtype, kept, found.tree, found.profile, found.source, batch_size, drafting, device, **limits,
                    calibration=read_calibration(kept) if drafting.children == "sampled" else None)


def read_calibration(draft: Optional[str]) -> Optional[DraftCalibration]:
    """The draft folder's draft_calibration.json (None: it has none); a bad one is a one-line UserError."""
    path = calibration_path(draft)
    if path is None:
        return None
    try:
        return DraftCalibration.read(path)
    except ConfigError as e:
        raise UserError(f"{e} (delete it, or run with --draft-children sampled-raw)") from None


def server_pool(pool_tokens: Optional[int], drafting: Drafting, has_draft: bool) -> int:
    """The server's --pool-tokens where a context drafter runs (POOL_TOKENS when not given), else 0; given without
    one: refused."""
    if drafting.uses_context:
        return POOL_TOKENS if pool_tokens is None else pool_tokens
    if pool_tokens is not None:
        how = f"drafts with {drafting.drafter}" if has_draft else "does not speculate"
        raise UserError(f"--pool-tokens {pool_tokens} applies to the context drafters (--drafter suffix or hybrid), "
                        f"but this server {how}")
    return 0


def check_drafting_flags(draft: Optional[str], embedded_target: bool, explicit: dict, profile: Optional[str],
                         drafter: Optional[str], tree: Optional[str]) -> None:
    """Flags that contradict each other, or that the drafter would never read, are refused (not rewritten), before
    anything is read: --draft / --profile / tree flags under --drafter suffix; a drafter, --tree, --profile or tree
    flags that need a draft model where there is none."""
    if drafter == "suffix":
        if draft not in (None, "none"):
            raise UserError(f"--draft {draft}: --drafter suffix drafts from the context alone and loads no draft "
                            "model; leave --draft out")
        if profile:
            raise UserError(f"--profile {profile}: --drafter suffix reads no speculation profile (its trees are the "
                            "draft model's); leave --profile out")
        check_context_tree(explicit, tree or "profile", "--drafter suffix")
        return
    if default_draft(draft, embedded_target) is not None:
        return
    why = "--draft none" if draft == "none" else "no --draft given"
    if drafter is not None:
        what = "drafts with the draft model" if drafter == "eagle" else "adds the draft model's tree to the context's"
        raise UserError(f"--drafter {drafter} {what}, but there is no draft ({why}): pass --draft, or --drafter suffix")
    if tree is not None:
        raise UserError(f"--tree {tree} sizes the draft tree, but there is no draft (vanilla decoding, {why}): pass "
                        "--draft, or --drafter suffix")
    if profile:
        raise UserError(f"--profile {profile}: a speculation profile needs a draft (--draft)")
    if explicit:
        raise UserError(f"--{next(iter(explicit)).replace('_', '-')} shapes the draft tree, but there is no draft "
                        "(vanilla decoding): pass --draft, or leave the tree flags out")


def check_context_tree(explicit: dict, tree: str, who: str) -> None:
    """Tree flags where only the context drafts (`who`: the flag or profile that chose suffix): none shapes its tree,
    except --num-draft-tokens with --tree auto (the most a step verifies)."""
    shaping = [k for k in explicit if not (k == "num_draft_tokens" and tree == "auto")]
    if shaping:
        flag = "--" + shaping[0].replace("_", "-")
        raise UserError(f"{flag} shapes the draft model's tree, but {who} drafts from the context alone: leave it out, "
                        "or pass --drafter eagle or hybrid" +
                        (" (with --tree auto, --num-draft-tokens is the most a step verifies)"
                         if flag == "--num-draft-tokens" else ""))


def resolve_drafting(draft: Optional[str], drafter: Optional[str], tree: Optional[str], explicit: dict,
                     table: Optional[SpecProfile]) -> Drafting:
    """--drafter / --tree, else the profile's measured choice for this host (`drafting` in its table), else
    eagle with the profile's fixed trees; without a draft model, `eagle` falls back to no speculation. With the
    per-step tree (`auto`), an explicit --num-draft-tokens is the most a step verifies."""
    chosen = dict(table.drafting) if table is not None else {}
    if drafter is None and chosen.get("drafter") == "suffix":
        check_context_tree(explicit, tree or chosen.get("tree", "profile"),
                           f"{table.source} (its drafter for this host: suffix)")
    if drafter is not None:
        chosen["drafter"] = drafter
    if tree is not None:
        chosen["tree"] = tree
    if chosen.get("tree") == "auto" and "num_draft_tokens" in explicit:
        most = explicit["num_draft_tokens"]
        if most > MAX_NODES:
            raise UserError(f"--num-draft-tokens {most}: with --tree auto it is the most a step verifies, at most "
                            f"{MAX_NODES}")
        chosen["max_nodes"] = most
    if chosen.get("drafter", "eagle") == "hybrid" and draft is None:
        chosen["drafter"] = "suffix"    # the profile measured the draft slower at every batch size: the context alone
    try:
        return Drafting(**chosen)
    except (ConfigError, TypeError) as e:
        raise UserError(str(e)) from None


class Found(NamedTuple):
    """The draft and its tree, and the profile they came from."""
    draft: Optional[str]
    tree: Optional[SpecConfig]
    profile: Optional[SpecProfile]          # the table the engine adapts with; None: the tree is fixed
    source: str
    table: Optional[SpecProfile] = None     # the profile read (its drafting choice counts under fixed trees too)


def _resolve_tree(draft, embedded_target, explicit, profile, batch_size, temperature, device, drafter,
                  target) -> Found:
    """The draft, its tree and the profile they came from."""
    draft = default_draft(draft, embedded_target) if drafter != "suffix" else None
    if draft is None:
        return Found(None, None, None, "no draft")
    table, where = load_profile(profile, draft, device, target)
    sampled = temperature > 0 and table is not None and table.sampled is not None
    if explicit:
        base = (table.measured_tree(batch_size, sampled) if table is not None else None) or SGLANG_TREE
        source = "flags " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in explicit.items()) + \
            (f" over {where}'s tree" if table is not None else "")
        return Found(draft, explicit_tree(base, explicit), None, source, table)
    if table is None:
        return Found(draft, SGLANG_TREE, None, where or SGLANG_TREE_SOURCE)
    if all(t is None for t in table.table.values()):
        return Found(None, None, None, f"{where} chooses no speculation at any batch size: the draft is not loaded",
                     table)
    tree = table.for_batch_size(batch_size, sampled)
    what = "tuned" if tree is not None else "vanilla measured faster"
    return Found(draft, tree, table, f"{table.source}, {'sampled, ' if sampled else ''}batch {batch_size}: {what}; "
                 "adapts to the running batch size", table)


def model_name(target: str) -> str:
    """What names a model on any machine: 'testbed' is the embedded SmolLM2; a folder or a hub id, its last part
    (tune_spec records a folder outside the repository by its name)."""
    if target in ("", "testbed"):
        return MODEL_DIRNAME.lower()
    return os.path.basename(os.path.normpath(os.path.expanduser(target))).lower()


def load_profile(path: Optional[str], draft: str, device: str = "cpu",
                 target: Optional[str] = None) -> tuple[Optional[SpecProfile], str]:
    """The speculation profile a run uses and a note on it: --profile as given, else the draft folder's own
    spec_profile.json. On a GPU a draft's own profile counts only with a table measured on GPUs (its CPU tables
    pick trees for another cost of a verify). A profile recorded for another target than `target` is refused."""
    own = path is None
    path = path or draft_profile_path(draft)
    if path is None:
        return None, ""
    kind = host_kind(device)
    named = "" if own else "--profile "
    try:
        table = SpecProfile.load(path, host=kind)
    except ConfigError as e:
        raise UserError(f"--profile: {e}" if not own else str(e)) from None
    if target is not None and table.target is not None and model_name(table.target) != model_name(target):
        raise UserError(f"{named}{path}: measured for target {table.target}, not this run's {target} (a profile's "
                        "trees hold for its own target; tune one for this target with bench/tune_spec.py)")
    if own and kind == "cuda" and table.host != "cuda":
        return None, f"{path} has no table for GPUs: {SGLANG_TREE_SOURCE}"
    return table, path


# ---- the flags every entry point shares --------------------------------------------------------------------
def add_dtype_arg(p, note: str = "") -> None:
    """--dtype: the run's compute dtype (note: what it applies to, added to the help)."""
    p.add_argument("--dtype", default=DEFAULT_DTYPE, choices=DTYPE_CHOICES, help=AUTO_DTYPE_HELP + note)


def add_compile_arg(p) -> None:
    p.add_argument("--compile", choices=["auto", "off"], default="auto",
                   help="auto (default): the compiled CPU path (packed bf16 linears, the C++ attention and norm "
                        "kernels built at install); off: plain eager PyTorch (the reference)")


def apply_compile_arg(args) -> None:
    extension.set_mode(args.compile)


def add_spec_args(p: argparse.ArgumentParser, profile: bool = True) -> None:
    """The tree and drafting flags settings_from_args reads; profile=False: a command without --profile (its
    namespace still holds profile None: the draft folder's own)."""
    g = p.add_argument_group("draft tree (SGLang semantics; default: the profile's tree for the running batch size, "
                             "else 5/4/16 as SGLang)")
    g.add_argument("--num-steps", type=int, default=None, help="tree depth")
    g.add_argument("--topk", type=int, default=None, help="branching per step")
    g.add_argument("--num-draft-tokens", type=int, default=None,
                   help="tokens verified per step incl. the root (--tree auto: the most a step verifies)")
    g.add_argument("--drafter", choices=list(DRAFTERS), default=None,
                   help="eagle: the draft model's tree; suffix: continuations of the context's earlier text (no draft "
                        "model, any target); hybrid: both in one tree (default: the profile's choice for this host, "
                        "else eagle)")
    g.add_argument("--tree", choices=list(TREE_SIZING), default=None,
                   help="profile: the fixed tree per batch size; auto: each step the size that maximises expected "
                        "tokens per second on this machine (costs measured once per machine, then cached)")
    add_children_arg(g)
    if profile:
        g.add_argument("--profile", default=None,
                       help="speculation profile JSON (bench/tune_spec.py); default: the draft folder's "
                            "spec_profile.json, its table for this kind of host")
    else:
        p.set_defaults(profile=None)


def add_children_arg(g) -> None:
    g.add_argument("--draft-children", choices=list(DRAFT_CHILDREN), default="sampled",
                   help="at temperature > 0: sampled (default) draws the draft's children from its distribution, "
                        "sharpened per tree depth by the draft folder's draft_calibration.json where it has one "
                        "(sampled-raw: at the request's own temperature), and verifies them by recursive rejection "
                        "sampling; top-k takes its likeliest tokens and accepts "
                        "each with the target's probability (the EAGLE authors' scheme). All three keep the target's "
                        "distribution exactly; greedy decoding is the same either way")


def fixed_tree(num_steps: Optional[int] = None, topk: Optional[int] = None,
               num_draft_tokens: Optional[int] = None) -> SpecConfig:
    """The tree these flags name, the rest from SGLang's default 5/4/16 (no draft folder to take a profile from)."""
    given = {k: v for k, v in (("num_steps", num_steps), ("topk", topk), ("num_draft_tokens", num_draft_tokens))
             if v is not None}
    return explicit_tree(SGLANG_TREE, given)


def explicit_tree(base: SpecConfig, given: dict) -> SpecConfig:
    """The tree of the flags given over `base`'s values. A chain (topk 1) verifies num_steps + 1 tokens: SGLang cuts
    a larger num_draft_tokens down to that, so an explicit --num-draft-tokens it would cut is refused here."""
    try:
        tree = replace(base, **given)
    except ConfigError as e:
        raise UserError(str(e)) from None
    if "num_draft_tokens" in given and tree.num_draft_tokens != given["num_draft_tokens"]:
        raise UserError(f"--num-draft-tokens {given['num_draft_tokens']}: a chain (topk 1) of {tree.num_steps} steps "
                        f"verifies {tree.num_draft_tokens} tokens; pass --num-draft-tokens {tree.num_draft_tokens} or "
                        "more --num-steps / --topk")
    return tree


def is_embedded(args) -> bool:
    """--target names the embedded model: 'testbed' as given, or marked so by the eagle3 command when it resolved
    'testbed' to its folder."""
    return args.target in (None, "testbed") or getattr(args, "embedded_target", False)


def settings_from_args(args, draft: Optional[str], *, batch_size: int = 1, temperature: float = 0.0,
                       device: str = "cpu", server: bool = False) -> Settings:
    """resolve_settings from a namespace with the shared flags: --target, add_dtype_arg's and add_spec_args' (the
    launcher declares the same). What a command has beside them is passed in: the batch size the tree is chosen
    for, its --temperature, its --device. server: the builtin server's flags too (--batch-size as the running
    limit, --max-queue, --max-len, --pool-tokens)."""
    limits = {"server": True, "max_running": args.batch_size, "max_queue": args.max_queue, "max_len": args.max_len,
              "pool_tokens": args.pool_tokens} if server else {}
    return resolve_settings(
        draft, embedded_target=is_embedded(args), target=args.target, dtype=args.dtype, num_steps=args.num_steps,
        topk=args.topk, num_draft_tokens=args.num_draft_tokens, profile=args.profile, drafter=args.drafter,
        tree=args.tree, batch_size=batch_size, temperature=temperature, device=device,
        draft_children=args.draft_children, **limits)
