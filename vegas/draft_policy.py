"""When drafting loses, decode plainly: a batch-level fallback policy (core; no backend).

A speculative iteration drafts γ tokens with sparse attention and verifies ``γ + 1`` with full
attention; it costs ``γ·c_draft + c_verify(γ+1)`` and emits τ tokens on average. A plain step
costs ``c_plain`` and emits 1. In units of a plain step (``r_draft = c_draft / c_plain``,
``r_verify = c_verify(γ+1) / c_plain``) drafting is worth its cost while the predicted speedup

    gain(τ) = τ / (γ·r_draft + r_verify)

exceeds 1. :class:`DraftPolicy` keeps an exponentially weighted estimate of the batch's τ and
drafts while ``gain(τ) >= min_gain``; once it falls below, the batch takes plain steps and
every ``probe_interval`` plain steps drafts once again (a probe), so that a recovered τ is
noticed. A probe resumes drafting only when its τ clears the threshold by ``hysteresis``
(``gain >= min_gain + hysteresis``), which keeps the policy from flapping at break-even.

Plain steps run through the same verifier (a verification of zero drafts), so greedy output
is token-identical whatever the policy decides; sampling stays distributed as the target.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import VegasConfig

__all__ = ["DraftPolicy", "AlwaysDraft"]


class AlwaysDraft:
    """The policy of ``fallback=False``: every iteration drafts."""

    def should_draft(self) -> bool:
        return True

    def observe_draft(self, tau: float) -> None:
        pass

    def observe_plain(self) -> None:
        pass


class DraftPolicy:
    """Draft or step plainly, from the batch's measured acceptance length and a cost model.

    Args:
        num_draft_tokens: γ.
        draft_cost: ``r_draft``, one sparse draft forward over one plain decode step.
        verify_cost: ``r_verify``, one verification of ``γ + 1`` tokens (with score
            collection and selection) over one plain decode step.
        min_gain: draft while ``gain(τ) >= min_gain`` (1.0: break-even).
        hysteresis: a probe resumes drafting only at ``gain >= min_gain + hysteresis``.
        probe_interval: plain steps between probes (>= 1).
        ewma: weight of the newest iteration in the τ estimate, in (0, 1].

    The estimate starts at ``γ + 1`` (optimistic: a batch drafts until its measured τ pulls
    the estimate under the threshold); a probe replaces the estimate with the probe's τ (the
    old estimate is stale after plain steps).
    """

    def __init__(
        self,
        num_draft_tokens: int,
        *,
        draft_cost: float,
        verify_cost: float,
        min_gain: float = 1.0,
        hysteresis: float = 0.1,
        probe_interval: int = 16,
        ewma: float = 0.25,
    ) -> None:
        self.num_draft_tokens = num_draft_tokens
        self.draft_cost, self.verify_cost = draft_cost, verify_cost
        self.min_gain, self.hysteresis = min_gain, hysteresis
        self.probe_interval, self.ewma = probe_interval, ewma
        self.tau = float(num_draft_tokens + 1)
        self.drafting = True
        self.plain_run = 0  # plain steps since the last drafting iteration
        self.plain_steps = 0
        self.probes = 0

    @classmethod
    def from_config(cls, config: VegasConfig) -> DraftPolicy | AlwaysDraft:
        """The policy ``config`` asks for: :class:`AlwaysDraft` when ``config.fallback`` is off."""
        if not config.fallback:
            return AlwaysDraft()
        return cls(
            config.num_draft_tokens,
            draft_cost=config.fallback_draft_cost,
            verify_cost=config.fallback_verify_cost,
            min_gain=config.fallback_min_gain,
            hysteresis=config.fallback_hysteresis,
            probe_interval=config.fallback_probe_interval,
        )

    @property
    def break_even_tau(self) -> float:
        """τ at which drafting pays exactly ``min_gain``."""
        return self.min_gain * (self.num_draft_tokens * self.draft_cost + self.verify_cost)

    def gain(self, tau: float) -> float:
        """Predicted speedup of drafting over plain steps at acceptance length ``tau``."""
        return tau / (self.num_draft_tokens * self.draft_cost + self.verify_cost)

    def should_draft(self) -> bool:
        """Draft this iteration (drafting, or a probe is due)?"""
        return self.drafting or self.plain_run >= self.probe_interval

    def observe_draft(self, tau: float) -> None:
        """A drafting iteration emitted ``tau`` tokens per sequence (batch mean)."""
        probe = not self.drafting
        if probe:
            self.probes += 1
            self.tau = tau
        else:
            self.tau += self.ewma * (tau - self.tau)
        self.plain_run = 0
        threshold = self.min_gain + (self.hysteresis if probe else 0.0)
        self.drafting = self.gain(self.tau) >= threshold

    def observe_plain(self) -> None:
        """A plain step ran."""
        self.plain_run += 1
        self.plain_steps += 1
