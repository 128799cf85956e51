"""`eagle3` command line: each subcommand lives in its own module (`add_cli(subparsers)`).

Errors a user can cause (the project's own, missing or unreadable files, invalid configs, wrong kinds of files)
print as one line naming the file or flag, exit code 2. `--debug` (or EAGLE3_DEBUG=1) shows the traceback.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

# Modules that register subcommands; each defines add_cli(subparsers).
SUBCOMMAND_MODULES = [
    "sglang_eagle3.testbed",
    "sglang_eagle3.check_draft",
    "sglang_eagle3.formats.cli",
    "sglang_eagle3.generate_cli",
    "sglang_eagle3.data.cli",
    "sglang_eagle3.synthesize",
    "sglang_eagle3.regenerate",
    "sglang_eagle3.trainer.cli",
    "sglang_eagle3.launcher",
]


class UserError(Exception):
    """An error caused by the user's input; printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3", description="Train, serve and benchmark EAGLE-3 drafts.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks (also EAGLE3_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_cli(sub)
    return parser


def user_errors() -> tuple:
    """The exception types that mean "bad input", not "bug": reported in one line."""
    from safetensors import SafetensorError
    from .config import ConfigError
    from .draft import CheckpointError
    from .formats import FolderError, FormatError
    from .formats.files import TargetError
    from .prompts import PromptFileError
    from .scheduler import RequestError
    return (UserError, ConfigError, CheckpointError, PromptFileError, FolderError, FormatError, TargetError,
            RequestError, OSError, SafetensorError, json.JSONDecodeError, UnicodeDecodeError)


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, OSError) and not isinstance(e, FileNotFoundError) and e.filename and str(e.filename) not in text:
        text = f"{e.filename}: {text}"
    return text if len(text) < 600 else text[:597] + "..."


def debug_enabled(args=None) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get("EAGLE3_DEBUG", "") not in ("", "0")


def report(prog: str, e: BaseException) -> int:
    """Print a user error as one line (rank 0 only when distributed); return exit code 2."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        if getattr(args, "target", None) == "testbed":      # every subcommand accepts the embedded target's name
            from .testbed import resolve_target
            args.target, args.embedded_target = resolve_target("testbed"), True
        elif getattr(args, "target", None):
            check_target_arg(args.target)
        return int(args.func(args) or 0)
    except user_errors() as e:
        if debug_enabled(args):
            raise
        return report(f"eagle3 {args.command}", e)
    except KeyboardInterrupt:
        print(f"eagle3 {args.command}: interrupted", file=sys.stderr)
        return 130


def check_target_arg(target: str) -> None:
    """A --target that looks like a path must exist (else the hub client talks about repo ids)."""
    looks_like_path = target.startswith((".", "/", "~")) or os.sep in target and target.count("/") != 1
    if looks_like_path and not os.path.exists(os.path.expanduser(target)):
        raise UserError(f"--target {target}: no such folder")
    if os.path.isfile(target):
        raise UserError(f"--target {target}: is a file; give the target's folder (config.json, weights, tokenizer)")
    known = ("config.json", "tokenizer_config.json", "tokenizer.json")
    if os.path.isdir(target) and not any(os.path.isfile(os.path.join(target, f)) for f in known):
        raise UserError(f"--target {target}: no config.json or tokenizer in that folder (not a Hugging Face model "
                        "folder)")


if __name__ == "__main__":
    sys.exit(main())
