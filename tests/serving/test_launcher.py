"""`eagle3 serve` / serve/launch_server.py: composed SGLang command lines and error paths.

Every composed command is parsed by SGLang's own server-args parser (`prepare_server_args` =
`ServerArgs.add_cli_args` + `ServerArgs.from_cli_args`) when SGLang is installed.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
import torch
from conftest import tiny_hf_model

from sglang_eagle3.cli import main as eagle3_main
from sglang_eagle3.models.config import Eagle3Config
from sglang_eagle3.models.draft import Eagle3DraftModel
from sglang_eagle3.serving import launcher, sglang_compat

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROFILE = {"per_batch_size": {"1": {"num_steps": 5, "topk": 4, "num_draft_tokens": 16},
                              "8": {"num_steps": 3, "topk": 2, "num_draft_tokens": 6},
                              "32": {"num_steps": 2, "topk": 1, "num_draft_tokens": 3}}}


@pytest.fixture(scope="module", autouse=True)
def process_state():
    with sglang_compat.undo_import_side_effects():
        yield


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("launch")
    hf = tiny_hf_model("llama", vocab_size=96)
    hf.save_pretrained(root / "target")
    draft = Eagle3DraftModel(Eagle3Config.for_target(hf.config, draft_vocab_size=32))
    with torch.no_grad():
        for p in draft.parameters():                  # off the initial values: check-draft would call it untrained
            p.add_(torch.randn_like(p) * 0.01)
    draft.set_vocab_mapping(torch.randperm(96)[:32])
    draft.save_pretrained(str(root / "draft"))
    other = tiny_hf_model("llama", vocab_size=128)
    Eagle3DraftModel(Eagle3Config.for_target(other.config)).save_pretrained(str(root / "bad_draft"))
    (root / "profile.json").write_text(json.dumps(PROFILE))
    return {k: str(root / k) for k in ("target", "draft", "bad_draft", "profile.json")}


def dry_run(capsys, *argv) -> list[str]:
    assert launcher.main([*argv, "--dry-run"]) == 0, capsys.readouterr().err
    return shlex.split(capsys.readouterr().out.strip())


def sglang_parse(cmd: list[str]):
    """SGLang's real parser on the arguments after `python -m sglang.launch_server`."""
    if sglang_compat.sglang_version() is None:
        pytest.skip("SGLang is not installed")
    from sglang.srt.server_args import prepare_server_args
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    return prepare_server_args(cmd[3:])


def base(folders, *more):
    return ["--engine", "sglang", "--target", folders["target"], "--draft", folders["draft"], *more]


# ---- composed commands ------------------------------------------------------------------------------
def test_default_command_parses_in_sglang(capsys, folders):
    cmd = dry_run(capsys, *base(folders, "--port", "30001", "--tp-size", "1", "--mem-fraction-static", "0.8"))
    args = sglang_parse(cmd)
    assert (args.model_path, args.speculative_draft_model_path) == (folders["target"], folders["draft"])
    assert args.speculative_algorithm == "EAGLE3"
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (5, 4, 16)
    assert args.attention_backend == "flashinfer"
    # SGLang's own concurrency defaults (no cap asked for): neither flag is passed
    assert "--max-running-requests" not in cmd and "--cuda-graph-max-bs-decode" not in cmd
    assert (args.cuda_graph_max_bs_decode, args.max_running_requests) == (None, None)
    assert (args.port, args.tp_size, args.mem_fraction_static) == (30001, 1, 0.8)      # passed through


@pytest.mark.parametrize("batch,expected", [(1, (5, 4, 16)), (8, (3, 2, 6)), (16, (3, 2, 6)), (64, (2, 1, 3))])
def test_profile_entry_for_the_batch_size(capsys, folders, batch, expected):
    cmd = dry_run(capsys, *base(folders, "--profile", folders["profile.json"], "--batch-size", str(batch)))
    args = sglang_parse(cmd)
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == expected
    assert (args.cuda_graph_max_bs_decode, args.max_running_requests) == (batch, batch)


def test_explicit_flags_win_over_the_profile(capsys, folders):
    cmd = dry_run(capsys, *base(folders, "--profile", folders["profile.json"], "--max-running-requests", "8",
                                "--topk", "1", "--num-draft-tokens", "4", "--cuda-graph-max-bs", "16",
                                "--attention-backend", "fa3"))
    args = sglang_parse(cmd)
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (3, 1, 4)
    assert (args.cuda_graph_max_bs_decode, args.max_running_requests, args.attention_backend) == (16, 8, "fa3")


def test_adaptive_command(capsys, folders, tmp_path):
    config = tmp_path / "adaptive.json"
    config.write_text(json.dumps({"1": {"candidate_steps": [1, 3, 5]}, "8": {"candidate_steps": [0, 1]}}))
    cmd = dry_run(capsys, *base(folders, "--topk", "1", "--num-draft-tokens", "6", "--adaptive", str(config)))
    args = sglang_parse(cmd)
    assert args.speculative_adaptive and args.speculative_adaptive_config == str(config)
    from sglang.srt.speculative.adaptive_spec_params import adaptive_unsupported_reason
    assert adaptive_unsupported_reason(args) is None
    args = sglang_parse(dry_run(capsys, *base(folders, "--topk", "1", "--adaptive")))
    assert args.speculative_adaptive and args.speculative_adaptive_config is None


def test_eagle3_serve_subcommand(capsys, folders):
    assert eagle3_main(["serve", *base(folders, "--port", "31000", "--dry-run", "--enable-metrics")]) == 0
    cmd = shlex.split(capsys.readouterr().out.strip())
    args = sglang_parse(cmd)
    assert args.port == 31000 and args.enable_metrics and args.speculative_draft_model_path == folders["draft"]


def test_launch_server_script(folders):
    r = subprocess.run([sys.executable, os.path.join(REPO, "serve", "launch_server.py"),
                        *base(folders, "--batch-size", "4", "--dry-run", "--skip-check")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "-m sglang.launch_server" in r.stdout and "--cuda-graph-max-bs-decode 4" in r.stdout


# ---- error paths ------------------------------------------------------------------------------------
def run_err(capsys, *argv) -> str:
    assert launcher.main(list(argv)) == 2
    err = capsys.readouterr().err
    return err


def test_mismatched_draft_is_refused(capsys, folders):
    for engine in ("sglang", "builtin"):
        err = run_err(capsys, "--engine", engine, "--target", folders["target"], "--draft", folders["bad_draft"],
                      "--dry-run")
        assert "ERROR" in err and "vocab size" in err and "failed" in err and "--skip-check" in err
    assert launcher.main(["--engine", "sglang", "--target", folders["target"], "--draft", folders["bad_draft"],
                          "--dry-run", "--skip-check"]) == 0


def test_missing_and_hub_drafts(capsys, folders, tmp_path):
    assert "no such folder" in run_err(capsys, *base(folders)[:4], "--draft", str(tmp_path / "nope"))
    cmd = dry_run(capsys, *base(folders)[:4], "--draft", "someorg/some-eagle3-draft")
    assert cmd[cmd.index("--speculative-draft-model-path") + 1] == "someorg/some-eagle3-draft"


@pytest.mark.parametrize("content", [None, "{not json", '{"per_batch": {}}', '{"per_batch_size": {"x": {}}}',
                                     '{"per_batch_size": {"4": {"num_steps": 3, "topk": 1}}}',
                                     '{"per_batch_size": {"4": {"num_steps": 3, "topk": 4, "num_draft_tokens": 99}}}'],
                         ids=["missing", "not-json", "no-table", "bad-key", "missing-field", "bad-tree"])
def test_bad_profiles(capsys, folders, tmp_path, content):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    err = run_err(capsys, *base(folders, "--profile", str(path), "--dry-run"))
    assert err.startswith("launch_server.py: error: --profile: ") and str(path) in err and err.count("\n") == 1


def test_profile_without_speculation_at_this_batch_size(capsys, folders, tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"per_batch_size": {"1": PROFILE["per_batch_size"]["1"],
                                                   "16": {"speculation": False, "tokens_per_s": 900.0}}}))
    cmd = dry_run(capsys, *base(folders, "--profile", str(path), "--batch-size", "32"))
    assert "--speculative-algorithm" not in cmd and "--speculative-draft-model-path" not in cmd
    args = sglang_parse(cmd)
    assert args.speculative_algorithm is None and args.max_running_requests == 32
    cmd = dry_run(capsys, *base(folders, "--profile", str(path), "--batch-size", "32", "--topk", "1"))
    assert sglang_parse(cmd).speculative_eagle_topk == 1            # explicit flags switch it back on


@pytest.mark.parametrize("argv,message", [
    (["--speculative-num-steps", "3"], "use --num-steps"), (["--model-path=x"], "use --target"),
    (["--num-draft-tokens", "99"], "exceeds"), (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--adaptive"], "needs topk 1"), (["--topk", "1", "--adaptive", "missing.json"], "no such file")])
def test_bad_flags(capsys, folders, argv, message):
    assert message in run_err(capsys, *base(folders, *argv, "--dry-run"))


def test_bad_adaptive_config_rejected_by_sglang_rules(capsys, folders, tmp_path):
    if sglang_compat.sglang_version() is None:
        pytest.skip("SGLang is not installed")
    path = tmp_path / "a.json"
    path.write_text('{"1": {"candidate_steps": [-1]}}')
    assert "candidate_steps" in run_err(capsys, *base(folders, "--topk", "1", "--adaptive", str(path), "--dry-run"))


def test_without_gpu_or_sglang_points_to_the_embedded_engine(capsys, folders, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = run_err(capsys, *base(folders))
    assert "no CUDA GPU" in err and "--engine builtin" in err and err.count("\n") == 1
    real = launcher.importlib.util.find_spec
    monkeypatch.setattr(launcher.importlib.util, "find_spec", lambda n, *a: None if n == "sglang" else real(n, *a))
    err = run_err(capsys, *base(folders))
    assert "SGLang is not installed" in err and "--engine builtin" in err


def test_launches_the_composed_command(capsys, folders, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(launcher.importlib.util, "find_spec", lambda n, *a: object())
    monkeypatch.setattr(launcher.subprocess, "call", lambda cmd: calls.append(cmd) or 7)
    assert launcher.main(base(folders, "--port", "30002")[2:]) == 7           # --engine auto picks SGLang here
    (cmd,) = calls
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"] and cmd[-2:] == ["--port", "30002"]
    assert cmd[-4:-2] == ["--host", "127.0.0.1"]
    assert "num_steps=5 topk=4 num_draft_tokens=16 (default tree (SGLang's 5/4/16))" in capsys.readouterr().err


def test_auto_picks_the_builtin_engine_without_a_gpu(capsys, folders, monkeypatch, tmp_path):
    from conftest import save_tiny_model_folder
    target = save_tiny_model_folder(tmp_path / "target")            # same shapes, with a tokenizer
    folders = {**folders, "target": target}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert launcher.main(["--target", folders["target"], "--draft", folders["draft"], "--dry-run"]) == 0
    assert "builtin engine, drafter eagle, tree num_steps=5 topk=4 num_draft_tokens=16" in capsys.readouterr().err
    assert launcher.main(["--target", folders["target"], "--draft", folders["draft"], "--profile",
                          folders["profile.json"], "--dry-run"]) == 0
    assert "adaptive speculation from" in capsys.readouterr().err
    err = run_err(capsys, "--engine", "builtin", "--target", folders["target"], "--draft", folders["draft"],
                  "--tp-size", "2", "--dry-run")
    assert "unknown flags for the builtin engine: --tp-size 2" in err


# ---- the port: checked before any banner, any model, any SGLang start -------------------------------------
def test_port_and_host_are_checked_before_any_banner_or_model(capsys, folders, monkeypatch):
    import socket

    from sglang_eagle3.serving import server
    monkeypatch.setattr(server, "build_state", lambda *a, **k: pytest.fail("the model loaded before the port check"))
    monkeypatch.setattr(launcher, "check_runtime", lambda args: None)            # as on a GPU machine with SGLang
    monkeypatch.setattr(launcher.subprocess, "call", lambda cmd: pytest.fail("SGLang started on a bad port"))
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        for argv, said in ((["--port", "99999"], "--port 99999: a port is 1..65535"),
                           (["--port", "0"], "--port 0: a port is 1..65535"),
                           (["--port", str(port)], f"--host 127.0.0.1 --port {port}: cannot listen there (Address "
                                                   "already in use); is a server already running on it?"),
                           (["--host", "203.0.113.7", "--port", "30123"], "--host 203.0.113.7 --port 30123: cannot "
                                                                          "listen there")):
            for engine in ("builtin", "sglang"):
                rc = eagle3_main(["serve", "--engine", engine, "--target", folders["target"], "--draft",
                                  folders["draft"], "--skip-check", *argv])
                out = capsys.readouterr()
                assert rc == 2, (engine, argv, out.err)
                assert out.out == "" and out.err.count("\n") == 1 and said in out.err, (engine, argv, out.err)
                assert "serve:" not in out.err.split("error:")[1] and "curl" not in out.err       # no banner
    finally:
        busy.close()


def test_the_builtin_server_listens_on_the_socket_it_checked(folders, monkeypatch, capsys, tmp_path):
    """bind_port's socket is the one uvicorn serves on: the banner is printed only once the address is ours, and no
    other process can take the port while the model loads."""
    import threading
    import time

    import httpx
    import uvicorn
    from conftest import save_tiny_model_folder

    from sglang_eagle3.engine.settings import Settings
    from sglang_eagle3.serving.server import build_state, run_server
    target = save_tiny_model_folder(tmp_path / "t")
    sock = launcher.bind_port("127.0.0.1", 0)
    port = sock.getsockname()[1]
    with pytest.raises(Exception):
        launcher.check_port_free("127.0.0.1", port)        # held: nobody else binds it meanwhile
    servers = []

    class Recording(uvicorn.Server):
        def __init__(self, config):
            super().__init__(config)
            servers.append(self)
    monkeypatch.setattr(uvicorn, "Server", Recording)
    state = build_state(target, Settings("float32", None, None, None, "test", max_running=2, max_queue=8, max_len=64),
                        "tiny")
    thread = threading.Thread(target=run_server, args=(state, "127.0.0.1", port), kwargs={"sock": sock}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not (servers and servers[0].started) and time.time() < deadline:
        time.sleep(0.05)
    try:
        assert httpx.get(f"http://127.0.0.1:{port}/health").json()["status"] == "ok"
        assert f"tiny on http://127.0.0.1:{port}/v1" in capsys.readouterr().out
    finally:
        servers[0].should_exit = True
        thread.join(timeout=30)
        sock.close()


# ---- flags one engine or drafter would ignore --------------------------------------------------------------
def test_flags_the_chosen_engine_or_drafter_would_ignore_are_refused(capsys, folders):
    """Tree flags under --drafter suffix, --pool-tokens without a context drafter or with SGLang, SGLang's flags with
    the builtin engine and the builtin engine's with SGLang: one line naming the flag (they were ignored)."""
    builtin = ["--engine", "builtin", "--target", folders["target"], "--dry-run"]
    sglang = [*base(folders), "--dry-run"]
    cases = [([*builtin, "--drafter", "suffix", "--num-steps", "3"], "--num-steps shapes the draft model's tree"),
             ([*builtin, "--drafter", "suffix", "--topk", "2"], "--topk shapes the draft model's tree"),
             ([*builtin, "--draft", folders["draft"], "--drafter", "eagle", "--pool-tokens", "5"],
              "--pool-tokens 5 applies to the context drafters"),
             ([*builtin, "--draft", "none", "--pool-tokens", "5"], "--pool-tokens 5"),
             ([*sglang, "--pool-tokens", "5"], "--pool-tokens 5"),
             ([*builtin, "--draft", folders["draft"], "--topk", "1", "--adaptive"], "--adaptive"),
             ([*builtin, "--draft", folders["draft"], "--attention-backend", "fa3"], "--attention-backend"),
             ([*builtin, "--draft", folders["draft"], "--cuda-graph-max-bs", "8"], "--cuda-graph-max-bs"),
             ([*sglang, "--max-queue", "8"], "--max-queue"),
             ([*sglang, "--max-len", "256"], "--max-len"),
             ([*sglang, "--compile", "off"], "--compile")]
    for argv, said in cases:
        err = run_err(capsys, *argv)
        assert err.count("\n") == 1 and said in err, (argv, err)
    cmd = dry_run(capsys, *base(folders, "--dtype", "float16"))
    assert cmd[cmd.index("--dtype") + 1] == "float16"          # SGLang's own flag: passed on (it was dropped)


def test_the_builtin_server_limits_and_pool_are_resolved_with_the_settings(folders):
    """resolve_settings decides the server's limits and its context drafter's pool with everything else (nothing
    downstream applies a default), and the settings it returns cannot be changed afterwards."""
    import dataclasses

    from sglang_eagle3.engine import settings as S
    plain = S.resolve_settings(folders["draft"], server=True)
    assert (plain.max_running, plain.max_queue, plain.max_len, plain.drafting.pool_tokens) == \
        (S.MAX_RUNNING, S.MAX_QUEUE, None, 0)
    hybrid = S.resolve_settings(folders["draft"], drafter="hybrid", server=True, max_running=4, max_len=256)
    assert (hybrid.max_running, hybrid.max_len, hybrid.drafting.pool_tokens) == (4, 256, S.POOL_TOKENS)
    assert S.resolve_settings(folders["draft"], drafter="hybrid").drafting.pool_tokens == 0     # one batch: no pool
    assert S.resolve_settings(folders["draft"], drafter="hybrid", server=True, pool_tokens=0).drafting.pool_tokens == 0
    assert [plain.slots_per_request(n) for n in (512, 10 ** 6, None)] == [512, S.MAX_LEN_CAP, S.MAX_LEN_CAP]
    assert hybrid.slots_per_request(128) == 128 and hybrid.slots_per_request(512) == 256
    for frozen, field in ((hybrid, "max_len"), (hybrid.drafting, "pool_tokens"), (hybrid.tree, "topk")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(frozen, field, 1)


def test_the_sglang_launch_resolves_the_settings_for_a_gpu(capsys, folders, monkeypatch, tmp_path):
    """serve on a CUDA host with SGLang (--engine auto picks it): the draft's profile gives its table for GPUs, not
    the one for this CPU (the settings were resolved for a CPU)."""
    import shutil

    from sglang_eagle3.engine.profile import host_kind
    draft = tmp_path / "draft"
    shutil.copytree(folders["draft"], draft)
    tree = {"cuda": (2, 1, 3), host_kind(): (3, 2, 6)}
    (draft / "spec_profile.json").write_text(json.dumps({
        "per_batch_size": PROFILE["per_batch_size"],
        "by_host": {kind: {"per_batch_size": {"1": dict(zip(("num_steps", "topk", "num_draft_tokens"), t))}}
                    for kind, t in tree.items()}}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(launcher.importlib.util, "find_spec", lambda n, *a: object())
    for engine in ("auto", "sglang"):
        cmd = dry_run(capsys, "--engine", engine, "--target", folders["target"], "--draft", str(draft))
        got = tuple(int(cmd[cmd.index(f"--speculative-{k}") + 1]) for k in ("num-steps", "eagle-topk",
                                                                             "num-draft-tokens"))
        assert got == tree["cuda"], (engine, cmd)
