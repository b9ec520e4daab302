"""The read-or-recompute decision for disk-only segments, from injected rates, and its step clock."""
from __future__ import annotations

import time

import pytest
import torch

from hypic.cache.disk_tier import ReadMeter
from hypic.engine.pic.read_cost import MIN_MEASURED_TOKENS, UNMEASURED_TOKENS_PER_S, ReadOrRecompute, StepClock
from hypic.engine.prefill_cost import StepWork


def _work(tokens: int) -> StepWork:
    return StepWork(tokens, 0.0, 0)


def test_reads_when_the_disk_beats_the_prefill_and_recomputes_otherwise():
    costs = ReadOrRecompute(lambda: 1e9, tokens_per_s=10_000, clock=lambda: 5.0)  # 1 GB/s disk, 10k tokens/s
    assert costs.read_deadline(nbytes=50_000_000, tokens=1000) == pytest.approx(5.1)  # 50 ms to read, 100 to recompute
    assert costs.read_deadline(nbytes=50_000_000, tokens=100) is None  # a short segment: 10 ms to recompute
    slow = ReadOrRecompute(lambda: 1e7, tokens_per_s=10_000)  # a 10 MB/s disk
    assert slow.read_deadline(nbytes=50_000_000, tokens=1000) is None
    assert (costs.recomputed, slow.recomputed) == (1, 1)


def test_reads_queue_behind_the_reads_under_way_and_recomputes_behind_the_recomputes():
    backlog = [30_000_000]
    costs = ReadOrRecompute(lambda: 1e9, tokens_per_s=10_000, reading_bytes=lambda: backlog[0], clock=lambda: 0.0)
    assert costs.read_deadline(50_000_000, 1000) == pytest.approx(0.1)  # 30 + 50 MB: 80 ms <= 100 ms
    backlog[0] = 60_000_000
    assert costs.read_deadline(50_000_000, 1000) is None  # 110 ms to read, 100 to recompute
    assert costs.read_deadline(50_000_000, 1000, recomputing=500) == pytest.approx(0.15)  # 150 ms to recompute


def test_the_read_rate_is_overall_throughput_not_the_rate_of_each_read():
    """Hand-worked: A reads 100 bytes over [0, 2], B 100 over [1, 3] (at once), C 50 over [10, 11]
    (alone). Each read's own rate is 50 B/s; the disk delivered 250 bytes in 4 s of reading."""
    now = [0.0]
    meter = ReadMeter(clock=lambda: now[0])
    assert meter.bytes_per_s is None
    for at, event, nbytes in [(0, "start", 0), (1, "start", 0), (2, "end", 100), (3, "end", 100),
                              (10, "start", 0), (11, "end", 50)]:
        now[0] = at
        meter.started() if event == "start" else meter.finished(nbytes)
        if at == 3:
            assert meter.bytes_per_s == pytest.approx(200 / 3)
    assert (meter.nbytes, meter.busy_s, meter.bytes_per_s) == (250, pytest.approx(4.0), pytest.approx(62.5))


def test_the_prefill_rate_is_a_constant_until_measured_then_follows_the_steps():
    costs = ReadOrRecompute(lambda: 1e9)
    assert costs.tokens_per_s == UNMEASURED_TOKENS_PER_S and not costs.measured
    costs.observe(_work(MIN_MEASURED_TOKENS - 1), 1e-6)  # too small a step to say anything
    assert not costs.measured
    costs.observe(_work(1000), 0.1)
    assert costs.measured and costs.tokens_per_s == pytest.approx(10_000)
    costs.observe(_work(1000), 0.05)  # a faster step moves the rate towards it, not onto it
    assert 10_000 < costs.tokens_per_s < 20_000


def test_a_kept_prefill_rate_starts_the_next_engine_until_its_own_steps_replace_it(tmp_path):
    kept = tmp_path / "rates.json"
    first = ReadOrRecompute(lambda: 1e9, kept=kept)
    first.keep()
    assert not kept.exists()  # nothing measured: nothing kept
    first.observe(_work(1000), 0.1)
    first.keep()
    second = ReadOrRecompute(lambda: 1e9, kept=kept)
    assert second.tokens_per_s == pytest.approx(10_000) and not second.measured
    second.observe(_work(1000), 0.5)  # its own first step replaces the kept rate
    assert second.tokens_per_s == pytest.approx(2000)
    kept.write_text('{"prefill_tokens_per_s": ')  # torn
    assert ReadOrRecompute(lambda: 1e9, kept=kept).tokens_per_s == UNMEASURED_TOKENS_PER_S


def test_the_step_clock_hands_measured_steps_to_the_cost_model():
    costs = ReadOrRecompute(lambda: 1e9)
    clock = StepClock(torch.device("cpu"), [costs])
    clock.start(None)  # a step composing cached pieces: not measured
    clock.stop()
    assert not costs.measured
    began = time.perf_counter()
    clock.start(_work(500))
    time.sleep(0.02)
    clock.stop()
    elapsed = time.perf_counter() - began
    assert 500 / elapsed <= costs.tokens_per_s <= 500 / 0.02


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_step_clock_reads_cuda_events_without_waiting():
    costs = ReadOrRecompute(lambda: 1e9)
    clock = StepClock(torch.device("cuda"), [costs])
    x = torch.randn(4096, 4096, device="cuda")
    clock.start(_work(1000))
    for _ in range(20):
        x = x @ x / 64
    clock.stop()
    torch.cuda.synchronize()
    clock.start(None)
    clock.stop()  # the first step's events have completed by now
    assert costs.measured and costs.tokens_per_s > 0
