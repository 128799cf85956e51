"""`eagle3 generate` contract: JSON output, prompt files, clear errors."""
import json
import os
import subprocess
import sys

import pytest
from conftest import fake_step_costs, save_tiny_model_folder

from sglang_eagle3.cli import main


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target = save_tiny_model_folder(root / "target")
    assert main(["init-draft", "--target", target, "--out", str(root / "draft"), "--draft-vocab-size", "48",
                 "--dtype", "float32"]) == 0
    return target, str(root / "draft"), root


def run_json(capsys, *args):
    assert main(["generate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_json_spec_equals_vanilla(folders, capsys, tmp_path):
    target, draft, _ = folders
    pf = tmp_path / "p.jsonl"
    rows = [{"question_id": 1, "turns": ["w1 w2 w3", "w9"]},
            {"conversations": [{"from": "human", "value": "w5 w6"}, {"from": "gpt", "value": "w7"}]},
            {"prompt": "w8 w10 w11 w12"}]
    pf.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    common = ["--target", target, "--prompts-file", str(pf), "--chat", "--max-new-tokens", "12", "--ignore-eos"]
    spec = run_json(capsys, *common, "--draft", draft, "--batch-size", "2", "--num-steps", "3", "--topk", "2",
                    "--num-draft-tokens", "6")
    van = run_json(capsys, *common, "--draft", "none")
    assert [o["token_ids"] for o in spec["outputs"]] == [o["token_ids"] for o in van["outputs"]]
    assert spec["outputs"][0]["prompt"] == [{"role": "user", "content": "w1 w2 w3"}]
    # the two-turn row is a conversation: its second turn is asked after the model's own first answer
    assert [(o["row"], o["turn"]) for o in spec["outputs"]] == [(0, 0), (0, 1), (1, 0), (2, 0)]
    second = spec["outputs"][1]["prompt"]
    assert [m["role"] for m in second] == ["user", "assistant", "user"] and second[2]["content"] == "w9"
    assert second[1]["content"] == spec["outputs"][0]["text"]
    s = spec["stats"]
    assert set(s) >= {"accept_length", "tokens_per_s", "verify_steps", "generated_tokens"}
    assert s["generated_tokens"] == 48 and s["accept_length"] == pytest.approx(48 / s["verify_steps"])
    assert van["stats"]["accept_length"] == 1.0
    first = run_json(capsys, *common, "--draft", "none", "--first-turn-only")
    assert [(o["row"], o["turn"]) for o in first["outputs"]] == [(0, 0), (1, 0), (2, 0)]
    assert first["outputs"][0]["token_ids"] == van["outputs"][0]["token_ids"]


def test_generate_tree_auto_reports_its_step_cost_measuring_apart(folders, capsys, tmp_path, monkeypatch):
    """The one-off measuring of this machine's step costs (--tree auto) is not decoding: it made 8 tokens report
    0.056 tok/s. It is reported as cost_measure_s, outside total_time_s and tokens_per_s."""
    import time
    target, draft, _ = folders
    fake_step_costs(monkeypatch, tmp_path, sleep=0.1)                     # seconds of measuring at batch 1
    common = ["--target", target, "--draft", draft, "--prompt", "w1 w2 w3", "--max-new-tokens", "8", "--ignore-eos",
              "--drafter", "hybrid", "--tree", "auto"]
    start = time.perf_counter()
    first = run_json(capsys, *common)["stats"]
    wall = time.perf_counter() - start
    assert first["cost_measure_s"] >= 2 and first["total_time_s"] + first["cost_measure_s"] <= wall
    assert first["tokens_per_s"] == pytest.approx(first["generated_tokens"] / first["total_time_s"])
    assert run_json(capsys, *common)["stats"]["cost_measure_s"] == 0            # cached: nothing measured
    (tmp_path / "step_costs").rename(tmp_path / "elsewhere")
    assert main(["generate", *common]) == 0
    assert "step costs measured in" in capsys.readouterr().out


def test_generate_refuses_multi_turn_rows_without_chat_and_limits_below_one(folders, capsys, tmp_path):
    target, _, _ = folders
    pf = tmp_path / "p.jsonl"
    pf.write_text(json.dumps({"turns": ["w1 w2", "w3"]}) + "\n")
    for extra, said in ((["--limit", "0"], "--limit must be >= 1, got 0"),
                        (["--limit", "-1"], "--limit must be >= 1, got -1"),
                        ([], "row 1 has 2 turns; decode them as a conversation with --chat, or pass --first-turn-only")):
        assert main(["generate", "--target", target, "--draft", "none", "--prompts-file", str(pf), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and said in err, err


def test_tree_comes_from_the_drafts_tuned_profile_unless_flags_say(folders, capsys, tmp_path):
    import shutil
    target, draft, _ = folders
    tuned = tmp_path / "tuned"
    shutil.copytree(draft, tuned)
    (tuned / "spec_profile.json").write_text(json.dumps({"per_batch_size": {
        "1": {"num_steps": 2, "topk": 1, "num_draft_tokens": 3}, "4": {"speculation": False}}}))
    common = ["--target", target, "--prompt", "w1 w2", "--max-new-tokens", "4", "--draft", str(tuned)]
    t = run_json(capsys, *common)["tree"]
    assert (t["num_steps"], t["topk"], t["num_draft_tokens"], t["adaptive"]) == (2, 1, 3, True)
    assert "spec_profile.json" in t["source"]
    t = run_json(capsys, *common, "--topk", "2")["tree"]           # a flag: fixed tree, the rest from the profile's
    assert (t["num_steps"], t["topk"], t["num_draft_tokens"], t["adaptive"]) == (2, 2, 3, False)
    assert t["source"].startswith("flags --topk 2 over ") and "spec_profile.json" in t["source"]
    t = run_json(capsys, "--target", target, "--prompt", "w1", "--max-new-tokens", "2", "--draft", draft)["tree"]
    assert (t["num_steps"], t["topk"], t["num_draft_tokens"]) == (5, 4, 16)     # no profile: SGLang's default
    (tuned / "spec_profile.json").write_text("{not json")
    assert main(["generate", *common]) == 2
    err = capsys.readouterr().err
    assert "spec_profile.json: not valid JSON" in err and "Traceback" not in err


def test_profile_where_vanilla_won_measures_with_its_fastest_tree(folders, capsys, tmp_path):
    import shutil

    from sglang_eagle3.engine.profile import SpecProfile
    from sglang_eagle3.engine.speculation import SpecConfig
    from sglang_eagle3.models.config import ConfigError
    target, draft, _ = folders
    tuned = tmp_path / "tuned"
    shutil.copytree(draft, tuned)
    path = tuned / "spec_profile.json"
    path.write_text(json.dumps({"per_batch_size": {
        "1": {"speculation": False, "best_tree": {"num_steps": 2, "topk": 1, "num_draft_tokens": 3}},
        "4": {"speculation": False}}}))
    prof = SpecProfile.load(str(path))
    assert prof.for_batch_size(1) is None                       # the engine decodes without a draft there
    assert prof.measured_tree(2) == SpecConfig(2, 1, 3) and prof.measured_tree(8) is None
    out = run_json(capsys, "--target", target, "--prompt", "w1 w2", "--max-new-tokens", "4", "--draft", str(tuned))
    assert out["tree"] is None and out["draft"] == "none"       # vanilla won everywhere: the draft is not loaded
    assert "chooses no speculation at any batch size" in out["source"]
    path.write_text(json.dumps({"per_batch_size": {
        "1": {"speculation": False, "best_tree": {"num_steps": 2, "topk": 1, "num_draft_tokens": 3}},
        "4": {"num_steps": 1, "topk": 1, "num_draft_tokens": 2}}}))
    t = run_json(capsys, "--target", target, "--prompt", "w1 w2", "--max-new-tokens", "4", "--draft", str(tuned))["tree"]
    assert (t["num_steps"], t["topk"], t["num_draft_tokens"]) == (2, 1, 3) and "vanilla measured faster" in t["source"]
    path.write_text(json.dumps({"per_batch_size": {"1": {"speculation": False, "best_tree": {"topk": 1}}}}))
    with pytest.raises(ConfigError, match="best_tree"):
        SpecProfile.load(str(path))


def test_generate_errors_are_one_line(folders, capsys, tmp_path):
    target, draft, _ = folders
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{"nothing": 1}\n')
    assert main(["generate", "--target", target, "--prompts-file", str(bad)]) == 2
    assert f"{bad}:2: no prompt found" in capsys.readouterr().err
    bad.write_text('{"turns": ["ok"]\n')
    assert main(["generate", "--target", target, "--prompts-file", str(bad)]) == 2
    assert f"{bad}:1: not valid JSON" in capsys.readouterr().err
    assert main(["generate", "--target", target, "--prompt", "w1", "--draft", str(tmp_path / "nope")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert main(["generate", "--target", target, "--prompt", "w1", "--num-steps", "0"]) == 2
    assert "--num-steps must be >= 1" in capsys.readouterr().err
    assert main(["generate", "--target", target, "--prompt", "w1", "--top-p", "0"]) == 2
    assert "--top-p must be in (0, 1], got 0.0" in capsys.readouterr().err


def test_console_script_runs(folders):
    target, draft, _ = folders
    exe = os.path.join(os.path.dirname(sys.executable), "eagle3")
    r = subprocess.run([exe, "generate", "--target", target, "--draft", draft, "--prompt", "w1 w2", "--max-new-tokens",
                        "5", "--ignore-eos"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "accept length" in r.stdout and "tok/s" in r.stdout


def test_real_smollm2_greedy_matches_transformers(smollm2_path, tmp_path, capsys):
    """The embedded target: speculative (random draft, batch 2) == vanilla == transformers greedy, fp32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    assert main(["init-draft", "--target", smollm2_path, "--out", str(tmp_path / "d"), "--draft-vocab-size", "8192",
                 "--seed", "3"]) == 0
    capsys.readouterr()
    prompts = ["Name three primary colors.", "Write a haiku about the sea."]
    pf = tmp_path / "p.jsonl"
    pf.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in prompts))
    common = ["--target", smollm2_path, "--prompts-file", str(pf), "--chat", "--max-new-tokens", "16"]
    spec = run_json(capsys, *common, "--draft", str(tmp_path / "d"), "--batch-size", "2")
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    for p, o in zip(prompts, spec["outputs"]):
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt")
        ids = ids if torch.is_tensor(ids) else ids["input_ids"]
        ref = hf.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
        assert o["token_ids"] == ref


def last_line(capsys) -> str:
    """The error line (model loading may print progress bars before it); exactly one error line."""
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


# ---- issue: defaults that mislead, reruns that destroy work, tracebacks -------------------------------------
def test_generate_uses_the_shipped_draft_for_the_embedded_target(capsys, smollm2_path):
    from sglang_eagle3.paths import shipped_draft
    if shipped_draft() is None:
        pytest.skip("no shipped draft in this checkout")
    assert main(["generate", "--prompt", "The capital of France is", "--max-new-tokens", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["draft"] == shipped_draft()                     # not "none": the help promises the shipped draft
    assert main(["generate", "--target", "testbed", "--prompt", "Hi", "--max-new-tokens", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["draft"] == shipped_draft()


def test_init_draft_refuses_a_non_empty_folder(folders, tmp_path, capsys):
    target, draft, _ = folders
    out = tmp_path / "d"
    assert main(["init-draft", "--target", target, "--out", str(out), "--draft-vocab-size", "48"]) == 0
    (out / "README.md").write_text("a trained draft")
    before = (out / "model.safetensors").read_bytes()
    capsys.readouterr()
    (out / "notes.txt").write_text("my notes")
    (tmp_path / "beside.txt").write_text("beside")
    assert main(["init-draft", "--target", target, "--out", str(out), "--draft-vocab-size", "48", "--seed", "5"]) == 2
    err = capsys.readouterr().err
    assert "holds a draft" in err and "pass --force to replace its weights and config.json" in err
    assert (out / "model.safetensors").read_bytes() == before
    assert main(["init-draft", "--target", target, "--out", str(out), "--draft-vocab-size", "48", "--seed", "5",
                 "--force"]) == 0
    # --force does what it says: the weights and config.json are new, every other file is where it was
    assert (out / "model.safetensors").read_bytes() != before
    assert (out / "README.md").read_text() == "a trained draft" and (out / "notes.txt").read_text() == "my notes"
    assert (tmp_path / "beside.txt").read_text() == "beside"
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors", "notes.txt"]
    assert "kept README.md, notes.txt" in capsys.readouterr().err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("x")
    assert main(["init-draft", "--target", target, "--out", str(tmp_path / "other")]) == 2
    assert "is not empty and holds no draft" in capsys.readouterr().err


def test_init_draft_never_writes_over_its_target_or_another_model(tmp_path, capsys):
    """--force replaces a draft's config.json and weights: never the --target's own (--out = --target), nor those of
    a folder holding another model; a folder holding one in a subfolder gets the draft beside it, as export does."""
    target = save_tiny_model_folder(tmp_path / "t")
    other = save_tiny_model_folder(tmp_path / "m")
    weights = {p: (tmp_path / p / "model.safetensors").read_bytes() for p in ("t", "m")}
    capsys.readouterr()
    for out, said in ((target, f"--out {target} is the same path as --target {target}"),
                      (str(tmp_path), f"--out {tmp_path} contains --target {target}"),
                      (other, f"--out {other} holds a target model (")):
        assert main(["init-draft", "--target", target, "--out", out, "--force"]) == 2, out
        assert said in last_line(capsys)
    assert {p: (tmp_path / p / "model.safetensors").read_bytes() for p in ("t", "m")} == weights
    box = tmp_path / "box"
    save_tiny_model_folder(box / "inner")
    assert main(["init-draft", "--target", target, "--out", str(box), "--force", "--dtype", "float32"]) == 0
    assert sorted(os.listdir(box)) == ["config.json", "inner", "model.safetensors"]
    assert "kept inner" in capsys.readouterr().err


def test_prompts_longer_than_the_context_are_refused_or_truncated(tmp_path, capsys):
    from conftest import save_tiny_model_folder
    target = save_tiny_model_folder(tmp_path / "t")
    cfg = json.loads((tmp_path / "t" / "config.json").read_text())
    cfg["max_position_embeddings"] = 64
    (tmp_path / "t" / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    long = " ".join(["w5"] * 100)
    assert main(["generate", "--target", target, "--draft", "none", "--prompt", long, "--max-new-tokens", "4"]) == 2
    err = last_line(capsys)
    assert "prompt of 100 tokens" in err and "context of 64 tokens" in err
    assert main(["generate", "--target", target, "--draft", "none", "--prompt", " ".join(["w5"] * 50),
                 "--max-new-tokens", "30"]) == 2                 # prompt + max_new_tokens over the context too
    assert "exceeds the target's context" in last_line(capsys)
    assert main(["generate", "--target", target, "--draft", "none", "--prompt", long, "--max-new-tokens", "4",
                 "--truncate-prompt", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"]) == 4


@pytest.mark.parametrize("case", ["empty-prompt", "missing-target", "truncated-draft", "bad-draft-config",
                                  "nan-draft", "shifted-d2t", "empty-stop", "file-as-target"])
def test_bad_inputs_are_one_line_errors(case, folders, tmp_path, capsys):
    import shutil

    from conftest import edit_tensors
    target, draft, _ = folders
    d = tmp_path / "draft"
    shutil.copytree(draft, d)
    args = ["generate", "--target", target, "--draft", str(d), "--prompt", "w1 w2", "--max-new-tokens", "3"]
    if case == "empty-prompt":
        args[args.index("--prompt") + 1] = ""
        phrase = "--prompt is empty"
    elif case == "missing-target":
        args[2] = str(tmp_path / "no" / "such" / "target")
        phrase = "no such folder"
    elif case == "file-as-target":
        args[2] = str(d / "config.json")
        phrase = "is a file"
    elif case == "truncated-draft":
        w = d / "model.safetensors"
        w.write_bytes(w.read_bytes()[:1000])
        phrase = "unreadable safetensors file"
    elif case == "bad-draft-config":
        cfg = json.loads((d / "config.json").read_text())
        cfg["num_attention_heads"] = "four"
        (d / "config.json").write_text(json.dumps(cfg))
        phrase = "config.json"
    elif case == "nan-draft":
        edit_tensors(str(d), lambda s: s["fc.weight"].fill_(float("nan")))
        phrase = "fc.weight holds NaN"
    elif case == "shifted-d2t":
        edit_tensors(str(d), lambda s: s["d2t"].add_(1))
        phrase = "d2t"
    else:
        args += ["--stop", ""]
        phrase = "stop strings must be non-empty"
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1, err
    assert phrase in err.strip().splitlines()[-1], err
    if case in ("truncated-draft", "nan-draft"):
        with pytest.raises(Exception):                          # --debug: the traceback
            main(["--debug", *args])


def test_sampled_requests_use_the_profiles_sampled_table(folders, capsys, tmp_path):
    """A profile with a table measured with sampling: sampled requests (the CLI at --temperature > 0, a scheduler
    step with a sampling request) take its tree, greedy ones the greedy tree; a profile without one, the greedy
    tree for both; a malformed one is refused naming 'sampled'."""
    import shutil

    import torch

    from sglang_eagle3.engine.engine import SpeculativeEngine
    from sglang_eagle3.engine.loader import load_draft
    from sglang_eagle3.engine.profile import SpecProfile
    from sglang_eagle3.engine.settings import Settings
    from sglang_eagle3.engine.speculation import SpecConfig
    from sglang_eagle3.engine.verify import SamplingParams
    from sglang_eagle3.models.config import ConfigError
    from sglang_eagle3.models.target import TargetModel
    target, draft, _ = folders
    tuned = tmp_path / "tuned"
    shutil.copytree(draft, tuned)
    path = tuned / "spec_profile.json"
    path.write_text(json.dumps({"per_batch_size": {"1": {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}},
                                "sampled": {"temperature": 1.0, "per_batch_size": {
                                    "1": {"num_steps": 1, "topk": 2, "num_draft_tokens": 3},
                                    "4": {"speculation": False}}}}))
    prof = SpecProfile.load(str(path))
    assert prof.for_batch_size(1) == SpecConfig(3, 2, 6) and prof.for_batch_size(1, sampled=True) == SpecConfig(1, 2, 3)
    assert prof.for_batch_size(8, sampled=True) is None and SpecConfig(1, 2, 3) in prof.trees()
    common = ["--target", target, "--prompt", "w1 w2", "--max-new-tokens", "4", "--draft", str(tuned)]
    t = run_json(capsys, *common, "--temperature", "1", "--seed", "0")["tree"]
    assert (t["num_steps"], t["topk"], t["num_draft_tokens"]) == (1, 2, 3) and "sampled" in t["source"]
    t = run_json(capsys, *common)["tree"]
    assert (t["num_steps"], t["topk"], t["num_draft_tokens"]) == (3, 2, 6)
    tm = TargetModel.from_pretrained(target)
    eng = SpeculativeEngine(tm, load_draft(str(tuned), torch.float32), Settings(tree=SpecConfig(3, 2, 6), profile=prof))
    sched = eng.scheduler(4, 64)
    assert sched.spec_for(1) == SpecConfig(3, 2, 6) and sched.spec_for(1, sampled=True) == SpecConfig(1, 2, 3)
    seen = []
    step = sched.worker.step
    sched.worker.step = lambda rows, params, gens, spec, *rest: seen.append(spec) or step(rows, params, gens, spec, *rest)
    eng.generate(["w1 w2"], SamplingParams(max_new_tokens=3, temperature=1.0, seed=0))
    eng.generate(["w1 w2"], SamplingParams(max_new_tokens=3))
    assert SpecConfig(1, 2, 3) in seen and seen[-1] == SpecConfig(3, 2, 6)
    path.write_text(json.dumps({"per_batch_size": {"1": {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}},
                                "sampled": [1]}))
    with pytest.raises(ConfigError, match="sampled"):
        SpecProfile.load(str(path))


def test_long_contexts_use_the_profiles_long_context_table(folders, tmp_path):
    """A profile with a long-context table: greedy steps whose longest row holds at least min_tokens tokens take its
    tree (the scheduler measures the longest row: prompt + output), shorter ones the batch-size table, sampled steps
    the sampled table; its trees count for the pools' room; a long_context without an integer min_tokens is refused
    naming it, and one under another host's by_host entry is not used on this host."""
    import shutil

    import torch

    from sglang_eagle3.engine.engine import SpeculativeEngine
    from sglang_eagle3.engine.loader import load_draft
    from sglang_eagle3.engine.profile import SpecProfile, host_kind
    from sglang_eagle3.engine.settings import Settings
    from sglang_eagle3.engine.speculation import SpecConfig
    from sglang_eagle3.engine.verify import SamplingParams
    from sglang_eagle3.models.config import ConfigError
    from sglang_eagle3.models.target import TargetModel
    target, draft, _ = folders
    tuned = tmp_path / "tuned"
    shutil.copytree(draft, tuned)
    path = tuned / "spec_profile.json"
    table = {"per_batch_size": {"1": {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}},
             "sampled": {"per_batch_size": {"1": {"num_steps": 1, "topk": 2, "num_draft_tokens": 3}}},
             "long_context": {"min_tokens": 10, "per_batch_size": {"1": {"num_steps": 1, "topk": 1,
                                                                         "num_draft_tokens": 2},
                                                                   "4": {"speculation": False}}}}
    path.write_text(json.dumps(table))
    prof = SpecProfile.load(str(path))
    assert prof.for_batch_size(1, context=9) == SpecConfig(3, 2, 6)
    assert prof.for_batch_size(1, context=10) == SpecConfig(1, 1, 2) and prof.for_batch_size(4, context=50) is None
    assert prof.for_batch_size(1, sampled=True, context=50) == SpecConfig(1, 2, 3)
    assert prof.measured_tree(1, context=10) == SpecConfig(1, 1, 2) and SpecConfig(1, 1, 2) in prof.trees()
    tm = TargetModel.from_pretrained(target)
    eng = SpeculativeEngine(tm, load_draft(str(tuned), torch.float32), Settings(tree=SpecConfig(3, 2, 6), profile=prof))
    sched = eng.scheduler(4, 64)
    seen = []
    step = sched.worker.step
    sched.worker.step = lambda rows, params, gens, spec, *rest: seen.append(spec) or step(rows, params, gens, spec, *rest)
    eng.generate(["w1 w2"], SamplingParams(max_new_tokens=2, ignore_eos=True))
    short = list(seen)
    eng.generate([" ".join(f"w{i % 7 + 1}" for i in range(12))], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert short and all(s == SpecConfig(3, 2, 6) for s in short)
    assert seen[len(short):] and all(s == SpecConfig(1, 1, 2) for s in seen[len(short):])
    for bad in ({"per_batch_size": table["per_batch_size"]}, {"min_tokens": "10", "per_batch_size": {}},
                {"min_tokens": 0, "per_batch_size": table["per_batch_size"]}):
        path.write_text(json.dumps({**table, "long_context": bad}))
        with pytest.raises(ConfigError, match="long_context"):
            SpecProfile.load(str(path))
    other = "avx2" if host_kind() != "avx2" else "amx"
    path.write_text(json.dumps({"per_batch_size": table["per_batch_size"], "by_host": {
        other: {**table}, host_kind(): {"per_batch_size": table["per_batch_size"]}}}))
    assert SpecProfile.load(str(path)).long_context is None
    assert SpecProfile.load(str(path), host=other).long_context[0] == 10


def test_dtype_auto_is_bf16_only_where_it_is_native(monkeypatch):
    """--dtype auto (serve, demo, benches): bfloat16 on GPUs and on CPUs where the engine computes bf16 products
    fast (AVX-512 BF16, AMX, or csrc's AVX2 kernel); float32 on other CPUs, where PyTorch's bf16 products are
    emulated (several times slower than fp32). Explicit names pass through."""
    from sglang_eagle3.engine.profile import host_kind
    from sglang_eagle3.engine.settings import resolve_dtype
    from sglang_eagle3.kernels import extension
    monkeypatch.setattr(extension, "cpu_flags", lambda: "flags : fpu sse2 avx avx2 fma f16c")
    monkeypatch.setattr(extension, "few_row_isa", lambda: "avx2")
    assert resolve_dtype("auto") == "bfloat16"                   # csrc's AVX2 kernel
    with extension.using("off"):
        assert resolve_dtype("auto") == "float32"                # --compile off: PyTorch's emulated bf16
    monkeypatch.setattr(extension, "few_row_isa", lambda: "")      # no extension (no compiler)
    assert resolve_dtype("auto") == "float32" and resolve_dtype("auto", "cuda:0") == "bfloat16"
    assert resolve_dtype("bfloat16") == "bfloat16" and resolve_dtype("float32", "cuda") == "float32"
    monkeypatch.setattr(extension, "few_row_kernel", lambda: "avx2")
    assert host_kind() == "avx2" and host_kind("cuda") == "cuda"
    monkeypatch.setattr(extension, "cpu_flags", lambda: "flags : avx2 fma avx512f avx512bw avx512vl avx512_vnni")
    monkeypatch.setattr(extension, "few_row_isa", lambda: "avx512f")     # Skylake-SP to Ice Lake: AVX-512F, no BF16
    monkeypatch.setattr(extension, "few_row_kernel", lambda: "avx512f")
    assert resolve_dtype("auto") == "bfloat16" and host_kind() == "avx512f"
    monkeypatch.setattr(extension, "few_row_kernel", lambda: None)   # no extension: fp32, no bf16 table
    assert host_kind() == "cpu"
    for flags in ("flags : avx2 avx512f avx512_bf16", "flags : avx512_bf16 amx_bf16 amx_tile"):
        monkeypatch.setattr(extension, "cpu_flags", lambda f=flags: f)
        assert resolve_dtype("auto") == "bfloat16"


HOST_KIND_PROBE = """
import json
from sglang_eagle3.engine.profile import SpecProfile, host_kind
from sglang_eagle3.kernels import extension
from sglang_eagle3.paths import shipped_draft
profile = SpecProfile.load(shipped_draft() + "/spec_profile.json")
print(json.dumps({"kind": host_kind(), "cuda": host_kind("cuda"), "kernels": extension.few_row_kernels(),
                  "isa": extension.few_row_isa(), "profile_host": profile.host}))
"""


def expected_host_kind(flags: set, isa: str, amx_on: bool, amx_usable: bool) -> str:
    """What host_kind() must say for a build for `isa` on a CPU with these flags (AMX where usable and on)."""
    if isa == "native" and amx_on and amx_usable:
        return "amx"
    if isa == "native" and "avx512_bf16" in flags:
        return "avx512_bf16"
    if isa in ("native", "avx512f") and "avx512f" in flags:
        return "avx512f"
    return "avx2" if "avx2" in flags and "fma" in flags else "cpu"


def test_host_kind_on_every_kind_the_profile_knows():
    """Each kind of CPU the shipped speculation profile holds a table for (amx, avx512_bf16, avx512f, avx2) is
    detected as that kind and gets its own table: on this host, the native build (AMX on and off) and the builds for
    the lesser instruction sets a host without AMX or AVX-512 BF16 runs (EAGLE3_KERNEL_ISA), each in a fresh process;
    without the extension the kind is 'cpu', on GPUs 'cuda'."""
    import shutil

    from sglang_eagle3.kernels import extension
    from sglang_eagle3.paths import shipped_draft
    if not (shutil.which("c++") or shutil.which("g++")) or extension.load() is None:
        pytest.skip("no C++ extension on this machine")
    with open(os.path.join(shipped_draft(), "spec_profile.json")) as f:
        profile_kinds = set(json.load(f)["by_host"])
    flags = set(extension.cpu_flags().split())
    seen = set()
    for isa, amx in (("native", "auto"), ("native", "off"), ("avx512f", "auto"), ("avx2", "auto"), ("off", "auto")):
        env = {**os.environ, "EAGLE3_AMX": amx, "EAGLE3_KERNEL_ISA": "native" if isa == "off" else isa,
               "EAGLE3_KERNELS": "off" if isa == "off" else "auto"}
        env.pop("EAGLE3_FEW_ROW", None)
        run = subprocess.run([sys.executable, "-c", HOST_KIND_PROBE], env=env, capture_output=True, text=True,
                             timeout=900)
        assert run.returncode == 0, run.stderr[-2000:]
        got = json.loads(run.stdout.strip().splitlines()[-1])
        want = "cpu" if isa == "off" else expected_host_kind(flags, isa, amx == "auto", "amx" in got["kernels"])
        assert got["kind"] == want and got["cuda"] == "cuda", (isa, amx, got)
        assert got["profile_host"] == (want if want in profile_kinds else None), (isa, amx, got)
        seen.add(want)
    if {"amx_bf16", "avx512_bf16"} <= flags and "amx" in seen:     # an AMX host builds every kind the profile has
        assert profile_kinds - {"cuda", "cpu"} <= seen, (profile_kinds, seen)


# ---- misuse: a folder of the wrong kind, a config field of the wrong type ---------------------------------
def test_a_draft_given_as_target_or_a_target_as_draft_is_named_in_one_line(folders, capsys):
    target, draft, _ = folders
    cases = [(["generate", "--target", draft, "--prompt", "w1"], f"--target {draft} is an EAGLE-3 draft folder"),
             (["generate", "--target", target, "--draft", target, "--prompt", "w1"],
              f"--draft {target} is a target model folder"),
             (["check-draft", "--draft", draft, "--target", draft], f"--target {draft} is an EAGLE-3 draft folder"),
             (["check-draft", "--draft", target], f"--draft {target} is a target model folder"),
             (["init-draft", "--target", draft, "--out", "/nonexistent/x"], "is an EAGLE-3 draft folder")]
    for argv, said in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err and "Traceback" not in err, err


BAD_FIELDS = [("draft_vocab_size", "abc", "is not a positive integer"), ("hidden_size", 0, "is not a positive integer"),
              ("intermediate_size", 1.5, "is not a positive integer"), ("num_attention_heads", None, "missing"),
              ("num_key_value_heads", True, "is not a positive integer"), ("head_dim", "16", "positive integer"),
              ("vocab_size", -3, "is not a positive integer"), ("target_hidden_size", [64], "positive integer"),
              ("max_position_embeddings", "long", "is not a positive integer"),
              ("rms_norm_eps", "tiny", "is not a positive number"), ("rope_theta", -1, "is not a positive number"),
              ("rope_scaling", "x", "is not an object"), ("torch_dtype", "int8", "is not one of"),
              ("hidden_act", 5, "is not a string"), ("eos_token_id", "</s>", "is not a token id"),
              ("bos_token_id", -1, "is not a token id"), ("fc_norm", "yes", "must be true or false"),
              ("eagle_config", [1, 2], "is not an object"), ("num_hidden_layers", "1", "exactly 1 layer"),
              ("eagle_config", {"eagle_aux_hidden_state_layer_ids": [1, "x", 4]}, "not a list of non-negative")]


@pytest.mark.parametrize("key,value,said", BAD_FIELDS, ids=[f"{k}={v!r}" for k, v, _ in BAD_FIELDS])
def test_every_draft_config_field_is_type_checked_naming_file_and_key(folders, key, value, said):
    from sglang_eagle3.models.config import ConfigError, Eagle3Config
    _, draft, _ = folders
    d = json.loads(open(os.path.join(draft, "config.json")).read())
    d[key] = value
    with pytest.raises(ConfigError) as e:
        Eagle3Config.from_dict(d, where="D/config.json")
    assert str(e.value).startswith("D/config.json: ") and key in str(e.value) and said in str(e.value), str(e.value)


def test_generate_names_the_bad_draft_config_field(folders, tmp_path, capsys):
    import shutil
    target, draft, _ = folders
    d = tmp_path / "d"
    shutil.copytree(draft, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["draft_vocab_size"] = "abc"
    (d / "config.json").write_text(json.dumps(cfg))
    assert main(["generate", "--target", target, "--draft", str(d), "--prompt", "w1"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"eagle3 generate: error: {d}/config.json: draft_vocab_size='abc' is not a positive integer"


LOADER_FAULTS = [({"hidden_size": 1000, "num_attention_heads": 9, "num_key_value_heads": 3},
                  "hidden_size=1000 is not a multiple of "
                  "num_attention_heads=9"),
                 ({"head_dim": 15}, "head_dim=15 is odd"),
                 ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
                 ({"rope_scaling": {"rope_type": "spiral", "factor": 2.0}}, "rope_scaling.rope_type='spiral' is not"),
                 ({"rope_scaling": {"rope_type": "yarn"}}, "transformers' LlamaConfig refuses it: "
                  "\"Missing required keys in `rope_parameters` for 'rope_type'='yarn': {'factor'}\"")]


@pytest.mark.parametrize("edit,said", LOADER_FAULTS, ids=[",".join(e) for e, _ in LOADER_FAULTS])
def test_generate_names_what_the_loaders_refuse_in_a_draft_config(folders, tmp_path, capsys, edit, said):
    """A config transformers' LlamaConfig refuses (the draft's RoPE is built through it, and SGLang and vLLM read a
    draft's config.json with it) is one line naming the file, not its StrictDataclass validation traceback."""
    import shutil
    target, draft, _ = folders
    d = tmp_path / "d"
    shutil.copytree(draft, d)
    (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), **edit}))
    assert main(["generate", "--target", target, "--draft", str(d), "--prompt", "w1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"eagle3 generate: error: {d}/config.json: ") and said in err, err


def test_flags_that_would_be_ignored_or_misread_are_refused(folders, tmp_path, capsys):
    """Tree flags without a draft, a --num-draft-tokens a chain would cut, a folder as prompts file, a draft vocabulary
    larger than the target's and a file as --cache-dir: one line each, before any model loads."""
    target, draft, _ = folders
    cases = [(["generate", "--target", target, "--draft", "none", "--prompt", "w1", "--num-steps", "3"],
              "--num-steps shapes the draft tree, but there is no draft"),
             (["generate", "--target", target, "--prompt", "w1", "--topk", "2"], "--topk shapes the draft tree"),
             (["generate", "--target", target, "--draft", draft, "--prompt", "w1", "--num-steps", "2", "--topk", "1",
               "--num-draft-tokens", "8"], "--num-draft-tokens 8: a chain (topk 1) of 2 steps verifies 3 tokens"),
             (["generate", "--target", target, "--draft", "none", "--prompts-file", str(tmp_path)],
              f"prompts file {tmp_path} is a folder"),
             (["init-draft", "--target", target, "--out", str(tmp_path / "d"), "--draft-vocab-size", "1000"],
              "--draft-vocab-size 1000 exceeds the target vocabulary of 96"),
             (["testbed", "--cache-dir", os.path.join(draft, "config.json")], "is a file, not a folder"),
             (["serve", "--engine", "builtin", "--target", target, "--draft", "none", "--num-steps", "2", "--dry-run"],
              "--num-steps shapes the draft tree"),
             (["serve", "--engine", "builtin", "--target", target, "--draft", "none", "--max-len", "100000",
               "--dry-run"], "--max-len 100000 exceeds the target's context of 512 tokens"),
             (["generate", "--target", target, "--prompt", "w1", "--limit", "2"],
              "--limit applies to the rows of --prompts-file, not to one --prompt"),
             (["generate", "--target", target, "--prompt", "w1", "--first-turn-only"],
              "--first-turn-only applies to the rows of --prompts-file"),
             (["regenerate", str(tmp_path / "p.jsonl"), "--server", "http://127.0.0.1:9/v1", "--write-every", "4",
               "--out", str(tmp_path / "r.jsonl")], "--write-every sets up the in-process engine")]
    for argv, said in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, (argv, err)
    assert not (tmp_path / "d").exists()


# ---- drafting modes: contradictions, unused names, profiles of other targets ------------------------------
def test_drafter_flags_that_contradict_or_go_unused_are_refused(folders, tmp_path, capsys):
    """Tree flags under --drafter suffix (no draft model: nothing they shape), a drafter or --tree auto that needs a
    draft under --draft none, and a --draft or --profile that --drafter suffix would never read: one line each, naming
    the flag, before any model loads (they were ignored or rewritten without a word)."""
    import shutil
    target, draft, _ = folders
    truncated = tmp_path / "truncated"
    shutil.copytree(draft, truncated)
    w = truncated / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    gen = ["generate", "--target", target, "--prompt", "w1", "--max-new-tokens", "2"]
    cases = [([*gen, "--drafter", "suffix", "--num-steps", "3"], "--num-steps shapes the draft model's tree, but "
              "--drafter suffix"),
             ([*gen, "--drafter", "suffix", "--topk", "2"], "--topk shapes the draft model's tree"),
             ([*gen, "--drafter", "suffix", "--num-draft-tokens", "4"], "--num-draft-tokens"),
             ([*gen, "--drafter", "hybrid", "--draft", "none"], "--drafter hybrid"),
             ([*gen, "--drafter", "eagle", "--draft", "none"], "--drafter eagle"),
             ([*gen, "--drafter", "eagle"], "--drafter eagle"),               # a target without a shipped draft
             ([*gen, "--tree", "auto", "--draft", "none"], "--tree auto"),
             ([*gen, "--drafter", "suffix", "--draft", str(tmp_path / "nonexistent")], f"--draft {tmp_path}"),
             ([*gen, "--drafter", "suffix", "--draft", str(truncated)], f"--draft {truncated}"),
             ([*gen, "--drafter", "suffix", "--profile", str(tmp_path / "nonexistent.json")], "--profile")]
    for argv, said in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, (argv, err)
    # what each of them may say instead runs
    for argv in ([*gen, "--drafter", "suffix", "--draft", "none", "--json"], [*gen, "--drafter", "suffix", "--tree",
                                                                               "auto", "--json"]):
        assert main(argv) == 0, capsys.readouterr().err
        out = json.loads(capsys.readouterr().out)
        assert out["drafting"]["drafter"] == "suffix" and out["draft"] == "none"


def test_tree_auto_reports_the_most_a_step_verifies(folders, tmp_path, capsys, monkeypatch):
    """--tree auto sizes each step's tree: an explicit --num-draft-tokens is the most a step verifies (it was
    reported in the JSON while the steps verified up to the shape's full size), and without one the JSON reports the
    size the steps may reach."""
    import shutil

    from sglang_eagle3.engine import scheduler
    from sglang_eagle3.engine.cost_model import StepCosts
    from sglang_eagle3.engine.loader import load_engine
    from sglang_eagle3.engine.settings import resolve_settings
    monkeypatch.setattr(scheduler, "load_or_measure_costs", lambda *a, **k: StepCosts({1: {1: 0.01, 16: 0.02}}, {}))
    target, draft, _ = folders
    flags = {"num_steps": 2, "topk": 2, "num_draft_tokens": 4}
    out = run_json(capsys, "--target", target, "--draft", draft, "--prompt", "w1 w2", "--max-new-tokens", "4",
                   "--tree", "auto", *[f"--{k.replace('_', '-')}={v}" for k, v in flags.items()])
    assert out["tree"]["num_draft_tokens"] == 4 and out["drafting"]["tree"] == "auto"
    settings = resolve_settings(draft, dtype="float32", tree="auto", **flags)
    sched = load_engine(target, settings).scheduler(1, 64)
    assert sched.spec_for(1).num_draft_tokens == 4 and sched.tree_slots == 4
    tuned = tmp_path / "tuned"
    shutil.copytree(draft, tuned)
    (tuned / "spec_profile.json").write_text(json.dumps({"per_batch_size": {
        "1": {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}}}))
    out = run_json(capsys, "--target", target, "--draft", str(tuned), "--prompt", "w1 w2", "--max-new-tokens", "4",
                   "--tree", "auto")
    settings = resolve_settings(str(tuned), dtype="float32", tree="auto")
    sched = load_engine(target, settings).scheduler(1, 64)
    assert out["tree"]["num_draft_tokens"] == sched.spec_for(1).num_draft_tokens == 11     # 1 + 2 + 2 * 2 * 2


def test_a_profile_recorded_for_another_target_is_refused(folders, tmp_path, capsys):
    """A profile whose 'target' names another model (its trees were measured there): one line naming the profile
    file, its target and this run's; a profile of this target (named as tune_spec records it) is used."""
    import shutil
    target, draft, _ = folders
    other = tmp_path / "qwen.json"
    other.write_text(json.dumps({"target": "Qwen/Qwen2.5-7B-Instruct", "draft": "qwen-eagle3",
                                 "per_batch_size": {"1": {"num_steps": 6, "topk": 8, "num_draft_tokens": 48}}}))
    tuned = tmp_path / "tuned"
    shutil.copytree(draft, tuned)
    shutil.copy(other, tuned / "spec_profile.json")
    gen = ["generate", "--target", target, "--prompt", "w1", "--max-new-tokens", "2"]
    for argv, path in (([*gen, "--draft", draft, "--profile", str(other)], other),
                       ([*gen, "--draft", str(tuned)], tuned / "spec_profile.json")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(path) in err and "Qwen/Qwen2.5-7B-Instruct" in err and target in err, err
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"target": os.path.basename(target), "per_batch_size": {
        "1": {"num_steps": 2, "topk": 1, "num_draft_tokens": 3}}}))
    t = run_json(capsys, *gen[1:], "--draft", draft, "--profile", str(mine))["tree"]
    assert (t["num_steps"], t["topk"], t["num_draft_tokens"]) == (2, 1, 3)


BAD_DRAFTING = [({"drafter": "bogus"}, "drafter must be one of eagle, suffix, hybrid, got 'bogus'"),
                ({"tree": None}, "tree must be one of profile, auto, got None"),
                ({"max_nodes": 0}, "max_nodes must be an integer in 1..128, got 0"),
                ({"max_nodes": "16"}, "max_nodes must be an integer in 1..128, got '16'"),
                ({"max_nodes": 2.5}, "max_nodes must be an integer in 1..128, got 2.5"),
                ({"max_nodes": 100000}, "max_nodes must be an integer in 1..128, got 100000"),
                ({"max_nodes": True}, "max_nodes must be an integer in 1..128, got True"),
                ({"context_tokens": 3.7}, "context_tokens must be an integer >= 1, got 3.7"),
                ({"min_match": -1}, "min_match must be an integer >= 1, got -1")]


@pytest.mark.parametrize("bad,said", BAD_DRAFTING, ids=[json.dumps(b) for b, _ in BAD_DRAFTING])
def test_a_profiles_bad_drafting_entry_names_the_file_and_field(folders, tmp_path, capsys, bad, said):
    """by_host.<kind>.drafting values are checked when the profile is read, named by file and field (they were
    reported as flags the user never passed, crashed with a traceback, or were blamed on the prompt's length), also
    in another host's entry and in the profile's own 'drafting'."""
    from sglang_eagle3.engine.profile import SpecProfile, host_kind
    from sglang_eagle3.models.config import ConfigError
    target, draft, _ = folders
    kind = host_kind()
    path = tmp_path / "p.json"
    table = {"1": {"num_steps": 2, "topk": 1, "num_draft_tokens": 3}}
    path.write_text(json.dumps({"per_batch_size": table, "by_host": {kind: {"drafting": {"drafter": "hybrid", **bad}}}}))
    assert main(["generate", "--target", target, "--draft", draft, "--profile", str(path), "--prompt", "w1",
                 "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path}: by_host.{kind}.drafting.{said}" in err, err
    assert "--drafter" not in err and "--max-nodes" not in err and "--tree" not in err
    for profile, where in (({"per_batch_size": table, "by_host": {"zen9": {"drafting": bad}}}, "by_host.zen9.drafting"),
                           ({"per_batch_size": table, "drafting": bad}, "drafting")):
        path.write_text(json.dumps(profile))
        with pytest.raises(ConfigError) as e:
            SpecProfile.load(str(path))
        assert str(e.value) == f"{path}: {where}.{said}"


def test_generate_banner_names_the_context_drafter(folders, capsys):
    """Text output under --drafter suffix: the banner says the context drafts (it said 'none (vanilla)')."""
    target, _, _ = folders
    assert main(["generate", "--target", target, "--prompt", "w1 w2 w1 w2", "--max-new-tokens", "4", "--drafter",
                 "suffix"]) == 0
    banner = capsys.readouterr().out.strip().splitlines()[-1]
    assert "vanilla" not in banner and "drafter suffix" in banner, banner


def test_demo_refuses_contradicting_flags_in_one_line(tmp_path, capsys):
    """make demo shares generate's flags and resolver: a contradiction is one line, exit 2 (it ran vanilla
    decoding, or printed a traceback), before any model loads."""
    from sglang_eagle3.bench import demo
    for argv, said in ((["--tree", "auto", "--draft", "none"], "--tree auto"),
                       (["--num-steps", "0"], "--num-steps must be >= 1, got 0"),
                       (["--drafter", "suffix", "--topk", "2"], "--topk shapes the draft model's tree"),
                       (["--rounds", "0"], "--rounds must be >= 1, got 0")):
        assert demo.main(["--data", str(tmp_path), *argv]) == 2, argv
        # (torch notes a missing CUDA runtime once per process, where this test runs first)
        err = "".join(x for x in capsys.readouterr().err.splitlines(True) if "cpp_extension.py" not in x)
        assert err.count("\n") == 1 and said in err, (argv, err)


def test_demo_prints_the_round_with_the_median_speed():
    from types import SimpleNamespace

    from sglang_eagle3.bench.demo import median_run
    runs = [(i, SimpleNamespace(tokens_per_s=v)) for i, v in enumerate((210.0, 190.0, 250.0))]
    assert median_run(runs)[0] == 0 and median_run(runs[:2])[0] == 0


def test_generate_reports_the_draft_calibration_it_samples_with(folders, tmp_path, capsys):
    """A draft folder with a draft_calibration.json: generate --json names the scales its sampled children use, and
    none with --draft-children sampled-raw; a broken file stops it in one line naming the file."""
    import shutil

    from sglang_eagle3.engine.draft_calibration import FILE, DraftCalibration
    target, draft, _ = folders
    calibrated = tmp_path / "calibrated"
    shutil.copytree(draft, calibrated)
    (calibrated / FILE).write_text(json.dumps(DraftCalibration((1.5, 1.1)).as_json()))
    args = ["--target", target, "--draft", str(calibrated), "--prompt", "w1 w2", "--max-new-tokens", "4",
            "--temperature", "1", "--seed", "0"]
    out = run_json(capsys, *args)
    assert out["drafting"]["children"] == "sampled" and out["drafting"]["calibration"] == [1.5, 1.1]
    out = run_json(capsys, *args, "--draft-children", "sampled-raw")
    assert out["drafting"]["children"] == "sampled-raw" and out["drafting"]["calibration"] is None
    (calibrated / FILE).write_text("{")
    assert main(["generate", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{calibrated / FILE}: not a readable JSON file" in err and len(err.splitlines()) == 1, err
