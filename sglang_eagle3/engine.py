"""SpeculativeEngine: batched EAGLE-3 decoding (and the vanilla baseline) on one target runtime.

One decoding step for a batch of sequences, each at root token x_n (the last verified token):
  1. draft:   grow a tree from the draft's state at position n-1           (tree.grow_tree)
  2. verify:  one target forward over the tree with its ancestor mask      (TargetModel.forward)
  3. accept:  greedy / lossless sampling walk down the tree                 (verify.py)
  4. commit:  keep the accepted KV slots; draft-extend over the accepted tokens with the target's
              fused features, which also gives the draft state for the next tree.
With draft=None the tree is just the root: the same runtime decodes one token per forward.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from .config import SpecConfig
from .kvcache import KVCache, cache_attend, cache_attention_mask, causal_mask
from .tree import DraftTree, grow_tree
from .verify import SamplingParams, target_probs, verify_greedy, verify_sampling

Prompt = Union[str, list]   # plain text, or chat messages [{"role", "content"}]


@dataclass
class RequestOutput:
    prompt: Prompt
    text: str
    token_ids: list[int]
    finish_reason: str                         # "eos" | "length" | "stop"
    verify_steps: int                          # target forwards that produced tokens (prefill included)
    accept_lengths: list[int] = field(default_factory=list)   # tokens emitted per step

    @property
    def accept_length(self) -> float:
        return len(self.token_ids) / max(1, self.verify_steps)


@dataclass
class BatchStats:
    generated_tokens: int = 0
    verify_steps: int = 0
    draft_time: float = 0.0
    verify_time: float = 0.0
    prefill_time: float = 0.0
    total_time: float = 0.0

    @property
    def accept_length(self) -> float:
        return self.generated_tokens / max(1, self.verify_steps)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / max(self.total_time, 1e-9)

    def add(self, other: "BatchStats") -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))

    def as_dict(self) -> dict:
        return {"accept_length": self.accept_length, "tokens_per_s": self.tokens_per_s,
                "verify_steps": self.verify_steps, "generated_tokens": self.generated_tokens,
                "draft_time_s": self.draft_time, "verify_time_s": self.verify_time,
                "prefill_time_s": self.prefill_time, "total_time_s": self.total_time}


class _Sequence:
    def __init__(self, prompt, prompt_ids):
        self.prompt, self.prompt_ids = prompt, prompt_ids
        self.out: list[int] = []
        self.accept_lengths: list[int] = []
        self.finish_reason: Optional[str] = None
        self.text: Optional[str] = None


class SpeculativeEngine:
    def __init__(self, target, draft=None, spec: Optional[SpecConfig] = None):
        self.target, self.draft, self.spec = target, draft, spec or SpecConfig()
        self.tokenizer = target.tokenizer
        if draft is not None:
            draft.check_target(target.hf_config, target.aux_layer_ids)
            draft.to(device=target.device, dtype=target.dtype).eval()
            draft.set_embedding(target.embed_tokens)
        self.eos_ids = self._eos_ids()

    def _eos_ids(self) -> set[int]:
        ids = set()
        gen = getattr(self.target, "generation_config", None)
        for src in (getattr(self.target.hf_config, "eos_token_id", None), getattr(gen, "eos_token_id", None),
                    getattr(self.tokenizer, "eos_token_id", None)):
            if src is not None:
                ids.update(src if isinstance(src, (list, tuple)) else [src])
        return ids

    # ---- prompts -------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        return list(ids)

    # ---- public API ----------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[Prompt], params: Optional[SamplingParams] = None,
                 batch_size: Optional[int] = None) -> tuple[list[RequestOutput], BatchStats]:
        params = params or SamplingParams()
        gen = None
        if not params.greedy:
            gen = torch.Generator(device=self.target.device)
            gen.manual_seed(params.seed if params.seed is not None else torch.seed())
        stats, outputs = BatchStats(), []
        bs = batch_size or len(prompts)
        for i in range(0, len(prompts), bs):
            outs, st = self._generate_batch(prompts[i:i + bs], params, gen)
            outputs += outs
            stats.add(st)
        return outputs, stats

    # ---- one batch -----------------------------------------------------------------------
    def _generate_batch(self, prompts, params, gen):
        t_start = time.perf_counter()
        seqs = [_Sequence(p, self.encode(p)) for p in prompts]
        B, dev = len(seqs), self.target.device
        lens = torch.tensor([len(s.prompt_ids) for s in seqs], device=dev)
        if int(lens.min()) == 0:
            raise ValueError("empty prompt after tokenization")
        n_tree = self.spec.num_draft_tokens if self.draft is not None else 1
        max_len = int(lens.max()) + params.max_new_tokens + n_tree + 1
        tcache = self.target.new_cache(B, max_len)
        stats = BatchStats()

        # prefill (right-padded) -> first token from the target
        ids = torch.zeros(B, int(lens.max()), dtype=torch.long, device=dev)
        for b, s in enumerate(seqs):
            ids[b, :len(s.prompt_ids)] = torch.tensor(s.prompt_ids)
        pos = torch.arange(ids.shape[1], device=dev).expand(B, -1)
        out = self.target(tcache, ids, pos, num_new=lens, logit_index=(lens - 1).view(B, 1),
                          want_aux=self.draft is not None)
        tcache.commit([list(range(len(s.prompt_ids))) for s in seqs])
        roots = self._sample(out.logits[:, 0], params, gen)                     # [B]
        stats.verify_steps += B
        for b, s in enumerate(seqs):
            self._emit(s, [int(roots[b])], params)                                # prefill token: not a verify step
        dcache, d_hidden, d_logits = None, None, None
        if self.draft is not None:
            dcache = KVCache(1, B, self.draft.config.num_key_value_heads,
                             max_len + self.spec.num_steps * self.spec.topk + 2, self.draft.config.head_dim,
                             self.target.dtype, dev)
            d_in = torch.cat([ids[:, 1:], ids[:, :1]], 1)
            d_in[torch.arange(B), lens - 1] = roots
            d_hidden, d_logits = self._draft_extend(dcache, d_in, out.aux_hidden_states, pos, lens)
        stats.prefill_time = time.perf_counter() - t_start

        root_pos = lens.clone()                                                   # position of each root token
        active = list(range(B))                                                   # cache row -> sequence
        while True:
            keep = [j for j, b in enumerate(active) if seqs[b].finish_reason is None]
            if not keep:
                break
            if len(keep) < len(active):                                           # drop finished rows once
                rows = torch.tensor(keep, device=dev)
                active = [active[j] for j in keep]
                tcache, roots, root_pos = tcache.select(rows), roots[rows], root_pos[rows]
                if self.draft is not None:
                    dcache, d_hidden, d_logits = dcache.select(rows), d_hidden[rows], d_logits[rows]
            t0 = time.perf_counter()
            tree = self._draft_tree(dcache, d_hidden, d_logits, roots, root_pos)
            t1 = time.perf_counter()
            tv = self.target(tcache, tree.tokens, tree.positions, tree_mask=tree.mask,
                             want_aux=self.draft is not None)
            accepted, emitted = self._accept(tree, tv.logits, params, gen)
            t2 = time.perf_counter()
            tcache.commit(accepted)
            for j, b in enumerate(active):
                seqs[b].accept_lengths.append(self._emit(seqs[b], emitted[j], params))
            roots = torch.tensor([e[-1] for e in emitted], device=dev)
            root_pos = root_pos + torch.tensor([len(e) for e in emitted], device=dev)
            if self.draft is not None:
                d_hidden, d_logits = self._extend_accepted(dcache, tree, tv.aux_hidden_states, accepted, emitted)
            stats.draft_time += t1 - t0 + time.perf_counter() - t2
            stats.verify_time += t2 - t1
            stats.verify_steps += len(active)

        stats.generated_tokens = sum(len(s.out) for s in seqs)
        stats.total_time = time.perf_counter() - t_start
        outputs = [RequestOutput(s.prompt, s.text if s.text is not None else self._decode(s.out), s.out,
                                 s.finish_reason, 1 + len(s.accept_lengths), [1] + s.accept_lengths) for s in seqs]
        return outputs, stats

    # ---- steps ---------------------------------------------------------------------------
    def _sample(self, logits, params, gen):
        if params.greedy:
            return logits.argmax(-1)
        return torch.multinomial(target_probs(logits, params), 1, generator=gen).squeeze(-1)

    def _draft_tree(self, dcache, d_hidden, d_logits, roots, root_pos) -> DraftTree:
        if self.draft is None:                                                    # vanilla: the root alone
            B = roots.shape[0]
            z = torch.zeros(B, 1, dtype=torch.long, device=roots.device)
            return DraftTree(roots.view(B, 1), z - 1, z, torch.ones(B, 1, 1, dtype=torch.bool, device=roots.device),
                             root_pos.view(B, 1), z)
        return grow_tree(self.draft, dcache, d_hidden, d_logits, roots, root_pos, self.spec)

    def _accept(self, tree: DraftTree, logits, params, gen):
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        accepted, emitted = [], []
        if params.greedy:
            argmax = logits.argmax(-1).tolist()
        else:
            probs = target_probs(logits, params)                                  # [B, N, V]
        for j in range(len(tokens)):
            if params.greedy:
                acc, bonus = verify_greedy(tokens[j], parents[j], argmax[j])
            else:
                acc, bonus = verify_sampling(tokens[j], parents[j], probs[j], gen)
            accepted.append(acc)
            emitted.append([tokens[j][i] for i in acc[1:]] + [bonus])
        return accepted, emitted

    def _draft_extend(self, dcache, input_ids, aux, positions, num_new):
        """Draft forward over (feature t, token t+1) pairs; commit them; return the last valid hidden/logits."""
        B, T = input_ids.shape
        S = dcache.check_room(T)
        mask = cache_attention_mask(dcache.lens, causal_mask(B, T, input_ids.device), S, num_new)
        slot = dcache.lens.view(B, 1) + torch.arange(T, device=input_ids.device).view(1, T)
        h = self.draft(input_ids, aux, positions, attend=cache_attend(dcache, 0, slot, mask), fuse=True)   # [B, T, H]
        dcache.commit([list(range(int(n))) for n in num_new])
        last = h[torch.arange(B, device=h.device), num_new - 1]                              # [B, H]
        return last, self.draft.compute_logits(last)

    def _extend_accepted(self, dcache, tree, aux, accepted, emitted):
        """Pairs (target feature at each accepted node, the token emitted after it), for the active rows."""
        R, n = len(accepted), torch.tensor([len(a) for a in accepted], device=aux.device)
        T = int(n.max())
        node = torch.zeros(R, T, dtype=torch.long, device=aux.device)
        ids = torch.zeros(R, T, dtype=torch.long, device=aux.device)
        for j in range(R):
            node[j, :len(accepted[j])] = torch.tensor(accepted[j])
            ids[j, :len(emitted[j])] = torch.tensor(emitted[j])
        feats = torch.gather(aux, 1, node.unsqueeze(-1).expand(R, T, aux.shape[-1]))
        positions = torch.gather(tree.positions, 1, node)
        return self._draft_extend(dcache, ids, feats, positions, n)

    # ---- output bookkeeping ----------------------------------------------------------------
    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _emit(self, s: _Sequence, tokens: list[int], params: SamplingParams) -> int:
        """Append tokens until EOS / max_new_tokens / a stop string; return how many were kept."""
        added = 0
        for t in tokens:
            if s.finish_reason is not None:
                break
            s.out.append(t)
            added += 1
            if not params.ignore_eos and t in self.eos_ids:
                s.finish_reason = "eos"
            elif len(s.out) >= params.max_new_tokens:
                s.finish_reason = "length"
            elif params.stop:
                text = self._decode(s.out)
                hits = [text.find(x) for x in params.stop if x in text]
                if hits:
                    s.finish_reason, s.text = "stop", text[:min(hits)]
        return added
