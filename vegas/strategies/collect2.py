"""Collect-2-Query selection (Vegas, seed; design notes (docs/design-notes.md) §1 step 4).

Aggregates only the two queries of the verified chunk furthest apart: row 0 (``x_last``,
it predicts the first draft token) and row γ (the last draft, it predicts the bonus
token). The collection cost is constant in γ.
"""

from __future__ import annotations

from .aggregated import AggregatedSelector


class Collect2Selector(AggregatedSelector):
    """Top-k of the logits of the first and last verify query, summed over heads."""

    name = "collect2"

    def score_rows(self, chunk_len: int) -> list[int]:
        return sorted({0, chunk_len - 1})
