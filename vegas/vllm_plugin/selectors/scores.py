"""Score collection shared by the score-based fast path and the generic path: per layer the
collect queries are stashed, at the last layer every layer is scored in one kernel launch
(Triton on CUDA, :mod:`vegas.kernels.reference` elsewhere) and, with tensor parallelism and
``tp_selection="all_reduce"``, summed over the ranks."""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from ...kernels import collect_scores_layers_reference
from .base import SelectionPath
from .plan import CollectPlan

__all__ = ["CollectingPath", "ScoreCollector"]


class ScoreCollector:
    """Collect queries and key caches of one forward's layers, then their scores."""

    def __init__(self) -> None:
        self._queries: torch.Tensor | None = None  # [L, num_seqs, width, num_q_heads, head_dim]
        self._key_caches: list = []  # per layer: [num_blocks, block_size, num_kv_heads, head_dim]
        self._key_offsets: tuple | None = None
        self._key_offsets_of: tuple = ()  # data pointers the offsets were computed for

    @property
    def key_caches(self) -> list:
        return self._key_caches

    def begin(self, state, plan: CollectPlan, query: torch.Tensor) -> None:
        """View the state's reserved query buffer for this batch (first layer); without
        collect queries (``plan.q_idx`` None) only the key caches are kept."""
        self._key_caches = [None] * state.num_layers
        if plan.q_idx is not None:
            shape = (state.num_layers, plan.num_seqs, plan.q_idx.shape[1]) + tuple(query.shape[1:])
            self._queries = state.query_buf[: math.prod(shape)].view(shape)

    def add_layer(self, row: int, plan: CollectPlan, query: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """Stash layer ``row``'s collect queries (one ``index_select``) and its key cache."""
        if plan.q_idx is not None:
            torch.index_select(query, 0, plan.q_idx.reshape(-1), out=self._queries[row].view(-1, *query.shape[1:]))
        self._key_caches[row] = kv_cache.unbind(1)[0]

    def scores(self, state, plan: CollectPlan, block_table: torch.Tensor, scale: float, capturing: bool) -> torch.Tensor:
        """``(L, num_seqs, max_len)`` float32 summed logits of the collect queries over each
        layer's query heads (all ranks' heads under ``tp_selection="all_reduce"``); ``-inf``
        at and beyond ``ctx_sel``. With the layers' soft-cap (``state.softcap``, Gemma 2) the
        logits are the capped ones the softmax sees."""
        if self._queries.is_cuda:
            from ...kernels.triton_score import collect_scores_layers_triton, layer_offsets

            pointers = tuple(k.data_ptr() for k in self._key_caches)
            if self._key_offsets_of != pointers:
                if capturing:
                    raise RuntimeError("vegas: KV cache layout first seen inside CUDA-graph capture")
                self._key_offsets = layer_offsets(self._key_caches)
                self._key_offsets_of = pointers
            scores = collect_scores_layers_triton(
                self._queries, plan.q_weight, self._key_caches, block_table, plan.ctx_sel, plan.max_len, scale,
                key_offsets=self._key_offsets, softcap=state.softcap,
            )
        else:
            scores = collect_scores_layers_reference(
                self._queries, plan.q_weight, self._key_caches, block_table, plan.ctx_sel, plan.max_len, scale,
                state.softcap,
            )
        if state.all_reduce is not None and _sums_over_ranks(state):
            scores = state.all_reduce(scores)  # this rank's heads -> all heads; -inf stays -inf
        return scores


def _sums_over_ranks(state) -> bool:
    """Whether the ranks sum their scores (``VegasConfig.vllm.tp_selection == "all_reduce"``)."""
    return state.path.selector.config.vllm.tp_selection == "all_reduce"


class CollectingPath(SelectionPath):
    """A path that collects the selector's score rows of every layer and selects at the last
    layer (:meth:`select_layers`), all layers at once."""

    #: the score rows may come from FA3 itself (:mod:`vegas.vllm_plugin.selection.fa3_verify`): a path
    #: whose :meth:`select_layers` takes the ``(L, num_seqs, max_len)`` rows with ``-inf`` tails
    uses_fa3_scores: ClassVar[bool] = False

    def __init__(self, selector, gamma, device) -> None:
        super().__init__(selector, gamma, device)
        self.collector = ScoreCollector()

    def begin(self, state, plan, query, kv_cache, attn_metadata) -> None:
        super().begin(state, plan, query, kv_cache, attn_metadata)
        self.collector.begin(state, plan, query)

    def layer(self, state, row, query, kv_cache, attn_metadata, scale) -> None:
        plan = state.plan
        if plan.k_max == 0:
            return
        self.collector.add_layer(row, plan, query, kv_cache)
        if row != state.num_layers - 1:
            return
        with state.timed(query):
            block_table = attn_metadata.block_table[: plan.num_seqs]  # [num_seqs, max_blocks] int32
            scores = None
            if plan.q_idx is not None:
                scores = self.collector.scores(state, plan, block_table, scale, state.capturing(query))
            self.select_layers(state, plan, scores, block_table)

    def select_layers(self, state, plan: CollectPlan, scores: torch.Tensor | None, block_table: torch.Tensor) -> None:
        """Write every layer's selection into ``state``'s buffers.

        Args:
            scores: ``(L, num_seqs, max_len)`` float32 (see :meth:`ScoreCollector.scores`), or
                None when the selector scores no rows.
        """
        raise NotImplementedError
