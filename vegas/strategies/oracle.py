"""Oracle selection (analysis only; design notes (docs/design-notes.md) §2): the exact top-k of
each draft query's own attention scores.

Every score-based selector ranks the slots by a *proxy* query (the verified chunk's rows);
the oracle ranks them by the query that is drafting, at every draft step and layer, so its
acceptance length is the upper bound of draft accuracy at a KV budget: the gap between
``collect2`` and ``oracle`` is what the proxy's staleness costs. Everything else is as for
the other score-based selectors (same budget, ``score_mode``, ``granularity``, recent
window), so that only the query differs.

Scores use the softmax scale ``head_dim ** -0.5`` (it matters for ``score_mode="weight"``
only). Not registered as a built-in: the vLLM backend has no fast path for it and ``vegas
bench`` should not time it; pass an instance (``Pipeline.generate(selector=OracleSelector(
pipe.config))``) or use ``vegas ablate``, which adds it to its studies. HF backend only.
"""

from __future__ import annotations

import torch

from ..interfaces import Selection, SelectionInput, Selector
from ..selection import collect_scores
from .aggregated import topk_with_recent


class OracleSelector(Selector):
    """Top-k of each draft query's own logits (summed over the heads of each group)."""

    name = "oracle"
    query_aware = True
    needs_keys = True

    def __init__(self, config) -> None:
        super().__init__(config)
        self._inputs: dict[int, SelectionInput] = {}

    def select(self, inputs: SelectionInput) -> Selection:
        """Keep the layer's committed keys, ``valid`` and budget; slots are chosen per draft
        query. The cache's key tensor is kept by reference: transformers' ``DynamicCache``
        appends by concatenation and crops by slicing, so it is never written in place."""
        self._inputs[inputs.layer_idx] = inputs
        groups = 1 if self.config.granularity == "layer" else inputs.keys.shape[1]  # as select_for_query's
        empty = inputs.budget.new_zeros(inputs.budget.shape[0], groups, 0)
        return Selection(indices=empty, mask=empty.bool())

    def select_for_query(self, layer_idx: int, query: torch.Tensor, selection: Selection) -> Selection:
        """Args: ``query`` ``(batch_size, num_heads, 1, head_dim)``, post-RoPE."""
        inputs = self._inputs[layer_idx]
        valid = inputs.valid  # [B, L]
        keys = inputs.keys[:, :, : valid.shape[1]]  # [B, KVH, L, D]
        groups = 1 if self.config.granularity == "layer" else keys.shape[1]
        scores = collect_scores(query, keys, valid[:, None, :], query.shape[-1] ** -0.5, groups,
                                self.config.score_mode)  # [B, G, L]
        return topk_with_recent(self.config, scores, valid, inputs.budget)

    def keep_rows(self, rows: torch.Tensor) -> None:
        self._inputs = {
            layer: SelectionInput(layer, None, i.valid[rows], i.budget[rows], i.keys[rows])
            for layer, i in self._inputs.items()
        }
