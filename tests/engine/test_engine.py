"""Greedy speculative decoding is token-identical to the target's own greedy decode."""
import pytest
import torch
from conftest import force_ragged_trees, random_draft, tiny_target

from sglang_eagle3.engine.engine import SpeculativeEngine
from sglang_eagle3.engine.settings import Settings
from sglang_eagle3.engine.speculation import SpecConfig
from sglang_eagle3.engine.verify import SamplingParams
from sglang_eagle3.models.config import Eagle3Config
from sglang_eagle3.models.draft import Eagle3DraftModel

SPECS = [SpecConfig(1, 1, 2), SpecConfig(4, 1, 5), SpecConfig(3, 3, 8), SpecConfig(5, 4, 16), SpecConfig(2, 8, 40)]


class OracleDraft(Eagle3DraftModel):
    """A draft that knows reference continuations: (position t, token x_{t+1}) -> x_{t+2}.

    `skill` in [0, 1]: how often the true token is ranked first; otherwise it is put at rank 2..4 or left
    out entirely (deterministic per position), so trees get partially accepted paths.
    """

    def __init__(self, cfg, table, skill=1.0):
        super().__init__(cfg)
        self.table, self.skill = table, skill

    def forward(self, input_ids, hidden_states, positions, attend=None, fuse=None):
        h = super().forward(input_ids, hidden_states, positions, attend, fuse).clone()   # still exercises the KV cache
        h[..., 0], h[..., 1] = positions.to(h.dtype), input_ids.to(h.dtype)
        return h

    def compute_logits(self, hidden):
        pos, tok = hidden[..., 0].round().long(), hidden[..., 1].round().long()
        V = self.config.draft_vocab_size
        noise = torch.sin(pos.unsqueeze(-1) * 12.9898 + tok.unsqueeze(-1) * 78.233 + torch.arange(V)) * 2.0
        flat_p, flat_t, flat_n = pos.flatten().tolist(), tok.flatten().tolist(), noise.view(-1, V)
        for i, (p, t) in enumerate(zip(flat_p, flat_t)):
            want = self.table.get((p, t))
            if want is None:
                continue
            r = ((p * 7 + t * 13) % 100) / 100.0
            if r < self.skill:
                flat_n[i, want] = 10.0                                   # rank 1
            elif r < self.skill + (1 - self.skill) * 0.6:
                flat_n[i, want] = flat_n[i].topk(3).values[-1] - 1e-3  # rank 4
            else:
                flat_n[i, want] = -10.0                                  # absent
        return flat_n.view(*pos.shape, V)


def oracle_for(target, refs, skill):
    table = {}
    for seq in refs:
        for t in range(len(seq) - 2):
            table[(t, seq[t + 1])] = seq[t + 2]
    d = OracleDraft(Eagle3Config.for_target(target.hf_config), table, skill)
    return d


def prompts_of(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [" ".join(str(int(x)) for x in torch.randint(3, vocab, (n,), generator=g)) for n in lengths]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_vanilla_equals_transformers_generate(family):
    tm, hf = tiny_target(family, eos_token_id=None, logit_scale=4.0)
    prompts = prompts_of([3, 9, 14], tm.vocab_size)
    outs, stats = SpeculativeEngine(tm, None, Settings()).generate(prompts, SamplingParams(max_new_tokens=30, ignore_eos=True))
    for p, o in zip(prompts, outs):
        ids = torch.tensor([[int(x) for x in p.split()]])
        ref = hf.generate(ids, max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=0)
        assert o.token_ids == ref[0, ids.shape[1]:].tolist()
    assert stats.accept_length == 1.0 and stats.generated_tokens == 90


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_random_draft_is_lossless_in_batches(spec):
    tm, _ = tiny_target("llama", logit_scale=4.0)
    prompts = prompts_of([2, 7, 13, 5, 1], tm.vocab_size)
    params = SamplingParams(max_new_tokens=25, ignore_eos=True)
    van, _ = SpeculativeEngine(tm, None, Settings()).generate(prompts, params)
    spec_out, stats = SpeculativeEngine(tm, random_draft(tm, draft_vocab_size=40), Settings(tree=spec)).generate(
        prompts, params, batch_size=3)
    assert [o.token_ids for o in spec_out] == [o.token_ids for o in van]
    assert stats.generated_tokens == 125


@pytest.mark.parametrize("skill", [1.0, 0.6, 0.2])
@pytest.mark.parametrize("spec", [SpecConfig(4, 1, 5), SpecConfig(4, 3, 10), SpecConfig(6, 4, 24)], ids=str)
def test_oracle_drafts_accept_and_stay_lossless(spec, skill):
    """Adversarial drafts: the true token at rank 1, at rank 4, or missing; outputs must not change."""
    tm, _ = tiny_target("qwen2", logit_scale=4.0)
    prompts = prompts_of([4, 9, 6], tm.vocab_size, seed=3)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    van, _ = SpeculativeEngine(tm, None, Settings()).generate(prompts, params)
    refs = [[int(x) for x in p.split()] + o.token_ids for p, o in zip(prompts, van)]
    draft = oracle_for(tm, refs, skill)
    outs, stats = SpeculativeEngine(tm, draft, Settings(tree=spec)).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in van]
    if skill == 1.0:   # a perfect draft fills every step (tokens beyond max_new_tokens are cut)
        assert stats.accept_length >= 0.8 * (spec.num_steps + 1)
    else:
        assert stats.accept_length > 1.2


@pytest.mark.parametrize("spec", [SpecConfig(1, 2, 2), SpecConfig(4, 3, 10)], ids=str)
def test_bf16_greedy_speculation_equals_bf16_vanilla(spec):
    """End to end in bf16 (the C++ path's pieces together: whole-layer steps, few-row linears, tree attention at
    head size 64 over contexts crossing its 8- and 16-key blocks, KV commit, the draft's held pairs), with oracle
    trees whose accepted nodes follow rejected siblings. A sum whose order differs by one rounding rarely flips
    a bf16 value, let alone an argmax of this tiny model: that finer property is the attention test's
    (test_target.py::test_a_verified_token_attends_as_the_one_token_step_would)."""
    tm, _ = tiny_target("llama", dtype=torch.bfloat16, head_dim=64, logit_scale=4.0)
    prompts = prompts_of([5, 14, 23], tm.vocab_size, seed=5)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    van, _ = SpeculativeEngine(tm, None, Settings()).generate(prompts, params)
    refs = [[int(x) for x in p.split()] + o.token_ids for p, o in zip(prompts, van)]
    draft = oracle_for(tm, refs, skill=0.6).to(torch.bfloat16)
    outs, stats = SpeculativeEngine(tm, draft, Settings(tree=spec)).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in van]
    assert stats.accept_length > 1.2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_output_with_ragged_trees_equals_vanilla(dtype, monkeypatch):
    """Rows of one step with trees of different sizes (one verify budget for the batch; here forced, varied by row
    and step; in bf16 the verify computes only each row's real nodes): greedy output stays vanilla's."""
    tm, _ = tiny_target("llama", dtype=dtype, head_dim=64, logit_scale=4.0)
    prompts = prompts_of([5, 14, 23, 9], tm.vocab_size, seed=7)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    van, _ = SpeculativeEngine(tm, None, Settings()).generate(prompts, params)
    refs = [[int(x) for x in p.split()] + o.token_ids for p, o in zip(prompts, van)]
    draft = oracle_for(tm, refs, skill=0.7).to(dtype)
    ragged = force_ragged_trees(monkeypatch)
    outs, stats = SpeculativeEngine(tm, draft, Settings(tree=SpecConfig(3, 2, 6))).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in van]
    assert len(ragged) > 5 and stats.accept_length > 1.2


def test_eos_stop_strings_and_uneven_finish():
    tm, hf = tiny_target("llama", logit_scale=4.0)
    prompts = prompts_of([3, 8, 5, 11], tm.vocab_size, seed=5)
    van_long, _ = SpeculativeEngine(tm, None, Settings()).generate(prompts, SamplingParams(max_new_tokens=30, ignore_eos=True))
    # choose as EOS a token that the first sequence emits at step 6: it must stop there, the others go on
    eos = van_long[0].token_ids[5]
    tm.tokenizer.eos_token_id = eos
    tm.hf_config.eos_token_id = eos
    refs = [[int(x) for x in p.split()] + o.token_ids for p, o in zip(prompts, van_long)]
    for draft, spec in [(None, None), (oracle_for(tm, refs, 0.7), SpecConfig(4, 2, 8))]:
        eng = SpeculativeEngine(tm, draft, Settings(tree=spec))
        outs, stats = eng.generate(prompts, SamplingParams(max_new_tokens=30))
        for o, full in zip(outs, van_long):
            cut = full.token_ids.index(eos) + 1 if eos in full.token_ids else 30
            assert o.token_ids == full.token_ids[:cut]
            assert o.finish_reason == ("eos" if eos in full.token_ids else "length")
        assert stats.generated_tokens == sum(len(o.token_ids) for o in outs)
        # stop string: the IdTokenizer renders tokens as "t<id>"
        stop = f"t{van_long[1].token_ids[3]} t{van_long[1].token_ids[4]}"
        outs, _ = eng.generate(prompts[1:2], SamplingParams(max_new_tokens=30, ignore_eos=True, stop=[stop]))
        assert outs[0].finish_reason == "stop" and stop not in outs[0].text
        full = van_long[1].token_ids
        first = next(n for n in range(1, 31) if stop in " ".join(f"t{i}" for i in full[:n]))
        assert outs[0].token_ids == full[:first]


def test_max_new_tokens_one_and_stats():
    tm, _ = tiny_target("llama")
    eng = SpeculativeEngine(tm, random_draft(tm), Settings(tree=SpecConfig(3, 2, 6)))
    outs, stats = eng.generate(["5 6 7", "8"], SamplingParams(max_new_tokens=1, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [1, 1] and stats.verify_steps == 2
    outs, stats = eng.generate(["5 6 7"], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert stats.accept_length == pytest.approx(stats.generated_tokens / stats.verify_steps)
    assert sum(outs[0].accept_lengths) == 12


def test_draft_for_another_target_is_refused():
    from sglang_eagle3.models.draft import CheckpointError
    tm, _ = tiny_target("llama")
    other, _ = tiny_target("llama", vocab_size=80)
    with pytest.raises(CheckpointError, match="vocab_size"):
        SpeculativeEngine(tm, random_draft(other), Settings())


def test_steps_without_speculation_keep_the_draft_in_sync():
    """A row decoded without speculation (profile: no tree at this batch size) holds its draft pairs back and
    runs them when it drafts again: within PENDING_MAX pairs its draft KV and state end up what speculating all along
    gives. Past them it drops its oldest held pairs (a row that never drafts never runs them all through the draft):
    its draft KV then holds the prompt and the newest pairs. Outputs stay lossless either way."""
    from sglang_eagle3.engine.proposers import PENDING_MAX
    from sglang_eagle3.engine.spec_worker import SpecWorker
    tm, _ = tiny_target("llama", logit_scale=4.0)
    draft = random_draft(tm, draft_vocab_size=48)
    draft.set_embedding(tm.embed_tokens)
    spec = SpecConfig(3, 2, 6)
    greedy = [SamplingParams(max_new_tokens=500, ignore_eos=True)] * 2
    prompts = [[5, 9, 3, 7], [8, 2, 6, 11, 12]]

    def run(plan):
        w = SpecWorker(tm, draft, num_rows=2, max_len=400, draft_tree_slots=spec.draft_slots)
        out = [[w.prefill(r, p, greedy[0])[0]] for r, p in enumerate(prompts)]
        # the prompts' pairs are held: the draft has run over nothing yet
        assert w.drafter.dpool.lens.tolist() == [0, 0] and [w.drafter.held(r) for r in (0, 1)] == [4, 5]
        for use_spec in plan:
            res = w.step([0, 1], greedy, [None, None], spec if use_spec else None)
            for o, e in zip(out, res.emitted):
                o += e
        w.drafter.catch_up([0, 1])
        return w, out

    always, out_a = run([True] * 100)
    within, out_w = run([False] * (PENDING_MAX - 1) + [True] * 8 + [False] * 5 + [True] * 3)
    past, out_p = run([False] * (PENDING_MAX + 10) + [True] * 8)
    n = min(len(o) for o in out_a + out_w + out_p)
    assert n > 40 and all(a[:n] == w[:n] == p[:n] for a, w, p in zip(out_a, out_w, out_p))   # lossless every way
    for r in range(2):
        k = int(min(always.drafter.dpool.lens[r], within.drafter.dpool.lens[r]))
        assert k > PENDING_MAX
        torch.testing.assert_close(within.drafter.dpool.k[0, r, :, :k], always.drafter.dpool.k[0, r, :, :k],
                                   rtol=1e-5, atol=1e-5)
    assert sum(within.drafter.pend_count) == 0 and torch.equal(within.drafter.dpool.lens, within.tpool.lens)
    dropped = past.tpool.lens - past.drafter.dpool.lens
    assert sum(past.drafter.pend_count) == 0 and bool((dropped > 0).all())    # the oldest held pairs were dropped
    for r in range(2):                                                        # the prompt's pairs were kept
        p = len(prompts[r])
        torch.testing.assert_close(past.drafter.dpool.k[0, r, :, :p], always.drafter.dpool.k[0, r, :, :p],
                                   rtol=1e-5, atol=1e-5)


def test_a_row_that_does_not_draft_keeps_only_the_end_of_its_prompt_and_its_newest_pairs():
    """A long prompt is held, not run through the draft; a row that then holds PENDING_MAX step pairs without drafting
    keeps the last PROMPT_KEEP prompt pairs and its newest PENDING_KEEP pairs (a step that drafts again runs those)."""
    from sglang_eagle3.engine.proposers import PENDING_KEEP, PENDING_MAX, PROMPT_KEEP
    from sglang_eagle3.engine.spec_worker import SpecWorker
    tm, _ = tiny_target("llama", logit_scale=4.0)
    w = SpecWorker(tm, random_draft(tm), num_rows=1, max_len=PROMPT_KEEP + 200, draft_tree_slots=8)
    greedy = [SamplingParams(max_new_tokens=100, ignore_eos=True)]
    prompt = [3 + i % 50 for i in range(PROMPT_KEEP + 40)]
    w.prefill(0, prompt, greedy[0])
    assert w.drafter.held(0) == len(prompt) and int(w.drafter.dpool.lens[0]) == 0
    for _ in range(PENDING_MAX + 1):
        w.step([0], greedy, [None], None)
    assert w.drafter.held(0) == PROMPT_KEEP + PENDING_KEEP + 1
    positions = w.drafter.prompt_pairs[0][2]
    assert positions[0, 0] == len(prompt) - PROMPT_KEEP and positions[0, -1] == len(prompt) - 1


def test_incremental_detokenizer_matches_full_decode(smollm2_path):
    """Token by token (and in uneven groups, as speculative steps emit them), the streamed text equals the full
    decode, multi-byte characters split across tokens included."""
    from transformers import AutoTokenizer

    from sglang_eagle3.engine.scheduler import IncrementalDetokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    text = "Grüße aus Köln! 你好，世界 🚀🔥 — naïve café, ½ + ¼ = ¾.\n  def f(x):\n\treturn x**2"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for group in (1, 2, 3, 5):
        d = IncrementalDetokenizer(tok)
        streamed = "".join(d.push(ids[i:i + group]) for i in range(0, len(ids), group))
        assert streamed == tok.decode(ids, skip_special_tokens=True) == d.text
