"""The thread governor: fewer threads when other processes take cores, back when they leave; greedy output does not
depend on the thread count."""
from __future__ import annotations

import pytest
import torch

from sglang_eagle3.engine import threads as T
from sglang_eagle3.engine.threads import CpuTimes, ThreadGovernor, read_cpu_times, threads_for


class FakeClock:
    """CPU-time counters of a machine where our process uses `ours` cores and the others `others` cores."""

    def __init__(self):
        self.t = self.busy = self.self_s = 0.0

    def advance(self, seconds: float, ours: float, others: float) -> None:
        self.t += seconds
        self.self_s += ours * seconds
        self.busy += (ours + others) * seconds

    def read(self) -> CpuTimes:
        return CpuTimes(self.busy, self.self_s, self.t)


def governor_on(clock: FakeClock, cores: int = 2, most: int = 2, monkeypatch=None):
    monkeypatch.setattr(T.time, "monotonic", lambda: clock.t)
    monkeypatch.setattr(T, "allowed_cpus", lambda: set(range(cores)))
    monkeypatch.delenv("EAGLE3_ADAPT_THREADS", raising=False)
    calls = []
    g = ThreadGovernor(most=most, reader=clock.read, set_threads=calls.append)
    return g, calls


@pytest.mark.parametrize("others, cores, most, want", [
    (0.0, 2, 2, 2), (0.3, 2, 2, 2), (0.5, 2, 2, 1), (1.0, 2, 2, 1), (2.0, 2, 2, 1),
    (1.0, 8, 8, 7), (3.2, 8, 8, 5), (0.0, 8, 4, 4), (7.9, 8, 8, 1)])
def test_threads_for_leaves_the_cores_others_take(others, cores, most, want):
    assert threads_for(others, cores, most) == want


def test_a_busy_neighbour_takes_a_thread_and_gives_it_back(monkeypatch):
    clock = FakeClock()
    g, calls = governor_on(clock, monkeypatch=monkeypatch)
    assert g.enabled and g.update() == 2
    for _ in range(2):                              # two readings agree: one thread beside a busy loop
        clock.advance(0.6, ours=2.0 * 2 / 3, others=2 / 3)
        g.update()
    assert g.threads == 1 and calls == [1]
    clock.advance(0.6, ours=1.0, others=1.0)
    assert g.update() == 1 and calls == [1]         # still busy: stays
    for _ in range(2):                              # the neighbour left
        clock.advance(0.6, ours=1.0, others=0.02)
        g.update()
    assert g.threads == 2 and calls == [1, 2]


def test_one_burst_does_not_flip_it_and_readings_wait_for_the_interval(monkeypatch):
    clock = FakeClock()
    g, calls = governor_on(clock, monkeypatch=monkeypatch)
    clock.advance(0.6, ours=1.0, others=1.0)
    g.update()                                      # one reading says 1 thread
    clock.advance(0.6, ours=2.0, others=0.0)
    g.update()                                      # the next disagrees
    clock.advance(0.1, ours=1.0, others=1.0)        # too soon for a reading
    g.update()
    assert g.threads == 2 and calls == []


def test_off_by_environment_or_with_one_thread(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(T.time, "monotonic", lambda: clock.t)
    monkeypatch.setenv("EAGLE3_ADAPT_THREADS", "0")
    calls = []
    g = ThreadGovernor(most=2, reader=clock.read, set_threads=calls.append)
    clock.advance(1.0, ours=1.0, others=2.0)
    assert not g.enabled and g.update() == 2 and calls == []
    monkeypatch.delenv("EAGLE3_ADAPT_THREADS")
    assert not ThreadGovernor(most=1, reader=clock.read, set_threads=calls.append).enabled


def test_no_proc_means_no_governor(monkeypatch):
    g = ThreadGovernor(most=2, reader=lambda: None, set_threads=lambda n: None)
    assert not g.enabled and g.update() == 2


def test_proc_counters_are_read_here():
    t = read_cpu_times()
    assert t is not None and t.busy_s > 0 and t.self_s >= 0


def test_greedy_output_does_not_depend_on_the_thread_count():
    """The governor may change the thread count between steps: each kernel splits its work by output columns, so a
    step's numbers (and greedy tokens) are the same on 1 thread and on 2."""
    from conftest import random_draft, tiny_target

    from sglang_eagle3.engine.engine import SpeculativeEngine
    from sglang_eagle3.engine.settings import Settings
    from sglang_eagle3.engine.speculation import SpecConfig
    from sglang_eagle3.engine.verify import SamplingParams
    target, _ = tiny_target(dtype=torch.bfloat16)
    engine = SpeculativeEngine(target, random_draft(target), Settings(tree=SpecConfig(3, 2, 6)))
    prompts = [[5, 9, 17, 3, 41], [7, 7, 2, 60, 11, 23]]
    params = SamplingParams(max_new_tokens=24)
    before = torch.get_num_threads()
    outs = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs[n] = [o.token_ids for o in engine.generate(prompts, params, batch_size=2)[0]]
    finally:
        torch.set_num_threads(before)
    assert outs[1] == outs[2]


def test_the_benchmarks_busy_process_runs_until_stopped():
    from sglang_eagle3.bench.contention import busy, start_busy, stop_busy
    assert start_busy("idle", "testbed", "bfloat16") is None
    proc = start_busy("loop", "testbed", "bfloat16")
    try:
        assert proc.poll() is None                      # computing
    finally:
        stop_busy(proc)
    assert proc.poll() is not None
    with busy("loop", "testbed", "bfloat16"):
        pass


def test_contention_loads_are_checked_in_one_line(capsys):
    from sglang_eagle3.bench.decode_cli import main
    assert main(["--parts", "contention", "--loads", "loop,idle"]) == 2
    assert "--loads loop,idle: start with idle" in capsys.readouterr().err
    assert main(["--parts", "contention", "--loads", "idle,bogus"]) == 2
    assert "choose from idle, loop, torch2, generate" in capsys.readouterr().err


def test_the_contention_report_shows_shares_and_checks():
    from sglang_eagle3.bench.decode_report import render

    class Args:
        pass
    row = lambda v, s, share: {"vanilla_tokens_per_s": v, "speculative_tokens_per_s": s, "verify8_s": 0.02 / share,  # noqa: E731
                               "threads": 1, "other_cores": 1.0, "identical_to_idle": {"vanilla": 2, "speculative": 2},
                               "vanilla_share": v / 60, "speculative_share": s / 90, "verify8_share": share,
                               "speedup": s / v}
    ct = {"loads": {"idle": {**row(60, 90, 1.0), "vanilla_tokens_per_s_governor_off": 61,
                             "speculative_tokens_per_s_governor_off": 90},
                    "loop": row(33, 40, 0.5), "torch2": row(10, 20, 0.2)},
          "prompts": 2, "max_new_tokens": 16, "governor": True, "cores": 2,
          "idle_governor_on_over_off": {"vanilla": 60 / 61, "speculative": 1.0}}
    text = render({"meta": {"target": "t", "dtype": "bfloat16", "threads": 2}, "contention": ct}, Args())
    assert "| a 1-thread busy loop" in text and "55%" in text
    assert "| beside a 1-thread busy loop: vanilla and speculative keep >= 45% of idle |  NO | 55% / 44% |" in text
    assert "| beside a 2-thread torch job: vanilla and speculative keep >= 25% of idle |  NO | 17% / 22% |" in text
    assert "idle speed with the governor within 3% of without" in text and "0.984x" in text


def test_a_long_prompt_decodes_the_same_tokens_on_whatever_threads_the_governor_chose(monkeypatch):
    """The embedded target, bf16: the prefill of a long prompt runs on the starting thread count (oneDNN's many-row
    sums depend on it: the first differing token came 44 tokens in), the steps on the governor's."""
    from sglang_eagle3.engine.loader import load_engine
    from sglang_eagle3.engine.settings import Settings
    from sglang_eagle3.engine.verify import SamplingParams
    engine = load_engine("testbed", Settings("bfloat16"))
    text = " ".join(f"In year {1900 + i} the town council of Rivermouth met {i % 7 + 2} times and argued about the "
                    f"bridge, the harbour tax and the school roof." for i in range(40))
    chat = [{"role": "user", "content": "Summarise this record:\n" + text}]
    assert len(engine.encode(chat)) > 600
    params = SamplingParams(max_new_tokens=48)
    g = T.governor()
    before = torch.get_num_threads()
    monkeypatch.setattr(g, "most", 2)
    monkeypatch.setattr(g, "update", lambda: g.threads)             # pinned: no readings during the test
    try:
        g.threads = 2
        torch.set_num_threads(2)
        on_two = engine.generate([chat], params)[0][0].token_ids
        g.threads = 1                                              # as beside a busy process
        torch.set_num_threads(1)
        on_one = engine.generate([chat], params)[0][0].token_ids
    finally:
        g.threads = g.most
        torch.set_num_threads(before)
    assert on_one == on_two
