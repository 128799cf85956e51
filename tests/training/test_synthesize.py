"""synthesize-prompts: the pre-query template, the prompt filter, resumable sampling, the command line."""
from __future__ import annotations

import json
import os
from contextlib import nullcontext
from types import SimpleNamespace

import pytest

from sglang_eagle3.errors import UserError
from sglang_eagle3.training.synthesize import FollowUps, PromptFilter, pre_query_ids, read_partial, synthesize


class FakeTokenizer:
    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        return "<s>" + "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([0] if add_special_tokens else []) + [ord(c) for c in text]}


class FakeEngine:
    """Writes prompt number (seed, i) of a batch; `texts(seed, i)` decides the text; raises after `fail_after`
    generate calls (a kill)."""

    def __init__(self, texts=None, fail_after=None, cut=()):
        self.tokenizer = FakeTokenizer()
        self.texts = texts or (lambda seed, i: f"Question {seed} number {i}: what is going on here?")
        self.seeds, self.prompts, self.fail_after, self.cut = [], [], fail_after, set(cut)

    def generate(self, prompts, params, batch_size=None):
        if self.fail_after is not None and len(self.seeds) >= self.fail_after:
            raise KeyboardInterrupt("killed")
        self.seeds.append(params.seed)
        self.prompts += prompts
        return [SimpleNamespace(text=self.texts(params.seed, i), finish_reason="length" if i in self.cut else "eos")
                for i in range(len(prompts))], None


def read_rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_pre_query_ids_end_where_the_user_text_begins():
    ids = pre_query_ids(FakeTokenizer())
    assert "".join(map(chr, ids)) == "<s><user>"                 # no extra special token in front
    assert "".join(map(chr, pre_query_ids(FakeTokenizer(), "Be brief."))) == "<s><system>Be brief.</system><user>"


def test_pre_query_ids_of_smollm2(smollm2_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    ids = pre_query_ids(tok)
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>user\n") and text.count("<|im_start|>") == 2      # system turn, user turn
    full = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True)
    full = full if isinstance(full, list) else full["input_ids"]
    assert full[:len(ids)] == ids                                 # the same tokens as the template's own


def test_filter_reasons():
    f = PromptFilter(min_chars=10)
    f.exclude(["Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
               "experiences and must-see attractions.", "Hi there"])
    assert f.keep("What is the capital of France?", True)
    assert not f.keep("what is  the capital of france?", True)    # case and spaces ignored
    assert not f.keep("Tell me a long story about a dragon", False)
    assert not f.keep("Why?", True)
    # 13 words of an eval prompt in a row: dropped; 12 of them: kept
    assert not f.keep("Please: compose an engaging travel blog post about a recent trip to Hawaii, highlighting "
                      "everything.", True)
    assert f.keep("Please: compose an engaging travel blog post about a recent trip to Hawaii, fine?", True)
    assert not f.keep("hi   THERE", True)                          # a short excluded prompt, whole
    assert f.dropped == {"duplicate": 1, "cut off at --max-new-tokens": 1, "shorter than --min-chars": 1,
                         "overlaps an --exclude prompt": 2}


def test_synthesize_keeps_n_distinct_prompts_with_a_seed_per_batch(tmp_path):
    eng = FakeEngine(texts=lambda seed, i: f"Question {i % 3} about the world, please?", cut=(0,))
    out = str(tmp_path / "p.jsonl")
    with pytest.raises(UserError, match="repeats itself"):      # 3 distinct texts only: it stops, saying why
        synthesize(eng, 10, out, batch_size=4, progress=False, max_barren_batches=3)
    rows, next_batch = read_partial(out + ".partial")
    assert [r["turns"][0] for r in rows] == ["Question 1 about the world, please?", "Question 2 about the world, please?",
                                              "Question 0 about the world, please?"]
    assert next_batch == 4 and eng.seeds == [0, 1, 2, 3]
    assert eng.prompts[0] == [ord(c) for c in "<s><user>"]      # token ids, not text to tokenize again

    eng = FakeEngine()
    counts = synthesize(eng, 10, str(tmp_path / "q.jsonl"), seed=5, batch_size=4, progress=False)
    rows = read_rows(tmp_path / "q.jsonl")
    assert len(rows) == 10 == counts["kept"] and len({r["turns"][0] for r in rows}) == 10
    assert eng.seeds == [5 * 1_000_003 + b for b in range(3)]
    assert not (tmp_path / "q.jsonl.partial").exists()
    # a larger n later: the finished rows stay, the next batch is drawn after the last one
    eng = FakeEngine()
    counts = synthesize(eng, 14, str(tmp_path / "q.jsonl"), seed=5, batch_size=4, progress=False)
    assert eng.seeds == [5 * 1_000_003 + 3] and counts["kept_before_this_run"] == 10
    assert read_rows(tmp_path / "q.jsonl")[:10] == rows and len(read_rows(tmp_path / "q.jsonl")) == 14


def test_synthesize_resumes_after_a_kill_without_drawing_a_batch_twice(tmp_path):
    out = str(tmp_path / "p.jsonl")
    eng = FakeEngine(fail_after=2)
    with pytest.raises(KeyboardInterrupt):
        synthesize(eng, 12, out, batch_size=4, progress=False)
    with open(out + ".partial", "a") as f:
        f.write('{"id": "torn", "tur')                            # a kill in the middle of a write
    eng2 = FakeEngine()
    counts = synthesize(eng2, 12, out, batch_size=4, progress=False)
    assert eng.seeds == [0, 1] and eng2.seeds == [2]              # batch 2 next, batches 0-1 kept
    assert counts["kept_before_this_run"] == 8 and counts["sampled_this_run"] == 4
    rows = read_rows(out)
    assert [r["id"] for r in rows] == [f"synth-s0-b{b}-{i}" for b in range(3) for i in range(4)]


class ConversingEngine(FakeEngine):
    """First turns "Question b-i: ...?"; answers (chat messages in) "Answer to <last user turn>", the answer of
    question 1 cut off; follow-ups (token ids in) "Follow-up k of question i?", question 2's second one too short."""
    SEED_STEP = 500_009

    def generate(self, prompts, params, batch_size=None):
        self.seeds.append(params.seed)
        self.temperatures = getattr(self, "temperatures", []) + [params.temperature]
        self.prompts += prompts
        out = []
        for i, p in enumerate(prompts):
            if not isinstance(p[0], int):                       # an answer to a conversation so far
                last = p[-1]["content"]
                cut = last.startswith("Question 1")
                out.append(SimpleNamespace(text=f"Answer to {last}", finish_reason="length" if cut else "eos"))
            else:
                text = "".join(map(chr, p))
                if text == "<s><user>":                        # a first turn
                    out.append(SimpleNamespace(text=f"Question {i}: what is the weather like?", finish_reason="eos"))
                    continue
                q = text.split("<user>Question ")[1][0]
                k = text.count("<assistant>")
                reply = "Why?" if (q == "2" and k == 2) else f"Follow-up {k} of question {q}, please?"
                out.append(SimpleNamespace(text=reply, finish_reason="eos"))
        return out, None


def test_follow_ups_grow_conversations_until_the_first_failure(tmp_path):
    eng = ConversingEngine()
    counts = synthesize(eng, 4, str(tmp_path / "c.jsonl"), seed=2, batch_size=4, progress=False,
                        flt=PromptFilter(min_chars=10), follow=FollowUps(turns=3, answer_temperature=0.5))
    rows = read_rows(tmp_path / "c.jsonl")
    assert [r["turns"] for r in rows] == [
        ["Question 0: what is the weather like?", "Follow-up 1 of question 0, please?",
         "Follow-up 2 of question 0, please?"],
        ["Question 1: what is the weather like?"],                                   # its answer was cut off
        ["Question 2: what is the weather like?", "Follow-up 1 of question 2, please?"],  # "Why?" is too short
        ["Question 3: what is the weather like?", "Follow-up 1 of question 3, please?",
         "Follow-up 2 of question 3, please?"]]
    assert counts["conversations_by_user_turns"] == {"1": 1, "2": 1, "3": 2}
    assert counts["dropped_this_run"] == {"answer cut off or empty (ends the conversation)": 1,
                                          "follow-up shorter than --min-chars": 1}
    b, step = 2 * 1_000_003, ConversingEngine.SEED_STEP
    assert eng.seeds == [b, b + step, b + 2 * step, b + 3 * step, b + 4 * step]    # first turns keep their seed
    # a follow-up continues the template right after the answer, where the next user message begins
    follow = "".join(map(chr, eng.prompts[4 + 4]))
    assert follow == ("<s><user>Question 0: what is the weather like?</user><assistant>Answer to Question 0: what "
                      "is the weather like?</assistant><user>")
    # the answers were drawn with --answer-temperature, as chats
    assert eng.prompts[4] == [{"role": "user", "content": "Question 0: what is the weather like?"}]
    assert eng.temperatures == [1.0, 0.5, 1.0, 0.5, 1.0]


def test_pre_query_ids_after_a_conversation_of_smollm2(smollm2_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    ids = pre_query_ids(tok, None, ["Hi"], ["Hello! How can I help?"])
    full = tok.apply_chat_template([{"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": "Hello! How can I help?"},
                                    {"role": "user", "content": "Tell me a joke."}], tokenize=True)
    full = full if isinstance(full, list) else full["input_ids"]
    assert full[:len(ids)] == ids and tok.decode(full[len(ids):]).startswith("Tell me a joke.")


def test_cli(tmp_path, capsys):
    from conftest import save_tiny_model_folder

    from sglang_eagle3.cli import main
    target = save_tiny_model_folder(tmp_path / "target")
    out = tmp_path / "p.jsonl"
    evals = tmp_path / "eval.jsonl"
    evals.write_text(json.dumps({"turns": ["one two three"]}) + "\n")
    common = ["synthesize-prompts", "--target", target, "--out", str(out), "--quiet", "--exclude", str(evals)]
    assert main([*common, "--n", "0"]) == 2
    assert "--n must be >= 1" in capsys.readouterr().err
    assert main([*common, "--n", "3", "--temperature", "0"]) == 2
    assert "--temperature must be > 0" in capsys.readouterr().err
    rc = main([*common, "--n", "3", "--max-new-tokens", "6", "--min-chars", "1", "--batch-size", "8"])
    assert rc == 0, capsys.readouterr().err
    rows = read_rows(out)
    assert len(rows) == 3 and all(r["turns"][0] for r in rows)
    before = out.read_text()
    assert main([*common, "--n", "3"]) == 0                      # complete: nothing drawn, nothing lost
    assert "already holds 3 prompts" in capsys.readouterr().out and out.read_text() == before
    args = ["--max-new-tokens", "6", "--min-chars", "1", "--batch-size", "8"]
    assert main([*common, "--n", "5", *args, "--seed", "1"]) == 2          # more, drawn another way: refused
    assert "other settings" in capsys.readouterr().err and out.read_text() == before
    assert main([*common, "--n", "5", *args]) == 0                          # more, the same way: drawn after them
    assert "drawing 2 more" in capsys.readouterr().out and read_rows(out)[:3] == rows and len(read_rows(out)) == 5
    rows = read_rows(out)
    # --turns 2: conversations of up to two user turns; its settings differ from a one-turn file's
    out2 = tmp_path / "c.jsonl"
    assert main(["synthesize-prompts", "--target", target, "--out", str(out2), "--quiet", "--n", "2", "--turns", "0"]) == 2
    assert "--turns must be >= 1" in capsys.readouterr().err
    rc = main(["synthesize-prompts", "--target", target, "--out", str(out2), "--quiet", "--n", "4", "--turns", "2",
               "--answer-max-new-tokens", "4", "--max-new-tokens", "6", "--min-chars", "1", "--batch-size", "8"])
    assert rc == 0, capsys.readouterr().err
    assert all(1 <= len(r["turns"]) <= 2 for r in read_rows(out2))
    assert json.load(open(str(out2) + ".settings.json"))["turns"] == 2
    # the rows load as prompts for regenerate
    from sglang_eagle3.training.regenerate import load_conversations
    convs = load_conversations([str(out)])
    assert [c.messages for c in convs] == [[{"role": "user", "content": r["turns"][0]}] for r in rows]


def test_engine_takes_token_ids_as_they_are():
    from conftest import tiny_target

    from sglang_eagle3.engine.engine import SpeculativeEngine
    from sglang_eagle3.engine.settings import Settings
    from sglang_eagle3.engine.verify import SamplingParams
    eng = SpeculativeEngine(tiny_target()[0], None, Settings())
    assert eng.encode([5, 7, 9]) == [5, 7, 9]
    a, _ = eng.generate([[5, 7, 9]], SamplingParams(max_new_tokens=4))
    assert a[0].token_ids and a[0].prompt == [5, 7, 9]


def test_a_second_run_on_the_same_output_is_refused(tmp_path):
    from sglang_eagle3.fileio import exclusive_writer
    out = str(tmp_path / "p.jsonl")
    with exclusive_writer(out + ".partial"):
        with pytest.raises(UserError, match="being written by another run"):
            synthesize(FakeEngine(), 4, out, batch_size=4, progress=False)
    synthesize(FakeEngine(), 4, out, batch_size=4, progress=False)     # the lock went with the first run
    assert len(read_rows(out)) == 4


def test_a_corrupt_line_before_the_last_is_named(tmp_path):
    out = tmp_path / "p.jsonl"
    (tmp_path / "p.jsonl.partial").write_text('{"id": "a", "turns": ["x"], "batch": 0}\nnot json\n'
                                              '{"id": "b", "turns": ["y"], "batch": 1}\n')
    with pytest.raises(UserError, match=r"p\.jsonl\.partial: line at byte 40 is not a synthesized prompt"):
        synthesize(FakeEngine(), 4, str(out), batch_size=4, progress=False)


def test_flags_and_exclude_files_are_checked_before_anything_is_written_or_removed(tmp_path, capsys, monkeypatch):
    from conftest import save_tiny_model_folder

    import sglang_eagle3.engine.loader as loader
    from sglang_eagle3.cli import main
    target = save_tiny_model_folder(tmp_path / "target")
    out = tmp_path / "p.jsonl"
    out.write_text(json.dumps({"id": "mine", "turns": ["a prompt I keep"], "batch": 0}) + "\n")
    monkeypatch.setattr(loader, "load_engine", lambda *a, **k: pytest.fail("the model loaded first"))
    common = ["synthesize-prompts", "--target", target, "--out", str(out), "--n", "4", "--quiet", "--overwrite"]
    for extra, said in ((["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
                        (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
                        (["--answer-temperature", "inf"], "--answer-temperature must be a finite number >= 0"),
                        (["--device", "cuda:1"], "--device cuda:1: "),
                        (["--exclude", str(tmp_path / "no.jsonl")], "no.jsonl does not exist")):
        with pytest.raises(SystemExit) if extra[0] == "--dtype" else nullcontext():
            assert main([*common, *extra]) == 2, extra
        assert said in capsys.readouterr().err, extra
    assert "a prompt I keep" in out.read_text()                 # --overwrite removed nothing: the run never began
    assert sorted(os.listdir(tmp_path)) == ["p.jsonl", "target"]


def test_an_output_over_an_exclude_file_is_refused(tmp_path, capsys, monkeypatch):
    """--out naming an --exclude file is refused before anything is read: --overwrite used to delete the eval set."""
    from conftest import save_tiny_model_folder

    import sglang_eagle3.engine.loader as loader
    from sglang_eagle3.cli import main
    target = save_tiny_model_folder(tmp_path / "target")
    evals = tmp_path / "eval.jsonl"
    evals.write_text(json.dumps({"turns": ["an eval prompt"]}) + "\n")
    monkeypatch.setattr(loader, "load_engine", lambda *a, **k: pytest.fail("the model loaded first"))
    capsys.readouterr()
    assert main(["synthesize-prompts", "--target", target, "--out", str(evals), "--n", "4", "--quiet",
                 "--exclude", str(evals), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out {evals} is the same path as --exclude {evals}" in err, err
    assert "an eval prompt" in evals.read_text() and sorted(os.listdir(tmp_path)) == ["eval.jsonl", "target"]
