"""H2O-style accumulated-attention selector, as a vegas plugin (entry-point group ``vegas``).

H2O (Zhang et al. 2023, §4) keeps "heavy hitters": the keys with the largest accumulated
attention. Here the accumulation runs over verification passes: ``acc ← decay · acc +
score`` per layer and slot, with ``score`` the attention scores of all γ+1 verify queries
summed over heads (logits or softmax weights, per ``score_mode``); the next draft attends to the top-k of ``acc`` plus the recent window.
"""

from __future__ import annotations

import torch

import vegas
from vegas.config import recent_window_for
from vegas.selection import topk_selection
from vegas.strategies.sliding_window import sliding_window_keep


class H2OSelector(vegas.Selector):
    """Top-k of exponentially decayed attention accumulated over verifications."""

    name = "h2o"
    decay = 0.5

    def __init__(self, config: vegas.VegasConfig) -> None:
        super().__init__(config)
        self._acc: dict[int, torch.Tensor] = {}  # layer -> [batch_size, groups, num_slots]

    def score_rows(self, chunk_len: int) -> list[int]:
        return list(range(chunk_len))

    def select(self, inputs: vegas.SelectionInput) -> vegas.Selection:
        scores = inputs.scores.masked_fill(~inputs.valid[:, None, :], 0.0)
        prev = self._acc.get(inputs.layer_idx)
        if prev is not None and prev.shape[:2] == scores.shape[:2]:
            n = min(prev.shape[-1], scores.shape[-1])
            scores = scores.clone()
            scores[..., :n] += self.decay * prev[..., :n]
        self._acc[inputs.layer_idx] = scores
        recent = sliding_window_keep(
            inputs.valid, torch.zeros_like(inputs.budget), recent_window_for(self.config, inputs.budget)
        )
        return topk_selection(scores.masked_fill(recent[:, None, :], float("inf")), inputs.valid, inputs.budget)

    def keep_rows(self, rows: torch.Tensor) -> None:
        self._acc = {layer: acc[rows] for layer, acc in self._acc.items()}


@vegas.hookimpl
def vegas_selectors():
    return {H2OSelector.name: H2OSelector}
