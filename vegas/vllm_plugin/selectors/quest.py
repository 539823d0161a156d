"""Quest on vLLM, in one module (its kernels: :mod:`vegas.kernels.quest_pages`, reference, and
:mod:`vegas.kernels.triton_quest`): the fast path :class:`QuestFastPath` keeps page bounds in
step with the KV cache and chooses pages per draft query (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
Inference", §3; the HF backend's :class:`vegas.strategies.quest.QuestSelector`).

- **Pages are vLLM's KV blocks** (``block_size`` slots). Their element-wise key minimum and
  maximum live in two buffers ``(layers, num_blocks + 1, kv_heads, head_dim)`` in the cache
  dtype, each ``1 / block_size`` of the key cache, allocated at the first forward that has a
  KV cache (outside vLLM's memory profile).
- **Verification and prefill** (:func:`update_layer`, called by :class:`QuestFastPath` after
  each layer's KV write) recompute the bounds of the blocks the forward wrote. The selectable
  prefix is cut to whole pages: ``ctx_sel`` becomes a multiple of ``block_size`` and the KV budget
  a whole number of pages (``budget // block_size``; every page when the budget covers the
  context), so the partial last page joins the recent positions that drafting always attends.
- **Drafting** (:func:`fill_draft_table`, called by the draft attention of every layer and
  draft step, inside the draft CUDA graph): bound every whole page with this step's query
  (:func:`vegas.kernels.quest_pages.group_query`, summed over all query heads as the HF
  backend's ``granularity="layer"``), take the best pages, and write their slots into the
  selection columns of the layer's page-size-1 draft table.

With tensor parallelism every rank bounds the pages with its own heads (a per-rank selection).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...config import VegasConfig, VegasConfigError
from ...kernels import slots_to_fa_pages
from ...kernels.quest_pages import group_query, page_scores_reference, select_pages, update_page_bounds
from .base import FastPath

__all__ = ["QuestDraft", "QuestFastPath", "fill_draft_table", "page_aligned_selection", "update_layer"]

@dataclass
class QuestDraft:
    """What the draft attention needs to choose pages (shared by the layers of one draft phase).

    Attributes:
        key_min, key_max: ``(layers, num_blocks + 1, kv_heads, head_dim)`` page bounds.
        block_table: ``(num_seqs, max_blocks)`` int32 block ids.
        num_pages: ``(num_seqs,)`` int64 whole pages before the recent positions.
        budget_cols: ``(num_seqs,)`` int64 selection columns per request (pages × block_size).
        k_pages: static number of pages chosen per request (the widest budget in pages).
        block_size: slots per page; page_stride: pages per block in the page-size-1 view.
    """

    key_min: torch.Tensor
    key_max: torch.Tensor
    block_table: torch.Tensor
    num_pages: torch.Tensor
    budget_cols: torch.Tensor
    k_pages: int
    block_size: int
    page_stride: int


def page_aligned_selection(
    ctx_sel: torch.Tensor, budgets: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ctx_sel, budget)`` of Quest, both ``(num_seqs,)`` int64: the selectable prefix cut to
    whole pages and the budget in whole pages (all of them when ``budgets >= ctx_sel``), in slots."""
    pages = ctx_sel // block_size
    k_pages = torch.where(budgets >= ctx_sel, pages, torch.minimum(budgets // block_size, pages))
    return pages * block_size, k_pages * block_size


def update_layer(state, row: int, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, capturing: bool) -> None:
    """Recompute layer ``row``'s bounds of the blocks this forward wrote (allocating the
    buffers at the first forward with a KV cache)."""
    key_cache = kv_cache.unbind(1)[0]  # (num_blocks, block_size, kv_heads, head_dim)
    num_blocks, _, kv_heads, head_dim = key_cache.shape
    shape = (state.num_layers, num_blocks + 1, kv_heads, head_dim)
    if state.quest_min is None or tuple(state.quest_min.shape) != shape or state.quest_min.dtype != key_cache.dtype:
        if capturing:
            raise RuntimeError("vegas: Quest page bounds first needed inside CUDA-graph capture")
        state.quest_min = torch.zeros(shape, dtype=key_cache.dtype, device=key_cache.device)
        state.quest_max = torch.zeros(shape, dtype=key_cache.dtype, device=key_cache.device)
    update_page_bounds(state.quest_min[row], state.quest_max[row], key_cache, slot_mapping)


def fill_draft_table(table: torch.Tensor, query: torch.Tensor, num_kv_heads: int, pages: QuestDraft, row: int) -> None:
    """Write this draft step's best pages of layer ``row`` into the selection columns of its
    draft table (in place; columns at or beyond a request's ``budget_cols`` keep the recent
    positions).

    Args:
        table: ``(num_seqs, width)`` int32 page-size-1 draft table of the layer.
        query: ``(num_seqs, num_q_heads, head_dim)`` this draft step's queries.
    """
    q_pos, q_neg = group_query(query, num_kv_heads)
    key_min = pages.key_min[row].view(pages.key_min.shape[1], -1)  # [num_blocks + 1, kv_heads * head_dim]
    key_max = pages.key_max[row].view(pages.key_max.shape[1], -1)
    n = table.shape[0]
    block_table = pages.block_table[:n]  # [n, max_blocks] int32
    if query.is_cuda:
        from ...kernels.triton_quest import page_scores_triton

        scores = page_scores_triton(q_pos, q_neg, key_min, key_max, block_table, pages.num_pages[:n])
    else:
        scores = page_scores_reference(q_pos, q_neg, key_min, key_max, block_table, pages.num_pages[:n])
    slots = select_pages(scores, pages.k_pages, block_table, pages.block_size)
    chosen = slots_to_fa_pages(slots, pages.block_size, pages.page_stride).to(table.dtype)  # [n, k_pages * block_size]
    width = min(chosen.shape[1], table.shape[1])
    col = torch.arange(width, device=table.device)[None, :]
    table[:, :width] = torch.where(col < pages.budget_cols[:n, None], chosen[:, :width], table[:, :width])


class QuestFastPath(FastPath):
    """Page bounds kept in step with the cache; pages chosen per draft step. Pages are vLLM's
    KV blocks, so ``page_size`` must be the engine's block size (``cache_config.block_size``)."""

    @classmethod
    def raise_if_unsupported(cls, selector, config: VegasConfig, block_size: int | None = None) -> None:
        if block_size is not None and config.page_size != block_size:
            raise VegasConfigError(
                f"quest on the vllm backend uses vLLM's KV blocks as pages: page_size must be the "
                f"engine's block_size {block_size}, got {config.page_size}"
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
