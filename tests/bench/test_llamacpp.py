"""bench/bench_llamacpp.py's table and plot."""
from __future__ import annotations

import os


def test_llamacpp_table_shows_each_rows_own_vanilla(tmp_path):
    """bench_llamacpp's rows carry the vanilla measured beside them; the table and the plot show it."""
    from sglang_eagle3.bench.llamacpp import plot, render
    row = {"draft_length": 1, "llamacpp_drafted": 10, "llamacpp_accepted": 4, "llamacpp_accept_rate": 0.4,
           "llamacpp_tau": 1.4, "llamacpp_tokens_per_s": 90.0, "llamacpp_vanilla_tokens_per_s": 100.0,
           "llamacpp_speedup": 0.9, "ours_tau": 1.38, "ours_tokens_per_s": 110.0, "ours_vanilla_tokens_per_s": 100.0,
           "ours_speedup": 1.1, "ours_accept_rate": 0.38}
    r = {"threads": 2, "prompts": 3, "max_new_tokens": 8, "draft": "D", "rows": [row, {**row, "draft_length": 2}]}
    text = render(r)
    assert "measured beside it" in text and " 100.0 |" in text and "0.90x" in text and "1.10x" in text
    assert os.path.exists(plot(r, str(tmp_path / "x.png")))
