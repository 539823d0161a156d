"""Quest: query-aware page selection (Tang et al. 2024, "Quest: Query-Aware Sparsity for
Efficient Long-Context LLM Inference", §3).

Pages of P slots keep the element-wise min and max of their keys per KV head. For a draft
query q the score of a page is bounded by ``Σ_d max(q_d · min_d, q_d · max_d) ≥ q · k`` for
every key k of the page; the pages with the highest bounds are attended, recomputed at
every draft step (so selection cost grows with the context).

As on the vLLM backend (:mod:`vegas.vllm_plugin.selectors.quest`), pages are chosen among the
whole pages before the verified chunk (the last ``γ + 1`` committed tokens), and the rest —
the partial page and the chunk — is always attended, beside the budget's pages: a draft must
see the tokens right before it, which a page bound does not always rank first (without them
a 135M model's drafts were rejected almost always on some prompts).

With attention logit soft-capping (Gemma 2) the bound stays on the raw ``q·k``: capping is
monotonic, so each head's page order is unchanged, but the sum over a group's heads weighs
logits beyond the cap more than the softmax does (the score-based selectors sum capped logits).
"""

from __future__ import annotations

import torch

from ..interfaces import Selection, SelectionInput, Selector
from ..selection import topk_selection


def page_bounds(keys: torch.Tensor, valid: torch.Tensor, page_size: int):
    """Per-page element-wise key minimum and maximum; page ``p`` of a sequence holds its valid
    slots of rank ``p * page_size .. (p + 1) * page_size - 1`` (rank = order among the valid
    slots, i.e. the token position), whatever padding or rolled-back slots lie between them.

    Args:
        keys: ``(batch_size, num_kv_heads, num_slots, head_dim)``.
        valid: ``torch.BoolTensor (batch_size, num_slots)``.

    Returns:
        ``key_min``, ``key_max``: ``torch.FloatTensor (batch_size, num_kv_heads, num_pages,
        head_dim)`` (0 on empty pages), ``page_valid`` ``(batch_size, num_pages)`` bool and
        ``page_slots`` ``(batch_size, num_pages, page_size)`` int64 (-1 where a page has no slot).
    """
    table = PageTable.empty(keys, page_size)
    table.append(keys, valid)
    return (*table.finite_bounds(), table.page_valid, table.page_slots)


class PageTable:
    """Quest pages of one layer, built incrementally as committed slots are appended.

    Attributes:
        key_min, key_max: ``(batch_size, num_kv_heads, num_pages, head_dim)`` float32, +inf /
            -inf on empty pages (so that appending is a plain min / max).
        page_slots: ``(batch_size, num_pages, page_size)`` int64 cache slot of each page entry, -1
            where empty.
        count: ``(batch_size,)`` int64 valid slots seen (tokens).
        num_slots: cache slots seen; slots before it are never read again (committed slots
            do not change, and slots rolled back before a selection stay invalid).
    """

    def __init__(self, key_min, key_max, page_slots, count, num_slots: int) -> None:
        self.key_min, self.key_max, self.page_slots = key_min, key_max, page_slots
        self.count, self.num_slots = count, num_slots

    @classmethod
    def empty(cls, keys: torch.Tensor, page_size: int) -> "PageTable":
        batch_size, num_kv_heads, _, head_dim = keys.shape
        bound = keys.new_empty(batch_size, num_kv_heads, 0, head_dim, dtype=torch.float32)
        slots = torch.empty(batch_size, 0, page_size, dtype=torch.long, device=keys.device)
        return cls(bound, bound.clone(), slots, torch.zeros(batch_size, dtype=torch.long, device=keys.device), 0)

    @property
    def page_size(self) -> int:
        return self.page_slots.shape[2]

    @property
    def page_valid(self) -> torch.Tensor:
        """``(batch_size, num_pages)`` bool: pages holding at least one slot."""
        return self.page_slots[:, :, 0] >= 0

    def finite_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``key_min``, ``key_max`` with 0 on empty pages."""
        empty = ~self.page_valid[:, None, :, None]
        return self.key_min.masked_fill(empty, 0.0), self.key_max.masked_fill(empty, 0.0)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` (int64 indices)."""
        self.key_min, self.key_max = self.key_min[rows], self.key_max[rows]
        self.page_slots, self.count = self.page_slots[rows], self.count[rows]

    def append(self, keys: torch.Tensor, valid: torch.Tensor) -> None:
        """Add the slots ``self.num_slots:`` of ``keys`` ``(B, KVH, num_slots, D)`` / ``valid``."""
        new_keys, new_valid = keys[:, :, self.num_slots:].float(), valid[:, self.num_slots:]
        batch_size, num_kv_heads, num_new, head_dim = new_keys.shape
        size = self.page_size
        rank = self.count[:, None] + new_valid.long().cumsum(dim=1) - 1  # [B, n]
        self.count = self.count + new_valid.sum(dim=1)
        needed = -(-int(self.count.max()) // size) if batch_size else 0
        num_pages = max(needed, self.key_min.shape[2])  # rows that left the batch may have held more
        grow = num_pages - self.key_min.shape[2]
        if grow > 0:
            pad = (0, 0, 0, grow)
            self.key_min = torch.nn.functional.pad(self.key_min, pad, value=float("inf"))
            self.key_max = torch.nn.functional.pad(self.key_max, pad, value=float("-inf"))
            self.page_slots = torch.nn.functional.pad(self.page_slots, (0, 0, 0, grow), value=-1)
        # invalid slots go to a scratch page / entry past the end, dropped afterwards
        page = torch.where(new_valid, rank // size, num_pages)  # [B, n]
        index = page[:, None, :, None].expand(batch_size, num_kv_heads, num_new, head_dim)
        for name, reduce, fill in (("key_min", "amin", float("inf")), ("key_max", "amax", float("-inf"))):
            bound = torch.nn.functional.pad(getattr(self, name), (0, 0, 0, 1), value=fill)
            bound.scatter_reduce_(2, index, new_keys, reduce, include_self=True)
            setattr(self, name, bound[:, :, :num_pages])
        entry = torch.where(new_valid, rank, num_pages * size)  # [B, n]
        flat = torch.nn.functional.pad(self.page_slots.flatten(1), (0, 1), value=-1)
        slots = self.num_slots + torch.arange(num_new, device=keys.device)
        flat.scatter_(1, entry, slots.expand(batch_size, -1))
        self.page_slots = flat[:, :-1].view(batch_size, num_pages, size)
        self.num_slots = keys.shape[2]


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
        self._pages: dict[int, PageTable] = {}
        self._num_pages: dict[int, torch.Tensor] = {}
        #: per layer: ``(batch_size,)`` int64 whole pages before the recent positions
        self._selectable: dict[int, torch.Tensor] = {}

    def select(self, inputs: SelectionInput) -> Selection:
        """Update the page bounds of one layer; the pages are chosen per draft query.

        Pages follow token positions (ranks among valid slots), so a sequence's pages do not
        depend on its batch neighbours' padding or rolled-back slots. Committed slots never
        change, so only the slots appended since the last call are added:
        O((γ + 1) · head_dim) per layer and iteration instead of O(context · head_dim). On a
        sliding-window layer old slots leave ``valid``; its pages are rebuilt (O(window)).
        """
        table = self._pages.get(inputs.layer_idx)
        if (
            table is None
            or table.num_slots > inputs.valid.shape[1]  # a new batch
            or not torch.equal(inputs.valid[:, : table.num_slots].sum(dim=1), table.count)  # a window moved
        ):
            table = self._pages[inputs.layer_idx] = PageTable.empty(inputs.keys, self.config.page_size)
        table.append(inputs.keys, inputs.valid)
        # Whole pages before the verified chunk are selectable, within the budget (all of them
        # when the budget covers them); the partial page and the chunk are always attended.
        size = self.config.page_size
        before_chunk = (table.count - (self.config.num_draft_tokens + 1)).clamp(min=0)
        selectable = before_chunk // size
        covers_all = inputs.budget >= selectable * size
        self._selectable[inputs.layer_idx] = selectable
        self._num_pages[inputs.layer_idx] = torch.where(
            covers_all, selectable, (inputs.budget // size).minimum(selectable)
        )
        empty = inputs.budget.new_zeros(inputs.budget.shape[0], 1, 0)
        return Selection(indices=empty, mask=empty.bool())

    def select_for_query(self, layer_idx: int, query: torch.Tensor, selection: Selection) -> Selection:
        """The best pages for this draft query (their slots first, ascending), then the recent
        slots (the partial page and the verified chunk, always attended).

        Returns:
            :class:`Selection` ``(batch_size, groups, (k + r) * page_size)``: ``k`` = the most
            pages of any sequence, ``r`` = pages spanning its recent slots.
        """
        table = self._pages[layer_idx]
        key_min, key_max = table.finite_bounds()
        groups = 1 if self.config.granularity == "layer" else key_min.shape[1]
        scores = page_scores(query, key_min, key_max, groups)  # [B, G, num_pages]
        selectable = self._selectable[layer_idx]  # [B]
        page_idx = torch.arange(table.page_slots.shape[1], device=selectable.device)
        pages = topk_selection(scores, table.page_valid & (page_idx[None, :] < selectable[:, None]),
                               self._num_pages[layer_idx])
        batch_size, num_groups, k = pages.indices.shape
        size = table.page_size
        slots = table.page_slots.gather(1, pages.indices.flatten(1)[..., None].expand(-1, -1, size))
        slots = slots.view(batch_size, num_groups, k * size)  # ascending: pages in order
        mask = pages.mask.repeat_interleave(size, dim=2) & (slots >= 0)
        # the recent pages: from the first one after the selectable pages to the last one in use
        in_use = -(-table.count // size)  # [B] pages holding a slot
        spans = int((in_use - selectable).max()) if batch_size else 0
        recent_pages = selectable[:, None] + torch.arange(spans, device=selectable.device)[None, :]  # [B, r]
        recent_ok = recent_pages < in_use[:, None]
        recent = table.page_slots.gather(1, recent_pages.clamp(max=table.page_slots.shape[1] - 1)[..., None]
                                         .expand(-1, -1, size)).flatten(1)  # [B, r * size]
        recent_mask = recent_ok.repeat_interleave(size, dim=1) & (recent >= 0)
        slots = torch.cat([slots, recent[:, None].expand(-1, num_groups, -1)], dim=2)
        mask = torch.cat([mask, recent_mask[:, None].expand(-1, num_groups, -1)], dim=2)
        return Selection(indices=slots.clamp(min=0), mask=mask)

    def keep_rows(self, rows: torch.Tensor) -> None:
        for table in self._pages.values():
            table.keep_rows(rows)
        self._num_pages = {layer: n[rows] for layer, n in self._num_pages.items()}
        self._selectable = {layer: n[rows] for layer, n in self._selectable.items()}
