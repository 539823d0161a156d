"""Triton kernel of score collection over vLLM's paged KV cache (GPU only).

Pre-softmax logits are linear in the query, so the sum over a layer's query heads and the
collect queries folds into the queries first: for KV head ``g``,
``qsum[s, g] = sum_{t, h in group(g)} q[s, t, h]`` and ``score[s, i] = scale * sum_g qsum[s, g] . k[s, i, g]``.
In vLLM's NHD cache the keys of one token (all KV heads) are one contiguous row of
``num_kv_heads * head_dim`` elements, so a score is the dot product of that row with the
flattened ``qsum[s]``: the kernel is one bandwidth-bound pass over the prefix keys, read once,
as FlashAttention reads them, with no logits materialised per head.

All layers go in one launch. Each layer's key cache is addressed as an element offset from
layer 0's (a table of ``L`` int64), with an alignment hint so that loads stay 16-byte vectors
(a pointer loaded from memory carries no alignment, which made an earlier version 10x slower).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = ["collect_scores_layers_triton", "collect_scores_triton", "layer_offsets"]


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
        queries[None], weights, [key_cache], block_table, ctx_lens, max_len, scale
    )[0]


@triton.jit(do_not_specialize=["num_seqs", "max_len", "stride_bt", "stride_ol", "stride_os"])
def _score_layers_kernel(
    qsum_ptr,  # [L, num_seqs, ROW] float32, contiguous: folded collect queries
    k_ptr,  # layer 0's key cache
    koff_ptr,  # [L] int64 element offset of each layer's key cache from k_ptr
    bt_ptr,  # [num_seqs, max_blocks] int32
    ctx_ptr,  # [num_seqs] int32
    out_ptr,  # [L, num_seqs, max_len] float32
    num_seqs,
    max_len,
    stride_kb,
    stride_bt,
    stride_ol,
    stride_os,
    scale,
    BLOCK_SIZE: tl.constexpr,
    ROW: tl.constexpr,  # num_kv_heads * head_dim: the key row of one token
    BLOCK_R: tl.constexpr,  # chunk of the row per inner step (divides ROW)
    BLOCK_N: tl.constexpr,  # tokens per program
    ALIGN: tl.constexpr,  # elements every layer offset is a multiple of
):
    pid = tl.program_id(0)
    tile = tl.program_id(1)
    layer = pid // num_seqs
    s = pid % num_seqs
    ctx = tl.load(ctx_ptr + s)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    out_base = out_ptr + layer.to(tl.int64) * stride_ol + s.to(tl.int64) * stride_os
    if tile * BLOCK_N >= ctx:  # nothing to read: only -inf to write
        tl.store(out_base + offs_n, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=offs_n < max_len)
        return
    valid = offs_n < ctx
    koff = tl.multiple_of(tl.load(koff_ptr + layer), ALIGN)
    blk = tl.load(bt_ptr + s.to(tl.int64) * stride_bt + offs_n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    row = koff + blk * stride_kb + (offs_n % BLOCK_SIZE).to(tl.int64) * ROW  # [BLOCK_N]
    q_base = qsum_ptr + pid.to(tl.int64) * ROW
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for c in tl.static_range(ROW // BLOCK_R):
        offs_r = c * BLOCK_R + tl.arange(0, BLOCK_R)
        q = tl.load(q_base + offs_r)
        k = tl.load(k_ptr + row[:, None] + offs_r[None, :], mask=valid[:, None], other=0.0)
        acc += tl.sum(k.to(tl.float32) * q[None, :], axis=1)
    res = tl.where(valid, acc * scale, float("-inf"))
    tl.store(out_base + offs_n, res, mask=offs_n < max_len)


def layer_offsets(key_caches: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Element offsets of each key cache from the first one (int64, on their device) and the
    largest power of two (<= 16) that divides them all."""
    k0 = key_caches[0]
    size = k0.element_size()
    offs = []
    for k in key_caches:
        delta = k.data_ptr() - k0.data_ptr()
        if delta % size:
            raise ValueError("key caches of different layers are not element-aligned to each other")
        offs.append(delta // size)
    g = 0
    for o in offs:
        g = math.gcd(g, o)
    align = 16
    while align > 1 and g % align:
        align //= 2
    return torch.tensor(offs, dtype=torch.int64, device=k0.device), align


def collect_scores_layers_triton(
    queries: torch.Tensor,
    weights: torch.Tensor,
    key_caches: list[torch.Tensor],
    block_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    max_len: int,
    scale: float = 1.0,
    key_offsets: tuple[torch.Tensor, int] | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """All layers in one launch.

    Args:
        queries: ``(L, num_seqs, NQ, H, D)`` collect queries of every layer.
        weights: ``(num_seqs, NQ)`` float weight of each collect query (0 masks a repeat).
        key_caches: ``L`` key caches ``(num_blocks, block_size, num_kv_heads, head_dim)`` with
            the same shape and strides, each token's keys one contiguous row (vLLM NHD).
        block_table: ``(num_seqs, max_blocks)`` int32.
        ctx_lens: ``(num_seqs,)`` positions to score per sequence.
        max_len: output width (>= ``ctx_lens.max()``).
        scale: softmax scale.
        key_offsets: cached result of :func:`layer_offsets` for ``key_caches``.

    Returns:
        ``(L, num_seqs, max_len)`` float32, as :func:`vegas.kernels.collect_scores` per layer.

    Raises:
        ValueError: if the key rows are not contiguous (``stride(2) != head_dim`` or
            ``stride(1) != num_kv_heads * head_dim``).
    """
    num_layers, num_seqs, nq, num_q_heads, head_dim = queries.shape
    k0 = key_caches[0]
    _, block_size, num_kv_heads, _ = k0.shape
    row = num_kv_heads * head_dim
    if k0.stride(3) != 1 or k0.stride(2) != head_dim or k0.stride(1) != row:
        raise ValueError(f"key cache strides {k0.stride()} do not give contiguous token rows (NHD layout needed)")
    koffs, align = key_offsets if key_offsets is not None else layer_offsets(key_caches)
    out = torch.empty((num_layers, num_seqs, max_len), dtype=torch.float32, device=k0.device)
    if num_seqs == 0 or max_len == 0:
        return out
    # logits are linear in q: fold the collect queries (weighted) and each KV head's group first
    group = num_q_heads // num_kv_heads
    w = weights.to(torch.float32)[None, :, :, None, None, None]
    qsum = (queries.float().reshape(num_layers, num_seqs, nq, num_kv_heads, group, head_dim) * w).sum(dim=(2, 4))
    qsum = qsum.reshape(num_layers, num_seqs, row).contiguous()
    block_r = min(triton.next_power_of_2(row), 256)
    if row % block_r:
        raise ValueError(f"num_kv_heads * head_dim = {row} must be a multiple of {block_r}")
    grid = (num_layers * num_seqs, triton.cdiv(max_len, block_n))
    _score_layers_kernel[grid](
        qsum, k0, koffs, block_table, ctx_lens.to(torch.int32), out,
        num_seqs, max_len,
        k0.stride(0), block_table.stride(0), out.stride(0), out.stride(1),
        float(scale),
        BLOCK_SIZE=block_size, ROW=row, BLOCK_R=block_r, BLOCK_N=block_n, ALIGN=align,
    )
    return out
