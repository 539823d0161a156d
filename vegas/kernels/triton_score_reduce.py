"""Sum of per-KV-head score partials into the selector's score row (GPU only, Triton).

Kernels that score keys per KV head (the fused Triton verification kernel, FlashAttention-3 with
the vegas score output, :mod:`vegas.kernels.fa3_scores`) write a ``(num_kv_heads, num_seqs,
max_len)`` float32 partial; :func:`reduce_head_scores` sums the KV heads in a fixed order
(deterministic, unlike atomics) into the caller's ``(num_seqs, max_len)`` row and writes ``-inf``
from ``ctx_sel`` on: the convention of the separate score kernel
(:mod:`vegas.kernels.triton_score`). A request with an empty chunk (a padded request of a captured
batch) scored nothing and gets 0 before ``ctx_sel``.

:func:`reduce_edge_rows` does the same for the CuTe score writer's per-query-head buffer
(:mod:`vegas.kernels.cute_scores`): ``(num_seqs, 2, num_q_heads, max_len)``, the first and the
last query row of each chunk, each weighted per request.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["reduce_edge_rows", "reduce_head_scores"]

#: positions per program
REDUCE_BLOCK = 1024


@triton.jit(do_not_specialize=["max_len"])
def _score_reduce_kernel(
    part_ptr,  # [Hkv, num_seqs, max_len] float32 (or the score row itself when DIRECT)
    sc_ptr,  # [num_seqs, max_len] float32 view
    cu_q_ptr,
    ctx_ptr,
    max_len,
    stride_pg, stride_ps,
    stride_ss,
    HKV: tl.constexpr,
    DIRECT: tl.constexpr,  # one KV head: the scores are in place, only the tail is written
    BLOCK: tl.constexpr,
):
    s = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = offs < max_len
    ctx = tl.load(ctx_ptr + s).to(tl.int32)
    # positions [0, n_sc) were scored by the main kernel; an empty chunk scores nothing (0)
    n_sc = tl.where(tl.load(cu_q_ptr + s + 1) > tl.load(cu_q_ptr + s), ctx, 0)
    sel = offs < ctx
    out_row = sc_ptr + s.to(tl.int64) * stride_ss + offs
    if DIRECT:
        tl.store(out_row, tl.where(sel, 0.0, float("-inf")), mask=in_row & (offs >= n_sc))
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for g in tl.static_range(HKV):
            acc += tl.load(part_ptr + g * stride_pg + s.to(tl.int64) * stride_ps + offs, mask=offs < n_sc,
                           other=0.0)
        tl.store(out_row, tl.where(sel, acc, float("-inf")), mask=in_row)


def _store_before_ctx(total: torch.Tensor, ctx_sel: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``scores`` = ``total`` before each request's ``ctx_sel``, ``-inf`` from it on (PyTorch path)."""
    pos = torch.arange(scores.shape[1], device=scores.device)
    keep = pos[None, :] < ctx_sel[: scores.shape[0], None].to(pos.dtype)
    scores.copy_(torch.where(keep, total, torch.full_like(total, float("-inf"))))
    return scores


def reduce_head_scores(
    part: torch.Tensor, scores: torch.Tensor, cu_seqlens_q: torch.Tensor, ctx_sel: torch.Tensor, *, direct: bool = False
) -> torch.Tensor:
    """Sum ``part`` over the KV heads into ``scores`` (``-inf`` from ``ctx_sel`` on).

    Args:
        part: ``(num_kv_heads, >= num_seqs, >= max_len)`` float32 with a unit last stride,
            positions ``[0, ctx_sel[s])`` written for every request with a non-empty chunk.
            Ignored (pass ``scores``) with ``direct``.
        scores: ``(num_seqs, max_len)`` float32 with a unit last stride, e.g. ``scores_all[layer]``.
        cu_seqlens_q: ``(num_seqs + 1,)`` int32 cumulative query lengths (an empty chunk scores nothing).
        ctx_sel: ``(num_seqs,)`` scored prefix per request.
        direct: one KV head whose scores were written into ``scores`` itself: only the tail
            (and the zeros of empty chunks) is written.

    Returns:
        ``scores``.
    """
    num_seqs, max_len = scores.shape
    if num_seqs == 0 or max_len == 0:
        return scores
    if not scores.is_cuda:  # the same computation in PyTorch (CPU tests)
        scored = (cu_seqlens_q[1 : num_seqs + 1] > cu_seqlens_q[:num_seqs])[:, None]
        total = scores.clone() if direct else part[:, :num_seqs, :max_len].sum(0)
        return _store_before_ctx(torch.where(scored, total, torch.zeros_like(total)), ctx_sel, scores)
    src = scores if direct else part
    sg, ss = (0, scores.stride(0)) if direct else (part.stride(0), part.stride(1))
    _score_reduce_kernel[(num_seqs, triton.cdiv(max_len, REDUCE_BLOCK))](
        src, scores, cu_seqlens_q, ctx_sel, max_len, sg, ss, scores.stride(0),
        HKV=1 if direct else part.shape[0], DIRECT=direct, BLOCK=REDUCE_BLOCK,
    )
    return scores


@triton.jit(do_not_specialize=["max_len"])
def _edge_reduce_kernel(
    ws_ptr,  # [>= num_seqs, 2, HQ, >= max_len] float32
    w_ptr,  # [num_seqs, 2] float32 slot weights
    ctx_ptr,  # [num_seqs] selectable positions
    sc_ptr,  # [num_seqs, max_len] float32 view
    max_len,
    stride_ws, stride_wk, stride_wh,
    stride_ss,
    HQ: tl.constexpr,
    BLOCK: tl.constexpr,
):
    s = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ctx = tl.load(ctx_ptr + s).to(tl.int32)
    sel = offs < ctx
    w0 = tl.load(w_ptr + s * 2)
    w1 = tl.load(w_ptr + s * 2 + 1)
    base = ws_ptr + s.to(tl.int64) * stride_ws + offs
    acc0 = tl.zeros([BLOCK], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK], dtype=tl.float32)
    for h in tl.static_range(HQ):
        acc0 += tl.load(base + h * stride_wh, mask=sel, other=0.0)
        acc1 += tl.load(base + stride_wk + h * stride_wh, mask=sel, other=0.0)
    out = tl.where(sel, w0 * acc0 + w1 * acc1, float("-inf"))
    tl.store(sc_ptr + s.to(tl.int64) * stride_ss + offs, out, mask=offs < max_len)


def reduce_edge_rows(ws: torch.Tensor, weights: torch.Tensor, ctx_sel: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``scores[s, p] = weights[s, 0] * sum_h ws[s, 0, h, p] + weights[s, 1] * sum_h ws[s, 1, h, p]``
    for ``p < ctx_sel[s]``, ``-inf`` from ``ctx_sel[s]`` on; one pass over ``ws`` on the GPU.

    Args:
        ws: ``(>= num_seqs, 2, num_q_heads, >= max_len)`` float32 with a unit last stride; only
            positions before ``ctx_sel`` are read.
        weights: ``(num_seqs, 2)`` float32, contiguous.
        ctx_sel: ``(num_seqs,)`` selectable positions.
        scores: ``(num_seqs, max_len)`` float32 with a unit last stride, written.

    Returns:
        ``scores``.
    """
    num_seqs, max_len = scores.shape
    if num_seqs == 0 or max_len == 0:
        return scores
    if not scores.is_cuda:  # the same computation in PyTorch (CPU tests)
        heads = ws[:num_seqs, :, :, :max_len].sum(dim=2)  # [num_seqs, 2, max_len]
        return _store_before_ctx((heads * weights[:num_seqs, :, None]).sum(dim=1), ctx_sel, scores)
    _edge_reduce_kernel[(num_seqs, triton.cdiv(max_len, REDUCE_BLOCK))](
        ws, weights, ctx_sel, scores, max_len, ws.stride(0), ws.stride(1), ws.stride(2), scores.stride(0),
        HQ=ws.shape[2], BLOCK=REDUCE_BLOCK,
    )
    return scores
