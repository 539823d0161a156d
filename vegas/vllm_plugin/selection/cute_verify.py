"""Verification attention through FlashAttention's CuTe-DSL forward, writing the selection's logits
(opt-in ``VegasConfig.vllm.cute_scores``; issue 22).

The same decisions as the FA3 extension's path (:class:`~.fa3_verify.FA3ScoreVerify`, its base:
per forward at the first layer; layers it does not cover are scored alone by the separate kernel;
one log line says which path runs), with vLLM's own CuTe-DSL attention
(:func:`vegas.kernels.cute_scores.cute_verify_attention`) instead of a built extension: each
layer of a decode-shaped verification runs it with the score-writing ``score_mod``, and the
layer's score row is reduced from the writer's buffer right after it
(:func:`~vegas.kernels.cute_scores.reduce_edge_scores`). Covers selectors that score the first
and/or the last query of the verified chunk (collect2, last_token).

The writer's buffer has its address compiled into the kernel, so it is made once, outside
CUDA-graph capture, at its largest (``max_num_seqs x 2 x query heads x max_model_len`` float32:
38 MB for SmolLM2 at 64 x 8K) and kept; a forward captured before it exists takes today's path.
"""

from __future__ import annotations

import torch

from ...kernels import cute_scores
from ..selectors.plan import score_rows_by_length
from .fa3_verify import FA3ScoreVerify

__all__ = ["CuteScoreVerify"]


class CuteScoreVerify(FA3ScoreVerify):
    """Per-process state of the CuTe score path."""

    KIND = "cute"
    KERNEL = cute_scores
    ANNOUNCE = "verification scores from the CuTe-DSL attention's score_mod (vllm.cute_scores: one pass over the keys)"

    def __init__(self) -> None:
        super().__init__()
        self.writer = None  # the score_mod of self.ws
        self.slot_weights: torch.Tensor | None = None  # [γ + 2, 2] float32 per chunk length
        self.weights: torch.Tensor | None = None  # [num_seqs, 2] float32 of this forward
        self._path_reason: str | None = None  # cached by path_reason

    def path_reason(self, state) -> str | None:
        """Whether the selector scores only the first and/or last query of a chunk (its
        ``score_rows``, asked once, outside CUDA-graph capture: the weights are copied to the device)."""
        if self.slot_weights is None and self._path_reason is None:
            device = state.path.row_table.rows.device
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return "the selector's scored rows were not read before CUDA-graph capture"
            try:
                weights = cute_scores.edge_row_weights(score_rows_by_length(state.path.selector, state.gamma))
                self.slot_weights = weights.to(device)
            except ValueError as e:
                self._path_reason = str(e)
        return self._path_reason

    @staticmethod
    def impl_reason(impl, query: torch.Tensor) -> str | None:
        if getattr(impl, "dcp_world_size", 1) > 1:
            return "decode context parallelism"
        return cute_scores.unsupported_reason(
            query.shape[1], impl.num_kv_heads, query.shape[2], query.dtype, 1,
            sliding_window=impl.sliding_window, softcap=impl.logits_soft_cap, alibi_slopes=impl.alibi_slopes,
            sinks=getattr(impl, "sinks", None), kv_cache_dtype=impl.kv_cache_dtype,
        )

    def ready(self, state, impl, query: torch.Tensor, attn_metadata) -> bool:
        """The writer's buffer exists (made here, at its largest, outside CUDA-graph capture) and
        holds this batch: its requests, query heads and sequence length (else today's path: the
        kernel would write past it)."""
        if self.ws is None:
            if state.capturing(query) or state.sel_buf is None or not state.max_model_len:
                return False
            shape = cute_scores.workspace_shape(state.sel_buf.shape[1], query.shape[1], state.max_model_len)
            self.ws = torch.zeros(shape, dtype=torch.float32, device=query.device)
            self.writer = cute_scores.score_writer(self.ws)
        num_seqs = attn_metadata.query_start_loc.shape[0] - 1
        return (num_seqs <= self.ws.shape[0] and query.shape[1] == self.ws.shape[2]
                and int(attn_metadata.max_seq_len) <= self.ws.shape[3])

    def prepare(self, state, plan, attn_metadata, num_kv_heads: int, device) -> None:
        n = plan.num_seqs
        self.scores = torch.empty((state.num_layers, n, plan.max_len), dtype=torch.float32, device=device)
        cu = attn_metadata.query_start_loc[: n + 1]
        chunk = (cu[1:] - cu[:-1]).long().clamp(0, self.slot_weights.shape[0] - 1)
        self.weights = self.slot_weights[chunk]  # [n, 2]

    def layer(self, state, row: int, impl, query, kv_cache, attn_metadata, output) -> None:
        plan = state.plan
        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache.unbind(1)
        cute_scores.cute_verify_attention(
            query[:n], key_cache, value_cache, attn_metadata.block_table, attn_metadata.query_start_loc,
            attn_metadata.seq_lens, attn_metadata.max_query_len, attn_metadata.max_seq_len, impl.scale,
            out=output[:n], writer=self.writer,
        )
        cute_scores.reduce_edge_scores(self.ws, self.weights, plan.ctx_sel, self.scores[row])
