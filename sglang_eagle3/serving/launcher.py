"""`eagle3 serve` and serve/launch_server.py: an OpenAI-compatible server with an EAGLE-3 draft, one command.

    eagle3 serve [--engine auto|builtin|sglang] [--target T] [--draft D] [--profile tuned.json] [--port 30000]

--engine builtin: our own engine behind FastAPI (server.py): continuous batching, adaptive speculation from
the profile, any machine (CPU included). Defaults: the embedded target and its shipped draft and profile.
--engine sglang (auto picks it where a CUDA GPU and SGLang are present): runs the draft check
(`check-draft`) and then

    python -m sglang.launch_server --model-path T --speculative-algorithm EAGLE3
        --speculative-draft-model-path D --speculative-num-steps S --speculative-eagle-topk K
        --speculative-num-draft-tokens N --attention-backend flashinfer [SGLang flags...]

S, K, N come from engine/settings.py's resolve_settings, as for every entry point: --num-steps/--topk/
--num-draft-tokens, else the profile's entry for --batch-size (default 1), else SGLang's 5/4/16. SGLang keeps its
own concurrency defaults; --batch-size / --max-running-requests B caps them (--max-running-requests B and
--cuda-graph-max-bs-decode B). Flags this command does not know are passed to SGLang unchanged.
(SGLang 0.5.23 split `--cuda-graph-max-bs` into -decode and -prefill; the decode one is set.)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import socket
import subprocess
import sys
from typing import Optional

from sglang_eagle3.engine.settings import (
    MAX_LEN_CAP,
    MAX_QUEUE,
    MAX_RUNNING,
    POOL_TOKENS,
    SGLANG_TREE,
    Settings,
    add_children_arg,
    add_compile_arg,
    add_dtype_arg,
    apply_compile_arg,
    is_embedded,
    settings_from_args,
)
from sglang_eagle3.engine.speculation import DRAFTERS, TREE_SIZING, SpecConfig
from sglang_eagle3.errors import UserError, check_at_least, flags_of

DEFAULT_ATTENTION_BACKEND = "flashinfer"
# flags only one engine reads (given to the other, they would be ignored): refused there
BUILTIN_ONLY = ("max_queue", "max_len", "pool_tokens", "max_body_mb")
SGLANG_ONLY = ("attention_backend", "cuda_graph_max_bs", "adaptive")
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
    add_dtype_arg(g)
    g.add_argument("--max-queue", type=int, default=None,
                   help=f"waiting requests beyond which the server answers 503 (default {MAX_QUEUE})")
    add_compile_arg(g)
    g.add_argument("--max-len", type=int, default=None,
                   help=f"KV slots per request: prompt + max_tokens + draft tree (default min(target context, "
                        f"{MAX_LEN_CAP}))")
    g.add_argument("--max-body-mb", type=float, default=None,
                   help="largest request body in MiB, a 413 past it (default 4, or 256 bytes a token of --max-len "
                        "where that is more)")
    p.add_argument("--profile", default=None, help='tuned tree shapes: {"per_batch_size": {"1": {"num_steps": .., '
                                                   '"topk": .., "num_draft_tokens": ..}, ...}} (default: the '
                                                   "draft folder's spec_profile.json)")
    p.add_argument("--batch-size", "--max-running-requests", dest="batch_size", type=int, default=None,
                   help=f"concurrent requests: builtin, the running-batch limit (default {MAX_RUNNING}); "
                        "sglang, caps SGLang's --max-running-requests and --cuda-graph-max-bs-decode and picks "
                        "the profile entry (default: SGLang's own limits, the profile's batch-1 entry)")
    p.add_argument("--num-steps", type=int, default=None, help=f"tree depth (default: profile, else "
                                                               f"{SGLANG_TREE.num_steps})")
    p.add_argument("--topk", type=int, default=None, help=f"branching per step (default: profile, else "
                                                          f"{SGLANG_TREE.topk})")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help=f"tokens verified per step (default: profile, else {SGLANG_TREE.num_draft_tokens})")
    g.add_argument("--drafter", choices=list(DRAFTERS), default=None,
                   help="eagle: the draft model's tree; suffix: continuations of the context (no draft model); hybrid: "
                        "both in one tree (default: the profile's choice for this host, else eagle)")
    g.add_argument("--tree", choices=list(TREE_SIZING), default=None,
                   help="profile: the fixed tree per batch size; auto: sized each step by this machine's costs")
    add_children_arg(g)
    g.add_argument("--pool-tokens", type=int, default=None,
                   help=f"suffix/hybrid: tokens of recent requests searched for continuations too (default "
                        f"{POOL_TOKENS}, about 150 MB of index; 0: none)")
    p.add_argument("--attention-backend", default=None,
                   help=f"SGLang attention backend (default {DEFAULT_ATTENTION_BACKEND})")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None, help="largest decode batch captured in a CUDA "
                                                                       "graph (default: SGLang's, or --batch-size)")
    p.add_argument("--adaptive", nargs="?", const="", default=None, metavar="CONFIG",
                   help="let SGLang adapt num_steps at run time (--speculative-adaptive; needs topk 1), "
                        "optionally with its adaptive config JSON")
    p.add_argument("--skip-check", action="store_true", help="do not run check-draft first")
    p.add_argument("--dry-run", action="store_true", help="print the SGLang command (or the builtin engine's "
                                                          "settings) and exit")


# ---- checks before any work ---------------------------------------------------------------------------
def check_args(args) -> None:
    """Every number this command takes, before anything loads."""
    check_at_least(1, flags_of(args, "batch_size", "max_queue", "max_len", "cuda_graph_max_bs"))
    check_at_least(0, flags_of(args, "pool_tokens"))
    if args.max_body_mb is not None and not args.max_body_mb > 0:
        raise UserError(f"--max-body-mb must be > 0, got {args.max_body_mb:g}")
    if not 1 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: a port is 1..65535")
    if args.target not in (None, "testbed"):
        from sglang_eagle3.models.testbed import check_target_arg
        check_target_arg(args.target)


def check_engine_flags(args, engine: str) -> None:
    """Flags the other engine reads, given to this one: refused in one line (they would be ignored)."""
    if engine == "builtin":
        given = [name for name in SGLANG_ONLY if getattr(args, name) is not None]
        why = "an SGLang flag (--engine sglang); the builtin engine does not read it"
    else:
        given = [name for name in BUILTIN_ONLY if getattr(args, name) is not None] + \
            (["compile"] if getattr(args, "compile", "auto") != "auto" else [])
        why = "a builtin-engine flag (--engine builtin); SGLang does not read it"
    if given:
        picked = " (--engine auto picked it on this machine)" if args.engine == "auto" else ""
        value = getattr(args, given[0])
        raise UserError(f"--{given[0].replace('_', '-')}{f' {value}' if value != '' else ''} is {why}{picked}")


def bind_port(host: str, port: int) -> socket.socket:
    """A socket listening on the address now (a server already on it, or a host this machine does not have, fails
    here in one line instead of after the model has loaded); the builtin server serves on this very socket, so a
    client that connects while the model loads waits for it instead of being refused."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UserError(f"--host {host}: not an address of this machine ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(addr)
        s.listen()                      # listening: no other server can take the port while the model loads
    except OSError as e:
        s.close()
        raise UserError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); is a server already "
                        "running on it?") from None
    return s


def check_port_free(host: str, port: int) -> None:
    """The address can be bound now (SGLang binds it itself, after its own start-up)."""
    bind_port(host, port).close()


def check_max_len(target: str, max_len: Optional[int]) -> None:
    """--max-len is at most the target's context (a longer one would be cut down without a word)."""
    if max_len is None:
        return
    from transformers import AutoConfig

    from sglang_eagle3.models.config import context_length
    ctx = context_length(AutoConfig.from_pretrained(target))
    if ctx and max_len > ctx:
        raise UserError(f"--max-len {max_len} exceeds the target's context of {ctx} tokens")


def check_passthrough(extra: list[str]) -> None:
    for token in extra:
        flag = token.split("=", 1)[0]
        if flag in COMPOSED_FLAGS:
            ours = COMPOSED_FLAGS[flag]
            raise UserError(f"{flag} is set by this command" + (f"; use {ours}" if ours else ""))


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
    from sglang_eagle3.formats.check_draft import ERROR, WARN, check_draft, format_table
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


# ---- SGLang ---------------------------------------------------------------------------------------------
def build_command(args, settings: Settings, extra: list[str], python: Optional[str] = None) -> list[str]:
    spec = settings.tree if settings.draft else None
    cmd = [python or sys.executable, "-m", "sglang.launch_server", "--model-path", args.target]
    if spec is not None:
        cmd += ["--speculative-algorithm", "EAGLE3",
                "--speculative-draft-model-path", settings.draft,
                "--speculative-num-steps", str(spec.num_steps),
                "--speculative-eagle-topk", str(spec.topk),
                "--speculative-num-draft-tokens", str(spec.num_draft_tokens)]
    cmd += ["--attention-backend", args.attention_backend or DEFAULT_ATTENTION_BACKEND]
    if args.dtype != "auto":
        cmd += ["--dtype", args.dtype]                  # SGLang's own flag of the same name and values
    graphs = args.cuda_graph_max_bs or args.batch_size
    if graphs is not None:
        cmd += ["--cuda-graph-max-bs-decode", str(graphs)]
    if args.batch_size is not None:
        cmd += ["--max-running-requests", str(args.batch_size)]
    cmd += ["--host", args.host, "--port", str(args.port)]
    if args.adaptive is not None and spec is not None:
        cmd.append("--speculative-adaptive")
        if args.adaptive:
            cmd += ["--speculative-adaptive-config", args.adaptive]
    return cmd + list(extra)


def serve_sglang(args, extra: list[str]) -> int:
    check_passthrough(extra)
    if args.drafter not in (None, "eagle") or args.tree == "auto":
        raise UserError(f"--drafter {args.drafter} / --tree {args.tree}: context drafting and per-step trees run in "
                        "the builtin engine (--engine builtin); SGLang drafts with its EAGLE-3 worker")
    embedded = is_embedded(args)
    settings = settings_from_args(args, args.draft, batch_size=args.batch_size or 1, device="cuda")   # SGLang: GPUs
    if settings.draft is None and settings.source == "no draft" and args.draft != "none":
        raise UserError("--draft is required with --engine sglang (an EAGLE-3 draft folder or hub id)")
    if embedded:
        from sglang_eagle3.models.testbed import prepare
        args.target = prepare()
    spec = settings.tree if settings.draft else None
    check_adaptive(args, spec)
    if not args.skip_check and spec is not None:
        run_draft_check(args.target, settings.draft)
    cmd = build_command(args, settings, extra)
    banner = f"eagle3 serve: {settings.describe()}"
    if args.dry_run:
        print(banner, file=sys.stderr)
        print(shlex.join(cmd))
        return 0
    check_runtime(args)
    check_port_free(args.host, args.port)
    print(f"{banner}\n{shlex.join(cmd)}", file=sys.stderr, flush=True)
    try:
        return subprocess.call(cmd)
    except KeyboardInterrupt:
        return 130


# ---- our engine -----------------------------------------------------------------------------------------
def serve_builtin(args, extra: list[str]) -> int:
    from sglang_eagle3.models.testbed import resolve_target
    from sglang_eagle3.serving.server import EngineThread, build_state, run_server
    if extra:
        raise UserError(f"unknown flags for the builtin engine: {' '.join(extra)} (SGLang flags need --engine sglang)")
    apply_compile_arg(args)
    sock = None if args.dry_run else bind_port(args.host, args.port)    # held until the server listens on it
    try:
        settings = settings_from_args(args, args.draft, batch_size=1, server=True)
        if settings.draft is None and "chooses no speculation" in settings.source:
            print(f"eagle3 serve: {settings.source}", file=sys.stderr, flush=True)
        target = resolve_target(args.target)
        check_max_len(target, args.max_len)
        engine_thread = EngineThread()                # every torch call of the server runs on it, the check's too
        if settings.draft and not args.skip_check:
            engine_thread.submit(run_draft_check, target, settings.draft).result()
        state = build_state(target, settings, max_body_mb=args.max_body_mb, engine_thread=engine_thread)
        how = settings.describe() + \
            (f"; adaptive speculation from {settings.profile.source}" if settings.profile else "")
        print(f"eagle3 serve: builtin engine, {how} ({settings.dtype})", file=sys.stderr, flush=True)
        if args.dry_run:
            return 0
        return run_server(state, args.host, args.port, sock=sock)
    finally:
        if sock is not None:
            sock.close()


def serve(args, extra: Optional[list[str]] = None) -> int:
    extra = list(extra if extra is not None else getattr(args, "sglang_args", []))
    check_args(args)
    engine = pick_engine(args)
    check_engine_flags(args, engine)
    if engine == "builtin":
        return serve_builtin(args, extra)
    return serve_sglang(args, extra)


# ---- entry points ---------------------------------------------------------------------------------------
class PassThroughParser(argparse.ArgumentParser):
    """Flags it does not know are SGLang's: kept, in order, in `args.sglang_args` instead of failing."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, rest = super().parse_known_args(args, namespace)
        namespace.sglang_args = rest
        return namespace, []


def add_cli(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server with an EAGLE-3 draft: our engine (any machine) or "
                                     "SGLang's (CUDA; check, tuned tree, CUDA graphs)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       allow_abbrev=False, epilog="Other flags (e.g. --port 30000 --tp-size 2) go to SGLang.")
    p.__class__ = PassThroughParser          # the `eagle3` parser rejects unknown flags otherwise
    add_arguments(p)
    p.set_defaults(func=serve)


def main(argv=None) -> int:
    """serve/launch_server.py: same flags as `eagle3 serve`; unknown flags go to SGLang."""
    from sglang_eagle3.errors import debug_enabled, report, user_errors
    p = PassThroughParser(prog="launch_server.py", description=__doc__, allow_abbrev=False,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return serve(args, args.sglang_args)
    except user_errors() as e:
        if debug_enabled(args):
            raise
        return report("launch_server.py", e)
