"""GGUF export for llama.cpp, and (where the pinned build exists) the draft running inside llama.cpp.

The export uses llama.cpp's own converter from the pinned source (downloaded from PyPI once); the GGUF it
writes is read back with the `gguf` package's reader. The llama.cpp part runs only with `make llamacpp`'s build.
"""
from __future__ import annotations

import os

import pytest
import torch

from sglang_eagle3.formats import llamacpp
from sglang_eagle3.formats.gguf import GGUFExportError, export_gguf, read_gguf
from sglang_eagle3.models.config import Eagle3Config
from sglang_eagle3.models.draft import Eagle3DraftModel
from sglang_eagle3.models.testbed import resolve_target


@pytest.fixture(scope="module")
def source():
    try:
        return llamacpp.fetch_source(llamacpp.root_dir())
    except Exception as e:       # no PyPI here: the export cannot run
        pytest.skip(f"pinned llama.cpp source unavailable ({e})")


@pytest.fixture(scope="module")
def target():
    return resolve_target("testbed")


def make_draft(path, target, aux=None, eagle31=False, seed=0):
    from transformers import AutoConfig
    torch.manual_seed(seed)
    cfg = Eagle3Config.for_target(AutoConfig.from_pretrained(target), draft_vocab_size=512, aux_layer_ids=aux)
    cfg.fc_norm = cfg.norm_output = eagle31
    d = Eagle3DraftModel(cfg)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    d.set_vocab_mapping(torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(seed))[:512])
    d.save_pretrained(str(path), dtype=torch.bfloat16)
    return str(path), d


@pytest.mark.parametrize("aux", [None, [3, 10, 20]], ids=["default-layers", "custom-layers"])
def test_gguf_export_parses_with_the_expected_layout(source, target, tmp_path, aux):
    draft, model = make_draft(tmp_path / "draft", target, aux)
    summary = export_gguf(draft, target, str(tmp_path / "gguf"))
    ours = model.config.aux_layer_ids
    assert summary["llamacpp_target_layers"] == [i + 1 for i in ours]          # llama.cpp counts layer inputs
    g = read_gguf(str(tmp_path / "gguf" / "draft.gguf"))
    assert g["architecture"] == "eagle3"
    m = g["metadata"]
    assert m["eagle3.target_layers"] == [i + 1 for i in ours] and m["eagle3.target_hidden_size"] == 576
    assert m["eagle3.block_count"] == 1 and m["eagle3.embedding_length"] == 576
    assert m["eagle3.rope.freq_base"] == pytest.approx(model.config.rope_theta)
    assert m["eagle3.norm_before_residual"] is False
    t = g["tensors"]
    assert t["fc.weight"]["shape"] == [3 * 576, 576] and t["output.weight"]["shape"] == [576, 512]
    assert t["blk.0.attn_q.weight"]["shape"] == [2 * 576, 576] and t["blk.0.attn_norm_2.weight"]["shape"] == [576]
    assert t["d2t"] == {"shape": [512], "type": "I64"} and "t2d" not in t
    # d2t holds absolute target ids in llama.cpp (our offsets + arange)
    from gguf import GGUFReader
    d2t = next(x for x in GGUFReader(str(tmp_path / "gguf" / "draft.gguf")).tensors if x.name == "d2t")
    assert d2t.data.tolist() == model.draft_to_target(torch.arange(512)).tolist()
    tg = read_gguf(str(tmp_path / "gguf" / "target.gguf"))
    assert tg["architecture"] == "llama" and tg["metadata"]["llama.block_count"] == 30


def test_gguf_export_refuses_eagle31_and_a_missing_target(source, target, tmp_path):
    draft, _ = make_draft(tmp_path / "d31", target, eagle31=True)
    with pytest.raises(GGUFExportError, match="EAGLE-3.1"):
        export_gguf(draft, target, str(tmp_path / "out"))
    draft, _ = make_draft(tmp_path / "d3", target)
    with pytest.raises(GGUFExportError, match="needs --target"):
        export_gguf(draft, str(tmp_path / "nope"), str(tmp_path / "out"))


def test_cli_export_gguf_one_line_errors(source, target, tmp_path, capsys):
    from sglang_eagle3.cli import main
    draft, _ = make_draft(tmp_path / "d31", target, eagle31=True)
    assert main(["export", "--format", "gguf", "--draft", draft, "--target", target, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "EAGLE-3.1" in err and err.count("\n") == 1


needs_build = pytest.mark.skipif(not llamacpp.is_built(), reason="no llama.cpp build here (make llamacpp)")


@needs_build
def test_llamacpp_runs_our_draft_losslessly_and_accepts_its_tokens(target, tmp_path):
    """Greedy llama.cpp output with our draft equals llama.cpp's own greedy output without it; a trained draft
    gets more of its tokens accepted than a random one."""
    from transformers import AutoTokenizer

    from sglang_eagle3.bench.llamacpp import chat_text, ensure_ggufs, run_speculative
    from sglang_eagle3.paths import shipped_draft
    tok = AutoTokenizer.from_pretrained(target)
    tgg, dgg = ensure_ggufs(target, shipped_draft())
    rand, _ = make_draft(tmp_path / "random", target)
    rdir = str(tmp_path / "rgguf")
    export_gguf(rand, target, rdir)
    prompts = ["Give me three tips for staying focused while studying.", "What is 17 * 23? Explain step by step."]
    trained_acc = random_acc = 0
    for p in prompts:
        text = chat_text(tok, p)
        a = run_speculative(tgg, dgg, text, 40, 3, 2, keep_text=True)
        b = run_speculative(tgg, os.path.join(rdir, "draft.gguf"), text, 40, 3, 2, keep_text=True)
        # whatever the draft, the target's greedy text; llama-speculative-simple may stop a few tokens past -n
        # when the last step accepts several drafts, so the shorter text must be a prefix of the longer one
        short, longer = sorted((a["text"].rstrip(), b["text"].rstrip()), key=len)
        assert short and longer.startswith(short), (a["text"], b["text"])
        trained_acc += a["n_accept"]
        random_acc += b["n_accept"]
    assert trained_acc > random_acc
