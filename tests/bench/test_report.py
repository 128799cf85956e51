"""The report helpers: Markdown and plain tables, atomic JSON files."""
from __future__ import annotations

import json
import os

import pytest
import torch

from sglang_eagle3.bench import report


def test_tables_and_atomic_files(tmp_path):
    headers, rows = ["set", "speed-up", "tau"], [["a", "1.50x", 2.345], ["bb", None, 1.0]]
    md = report.format_table(headers, rows)
    assert report.parse_markdown_table(md) == [headers, ["a", "1.50x", "2.35"], ["bb", "-", "1.00"]]
    assert md.splitlines()[1].startswith("| --") and md.splitlines()[1].endswith(": |")
    plain = report.format_table(headers, rows, style="plain").splitlines()
    assert plain[0].split() == headers and plain[2].split() == ["a", "1.50x", "2.35"]
    with pytest.raises(ValueError, match="row 1"):
        report.format_table(headers, [["only", "two"]])
    path = tmp_path / "sub" / "r.json"
    report.write_json_atomic(str(path), {"x": torch.tensor(3).item(), "y": [1.5]})
    assert json.loads(path.read_text()) == {"x": 3, "y": [1.5]} and os.listdir(path.parent) == ["r.json"]
    umask = os.umask(0o022)
    try:
        report.write_json_atomic(str(path), {"x": 3, "y": [1.5]})
    finally:
        os.umask(umask)
    assert (path.stat().st_mode & 0o777) == 0o644                  # the usual permissions, not mkstemp's 0600
    with pytest.raises(ValueError):
        report.write_json_atomic(str(path), {"bad": float("nan")})
    assert json.loads(path.read_text()) == {"x": 3, "y": [1.5]}            # a failed write leaves the old file
    assert os.listdir(path.parent) == ["r.json"]
    assert report.sibling("a/b.json", ".md") == "a/b.md" and report.sibling("a/b", "_h.png") == "a/b_h.png"
