"""Fast path of Quest: pages are vLLM's KV blocks; every verification updates the page bounds
of the blocks it wrote (:func:`vegas.vllm_plugin.quest.update_layer`) and the draft attention
chooses pages per draft query (:func:`vegas.vllm_plugin.quest.fill_draft_table`). See
:mod:`vegas.vllm_plugin.quest` for the layout and the page-aligned budget."""

from __future__ import annotations

import torch

from ...config import VegasConfig, VegasConfigError
from ..quest import QuestDraft, page_aligned_selection, update_layer
from .base import FastPath

__all__ = ["QuestFastPath", "VLLM_BLOCK_SIZE"]

#: vLLM's KV block size (tokens), the page of Quest on this backend
VLLM_BLOCK_SIZE = 16


class QuestFastPath(FastPath):
    """Page bounds kept in step with the cache; pages chosen per draft step."""

    @classmethod
    def raise_if_unsupported(cls, selector, config: VegasConfig) -> None:
        if config.page_size != VLLM_BLOCK_SIZE:
            raise VegasConfigError(
                f"quest on the vllm backend uses vLLM's KV blocks as pages: page_size must be "
                f"{VLLM_BLOCK_SIZE}, got {config.page_size}"
            )

    def recent_columns(self, block_size: int) -> int:
        return block_size  # the partial last page joins the recent positions

    def begin(self, state, plan, query, kv_cache, attn_metadata) -> None:
        n = plan.num_seqs
        ctx_sel, budgets = page_aligned_selection(plan.ctx_sel, plan.budgets, state.block_size)
        state.ctx_sel_buf[:n].copy_(ctx_sel)
        state.budget_buf[:n].copy_(budgets)
        state.has_selection = True

    def layer(self, state, row, query, kv_cache, attn_metadata, scale) -> None:
        with state.timed(query):
            update_layer(state, row, kv_cache, attn_metadata.slot_mapping, state.capturing(query))

    def draft_pages(self, state, block_table, ctx_sel, budgets, active, width):
        return QuestDraft(
            state.quest_min, state.quest_max, block_table, ctx_sel // state.block_size,
            torch.where(active, budgets, 0), width // state.block_size, state.block_size, state.page_stride,
        )
