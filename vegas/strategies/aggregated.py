"""Aggregated-logit selection (Vegas, seed; design notes (docs/design-notes.md) §1 step 4).

``score_l[i] = Σ_{t ∈ chunk} Σ_{h ∈ heads(l)} logit_l^{(h)}[t, i]`` over all γ+1 queries
of the verified chunk, rejected ones included; ``S_l = top-k(score_l)``.
"""

from __future__ import annotations

import torch

from ..config import VegasConfig, recent_window_for
from ..interfaces import Selection, SelectionInput, Selector
from ..selection import topk_selection
from .sliding_window import sliding_window_keep


class AggregatedSelector(Selector):
    """Top-k of the attention logits summed over every query of the verified chunk."""

    name = "aggregated"

    def score_rows(self, chunk_len: int) -> list[int]:
        return list(range(chunk_len))

    def select(self, inputs: SelectionInput) -> Selection:
        assert inputs.scores is not None, "the backend must collect score_rows"
        return topk_with_recent(self.config, inputs.scores, inputs.valid, inputs.budget)


def topk_with_recent(config: VegasConfig, scores: torch.Tensor, valid: torch.Tensor, budget: torch.Tensor) -> Selection:
    """Top-k of ``scores`` ``(batch_size, groups, num_slots)`` within ``budget`` ``(batch_size,)``
    tokens, the last :func:`~vegas.config.recent_window_for` valid slots kept first."""
    if config.recent_window:
        none = torch.zeros_like(budget)
        window = recent_window_for(config, budget)
        recent = sliding_window_keep(valid, none, window)  # [B, num_slots]
        scores = scores.masked_fill(recent[:, None, :], float("inf"))
    return topk_selection(scores, valid, budget)
