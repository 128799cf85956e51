"""Drafts from the context: the continuation of the longest earlier occurrence of what was just written.

Much of what a target writes is already in its context (a summary copies its article, a code edit its code, a
small model its own loops). `SuffixIndex` keeps, for one request's token stream (prompt + output), the most recent
end positions of every n-gram up to `max_n` tokens: appending a token updates `max_n` dict entries (amortised O(1)
per token), and `propose` looks the current suffix up from the longest n-gram down. It returns the continuation
after the longest earlier match and, where earlier occurrences disagree on the next token, the next few distinct
ones (from the same or shorter matches), each with its match length (what acceptance is calibrated by).

`SuffixPool` holds the streams of recent requests (the server's: bounded tokens, least recently used out), so a
request can also continue text another request wrote. `ContextDrafter` is the speculative worker's proposer of them
(proposers.Proposer): calibrated chains as tree candidates, and the calibration learnt from each verify.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional

from sglang_eagle3.engine.proposers import StepBatch, VerifyOutput
from sglang_eagle3.engine.tree import Candidates, chain_candidates


@dataclass
class Proposal:
    tokens: list[int]        # the continuation: what followed the earlier occurrence
    match_len: int           # tokens of the current suffix that the earlier occurrence shares


def continuation(src: list[int], end: int, max_tokens: int) -> list[int]:
    """What followed position `end` of `src`, up to max_tokens; past the stream's end it goes on with itself (a loop
    that ends the stream repeats: "a b c a b" matched at 2 continues "c a b c a b ...")."""
    out: list[int] = []
    for i in range(max_tokens):
        j = end + i
        out.append(src[j] if j < len(src) else out[j - len(src)])
    return out


def _remember(table: dict, ngram: tuple, where, keep: int) -> None:
    """table[ngram] += [where], keeping its `keep` most recent entries (newest last)."""
    seen = table.setdefault(ngram, [])
    seen.append(where)
    if len(seen) > keep:
        del seen[0]


class SuffixIndex:
    """n-gram -> its `keep` most recent end positions (exclusive, newest last), for n = 1..max_n."""

    def __init__(self, tokens: Iterable[int] = (), max_n: int = 8, keep: int = 4):
        if max_n < 1 or keep < 1:
            raise ValueError(f"max_n and keep must be >= 1, got {max_n}, {keep}")
        self.max_n, self.keep = max_n, keep
        self.tokens: list[int] = []
        self.ends: list[dict[tuple, list[int]]] = [{} for _ in range(max_n + 1)]   # [n][ngram] -> end positions
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens)
            for n in range(1, min(self.max_n, end) + 1):
                _remember(self.ends[n], tuple(self.tokens[end - n:end]), end, self.keep)

    def earlier_ends(self, suffix: tuple) -> list[int]:
        """End positions of earlier occurrences of `suffix` (not the one ending the stream), newest first."""
        seen = self.ends[len(suffix)].get(suffix, ())
        return [e for e in reversed(seen) if e < len(self.tokens)]

    def continuation(self, end: int, max_tokens: int) -> list[int]:
        return continuation(self.tokens, end, max_tokens)

    def propose(self, max_tokens: int, max_branches: int = 1, min_match: int = 1,
                suffix: Optional[list[int]] = None) -> list[Proposal]:
        """Continuations of `suffix` (default: the end of this stream), longest earlier match first, at most
        `max_branches` with distinct first tokens, each up to `max_tokens` long."""
        suffix = self.tokens if suffix is None else suffix
        out: list[Proposal] = []
        firsts: set[int] = set()
        for n in range(min(self.max_n, len(suffix)), min_match - 1, -1):
            key = tuple(suffix[len(suffix) - n:])
            ends = self.earlier_ends(key)         # (another stream's suffix: its matches ending ours are earlier too)
            for e in ends:
                cont = self.continuation(e, max_tokens)
                if cont and cont[0] not in firsts:
                    firsts.add(cont[0])
                    out.append(Proposal(cont, n))
                    if len(out) >= max_branches:
                        return out
        return out


class SuffixPool:
    """The token streams of recent requests, searched when a request's own stream has no match. One n-gram index
    over all of them (n-gram -> its `keep` most recent (stream, end) pairs), so a lookup costs the same however many
    streams the pool holds. Bounded by `max_tokens` in all; the least recently added stream goes first, and the
    index drops a gone stream's entries once they outnumber the live ones (amortised O(1) per token)."""

    def __init__(self, max_tokens: int, max_n: int = 8, keep: int = 4):
        self.max_tokens, self.max_n, self.keep = max_tokens, max_n, keep
        self.streams: OrderedDict[object, tuple[int, list[int]]] = OrderedDict()   # key -> (stream id, tokens)
        self.live: dict[int, list[int]] = {}                                         # stream id -> tokens
        self.ends: list[dict[tuple, list[tuple[int, int]]]] = [{} for _ in range(max_n + 1)]
        self.total, self.stale, self._next_id = 0, 0, 0

    def add(self, key, tokens: list[int]) -> None:
        if key in self.streams:
            self._drop(key)
        if not tokens or len(tokens) > self.max_tokens:
            return
        sid, self._next_id = self._next_id, self._next_id + 1
        tokens = [int(t) for t in tokens]
        self.streams[key] = (sid, tokens)
        self.live[sid] = tokens
        self.total += len(tokens)
        self._index(sid, tokens)
        while self.total > self.max_tokens:
            self._drop(next(iter(self.streams)))
        if self.stale > max(self.total, 4096):                 # rebuild without the gone streams' entries
            self.ends = [{} for _ in range(self.max_n + 1)]
            for sid, tokens in self.streams.values():
                self._index(sid, tokens)
            self.stale = 0

    def _drop(self, key) -> None:
        sid, tokens = self.streams.pop(key)
        del self.live[sid]
        self.total -= len(tokens)
        self.stale += len(tokens)

    def _index(self, sid: int, tokens: list[int]) -> None:
        for end in range(1, len(tokens)):                      # a match must have a next token in its stream
            for n in range(1, min(self.max_n, end) + 1):
                _remember(self.ends[n], tuple(tokens[end - n:end]), (sid, end), self.keep)

    def propose(self, suffix: list[int], max_tokens: int, min_match: int) -> Optional[Proposal]:
        """The longest match of `suffix` over the pooled streams (the newest stream first on equal length)."""
        for n in range(min(self.max_n, len(suffix)), max(min_match, 1) - 1, -1):
            for sid, end in reversed(self.ends[n].get(tuple(suffix[len(suffix) - n:]), ())):
                tokens = self.live.get(sid)
                if tokens is not None:
                    return Proposal(continuation(tokens, end, max_tokens), n)
        return None


class MatchCalibration:
    """P(a context continuation's next token is accepted | its match length): a Beta posterior per match length
    (1..max_n), updated from every step's outcome."""

    # SmolLM2-135M's greedy answers to 50 eval prompts (10 per set, 96 tokens): the share of positions where the
    # longest earlier match of length m predicted the next token (1,238 / 502 / 293 / ... / 620 positions)
    PRIOR = {1: 0.195, 2: 0.488, 3: 0.635, 4: 0.708, 5: 0.75, 6: 0.828, 7: 0.846, 8: 0.874}
    STRENGTH = 20.0                       # the prior counts as this many observations

    def __init__(self, max_n: int = 8):
        self.max_n = max_n
        self.hits = {m: self.STRENGTH * self.PRIOR.get(m, self.PRIOR[8]) for m in range(1, max_n + 1)}
        self.tries = {m: self.STRENGTH for m in range(1, max_n + 1)}

    def chance(self, match_len: int) -> float:
        m = min(max(match_len, 1), self.max_n)
        return self.hits[m] / self.tries[m]

    def chain_log_chances(self, match_len: int, length: int) -> list[float]:
        """Cumulative log chances of a chain of `length` continuation tokens: each accepted token lengthens the
        match by one."""
        out, acc = [], 0.0
        for j in range(length):
            acc += math.log(self.chance(match_len + j))
            out.append(acc)
        return out

    def observe(self, match_len: int, proposed: int, accepted: int) -> None:
        """A chain of `proposed` tokens from a match of `match_len`, of which the first `accepted` were accepted."""
        for j in range(min(proposed, accepted + 1)):
            m = min(match_len + j, self.max_n)
            self.tries[m] += 1
            self.hits[m] += 1 if j < accepted else 0


class ContextDrafter:
    """Proposals from each running request's own text (and the pool of recent requests'), scored by calibrated
    acceptance chances, and the calibration learnt from what the verifies accepted (greedy and sampled apart)."""

    def __init__(self, max_tokens: int, max_branches: int, min_match: int, pool_tokens: int, max_n: int = 8):
        """The Drafting fields of the same names (context_tokens, context_branches, min_match, pool_tokens: 0 for
        none)."""
        self.max_tokens, self.max_branches, self.min_match, self.max_n = max_tokens, max_branches, min_match, max_n
        self.streams: dict[object, SuffixIndex] = {}
        self.pool = SuffixPool(pool_tokens, max_n) if pool_tokens else None
        self.calibration = {True: MatchCalibration(max_n), False: MatchCalibration(max_n)}   # greedy -> table
        self.last: dict[object, list[Proposal]] = {}

    def start(self, key, tokens: list[int]) -> None:
        self.streams[key] = SuffixIndex(tokens, self.max_n)

    def append(self, key, tokens: list[int]) -> None:
        if key in self.streams:
            self.streams[key].extend(tokens)

    def finish(self, key) -> None:
        index = self.streams.pop(key, None)
        self.last.pop(key, None)
        if index is not None and self.pool is not None:
            self.pool.add(key, index.tokens)

    def proposals(self, keys: list, greedy: list[bool]) -> list[list[tuple[list[int], list[float]]]]:
        """Per request: its chains (tokens after its last token, cumulative log chances of acceptance)."""
        out = []
        for key, g in zip(keys, greedy):
            index = self.streams[key]
            found = index.propose(self.max_tokens, self.max_branches, self.min_match)
            if not found and self.pool is not None:
                other = self.pool.propose(index.tokens[-self.max_n:], self.max_tokens, self.min_match)
                found = [other] if other is not None else []
            self.last[key] = found
            table = self.calibration[g]
            out.append([(p.tokens, table.chain_log_chances(p.match_len, len(p.tokens))) for p in found])
        return out

    def propose(self, batch: StepBatch) -> Optional[Candidates]:
        """The proposer interface (proposers.Proposer): the batch's chains as tree candidates (None: no row has one)."""
        chains = self.proposals(batch.keys, batch.greedy)
        return chain_candidates(chains, batch.index.device) if any(chains) else None

    def commit(self, batch: StepBatch, verified: VerifyOutput) -> None:
        """After the verify: learn from the chains proposed for it (none when this step did not look them up)."""
        if verified.tree.num_nodes > 1 and any(self.last.get(key) for key in batch.keys):
            self.observe(batch.keys, batch.greedy, verified.emitted, verified.tree.tokens.tolist(),
                         verified.tree.parents.tolist())
        for key in batch.keys:
            self.last.pop(key, None)

    def observe(self, keys: list, greedy: list[bool], emitted: list[list[int]], tree_tokens: list[list[int]],
                tree_parents: list[list[int]]) -> None:
        """Learn from one step: for each proposed chain, how far it reached into the verified tree and how much of
        that the target accepted (its emitted tokens before the bonus)."""
        for key, g, out, tokens, parents in zip(keys, greedy, emitted, tree_tokens, tree_parents):
            accepted = out[:-1]
            for p in self.last.get(key, ()):
                in_tree = _depth_in_tree(p.tokens, tokens, parents)
                if in_tree:
                    same = 0
                    while same < min(in_tree, len(accepted)) and accepted[same] == p.tokens[same]:
                        same += 1
                    self.calibration[g].observe(p.match_len, in_tree, same)


def _depth_in_tree(chain: list[int], tokens: list[int], parents: list[int]) -> int:
    """How many of the chain's first tokens form a path from the root of the tree (tokens, parents per node)."""
    at, depth = 0, 0
    for token in chain:
        nxt = next((i for i in range(at + 1, len(tokens)) if parents[i] == at and tokens[i] == token), None)
        if nxt is None:
            break
        at, depth = nxt, depth + 1
    return depth
