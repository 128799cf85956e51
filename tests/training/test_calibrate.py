"""`eagle3 calibrate`: the acceptance grid, the chains it reads, its refusals."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import random_draft, tiny_target

from sglang_eagle3.training.calibrate import SCALES, AcceptanceGrid, add_row, heldout_prompts


def test_the_grid_finds_the_scale_that_undoes_a_compressed_draft():
    """A draft whose logits are the target's halved, over 60 of 80 tokens: the fitted scale is the grid's nearest to
    2 at both temperatures and every depth; there it accepts the target's mass inside the vocabulary (its coverage)
    minus what q puts where p has less, and more than at scale 1."""
    g = torch.Generator().manual_seed(0)
    S, V = 200, 80
    ids = torch.randperm(V, generator=g)[:60]
    zt = torch.randn(S, V, generator=g) * 3
    grid = AcceptanceGrid(SCALES, (0.7, 1.0), 2)
    for d in range(2):
        grid.add(d, zt[:, ids] / 2, zt, ids)
    nearest = min(SCALES, key=lambda s: abs(s - 2.0))
    assert grid.best_scales() == [nearest, nearest]
    rep = grid.report()
    for row in rep["rows"]:
        p = torch.softmax(zt / row["temperature"], -1)[:, ids]
        assert row["positions"] == S and abs(row["vocab_coverage"] - float(p.sum(-1).mean())) < 1e-4
        assert row["accept_fitted"] > row["accept_raw"] and row["accept_fitted"] <= row["vocab_coverage"] + 1e-6


def test_a_depth_no_chain_reached_takes_the_scale_before_it():
    g = torch.Generator().manual_seed(1)
    zt = torch.randn(10, 30, generator=g)
    grid = AcceptanceGrid(SCALES, (1.0,), 3)
    grid.add(0, zt * 1.5, zt, torch.arange(30))
    best = grid.best_scales()
    assert best[1] == best[2] == best[0] and abs(best[0] - 1 / 1.5) < 0.05


class Recorder:
    depths = 3

    def __init__(self):
        self.calls = []

    def add(self, depth, draft_logits, target_logits, draft_ids):
        self.calls.append((depth, draft_logits, target_logits, draft_ids))


def test_a_rows_chains_pair_each_depths_draft_logits_with_the_targets_at_every_answer_position():
    """add_row on a tiny target: every depth sees the answer's positions (the first answer token onward), paired with
    the target's own logits there (the HF model's), and the draft's logits over its vocabulary."""
    tm, hf = tiny_target("llama", vocab_size=40)
    draft = random_draft(tm, draft_vocab_size=24)
    draft.set_embedding(tm.embed_tokens)
    ids = torch.randint(0, 40, (20,), generator=torch.Generator().manual_seed(2))
    rec = Recorder()
    add_row(rec, tm, draft, ids, answer_from=8)
    with torch.no_grad():
        want = hf(ids[None]).logits[0, 8:]                                      # [12, V]
    assert [c[0] for c in rec.calls] == [0, 1, 2]
    for depth, dl, tl, draft_ids in rec.calls:
        assert dl.shape == (12, 24) and torch.equal(draft_ids, draft.draft_to_target(torch.arange(24)))
        torch.testing.assert_close(tl.float(), want, atol=1e-4, rtol=1e-4)


def test_heldout_prompts_read_each_set_from_first_on(tmp_path):
    from sglang_eagle3.errors import UserError
    from sglang_eagle3.training.calibrate import SETS
    for name in SETS:
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for i in range(5):
                f.write(json.dumps({"question_id": i, "turns": [f"{name} {i}", "again"]}) + "\n")
    prompts = heldout_prompts(str(tmp_path), 3, 4)
    assert len(prompts) == 2 * len(SETS) and prompts[0] == [{"role": "user", "content": f"{SETS[0]} 3"}]
    with pytest.raises(UserError, match="no prompts from index --first 5 on"):
        heldout_prompts(str(tmp_path), 5, 2)


@pytest.mark.parametrize("argv,phrase", [
    (["--temperatures", "0"], "--temperatures [0.0]: each must be a number > 0"),
    (["--per-set", "0"], "--per-set must be >= 1"),
])
def test_calibrate_refuses_bad_flags_in_one_line(argv, phrase, capsys):
    from sglang_eagle3.cli import main
    assert main(["calibrate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert phrase in err and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_calibrate_never_replaces_a_calibration_unless_told(tmp_path, capsys):
    from sglang_eagle3.cli import main
    out = tmp_path / "cal.json"
    out.write_text("{}")
    assert main(["calibrate", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{out} exists: pass --overwrite" in err and out.read_text() == "{}"
