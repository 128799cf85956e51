"""`eagle3` command line: each subcommand lives in its own module (`add_cli(subparsers)`).

Errors a user can cause (the project's own, missing or unreadable files, invalid configs, wrong kinds of files)
print as one line naming the file or flag, exit code 2. `--debug` (or EAGLE3_DEBUG=1) shows the traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from sglang_eagle3.errors import debug_enabled, report, user_errors

# Modules that register subcommands; each defines add_cli(subparsers).
SUBCOMMAND_MODULES = [
    "sglang_eagle3.models.testbed",
    "sglang_eagle3.models.cli",
    "sglang_eagle3.formats.check_draft",
    "sglang_eagle3.formats.cli",
    "sglang_eagle3.engine.cli",
    "sglang_eagle3.training.data_cli",
    "sglang_eagle3.training.synthesize",
    "sglang_eagle3.training.regenerate",
    "sglang_eagle3.training.calibrate",
    "sglang_eagle3.training.trainer.cli",
    "sglang_eagle3.serving.launcher",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3", description="Train, serve and benchmark EAGLE-3 drafts.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks (also EAGLE3_DEBUG=1)")
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
    try:
        if getattr(args, "target", None) == "testbed":      # every subcommand accepts the embedded target's name
            from sglang_eagle3.models.testbed import resolve_target
            args.target, args.embedded_target = resolve_target("testbed"), True
        elif getattr(args, "target", None):
            from sglang_eagle3.models.testbed import check_target_arg
            check_target_arg(args.target)
        return int(args.func(args) or 0)
    except user_errors() as e:
        if debug_enabled(args):
            raise
        return report(f"eagle3 {args.command}", e)
    except KeyboardInterrupt:
        print(f"eagle3 {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
