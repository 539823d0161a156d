"""Draft attention on vLLM's FlashAttention backend (FA3 on Hopper).

:func:`vegas.vllm_plugin.patches.patch_attention` wraps ``FlashAttentionImpl.forward`` once per
process:

- **draft calls** (the forward context carries :class:`DraftMetadata` for the layer):
  :func:`draft_attention`, FA3 over
  the same paged cache viewed with page size 1, with this layer's block table of selected
  pages plus the recent/draft pages (``seqused_k`` = budget + recent count); Quest first
  writes the pages it chooses for this step's query into the table. A sliding-window layer
  (Gemma 2) drafts over its own window of the paged cache instead, as it attends in the target;
- **every other call with metadata** (prefill and verification of the runner): the normal FA3
  call, then :meth:`vegas.vllm_plugin.selection.state.SelectionState.on_layer` hands the layer to the
  selector's selection path.

The KV write of draft tokens is vLLM's own ``unified_kv_cache_update`` with the slot mapping
that the proposer puts into the forward context. Under piecewise CUDA graphs (attention is a
splitting op) this Python runs every step; under vLLM's full CUDA graphs it runs once per
captured batch shape, and the captured selection writes the persistent selection buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..selectors.quest import QuestDraft, fill_draft_table

__all__ = ["DraftMetadata", "ONE_SPLIT_MAX_KEYS", "draft_attention", "draft_schedule", "draft_splits",
           "layer_index", "page_views"]

#: draft tables at most this wide (keys) run FA3 unsplit (``num_splits=1``): at most four key
#: blocks per request, where FA3's split-KV heuristic would add a combine kernel per layer to a
#: launch-bound draft forward for a few microseconds of parallelism
ONE_SPLIT_MAX_KEYS = 512

_layer_idx: dict[str, int] = {}
_views: dict[tuple[int, tuple], tuple[torch.Tensor, torch.Tensor]] = {}


@dataclass
class DraftMetadata:
    """Attention metadata of one layer in one draft step (query length 1 per request).

    Attributes:
        block_table: ``(num_seqs, width)`` int32 page ids of the page-size-1 view.
        seqused_k: ``(num_seqs,)`` int32 pages used per request.
        query_start_loc: ``(num_seqs + 1,)`` int32, ``arange``.
        max_seq_len: host bound of ``seqused_k`` (the table width).
        num_actual_tokens: requests in the step (tokens beyond are padding).
        quest: Quest only: chooses this step's pages from its query and writes them into
            ``block_table`` before the attention (see :mod:`vegas.vllm_plugin.selectors.quest`).
        quest_row: the layer's row in the Quest page bounds.
        scheduler_metadata: FA3's tile schedule of this draft step (:func:`draft_schedule`),
            shared by every layer (their ``seqused_k`` and table width are the same); None lets
            each layer's FA3 call compute it (one more kernel per layer).
        window: a sliding-window layer's FA3 window ``(left, right)``: then ``block_table`` is
            the runner's own ``(num_seqs, max_blocks)`` table of the paged cache, ``seqused_k``
            the positions ``0..p`` each draft token sees, and the layer attends its window of
            them, as in the target model; None for the layers that draft over the selection.
        ready: a CUDA event the attention waits for first: the layer's group of a selection
            made beside the first draft forward (``vllm.select_in_draft``,
            :mod:`vegas.vllm_plugin.drafting.in_draft`); None: its table is ready.
    """

    block_table: torch.Tensor
    seqused_k: torch.Tensor
    query_start_loc: torch.Tensor
    max_seq_len: int
    num_actual_tokens: int
    quest: QuestDraft | None = None
    quest_row: int = 0
    scheduler_metadata: torch.Tensor | None = None
    window: tuple[int, int] | None = None
    ready: object | None = None


def layer_index(layer_name: str) -> int:
    idx = _layer_idx.get(layer_name)
    if idx is None:
        from vllm.model_executor.models.utils import extract_layer_index

        idx = _layer_idx[layer_name] = extract_layer_index(layer_name)
    return idx


def page_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[num_blocks, 2, block_size, H, D]`` cache -> K and V views ``[num_pages, 1, H, D]``.

    Page ``p = block * page_stride + offset`` (``page_stride = stride(0) // stride(2)``,
    ``2 * block_size`` for vLLM's NHD layout) addresses the key (value) of slot
    ``block * block_size + offset``; see :func:`vegas.kernels.slots_to_fa_pages`.
    """
    key = (kv_cache.data_ptr(), tuple(kv_cache.shape))
    hit = _views.get(key)
    if hit is not None:
        return hit
    num_blocks, _, block_size, num_heads, head_dim = kv_cache.shape
    k_cache, v_cache = kv_cache.unbind(1)
    s_block, s_tok, s_head = k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)
    page_stride = s_block // s_tok
    num_pages = (num_blocks - 1) * page_stride + block_size
    size, stride = (num_pages, 1, num_heads, head_dim), (s_tok, s_tok, s_head, 1)
    views = (
        torch.as_strided(k_cache, size, stride),
        torch.as_strided(v_cache, size, stride),
    )
    _views[key] = views
    return views


def draft_splits(width: int) -> int:
    """FA3's ``num_splits`` of a draft step over a table ``width`` keys wide: 1 up to
    :data:`ONE_SPLIT_MAX_KEYS`, else 0 (FA3's heuristic)."""
    return 1 if width <= ONE_SPLIT_MAX_KEYS else 0


def draft_schedule(impl, seqused_k: torch.Tensor, query_start_loc: torch.Tensor, width: int, dtype):
    """FA3's tile schedule of one draft step (``get_scheduler_metadata`` with the arguments
    :func:`draft_attention` calls FA3 with), computed once per step instead of once per layer;
    None where FA3 is not the attention (FA2 takes no schedule).

    Args:
        impl: a layer's ``FlashAttentionImpl`` (heads, head size, soft-cap; all layers alike).
        seqused_k: ``(rows,)`` int32 pages each request attends in this step.
        query_start_loc: ``(rows + 1,)`` int32 ``arange``.
        width: the draft table's width (``max_seqlen_k``).
        dtype: the KV cache's dtype.
    """
    if getattr(impl, "vllm_flash_attn_version", None) != 3:
        return None
    from vllm.v1.attention.backends.flash_attn import get_scheduler_metadata

    return get_scheduler_metadata(
        batch_size=seqused_k.shape[0], max_seqlen_q=1, max_seqlen_k=width, num_heads_q=impl.num_heads,
        num_heads_kv=impl.num_kv_heads, headdim=impl.head_size, cache_seqlens=seqused_k, qkv_dtype=dtype,
        cu_seqlens_q=query_start_loc, page_size=1, causal=True, has_softcap=bool(impl.logits_soft_cap),
        num_splits=draft_splits(width),
    )


def draft_attention(impl, layer, query, kv_cache, md: DraftMetadata, output):
    """FA3 over the page-size-1 view of ``kv_cache`` with the layer's draft table (Quest first
    writes this step's pages into it), or, for a sliding-window layer (``md.window``), FA3 over
    the paged cache itself with the runner's block table and the layer's window; ``impl`` is the
    layer's ``FlashAttentionImpl``.

    Args:
        query: ``(num_tokens, num_q_heads, head_dim)``, one token per request (then padding).
        output: ``(num_tokens, num_q_heads, head_dim)`` written in place and returned.
    """
    from vllm.v1.attention.backends.flash_attn import flash_attn_varlen_func

    n = md.num_actual_tokens
    if md.ready is not None:  # this layer's selection, made on a side stream beside the draft
        torch.cuda.current_stream(query.device).wait_event(md.ready)
    if md.window is not None:  # a sliding-window layer: its own window of the paged cache
        k_view, v_view = kv_cache.unbind(1)  # [num_blocks, block_size, kv_heads, head_dim] each
    else:
        if md.quest is not None:
            fill_draft_table(md.block_table, query[:n], impl.num_kv_heads, md.quest, md.quest_row)
        k_view, v_view = page_views(kv_cache)
    descale_shape = (n, impl.num_kv_heads)
    flash_attn_varlen_func(
        q=query[:n],
        k=k_view,
        v=v_view,
        out=output[:n],
        cu_seqlens_q=md.query_start_loc,
        max_seqlen_q=1,
        seqused_k=md.seqused_k,
        max_seqlen_k=md.max_seq_len,
        softmax_scale=impl.scale,
        causal=True,
        alibi_slopes=impl.alibi_slopes,
        window_size=list(md.window) if md.window is not None else None,
        block_table=md.block_table,
        softcap=impl.logits_soft_cap,
        scheduler_metadata=md.scheduler_metadata,
        fa_version=impl.vllm_flash_attn_version,
        q_descale=None,
        k_descale=layer._k_scale.expand(descale_shape),
        v_descale=layer._v_scale.expand(descale_shape),
        num_splits=0 if md.window is not None else draft_splits(md.max_seq_len),
        s_aux=impl.sinks,
    )
    return output
