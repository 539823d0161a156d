"""Page-size-1 draft tables from a selection (pure PyTorch, no vLLM): what both the drafting
engine (:mod:`.engine`) and the selection beside the first draft forward (:mod:`.in_draft`) build."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...kernels import slots_to_fa_pages

__all__ = ["DraftExtent", "build_draft_tables", "draft_extent"]


def build_draft_tables(
    sel_slots: torch.Tensor,
    budgets: torch.Tensor,
    ctx_sel: torch.Tensor,
    last_pos: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    page_stride: int,
    recent_cap: int,
) -> torch.Tensor:
    """Page-size-1 block tables of the draft phase.

    Row ``s`` of layer ``l``: columns ``[0, budgets[s])`` hold the selected pages, then the pages
    of positions ``ctx_sel[s], ctx_sel[s] + 1, …`` (the recent and draft positions); a draft query
    at position ``p`` uses ``seqused_k = budgets[s] + p - ctx_sel[s] + 1``.

    Args:
        sel_slots: ``(L, num_seqs, k_max)`` slot ids (L = layers, or 1 when shared).
        budgets, ctx_sel, last_pos: ``(num_seqs,)`` int64; ``last_pos`` is the last draft position.
        block_table: ``(num_seqs, max_blocks)`` int32.
        page_stride: pages per block in the page-size-1 view (``2 * block_size`` in vLLM).
        recent_cap: columns reserved for recent positions (>= max ``last_pos - ctx_sel + 1``).

    Returns:
        ``torch.IntTensor`` of shape ``(L, num_seqs, k_max + recent_cap)``.
    """
    num_layers, num_seqs, k_max = sel_slots.shape
    width = k_max + recent_cap
    col = torch.arange(width, device=budgets.device)[None, :]  # [1, width]
    k = budgets[:, None]  # [num_seqs, 1]
    positions = ctx_sel[:, None] + (col - k)  # [num_seqs, width] of the recent columns
    positions = torch.minimum(torch.clamp(positions, min=0), last_pos[:, None])
    block_idx = torch.clamp(positions // block_size, max=block_table.shape[1] - 1)  # no read past the table
    blocks = torch.gather(block_table[:num_seqs].long(), 1, block_idx)
    recent = slots_to_fa_pages(blocks * block_size + positions % block_size, block_size, page_stride)
    selected = slots_to_fa_pages(sel_slots.long().clamp(min=0), block_size, page_stride)  # [L, num_seqs, k_max]
    selected = torch.nn.functional.pad(selected, (0, recent_cap))
    return torch.where(col[None] < k[None], selected, recent[None]).to(torch.int32)


class DraftExtent(NamedTuple):
    """What every draft table of one draft phase is laid out by (:func:`draft_extent`)."""

    active: torch.Tensor  # [rows] bool: rows with a request
    first_pos: torch.Tensor  # [rows] int64: position of each row's first draft
    ctx_sel: torch.Tensor  # [rows] int64: the selectable prefix, at most first_pos
    recent_cap: int  # table columns for the positions from ctx_sel on
    base_used: torch.Tensor  # [rows] int64: pages in use before the first draft (1 for an idle row)


def draft_extent(step_inputs: torch.Tensor, ctx_sel: torch.Tensor, budgets: torch.Tensor, gamma: int,
                 path_columns: int) -> DraftExtent:
    """The layout shared by the draft tables of a draft phase, whichever way the selection was made.

    Args:
        step_inputs: ``(4, rows)`` int64 (active, last token, its position, blocks in use).
        ctx_sel, budgets: ``(rows,)`` int64, the verification's selectable prefix and KV budgets.
        gamma: γ.
        path_columns: columns the selection path keeps beyond ``2γ + 2`` for recent positions
            (``SelectionPath.recent_columns``).
    """
    active, _, first_pos, _ = step_inputs.unbind(0)
    active = active.bool()
    ctx_sel = torch.minimum(ctx_sel, first_pos)
    # recent positions from ctx_sel on: the verified chunk and the drafts (plus the path's own)
    recent_cap = 2 * gamma + 2 + path_columns
    base_used = torch.where(active, budgets + (first_pos - ctx_sel + 1), 1)
    return DraftExtent(active, first_pos, ctx_sel, recent_cap, base_used)
