"""Selection maths shared by the selectors and the backends; pure tensor code, no model.

* :func:`collect_scores`: aggregated attention scores of a few query rows (the Vegas
  oracle, seed §"Verification-guided selection"; design notes (docs/design-notes.md) §1 step 4).
* :func:`topk_selection`: per-sequence top-k under a per-sequence budget.
"""

from __future__ import annotations

import torch

from .interfaces import Selection

__all__ = ["collect_scores", "topk_selection", "selection_from_keep"]


def collect_scores(
    query_rows: torch.Tensor,
    keys: torch.Tensor,
    allowed: torch.Tensor,
    scaling: float,
    groups: int,
    score_mode: str = "logit",
    softcap: float | None = None,
    per_row: bool = False,
) -> torch.Tensor:
    """Sum of attention scores of ``m`` query rows over those rows and the heads of each group.

    ``score[b, g, i] = Σ_t Σ_{h ∈ g} s_h[b, t, i]`` with ``s`` the pre-softmax logit
    ``q·k * scaling`` (``score_mode="logit"``, the seed's formula) or the softmax weight
    (``"weight"``, the reference implementation's default). With ``softcap`` (Gemma 2) the
    logit is the soft-capped one the softmax sees, ``softcap * tanh(q·k * scaling / softcap)``.
    Only ``m`` rows are materialised: ``(batch_size, num_heads, m, num_slots)`` float32.

    Args:
        query_rows: ``(batch_size, num_heads, m, head_dim)``, post-RoPE queries.
        keys: ``(batch_size, num_kv_heads, num_slots, head_dim)``, the layer's cached keys.
        allowed: ``torch.BoolTensor (batch_size, m, num_slots)``: key ``i`` is visible to row
            ``t`` (causal, not padding). Disallowed entries contribute 0.
        scaling: softmax scale, usually ``head_dim ** -0.5``.
        groups: 1 (one score per layer) or ``num_kv_heads`` (one per KV head).
        softcap: the layer's attention logit soft-cap, or None (0 alike) for none.
        per_row: keep the rows apart (summed over the heads of each group only).

    Returns:
        ``torch.FloatTensor (batch_size, groups, num_slots)``, or ``(batch_size, groups, m,
        num_slots)`` with ``per_row``.
    """
    batch_size, num_heads, m, head_dim = query_rows.shape
    num_kv_heads, num_slots = keys.shape[1], keys.shape[2]
    q = query_rows.float().view(batch_size, num_kv_heads, num_heads // num_kv_heads * m, head_dim)
    logits = torch.matmul(q, keys.float().transpose(-1, -2)) * scaling  # [B, KVH, g*m, L]
    logits = logits.view(batch_size, num_heads, m, num_slots)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    mask = allowed[:, None]  # [B, 1, m, L]
    if score_mode == "weight":
        s = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
        s = torch.nan_to_num(s, nan=0.0)  # rows with no visible key
    else:
        s = logits.masked_fill(~mask, 0.0)
    s = s.view(batch_size, groups, num_heads // groups, m, num_slots).sum(dim=2)  # [B, G, m, L]
    return s if per_row else s.sum(dim=2)


def topk_selection(scores: torch.Tensor, valid: torch.Tensor, budget: torch.Tensor) -> Selection:
    """Top-``budget[b]`` valid slots of ``scores`` per sequence and group, in ascending slot order.

    Args:
        scores: ``torch.FloatTensor (batch_size, groups, num_slots)``.
        valid: ``torch.BoolTensor (batch_size, num_slots)``.
        budget: ``torch.LongTensor (batch_size,)``, at most the number of valid slots.

    Returns:
        :class:`Selection` with ``k = max(budget)``.
    """
    k = int(budget.max()) if budget.numel() else 0
    masked = scores.float().masked_fill(~valid[:, None, :], float("-inf"))
    top = masked.topk(k, dim=-1).indices  # [B, G, k], best first
    mask = torch.arange(k, device=scores.device)[None, None, :] < budget[:, None, None]
    # Drop the entries beyond each sequence's budget, then order by slot.
    top = torch.where(mask, top, torch.full_like(top, scores.shape[-1]))
    top = top.sort(dim=-1).values
    return Selection(indices=top.masked_fill(~mask, 0), mask=mask.expand_as(top).clone())


def selection_from_keep(keep: torch.Tensor) -> Selection:
    """:class:`Selection` of the True slots of ``keep`` ``(batch_size, groups, num_slots)``."""
    num_slots = keep.shape[-1]
    counts = keep.sum(dim=-1)  # [B, G]
    k = int(counts.max()) if counts.numel() else 0
    slots = torch.arange(num_slots, device=keep.device).expand_as(keep)
    order = torch.where(keep, slots, slots + num_slots).sort(dim=-1).values[..., :k]
    mask = torch.arange(k, device=keep.device) < counts[..., None]
    return Selection(indices=order.masked_fill(~mask, 0), mask=mask)
