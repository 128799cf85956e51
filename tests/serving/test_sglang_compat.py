"""Our exported drafts through SGLang's own code (CPU, one rank; skipped when SGLang is not installed).

For a Llama-family and a Qwen-family target, with a reduced and a full draft vocabulary:
  * SGLang's loader (`ModelConfig` + `get_model`) builds `LlamaForCausalLMEagle3` from our config.json and
    feeds our model.safetensors through its `load_weights`; every SGLang parameter is compared with ours
    (fused qkv_proj = q, k, v stacked; gate_up_proj = gate, up; hot_token_id = d2t + arange);
  * SGLang's target runner logic resolves the aux layer ids from our draft config and switches capture on
    in SGLang's `LlamaForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM`; the captured layers equal the
    ones our target runtime captures (id i -> input of layer i+1 = HF output_hidden_states[i+1]);
  * SGLang's forward runs with its pure-PyTorch attention backend: its target logits and aux hidden states
    equal ours, and its draft, fed those aux states with its embedding shared from the target exactly as
    the EAGLE worker does (`set_embed`), gives our draft's hidden states and logits.
"""
from __future__ import annotations

import pytest
import torch
from conftest import IdTokenizer, tiny_hf_model

from sglang_eagle3.models.config import Eagle3Config
from sglang_eagle3.models.draft import Eagle3DraftModel
from sglang_eagle3.models.target import TargetModel
from sglang_eagle3.serving import sglang_compat as sc

pytestmark = pytest.mark.skipif(sc.sglang_version() is None,
                                reason="SGLang is not installed (pip install --no-deps -r requirements-sglang.txt)")

VOCAB = 96
CASES = [("llama", 32, False), ("llama", None, False), ("qwen3", 40, False), ("qwen2", None, False),
         ("llama", 32, True)]          # last: EAGLE-3.1 (fc_norm + norm_output)


@pytest.fixture(scope="module", autouse=True)
def cpu_runtime():
    with sc.undo_import_side_effects():
        sc.init_cpu_runtime()
        yield
        sc.shutdown_cpu_runtime()


def make_draft(hf_config, draft_vocab_size, seed=3, eagle31=False) -> Eagle3DraftModel:
    torch.manual_seed(seed)
    cfg = Eagle3Config.for_target(hf_config, draft_vocab_size=draft_vocab_size)
    cfg.fc_norm = cfg.norm_output = eagle31
    draft = Eagle3DraftModel(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" in name:                      # off their init value, so a swapped norm shows
                p.add_(torch.randn_like(p) * 0.2)
    if draft_vocab_size:
        draft.set_vocab_mapping(torch.randperm(VOCAB)[:draft_vocab_size])
    return draft


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}-dv{v or 'full'}{'-eagle3.1' if e else ''}" for m, v, e in CASES])
def case(request, tmp_path_factory):
    family, draft_vocab, eagle31 = request.param
    root = tmp_path_factory.mktemp(f"{family}_{draft_vocab}_{eagle31}")
    hf = tiny_hf_model(family, vocab_size=VOCAB)
    hf.save_pretrained(root / "target")
    ours_target = TargetModel(hf, IdTokenizer())
    draft = make_draft(hf.config, draft_vocab, eagle31=eagle31)
    draft.save_pretrained(str(root / "draft"), dtype=torch.float32)
    draft.set_embedding(ours_target.embed_tokens)
    return dict(hf=hf, target=ours_target, draft=draft, target_dir=str(root / "target"),
                draft_dir=str(root / "draft"), draft_vocab=draft_vocab or VOCAB)


def expected_draft_params(draft: Eagle3DraftModel) -> dict[str, torch.Tensor]:
    """SGLang parameter name -> the tensor it must hold, from our draft."""
    a, m = draft.midlayer.self_attn, draft.midlayer.mlp
    layer = "model.layers.0."
    fc_norm = {f"model.fc_norm.{i}.weight": n.weight for i, n in enumerate(draft.fc_norm or [])}
    return {**fc_norm,
        "model.fc.weight": draft.fc.weight,
        layer + "self_attn.qkv_proj.weight": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
        layer + "self_attn.o_proj.weight": a.o_proj.weight,
        layer + "mlp.gate_up_proj.weight": torch.cat([m.gate_proj.weight, m.up_proj.weight]),
        layer + "mlp.down_proj.weight": m.down_proj.weight,
        layer + "input_layernorm.weight": draft.midlayer.input_layernorm.weight,
        layer + "post_attention_layernorm.weight": draft.midlayer.post_attention_layernorm.weight,
        layer + "hidden_norm.weight": draft.midlayer.hidden_norm.weight,
        "model.norm.weight": draft.norm.weight,
        "lm_head.weight": draft.lm_head.weight,
    }


def test_sglang_loads_every_draft_weight(case):
    sg = sc.load_model(case["draft_dir"], is_draft=True)
    assert type(sg).__name__ == "LlamaForCausalLMEagle3"
    assert sg.config.draft_vocab_size == case["draft_vocab"]
    expected = expected_draft_params(case["draft"])
    params = dict(sg.named_parameters())
    # every SGLang parameter is one of ours, except the embedding it takes from the target (set_embed)
    assert set(params) - {"model.embed_tokens.weight"} == set(expected)
    for name, want in expected.items():
        got = params[name]
        rows = want.shape[0]                        # SGLang pads vocab rows of lm_head to a multiple of 64
        assert got.shape[1:] == want.shape[1:] and got.shape[0] >= rows, name
        torch.testing.assert_close(got[:rows], want.detach(), rtol=0, atol=0, msg=name)
    ids = torch.arange(case["draft_vocab"])
    torch.testing.assert_close(sg.get_hot_token_id(), case["draft"].draft_to_target(ids))


def test_sglang_captures_the_layers_we_capture(case):
    ours = case["target"]
    ids = sc.draft_aux_layer_ids(case["target_dir"], case["draft_dir"])
    assert ids == ours.aux_layer_ids == case["draft"].config.aux_layer_ids
    sg = sc.load_model(case["target_dir"])
    assert not sg.capture_aux_hidden_states
    sc.enable_aux_capture(sg, ids)
    assert sg.model.layers_to_capture == sorted(ours.capture_at) == [i + 1 for i in ids]


def test_sglang_forward_matches_ours(case):
    ours, draft = case["target"], case["draft"]
    sg_target = sc.load_model(case["target_dir"])
    sc.enable_aux_capture(sg_target, sc.draft_aux_layer_ids(case["target_dir"], case["draft_dir"]))
    sg_draft = sc.load_model(case["draft_dir"], is_draft=True)
    sg_draft.set_embed(sg_target.model.embed_tokens.weight)          # what SGLang's EAGLE worker does

    torch.manual_seed(0)
    x = torch.randint(0, VOCAB, (11,))
    out = sc.forward_extend(sg_target, x)
    aux, _ = ours.features(x[None])                                  # [1, T, 3H]
    torch.testing.assert_close(out.hidden_states, aux[0], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        hf_logits = case["hf"](x[None]).logits[0, -1]
    torch.testing.assert_close(out.next_token_logits[0, :VOCAB], hf_logits, rtol=1e-5, atol=1e-5)

    # draft step 0: token x_{t+1} paired with target features at t
    nxt = torch.cat([x[1:], hf_logits.argmax().view(1)])
    d_out = sc.forward_extend(sg_draft, nxt, spec_hidden_states=out.hidden_states)
    with torch.no_grad():
        h = draft(nxt[None], aux, torch.arange(len(x))[None])         # pre-norm [1, T, H]
        logits = draft.compute_logits(h[0, -1])
    # what the next draft step reads: pre-norm (EAGLE-3) or normed (EAGLE-3.1 norm_output), in both
    torch.testing.assert_close(d_out.hidden_states, draft.next_hidden(h)[0], rtol=1e-5, atol=1e-5)
    dv = case["draft_vocab"]
    torch.testing.assert_close(d_out.next_token_logits[0, :dv], logits, rtol=1e-5, atol=1e-5)
    top = logits.argmax()
    assert sg_draft.get_hot_token_id()[top] == draft.draft_to_target(top)


def test_forward_extend_needs_attention_layers():
    with pytest.raises(ValueError, match="RadixAttention"):
        sc.forward_extend(torch.nn.Linear(2, 2), torch.zeros(3, dtype=torch.long))
