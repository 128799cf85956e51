"""What a finished speculative step tells its observer: its seconds per phase and what it verified.

The worker marks its phases' boundaries on a `StepClock` and, once a step is done, hands one `StepRecord` to the
tree planner (TreePlanner.observe: it learns the verify's costs and the draft's rate from it); the step's result
carries its StepTimes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional


@dataclass
class StepTimes:
    draft: float = 0.0      # proposing, sizing the tree, the draft's extend: all of a step but its verify
    verify: float = 0.0     # target forward + acceptance + KV commit
    prefill: float = 0.0

    def add(self, other: "StepTimes") -> None:
        self.draft, self.verify, self.prefill = (self.draft + other.draft, self.verify + other.verify,
                                                 self.prefill + other.prefill)


class StepClock:
    """perf_counter marks at a step's phase boundaries: its start, the verify's start, the target forward's end and
    the verify's end (`mark`), and the step's end (`times`)."""

    def __init__(self):
        self.marks = {"start": time.perf_counter()}

    def mark(self, name: str) -> None:
        self.marks[name] = time.perf_counter()

    def seconds(self, first: str, last: str) -> float:
        return self.marks[last] - self.marks[first]

    def times(self) -> StepTimes:
        """The step's StepTimes, its end marked now."""
        self.mark("end")
        return StepTimes(draft=self.seconds("start", "verify") + self.seconds("verified", "end"),
                         verify=self.seconds("verify", "verified"))


@dataclass
class StepRecord:
    batch: int                  # rows the step decoded
    nodes: float                # tokens per row its verify ran, a mean over rows (the trees' sizes, roots included)
    drafted: bool               # the draft model ran
    context: int                # the longest row's tokens (what the verify's attention read)
    tokens: int                 # tokens emitted, all rows together
    times: StepTimes
    forward_s: Optional[float]  # the target forward's seconds (None where they are not its cost: asynchronous devices)
    owed_s: float = 0.0         # of its draft seconds, the extend work earlier steps held back (their pairs, prompts)

