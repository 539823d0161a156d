"""Quest page metadata and page selection over vLLM's paged KV cache (pure PyTorch).

Quest (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
Inference", §3) keeps, per page of keys, the element-wise minimum and maximum over the page's
keys; for a query ``q`` the bound ``Σ_d max(q_d · min_d, q_d · max_d)`` is at least ``q · k``
for every key ``k`` of the page, and the pages with the highest bounds are attended.

On vLLM a page is one KV-cache block (``block_size`` slots, 16 by default), so the metadata is
indexed by physical block id, shared by every request that holds the block (prefix caching),
and ``1 / block_size`` of the key cache in size per bound. It is kept current by
:func:`update_page_bounds` after every KV write of a runner forward (prefill and verification).

Summed over the query heads of a KV head, the bound is linear in two per-KV-head vectors
(:func:`group_query`): ``Σ_g max(q_g · mn, q_g · mx) = Q⁺ · mx + Q⁻ · mn`` element-wise, with
``Q⁺ = Σ_g max(q_g, 0)`` and ``Q⁻ = Σ_g min(q_g, 0)``. That equals the HF backend's
:func:`vegas.strategies.quest.page_scores` with ``granularity="layer"``.
"""

from __future__ import annotations

import torch

from .reference import check_head_shape

__all__ = ["group_query", "last_in_block", "page_scores_reference", "select_pages", "update_page_bounds"]


def update_page_bounds(
    key_min: torch.Tensor,
    key_max: torch.Tensor,
    key_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Recompute the bounds of every block that a forward just wrote (in place, no host sync).

    The last slot written to a block in this forward (the next token's slot is not the next
    slot of the same block) recomputes the block's bounds over offsets ``[0, its offset]``:
    the slots a request has filled, so stale keys of a reused block or of rejected drafts
    beyond it do not count. Other tokens write to the scratch row ``key_min.shape[0] - 1``, so
    shapes stay static (CUDA-graph capture).

    Args:
        key_min, key_max: ``(num_blocks + 1, num_kv_heads, head_dim)`` in the cache dtype;
            row ``num_blocks`` is scratch.
        key_cache: ``(num_blocks, block_size, num_kv_heads, head_dim)`` one layer's keys (any
            strides, e.g. ``kv_cache.unbind(1)[0]`` in vLLM).
        slot_mapping: ``(num_tokens,)`` integer slot ids of the forward's tokens, ``< 0`` for
            padding.
    """
    block_size = key_cache.shape[1]
    scratch = key_min.shape[0] - 1
    slots = slot_mapping.long()
    valid = slots >= 0
    last = last_in_block(slots, block_size)
    blocks = torch.where(valid, slots // block_size, 0)
    offsets = torch.where(valid, slots % block_size, 0)
    keys = key_cache[blocks]  # (num_tokens, block_size, kv_heads, head_dim)
    filled = (torch.arange(block_size, device=slots.device)[None, :] <= offsets[:, None])[..., None, None]
    mn = keys.masked_fill(~filled, float("inf")).amin(dim=1)
    mx = keys.masked_fill(~filled, float("-inf")).amax(dim=1)
    dst = torch.where(last, blocks, scratch)
    key_min.index_copy_(0, dst, mn)
    key_max.index_copy_(0, dst, mx)


def last_in_block(slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """``(num_tokens,)`` bool: the token is the last one of the forward written to its block
    (a request's tokens are consecutive and fill consecutive slots of a block; ``slots < 0``
    is padding). Exactly one token per written block is marked, so the bounds' scatter has no
    duplicate destinations (its order would be undefined on a GPU)."""
    nxt = torch.cat([slots[1:], slots.new_full((1,), -1)])
    return (slots >= 0) & ((nxt != slots + 1) | ((slots + 1) % block_size == 0))


def group_query(query: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q⁺, Q⁻)`` of a draft step's queries, each ``(num_seqs, num_kv_heads * head_dim)`` float32.

    Args:
        query: ``(num_seqs, num_q_heads, head_dim)``; query head ``h`` reads KV head
            ``h // (num_q_heads // num_kv_heads)`` (any head_dim, any GQA ratio).

    Raises:
        VegasConfigError: ``num_q_heads`` is not a multiple of ``num_kv_heads``.
    """
    n, hq, d = query.shape
    check_head_shape(hq, num_kv_heads, d, d)
    q = query.float().view(n, num_kv_heads, hq // num_kv_heads, d)
    return q.clamp(min=0).sum(2).reshape(n, -1), q.clamp(max=0).sum(2).reshape(n, -1)


def page_scores_reference(
    q_pos: torch.Tensor,
    q_neg: torch.Tensor,
    key_min: torch.Tensor,
    key_max: torch.Tensor,
    block_table: torch.Tensor,
    num_pages: torch.Tensor,
) -> torch.Tensor:
    """Quest bound of each request's first ``num_pages`` blocks.

    Args:
        q_pos, q_neg: ``(num_seqs, num_kv_heads * head_dim)`` float32 (:func:`group_query`).
        key_min, key_max: ``(num_blocks + 1, num_kv_heads, head_dim)``.
        block_table: ``(num_seqs, max_blocks)`` int32 block ids.
        num_pages: ``(num_seqs,)`` integer pages to score per request.

    Returns:
        ``torch.FloatTensor (num_seqs, max_blocks)``: the bound, ``-inf`` from ``num_pages`` on.
    """
    n, width = block_table.shape
    mx = key_max[block_table.long()].reshape(n, width, -1).float()
    mn = key_min[block_table.long()].reshape(n, width, -1).float()
    scores = (mx * q_pos[:, None, :]).sum(-1) + (mn * q_neg[:, None, :]).sum(-1)
    col = torch.arange(width, device=scores.device)[None, :]
    return scores.masked_fill(col >= num_pages[:, None], float("-inf"))


def select_pages(scores: torch.Tensor, k_pages: int, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slots of the ``k_pages`` best-scored pages of each request, best page first:
    ``(num_seqs, k_pages * block_size)`` int64, so columns ``[0, k * block_size)`` hold the best
    ``k`` pages for any ``k <= k_pages``.

    Pages that scored ``-inf`` (beyond a request's pages) come last and are still some slot of
    the request's table; the caller masks columns beyond each request's budget.
    """
    k_pages = min(k_pages, scores.shape[1])
    pages = scores.topk(k_pages, dim=1, sorted=True).indices  # best first: columns [0, k) hold the best k
    blocks = torch.gather(block_table.long(), 1, pages)
    offs = torch.arange(block_size, device=scores.device)
    return (blocks[:, :, None] * block_size + offs).flatten(1)
