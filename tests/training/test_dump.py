"""Hidden-state dumps: content, manifest, resume after a kill, rank partitioning, verification on load."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from sglang_eagle3.training import hidden_dump as hd
from sglang_eagle3.training.dump_reader import DumpError, HiddenStateDump
from sglang_eagle3.training.hidden_dump import dump_hidden_states

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB, HIDDEN, LAYERS = 64, 32, 8


def make_tiny_target(path, seed=0, head_std=None):
    """A random 8-layer Llama (hidden 32, vocab 64) with a word-level tokenizer, saved as an HF folder.
    head_std: re-draw lm_head with this std so the target's next-token distributions are peaked."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    if head_std is not None:
        torch.nn.init.normal_(model.lm_head.weight, 0, head_std)
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w1").save_pretrained(path)
    return str(path)


def load_target(path, aux=None):
    from sglang_eagle3.models.target import TargetModel
    return TargetModel.from_pretrained(path, dtype=torch.float32, aux_layer_ids=aux)


def make_rows(n=7, seed=0, lo=3, hi=20):
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        L = int(rng.integers(lo, hi))
        mask = (np.arange(L) >= L // 3).astype(np.uint8)
        rows.append((rng.integers(0, VOCAB, L).astype(np.int64), mask))
    return rows


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for ids, mask in rows:
            f.write(json.dumps({"input_ids": ids.tolist(), "loss_mask": mask.tolist()}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_target(tmp_path_factory.mktemp("target") / "tiny")
    return path, load_target(path)


def test_dump_matches_target_features(tiny, tmp_path):
    path, target = tiny
    rows = make_rows()
    man = dump_hidden_states(target, rows, str(tmp_path / "d"), rows_per_shard=3, batch_tokens=40,
                             dtype=torch.float32, progress=False, log=lambda *_: None)
    assert man is not None and man["rows"] == 7 and len(man["shards"]) == 3
    assert man["tokens"] == sum(len(r[0]) for r in rows)
    assert man["aux_layer_ids"] == target.aux_layer_ids == [1, 3, 4] and man["dtype"] == "float32"
    assert man["last_hidden"] == "after_final_norm"
    for s in man["shards"]:
        assert s["sha256"] == hd.file_sha256(str(tmp_path / "d" / s["file"]))
    dump = HiddenStateDump(str(tmp_path / "d"))
    assert len(dump) == 7
    for i, (ids, mask) in enumerate(rows):
        aux, last = target.features(torch.from_numpy(ids)[None], torch.ones(1, len(ids), dtype=torch.long))
        r = dump[i]
        assert r["input_ids"].tolist() == ids.tolist() and r["loss_mask"].tolist() == mask.tolist()
        # batched with right padding vs alone: same numbers up to fp32 reduction order
        torch.testing.assert_close(r["aux_hidden_states"], aux[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["last_hidden"], last[0], rtol=1e-5, atol=1e-5)
        # last_hidden is post-norm: the target's own logits come back from lm_head
        logits = target.lm_head(r["last_hidden"])
        hf_logits = target.forward(target.new_cache(1, len(ids)), torch.from_numpy(ids)[None],
                                   torch.arange(len(ids))[None]).logits[0]
        torch.testing.assert_close(logits, hf_logits, rtol=1e-4, atol=1e-4)


def test_resume_after_kill_redoes_only_missing_shards(tiny, tmp_path, monkeypatch):
    path, target = tiny
    rows = make_rows(9, seed=1)
    ref = dump_hidden_states(target, rows, str(tmp_path / "ref"), rows_per_shard=2, dtype=torch.float32,
                             progress=False, log=lambda *_: None)
    out = str(tmp_path / "d")
    real_write, calls = hd.write_shard, []

    def killed_on_third(out_dir, i, tensors, rr):
        calls.append(i)
        if len(calls) == 3:            # die half-way through writing shard 2: a stale tmp file stays behind
            open(os.path.join(out_dir, hd.shard_name(i) + ".tmp-999"), "wb").write(b"partial")
            raise KeyboardInterrupt
        return real_write(out_dir, i, tensors, rr)

    monkeypatch.setattr(hd, "write_shard", killed_on_third)
    with pytest.raises(KeyboardInterrupt):
        dump_hidden_states(target, rows, out, rows_per_shard=2, dtype=torch.float32, progress=False, log=lambda *_: None)
    assert not os.path.exists(os.path.join(out, hd.MANIFEST))
    with pytest.raises(DumpError, match="unfinished"):
        HiddenStateDump(out)
    calls.clear()
    monkeypatch.setattr(hd, "write_shard", lambda *a: (calls.append(a[1]), real_write(*a))[1])
    man = dump_hidden_states(target, rows, out, rows_per_shard=2, dtype=torch.float32, progress=False,
                             log=lambda *_: None)
    assert calls == [2, 3, 4]                                  # shards 0, 1 were kept, none twice
    assert not [f for f in os.listdir(out) if ".tmp-" in f]
    assert [s["sha256"] for s in man["shards"]] == [s["sha256"] for s in ref["shards"]]
    d = HiddenStateDump(out)
    assert [d[i]["input_ids"].tolist() for i in range(len(d))] == [r[0].tolist() for r in rows]


def test_resume_with_other_settings_is_refused(tiny, tmp_path):
    _, target = tiny
    rows = make_rows(4)
    out = str(tmp_path / "d")
    dump_hidden_states(target, rows, out, rows_per_shard=2, progress=False, log=lambda *_: None)
    with pytest.raises(DumpError, match="rows_per_shard"):
        dump_hidden_states(target, rows, out, rows_per_shard=3, progress=False, log=lambda *_: None)
    with pytest.raises(DumpError, match="rows_sha256"):
        dump_hidden_states(target, make_rows(4, seed=5), out, rows_per_shard=2, progress=False, log=lambda *_: None)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_rank_partition_covers_each_shard_once(world):
    owned = sorted(i for r in range(world) for i in hd.shards_of_rank(11, r, world))
    assert owned == list(range(11))
    with pytest.raises(DumpError, match="--rank"):
        hd.shards_of_rank(11, world, world)


def test_two_ranks_via_cli_then_verification_errors(tiny, tmp_path, capsys):
    path, _ = tiny
    rows = make_rows(6, seed=2)
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    out = str(tmp_path / "d")
    script = os.path.join(ROOT, "train", "dump_hidden_states.py")
    env = dict(os.environ, PYTHONPATH=ROOT)
    base = [sys.executable, script, "--target", path, "--data", data, "--out", out, "--rows-per-shard", "2",
            "--aux-layer-ids", "0,2,3", "--world-size", "2", "--quiet"]
    r1 = subprocess.run(base + ["--rank", "1"], capture_output=True, text=True, env=env)
    assert r1.returncode == 0, r1.stderr
    assert " KB in 3 shards" in r1.stdout and "waiting for other ranks" in r1.stdout   # disk estimate printed
    assert sorted(f for f in os.listdir(out) if f.endswith(".safetensors")) == ["shard_00001.safetensors"]
    r0 = subprocess.run(base + ["--rank", "0"], capture_output=True, text=True, env=env)
    assert r0.returncode == 0, r0.stderr
    assert "complete: 6 rows" in r0.stdout
    d = HiddenStateDump(out)
    assert d.aux_layer_ids == [0, 2, 3] and len(d) == 6
    assert d[5]["aux_hidden_states"].shape == (len(rows[5][0]), 3 * HIDDEN)
    assert d[5]["aux_hidden_states"].dtype == torch.bfloat16

    shard = os.path.join(out, "shard_00001.safetensors")
    blob = bytearray(open(shard, "rb").read())
    blob[-3] ^= 0xFF
    open(shard, "wb").write(bytes(blob))
    with pytest.raises(DumpError, match="shard_00001.safetensors: sha256"):
        HiddenStateDump(out)
    HiddenStateDump(out, verify="size")                          # same size: only sha256 notices
    open(shard, "ab").write(b"x")
    with pytest.raises(DumpError, match="shard_00001.safetensors: .* bytes"):
        HiddenStateDump(out, verify="size")
    os.remove(shard)
    with pytest.raises(DumpError, match="shard_00001.safetensors: shard listed .* missing"):
        HiddenStateDump(out, verify="none")

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1]}\n{"input_ids": [1, 2], "loss_mask": [1]}\n')
    from sglang_eagle3.cli import main
    assert main(["dump-hidden-states", "--target", path, "--data", str(bad), "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl: line 2" in err and "Traceback" not in err


def test_prepared_dataset_dir_is_read(tmp_path):
    from sglang_eagle3.training.data.build import write_examples
    rows = make_rows(3)
    d = tmp_path / "prep"
    d.mkdir()
    write_examples(str(d / "data.arrow"), ({"input_ids": ids.tolist(), "loss_mask": m.tolist(), "id": str(i),
                                            "source": "x"} for i, (ids, m) in enumerate(rows)))
    got = hd.load_token_rows(str(d))
    assert [g[0].tolist() for g in got] == [r[0].tolist() for r in rows]
    assert [g[1].tolist() for g in got] == [r[1].tolist() for r in rows]


def test_reuse_copies_known_rows_and_computes_only_new_ones(tiny, tmp_path, monkeypatch):
    _, target = tiny
    old_rows, new_rows = make_rows(6, seed=2), make_rows(3, seed=3)
    quiet = dict(dtype=torch.float32, progress=False, log=lambda *_: None)
    dump_hidden_states(target, old_rows, str(tmp_path / "old"), rows_per_shard=4, **quiet)
    grown = [old_rows[4], new_rows[0], old_rows[1], new_rows[1], old_rows[0], new_rows[2]]   # another order
    fresh = dump_hidden_states(target, grown, str(tmp_path / "fresh"), rows_per_shard=2, **quiet)
    seen = []
    real = target.features
    monkeypatch.setattr(target, "features", lambda ids, am: (seen.append(int(am.sum())), real(ids, am))[1])
    man = dump_hidden_states(target, grown, str(tmp_path / "grown"), rows_per_shard=2,
                             reuse=[str(tmp_path / "old")], **quiet)
    assert sum(seen) == sum(len(r[0]) for r in new_rows)          # the target ran over the new rows only
    assert man["rows_sha256"] == fresh["rows_sha256"] and man["tokens"] == fresh["tokens"]
    got, want, old = HiddenStateDump(str(tmp_path / "grown")), HiddenStateDump(str(tmp_path / "fresh")), \
        HiddenStateDump(str(tmp_path / "old"))
    for i in range(len(grown)):
        for k in ("input_ids", "loss_mask"):
            assert torch.equal(got[i][k], want[i][k])
        for k in ("aux_hidden_states", "last_hidden"):
            torch.testing.assert_close(got[i][k], want[i][k], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[0]["aux_hidden_states"], old[4]["aux_hidden_states"])     # copied bit for bit


def test_reuse_with_other_settings_or_itself_is_refused(tiny, tmp_path):
    _, target = tiny
    rows = make_rows(3)
    quiet = dict(progress=False, log=lambda *_: None)
    dump_hidden_states(target, rows, str(tmp_path / "bf16"), rows_per_shard=2, dtype=torch.bfloat16, **quiet)
    with pytest.raises(DumpError, match=r"--reuse .*bf16: made with other settings \(dtype"):
        dump_hidden_states(target, rows, str(tmp_path / "fp32"), rows_per_shard=2, dtype=torch.float32,
                           reuse=[str(tmp_path / "bf16")], **quiet)
    with pytest.raises(DumpError, match="--out .*bf16 is the same path as --reuse .*bf16"):
        dump_hidden_states(target, rows, str(tmp_path / "bf16"), rows_per_shard=2, dtype=torch.bfloat16,
                           reuse=[str(tmp_path / "bf16")], overwrite=True, **quiet)
    assert os.path.isfile(tmp_path / "bf16" / hd.MANIFEST)             # nothing was deleted


def test_dump_from_before_target_dtype_was_recorded_resumes_and_is_reused(tiny, tmp_path):
    _, target = tiny
    rows = make_rows(4, seed=4)
    quiet = dict(dtype=torch.float32, progress=False, log=lambda *_: None)
    old = str(tmp_path / "old")
    dump_hidden_states(target, rows, old, rows_per_shard=2, **quiet)
    for name in (hd.CONFIG, hd.MANIFEST):                        # as an older version wrote them
        path = os.path.join(old, name)
        d = json.load(open(path))
        del d["target_dtype"]
        json.dump(d, open(path, "w"))
    assert dump_hidden_states(target, rows, old, rows_per_shard=2, **quiet) is not None     # resumes (finished)
    man = dump_hidden_states(target, rows[:3], str(tmp_path / "new"), rows_per_shard=2, reuse=[old], **quiet)
    assert man["target_dtype"] == "float32" and man["rows"] == 3


def test_reuse_of_an_unfinished_or_missing_dump_names_the_flag(tiny, tmp_path):
    _, target = tiny
    with pytest.raises(DumpError, match=r"--reuse .*nope: not a finished dump \(.*no manifest.json\)"):
        dump_hidden_states(target, make_rows(2), str(tmp_path / "d"), rows_per_shard=2, progress=False,
                           reuse=[str(tmp_path / "nope")], log=lambda *_: None)


def test_cli_checks_its_flags_before_the_target_loads(tiny, tmp_path, capsys, monkeypatch):
    from sglang_eagle3.cli import main
    from sglang_eagle3.models.target import TargetModel
    path, _ = tiny
    data = write_jsonl(tmp_path / "rows.jsonl", make_rows(4, seed=5))
    monkeypatch.setattr(TargetModel, "from_pretrained", lambda *a, **k: pytest.fail("the target loaded first"))
    out = tmp_path / "d"
    base = ["dump-hidden-states", "--target", path, "--data", data, "--out", str(out), "--quiet"]
    for extra, said in ((["--rows-per-shard", "0"], "--rows-per-shard must be >= 1, got 0"),
                        (["--batch-tokens", "-5"], "--batch-tokens must be >= 1, got -5"),
                        (["--max-rows", "0"], "--max-rows must be >= 1, got 0"),
                        (["--world-size", "0"], "--world-size must be >= 1, got 0"),
                        (["--world-size", "2", "--rank", "2"], "--rank 2 must be in [0, --world-size 2)"),
                        (["--aux-layer-ids", "1,2,99"], f"--aux-layer-ids [1, 2, 99]: ids [99] are not layers of the "
                                                        f"target's {LAYERS}"),
                        (["--aux-layer-ids", "3,1,2"], "must be strictly increasing"),
                        (["--aux-layer-ids", "1,x"], "--aux-layer-ids must be comma-separated integers"),
                        (["--device", "cuda:7"], "--device cuda:7: "),
                        (["--reuse", str(tmp_path / "nope")], "nope: not a finished dump (no manifest.json)")):
        assert main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, (extra, err)
    assert not out.exists()


def test_dump_never_replaces_its_own_input(tiny, tmp_path, capsys, monkeypatch):
    """--out that contains the --data being dumped is refused before the target loads: --overwrite used to delete
    the folder, the data set and a user's notes with it."""
    from sglang_eagle3.cli import main
    from sglang_eagle3.models.target import TargetModel
    from sglang_eagle3.training.data.build import write_examples
    path, _ = tiny
    box = tmp_path / "D"
    (box / "data").mkdir(parents=True)
    write_examples(str(box / "data" / "data.arrow"), ({"input_ids": ids.tolist(), "loss_mask": m.tolist(),
                                                       "id": str(i), "source": "x"}
                                                      for i, (ids, m) in enumerate(make_rows(3))))
    (box / "NOTES.txt").write_text("notes")
    monkeypatch.setattr(TargetModel, "from_pretrained", lambda *a, **k: pytest.fail("the target loaded first"))
    assert main(["dump-hidden-states", "--target", path, "--data", str(box / "data"), "--out", str(box),
                 "--overwrite", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out {box} contains --data {box / 'data'}: an output must not" in err, err
    assert sorted(os.listdir(box)) == ["NOTES.txt", "data"] and os.listdir(box / "data") == ["data.arrow"]


def test_overwrite_removes_the_dump_only(tiny, tmp_path, capsys):
    """--overwrite deletes the dump's own files (config, manifest, shards), keeps a user's files and names them;
    shards get the usual permissions (safetensors' save_file made them 0600)."""
    _, target = tiny
    out = tmp_path / "d"
    quiet = dict(rows_per_shard=2, dtype=torch.float32, progress=False, log=lambda *_: None)
    old = os.umask(0o022)
    try:
        dump_hidden_states(target, make_rows(5), str(out), **quiet)
        (out / "NOTES.txt").write_text("notes")
        man = dump_hidden_states(target, make_rows(3, seed=1), str(out), overwrite=True, **quiet)
    finally:
        os.umask(old)
    assert man["rows"] == 3 and (out / "NOTES.txt").read_text() == "notes"
    assert sorted(os.listdir(out)) == ["NOTES.txt", hd.CONFIG, hd.MANIFEST, *sorted(
        f"shard_{i:05d}.{ext}" for i in range(2) for ext in ("json", "safetensors"))]
    assert "kept NOTES.txt" in capsys.readouterr().err
    assert {os.stat(out / f).st_mode & 0o777 for f in os.listdir(out) if f.startswith("shard_")} == {0o644}
