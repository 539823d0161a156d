"""Score collection shared by the score-based fast path and the generic path: per layer the
collect queries are stashed, at the last layer every layer is scored in one kernel launch
(Triton on CUDA, :mod:`vegas.kernels.reference` elsewhere) — or, in forwards captured into
full CUDA graphs with ``VegasConfig.vllm.score_overlap``, each layer right after its attention
on a side stream — and, with tensor parallelism and ``tp_selection="all_reduce"``, summed over
the ranks."""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from ...kernels import collect_scores_layers_reference
from .base import SelectionPath
from .plan import CollectPlan

__all__ = ["CollectingPath", "LayerOffsets", "ScoreCollector"]


class LayerOffsets:
    """:func:`vegas.kernels.triton_score.layer_offsets` of each list of key caches the score
    kernel reads in one launch, computed once per layout and eagerly: inside a CUDA-graph
    capture the host cannot build the offsets tensor the graph would read."""

    def __init__(self) -> None:
        self._of: dict[tuple, tuple[torch.Tensor, int]] = {}  # data pointers -> (offsets, alignment)

    def get(self, key_caches: list, capturing: bool) -> tuple[torch.Tensor, int]:
        """Raises:
            RuntimeError: a layout first seen inside a capture."""
        pointers = tuple(k.data_ptr() for k in key_caches)
        hit = self._of.get(pointers)
        if hit is None:
            if capturing:
                raise RuntimeError("vegas: KV cache layout first seen inside CUDA-graph capture")
            from ...kernels.triton_score import layer_offsets

            hit = self._of[pointers] = layer_offsets(key_caches)
        return hit


class ScoreCollector:
    """Collect queries and key caches of one forward's layers, then their scores.

    Two ways to score, the same scores either way:

    - at the last layer, every layer in one kernel launch (:meth:`scores`);
    - layer by layer (``VegasConfig.vllm.score_overlap``, forwards captured into full CUDA
      graphs): each layer is scored right after its attention on a side stream, beside the
      later layers' kernels, into one ``(L, num_seqs, max_len)`` buffer; :meth:`scores` joins
      the side stream.
    """

    def __init__(self) -> None:
        self._queries: torch.Tensor | None = None  # [L, num_seqs, width, num_q_heads, head_dim]
        self._key_caches: list = []  # per layer: [num_blocks, block_size, num_kv_heads, head_dim]
        self._key_offsets = LayerOffsets()
        #: layer-by-layer scores of the current forward ([L, num_seqs, max_len] float32), or None
        self._layer_scores: torch.Tensor | None = None
        #: CUDA side stream of the layer-by-layer scores and the one-layer key offset (made eagerly)
        self._stream = None
        self._zero_offset: torch.Tensor | None = None
        #: forwards whose Python scored layer by layer (captures: each replay of their graph does too)
        self.layer_scored_forwards = 0

    @property
    def key_caches(self) -> list:
        return self._key_caches

    def begin(self, state, plan: CollectPlan, query: torch.Tensor, per_layer: bool = False) -> None:
        """View the state's reserved query buffer for this batch (first layer); without
        collect queries (``plan.q_idx`` None) only the key caches are kept. ``per_layer``:
        score each layer as it comes (:meth:`add_layer`) when this forward can (a CUDA forward
        needs the side stream, made by an eager forward before any capture)."""
        self._key_caches = [None] * state.num_layers
        self._layer_scores = None
        if plan.q_idx is None:
            return
        # laid out for this batch, or for every request a deferred selection may read (select_in_draft)
        rows = state.query_rows() or plan.num_seqs
        shape = (state.num_layers, rows, plan.q_idx.shape[1]) + tuple(query.shape[1:])
        self._queries = state.query_buf[: math.prod(shape)].view(shape)[:, : plan.num_seqs]
        if query.is_cuda and self._stream is None and not state.capturing(query):
            self._stream = torch.cuda.Stream(query.device)
            self._zero_offset = torch.zeros(1, dtype=torch.int64, device=query.device)
        if per_layer and (self._stream is not None or not query.is_cuda):
            self._layer_scores = torch.empty((state.num_layers, plan.num_seqs, plan.max_len), dtype=torch.float32,
                                             device=query.device)
            self.layer_scored_forwards += 1

    def add_layer(self, state, row: int, plan: CollectPlan, query: torch.Tensor, kv_cache: torch.Tensor,
                  block_table: torch.Tensor, scale: float) -> None:
        """Stash layer ``row``'s collect queries (one ``index_select``) and its key cache; when
        scoring layer by layer, score it on the side stream."""
        key_cache = kv_cache.unbind(1)[0]
        self._key_caches[row] = key_cache
        if plan.q_idx is None:
            return
        torch.index_select(query, 0, plan.q_idx.reshape(-1), out=self._queries[row].view(-1, *query.shape[1:]))
        if self._layer_scores is None:
            return
        out = self._layer_scores[row : row + 1]
        if not query.is_cuda:
            out.copy_(collect_scores_layers_reference(
                self._queries[row : row + 1], plan.q_weight, [key_cache], block_table, plan.ctx_sel, plan.max_len,
                scale, state.softcap,
            ))
            return
        from ...kernels.triton_score import collect_scores_layers_triton

        self._stream.wait_stream(torch.cuda.current_stream(query.device))
        with torch.cuda.stream(self._stream):
            collect_scores_layers_triton(
                self._queries[row : row + 1], plan.q_weight, [key_cache], block_table, plan.ctx_sel, plan.max_len,
                scale, key_offsets=(self._zero_offset, 16), softcap=state.softcap, out=out,
            )

    def scores(self, state, plan: CollectPlan, block_table: torch.Tensor, scale: float, capturing: bool) -> torch.Tensor:
        """``(L, num_seqs, max_len)`` float32 summed logits of the collect queries over each
        layer's query heads (all ranks' heads under ``tp_selection="all_reduce"``); ``-inf``
        at and beyond ``ctx_sel``. With the layers' soft-cap (``state.softcap``, Gemma 2) the
        logits are the capped ones the softmax sees."""
        if self._layer_scores is not None:  # scored layer by layer: join the side stream
            scores, self._layer_scores = self._layer_scores, None
            if scores.is_cuda:
                torch.cuda.current_stream(scores.device).wait_stream(self._stream)
        elif self._queries.is_cuda:
            from ...kernels.triton_score import collect_scores_layers_triton

            scores = collect_scores_layers_triton(
                self._queries, plan.q_weight, self._key_caches, block_table, plan.ctx_sel, plan.max_len, scale,
                key_offsets=self._key_offsets.get(self._key_caches, capturing), softcap=state.softcap,
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
        per_layer = self.capturable and self.selector.config.vllm.score_overlap and state.capturing(query)
        self.collector.begin(state, plan, query, per_layer=per_layer and plan.k_max > 0)

    def layer(self, state, row, query, kv_cache, attn_metadata, scale) -> None:
        plan = state.plan
        if plan.k_max == 0:
            return
        block_table = attn_metadata.block_table[: plan.num_seqs]  # [num_seqs, max_blocks] int32
        self.collector.add_layer(state, row, plan, query, kv_cache, block_table, scale)
        if row != state.num_layers - 1:
            return
        if state.select_in_draft:  # the draft phase scores and selects (drafting/in_draft.py)
            if plan.q_idx is not None:
                state.defer_selection(plan, scale, self.collector.key_caches, query)
            return
        with state.timed(query):
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
