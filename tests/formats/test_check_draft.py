"""check_draft: a clean draft passes; each kind of fault is reported as an ERROR that names it."""
from __future__ import annotations

import argparse
import json
import os

import pytest
import torch
from conftest import edit_tensors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from sglang_eagle3.formats.check_draft import ERROR, OK, WARN, add_cli, check_draft, format_table, has_errors
from sglang_eagle3.models.config import Eagle3Config
from sglang_eagle3.models.draft import Eagle3DraftModel

V, VD, H, L = 300, 100, 64, 8


def save_target(path, **kw):
    from transformers import LlamaConfig
    base = dict(vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=L, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512)
    base.update(kw)
    LlamaConfig(**base).save_pretrained(path)
    return str(path)


def save_draft(path, target_dir, draft_vocab=VD, dtype=torch.bfloat16, seed=0):
    from transformers import AutoConfig
    torch.manual_seed(seed)
    cfg = Eagle3Config.for_target(AutoConfig.from_pretrained(target_dir), draft_vocab_size=draft_vocab)
    model = Eagle3DraftModel(cfg)
    for p in model.parameters():                       # norms away from 1 so mix-ups would show
        p.data.add_(torch.randn_like(p) * 0.01)
    if draft_vocab < V:
        model.set_vocab_mapping(torch.randperm(V)[:draft_vocab])
    model.save_pretrained(path, dtype=dtype)
    return str(path)


@pytest.fixture
def target(tmp_path):
    return save_target(tmp_path / "target")


@pytest.fixture
def draft(tmp_path, target):
    return save_draft(tmp_path / "draft", target)


def edit_config(d, fn):
    p = os.path.join(d, "config.json")
    with open(p) as f:
        c = json.load(f)
    fn(c)
    with open(p, "w") as f:
        json.dump(c, f)


def errors(findings):
    return [f for f in findings if f.status == ERROR]


def assert_error(findings, *phrases):
    errs = errors(findings)
    assert errs, format_table(findings)
    text = "\n".join(f"{f.check}: {f.detail}" for f in errs)
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in:\n{text}"


def test_clean_draft_passes(draft, target):
    findings = check_draft(draft, target)
    assert not has_errors(findings), format_table(findings)
    assert [f for f in findings if f.status == WARN] == [], format_table(findings)
    checks = {f.check for f in findings if f.status == OK}
    assert {"format", "tensor names", "tensor shapes", "dtype", "d2t", "t2d", "vocab size", "hidden size",
            "aux layer ids", "rope"} <= checks


def test_without_target_only_warns(draft):
    findings = check_draft(draft)
    assert not has_errors(findings)
    assert any(f.check == "target" and f.status == WARN for f in findings)


def _drop(name):
    return lambda s: s.pop(name)


def _set(name, value):
    def fn(s):
        s[name] = value
    return fn


def _d2t_out_of_range(s):
    s["d2t"][5] = 10 ** 6


def _d2t_duplicated(s):
    ids = torch.arange(VD) + s["d2t"]
    s["d2t"][1] = ids[0] - 1                          # draft id 1 -> the target id of draft id 0


def _t2d_swapped(s):
    on, off = s["t2d"].nonzero()[0], (~s["t2d"]).nonzero()[0]
    s["t2d"][on], s["t2d"][off] = False, True


def _t2d_short(s):
    s["t2d"][s["t2d"].nonzero()[0]] = False


def _nan(s):
    s["norm.weight"][3] = float("nan")


TENSOR_FAULTS = {
    "missing tensor": (_drop("midlayer.mlp.up_proj.weight"), ["missing tensor midlayer.mlp.up_proj.weight"]),
    "extra tensor": (_set("midlayer.self_attn.q_norm.weight", torch.ones(16, dtype=torch.bfloat16)),
                     ["unexpected tensor midlayer.self_attn.q_norm.weight"]),
    "mis-shaped": (_set("fc.weight", torch.zeros(H, 2 * H, dtype=torch.bfloat16)),
                   ["tensor fc.weight has shape [64, 128]", "[64, 192]"]),
    "wrong dtype": (_set("lm_head.weight", torch.zeros(VD, H, dtype=torch.float64)),
                    ["tensor lm_head.weight is float64"]),
    "int weights": (_set("norm.weight", torch.ones(H, dtype=torch.int8)), ["tensor norm.weight is int8"]),
    "float d2t": (_set("d2t", torch.zeros(VD)), ["d2t is torch.float32"]),
    "d2t out of range": (_d2t_out_of_range, ["outside the target vocabulary [0, 300)", "draft id 5"]),
    "d2t duplicated": (_d2t_duplicated, ["several draft ids [0, 1]"]),
    "t2d disagreeing": (_t2d_swapped, ["t2d disagrees with d2t on 2 target ids"]),
    "t2d count": (_t2d_short, ["t2d marks 99 target tokens but draft_vocab_size=100"]),
    "t2d wrong length": (_set("t2d", torch.ones(V - 1, dtype=torch.bool)), ["tensor t2d has shape [299]"]),
    "nan weights": (_nan, ["norm.weight has 1 NaN/Inf"]),
}


@pytest.mark.parametrize("fault", sorted(TENSOR_FAULTS))
def test_tensor_faults(fault, draft, target):
    fn, phrases = TENSOR_FAULTS[fault]
    edit_tensors(draft, fn)
    assert_error(check_draft(draft, target), *phrases)


def _del(key):
    return lambda c: c.pop(key)


def _cset(key, value):
    def fn(c):
        c[key] = value
    return fn


def _aux(ids):
    def fn(c):
        c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    return fn


CONFIG_FAULTS = {
    "missing draft_vocab_size": (_del("draft_vocab_size"), ["missing config key draft_vocab_size"]),
    "missing num_hidden_layers": (_del("num_hidden_layers"), ["missing config key num_hidden_layers", "32"]),
    "missing architectures": (_del("architectures"), ["missing config key architectures"]),
    "two layers": (_cset("num_hidden_layers", 2), ["num_hidden_layers=2"]),
    "tied lm_head": (_cset("tie_word_embeddings", True), ["tie_word_embeddings=true"]),
    "aux id past last layer": (_aux([1, 3, 7]), ["ids [7] out of range", "[0, 6] for a 8-layer target"]),
    "negative aux id": (_aux([-1, 3, 4]), ["ids [-1] out of range"]),
    "two aux ids": (_aux([1, 3]), ["has 2 ids"]),
    "aux not ints": (_aux("1,3,4"), ["is not a list of integers"]),
    "gelu": (_cset("hidden_act", "gelu"), ["hidden_act='gelu'"]),
    "unknown architecture": (_cset("architectures", ["MistralForCausalLM"]), ["not a known EAGLE-3 draft layout"]),
    "string head_dim": (_cset("head_dim", "16"), ["head_dim='16' is not a positive integer"]),
    "eagle_config not an object": (_cset("eagle_config", [1, 3, 4]), ["eagle_config=[1, 3, 4] is not an object"]),
    "draft vocab above vocab": (_cset("draft_vocab_size", V + 1), ["draft_vocab_size=301 exceeds vocab_size=300"]),
    # what transformers' LlamaConfig refuses (SGLang and vLLM read the config with it)
    "hidden not a multiple of heads": (_cset("num_attention_heads", 6), ["hidden_size=64 is not a multiple of "
                                                                         "num_attention_heads=6"]),
    "odd head_dim": (_cset("head_dim", 15), ["head_dim=15 is odd"]),
    "unknown rope type": (_cset("rope_scaling", {"rope_type": "spiral"}), ["rope_type='spiral' is not a RoPE type"]),
    "yarn without factor": (_cset("rope_scaling", {"rope_type": "yarn"}), ["LlamaConfig refuses it", "'factor'"]),
}


@pytest.mark.parametrize("fault", sorted(CONFIG_FAULTS))
def test_config_faults(fault, draft, target):
    fn, phrases = CONFIG_FAULTS[fault]
    edit_config(draft, fn)
    assert_error(check_draft(draft, target), *phrases)


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-3, 10 ** 6) | st.floats(allow_nan=False)
                           | st.text(max_size=5), lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
KEYS = ["hidden_size", "vocab_size", "draft_vocab_size", "head_dim", "num_key_value_heads", "eagle_config",
        "rope_scaling", "rope_theta", "architectures", "tie_word_embeddings", "max_position_embeddings", "torch_dtype"]


@pytest.mark.parametrize("key,value", [("architectures", {"a": 1}), ("architectures", 5), ("rope_scaling", "x"),
                                       ("eagle_config", {"eagle_aux_hidden_state_layer_ids": None}),
                                       ("num_hidden_layers", True), ("vocab_size", 1.5)])
def test_odd_config_values_give_findings(key, value, draft, target):
    edit_config(draft, _cset(key, value))
    assert check_draft(draft, target)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(KEYS), value=JSON_VALUES)
def test_any_config_value_gives_findings_not_a_crash(key, value, draft, target):
    edit_config(draft, _cset(key, value))
    findings = check_draft(draft, target)
    assert findings and all(f.status in (OK, WARN, ERROR) for f in findings)


def test_last_valid_aux_id_is_l_minus_2(draft, target):
    edit_config(draft, _aux([1, 3, L - 2]))
    assert not has_errors(check_draft(draft, target))


def test_vocab_mismatch_vs_target(draft, tmp_path):
    other = save_target(tmp_path / "other", vocab_size=V + 20)
    assert_error(check_draft(draft, other), "draft vocab_size=300", "target vocab_size=320")


def test_hidden_mismatch_vs_target(draft, tmp_path):
    other = save_target(tmp_path / "other", hidden_size=128)
    assert_error(check_draft(draft, other), "target_hidden_size=64", "target hidden_size=128", "fc.weight [64, 192]")


def test_aux_ids_checked_against_a_shallower_target(draft, tmp_path):
    shallow = save_target(tmp_path / "shallow", num_hidden_layers=5)      # ids [1, 3, 4] -> 4 > 5 - 2
    assert_error(check_draft(draft, shallow), "ids [4] out of range")


def test_missing_eagle_config_is_a_warning(draft, target):
    edit_config(draft, _del("eagle_config"))
    findings = check_draft(draft, target)
    assert not has_errors(findings), format_table(findings)
    warn = [f for f in findings if f.check == "aux layer ids"][0]
    assert warn.status == WARN and "[2, 4, 5] for this target" in warn.detail


def test_rope_mismatch_is_a_warning(draft, target):
    edit_config(draft, _cset("rope_theta", 500000.0))
    edit_config(draft, _cset("rope_scaling", None))
    findings = check_draft(draft, target)
    assert not has_errors(findings)
    rope = [f for f in findings if f.check == "rope"][0]
    assert rope.status == WARN and "rope_theta=500000" in rope.detail and "rope_theta=10000" in rope.detail


def test_shorter_context_is_a_warning(draft, tmp_path):
    long = save_target(tmp_path / "long", max_position_embeddings=4096)
    f = [x for x in check_draft(draft, long) if x.check == "context length"][0]
    assert f.status == WARN and "max_position_embeddings=512 < target's 4096" in f.detail


def test_torch_dtype_mismatch_is_a_warning(draft, target):
    edit_config(draft, _cset("torch_dtype", "float16"))
    f = [x for x in check_draft(draft, target) if x.check == "dtype"][0]
    assert f.status == WARN and "torch_dtype=float16" in f.detail


def test_unreadable_safetensors(draft, target):
    with open(os.path.join(draft, "model.safetensors"), "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    findings = check_draft(draft, target)
    assert_error(findings, "model.safetensors: unreadable safetensors file")
    assert any(f.check == "vocab size" and f.status == OK for f in findings)   # config checks still ran


def test_invalid_json_config(draft, target):
    with open(os.path.join(draft, "config.json"), "w") as f:
        f.write("{")
    assert_error(check_draft(draft, target), "config.json: not valid JSON")


def test_no_weights(draft, target):
    os.remove(os.path.join(draft, "model.safetensors"))
    assert_error(check_draft(draft, target), "no weights")


def test_not_a_folder(tmp_path):
    assert_error(check_draft(str(tmp_path / "nope")), "not a directory")


def test_unreadable_target(draft, tmp_path):
    (tmp_path / "empty").mkdir()
    assert_error(check_draft(draft, str(tmp_path / "empty")), "cannot read the target config")


def test_target_as_config_object(draft):
    from transformers import LlamaConfig
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=L, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512)
    assert not has_errors(check_draft(draft, cfg))


def test_official_layout_with_bin_and_embedding(draft, target):
    """yuhuili/EAGLE3-*: LlamaForCausalLM, pytorch_model.bin, no eagle_config, sometimes embed_tokens."""
    state = load_file(os.path.join(draft, "model.safetensors"))
    state["embed_tokens.weight"] = torch.zeros(V, H, dtype=torch.bfloat16)
    os.remove(os.path.join(draft, "model.safetensors"))
    torch.save(state, os.path.join(draft, "pytorch_model.bin"))
    edit_config(draft, _cset("architectures", ["LlamaForCausalLM"]))
    edit_config(draft, _del("eagle_config"))
    findings = check_draft(draft, target)
    assert not has_errors(findings), format_table(findings)
    fmt = [f for f in findings if f.check == "format"][0]
    assert "eagle-official" in fmt.detail and "pytorch_model.bin" in fmt.detail
    assert any(f.check == "embed_tokens" for f in findings)


def test_official_layout_without_embedding_is_an_error(draft, target):
    state = load_file(os.path.join(draft, "model.safetensors"))
    os.remove(os.path.join(draft, "model.safetensors"))
    torch.save(state, os.path.join(draft, "pytorch_model.bin"))
    edit_config(draft, _cset("architectures", ["LlamaForCausalLM"]))
    assert_error(check_draft(draft, target), "no embed_tokens.weight", "strict=False")


def test_untrained_draft_is_flagged(tmp_path, target):
    from sglang_eagle3.cli import main
    out = str(tmp_path / "random")
    assert main(["init-draft", "--target", target, "--out", out, "--draft-vocab-size", "50"]) == 0
    findings = check_draft(out, target)
    assert not has_errors(findings)
    assert any(f.check == "trained" and f.status == WARN and "looks untrained" in f.detail for f in findings)


def test_bin_with_pickled_objects_is_refused(draft, target):
    os.remove(os.path.join(draft, "model.safetensors"))
    torch.save({"fc.weight": torch.zeros(2), "meta": argparse.Namespace(x=1)},
               os.path.join(draft, "pytorch_model.bin"))
    assert_error(check_draft(draft, target), "pytorch_model.bin: unreadable PyTorch file")


def test_model_prefix(draft, target):
    edit_tensors(draft, lambda s: s.update({f"model.{k}": s.pop(k) for k in list(s) if k.startswith("midlayer.")}))
    findings = check_draft(draft, target)
    assert not has_errors(findings)
    assert any(f.check == "tensor names" and f.status == WARN and "'model.' prefix" in f.detail for f in findings)
    edit_tensors(draft, lambda s: s.update({"model.lm_head.weight": s.pop("lm_head.weight")}))
    assert_error(check_draft(draft, target), "model.lm_head.weight")


def test_specforge_transformers5_config(draft, target):
    """SpecForge saves through transformers 5: `dtype` and `rope_parameters` instead of torch_dtype/rope_*."""
    def fn(c):
        c["dtype"] = c.pop("torch_dtype")
        c.pop("rope_scaling")
        c["rope_parameters"] = {"rope_theta": c.pop("rope_theta"), "rope_type": "default"}
    edit_config(draft, fn)
    findings = check_draft(draft, target)
    assert not has_errors(findings)
    assert {f.check: f.status for f in findings}["rope"] == OK
    assert {f.check: f.status for f in findings}["dtype"] == OK


def test_full_vocab_without_d2t_warns(tmp_path, target):
    d = save_draft(tmp_path / "full", target, draft_vocab=V)
    edit_tensors(d, lambda s: (s.pop("d2t"), s.pop("t2d")))
    findings = check_draft(d, target)
    assert not has_errors(findings), format_table(findings)
    assert [f.status for f in findings if f.check == "d2t"] == [WARN]


def test_reduced_vocab_without_d2t_fails(draft, target):
    edit_tensors(draft, _drop("d2t"))
    assert_error(check_draft(draft, target), "missing tensor d2t: draft_vocab_size=100 < vocab_size=300")


# ---- speculators layout (converted by the exporter; faults injected by hand) ------------------------------

@pytest.fixture
def spec_draft(tmp_path, draft, target):
    from sglang_eagle3.formats.convert import export_draft
    out = str(tmp_path / "spec")
    export_draft(draft, "speculators", out, target=target)
    return out


def test_speculators_clean(spec_draft, target):
    findings = check_draft(spec_draft, target)
    assert not has_errors(findings) and not [f for f in findings if f.status == WARN], format_table(findings)
    aux = [f for f in findings if f.check == "aux layer ids"][0]
    assert "[1, 3, 4]" in aux.detail                      # file says [2, 4, 5] (layer inputs)


def test_speculators_layer_id_convention(spec_draft, target):
    edit_config(spec_draft, _cset("eagle_aux_hidden_state_layer_ids", [2, 4, L]))   # L = output of the last layer
    assert_error(check_draft(spec_draft, target), "ids [7] out of range", "eagle_aux_hidden_state_layer_ids [2, 4, 8]")


def test_speculators_nested_layer_ids(spec_draft, target):
    def fn(c):
        c["transformer_layer_config"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = c.pop(
            "eagle_aux_hidden_state_layer_ids")
    edit_config(spec_draft, fn)
    aux = [f for f in check_draft(spec_draft, target) if f.check == "aux layer ids"][0]
    assert aux.status == OK and aux.detail.startswith("[1, 3, 4]")


def test_speculators_schema_faults(spec_draft, target):
    def fn(c):
        c["speculators_config"]["proposal_methods"] = []
        del c["speculators_config"]["verifier"]["name_or_path"]
        c["norm_before_residual"] = True
        del c["transformer_layer_config"]["intermediate_size"]
    edit_config(spec_draft, fn)
    findings = check_draft(spec_draft, target)
    assert_error(findings, "proposal_methods[0].speculative_tokens", "speculators_config.verifier.name_or_path",
                 "missing config key transformer_layer_config.intermediate_size")
    assert any(f.check == "norm_before_residual" and f.status == WARN for f in findings)


def test_speculators_tensor_names_in_messages(spec_draft, target):
    edit_tensors(spec_draft, _drop("layers.0.mlp.down_proj.weight"))
    assert_error(check_draft(spec_draft, target), "missing tensor layers.0.mlp.down_proj.weight")


# ---- command line -------------------------------------------------------------------------------------------

def _parse(argv):
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_table_and_exit_codes(draft, target, capsys):
    args = _parse(["check-draft", "--draft", draft, "--target", target])
    assert args.func(args) == 0
    out = capsys.readouterr()
    assert "tensor shapes" in out.out and "PASS" in out.err
    edit_tensors(draft, _drop("norm.weight"))
    assert args.func(args) == 1
    assert "missing tensor norm.weight" in capsys.readouterr().out


def test_cli_json(draft, target, capsys):
    edit_tensors(draft, _d2t_out_of_range)
    args = _parse(["check-draft", "--draft", draft, "--target", target, "--json"])
    assert args.func(args) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert any(f["status"] == ERROR and f["check"] == "d2t" for f in report["findings"])


def write_gguf(path, arch, hidden=H, layers=(2, 5, 8)):
    """A small GGUF file as llama.cpp's converter writes one (the metadata check-draft reads, two tensors)."""
    import numpy as np
    from gguf import GGUFWriter
    w = GGUFWriter(str(path), arch)
    if arch == "eagle3":
        w.add_array("eagle3.target_layers", list(layers))
        w.add_uint32("eagle3.target_hidden_size", hidden)
        w.add_tensor("d2t", np.arange(VD, dtype=np.int64))
    w.add_tensor("fc.weight", np.zeros((4, 12), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_a_gguf_export_is_recognised_and_what_is_not_checked_is_said(draft, target, tmp_path, capsys):
    """check-draft on an `export --format gguf` folder or its draft.gguf reads the GGUF metadata (it used to say "no
    config.json" / "no such folder") and names the safetensors folder for the tensor-level checks."""
    from sglang_eagle3.cli import main
    out = tmp_path / "gguf"
    out.mkdir()
    draft_file = write_gguf(out / "draft.gguf", "eagle3")
    write_gguf(out / "target.gguf", "llama")
    (out / "gguf_export.json").write_text(json.dumps({"draft": draft}))
    for argv in (["--draft", str(out)], ["--draft", draft_file, "--target", target]):
        assert main(["check-draft", *argv, "--json"]) == 0, argv
        findings = {f["check"]: f for f in json.loads(capsys.readouterr().out)["findings"]}
        assert findings["format"]["detail"] == f"GGUF file {draft_file}: architecture eagle3, 2 tensors"
        assert "target_layers [2, 5, 8] (layer inputs; SGLang's ids [1, 4, 7]), target_hidden_size 64, draft " \
               f"vocabulary {VD}" in findings["eagle3 metadata"]["detail"]
        assert findings["not checked"]["status"] == WARN
        assert f"checked on the safetensors draft folder the GGUF was exported from: `eagle3 check-draft --draft " \
               f"{draft}`" in findings["not checked"]["detail"]
    assert findings["target"]["status"] == OK
    assert main(["check-draft", "--draft", write_gguf(tmp_path / "wide.gguf", "eagle3", hidden=H * 2), "--target",
                 target]) == 1
    assert f"eagle3.target_hidden_size={2 * H} but the target's hidden_size is {H}" in capsys.readouterr().out
    assert main(["check-draft", "--draft", str(out / "target.gguf")]) == 1
    assert "GGUF architecture 'llama', not llama.cpp's eagle3 draft" in capsys.readouterr().out
    (tmp_path / "notes.txt").write_text("x")
    assert main(["check-draft", "--draft", str(tmp_path / "notes.txt")]) == 2
    assert "is a file; expected a draft folder or a GGUF draft file" in capsys.readouterr().err


def test_registered_in_eagle3_cli(draft, target):
    from sglang_eagle3.cli import main
    assert main(["check-draft", "--draft", draft, "--target", target]) == 0
