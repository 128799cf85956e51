"""`eagle3 serve` and serve/launch_server.py: an OpenAI-compatible server with an EAGLE-3 draft, one command.

    eagle3 serve [--engine auto|builtin|sglang] [--target T] [--draft D] [--profile tuned.json] [--port 30000]

--engine builtin: our own engine behind FastAPI (server.py): continuous batching, adaptive speculation from
the profile, any machine (CPU included). Defaults: the embedded target and its shipped draft and profile.
--engine sglang (auto picks it where a CUDA GPU and SGLang are present): runs the draft check
(`check_draft`) and then

    python -m sglang.launch_server --model-path T --speculative-algorithm EAGLE3
        --speculative-draft-model-path D --speculative-num-steps S --speculative-eagle-topk K
        --speculative-num-draft-tokens N --attention-backend flashinfer
        --cuda-graph-max-bs-decode B --max-running-requests B [SGLang flags...]

S, K, N come from the profile entry for the expected batch size B (profile format, as written by
`bench/tune`: {"per_batch_size": {"1": {"num_steps": 5, "topk": 4, "num_draft_tokens": 16}, "8": {...}}};
an entry {"speculation": false} launches without a draft), or from --num-steps/--topk/--num-draft-tokens,
which win over the profile. Flags this command does not know are passed to SGLang unchanged.
(SGLang 0.5.23 split `--cuda-graph-max-bs` into -decode and -prefill; the decode one is set.)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
from typing import Optional

from .cli import UserError
from .config import SpecConfig

DEFAULT_SPEC = SpecConfig()
# SGLang flags this command composes; passing them through as well would be ambiguous.
COMPOSED_FLAGS = {
    "--model-path": "--target", "--model": "--target",
    "--speculative-algorithm": None,
    "--speculative-draft-model-path": "--draft", "--speculative-draft-model": "--draft",
    "--speculative-num-steps": "--num-steps", "--speculative-eagle-topk": "--topk",
    "--speculative-num-draft-tokens": "--num-draft-tokens",
    "--attention-backend": "--attention-backend", "--cuda-graph-max-bs-decode": "--cuda-graph-max-bs",
    "--speculative-adaptive": "--adaptive", "--speculative-adaptive-config": "--adaptive",
    "--host": "--host", "--port": "--port",
}
EMBEDDED_HINT = ("without a GPU, serve with our own engine instead: "
                 "eagle3 serve --engine builtin --target {target} --draft {draft}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=["auto", "builtin", "sglang"], default="auto",
                   help="builtin: our engine (CPU or GPU); sglang: SGLang's server (CUDA GPU); auto (default): sglang "
                        "where a CUDA GPU and SGLang are present, else builtin")
    p.add_argument("--target", default="testbed", help="target HF folder or hub id (SGLang --model-path); "
                                                       "default 'testbed' = the embedded SmolLM2")
    p.add_argument("--draft", default=None, help="EAGLE-3 draft folder or hub id (default for the embedded target: "
                                                 "its shipped draft; 'none': no speculation)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="port (default 30000, as SGLang)")
    g = p.add_argument_group("builtin engine")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="auto (default): bfloat16 on GPUs and on CPUs with a bf16 kernel (AVX-512 BF16, AMX, AVX2 + FMA), "
                        "else float32")
    g.add_argument("--max-queue", type=int, default=256, help="waiting requests beyond which the server answers 503")
    g.add_argument("--compile", choices=["auto", "off"], default="auto",
                   help="auto: the compiled CPU kernels (default); off: eager PyTorch")
    g.add_argument("--max-len", type=int, default=None,
                   help="KV slots per request: prompt + max_tokens + draft tree (default min(target context, 4096))")
    p.add_argument("--profile", default=None, help='tuned tree shapes: {"per_batch_size": {"1": {"num_steps": .., '
                                                   '"topk": .., "num_draft_tokens": ..}, ...}}')
    p.add_argument("--batch-size", "--max-running-requests", dest="batch_size", type=int, default=None,
                   help="concurrent requests: builtin, the running-batch limit (default 32); sglang, the expected "
                        "batch size that picks the profile entry and sets --max-running-requests and "
                        "--cuda-graph-max-bs-decode (default 1)")
    p.add_argument("--num-steps", type=int, default=None, help=f"tree depth (default: profile, else "
                                                               f"{DEFAULT_SPEC.num_steps})")
    p.add_argument("--topk", type=int, default=None, help=f"branching per step (default: profile, else "
                                                          f"{DEFAULT_SPEC.topk})")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help=f"tokens verified per step (default: profile, else {DEFAULT_SPEC.num_draft_tokens})")
    p.add_argument("--attention-backend", default="flashinfer", help="SGLang attention backend (default flashinfer)")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None, help="largest decode batch captured in a CUDA "
                                                                       "graph (default: --batch-size)")
    p.add_argument("--adaptive", nargs="?", const="", default=None, metavar="CONFIG",
                   help="let SGLang adapt num_steps at run time (--speculative-adaptive; needs topk 1), "
                        "optionally with its adaptive config JSON")
    p.add_argument("--skip-check", action="store_true", help="do not run check-draft first")
    p.add_argument("--dry-run", action="store_true", help="print the SGLang command and exit")


# ---- tree shape ---------------------------------------------------------------------------------------
def resolve_spec(args) -> tuple[Optional[SpecConfig], str]:
    """Tree shape for this launch (None = serve without speculation) and a note on where it came from.

    The profile is read by `bench.tune.load_profile`, which routes a batch size without its own entry to
    the largest profiled one below it (else the smallest), as SGLang does for its adaptive config.
    """
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {args.batch_size}")
    base, source = DEFAULT_SPEC, "defaults"
    if args.profile:
        from .bench.tune import ProfileError, load_profile
        try:
            base = load_profile(args.profile, args.batch_size)
        except (ProfileError, FileNotFoundError) as e:
            raise UserError(f"--profile: {e}") from None
        source = f"{args.profile} at batch size {args.batch_size}"
    explicit = {k: getattr(args, k) for k in ("num_steps", "topk", "num_draft_tokens") if getattr(args, k) is not None}
    if base is None and not explicit:
        return None, source + " (vanilla decoding measured at least as fast: no speculation)"
    base = base or DEFAULT_SPEC
    if explicit:
        source += " + " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in explicit.items())
    values = {"num_steps": base.num_steps, "topk": base.topk, "num_draft_tokens": base.num_draft_tokens, **explicit}
    return SpecConfig(**values), source


# ---- command --------------------------------------------------------------------------------------------
def check_passthrough(extra: list[str]) -> None:
    for token in extra:
        flag = token.split("=", 1)[0]
        if flag in COMPOSED_FLAGS:
            ours = COMPOSED_FLAGS[flag]
            raise UserError(f"{flag} is set by this command" + (f"; use {ours}" if ours else ""))


def build_command(args, spec: Optional[SpecConfig], extra: list[str], python: Optional[str] = None) -> list[str]:
    cmd = [python or sys.executable, "-m", "sglang.launch_server", "--model-path", args.target]
    if spec is not None:
        cmd += ["--speculative-algorithm", "EAGLE3",
                "--speculative-draft-model-path", args.draft,
                "--speculative-num-steps", str(spec.num_steps),
                "--speculative-eagle-topk", str(spec.topk),
                "--speculative-num-draft-tokens", str(spec.num_draft_tokens)]
    cmd += ["--attention-backend", args.attention_backend,
            "--cuda-graph-max-bs-decode", str(args.cuda_graph_max_bs or args.batch_size),
            "--max-running-requests", str(args.batch_size), "--host", args.host, "--port", str(args.port)]
    if args.adaptive is not None and spec is not None:
        cmd.append("--speculative-adaptive")
        if args.adaptive:
            cmd += ["--speculative-adaptive-config", args.adaptive]
    return cmd + list(extra)


def check_adaptive(args, spec: Optional[SpecConfig]) -> None:
    if args.adaptive is None or spec is None:
        return
    if spec.topk != 1:
        raise UserError(f"--adaptive needs topk 1 (SGLang adapts chains only), got topk {spec.topk}")
    if args.adaptive:
        if not os.path.isfile(args.adaptive):
            raise UserError(f"--adaptive {args.adaptive}: no such file")
        if importlib.util.find_spec("sglang") is not None:
            from sglang.srt.speculative.adaptive_spec_params import resolve_candidate_steps_from_config
            try:
                resolve_candidate_steps_from_config(args.adaptive)
            except (ValueError, KeyError, json.JSONDecodeError) as e:
                raise UserError(f"--adaptive {args.adaptive}: {e}") from None


def looks_local(path: str) -> bool:
    return os.path.exists(path) or path.startswith((".", "/", "~")) or path.count("/") != 1


def run_draft_check(target: str, draft: str) -> None:
    """check-draft before any GPU work; raises UserError listing the errors."""
    from .check_draft import ERROR, WARN, check_draft, format_table
    if not os.path.isdir(draft):
        if looks_local(draft):
            raise UserError(f"--draft {draft}: no such folder")
        print(f"eagle3 serve: {draft} is a hub id; check-draft skipped (the sglang_eagle3 SGLang plugin still "
              "checks its config at start-up)", file=sys.stderr)
        return
    findings = check_draft(draft, target)
    errors = [f for f in findings if f.status == ERROR]
    warnings = [f for f in findings if f.status == WARN]
    if warnings or errors:
        print(format_table(errors + warnings), file=sys.stderr)
    if errors:
        raise UserError(f"draft {draft} failed {len(errors)} check(s) against {target} (table above); "
                        "SGLang would not load it or would serve it at acceptance length ~1.0 "
                        "(--skip-check to launch anyway)")


def check_runtime(args) -> None:
    """SGLang and a GPU are needed to serve; say so in one line, with the CPU alternative."""
    hint = EMBEDDED_HINT.format(target=args.target, draft=args.draft)
    if importlib.util.find_spec("sglang") is None:
        raise UserError("SGLang is not installed (on a CUDA machine: pip install 'sglang[all]==0.5.23'); " + hint)
    import torch
    if not torch.cuda.is_available():
        raise UserError("no CUDA GPU visible; SGLang's EAGLE-3 server needs one; " + hint)


def pick_engine(args) -> str:
    if args.engine != "auto":
        return args.engine
    if importlib.util.find_spec("sglang") is None:
        return "builtin"
    import torch
    return "sglang" if torch.cuda.is_available() else "builtin"


def default_draft(args) -> Optional[str]:
    """The shipped draft for the embedded target; otherwise the draft must be named."""
    if args.draft is not None:
        return None if args.draft == "none" else args.draft
    if getattr(args, "embedded_target", False) or args.target in (None, "testbed"):
        from .generate_cli import shipped_draft
        return shipped_draft()
    return None


def serve_builtin(args, extra: list[str]) -> int:
    from .config import ConfigError, SpecProfile, draft_profile_path
    from .server import build_state, run_server
    from .testbed import resolve_target
    if extra:
        raise UserError(f"unknown flags for the builtin engine: {' '.join(extra)} (SGLang flags need --engine sglang)")
    for flag, v in (("--batch-size", args.batch_size), ("--max-queue", args.max_queue), ("--max-len", args.max_len),
                    ("--port", args.port)):
        if v is not None and v < 1:
            raise UserError(f"{flag} must be >= 1, got {v}")
    from . import kernels
    kernels.set_mode(args.compile)
    target = resolve_target(args.target)
    draft = default_draft(args)
    profile = None
    profile_path = args.profile or draft_profile_path(draft)     # a draft's own profile, however it was named
    explicit = any(getattr(args, k) is not None for k in ("num_steps", "topk", "num_draft_tokens"))
    if draft and profile_path and not explicit:
        try:
            profile = SpecProfile.load(profile_path)
        except ConfigError as e:
            raise UserError(f"--profile: {e}") from None
    unused = profile is not None and all(tree is None for tree in profile.table.values())
    if unused:                                    # vanilla won at every batch size: the draft would only cost time
        print(f"eagle3 serve: {profile_path} chooses no speculation at any batch size; serving without the draft",
              file=sys.stderr, flush=True)
        draft, profile = None, None
    spec = SpecConfig(args.num_steps or DEFAULT_SPEC.num_steps, args.topk or DEFAULT_SPEC.topk,
                      args.num_draft_tokens or DEFAULT_SPEC.num_draft_tokens)
    if draft and not args.skip_check:
        run_draft_check(target, draft)
    from .generate_cli import resolve_dtype
    args.dtype = resolve_dtype(args.dtype)
    state = build_state(target, draft, args.dtype, spec, profile, args.batch_size or 32, args.max_queue,
                        args.max_len or 4096)
    how = (f"adaptive speculation from {profile.source}" if profile else
           f"tree num_steps={spec.num_steps} topk={spec.topk} num_draft_tokens={spec.num_draft_tokens}" if draft
           else "no speculation")
    print(f"eagle3 serve: builtin engine, {how} ({args.dtype})", file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    return run_server(state, args.host, args.port)


def serve(args, extra: Optional[list[str]] = None) -> int:
    extra = list(extra if extra is not None else getattr(args, "sglang_args", []))
    if pick_engine(args) == "builtin":
        return serve_builtin(args, extra)
    check_passthrough(extra)
    args.draft = args.draft if args.draft is not None else default_draft(args)
    if args.draft is None:
        raise UserError("--draft is required with --engine sglang (an EAGLE-3 draft folder or hub id)")
    args.batch_size = 1 if args.batch_size is None else args.batch_size
    if args.target == "testbed":
        from .testbed import prepare
        args.target = prepare()
    spec, source = resolve_spec(args)
    check_adaptive(args, spec)
    if not args.skip_check and spec is not None:
        run_draft_check(args.target, args.draft)
    cmd = build_command(args, spec, extra)
    tree = (f"tree num_steps={spec.num_steps} topk={spec.topk} num_draft_tokens={spec.num_draft_tokens}"
            if spec is not None else "no speculation")
    if args.dry_run:
        print(f"eagle3 serve: {tree} from {source}", file=sys.stderr)
        print(shlex.join(cmd))
        return 0
    check_runtime(args)
    print(f"eagle3 serve: {tree} from {source}\n{shlex.join(cmd)}", file=sys.stderr, flush=True)
    try:
        return subprocess.call(cmd)
    except KeyboardInterrupt:
        return 130


# ---- entry points ---------------------------------------------------------------------------------------
class PassThroughParser(argparse.ArgumentParser):
    """Flags it does not know are SGLang's: kept, in order, in `args.sglang_args` instead of failing."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, rest = super().parse_known_args(args, namespace)
        namespace.sglang_args = rest
        return namespace, []


def _cli(args) -> int:
    return serve(args)


def add_cli(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server with an EAGLE-3 draft: our engine (any machine) or "
                                     "SGLang's (CUDA; check, tuned tree, CUDA graphs)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       allow_abbrev=False, epilog="Other flags (e.g. --port 30000 --tp-size 2) go to SGLang.")
    p.__class__ = PassThroughParser          # the `eagle3` parser rejects unknown flags otherwise
    add_arguments(p)
    p.set_defaults(func=_cli)


def main(argv=None) -> int:
    """serve/launch_server.py: same flags as `eagle3 serve`; unknown flags go to SGLang."""
    from .config import ConfigError
    from .draft import CheckpointError
    p = PassThroughParser(prog="launch_server.py", description=__doc__, allow_abbrev=False,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    extra = args.sglang_args
    try:
        return serve(args, extra)
    except (UserError, ConfigError, CheckpointError, FileNotFoundError) as e:
        print(f"launch_server.py: error: {e}", file=sys.stderr)
        return 2
