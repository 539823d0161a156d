"""The per-batch plan of a full-attention forward on vLLM (pure PyTorch, no vLLM).

Positions, per request of the batch:

- the verified chunk holds positions ``[seq_len - query_len, seq_len)``;
- the collect queries are the last ``γ + 1`` of the chunk (or the whole chunk when shorter);
  the selector's ``score_rows(chunk_len)`` names which of them are scored (:class:`RowTable`);
- ``ctx_sel`` = position of the first collect query; keys ``[0, ctx_sel)`` are selectable, so
  no causal mask is needed (every collect query sees all of them);
- drafting attends to the ``k`` selected positions plus every position ``>= ctx_sel``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...config import VegasConfigError, recent_window_for
from ...interfaces import Selector
from ...plugins import run_selector

__all__ = ["CollectPlan", "RowTable", "budget_cap", "make_plan", "score_rows_by_length"]


def score_rows_by_length(selector: Selector, gamma: int) -> list[list[int]]:
    """``selector.score_rows(c)`` of every chunk length ``c`` in ``0 .. γ + 1`` (sorted, without
    repeats; ``c = 0`` scores nothing): offsets into a chunk of ``c`` collect queries.

    Raises:
        VegasPluginError: ``score_rows`` raised.
    """
    return [[]] + [sorted(set(run_selector(selector, "score_rows", c))) for c in range(1, gamma + 2)]


@dataclass(frozen=True)
class RowTable:
    """The selector's ``score_rows`` of every chunk length, as device tensors (built once, so
    that a plan needs no host work and can be captured into CUDA graphs).

    Row ``c`` lists ``score_rows(c)`` (offsets into a chunk of ``c`` collect queries), padded
    to ``width`` with the last listed row at weight 0; ``c = 0`` (a padded request of a
    captured batch) is all padding.

    Attributes:
        rows: ``(γ + 2, width)`` int64 query offsets within the chunk.
        weights: ``(γ + 2, width)`` float32, 1 for a scored row, 0 for padding.
    """

    rows: torch.Tensor  # [γ + 2, width] int64
    weights: torch.Tensor  # [γ + 2, width] float32

    @property
    def width(self) -> int:
        """Collect queries per request (0: the selector scores nothing)."""
        return self.rows.shape[1]

    @classmethod
    def of(cls, selector: Selector, gamma: int, device) -> RowTable:
        """Ask ``selector.score_rows(c)`` for every chunk length ``c`` in ``1 .. γ + 1``.

        Raises:
            VegasPluginError: ``score_rows`` raised.
            VegasConfigError: it named a row outside ``[0, c)``.
        """
        listed = score_rows_by_length(selector, gamma)
        for c, rows in enumerate(listed):
            if any(not 0 <= r < max(c, 1) for r in rows):
                raise VegasConfigError(
                    f"selector {selector.name!r}: score_rows({c}) must name rows in [0, {c}), got {rows}"
                )
        width = max(len(rows) for rows in listed)
        offsets = torch.zeros((gamma + 2, width), dtype=torch.int64)
        weights = torch.zeros((gamma + 2, width), dtype=torch.float32)
        for c, rows in enumerate(listed):
            padded = rows + [rows[-1] if rows else 0] * (width - len(rows))
            offsets[c] = torch.tensor(padded, dtype=torch.int64)
            weights[c, : len(rows)] = 1.0
        return cls(offsets.to(device), weights.to(device))


@dataclass
class CollectPlan:
    """Per-batch plan of one full-attention forward (built at its first layer).

    Attributes:
        num_seqs: requests in the batch (padded requests of a captured batch included).
        q_idx: ``(num_seqs, width)`` int64 token indices of the collect queries in the batch
            (None when the selector scores nothing).
        q_weight: ``(num_seqs, width)`` float32 1/0 (0 masks the padding of a short chunk).
        ctx_sel: ``(num_seqs,)`` int64 selectable positions ``[0, ctx_sel)``.
        budgets: ``(num_seqs,)`` int64 k per request (<= ctx_sel).
        recent: ``(num_seqs,)`` int64 positions right before ``ctx_sel`` kept inside the budget
            by score-based selectors (:func:`vegas.config.recent_window_for`).
        k_max: static top-k width (>= budgets.max()).
        max_len: score width (>= ctx_sel.max()), tokens.
    """

    num_seqs: int
    q_idx: torch.Tensor | None  # [num_seqs, width] int64
    q_weight: torch.Tensor | None  # [num_seqs, width] float32
    ctx_sel: torch.Tensor  # [num_seqs] int64
    budgets: torch.Tensor  # [num_seqs] int64
    recent: torch.Tensor  # [num_seqs] int64
    k_max: int
    max_len: int


def budget_cap(selector: Selector, context_len: int) -> int:
    """The selector's KV budget for ``context_len`` tokens, clamped to it (host ints)."""
    return min(int(run_selector(selector, "budget", context_len)), context_len)


def make_plan(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    gamma: int,
    selector: Selector,
    row_table: RowTable,
) -> CollectPlan:
    """Collect plan of a batch from its attention metadata (device tensors, no host sync).

    Args:
        query_start_loc: ``(num_seqs + 1,)`` int32 cumulative query lengths.
        seq_lens: ``(num_seqs,)`` int32 sequence lengths including this chunk.
        max_seq_len: host-side upper bound of ``seq_lens``.
        gamma: γ, draft tokens per iteration.
        selector: its ``budget`` gives the KV budgets (with a tensor of contexts).
        row_table: the selector's score rows (:meth:`RowTable.of`).
    """
    num_seqs = seq_lens.shape[0]
    start = query_start_loc[:num_seqs].long()
    end = query_start_loc[1 : num_seqs + 1].long()
    first = torch.maximum(start, end - 1 - gamma)
    ctx_sel = torch.clamp(seq_lens.long() - (end - first), min=0)
    q_idx = q_weight = None
    if row_table.width:
        chunk_len = (end - first).clamp(0, gamma + 1)  # [num_seqs]
        q_idx = first[:, None] + row_table.rows[chunk_len]
        q_weight = row_table.weights[chunk_len]
    max_len = max(int(max_seq_len), 1)
    k_max = budget_cap(selector, max_len)
    budgets = torch.minimum(run_selector(selector, "budget", ctx_sel), ctx_sel)
    recent = recent_window_for(selector.config, budgets)
    return CollectPlan(num_seqs, q_idx, q_weight, ctx_sel, budgets, recent, k_max, max_len)
