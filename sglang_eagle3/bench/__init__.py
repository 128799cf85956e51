"""Benchmarks: acceptance length and speed-up per eval set, tree-shape tuning per batch size, decode cost."""
from __future__ import annotations


def run_cli(prog: str, body, argv=None, extra_errors: tuple = ()) -> int:
    """Run a bench entry point; input errors become one line on stderr and exit code 2 (EAGLE3_DEBUG=1 or
    --debug among the arguments: the traceback)."""
    import sys

    from sglang_eagle3.errors import debug_enabled, report, user_errors
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    if debug:
        argv.remove("--debug")
    try:
        return int(body(argv) or 0)
    except (*user_errors(), *extra_errors) as e:
        if debug or debug_enabled():
            raise
        return report(prog, e)
