"""`eagle3 prepare-data` and `eagle3 build-vocab` (also train/prepare_data.py and train/build_vocab.py)."""
from __future__ import annotations

import argparse
import json
import sys

from sglang_eagle3.errors import check_at_least, flags_of
from sglang_eagle3.fileio import check_apart
from sglang_eagle3.training.data.build import LENGTH_POLICIES
from sglang_eagle3.training.data.formats import FORMATS, DataError


def load_target_tokenizer(target: str):
    """(tokenizer, target vocab size from config.json, else len(tokenizer))."""
    from transformers import AutoConfig, AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError) as e:
        raise DataError(f"--target {target}: cannot load a tokenizer ({e})") from None
    try:
        cfg = AutoConfig.from_pretrained(target)
        vocab = getattr(getattr(cfg, "text_config", cfg), "vocab_size", None)
    except (OSError, ValueError):
        vocab = None
    return tok, int(vocab or len(tok))


def add_prepare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="local .json/.jsonl/.parquet file or HF dataset id (org/name[@split]); append :FORMAT to "
                        f"force a format ({', '.join(FORMATS)})")
    p.add_argument("--target", required=True,
                   help="target model or tokenizer folder / HF id (its chat template is used)")
    p.add_argument("--out", required=True, help="output dataset directory (data.arrow + stats.json)")
    p.add_argument("--format", choices=FORMATS, default=None, help="format of inputs without :FORMAT (default: detect)")
    p.add_argument("--max-length", type=int, default=None, help="token limit per conversation")
    p.add_argument("--length-policy", choices=LENGTH_POLICIES, default="truncate",
                   help="what to do with longer conversations (default: truncate)")
    p.add_argument("--merge-system", action="store_true",
                   help="fold the system prompt into the first user turn (templates without a system role)")
    p.add_argument("--tool-role", default="tool", help="role name for tool results (default: tool; or user)")
    p.add_argument("--skip-template-errors", action="store_true",
                   help="skip (and count) conversations the chat template rejects instead of stopping")
    p.add_argument("--max-rows", type=int, default=None, help="read at most this many rows per input")
    p.add_argument("--min-distinct-ngrams", type=float, default=None, metavar="RATIO",
                   help="drop rows whose answer repeats itself: distinct/all 8-grams of the assistant tokens below "
                        "RATIO (0.5 catches answers stuck in a loop; default: keep every row)")
    p.add_argument("--cut-loops", action="store_true",
                   help="with --min-distinct-ngrams: keep a looping row up to where its loop begins (its first "
                        "repeated 8-gram) instead of dropping it")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="also build the draft vocab (draft_vocab.safetensors) of this size in --out")
    p.add_argument("--overwrite", action="store_true", help="write into an existing --out: its data set (data.arrow, "
                                                            "stats.json, draft_vocab.*) is replaced, other files kept")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run_prepare(args) -> int:
    from sglang_eagle3.training.data.build import check_dataset_out, kept_files, prepare_dataset
    from sglang_eagle3.training.data.formats import parse_sources
    sources = parse_sources(args.inputs, args.format)
    check_apart({"--out": args.out}, {"input": [s.path for s in sources if not s.is_hub], "--target": args.target})
    if args.max_length is not None and args.max_length < 2:
        raise DataError(f"--max-length must be >= 2, got {args.max_length}")
    if args.min_distinct_ngrams is not None and not 0 < args.min_distinct_ngrams <= 1:
        raise DataError(f"--min-distinct-ngrams must be in (0, 1], got {args.min_distinct_ngrams}")
    if args.cut_loops and args.min_distinct_ngrams is None:
        raise DataError("--cut-loops needs --min-distinct-ngrams (which rows count as looping)")
    check_at_least(1, flags_of(args, "max_rows", "draft_vocab_size"), DataError)
    check_dataset_out(args.out, args.overwrite)
    kept = kept_files(args.out)
    tok, vocab = load_target_tokenizer(args.target)
    if args.draft_vocab_size is not None and args.draft_vocab_size > vocab:
        raise DataError(f"--draft-vocab-size {args.draft_vocab_size} exceeds the target vocabulary of {vocab}")
    stats = prepare_dataset(sources, tok, args.out, max_length=args.max_length, length_policy=args.length_policy,
                            merge_system=args.merge_system, tool_role=args.tool_role,
                            skip_template_errors=args.skip_template_errors, max_rows=args.max_rows,
                            min_distinct_ngrams=args.min_distinct_ngrams, cut_loops=args.cut_loops,
                            overwrite=args.overwrite, target_vocab_size=vocab, progress=not args.quiet,
                            extra_stats={"target": args.target, "inputs": args.inputs})
    print(format_stats(stats))
    print(f"wrote {args.out}")
    if kept:
        print(f"eagle3 prepare-data: replaced the data set in {args.out}; kept {', '.join(kept)}", file=sys.stderr)
    if args.draft_vocab_size:
        from sglang_eagle3.training.vocab import build_vocab, format_report
        print(format_report(build_vocab(args.out, args.draft_vocab_size, vocab, overwrite=True)))
    return 0


def format_stats(stats: dict) -> str:
    lines = []
    for name, st in list(stats["sources"].items()) + [("TOTAL", stats["total"])]:
        lines.append(f"{name}: rows {st['rows']}, kept {st['kept']}, dropped {st['dropped']}, "
                     f"truncated {st['truncated']}, tokens {st['tokens']}, assistant tokens {st['assistant_tokens']}")
        for reason, d in st["dropped_by_reason"].items():
            first = f"row {d['first_row']}" if isinstance(d["first_row"], int) else d["first_row"]
            lines.append(f"    dropped {d['rows']:>6}  {reason}  (first: {first})")
        for note, n in st["notes"].items():
            lines.append(f"    note    {n:>6}  {note}")
        if name != "TOTAL" and st["kept"] == 0 and "no assistant turn" in st["dropped_by_reason"]:
            lines.append("    hint: prompts only? give them answers first with `eagle3 regenerate`")
    return "\n".join(lines)


def add_vocab_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("data", help="dataset directory written by prepare-data")
    p.add_argument("--draft-vocab-size", type=int, required=True, help="number of target ids the draft predicts")
    p.add_argument("--vocab-size", type=int, default=None, help="target vocab size (default: from stats.json)")
    p.add_argument("--out", default=None, help="directory for draft_vocab.safetensors/.json (default: the data dir)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--force", action="store_true", help="replace a draft vocabulary already in --out")


def run_vocab(args) -> int:
    from sglang_eagle3.training.vocab import build_vocab, format_report
    try:
        report = build_vocab(args.data, args.draft_vocab_size, args.vocab_size, args.out, overwrite=args.force)
    except ValueError as e:
        raise DataError(str(e)) from None
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def add_cli(sub) -> None:
    p = sub.add_parser("prepare-data", help="tokenize chat data with the target's chat template (+ loss mask)")
    add_prepare_args(p)
    p.set_defaults(func=run_prepare)
    v = sub.add_parser("build-vocab", help="choose the draft vocab from a prepared dataset's assistant tokens")
    add_vocab_args(v)
    v.set_defaults(func=run_vocab)
