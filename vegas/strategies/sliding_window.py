"""Sliding window with attention sinks (StreamingLLM, Xiao et al. 2024; drafting as in
MagicDec, Chen et al. 2025): ``S = first num_sinks valid slots ∪ last window valid slots``.
Query-agnostic and free to select."""

from __future__ import annotations

import torch

from ..interfaces import Selection, SelectionInput, Selector
from ..selection import selection_from_keep


def sliding_window_keep(
    valid: torch.Tensor, num_sinks: torch.Tensor, window: torch.Tensor
) -> torch.Tensor:
    """Slots kept by a sink + window policy.

    Args:
        valid: ``torch.BoolTensor (batch_size, num_slots)``.
        num_sinks, window: ``torch.LongTensor (batch_size,)`` in tokens.

    Returns:
        ``torch.BoolTensor (batch_size, num_slots)``.
    """
    rank = valid.long().cumsum(dim=1) - 1  # position of each valid slot among valid slots
    count = valid.sum(dim=1, keepdim=True)
    return valid & ((rank < num_sinks[:, None]) | (rank >= count - window[:, None]))


class SlidingWindowSelector(Selector):
    """Sinks plus the most recent positions, within the KV budget.

    ``num_sinks = min(config.num_sinks, budget)``; ``window = config.window`` or, if None,
    ``budget - num_sinks`` (equal budget to the other selectors). A ``config.window`` that is
    set makes the budget ``num_sinks + window`` (:meth:`budget`).
    """

    name = "sliding_window"

    def budget(self, context_len):
        """``num_sinks + window`` when ``config.window`` is set, else the shared rule."""
        if self.config.window is None:
            return super().budget(context_len)
        k = self.config.num_sinks + self.config.window
        return k if isinstance(context_len, int) else context_len.new_full(context_len.shape, k)

    def select(self, inputs: SelectionInput) -> Selection:
        budget = inputs.budget
        sinks = budget.clamp(max=self.config.num_sinks)
        if self.config.window is None:
            window = budget - sinks
        else:
            window = torch.full_like(budget, self.config.window)
        keep = sliding_window_keep(inputs.valid, sinks, window)
        return selection_from_keep(keep[:, None, :])
