"""bench/bench_acceptance.py end to end on a tiny random target: tau per set and per turn, a baseline
draft side by side, resuming, sampling, and its one-line refusals of bad inputs."""
from __future__ import annotations

import json

import bench_env
import pytest
import torch
from bench_env import PNG_MAGIC, acceptance

from sglang_eagle3.bench import report
from sglang_eagle3.bench.acceptance import main as acceptance_main
from sglang_eagle3.bench.tune import main as tune_main
from sglang_eagle3.cli import main as eagle3_main

env, keep_threads = bench_env.env, bench_env.keep_threads             # the shared fixtures; keep_threads is autouse


def test_acceptance_end_to_end(env, tmp_path, capsys):
    out = tmp_path / "acc.json"
    assert acceptance(env, out, "--datasets", "mt_bench,gsm8k") == 0
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["format"] == "sglang_eagle3.bench_acceptance/1" and list(res["sets"]) == ["mt_bench", "gsm8k"]
    assert res["config"]["spec"] == {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}
    for name, s in res["sets"].items():
        turns = 2 if name == "mt_bench" else 1
        assert s["n_prompts"] == 2 and s["tokens_vanilla"] == s["tokens_spec"] == 2 * turns * 6
        assert s["identical_to_vanilla"] == 2                        # greedy speculative == vanilla (fp32)
        assert all(p["identical"] and p["turns"] == turns for p in s["per_prompt"])
        assert [p["spec_first"] for p in s["per_prompt"]] == [False, True]   # alternated order
        assert sum(s["accept_histogram"].values()) == s["decode_steps"] > 0
        assert sum(int(k) * v for k, v in s["accept_histogram"].items()) == s["tau"] * s["decode_steps"]
        assert 1.0 <= s["tau"] <= 4.0                                # at most num_steps + 1 per step
        for key in ("speedup_median", "speedup_total", "tokens_per_s_vanilla", "tokens_per_s_spec"):
            assert s[key] > 0
        assert s["speedup_total"] == pytest.approx(s["tokens_per_s_spec"] / s["tokens_per_s_vanilla"])
        assert 0 <= s["draft_vocab_coverage"] <= 1
        assert s["draft_vocab_coverage"] == sum(p["in_draft_vocab"] for p in s["per_prompt"]) / s["tokens_vanilla"]
        assert all(len(p["tau_by_turn"]) == turns for p in s["per_prompt"])
    assert list(res["sets"]["mt_bench"]["tau_by_turn"]) == ["1", "2"] and "tau_by_turn" not in res["sets"]["gsm8k"]
    assert res["average"]["tau"] == pytest.approx((res["sets"]["mt_bench"]["tau"] + res["sets"]["gsm8k"]["tau"]) / 2)
    md = (tmp_path / "acc.md").read_text()
    assert "τ by turn: MT-bench turn 1 " in md and "GSM8K turn" not in md
    rows = report.parse_markdown_table(md)
    assert rows[0][:3] == ["Set", "Speed-up", "τ"] and [r[0] for r in rows[1:]] == ["MT-bench", "GSM8K", "Average"]
    assert rows[-1][2] == f"{res['average']['tau']:.2f}" and rows[1][1].endswith("x")
    assert report.parse_markdown_table(printed) == rows
    assert (tmp_path / "acc_hist.png").read_bytes()[:8] == PNG_MAGIC


def test_acceptance_runs_the_profiles_long_context_tree(env, tmp_path, monkeypatch):
    """With the draft's profile (no tree flags), bench_acceptance decodes as the server would: greedy steps of rows
    holding the long-context table's min_tokens or more run its tree; the result's config and caption say so. Here
    every row is that long (min_tokens 1), so every speculative step runs the long-context tree."""
    import shutil

    from sglang_eagle3.engine import scheduler as S
    from sglang_eagle3.engine.profile import host_kind
    from sglang_eagle3.engine.speculation import SpecConfig
    ran = []
    spec_for = S.Scheduler.spec_for
    monkeypatch.setattr(S.Scheduler, "spec_for", lambda self, *a: ran.append(spec_for(self, *a)) or ran[-1]
                        if self.draft is not None else None)
    draft = tmp_path / "draft"
    shutil.copytree(env["draft"], draft)
    long = {"min_tokens": 1, "per_batch_size": {"1": {"num_steps": 1, "topk": 1, "num_draft_tokens": 2}}}
    (draft / "spec_profile.json").write_text(json.dumps({"per_batch_size": {
        "1": {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}}, "by_host": {host_kind(): {
            "per_batch_size": {"1": {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}}, "long_context": long}}}))
    out = tmp_path / "acc.json"
    assert acceptance_main(["--target", env["target"], "--draft", str(draft), "--n", "2", "--max-new-tokens", "6",
                            "--ignore-eos", "--threads", "1", "--datasets", "gsm8k", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["config"]["spec"] == {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}
    assert res["config"]["long_context"] == {"min_tokens": 1, "num_steps": 1, "topk": 1, "num_draft_tokens": 2}
    assert ran and all(t == SpecConfig(1, 1, 2) for t in ran)
    assert "from 1 tokens on, the profile's long-context tree 1/1/2" in (tmp_path / "acc.md").read_text()


def test_acceptance_counts_the_target_tokens_the_draft_vocab_holds():
    from types import SimpleNamespace

    from sglang_eagle3.bench.acceptance import bench_prompt, summarize_set

    class Fake:
        def __init__(self, ids):
            self.ids = ids

        def generate(self, convs, params, batch_size):
            return [SimpleNamespace(text="x", token_ids=self.ids, accept_lengths=[1] * (len(self.ids) + 1))], None

    in_vocab = torch.zeros(10, dtype=torch.bool)
    in_vocab[[1, 2, 3]] = True
    row = bench_prompt(Fake([1, 5, 2, 9]), Fake([1, 5, 2, 9]), ["a", "b"], lambda k: None, 0, in_vocab)
    assert row["in_draft_vocab"] == 4 and row["tokens_vanilla"] == 8              # 2 of 4 per turn, two turns
    assert summarize_set([row], greedy=True)["draft_vocab_coverage"] == 0.5
    assert summarize_set([bench_prompt(Fake([1]), Fake([1]), ["a"], lambda k: None, 0)],
                         greedy=True)["draft_vocab_coverage"] is None


def test_acceptance_reports_tau_per_turn():
    """MT-bench asks two turns: τ of each turn pools that turn's steps over the prompts that have it."""
    from types import SimpleNamespace

    from sglang_eagle3.bench.acceptance import bench_prompt, summarize_set
    from sglang_eagle3.bench.acceptance_report import markdown_report

    class Turns:                 # turn k (counted by calls) accepts lengths[k] per step, after the prefill token
        def __init__(self, lengths):
            self.lengths, self.calls = lengths, 0

        def generate(self, convs, params, batch_size):
            steps = self.lengths[self.calls % len(self.lengths)]
            self.calls += 1
            ids = list(range(1 + sum(steps)))
            return [SimpleNamespace(text="x", token_ids=ids, accept_lengths=[1] + steps)], None

    vanilla = Turns([[1] * 4, [1] * 6])
    two = bench_prompt(vanilla, Turns([[3, 1], [1, 1, 2, 1]]), ["a", "b"], lambda k: None)
    one = bench_prompt(Turns([[1] * 5]), Turns([[2, 3]]), ["a"], lambda k: None)
    assert two["tau_by_turn"] == [2.0, 1.25] and one["tau_by_turn"] == [2.5]
    s = summarize_set([two, one], greedy=False, max_accept=3)
    assert s["tau_by_turn"] == {"1": (3 + 1 + 2 + 3) / 4, "2": 1.25}          # turn 1 pooled over both prompts
    assert s["tau"] == pytest.approx((4 + 5 + 5) / 8)
    assert "tau_by_turn" not in summarize_set([one], greedy=False)           # single-turn sets: no split
    result = {"config": {"temperature": 1, "target": "t", "draft": "d", "dtype": "float32", "max_new_tokens": 8,
                         "spec": {"num_steps": 2, "topk": 1, "num_draft_tokens": 3}},
              "sets": {"mt_bench": s}, "average": s}
    assert "τ by turn: MT-bench turn 1 2.25, turn 2 1.25." in markdown_report(result)


def test_acceptance_baseline_draft_side_by_side(env, tmp_path, capsys):
    """--baseline-draft B: B decoded on every prompt beside --draft, each draft's numbers equal to a run of it alone
    (greedy, fp32: deterministic), the three runs' order rotated, the comparison table in the .md."""
    other = tmp_path / "other"
    assert eagle3_main(["init-draft", "--target", env["target"], "--out", str(other), "--draft-vocab-size", "48",
                        "--dtype", "float32", "--seed", "7"]) == 0
    both, alone_a, alone_b = tmp_path / "both.json", tmp_path / "a.json", tmp_path / "b.json"
    sets = ("--datasets", "mt_bench,gsm8k,alpaca")
    assert acceptance(env, both, *sets, "--baseline-draft", str(other)) == 0
    assert acceptance(env, alone_a, *sets) == 0
    assert acceptance_main(["--target", env["target"], "--draft", str(other), "--n", "2", "--max-new-tokens", "6",
                            "--ignore-eos", "--num-steps", "3", "--topk", "2", "--num-draft-tokens", "6",
                            "--threads", "1", "--out", str(alone_b), *sets]) == 0
    res, a, b = (json.loads(f.read_text()) for f in (both, alone_a, alone_b))
    assert res["config"]["baseline_draft"] == str(other) and res["baseline"]["draft"] == str(other)
    for name, s in res["sets"].items():
        base = res["baseline"]["sets"][name]
        for mine, alone in ((s, a["sets"][name]), (base, b["sets"][name])):
            assert (mine["decode_steps"], mine["tau"], mine["accept_histogram"]) == \
                (alone["decode_steps"], alone["tau"], alone["accept_histogram"])
        assert base["identical_to_vanilla"] == 2 and "per_prompt" not in base
        orders = [p["order"] for p in s["per_prompt"]]
        assert orders == [["vanilla", "spec", "baseline"], ["spec", "baseline", "vanilla"]]
        ratios = [p["speedup"] / p["baseline"]["speedup"] for p in s["per_prompt"]]
        assert base["draft_over_baseline_median"] == pytest.approx(report.median(ratios))
    assert res["baseline"]["average"]["tau"] == pytest.approx(b["average"]["tau"])
    md = (tmp_path / "both.md").read_text()
    assert "Side by side with the baseline draft" in md and "| τ draft | τ baseline |" in md
    assert "Baseline greedy outputs identical to vanilla: mt_bench 2/2, gsm8k 2/2, alpaca 2/2." in md
    # resumed: the finished sets of both drafts are reused
    assert acceptance(env, both, *sets, "--baseline-draft", str(other)) == 0
    assert json.loads(both.read_text())["baseline"]["sets"] == res["baseline"]["sets"]
    # a baseline that reads other target layers is refused in one line
    cfg = json.loads((other / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]
    (other / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert acceptance(env, tmp_path / "x.json", "--datasets", "gsm8k", "--baseline-draft", str(other)) == 2
    err = capsys.readouterr().err
    assert "--baseline-draft" in err and "aux_layer_ids [0, 1, 2] differs" in err and err.count("\n") == 1
    assert acceptance(env, tmp_path / "x.json", "--datasets", "gsm8k", "--baseline-draft", str(tmp_path / "nope")) == 2
    err = capsys.readouterr().err
    assert "--baseline-draft" in err and "no config.json" in err and err.count("\n") == 1
    # a broken --draft is reported as --draft's problem, not the baseline's
    assert acceptance_main(["--target", env["target"], "--draft", str(tmp_path / "nope"), "--n", "1",
                            "--datasets", "gsm8k", "--baseline-draft", env["draft"], "--out", str(tmp_path / "y.json")]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "error: --draft" in last and "no such folder" in last and "--baseline-draft" not in err


def test_acceptance_resumes_finished_sets(env, tmp_path, capsys):
    out = tmp_path / "acc.json"
    assert acceptance(env, out, "--datasets", "gsm8k") == 0
    first = json.loads(out.read_text())["sets"]["gsm8k"]
    assert acceptance(env, out, "--datasets", "gsm8k,alpaca") == 0
    res = json.loads(out.read_text())
    assert res["sets"]["gsm8k"] == first and res["sets"]["alpaca"]["n_prompts"] == 2   # reused, not re-timed
    assert acceptance(env, out, "--datasets", "gsm8k", "--max-new-tokens", "4") == 0   # other settings: redo
    assert json.loads(out.read_text())["sets"]["gsm8k"]["tokens_spec"] == 2 * 4


def test_acceptance_sampling(env, tmp_path, capsys):
    out = tmp_path / "t1.json"
    assert acceptance(env, out, "--datasets", "mt_bench", "--temperature", "1", "--seed", "3") == 0
    res = json.loads(out.read_text())
    s = res["sets"]["mt_bench"]
    assert res["config"]["seed"] == 3 and "identical_to_vanilla" not in s and s["tau"] >= 1
    assert "Greedy outputs identical" not in (tmp_path / "t1.md").read_text()
    nucleus = tmp_path / "t1p.json"
    assert acceptance(env, nucleus, "--datasets", "mt_bench", "--temperature", "1", "--top-p", "0.9") == 0
    assert json.loads(nucleus.read_text())["config"]["top_p"] == 0.9
    assert "Temperature=1, top_p=0.9;" in (tmp_path / "t1p.md").read_text()


def test_acceptance_bad_inputs(env, tmp_path, capsys):
    assert acceptance(env, tmp_path / "x.json", "--datasets", "nope") == 2
    err = capsys.readouterr().err
    assert "nope.jsonl does not exist" in err and "available: alpaca, gsm8k, mt_bench" in err
    assert err.count("\n") == 1
    assert acceptance(env, tmp_path / "x.json", "--datasets", "gsm8k", "--topk", "4", "--num-steps", "1",
                      "--num-draft-tokens", "9") == 2
    assert "--num-draft-tokens=9 exceeds" in capsys.readouterr().err
    assert acceptance(env, tmp_path / "x.json", "--datasets", "gsm8k", "--top-p", "0") == 2
    assert "--top-p must be in (0, 1], got 0.0" in capsys.readouterr().err


def test_acceptance_refuses_drafter_flags_it_would_ignore_before_any_work(env, tmp_path, capsys):
    """--drafter / --tree in the plain benchmark (it measured EAGLE under a "(from no draft)" banner), --drafter,
    --tree or --baseline-draft beside --drafters (the columns name the drafters), an empty --drafters (it ran the
    plain benchmark), a column that needs a draft under --draft none (it said no draft was shipped) and a
    --choose-into that cannot be written (found after the whole run) or given without --drafters: one line each,
    before any model loads or any output is written."""
    out = tmp_path / "a.json"
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"per_batch_size": {"1": {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}}}))
    cases = [(["--drafter", "suffix"], "--drafter suffix"), (["--tree", "auto"], "--tree auto"),
             (["--drafters", "eagle", "--drafter", "suffix"], "--drafter suffix"),
             (["--drafters", "eagle-auto", "--tree", "profile"], "--tree profile"),
             (["--drafters", "eagle", "--baseline-draft", env["draft"]], "--baseline-draft"),
             (["--drafters", ""], "--drafters ''"),
             (["--drafters", "suffix,hybrid", "--draft", "none"], "--drafters suffix,hybrid: hybrid"),
             (["--draft", "none"], "--draft none"),
             (["--drafters", "eagle", "--choose-into", str(tmp_path / "missing" / "p.json")], "--choose-into"),
             (["--choose-into", str(profile)], "--choose-into"),
             (["--threads", "-1"], "--threads must be >= 1, got -1"),                  # it was a traceback
             (["--datasets", "mt_bench_turn2"], "--datasets mt_bench_turn2: built from mt_bench by bench_acceptance "
              "--drafters only")]                                    # it ran MT-bench's first turns under that name
    for extra, said in cases:
        assert acceptance(env, out, "--datasets", "gsm8k", *extra) == 2, extra
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err and "no shipped draft" not in err, (extra, err)
    assert not out.exists() and not (tmp_path / "missing").exists()
    # the context drafter alone needs no draft: --draft none runs it (the tree flags shape no column there)
    assert acceptance(env, out, "--datasets", "gsm8k", "--drafters", "suffix", "--draft", "none") == 0
    res = json.loads(out.read_text())
    assert res["columns"] == ["suffix"] and res["sets"]["gsm8k"]["suffix"]["identical_to_vanilla"] == 2
    assert tune_main(["--target", env["target"], "--draft", env["draft"], "--dataset", "code_edit", "--out",
                      str(tmp_path / "t.json")]) == 2                        # the other benchmarks: the same refusal
    assert "--datasets code_edit: built from humaneval" in capsys.readouterr().err
