"""Prompt files for generation and benchmarks: one JSON object a line.

Accepted rows: the eval format `{"turns": [str, ...]}` (all turns kept: MT-bench asks its second turn
after the model's own first answer), ShareGPT `{"conversations": [{"from", "value"}]}` (human turns),
`{"prompt": str}`, Alpaca `{"instruction", "input"}` and GSM8K `{"question"}`.
"""
from __future__ import annotations

import json
import os

from sglang_eagle3.errors import UserError


class PromptFileError(UserError, ValueError):
    pass


def row_turns(row, where: str) -> list[str]:
    """User turns of one row."""
    if not isinstance(row, dict):
        raise PromptFileError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "turns" in row:
        turns = row["turns"]
    elif "conversations" in row:
        convs = row["conversations"]
        if not isinstance(convs, list):
            raise PromptFileError(f"{where}: 'conversations' must be a list")
        turns = [t.get("value") for t in convs if isinstance(t, dict) and t.get("from") in ("human", "user")]
    elif "prompt" in row:
        turns = [row["prompt"]]
    elif "instruction" in row:
        turns = [row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")]
    elif "question" in row:
        turns = [row["question"]]
    else:
        raise PromptFileError(f"{where}: no prompt found (expected one of turns, conversations, prompt, "
                              f"instruction, question; got keys {sorted(row)})")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise PromptFileError(f"{where}: prompt turns must be a non-empty list of non-empty strings")
    return turns


def load_prompts(path: str, limit: int | None = None) -> list[list[str]]:
    """[[turn1, turn2, ...], ...] from a jsonl file; errors name the file and the line."""
    if os.path.isdir(path):
        raise PromptFileError(f"prompts file {path} is a folder; give a .jsonl file (one prompt row a line)")
    if not os.path.isfile(path):
        raise PromptFileError(f"prompts file {path} does not exist")
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptFileError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            out.append(row_turns(row, f"{path}:{n}"))
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise PromptFileError(f"{path}: no prompts")
    return out
