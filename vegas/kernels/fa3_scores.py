"""Verification attention with the selector's scores written from inside FlashAttention-3 (issue 22).

An optional CUDA extension, ``_vegas_fa3_C``: the FlashAttention-3 Hopper forward that vLLM 0.24.0
ships (vllm-project/flash-attention ``803020a8``) plus an optional ``scores`` output, built for
sm90a (bf16, head_dim 64/128/256, paged KV read without TMA, PackGQA, causal; the device-side
writer is ``csrc/fa3_scores/vegas_scores.h``, the design and the build are in ``csrc/README.md``).
Its op ``torch.ops._vegas_fa3_C.fwd_scores`` runs vLLM's FA3 call for a decode-shaped
verification batch (same heuristics, same kernel, same output) and, after the QK GEMM of every
key block, writes ``scale * sum of the logits of each request's two scored rows over the query
heads of each KV head`` into a ``(num_kv_heads, num_seqs, max_len)`` float32 workspace;
:func:`vegas.kernels.triton_score_reduce.reduce_head_scores` then sums the KV heads into the
selector's ``(num_seqs, max_len)`` score row, exactly what the separate score kernel
(:mod:`vegas.kernels.triton_score`) computes, without reading the keys a second time.

Nothing here is needed: without the extension (:func:`unavailable_reason` says why) vegas runs
FA3 and the separate score kernel as before. The extension is found through the
``VEGAS_FA3_EXT`` environment variable (path of the built shared library) or as an importable
module ``_vegas_fa3_C``.
"""

from __future__ import annotations

import importlib
import os

import torch

__all__ = [
    "EXT_ENV",
    "MAX_PACKED_ROWS",
    "attention_reason",
    "available",
    "fa3_verify_attention",
    "score_rows_in_chunk",
    "sm90_reason",
    "unavailable_reason",
    "unsupported_reason",
]

#: environment variable naming the built ``_vegas_fa3_C`` shared library
EXT_ENV = "VEGAS_FA3_EXT"
#: the scored rows must lie in the first MMA warpgroup of the first query tile:
#: ``max_query_len * (num_q_heads / num_kv_heads) <= MAX_PACKED_ROWS``
MAX_PACKED_ROWS = 64
#: head dims the restricted build instantiates
HEAD_DIMS = (64, 128, 256)

_loaded: dict[str, str | None] = {}


def sm90_reason(exact: bool) -> str | None:
    """Why this process has no Hopper GPU, or None: no CUDA device, or a compute capability other
    than 9.0 (``exact``, what an sm90a build runs on) or 9.x."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    capability = torch.cuda.get_device_capability()
    if (capability != (9, 0)) if exact else (capability[0] != 9):
        return f"compute capability {capability} is not sm90 (Hopper)"
    return None


def attention_reason(num_q_heads: int, num_kv_heads: int, *, sliding_window=None, softcap: float | None = None,
                     alibi_slopes=None, sinks=None, kv_cache_dtype: str = "auto") -> str | None:
    """Why a layer's attention is not the plain causal GQA that both score-writing kernels (this
    extension and :mod:`vegas.kernels.cute_probe`) cover (whole query groups per KV head; no
    window, soft-capping, ALiBi, sinks or quantized cache), or None."""
    if num_q_heads % num_kv_heads:
        return f"{num_q_heads} query heads over {num_kv_heads} KV heads"
    if sliding_window is not None and tuple(sliding_window) not in ((-1, -1), (-1, 0)):
        return f"sliding window {sliding_window}"
    if softcap:
        return f"soft-capping {softcap}"
    if alibi_slopes is not None or sinks is not None:
        return "ALiBi or attention sinks"
    if kv_cache_dtype != "auto":
        return f"kv_cache_dtype {kv_cache_dtype}"
    return None


def unavailable_reason() -> str | None:
    """Why the extension cannot be used in this process, or None when it can (checked once)."""
    if "reason" in _loaded:
        return _loaded["reason"]
    reason = sm90_reason(exact=True)
    try:
        if reason is None:
            path = os.environ.get(EXT_ENV)
            if path:
                torch.ops.load_library(path)
            else:
                importlib.import_module("_vegas_fa3_C")
            if not hasattr(torch.ops._vegas_fa3_C, "fwd_scores"):
                reason = "_vegas_fa3_C has no op fwd_scores"
    except (ImportError, OSError, RuntimeError) as e:
        reason = f"extension _vegas_fa3_C not loaded ({type(e).__name__}: {str(e)[:160]}); set {EXT_ENV}"
    _loaded["reason"] = reason
    return reason


def available() -> bool:
    """Whether ``torch.ops._vegas_fa3_C.fwd_scores`` can run here."""
    return unavailable_reason() is None


def unsupported_reason(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    max_query_len: int,
    *,
    score_rows: int = 2,
    sliding_window=None,
    softcap: float | None = None,
    alibi_slopes=None,
    sinks=None,
    kv_cache_dtype: str = "auto",
) -> str | None:
    """Why a verification call of this shape cannot use the extension, or None when it can.

    The build covers bf16 with head_dim 64/128/256, causal attention without window,
    soft-capping, ALiBi or sinks, a 16-bit cache, at most two scored rows per request, and
    decode-shaped batches (``max_query_len * num_q_heads / num_kv_heads <= 64``).
    """
    if dtype != torch.bfloat16:
        return f"dtype {dtype} (the build is bf16 only)"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (built: {HEAD_DIMS})"
    if score_rows > 2:
        return f"{score_rows} scored rows per request (the kernel writes at most 2)"
    reason = attention_reason(num_q_heads, num_kv_heads, sliding_window=sliding_window, softcap=softcap,
                              alibi_slopes=alibi_slopes, sinks=sinks, kv_cache_dtype=kv_cache_dtype)
    if reason is not None:
        return reason
    rows = max_query_len * (num_q_heads // num_kv_heads)
    if max_query_len < 2 or rows > MAX_PACKED_ROWS:
        return f"max_query_len {max_query_len} x group {num_q_heads // num_kv_heads} = {rows} packed rows (2..64 tokens fit)"
    return None


def score_rows_in_chunk(q_idx: torch.Tensor, q_weight: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """The scored rows of a :class:`~vegas.vllm_plugin.selectors.plan.CollectPlan` as the kernel takes them.

    Args:
        q_idx: ``(num_seqs, R)`` int64 token indices of the scored rows in the batch (R <= 2).
        q_weight: ``(num_seqs, R)`` float32, 0 for a padding row.
        cu_seqlens_q: ``(num_seqs + 1,)`` int32 cumulative query lengths.
        out: ``(num_seqs, 2)`` int32 to write into (persistent under CUDA graphs), or None.

    Returns:
        ``(num_seqs, 2)`` int32: each scored row as an offset in its request's chunk, -1 for none.
        A duplicated row (a chunk of one token lists its only row twice at weight 0) is -1.
    """
    num_seqs, width = q_idx.shape
    if width > 2:
        raise ValueError(f"the FA3 score output takes at most 2 scored rows per request, got {width}")
    start = cu_seqlens_q[:num_seqs].long()[:, None]
    rows = torch.where(q_weight > 0, q_idx - start, torch.full_like(q_idx, -1))
    if width < 2:
        rows = torch.cat([rows, torch.full_like(rows[:, :1], -1).expand(num_seqs, 2 - width)], dim=1)
    if out is None:
        return rows.to(torch.int32)
    out[:num_seqs].copy_(rows)
    return out[:num_seqs]


def fa3_verify_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    *,
    out: torch.Tensor,
    workspace: torch.Tensor | None = None,
    score_rows: torch.Tensor | None = None,
    score_ctx: torch.Tensor | None = None,
    scheduler_metadata: torch.Tensor | None = None,
    num_splits: int = 0,
) -> torch.Tensor:
    """vLLM's FA3 verification call, plus the per-KV-head scores into ``workspace``.

    Args:
        q: ``(num_tokens, num_q_heads, head_dim)`` bf16 queries of the actual tokens.
        k_cache, v_cache: ``(num_blocks, block_size, num_kv_heads, head_dim)``: ``kv_cache.unbind(1)``.
        block_table: ``(num_seqs, max_blocks)`` int32.
        cu_seqlens_q: ``(num_seqs + 1,)`` int32; seq_lens: ``(num_seqs,)`` int32 keys per request.
        max_seqlen_q, max_seqlen_k: host bounds (vLLM's ``max_query_len``, ``max_seq_len``).
        scale: softmax scale.
        out: ``(num_tokens, num_q_heads, head_dim)``, written in place.
        workspace: ``(num_kv_heads, >= num_seqs, max_len)`` float32 receiving, for every request,
            ``scale * sum of S[r, p]`` over its scored rows ``r`` and the KV head's query heads,
            positions ``p < score_ctx`` (nothing else is written); None: attention only.
        score_rows: ``(num_seqs, 2)`` int32 (:func:`score_rows_in_chunk`).
        score_ctx: ``(num_seqs,)`` int32 scored prefix (the plan's ``ctx_sel``).
        scheduler_metadata, num_splits: as vLLM passes them (``attn_metadata.scheduler_metadata``,
            ``attn_metadata.max_num_splits``), so that the kernel and its output are FA3's.

    Returns:
        ``out``.
    """
    torch.ops._vegas_fa3_C.fwd_scores(
        q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, int(max_seqlen_q), int(max_seqlen_k), block_table,
        float(scale), scheduler_metadata, int(num_splits), workspace, score_rows, score_ctx,
    )
    return out
