"""What `eagle3 check-draft` reports: findings of three severities, collected in order, printed as a table.

ERROR = SGLang/vLLM would fail to load the draft or would silently run wrong numbers (low acceptance at best);
WARN = it runs, but something deserves a look.
"""
from __future__ import annotations

from dataclasses import dataclass

OK, WARN, ERROR = "OK", "WARN", "ERROR"


@dataclass
class Finding:
    check: str
    status: str     # OK | WARN | ERROR
    detail: str


class Report:
    """The findings of one check, in the order they were made."""

    def __init__(self):
        self.findings: list[Finding] = []

    def add(self, status: str, check: str, detail: str) -> None:
        self.findings.append(Finding(check, status, detail))


def positive_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def has_errors(findings: list[Finding]) -> bool:
    return any(f.status == ERROR for f in findings)


def format_table(findings: list[Finding]) -> str:
    w = max([len(f.check) for f in findings] + [5])
    lines = [f"{'check':<{w}}  {'status':<6}  detail", f"{'-' * w}  ------  {'-' * 40}"]
    lines += [f"{f.check:<{w}}  {f.status:<6}  {f.detail}" for f in findings]
    return "\n".join(lines)
