"""A GPU-side stopwatch that also runs inside CUDA graphs.

CUDA events cannot time work replayed from a captured graph: the event is recorded once, at
capture. :class:`DeviceTimer` instead launches two one-thread Triton kernels that read the
GPU's nanosecond clock (``%globaltimer``, via :func:`triton.language.extra.cuda.globaltimer`):
``start()`` stores it, ``stop()`` adds ``now - start`` to a running total and counts the
interval. Both are ordinary kernels on the current stream, so they are captured into a graph
and run, in stream order, on every replay. The host reads the totals only in :meth:`read`.

Resolution: the global timer ticks every 32 ns to 1 µs depending on the GPU; each interval
also includes the launch latency of the ``stop`` kernel (~1–3 µs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer


@triton.jit
def _stamp_kernel(buf_ptr, STOP: tl.constexpr):
    now = globaltimer()
    if STOP:
        tl.store(buf_ptr + 1, tl.load(buf_ptr + 1) + (now - tl.load(buf_ptr)))
        tl.store(buf_ptr + 2, tl.load(buf_ptr + 2) + 1)
    else:
        tl.store(buf_ptr, now)


class DeviceTimer:
    """Sums GPU time between :meth:`start` and :meth:`stop`, also under CUDA-graph replay.

    Args:
        device: a CUDA device.

    The state is one ``(3,)`` int64 tensor on ``device``: last start stamp (ns), total (ns),
    number of intervals. Create the timer before capturing a graph that uses it: the graph
    keeps the tensor's address.
    """

    def __init__(self, device: torch.device | str):
        self.buf = torch.zeros(3, dtype=torch.int64, device=device)

    def start(self) -> None:
        """Stamp the start of an interval (a kernel on the current stream)."""
        _stamp_kernel[(1,)](self.buf, STOP=False, num_warps=1)

    def stop(self) -> None:
        """Add the time since the last :meth:`start` to the total (a kernel on the current stream)."""
        _stamp_kernel[(1,)](self.buf, STOP=True, num_warps=1)

    def read(self, reset: bool = False) -> tuple[float, int]:
        """``(total milliseconds, intervals)`` of the work finished so far on the stream.

        Synchronizes the device first. With ``reset``, zeroes the totals afterwards.
        """
        torch.cuda.synchronize(self.buf.device)
        total_ns, count = self.buf[1:].tolist()
        if reset:
            self.buf[1:].zero_()
        return total_ns / 1e6, int(count)

def interleaved(fns, reps, iters):
    """Time GPU work by CUDA events: ``{name: [ms per call of each repeat]}``, after one warm-up
    call of each; the variants take turns in every repeat (a drifting clock or load meets them
    alike), each repeat timing ``iters`` back-to-back calls of ``fns[name]()``."""
    res = {n: [] for n in fns}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    for _ in range(reps):
        for name, fn in fns.items():
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(iters):
                fn()
            e1.record()
            torch.cuda.synchronize()
            res[name].append(e0.elapsed_time(e1) / iters)
    return res
