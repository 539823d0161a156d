"""Verification attention through vLLM's CuTe-DSL forward with the selection scores from the
same QK product (opt-in ``VegasConfig.vllm.score_path="cute"``; issue 22).

The same decisions as the FA3 extension's path (:class:`~.fa3_verify.FA3ScoreVerify`, its base:
per forward at the first layer; a layer it does not cover is scored alone by the separate
kernel; one log line says which path runs), with the probe kernel of
:mod:`vegas.kernels.cute_probe` instead of a built extension. Each layer of a covered forward:

1. :func:`~vegas.kernels.cute_probe.probe_attention` puts each request's probe tokens (the
   scored queries summed over each KV head's query heads, :mod:`vegas.kernels.probe_queries`)
   in front of its chunk, runs FlashAttention's CuTe-DSL sm90 forward with the 64-row tile (not
   vLLM's FA3: greedy output equals plain vLLM's up to bf16 near-ties), stores the probe rows'
   logits into a ``(num_seqs, num_kv_heads, L)`` float32 buffer and gathers the chunk's
   attention output back into vLLM's output tensor;
2. :func:`~vegas.kernels.triton_score_reduce.reduce_head_scores` sums the KV heads in a fixed
   order into the layer's score row (``-inf`` from ``ctx_sel`` on).

Covered: collect2 (the chunk's first and last query; a one-query chunk counts its row twice: its
score row is exactly twice the separate kernel's, its top-k the same) and last_token (the first
query alone); a decode-shaped batch whose probe tokens and chunk fit one 64-row query tile
(``(P + max_query_len) * G <= 64``, ``max_query_len <= γ + 1``); bf16/fp16, head_dim 64 or 128,
no window, soft-capping, ALiBi, sinks, FP8 cache or DCP
(:func:`~vegas.kernels.cute_probe.unsupported_reason`). Other forwards take FA3 and the
separate score pass (not the FA3 extension, even where it loads). Plain stores, no atomics: the
scores are deterministic.

CUDA graphs: the kernel JIT-compiles on first use, which must not happen inside stream capture.
:meth:`CuteProbeVerify.warm` compiles every variant of the engine's shape (unsplit, split, each
split bucket of the combine kernel) when the drafter reserves its buffers, before vLLM captures;
a forward captured for a shape not compiled takes today's path (and replays it).
"""

from __future__ import annotations

import logging
import time

import torch

from ...kernels import cute_probe
from ...kernels.triton_score_reduce import reduce_head_scores
from ..selectors.plan import score_rows_by_length
from .fa3_verify import FA3ScoreVerify, attention_kwargs

__all__ = ["CuteProbeVerify", "make_score_verify"]

log = logging.getLogger("vegas.vllm")


class CuteProbeVerify(FA3ScoreVerify):
    """Per-process state of the CuTe probe score path."""

    KIND = "cute"
    ANNOUNCE = ("verification scores from the CuTe-DSL attention's own QK product, through probe queries "
                "(vllm.score_path=cute: one pass over the keys; experimental, its engine tests have not passed "
                "yet: csrc/README.md)")

    def __init__(self) -> None:
        super().__init__()
        #: the kernel's row mode for the selector in force (cute_probe.EDGES / FIRST), from path_reason
        self.mode: str | None = None
        self._path_reason: str | None = None
        #: why the compile failed (then the path is off for this process)
        self.warm_reason: str | None = None

    def kernel_unavailable(self) -> str | None:
        return cute_probe.unavailable_reason() or self.warm_reason

    def path_reason(self, state) -> str | None:
        """Whether the selector scores only the chunk's first row, or its first and last
        (:func:`~vegas.kernels.cute_probe.row_mode`; asked once, on the host)."""
        if self.mode is None and self._path_reason is None:
            try:
                self.mode = cute_probe.row_mode(score_rows_by_length(state.path.selector, state.gamma))
            except ValueError as e:
                self._path_reason = str(e)
        return self._path_reason

    @staticmethod
    def impl_reason(impl, query: torch.Tensor) -> str | None:
        if getattr(impl, "dcp_world_size", 1) > 1:
            return "decode context parallelism"
        return cute_probe.unsupported_reason(
            query.shape[1], impl.num_kv_heads, query.shape[2], query.dtype, 1, **attention_kwargs(impl))

    def shape_reason(self, state, impl, query: torch.Tensor, attn_metadata) -> str | None:
        """A prefill chunk, a chunk longer than γ + 1, or probe tokens and chunk that do not fit
        one query tile (:func:`~vegas.kernels.cute_probe.unsupported_reason`)."""
        return cute_probe.unsupported_reason(
            query.shape[1], impl.num_kv_heads, query.shape[2], query.dtype, int(attn_metadata.max_query_len),
            max_chunk=state.gamma + 1, block_size=state.block_size)

    def _shape(self, state, impl, query: torch.Tensor) -> tuple:
        return (query.shape[1], impl.num_kv_heads, query.shape[2], query.dtype, state.block_size)

    def ready(self, state, impl, query: torch.Tensor) -> bool:
        """The kernels of this shape are compiled (here, outside CUDA-graph capture, when
        :meth:`warm` did not run before); a captured forward of a shape not compiled takes
        today's path."""
        shape = self._shape(state, impl, query)
        if cute_probe.is_warm(*shape):
            return True
        if state.capturing(query):
            return False
        self.warm(state, *shape, device=query.device)
        return cute_probe.is_warm(*shape)

    def warm(self, state, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int,
             device) -> None:
        """Compile every variant the engine can call for this shape (per rank: its query and KV
        heads), outside CUDA-graph capture; nothing when the path cannot run (its reason is
        logged by the first forward). A failed compile turns the path off for this process
        (:attr:`warm_reason`) and logs why."""
        if self.kernel_unavailable() is not None or self.path_reason(state) is not None:
            return
        if cute_probe.unsupported_reason(num_q_heads, num_kv_heads, head_dim, dtype, 1,
                                         block_size=block_size) is not None:
            return
        if cute_probe.is_warm(num_q_heads, num_kv_heads, head_dim, dtype, block_size):
            return
        started = time.perf_counter()
        try:
            cute_probe.warm_up(num_q_heads, num_kv_heads, head_dim, dtype, block_size, device, mode=self.mode)
        except Exception as e:  # a DSL or compile error: today's path, said once
            self.warm_reason = f"the CuTe probe kernel did not compile ({type(e).__name__}: {str(e)[:200]})"
            log.warning("vegas: %s", self.warm_reason)
            return
        log.info("vegas: compiled the CuTe probe kernel (%d q / %d kv heads x %d, %s) in %.0f s", num_q_heads,
                 num_kv_heads, head_dim, dtype, time.perf_counter() - started)

    def prepare(self, state, plan, attn_metadata, num_kv_heads: int, device) -> None:
        """This forward's score rows and the buffer the kernel stores the probe logits into
        (every position a layer's reduce reads is stored first: no zeroing)."""
        n = plan.num_seqs
        self.scores = torch.empty((state.num_layers, n, plan.max_len), dtype=torch.float32, device=device)
        self.ws = torch.empty((n, num_kv_heads, cute_probe.padded_len(plan.max_len)), dtype=torch.float32,
                              device=device)
        self.cu = attn_metadata.query_start_loc[: n + 1]

    def layer(self, state, row: int, impl, query, kv_cache, attn_metadata, output) -> None:
        plan = state.plan
        n = attn_metadata.num_actual_tokens
        seqs = attn_metadata.query_start_loc.shape[0] - 1  # the CuTe interface checks every batch dim
        key_cache, value_cache = kv_cache.unbind(1)
        cute_probe.probe_attention(
            query[:n], key_cache, value_cache, output[:n], self.ws[:seqs], attn_metadata.query_start_loc,
            attn_metadata.seq_lens[:seqs], int(attn_metadata.max_query_len), int(attn_metadata.max_seq_len),
            attn_metadata.block_table[:seqs], impl.scale, mode=self.mode,
        )
        reduce_head_scores(self.ws.permute(1, 0, 2), self.scores[row], self.cu, plan.ctx_sel)


def make_score_verify(score_path: str) -> FA3ScoreVerify:
    """The score path of ``VegasConfig.vllm.score_path``: :class:`CuteProbeVerify` for ``"cute"``
    when its kernel can run here, else (said once in the log) the FA3 extension's path, which
    falls back to the separate pass by itself."""
    if score_path == "cute":
        cute = CuteProbeVerify()
        reason = cute.kernel_unavailable()
        if reason is None:
            return cute
        log.info("vegas: vllm.score_path=cute is unavailable (%s); verification scores as with 'auto'", reason)
    return FA3ScoreVerify()
