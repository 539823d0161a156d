"""Score collection and top-k selection over a paged KV cache (vLLM's FlashAttention layout).

Two implementations of one computation:

- :mod:`vegas.kernels.reference`: pure PyTorch, any device, the specification.
- :mod:`vegas.kernels.triton_score`: a Triton kernel (GPU only; imported lazily).

Both accept any head shape vLLM's FlashAttention takes (any ``num_kv_heads x head_dim``, any
GQA ratio); :func:`check_head_shape` names what they refuse.

:func:`collect_scores` picks the Triton kernel for CUDA tensors when Triton imports, else the
reference. :func:`select_topk` is shared (``torch.topk`` plus index arithmetic).
"""

from __future__ import annotations

import torch

from .reference import (
    check_head_shape,
    collect_scores_layers_reference,
    collect_scores_reference,
    paged_slots,
    select_topk,
    select_topk_layers,
    slots_to_fa_pages,
)

__all__ = [
    "check_head_shape",
    "collect_scores",
    "collect_scores_layers_reference",
    "collect_scores_reference",
    "paged_slots",
    "select_topk",
    "select_topk_layers",
    "slots_to_fa_pages",
]


def collect_scores(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    max_len: int,
    scale: float = 1.0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Summed pre-softmax logits of each sequence's collect queries against its prefix keys.

    With ``softcap`` (a layer's ``logits_soft_cap``, Gemma 2) each logit is the soft-capped one
    the softmax sees, ``softcap * tanh(scale * q . k / softcap)``, before the sum: capping is
    monotonic per entry but not across the sum over queries and heads.

    Args:
        queries: ``(num_seqs, num_collect, num_q_heads, head_dim)``, the collect queries
            (collect2: the first and last verify query of each sequence).
        key_cache: ``(num_blocks, block_size, num_kv_heads, head_dim)``, one layer's keys
            (any strides with a unit last stride, e.g. ``kv_cache.unbind(1)[0]`` in vLLM).
        block_table: ``(num_seqs, max_blocks)`` int32 block ids of each sequence.
        ctx_lens: ``(num_seqs,)`` number of prefix positions to score per sequence.
        max_len: width of the output (>= ``ctx_lens.max()``).
        scale: softmax scale applied to the logits (does not change the ranking without a soft-cap).
        softcap: the attention logit soft-cap; 0 (vLLM's and FlashAttention's "none") for none.

    Returns:
        ``torch.FloatTensor`` of shape ``(num_seqs, max_len)``: ``sum_{t, h} cap(scale * q[t, h] . k[i, kv(h)])``
        (``cap`` the identity without a soft-cap) for ``i < ctx_lens[s]``, ``-inf`` beyond.
    """
    if queries.is_cuda:
        try:
            from .triton_score import collect_scores_triton
        except ImportError:  # pragma: no cover - Triton missing on a CUDA machine
            pass
        else:
            return collect_scores_triton(queries, key_cache, block_table, ctx_lens, max_len, scale, softcap)
    return collect_scores_reference(queries, key_cache, block_table, ctx_lens, max_len, scale, softcap)
