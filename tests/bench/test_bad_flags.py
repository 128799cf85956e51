"""The bench scripts refuse bad flags in one line, before any model loads."""
from __future__ import annotations


def test_bench_scripts_refuse_bad_flags_in_one_line(capsys, monkeypatch, tmp_path):
    """bench_decode --parts, bench_serving's flags and bench_llamacpp's (and a missing llama.cpp build): one line
    naming the flag, exit 2, before any model loads."""
    import socket

    from sglang_eagle3.bench import llamacpp as bench_llamacpp
    from sglang_eagle3.bench.decode_cli import main as decode_main
    from sglang_eagle3.bench.serving import main as serving_main
    from sglang_eagle3.formats import llamacpp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = f"http://127.0.0.1:{s.getsockname()[1]}"              # closed again: nothing listens there
    cases = [(decode_main, ["--parts", "speed,warp"], "--parts warp: choose from"),
             (serving_main, ["--start", "builtin", "--concurrency", "1,x"], "--concurrency must be comma-separated"),
             (serving_main, ["--start", "builtin", "--concurrency", "0"], "--concurrency levels must be >= 1"),
             (serving_main, ["--concurrency", "1"], "give --url NAME=URL"),
             (serving_main, ["--url", "nourl", "--concurrency", "1", "--out", str(tmp_path / "s.json")],
              "--url 'nourl': expected NAME=URL"),
             # a server that does not answer: named before any data is read (it was an httpx traceback)
             (serving_main, ["--url", f"a={nobody}/v1", "--data", str(tmp_path / "no-data"), "--out",
                             str(tmp_path / "s.json")], f"--url a={nobody}/v1: no server answers there (ConnectError"),
             (serving_main, ["--start", "builtin", "--requests", "0"], "--requests must be >= 1, got 0"),
             (serving_main, ["--start", "builtin", "--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
             (serving_main, ["--start", "builtin", "--temperature", "-1"], "--temperature must be >= 0, got -1"),
             (serving_main, ["--start", "builtin", "--timeout", "0"], "--timeout must be > 0, got 0"),
             (bench_llamacpp.main, ["--draft-lengths", "1,two"], "--draft-lengths must be comma-separated integers"),
             (bench_llamacpp.main, ["--draft-lengths", "0,2"], "--draft-lengths must all be >= 1")]
    for main, argv, phrase in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert phrase in err and "Traceback" not in err and len(err.splitlines()) == 1, (argv, err)
    monkeypatch.setattr(llamacpp, "is_built", lambda: False)
    assert bench_llamacpp.main([]) == 2
    assert "no llama.cpp build: run `make llamacpp` first" in capsys.readouterr().err
