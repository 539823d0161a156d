"""Counters of one worker's Vegas proposer: acceptance, timings, per-request counts.

Timings are CUDA events resolved when they have completed (under async scheduling the host
runs ahead of the GPU), so reading them never waits unless asked to.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["FORWARD_EVENTS_DROP", "FORWARD_EVENTS_MAX", "ProposerStats", "StatsRecorder", "take_finished",
           "timing_event"]

#: forward event pairs kept before the oldest are dropped (forwards without a proposal, e.g. on
#: idle tensor-parallel ranks, are never resolved by a proposal)
FORWARD_EVENTS_MAX = 4096
#: event pairs dropped at once when :data:`FORWARD_EVENTS_MAX` is exceeded
FORWARD_EVENTS_DROP = 2048


@dataclass
class ProposerStats:
    """Counters of one worker's proposer (reset with :meth:`VegasProposer.reset_stats`)."""

    proposals: int = 0
    draft_steps: int = 0
    prefill_skips: int = 0  # steps that did not draft: their forward carried >= prefill_skip_tokens prompt tokens
    iterations: int = 0  # verified iterations of requests that had drafts
    emitted: int = 0  # tokens emitted by those iterations (accepted + bonus)
    select_ms: float = 0.0  # selection inside verification: plan + scoring + top-k (GPU clock, graphs included)
    select_timed: int = 0  # timed intervals summed into select_ms (two per verification forward)
    draft_ms: float = 0.0  # draft tables + γ draft forwards incl. sampling (CUDA events)
    verify_fwd_ms: float = 0.0  # layer 0 .. last layer of full-attention forwards (CUDA events)
    propose_wall_ms: float = 0.0  # host wall time inside propose()

    @property
    def acceptance_length(self) -> float:
        return self.emitted / self.iterations if self.iterations else 0.0

    def as_dict(self) -> dict:
        return {**self.__dict__, "acceptance_length": self.acceptance_length}


def timing_event() -> torch.cuda.Event:
    """A timing CUDA event recorded on the current stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def take_finished(items: list, event_at: int) -> list:
    """Remove and return the entries of ``items`` whose CUDA event ``entry[event_at]`` has
    completed."""
    ready, rest = [], []
    for item in items:
        (ready if item[event_at].query() else rest).append(item)
    items[:] = rest
    return ready


@dataclass
class StatsRecorder:
    """:class:`ProposerStats` plus the per-request counts and the events still pending."""

    stats: ProposerStats = field(default_factory=ProposerStats)
    #: request id -> [iterations, drafted, accepted] since the last reset
    requests: dict[str, list[int]] = field(default_factory=dict)
    #: (stats field, start event, end event) of timed phases
    pending_timings: list = field(default_factory=list)
    #: async scheduling: (event, pinned valid counts, req_ids, drafts per request)
    pending_counts: list = field(default_factory=list)

    def reset(self) -> None:
        self.stats, self.requests = ProposerStats(), {}

    def add_forward(self, forward_events: list, start, end) -> None:
        """Keep one runner forward's events in ``forward_events`` (bounded)."""
        if len(forward_events) > FORWARD_EVENTS_MAX:
            del forward_events[:FORWARD_EVENTS_DROP]
        forward_events.append((start, end))

    def count_iteration(self, request_id: str, emitted: int, drafted: int) -> None:
        """One verified iteration of a request that had drafts: ``emitted`` = accepted + bonus."""
        self.stats.iterations += 1
        self.stats.emitted += emitted
        counts = self.requests.setdefault(request_id, [0, 0, 0])  # iterations, drafted, accepted
        counts[0] += 1
        counts[1] += drafted
        counts[2] += emitted - 1

    def resolve(self, state, wait: bool = False) -> None:
        """Fold finished timings (``state``'s forward events and, with ``wait``, its selection
        timer) and acceptance counts into the stats; with ``wait``, synchronize first."""
        if wait and torch.cuda.is_available():
            torch.cuda.synchronize()
        for kind, start, end in take_finished(self.pending_timings, 2):
            setattr(self.stats, kind, getattr(self.stats, kind) + start.elapsed_time(end))
        if wait and state.timer is not None:  # reading it waits for the GPU: only on request
            ms, count = state.timer.read(reset=True)
            self.stats.select_ms += ms
            self.stats.select_timed += count
        for start, end in take_finished(state.fwd_events, 1):
            self.stats.verify_fwd_ms += start.elapsed_time(end)
        for _, counts, req_ids, num_draft in take_finished(self.pending_counts, 0):
            for request_id, emitted, drafted in zip(req_ids, counts.tolist(), num_draft.tolist()):
                if drafted > 0 and emitted > 0:
                    self.count_iteration(request_id, emitted, drafted)
