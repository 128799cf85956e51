"""`eagle3` command line: each subcommand lives in its own module (`add_cli(subparsers)`)."""
from __future__ import annotations

import argparse
import importlib
import sys

# Modules that register subcommands; each defines add_cli(subparsers).
SUBCOMMAND_MODULES = [
    "sglang_eagle3.testbed",
    "sglang_eagle3.check_draft",
    "sglang_eagle3.formats.cli",
    "sglang_eagle3.generate_cli",
    "sglang_eagle3.data.cli",
    "sglang_eagle3.regenerate",
    "sglang_eagle3.trainer.cli",
    "sglang_eagle3.launcher",
]


class UserError(Exception):
    """An error caused by the user's input; printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3", description="Train, serve and benchmark EAGLE-3 drafts.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_cli(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from .config import ConfigError
    from .draft import CheckpointError
    from .prompts import PromptFileError
    try:
        if getattr(args, "target", None) == "testbed":      # every subcommand accepts the embedded target's name
            from .testbed import resolve_target
            args.target = resolve_target("testbed")
        return int(args.func(args) or 0)
    except (UserError, ConfigError, CheckpointError, PromptFileError, FileNotFoundError) as e:
        print(f"eagle3 {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
