"""Fast path of the sliding-window selector: sinks plus the last ``k - sinks`` positions before
``ctx_sel``, computed from positions alone at the first layer and shared by every layer.
Selects what :meth:`vegas.strategies.sliding_window.SlidingWindowSelector.select` selects."""

from __future__ import annotations

import torch

from ...kernels import paged_slots
from .base import FastPath

__all__ = ["SlidingWindowFastPath", "sliding_window_slots"]


def sliding_window_slots(plan, num_sinks: int, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """Sinks plus the last ``k - sinks`` positions before ``ctx_sel``.

    Args:
        plan: the batch's :class:`~vegas.vllm_plugin.selectors.plan.CollectPlan`.
        block_table: ``(num_seqs, max_blocks)`` int32 block ids.

    Returns:
        ``(num_seqs, k_max)`` int32 slot ids, -1 beyond each request's budget.
    """
    col = torch.arange(plan.k_max, device=plan.ctx_sel.device)[None, :]  # [1, k_max]
    k = plan.budgets[:, None]  # [num_seqs, 1]
    sinks = torch.clamp(k, max=num_sinks)
    positions = torch.clamp(torch.where(col < sinks, col, plan.ctx_sel[:, None] - k + col), min=0)
    slots = paged_slots(positions, block_table[: plan.num_seqs], block_size).to(torch.int32)  # [num_seqs, k_max]
    return torch.where(col < k, slots, torch.full_like(slots, -1))


class SlidingWindowFastPath(FastPath):
    """One positional selection per forward, in ``sel_buf`` row 0."""

    shared_across_layers = True

    def begin(self, state, plan, query, kv_cache, attn_metadata) -> None:
        super().begin(state, plan, query, kv_cache, attn_metadata)
        if plan.k_max > 0:
            num_sinks = self.selector.config.num_sinks
            slots = sliding_window_slots(plan, num_sinks, attn_metadata.block_table, state.block_size)
            state.sel_buf[0, : plan.num_seqs, : plan.k_max].copy_(slots)
            state.has_selection = True
