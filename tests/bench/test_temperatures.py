"""bench_acceptance --temperature 0,0.7,1: each temperature a run of its own, then side by side."""
from __future__ import annotations

import json

import pytest

from sglang_eagle3.bench import temperatures as temps


def test_temperature_lists_parse_and_bad_ones_are_named():
    from sglang_eagle3.errors import UserError
    assert temps.parse_temperatures("0, 0.7,1") == [0.0, 0.7, 1.0] and temps.parse_temperatures(0.5) == [0.5]
    for text, phrase in (("0,x", "'x' is not a number"), ("0,-1", "-1 must be a finite number >= 0"),
                         ("1,1", "name each temperature once"), ("nan", "must be a finite number")):
        with pytest.raises(UserError, match=phrase):
            temps.parse_temperatures(text)


def test_each_temperature_reruns_the_same_flags_into_its_own_file():
    argv = ["--n", "3", "--temperature", "0,1", "--out=r/a.json", "--drafters", "eagle"]
    assert temps.with_flag(temps.with_flag(argv, "--temperature", "1"), "--out", temps.per_temperature_out(
        "r/a.json", 1.0)) == ["--n", "3", "--drafters", "eagle", "--temperature", "1", "--out", "r/a_T1.json"]
    assert temps.per_temperature_out("r/a", 0.7) == "r/a_T0.7.json"


def drafters_result(t, speedup):
    cell = {"speedup_median": speedup, "tau": 1.5}
    return {"config": {"temperature": t, "seed": 0, "max_new_tokens": 8, "dtype": "bfloat16"},
            "meta": {"cpu": "test cpu"}, "columns": ["eagle"], "sets": {"gsm8k": {"eagle": cell}},
            "average": {"eagle": cell}}


def test_run_each_writes_every_temperature_then_the_side_by_side_table(tmp_path):
    """A fake benchmark run: run_each calls it once per temperature with that temperature and its own --out, then
    writes OUT (JSON, Markdown, PNG) with each temperature's speed-up and τ per set."""
    calls = []

    def fake_run(argv):
        t, out = float(argv[argv.index("--temperature") + 1]), argv[argv.index("--out") + 1]
        calls.append((t, out))
        with open(out, "w") as f:
            json.dump(drafters_result(t, 2.0 - t), f)
        return 0

    out = str(tmp_path / "acc.json")
    assert temps.run_each(fake_run, ["--temperature", "0,1", "--out", out], [0.0, 1.0], out) == 0
    assert calls == [(0.0, str(tmp_path / "acc_T0.json")), (1.0, str(tmp_path / "acc_T1.json"))]
    combined = json.load(open(out))
    assert combined["format"] == temps.FORMAT
    assert combined["temperatures"]["1"]["columns"]["eagle"]["gsm8k"] == [1.0, 1.5]
    md = open(tmp_path / "acc.md").read()
    assert "eagle T=0" in md and "| gsm8k   | 2.00x (τ 1.50) | 1.00x (τ 1.50) |" in md
    assert (tmp_path / "acc.png").stat().st_size > 1000


def test_bench_acceptance_refuses_a_bad_temperature_list_in_one_line(capsys, tmp_path):
    from sglang_eagle3.bench.acceptance import main
    for argv, phrase in ((["--temperature", "0,x"], "--temperature 0,x: 'x' is not a number"),
                         (["--temperature", "0,1", "--drafters", "eagle", "--choose-into", "p.json"],
                          "--choose-into p.json records one temperature's best column")):
        assert main([*argv, "--out", str(tmp_path / "a.json")]) == 2
        err = capsys.readouterr().err.strip()
        assert phrase in err and "Traceback" not in err and len(err.splitlines()) == 1, err
