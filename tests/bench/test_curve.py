"""bench/learning_curve.py's trend line."""
from __future__ import annotations

import math

import pytest


def test_learning_curve_trend_extrapolates_the_later_half():
    from sglang_eagle3.bench.curve import trend, trend_text
    toks = [1e6 * 2 ** (i / 2) for i in range(9)]                 # 1M .. 16M tokens
    pts = [{"tokens_total": t, "tau": {"a": 1.0 + 0.5 * math.log2(t / 1e6), "b": 2.0 - 0.01 * i}}
           for i, t in enumerate(toks)]
    pts[0]["tau"]["a"] = 9.0                                        # before the later half: not fitted
    t = trend(pts, "a", 3.0)
    assert t["points_fitted"] == 3 and t["from_tokens"] == toks[6]
    assert t["gain_per_doubling"] == pytest.approx(0.5) and t["tokens_for_goal"] == pytest.approx(16e6)
    flat = trend(pts, "b", 3.0)
    assert flat["tokens_for_goal"] is None and "does not rise" in trend_text({"b": flat}, 3.0)
    few = trend(pts[:2], "a", 3.0)
    assert few["points_fitted"] == 2 and "gain_per_doubling" not in few and "too few" in trend_text({"a": few}, 3.0)
