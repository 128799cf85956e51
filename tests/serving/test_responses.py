"""The server's response bodies and its server-sent events, built from scheduler Requests directly (no model, no
HTTP): a stub tokenizer that decodes token t as " w<t>", requests finished by hand, deltas scripted."""
from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from sglang_eagle3.engine.scheduler import Request
from sglang_eagle3.engine.verify import SamplingParams, TokenLogprob
from sglang_eagle3.serving.openai_protocol import APIError
from sglang_eagle3.serving.responses import ResponseInfo, response_body
from sglang_eagle3.serving.server import SHUTTING_DOWN, end_response, next_delta, shutting_down
from sglang_eagle3.serving.streaming import DONE, stream_events

NOW = 1700000000


class Words:
    def decode(self, ids):
        return "".join(f" w{t}" for t in ids)


def request(ids, text, reason="length", steps=1, logprobs=None, error=None, done=True) -> Request:
    """A request over the prompt [1, 2, 3] that produced ids (as text) in `steps` target forwards."""
    req = Request([1, 2, 3], SamplingParams(max_new_tokens=8))
    req.output_ids, req.text, req.finish_reason, req.error = list(ids), text, reason, error
    req.accept_lengths = [len(ids) // steps] * steps
    req.output_logprobs = logprobs
    if done:
        req.done.set()
    return req


def entries(*tokens) -> list[TokenLogprob]:
    return [TokenLogprob(t, -0.5 * t, [(t, -0.5 * t), (9, -4.0)]) for t in tokens]


def info(chat=True, echo="") -> ResponseInfo:
    return ResponseInfo("chatcmpl-1" if chat else "cmpl-1", chat, "tïny", Words(), echo)


@pytest.fixture(autouse=True)
def frozen_clock(monkeypatch):
    monkeypatch.setattr(time, "time", lambda: NOW + 0.7)


# ---- finished responses -------------------------------------------------------------------------
def test_a_chat_body_has_each_choice_its_logprobs_but_the_eos_usage_and_spec_stats():
    eos = request([5, 2], " w5", "eos", logprobs=entries(5, 2))
    long = request([6, 7, 8, 6], " w6 w7 w8 w6", "length", steps=2, logprobs=entries(6, 7, 8, 6))
    body = response_body(info(), [eos, long])
    one = lambda t: {"token": f" w{t}", "logprob": -0.5 * t, "bytes": list(f" w{t}".encode())}  # noqa: E731
    assert body == {
        "id": "chatcmpl-1", "object": "chat.completion", "created": NOW, "model": "tïny",
        "choices": [
            {"index": 0, "finish_reason": "stop",
             "logprobs": {"content": [{**one(5), "top_logprobs": [one(5), {**one(9), "logprob": -4.0}]}]},
             "message": {"role": "assistant", "content": " w5"}},
            {"index": 1, "finish_reason": "length",
             "logprobs": {"content": [{**one(t), "top_logprobs": [one(t), {**one(9), "logprob": -4.0}]}
                                      for t in (6, 7, 8, 6)]},
             "message": {"role": "assistant", "content": " w6 w7 w8 w6"}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9},
        "spec_stats": {"accept_length": 2.0, "verify_steps": 3, "accepted_draft_tokens": 3}}


def test_a_completions_body_echoes_the_prompt_and_offsets_its_logprobs():
    body = response_body(info(chat=False, echo="w1 w2"), [request([5, 6], " w5 w6", "stop", logprobs=entries(5, 6)),
                                                          request([7], " w7")])
    assert body["object"] == "text_completion" and body["id"] == "cmpl-1"
    first, second = body["choices"]
    assert first["text"] == "w1 w2 w5 w6" and second["text"] == "w1 w2 w7" and first["finish_reason"] == "stop"
    assert first["logprobs"] == {"tokens": [" w5", " w6"], "token_logprobs": [-2.5, -3.0],
                                 "top_logprobs": [{" w5": -2.5, " w9": -4.0}, {" w6": -3.0, " w9": -4.0}],
                                 "text_offset": [0, 3]}
    assert second["logprobs"] is None                                   # not asked for
    assert list(first) == ["index", "finish_reason", "logprobs", "text"]


def test_a_failed_choice_makes_the_body_a_500():
    reqs = [request([5], " w5"), request([], "", "error", error="RuntimeError: a kernel failed")]
    with pytest.raises(APIError) as e:
        response_body(info(), reqs)
    assert e.value.status == 500 and e.value.body() == {"error": {
        "message": "generation failed: RuntimeError: a kernel failed", "type": "server_error", "param": None,
        "code": None}}


# ---- streamed responses -------------------------------------------------------------------------
def scripted(*items):
    """receive() for stream_events: each call the next delta, or raises it if it is an exception."""
    queue = iter(items)

    async def receive():
        item = next(queue)
        if isinstance(item, Exception):
            raise item
        return item
    return receive


def run(info, reqs, receive, include_usage=False) -> tuple[list[str], list[str]]:
    """The stream's events, and what on_end was called with (once, at the end)."""
    ended = []

    async def collect():
        return [e async for e in stream_events(info, reqs, receive, include_usage, lambda: ended.append("ended"))]
    return asyncio.run(collect()), ended


def bodies(events: list[str]) -> list:
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
    return [e[6:-2] if e == DONE else json.loads(e[6:-2]) for e in events]


def test_a_chat_stream_is_role_deltas_finish_usage_and_done():
    req = request([5, 6], " w5 w6", steps=1)
    events, ended = run(info(), [req], scripted((0, " w5", False, 0), (0, " w6", False, 0), (0, "", True, 0)),
                        include_usage=True)
    assert events[0] == ('data: {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, '
                         '"model": "tïny", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, '
                         '"finish_reason": null, "logprobs": null}]}\n\n')
    assert events[-2] == ('data: {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, '
                          '"model": "t\\u00efny", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, '
                          '"total_tokens": 5}}\n\n')
    assert events[-1] == "data: [DONE]\n\n" and ended == ["ended"]
    choices = [b["choices"][0] for b in bodies(events)[1:4]]
    assert choices == [{"index": 0, "delta": {"content": " w5"}, "finish_reason": None, "logprobs": None},
                       {"index": 0, "delta": {"content": " w6"}, "finish_reason": None, "logprobs": None},
                       {"index": 0, "delta": {}, "finish_reason": "length", "logprobs": None}]
    assert bodies(events)[3]["spec_stats"] == {"accept_length": 2.0, "verify_steps": 1, "accepted_draft_tokens": 1}
    assert "usage" not in bodies(events)[3] and len(events) == 6


def test_a_completions_stream_echoes_then_sends_each_choices_logprobs_in_pieces():
    """n=2, interleaved: each piece's text_offset goes on from the last; the finish chunk carries what is left
    (the EOS token's entry never); spec_stats only on the last choice to finish; no usage unless asked."""
    full = request([5, 6, 7], " w5 w6 w7", logprobs=entries(5, 6, 7))
    eos = request([8, 2], " w8", "eos", logprobs=entries(8, 2))
    events, ended = run(info(chat=False, echo="w1 w2"), [full, eos], scripted(
        (0, " w5", False, 1), (1, " w8", False, 1), (0, " w6", False, 2), (1, "", True, 1), (0, " w7", True, 2),
        (0, "", True, 3)))
    out = bodies(events)
    assert out[-1] == "[DONE]" and ended == ["ended"]
    texts = [(b["choices"][0]["index"], b["choices"][0]["text"], b["choices"][0]["finish_reason"]) for b in out[:-1]]
    assert texts == [(0, "w1 w2", None), (1, "w1 w2", None), (0, " w5", None), (1, " w8", None), (0, " w6", None),
                     (1, "", "stop"), (0, " w7", None), (0, "", "length")]
    pieces = [b["choices"][0]["logprobs"] for b in out[:-1]]
    assert pieces[:2] == [None, None] and pieces[5] is None and pieces[6] is None
    assert [(p["tokens"], p["text_offset"]) for p in pieces[2:5]] == [([" w5"], [0]), ([" w8"], [0]), ([" w6"], [3])]
    assert pieces[7] == {"tokens": [" w7"], "token_logprobs": [-3.5], "top_logprobs": [{" w7": -3.5, " w9": -4.0}],
                         "text_offset": [6]}
    assert [("spec_stats" in b) for b in out[:-1]] == [False] * 7 + [True]
    assert all(b["object"] == "text_completion" and b["id"] == "cmpl-1" for b in out[:-1])


def test_a_delta_with_unicode_line_separators_stays_one_data_line():
    """Text holding characters that line-splitting clients take for line ends (U+2028, U+2029, NEL: sampled text
    can hold them) is escaped, the rest stays UTF-8: each event is one `data:` line however a client splits it
    (httpx's aiter_lines, Python's splitlines), and it decodes to the text."""
    text = " a\u2028b\x85c\u2029 é"
    events, _ = run(info(), [request([5], text)], scripted((0, text, True, 0)), include_usage=False)
    delta = next(e for e in events if "delta" in e and text[:2] in e)
    assert "é" in delta and len(delta.splitlines()) == 2 and delta.splitlines()[1] == ""
    assert json.loads(delta.splitlines()[0][6:])["choices"][0]["delta"]["content"] == text


def test_a_failed_choice_ends_the_stream_with_an_error_event():
    ok = request([5], " w5", done=False)
    failed = request([], "", "error", error="RuntimeError: a kernel failed")
    events, ended = run(info(), [ok, failed], scripted((0, " w5", False, 0), (1, "", True, 0)), include_usage=True)
    assert events[-2:] == ['data: {"error": {"message": "generation failed: RuntimeError: a kernel failed", '
                           '"type": "server_error", "param": null, "code": null}}\n\n', DONE]
    assert len(events) == 5 and ended == ["ended"]                       # 2 roles, a delta: no usage


def test_shutdown_ends_the_stream_with_its_503_event():
    events, ended = run(info(), [request([5], " w5", done=False)], scripted((0, " w5", False, 0), shutting_down()),
                        include_usage=True)
    assert events[-2:] == [f"data: {json.dumps(shutting_down().body())}\n\n", DONE] and ended == ["ended"]
    assert "shutting down" in events[-2]


def test_a_client_that_hangs_up_mid_stream_ends_it():
    """The server cancels the task that reads the stream when the client disconnects: on_end runs there."""
    ended, events, deltas = [], [], [(0, " w5", False, 0)]

    async def receive():
        if deltas:
            return deltas.pop()
        await asyncio.Event().wait()                                   # generating, never finishes

    async def main():
        stream = stream_events(info(), [request([5], " w5", done=False)], receive, True, lambda: ended.append(1))
        reading = asyncio.ensure_future(_read(stream, events))
        while len(events) < 2:
            await asyncio.sleep(0)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
    asyncio.run(main())
    assert len(events) == 2 and ended == [1]


async def _read(stream, events):
    async for e in stream:
        events.append(e)


# ---- the server's side of a response's queue ----------------------------------------------------------
def test_shutdown_on_the_queue_is_raised_as_the_503_and_a_response_that_ends_cancels_what_still_runs():
    async def main():
        queue = asyncio.Queue()
        queue.put_nowait((0, " w5", False, 0))
        queue.put_nowait(SHUTTING_DOWN)
        assert await next_delta(queue) == (0, " w5", False, 0)
        with pytest.raises(APIError) as e:
            await next_delta(queue)
        return queue, e.value
    queue, err = asyncio.run(main())
    assert err.status == 503 and err.code == "server_shutting_down"
    running, finished = request([5], " w5", done=False), request([6], " w6")
    cancelled = []
    state = SimpleNamespace(responses={queue: [running, finished]}, scheduler=SimpleNamespace(cancel=cancelled.append))
    end_response(state, [running, finished], queue)
    assert state.responses == {} and cancelled == [running]
