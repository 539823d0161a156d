"""Fast path of the score-based top-k selectors (collect2, aggregated, last_token): the
collect queries named by ``score_rows`` are scored in one fused kernel launch for all layers,
then one ``torch.topk`` over all layers and requests keeps each request's best positions plus
its recent window (:func:`vegas.kernels.select_topk_layers`), captured into vLLM's full CUDA
graphs. Selects what :meth:`vegas.strategies.aggregated.AggregatedSelector.select` selects."""

from __future__ import annotations

from ...kernels import select_topk_layers
from .base import FastPath
from .scores import CollectingPath

__all__ = ["ScoreTopKFastPath"]


class ScoreTopKFastPath(CollectingPath, FastPath):
    """Top-k of the summed logits of the selector's score rows, per layer."""

    uses_fa3_scores = True

    def select_layers(self, state, plan, scores, block_table) -> None:
        slots = select_topk_layers(
            scores, plan.budgets, plan.k_max, block_table, state.block_size, plan.recent, plan.ctx_sel
        )  # [L, num_seqs, k_max] int32
        state.sel_buf[:, : plan.num_seqs, : plan.k_max].copy_(slots)
        state.has_selection = True
