"""Tokenize chat sources into a training set on disk, with stats.

Layout of a prepared dataset directory (written to DIR.tmp-PID and renamed into place when complete):
  data.arrow   Arrow IPC stream, one row per conversation: input_ids list<int32>, loss_mask list<int8>
               (1 = assistant token: trained on), id string, source string. `load_tokenized(DIR)` returns it as a
               memory-mapped `datasets.Dataset`; `pyarrow.ipc.open_stream` reads it without `datasets`.
  stats.json   rows read/kept/dropped (with reasons, per source), tokens, assistant tokens, length policy.
"""
from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Optional

from sglang_eagle3.fileio import check_apart, move_in, write_json
from sglang_eagle3.training.data.chat import ChatRenderer, ChatTemplateError
from sglang_eagle3.training.data.formats import BadRow, DataError, Source, count_rows, read_source

DATA_FILE, STATS_FILE = "data.arrow", "stats.json"
LENGTH_POLICIES = ("drop", "truncate")


@dataclass
class SourceStats:
    rows: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    first_dropped: dict = field(default_factory=dict)   # reason -> first row number
    notes: Counter = field(default_factory=Counter)
    tokens: int = 0
    assistant_tokens: int = 0
    truncated: int = 0

    def drop(self, reason: str, number: int) -> None:
        self.dropped[reason] += 1
        self.first_dropped.setdefault(reason, number)

    def as_dict(self) -> dict:
        return {"rows": self.rows, "kept": self.kept, "dropped": sum(self.dropped.values()),
                "dropped_by_reason": {r: {"rows": n, "first_row": self.first_dropped[r]}
                                      for r, n in self.dropped.most_common()},
                "notes": dict(self.notes), "truncated": self.truncated,
                "tokens": self.tokens, "assistant_tokens": self.assistant_tokens}


def _reason_key(e: BadRow) -> str:
    """Group reasons by kind: 'empty text in conversations[3]' -> 'empty text'."""
    msg = str(e)
    for prefix in ("empty text", "wrong types", "unknown role", "not valid JSON"):
        if msg.startswith(prefix):
            return prefix if prefix != "unknown role" else msg
    return msg


def apply_length(ids: list[int], mask: list[int], max_length: Optional[int], policy: str):
    """(ids, mask, truncated?) or raise BadRow."""
    if max_length is None or len(ids) <= max_length:
        return ids, mask, False
    if policy == "drop":
        raise BadRow("longer than --max-length")
    ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        raise BadRow("no assistant token within --max-length")
    return ids, mask, True


def answer_ngrams(ids: list[int], mask: list[int], n: int = 8) -> tuple[list[int], list[tuple]]:
    """(positions in `ids` of the assistant tokens, their n-grams in order: gram j starts at positions[j])."""
    positions = [i for i, m in enumerate(mask) if m]
    answer = [ids[i] for i in positions]
    return positions, [tuple(answer[j:j + n]) for j in range(len(answer) - n + 1)]


def distinct_ngram_ratio(ids: list[int], mask: list[int], n: int = 8) -> float:
    """Distinct n-grams / all n-grams over the assistant tokens: ~1 for prose, < 0.5 for an answer stuck in a loop
    (small greedy targets often repeat one sentence until max_new_tokens). Answers shorter than n tokens -> 1."""
    grams = answer_ngrams(ids, mask, n)[1]
    return len(set(grams)) / len(grams) if grams else 1.0


def loop_start(ids: list[int], mask: list[int], n: int = 8) -> Optional[int]:
    """Index in `ids` where the answers first repeat an n-gram they already said (the loop begins), or None."""
    positions, grams = answer_ngrams(ids, mask, n)
    seen = set()
    for j, gram in enumerate(grams):
        if gram in seen:
            return positions[j]
        seen.add(gram)
    return None


def encode_sources(sources: list[Source], renderer: ChatRenderer, max_length: Optional[int] = None,
                   length_policy: str = "truncate", skip_template_errors: bool = False,
                   max_rows: Optional[int] = None, stats: Optional[dict] = None, progress: bool = True,
                   min_distinct_ngrams: Optional[float] = None, cut_loops: bool = False):
    """Yield training examples {input_ids, loss_mask, id, source}; fills stats[source name] = SourceStats.
    min_distinct_ngrams: rows whose answers repeat themselves (see `distinct_ngram_ratio`) are dropped, or with
    cut_loops kept up to where the loop begins (the answer so far is still the target's own)."""
    from tqdm import tqdm

    if length_policy not in LENGTH_POLICIES:
        raise DataError(f"--length-policy must be one of {LENGTH_POLICIES}, got {length_policy!r}")
    stats = {} if stats is None else stats
    counts = [count_rows(s) if progress else None for s in sources]
    total = None if None in counts else sum(min(n, max_rows or n) for n in counts)
    bar = tqdm(desc="tokenizing", unit=" rows", total=total, disable=not progress)
    for src in sources:
        st = stats.setdefault(src.name, SourceStats())
        for number, item in read_source(src):
            if max_rows is not None and st.rows >= max_rows:
                break
            st.rows += 1
            bar.update(1)
            if isinstance(item, BadRow):
                st.drop(_reason_key(item), number)
                continue
            try:
                enc = renderer.encode(item)
                ids, mask, truncated = apply_length(enc.input_ids, enc.loss_mask, max_length, length_policy)
            except BadRow as e:
                st.drop(str(e), number)
                continue
            except ChatTemplateError as e:
                if not skip_template_errors:
                    raise ChatTemplateError(f"{src.path}: row {number}: {e}") from None
                st.drop(f"chat template error: {str(e)[:160]}", number)
                continue
            if not any(mask):
                st.drop("no assistant token after rendering", number)
                continue
            if min_distinct_ngrams is not None and distinct_ngram_ratio(ids, mask) < min_distinct_ngrams:
                cut = loop_start(ids, mask) if cut_loops else None
                if cut is None or not any(mask[:cut]):
                    st.drop(f"looping answer (distinct 8-gram ratio < {min_distinct_ngrams})", number)
                    continue
                ids, mask = ids[:cut], mask[:cut]
                st.notes["looping answer cut where the loop begins"] += 1
            st.kept += 1
            st.truncated += truncated
            st.notes.update(item.notes)
            if enc.fallback:
                st.notes["answer spans found by search (template not prefix-stable)"] += 1
            if not enc.exact:
                st.notes["tokenized piecewise: differs from whole-text tokenization"] += 1
            st.tokens += len(ids)
            st.assistant_tokens += int(sum(mask))
            yield {"input_ids": ids, "loss_mask": mask, "id": item.id, "source": src.name}
    bar.close()


# ---- writing -------------------------------------------------------------------------------
def _schema():
    import pyarrow as pa
    return pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
                      ("id", pa.string()), ("source", pa.string())])


def write_examples(path: str, examples: Iterable[dict], batch_rows: int = 512) -> int:
    """Stream examples into an Arrow IPC stream file; returns rows written."""
    import pyarrow as pa
    schema, n, buf = _schema(), 0, []
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        def flush():
            cols = {k: [ex[k] for ex in buf] for k in schema.names}
            writer.write_batch(pa.RecordBatch.from_pydict(cols, schema=schema))
            buf.clear()
        for ex in examples:
            buf.append(ex)
            n += 1
            if len(buf) >= batch_rows:
                flush()
        if buf:
            flush()
    return n


def _fsync_dir(path: str) -> None:
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f:
            os.fsync(f.fileno())


def dataset_file(name: str) -> bool:
    """A file of the data set: what --overwrite replaces in an existing --out (the rows, their stats, and the
    draft vocabulary built from them: training/vocab.py's draft_vocab.safetensors / .json)."""
    return name in (DATA_FILE, STATS_FILE) or name.startswith("draft_vocab.")


def check_dataset_out(out: str, overwrite: bool) -> None:
    """The folder a dataset goes to: new, or a folder whose dataset files --overwrite replaces (others are kept)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise DataError(f"--out {out} is a file, not a folder")
    if os.path.exists(out) and not overwrite:
        raise DataError(f"--out {out} exists; pass --overwrite to replace its {DATA_FILE} and {STATS_FILE} (its "
                        "other files are kept)")


def kept_files(out: str) -> list[str]:
    """The files of an existing --out that --overwrite keeps (all but the dataset's own)."""
    return sorted(n for n in os.listdir(out) if not dataset_file(n)) if os.path.isdir(out) else []


def publish_dir(tmp: str, out: str, overwrite: bool) -> None:
    """Move a finished tmp dir to `out`. An existing `out` is written into only with overwrite=True: its dataset files
    are replaced, its other files kept (kept_files)."""
    _fsync_dir(tmp)
    check_dataset_out(out, overwrite)
    if os.path.exists(out):
        move_in(tmp, out, dataset_file)
    else:
        os.rename(tmp, out)


def prepare_dataset(sources: list[Source], tokenizer, out: str, *, max_length: Optional[int] = None,
                    length_policy: str = "truncate", merge_system: bool = False, tool_role: str = "tool",
                    min_distinct_ngrams: Optional[float] = None, cut_loops: bool = False,
                    skip_template_errors: bool = False, max_rows: Optional[int] = None, overwrite: bool = False,
                    target_vocab_size: Optional[int] = None, extra_stats: Optional[dict] = None,
                    progress: bool = True) -> dict:
    """Tokenize `sources` with the target tokenizer's chat template into dataset dir `out`; returns the stats."""
    check_apart({"--out": out}, {"input": [s.path for s in sources if not s.is_hub]}, DataError)
    check_dataset_out(out, overwrite)
    renderer = ChatRenderer(tokenizer, merge_system=merge_system, tool_role=tool_role)
    out = os.path.abspath(out)
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    per_source: dict[str, SourceStats] = {}
    try:
        examples = encode_sources(sources, renderer, max_length, length_policy, skip_template_errors, max_rows,
                                  per_source, progress, min_distinct_ngrams, cut_loops)
        rows = write_examples(os.path.join(tmp, DATA_FILE), examples)
        if rows == 0:
            reasons = Counter()
            for st in per_source.values():
                reasons.update(st.dropped)
            raise DataError(f"no usable conversations in {', '.join(s.spec for s in sources)} "
                            f"(dropped: {dict(reasons.most_common(3))})")
        total = SourceStats()
        for name, st in per_source.items():
            total.rows += st.rows
            total.kept += st.kept
            total.truncated += st.truncated
            total.tokens += st.tokens
            total.assistant_tokens += st.assistant_tokens
            total.notes.update(st.notes)
            for reason, n in st.dropped.items():
                total.dropped[reason] += n
                total.first_dropped.setdefault(reason, f"{name}:{st.first_dropped[reason]}")
        stats = {"examples": rows, "total": total.as_dict(),
                 "sources": {name: st.as_dict() for name, st in per_source.items()},
                 "target_tokenizer": renderer.name, "target_vocab_size": target_vocab_size or len(tokenizer),
                 "max_length": max_length, "length_policy": length_policy, "merge_system": merge_system,
                 "min_distinct_ngrams": min_distinct_ngrams, "cut_loops": cut_loops,
                 "tool_role": tool_role, **(extra_stats or {})}
        write_json(os.path.join(tmp, STATS_FILE), stats)
        publish_dir(tmp, out, overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return stats


# ---- reading -------------------------------------------------------------------------------
def load_tokenized(path: str):
    """A prepared dataset dir -> memory-mapped `datasets.Dataset` (columns input_ids, loss_mask, id, source)."""
    import datasets
    f = os.path.join(path, DATA_FILE)
    if not os.path.isfile(f):
        raise DataError(f"{path}: no {DATA_FILE}; prepare it with `eagle3 prepare-data`")
    return datasets.Dataset.from_file(f)


def iter_tokenized(path: str, batch_rows: int = 1024):
    """Yield (input_ids [n] int32, loss_mask [n] int8) numpy arrays per row, without `datasets`."""
    import pyarrow as pa
    f = os.path.join(path, DATA_FILE)
    if not os.path.isfile(f):
        raise DataError(f"{path}: no {DATA_FILE}; prepare it with `eagle3 prepare-data`")
    with pa.memory_map(f) as source:
        for batch in pa.ipc.open_stream(source):
            ids, mask = _flat(batch.column("input_ids")), _flat(batch.column("loss_mask"))
            for r in range(len(batch)):
                # copies: the memory map closes when the generator ends
                yield ids[0][ids[1][r]:ids[1][r + 1]].copy(), mask[0][mask[1][r]:mask[1][r + 1]].copy()


def _flat(col):
    """list array -> (values [N], offsets [rows+1] starting at 0)."""
    off = col.offsets.to_numpy()
    return col.flatten().to_numpy(zero_copy_only=False), off - off[0]


def read_stats(path: str) -> dict:
    with open(os.path.join(path, STATS_FILE)) as f:
        return json.load(f)
