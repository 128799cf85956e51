"""What the benchmark tests share: a tiny random target with an init-draft and eval files (`env`), the
threads and EAGLE3_DATA kept per test, and a quick bench_acceptance run."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import save_tiny_model_folder

from sglang_eagle3.bench.acceptance import main as acceptance_main
from sglang_eagle3.cli import main as eagle3_main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

EVAL = {"mt_bench": [{"turns": ["w1 w2 w3", "w4 w5"]}, {"turns": ["w6 w7", "w8 w9 w10"]}],
        "gsm8k": [{"turns": ["w11 w12"]}, {"turns": ["w13 w14 w15"]}],
        "alpaca": [{"turns": ["w16"]}, {"turns": ["w17 w18"]}]}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target = save_tiny_model_folder(root / "target")
    assert eagle3_main(["init-draft", "--target", target, "--out", str(root / "draft"), "--draft-vocab-size", "48",
                        "--dtype", "float32"]) == 0
    (root / "data" / "eval").mkdir(parents=True)
    for name, rows in EVAL.items():
        (root / "data" / "eval" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"target": target, "draft": str(root / "draft"), "data": str(root / "data")}


@pytest.fixture(autouse=True)
def keep_threads(monkeypatch, env):
    """The scripts take --threads 1 (fast for tiny models on a busy machine); restore the suite's setting."""
    n = torch.get_num_threads()
    monkeypatch.setenv("EAGLE3_DATA", env["data"])
    yield
    torch.set_num_threads(n)


def acceptance(env, out, *extra):
    return acceptance_main(["--target", env["target"], "--draft", env["draft"], "--n", "2", "--max-new-tokens", "6",
                            "--ignore-eos", "--num-steps", "3", "--topk", "2", "--num-draft-tokens", "6",
                            "--threads", "1", "--out", str(out), *extra])
