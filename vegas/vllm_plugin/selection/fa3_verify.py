"""Verification attention that writes the selection scores itself (optional ``_vegas_fa3_C``, issue 22).

Today a score-based selector on vLLM costs FA3 per layer plus, at the last layer, a second pass
over every prefix key (:mod:`vegas.kernels.triton_score`). With the extension
(:mod:`vegas.kernels.fa3_scores`) each layer's verification runs FA3 with the score output
instead of vLLM's FA3 call: same kernel, same attention output, and the layer's score row comes
out of the same pass over the keys. :meth:`FA3ScoreVerify.begin` decides per forward, at the
first layer, whether the forward goes that way:

- the extension loads (``VEGAS_FA3_EXT``) on an sm90 GPU;
- the path is the score top-k fast path (collect2, aggregated, last_token: at most 2 scored rows);
- the batch is decode-shaped: ``max_query_len * num_q_heads / num_kv_heads <= 64`` (verification
  at γ + 1 queries; prefill chunks take today's path), no cascade attention;
- every attention layer seen so far is one the build covers (bf16, head_dim 64/128/256, FA3,
  no window, soft-capping, ALiBi, sinks, FP8 cache or DCP).

A layer found unsupported inside such a forward (a model mixing layer kinds) runs vLLM's FA3 and
is scored alone by the separate kernel, and later forwards take today's path throughout. One log
line says which path runs, once it is known (after the first forward that saw every layer).

Under vLLM's full CUDA graphs the decision is captured with the graph, as the rest of the
selection: a batch size captured in a forward that took the extension replays it, each layer the
way it ran at capture (an uncovered layer found during that forward replays its separate scoring).
"""

from __future__ import annotations

import logging

import torch

from ...kernels import fa3_scores
from ...kernels.triton_score_reduce import reduce_head_scores

__all__ = ["FA3ScoreVerify"]

log = logging.getLogger("vegas.vllm")


def attention_kwargs(impl) -> dict:
    """What a score kernel's ``unsupported_reason`` asks of a ``FlashAttentionImpl``'s attention:
    window, soft-cap, ALiBi, sinks and cache dtype."""
    return dict(sliding_window=impl.sliding_window, softcap=impl.logits_soft_cap, alibi_slopes=impl.alibi_slopes,
                sinks=getattr(impl, "sinks", None), kv_cache_dtype=impl.kv_cache_dtype)


class FA3ScoreVerify:
    """Per-process state of the FA3 score path of a :class:`~.selectors.scores.CollectingPath`."""

    def __init__(self) -> None:
        #: row (layer - first layer) -> why its calls cannot use the extension (None: they can)
        self.layer_reason: dict[int, str | None] = {}
        #: this forward runs through the extension (decided at its first layer)
        self.active = False
        self.scores: torch.Tensor | None = None  # [L, num_seqs, max_len] float32 score rows
        self.ws: torch.Tensor | None = None  # [num_kv_heads, num_seqs, max_len] float32 partials
        self.rows: torch.Tensor | None = None  # [num_seqs, 2] int32 scored rows in the chunk
        self.ctx: torch.Tensor | None = None  # [num_seqs] int32 scored prefix
        self.cu: torch.Tensor | None = None  # [num_seqs + 1] int32
        self._announced: str | None = None
        #: forwards whose Python ran through this path's kernel (captures: each replay does too)
        self.forwards = 0

    #: the path's name in the engine's stats (``score_path``)
    KIND = "fa3_ext"
    #: what the log line calls this path when it runs
    ANNOUNCE = "verification scores from FA3 (_vegas_fa3_C: one pass over the keys)"

    def kernel_unavailable(self) -> str | None:
        """Why this path's kernel cannot run in this process, or None."""
        return fa3_scores.unavailable_reason()

    def path_reason(self, state) -> str | None:
        """Why the selection path in force cannot take this path, or None."""
        width = state.path.row_table.width
        return f"{width} scored rows per request" if width > 2 else None

    @staticmethod
    def impl_reason(impl, query: torch.Tensor) -> str | None:
        """Why calls of this ``FlashAttentionImpl`` cannot use the extension, or None."""
        if getattr(impl, "vllm_flash_attn_version", None) != 3:
            return f"FlashAttention version {getattr(impl, 'vllm_flash_attn_version', None)} (FA3 only)"
        if getattr(impl, "dcp_world_size", 1) > 1:
            return "decode context parallelism"
        return fa3_scores.unsupported_reason(
            query.shape[1], impl.num_kv_heads, query.shape[2], query.dtype, 2, **attention_kwargs(impl))

    def shape_reason(self, state, impl, query: torch.Tensor, attn_metadata) -> str | None:
        """Why this forward's batch is not one this path takes (a prefill chunk), or None."""
        return fa3_scores.unsupported_reason(
            query.shape[1], impl.num_kv_heads, query.shape[2], query.dtype, int(attn_metadata.max_query_len))

    def ready(self, state, impl, query: torch.Tensor) -> bool:
        """Whether this path's kernels can run in the forward about to start (a JIT-compiled path
        compiles outside CUDA-graph capture only); the built extension always can."""
        return True

    @property
    def in_use(self) -> bool:
        """Whether forwards ran through this path's kernel with every layer covered (and it was
        announced as the path in force)."""
        return self.forwards > 0 and self._announced == self.ANNOUNCE

    def _announce(self, reason: str | None) -> None:
        msg = self.ANNOUNCE if reason is None else f"verification scores from the separate score kernel ({reason})"
        if self._announced is None:
            log.info("vegas: %s", msg)
            self._announced = msg

    def begin(self, state, impl, query: torch.Tensor, attn_metadata) -> bool:
        """At the first layer of a full-attention forward: whether it runs through the extension."""
        self.active = False
        reason = self.kernel_unavailable()
        if reason is not None:
            self._announce(reason)
            return False
        path = state.path
        if not getattr(path, "uses_fa3_scores", False) or path.row_table.width == 0:
            return False
        reason = self.path_reason(state)
        if reason is not None:
            self._announce(reason)
            return False
        row0 = self.impl_reason(impl, query)
        self.layer_reason[0] = row0
        bad = next((r for r in self.layer_reason.values() if r is not None), None)
        if bad is not None:
            self._announce(bad)
            return False
        if getattr(attn_metadata, "use_cascade", False) or getattr(attn_metadata, "causal", True) is not True:
            return False
        if self.shape_reason(state, impl, query, attn_metadata) is not None:  # a prefill chunk: today's path
            return False
        if not self.ready(state, impl, query):
            return False
        self.active = True
        self.forwards += 1
        if len(self.layer_reason) == state.num_layers:  # every layer seen and covered: say so once
            self._announce(None)
        return True

    def prepare(self, state, plan, attn_metadata, num_kv_heads: int, device) -> None:
        """Buffers of this forward, from its plan (before the plan's ``q_idx`` is clamped)."""
        n = plan.num_seqs
        self.scores = torch.empty((state.num_layers, n, plan.max_len), dtype=torch.float32, device=device)
        self.ws = torch.empty((num_kv_heads, n, plan.max_len), dtype=torch.float32, device=device)
        self.cu = attn_metadata.query_start_loc[: n + 1].to(torch.int32)
        self.rows = fa3_scores.score_rows_in_chunk(plan.q_idx, plan.q_weight, self.cu)
        self.ctx = plan.ctx_sel.to(torch.int32)

    def layer(self, state, row: int, impl, query, kv_cache, attn_metadata, output) -> None:
        """Layer ``row`` (a supported one) of an active forward: attention into ``output`` and its
        score row into ``self.scores[row]``."""
        plan = state.plan
        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache.unbind(1)
        fa3_scores.fa3_verify_attention(
            query[:n], key_cache, value_cache, attn_metadata.block_table, attn_metadata.query_start_loc,
            attn_metadata.seq_lens, attn_metadata.max_query_len, attn_metadata.max_seq_len, impl.scale,
            out=output[:n], workspace=self.ws, score_rows=self.rows, score_ctx=self.ctx,
            scheduler_metadata=attn_metadata.scheduler_metadata, num_splits=attn_metadata.max_num_splits,
        )
        reduce_head_scores(self.ws, self.scores[row], self.cu, plan.ctx_sel)

    def fallback_layer(self, state, row: int, query, kv_cache, attn_metadata, scale: float) -> None:
        """Layer ``row`` of an active forward that the build does not cover (vLLM's FA3 already
        ran): its score row from the separate kernel, for this layer alone."""
        if query.is_cuda:
            from ...kernels.triton_score import collect_scores_layers_triton as collect
        else:
            from ...kernels import collect_scores_layers_reference as collect

        plan = state.plan
        width = plan.q_idx.shape[1]
        rows = torch.index_select(query, 0, plan.q_idx.reshape(-1)).view(1, plan.num_seqs, width, *query.shape[1:])
        block_table = attn_metadata.block_table[: plan.num_seqs]
        self.scores[row : row + 1] = collect(
            rows, plan.q_weight, [kv_cache.unbind(1)[0]], block_table, plan.ctx_sel, plan.max_len, scale)
