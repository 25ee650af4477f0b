"""`andrea bench`'s timing (andrea.bench.time_per_call) against a simulated GPU stream and a fake
clock: what a timing counts, not how fast anything is.

The simulated stream is the CUDA model: the host enqueues a call in `host_ms`, the device runs
it in `device_ms` once the host has enqueued it and the call before has finished, and an event
completes when the stream reaches it. Timing one call between events after a synchronize counts
the host's enqueue time as device time; back-to-back calls hide it behind the kernels.
"""

from __future__ import annotations

import pytest
import torch

from andrea import bench


class SimulatedStream:
    def __init__(self) -> None:
        self.host = 0.0  # ms on the host's clock
        self.device_free = 0.0  # when the device finishes what is queued
        self.launched: list[str] = []

    def enqueue(self, name: str, host_ms: float, device_ms: float) -> None:
        self.host += host_ms
        self.device_free = max(self.host, self.device_free) + device_ms
        self.launched.append(name)

    def event_time(self) -> float:
        return max(self.host, self.device_free)  # the stream reaches the event after its work


class SimulatedCudaTimer:
    """CudaTimer's contract on the simulated stream: start() records an event after whatever is
    queued, stop() records one and waits for it (the host catches up with the device)."""

    def __init__(self, stream: SimulatedStream) -> None:
        self.stream = stream

    def start(self) -> None:
        self.begin = self.stream.event_time()

    def stop(self) -> float:
        end = self.stream.event_time()
        self.stream.host = end  # synchronize
        return end - self.begin


HOST_MS, KERNEL_MS = 0.15, 0.3  # a fwd+bwd's Python and launches; its kernels at the gpt2 shape


def test_back_to_back_calls_hide_the_host_time_that_one_call_counts() -> None:
    stream = SimulatedStream()
    timer = SimulatedCudaTimer(stream)

    def fwd_bwd(_: object) -> None:
        stream.enqueue("fwd_bwd", HOST_MS, KERNEL_MS)

    one = bench.time_per_call(timer, repeats=5, warmup=1, timed=fwd_bwd, max_calls=1)
    assert one.calls == 1 and one.ms == pytest.approx(HOST_MS + KERNEL_MS)  # the old bias: +50%
    many = bench.time_per_call(timer, repeats=5, warmup=1, timed=fwd_bwd)
    # Enough calls for TARGET_MS by the one-call estimate (at most 0.45 ms), at most MAX_CALLS.
    assert bench.TARGET_MS / (HOST_MS + KERNEL_MS) <= many.calls <= bench.MAX_CALLS
    assert KERNEL_MS <= many.ms <= KERNEL_MS + HOST_MS / many.calls
    assert abs(many.ms - KERNEL_MS) / KERNEL_MS < 0.02


def test_a_backward_is_timed_without_its_prepared_forwards() -> None:
    stream = SimulatedStream()
    timer = SimulatedCudaTimer(stream)
    fwd_ms, bwd_ms = 0.1, 0.25

    def forward() -> int:
        stream.enqueue("fwd", HOST_MS, fwd_ms)
        return len(stream.launched)

    backwards: list[int] = []

    def backward(graph: int) -> None:
        backwards.append(graph)
        stream.enqueue("bwd", HOST_MS, bwd_ms)

    timing = bench.time_per_call(timer, repeats=3, warmup=2, timed=backward, prepare=forward)
    assert timing.calls > 1
    assert bwd_ms <= timing.ms <= bwd_ms + HOST_MS / timing.calls  # no forward in it
    # Every backward ran on a forward of its own, all of a timing's forwards before its start.
    assert len(set(backwards)) == len(backwards) == 2 + 1 + 3 * timing.calls
    last = stream.launched[-2 * timing.calls:]
    assert last == ["fwd"] * timing.calls + ["bwd"] * timing.calls


def test_host_bound_calls_are_timed_as_the_host_makes_them() -> None:
    """When the host is slower than the kernels (tiny shapes), a call costs what the host
    takes: the timing says so instead of reporting idle kernels' time."""
    stream = SimulatedStream()
    timer = SimulatedCudaTimer(stream)
    timing = bench.time_per_call(
        timer, repeats=3, warmup=0, timed=lambda _: stream.enqueue("k", 0.2, 0.05))
    assert timing.calls == bench.MAX_CALLS
    assert timing.ms == pytest.approx(0.2 + 0.05 / timing.calls)


def test_wall_timer_counts_the_calls_and_not_their_preparation(monkeypatch) -> None:
    """The CPU path: perf_counter around the same back-to-back calls; prepare() is outside."""
    clock = [100.0]  # seconds
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

    def prepare() -> None:
        clock[0] += 1.0  # a forward that must not count

    def timed(_: object) -> None:
        clock[0] += 0.004  # 4 ms of CPU work

    timing = bench.time_per_call(bench.WallTimer(), repeats=3, warmup=1, timed=timed,
                                 prepare=prepare)
    assert timing.calls == 5  # 20 ms / 4 ms
    assert timing.ms == pytest.approx(4.0)
    slow = bench.time_per_call(bench.WallTimer(), repeats=1, warmup=0,
                               timed=lambda _: clock.__setitem__(0, clock[0] + 0.5))
    assert (slow.calls, slow.ms) == (1, pytest.approx(500.0))  # one call already spans 20 ms


class FakeClock:
    """perf_counter for bench_attention on the CPU: a fake attention advances it by its cost
    times the machine's load, which falls as the run goes on (another job finishing)."""

    FWD_MS, BWD_MS = 10.0, 25.0

    def __init__(self) -> None:
        self.s = 100.0
        self.start = self.s

    def load(self) -> float:
        return max(1.0, 4.0 - (self.s - self.start) / 0.3)  # 4x at first, 1x after ~1 s

    def spend(self, ms: float) -> None:
        self.s += ms * self.load() * 1e-3


def fake_attention(clock: FakeClock, log: list[str]):
    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):  # type: ignore[override]
            clock.spend(clock.FWD_MS)
            log.append("F")
            return q + k + v

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            clock.spend(clock.BWD_MS)
            log.append("B")
            return grad, grad, grad

    return lambda q, k, v: Attention.apply(q, k, v)


class LoggedWallTimer(bench.WallTimer):
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def start(self) -> None:
        self.log.append("[")
        super().start()

    def stop(self) -> float:
        self.log.append("]")
        return super().stop()


def test_attention_modes_are_timed_in_rounds_under_the_same_load(monkeypatch) -> None:
    """Each round times fwd, bwd and fwd_bwd once, so a load that changes during the run
    reaches the three medians alike; timed one mode after another, the later modes ran on a
    quieter machine and backward alone came out slower than forward + backward."""
    clock, log = FakeClock(), []
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock.s)
    monkeypatch.setattr(bench, "_attention_fn", lambda backend: fake_attention(clock, log))
    monkeypatch.setattr(bench, "timer_for", lambda device: LoggedWallTimer(log))
    repeats = 3
    row = bench.bench_attention("tiny", (1, 1, 4, 2), "sdpa", "fp32", torch.device("cpu"),
                                repeats=repeats, warmup=1)
    # What ran between each timer.start() and stop(): forwards only, backwards only (their
    # forwards prepared before the start), or both.
    inside = [t.split("]")[0] for t in "".join(log).split("[")[1:]]
    modes = [{"F": "fwd", "B": "bwd", "FB": "fwd_bwd"}["".join(dict.fromkeys(t))] for t in inside]
    assert modes[-3 * repeats:] == ["fwd", "bwd", "fwd_bwd"] * repeats
    assert row.ms["bwd"] < row.ms["fwd_bwd"]  # one after another: 56.8 ms against 43.8
