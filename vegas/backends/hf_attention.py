"""The attention function Vegas registers with transformers' ``AttentionInterface``.

transformers calls it for every attention layer with the layer's post-RoPE ``query``
``(batch_size, num_heads, q_len, head_dim)`` and the cached ``key``/``value``
``(batch_size, num_kv_heads, num_slots, head_dim)`` (the new tokens included, before GQA
repetition). The per-call :class:`AttentionContext` travels as the keyword ``vegas_ctx``
of ``model(...)``; without it the function is plain masked attention.

* ``full``: full attention under ``attention_mask`` (prefill, verification, plain
  decoding). When ``ctx.score_rows`` is set, the logits of those query rows are reduced
  with :func:`vegas.selection.collect_scores` and stored in ``ctx.scores[layer]``: only
  ``(batch_size, num_heads, len(score_rows), num_slots)`` is materialised for it.
* ``draft``: sparse attention over the layer's selected slots (gathered, so the work is
  proportional to the budget) plus every slot appended since the selection.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.nn.functional import scaled_dot_product_attention

from ..interfaces import Selection, Selector
from ..plugins import run_selector
from ..selection import collect_scores

ATTENTION_NAME = "vegas"


def clock(sync: bool) -> float:
    """Seconds from ``time.perf_counter``, after the CUDA queue drains when ``sync``."""
    if sync:
        torch.cuda.synchronize()
    return time.perf_counter()


@dataclass
class AttentionContext:
    """Per-forward instructions and outputs of :func:`vegas_attention`.

    Attributes:
        mode: ``"full"`` or ``"draft"``.
        score_rows: query rows (of this forward's ``q_len``) whose scores to collect.
        score_allowed: ``(batch_size, len(score_rows), num_slots)`` bool visibility.
        score_mode, groups: see :func:`vegas.selection.collect_scores`.
        scores: filled per layer, ``(batch_size, groups, num_slots)`` float32.
        selections: per layer, the drafting index sets (draft mode).
        selection_len: cache length at selection time; later slots are always attended.
        selector: the query-aware selector to refine selections per draft step, or None.
        selection_seconds: time spent collecting / refining (seconds), accumulated.
        sync: synchronise CUDA around timed sections (accurate timing on GPUs).
    """

    mode: str = "full"
    score_rows: list[int] | None = None
    score_allowed: torch.Tensor | None = None
    score_mode: str = "logit"
    groups: int = 1
    scores: dict[int, torch.Tensor] = field(default_factory=dict)
    selections: list[Selection] | None = None
    selection_len: int = 0
    selector: Selector | None = None
    selection_seconds: float = 0.0
    sync: bool = False

    def _tick(self) -> float:
        return clock(self.sync)


def _gather_slots(x: torch.Tensor, sel: Selection) -> torch.Tensor:
    """Slots ``sel.indices`` of ``x`` ``(B, KVH, L, D)`` -> ``(B, KVH, k, D)``."""
    batch_size, num_kv_heads, _, head_dim = x.shape
    idx = sel.indices.expand(batch_size, num_kv_heads, -1)
    return x.gather(2, idx[..., None].expand(-1, -1, -1, head_dim))


def _draft_attention(module, query, key, value, scaling, ctx: AttentionContext):
    layer = module.layer_idx
    sel = ctx.selections[layer]
    if ctx.selector is not None and ctx.selector.query_aware:
        start = ctx._tick()
        sel = run_selector(ctx.selector, "select_for_query", layer, query, sel)
        ctx.selection_seconds += ctx._tick() - start
    n = ctx.selection_len
    k = torch.cat([_gather_slots(key, sel), key[:, :, n:]], dim=2)
    v = torch.cat([_gather_slots(value, sel), value[:, :, n:]], dim=2)
    recent = sel.mask.new_ones(sel.mask.shape[0], sel.mask.shape[1], key.shape[2] - n)
    mask = torch.cat([sel.mask, recent], dim=2)  # [B, G, k + recent]
    num_heads, groups = query.shape[1], mask.shape[1]
    mask = mask.repeat_interleave(num_heads // groups, dim=1)[:, :, None, :]  # [B, H, 1, ...]
    return scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)


def vegas_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    vegas_ctx: AttentionContext | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention for transformers models; see the module docstring.

    Args:
        attention_mask: ``torch.BoolTensor (batch_size, 1, q_len, num_slots)`` (True =
            attend), or None for plain causal attention.

    Returns:
        ``(attn_output (batch_size, q_len, num_heads, head_dim), None)``.
    """
    ctx = vegas_ctx
    if ctx is not None and ctx.mode == "draft":
        out = _draft_attention(module, query, key, value, scaling, ctx)
    else:
        is_causal = attention_mask is None and query.shape[2] > 1
        out = scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, is_causal=is_causal,
            scale=scaling, enable_gqa=True,
        )
        if ctx is not None and ctx.score_rows:
            start = ctx._tick()
            rows = query[:, :, ctx.score_rows]  # [B, H, m, D]
            ctx.scores[module.layer_idx] = collect_scores(
                rows, key, ctx.score_allowed, scaling, ctx.groups, ctx.score_mode
            )
            ctx.selection_seconds += ctx._tick() - start
    return out.transpose(1, 2).contiguous(), None
