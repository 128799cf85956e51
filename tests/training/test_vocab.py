"""Draft vocab: counting assistant tokens, choosing ids, d2t/t2d buffers, coverage report."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from sglang_eagle3.fileio import write_json
from sglang_eagle3.models.config import Eagle3Config
from sglang_eagle3.models.draft import Eagle3DraftModel
from sglang_eagle3.training.data.build import write_examples
from sglang_eagle3.training.vocab import (
    build_vocab,
    count_tokens,
    coverage_table,
    format_report,
    load_vocab,
    select_draft_vocab,
    vocab_mapping,
)


def test_count_only_masked_tokens():
    rows = [(np.array([5, 6, 7, 7]), np.array([0, 1, 1, 1])), ([7, 1], [1, 0])]
    counts = count_tokens(rows, 10)
    assert counts.tolist() == [0, 0, 0, 0, 0, 0, 1, 3, 0, 0]
    with pytest.raises(ValueError, match="outside the target vocab of 10"):
        count_tokens([([12], [1])], 10)


def test_select_by_frequency_ties_by_id_sorted_output():
    counts = np.array([0, 5, 9, 5, 1, 0, 7, 5])
    ids, info = select_draft_vocab(counts, 4)
    assert ids.dtype == torch.int64 and ids.tolist() == [1, 2, 3, 6]   # 9, 7, then 5s by lowest id: 1, 3
    assert info["coverage"] == pytest.approx((9 + 7 + 5 + 5) / 32)
    assert info["filled_with_unseen_ids"] == 0


def test_fewer_distinct_tokens_fills_lowest_unseen_ids():
    counts = np.zeros(20, dtype=np.int64)
    counts[[4, 17]] = [3, 8]
    ids, info = select_draft_vocab(counts, 5)
    assert ids.tolist() == [0, 1, 2, 4, 17]
    assert info["filled_with_unseen_ids"] == 3 and info["coverage"] == 1.0
    assert "3 unseen ids" in format_report({**info, "coverage_table": coverage_table(counts, (2, 4))})
    with pytest.raises(ValueError, match=r"draft_vocab_size must be in \[1, 20\]"):
        select_draft_vocab(counts, 21)


def test_mapping_matches_draft_model_buffers():
    counts = np.random.default_rng(0).integers(0, 50, size=100)
    ids, _ = select_draft_vocab(counts, 12)
    d2t, t2d = vocab_mapping(ids, 100)
    cfg = Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=100, draft_vocab_size=12, target_hidden_size=32, aux_layer_ids=[0, 1, 2])
    draft = Eagle3DraftModel(cfg)
    draft.set_vocab_mapping(ids)
    assert torch.equal(draft.d2t, d2t) and torch.equal(draft.t2d, t2d)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and int(t2d.sum()) == 12
    assert torch.equal(draft.draft_to_target(torch.arange(12)), ids)


def test_coverage_table():
    counts = np.array([10, 0, 30, 60])
    table = coverage_table(counts, (1, 2, 8, 4))
    assert table == [{"size": 1, "coverage": 0.6}, {"size": 2, "coverage": 0.9}, {"size": 4, "coverage": 1.0}]


def test_build_vocab_from_prepared_dir(tmp_path):
    data = tmp_path / "ds"
    data.mkdir()
    rows = [{"input_ids": [1, 2, 3, 3, 9], "loss_mask": [0, 0, 1, 1, 1], "id": "a", "source": "s"},
            {"input_ids": [2, 2, 3, 4], "loss_mask": [1, 1, 0, 1], "id": "b", "source": "s"}]
    write_examples(str(data / "data.arrow"), rows, batch_rows=1)
    write_json(str(data / "stats.json"), {"target_vocab_size": 16})
    report = build_vocab(str(data), 3)
    assert report["assistant_tokens"] == 6 and report["distinct_assistant_tokens"] == 4
    v = load_vocab(str(data))
    assert v["draft_to_target"].tolist() == [2, 3, 4]   # counts: 2->2, 3->2, 4->1, 9->1 (tie -> lower id)
    assert v["t2d"].shape == (16,) and v["d2t"].tolist() == [2, 2, 2]
    assert v["token_counts"][[2, 3, 4, 9]].tolist() == [2, 2, 1, 1]
    assert report["coverage"] == pytest.approx(5 / 6)
    assert json.load(open(data / "draft_vocab.json"))["file"] == os.path.join(str(data), "draft_vocab.safetensors")
    assert [r["size"] for r in report["coverage_table"]] == [3]   # only sizes <= vocab
    with pytest.raises(FileNotFoundError, match="build it with"):
        load_vocab(str(tmp_path))


def test_cli_build_vocab(tmp_path, capsys):
    from sglang_eagle3.cli import main
    data = tmp_path / "ds"
    data.mkdir()
    write_examples(str(data / "data.arrow"), [{"input_ids": list(range(40)), "loss_mask": [1] * 40,
                                               "id": "a", "source": "s"}])
    write_json(str(data / "stats.json"), {"target_vocab_size": 64})
    assert main(["build-vocab", str(data), "--draft-vocab-size", "8", "--out", str(tmp_path / "v")]) == 0
    assert "draft vocab 8 of 64 target ids covers 20.00% of 40 assistant tokens" in capsys.readouterr().out
    assert load_vocab(str(tmp_path / "v"))["draft_to_target"].tolist() == list(range(8))
    assert main(["build-vocab", str(data), "--draft-vocab-size", "100"]) == 2
    assert "--draft-vocab-size 100 exceeds the target vocabulary of 64" in capsys.readouterr().err


def test_build_vocab_refuses_to_replace_a_vocabulary_without_force(tmp_path, capsys):
    """build-vocab follows the rule of every command: an existing output is refused, or replaced with --force."""
    from sglang_eagle3.cli import main
    data = tmp_path / "ds"
    data.mkdir()
    write_examples(str(data / "data.arrow"), [{"input_ids": list(range(40)), "loss_mask": [1] * 40,
                                               "id": "a", "source": "s"}])
    write_json(str(data / "stats.json"), {"target_vocab_size": 64})
    out = tmp_path / "v"
    assert main(["build-vocab", str(data), "--draft-vocab-size", "8", "--out", str(out)]) == 0
    first = (out / "draft_vocab.safetensors").read_bytes()
    capsys.readouterr()
    assert main(["build-vocab", str(data), "--draft-vocab-size", "16", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{out} already holds a draft vocabulary" in err and "--force" in err
    assert (out / "draft_vocab.safetensors").read_bytes() == first
    assert main(["build-vocab", str(data), "--draft-vocab-size", "16", "--out", str(out), "--force"]) == 0
    assert load_vocab(str(out))["draft_to_target"].numel() == 16
    for argv, said in ((["build-vocab", str(tmp_path / "nope"), "--draft-vocab-size", "8"], "not a prepare-data folder"),
                       (["build-vocab", str(data), "--draft-vocab-size", "0", "--out", str(tmp_path / "w")],
                        "--draft-vocab-size must be >= 1, got 0"),
                       (["build-vocab", str(data), "--draft-vocab-size", "8", "--out", str(data / "stats.json")],
                        "is a file, not a folder")):
        assert main(argv) == 2, argv
        assert said in capsys.readouterr().err
