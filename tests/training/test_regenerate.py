"""Regeneration: turn-by-turn answers from the target, resumable output, OpenAI-compatible server path."""
from __future__ import annotations

import json
import os
import threading
from http.server import ThreadingHTTPServer

import pytest
from conftest import JSONHandler

from sglang_eagle3.training.data.formats import Conversation
from sglang_eagle3.training.regenerate import (
    EngineGenerator,
    OpenAIGenerator,
    RegenStats,
    load_conversations,
    regenerate,
    regenerate_batch,
)


class FakeGenerator:
    """Answers 'A(<user text>|<n prior answers>)'; raises after `fail_after` generate() calls."""

    def __init__(self, fail_after=None, empty_for=()):
        self.calls, self.prompts, self.fail_after, self.empty_for = 0, [], fail_after, set(empty_for)

    def generate(self, prompts):
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise KeyboardInterrupt("killed")
        self.calls += 1
        self.prompts += prompts
        out = []
        for p in prompts:
            user = p[-1]["content"]
            prior = sum(m["role"] == "assistant" for m in p)
            out.append("" if user in self.empty_for else f"A({user}|{prior})")
        return out


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def chats(tmp_path):
    rows = []
    for i in range(7):
        turns = [{"from": "human", "value": f"q{i}.{k}"} if j == 0 else {"from": "gpt", "value": f"old{i}.{k}"}
                 for k in range(1 + i % 3) for j in range(2)]
        rows.append({"id": f"c{i}", "conversations": turns})
    rows.append({"id": "tool", "conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "{}"},
                                                 {"from": "observation", "value": "{}"}, {"from": "gpt", "value": "y"}]})
    rows.append({"id": "sys", "system": "Be brief.", "conversations": [{"from": "human", "value": "qs"}]})
    return write_jsonl(tmp_path / "chats.jsonl", rows)


def read_out(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_turn_by_turn_history_uses_regenerated_answers(chats):
    convs = load_conversations([chats])
    gen = FakeGenerator()
    msgs = regenerate_batch(convs[:3], gen)
    assert msgs[2] == [{"role": "user", "content": "q2.0"}, {"role": "assistant", "content": "A(q2.0|0)"},
                       {"role": "user", "content": "q2.1"}, {"role": "assistant", "content": "A(q2.1|1)"},
                       {"role": "user", "content": "q2.2"}, {"role": "assistant", "content": "A(q2.2|2)"}]
    assert gen.calls == 3   # one batched call per turn index
    turn2 = [p for p in gen.prompts if p[-1]["content"] == "q2.1"][0]
    assert turn2[1] == {"role": "assistant", "content": "A(q2.0|0)"}   # not the dataset's old answer
    assert all("old" not in m["content"] for p in gen.prompts for m in p)
    assert regenerate_batch(convs[2:3], FakeGenerator(), max_turns=1)[0][-1]["content"] == "A(q2.0|0)"


def test_system_prompt_kept_tool_chats_skipped_empty_answers_stop(chats, tmp_path):
    stats = RegenStats()
    convs = load_conversations([chats], stats=stats)
    assert len(convs) == 8 and stats.skipped == {"tool turns cannot be regenerated": 1}
    out = str(tmp_path / "out.jsonl")
    regenerate(convs, FakeGenerator(empty_for={"q2.1"}), out, batch_size=3, progress=False, stats=stats)
    rows = {r["id"]: r for r in read_out(out)}
    assert rows["sys"]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert [m["content"] for m in rows["c2"]["messages"]] == ["q2.0", "A(q2.0|0)"]   # stops at the empty answer
    assert (stats.empty_answers, stats.turns_dropped, stats.written) == (1, 2, 8)


def test_resume_after_kill_no_lost_or_duplicated_rows(chats, tmp_path):
    convs = load_conversations([chats])
    out = tmp_path / "out.jsonl"
    partial = tmp_path / "out.jsonl.partial"
    with pytest.raises(KeyboardInterrupt):
        regenerate(convs, FakeGenerator(fail_after=4), str(out), batch_size=3, progress=False)
    assert not out.exists()
    first = read_out(partial)
    assert 0 < len(first) < len(convs) and len(first) % 3 == 0   # only whole batches were written
    with open(partial, "a") as f:   # a torn line, as left by a kill during a write
        f.write('{"key": "chats.jsonl:9", "messa')
    gen = FakeGenerator()
    stats = regenerate(convs, gen, str(out), batch_size=3, progress=False)
    assert stats.already_done == len(first) and stats.written == len(convs) - len(first)
    rows = read_out(out)
    assert not partial.exists()
    assert [r["key"] for r in rows] == [c.key for c in convs]   # every row once, in input order
    fresh = tmp_path / "fresh.jsonl"
    regenerate(convs, FakeGenerator(), str(fresh), batch_size=2, progress=False)
    assert rows == read_out(fresh)
    assert all(p[-1]["content"] not in {m["content"] for r in first for m in r["messages"]} for p in gen.prompts)
    # a finished output is not redone
    assert regenerate(convs, FakeGenerator(fail_after=0), str(out), progress=False).already_done == len(convs)


def test_time_budget_writes_the_rows_done_and_a_rerun_goes_on(chats, tmp_path):
    import time

    class Slow(FakeGenerator):
        def generate(self, prompts):
            time.sleep(0.3)
            return super().generate(prompts)

    convs = load_conversations([chats])
    out = tmp_path / "out.jsonl"
    stats = regenerate(convs, Slow(), str(out), batch_size=2, progress=False, time_budget_s=0.25)
    first = read_out(out)                     # a finished file (not .partial) with the first batch only
    assert len(first) == 2 and stats.left_for_later == len(convs) - 2
    assert not (tmp_path / "out.jsonl.partial").exists()
    from sglang_eagle3.training.regenerate import _prompt_chars
    assert {r["key"] for r in first} == {c.key for c in sorted(convs, key=_prompt_chars)[:2]}   # shortest first
    stats = regenerate(convs, FakeGenerator(), str(out), batch_size=2, progress=False)
    rows = read_out(out)
    assert stats.already_done == 2 and stats.left_for_later == 0
    assert [r["key"] for r in rows] == [c.key for c in convs]            # the rest added, input order, once each
    assert [r for r in rows if r["key"] in {f["key"] for f in first}] == first   # the earlier rows kept as they were


def test_output_loads_as_training_data(chats, tmp_path):
    from sglang_eagle3.training.data import parse_source, read_source
    out = tmp_path / "out.jsonl"
    regenerate(load_conversations([chats]), FakeGenerator(), str(out), progress=False)
    rows = list(read_source(parse_source(str(out))))
    assert len(rows) == 8 and rows[0][1].messages[1]["content"] == "A(q0.0|0)"


def test_engine_generator_adapter():
    class Out:
        def __init__(self, text):
            self.text = text

    from sglang_eagle3.engine.scheduler import RequestError

    class Engine:
        def encode(self, prompt):
            return prompt[-1]["content"].split()

        def check_fits(self, n, max_new_tokens):
            if n + max_new_tokens > 10:
                raise RequestError("too long")

        def generate(self, prompts, params, batch_size=None):
            self.params, self.batch_size = params, batch_size
            return [Out(p[-1]["content"].upper()) for p in prompts], None

    eng = Engine()
    gen = EngineGenerator(eng, max_new_tokens=7, temperature=0.5, batch_size=2, seed=3)
    assert gen.generate([[{"role": "user", "content": "hi"}]]) == ["HI"]
    assert (eng.params.max_new_tokens, eng.params.temperature, eng.params.seed, eng.batch_size) == (7, 0.5, 3, 2)
    # a prompt too long for the context is skipped (None), the others are answered
    long = [{"role": "user", "content": "a b c d e f"}]
    assert gen.generate([long, [{"role": "user", "content": "ok"}]]) == [None, "OK"]
    stats = RegenStats()
    convs = [Conversation([{"role": "user", "content": "a b c d e f"}], key="k0"),
             Conversation([{"role": "user", "content": "fine"}], key="k1")]
    hist = regenerate_batch(convs, gen, stats=stats)
    assert stats.too_long == 1 and hist[0] == [] and hist[1][-1]["content"] == "FINE"


def test_resume_refuses_other_settings_and_extends_with_more_rows(tmp_path, chats, capsys):
    from conftest import save_tiny_model_folder

    from sglang_eagle3.cli import main
    target = save_tiny_model_folder(tmp_path / "target")
    out = tmp_path / "regen.jsonl"
    common = ["regenerate", chats, "--target", target, "--out", str(out), "--max-turns", "1", "--quiet"]
    assert main([*common, "--max-new-tokens", "3", "--max-rows", "2"]) == 0
    assert [r["id"] for r in read_out(out)] == ["c0", "c1"]
    capsys.readouterr()
    assert main([*common, "--max-new-tokens", "4", "--max-rows", "2"]) == 0           # nothing to add: complete
    capsys.readouterr()
    assert main([*common, "--max-new-tokens", "4", "--max-rows", "4"]) == 2           # rows made otherwise: refused
    err = capsys.readouterr().err
    assert "max_new_tokens: 3 then, 4 now" in err and err.count("\n") == 1
    assert [r["id"] for r in read_out(out)] == ["c0", "c1"]                         # nothing touched
    assert main([*common, "--max-new-tokens", "3", "--max-rows", "4"]) == 0           # more rows: continued
    rows = read_out(out)
    assert [r["id"] for r in rows] == ["c0", "c1", "c2", "c3"]
    assert main([*common, "--max-new-tokens", "4", "--max-rows", "4", "--overwrite"]) == 0


def test_larger_max_prompt_chars_adds_the_skipped_conversations(tmp_path, chats, capsys):
    from conftest import save_tiny_model_folder

    from sglang_eagle3.cli import main
    target = save_tiny_model_folder(tmp_path / "target")
    out = tmp_path / "regen.jsonl"
    common = ["regenerate", chats, "--target", target, "--out", str(out), "--max-new-tokens", "3", "--max-rows", "3",
              "--quiet"]
    assert main([*common, "--max-prompt-chars", "4"]) == 0                 # c1 (8 chars), c2 (12) skipped
    first = read_out(out)
    assert [r["id"] for r in first] == ["c0"]
    assert main([*common, "--max-prompt-chars", "8"]) == 0                 # a selection, not a row setting: adds c1
    rows = read_out(out)
    assert [r["id"] for r in rows] == ["c0", "c1"] and rows[0] == first[0]
    capsys.readouterr()
    assert main([*common, "--max-prompt-chars", "8"]) == 0
    assert "already complete" in capsys.readouterr().out


def test_cli_with_in_process_engine(tmp_path, chats, capsys):
    from conftest import save_tiny_model_folder

    from sglang_eagle3.cli import main
    target = save_tiny_model_folder(tmp_path / "target")
    out = tmp_path / "regen.jsonl"
    rc = main(["regenerate", chats, "--target", target, "--out", str(out), "--max-new-tokens", "3",
               "--max-rows", "3", "--max-turns", "2", "--quiet"])
    assert rc == 0, capsys.readouterr().err
    rows = read_out(out)
    assert [r["id"] for r in rows] == ["c0", "c1", "c2"]
    msgs = rows[2]["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]   # 3 turns, capped at 2
    # the answers are the target's own greedy continuations of the regenerated history
    from sglang_eagle3.engine.loader import load_engine
    from sglang_eagle3.engine.settings import Settings
    from sglang_eagle3.engine.verify import SamplingParams
    engine = load_engine(target, Settings())
    outs, _ = engine.generate([msgs[:1], msgs[:3]], SamplingParams(max_new_tokens=3))
    assert [o.text for o in outs] == [msgs[1]["content"], msgs[3]["content"]]


# ---- OpenAI-compatible server stub -------------------------------------------------------------
class Stub(JSONHandler):
    requests: list = []

    def do_GET(self):
        self._send({"object": "list", "data": [{"id": "stub-model", "object": "model", "created": 0, "owned_by": "me"}]})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Stub.requests.append(req)
        if len(Stub.requests) > 50:
            self.send_error(500, "too many requests")
            return
        text = f"echo {req['messages'][-1]['content']} ({req['model']}, {req['max_tokens']})"
        self._send({"id": "x", "object": "chat.completion", "created": 0, "model": req["model"],
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": text}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})



@pytest.fixture
def server():
    Stub.requests = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


def test_openai_generator(server):
    gen = OpenAIGenerator(server, max_new_tokens=9, concurrency=3, timeout=10, max_retries=0)
    assert gen.model == "stub-model"
    prompts = [[{"role": "user", "content": f"p{i}"}] for i in range(5)]
    assert gen.generate(prompts) == [f"echo p{i} (stub-model, 9)" for i in range(5)]
    assert len(Stub.requests) == 5


def test_cli_with_server(server, chats, tmp_path, capsys):
    from sglang_eagle3.cli import main
    out = tmp_path / "regen.jsonl"
    rc = main(["regenerate", chats, "--server", server, "--model", "m", "--out", str(out), "--max-new-tokens", "5",
               "--batch-size", "4", "--concurrency", "2", "--quiet"])
    assert rc == 0
    rows = read_out(out)
    assert len(rows) == 8 and rows[1]["messages"][3]["content"] == "echo q1.1 (m, 5)"
    assert len(Stub.requests) == sum(1 + i % 3 for i in range(7)) + 1
    assert '"written": 8' in capsys.readouterr().out
    assert main(["regenerate", chats, "--out", str(out)]) == 2   # neither --target nor --server
    assert "give exactly one of --target" in capsys.readouterr().err
    assert main(["regenerate", chats, "--server", server, "--out", str(out)]) == 0
    assert "already complete" in capsys.readouterr().out


def test_cli_server_down_is_one_line_error(chats, tmp_path, capsys):
    import socket

    from sglang_eagle3.cli import main
    with socket.socket() as s:   # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = main(["regenerate", chats, "--server", f"http://127.0.0.1:{port}/v1", "--model", "m",
               "--out", str(tmp_path / "o.jsonl"), "--max-retries", "0", "--quiet"])
    assert rc == 2
    assert "APIConnectionError" in capsys.readouterr().err


# ---- misuse: every flag before the model loads; an empty output protects nothing -----------------------
def test_every_flag_is_checked_before_the_model_loads(tmp_path, chats, capsys, monkeypatch):
    from conftest import save_tiny_model_folder

    import sglang_eagle3.engine.loader as loader
    from sglang_eagle3.cli import main
    target = save_tiny_model_folder(tmp_path / "target")
    monkeypatch.setattr(loader, "load_engine", lambda *a, **k: pytest.fail("the model loaded first"))
    capsys.readouterr()
    out = tmp_path / "r.jsonl"
    common = ["regenerate", chats, "--out", str(out), "--quiet"]
    for extra, said in ((["--temperature", "-1"], "--temperature must be a finite number >= 0, got -1.0"),
                        (["--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
                        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
                        (["--max-turns", "0"], "--max-turns must be >= 1, got 0"),
                        (["--max-rows", "0"], "--max-rows must be >= 1, got 0"),
                        (["--request-timeout", "0"], "--request-timeout must be > 0 seconds"),
                        (["--device", "cuda:3"], "--device cuda:3: "),
                        (["--model", "m"], "--model names a model on --server")):
        assert main([*common, "--target", target, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, (extra, err)
    for extra, said in ((["--server", "localhost:30000"], "--server localhost:30000: expected a base URL"),
                        (["--server", "http://127.0.0.1:9/v1", "--draft", "d"], "--draft sets up the in-process"),
                        (["--server", "http://127.0.0.1:9/v1", "--max-retries", "-1"], "--max-retries must be >= 0")):
        assert main([*common, *extra]) == 2, extra
        assert said in capsys.readouterr().err
    assert not out.exists() and not os.path.exists(str(out) + ".partial")
    assert not os.path.exists(str(out) + ".settings.json")


def test_an_output_over_its_own_input_is_refused(tmp_path, chats, capsys, monkeypatch):
    """--out naming an input (or whose .partial / .settings.json file is one) is refused before anything is read:
    --overwrite used to delete the input before regenerating it."""
    from conftest import save_tiny_model_folder

    import sglang_eagle3.engine.loader as loader
    from sglang_eagle3.cli import main
    target = save_tiny_model_folder(tmp_path / "target")
    monkeypatch.setattr(loader, "load_engine", lambda *a, **k: pytest.fail("the model loaded first"))
    before = open(chats).read()
    capsys.readouterr()
    assert main(["regenerate", chats, "--target", target, "--out", chats, "--overwrite", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out {chats} is the same path as input {chats}: an output must" in err, err
    assert open(chats).read() == before
    partial = str(tmp_path / "p.jsonl.partial")
    os.replace(chats, partial)
    assert main(["regenerate", partial, "--target", target, "--out", str(tmp_path / "p.jsonl"), "--quiet"]) == 2
    assert f"--out {partial} is the same path as input {partial}" in capsys.readouterr().err
    assert open(partial).read() == before


def test_a_rerun_over_an_empty_partial_file_takes_the_new_settings(tmp_path, chats, capsys):
    """A run stopped before its first batch leaves an empty OUT.partial and its settings: nothing to protect, so a
    rerun with other settings goes ahead (and records them); a partial file with rows is still protected."""
    from conftest import save_tiny_model_folder

    from sglang_eagle3.cli import main
    target = save_tiny_model_folder(tmp_path / "target")
    out = tmp_path / "r.jsonl"
    (tmp_path / "r.jsonl.partial").write_text("")
    (tmp_path / "r.jsonl.settings.json").write_text(json.dumps({"max_new_tokens": 512, "temperature": -1.0}))
    common = ["regenerate", chats, "--target", target, "--out", str(out), "--max-rows", "2", "--max-turns", "1",
              "--quiet"]
    assert main([*common, "--max-new-tokens", "3"]) == 0, capsys.readouterr().err
    assert len(read_out(out)) == 2
    assert json.loads((tmp_path / "r.jsonl.settings.json").read_text())["max_new_tokens"] == 3
    (tmp_path / "r.jsonl.partial").write_text(out.read_text())
    out.unlink()
    assert main([*common, "--max-new-tokens", "4"]) == 2
    assert "holds rows made with other settings" in capsys.readouterr().err
