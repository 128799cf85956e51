"""Render a conversation with the target tokenizer's own chat template and mask the assistant tokens.

The mask is derived from the template itself, never from hard-coded separators. For assistant message i:
  pre_i  = render(messages[:i],   add_generation_prompt=True)   # everything up to where the answer starts
  upto_i = render(messages[:i+1])                               # ... plus the answer and what closes the turn
When both are prefixes of the full rendering, the span of turn i is [len(pre_i), len(upto_i)) minus trailing
whitespace: the content plus the template's end-of-turn marker (`<|im_end|>`, `<|eot_id|>`, `</s>`,
`<end_of_turn>`), but not the newline the template prints after it (never generated: decoding stops first).
Templates whose renderings are not prefix-stable (system prompt put into the last user turn, reasoning blocks
only on the last answer, ...) fall back to finding the rendered content in the full text and extending it with
the head/tail the local rendering put around it. The full text is tokenized once; a token is a loss token when
its character span (offset mapping) overlaps an assistant span. Tokenizers without offsets are encoded piece by
piece instead (and flagged when that differs from tokenizing the whole text).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

import numpy as np

from sglang_eagle3.training.data.formats import Conversation, DataError

TOOLS_PREAMBLE = "You can call the following tools. Their JSON definitions:\n"


class ChatTemplateError(DataError):
    """The target's chat template cannot render this conversation (unsupported role, alternation, ...)."""


@dataclass
class Encoded:
    input_ids: list[int]
    loss_mask: list[int]
    text: str
    spans: list[tuple[int, int]]    # character spans of assistant turns in `text`
    fallback: bool                  # True if a span needed the non-prefix-stable fallback
    exact: bool = True              # False if piecewise tokens differ from tokenizing the whole text


class ChatRenderer:
    """Chat-template rendering + assistant loss mask for one tokenizer.

    merge_system: fold a system message into the first user turn (for templates without a system role).
    tool_role:    role name used for tool results ("tool"; use "user" for templates that only know user/assistant).
    """

    def __init__(self, tokenizer, merge_system: bool = False, tool_role: str = "tool"):
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("default") or next(iter(template.values()), None)
        if not template:
            raise ChatTemplateError(f"tokenizer {tokenizer.name_or_path!r} has no chat_template; the data is "
                                    "rendered with the target's own template, so the target needs one")
        self.tokenizer, self.template = tokenizer, template
        self.name = tokenizer.name_or_path or "tokenizer"
        self.merge_system, self.tool_role = merge_system, tool_role
        self.supports_tools = "tools" in template
        self.use_offsets = bool(getattr(tokenizer, "is_fast", False))

    # ---- messages as the template will see them -------------------------------------------
    def prepare(self, conv: Conversation) -> tuple[list[dict], Optional[list]]:
        msgs = [dict(m) for m in conv.messages]
        tools = conv.tools
        if tools and not self.supports_tools:   # the template ignores tools=: keep them visible in the prompt
            text = TOOLS_PREAMBLE + json.dumps(tools, ensure_ascii=False)
            if msgs and msgs[0]["role"] == "system":
                msgs[0]["content"] = text + "\n\n" + msgs[0]["content"]
            else:
                msgs.insert(0, {"role": "system", "content": text})
            tools = None
        for m in msgs:
            if m["role"] == "tool":
                m["role"] = self.tool_role
        if self.merge_system and msgs and msgs[0]["role"] == "system":
            system = msgs.pop(0)["content"]
            first_user = next((i for i, m in enumerate(msgs) if m["role"] == "user"), None)
            if first_user is not None:
                msgs[first_user] = {"role": "user", "content": system + "\n\n" + msgs[first_user]["content"]}
        return msgs, tools

    def render(self, msgs: list[dict], tools=None, add_generation_prompt: bool = False) -> str:
        try:
            text = self.tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as e:   # jinja2 TemplateError from raise_exception(), or a template bug
            roles = "/".join(m["role"] for m in msgs)
            hints = []
            if any(m["role"] == "system" for m in msgs) and not self.merge_system:
                hints.append("--merge-system folds the system prompt into the first user turn")
            if any(m["role"] == "tool" for m in msgs):
                hints.append("--tool-role user sends tool results as user turns")
            hints.append("--skip-template-errors skips such conversations")
            raise ChatTemplateError(f"chat template of {self.name!r} rejected a conversation with roles {roles}: "
                                    f"{type(e).__name__}: {e} ({'; '.join(hints)})") from None
        if not isinstance(text, str):
            raise ChatTemplateError(f"apply_chat_template of {self.name!r} returned {type(text).__name__}, not text")
        return text

    # ---- assistant spans --------------------------------------------------------------------
    def spans(self, msgs: list[dict], tools=None) -> tuple[str, list[tuple[int, int]], bool]:
        """(full text, [(start, end)] character span of every assistant message, used fallback?)."""
        full = self.render(msgs, tools)
        spans, cursor, fallback = [], 0, False
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            pre = self.render(msgs[:i], tools, add_generation_prompt=True)
            upto = self.render(msgs[:i + 1], tools)
            if upto.startswith(pre) and full.startswith(upto) and len(pre) >= cursor:
                start, end = len(pre), len(pre) + len(upto[len(pre):].rstrip())
            else:
                anchor = self._skip_prompts(full, cursor, msgs, i)
                local = self._local_turn(msgs, i, pre, upto, tools)
                start, end = self._locate(full, anchor, local, m["content"], i, floor=cursor)
                fallback = True
            if end <= start:
                raise ChatTemplateError(f"chat template of {self.name!r} rendered assistant message {i} as nothing")
            spans.append((start, end))
            cursor = end
        return full, spans, fallback

    def _skip_prompts(self, full, cursor, msgs, i) -> int:
        """Move past the contents of the non-assistant messages just before assistant message i."""
        j = i
        while j > 0 and msgs[j - 1]["role"] != "assistant":
            j -= 1
        for m in msgs[j:i]:
            if m["role"] == "system":   # templates move system prompts around; users and tool results stay put
                continue
            at = full.find(m["content"].strip(), cursor)
            if at >= 0:
                cursor = at + len(m["content"].strip())
        return cursor

    def _local_turn(self, msgs, i, pre, upto, tools) -> str:
        """The answer as the template renders it right after a generation prompt (content + head/tail)."""
        if upto.startswith(pre):
            return upto[len(pre):]
        mini = [{"role": "user", "content": "Hi."}, msgs[i]]
        try:
            pre, upto = self.render(mini[:1], tools, True), self.render(mini, tools)
        except ChatTemplateError:
            return ""
        return upto[len(pre):] if upto.startswith(pre) else ""

    def _locate(self, full, cursor, local, content, i, floor) -> tuple[int, int]:
        """Find the content after `cursor` (else after `floor`, the end of the previous answer)."""
        for body, frm in ((content, cursor), (content.strip(), cursor), (content, floor), (content.strip(), floor)):
            at = full.find(body, frm)
            if body and at >= 0:
                cursor = frm
                break
        else:
            raise ChatTemplateError(f"chat template of {self.name!r}: cannot find assistant message {i} in the "
                                    "rendered conversation (the template rewrites assistant content)")
        start, end = at, at + len(body)
        k = local.find(body)
        if k >= 0:
            head, tail = local[:k], local[k + len(body):].rstrip()
            if head and start - len(head) >= cursor and full[start - len(head):start] == head:
                start -= len(head)
            if tail and full.startswith(tail, end):
                end += len(tail)
        return start, end

    # ---- tokens ---------------------------------------------------------------------------
    def encode(self, conv: Conversation) -> Encoded:
        msgs, tools = self.prepare(conv)
        text, spans, fallback = self.spans(msgs, tools)
        if self.use_offsets:
            ids, mask = self._encode_offsets(text, spans)
            return Encoded(ids, mask, text, spans, fallback)
        ids, mask = self._encode_pieces(text, spans)
        exact = ids == list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return Encoded(ids, mask, text, spans, fallback, exact)

    def _encode_offsets(self, text, spans):
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        off = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)   # [T, 2]
        starts = np.array([s for s, _ in spans], dtype=np.int64)
        ends = np.array([e for _, e in spans], dtype=np.int64)
        a, b = off[:, 0], np.maximum(off[:, 1], off[:, 0] + 1)   # empty spans count as one char at their start
        k = np.searchsorted(starts, b, side="left") - 1           # last assistant span starting before b
        mask = (k >= 0) & (ends[np.clip(k, 0, None)] > a)
        return ids, mask.astype(np.int64).tolist()

    def _encode_pieces(self, text, spans):
        ids, mask, pos = [], [], 0
        cuts = [(s, e, 1) for s, e in spans]
        pieces = []
        for s, e, flag in cuts:
            pieces += [(text[pos:s], 0), (text[s:e], flag)]
            pos = e
        pieces.append((text[pos:], 0))
        for piece, flag in pieces:
            if piece:
                p = self.tokenizer(piece, add_special_tokens=False)["input_ids"]
                ids += p
                mask += [flag] * len(p)
        return ids, mask
