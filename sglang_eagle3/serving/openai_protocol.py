"""The OpenAI API as the builtin server speaks it: request models, their checks, and the response pieces.

Parameters this server cannot honour are refused with a 400 naming them when set to anything but their no-op
value (a frequency penalty, a logit bias, tools, a JSON response format, ...): a silently ignored parameter
would return something other than what the client asked for. `logprobs` are the target's log-probabilities of
the emitted tokens from the raw logits (before temperature, top-k and top-p), one entry per completion token
but the EOS token that ended it, each with up to 20 alternatives.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict

from sglang_eagle3.engine.scheduler import Request
from sglang_eagle3.engine.verify import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprob

DEFAULT_MAX_TOKENS = 512          # when a request gives none (OpenAI's chat API: up to the context)
MAX_CHOICES = 16                  # n: choices per request, each decoded as a request of its own


# ---- request models ---------------------------------------------------------------------------
class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                               # extension (as SGLang and vLLM accept it)
    n: int = 1
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[dict] = None
    ignore_eos: bool = False                     # extension, for benchmarks
    logprobs: Optional[Union[bool, int]] = None  # chat: true/false; completions: how many top tokens (0-20)
    top_logprobs: Optional[int] = None           # chat: how many top tokens (0-20)
    # refused unless at their no-op values (see NO_OP_VALUES)
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_p: Optional[float] = None
    min_tokens: Optional[int] = None
    best_of: Optional[int] = None
    logit_bias: Optional[dict] = None
    response_format: Optional[dict] = None
    tools: Optional[list] = None
    tool_choice: Optional[Any] = None
    functions: Optional[list] = None
    function_call: Optional[Any] = None
    suffix: Optional[str] = None


NO_OP_VALUES = {"presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "min_p": (0,),
                "min_tokens": (0,), "best_of": (1,), "logit_bias": ({},), "tools": ([],), "functions": ([],),
                "tool_choice": ("none",), "function_call": ("none",), "suffix": ("",),
                "response_format": ({"type": "text"},)}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: Optional[Union[str, list[dict]]] = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error", headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ---- checks -------------------------------------------------------------------------------------
def check_supported(body: _Sampling) -> None:
    """400 for a parameter set to a value this server would ignore."""
    for name, no_op in NO_OP_VALUES.items():
        value = getattr(body, name)
        if value is not None and value not in no_op:
            raise APIError(400, f"{name}={value!r} is not supported by this server (only {no_op[0]!r}); it is "
                                "refused rather than ignored", name)


def requested_top_logprobs(body: _Sampling, chat: bool) -> Optional[int]:
    """How many top tokens each log-prob entry lists, or None when the request asks for no log-probs."""
    if chat:
        if body.top_logprobs is not None and body.logprobs is not True:
            raise APIError(400, "top_logprobs requires logprobs=true", "top_logprobs")
        if body.logprobs not in (None, True, False):
            raise APIError(400, f"logprobs must be true or false on /v1/chat/completions, got {body.logprobs!r}",
                           "logprobs")
        top, param = (body.top_logprobs or 0, "top_logprobs") if body.logprobs else (None, None)
    else:
        if body.top_logprobs is not None:
            raise APIError(400, "top_logprobs is a chat parameter; /v1/completions takes logprobs=N", "top_logprobs")
        if isinstance(body.logprobs, bool):
            raise APIError(400, f"logprobs must be an integer (0-{MAX_TOP_LOGPROBS}) on /v1/completions, got "
                                f"{body.logprobs!r}", "logprobs")
        top, param = body.logprobs, "logprobs"
        if top is not None and getattr(body, "echo", False):
            raise APIError(400, "echo with logprobs is not supported (no prompt log-probs)", "echo")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise APIError(400, f"{param} must be in [0, {MAX_TOP_LOGPROBS}], got {top}", param)
    return top


def sampling_params(body: _Sampling, prompt_len: int, room: int, chat: bool = True) -> SamplingParams:
    """room: the tokens a request may hold beside its draft slots (a default max_tokens fits in it)."""
    if not 1 <= body.n <= MAX_CHOICES:
        raise APIError(400, f"n must be in [1, {MAX_CHOICES}], got {body.n}", "n")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")
    check_supported(body)
    top_logprobs = requested_top_logprobs(body, chat)
    given = getattr(body, "max_completion_tokens", None)
    param = "max_completion_tokens" if given is not None else "max_tokens"
    max_tokens = given if given is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = max(1, min(DEFAULT_MAX_TOKENS, room - prompt_len))
    if max_tokens < 1:
        raise APIError(400, f"{param} must be >= 1, got {max_tokens}", param)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    try:
        return SamplingParams(max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                              top_k=body.top_k, stop=stop, ignore_eos=body.ignore_eos, seed=body.seed,
                              logprobs=top_logprobs)
    except ValueError as e:
        param = next((p for p in ("temperature", "top_p", "top_k", "stop") if p in str(e)), None)
        raise APIError(400, str(e), param) from None


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One SamplingParams per choice: choice 0 as asked, choice i > 0 with its own seed derived from the request's
    (unseeded choices draw their own), so that n sampled choices differ and a seeded request repeats."""
    return [params if i == 0 else params.derived(i) for i in range(n)]


def chat_prompt(body: ChatRequest) -> list[dict]:
    if not body.messages:
        raise APIError(400, "messages must be a non-empty list", "messages")
    msgs = []
    for i, m in enumerate(body.messages):
        if m.role not in ("system", "user", "assistant", "developer"):
            raise APIError(400, f"messages[{i}].role={m.role!r}: expected system, user or assistant",
                           f"messages[{i}].role")
        msgs.append({"role": "system" if m.role == "developer" else m.role, "content": message_text(i, m)})
    return msgs


def message_text(i: int, m: ChatMessage) -> str:
    """The text of messages[i]: a string, or OpenAI content parts of type text (each with a string `text`). A user
    message without text (content missing, null, [] or blank) is refused: the answer would be to an empty prompt."""
    where = f"messages[{i}].content"
    content = m.content
    if content is None:
        raise APIError(400, f"{where} is {'null' if 'content' in m.model_fields_set else 'missing'}: every message "
                            "needs its text", where)
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.get("type") != "text":
                raise APIError(400, f"{where}[{j}]: only text parts are supported, got type {part.get('type')!r}",
                               f"{where}[{j}].type")
            if not isinstance(part.get("text"), str):
                text = part.get("text")
                got = "missing" if "text" not in part else "null" if text is None else f"{json_type(text)} {text!r}"
                raise APIError(400, f"{where}[{j}].text must be a string, got {got}", f"{where}[{j}].text")
            texts.append(part["text"])
        content = "".join(texts)
    if m.role == "user" and not content.strip():
        raise APIError(400, f"{where} has no text: a user message needs some", where)
    return content


def json_type(value: Any) -> str:
    return {type(None): "null", bool: "boolean", int: "number", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(value), type(value).__name__)


# ---- response pieces ----------------------------------------------------------------------------
def spec_stats(reqs: list[Request]) -> dict:
    """Over the choices of one response: tokens per target forward, forwards, tokens that were draft tokens."""
    tokens, steps = sum(len(r.output_ids) for r in reqs), sum(r.verify_steps for r in reqs)
    return {"accept_length": round(tokens / max(1, steps), 4), "verify_steps": steps,
            "accepted_draft_tokens": tokens - steps}


def usage(reqs: list[Request]) -> dict:
    """The prompt once, the completion tokens of every choice."""
    prompt, completion = len(reqs[0].prompt_ids), sum(len(r.output_ids) for r in reqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def finish_reason(req: Request) -> str:
    return {"eos": "stop", "stop": "stop", "length": "length"}.get(req.finish_reason, req.finish_reason or "stop")


def reported_logprobs(req: Request) -> int:
    """How many of the request's log-prob entries a response shows now: all but the EOS token that ended it."""
    n = len(req.output_logprobs or ())
    return n - 1 if req.finish_reason == "eos" and n else n


def chat_logprobs(tokenizer, entries: list[TokenLogprob]) -> dict:
    def one(token: int, logprob: float) -> dict:
        text = tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries]}


def completion_logprobs(tokenizer, entries: list[TokenLogprob], text_offset: int = 0) -> dict:
    """The legacy completions shape; text_offset: where the first token starts in the completion's text."""
    tokens = [tokenizer.decode([e.token]) for e in entries]
    offsets = list(accumulate((len(t) for t in tokens[:-1]), initial=text_offset)) if tokens else []
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in e.top} for e in entries], "text_offset": offsets}
