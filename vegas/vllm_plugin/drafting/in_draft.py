"""The score pass and top-k of a score-based selector inside the draft phase, beside the first
draft forward (``VegasConfig.vllm.select_in_draft``).

Why: after a verification, collect2's selection reads every layer's keys once (at SmolLM2,
7,680 tokens, batch 128: 11.3 GB, ~2.6 ms at 4.3 TB/s, plus the top-k), while a draft forward
is launch-bound (~360 small kernels, ~1.65 ms for ~1.4 GB) and leaves the memory bus mostly
idle. Here the verification only keeps its collect queries
(:meth:`~vegas.vllm_plugin.selection.state.SelectionState.defer_selection`); the draft phase
forks a side stream that scores and selects the layers in :data:`GROUPS` groups, each group in
one launch of the same score kernel (:func:`vegas.kernels.triton_score.collect_scores_layers_triton`)
and one ``torch.topk``, writes the group's draft tables and records an event; in the first draft
forward each layer's attention waits for its group's event only
(:class:`~vegas.vllm_plugin.drafting.attention.DraftMetadata` ``ready``). The first group gates the
draft's start; the later groups run beside the draft's earlier layers.

Same scores and the same selection as the verification's one launch (:mod:`..selectors.score_topk`)
for every active request; the draft tables are built by the same
:func:`~vegas.vllm_plugin.drafting.tables.build_draft_tables`. Captured into the draft CUDA graphs
(fork and join on one capture); on the CPU it runs in line (no streams).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from ...kernels import collect_scores_layers_reference, select_topk_layers
from ..selectors.scores import LayerOffsets
from .tables import build_draft_tables, draft_extent

__all__ = ["GROUPS", "InDraftSelection", "layer_groups"]

#: layer groups of the deferred selection: each one score launch, one top-k and one event; more
#: groups start the draft sooner (the first group gates it) at a few more launches each
GROUPS = 6


def layer_groups(num_layers: int, groups: int = GROUPS) -> list[tuple[int, int]]:
    """``[(first, end), ...]`` consecutive layer rows in at most ``groups`` groups of near-equal
    size (the first ones one larger), covering ``0 .. num_layers``."""
    groups = max(1, min(groups, num_layers))
    size, extra = divmod(num_layers, groups)
    out, first = [], 0
    for g in range(groups):
        end = first + size + (g < extra)
        out.append((first, end))
        first = end
    return out


class InDraftSelection:
    """The deferred selection of one drafter: its side stream and the key-cache offsets of each
    layer group (computed eagerly, before any draft graph is captured)."""

    def __init__(self) -> None:
        self._stream = None
        self._key_offsets = LayerOffsets()  # one entry per layer group
        #: tensors made on the drafting stream that the side stream reads: held until :meth:`join`,
        #: so that the caching allocator cannot hand their memory to the drafting stream meanwhile
        self._held: list[torch.Tensor] = []

    def tables(self, state, step_inputs: torch.Tensor, block_table: torch.Tensor, rows: int, gamma: int,
               max_len: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Score, select and build the draft tables of the last verification (as
        :func:`~vegas.vllm_plugin.drafting.engine.draft_tables` does from a selection already made).

        Args:
            state: the drafter's selection state, after a forward that deferred its selection.
            step_inputs: ``(4, rows)`` int64 (active, last token, its position, blocks in use).
            block_table: ``(>= rows, max_blocks)`` int32, batch order (the verification's).
            rows: requests of the draft phase (padded rows included).
            gamma: γ.
            max_len: score width, tokens (the engine's ``max_model_len``: static for the graphs).

        Returns:
            ``(tables, base_used, ready)``: ``(L, rows, k_cap + recent_cap)`` int32 draft tables,
            ``(rows,)`` int64 pages in use before the first draft, and ``{layer row: event}`` the
            event each layer's first draft attention waits for (empty on the CPU).
        """
        _, ctx_sel, budgets = state.selection(rows)
        ext = draft_extent(step_inputs, ctx_sel, budgets, gamma, state.path.recent_columns(state.block_size))
        block_table = block_table[:rows]
        # rows without a request (graph padding) score and select nothing
        score_ctx = torch.where(ext.active, ctx_sel, 0)
        score_budgets = torch.where(ext.active, budgets, 0)
        recent = state.recent_buf[:rows]
        k_max = state.sel_buf.shape[2]
        tables = torch.empty((state.num_layers, rows, k_max + ext.recent_cap), dtype=torch.int32,
                             device=ctx_sel.device)
        queries = state.collect_queries(rows)  # [L, rows, width, heads, head_dim]
        weights = state.q_weight_buf[:rows, : state.score_width]
        cuda = ctx_sel.is_cuda
        capturing = cuda and torch.cuda.is_current_stream_capturing()
        ready: dict[int, object] = {}
        if cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream(ctx_sel.device)
            self._stream.wait_stream(torch.cuda.current_stream(ctx_sel.device))
            self._held = [score_ctx, score_budgets, ext.ctx_sel]
        with torch.cuda.stream(self._stream) if cuda else nullcontext():
            for first, end in layer_groups(state.num_layers):
                caches = state.key_caches[first:end]
                if cuda:
                    from ...kernels.triton_score import collect_scores_layers_triton

                    scores = collect_scores_layers_triton(
                        queries[first:end], weights, caches, block_table, score_ctx, max_len, state.score_scale,
                        key_offsets=self._key_offsets.get(caches, capturing), softcap=state.softcap,
                    )
                else:
                    scores = collect_scores_layers_reference(
                        queries[first:end], weights, caches, block_table, score_ctx, max_len, state.score_scale,
                        state.softcap,
                    )
                slots = select_topk_layers(scores, score_budgets, k_max, block_table, state.block_size, recent,
                                           score_ctx)  # [end - first, rows, k_max]
                state.sel_buf[first:end, :rows].copy_(slots)
                tables[first:end] = build_draft_tables(
                    slots, score_budgets, ext.ctx_sel, ext.first_pos + gamma - 1, block_table, state.block_size,
                    state.page_stride, ext.recent_cap,
                )
                if cuda:
                    event = torch.cuda.Event()
                    event.record(self._stream)
                    ready.update((row, event) for row in range(first, end))
        return tables, ext.base_used, ready

    def join(self, device) -> None:
        """The drafting stream waits for everything the side stream did (after the first draft
        forward, whose layers waited for their groups: this closes the fork of a capture)."""
        if self._stream is not None:
            torch.cuda.current_stream(device).wait_stream(self._stream)
        self._held = []
