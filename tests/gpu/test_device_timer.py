"""The GPU-clock stopwatch against CUDA events, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _work(a: torch.Tensor) -> None:
    for _ in range(20):  # ~1 ms of matmuls on an H200
        a.copy_(torch.tanh(a @ a))


def _event_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


@cuda
def test_device_timer_agrees_with_cuda_events_eager_and_in_a_graph():
    from vegas.kernels.device_timer import DeviceTimer

    timer = DeviceTimer("cuda")
    a = torch.randn(2048, 2048, device="cuda") / 64

    def timed():
        timer.start()
        _work(a)
        timer.stop()

    timed()  # warm-up: Triton compilation, cuBLAS handles
    timer.read(reset=True)
    assert timer.read() == (0.0, 0)

    ev = _event_ms(timed)
    ms, n = timer.read(reset=True)
    assert n == 1
    assert 0.8 * ev - 0.02 < ms <= ev + 0.02, (ms, ev)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        timed()
    torch.cuda.synchronize()
    assert timer.read(reset=True) == (0.0, 0)  # capture runs nothing

    replay_ms = [_event_ms(graph.replay) for _ in range(3)]
    ms, n = timer.read()
    assert n == 3
    assert 0.8 * sum(replay_ms) - 0.05 < ms <= sum(replay_ms) + 0.05, (ms, replay_ms)
    assert ms > 0.1  # the work was timed, not just the stamps
