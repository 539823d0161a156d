"""The generic path: any selector without a fast path runs on vLLM through its ``select``.

In every full-attention forward (prefill or verification) the collect queries that the
selector's ``score_rows`` names are stashed per layer; at the last layer every layer is
scored in one kernel launch (:class:`~.scores.ScoreCollector`, as the score-based fast path;
summed over tensor-parallel ranks under ``tp_selection="all_reduce"``), and for each layer the
selector gets a :class:`~vegas.interfaces.SelectionInput` over token positions:

- ``scores``: ``(num_seqs, 1, max_len)`` float32, the rows' logits summed over the layer's
  query heads, 0 at and beyond ``ctx_sel`` (None when ``score_rows`` names no row);
- ``valid``: ``(num_seqs, max_len)`` bool, ``position < ctx_sel``;
- ``budget``: ``(num_seqs,)`` int64, ``min(selector.budget(ctx_sel), ctx_sel)``;
- ``keys``: ``(num_seqs, num_kv_heads, max_len, head_dim)`` gathered from the paged cache when
  ``selector.needs_keys``, else None.

The selected positions are mapped to cache slot ids through the block table and written into
the same selection buffers the fast paths write, so drafting is shared.

Cost: Python and a host synchronisation per verification (the selector's own ``select`` and
the check below), so this path cannot live inside CUDA graphs: the proposer forces piecewise
verification graphs for it (one log line says so). Limits:

- a query-aware selector (``select_for_query``) is refused (``VegasConfigError``);
- a selection must hold one count per request, the same at every layer, at most
  ``selector.budget(max_model_len)`` entries, one group (``granularity="layer"``);
- ``observe`` and ``keep_rows`` are not called: vLLM reorders and refills batch rows on its own,
  and per-request selector state follows batch rows (row ``i`` of one verification may be
  another request in the next).
"""

from __future__ import annotations

import torch

from ...config import VegasConfigError, VegasPluginError
from ...interfaces import Selection, SelectionInput
from ...kernels import paged_slots
from ...plugins import described, run_selector
from .scores import CollectingPath

__all__ = ["GenericPath", "positions_to_slots"]


def positions_to_slots(positions: torch.Tensor, mask: torch.Tensor, block_table: torch.Tensor, block_size: int):
    """Token positions -> cache slot ids of a paged cache, masked entries last.

    Args:
        positions: ``(num_seqs, k)`` int64 token positions.
        mask: ``(num_seqs, k)`` bool, the real entries.
        block_table: ``(num_seqs, max_blocks)`` int32 block ids.

    Returns:
        ``(num_seqs, k)`` int32 slot ids, the real entries first (in their order), -1 after.
    """
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices  # real entries first
    positions, mask = positions.gather(1, order), mask.gather(1, order)
    positions = positions.clamp(0, block_table.shape[1] * block_size - 1)  # padding may hold anything
    slots = paged_slots(positions, block_table, block_size).to(torch.int32)
    return torch.where(mask, slots, torch.full_like(slots, -1))


def _gather_keys(key_cache: torch.Tensor, block_table: torch.Tensor, max_len: int) -> torch.Tensor:
    """``(num_seqs, num_kv_heads, max_len, head_dim)`` keys of positions ``[0, max_len)``
    from ``key_cache`` ``(num_blocks, block_size, num_kv_heads, head_dim)``."""
    block_size = key_cache.shape[1]
    positions = torch.arange(max_len, device=key_cache.device)
    blocks = block_table[:, positions // block_size].long()  # [num_seqs, max_len]
    return key_cache[blocks, positions % block_size].permute(0, 2, 1, 3)


class GenericPath(CollectingPath):
    """Calls ``selector.select`` per layer at the last layer of every full-attention forward."""

    capturable = False

    @classmethod
    def raise_if_unsupported(cls, selector, config, block_size=None) -> None:
        if selector.per_row_scores:
            raise VegasConfigError(
                f"selector {selector.name!r} asks for per-row scores (an analysis selector); the vllm "
                "backend collects summed scores only: use backend='hf'"
            )
        if selector.query_aware:
            raise VegasConfigError(
                f"{described('selectors', selector.name)} is query-aware "
                "(select_for_query at every draft step) and has no vLLM fast path; the vllm backend runs "
                "query-aware selectors only through a fast path (register one with vegas_vllm_fast_paths), "
                "or use backend='hf'"
            )

    def select_layers(self, state, plan, scores, block_table) -> None:
        n, max_len = plan.num_seqs, plan.max_len
        valid = torch.arange(max_len, device=plan.ctx_sel.device)[None, :] < plan.ctx_sel[:, None]  # [n, max_len]
        counts = []
        for row in range(state.num_layers):
            layer_scores = None
            if scores is not None:
                layer_scores = scores[row].masked_fill(~valid, 0.0)[:, None, :]  # [n, 1, max_len] float32
            keys = None
            if self.selector.needs_keys:
                keys = _gather_keys(self.collector.key_caches[row], block_table, max_len)
            inputs = SelectionInput(
                layer_idx=state.first_layer + row, scores=layer_scores, valid=valid, budget=plan.budgets, keys=keys
            )
            selection = run_selector(self.selector, "select", inputs)
            slots = self._slots(state, selection, block_table, n)  # [n, k] int32
            state.sel_buf[row, :n].fill_(-1)
            state.sel_buf[row, :n, : slots.shape[1]].copy_(slots)
            counts.append(selection.mask[:, 0].sum(dim=1))
        counts = torch.stack(counts)  # [L, n] int64
        self._raise_if_counts_differ(counts)
        state.budget_buf[:n].copy_(counts[0])
        state.has_selection = True

    def _slots(self, state, selection: Selection, block_table, n: int) -> torch.Tensor:
        groups, width = selection.indices.shape[1], selection.indices.shape[2]
        if selection.indices.shape[0] != n or groups != 1:
            raise self._failure(
                f"select() must return (num_seqs={n}, groups=1, k) indices on the vllm backend, "
                f"got {tuple(selection.indices.shape)}"
            )
        if width > state.sel_buf.shape[2]:
            raise self._failure(
                f"select() returned {width} entries per sequence, more than its budget at max_model_len "
                f"({state.sel_buf.shape[2]})"
            )
        return positions_to_slots(selection.indices[:, 0], selection.mask[:, 0], block_table, state.block_size)

    def _raise_if_counts_differ(self, counts: torch.Tensor) -> None:
        if not bool((counts == counts[:1]).all()):  # host sync: once per verification
            raise self._failure(
                "select() chose a different number of positions per layer for one sequence; the vllm "
                "backend drafts with one count per sequence for every layer"
            )

    def _failure(self, message: str) -> VegasPluginError:
        name = self.selector.name
        return VegasPluginError(f"{described('selectors', name)}: {message}")
