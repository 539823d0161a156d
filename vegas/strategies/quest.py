"""Quest: query-aware page selection (Tang et al. 2024, "Quest: Query-Aware Sparsity for
Efficient Long-Context LLM Inference", §3).

Pages of P slots keep the element-wise min and max of their keys per KV head. For a draft
query q the score of a page is bounded by ``Σ_d max(q_d · min_d, q_d · max_d) ≥ q · k`` for
every key k of the page; the pages with the highest bounds are attended, recomputed at
every draft step (so selection cost grows with the context).
"""

from __future__ import annotations

import torch

from ..interfaces import Selection, SelectionInput, Selector
from ..selection import topk_selection


def page_bounds(keys: torch.Tensor, valid: torch.Tensor, page_size: int):
    """Per-page element-wise key minimum and maximum.

    Args:
        keys: ``(batch_size, num_kv_heads, num_slots, head_dim)``.
        valid: ``torch.BoolTensor (batch_size, num_slots)``.

    Returns:
        ``key_min``, ``key_max``: ``torch.FloatTensor (batch_size, num_kv_heads, num_pages,
        head_dim)`` (0 on empty pages), ``page_valid`` ``(batch_size, num_pages)`` bool and
        ``slot_valid`` ``(batch_size, num_pages * page_size)`` bool.
    """
    batch_size, num_kv_heads, num_slots, head_dim = keys.shape
    num_pages = -(-num_slots // page_size)
    pad = num_pages * page_size - num_slots
    k = torch.nn.functional.pad(keys.float(), (0, 0, 0, pad))
    slot_valid = torch.nn.functional.pad(valid, (0, pad), value=False)
    k = k.view(batch_size, num_kv_heads, num_pages, page_size, head_dim)
    v = slot_valid.view(batch_size, 1, num_pages, page_size, 1)
    page_valid = slot_valid.view(batch_size, num_pages, page_size).any(dim=-1)
    key_min = k.masked_fill(~v, float("inf")).amin(dim=3)
    key_max = k.masked_fill(~v, float("-inf")).amax(dim=3)
    empty = ~page_valid[:, None, :, None]
    return key_min.masked_fill(empty, 0.0), key_max.masked_fill(empty, 0.0), page_valid, slot_valid


def page_scores(query: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, groups: int):
    """Quest upper bound of ``q·k`` per page, summed over the query heads of each group.

    Args:
        query: ``(batch_size, num_heads, 1, head_dim)``.
        key_min, key_max: ``(batch_size, num_kv_heads, num_pages, head_dim)``.

    Returns:
        ``torch.FloatTensor (batch_size, groups, num_pages)``.
    """
    batch_size, num_heads, _, head_dim = query.shape
    num_kv_heads = key_min.shape[1]
    q = query.float().view(batch_size, num_kv_heads, num_heads // num_kv_heads, 1, head_dim)
    bound = torch.maximum(q * key_min[:, :, None], q * key_max[:, :, None]).sum(-1)
    bound = bound.sum(dim=2)  # [B, KVH, num_pages]: summed over the group's query heads
    if groups == 1:
        bound = bound.sum(dim=1, keepdim=True)
    return bound


class QuestSelector(Selector):
    """Best pages by the Quest bound, per draft query, within the KV budget."""

    name = "quest"
    query_aware = True

    def __init__(self, config) -> None:
        super().__init__(config)
        self._pages: dict[int, tuple] = {}

    def select(self, inputs: SelectionInput) -> Selection:
        """Update the page bounds of one layer; the pages are chosen per draft query.

        Committed slots never change and new slots are appended, so the pages wholly
        before the previous selection's length are reused and only the tail is recomputed:
        O((γ + 1 + P) · head_dim) per layer and iteration instead of O(context · head_dim).
        """
        size = self.config.page_size
        num_slots = inputs.valid.shape[1]
        cached = self._pages.get(inputs.layer_idx)
        start = 0 if cached is None else min(cached[-1], num_slots) // size
        key_min, key_max, page_valid, slot_valid = page_bounds(
            inputs.keys[:, :, start * size :], inputs.valid[:, start * size :], size
        )
        if start:  # reuse the pages that lie wholly before the previous selection's length
            old_min, old_max, old_page_valid, old_slot_valid = cached[:4]
            key_min = torch.cat([old_min[:, :, :start], key_min], dim=2)
            key_max = torch.cat([old_max[:, :, :start], key_max], dim=2)
            page_valid = torch.cat([old_page_valid[:, :start], page_valid], dim=1)
            slot_valid = torch.cat([old_slot_valid[:, : start * size], slot_valid], dim=1)
        # Whole pages within the budget; a budget that covers every valid slot takes every page.
        all_pages = page_valid.sum(dim=1)
        covers_all = inputs.budget >= inputs.valid.sum(dim=1)
        num_pages = torch.where(covers_all, all_pages, (inputs.budget // size).minimum(all_pages))
        self._pages[inputs.layer_idx] = (key_min, key_max, page_valid, slot_valid, num_pages, num_slots)
        empty = inputs.budget.new_zeros(inputs.budget.shape[0], 1, 0)
        return Selection(indices=empty, mask=empty.bool())

    def select_for_query(self, layer_idx: int, query: torch.Tensor, selection: Selection) -> Selection:
        key_min, key_max, page_valid, slot_valid, num_pages, _ = self._pages[layer_idx]
        groups = 1 if self.config.granularity == "layer" else key_min.shape[1]
        pages = topk_selection(page_scores(query, key_min, key_max, groups), page_valid, num_pages)
        size = self.config.page_size
        offsets = torch.arange(size, device=query.device)
        slots = (pages.indices[..., None] * size + offsets).flatten(2)  # [B, G, k_pages * P]
        in_page = slot_valid.gather(1, slots.flatten(1)).view_as(slots)
        mask = pages.mask[..., None].expand(*pages.mask.shape, size).flatten(2) & in_page
        return Selection(indices=slots.masked_fill(~mask, 0), mask=mask)
