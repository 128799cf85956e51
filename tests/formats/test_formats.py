"""Layouts: ours <-> eagle-official <-> speculators are lossless, atomic and validated."""
from __future__ import annotations

import argparse
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_eagle3.formats.check_draft import check_draft, has_errors
from sglang_eagle3.formats.cli import add_cli
from sglang_eagle3.formats.convert import export_draft, import_draft
from sglang_eagle3.formats.files import FolderError
from sglang_eagle3.formats.layouts import FORMATS, FormatError, detect_format, read_folder
from sglang_eagle3.models.config import Eagle3Config
from sglang_eagle3.models.draft import Eagle3DraftModel

V, H, L = 300, 64, 8


def save_target(path, **kw):
    """A small random Llama with weights (the eagle-official export reads its token embedding)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    base = dict(vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=L, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, architectures=["LlamaForCausalLM"])
    base.update(kw)
    torch.manual_seed(11)
    LlamaForCausalLM(LlamaConfig(**base)).save_pretrained(path)
    return str(path)


def save_draft(path, target_dir, draft_vocab=100, dtype=torch.bfloat16, aux=None, seed=0, eagle31=False):
    from transformers import AutoConfig
    torch.manual_seed(seed)
    cfg = Eagle3Config.for_target(AutoConfig.from_pretrained(target_dir), draft_vocab_size=draft_vocab,
                                  aux_layer_ids=aux)
    cfg.fc_norm = cfg.norm_output = eagle31
    cfg.extra["custom_note"] = {"kept": [1, 2]}          # unknown keys must survive every layout
    model = Eagle3DraftModel(cfg)
    for p in model.parameters():
        p.data.add_(torch.randn_like(p) * 0.01)
    if draft_vocab < V:
        model.set_vocab_mapping(torch.randperm(V)[:draft_vocab])
    model.save_pretrained(path, dtype=dtype)
    return str(path)


def read_json(d):
    with open(os.path.join(d, "config.json")) as f:
        return json.load(f)


def state_of(d):
    return read_folder(d).tensors


@pytest.fixture
def target(tmp_path):
    return save_target(tmp_path / "target")


@pytest.fixture
def draft(tmp_path, target):
    return save_draft(tmp_path / "draft", target)


def assert_same_draft(a, b):
    ta, tb = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype, k
        assert torch.equal(ta[k], tb[k]), k
    assert read_json(a) == read_json(b)
    assert Eagle3Config.load(a) == Eagle3Config.load(b)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype,draft_vocab,aux", [(torch.bfloat16, 100, None), (torch.float32, V, [0, 2, 6]),
                                                    (torch.float16, 37, None)])
def test_round_trip_is_lossless(fmt, dtype, draft_vocab, aux, tmp_path, target):
    src = save_draft(tmp_path / "src", target, draft_vocab=draft_vocab, dtype=dtype, aux=aux)
    out, back = str(tmp_path / "out"), str(tmp_path / "back")
    findings, _ = export_draft(src, fmt, out, target=target)
    assert not has_errors(findings)
    assert detect_format(read_json(out)) == fmt
    findings, _ = import_draft(out, back, target=target)
    assert not has_errors(findings)
    assert_same_draft(src, back)
    assert Eagle3DraftModel.from_pretrained(back).config == Eagle3Config.load(src)


def test_round_trip_without_target(tmp_path, draft):
    for fmt in ("sglang", "speculators"):
        export_draft(draft, fmt, str(tmp_path / fmt))
        import_draft(str(tmp_path / fmt), str(tmp_path / f"{fmt}-back"))
        assert_same_draft(draft, str(tmp_path / f"{fmt}-back"))
    with pytest.raises(FormatError, match="needs --target"):     # the official layout must carry the embedding
        export_draft(draft, "eagle-official", str(tmp_path / "official"))
    assert not os.path.exists(tmp_path / "official")


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_eagle31_round_trips(fmt, tmp_path, target):
    src = save_draft(tmp_path / "src", target, eagle31=True)
    out, back = str(tmp_path / "out"), str(tmp_path / "back")
    findings, _ = export_draft(src, fmt, out, target=target)
    assert not has_errors(findings)
    c = read_json(out)
    assert c["fc_norm"] is True and c["norm_output"] is True
    names = set(load_file(os.path.join(out, "model.safetensors")))
    assert {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"} <= names
    import_draft(out, back, target=target)
    assert_same_draft(src, back)
    assert Eagle3DraftModel.from_pretrained(back).fc_norm is not None


def test_eagle31_has_no_official_layout(tmp_path, target):
    src = save_draft(tmp_path / "src", target, eagle31=True)
    with pytest.raises(FormatError, match="cannot express EAGLE-3.1"):
        export_draft(src, "eagle-official", str(tmp_path / "official"), target=target)


def test_export_onto_its_own_source_is_refused(tmp_path, draft):
    with pytest.raises(FormatError, match=f"--out {draft} is the same path as --draft {draft}"):
        export_draft(draft, "sglang", draft, overwrite=True)
    assert sorted(os.listdir(draft)) == ["config.json", "model.safetensors"]


def test_export_uses_the_usual_permissions(tmp_path, draft):
    out = tmp_path / "out"
    old = os.umask(0o022)
    try:
        export_draft(draft, "speculators", str(out))
    finally:
        os.umask(old)
    assert oct(os.stat(out).st_mode & 0o777) == "0o755"
    assert all(oct(os.stat(out / f).st_mode & 0o777) == "0o644" for f in os.listdir(out))


def test_import_with_the_wrong_format_names_the_layout(tmp_path, draft):
    with pytest.raises(FormatError, match="--format speculators, but config.json is the sglang layout"):
        import_draft(draft, str(tmp_path / "out"), fmt="speculators")


def test_official_layout_facts(tmp_path, draft, target):
    out = str(tmp_path / "official")
    export_draft(draft, "eagle-official", out, target=target)
    assert sorted(os.listdir(out)) == ["config.json", "pytorch_model.bin"]
    c = read_json(out)
    assert c["architectures"] == ["LlamaForCausalLM"] and c["draft_vocab_size"] == 100
    assert c["num_hidden_layers"] == 1 and c["tie_word_embeddings"] is False
    state = torch.load(os.path.join(out, "pytorch_model.bin"), weights_only=True)
    assert "midlayer.self_attn.q_proj.weight" in state and state["d2t"].dtype == torch.int64
    assert state["t2d"].dtype == torch.bool and int(state["t2d"].sum()) == 100
    # the target's embedding, in the draft's dtype: the authors' loader takes it from the draft
    from transformers import AutoModelForCausalLM
    emb = AutoModelForCausalLM.from_pretrained(target).model.embed_tokens.weight
    assert state["embed_tokens.weight"].dtype == torch.bfloat16
    assert torch.equal(state["embed_tokens.weight"], emb.detach().to(torch.bfloat16))


def official_module():
    """The parameter set of the authors' EAGLE-3 draft model (`cnets.Model` of SafeAILab/EAGLE, eagle3):
    embed_tokens, fc, midlayer.*, norm, lm_head, plus the d2t/t2d buffers. Their loader is
    `model.load_state_dict(state, strict=False)`; anything missing keeps its random initial value."""
    m = torch.nn.Module()
    m.embed_tokens = torch.nn.Embedding(V, H)
    m.fc = torch.nn.Linear(3 * H, H, bias=False)
    mid = Eagle3DraftModel(Eagle3Config(hidden_size=H, intermediate_size=96, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=V, draft_vocab_size=100,
                                        target_hidden_size=H, aux_layer_ids=[1, 3, 4])).midlayer
    m.midlayer, m.norm = mid, torch.nn.Module()
    m.norm.weight = torch.nn.Parameter(torch.ones(H))
    m.lm_head = torch.nn.Linear(H, 100, bias=False)
    m.register_buffer("d2t", torch.zeros(100, dtype=torch.long))
    m.register_buffer("t2d", torch.zeros(V, dtype=torch.bool))
    return m


def test_authors_loader_finds_every_tensor_of_the_official_export(tmp_path, draft, target):
    out = str(tmp_path / "official")
    export_draft(draft, "eagle-official", out, target=target)
    state = torch.load(os.path.join(out, "pytorch_model.bin"), weights_only=True)
    result = official_module().load_state_dict(state, strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == []


def test_speculators_layout_facts(tmp_path, draft, target):
    out = str(tmp_path / "spec")
    export_draft(draft, "speculators", out, target=target, speculative_tokens=5)
    c = read_json(out)
    assert c["speculators_model_type"] == "eagle3"
    sc = c["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"][0] == {"proposal_type": "greedy", "speculative_tokens": 5,
                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}
    assert sc["verifier"] == {"name_or_path": os.path.abspath(target), "architectures": ["LlamaForCausalLM"]}
    tl = c["transformer_layer_config"]
    assert tl["vocab_size"] == V and tl["num_hidden_layers"] == 1 and tl["model_type"] == "llama"
    assert c["draft_vocab_size"] == 100 and c["target_hidden_size"] == H
    assert c["norm_before_residual"] is False                  # vLLM assumes true when absent
    ours = read_json(draft)["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert c["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in ours]   # vLLM ids are layer inputs
    names = set(load_file(os.path.join(out, "model.safetensors")))
    assert "layers.0.self_attn.q_proj.weight" in names and not any(n.startswith("midlayer.") for n in names)
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names


def test_import_official_release_without_eagle_config(tmp_path, draft, target):
    """The released layout: no aux ids, an embedding, pytorch_model.bin."""
    src = tmp_path / "release"
    src.mkdir()
    state = load_file(os.path.join(draft, "model.safetensors"))
    state["embed_tokens.weight"] = torch.randn(V, H).to(torch.bfloat16)
    torch.save(state, src / "pytorch_model.bin")
    c = read_json(draft)
    c["architectures"] = ["LlamaForCausalLM"]
    del c["eagle_config"]
    (src / "config.json").write_text(json.dumps(c))
    with pytest.raises(FormatError, match="pass --target"):
        import_draft(str(src), str(tmp_path / "x"))
    assert not os.path.exists(tmp_path / "x")
    findings, notes = import_draft(str(src), str(tmp_path / "ours"), target=target)
    assert not has_errors(findings)
    assert Eagle3Config.load(str(tmp_path / "ours")).aux_layer_ids == [1, 3, 4]
    assert any("embed_tokens" in n for n in notes)
    assert "embed_tokens.weight" not in load_file(str(tmp_path / "ours" / "model.safetensors"))


def test_import_specforge_prefixed_names(tmp_path, draft, target):
    state = load_file(os.path.join(draft, "model.safetensors"))
    save_file({f"model.{k}": v for k, v in state.items()}, os.path.join(draft, "model.safetensors"))
    out = str(tmp_path / "ours")
    import_draft(draft, out, target=target)
    assert sorted(load_file(os.path.join(out, "model.safetensors"))) == sorted(state)


def test_import_full_vocab_speculators_without_vocab_map(tmp_path, target):
    src = save_draft(tmp_path / "src", target, draft_vocab=V)
    spec = str(tmp_path / "spec")
    export_draft(src, "speculators", spec, target=target)
    p = os.path.join(spec, "model.safetensors")
    state = load_file(p)
    del state["d2t"], state["t2d"]                               # speculators omits them for a full vocab
    save_file(state, p)
    out = str(tmp_path / "back")
    import_draft(spec, out, target=target)
    assert_same_draft(src, out)


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(norm_before_residual=True), "norm_before_residual"),
    (lambda c: c.pop("norm_before_residual"), "absent, which vLLM reads as true"),
    (lambda c: c.update(norm_before_fc=True), "norm_before_fc=true"),
    (lambda c: c["transformer_layer_config"].update(model_type="qwen3"), "model_type='qwen3'"),
])
def test_import_refuses_speculators_variants(edit, match, tmp_path, draft, target):
    spec = str(tmp_path / "spec")
    export_draft(draft, "speculators", spec, target=target)
    c = read_json(spec)
    edit(c)
    with open(os.path.join(spec, "config.json"), "w") as f:
        json.dump(c, f)
    with pytest.raises(FormatError, match=match):
        import_draft(spec, str(tmp_path / "out"))


def test_failed_validation_leaves_nothing(tmp_path, draft, target):
    p = os.path.join(draft, "model.safetensors")
    state = load_file(p)
    state["d2t"][1] = state["d2t"][0] - 1                        # two draft ids -> one target id
    save_file(state, p)
    with pytest.raises(FormatError, match="several draft ids"):
        import_draft(draft, str(tmp_path / "out"), target=target)
    assert sorted(os.listdir(tmp_path)) == ["draft", "target"]   # no output, no temporary folder


def test_overwrite_needs_force(tmp_path, draft, target):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("x")
    with pytest.raises(FolderError, match="already exists .pass --force to replace its config.json and weights"):
        export_draft(draft, "sglang", str(out))
    assert (out / "old.txt").exists()
    (out / "pytorch_model.bin").write_text("stale weights")              # an old layout's weights go too
    _, notes = export_draft(draft, "sglang", str(out), overwrite=True)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "old.txt"]
    assert any("kept old.txt" in n for n in notes)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_export_notes_for_eagle_runtime(tmp_path, target):
    src = save_draft(tmp_path / "src", target, aux=[0, 2, 6])
    _, notes = export_draft(src, "eagle-official", str(tmp_path / "o"), target=target)
    assert any("always captures its default layers" in n for n in notes)
    _, notes = export_draft(src, "speculators", str(tmp_path / "s"))
    assert any("verifier.name_or_path is null" in n for n in notes)
    assert read_json(str(tmp_path / "s"))["speculators_config"]["verifier"]["name_or_path"] is None


def test_wrong_target_is_refused(tmp_path, draft):
    other = save_target(tmp_path / "other", vocab_size=V + 1)
    with pytest.raises(FormatError, match="target vocab_size=301"):
        export_draft(draft, "speculators", str(tmp_path / "out"), target=other)
    assert not os.path.exists(tmp_path / "out")


# ---- command line -------------------------------------------------------------------------------------------

def _run(argv):
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_export_import(tmp_path, draft, target, capsys):
    spec, back = str(tmp_path / "spec"), str(tmp_path / "back")
    assert _run(["export", "--draft", draft, "--format", "speculators", "--out", spec, "--target", target]) == 0
    assert "speculators layout" in capsys.readouterr().out
    assert _run(["import", "--src", spec, "--out", back]) == 0
    assert_same_draft(draft, back)


def test_cli_errors_are_one_line(tmp_path, draft):
    from sglang_eagle3.cli import main
    assert main(["import", "--src", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert main(["export", "--draft", draft, "--format", "sglang", "--out", draft]) == 2   # exists
    assert not has_errors(check_draft(draft))                                                  # untouched


# ---- misuse: flags checked before converting, nothing left behind, companion files ---------------------------
def one_line_error(capsys, argv) -> str:
    from sglang_eagle3.cli import main
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_export_and_import_of_a_target_folder_say_so(tmp_path, target, capsys):
    for argv, flag in ((["export", "--draft", target, "--format", "sglang"], "--draft"),
                       (["import", "--src", target], "--src")):
        err = one_line_error(capsys, [*argv, "--out", str(tmp_path / "o")])
        assert f"{flag} {target} is a target model folder (LlamaForCausalLM with {L} layers)" in err, err
    assert sorted(os.listdir(tmp_path)) == ["target"]


def test_speculative_tokens_are_checked_before_converting(tmp_path, draft, target, monkeypatch, capsys):
    import sglang_eagle3.formats.cli as fcli
    monkeypatch.setattr(fcli, "export_draft", lambda *a, **k: pytest.fail("converted before checking the flags"))
    out = str(tmp_path / "o")
    err = one_line_error(capsys, ["export", "--draft", draft, "--format", "speculators", "--speculative-tokens", "0",
                                  "--out", out])
    assert "--speculative-tokens must be >= 1, got 0" in err and "----" not in err       # no flattened table
    for fmt in ("sglang", "eagle-official", "gguf"):
        err = one_line_error(capsys, ["export", "--draft", draft, "--format", fmt, "--speculative-tokens", "5",
                                      "--target", target, "--out", out])
        assert f"--speculative-tokens is a speculators setting (vLLM's draft length); --format {fmt}" in err
    assert not os.path.exists(out)


def test_a_failed_check_after_converting_is_one_line_naming_the_finding(tmp_path, draft, capsys):
    state = load_file(os.path.join(draft, "model.safetensors"))
    state["d2t"][1] = state["d2t"][0] - 1
    save_file(state, os.path.join(draft, "model.safetensors"))
    err = one_line_error(capsys, ["import", "--src", draft, "--out", str(tmp_path / "o")])
    assert "the converted draft fails check-draft: d2t: " in err and "------" not in err


def test_force_onto_a_folder_it_cannot_write_is_refused_up_front(tmp_path, draft, monkeypatch, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("x")
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if os.path.abspath(p) == str(out) else real(p, mode))
    err = one_line_error(capsys, ["export", "--draft", draft, "--format", "sglang", "--out", str(out), "--force"])
    assert f"--out {out}: no permission to write in {out} (the folder being replaced)" in err
    monkeypatch.setattr(os, "access", lambda p, mode: False if os.path.abspath(p) == str(tmp_path) else real(p, mode))
    err = one_line_error(capsys, ["export", "--draft", draft, "--format", "sglang", "--out", str(tmp_path / "new")])
    assert f"no permission to write in {tmp_path}" in err and "Errno" not in err
    assert sorted(os.listdir(tmp_path)) == ["draft", "out", "target"] and os.listdir(out) == ["mine.txt"]


def test_a_write_that_fails_at_the_swap_restores_the_old_folder(tmp_path, draft, monkeypatch, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("x")
    (out / "config.json").write_text("{}")
    real = os.replace

    def replace(a, b):                                   # the second new file cannot be moved in
        if os.path.dirname(os.path.abspath(b)) == str(out) and os.path.basename(b) == "model.safetensors":
            raise PermissionError(13, "Permission denied", str(b))
        return real(a, b)
    monkeypatch.setattr(os, "replace", replace)
    err = one_line_error(capsys, ["export", "--draft", draft, "--format", "sglang", "--out", str(out), "--force"])
    assert f"--out {out}: cannot write it (Permission denied" in err and "[Errno" not in err
    assert sorted(os.listdir(tmp_path)) == ["draft", "out", "target"]
    assert sorted(os.listdir(out)) == ["config.json", "mine.txt"] and (out / "config.json").read_text() == "{}"


def test_sglang_exports_and_imports_carry_the_tuned_profile(tmp_path, draft, target, capsys):
    profile = '{"per_batch_size": {"1": {"num_steps": 2, "topk": 1, "num_draft_tokens": 3}}}'
    with open(os.path.join(draft, "spec_profile.json"), "w") as f:
        f.write(profile)
    export_draft(draft, "sglang", str(tmp_path / "s"))
    assert (tmp_path / "s" / "spec_profile.json").read_text() == profile
    import_draft(str(tmp_path / "s"), str(tmp_path / "back"))
    assert (tmp_path / "back" / "spec_profile.json").read_text() == profile
    _, notes = export_draft(draft, "speculators", str(tmp_path / "v"), target=target)
    assert not (tmp_path / "v" / "spec_profile.json").exists()
    assert any("spec_profile.json was not copied: the speculators layout" in n for n in notes)


def test_formats_that_need_a_target_say_so_before_reading_the_draft(tmp_path, draft, monkeypatch, capsys):
    import sglang_eagle3.formats.cli as fcli
    monkeypatch.setattr(fcli, "export_draft", lambda *a, **k: pytest.fail("converted before checking the flags"))
    for fmt, said in (("eagle-official", "--format eagle-official needs --target: the authors' loader"),
                      ("gguf", "--format gguf needs --target: llama.cpp's converter")):
        err = one_line_error(capsys, ["export", "--draft", draft, "--format", fmt, "--out", str(tmp_path / fmt)])
        assert said in err
        assert not os.path.exists(tmp_path / fmt)


# ---- outputs apart from inputs; --force replaces only the draft's files ------------------------------------------
def tree(d) -> dict:
    """Every file under d with its bytes: what a refused command must leave as it was."""
    return {os.path.relpath(os.path.join(r, f), d): open(os.path.join(r, f), "rb").read()
            for r, _, names in os.walk(d) for f in names}


def test_export_into_the_folder_holding_its_source_is_refused(tmp_path, target, capsys):
    """An --out that contains the --draft (here beside another model) is refused before anything is read, with or
    without --force: --force used to replace the whole folder, the source and the other model with it."""
    box = tmp_path / "D"
    save_draft(box / "src", target)
    save_target(box / "other")
    before = tree(box)
    capsys.readouterr()
    err = one_line_error(capsys, ["export", "--draft", str(box / "src"), "--format", "speculators", "--target",
                                  target, "--out", str(box), "--force"])
    assert f"--out {box} contains --draft {box / 'src'}: an output must not be, contain or sit inside" in err
    assert tree(box) == before
    err = one_line_error(capsys, ["export", "--draft", str(box / "src"), "--format", "sglang",
                                  "--out", str(box / "src" / "sub")])
    assert f"--out {box / 'src' / 'sub'} is inside --draft {box / 'src'}" in err
    os.symlink(box, tmp_path / "link")                   # the same folder under another name
    err = one_line_error(capsys, ["export", "--draft", str(box / "src"), "--format", "sglang",
                                  "--out", str(tmp_path / "link"), "--force"])
    assert f"--out {tmp_path / 'link'} contains --draft" in err
    assert tree(box) == before


def test_import_into_the_folder_holding_its_source_is_refused(tmp_path, target, capsys):
    box = tmp_path / "D"
    save_draft(box / "src", target)
    (box / "keep.txt").write_text("mine")
    before = tree(box)
    capsys.readouterr()
    err = one_line_error(capsys, ["import", "--src", str(box / "src"), "--out", str(box), "--force"])
    assert f"--out {box} contains --src {box / 'src'}" in err
    assert tree(box) == before


def test_force_replaces_only_the_draft_files_as_init_draft_does(tmp_path, draft, target, capsys):
    """export/import --force into a folder that is not a draft write the draft beside its files (another model in a
    subfolder, notes) instead of replacing the folder; a folder holding a target model itself is refused."""
    out = tmp_path / "X"
    save_target(out / "other")
    (out / "NOTES.txt").write_text("notes")
    other = tree(out / "other")
    capsys.readouterr()
    from sglang_eagle3.cli import main
    assert main(["export", "--draft", draft, "--format", "speculators", "--target", target, "--out", str(out),
                 "--force"]) == 0
    assert sorted(os.listdir(out)) == ["NOTES.txt", "config.json", "model.safetensors", "other"]
    assert tree(out / "other") == other and (out / "NOTES.txt").read_text() == "notes"
    assert "kept NOTES.txt, other" in capsys.readouterr().err
    assert main(["import", "--src", str(out), "--out", str(tmp_path / "back")]) == 0
    assert main(["import", "--src", str(tmp_path / "back"), "--out", str(out), "--force"]) == 0   # speculators -> ours
    assert read_json(str(out))["architectures"] == ["LlamaForCausalLMEagle3"]
    assert tree(out / "other") == other and (out / "NOTES.txt").read_text() == "notes"
    model = tmp_path / "model"
    save_target(model)
    before = tree(model)
    capsys.readouterr()
    err = one_line_error(capsys, ["export", "--draft", draft, "--format", "sglang", "--out", str(model), "--force"])
    assert f"--out {model} holds a target model (LlamaForCausalLM with {L} layers), not an EAGLE-3 draft" in err
    assert tree(model) == before
    (tmp_path / "f.txt").write_text("x")                 # a file: said at once, not "pass --force" first
    err = one_line_error(capsys, ["export", "--draft", draft, "--format", "sglang", "--out", str(tmp_path / "f.txt")])
    assert f"--out {tmp_path / 'f.txt'} is a file, not a folder" in err
