"""bench/ablation_table.py: drafts' acceptance results side by side, with their trainer summaries."""
from __future__ import annotations

import json

import bench_env
from bench_env import acceptance

from sglang_eagle3.bench import report

env, keep_threads = bench_env.env, bench_env.keep_threads             # the shared fixtures; keep_threads is autouse


def test_ablation_table_lines_up_drafts_and_refuses_mismatched_runs(env, tmp_path, capsys):
    from sglang_eagle3.bench.ablation import main as ablation_main
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    assert acceptance(env, a, "--datasets", "mt_bench,gsm8k") == 0
    assert acceptance(env, b, "--datasets", "gsm8k,mt_bench") == 0
    assert acceptance(env, c, "--datasets", "mt_bench,gsm8k", "--max-new-tokens", "4") == 0
    capsys.readouterr()
    out = tmp_path / "abl.json"
    assert ablation_main(["--row", f"fused={a}", "--row", f"again (w=1)={b}", "--out", str(out)]) == 0
    table = json.loads(out.read_text())
    res_a = json.loads(a.read_text())
    assert [r["label"] for r in table["rows"]] == ["fused", "again (w=1)"]
    assert table["rows"][0]["tau"] == {s: res_a["sets"][s]["tau"] for s in ("mt_bench", "gsm8k")}
    assert table["rows"][0]["train"] is None                       # init-draft output: no trainer summary
    rows = report.parse_markdown_table((tmp_path / "abl.md").read_text())
    assert rows[0][:3] == ["Draft", "MT-bench τ", "GSM8K τ"] and [r[0] for r in rows[1:]] == ["fused", "again (w=1)"]
    assert rows[1][1] == f"{res_a['sets']['mt_bench']['tau']:.2f}"
    assert ablation_main(["--row", f"fused={a}", "--row", f"short={c}", "--out", str(out)]) == 2
    assert "max_new_tokens=4" in capsys.readouterr().err
    assert ablation_main(["--row", f"fused={a}", "--sets", "alpaca", "--out", str(out)]) == 2
    assert "no results for set 'alpaca'" in capsys.readouterr().err
    assert ablation_main(["--row", "no-equals-sign", "--out", str(out)]) == 2
    assert ablation_main(["--row", f"x={tmp_path / 'missing.json'}", "--out", str(out)]) == 2


def test_ablation_row_reads_the_trainer_summary_next_to_an_exported_draft(tmp_path):
    from sglang_eagle3.bench.ablation import train_summary
    out = tmp_path / "run"
    (out / "draft").mkdir(parents=True)
    summary = {"export": str(out / "draft"), "steps": 7, "train_tokens": 1234,
               "final_eval": {"acc_0": 0.5, "accept_length": 1.7}, "config": {"features": "top"}}
    (out / "train_summary.json").write_text(json.dumps(summary))
    got = train_summary(str(out / "draft"))
    assert got["final_eval"]["acc_0"] == 0.5 and got["train_tokens"] == 1234 and got["features"] == "top"
    summary["export"] = str(tmp_path / "elsewhere")                 # a summary of another export: ignored
    (out / "train_summary.json").write_text(json.dumps(summary))
    assert train_summary(str(out / "draft")) is None


def test_ablation_per_step_table_lists_every_acc_k():
    from sglang_eagle3.bench.ablation import per_step_table
    rows = [{"label": "a", "train": {"final_eval": {"acc_0": 0.5, "acc_1": 0.25, "accept_length": 1.7}}},
            {"label": "b", "train": None}]
    md = per_step_table(rows)
    header = next(l for l in md.splitlines() if l.startswith("| Draft"))
    assert [c.strip() for c in header.strip("|").split("|")] == ["Draft", "acc_0", "acc_1"]
    line_a = next(l for l in md.splitlines() if l.startswith("| a"))
    assert "0.5" in line_a and "0.25" in line_a and "accept_length" not in md
    assert per_step_table([{"label": "b", "train": None}]) == ""


def test_ablation_table_refuses_files_that_are_not_acceptance_results(tmp_path, capsys):
    from sglang_eagle3.bench.ablation import main as ablation_main
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"sets": {}, "config": {}}))          # right keys, no bench_acceptance format tag
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    out = str(tmp_path / "abl.json")
    assert ablation_main(["--row", f"x={other}", "--out", out]) == 2
    assert "not a bench_acceptance result" in capsys.readouterr().err
    assert ablation_main(["--row", f"x={broken}", "--out", out]) == 2
    assert "broken.json: not valid JSON" in capsys.readouterr().err
