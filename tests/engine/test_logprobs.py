"""Log-probs of emitted tokens: the target's own, at the position that emitted each token, whichever way the
token came out (prefill, an accepted draft node, the bonus token; greedy or sampled), aligned after stops."""
import pytest
import torch
from conftest import tiny_target
from test_engine import oracle_for, prompts_of

from sglang_eagle3.engine.engine import SpeculativeEngine
from sglang_eagle3.engine.scheduler import Request
from sglang_eagle3.engine.settings import Settings
from sglang_eagle3.engine.speculation import SpecConfig
from sglang_eagle3.engine.verify import SamplingParams, TokenLogprob
from sglang_eagle3.serving.openai_protocol import reported_logprobs


def teacher_forced(hf, prompt_ids: list[int], out_ids: list[int]) -> torch.Tensor:
    """[n, V] log-probs: row j is transformers' distribution over out_ids[j] given everything before it."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + out_ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(out_ids)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("spec", [None, SpecConfig(3, 2, 6)], ids=["vanilla", "spec"])
def test_logprobs_are_the_targets_at_each_emitted_token(spec, temperature):
    tm, hf = tiny_target("llama", logit_scale=12.0)       # peaked: samples mostly follow the greedy references
    prompts = prompts_of([4, 9, 6], tm.vocab_size, seed=2)
    greedy = SamplingParams(max_new_tokens=30, ignore_eos=True)
    van, _ = SpeculativeEngine(tm, None, Settings()).generate(prompts, greedy)
    assert all(o.logprobs is None for o in van)                        # off unless asked for
    refs = [[int(x) for x in p.split()] + o.token_ids for p, o in zip(prompts, van)]
    draft = oracle_for(tm, refs, 0.6) if spec else None                # partly accepted paths
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=temperature, seed=3, logprobs=3)
    outs, stats = SpeculativeEngine(tm, draft, Settings(tree=spec)).generate(prompts, params, batch_size=2)
    if spec:     # accepted draft nodes emitted tokens (few when sampling: the oracle knows the greedy answers)
        assert stats.accept_length > (1.3 if temperature == 0 else 1.03)
    for p, o in zip(prompts, outs):
        ref = teacher_forced(hf, [int(x) for x in p.split()], o.token_ids)
        assert len(o.logprobs) == len(o.token_ids) == 30
        assert [e.token for e in o.logprobs] == o.token_ids
        want = ref.gather(1, torch.tensor(o.token_ids).view(-1, 1)).view(-1)
        torch.testing.assert_close(torch.tensor([e.logprob for e in o.logprobs]), want, atol=1e-4, rtol=0)
        for e, row in zip(o.logprobs, ref):
            top = row.topk(3)
            assert [t for t, _ in e.top] == top.indices.tolist()
            torch.testing.assert_close(torch.tensor([lp for _, lp in e.top]), top.values, atol=1e-4, rtol=0)
            if temperature == 0:
                assert e.top[0][0] == e.token


def test_logprobs_follow_stop_string_cuts():
    tm, _ = tiny_target("llama", logit_scale=4.0)
    prompt = prompts_of([5], tm.vocab_size, seed=7)
    full, _ = SpeculativeEngine(tm, None, Settings()).generate(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))
    ids = full[0].token_ids
    stop = f"t{ids[6]} t{ids[7]}"                                       # IdTokenizer renders tokens as "t<id>"
    refs = [[int(x) for x in prompt[0].split()] + ids]
    eng = SpeculativeEngine(tm, oracle_for(tm, refs, 1.0), Settings(tree=SpecConfig(4, 1, 5)))   # the stop lands inside a step
    outs, _ = eng.generate(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True, stop=[stop], logprobs=0))
    o = outs[0]
    first = next(n for n in range(1, 21) if stop in " ".join(f"t{i}" for i in ids[:n]))
    assert o.finish_reason == "stop" and o.token_ids == ids[:first] and len(ids) > first
    assert [e.token for e in o.logprobs] == o.token_ids and all(e.top == [] for e in o.logprobs)


def test_responses_leave_out_the_eos_that_ended_the_answer():
    req = Request([1], SamplingParams(logprobs=0))
    req.output_ids, req.output_logprobs = [5, 2], [TokenLogprob(5, -0.1, []), TokenLogprob(2, -0.2, [])]
    req.finish_reason = "length"
    assert reported_logprobs(req) == 2
    req.finish_reason = "eos"
    assert reported_logprobs(req) == 1


def test_bad_logprobs_counts_are_refused():
    with pytest.raises(ValueError, match="top logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="top logprobs"):
        SamplingParams(logprobs=-1)
