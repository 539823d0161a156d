"""Pure-PyTorch reference of score collection and top-k over a paged KV cache.

Layout (vLLM FlashAttention, NHD): ``key_cache[block, offset, kv_head, :]`` holds the key of the
token at position ``p`` of sequence ``s`` where ``block = block_table[s, p // block_size]`` and
``offset = p % block_size``; its *slot id* is ``block * block_size + offset``.
"""

from __future__ import annotations

import torch

from ..config import VegasConfigError

__all__ = [
    "check_head_shape",
    "collect_scores_layers_reference",
    "collect_scores_reference",
    "select_topk",
    "select_topk_layers",
    "slots_to_fa_pages",
]


def check_head_shape(num_q_heads: int, num_kv_heads: int, head_dim: int, key_head_dim: int) -> None:
    """Shapes the kernels accept: any ``num_kv_heads >= 1`` and ``head_dim >= 1`` (keys and
    queries alike) and ``num_q_heads`` a multiple of ``num_kv_heads`` (GQA/MQA/MHA).

    Raises:
        VegasConfigError: naming the mismatching sizes.
    """
    if num_kv_heads < 1 or head_dim < 1:
        raise VegasConfigError(f"num_kv_heads and head_dim must be >= 1, got {num_kv_heads} and {head_dim}")
    if key_head_dim != head_dim:
        raise VegasConfigError(f"the keys' head_dim ({key_head_dim}) must equal the queries' head_dim ({head_dim})")
    if num_q_heads < num_kv_heads or num_q_heads % num_kv_heads:
        raise VegasConfigError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads}): each KV head "
            "serves the same number of query heads"
        )


def collect_scores_reference(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    max_len: int,
    scale: float = 1.0,
    softcap: float = 0.0,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of :func:`vegas.kernels.collect_scores` (same arguments and result).

    Materialises every logit per head and query in float32, one sequence at a time.

    Args:
        weights: optional ``(num_seqs, num_collect)`` float weight of each collect query's
            (capped) logits; None weighs every query 1.

    Raises:
        VegasConfigError: see :func:`check_head_shape`.
    """
    num_seqs, _, num_q_heads, head_dim = queries.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    check_head_shape(num_q_heads, num_kv_heads, head_dim, key_cache.shape[3])
    group = num_q_heads // num_kv_heads
    out = torch.full((num_seqs, max_len), float("-inf"), dtype=torch.float32, device=queries.device)
    for s in range(num_seqs):
        n = int(ctx_lens[s])
        if n == 0:
            continue
        pos = torch.arange(n, device=queries.device)
        blocks = block_table[s, pos // block_size].long()
        keys = key_cache[blocks, pos % block_size].float()  # [n, num_kv_heads, head_dim]
        keys = keys.repeat_interleave(group, dim=1)  # [n, num_q_heads, head_dim]
        logits = torch.einsum("qhd,nhd->qhn", queries[s].float(), keys) * scale  # [Q, H, n]
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        if weights is not None:
            logits = logits * weights[s].float()[:, None, None]
        out[s, :n] = logits.sum(dim=(0, 1))
    return out


def select_topk(
    scores: torch.Tensor,
    budgets: torch.Tensor,
    k_max: int,
    block_table: torch.Tensor,
    block_size: int,
    recent: torch.Tensor | None = None,
    ctx_lens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence top-k positions of ``scores``, as slot ids of the paged cache.

    Args:
        scores: ``(num_seqs, max_len)`` float scores, ``-inf`` where a position is not a candidate.
        budgets: ``(num_seqs,)`` k per sequence (callers clamp it to the number of candidates).
        k_max: static width, >= ``budgets.max()`` (and <= ``max_len``).
        block_table: ``(num_seqs, max_blocks)`` int32 block ids.
        block_size: tokens per block.
        recent: ``(num_seqs,)`` optional count of positions right before ``ctx_lens`` that are
            always selected (the recent window, inside the budget).
        ctx_lens: ``(num_seqs,)`` candidate prefix lengths; needed with ``recent``.

    Returns:
        ``slots``: ``torch.IntTensor`` of shape ``(num_seqs, k_max)``: slot ids of the
        ``budgets[s]`` best positions in the first ``budgets[s]`` columns (best first), ``-1``
        after; ``counts``: ``torch.IntTensor`` of shape ``(num_seqs,)``, equal to ``budgets``.
    """
    slots = select_topk_layers(scores[None], budgets, k_max, block_table, block_size, recent, ctx_lens)[0]
    return slots, budgets.to(torch.int32)


def paged_slots(positions: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """Token positions -> slot ids of vLLM's paged KV cache: ``block_table[.., p // block_size]
    * block_size + p % block_size``.

    Args:
        positions: int64 positions, ``(..., n)``; every ``p // block_size`` must index the table.
        block_table: int32 block ids with the same leading dimensions, ``(..., max_blocks)``.

    Returns:
        int64 slot ids shaped like ``positions``.
    """
    blocks = torch.gather(block_table.long(), -1, positions // block_size)
    return blocks * block_size + positions % block_size


def slots_to_fa_pages(slots: torch.Tensor, block_size: int, block_stride_tokens: int) -> torch.Tensor:
    """Slot ids -> page ids of a page-size-1 view of the cache.

    vLLM's FlashAttention cache is ``[num_blocks, 2, block_size, kv_heads, head_dim]`` (K and V
    interleaved per block), so a page-size-1 view over the flat tensor puts the key of slot
    ``b * block_size + o`` at page ``b * block_stride_tokens + o`` with
    ``block_stride_tokens = 2 * block_size`` (and its value ``block_size`` pages later).
    """
    return slots + (slots // block_size) * (block_stride_tokens - block_size)


def collect_scores_layers_reference(
    queries: torch.Tensor,
    weights: torch.Tensor,
    key_caches: list[torch.Tensor],
    block_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    max_len: int,
    scale: float = 1.0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Reference of the all-layers kernel: ``queries`` ``(L, num_seqs, NQ, H, D)``, each query's
    (soft-capped) logits weighted by ``weights`` ``(num_seqs, NQ)``; returns
    ``(L, num_seqs, max_len)`` float32."""
    return torch.stack(
        [
            collect_scores_reference(queries[l], key_caches[l], block_table, ctx_lens, max_len, scale, softcap, weights)
            for l in range(queries.shape[0])
        ]
    )


def select_topk_layers(
    scores: torch.Tensor,
    budgets: torch.Tensor,
    k_max: int,
    block_table: torch.Tensor,
    block_size: int,
    recent: torch.Tensor | None = None,
    ctx_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`select_topk` for ``scores`` ``(L, num_seqs, max_len)`` in one ``torch.topk``;
    returns ``(L, num_seqs, k_max)`` int32 slot ids (-1 beyond each budget).

    The top-k is sorted, so that the first ``budgets[s]`` columns are that sequence's best
    positions whatever ``k_max`` is (an unsorted top-``k_max`` would keep an arbitrary subset).
    With ``recent``, positions ``[ctx_lens[s] - recent[s], ctx_lens[s])`` score ``+inf`` first
    (``scores`` is modified in place).
    """
    num_layers, num_seqs, max_len = scores.shape
    if k_max == 0:
        return torch.empty((num_layers, num_seqs, 0), dtype=torch.int32, device=scores.device)
    if recent is not None:
        pos = torch.arange(max_len, device=scores.device)[None, :]
        end = ctx_lens.long()[:, None]
        keep = (pos >= end - recent.long()[:, None]) & (pos < end)  # [num_seqs, max_len]
        scores.masked_fill_(keep[None], float("inf"))
    pos = torch.topk(scores, k_max, dim=2, sorted=True).indices  # [L, num_seqs, k_max], best first
    bt = block_table[:num_seqs].long().unsqueeze(0).expand(num_layers, -1, -1)
    slots = paged_slots(pos, bt, block_size).to(torch.int32)
    col = torch.arange(k_max, device=scores.device)
    keep = col[None, None, :] < budgets[None, :, None]
    return torch.where(keep, slots, torch.full_like(slots, -1))
