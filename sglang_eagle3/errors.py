"""The errors a user can cause, and how every entry point reports them: one line, exit code 2.

Each layer raises its own subclass of `UserError` (a bad config, a broken checkpoint, a request that cannot fit),
so the command line and the benchmarks catch them all without importing the layers that raise them.
`--debug` (or EAGLE3_DEBUG=1) shows the traceback instead.
"""
from __future__ import annotations

import json
import os
import sys


class UserError(Exception):
    """An error caused by the user's input; printed as one line, exit code 2."""


def check_at_least(minimum, values: dict, error: type = UserError) -> None:
    """values: {flag: value, or None when not given}; the first value below `minimum` is a one-line error naming its
    flag (the check every command makes of its counts and sizes)."""
    for flag, value in values.items():
        if value is not None and value < minimum:
            raise error(f"{flag} must be >= {minimum}, got {value}")


def flags_of(args, *names: str) -> dict:
    """{--flag-name: value} of argparse destinations, for check_at_least."""
    return {"--" + name.replace("_", "-"): getattr(args, name) for name in names}


def user_errors() -> tuple:
    """The exception types that mean "bad input", not "bug": reported in one line."""
    from safetensors import SafetensorError
    return (UserError, OSError, SafetensorError, json.JSONDecodeError, UnicodeDecodeError)


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
