"""Regenerate chat data with the target's own answers (the draft should learn the target, not the dataset).

Every conversation keeps its system prompt and user turns; answer k is generated from the regenerated history
(system, user 1, answer 1, ..., user k), batched across conversations turn by turn. Conversations with tool
turns are skipped (their tool results depend on the original calls). Generators:
  EngineGenerator   the in-process SpeculativeEngine (vanilla or with an EAGLE-3 draft)
  OpenAIGenerator   any OpenAI-compatible server (SGLang, vLLM, ...), requests in parallel threads
Output: jsonl rows {"key", "id", "source", "messages": [{"role", "content"}]} (loadable by prepare-data, format
"messages"). Rows are appended to OUT.partial with fsync after every batch; a rerun skips the keys already there
(a torn last line from a kill is cut off). When every row is done OUT.partial is renamed to OUT.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Optional, Protocol

from sglang_eagle3.engine.settings import add_dtype_arg, add_spec_args
from sglang_eagle3.errors import UserError, check_at_least, flags_of
from sglang_eagle3.fileio import append_jsonl, check_apart, exclusive_writer, read_jsonl_resumable, write_text_atomic
from sglang_eagle3.training.data.formats import FORMATS, BadRow, Conversation, parse_sources, read_source


class Generator(Protocol):
    def generate(self, prompts: list[list[dict]]) -> list:
        """Chat prompts -> answers (str, or objects with .text), one per prompt, same order."""


# ---- generators ------------------------------------------------------------------------------
class EngineGenerator:
    def __init__(self, engine, max_new_tokens: int = 512, temperature: float = 0.0, batch_size: int = 8,
                 seed: Optional[int] = None):
        self.engine, self.batch_size, self.calls = engine, batch_size, 0
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed

    def generate(self, prompts):
        """Answers in prompt order; None for a prompt too long for the target's context (it is skipped)."""
        from sglang_eagle3.engine.scheduler import RequestError
        from sglang_eagle3.engine.verify import SamplingParams
        seed = None if self.seed is None else self.seed + self.calls   # a fresh random stream per call
        self.calls += 1
        params = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, seed=seed)
        fits = []
        for i, p in enumerate(prompts):
            try:
                self.engine.check_fits(len(self.engine.encode(p)), self.max_new_tokens)
                fits.append(i)
            except RequestError:
                pass
        outputs, _ = self.engine.generate([prompts[i] for i in fits], params, batch_size=self.batch_size) \
            if fits else ([], None)
        answers: list = [None] * len(prompts)
        for i, o in zip(fits, outputs):
            answers[i] = o.text
        return answers


class OpenAIGenerator:
    def __init__(self, base_url: str, model: Optional[str] = None, api_key: str = "EMPTY",
                 max_new_tokens: int = 512, temperature: float = 0.0, concurrency: int = 16,
                 timeout: float = 600.0, max_retries: int = 3):
        from openai import OpenAI
        self.client = OpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=max_retries)
        self.model = model or self.client.models.list().data[0].id
        self.max_new_tokens, self.temperature, self.concurrency = max_new_tokens, temperature, concurrency

    def _one(self, messages):
        r = self.client.chat.completions.create(model=self.model, messages=messages,
                                                max_tokens=self.max_new_tokens, temperature=self.temperature)
        return r.choices[0].message.content or ""

    def generate(self, prompts):
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(prompts)))) as pool:
            return list(pool.map(self._one, prompts))


# ---- one batch of conversations --------------------------------------------------------------
def split_prompts(conv: Conversation) -> tuple[list[dict], list[str]]:
    """(system messages, user turns); raises BadRow for conversations that cannot be regenerated."""
    if any(m["role"] == "tool" for m in conv.messages):
        raise BadRow("tool turns cannot be regenerated")
    system = [m for m in conv.messages if m["role"] == "system"][:1]
    users = [m["content"] for m in conv.messages if m["role"] == "user"]
    if not users:
        raise BadRow("no user turn")
    return system, users


def _text(answer) -> str:
    return answer if isinstance(answer, str) else getattr(answer, "text", "")


def regenerate_batch(convs: list[Conversation], generator: Generator, max_turns: Optional[int] = None,
                     stats: Optional["RegenStats"] = None):
    """-> one message list per conversation: system + (user, regenerated answer) pairs. A conversation stops at
    its first empty answer (that user turn is dropped)."""
    parts = [split_prompts(c) for c in convs]
    history = [list(system) for system, _ in parts]
    active = list(range(len(convs)))
    k = 0
    while active and (max_turns is None or k < max_turns):
        active = [i for i in active if k < len(parts[i][1])]
        if not active:
            break
        prompts = [history[i] + [{"role": "user", "content": parts[i][1][k]}] for i in active]
        answers = generator.generate(prompts)
        if len(answers) != len(prompts):
            raise RuntimeError(f"generator returned {len(answers)} answers for {len(prompts)} prompts")
        still = []
        for i, prompt, ans in zip(active, prompts, answers):
            if ans is None:                                   # too long for the target's context: stop here
                if stats is not None:
                    stats.too_long += 1
                continue
            text = _text(ans)
            if text.strip():
                history[i] = prompt + [{"role": "assistant", "content": text}]
                still.append(i)
            elif stats is not None:
                stats.empty_answers += 1
        active, k = still, k + 1
    return history


# ---- resumable output ------------------------------------------------------------------------
def _scan_partial(path: str) -> set[str]:
    """Keys already written; cuts a torn last line (a kill mid-write) off the file."""
    return {row["key"] for row in read_jsonl_resumable(path, lambda row: row["key"], "a regenerated row")}


def _prompt_chars(conv: Conversation) -> int:
    return sum(len(m["content"] or "") for m in conv.messages if m["role"] in ("system", "user"))


@dataclass
class RegenStats:
    rows: int = 0
    written: int = 0
    already_done: int = 0
    skipped: dict = field(default_factory=dict)
    empty_answers: int = 0
    too_long: int = 0         # turns whose prompt + max_new_tokens exceed the target's context (skipped)
    turns_dropped: int = 0    # user turns without an answer (an empty answer ends its conversation)
    left_for_later: int = 0   # conversations not started within --time-budget (a rerun answers them)

    def as_dict(self):
        return dict(self.__dict__)


def load_conversations(inputs: list[str], fmt: Optional[str] = None, max_rows: Optional[int] = None,
                       stats: Optional[RegenStats] = None,
                       max_prompt_chars: Optional[int] = None) -> list[Conversation]:
    stats = stats or RegenStats()
    convs = []
    for src in parse_sources(inputs, fmt):
        n = 0
        for number, item in read_source(src, require_assistant=False):
            if max_rows is not None and n >= max_rows:
                break
            n += 1
            stats.rows += 1
            if isinstance(item, Conversation):
                try:
                    split_prompts(item)
                    if max_prompt_chars is not None and _prompt_chars(item) > max_prompt_chars:
                        raise BadRow("prompt longer than --max-prompt-chars")
                except BadRow as e:
                    item = e
            if isinstance(item, BadRow):
                stats.skipped[str(item)] = stats.skipped.get(str(item), 0) + 1
                continue
            convs.append(item)
    return convs


def regenerate(convs: list[Conversation], generator: Generator, out: str, batch_size: int = 16,
               max_turns: Optional[int] = None, overwrite: bool = False, progress: bool = True,
               stats: Optional[RegenStats] = None, time_budget_s: Optional[float] = None) -> RegenStats:
    """Generate answers for every conversation not yet in OUT.partial; rename to OUT when all are done.

    time_budget_s: start no batch after this many seconds and write OUT with the rows done so far (the shortest
    prompts: they are answered first); a later call without it goes on from there."""
    import time

    from tqdm import tqdm
    t0 = time.monotonic()
    stats = stats or RegenStats()
    partial = out + ".partial"
    if overwrite:
        for stale in (out, partial):
            if os.path.exists(stale):
                os.remove(stale)
    elif os.path.exists(out):
        finished = _scan_partial(out)
        if all(c.key in finished for c in convs):
            stats.already_done = len(convs)
            return stats
        os.replace(out, partial)                     # more rows asked for (--max-rows): continue the run
    with exclusive_writer(partial):
        done = _scan_partial(partial)
        # Similar lengths in one batch: every row of a batch attends over the longest prompt's cache.
        todo = sorted((c for c in convs if c.key not in done), key=_prompt_chars)
        stats.already_done = len(convs) - len(todo)
        with open(partial, "a", encoding="utf-8") as f, \
                tqdm(total=len(todo), desc="regenerating", unit=" conv", disable=not progress) as bar:
            for i in range(0, len(todo), batch_size):
                if time_budget_s is not None and time.monotonic() - t0 >= time_budget_s:
                    stats.left_for_later = len(todo) - i
                    break
                batch = todo[i:i + batch_size]
                histories = regenerate_batch(batch, generator, max_turns, stats)
                rows = []
                for conv, msgs in zip(batch, histories):
                    wanted = min(len(split_prompts(conv)[1]), max_turns or 10**9)
                    stats.turns_dropped += wanted - sum(m["role"] == "assistant" for m in msgs)
                    rows.append({"key": conv.key, "id": conv.id, "source": conv.source, "messages": msgs})
                append_jsonl(f, rows)
                stats.written += len(rows)
                bar.update(len(batch))
        _finish_in_input_order(partial, out, [c.key for c in convs])
    return stats


def _finish_in_input_order(partial: str, out: str, keys: list[str]) -> None:
    """Rows were generated shortest prompt first; the finished file lists them in input order."""
    order = {k: i for i, k in enumerate(keys)}
    with open(partial, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    lines.sort(key=lambda line: order.get(json.loads(line)["key"], len(order)))
    write_text_atomic(out, "".join(lines))
    os.remove(partial)


# ---- settings ---------------------------------------------------------------------------------
SETTINGS_SUFFIX = ".settings.json"


def written_files(out: str) -> dict:
    """The files a resumable --out run writes (regenerate, synthesize-prompts), for fileio.check_apart."""
    return {"--out": [out, out + ".partial", out + SETTINGS_SUFFIX]}


def run_settings(args) -> dict:
    """What decides the rows' contents; a resumed or extended run must use the same. --max-rows and
    --max-prompt-chars only select which conversations are answered: raising them adds rows."""
    def where(x):
        return os.path.abspath(x) if x and os.path.exists(x) else x
    return {"inputs": [where(i.split(":")[0]) + (":" + i.split(":", 1)[1] if ":" in i else "") for i in args.inputs],
            "format": args.format, "generator": "server" if args.server else "engine",
            "target": where(args.target), "server": args.server, "model": args.model, "draft": where(args.draft),
            "dtype": args.dtype if not args.server else None, "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "seed": args.seed, "max_turns": args.max_turns}


def check_settings(out: str, settings: dict, overwrite: bool) -> None:
    """Store the settings beside the output; refuse to add rows made another way to an output that holds rows
    (an empty one, say from a run stopped before its first batch, has nothing to protect)."""
    path = out + SETTINGS_SUFFIX
    has_rows = any(os.path.isfile(f) and os.path.getsize(f) > 0 for f in (out, out + ".partial"))
    if os.path.exists(path) and has_rows and not overwrite:
        try:
            with open(path) as f:
                old = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"{path}: unreadable ({e}); delete it to accept the rows already in {out}") from None
        diff = [f"{k}: {old.get(k)!r} then, {v!r} now" for k, v in settings.items() if old.get(k) != v]
        if diff:
            raise UserError(f"{out} holds rows made with other settings ({'; '.join(diff)}): rerun with the same "
                            f"settings, write to another --out, or pass --overwrite")
        return
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    from sglang_eagle3.fileio import write_json
    write_json(path, settings)


# ---- command line ----------------------------------------------------------------------------
def check_args(args) -> None:
    """Every flag, before any input is read, any model loads or any server is asked."""
    from sglang_eagle3.engine.settings import check_device
    from sglang_eagle3.engine.verify import SamplingParams
    if (args.server is None) == (args.target is None):
        raise UserError("give exactly one of --target (in-process engine) or --server (OpenAI-compatible URL)")
    check_at_least(1, flags_of(args, "batch_size", "max_new_tokens", "concurrency", "write_every", "max_turns",
                               "max_rows", "max_prompt_chars"))
    for flag, value, ok, rule in (("--time-budget", args.time_budget, args.time_budget is None or args.time_budget > 0,
                                   "> 0 minutes"),
                                  ("--request-timeout", args.request_timeout, args.request_timeout > 0, "> 0 seconds"),
                                  ("--max-retries", args.max_retries, args.max_retries >= 0, ">= 0")):
        if not ok:
            raise UserError(f"{flag} must be {rule}, got {value}")
    SamplingParams.from_flags(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    if args.server:
        if not args.server.startswith(("http://", "https://")):
            raise UserError(f"--server {args.server}: expected a base URL such as http://127.0.0.1:30000/v1")
        engine_only = [flag for flag, v in (("--draft", args.draft), ("--num-steps", args.num_steps),
                                            ("--topk", args.topk), ("--num-draft-tokens", args.num_draft_tokens),
                                            ("--write-every", args.write_every)) if v is not None]
        if engine_only:
            raise UserError(f"{engine_only[0]} sets up the in-process engine (--target); the server at --server "
                            "decodes with its own draft and tree")
    else:
        check_device(args.device)
        if args.model is not None:
            raise UserError("--model names a model on --server; the in-process engine runs --target")
    inputs = [s.path for s in parse_sources(args.inputs, args.format) if not s.is_hub]     # flags first, then files
    check_apart(written_files(args.out), {"input": inputs, "--target": args.target, "--draft": args.draft})


def run(args) -> int:
    check_args(args)
    stats = RegenStats()
    budget_s = None if args.time_budget is None else 60.0 * args.time_budget
    convs = load_conversations(args.inputs, args.format, args.max_rows, stats, args.max_prompt_chars)
    if os.path.exists(args.out) and not args.overwrite and all(c.key in _scan_partial(args.out) for c in convs):
        print(f"{args.out} is already complete; pass --overwrite to regenerate it (or a larger --max-rows / "
              "--max-prompt-chars to add rows)")
        return 0
    check_settings(args.out, run_settings(args), args.overwrite)     # rows will be added: made the same way
    if args.server:
        from openai import OpenAIError
        try:
            gen = OpenAIGenerator(args.server, args.model, args.api_key, args.max_new_tokens, args.temperature,
                                  args.concurrency, args.request_timeout, args.max_retries)
            regenerate(convs, gen, args.out, args.batch_size, args.max_turns, args.overwrite, not args.quiet, stats,
                       budget_s)
        except OpenAIError as e:
            raise UserError(f"--server {args.server}: {type(e).__name__}: {e}; finished rows are kept in "
                            f"{args.out}.partial, rerun to resume") from None
    else:
        from sglang_eagle3.engine.loader import load_engine
        from sglang_eagle3.engine.settings import settings_from_args
        # no draft unless asked: vanilla decoding
        settings = settings_from_args(args, args.draft or "none", temperature=args.temperature, device=args.device)
        gen = EngineGenerator(load_engine(args.target, settings),
                              args.max_new_tokens, args.temperature, args.batch_size, args.seed)
        # the engine batches continuously: hand it several batches' worth of conversations per call
        regenerate(convs, gen, args.out, args.write_every or 4 * args.batch_size, args.max_turns, args.overwrite,
                   not args.quiet, stats, budget_s)
    print(json.dumps(stats.as_dict(), indent=2))
    print(f"wrote {args.out}" + (f" ({stats.left_for_later} conversations left for a rerun: --time-budget "
                                 f"{args.time_budget:g} min spent)" if stats.left_for_later else ""))
    return 0


def add_cli(sub) -> None:
    p = sub.add_parser("regenerate", help="replace the answers of chat data with the target's own (resumable)")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="chat data files or HF ids (as in prepare-data)")
    p.add_argument("--out", required=True, help="output .jsonl (OUT.partial while running; rerun to resume)")
    p.add_argument("--format", choices=FORMATS, default=None, help="format of inputs without :FORMAT")
    p.add_argument("--target", default=None, help="target folder for the in-process engine ('testbed' = SmolLM2)")
    p.add_argument("--draft", default=None, help="EAGLE-3 draft folder to speed the engine up (default: none)")
    add_dtype_arg(p)
    p.add_argument("--device", default="cpu")
    p.add_argument("--server", default=None, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:30000/v1")
    p.add_argument("--model", default=None, help="model name on the server (default: its first model)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"))
    p.add_argument("--concurrency", type=int, default=16, help="parallel requests to the server")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default 600)")
    p.add_argument("--max-retries", type=int, default=3, help="retries per failed request (default 3)")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=16, help="requests decoded together (server: per batch)")
    p.add_argument("--write-every", type=int, default=None,
                   help="in-process engine: conversations per call and per fsync (default 4 x --batch-size)")
    p.add_argument("--max-turns", type=int, default=None, help="regenerate at most this many turns per conversation")
    p.add_argument("--max-rows", type=int, default=None, help="read at most this many rows per input")
    p.add_argument("--max-prompt-chars", type=int, default=None,
                   help="skip conversations whose system + user text is longer (counted; they are answered last "
                        "anyway, shortest prompts first); a larger value on a finished OUT adds the skipped ones")
    p.add_argument("--time-budget", type=float, default=None, metavar="MINUTES",
                   help="start no batch after this many minutes and write OUT with the rows done (shortest prompts "
                        "first); rerunning goes on with the rest")
    p.add_argument("--overwrite", action="store_true", help="redo a finished OUT")
    p.add_argument("--quiet", action="store_true")
    add_spec_args(p, profile=False)
    p.set_defaults(func=run)
