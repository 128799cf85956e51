"""The draft checkpoint: SGLang-compatible names and config, strict loading with clear errors."""
import json
import os

import pytest
import torch
from conftest import edit_tensors, random_draft, tiny_target
from safetensors.torch import load_file

from sglang_eagle3.models.config import ConfigError, Eagle3Config
from sglang_eagle3.models.draft import CheckpointError, Eagle3DraftModel

SGLANG_NAMES = {
    "fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
}


@pytest.fixture
def saved(tmp_path):
    tm, _ = tiny_target("llama")
    d = random_draft(tm, draft_vocab_size=40)
    d.save_pretrained(tmp_path / "d", dtype=torch.bfloat16)
    return tm, d, str(tmp_path / "d")


def test_saved_files_get_the_usual_permissions(saved):
    """safetensors writes 0600; a draft must be readable by a server that runs as another user (umask allowing)."""
    from sglang_eagle3.fileio import current_umask
    _, _, path = saved
    for name in ("model.safetensors", "config.json"):
        assert os.stat(os.path.join(path, name)).st_mode & 0o777 == 0o666 & ~current_umask(), name


def test_names_shapes_and_config(saved):
    tm, d, path = saved
    state = load_file(os.path.join(path, "model.safetensors"))
    assert set(state) == SGLANG_NAMES
    H, Ht = d.config.hidden_size, tm.hidden_size
    assert state["fc.weight"].shape == (H, 3 * Ht)
    assert state["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * H
    assert state["lm_head.weight"].shape == (40, H)
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert state["fc.weight"].dtype == torch.bfloat16
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["draft_vocab_size"] == 40 and cfg["vocab_size"] == tm.vocab_size
    assert cfg["target_hidden_size"] == Ht and cfg["tie_word_embeddings"] is False
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]   # 8 layers: inputs of 2, 4, 5
    ids = torch.arange(40) + state["d2t"]
    assert state["t2d"].sum() == 40 and bool(state["t2d"][ids].all())


def test_round_trip_is_exact(saved):
    _, d, path = saved
    back = Eagle3DraftModel.from_pretrained(path)
    ref = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in d.state_dict().items()}
    for k, v in back.state_dict().items():
        assert torch.equal(v, ref[k]), k
    assert back.config.to_dict() == Eagle3Config.load(path).to_dict()
    assert back.config.to_dict() == d.config.to_dict()          # nothing falls back to a default on load
    d.config.rope_theta, d.config.rms_norm_eps = 123456.0, 3e-6      # non-default values survive the round trip
    d.save_pretrained(path)
    back = Eagle3DraftModel.from_pretrained(path)
    assert (back.config.rope_theta, back.config.rms_norm_eps) == (123456.0, 3e-6)


def test_missing_extra_misshaped_tensors_are_named(saved):
    _, _, path = saved
    edit_tensors(path, lambda s: s.pop("midlayer.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor midlayer\.mlp\.up_proj\.weight \(expected shape \[96, 64\]\)"):
        Eagle3DraftModel.from_pretrained(path)
    edit_tensors(path, lambda s: s.update({"midlayer.mlp.up_proj.weight": torch.zeros(96, 64), "bogus": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor bogus \(shape \[2\]\)"):
        Eagle3DraftModel.from_pretrained(path)
    edit_tensors(path, lambda s: (s.pop("bogus"), s.update({"lm_head.weight": torch.zeros(41, 64)})))
    with pytest.raises(CheckpointError, match=r"lm_head\.weight has shape \[41, 64\], config\.json implies \[40, 64\]"):
        Eagle3DraftModel.from_pretrained(path)


def test_bad_config_is_named(saved):
    _, _, path = saved
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    del cfg["eagle_config"]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ConfigError, match="eagle_aux_hidden_state_layer_ids"):
        Eagle3DraftModel.from_pretrained(path)
    open(cfg_path, "w").write("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Eagle3DraftModel.from_pretrained(path)


def test_vocab_and_hidden_mismatch_with_target_refused(saved):
    tm, d, path = saved
    other, _ = tiny_target("llama", vocab_size=100)
    with pytest.raises(CheckpointError, match="vocab_size=96 but target vocab_size=100"):
        Eagle3DraftModel.from_pretrained(path).check_target(other.hf_config)
    wide, _ = tiny_target("llama", hidden_size=128, head_dim=32)
    with pytest.raises(CheckpointError, match="target_hidden_size=64"):
        Eagle3DraftModel.from_pretrained(path).check_target(wide.hf_config)
    with pytest.raises(CheckpointError, match="aux layers"):
        Eagle3DraftModel.from_pretrained(path).check_target(tm.hf_config, aux_layer_ids=[1, 2, 3])


def test_init_draft_cli(tmp_path):
    from conftest import save_tiny_model_folder

    from sglang_eagle3.cli import main
    target = save_tiny_model_folder(tmp_path / "t")
    assert main(["init-draft", "--target", target, "--out", str(tmp_path / "d"), "--draft-vocab-size", "32"]) == 0
    d = Eagle3DraftModel.from_pretrained(str(tmp_path / "d"))
    assert d.config.draft_vocab_size == 32 and d.t2d[:32].all() and not d.t2d[32:].any()


def test_linear_rows_pads_bf16_cpu_products_to_a_bucket_and_keeps_values_and_gradients():
    """bf16 autocast on CPU: the layer sees a multiple of ROW_BUCKET rows (oneDNN reuses its kernel per shape),
    the caller sees its own rows, and the weight gradient equals the unpadded product's."""
    from sglang_eagle3.models.draft import ROW_BUCKET, linear_rows
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 40, bias=False)
    seen = []
    layer.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[0]))
    x = torch.randn(3, 35, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = linear_rows(layer, x)
        ref = layer(x)
    assert seen[0] % ROW_BUCKET == 0 and seen[0] >= 105 and y.shape == ref.shape == (3, 35, 40)
    assert torch.allclose(y.float(), ref.float(), rtol=1e-2, atol=1e-2)
    g = torch.randn(3, 35, 40)
    (gw,) = torch.autograd.grad((y.float() * g).sum(), layer.weight)
    (gr,) = torch.autograd.grad((ref.float() * g).sum(), layer.weight)
    assert torch.allclose(gw, gr, rtol=2e-2, atol=2e-2)
    seen.clear()
    linear_rows(layer, x)                                  # fp32 outside autocast: untouched
    assert seen == [3]
