"""Benchmarks: acceptance length and speed-up per eval set, tree-shape tuning per batch size."""
from __future__ import annotations

import sys


def run_cli(prog: str, body, argv=None, extra_errors: tuple = ()) -> int:
    """Run a bench entry point; input errors become one line on stderr and exit code 2."""
    from ..cli import UserError
    from ..config import ConfigError
    from ..draft import CheckpointError
    from ..prompts import PromptFileError
    try:
        return int(body(argv) or 0)
    except (UserError, ConfigError, CheckpointError, PromptFileError, FileNotFoundError, *extra_errors) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
