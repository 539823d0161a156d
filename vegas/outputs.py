"""What a decode returns per request: token ids, text and statistics (core; no backend)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RequestOutput", "RequestStats", "as_token_ids"]


def as_token_ids(value: Any) -> set[int]:
    """Token ids from an int, a list/tuple/set of ints, or None (an empty set)."""
    if value is None:
        return set()
    if isinstance(value, int):
        return {int(value)}
    return {int(v) for v in value}


@dataclass
class RequestStats:
    """Per-request statistics of one ``generate`` call.

    Attributes:
        num_generated: tokens emitted (after truncation to ``max_new_tokens``/EOS).
        iterations: draft/verify iterations and plain steps (plain decoding: decode steps).
        plain_steps: the iterations of Vegas decoding that took a plain step instead of
            drafting, because the batch's acceptance made drafting a loss
            (:mod:`vegas.draft_policy`; probes count as drafting iterations).
        num_drafted: draft tokens proposed (γ per drafting iteration; fewer in the last ones,
            where the batch may emit fewer than γ + 1 tokens).
        num_accepted: draft tokens accepted.
        decode_seconds: wall time of the batch's decode phase, after prefill (seconds).
        prefill_seconds: wall time of the batch's prefill (seconds).
        selection_seconds: time in score collection, top-k and index building during the
            decode phase (seconds; the selection made at prefill counts with the prefill).
        kv_budget: the KV budget of the last selection, clamped to the context (tokens per
            layer; 0 for plain decoding): the nominal size, not what drafts attended (Quest
            attends its partial page and the verified chunk beside the budget's pages).
        kv_attended: KV entries per layer a draft query attended to among the committed ones,
            averaged over KV-head groups, layers, draft steps and drafting iterations (tokens):
            each selector's selection as attended (Quest's partial page and verified chunk
            included; the oracle's per-query sets; slots a sliding-window layer's window has
            left excluded). The drafting phase's own new positions (``x_last``, then the
            drafts: 1..γ, the same for every selector) are not counted. None when no draft
            ran or the backend does not count it (vLLM).
    """

    num_generated: int = 0
    iterations: int = 0
    plain_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    decode_seconds: float = 0.0
    prefill_seconds: float = 0.0
    selection_seconds: float = 0.0
    kv_budget: int = 0
    kv_attended: float | None = None

    @property
    def acceptance_length(self) -> float:
        """τ: tokens emitted per iteration (accepted drafts + the bonus/correction token, so
        τ <= γ + 1; a plain step counts as an iteration emitting one token).

        Counts emitted tokens, so an iteration cut short by ``max_new_tokens`` or EOS counts
        what it emitted; ``num_accepted`` counts every draft the verification accepted.
        """
        return self.num_generated / self.iterations if self.iterations else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "acceptance_length": self.acceptance_length}


@dataclass
class RequestOutput:
    """One request's result: generated ``token_ids``, decoded ``text``, and ``stats``."""

    token_ids: list[int]
    text: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
