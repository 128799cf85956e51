"""Shared output helpers for the bench scripts: tables, atomic files, PNG figures, run metadata.

    rows = [["mt_bench", "1.92x", "3.10"], ...]
    print(format_table(["set", "speed-up", "tau"], rows))             # Markdown (GitHub) table
    print(format_table(headers, rows, style="plain"))                  # aligned plain text
    write_json_atomic("results.json", obj)                             # tmp file + rename: no torn files
    fig, axes = subplots(1, 2); ...; save_figure(fig, "hist.png")      # matplotlib with the Agg backend
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import time
from typing import Any, Iterable, Optional, Sequence

from sglang_eagle3.fileio import atomic_write, write_text_atomic
from sglang_eagle3.paths import REPO_ROOT

# ---- numbers ---------------------------------------------------------------------------------


def fmt_num(x: Any, digits: int = 2) -> str:
    """Floats with fixed digits, None/NaN as '-', everything else str()."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def fmt_speedup(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def median(xs: Iterable[float]) -> float | None:
    xs = list(xs)
    return statistics.median(xs) if xs else None


def safe_div(a: float, b: float) -> float | None:
    return a / b if b else None


# ---- tables ----------------------------------------------------------------------------------


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], style: str = "markdown",
                 align: Sequence[str] | None = None) -> str:
    """A table as text. style: 'markdown' (GitHub pipes) or 'plain' (space-aligned columns).
    align: per column 'l' or 'r' (default: first column left, the rest right)."""
    if style not in ("markdown", "plain"):
        raise ValueError(f"table style must be 'markdown' or 'plain', got {style!r}")
    cells = [[str(h) for h in headers]] + [[fmt_num(c) for c in r] for r in rows]
    for i, r in enumerate(cells):
        if len(r) != len(headers):
            raise ValueError(f"table row {i} has {len(r)} cells, expected {len(headers)}")
    align = list(align) if align else ["l"] + ["r"] * (len(headers) - 1)
    widths = [max(len(r[j]) for r in cells) for j in range(len(headers))]

    def pad(s, j):
        return s.ljust(widths[j]) if align[j] == "l" else s.rjust(widths[j])

    if style == "plain":
        lines = ["  ".join(pad(c, j) for j, c in enumerate(r)).rstrip() for r in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)
    rule = ["-" * max(3, w) for w in widths]
    rule = [(r[:-1] + ":") if a == "r" else r for r, a in zip(rule, align)]
    widths = [max(w, 3) for w in widths]
    lines = ["| " + " | ".join(pad(c, j) for j, c in enumerate(r)) + " |" for r in cells]
    lines.insert(1, "| " + " | ".join(rule) + " |")
    return "\n".join(lines)


def parse_markdown_table(text: str) -> list[list[str]]:
    """Rows of the first Markdown table in text (header included, rule line dropped)."""
    rows = []
    for line in text.splitlines():
        s = line.strip()
        if not s.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in s.strip("|").split("|")]
        if all(set(c) <= set("-:") and c for c in cells):
            continue
        rows.append(cells)
    return rows


# ---- files -----------------------------------------------------------------------------------


def write_json_atomic(path: str, obj: Any) -> str:
    text = json.dumps(obj, indent=2, sort_keys=False, allow_nan=False, default=_json_default) + "\n"
    return write_text_atomic(path, text)


def _json_default(o):
    if hasattr(o, "item"):                   # numpy / torch scalars
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def read_json(path: str) -> Any:
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None


def write_outputs(out: str, result: Any, text: str, plot=None, png_suffix: str = ".png") -> None:
    """A benchmark's files: result as JSON at `out`, text as Markdown beside it (.md), plot(result, path) as a PNG
    beside it when given; prints the text and where each file went."""
    write_json_atomic(out, result)
    print(text)
    paths = [write_text_atomic(sibling(out, ".md"), text.rstrip("\n") + "\n")]
    if plot is not None:
        paths.append(plot(result, sibling(out, png_suffix)))
    print(f"wrote {os.path.abspath(out)}" + "".join(f"\n      {p}" for p in paths))


def sibling(path: str, suffix: str) -> str:
    """results.json + '.md' -> results.md; + '_hist.png' -> results_hist.png."""
    root, ext = os.path.splitext(path)
    return (root if ext.lower() == ".json" else path) + suffix


# ---- figures ---------------------------------------------------------------------------------


def subplots(nrows: int = 1, ncols: int = 1, **kw):
    """matplotlib figure on the Agg backend (no display needed); axes always a flat list."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    kw.setdefault("figsize", (4.2 * ncols, 3.2 * nrows))
    kw.setdefault("squeeze", False)
    fig, axes = plt.subplots(nrows, ncols, **kw)
    return fig, list(axes.flat)


def save_figure(fig, path: str, dpi: int = 110) -> str:
    import matplotlib.pyplot as plt
    fig.tight_layout()
    out = atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=dpi))
    plt.close(fig)
    return out


# ---- metadata --------------------------------------------------------------------------------


def cpu_model() -> Optional[str]:
    """The CPU's model name (/proc/cpuinfo), or None."""
    from sglang_eagle3.kernels.extension import cpu_model as model_name
    return model_name() or None


def run_metadata() -> dict:
    """Where and when numbers were measured (timings mean little without it)."""
    import torch
    meta = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(),
            "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    try:
        repo = REPO_ROOT
        meta["git_commit"] = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True,
                                            text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        meta["git_commit"] = None
    meta["cpu"] = cpu_model()
    try:
        meta["load_average"] = list(os.getloadavg())
    except OSError:
        pass
    return meta
