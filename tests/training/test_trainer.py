"""Trainer: 2-rank DeepSpeed ZeRO-2 on CPU (gloo) end to end, kill -9 and resume, ZeRO-3, plain PyTorch online."""
import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from conftest import edit_tensors
from test_dump import load_target, make_rows, make_tiny_target, write_jsonl

from sglang_eagle3.errors import UserError
from sglang_eagle3.models.config import ConfigError
from sglang_eagle3.models.draft import Eagle3DraftModel
from sglang_eagle3.training.hidden_dump import dump_hidden_states
from sglang_eagle3.training.trainer import backend as B
from sglang_eagle3.training.trainer.data import StepSampler, collate, eval_rows_of_rank, pack, split_indices
from sglang_eagle3.training.trainer.logs import read_metrics
from sglang_eagle3.training.trainer.loop import Trainer
from sglang_eagle3.training.trainer.run_config import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "train", "train_eagle3.py")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
STEPS, K = 40, 3
needs_deepspeed = pytest.mark.skipif(not B.deepspeed_available(), reason="deepspeed is not installed")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = make_tiny_target(root / "target", head_std=2.0)
    rows = make_rows(80, seed=3, lo=8, hi=40)
    data = write_jsonl(root / "rows.jsonl", rows)
    dump = str(root / "dump")
    dump_hidden_states(load_target(target), rows, dump, rows_per_shard=32, dtype=torch.float32, progress=False,
                       log=lambda *_: None)
    return root, target, data, dump


def train_args(setup, out, *extra):
    _, target, _, dump = setup
    return ["--target", target, "--data", dump, "--out", str(out), "--max-steps", str(STEPS), "--lr", "3e-3",
            "--micro-batch-size", "2", "--eval-rows", "8", "--eval-every", "10", "--save-every", "4",
            "--log-every", "1", "--draft-vocab-size", "48", "--ttt-length", str(K), "--quiet", *extra]


def env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONWARNINGS="ignore")


def torchrun(args, timeout=240):
    r = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node", "2", SCRIPT, *args], capture_output=True,
                       text=True, env=env(), timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(args):
    """Two rank processes with torchrun's environment, so the test holds every pid it must kill."""
    port = str(free_port())
    procs = []
    for r in range(2):
        e = dict(env(), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, SCRIPT, *args], env=e, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
    return procs


def comparable(records):
    """Everything but timing."""
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in records]


@pytest.fixture(scope="module")
def reference(setup):
    out = setup[0] / "ref"
    torchrun(train_args(setup, out, "--deepspeed-config", os.path.join(ROOT, "train", "ds_zero2.json")))
    return out


@needs_deepspeed
def test_zero2_two_ranks_stay_in_sync_and_learn(setup, reference):
    s = json.load(open(reference / "train_summary.json"))
    auto = str(B.compute_dtype("auto", torch.device("cpu"))).replace("torch.", "")   # bf16 where the CPU has it
    assert (s["backend"], s["zero_stage"], s["world_size"], s["dtype"]) == ("deepspeed", 2, 2, auto)
    assert s["param_checksums"][0] == s["param_checksums"][1]          # replicas identical after 40 steps
    recs = read_metrics(str(reference / "metrics.jsonl"))
    train = [r["loss"] for r in recs if r["split"] == "train"]
    assert len(train) == STEPS
    assert np.mean(train[-8:]) < 0.93 * np.mean(train[:8]), train     # loss falls
    ev = [r for r in recs if r["split"] == "eval"]
    assert [r["step"] for r in ev] == [10, 20, 30, 40] and ev[-1]["loss"] < ev[0]["loss"]
    assert ev[-1]["rows"] == 8 and 1.0 <= ev[-1]["accept_length"] <= 1.0 + K
    assert all(0 <= ev[-1][f"acc_{k}"] <= 1 for k in range(K))
    lrs = [r["lr"] for r in recs if r["split"] == "train"]
    assert max(lrs) <= 3e-3 and lrs[-1] == pytest.approx(0.0, abs=1e-12)   # warm-up + cosine to 0
    assert s["tokens_per_s"] > 0

    # export: SGLang layout in bf16, vocab mapping inside, loads and fits the target
    from safetensors.torch import load_file
    from transformers import AutoConfig
    w = load_file(str(reference / "draft" / "model.safetensors"))
    assert w["fc.weight"].dtype == torch.bfloat16 and w["fc.weight"].shape == (32, 96)
    assert w["lm_head.weight"].shape == (48, 32)
    draft = Eagle3DraftModel.from_pretrained(str(reference / "draft"), dtype=torch.float32)
    draft.check_target(AutoConfig.from_pretrained(setup[1]), [1, 3, 4])
    vocab = load_file(str(reference / "draft_vocab.safetensors"))
    assert torch.equal(draft.d2t, vocab["d2t"]) and torch.equal(draft.t2d, vocab["t2d"])

    assert open(reference / "training_curves.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(reference / "tensorboard"))
    ck = sorted(os.listdir(reference / "checkpoints"))
    assert ck == ["latest", "step_0000036", "step_0000040"]            # keep 2, no temporary dirs left


@needs_deepspeed
def test_kill_9_and_resume_reproduces_the_run(setup, reference):
    out = setup[0] / "killed"
    args = train_args(setup, out, "--deepspeed-config", os.path.join(ROOT, "train", "ds_zero2.json"),
                      "--no-tensorboard")
    procs = spawn_ranks(args)
    latest = out / "checkpoints" / "latest"
    deadline = time.time() + 180
    while not latest.exists() and time.time() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.01)
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait()
    assert latest.exists(), "the run died before its first checkpoint"
    assert not (out / "train_summary.json").exists(), "the run finished before it could be killed"

    torchrun(args + ["--resume"])
    s = json.load(open(out / "train_summary.json"))
    assert 0 < s["resumed_from"] < STEPS
    ref = comparable(read_metrics(str(reference / "metrics.jsonl")))
    got = comparable(read_metrics(str(out / "metrics.jsonl")))
    assert got == ref                                   # every loss, lr, grad norm and eval metric, bit for bit
    from safetensors.torch import load_file
    a, b = load_file(str(reference / "draft" / "model.safetensors")), load_file(str(out / "draft" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@needs_deepspeed
def test_zero3_two_ranks(setup):
    out = setup[0] / "zero3"
    args = train_args(setup, out, "--deepspeed-config", os.path.join(ROOT, "train", "ds_zero3.json"),
                      "--no-tensorboard")
    args[args.index("--max-steps") + 1] = "6"
    torchrun(args)
    s = json.load(open(out / "train_summary.json"))
    assert s["zero_stage"] == 3 and s["param_checksums"][0] == s["param_checksums"][1]
    Eagle3DraftModel.from_pretrained(str(out / "draft"))


def test_plain_pytorch_online_top_features(setup, tmp_path):
    """One process, no DeepSpeed, target features computed on the fly, the 'top'-feature ablation + feature loss."""
    _, target, data, _ = setup
    cfg = TrainConfig(target=target, data=data, out=str(tmp_path / "run"), eval_rows=4, max_steps=4, lr=1e-3,
                      ttt_length=2, features="top", feature_loss_weight=0.1, backend="ddp", eval_every=2,
                      save_every=2, log_every=1, progress=False, tensorboard=False)
    summary = Trainer(cfg).run()
    assert summary["backend"] == "ddp" and summary["final_eval"]["rows"] == 4
    draft = Eagle3DraftModel.from_pretrained(summary["export"])
    assert draft.config.aux_layer_ids == [7] and draft.fc.weight.shape == (32, 32)    # fc reads H_t, not 3 H_t
    assert draft.config.draft_vocab_size == 64
    # same settings resume cleanly (nothing left to do); a different batch size is refused
    assert Trainer(TrainConfig(**{**cfg.__dict__, "resume": True})).run()["resumed_from"] == 4
    with pytest.raises(ConfigError, match=re.escape("rows per step (ranks x --micro-batch-size x --grad-accum): "
                                                    "checkpoint 1, given 2")):
        Trainer(TrainConfig(**{**cfg.__dict__, "resume": True, "micro_batch_size": 2})).run()


def test_online_batches_equal_the_dumped_features(setup, tmp_path):
    """Online on CPU runs the target on each row alone (no padded forward): a packed batch of rows of different
    lengths, some cut at max_length, holds the same features as the dump made from the same target."""
    _, target, data, dump = setup
    common = dict(target=target, eval_rows=4, max_steps=1, micro_batch_size=3, pack_rows=True, max_length=24,
                  backend="ddp", dtype="float32", progress=False, tensorboard=False, draft_vocab_size=48)
    online = Trainer(TrainConfig(data=data, out=str(tmp_path / "on"), **common))
    offline = Trainer(TrainConfig(data=dump, out=str(tmp_path / "off"), **common))
    assert (online.mode, offline.mode) == ("online", "offline")
    rows = [i for i in range(80) if i not in online.eval_idx][:3]
    shapes, features = [], online.target.features
    online.target.features = lambda ids, *mask: shapes.append(tuple(ids.shape)) or features(ids, *mask)
    a, b = online.make_batch(online.data, rows), offline.make_batch(offline.data, rows)
    assert shapes == [(1, n) for n in a["row_lengths"].tolist()]                         # one forward per row
    assert a.keys() == b.keys() and a["row_lengths"].tolist() == b["row_lengths"].tolist()
    assert a["row_lengths"].max() == 24 and a["row_lengths"].min() < 24                  # cut and uncut rows
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), rtol=1e-5, atol=1e-5, msg=k)


def test_step_sampler_is_a_deterministic_partition():
    idx = np.arange(3, 50)
    per_rank = [StepSampler(idx, 2, r, micro_batch_size=3, grad_accum=2, seed=7) for r in range(2)]
    spe = per_rank[0].steps_per_epoch
    assert spe == len(idx) // 12
    for epoch in range(2):
        seen = [i for s in range(epoch * spe, (epoch + 1) * spe) for smp in per_rank
                for mb in smp.micro_batches(s) for i in mb]
        assert len(seen) == len(set(seen)) == spe * 12 and set(seen) <= set(idx.tolist())
    fresh = StepSampler(idx, 2, 1, micro_batch_size=3, grad_accum=2, seed=7)
    assert fresh.micro_batches(spe + 1) == per_rank[1].micro_batches(spe + 1)     # no hidden state
    assert per_rank[0].micro_batches(0) != per_rank[0].micro_batches(spe)          # reshuffled per epoch
    with pytest.raises(ValueError, match="fewer than one optimizer step"):
        StepSampler(np.arange(5), 2, 0, 3, 1, 0)
    # a run continuing another on the same data reads the rows the first one did not reach, then the next epochs
    later = StepSampler(idx, 2, 1, micro_batch_size=3, grad_accum=2, seed=7, start_step=2)
    assert [later.micro_batches(s) for s in range(spe + 1)] == [fresh.micro_batches(s) for s in range(2, spe + 3)]
    assert later.epoch_of(spe - 2) == 1
    with pytest.raises(ValueError, match="--data-start-step -1"):
        StepSampler(idx, 2, 0, 3, 1, 0, start_step=-1)


def test_split_eval_plan_schedule_and_collate():
    tr, ev = split_indices(20, 6, seed=1)
    assert len(ev) == 6 and sorted(set(tr) | set(ev)) == list(range(20)) and not set(tr) & set(ev)
    plans = [eval_rows_of_rank(np.arange(5), 2, r) for r in range(2)]
    assert len(plans[0]) == len(plans[1]) == 3                       # equal forwards per rank (ZeRO-3)
    assert sorted(i for p in plans for i, counted in p if counted) == list(range(5))
    f = B.warmup_cosine(100, 10)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0) and f(10) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.5) and f(100) == pytest.approx(0.0, abs=1e-12)
    b = collate([{"input_ids": torch.tensor([1, 2, 3]), "loss_mask": torch.tensor([0, 1, 1]),
                  "last_hidden": torch.ones(3, 4)},
                 {"input_ids": torch.tensor([4]), "loss_mask": torch.tensor([1]), "last_hidden": torch.ones(1, 4)}],
                max_length=2)
    assert b["input_ids"].tolist() == [[1, 2], [4, 0]] and b["attention_mask"].tolist() == [[1, 1], [1, 0]]
    assert b["last_hidden"].shape == (2, 2, 4) and b["last_hidden"][1, 1].abs().sum() == 0


def test_deepspeed_config_files(tmp_path):
    for z in (1, 2, 3):
        cfg = B.load_ds_config(os.path.join(ROOT, "train", f"ds_zero{z}.json"), None, 4, 8, 0.5, True)
        assert cfg["zero_optimization"]["stage"] == z and cfg["train_micro_batch_size_per_gpu"] == 4
        assert cfg["gradient_accumulation_steps"] == 8 and cfg["gradient_clipping"] == 0.5 and cfg["bf16"]["enabled"]
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 2}}))
    with pytest.raises(ValueError, match="remove the 'optimizer' section"):
        B.load_ds_config(str(bad), None, 1, 1, 0.5, False)


def small_cfg(setup, out, **kw):
    _, target, _, dump = setup
    base = dict(target=target, data=dump, out=str(out), eval_rows=4, max_steps=4, lr=1e-3, ttt_length=2,
                backend="ddp", eval_every=2, save_every=1, log_every=1, progress=False, tensorboard=False,
                draft_vocab_size=48)
    base.update(kw)
    return TrainConfig(**base)


def test_rerun_into_a_run_folder_is_refused_or_overwritten(setup, tmp_path):
    out = tmp_path / "run"
    Trainer(small_cfg(setup, out, keep_checkpoints=2)).run()
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step_0000003", "step_0000004"]
    metrics = (out / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"already holds checkpoints.*step_0000004.*--resume.*--overwrite"):
        Trainer(small_cfg(setup, out))
    assert (out / "metrics.jsonl").read_text() == metrics                  # nothing touched
    with pytest.raises(ConfigError, match="exclude each other"):
        Trainer(small_cfg(setup, out, resume=True, overwrite=True))
    # a finished run cannot be stretched to more steps: one clear message pointing at --init-from
    with pytest.raises(ConfigError, match=r"finished its planned 4 steps.*--init-from"):
        Trainer(small_cfg(setup, out, resume=True, max_steps=8)).run()
    # --overwrite starts again; pruning keeps this run's newest checkpoints even among old higher-numbered ones
    (out / "checkpoints" / "step_0000009").mkdir()
    with pytest.raises(ConfigError):
        Trainer(small_cfg(setup, out, max_steps=2))
    summary = Trainer(small_cfg(setup, out, max_steps=2, overwrite=True)).run()
    assert summary["resumed_from"] == 0
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step_0000001", "step_0000002"]
    assert Trainer(small_cfg(setup, out, max_steps=2, resume=True)).run()["resumed_from"] == 2


def test_cli_train_error_is_one_line(setup, tmp_path, capsys):
    from sglang_eagle3.cli import main
    _, target, _, dump = setup
    out = tmp_path / "run"
    args = ["train", "--target", target, "--data", dump, "--out", str(out), "--max-steps", "2", "--eval-rows", "2",
            "--ttt-length", "2", "--backend", "ddp", "--quiet", "--no-tensorboard", "--draft-vocab-size", "48"]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds checkpoints" in err[0]


def test_packed_rows_train_like_gradient_accumulation(setup, tmp_path):
    """--micro-batch-size 3 --pack-rows: the same steps as --grad-accum 3 (same rows, per-row loss), so the two
    runs end with the same weights, and a run may resume across the switch; padded micro-batches may not."""
    kw = dict(dtype="float32", save_every=2, max_steps=4)
    accum = Trainer(small_cfg(setup, tmp_path / "accum", grad_accum=3, **kw)).run()
    packed = Trainer(small_cfg(setup, tmp_path / "packed", micro_batch_size=3, pack_rows=True, **kw)).run()
    assert packed["param_checksums"][0] == pytest.approx(accum["param_checksums"][0], rel=1e-6)
    for key in ("loss", "acc_0", "accept_length"):
        assert packed["final_eval"][key] == pytest.approx(accum["final_eval"][key], rel=1e-5)
    assert packed["train_tokens"] == accum["train_tokens"]
    (tmp_path / "accum" / "checkpoints" / "latest").write_text("step_0000002\n")      # back to step 2
    switched = Trainer(small_cfg(setup, tmp_path / "accum", micro_batch_size=3, pack_rows=True, resume=True,
                                 **kw)).run()
    assert switched["resumed_from"] == 2
    assert switched["param_checksums"][0] == pytest.approx(accum["param_checksums"][0], rel=1e-6)
    with pytest.raises(ConfigError, match=re.escape("per-row loss (--micro-batch-size 1 or --pack-rows): checkpoint "
                                                    "True, given False")):
        Trainer(small_cfg(setup, tmp_path / "accum", micro_batch_size=3, resume=True, **kw)).run()


def test_pack_puts_rows_end_to_end():
    batch = collate([{"input_ids": torch.tensor([1, 2, 3]), "loss_mask": torch.tensor([0, 1, 1]),
                      "last_hidden": torch.arange(6.).view(3, 2)},
                     {"input_ids": torch.tensor([4, 5]), "loss_mask": torch.tensor([1, 0]),
                      "last_hidden": -torch.ones(2, 2)}])
    p = pack(batch)
    assert p["input_ids"].tolist() == [[1, 2, 3, 4, 5]] and p["loss_mask"].tolist() == [[0, 1, 1, 1, 0]]
    assert p["attention_mask"].tolist() == [[1] * 5] and p["row_lengths"].tolist() == [3, 2]
    assert p["last_hidden"].shape == (1, 5, 2) and p["last_hidden"][0, 3:].eq(-1).all()


def test_eval_rows_zero_trains_without_eval(setup, tmp_path):
    summary = Trainer(small_cfg(setup, tmp_path / "run", eval_rows=0, save_every=0)).run()
    assert summary["final_eval"] is None and summary["steps"] == 4
    assert eval_rows_of_rank(np.arange(0), 2, 1) == []


def test_init_from_continues_a_draft(setup, tmp_path):
    first = Trainer(small_cfg(setup, tmp_path / "a", save_every=0)).run()
    src = Eagle3DraftModel.from_pretrained(first["export"], dtype=torch.float32)
    cfg = small_cfg(setup, tmp_path / "b", init_from=first["export"], draft_vocab_size=None, max_steps=1, lr=1e-12,
                    save_every=0)
    t = Trainer(cfg)
    got = t.module.draft.state_dict()
    assert all(torch.equal(got[k].float(), v.float()) for k, v in src.state_dict().items())   # same weights + vocab
    summary = t.run()
    evals = [json.loads(l) for l in open(tmp_path / "b" / "metrics.jsonl") if '"eval"' in l]
    assert [e["step"] for e in evals] == [0, 1]          # the warm start is scored before its first step
    # lr ~0: one step leaves the weights, so the step-0 score equals the final one (same held-out rows)
    assert evals[0]["acc_0"] == pytest.approx(summary["final_eval"]["acc_0"], abs=1e-6)
    with pytest.raises(ConfigError, match="fc_norm"):
        Trainer(small_cfg(setup, tmp_path / "c", init_from=first["export"], draft_vocab_size=None, fc_norm=True))


def test_init_from_with_a_larger_draft_vocab(setup, tmp_path):
    """--init-from + --draft-vocab-size N: every weight is the draft's, shared tokens keep their trained output
    row, new tokens get the affine image of the target's row; the vocabulary is the new one."""
    from sglang_eagle3.training.vocab import remap_lm_head
    first = Trainer(small_cfg(setup, tmp_path / "a", save_every=0)).run()
    src = Eagle3DraftModel.from_pretrained(first["export"], dtype=torch.float32)
    t = Trainer(small_cfg(setup, tmp_path / "b", init_from=first["export"], draft_vocab_size=64, max_steps=1,
                          save_every=0))
    d = t.module.draft
    old_ids, new_ids = (m.draft_to_target(torch.arange(m.config.draft_vocab_size)) for m in (src, d))
    assert len(new_ids) == 64 and d.lm_head.weight.shape[0] == 64 and set(old_ids.tolist()) <= set(new_ids.tolist())
    for k, v in src.state_dict().items():
        if k not in ("lm_head.weight", "d2t"):
            assert torch.equal(d.state_dict()[k].float(), v.float()) or k == "t2d", k
    pos = {int(x): i for i, x in enumerate(new_ids.tolist())}
    kept = torch.tensor([pos[int(x)] for x in old_ids])
    assert torch.equal(d.lm_head.weight.data[kept], src.lm_head.weight.data)
    want, info = remap_lm_head(src.lm_head.weight.data, old_ids, new_ids, t.module.lm_head.weight.data.float())
    assert info == {**info, "kept": 48, "new": 16, "dropped": 0} and torch.equal(d.lm_head.weight.data, want)
    t.run()
    assert Eagle3DraftModel.from_pretrained(str(tmp_path / "b" / "draft")).config.draft_vocab_size == 64


def test_remap_vocab_command_cuts_a_draft_to_its_most_frequent_tokens(setup, tmp_path, capsys):
    from sglang_eagle3.cli import main
    from sglang_eagle3.training.vocab import save_vocab
    _, target, _, _ = setup
    first = Trainer(small_cfg(setup, tmp_path / "a", save_every=0, max_steps=1)).run()
    src = Eagle3DraftModel.from_pretrained(first["export"], dtype=torch.float32)
    ids = src.draft_to_target(torch.arange(src.config.draft_vocab_size))
    keep = torch.sort(ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))[:20]]).values
    save_vocab(str(tmp_path / "v"), keep, np.zeros(src.config.vocab_size), {})
    args = ["remap-vocab", "--draft", first["export"], "--draft-vocab", str(tmp_path / "v" / "draft_vocab.safetensors"),
            "--target", target, "--out", str(tmp_path / "cut")]
    assert main(args) == 0
    cut = Eagle3DraftModel.from_pretrained(str(tmp_path / "cut"), dtype=torch.float32)
    assert torch.equal(cut.draft_to_target(torch.arange(20)), keep) and cut.config.draft_vocab_size == 20
    rows = torch.tensor([int((ids == t).nonzero()) for t in keep])
    assert torch.equal(cut.lm_head.weight.data, src.lm_head.weight.data[rows])          # trained rows, by token
    assert torch.equal(cut.fc.weight.data, src.fc.weight.data)
    capsys.readouterr()
    assert main(args) == 2 and "exists" in capsys.readouterr().err                        # never overwritten
    save_vocab(str(tmp_path / "w"), torch.tensor([1, src.config.vocab_size]), np.zeros(src.config.vocab_size + 1), {})
    bad = args[:4] + [str(tmp_path / "w" / "draft_vocab.safetensors")] + args[5:-1] + [str(tmp_path / "cut2")]
    assert main(bad) == 2 and f"draft_to_target[1] = {src.config.vocab_size} is not a token of the target " \
        f"vocabulary [0, {src.config.vocab_size})" in capsys.readouterr().err
    assert not (tmp_path / "cut2").exists()


def bad_vocab_files(folder, vocab_size: int) -> dict:
    """name -> (path, what the one-line error says) for draft vocabulary files remap-vocab and train must refuse."""
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    ids = torch.arange(20)
    cases = {"negative id": ({"draft_to_target": torch.cat([torch.tensor([-1]), ids[1:]])},
                             "draft_to_target[0] = -1 is not a token of the target vocabulary"),
             "id past the vocabulary": ({"draft_to_target": torch.cat([ids[:-1], torch.tensor([vocab_size])])},
                                        f"draft_to_target[19] = {vocab_size} is not a token"),
             "no draft_to_target": ({"d2t": ids}, "no draft_to_target tensor (it holds d2t)"),
             "empty": ({"draft_to_target": ids[:0]}, "draft_to_target is int64 [0]; expected a non-empty list"),
             "floats": ({"draft_to_target": ids.float()}, "draft_to_target is float32 [20]"),
             "repeated id": ({"draft_to_target": torch.cat([ids[:5], ids[:5]])}, "target id 0 appears 2 times")}
    out = {}
    for name, (tensors, said) in cases.items():
        path = os.path.join(folder, name.replace(" ", "_") + ".safetensors")
        save_file(tensors, path)
        out[name] = (path, said)
    path = os.path.join(folder, "text.safetensors")
    with open(path, "w") as f:
        f.write("not a safetensors file at all")
    out["not safetensors"] = (path, f"--draft-vocab {path}: not a readable safetensors file")
    return out


def test_remap_vocab_refuses_a_bad_vocabulary_file_before_loading_anything(setup, tmp_path, capsys, monkeypatch):
    from sglang_eagle3.cli import main
    _, target, _, _ = setup
    draft = Trainer(small_cfg(setup, tmp_path / "a", save_every=0, max_steps=1)).run()["export"]
    vocab = Eagle3DraftModel.from_pretrained(draft).config.vocab_size
    monkeypatch.setattr(Eagle3DraftModel, "from_pretrained", lambda *a, **k: pytest.fail("weights loaded first"))
    for name, (path, said) in bad_vocab_files(tmp_path / "v", vocab).items():
        out = tmp_path / ("out_" + name.replace(" ", "_"))
        assert main(["remap-vocab", "--draft", draft, "--draft-vocab", path, "--target", target,
                     "--out", str(out)]) == 2, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err and f"--draft-vocab {path}" in err, (name, err)
        assert not out.exists()
    assert main(["remap-vocab", "--draft", target, "--draft-vocab", path, "--target", target,
                 "--out", str(tmp_path / "o")]) == 2
    assert f"--draft {target} is a target model folder" in capsys.readouterr().err


def test_remap_lm_head_recovers_an_affine_map():
    from sglang_eagle3.training.vocab import remap_lm_head
    g = torch.Generator().manual_seed(0)
    target = torch.randn(100, 6, generator=g)
    a, b = torch.randn(6, 4, generator=g), torch.randn(4, generator=g)
    old_ids, new_ids = torch.arange(0, 40), torch.arange(10, 70)       # 30 shared, 30 new, 10 dropped
    head, info = remap_lm_head(target[old_ids] @ a + b, old_ids, new_ids, target)
    assert (info["kept"], info["new"], info["dropped"]) == (30, 30, 10) and info["fit_cosine"] > 0.9999
    torch.testing.assert_close(head, target[new_ids] @ a + b, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="shares 0 tokens"):
        remap_lm_head(head[:5], torch.arange(5), torch.arange(50, 60), target)


def test_head_init_from_the_target(setup, tmp_path):
    """--head-init target: the draft's lm_head starts as the target's rows for the draft vocabulary and its final
    norm as the target's (offline: read from the target's safetensors)."""
    from safetensors.torch import load_file
    _, target, _, _ = setup
    w = load_file(os.path.join(target, "model.safetensors"))
    t = Trainer(small_cfg(setup, tmp_path / "h", head_init="target", max_steps=1, save_every=0))
    d = t.module.draft
    ids = d.draft_to_target(torch.arange(d.config.draft_vocab_size))
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    frozen = t.module.lm_head.weight.dtype                                      # the target head as training holds it
    assert torch.equal(d.lm_head.weight.data, head[ids].to(frozen).float())
    assert torch.equal(d.norm.weight.data, w["model.norm.weight"].float())
    r = Trainer(small_cfg(setup, tmp_path / "r", max_steps=1, save_every=0)).module.draft
    assert not torch.equal(r.lm_head.weight.data, head[ids].float())            # the default stays random


def test_eagle31_training_and_loss_mask_offset(setup, tmp_path):
    s = Trainer(small_cfg(setup, tmp_path / "v31", fc_norm=True, norm_output=True, loss_mask_offset=0,
                          save_every=0)).run()
    d = Eagle3DraftModel.from_pretrained(s["export"])
    assert d.config.fc_norm and d.config.norm_output and len(d.fc_norm) == 3
    assert s["final_eval"]["loss"] == s["final_eval"]["loss"]              # finite (not NaN)


def test_check_only_names_missing_inputs(setup, tmp_path, capsys):
    from sglang_eagle3.cli import main
    _, target, _, dump = setup
    base = ["train", "--target", target, "--out", str(tmp_path / "run"), "--check-only"]
    assert main([*base, "--data", str(tmp_path / "nope")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert main([*base, "--data", dump, "--draft-vocab", str(tmp_path / "v.safetensors")]) == 2
    assert "--draft-vocab" in capsys.readouterr().err
    assert main([*base, "--data", dump]) == 0 and "inputs ok" in capsys.readouterr().out
    assert not (tmp_path / "run").exists()


def test_check_only_checks_what_the_run_will_before_any_worker_starts(setup, tmp_path, capsys, monkeypatch):
    """A 3-row data set with the default --eval-rows 64 (and the other mistakes the run would find after its
    DeepSpeed set-up) is refused by --check-only, and by a plain run before the trainer is built."""
    from sglang_eagle3.cli import main
    from sglang_eagle3.training.trainer import loop
    root, target, _, dump = setup
    three = write_jsonl(tmp_path / "three.jsonl", make_rows(3, seed=1, lo=8, hi=12))
    base = ["train", "--target", target, "--out", str(tmp_path / "run"), "--check-only"]

    def refused(argv, said):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err and "Traceback" not in err, (argv, err)

    refused([*base, "--data", three], "--eval-rows 64: --data has 3 rows, so at most 2 can be held out")
    refused([*base, "--data", three, "--eval-rows", "1", "--micro-batch-size", "4"],
            "2 training rows are fewer than one optimizer step needs (1 ranks x micro batch 4")
    monkeypatch.setenv("WORLD_SIZE", "2")                      # what `make train NPROC=2` sets for --check-only
    refused([*base, "--data", three, "--eval-rows", "1", "--grad-accum", "2"],
            "2 training rows are fewer than one optimizer step needs (2 ranks x micro batch 1 x grad accum 2)")
    monkeypatch.delenv("WORLD_SIZE")
    refused([*base, "--data", dump, "--draft-vocab-size", "1000"], "--draft-vocab-size must be in [1, 64]")
    refused([*base, "--data", dump, "--init-from", target], f"--init-from {target} is a target model folder")
    refused([*base, "--data", three, "--eval-rows", "1", "--aux-layer-ids", "1,3,40"],
            "--aux-layer-ids [1, 3, 40]: ids [40] are not layers of the target's 8")
    refused([*base, "--data", dump, "--aux-layer-ids", "0,1,2"], "--aux-layer-ids [0, 1, 2] but the dump holds")
    refused([*base, "--data", dump, "--save-every", "-1"], "--save-every must be >= 0, got -1")
    refused([*base, "--data", dump, "--keep-checkpoints", "0"], "--keep-checkpoints must be >= 1, got 0")
    for name, (path, said) in bad_vocab_files(tmp_path / "v", 64).items():
        refused([*base, "--data", dump, "--draft-vocab", path], said)
    monkeypatch.setattr(loop, "Trainer", lambda cfg: pytest.fail("the trainer was built before the inputs were checked"))
    refused([a for a in base if a != "--check-only"] + ["--data", three, "--backend", "ddp"], "--eval-rows 64")
    assert not (tmp_path / "run").exists()


def test_outputs_never_cover_an_input(setup, tmp_path, capsys, monkeypatch):
    """train --init-from RUN/draft --out RUN --overwrite used to delete the draft it was to start from; --out must
    lie apart from every input (train, remap-vocab), refused before the trainer is built or anything is written."""
    from sglang_eagle3.cli import main
    from sglang_eagle3.training.trainer import loop
    _, target, _, dump = setup
    run = tmp_path / "run"
    first = Trainer(small_cfg(setup, run, save_every=0, max_steps=1)).run()
    before = {f: open(os.path.join(first["export"], f), "rb").read() for f in os.listdir(first["export"])}
    monkeypatch.setattr(loop, "Trainer", lambda cfg: pytest.fail("the trainer was built before the check"))
    capsys.readouterr()
    base = ["train", "--target", target, "--data", dump, "--eval-rows", "4", "--draft-vocab-size", "48"]
    for argv, said in (([*base, "--init-from", first["export"], "--out", str(run), "--overwrite"],
                        f"--out {run} contains --init-from {first['export']}: an output must not be"),
                       ([*base, "--init-from", first["export"], "--out", str(run), "--overwrite", "--check-only"],
                        f"--out {run} contains --init-from"),
                       ([*base, "--out", dump, "--overwrite"], f"--out {dump} is the same path as --data {dump}"),
                       (["remap-vocab", "--draft", first["export"], "--target", target, "--draft-vocab",
                         str(run / "draft_vocab.safetensors"), "--out", os.path.join(first["export"], "cut")],
                        f"--out {os.path.join(first['export'], 'cut')} is inside --draft {first['export']}")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, (argv, err)
    assert {f: open(os.path.join(first["export"], f), "rb").read() for f in os.listdir(first["export"])} == before


def test_flags_the_run_would_ignore_are_refused_naming_both(setup, tmp_path, capsys):
    from sglang_eagle3.cli import main
    _, target, _, dump = setup
    base = ["train", "--target", target, "--data", dump, "--out", str(tmp_path / "run"), "--check-only"]
    ds_config = os.path.join(ROOT, "train", "ds_zero2.json")
    cases = [(["--eval-data", dump, "--eval-rows", "8"], f"--eval-rows 8 holds rows of --data out for eval, but "
                                                         f"--eval-data {dump} is the eval set"),
             (["--save-every", "30", "--keep-every", "100"], "--keep-every 100 keeps the checkpoints at its "
                                                             "multiples, but --save-every 30 writes none at some"),
             (["--save-every", "0", "--keep-every", "100"], "--save-every 0 writes only the last one"),
             (["--init-from", str(tmp_path / "d"), "--head-init", "target"], "--head-init target starts a new "
                                                                             "draft's output head from the target's"),
             (["--backend", "ddp", "--zero-stage", "3"], "--zero-stage 3 is a DeepSpeed setting, but the run trains "
                                                         "with PyTorch DDP (--backend ddp)"),
             (["--backend", "ddp", "--deepspeed-config", ds_config], f"--deepspeed-config {ds_config} is a DeepSpeed "
                                                                     "setting")]
    for extra, said in cases:
        assert main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err
    assert main([*base, "--eval-data", dump, "--save-every", "25", "--keep-every", "250"]) == 0


def test_check_only_refuses_a_resume_the_run_would_refuse(setup, tmp_path, capsys):
    from sglang_eagle3.cli import main
    _, target, _, dump = setup
    out = tmp_path / "run"
    Trainer(small_cfg(setup, out, max_steps=2)).run()
    args = ["train", "--target", target, "--data", dump, "--out", str(out), "--eval-rows", "4", "--ttt-length", "2",
            "--draft-vocab-size", "48", "--backend", "ddp", "--lr", "1e-3", "--resume", "--check-only"]
    assert main([*args, "--max-steps", "2"]) == 0 and "inputs ok" in capsys.readouterr().out
    assert main([*args, "--max-steps", "2", "--seed", "5"]) == 2
    assert "cannot resume" in capsys.readouterr().err
    assert main([*args, "--max-steps", "8"]) == 2
    assert "finished its planned 2 steps" in capsys.readouterr().err


CHANGED_ON_RESUME = [("--lr", "2e-3", "--lr: checkpoint 0.001, given 0.002"),
                     ("--warmup-ratio", "0.5", "--warmup-ratio: checkpoint 0.02, given 0.5"),
                     ("--min-lr-ratio", "0.1", "--min-lr-ratio: checkpoint 0.0, given 0.1"),
                     ("--weight-decay", "0.1", "--weight-decay: checkpoint 0.0, given 0.1"),
                     ("--grad-clip", "1.0", "--grad-clip: checkpoint 0.5, given 1.0"),
                     ("--step-decay", "0.5", "--step-decay: checkpoint 0.8, given 0.5"),
                     ("--ttt-length", "3", "--ttt-length: checkpoint 2, given 3"),
                     ("--target-temperature", "0", "--target-temperature: checkpoint 1.0, given 0.0"),
                     ("--feature-loss-weight", "0.1", "--feature-loss-weight: checkpoint 0.0, given 0.1"),
                     ("--loss-mask-offset", "0", "--loss-mask-offset: checkpoint 1, given 0"),
                     ("--features", "top", "--features: checkpoint fused, given top"),
                     ("--max-length", "16", "--max-length: checkpoint 2048, given 16"),
                     ("--head-init", "target", "--head-init: checkpoint random, given target"),
                     ("--fc-norm", None, "--fc-norm: checkpoint False, given True"),
                     ("--draft-vocab-size", "32", "--draft-vocab-size: checkpoint 48, given 32"),
                     ("--grad-accum", "2", "rows per step (ranks x --micro-batch-size x --grad-accum): checkpoint 1, "
                                           "given 2"),
                     ("--max-steps", "6", "total steps (--max-steps / --epochs): checkpoint 4, given 6")]


def test_resume_refuses_every_changed_setting_naming_the_flag(setup, tmp_path, capsys):
    """A resume restores the checkpoint's optimizer and schedule (a new --lr was silently ignored) and continues its
    loss, draft and data order: a flag that would change them is refused in one line naming it with the checkpoint's
    value and the given one. The cadence flags may change."""
    from sglang_eagle3.cli import main
    _, target, _, dump = setup
    out = tmp_path / "run"
    args = ["train", "--target", target, "--data", dump, "--out", str(out), "--eval-rows", "4", "--ttt-length", "2",
            "--draft-vocab-size", "48", "--backend", "ddp", "--max-steps", "4", "--lr", "1e-3", "--save-every", "2",
            "--quiet", "--no-tensorboard"]
    assert main(args) == 0
    (out / "checkpoints" / "latest").write_text("step_0000002\n")       # back to the middle of the run
    for flag, value, said in CHANGED_ON_RESUME:
        for mode in (["--check-only"], []):
            argv = [*args, "--resume", *mode, flag, *([value] if value else [])]
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"cannot resume {out}/checkpoints/step_0000002: " in err and said in err, err
    with pytest.raises(ConfigError, match="--lr: checkpoint 0.001, given 0.002"):      # the trainer itself too
        Trainer(small_cfg(setup, out, resume=True, lr=2e-3, save_every=2)).run()
    assert main([*args, "--resume", "--eval-every", "1", "--log-every", "2", "--keep-checkpoints", "3",
                 "--grow-chains", "all", "--verify-dumps", "size"]) == 0
    assert "resumed from" in capsys.readouterr().out


def test_init_from_weights_are_checked_before_the_target_loads(setup, tmp_path, capsys, monkeypatch):
    """A truncated --init-from (or one without a tensor its config implies) is refused by --check-only and by the
    run before the trainer is built, naming the file; the run leaves no folder behind."""
    from sglang_eagle3.cli import main
    from sglang_eagle3.models.draft import CheckpointError
    from sglang_eagle3.training.trainer import loop
    _, target, _, dump = setup
    first = Trainer(small_cfg(setup, tmp_path / "a", max_steps=1)).run()["export"]
    truncated = shutil.copytree(first, tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    missing = shutil.copytree(first, tmp_path / "missing")
    edit_tensors(missing, lambda state: state.pop("norm.weight"))
    out = tmp_path / "run"
    with pytest.raises(CheckpointError, match="unreadable safetensors file"):     # the trainer alone
        Trainer(small_cfg(setup, out, init_from=str(truncated), draft_vocab_size=None))
    assert not (out / "checkpoints").exists()
    base = ["train", "--target", target, "--data", dump, "--out", str(out), "--eval-rows", "4", "--backend", "ddp"]
    monkeypatch.setattr(loop, "Trainer", lambda cfg: pytest.fail("the trainer was built before --init-from's check"))
    for folder, said in ((truncated, f"{weights}: unreadable safetensors file"),
                         (missing, f"{missing}: missing tensor norm.weight")):
        for mode in (["--check-only"], []):
            assert main([*base, "--init-from", str(folder), *mode]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and said in err, err
    assert not out.exists()


def test_check_only_builds_the_draft_the_run_will_train(setup, tmp_path, capsys, monkeypatch):
    """--draft-config's fields, the shape it gives against the target and an --init-from of another variant are
    refused by --check-only and by the run before the trainer is built (the run found them after the target
    loaded)."""
    from sglang_eagle3.cli import main
    from sglang_eagle3.training.trainer import loop
    _, target, _, dump = setup
    first = Trainer(small_cfg(setup, tmp_path / "a", max_steps=1)).run()["export"]
    config = json.loads(open(os.path.join(first, "config.json")).read())

    def draft_config(name, **edit):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({**config, **edit}))
        return str(path)
    base = ["train", "--target", target, "--data", dump, "--out", str(tmp_path / "run"), "--eval-rows", "4",
            "--backend", "ddp"]
    cases = [(["--draft-config", draft_config("bad", intermediate_size="wide")],
              "bad.json: intermediate_size='wide' is not a positive integer"),
             (["--draft-config", draft_config("heads", num_attention_heads=3, num_key_value_heads=1, head_dim=None)],
              "heads.json: hidden_size=32 is not a multiple of num_attention_heads=3"),
             (["--draft-config", draft_config("wide", hidden_size=64, head_dim=16)],
              "draft hidden_size=64 but the target's embedding is [64, 32]"),
             (["--init-from", first, "--fc-norm"], f"--init-from {first} does not match the draft being trained: "
                                                   "fc_norm: False vs True")]
    monkeypatch.setattr(loop, "Trainer", lambda cfg: pytest.fail("the trainer was built before the draft was checked"))
    for extra, said in cases:
        for mode in (["--check-only"], []):
            assert main([*base, *extra, *mode]) == 2, extra
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and said in err, err
    assert not (tmp_path / "run").exists()


def train_argv(setup, out, *extra):
    _, target, _, dump = setup
    return ["train", "--target", target, "--data", dump, "--out", str(out), "--eval-rows", "4", "--ttt-length", "2",
            "--draft-vocab-size", "48", "--backend", "ddp", "--max-steps", "3", "--save-every", "1", "--quiet",
            "--no-tensorboard", *extra]


def test_too_little_free_space_for_the_checkpoints_is_refused_before_anything_loads(setup, tmp_path, capsys,
                                                                                    monkeypatch):
    from sglang_eagle3.cli import main
    from sglang_eagle3.training.trainer import loop
    out = tmp_path / "run"
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real_usage(p)._replace(free=10_000))
    monkeypatch.setattr(loop, "Trainer", lambda cfg: pytest.fail("the trainer was built without room to save"))
    for mode in (["--check-only"], []):
        assert main(train_argv(setup, out, *mode)) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--out {out}: the run needs ~" in err and "only 10.00 KB are free" in err, err
    assert main(train_argv(setup, out, "--check-only", "--no-disk-check")) == 0
    assert not out.exists()


def test_a_checkpoint_write_that_runs_out_of_space_cleans_up(setup, tmp_path, capsys, monkeypatch):
    """A checkpoint whose write fails for want of space removes its temporary folder (and any a kill left) and ends
    in one line naming the folder and the free space, the previous checkpoint and `latest` untouched."""
    from sglang_eagle3.cli import main
    out = tmp_path / "run"

    def full_disk(error, real_save=None):
        """A backend save that writes part of a file and fails (after a first save that works, when given)."""
        calls = []

        def save(directory):
            calls.append(directory)
            if real_save and len(calls) == 1:
                return real_save(directory)
            open(os.path.join(directory, "state.pt"), "wb").write(b"partial")
            raise error
        return save
    errors = [OSError(errno.ENOSPC, "No space left on device"),
              RuntimeError("[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing file "
                           "data/3: file write failed"), RuntimeError("write: No space left on device")]
    for i, error in enumerate(errors):
        t = Trainer(small_cfg(setup, tmp_path / f"r{i}", max_steps=3, save_every=1))
        t.backend.save = full_disk(error, real_save=t.backend.save)
        os.makedirs(t.ckpt_dir, exist_ok=True)
        os.makedirs(os.path.join(t.ckpt_dir, ".tmp-step_0000009"))           # a write a kill interrupted
        tmp = os.path.join(t.ckpt_dir, ".tmp-step_0000002")
        with pytest.raises(UserError, match=re.escape(tmp) + r": no space left on the device .*B free; the partial "
                           r"checkpoint was removed\): free some space or lower --keep-checkpoints"):
            t.run()
        assert sorted(os.listdir(t.ckpt_dir)) == ["latest", "step_0000001"]
        assert (tmp_path / f"r{i}" / "checkpoints" / "latest").read_text() == "step_0000001\n"
    monkeypatch.setattr(B.TorchBackend, "save", lambda self, directory: full_disk(errors[0])(directory))
    assert main(train_argv(setup, out)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ".tmp-step_0000001: no space left on the device" in err, err
    assert os.listdir(out / "checkpoints") == []


def test_checkpoint_export_and_learning_curve(setup, tmp_path):
    """A kept checkpoint exports as a loadable draft equal to the run's weights at that step, and its eval
    records carry the tokens seen (what the learning curve reads)."""
    from sglang_eagle3.training.trainer.export import export_checkpoint
    run = tmp_path / "run"
    s = Trainer(small_cfg(setup, run, max_steps=4, save_every=2, keep_checkpoints=1, keep_every=2)).run()
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_0000002", "step_0000004"]
    st = export_checkpoint(str(run / "checkpoints" / "step_0000004"), str(tmp_path / "d4"))
    assert st["step"] == 4 and st["tokens_seen"] == s["tokens_seen"] > 0
    a = Eagle3DraftModel.from_pretrained(str(tmp_path / "d4")).state_dict()
    b = Eagle3DraftModel.from_pretrained(s["export"]).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    recs = [r for r in read_metrics(str(run / "metrics.jsonl")) if r["split"] == "eval"]
    assert [r["tokens_seen"] for r in recs][-1] == s["tokens_seen"]


def fake_curve_sets(tmp_path, monkeypatch) -> list:
    """One-prompt MT-bench and GSM8K files, and a τ measurement that records which drafts it was asked for."""
    from sglang_eagle3.bench import curve
    for name in ("mt_bench", "gsm8k"):
        (tmp_path / f"{name}.jsonl").write_text('{"question_id": 1, "category": "x", "turns": ["hi"]}\n')
    measured = []

    def fake_tau(target, draft_dir, spec, prompts, max_new_tokens, dtype):
        measured.append(draft_dir)
        return {k: 1.0 + len(measured) / 10 for k in prompts}
    monkeypatch.setattr(curve, "measure_tau", fake_tau)
    return measured


def test_export_command_names_a_folder_that_is_no_checkpoint(tmp_path, capsys):
    from sglang_eagle3.training.trainer.export import main as export_main
    assert export_main([str(tmp_path), str(tmp_path / "d")]) == 2
    assert capsys.readouterr().err == (f"export: error: {tmp_path}: not a training checkpoint (no trainer_state.json; "
                                       "RUN/checkpoints/step_N is)\n")
    assert not (tmp_path / "d").exists()


def test_learning_curve_measures_each_checkpoint_once(setup, tmp_path, monkeypatch):
    """A rerun measures only new checkpoints and keeps points whose checkpoints were rotated away; a rewritten
    checkpoint, changed settings or --fresh measure again; tokens count on across runs."""
    from sglang_eagle3.bench import curve
    run1, run2 = tmp_path / "r1", tmp_path / "r2"
    Trainer(small_cfg(setup, run1, max_steps=4, save_every=2, keep_checkpoints=1, keep_every=2)).run()
    Trainer(small_cfg(setup, run2, max_steps=2, save_every=1, keep_checkpoints=2, keep_every=0)).run()
    measured = fake_curve_sets(tmp_path, monkeypatch)
    out = str(tmp_path / "curve.json")
    argv = ["--run", str(run1), "--run", str(run2), "--target", setup[1], "--dtype", "float32", "--n", "1",
            "--datasets", f"{tmp_path}/mt_bench.jsonl,{tmp_path}/gsm8k.jsonl", "--num-steps", "1", "--topk", "1",
            "--num-draft-tokens", "2", "--out", out]
    assert curve.run(argv) == 0
    first = json.load(open(out))["points"]
    assert [(p["step"], len(measured)) for p in first][-1] == (2, 4)       # r1: 2, 4; r2: 1, 2
    tokens = [p["tokens_total"] for p in first]
    assert tokens == sorted(tokens) and tokens[2] > tokens[1]               # run 2 counts on from run 1's end
    shutil.rmtree(run1 / "checkpoints" / "step_0000002")                  # rotated away after it was measured
    assert curve.run(argv) == 0 and len(measured) == 4                      # nothing new to measure
    again = json.load(open(out))["points"]
    assert [(p["step"], p["tokens_total"], p["tau"]) for p in again] == [(p["step"], p["tokens_total"], p["tau"]) for p in first]
    state = run2 / "checkpoints" / "step_0000002" / "trainer_state.json"       # trained again in place (--overwrite)
    os.utime(state, ns=(state.stat().st_atime_ns, state.stat().st_mtime_ns + 10 ** 9))
    assert curve.run(argv) == 0 and len(measured) == 5                      # that checkpoint only
    assert curve.run([*argv[:-2], "--topk", "2", "--num-draft-tokens", "3", "--out", out]) == 0 and len(measured) == 8   # other tree
    assert curve.run([*argv, "--fresh"]) == 0 and len(measured) == 11


def test_learning_curve_goes_on_when_run_folders_are_gone(setup, tmp_path, monkeypatch):
    """On another machine the run folders are gone: their points and held-out evals stay in --out; a run whose
    checkpoints are gone but whose final draft was kept adds one point at its end, measured once."""
    from sglang_eagle3.bench import curve
    from sglang_eagle3.errors import UserError
    run1 = tmp_path / "r1"
    s = Trainer(small_cfg(setup, run1, max_steps=4, save_every=2, keep_checkpoints=1, keep_every=2)).run()
    measured = fake_curve_sets(tmp_path, monkeypatch)
    out = str(tmp_path / "curve.json")
    common = ["--target", setup[1], "--dtype", "float32", "--n", "1", "--num-steps", "1", "--topk", "1",
              "--datasets", f"{tmp_path}/mt_bench.jsonl,{tmp_path}/gsm8k.jsonl", "--num-draft-tokens", "2",
              "--out", out]
    assert curve.run(["--run", str(run1), *common]) == 0 and len(measured) == 2
    first = json.load(open(out))
    shipped = shutil.copytree(s["export"], tmp_path / "shipped")
    shutil.rmtree(run1)                                    # a new machine: the run folder is gone
    final = f"{tmp_path / 'r2'}={shipped}:1000"           # a run of which only the final draft is left
    assert curve.run(["--run", str(run1), "--run", final, *common]) == 0 and len(measured) == 3
    again = json.load(open(out))
    assert again["points"][:2] == first["points"] and again["evals"] == first["evals"]
    end = again["points"][2]
    assert end["step"] == "end" and end["tokens_total"] == first["points"][-1]["tokens_total"] + 1000
    assert end["tau"]["gsm8k"] == 1.3
    shutil.rmtree(shipped)                                # the draft shipped then is replaced later: kept too
    assert curve.run(["--run", str(run1), "--run", str(tmp_path / "r2"), *common]) == 0 and len(measured) == 3
    assert json.load(open(out))["points"] == again["points"]
    for bad, msg in ((str(tmp_path / "r9"), "no checkpoints/ folder, and"), (f"{tmp_path / 'r3'}=x:0", "DIR=DRAFT:TOKENS"),
                     (f"{tmp_path / 'r3'}={tmp_path}:5", "not a draft folder")):
        with pytest.raises(UserError, match=msg):
            curve.run(["--run", str(run1), "--run", bad, *common])
