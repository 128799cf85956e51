"""Read chat data in its common public formats and normalise every row to one shape.

A row becomes a `Conversation`: a list of messages `{"role": "system"|"user"|"assistant"|"tool", "content": str}`
plus optional tool definitions. Supported row formats (auto-detected per source from its first row):

  sharegpt   {"conversations": [{"from": "human"|"gpt"|"system"|"function_call"|"observation", "value"}],
              optional "system": str, "tools": str|list}          (ShareGPT, LLaMA-Factory tool calling)
  messages   {"messages": [{"role", "content"}]}                    (UltraChat-200k on the HF hub, OpenAI style)
  ultrachat  {"data": [str, str, ...]}                              (original UltraChat: user/assistant alternating)
  alpaca     {"instruction", "input", "output", optional "system", "history": [[q, a], ...]}
  gsm8k      {"question", "answer"}
  prompts    {"turns": [str, ...]}                                  (MT-bench-style eval files: user turns only)

Sources are local .json/.jsonl files (or anything `datasets` reads locally, e.g. .parquet) or HF hub dataset ids.
Row problems (no assistant turn, wrong types, empty text) raise `BadRow` and are counted by the caller; a source
whose rows match no format, or that is not valid JSON, raises `DataError` naming the file and the row.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Iterator, Optional

from sglang_eagle3.errors import UserError

FORMATS = ("sharegpt", "messages", "ultrachat", "alpaca", "gsm8k", "prompts")

ROLE_ALIASES = {
    "system": "system",
    "human": "user", "user": "user", "prompter": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "model": "assistant", "function_call": "assistant",
    "observation": "tool", "tool": "tool", "function": "tool", "ipython": "tool",
}


class DataError(UserError):
    """A source that cannot be read as chat data (bad file, unknown format)."""


class BadRow(ValueError):
    """A row that is skipped; str(self) is the reason it is counted under."""


@dataclass
class Conversation:
    messages: list[dict]
    tools: Optional[list] = None
    id: str = ""        # the row's own id field, else its row number
    source: str = ""    # source name (file name or hub id@split)
    key: str = ""       # "source:row number", unique across inputs
    notes: list[str] = field(default_factory=list)   # harmless fixes applied while normalising


# ---- format detection --------------------------------------------------------------------
REQUIRED_FIELDS = {"sharegpt": ("conversations",), "messages": ("messages",), "ultrachat": ("data",),
                   "alpaca": ("instruction", "output"), "gsm8k": ("question", "answer"), "prompts": ("turns",)}


def has_fields(row, fmt: str) -> bool:
    return isinstance(row, dict) and all(k in row for k in REQUIRED_FIELDS[fmt])


def detect_format(row) -> Optional[str]:
    """The first format (in FORMATS order) whose fields the row has, else None."""
    return next((fmt for fmt in FORMATS if has_fields(row, fmt)), None)


# ---- per-format normalisation (row -> messages, tools) ----------------------------------------
def _text(value, what: str) -> str:
    if isinstance(value, list):   # OpenAI content parts: [{"type": "text", "text": ...}]
        parts = [p.get("text") for p in value if isinstance(p, dict) and p.get("type", "text") == "text"]
        if parts and all(isinstance(p, str) for p in parts):
            value = "".join(parts)
    if not isinstance(value, str):
        raise BadRow(f"wrong types: {what} is {type(value).__name__}, not a string")
    if not value.strip():
        raise BadRow(f"empty text in {what}")
    return value


def _role(name) -> str:
    role = ROLE_ALIASES.get(name.lower()) if isinstance(name, str) else None
    if role is None:
        raise BadRow(f"unknown role {name!r}")
    return role


def _turn_list(value, what: str) -> list:
    if not isinstance(value, list):
        raise BadRow(f"wrong types: {what} is {type(value).__name__}, not a list")
    return value


def _tools(value) -> Optional[list]:
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise BadRow("wrong types: 'tools' is not valid JSON")
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise BadRow("wrong types: 'tools' must be a list of objects")
    return value


def _system(row) -> list[dict]:
    s = row.get("system")
    return [{"role": "system", "content": _text(s, "'system'")}] if isinstance(s, str) and s.strip() else []


def _sharegpt(row):
    msgs = _system(row)
    for i, turn in enumerate(_turn_list(row["conversations"], "'conversations'")):
        if not isinstance(turn, dict):
            raise BadRow(f"wrong types: conversations[{i}] is {type(turn).__name__}")
        role = turn.get("from", turn.get("role"))
        content = turn.get("value", turn.get("content"))
        msgs.append({"role": _role(role), "content": _text(content, f"conversations[{i}]")})
    return msgs, _tools(row.get("tools"))


def _messages(row):
    msgs = []
    for i, turn in enumerate(_turn_list(row["messages"], "'messages'")):
        if not isinstance(turn, dict):
            raise BadRow(f"wrong types: messages[{i}] is {type(turn).__name__}")
        msgs.append({"role": _role(turn.get("role")), "content": _text(turn.get("content"), f"messages[{i}]")})
    return msgs, _tools(row.get("tools"))


def _ultrachat(row):
    turns = _turn_list(row["data"], "'data'")
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": _text(t, f"data[{i}]")}
            for i, t in enumerate(turns)], None


def _alpaca(row):
    msgs = _system(row)
    for i, pair in enumerate(row.get("history") or []):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise BadRow(f"wrong types: history[{i}] is not a [question, answer] pair")
        msgs += [{"role": "user", "content": _text(pair[0], f"history[{i}][0]")},
                 {"role": "assistant", "content": _text(pair[1], f"history[{i}][1]")}]
    prompt = _text(row["instruction"], "'instruction'")
    extra = row.get("input")
    if extra is not None and not isinstance(extra, str):
        raise BadRow(f"wrong types: 'input' is {type(extra).__name__}")
    if extra and extra.strip():
        prompt = f"{prompt}\n\n{extra}"
    msgs += [{"role": "user", "content": prompt}, {"role": "assistant", "content": _text(row["output"], "'output'")}]
    return msgs, None


def _gsm8k(row):
    return [{"role": "user", "content": _text(row["question"], "'question'")},
            {"role": "assistant", "content": _text(row["answer"], "'answer'")}], None


def _prompts(row):
    turns = _turn_list(row["turns"], "'turns'")
    return [{"role": "user", "content": _text(t, f"turns[{i}]")} for i, t in enumerate(turns)], None


_NORMALISERS = {"sharegpt": _sharegpt, "messages": _messages, "ultrachat": _ultrachat, "alpaca": _alpaca,
                "gsm8k": _gsm8k, "prompts": _prompts}


def normalise(row, fmt: str, require_assistant: bool = True) -> Conversation:
    """One raw row -> Conversation; raises BadRow. Assistant turns before the first user turn are dropped
    (ShareGPT chunks of split conversations start mid-dialogue), and so are turns after the last assistant turn."""
    if not isinstance(row, dict):
        raise BadRow(f"wrong types: row is {type(row).__name__}, not an object")
    if not has_fields(row, fmt):
        raise BadRow(f"wrong types: row does not have the {fmt} fields")
    msgs, tools = _NORMALISERS[fmt](row)
    conv = Conversation(msgs, tools)
    first_user = next((i for i, m in enumerate(msgs) if m["role"] == "user"), None)
    if first_user is None:
        raise BadRow("no user turn")
    lead = [m for m in msgs[:first_user] if m["role"] not in ("system",)]
    if lead:
        conv.notes.append("leading non-user turns dropped")
        msgs = [m for m in msgs[:first_user] if m["role"] == "system"] + msgs[first_user:]
    if require_assistant:
        last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
        if last is None:
            raise BadRow("no assistant turn")
        if last + 1 < len(msgs):
            conv.notes.append("trailing non-assistant turns dropped")
            msgs = msgs[:last + 1]
    conv.messages = msgs
    return conv


def row_id(row, number: int) -> str:
    if isinstance(row, dict):
        for key in ("id", "question_id", "prompt_id", "idx"):
            if isinstance(row.get(key), (str, int)):
                return str(row[key])
    return str(number)


# ---- sources -----------------------------------------------------------------------------
@dataclass
class Source:
    """One input: a local file or an HF dataset id, with an optional forced format and split."""
    spec: str
    path: str
    format: Optional[str] = None
    split: str = "train"
    is_hub: bool = False
    label: Optional[str] = None   # overrides the default name (see parse_sources)

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        return os.path.basename(self.path) if not self.is_hub else f"{self.path}@{self.split}"


def parse_source(spec: str, default_format: Optional[str] = None) -> Source:
    """`PATH[:FORMAT]` or `HF_ID[@SPLIT][:FORMAT]`; a path that does not exist and looks like `org/name` is a hub id."""
    path, fmt = spec, default_format
    head, sep, tail = spec.rpartition(":")
    if sep and tail in FORMATS:
        path, fmt = head, tail
    if fmt is not None and fmt not in FORMATS:
        raise DataError(f"{spec}: unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if os.path.exists(path):
        return Source(spec, path, fmt)
    name, _, split = path.partition("@")
    if name.count("/") == 1 and not name.startswith((".", "/")) and not name.endswith((".json", ".jsonl")):
        return Source(spec, name, fmt, split or "train", is_hub=True)
    raise DataError(f"{spec}: no such file (and not an HF dataset id of the form org/name[@split])")


def parse_sources(specs: list[str], default_format: Optional[str] = None) -> list[Source]:
    """parse_source for each spec; sources whose names collide are named by their full path instead."""
    sources = [parse_source(s, default_format) for s in specs]
    names = [s.name for s in sources]
    for s in sources:
        if names.count(s.name) > 1:
            s.label = s.path if not s.is_hub else s.spec
    names = [s.name for s in sources]
    if len(set(names)) < len(names):
        raise DataError(f"an input is given twice: {sorted(n for n in set(names) if names.count(n) > 1)}")
    return sources


def _json_rows(path: str) -> Iterator[tuple[int, object]]:
    """(row number, parsed row); jsonl row numbers are line numbers."""
    with open(path, encoding="utf-8") as f:
        head = f.read(1 << 16).lstrip()
    if path.endswith(".json") and head.startswith("["):
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: not valid JSON ({e})") from None
        yield from enumerate(data, start=1)
        return
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as e:   # one broken line is a malformed row: skipped and counted
                yield number, BadRow(f"not valid JSON ({e.msg})")


def _dataset_rows(src: Source) -> Iterator[tuple[int, object]]:
    import datasets  # optional dependency (extra "train")
    try:
        if src.is_hub:
            ds = datasets.load_dataset(src.path, split=src.split)
        else:
            ext = os.path.splitext(src.path)[1].lstrip(".")
            builder = {"jsonl": "json", "pq": "parquet"}.get(ext, ext)
            ds = datasets.load_dataset(builder, data_files=src.path, split="train")
    except Exception as e:   # network, unknown id or split, unreadable file: one line, not a traceback
        raise DataError(f"{src.spec}: cannot load with datasets.load_dataset ({type(e).__name__}: {e})") from None
    yield from enumerate(ds, start=1)


def count_rows(src: Source) -> Optional[int]:
    """Row count of a local .jsonl (cheap: one pass over the lines), else None."""
    if src.is_hub or not src.path.endswith(".jsonl"):
        return None
    with open(src.path, "rb") as f:
        return sum(1 for line in f if line.strip())


def raw_rows(src: Source) -> Iterator[tuple[int, object]]:
    if src.is_hub or not src.path.endswith((".json", ".jsonl")):
        return _dataset_rows(src)
    return _json_rows(src.path)


def read_source(src: Source, require_assistant: bool = True) -> Iterator[tuple[int, object]]:
    """Yield (row number, Conversation | BadRow) for every row of a source; format fixed by its first row."""
    fmt, first = src.format, True
    for number, row in raw_rows(src):
        if isinstance(row, BadRow):
            yield number, row
            continue
        if first:
            first = False
            if fmt is not None and not has_fields(row, fmt):
                raise DataError(f"{src.path}: row {number} does not have the {fmt} fields "
                                f"{list(REQUIRED_FIELDS[fmt])} (format given with --format or PATH:FORMAT)")
            fmt = fmt or detect_format(row)
            if fmt is None:
                keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise DataError(f"{src.path}: row {number} matches no supported format (fields: {keys}); expected "
                                "one of: conversations (sharegpt), messages, data (ultrachat), instruction/output "
                                "(alpaca), question/answer (gsm8k), turns (prompts)")
        try:
            conv = normalise(row, fmt, require_assistant)
        except BadRow as e:
            yield number, e
            continue
        conv.id, conv.source, conv.key = row_id(row, number), src.name, f"{src.name}:{number}"
        yield number, conv
