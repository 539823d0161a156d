"""Sum of per-KV-head score partials into the selector's score row (GPU only, Triton).

FlashAttention-3 with the vegas score output (:mod:`vegas.kernels.fa3_scores`) scores keys per KV
head into a ``(num_kv_heads, num_seqs, max_len)`` float32 partial; :func:`reduce_head_scores` sums the KV heads in a fixed order
(deterministic, unlike atomics) into the caller's ``(num_seqs, max_len)`` row and writes ``-inf``
from ``ctx_sel`` on: the convention of the separate score kernel
(:mod:`vegas.kernels.triton_score`). A request with an empty chunk (a padded request of a captured
batch) scored nothing and gets 0 before ``ctx_sel``. The CuTe probe kernel
(:mod:`vegas.kernels.cute_probe`) stores its partial the same way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["reduce_head_scores"]

#: positions per program
REDUCE_BLOCK = 1024


@triton.jit(do_not_specialize=["max_len"])
def _score_reduce_kernel(
    part_ptr,  # [Hkv, num_seqs, max_len] float32
    sc_ptr,  # [num_seqs, max_len] float32 view
    cu_q_ptr,
    ctx_ptr,
    max_len,
    stride_pg, stride_ps,
    stride_ss,
    HKV: tl.constexpr,
    BLOCK: tl.constexpr,
):
    s = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = offs < max_len
    ctx = tl.load(ctx_ptr + s).to(tl.int32)
    # positions [0, n_sc) were scored by the main kernel; an empty chunk scores nothing (0)
    n_sc = tl.where(tl.load(cu_q_ptr + s + 1) > tl.load(cu_q_ptr + s), ctx, 0)
    sel = offs < ctx
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for g in tl.static_range(HKV):
        src = part_ptr + g * stride_pg + s.to(tl.int64) * stride_ps + offs
        acc += tl.load(src, mask=offs < n_sc, other=0.0)
    tl.store(sc_ptr + s.to(tl.int64) * stride_ss + offs, tl.where(sel, acc, float("-inf")), mask=in_row)


def reduce_head_scores(part: torch.Tensor, scores: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       ctx_sel: torch.Tensor) -> torch.Tensor:
    """Sum ``part`` over the KV heads into ``scores`` (``-inf`` from ``ctx_sel`` on).

    Args:
        part: ``(num_kv_heads, >= num_seqs, >= max_len)`` float32 with a unit last stride,
            positions ``[0, ctx_sel[s])`` written for every request with a non-empty chunk.
        scores: ``(num_seqs, max_len)`` float32 with a unit last stride, e.g. ``scores_all[layer]``.
        cu_seqlens_q: ``(num_seqs + 1,)`` int32 cumulative query lengths (an empty chunk scores nothing).
        ctx_sel: ``(num_seqs,)`` scored prefix per request.

    Returns:
        ``scores``.
    """
    num_seqs, max_len = scores.shape
    if num_seqs == 0 or max_len == 0:
        return scores
    if not scores.is_cuda:  # the same computation in PyTorch (CPU tests)
        pos = torch.arange(max_len, device=scores.device)
        ctx = ctx_sel[:num_seqs].to(pos.dtype)[:, None]
        scored = (cu_seqlens_q[1 : num_seqs + 1] > cu_seqlens_q[:num_seqs])[:, None]
        total = torch.where(scored, part[:, :num_seqs, :max_len].sum(0), torch.zeros((), device=scores.device))
        scores.copy_(torch.where(pos[None, :] < ctx, total, torch.full_like(total, float("-inf"))))
        return scores
    _score_reduce_kernel[(num_seqs, triton.cdiv(max_len, REDUCE_BLOCK))](
        part, scores, cu_seqlens_q, ctx_sel, max_len, part.stride(0), part.stride(1), scores.stride(0),
        HKV=part.shape[0], BLOCK=REDUCE_BLOCK,
    )
    return scores
