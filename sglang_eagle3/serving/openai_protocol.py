"""The OpenAI API as the builtin server speaks it: request models, their checks, and the response pieces.

OpenAI's chat and completions parameters, one by one:
- honoured: model, messages / prompt, max_tokens / max_completion_tokens, temperature, top_p, n, stop, seed,
  stream, stream_options.include_usage, logprobs, top_logprobs, echo; extensions top_k and ignore_eos.
- accepted and ignored, as they change nothing in the answer: user, metadata, prompt_cache_key, safety_identifier,
  parallel_tool_calls (tools are refused), stream_options.include_obfuscation, store=false, service_tier auto or
  default, modalities ["text"]. Fields OpenAI does not define are ignored too, as SGLang and vLLM ignore them.
- refused with a 400 naming them unless at their no-op value (NO_OP_VALUES): penalties, logit_bias, tools,
  functions, a JSON response_format, best_of, suffix, min_p, min_tokens, prediction, audio (and modalities with
  it), reasoning_effort, verbosity, web_search_options, store=true, another service_tier: a silently ignored
  parameter would return something other than what the client asked for.
Numbers and booleans are taken as JSON types them: `true` is not 1, "3" is not 3. `logprobs` are the target's
log-probabilities of the emitted tokens from the raw logits (before temperature, top-k and top-p), one entry per
completion token but the EOS token that ended it, each with up to 20 alternatives.
"""
from __future__ import annotations

import json
from itertools import accumulate
from typing import Annotated, Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Strict, StrictBool, StrictInt

from sglang_eagle3.engine.scheduler import Request
from sglang_eagle3.engine.verify import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprob

DEFAULT_MAX_TOKENS = 512          # when a request gives none (OpenAI's chat API: up to the context)
MAX_CHOICES = 16                  # n: choices per request, each decoded as a request of its own
Number = Annotated[float, Strict()]                    # a JSON number: an int is one, a boolean or a string is not
TEXT_PART = '{"type": "text", "text": ...}'           # the content part this server reads
STREAM_OPTIONS = ("include_usage", "include_obfuscation")      # the second pads chunks against side channels: none here


# ---- request models ---------------------------------------------------------------------------
class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: Optional[StrictInt] = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: StrictInt = 0                         # extension (as SGLang and vLLM accept it)
    n: StrictInt = 1
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[StrictInt] = None
    stream: StrictBool = False
    stream_options: Optional[dict] = None        # checked by include_usage
    ignore_eos: StrictBool = False               # extension, for benchmarks
    logprobs: Optional[Union[StrictBool, StrictInt]] = None  # chat: true/false; completions: top tokens (0-20)
    top_logprobs: Optional[StrictInt] = None     # chat: how many top tokens (0-20)
    # accepted and ignored: nothing in the answer depends on them
    user: Optional[str] = None
    metadata: Optional[dict] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    parallel_tool_calls: Optional[StrictBool] = None
    # refused unless at their no-op values (see NO_OP_VALUES)
    presence_penalty: Optional[Number] = None
    frequency_penalty: Optional[Number] = None
    repetition_penalty: Optional[Number] = None
    min_p: Optional[Number] = None
    min_tokens: Optional[StrictInt] = None
    best_of: Optional[StrictInt] = None
    logit_bias: Optional[dict] = None
    response_format: Optional[dict] = None
    tools: Optional[list] = None
    tool_choice: Optional[Any] = None
    functions: Optional[list] = None
    function_call: Optional[Any] = None
    suffix: Optional[str] = None
    prediction: Optional[Any] = None
    modalities: Optional[Any] = None
    audio: Optional[Any] = None
    reasoning_effort: Optional[Any] = None
    verbosity: Optional[Any] = None
    web_search_options: Optional[Any] = None
    store: Optional[Any] = None
    service_tier: Optional[Any] = None


# parameter: its values that change nothing here (none: any value is refused)
NO_OP_VALUES = {"presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "min_p": (0,),
                "min_tokens": (0,), "best_of": (1,), "logit_bias": ({},), "tools": ([],), "functions": ([],),
                "tool_choice": ("none",), "function_call": ("none",), "suffix": ("",),
                "response_format": ({"type": "text"},), "prediction": (), "modalities": (["text"],), "audio": (),
                "reasoning_effort": (), "verbosity": (), "web_search_options": (), "store": (False,),
                "service_tier": ("auto", "default")}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: Any = None                          # a string or a list of content parts: checked by message_text


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[StrictInt] = None


class CompletionRequest(_Sampling):
    prompt: Any                                  # a string or token ids (or a batch of one): completion_prompt
    echo: StrictBool = False


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
            only = f" (only {json.dumps(no_op[0])})" if no_op else ""
            raise APIError(400, f"{name}={short_json(value)} is not supported by this server{only}; it is refused "
                                "rather than ignored", name)


def include_usage(body: _Sampling) -> bool:
    """stream_options: only with stream=true, only the options OpenAI defines, each true or false."""
    options = body.stream_options
    if options is None:
        return False
    if not body.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")
    for key, value in options.items():
        where = f"stream_options.{key}"
        if key not in STREAM_OPTIONS:
            raise APIError(400, f"{where} is not supported by this server (it takes {' and '.join(STREAM_OPTIONS)})",
                           where)
        if value is not None and not isinstance(value, bool):
            raise APIError(400, f"{where} must be true or false, got {describe(value)}", where)
    return bool(options.get("include_usage"))


def check_text(where: str, text: str, param: Optional[str] = None) -> None:
    """400 for a string that is not Unicode text: JSON's escapes can spell a lone surrogate ("\\ud800"), which
    no tokenizer takes (a character past U+FFFF is a pair of them)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{where} holds a lone surrogate \\u{ord(text[e.start]):04x} at character {e.start}: "
                            "not Unicode text (a surrogate pair spells one character)", param or where) from None


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
    include_usage(body)
    check_supported(body)
    top_logprobs = requested_top_logprobs(body, chat)
    given = getattr(body, "max_completion_tokens", None)
    if given is not None and body.max_tokens not in (None, given):
        raise APIError(400, f"max_tokens {body.max_tokens} and max_completion_tokens {given} disagree: give one "
                            "(max_completion_tokens is the chat API's newer name)", "max_completion_tokens")
    param = "max_completion_tokens" if given is not None else "max_tokens"
    max_tokens = given if given is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = max(1, min(DEFAULT_MAX_TOKENS, room - prompt_len))
    if max_tokens < 1:
        raise APIError(400, f"{param} must be >= 1, got {max_tokens}", param)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    for i, s in enumerate(stop):
        check_text("stop" if isinstance(body.stop, str) else f"stop[{i}]", s)
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
    if not isinstance(content, (str, list)):
        raise APIError(400, f"{where} must be a string or a list of content parts, got {describe(content)}", where)
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise APIError(400, f"{where}[{j}]: a content part is an object ({TEXT_PART}), got {describe(part)}",
                               f"{where}[{j}]")
            if part.get("type") != "text":
                raise APIError(400, f"{where}[{j}]: only text parts are supported, got type {part.get('type')!r}",
                               f"{where}[{j}].type")
            if not isinstance(part.get("text"), str):
                text = part.get("text")
                got = "missing" if "text" not in part else "null" if text is None else f"{json_type(text)} {text!r}"
                raise APIError(400, f"{where}[{j}].text must be a string, got {got}", f"{where}[{j}].text")
            check_text(f"{where}[{j}].text", part["text"])
            texts.append(part["text"])
        content = "".join(texts)
    else:
        check_text(where, content)
    if m.role == "user" and not content.strip():
        raise APIError(400, f"{where} has no text: a user message needs some", where)
    return content


def completion_prompt(prompt: Any) -> Union[str, list[int]]:
    """The prompt of /v1/completions: a non-empty string or list of token ids, or a batch of one of either. The ids'
    range is the server's to check (it knows the vocabulary)."""
    where = "prompt"
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt, where = prompt[0], "prompt[0]"                      # a batch of one prompt: that prompt
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, f"{where} must be a non-empty string", "prompt")
        check_text(where, prompt, "prompt")
        return prompt
    if not isinstance(prompt, list):
        raise APIError(400, f"{where} must be a string or a list of token ids, got {describe(prompt)}", "prompt")
    if not prompt:
        raise APIError(400, f"{where} is an empty list: a prompt needs a token", "prompt")
    if all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, "prompt: one string (or one list of token ids) per request", "prompt")
    bad = next((i for i, t in enumerate(prompt) if not isinstance(t, int) or isinstance(t, bool)), None)
    if bad is not None:
        raise APIError(400, f"{where}[{bad}] = {short_json(prompt[bad])}: a token id is an integer", "prompt")
    return prompt


def json_type(value: Any) -> str:
    return {type(None): "null", bool: "boolean", int: "number", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(value), type(value).__name__)


def short_json(value: Any, limit: int = 60) -> str:
    """A value as JSON, cut at `limit` characters (escaped: safe to echo whatever the client sent)."""
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def describe(value: Any) -> str:
    """A client's value for an error message: its JSON type, and the value itself when it is a scalar."""
    kind = json_type(value)
    return kind if isinstance(value, (list, dict)) else f"{kind} {short_json(value)}"


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
