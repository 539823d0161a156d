"""Which steps draft, decided where vLLM schedules them (pure Python; no vLLM import).

Under asynchronous scheduling vLLM's scheduler reserves the next step's draft slots while it
schedules the current one: ``AsyncScheduler._update_after_schedule`` gives every decoding
request ``SchedulerOutput.num_spec_tokens_to_schedule`` placeholders, and the next step verifies
that many drafts per request (``vllm/v1/core/sched/async_scheduler.py``, vLLM 0.24.0). A drafter
that merely returns no drafts still costs the next step its ``γ + 1``-token verification.

Vegas sets ``num_spec_tokens_to_schedule`` itself, 0 or γ per step (:meth:`StepSwitch.decide`),
before the async scheduler reads it, and the V2 speculator reads the same number from the step's
``SchedulerOutput`` (:meth:`~vegas.vllm_plugin.runners.v2.VegasSpeculator.on_schedule`): a step
scheduled with 0 neither selects nor drafts, and the next step verifies one token per request,
a plain step. Two rules set 0:

* ``VegasConfig.vllm.prefill_skip_tokens``: a step that carries at least that many prompt tokens
  runs plainly, so that requests waiting for their first token are not held up by a draft phase;
* ``VegasConfig.vllm.fallback``: :class:`MeasuredFallback` keeps whichever of drafting and plain
  steps gave more output tokens per second on this engine's recent decode steps.

Correctness does not depend on either: verification accepts exactly what the target model
samples, whatever was drafted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

__all__ = ["DEFAULT_PREFILL_SKIP_TOKENS", "MeasuredFallback", "StepSwitch", "drafts_next_step", "prompt_tokens",
           "prefill_skip_tokens"]

logger = logging.getLogger("vegas.vllm")


#: ``vllm.prefill_skip_tokens`` in force where it is None and the scheduler decides (tokens)
DEFAULT_PREFILL_SKIP_TOKENS = 2048


def prefill_skip_tokens(setting: int | None, scheduler_decides: bool) -> int:
    """``VegasConfig.vllm.prefill_skip_tokens`` in force: the setting, or where it is None
    :data:`DEFAULT_PREFILL_SKIP_TOKENS` when the scheduler decides which steps draft (V2 runner,
    asynchronous scheduling: a skipped step is then a plain step, measured faster to the first
    token) and 0 elsewhere (there the next step still verifies γ + 1 tokens a request; not measured)."""
    if setting is not None:
        return int(setting)
    return DEFAULT_PREFILL_SKIP_TOKENS if scheduler_decides else 0


def prompt_tokens(num_scheduled_tokens: Mapping[str, int], spec_decode_tokens: Mapping[str, Sequence]) -> int:
    """Prompt (prefill) tokens of a scheduled step: every request's scheduled tokens beyond one
    sampled token and its scheduled drafts (``SchedulerOutput.num_scheduled_tokens`` and
    ``scheduled_spec_decode_tokens``). A decoding request contributes 0; a prefill chunk of ``n``
    tokens ``n - 1``."""
    return sum(max(n - 1 - len(spec_decode_tokens.get(req, ())), 0) for req, n in num_scheduled_tokens.items())


def drafts_next_step(num_scheduled_tokens: Mapping[str, int], spec_decode_tokens: Mapping[str, Sequence],
                     gamma: int, prefill_skip_tokens: int) -> int:
    """Drafts per request the step's drafter makes and the next step verifies: 0 when the step
    carries at least ``prefill_skip_tokens`` prompt tokens (``prefill_skip_tokens > 0``), else γ."""
    if prefill_skip_tokens > 0 and prompt_tokens(num_scheduled_tokens, spec_decode_tokens) >= prefill_skip_tokens:
        return 0
    return gamma


class MeasuredFallback:
    """Draft or step plainly, by the output tokens per second each mode measures on this engine.

    Only decode-only steps (no prompt tokens) are measured: the interval between two consecutive
    step outputs and the tokens the later one emitted. The mode in force runs for ``interval``
    measured steps; then the other mode runs for a probe of ``settle + window`` steps (the first
    ``settle`` are not measured: under asynchronous scheduling a step still verifies the previous
    step's drafts), and the probe's tokens per second are compared with those of the last
    ``window`` steps before it. The other mode takes over when it was faster by more than
    ``margin``; otherwise the next probe comes after twice the interval (at most
    ``max_interval``), so that a settled decision costs little. A gap longer than ``max_gap_s``
    between step outputs (an idle engine) or a step with prompt tokens restarts the count of
    settled steps.

    The same idea as the HF backend's :class:`vegas.draft_policy.DraftPolicy` (draft while it
    pays, probe the alternative now and then), with measured time instead of a cost model:
    on vLLM the cost of a step depends on the batch, the context and on whether CUDA graphs
    replay it (a plain step at γ > 0 runs vLLM's piecewise graphs), which no fixed ratio
    captures.

    Args:
        gamma: γ, draft tokens per request of a drafting step.
        interval: measured steps of the mode in force before the first probe (>= ``window``).
        max_interval: the longest interval between probes (steps).
        window: measured steps on each side of a comparison.
        settle: steps after a change of mode that are not measured.
        margin: the other mode must be faster by more than this share to take over.
        max_gap_s: a longer interval between step outputs is not a step's time (seconds).
        clock: seconds, monotonic (``time.monotonic``; tests pass their own).
    """

    def __init__(self, gamma: int, *, interval: int = 64, max_interval: int = 1024, window: int = 8,
                 settle: int = 2, margin: float = 0.05, max_gap_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 1 <= window <= interval <= max_interval:
            raise ValueError(f"need 1 <= window <= interval <= max_interval, got {window}, {interval}, {max_interval}")
        self.gamma = gamma
        self.base_interval, self.interval, self.max_interval = interval, interval, max_interval
        self.window, self.settle, self.margin, self.max_gap_s = window, settle, margin, max_gap_s
        self.clock = clock
        #: the mode in force (True: drafting)
        self.drafting = True
        #: whether the other mode runs now, as a probe
        self.probing = False
        #: measured steps left in the current phase (the mode in force, or the probe)
        self.steps_left = interval
        #: tokens per second of the last window of each mode (True: drafting), None before any
        self.rates: dict[bool, float | None] = {True: None, False: None}
        self.switches = 0  # decisions that changed the mode in force
        self.probes = 0
        self._tokens, self._seconds = 0, 0.0
        self._settled = 0
        self._last: float | None = None

    @property
    def drafting_now(self) -> bool:
        """Whether the steps scheduled now draft (the mode in force, or the probe's)."""
        return self.drafting != self.probing

    def drafts(self) -> int:
        """Drafts per request of the step scheduled now: γ or 0."""
        return self.gamma if self.drafting_now else 0

    def observe(self, drafts: int, tokens: int, decode_only: bool) -> None:
        """A step's output arrived: the step was scheduled with ``drafts`` per request, emitted
        ``tokens`` in all, and carried no prompt tokens (``decode_only``)."""
        now = self.clock()
        last, self._last = self._last, now
        if not decode_only or last is None or now - last > self.max_gap_s or (drafts > 0) != self.drafting_now:
            self._settled = 0  # not a step of the mode scheduled now, or not a step's time
            return
        self._settled += 1
        if self._settled <= self.settle:
            return
        self.steps_left -= 1
        if self.steps_left < self.window:  # the last window of the phase is measured
            self._tokens += tokens
            self._seconds += now - last
        if self.steps_left <= 0:
            self._end_phase()

    def _end_phase(self) -> None:
        mode = self.drafting_now
        if self._seconds > 0:
            self.rates[mode] = self._tokens / self._seconds
        self._tokens, self._seconds = 0, 0.0
        self._settled = 0
        if not self.probing:  # the mode in force measured its last window: probe the other
            self.probing = True
            self.probes += 1
            self.steps_left = self.window
            return
        self.probing = False
        kept, other = self.rates[self.drafting], self.rates[not self.drafting]
        if kept is not None and other is not None and other > kept * (1.0 + self.margin):
            self.drafting = not self.drafting
            self.switches += 1
            self.interval = self.base_interval
            level = logging.INFO  # a change of mode: the user sees it
        else:
            self.interval = min(2 * self.interval, self.max_interval)
            level = logging.DEBUG
        logger.log(level, "vegas: fallback %s (measured output tok/s: drafting %s, plain steps %s; next probe in %d steps)",
                   "drafts" if self.drafting else "takes plain steps", _rate(self.rates[True]),
                   _rate(self.rates[False]), self.interval)
        self.steps_left = self.interval


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


class StepSwitch:
    """The scheduler's per-step decision (0 or γ drafts) from the prefill rule and, when on, the
    measured fallback.

    Args:
        gamma: γ.
        prefill_skip_tokens: ``VegasConfig.vllm.prefill_skip_tokens`` (0: no prefill rule).
        fallback: the measured fallback, or None.
    """

    def __init__(self, gamma: int, prefill_skip_tokens: int = 0, fallback: MeasuredFallback | None = None) -> None:
        self.gamma = gamma
        self.prefill_skip_tokens = prefill_skip_tokens
        self.fallback = fallback

    @staticmethod
    def wanted(prefill_skip_tokens: int, fallback: bool) -> bool:
        """Whether these settings need a switch (either rule on); the V2 speculator asks the same
        to know whether it reads the scheduler's decision."""
        return bool(prefill_skip_tokens) or bool(fallback)

    @classmethod
    def of(cls, gamma: int, prefill_skip_tokens: int, fallback: bool) -> StepSwitch | None:
        """The switch of these settings, or None when neither rule is on."""
        if not cls.wanted(prefill_skip_tokens, fallback):
            return None
        return cls(gamma, prefill_skip_tokens, MeasuredFallback(gamma) if fallback else None)

    def decide(self, num_scheduled_tokens: Mapping[str, int], spec_decode_tokens: Mapping[str, Sequence]) -> int:
        """Drafts per request for the step being scheduled (its ``num_spec_tokens_to_schedule``)."""
        if drafts_next_step(num_scheduled_tokens, spec_decode_tokens, self.gamma, self.prefill_skip_tokens) == 0:
            return 0
        return self.fallback.drafts() if self.fallback is not None else self.gamma

    def observe(self, num_scheduled_tokens: Mapping[str, int], spec_decode_tokens: Mapping[str, Sequence],
                drafts: int, sampled_token_ids: Sequence[Sequence[int]]) -> None:
        """A step's output: its schedule, the drafts it was scheduled with and every request's
        sampled tokens (``ModelRunnerOutput.sampled_token_ids``)."""
        if self.fallback is None:
            return
        decode_only = bool(num_scheduled_tokens) and prompt_tokens(num_scheduled_tokens, spec_decode_tokens) == 0
        self.fallback.observe(drafts, sum(len(t) for t in sampled_token_ids or ()), decode_only)
