"""A response once its requests (one per choice) have finished, when not streamed: chat.completion or
text_completion in OpenAI's shape, with usage and the speculative statistics (`spec_stats`)."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

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


@dataclass(frozen=True)
class ResponseInfo:
    """What every body of one response is built with, streamed or not."""
    id: str                 # chatcmpl-... or cmpl-...
    chat: bool              # /v1/chat/completions (else /v1/completions)
    model: str
    tokenizer: Any          # decodes the tokens of the log-probs
    echo: str = ""          # completions with echo=true: the prompt, before each choice's text


def response_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def generation_failed(req: Request) -> APIError:
    """The 500 of a choice the engine failed."""
    return APIError(500, f"generation failed: {req.error}", None, None, "server_error")


def response_body(info: ResponseInfo, reqs: list[Request]) -> dict:
    """The body of a response whose requests have all finished; a failed one makes it the 500 of the first."""
    failed = next((r for r in reqs if r.finish_reason == "error"), None)
    if failed:
        raise generation_failed(failed)
    return {"id": info.id, "object": "chat.completion" if info.chat else "text_completion",
            "created": int(time.time()), "model": info.model,
            "choices": [choice_body(info, i, req) for i, req in enumerate(reqs)], "usage": usage(reqs),
            "spec_stats": spec_stats(reqs)}


def choice_body(info: ResponseInfo, index: int, req: Request) -> dict:
    choice = {"index": index, "finish_reason": finish_reason(req), "logprobs": choice_logprobs(info, req)}
    if info.chat:
        choice["message"] = {"role": "assistant", "content": req.text}
    else:
        choice["text"] = info.echo + req.text
    return choice


def choice_logprobs(info: ResponseInfo, req: Request) -> Optional[dict]:
    """The log-probs of a finished choice (all its tokens but an EOS that ended it), None unless asked for."""
    if req.output_logprobs is None:
        return None
    entries = req.output_logprobs[:reported_logprobs(req)]
    return (chat_logprobs if info.chat else completion_logprobs)(info.tokenizer, entries)
