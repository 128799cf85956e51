"""The GPU path: skipped without CUDA (bench/gpu_check.sh runs these on a GPU machine).

On CUDA: the engine's greedy output with CUDA graphs equals the eager output and transformers' (fp32), and
speculative decoding with a random draft stays identical to vanilla.
"""
import pytest
import torch
from conftest import random_draft, tiny_target

from sglang_eagle3.engine.engine import SpeculativeEngine
from sglang_eagle3.engine.settings import Settings
from sglang_eagle3.engine.speculation import SpecConfig
from sglang_eagle3.engine.verify import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (the GPU path needs one)")


def on_cuda(tm):
    tm.to("cuda")
    return tm


def prompts(vocab, n=4):
    g = torch.Generator().manual_seed(1)
    return [" ".join(str(int(x)) for x in torch.randint(3, vocab, (5 + 3 * i,), generator=g)) for i in range(n)]


@pytest.mark.parametrize("spec", [None, SpecConfig(3, 2, 6)], ids=["vanilla", "tree"])
def test_cuda_graphs_equal_eager_and_transformers(spec):
    tm, hf = tiny_target("llama", logit_scale=4.0)
    hf.to("cuda")
    tm = on_cuda(tm)
    ps = prompts(tm.vocab_size)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    draft = random_draft(tm, draft_vocab_size=48) if spec else None
    graphs = SpeculativeEngine(tm, draft, Settings(tree=spec))
    outs, _ = graphs.generate(ps, params, batch_size=3)
    sched = graphs._scheduler
    assert sched.worker.graphs is not None and sched.worker.graphs.graphs            # graphs were captured
    eager = SpeculativeEngine(tm, draft, Settings(tree=spec))
    eager.scheduler(3, 128).worker.graphs = None
    ref, _ = eager.generate(ps, params, batch_size=3)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    for p, o in zip(ps, outs):
        ids = torch.tensor([[int(x) for x in p.split()]], device="cuda")
        want = hf.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
        assert o.token_ids == want[0, ids.shape[1]:].tolist()
