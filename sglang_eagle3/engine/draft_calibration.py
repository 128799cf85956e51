"""A draft's calibration: how much sharper (or flatter) its distribution q is drawn at each tree depth.

A sampled child is accepted with chance min(1, p(x) / q(x)), so a node accepts one of its draws with chance
sum_x min(p(x), q(x)): the closer q is to the target's p, the more is accepted. A draft trained by soft cross-entropy
over a reduced vocabulary comes out flatter than the target (its logits are compressed), so at temperature T its
children are drawn from q = softmax(scale[d] * logits / T), with scale[d] fitted per depth d on held-out text
(`eagle3 calibrate`, training/calibrate.py) and stored beside the draft as draft_calibration.json. Exactness does not
depend on it: the verify reads the very q the children were drawn from. Greedy decoding never reads it.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Optional

from sglang_eagle3.models.config import ConfigError

FILE = "draft_calibration.json"
FORMAT = "sglang_eagle3.draft_calibration/1"
SCALE_RANGE = (0.05, 20.0)          # a scale outside it is a broken fit, not a calibration


@dataclass(frozen=True)
class DraftCalibration:
    logit_scale: tuple[float, ...]   # [depths] q at a depth-d node: softmax(logit_scale[d] * logits / T); deeper
                                     # nodes than the list covers take its last entry

    def __post_init__(self):
        if not self.logit_scale:
            raise ConfigError("logit_scale must list at least one depth's scale")
        lo, hi = SCALE_RANGE
        for d, s in enumerate(self.logit_scale):
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or not lo <= s <= hi:
                raise ConfigError(f"logit_scale[{d}] must be a number in [{lo}, {hi}], got {s!r}")

    def at(self, depth: int) -> float:
        return float(self.logit_scale[min(depth, len(self.logit_scale) - 1)])

    @classmethod
    def read(cls, path: str) -> DraftCalibration:
        """The calibration in a draft_calibration.json; a bad file is one ConfigError naming it and the field."""
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: not a readable JSON file ({type(e).__name__}: {e})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ConfigError(f"{path}: expected an object with format {FORMAT!r}")
        scales = data.get("logit_scale")
        if not isinstance(scales, list):
            raise ConfigError(f"{path}: logit_scale must be a list of numbers, one per tree depth")
        try:
            return cls(tuple(scales))
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def as_json(self, **about) -> dict:
        """The file's content: the scales and what fitted them (`about`)."""
        return {"format": FORMAT, "logit_scale": [round(s, 4) for s in self.logit_scale], **about}


def calibration_path(draft: Optional[str]) -> Optional[str]:
    """A draft folder's draft_calibration.json, where it has one."""
    if not draft or not os.path.isdir(draft):
        return None
    path = os.path.join(draft, FILE)
    return path if os.path.isfile(path) else None
