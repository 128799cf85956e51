"""Synthesize user prompts with the target itself (`eagle3 synthesize-prompts`).

A chat model asked to continue its own template right where a user's message begins writes a user's message
(the "Magpie" recipe: arXiv 2406.08464): no seed data, and as many distinct prompts as one samples. For a draft the
point is distinct conversations on the target's own distribution: every public prompt here has been answered
already, and more answers to the same prompts teach a draft less than new prompts do. `eagle3 regenerate` then
answers these prompts like any others.

Each kept prompt ended with the target's end-of-turn token (a message cut off by --max-new-tokens is not kept),
has at least --min-chars characters, differs from every prompt kept before it (whitespace and case ignored) and
shares no 13-word sequence with the --exclude files (the eval sets: no benchmark prompt, or most of one, may
reach the training data). Output: jsonl rows {"id", "turns": [prompt], "batch"} (the "prompts" format that
regenerate and prepare-data read), appended to OUT.partial after every batch; a rerun resumes after the last
batch written (a batch's seed is the run's seed and its index, so a resumed run never draws the same batch
twice); OUT.partial becomes OUT once --n prompts are kept (a larger --n later draws more after them).

--turns K writes conversations of up to K user turns (MT-bench asks a second question after the model's own first
answer): the target answers each kept prompt (--answer-temperature, --answer-max-new-tokens), then continues its
template where the next user message begins, as many times as asked. A follow-up is kept if it finished and has
--min-chars characters, and shares no 13-word run with an --exclude file (follow-ups such as "Make it shorter." may
repeat across conversations); the first follow-up or answer that fails ends its conversation, which keeps the turns
before it. These answers only condition the follow-ups: regenerate answers every turn again.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from typing import Iterable, Optional

from sglang_eagle3.engine.settings import add_dtype_arg
from sglang_eagle3.errors import UserError, check_at_least, flags_of
from sglang_eagle3.fileio import append_jsonl, check_apart, exclusive_writer, read_jsonl_resumable, write_text_atomic

SENTINEL = "\u2063SYNTH\u2063"          # stands for the user's message while the template is rendered
NGRAM = 13                               # decontamination: word n-grams shared with an excluded prompt
FOLLOW_UP_SEED_STEP = 500_009            # --turns: answer k and follow-up k draw at batch seed + (2k-1) or 2k x this


def chat_messages(system: Optional[str], users: list[str], answers: list[str]) -> list[dict]:
    """system, user 1, answer 1, user 2, ...: the user turns and the answers interleaved."""
    messages = [{"role": "system", "content": system}] if system else []
    for k, user in enumerate(users):
        messages.append({"role": "user", "content": user})
        if k < len(answers):
            messages.append({"role": "assistant", "content": answers[k]})
    return messages


def pre_query_ids(tokenizer, system: Optional[str] = None, users: Iterable[str] = (),
                  answers: Iterable[str] = ()) -> list[int]:
    """Token ids of the chat template (and a conversation so far, if given) up to where the next user message's
    text begins."""
    messages = chat_messages(system, list(users) + [SENTINEL], list(answers))
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    except Exception as e:              # a template that rejects a system message, or no template at all
        raise UserError(f"the target's chat template cannot render a user turn ({type(e).__name__}: {e})") from None
    if SENTINEL not in text:
        raise UserError("the target's chat template does not place the user's text verbatim; cannot find where a "
                        "user message begins")
    return list(tokenizer(text[:text.index(SENTINEL)], add_special_tokens=False)["input_ids"])


def normalize(text: str) -> str:
    return " ".join(text.lower().split())


def word_ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


@dataclass
class PromptFilter:
    """Keeps a prompt once: finished, long enough, new, and sharing no NGRAM-word run with an excluded prompt."""
    min_chars: int = 16
    excluded: set = field(default_factory=set)         # word n-grams of the excluded prompts
    excluded_short: set = field(default_factory=set)   # whole normalised excluded prompts shorter than NGRAM words
    seen: set = field(default_factory=set)             # normalised prompts kept so far
    dropped: dict = field(default_factory=dict)        # reason -> count

    def exclude(self, prompts: Iterable[str]) -> None:
        for p in prompts:
            grams = word_ngrams(p)
            if grams:
                self.excluded |= grams
            else:
                self.excluded_short.add(normalize(p))

    def drop(self, reason: str) -> bool:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        return False

    def keep(self, text: str, finished: bool, follow_up: bool = False) -> bool:
        """A first turn must be new; a follow-up (`follow_up`) may repeat another conversation's."""
        what = "follow-up " if follow_up else ""
        if not finished:
            return self.drop(what + "cut off at --max-new-tokens")
        if len(text.strip()) < self.min_chars:
            return self.drop(what + "shorter than --min-chars")
        key = normalize(text)
        if not follow_up and key in self.seen:
            return self.drop("duplicate")
        if key in self.excluded_short or not word_ngrams(text).isdisjoint(self.excluded):
            return self.drop(what + "overlaps an --exclude prompt")
        if not follow_up:
            self.seen.add(key)
        return True


def read_partial(path: str) -> tuple[list[dict], int]:
    """(rows already kept, the next batch index); a torn last line (a kill mid-write) is cut off."""
    def check(row):
        int(row["batch"]), row["turns"][0]
    rows = read_jsonl_resumable(path, check, "a synthesized prompt")
    next_batch = max((int(r["batch"]) + 1 for r in rows), default=0)
    return [r for r in rows if r.get("id") != "-"], next_batch     # "-": a batch that kept nothing (still counted)


@dataclass
class FollowUps:
    """How conversations grow past their first user turn (turns=1: they do not)."""
    turns: int = 1                       # user turns per conversation, at most
    answer_temperature: float = 0.7
    answer_max_new_tokens: int = 512


def add_follow_ups(engine, convs: list[dict], batch_seed: int, params, follow: FollowUps, flt: PromptFilter,
                   system: Optional[str], batch_size: int) -> None:
    """Grows each conversation {"turns": [user 1]} by an answer and a follow-up user turn, up to follow.turns user
    turns; the first answer or follow-up that fails ends a conversation (it keeps the turns before it)."""
    answers = [[] for _ in convs]
    live = list(range(len(convs)))
    for k in range(1, follow.turns):
        step_seed = batch_seed + FOLLOW_UP_SEED_STEP * (2 * k - 1)   # turn 1 keeps batch_seed: --turns 1 is unchanged
        outs, _ = engine.generate([chat_messages(system, convs[i]["turns"], answers[i]) for i in live],
                                  replace(params, temperature=follow.answer_temperature, top_p=1.0,
                                          max_new_tokens=follow.answer_max_new_tokens, seed=step_seed),
                                  batch_size=batch_size)
        answered = []
        for i, o in zip(live, outs):
            if o.finish_reason in ("eos", "stop") and o.text.strip():
                answers[i].append(o.text.strip())
                answered.append(i)
            else:
                flt.drop("answer cut off or empty (ends the conversation)")
        if not answered:
            return
        outs, _ = engine.generate([pre_query_ids(engine.tokenizer, system, convs[i]["turns"], answers[i])
                                   for i in answered], replace(params, seed=step_seed + FOLLOW_UP_SEED_STEP),
                                  batch_size=batch_size)
        live = []
        for i, o in zip(answered, outs):
            text = o.text.strip()
            if flt.keep(text, o.finish_reason in ("eos", "stop"), follow_up=True):
                convs[i]["turns"].append(text)
                live.append(i)
        if not live:
            return


def synthesize(engine, n: int, out: str, seed: int = 0, temperature: float = 1.0, top_p: float = 1.0,
               max_new_tokens: int = 256, batch_size: int = 64, system: Optional[str] = None,
               flt: Optional[PromptFilter] = None, progress: bool = True, max_barren_batches: int = 20,
               follow: Optional[FollowUps] = None) -> dict:
    """Sample user prompts (conversations of up to follow.turns user turns) from the engine's target until n are
    kept in OUT; returns counts."""
    from tqdm import tqdm

    from sglang_eagle3.engine.verify import SamplingParams, derived_seed
    flt, follow = flt or PromptFilter(), follow or FollowUps()
    prefix = pre_query_ids(engine.tokenizer, system)
    partial = out + ".partial"
    with exclusive_writer(partial):
        if os.path.exists(out) and os.path.getsize(partial) == 0:
            os.replace(out, partial)       # a larger --n: go on from the finished rows (they keep their batch)
        rows, batch = read_partial(partial)
        for r in rows:
            flt.seen.add(normalize(r["turns"][0]))
        kept_before, sampled, barren = len(rows), 0, 0
        with open(partial, "a", encoding="utf-8") as f, \
                tqdm(total=n, initial=min(n, len(rows)), desc="synthesizing", unit=" prompt",
                     disable=not progress) as bar:
            while len(rows) < n:
                batch_seed = derived_seed(seed, batch)
                params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                        seed=batch_seed)
                outs, _ = engine.generate([list(prefix)] * batch_size, params, batch_size=batch_size)
                sampled += len(outs)
                new = []
                for i, o in enumerate(outs):
                    text = o.text.strip()
                    if flt.keep(text, o.finish_reason in ("eos", "stop")) and len(rows) + len(new) < n:
                        new.append({"id": f"synth-s{seed}-b{batch}-{i}", "turns": [text], "batch": batch})
                if follow.turns > 1 and new:
                    add_follow_ups(engine, new, batch_seed, params, follow, flt, system, batch_size)
                append_jsonl(f, new or [{"id": "-", "turns": [""], "batch": batch}])
                rows += new
                bar.update(len(new))
                bar.set_postfix_str(f"kept {len(new)}/{len(outs)} of batch {batch}")
                barren = barren + 1 if len(new) < max(1, batch_size // 20) else 0
                if barren >= max_barren_batches:
                    raise UserError(f"{max_barren_batches} batches in a row kept under 5% of their prompts "
                                    f"({len(rows)} kept of --n {n}; dropped: {flt.dropped}): the target repeats "
                                    f"itself at --temperature {temperature:g}; raise it or ask for fewer")
                batch += 1
    # the finished file: kept prompts only, in the order drawn
    write_text_atomic(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows[:n]))
    os.remove(partial)
    turns = [len(r["turns"]) for r in rows[:n]]
    return {"kept": min(n, len(rows)), "kept_before_this_run": kept_before, "sampled_this_run": sampled,
            "batches": batch, "dropped_this_run": dict(flt.dropped),
            "conversations_by_user_turns": {str(k): turns.count(k) for k in sorted(set(turns))}}


# ---- command line ----------------------------------------------------------------------------
def run_settings(args) -> dict:
    return {"target": os.path.abspath(args.target) if os.path.exists(args.target) else args.target,
            "dtype": args.dtype, "seed": args.seed, "temperature": args.temperature, "top_p": args.top_p,
            "max_new_tokens": args.max_new_tokens, "system": args.system, "min_chars": args.min_chars,
            "exclude": sorted(os.path.abspath(p) for p in args.exclude), "batch_size": args.batch_size,
            **({"turns": args.turns, "answer_temperature": args.answer_temperature,      # only when used: files
                "answer_max_new_tokens": args.answer_max_new_tokens} if args.turns > 1 else {})}  # of one turn resume


def check_args(args) -> None:
    """Every flag, before any file is read, removed or written."""
    from sglang_eagle3.engine.settings import check_device
    from sglang_eagle3.engine.verify import SamplingParams
    from sglang_eagle3.training.regenerate import written_files
    check_apart(written_files(args.out), {"--exclude": args.exclude, "--target": args.target})
    check_at_least(1, flags_of(args, "n", "batch_size", "max_new_tokens", "min_chars", "turns",
                               "answer_max_new_tokens"))
    if not args.temperature > 0:
        raise UserError(f"--temperature must be > 0 (greedy decoding writes one prompt), got {args.temperature}")
    SamplingParams.from_flags(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              seed=args.seed)
    try:
        SamplingParams(temperature=args.answer_temperature)
    except ValueError:
        raise UserError(f"--answer-temperature must be a finite number >= 0, got {args.answer_temperature}") from None
    check_device(args.device)


def run(args) -> int:
    from sglang_eagle3.engine.prompts import load_prompts
    from sglang_eagle3.training.regenerate import check_settings
    check_args(args)
    flt = PromptFilter(min_chars=args.min_chars)
    for path in args.exclude:                        # read before anything is removed: a bad path loses nothing
        flt.exclude(t for turns in load_prompts(path) for t in turns)
    if os.path.exists(args.out) and not args.overwrite:
        with open(args.out, encoding="utf-8") as f:
            have = sum(1 for line in f if line.strip())
        if have >= args.n:
            print(f"{args.out} already holds {have} prompts; pass --overwrite to draw new ones")
            return 0
        print(f"{args.out} holds {have} prompts: drawing {args.n - have} more")
    if args.overwrite:
        for stale in (args.out, args.out + ".partial"):
            if os.path.exists(stale):
                os.remove(stale)
    check_settings(args.out, run_settings(args), args.overwrite)   # a resumed run draws the same way
    from sglang_eagle3.engine.loader import load_engine
    from sglang_eagle3.engine.settings import resolve_settings
    engine = load_engine(args.target, resolve_settings("none", dtype=args.dtype, device=args.device))
    counts = synthesize(engine, args.n, args.out, args.seed, args.temperature, args.top_p, args.max_new_tokens,
                        args.batch_size, args.system, flt, not args.quiet,
                        follow=FollowUps(args.turns, args.answer_temperature, args.answer_max_new_tokens))
    print(json.dumps(counts, indent=2))
    print(f"wrote {args.out}")
    return 0


def add_cli(sub) -> None:
    p = sub.add_parser("synthesize-prompts",
                       help="user prompts written by the target itself (Magpie), for regenerate (resumable)")
    p.add_argument("--target", required=True, help="target folder ('testbed' = SmolLM2)")
    p.add_argument("--out", required=True, help="output .jsonl (OUT.partial while running; rerun to resume)")
    p.add_argument("--n", type=int, required=True, help="prompts to keep")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest prompt drawn (longer ones are dropped)")
    p.add_argument("--min-chars", type=int, default=16, help="shortest prompt kept (default 16 characters)")
    p.add_argument("--system", default=None, help="system message before the user turn (default: the template's)")
    p.add_argument("--exclude", nargs="*", default=[], metavar="FILE",
                   help="prompt files (eval sets) whose prompts must not reappear: a prompt sharing a 13-word run "
                        "with one of them is dropped")
    p.add_argument("--turns", type=int, default=1,
                   help="user turns per conversation, at most: the target answers, then writes the next user turn")
    p.add_argument("--answer-temperature", type=float, default=0.7, help="--turns > 1: temperature of the answers")
    p.add_argument("--answer-max-new-tokens", type=int, default=512,
                   help="--turns > 1: an answer cut off here ends its conversation")
    p.add_argument("--batch-size", type=int, default=64, help="prompts drawn per batch")
    add_dtype_arg(p)
    p.add_argument("--device", default="cpu")
    p.add_argument("--overwrite", action="store_true", help="draw a finished or partial OUT again")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=run)
