"""The sglang_eagle3 SGLang plugin, loaded through SGLang's own `load_plugins()` (skipped without SGLang).

(a) target capture for classes that lack `set_eagle3_layers_to_capture`: each class is built by SGLang's
    loader from a tiny HF folder, capture is switched on by SGLang's own start-up function, and the
    forward (pure-PyTorch attention backend, CPU) must hand over exactly transformers'
    output_hidden_states[i + 1] for each aux id i, with unchanged logits;
(b) the start-up draft check: the check function directly, then wired into `ServerArgs.check_server_args`
    and run on real, resolved server args.
"""
from __future__ import annotations

import os

import pytest
import torch
from conftest import tiny_hf_model

from sglang_eagle3.models.config import Eagle3Config
from sglang_eagle3.models.draft import Eagle3DraftModel
from sglang_eagle3.serving import sglang_compat as sc
from sglang_eagle3.serving.sglang_plugin import PLUGIN_NAME
from sglang_eagle3.serving.sglang_plugin.capture import SUPPORTED_ARCHITECTURES
from sglang_eagle3.serving.sglang_plugin.validate import DraftMismatchError, draft_config_problems

pytestmark = pytest.mark.skipif(sc.sglang_version() is None,
                                reason="SGLang is not installed (pip install --no-deps -r requirements-sglang.txt)")


@pytest.fixture(scope="module", autouse=True)
def process_state():
    with sc.undo_import_side_effects():
        yield

VOCAB = 96
# model_type -> (SGLang architecture, tiny-config overrides SGLang's class needs)
FAMILIES = {
    "gemma": ("GemmaForCausalLM", dict(hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True)),
    "gemma2": ("Gemma2ForCausalLM", dict(hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True,
                                         sliding_window=64, query_pre_attn_scalar=16,
                                         attn_logit_softcapping=None, final_logit_softcapping=None)),
    "granite": ("GraniteForCausalLM", dict(embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0,
                                           attention_multiplier=0.2)),
    "granitemoe": ("GraniteMoeForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "olmo": ("OlmoForCausalLM", dict(num_key_value_heads=4)),
    "olmo2": ("Olmo2ForCausalLM", {}),
    "olmoe": ("OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, num_key_value_heads=4)),
    "stablelm": ("StableLmForCausalLM", dict(partial_rotary_factor=0.25)),
    "starcoder2": ("Starcoder2ForCausalLM", {}),
    "glm4": ("Glm4ForCausalLM", dict(partial_rotary_factor=0.5)),
}


def _load_plugins(monkeypatch, allow=PLUGIN_NAME, enable=None):
    import sglang.srt.plugins as plugins
    from sglang.srt.plugins.hook_registry import HookRegistry
    monkeypatch.setenv("SGLANG_PLUGINS", allow)
    if enable is None:
        monkeypatch.delenv("SGLANG_EAGLE3_PLUGIN", raising=False)
    else:
        monkeypatch.setenv("SGLANG_EAGLE3_PLUGIN", enable)
    HookRegistry.reset()
    plugins._plugins_loaded = False
    plugins.load_plugins()


@pytest.fixture
def sglang_state():
    """Undo what load_plugins() patches (registry entries, ServerArgs.check_server_args)."""
    import sglang.srt.plugins as plugins
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import ServerArgs
    models, check = dict(ModelRegistry.models), ServerArgs.__dict__["check_server_args"]
    yield models, check
    ModelRegistry.models.clear()
    ModelRegistry.models.update(models)
    ServerArgs.check_server_args = check
    HookRegistry.reset()
    plugins._plugins_loaded = False


@pytest.fixture(scope="module")
def cpu_runtime():
    sc.init_cpu_runtime()
    yield
    sc.shutdown_cpu_runtime()


@pytest.fixture
def plugin(monkeypatch, sglang_state):
    _load_plugins(monkeypatch)
    return sglang_state


# ---- loading --------------------------------------------------------------------------------------
def test_load_plugins_registers_capture_and_check(plugin):
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.server_args import ServerArgs
    originals, check = plugin
    for arch in SUPPORTED_ARCHITECTURES:
        assert not hasattr(originals[arch], "set_eagle3_layers_to_capture"), f"SGLang now supports {arch} itself"
        cls = ModelRegistry.models[arch]
        assert cls is not originals[arch] and issubclass(cls, originals[arch]) and cls.__name__ == arch
        assert hasattr(cls, "set_eagle3_layers_to_capture")
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM"):
        assert ModelRegistry.models[arch] is originals[arch]         # SGLang's own capture is kept
    assert ModelRegistry.models["MixtralForCausalLM"] is originals["MixtralForCausalLM"]   # not verified: untouched
    assert ServerArgs.check_server_args is not check and ServerArgs.check_server_args.__wrapped__ is check


@pytest.mark.parametrize("allow,enable", [("some_other_plugin", None), (PLUGIN_NAME, "0")],
                         ids=["SGLANG_PLUGINS-filter", "SGLANG_EAGLE3_PLUGIN=0"])
def test_plugin_can_be_switched_off(monkeypatch, sglang_state, allow, enable):
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.server_args import ServerArgs
    originals, check = sglang_state
    _load_plugins(monkeypatch, allow=allow, enable=enable)
    assert all(ModelRegistry.models[a] is originals[a] for a in SUPPORTED_ARCHITECTURES)
    assert ServerArgs.check_server_args is check


# ---- (a) capture ----------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_capture_equals_hf_hidden_states(plugin, cpu_runtime, tmp_path, model_type):
    arch, overrides = FAMILIES[model_type]
    hf = tiny_hf_model(model_type, vocab_size=VOCAB, **overrides)
    hf.save_pretrained(tmp_path)
    model = sc.load_model(str(tmp_path))
    assert type(model).__name__ == arch and isinstance(model, plugin[0][arch])
    ids = [1, 3, 5]
    sc.enable_aux_capture(model, ids)                                 # SGLang's own start-up call
    assert model.capture_aux_hidden_states and model.model.layers_to_capture == [2, 4, 6]
    x = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(0))
    out = sc.forward_extend(model, x)
    with torch.no_grad():
        ref = hf(x[None], output_hidden_states=True)
    expected = torch.cat([ref.hidden_states[i + 1][0] for i in ids], dim=-1)   # [T, 3H]
    torch.testing.assert_close(out.hidden_states, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.next_token_logits[0, :VOCAB], ref.logits[0, -1], rtol=1e-5, atol=1e-5)
    out2 = sc.forward_extend(model, x)                                # a second forward starts a fresh capture
    assert out2.hidden_states.shape == expected.shape


def test_capture_is_off_until_requested(plugin, cpu_runtime, tmp_path):
    hf = tiny_hf_model("olmo2", vocab_size=VOCAB)
    hf.save_pretrained(tmp_path)
    model = sc.load_model(str(tmp_path))
    assert not model.capture_aux_hidden_states
    out = sc.forward_extend(model, torch.arange(5))
    assert out.hidden_states.shape == (5, 64)                         # the final hidden state, no aux
    model.set_eagle3_layers_to_capture(None)                          # SGLang's default layers
    assert model.model.layers_to_capture == [2, 4, 5]
    with pytest.raises(ValueError, match=r"outside \[0, 6\]"):
        model.set_eagle3_layers_to_capture([1, 3, 7])


def test_sglang_refuses_these_targets_without_the_plugin(sglang_state, cpu_runtime):
    original = sglang_state[0]["Olmo2ForCausalLM"]
    with sc.cpu_model_build():
        model = original(tiny_hf_model("olmo2", vocab_size=VOCAB).config)
    with pytest.raises(ValueError, match="does not implement set_eagle3_layers_to_capture"):
        sc.enable_aux_capture(model, [1, 3, 5])


# ---- (b) draft check ------------------------------------------------------------------------------
def draft_dict(hf_config, **changes):
    d = Eagle3Config.for_target(hf_config, draft_vocab_size=32).to_dict()
    eagle = changes.pop("aux", None)
    d.update(changes)
    if eagle is not None:
        d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = eagle
    return d


def test_draft_config_problems():
    tc = tiny_hf_model("llama", vocab_size=VOCAB).config                # 8 layers, hidden 64
    assert draft_config_problems(draft_dict(tc), tc) == []
    assert draft_config_problems(draft_dict(tc), tc.to_dict()) == []
    assert draft_config_problems({}, tc) == []                          # nothing stated, nothing checked
    (p,) = draft_config_problems(draft_dict(tc, vocab_size=128), tc)
    assert "vocab_size" in p and "128" in p and "96" in p
    (p,) = draft_config_problems(draft_dict(tc, target_hidden_size=32), tc)
    assert "target_hidden_size=32" in p and "64" in p
    (p,) = draft_config_problems(draft_dict(tc, aux=[1, 3, 7]), tc)
    assert "[7]" in p and "[0, 6]" in p
    (p,) = draft_config_problems(draft_dict(tc, aux=[1, "3", 5]), tc)
    assert "not a list of integers" in p
    (p,) = draft_config_problems(draft_dict(tc, draft_vocab_size=100), tc)
    assert "draft_vocab_size=100" in p
    assert len(draft_config_problems(draft_dict(tc, vocab_size=128, aux=[0, 9, 2]), tc)) == 2


def test_draft_with_other_width_needs_its_own_embedding(tmp_path):
    tc = tiny_hf_model("llama", vocab_size=VOCAB).config
    from safetensors.torch import save_file
    save_file({"fc.weight": torch.zeros(32, 192)}, str(tmp_path / "model.safetensors"))
    d = draft_dict(tc, hidden_size=32, target_hidden_size=64)
    (p,) = draft_config_problems(d, tc, draft_dir=str(tmp_path))
    assert "embed_tokens" in p
    save_file({"fc.weight": torch.zeros(32, 192), "embed_tokens.weight": torch.zeros(VOCAB, 32)},
              str(tmp_path / "model.safetensors"))
    assert draft_config_problems(d, tc, draft_dir=str(tmp_path)) == []


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    hf = tiny_hf_model("llama", vocab_size=VOCAB)
    hf.save_pretrained(root / "target")
    Eagle3DraftModel(Eagle3Config.for_target(hf.config)).save_pretrained(str(root / "good"))
    other = tiny_hf_model("llama", vocab_size=128, num_layers=12)
    Eagle3DraftModel(Eagle3Config.for_target(other.config, draft_vocab_size=32)).save_pretrained(str(root / "bad"))
    return {k: str(root / k) for k in ("target", "good", "bad")}


def resolved_args(folders, draft):
    from sglang.srt.server_args import prepare_server_args
    args = prepare_server_args(["--model-path", folders["target"], "--device", "cpu", "--skip-tokenizer-init",
                                "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                                folders[draft], "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                                "--speculative-num-draft-tokens", "4"])
    args.resolve_once()
    return args


def test_check_server_args_refuses_a_mismatched_draft(plugin, folders, monkeypatch):
    resolved_args(folders, "good").check_server_args()               # fits: SGLang's checks and ours pass
    with pytest.raises(DraftMismatchError) as e:
        resolved_args(folders, "bad").check_server_args()
    msg = str(e.value)
    assert folders["bad"] in msg and "vocab_size" in msg and "hidden size" not in msg
    assert "[1, 5, 8]" in msg and "outside [0, 6]" in msg               # ids for 12 layers, target has 8
    monkeypatch.setenv("SGLANG_EAGLE3_DRAFT_CHECK", "0")
    resolved_args(folders, "bad").check_server_args()


def test_check_skips_other_algorithms_and_unreadable_drafts(plugin, folders, tmp_path):
    from sglang.srt.server_args import prepare_server_args
    args = prepare_server_args(["--model-path", folders["target"], "--device", "cpu", "--skip-tokenizer-init"])
    args.resolve_once()
    args.check_server_args()
    from sglang_eagle3.serving.sglang_plugin.validate import check_server_args_draft
    os.makedirs(tmp_path / "empty")
    args = prepare_server_args(["--model-path", folders["target"], "--speculative-algorithm", "EAGLE3",
                                "--speculative-draft-model-path", str(tmp_path / "empty")])
    check_server_args_draft(args)                                       # no config.json: left to SGLang
