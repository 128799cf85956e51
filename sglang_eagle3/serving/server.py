"""OpenAI-compatible HTTP server on our engine (`eagle3 serve --engine builtin`).

Thin by design: the HTTP layer lives here (request models, their checks and the response pieces in
openai_protocol.py; a finished response's body in responses.py, a streamed one's events in streaming.py); one
scheduler thread (scheduler.py) owns the batch, the KV rows and the speculative worker; each request streams its text
deltas back through an asyncio queue. Endpoints: POST /v1/chat/completions, POST /v1/completions
(both with "stream": true as server-sent events ending with [DONE]), GET /v1/models, GET /v1/models/{model},
GET /health, GET /metrics (Prometheus text). Each response carries its speculative statistics in `spec_stats`, and
the target's log-probs of its tokens when asked (`logprobs`).

A request body over the limit (`--max-body-mb`) is a 413 before it is read; prompts are tokenized on one worker
thread, never on the event loop. A client that hangs up has its requests cancelled (streaming or not), and
stopping the server gives the requests still generating a grace period, then answers them 503.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import asynccontextmanager
from functools import partial
from itertools import accumulate
from queue import SimpleQueue
from typing import Any, Optional

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from sglang_eagle3.engine.engine import encode_prompt, is_token_ids
from sglang_eagle3.engine.scheduler import QueueFull, Request, RequestError, Scheduler
from sglang_eagle3.engine.settings import Settings
from sglang_eagle3.engine.verify import SamplingParams
from sglang_eagle3.serving.openai_protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    chat_prompt,
    choice_params,
    completion_prompt,
    describe,
    include_usage,
    reported_logprobs,
    sampling_params,
)
from sglang_eagle3.serving.responses import ResponseInfo, response_body, response_id
from sglang_eagle3.serving.streaming import stream_events

RETRY_AFTER_S = 1
SHUTDOWN_GRACE_S = 5.0            # stopping the server: how long requests still generating may go on
MIN_BODY_BYTES = 4 * 2 ** 20      # the default body limit: this, or BODY_BYTES_PER_TOKEN a token of max_len if more
BODY_BYTES_PER_TOKEN = 256        # more than any token takes as JSON-escaped text or as an id
HUNG_UP, SHUTTING_DOWN = "hung up", "shutting down"    # queue items that end a response before its requests finish
NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


# ---- state -----------------------------------------------------------------------------------
class Metrics:
    """Counters for /metrics (Prometheus text format)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = {"finished": 0, "cancelled": 0, "error": 0, "rejected": 0}
        self.responses: dict[int, int] = {}                # HTTP status code: responses sent with it
        self.prompt_tokens = self.generated_tokens = self.verify_steps = 0
        self.ttft_sum, self.ttft_count = 0.0, 0
        self.recent: list[tuple[float, int]] = []         # (time, tokens) of finished requests, last 60 s

    def finished(self, req: Request) -> None:
        with self.lock:
            kind = req.finish_reason if req.finish_reason in ("cancelled", "error") else "finished"
            self.requests[kind] += 1
            self.prompt_tokens += len(req.prompt_ids)
            self.generated_tokens += len(req.output_ids)
            self.verify_steps += req.verify_steps
            if req.first_token_time is not None:
                self.ttft_sum += req.first_token_time - req.arrival
                self.ttft_count += 1
            now = time.time()
            self.recent = [(t, n) for t, n in self.recent if now - t < 60] + [(now, len(req.output_ids))]

    def rejected(self) -> None:
        with self.lock:
            self.requests["rejected"] += 1

    def server_error(self) -> None:
        """A request the server failed (an exception, not the client's mistake): counted with the errors."""
        with self.lock:
            self.requests["error"] += 1

    def responded(self, status: int) -> None:
        with self.lock:
            self.responses[status] = self.responses.get(status, 0) + 1

    def text(self, load: dict) -> str:
        with self.lock:
            now = time.time()
            window = [n for t, n in self.recent if now - t < 60]
            lines = [
                "# HELP eagle3_requests_total Requests by outcome.", "# TYPE eagle3_requests_total counter",
                *[f'eagle3_requests_total{{status="{k}"}} {v}' for k, v in self.requests.items()],
                "# HELP eagle3_http_responses_total HTTP responses by status code (every 5xx among them).",
                "# TYPE eagle3_http_responses_total counter",
                *[f'eagle3_http_responses_total{{code="{k}"}} {v}' for k, v in sorted(self.responses.items())],
                "# TYPE eagle3_prompt_tokens_total counter", f"eagle3_prompt_tokens_total {self.prompt_tokens}",
                "# TYPE eagle3_generated_tokens_total counter",
                f"eagle3_generated_tokens_total {self.generated_tokens}",
                "# HELP eagle3_verify_steps_total Target forwards that produced tokens.",
                "# TYPE eagle3_verify_steps_total counter", f"eagle3_verify_steps_total {self.verify_steps}",
                "# HELP eagle3_accept_length Tokens per target forward over all finished requests.",
                "# TYPE eagle3_accept_length gauge",
                f"eagle3_accept_length {self.generated_tokens / max(1, self.verify_steps):.4f}",
                "# HELP eagle3_generation_tokens_per_second Generated tokens/s of requests finished in the last 60 s.",
                "# TYPE eagle3_generation_tokens_per_second gauge",
                f"eagle3_generation_tokens_per_second {sum(window) / 60.0:.3f}",
                "# TYPE eagle3_time_to_first_token_seconds summary",
                f"eagle3_time_to_first_token_seconds_sum {self.ttft_sum:.6f}",
                f"eagle3_time_to_first_token_seconds_count {self.ttft_count}",
                "# TYPE eagle3_running_requests gauge", f"eagle3_running_requests {load['running']}",
                "# TYPE eagle3_queued_requests gauge", f"eagle3_queued_requests {load['waiting']}",
                "# HELP eagle3_free_kv_rows KV-cache rows free for new requests.",
                "# TYPE eagle3_free_kv_rows gauge", f"eagle3_free_kv_rows {load['free_rows']}",
                "# TYPE eagle3_max_running_requests gauge", f"eagle3_max_running_requests {load['max_running']}",
                "# HELP eagle3_decode_steps_total Batched decoding steps.",
                "# TYPE eagle3_decode_steps_total counter", f"eagle3_decode_steps_total {load['steps']}",
                "# HELP eagle3_step_rows_total Rows over all decoding steps (a step of 4 requests counts 4).",
                "# TYPE eagle3_step_rows_total counter", f"eagle3_step_rows_total {load['row_steps']}",
                "# HELP eagle3_speculated_rows_total Rows of decoding steps whose tree held more than the root.",
                "# TYPE eagle3_speculated_rows_total counter",
                f"eagle3_speculated_rows_total {load['speculated_rows']}",
                "# HELP eagle3_verified_tokens_total Tokens the verifies computed, all rows (each tree, its root "
                "included).",
                "# TYPE eagle3_verified_tokens_total counter", f"eagle3_verified_tokens_total {load['verified_nodes']}",
                "# HELP eagle3_step_seconds_total Decoding steps' seconds by part: draft (proposing, sizing the tree, "
                "the draft model) and verify (the target forward, acceptance, KV commit).",
                "# TYPE eagle3_step_seconds_total counter",
                f'eagle3_step_seconds_total{{part="draft"}} {load["draft_seconds"]:.6f}',
                f'eagle3_step_seconds_total{{part="verify"}} {load["verify_seconds"]:.6f}',
            ]
        return "\n".join(lines) + "\n"


class ServerState:
    """The scheduler, its thread, and what the HTTP layer needs to know about the model."""

    def __init__(self, scheduler: Scheduler, model_name: str, info: Optional[dict] = None,
                 max_body_bytes: Optional[int] = None, engine_thread: Optional["EngineThread"] = None):
        """engine_thread: the thread that built the engine (build_state), which then runs its steps too (one
        thread does all torch work: EngineThread)."""
        self.scheduler, self.model_name, self.info = scheduler, model_name, info or {}
        self.engine_thread = engine_thread
        self.tokenizer = scheduler.tokenizer
        self.vocab_size = scheduler.target.vocab_size           # rows of the embedding: the valid token ids
        self.max_body_bytes = default_body_limit(scheduler.max_len) if max_body_bytes is None else max_body_bytes
        self.metrics = Metrics()
        self.created = int(time.time())
        self.loop: Optional[Future] = None                         # the scheduler's loop on the engine thread
        self.tokenizing: Optional[ThreadPoolExecutor] = None      # started with the scheduler
        self.responses: dict[asyncio.Queue, list[Request]] = {}    # responses still generating: their queue, requests
        self.closing = False                                      # stopping: new requests are answered 503

    def start(self) -> None:
        if self.tokenizing is None:     # one thread: long prompts tokenize beside the event loop, not beside the engine
            self.tokenizing = ThreadPoolExecutor(1, thread_name_prefix="eagle3-tokenize")
        if self.engine_thread is None:
            self.engine_thread = EngineThread()
        if self.loop is None:
            self.loop = self.engine_thread.submit(self.scheduler.serve_forever)

    def stop(self) -> None:
        self.scheduler.shutdown()
        if self.loop is not None:
            wait([self.loop], timeout=30)
            self.loop = None
        if self.tokenizing is not None:
            self.tokenizing.shutdown(wait=False, cancel_futures=True)
            self.tokenizing = None

    def stop_responses(self) -> None:
        """Shutdown's grace period is over: every response still generating is cancelled and told so (on the event
        loop, which its handler then wakes on; the scheduler frees the rows at its next step)."""
        self.closing = True
        for queue, reqs in self.responses.items():
            for req in reqs:
                self.scheduler.cancel(req)
            queue.put_nowait(SHUTTING_DOWN)


class EngineThread:
    """One daemon thread for all of the server's torch work: loading the models, then every step. PyTorch's OpenMP
    runtime keeps a team of worker threads per thread that runs parallel regions; with a second team (the models
    loaded on the main thread, the steps on another) there are more OpenMP threads than cores on a small machine,
    libgomp stops spinning between regions, and each of a step's few hundred regions waits for its workers to wake:
    one request decoded at 35 tok/s instead of 59 on a 2-core Xeon with AMX. A daemon: a process that exits without
    stopping the scheduler does not wait for it."""

    def __init__(self):
        self.tasks: SimpleQueue = SimpleQueue()
        threading.Thread(target=self._run, name="eagle3-engine", daemon=True).start()

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self.tasks.put((fn, args, future))
        return future

    def _run(self) -> None:
        while True:
            fn, args, future = self.tasks.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:          # noqa: BLE001 - handed to whoever waits on the future
                    future.set_exception(e)


def default_body_limit(max_len: int) -> int:
    """The request body limit unless --max-body-mb sets one: room for any prompt that fits max_len tokens."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_len)


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry on another instance or once it is back", None,
                    "server_shutting_down", "server_error")


class Handler:
    """Runs a response's requests (one per choice) against the scheduler: their text deltas arrive on one queue,
    tagged with the choice index, then the finished requests."""

    def __init__(self, state: ServerState):
        self.state = state

    def check_model(self, name: str) -> None:
        if name != self.state.model_name:
            raise APIError(404, f"model {name!r} is not served here (this server serves {self.state.model_name!r})",
                           "model", "model_not_found")

    def submit(self, prompt_ids: list[int], params: list[SamplingParams], prompt: Any, loop, queue) -> list[Request]:
        """One request per choice; all or none: a choice that cannot be queued cancels those already queued."""
        sched = self.state.scheduler
        metrics = self.state.metrics

        def listener_of(index: int):
            def listener(req: Request, delta: str) -> None:          # called on the scheduler thread
                if delta == "" and req.done.is_set():
                    metrics.finished(req)                             # exactly once, however the request ended
                loop.call_soon_threadsafe(queue.put_nowait, (index, delta, req.finished, reported_logprobs(req)))
            return listener

        reqs = []
        try:
            sched.check_fits(len(prompt_ids), params[0].max_new_tokens)
            for i, p in enumerate(params):
                reqs.append(sched.submit(Request(prompt_ids, p, prompt=prompt, listener=listener_of(i))))
        except RequestError as e:
            raise APIError(400, str(e), "prompt" if isinstance(prompt, str) or is_token_ids(prompt) else "messages",
                           "context_length_exceeded") from None
        except QueueFull as e:
            for req in reqs:
                sched.cancel(req)
            self.state.metrics.rejected()
            raise APIError(503, f"server busy: {e}; retry later", None, "server_busy", "server_error",
                           {"Retry-After": str(RETRY_AFTER_S)}) from None
        return reqs

    def check_token_ids(self, ids: list[int]) -> None:
        vocab = self.state.vocab_size
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"prompt[{bad}] = {ids[bad]} is not a token id of this model (0 <= id < {vocab})",
                           "prompt")

    def tokenize(self, prompt) -> list[int]:
        """On the tokenizer thread (see tokenized)."""
        try:
            ids = encode_prompt(self.state.tokenizer, prompt)
        except Exception as e:      # a chat template that rejects the roles, say
            what, param = ("cannot apply the chat template", "messages") if isinstance(prompt, list) else \
                ("cannot tokenize the prompt", "prompt")
            raise APIError(400, f"{what}: {e}", param) from None
        if not ids:
            raise APIError(400, "empty prompt (no tokens after tokenization)", "prompt")
        return ids

    async def tokenized(self, prompt) -> list[int]:
        """The prompt's ids, tokenized off the event loop: a long prompt holds up nothing else (/health included)."""
        if is_token_ids(prompt):
            return list(prompt)                                 # token ids, already checked
        return await asyncio.get_running_loop().run_in_executor(self.state.tokenizing, self.tokenize, prompt)


async def hung_up(http: HTTPRequest, queue: asyncio.Queue) -> None:
    """Put HUNG_UP on the queue when the client disconnects (the body has been read: what the connection says next
    is that it closed)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    queue.put_nowait(HUNG_UP)


def model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "sglang-eagle3",
            **state.info}


async def respond(handler: Handler, http: HTTPRequest, body: ChatRequest | CompletionRequest, prompt, chat: bool):
    """One request's choices run against the scheduler: their answer in one body, or as events (stream=true)."""
    state = handler.state
    handler.check_model(body.model)
    if state.closing:
        raise shutting_down()
    prompt_ids = await handler.tokenized(prompt)
    params = sampling_params(body, len(prompt_ids), state.scheduler.limit - state.scheduler.tree_slots, chat)
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    reqs = handler.submit(prompt_ids, choice_params(params, body.n), prompt, loop, queue)
    echo = ""                                                   # completions: the prompt before the answer
    if not chat and body.echo:
        echo = prompt if isinstance(prompt, str) else state.tokenizer.decode(prompt)
    info = ResponseInfo(response_id(chat), chat, state.model_name, state.tokenizer, echo)
    state.responses[queue] = reqs
    if body.stream:
        events = stream_events(info, reqs, partial(next_delta, queue), include_usage(body),
                               partial(end_response, state, reqs, queue))
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    if not await all_finished(state, http, reqs, queue):
        return Response(status_code=499)                 # nobody reads it: the client has gone
    return response_body(info, reqs)


async def next_delta(queue: asyncio.Queue):
    """A streamed response's next delta from its queue; the server stopping its requests raises the 503."""
    item = await queue.get()
    if item == SHUTTING_DOWN:
        raise shutting_down()
    return item


async def all_finished(state: ServerState, http: HTTPRequest, reqs: list[Request], queue: asyncio.Queue) -> bool:
    """Wait for a non-streamed response's requests: True once all have finished, False if the client hung up
    first (they are cancelled, their rows freed); shutdown stops them with a 503."""
    watch = asyncio.ensure_future(hung_up(http, queue))
    try:
        while not all(r.done.is_set() for r in reqs):
            item = await queue.get()
            if item == SHUTTING_DOWN:
                raise shutting_down()
            if item == HUNG_UP:
                return False
        return True
    finally:
        watch.cancel()
        end_response(state, reqs, queue)


def end_response(state: ServerState, reqs: list[Request], queue: asyncio.Queue) -> None:
    """A response is over, however: requests still running are cancelled (a client gone, a failed choice)."""
    state.responses.pop(queue, None)
    for req in reqs:
        if not req.done.is_set():
            state.scheduler.cancel(req)


@asynccontextmanager
async def scheduler_running(state: ServerState):
    """The app's lifespan: the scheduler's thread (and the tokenizer's) run while the app does."""
    state.start()
    yield
    state.stop()


def create_app(state: ServerState):
    """The app: OpenAI-shaped errors, the body limit, and the routes."""
    app = FastAPI(title="sglang-eagle3", lifespan=lambda app: scheduler_running(state))
    app.router.route_class = BodyRoute
    handler = Handler(state)

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return openai_error(e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(http: HTTPRequest, e: RequestValidationError):
        return openai_error(request_error(http, e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(http: HTTPRequest, e: StarletteHTTPException):
        return openai_error(route_error(http, e, state.max_body_bytes))

    app.add_middleware(BodyLimit, limit=state.max_body_bytes)
    app.add_middleware(ServerErrors, metrics=state.metrics)          # outside BodyLimit: its 413s are counted

    @app.get("/health")
    async def health():
        return {"status": "ok", **state.scheduler.load()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(state)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        handler.check_model(name)
        return model_card(state)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.text(state.scheduler.load()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest, body: ChatRequest):
        return await respond(handler, http, body, chat_prompt(body), chat=True)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest, body: CompletionRequest):
        prompt = completion_prompt(body.prompt)
        if is_token_ids(prompt):
            handler.check_token_ids(prompt)             # token ids go to the model as they are, not re-tokenized
        return await respond(handler, http, body, prompt, chat=False)

    return app


# ---- request bodies --------------------------------------------------------------------------------------------
class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is a 413 before any of it is parsed: at once when its
    Content-Length says so, else as soon as the bytes read pass the limit."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await openai_error(body_too_large(int(declared), self.limit))(scope, receive, send)
        read = 0

        async def counted():
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            if read > self.limit:               # FastAPI passes an HTTPException on to the handlers: route_error
                raise StarletteHTTPException(413)
            return message
        await self.app(scope, counted, send)


def body_too_large(size: Optional[int], limit: int) -> APIError:
    return APIError(413, f"request body{f' of {size} bytes' if size else ''} exceeds this server's limit of {limit} "
                         f"bytes ({limit / 2 ** 20:.4g} MiB; eagle3 serve --max-body-mb)", None, "request_too_large")


class BodyTooDeep(StarletteHTTPException):
    """A JSON body nested past what the reader takes (FastAPI would call it a body it could not parse)."""


class JSONBody(HTTPRequest):
    """A request whose JSON body names its nesting when it is too deep to read."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = json.loads(body)
            except RecursionError:
                depth, most = nesting_depth(body), sys.getrecursionlimit()
                raise BodyTooDeep(400, f"the request body nests {depth} levels deep; the JSON reader goes fewer than "
                                       f"{most} levels deep (Python's recursion limit; a request needs a handful)") \
                    from None
        return self._json


class BodyRoute(APIRoute):
    """The routes read their body as a JSONBody."""

    def get_route_handler(self):
        handle = super().get_route_handler()

        async def route(request: HTTPRequest):
            return await handle(JSONBody(request.scope, request.receive, request._send))
        return route


def nesting_depth(body: bytes) -> int:
    """How deep a JSON text's arrays and objects nest (brackets inside strings left out)."""
    brackets = re.sub(rb'"(?:[^"\\]|\\.)*"', b"", body).translate(None, NOT_BRACKETS)
    return max(accumulate(1 if b in b"[{" else -1 for b in brackets), default=0)


# ---- errors in OpenAI's shape --------------------------------------------------------------------------------
def openai_error(e: APIError) -> Response:
    """json.dumps escapes what it cannot encode: a message that quotes the client's text never fails to render."""
    return Response(json.dumps(e.body()), status_code=e.status, headers=e.headers, media_type="application/json")


def field_path(loc) -> str:
    """pydantic's error location as a request path: ('body', 'messages', 0, 'role') -> messages[0].role (union
    member tags such as 'list[str]' left out)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "body" and str(part).isidentifier() and part not in ("str", "int", "float", "bool", "list",
                                                                          "dict"):
            out += f".{part}" if out else str(part)
    return out


def request_error(http: HTTPRequest, errors: list) -> APIError:
    """A body FastAPI could not read as the route's request: the wrong Content-Type, not JSON, not an object, or a
    field of the wrong type (named, with its path)."""
    ctype = http.headers.get("content-type", "")
    if ctype.split(";")[0].strip().lower() != "application/json":
        return APIError(415, f"Content-Type must be application/json, got {ctype or 'none'}", None,
                        "unsupported_media_type")
    first = errors[0] if errors else {}
    path = field_path(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON (UTF-8): {first.get('ctx', {}).get('error', '')}")
    if not path:
        return APIError(400, f"request body must be a JSON object ({first.get('msg', 'invalid value')})")
    got = f", got {describe(first['input'])}" if "input" in first and first.get("type") != "missing" else ""
    return APIError(400, f"{path}: {first.get('msg', 'invalid value')}{got}", path)


def route_error(http: HTTPRequest, e, max_body_bytes: int) -> APIError:
    """Starlette's 404 / 405 / 413 (and any other HTTP error) in OpenAI's shape, saying what is served."""
    where = f"{http.method} {http.url.path}"
    if e.status_code == 413:                     # BodyLimit: a body read past the limit
        return body_too_large(None, max_body_bytes)
    if isinstance(e, BodyTooDeep):
        return APIError(400, e.detail)
    if e.status_code == 404:
        return APIError(404, f"no such route: {where} (this server answers POST /v1/chat/completions, POST "
                             "/v1/completions, GET /v1/models, GET /v1/models/{model}, GET /health, GET /metrics)",
                        None, "unknown_url")
    if e.status_code == 405:
        allowed = (e.headers or {}).get("allow", (e.headers or {}).get("Allow", ""))
        return APIError(405, f"{where}: method not allowed" + (f"; use {allowed}" if allowed else ""), None,
                        "method_not_allowed", headers=e.headers)
    if e.status_code == 400:                     # FastAPI's "There was an error parsing the body"
        return APIError(400, f"request body is not valid JSON (UTF-8): {e.detail}")
    return APIError(e.status_code, f"{where}: {e.detail}", headers=e.headers)


class ServerErrors:
    """ASGI middleware: an exception a route did not turn into an APIError is the server's failure, not the client's
    mistake. It is counted on /metrics (requests_total{status="error"}), logged with its traceback and answered as an
    OpenAI-style 500 (mid-stream, where a status can no longer be sent, the connection is closed)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_tracking(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.responded(message["status"])
            await send(message)
        try:
            await self.app(scope, receive, send_tracking)
        except Exception as e:
            self.metrics.server_error()
            logging.getLogger("sglang_eagle3.server").exception("request %s %s failed", scope.get("method"),
                                                                scope.get("path"))
            if started:
                return
            body = json.dumps(APIError(500, f"internal server error ({type(e).__name__}: {e})", None, None,
                                       "server_error").body()).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send_tracking({"type": "http.response.start", "status": 500, "headers": headers})
            await send({"type": "http.response.body", "body": body})


# ---- building and running ---------------------------------------------------------------------------
def build_state(target: str, settings: Settings, model_name: Optional[str] = None,
                max_body_mb: Optional[float] = None, engine_thread: Optional[EngineThread] = None) -> ServerState:
    """The engine resolve_settings decided on, behind its scheduler (the settings' running and queue limits, their
    KV slots per request); request bodies up to max_body_mb (default: default_body_limit). The models load on
    engine_thread (default: a new EngineThread), which then runs the scheduler."""
    from sglang_eagle3.engine.loader import load_engine
    worker = engine_thread or EngineThread()
    engine = worker.submit(load_engine, target, settings).result()
    context = engine.target.context_len
    max_len = settings.slots_per_request(context)
    sched = worker.submit(engine.scheduler, settings.max_running, max_len, settings.max_queue).result()
    name = model_name or os.path.basename(os.path.normpath(target))
    info = {"draft": os.path.abspath(settings.draft) if settings.draft else None, "dtype": settings.dtype,
            "max_running_requests": settings.max_running, "context_length": max_len,
            "target_context_length": context, "kv_pool_mb": round(sched.worker.nbytes() / 2 ** 20, 1)}
    return ServerState(sched, name, info, None if max_body_mb is None else max(1, round(max_body_mb * 2 ** 20)),
                       worker)


def make_server(state: ServerState, host: str, port: int, log_level: str = "warning",
                grace_s: float = SHUTDOWN_GRACE_S):
    """uvicorn's server for the app. Stopping it (SIGTERM, Ctrl-C) gives the requests still generating grace_s to
    finish, then stops them with a 503 (past its own deadline uvicorn would cancel their handlers and log a traceback
    for each)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            state.closing = True
            stop = asyncio.get_running_loop().call_later(grace_s, state.stop_responses)
            try:
                await super().shutdown(sockets)
            finally:
                stop.cancel()
    return Server(uvicorn.Config(create_app(state), host=host, port=port, log_level=log_level,
                                 timeout_graceful_shutdown=grace_s + 10))


def run_server(state: ServerState, host: str, port: int, log_level: str = "warning", sock=None) -> int:
    """Serve until interrupted. sock: a socket already bound to host:port (launcher.bind_port), which uvicorn
    listens on, so that the banner below is printed only for an address that is ours."""
    server = make_server(state, host, port, log_level)
    if sock is None:
        sock = server.config.bind_socket()
    print(f"eagle3 serve: {state.model_name} on http://{host}:{port}/v1 (draft: {state.info.get('draft') or 'none'}, "
          f"{state.info['dtype']}, up to {state.info['max_running_requests']} running requests, "
          f"KV pool {state.info['kv_pool_mb']} MB)\n"
          f"  curl -s http://{host}:{port}/v1/chat/completions -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{state.model_name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], "
          f"\"max_tokens\": 64}}'", flush=True)
    server.run(sockets=[sock])
    return 0
