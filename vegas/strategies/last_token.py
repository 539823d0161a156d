"""Last-token selection (ablation, design notes (docs/design-notes.md) §2): the logits of ``x_last`` alone.

Row 0 of the verified chunk is the last token accepted before it was drafted.
"""

from __future__ import annotations

from .aggregated import AggregatedSelector


class LastTokenSelector(AggregatedSelector):
    """Top-k of the logits of the chunk's first query (the last accepted token)."""

    name = "last_token"

    def score_rows(self, chunk_len: int) -> list[int]:
        return [0]
