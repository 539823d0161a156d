"""Triton kernel of score collection over vLLM's paged KV cache (GPU only).

Pre-softmax logits are linear in the query, so the sum over a layer's query heads and the
collect queries folds into the queries first: for KV head ``g``,
``qsum[s, g] = sum_{t, h in group(g)} q[s, t, h]`` and ``score[s, i] = scale * sum_g qsum[s, g] . k[s, i, g]``.
The kernel is then one bandwidth-bound pass over the prefix keys (the keys are read once, as
FlashAttention reads them; no logits are materialised per head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["collect_scores_triton"]


@triton.jit(do_not_specialize=["max_len", "stride_qs", "stride_bt", "stride_out"])
def _score_kernel(
    qsum_ptr,  # [num_seqs, num_kv_heads, head_dim] float32
    k_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    bt_ptr,  # [num_seqs, max_blocks] int32
    ctx_ptr,  # [num_seqs] int32
    out_ptr,  # [num_seqs, max_len] float32
    max_len,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_bt,
    stride_out,
    scale,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    s = tl.program_id(0)
    tile = tl.program_id(1)
    ctx = tl.load(ctx_ptr + s)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = offs_n < ctx
    blk = tl.load(bt_ptr + s * stride_bt + offs_n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    base = blk * stride_kb + (offs_n % BLOCK_SIZE).to(tl.int64) * stride_ko
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for g in tl.static_range(NUM_KV_HEADS):
        q = tl.load(qsum_ptr + s * stride_qs + g * stride_qh + offs_d, mask=dmask, other=0.0)
        k = tl.load(
            k_ptr + base[:, None] + g * stride_kh + offs_d[None, :],
            mask=valid[:, None] & dmask[None, :],
            other=0.0,
        )
        acc += tl.sum(k.to(tl.float32) * q[None, :], axis=1)
    res = tl.where(valid, acc * scale, float("-inf"))
    tl.store(out_ptr + s * stride_out + offs_n, res, mask=offs_n < max_len)


def fold_queries(queries: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``(num_seqs, Q, H, D)`` -> ``(num_seqs, num_kv_heads, D)`` float32 sums over Q and each group."""
    num_seqs, nq, num_q_heads, head_dim = queries.shape
    group = num_q_heads // num_kv_heads
    return queries.float().view(num_seqs, nq, num_kv_heads, group, head_dim).sum(dim=(1, 3))


def collect_scores_triton(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    max_len: int,
    scale: float = 1.0,
    qsum: torch.Tensor | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """Triton implementation of :func:`vegas.kernels.collect_scores`.

    ``qsum`` (``(num_seqs, num_kv_heads, head_dim)`` float32) may be passed instead of folding
    ``queries`` here.
    """
    num_seqs = block_table.shape[0]
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    assert key_cache.stride(-1) == 1, "key_cache needs a unit stride on head_dim"
    if qsum is None:
        qsum = fold_queries(queries, num_kv_heads)
    qsum = qsum.contiguous()
    out = torch.empty((num_seqs, max_len), dtype=torch.float32, device=key_cache.device)
    if num_seqs == 0 or max_len == 0:
        return out
    ctx = ctx_lens.to(torch.int32)
    grid = (num_seqs, triton.cdiv(max_len, block_n))
    _score_kernel[grid](
        qsum,
        key_cache,
        block_table,
        ctx,
        out,
        max_len,
        qsum.stride(0),
        qsum.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        out.stride(0),
        float(scale),
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=block_n,
    )
    return out
