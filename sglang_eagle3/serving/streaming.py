"""A streamed response (stream=true) as server-sent events.

Each choice opens with a chunk (chat: the assistant's role; completions: the prompt when echo=true), then one chunk
per text delta with the log-probs of its tokens, then a chunk with its finish_reason (`spec_stats` over every choice
on the last choice to finish); then a usage chunk when stream_options.include_usage asks for it, and
`data: [DONE]`. A choice that fails, or the server shutting down, ends the stream with an error event, then
`data: [DONE]`. However the stream ends (the client hanging up included), `on_end` runs.
"""
from __future__ import annotations

import json
import time
from typing import AsyncIterator, Awaitable, Callable, Optional

from sglang_eagle3.engine.scheduler import Request
from sglang_eagle3.serving.openai_protocol import (
    APIError,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    reported_logprobs,
    spec_stats,
    usage,
)
from sglang_eagle3.serving.responses import ResponseInfo, generation_failed

DONE = "data: [DONE]\n\n"
Delta = tuple[int, str, bool, int]    # choice index, its new text, its request finished, log-prob entries to show


# Characters JSON leaves raw outside ASCII that line-splitting clients (Python's str.splitlines, httpx's aiter_lines)
# take for line ends: inside an event they would cut its data line in two.
LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def event(body: dict, ensure_ascii: bool = True) -> str:
    """One SSE event; ensure_ascii=False keeps text as UTF-8, with the line-breaking characters still escaped."""
    data = json.dumps(body, ensure_ascii=ensure_ascii)
    return f"data: {data if ensure_ascii else data.translate(LINE_BREAKS)}\n\n"


class Chunks:
    """The chunk events of one streamed response, each with its id, object, created time and model."""

    def __init__(self, info: ResponseInfo):
        self.chat = info.chat
        self.head = {"id": info.id, "object": "chat.completion.chunk" if info.chat else "text_completion",
                     "created": int(time.time()), "model": info.model}

    def choice(self, index: int, text: str = "", reason: Optional[str] = None, logprobs: Optional[dict] = None,
               extra: Optional[dict] = None, role: bool = False) -> str:
        """role: chat's opening chunk (the assistant's role, no text)."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else {"content": text} if text else {}
            choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}
        return event({**self.head, "choices": [choice], **(extra or {})}, ensure_ascii=False)

    def usage(self, reqs: list[Request]) -> str:
        return event({**self.head, "choices": [], "usage": usage(reqs)})


class StreamedLogprobs:
    """One choice's log-probs streamed in pieces: each piece the entries not sent yet (completions: their
    text_offset going on from where the previous piece's text ended)."""

    def __init__(self, info: ResponseInfo, req: Request):
        self.info, self.req = info, req
        self.sent = self.chars = 0              # entries streamed, the length of their text

    def upto(self, n: int) -> Optional[dict]:
        """The entries from the last sent up to n (None if there are none, or none were asked for)."""
        if self.req.output_logprobs is None or n <= self.sent:
            return None
        entries, self.sent = self.req.output_logprobs[self.sent:n], n
        if self.info.chat:
            return chat_logprobs(self.info.tokenizer, entries)
        out = completion_logprobs(self.info.tokenizer, entries, self.chars)
        self.chars = out["text_offset"][-1] + len(out["tokens"][-1])     # where the next piece starts
        return out


async def stream_events(info: ResponseInfo, reqs: list[Request], receive: Callable[[], Awaitable[Delta]],
                        include_usage: bool, on_end: Callable[[], None]) -> AsyncIterator[str]:
    """The events of a response whose requests (one per choice) report their deltas through receive, which raises
    an APIError when the server stops them."""
    chunks = Chunks(info)
    logprobs = [StreamedLogprobs(info, req) for req in reqs]
    try:
        if info.chat or info.echo:
            for i in range(len(reqs)):
                yield chunks.choice(i, info.echo, role=info.chat)
        open_choices = set(range(len(reqs)))
        while open_choices:
            try:
                i, text, finished, reported = await receive()
            except APIError as e:                       # shutting down
                yield event(e.body())
                break
            req = reqs[i]
            if text:
                yield chunks.choice(i, text, logprobs=logprobs[i].upto(reported))
            if not (finished and req.done.is_set() and i in open_choices):
                continue
            open_choices.discard(i)
            if req.finish_reason == "error":
                yield event(generation_failed(req).body())
                break
            last = not open_choices
            yield chunks.choice(i, reason=finish_reason(req), logprobs=logprobs[i].upto(reported_logprobs(req)),
                                extra={"spec_stats": spec_stats(reqs)} if last else None)
        else:
            if include_usage:
                yield chunks.usage(reqs)
        yield DONE
    finally:
        on_end()                                # a client gone mid-stream, a failed choice, shutdown: cancels the rest
