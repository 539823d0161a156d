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

__all__ = ["collect_scores_layers_triton", "collect_scores_triton"]


def collect_scores_triton(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    max_len: int,
    scale: float = 1.0,
) -> torch.Tensor:
    """Triton implementation of :func:`vegas.kernels.collect_scores` (one layer)."""
    weights = torch.ones(queries.shape[:2], dtype=torch.float32, device=queries.device)
    return collect_scores_layers_triton(
        queries[None].contiguous(), weights, [key_cache], block_table, ctx_lens, max_len, scale
    )[0]


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit(do_not_specialize=["num_seqs", "max_len", "stride_bt", "stride_ol", "stride_os"])
def _score_layers_kernel(
    qsum_ptr,  # [L, num_seqs, NUM_KV_HEADS, HEAD_DIM] float32, contiguous: folded collect queries
    kptrs_ptr,  # [L] int64 data pointers of each layer's key cache (same shape and strides)
    bt_ptr,  # [num_seqs, max_blocks] int32
    ctx_ptr,  # [num_seqs] int32
    out_ptr,  # [L, num_seqs, max_len] float32
    num_seqs,
    max_len,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_bt,
    stride_ol,
    stride_os,
    scale,
    KDTYPE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    tile = tl.program_id(1)
    layer = pid // num_seqs
    s = pid % num_seqs
    k_ptr = tl.load(kptrs_ptr + layer).to(tl.pointer_type(KDTYPE))
    ctx = tl.load(ctx_ptr + s)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = offs_n < ctx
    blk = tl.load(bt_ptr + s * stride_bt + offs_n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    base = blk * stride_kb + (offs_n % BLOCK_SIZE).to(tl.int64) * stride_ko
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    q_base = qsum_ptr + pid.to(tl.int64) * (NUM_KV_HEADS * HEAD_DIM)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for g in tl.static_range(NUM_KV_HEADS):
        qg = tl.load(q_base + g * HEAD_DIM + offs_d, mask=dmask, other=0.0)
        k = tl.load(
            k_ptr + base[:, None] + g * stride_kh + offs_d[None, :],
            mask=valid[:, None] & dmask[None, :],
            other=0.0,
        )
        acc += tl.sum(k.to(tl.float32) * qg[None, :], axis=1)
    res = tl.where(valid, acc * scale, float("-inf"))
    tl.store(out_ptr + layer.to(tl.int64) * stride_ol + s * stride_os + offs_n, res, mask=offs_n < max_len)


def collect_scores_layers_triton(
    queries: torch.Tensor,
    weights: torch.Tensor,
    key_caches: list[torch.Tensor],
    block_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    max_len: int,
    scale: float = 1.0,
    key_ptrs: torch.Tensor | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """All layers in one launch: ``queries`` ``(L, num_seqs, NQ, H, D)``, ``weights``
    ``(num_seqs, NQ)``, one key cache per layer (same shape/strides); returns
    ``(L, num_seqs, max_len)`` float32 (see :func:`vegas.kernels.collect_scores`)."""
    num_layers, num_seqs, nq, num_q_heads, head_dim = queries.shape
    k0 = key_caches[0]
    _, block_size, num_kv_heads, _ = k0.shape
    assert k0.stride(-1) == 1, "key caches need a unit stride on head_dim"
    if key_ptrs is None:
        key_ptrs = torch.tensor([k.data_ptr() for k in key_caches], dtype=torch.int64, device=k0.device)
    out = torch.empty((num_layers, num_seqs, max_len), dtype=torch.float32, device=k0.device)
    if num_seqs == 0 or max_len == 0:
        return out
    # logits are linear in q: fold the collect queries (weighted) and each KV head's group first
    group = num_q_heads // num_kv_heads
    w = weights.to(torch.float32)[None, :, :, None, None, None]
    qsum = (queries.float().reshape(num_layers, num_seqs, nq, num_kv_heads, group, head_dim) * w).sum(dim=(2, 4))
    qsum = qsum.contiguous()  # [L, num_seqs, num_kv_heads, head_dim]
    grid = (num_layers * num_seqs, triton.cdiv(max_len, block_n))
    _score_layers_kernel[grid](
        qsum, key_ptrs, block_table, ctx_lens.to(torch.int32), out,
        num_seqs, max_len,
        k0.stride(0), k0.stride(1), k0.stride(2),
        block_table.stride(0), out.stride(0), out.stride(1),
        float(scale),
        KDTYPE=_TL_DTYPES[k0.dtype], BLOCK_SIZE=block_size, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=block_n,
    )
    return out
