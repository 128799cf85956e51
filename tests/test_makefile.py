"""`make ablation` composes what its table claims: four trainings that differ only in their variant flag,
each parsed by the trainer's own CLI, then bench_acceptance on the same sets and tree for each draft."""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess

import pytest

from sglang_eagle3.training.trainer.cli import add_train_args, train_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def dry_run(*args: str, stamp: str) -> list[str]:
    # STAMP: an existing file, so that make does not plan a venv rebuild around the commands
    out = subprocess.run(["make", "-n", "--no-print-directory", *args, f"STAMP={stamp}"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [line.strip() for line in out.splitlines()]


def parse_train(line: str):
    argv = shlex.split(line)
    argv = argv[argv.index("train") + 1:]
    p = argparse.ArgumentParser()
    add_train_args(p)
    return train_config(p.parse_args(argv))


def ablation_trainings(tmp_path, *args: str) -> tuple[list, list[str]]:
    """The trainer configs of `make ablation` (its sub-makes run under -n too: their lines are marked `+`)."""
    stamp = tmp_path / "stamp"
    stamp.write_text("")
    lines = dry_run("ablation", *args, stamp=str(stamp))
    return [parse_train(line) for line in lines if "eagle3 train" in line], lines


def test_ablation_trains_four_variants_at_one_budget_and_benches_each(tmp_path):
    run = tmp_path / "run"
    trains, lines = ablation_trainings(tmp_path, f"RUN={run}", "ABL_STEPS=7")
    assert [os.path.basename(c.out) for c in trains] == ["eagle3", "eagle31", "top", "featloss"]
    assert {(c.max_steps, c.lr, c.data, c.seed, c.init_from) for c in trains} == {(7, 1e-3, f"{run}/dump_cut", 0, None)}
    variant = {os.path.basename(c.out): (c.fc_norm, c.norm_output, c.features, c.feature_loss_weight) for c in trains}
    assert variant == {"eagle3": (False, False, "fused", 0.0), "eagle31": (True, True, "fused", 0.0),
                       "top": (False, False, "top", 0.0), "featloss": (False, False, "fused", 1.0)}
    benches = [shlex.split(line) for line in lines if "bench_acceptance.py" in line]
    assert len(benches) == 4
    trees = set()
    for cmd, name in zip(benches, variant):
        assert cmd[cmd.index("--draft") + 1] == f"{run}/ablation/{name}/draft"
        assert cmd[cmd.index("--datasets") + 1] == "mt_bench,gsm8k" and cmd[cmd.index("--n") + 1] == "10"
        trees.add(tuple(cmd[cmd.index(f) + 1] for f in ("--num-steps", "--topk", "--num-draft-tokens")))
    assert len(trees) == 1                                      # one tree for every draft
    assert any("ablation_table.py" in line for line in lines)


def test_ablation_warm_start_is_not_inherited(tmp_path):
    """INIT= on the command line (a continued run) must not leak into the ablation's from-scratch trainings."""
    trains, _ = ablation_trainings(tmp_path, "INIT=checkpoints/smollm2-135m-eagle3", "ABL_STEPS=3")
    assert len(trains) == 4 and all(c.init_from is None for c in trains)
