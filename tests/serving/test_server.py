"""The builtin OpenAI-compatible server: a real uvicorn on 127.0.0.1, the `openai` client and raw HTTP.

Greedy answers equal offline `generate` in fp32 whatever runs beside them; streaming, errors, 503 with
Retry-After, cancellation on disconnect, and a bounded load test without KV-row leaks.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import fake_step_costs, save_tiny_model_folder

from sglang_eagle3.cli import main as eagle3_main
from sglang_eagle3.engine.loader import load_engine
from sglang_eagle3.engine.settings import Settings
from sglang_eagle3.engine.speculation import SpecConfig
from sglang_eagle3.engine.verify import SamplingParams
from sglang_eagle3.serving.server import build_state, create_app

SPEC = SpecConfig(3, 2, 6)
PROMPTS = [f"w{i} w{i + 3} w{2 * i + 1} w7" for i in range(8)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, state):
        import uvicorn
        self.state, self.port = state, free_port()
        self.server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=self.port,
                                                    log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started and time.time() < deadline:
            time.sleep(0.02)
        assert self.server.started
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    target = save_tiny_model_folder(root / "target")
    assert eagle3_main(["init-draft", "--target", target, "--out", str(root / "draft"), "--draft-vocab-size", "48",
                        "--dtype", "float32"]) == 0
    return target, str(root / "draft")


@pytest.fixture(scope="module")
def live(folders):
    target, draft = folders
    srv = LiveServer(build_state(target, Settings("float32", draft, SPEC, None, "test", max_running=4, max_queue=64,
                                 max_len=256), model_name="tiny"))
    yield srv
    srv.close()


def client(live):
    from openai import OpenAI
    return OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=60)


def chat(p):
    return [{"role": "user", "content": p}]


def offline(folders, prompts, max_new_tokens):
    target, draft = folders
    eng = load_engine(target, Settings("float32"))
    outs, _ = eng.generate([chat(p) for p in prompts], SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    return [o.text for o in outs]


def test_greedy_answers_equal_offline_generate_whatever_runs_beside(live, folders):
    c = client(live)
    expect = offline(folders, PROMPTS, 20)
    results = [None] * len(PROMPTS)

    def ask(i):   # greedy requests interleaved with sampled ones (other params, other lengths)
        r = c.chat.completions.create(model="tiny", messages=chat(PROMPTS[i]), max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True})
        results[i] = r
        c.chat.completions.create(model="tiny", messages=chat(PROMPTS[-1 - i]), max_tokens=7 + i, temperature=0.9,
                                  top_p=0.9, seed=i)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert [r.choices[0].message.content for r in results] == expect
    r = results[0]
    assert r.usage.completion_tokens == 20 and r.usage.prompt_tokens > 0 and r.choices[0].finish_reason == "length"
    stats = r.model_extra["spec_stats"]
    assert stats["verify_steps"] >= 1 and stats["accept_length"] == pytest.approx(20 / stats["verify_steps"], abs=1e-3)


def test_streaming_chat_and_completions(live):
    c = client(live)
    full = c.chat.completions.create(model="tiny", messages=chat(PROMPTS[1]), max_tokens=16, temperature=0)
    chunks = list(c.chat.completions.create(model="tiny", messages=chat(PROMPTS[1]), max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens and not chunks[-1].choices
    assert [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason][0].choices[0].finish_reason in ("stop", "length")
    comp = c.completions.create(model="tiny", prompt="w1 w2 w3", max_tokens=10, temperature=0)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(model="tiny", prompt="w1 w2 w3",
                                                                           max_tokens=10, temperature=0, stream=True))
    assert streamed == comp.choices[0].text and comp.object == "text_completion"
    # raw SSE: data lines, the last one [DONE]
    with httpx.stream("POST", live.url + "/v1/completions", json={"model": "tiny", "prompt": "w5", "max_tokens": 4,
                                                                   "stream": True}, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    assert "spec_stats" in json.loads(lines[-2][6:])


def test_completions_take_token_ids_as_they_are(live, folders):
    """A list of token ids reaches the model unchanged: not decoded and tokenized again (which here would drop the
    newline token, as the word-level tokenizer splits on whitespace); an id outside the vocabulary is refused."""
    target, _ = folders
    tok = load_engine(target, Settings("float32")).tokenizer
    ids = [tok.convert_tokens_to_ids(t) for t in ["w4", "\n", "w9", "w1"]]
    assert len(tok(tok.decode(ids), add_special_tokens=True)["input_ids"]) != len(ids)   # the round trip loses it
    eng = load_engine(target, Settings("float32"))
    expect = eng.generate([ids], SamplingParams(max_new_tokens=8, ignore_eos=True))[0][0].text
    r = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 8,
                                                      "temperature": 0, "ignore_eos": True, "echo": True}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["choices"][0]["text"] == tok.decode(ids) + expect
    one = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": [ids], "max_tokens": 8,
                                                        "temperature": 0, "ignore_eos": True}, timeout=60)
    assert one.json()["choices"][0]["text"] == expect                        # a batch of one list: that list
    for bad in ([ids, ids], [], [""]):
        r = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": bad, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": [ids[0], 96], "max_tokens": 2})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt" and "prompt[1] = 96" in err["message"], r.text


def test_models_health_metrics(live):
    models = httpx.get(live.url + "/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["object"] == "list"
    h = httpx.get(live.url + "/health").json()
    assert h["status"] == "ok" and h["max_running"] == 4
    assert client(live).models.retrieve("tiny").id == "tiny"              # GET /v1/models/{model}
    r = httpx.get(live.url + "/v1/models/org/gpt-9")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    m = httpx.get(live.url + "/metrics")
    assert m.headers["content-type"].startswith("text/plain")
    for name in ("eagle3_generated_tokens_total", "eagle3_accept_length", "eagle3_running_requests",
                 "eagle3_queued_requests", "eagle3_generation_tokens_per_second", "eagle3_free_kv_rows"):
        assert f"\n{name} " in "\n" + m.text, name


def ask(**fields) -> dict:
    """A chat request for w1 with these fields set (or replaced)."""
    return {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], **fields}


@pytest.mark.parametrize("body,status,param,phrase", [
    ('{"model": "tiny", "messages": [', 400, None, "not valid JSON"),
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "w1"}]}, 404, "model", "not served here"),
    ({"model": "tiny", "messages": "hello"}, 400, "messages", "messages"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "max_tokens": -3}, 400, "max_tokens", ">= 1"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "max_tokens": 100000}, 400, "messages",
     "exceeds"),
    ({"model": "tiny", "messages": [{"role": "user", "content": " ".join(["w3"] * 400)}], "max_tokens": 4}, 400,
     "messages", "exceeds"),
    ({"model": "tiny", "messages": []}, 400, "messages", "non-empty"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "temperature": "hot"}, 400, "temperature",
     "temperature"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "n": 17}, 400, "n", "[1, 16]"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "stop": [""]}, 400, "stop", "non-empty"),
    # parameters the server would otherwise ignore are refused, naming them
    ({"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "frequency_penalty": 0.5}, 400,
     "frequency_penalty", "not supported"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "presence_penalty": -1}, 400,
     "presence_penalty", "not supported"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "logit_bias": {"5": 100}}, 400,
     "logit_bias", "not supported"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "response_format": {"type": "json_object"}},
     400, "response_format", "not supported"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "w1"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, 400, "tools", "not supported"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "top_logprobs": 2}, 400, "top_logprobs",
     "requires logprobs=true"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs", "[0, 20]"),
    # a user message without text is refused, naming it (it used to be answered as an empty prompt)
    ({"model": "tiny", "messages": [{"role": "user", "content": None}]}, 400, "messages[0].content", "is null"),
    ({"model": "tiny", "messages": [{"role": "user"}]}, 400, "messages[0].content", "is missing"),
    ({"model": "tiny", "messages": [{"role": "user", "content": []}]}, 400, "messages[0].content", "has no text"),
    ({"model": "tiny", "messages": [{"role": "system", "content": "w2"}, {"role": "user", "content": "  "}]}, 400,
     "messages[1].content", "has no text"),
    # malformed content parts: a 400 naming the part (they used to be a 500)
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "messages[0].content[0].text", "must be a string, got missing"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "w1"},
                                                                 {"type": "text", "text": None}]}]}, 400,
     "messages[0].content[1].text", "must be a string, got null"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400,
     "messages[0].content[0].text", "must be a string, got number 5"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages[0].content[0].type", "only text parts"),
    ({"model": "tiny", "messages": [{"role": "tool", "content": "w1"}]}, 400, "messages[0].role", "expected system"),
    ({"model": "tiny", "messages": [{"role": 5, "content": "w1"}]}, 400, "messages[0].role", "valid string"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "temperature": float("nan")}, 400,
     "temperature", "finite"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "stream_options": {"include_usage": True}},
     400, "stream_options", "only allowed with stream=true"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens", ">= 1, got 0"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "stop": [5]}, 400, "stop", "valid string"),
    ('[1, 2]', 400, None, "request body must be a JSON object"),
    # OpenAI parameters this server cannot honour are refused, naming them (they used to be answered 200)
    (ask(prediction={"type": "content", "content": "w1 w2"}), 400, "prediction", "not supported"),
    (ask(modalities=["text", "audio"]), 400, "modalities", "not supported"),
    (ask(audio={"voice": "alloy", "format": "wav"}), 400, "audio", "not supported"),
    (ask(reasoning_effort="high"), 400, "reasoning_effort", "not supported"),
    (ask(web_search_options={}), 400, "web_search_options", "not supported"),
    (ask(store=True), 400, "store", "not supported"),
    (ask(service_tier="priority"), 400, "service_tier", "not supported"),
    (ask(verbosity="low"), 400, "verbosity", "not supported"),
    (ask(stream=True, stream_options={"continuous_usage_stats": True}), 400, "stream_options.continuous_usage_stats",
     "not supported"),
    (ask(stream=True, stream_options={"include_usage": "no"}), 400, "stream_options.include_usage",
     "got string \"no\""),
    (ask(max_tokens=5, max_completion_tokens=7), 400, "max_completion_tokens", "max_tokens 5 and max_completion_tokens 7"),
    # booleans (and strings) are not numbers: true used to be taken as 1
    (ask(max_tokens=True), 400, "max_tokens", "valid integer, got boolean true"),
    (ask(max_completion_tokens=True), 400, "max_completion_tokens", "valid integer, got boolean true"),
    (ask(temperature=True), 400, "temperature", "valid number, got boolean true"),
    (ask(top_p=False), 400, "top_p", "got boolean false"),
    (ask(n=True), 400, "n", "got boolean true"),
    (ask(seed=False), 400, "seed", "got boolean false"),
    (ask(top_k=True), 400, "top_k", "got boolean true"),
    (ask(logprobs=True, top_logprobs=True), 400, "top_logprobs", "got boolean true"),
    (ask(max_tokens="3"), 400, "max_tokens", "got string \"3\""),
    (ask(stream=1), 400, "stream", "valid boolean, got number 1"),
    (ask(ignore_eos="yes"), 400, "ignore_eos", "got string"),
    # text that is not Unicode, and JSON nested past what the reader takes, named as such
    (ask(messages=[{"role": "user", "content": "w1 \ud800"}]), 400, "messages[0].content",
     "messages[0].content holds a lone surrogate \\ud800 at character 3"),
    (ask(messages=[{"role": "user", "content": [{"type": "text", "text": "w1"}, {"type": "text", "text": "\udfff"}]}]),
     400, "messages[0].content[1].text", "lone surrogate \\udfff at character 0"),
    (ask(stop=["w1", "w2\ud800"]), 400, "stop[1]", "stop[1] holds a lone surrogate \\ud800 at character 2"),
    ('{"model": "tiny", "messages": ' + "[" * 100000 + "]" * 100000 + "}", 400, None,
     "the request body nests 100001 levels deep"),
    # a content that is neither a string nor a list of parts says what it should be
    (ask(messages=[{"role": "user", "content": ["w1"]}]), 400, "messages[0].content[0]",
     "a content part is an object"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(live, body, status, param, phrase):
    data = body if isinstance(body, str) else json.dumps(body)            # json.dumps writes NaN as NaN
    r = httpx.post(live.url + "/v1/chat/completions", content=data, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert phrase in err["message"] and err["type"] == "invalid_request_error"
    if param:
        assert param in (err["param"] or "")
    ok = httpx.post(live.url + "/v1/chat/completions", json={"model": "tiny", "messages": chat("w1"), "max_tokens": 2})
    assert ok.status_code == 200


def test_no_op_values_of_unsupported_parameters_are_accepted(live):
    body = {"model": "tiny", "messages": chat("w1"), "max_tokens": 2, "frequency_penalty": 0, "presence_penalty": 0.0,
            "logit_bias": {}, "response_format": {"type": "text"}, "tools": [], "best_of": 1, "user": "u1",
            "modalities": ["text"], "store": False, "service_tier": "auto", "parallel_tool_calls": True,
            "metadata": {"k": "v"}, "prompt_cache_key": "c", "safety_identifier": "s", "max_completion_tokens": 2}
    assert httpx.post(live.url + "/v1/chat/completions", json=body).status_code == 200
    streamed = {**body, "stream": True, "stream_options": {"include_usage": False, "include_obfuscation": False}}
    assert httpx.post(live.url + "/v1/chat/completions", json=streamed).status_code == 200
    for bad, param in [({"logprobs": True}, "logprobs"), ({"logprobs": 2, "echo": True}, "echo"),
                       ({"logprobs": 30}, "logprobs"), ({"suffix": "w3"}, "suffix")]:
        r = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": "w1", "max_tokens": 2, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text



@pytest.mark.parametrize("prompt,phrase", [
    ([True, False], "prompt[0] = true: a token id is an integer"),         # used to be the token ids [1, 0]
    ([[5, True]], "prompt[0][1] = true: a token id is an integer"),
    ([5, 2.0], "prompt[1] = 2.0: a token id is an integer"),
    ("w1 \ud800", "prompt holds a lone surrogate \\ud800 at character 3"),
    (["w2\udc00"], "prompt[0] holds a lone surrogate \\udc00 at character 2"),
    ({"text": "w1"}, "prompt must be a string or a list of token ids, got object"),
])
def test_bad_completion_prompts_are_named(live, prompt, phrase):
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2})         # JSON escapes the surrogates
    r = httpx.post(live.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert phrase in err["message"] and err["param"] == "prompt", err

def test_logprobs_chat_and_completions_streamed_or_not(live, folders):
    """The target's log-probs of each token (vanilla offline = speculative server), the same streamed in pieces."""
    c = client(live)
    target, _ = folders
    outs, _ = load_engine(target, Settings("float32")).generate(
        [chat(PROMPTS[2])], SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=3))
    want = outs[0].logprobs
    kw = dict(model="tiny", messages=chat(PROMPTS[2]), max_tokens=12, temperature=0, logprobs=True, top_logprobs=3,
              extra_body={"ignore_eos": True})
    r = c.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 12
    assert [e.logprob for e in content] == pytest.approx([e.logprob for e in want], abs=1e-4)
    for e, w in zip(content, want):
        assert [t.logprob for t in e.top_logprobs] == pytest.approx([lp for _, lp in w.top], abs=1e-4)
        assert e.top_logprobs[0].token == e.token and e.bytes == list(e.token.encode())
    chunks = list(c.chat.completions.create(**kw, stream=True))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    # completions: the legacy shape, offsets into the text, streamed too; echo puts the prompt first
    ckw = dict(model="tiny", prompt="w1 w2 w3", max_tokens=6, temperature=0, logprobs=2)
    lp = c.completions.create(**ckw).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(len(t) <= 2 and max(t.values()) >= v - 1e-6 for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    parts = [ch.choices[0].logprobs for ch in c.completions.create(**ckw, stream=True) if ch.choices[0].logprobs]
    assert sum((p.tokens for p in parts), []) == lp.tokens
    assert sum((p.text_offset for p in parts), []) == lp.text_offset
    plain = c.completions.create(model="tiny", prompt="w1 w2", max_tokens=3, temperature=0).choices[0].text
    echoed = c.completions.create(model="tiny", prompt="w1 w2", max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text == "w1 w2" + plain
    assert "".join(ch.choices[0].text for ch in c.completions.create(model="tiny", prompt="w1 w2", max_tokens=3,
                                                                     temperature=0, echo=True, stream=True)) == \
        "w1 w2" + plain


def test_n_choices_streamed_or_not(live):
    c = client(live)
    kw = dict(model="tiny", messages=chat(PROMPTS[3]), max_tokens=10, extra_body={"ignore_eos": True})
    one = c.chat.completions.create(**kw, temperature=0).choices[0].message.content
    r = c.chat.completions.create(**kw, temperature=0, n=3)
    assert [ch.index for ch in r.choices] == [0, 1, 2] and all(ch.message.content == one for ch in r.choices)
    assert r.usage.completion_tokens == 30 and r.model_extra["spec_stats"]["verify_steps"] >= 3
    r = c.chat.completions.create(**kw, temperature=1.0, n=4, seed=11)
    texts = [ch.message.content for ch in r.choices]
    assert len(texts) == 4 and len(set(texts)) > 1                        # each choice samples on its own
    chunks = list(c.chat.completions.create(**kw, temperature=0, n=2, stream=True,
                                            stream_options={"include_usage": True}))
    for i in (0, 1):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"
        assert "".join(x.delta.content or "" for x in mine) == one
    assert chunks[-1].usage.completion_tokens == 20
    comp = c.completions.create(model="tiny", prompt="w1 w2", max_tokens=4, temperature=0, n=2, echo=True)
    assert comp.choices[0].text == comp.choices[1].text and comp.choices[1].text.startswith("w1 w2")


def test_full_queue_answers_503_with_retry_after(folders):
    target, draft = folders
    srv = LiveServer(build_state(target, Settings("float32", draft, SPEC, None, "test", max_running=1, max_queue=1,
                                 max_len=256), model_name="tiny"))
    try:
        async def burst():
            async with httpx.AsyncClient(timeout=60) as c:
                body = {"model": "tiny", "messages": chat("w1 w2"), "max_tokens": 120, "ignore_eos": True}
                return await asyncio.gather(*[c.post(srv.url + "/v1/chat/completions", json=body) for _ in range(4)])
        codes = [r for r in asyncio.run(burst())]
        busy = [r for r in codes if r.status_code == 503]
        assert busy and all(r.status_code in (200, 503) for r in codes)
        assert busy[0].headers["Retry-After"] == "1" and busy[0].json()["error"]["code"] == "server_busy"
        assert httpx.get(srv.url + "/metrics").text.count('eagle3_requests_total{status="rejected"} ' + str(len(busy)))
        assert metric(srv.url, 'eagle3_http_responses_total{code="503"}') == len(busy)
    finally:
        srv.close()


def test_n_choices_are_queued_all_or_none(folders):
    """A response whose choices do not all fit the queue is refused whole (503) and the queued ones cancelled."""
    target, draft = folders
    srv = LiveServer(build_state(target, Settings("float32", draft, SPEC, None, "test", max_running=1, max_queue=1,
                                 max_len=256), model_name="tiny"))
    try:
        body = {"model": "tiny", "messages": chat("w1 w2"), "max_tokens": 100, "ignore_eos": True, "n": 4}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy"
        h = wait_idle(srv)
        assert h["free_rows"] == 1
        metrics = httpx.get(srv.url + "/metrics").text
        assert int(metrics.split('eagle3_requests_total{status="cancelled"} ')[1].split()[0]) >= 1
        assert 'eagle3_requests_total{status="finished"} 0' in metrics
        ok = httpx.post(srv.url + "/v1/chat/completions", json={**body, "n": 1, "max_tokens": 3}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    finally:
        srv.close()


def wait_idle(live, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        h = httpx.get(live.url + "/health").json()
        if h["free_rows"] == h["max_running"] and h["running"] == 0 and h["waiting"] == 0:
            return h
        time.sleep(0.05)
    raise AssertionError(f"server not idle: {h}")


def test_client_disconnect_cancels_and_frees_the_row(live):
    before = httpx.get(live.url + "/metrics").text
    body = {"model": "tiny", "messages": chat("w9 w8"), "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 3:
                break                                   # hang up mid-stream
    wait_idle(live)
    after = httpx.get(live.url + "/metrics").text
    count = lambda text: int(text.split('eagle3_requests_total{status="cancelled"} ')[1].split()[0])  # noqa: E731
    assert count(after) == count(before) + 1


def metric(url: str, name: str) -> int:
    """A counter of the server's /metrics (0 while it has no line)."""
    line = next((ln for ln in httpx.get(url + "/metrics").text.splitlines() if ln.startswith(name + " ")), None)
    return int(float(line.split()[-1])) if line else 0


def slow_steps(monkeypatch, sched, seconds=0.03):
    """Each scheduler step takes at least `seconds`: a request of a few hundred tokens lasts long enough to act on."""
    step = sched.step

    def slow():
        time.sleep(seconds)
        step()
    monkeypatch.setattr(sched, "step", slow)


def test_a_non_streaming_client_that_hangs_up_frees_its_row(live, monkeypatch):
    """A client that gives up on a non-streaming request has it cancelled and its row freed at once (it used to
    hold its row until max_tokens: minutes for a long answer)."""
    slow_steps(monkeypatch, live.state.scheduler)                  # 240 tokens: 2 s at least
    cancelled = 'eagle3_requests_total{status="cancelled"}'
    before = metric(live.url, cancelled)
    body = {"model": "tiny", "messages": chat("w9 w8"), "max_tokens": 240, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/v1/chat/completions", json=body, timeout=0.5)
    wait_idle(live)
    assert metric(live.url, cancelled) == before + 1


def test_stopping_the_server_answers_requests_in_flight_and_logs_no_traceback(folders, monkeypatch):
    """SIGTERM / Ctrl-C with requests generating: after the grace period each is stopped and answered (a 503, or an
    error event mid-stream) naming the shutdown, and nothing is logged as an error (uvicorn used to cancel their
    handlers and log a CancelledError traceback for each)."""
    import logging

    from sglang_eagle3.serving.server import make_server
    target, draft = folders
    state = build_state(target, Settings("float32", draft, SPEC, None, "test", max_running=4, max_queue=64, max_len=256),
                        model_name="tiny")
    slow_steps(monkeypatch, state.scheduler)
    port = free_port()
    server = make_server(state, "127.0.0.1", port, "info", grace_s=0.5)
    logged = []
    catch = logging.Handler(logging.ERROR)
    catch.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("uvicorn.error").addHandler(catch)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url, answers = f"http://127.0.0.1:{port}", {}
    body = {"model": "tiny", "messages": chat("w9 w8"), "max_tokens": 240, "ignore_eos": True}

    def plain():
        answers["plain"] = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)

    def streamed():
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
            answers["stream"] = [ln for ln in r.iter_lines() if ln]
    try:
        deadline = time.time() + 30
        while not server.started and time.time() < deadline:
            time.sleep(0.02)
        clients = [threading.Thread(target=plain), threading.Thread(target=streamed)]
        [c.start() for c in clients]
        while httpx.get(url + "/health").json()["running"] < 2 and time.time() < deadline:
            time.sleep(0.02)
        server.should_exit = True                                   # what uvicorn's SIGTERM handler does
        thread.join(timeout=30)
        [c.join(timeout=30) for c in clients]
        assert not thread.is_alive()
        r = answers["plain"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down", r.text
        assert "shutting down" in r.json()["error"]["message"]
        events = answers["stream"]
        assert events[-1] == "data: [DONE]" and "shutting down" in json.loads(events[-2][6:])["error"]["message"]
        assert logged == []
    finally:
        logging.getLogger("uvicorn.error").removeHandler(catch)
        server.should_exit = True
        thread.join(timeout=30)


def test_tokenizing_a_prompt_does_not_hold_up_other_requests(live, monkeypatch):
    """Prompts are tokenized off the event loop: /health answers while a long prompt is being tokenized (the whole
    server used to freeze for as long as that took: 38 s for a 20 MB body)."""
    from sglang_eagle3.serving import server
    real = server.encode_prompt

    def slow(tokenizer, prompt):
        time.sleep(1.5)
        return real(tokenizer, prompt)
    monkeypatch.setattr(server, "encode_prompt", slow)
    answer = {}
    asking = threading.Thread(target=lambda: answer.update(r=httpx.post(
        live.url + "/v1/chat/completions", json=ask(max_tokens=2), timeout=60)))
    asking.start()
    time.sleep(0.3)
    t0 = time.perf_counter()
    health = httpx.get(live.url + "/health", timeout=10)
    waited = time.perf_counter() - t0
    asking.join()
    assert health.status_code == 200 and waited < 0.5, waited
    assert answer["r"].status_code == 200


def test_a_body_over_the_limit_is_413_before_it_is_read(live):
    """A body over the server's limit (default: 4 MiB, or 256 bytes a token of --max-len) is refused with a 413
    naming the limit and the flag, declared or streamed in chunks; it used to be read, parsed and tokenized first."""
    big = json.dumps(ask(messages=chat("w1 " * (5 * 2 ** 20 // 3)), max_tokens=2)).encode()
    for how in ({"content": big}, {"content": iter([big[i:i + 2 ** 16] for i in range(0, len(big), 2 ** 16)])}):
        t0 = time.perf_counter()
        r = httpx.post(live.url + "/v1/chat/completions", headers={"Content-Type": "application/json"}, timeout=60,
                       **how)
        assert r.status_code == 413, r.text[:300]
        err = r.json()["error"]
        assert "exceeds this server's limit of 4194304 bytes (4 MiB; eagle3 serve --max-body-mb)" in err["message"]
        assert err["code"] == "request_too_large" and time.perf_counter() - t0 < 5
    assert httpx.post(live.url + "/v1/chat/completions", json=ask(max_tokens=2)).status_code == 200


def test_max_body_mb_sets_the_limit(folders, capsys):
    from fastapi.testclient import TestClient
    target, _ = folders
    assert eagle3_main(["serve", "--engine", "builtin", "--target", target, "--max-body-mb", "0", "--dry-run"]) == 2
    assert "--max-body-mb must be > 0, got 0" in capsys.readouterr().err
    state = build_state(target, Settings("float32", None, None, None, "test", max_running=2, max_queue=8, max_len=64),
                        "tiny", max_body_mb=0.001)
    with TestClient(create_app(state)) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "w1 " * 1000, "max_tokens": 2})
        assert r.status_code == 413 and "limit of 1049 bytes (0.001 MiB" in r.json()["error"]["message"], r.text
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "w1", "max_tokens": 2}).status_code == 200

def test_a_prompt_the_tokenizer_refuses_is_named_as_such(live, monkeypatch):
    """A completions prompt the tokenizer cannot take is "cannot tokenize the prompt" (param prompt), not a chat
    template's failure (param messages)."""
    from sglang_eagle3.serving import server

    def refuse(tokenizer, prompt):
        raise ValueError("no such characters")
    monkeypatch.setattr(server, "encode_prompt", refuse)
    r = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": "w1", "max_tokens": 2})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt" and "cannot tokenize the prompt: no such" in err["message"]
    r = httpx.post(live.url + "/v1/chat/completions", json=ask(max_tokens=2))
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages" and "cannot apply the chat template" in err["message"]

def test_every_5xx_is_counted_on_metrics(live, monkeypatch):
    """Responses by status code on /metrics: a generation that fails is a 500 counted there, as is a bug's 500."""
    fivehundreds = 'eagle3_http_responses_total{code="500"}'
    before = metric(live.url, fivehundreds)
    ok = metric(live.url, 'eagle3_http_responses_total{code="200"}')

    def broken(*a, **k):
        raise RuntimeError("a kernel failed")
    monkeypatch.setattr(live.state.scheduler.worker, "step", broken)
    r = httpx.post(live.url + "/v1/chat/completions", json=ask(max_tokens=5))
    assert r.status_code == 500 and "RuntimeError: a kernel failed" in r.json()["error"]["message"], r.text
    assert metric(live.url, fivehundreds) == before + 1
    assert metric(live.url, 'eagle3_http_responses_total{code="200"}') > ok         # /metrics itself

def test_load_200_requests_at_concurrency_32_without_leaks(live):
    import psutil
    proc = psutil.Process(os.getpid())

    async def load(n, conc):
        sem = asyncio.Semaphore(conc)
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=conc)) as c:
            async def one(i):
                async with sem:
                    body = {"model": "tiny", "messages": chat(PROMPTS[i % len(PROMPTS)]), "max_tokens": 8 + i % 9,
                            "temperature": 0 if i % 2 else 0.7, "stream": bool(i % 3 == 0)}
                    r = await c.post(live.url + "/v1/chat/completions", json=body)
                    return r.status_code
            return await asyncio.gather(*[one(i) for i in range(n)])
    asyncio.run(load(40, 32))                            # warm-up: allocator and caches reach their level
    wait_idle(live)
    rss_idle = proc.memory_info().rss
    codes = asyncio.run(load(200, 32))
    assert codes == [200] * 200
    h = wait_idle(live)
    assert h["free_rows"] == h["max_running"] == 4     # every KV row came back
    assert proc.memory_info().rss - rss_idle < 64 * 2 ** 20, "memory did not return to its idle level"


def test_bench_serving_against_live_servers(live, tmp_path, folders):
    """The serving benchmark's client on two servers (here both ours): JSON, table and plot; `--temperature default`
    sends none (the server's default applies)."""
    from sglang_eagle3.bench import report
    from sglang_eagle3.bench.serving import run
    data = tmp_path / "data" / "eval"
    data.mkdir(parents=True)
    (data / "tiny.jsonl").write_text("\n".join(json.dumps({"turns": [p]}) for p in PROMPTS) + "\n")
    out = tmp_path / "serving.json"
    assert run(["--url", f"a={live.url}/v1", "--url", f"b={live.url}/v1", "--data", str(tmp_path / "data"),
                "--datasets", "tiny", "--concurrency", "1,3", "--requests", "5", "--max-tokens", "6",
                "--temperature", "0,default", "--out", str(out)]) == 0
    r = report.read_json(str(out))
    assert r["temperatures"] == ["0", "default"] and "server default" in r["title"]
    for name in ("a", "b"):
        for t in ("0", "default"):
            for c in ("1", "3"):
                lv = r["levels"][name][t][c]
                assert lv["completed"] == 5 and lv["output_tokens"] > 0 and lv["ttft_p50_s"] > 0
                assert lv["accept_length"] >= 1.0
                steps = lv["steps"]                   # from /metrics: the rows' trees and the draft's time
                assert 0 <= steps["speculated_share"] <= 1 and steps["mean_tree"] >= 1
                assert 0 <= steps["draft_share"] < 1
    md = (tmp_path / "serving.md").read_text()
    assert "concurrency" in md and "T=0\n" in md and "T=default (none sent" in md
    assert (tmp_path / "serving.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert r["prompts_repeated"] is True                      # 3 prompts for 2 x 5 requests + warm-up


def test_bench_serving_stops_at_a_server_that_fails_every_warm_up_request(live, tmp_path, capsys):
    """A server that refuses every request (here max_tokens over its context), or a URL that is not an OpenAI API:
    one line naming the server, before any level runs and nothing written (it used to sweep every level to zeros)."""
    from sglang_eagle3.bench.serving import main
    data = tmp_path / "data" / "eval"
    data.mkdir(parents=True)
    (data / "tiny.jsonl").write_text("\n".join(json.dumps({"turns": [p]}) for p in PROMPTS) + "\n")
    out = tmp_path / "serving.json"
    common = ["--data", str(tmp_path / "data"), "--datasets", "tiny", "--concurrency", "1", "--requests", "2",
              "--out", str(out)]
    assert main(["--url", f"a={live.url}/v1", *common, "--max-tokens", "100000"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"server a ({live.url}/v1): all 4 warm-up requests failed (400:" in err and len(err.splitlines()) == 1
    assert main(["--url", f"a={live.url}", *common]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--url a={live.url}: GET {live.url}/models answered 404, not an OpenAI model list" in err, err
    assert not out.exists()


def test_bench_serving_gives_each_level_its_own_prompts():
    """A server with a pool of recent requests' text would find a repeated prompt's answer there: levels take fresh
    prompts from the front, the warm-up from the back, and repeat only when the sets run out."""
    from sglang_eagle3.bench.serving import level_prompts
    prompts = [f"p{i}" for i in range(40)]
    levels = level_prompts(prompts, [4, 8, 16], warm=4)
    flat = [p for lv in levels for p in lv]
    assert [len(lv) for lv in levels] == [4, 8, 16] and len(set(flat)) == 28
    assert not set(flat) & set(prompts[::-1][:4])                # none of the warm-up's
    again = level_prompts(prompts[:10], [4, 8], warm=2)           # 8 fresh prompts for 12 requests: wraps
    assert again[0] == prompts[:4] and again[1] == prompts[4:8] + prompts[:4]


def test_builtin_serve_uses_the_drafts_own_profile_when_the_draft_is_named(folders, tmp_path, capsys):
    import shutil
    target, draft = folders
    tuned = tmp_path / "tuned"
    shutil.copytree(draft, tuned)
    (tuned / "spec_profile.json").write_text(json.dumps({"per_batch_size": {"1": {"speculation": False}}}))
    common = ["serve", "--engine", "builtin", "--target", target, "--dtype", "float32", "--dry-run", "--skip-check"]
    assert eagle3_main([*common, "--draft", str(tuned)]) == 0                      # vanilla everywhere: no draft
    err = capsys.readouterr().err
    assert "chooses no speculation at any batch size" in err and "builtin engine, no speculation" in err
    (tuned / "spec_profile.json").write_text(json.dumps({"per_batch_size": {
        "1": {"num_steps": 2, "topk": 1, "num_draft_tokens": 3}, "4": {"speculation": False}}}))
    assert eagle3_main([*common, "--draft", str(tuned)]) == 0
    assert f"adaptive speculation from {tuned / 'spec_profile.json'}" in capsys.readouterr().err
    assert eagle3_main([*common, "--draft", str(tuned), "--num-steps", "2"]) == 0    # a tree flag wins
    assert "tree num_steps=2" in capsys.readouterr().err
    assert eagle3_main([*common, "--draft", draft]) == 0                           # no profile: the fixed tree
    assert "tree num_steps=" in capsys.readouterr().err


def test_hybrid_server_matches_vanilla_and_pools_recent_requests(folders):
    """--drafter hybrid behind the server: greedy answers equal vanilla's, concurrent requests too; a finished
    request's text joins the pool that later requests search."""
    from sglang_eagle3.engine.speculation import Drafting
    target, draft = folders
    loop = "w3 w4 w5 w6 w3 w4 w5 w6 w3 w4"
    prompts = [loop, *PROMPTS[:3]]
    van = load_engine(target, Settings("float32"))
    want = [van.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in
            van.generate([[{"role": "user", "content": p}] for p in prompts],
                         SamplingParams(max_new_tokens=12, ignore_eos=True), batch_size=1)[0]]
    settings = Settings("float32", draft, SPEC, None, "test", drafting=Drafting("hybrid", pool_tokens=4096),
                        max_running=4, max_queue=64, max_len=256)
    srv = LiveServer(build_state(target, settings, model_name="tiny"))
    try:
        def ask(p):
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
                "model": "tiny", "messages": [{"role": "user", "content": p}], "max_tokens": 12, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]
        assert [ask(p) for p in prompts] == want
        with ThreadPoolExecutor(4) as ex:
            assert list(ex.map(ask, prompts)) == want
        pool = srv.state.scheduler.context.pool
        assert len(pool.streams) >= len(prompts) and pool.total <= 4096
    finally:
        srv.close()


def test_a_server_started_on_an_all_zero_step_cost_cache_answers_chat(folders, tmp_path, monkeypatch, capsys):
    """`serve --tree auto` on a cache of zero costs answered every chat request 500 (a division by zero in the
    planner) while /health said ok: the cache is measured again at start-up, said in one line."""
    from sglang_eagle3.engine.speculation import Drafting
    target, draft = folders
    fake_step_costs(monkeypatch, tmp_path)
    settings = Settings("float32", draft, SPEC, None, "test", drafting=Drafting("hybrid", "auto", max_nodes=8),
                        max_running=2, max_queue=8, max_len=256)
    build_state(target, settings, model_name="tiny")      # measured, cached
    (file,) = (tmp_path / "step_costs").iterdir()
    costs = json.loads(file.read_text())
    costs["verify"] = {b: {t: 0.0 for t in row} for b, row in costs["verify"].items()}
    file.write_text(json.dumps(costs))
    capsys.readouterr()
    srv = LiveServer(build_state(target, settings, model_name="tiny"))
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "w3 w4 w3 w4"}], "max_tokens": 6})
        assert r.status_code == 200, r.text
    finally:
        srv.close()
    warned = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and f"{file}: verify[1][1] = 0.0 is not a positive" in warned[0]


# ---- misuse of the HTTP layer: OpenAI-shaped errors everywhere, never a 5xx for a client's mistake ---------
@pytest.mark.parametrize("method,path,kw,status,phrase", [
    ("GET", "/v1/chat/completions", {}, 405, "GET /v1/chat/completions: method not allowed; use POST"),
    ("POST", "/v1/models", {"json": {}}, 405, "method not allowed; use GET"),
    ("GET", "/v1/nothing", {}, 404, "no such route: GET /v1/nothing"),
    ("POST", "/v1/chat/completions", {"content": json.dumps({"model": "tiny", "messages": [{"role": "user",
                                                                                           "content": "w1"}]}),
                                      "headers": {"Content-Type": "text/plain"}}, 415,
     "Content-Type must be application/json, got text/plain"),
    ("POST", "/v1/completions", {"content": b'{"model": "tiny", "prompt": "w1"}',
                                 "headers": {"Content-Type": "application/x-www-form-urlencoded"}}, 415,
     "Content-Type must be application/json"),
    ("POST", "/v1/completions", {"content": b'\xff\xfe{"model": "tiny"}', "headers": {"Content-Type": "application/json"}},
     400, "request body is not valid JSON (UTF-8)"),
])
def test_routes_methods_and_bodies_get_openai_errors(live, method, path, kw, status, phrase):
    r = httpx.request(method, live.url + path, **kw)
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and phrase in body["error"]["message"], body
    assert body["error"]["type"] == "invalid_request_error"


def test_max_tokens_over_the_servers_max_len_names_it(live):
    """The live server holds 256 tokens a request (--max-len) of the target's 512-token context: a request over
    256 is refused naming --max-len, not the target's context; a default max_tokens fits in what is left."""
    r = httpx.post(live.url + "/v1/chat/completions", json={"model": "tiny", "messages": chat("w1"),
                                                              "max_tokens": 10 ** 9})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "exceeds the 256 tokens a request may hold here (max_len: eagle3 serve --max-len; " \
        "the target's context is 512)" in msg, msg
    long = " ".join(["w3"] * 200)
    r = httpx.post(live.url + "/v1/chat/completions", json={"model": "tiny", "messages": chat(long),
                                                              "extra": 1, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["total_tokens"] + SPEC.num_draft_tokens <= 256


def test_a_server_failure_is_an_openai_500_and_counted(live, monkeypatch):
    from sglang_eagle3.serving import server

    def boom(*a, **k):
        raise RuntimeError("a bug")
    errors = lambda: int(next(ln for ln in httpx.get(live.url + "/metrics").text.splitlines()  # noqa: E731
                              if ln.startswith('eagle3_requests_total{status="error"}')).split()[-1])
    before = errors()
    monkeypatch.setattr(server, "sampling_params", boom)
    r = httpx.post(live.url + "/v1/chat/completions", json={"model": "tiny", "messages": chat("w1")})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
    assert "RuntimeError: a bug" in r.json()["error"]["message"]
    assert errors() == before + 1
    monkeypatch.undo()
    assert httpx.post(live.url + "/v1/chat/completions", json={"model": "tiny", "messages": chat("w1"),
                                                               "max_tokens": 2}).status_code == 200


def test_any_seed_is_a_seed(live):
    """OpenAI's seed is any integer: one past torch's 64 bits (and, for n > 1, the choices' derived seeds) used to
    be a 500; the same seed repeats its answer."""
    body = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 4, "temperature": 1.0, "n": 2, "seed": 10 ** 25}
    a = httpx.post(live.url + "/v1/completions", json=body)
    b = httpx.post(live.url + "/v1/completions", json=body)
    assert a.status_code == 200, a.text
    assert [c["text"] for c in a.json()["choices"]] == [c["text"] for c in b.json()["choices"]]


def test_the_server_loads_and_steps_its_engine_on_one_thread(folders, monkeypatch):
    """build_state loads the models on the engine thread, and the scheduler's loop runs on that same thread (a second
    thread running torch would start a second OpenMP team: a step 40% slower on 2 cores); a failing task reaches
    whoever waits on it, and the thread goes on."""
    import sglang_eagle3.engine.loader as loader_mod
    from sglang_eagle3.engine.scheduler import Scheduler
    from sglang_eagle3.serving.server import EngineThread
    seen = {}
    real_load, real_loop = loader_mod.load_engine, Scheduler.serve_forever
    monkeypatch.setattr(loader_mod, "load_engine",
                        lambda *a: seen.setdefault("load", threading.get_ident()) and real_load(*a))
    monkeypatch.setattr(Scheduler, "serve_forever",
                        lambda self: seen.setdefault("loop", threading.get_ident()) and real_loop(self))
    target, _ = folders
    state = build_state(target, Settings("float32", None, None, None, "test", max_running=1, max_queue=1, max_len=64))
    state.start()
    deadline = time.time() + 10
    while "loop" not in seen and time.time() < deadline:
        time.sleep(0.01)
    state.stop()
    assert seen["load"] == seen["loop"] != threading.get_ident()
    worker = EngineThread()
    with pytest.raises(ZeroDivisionError):
        worker.submit(lambda: 1 / 0).result(timeout=10)
    assert worker.submit(lambda: 6 * 7).result(timeout=10) == 42
