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

With a logit soft-cap (``softcap > 0``, Gemma 2) the logits are no longer linear in the query,
so nothing folds: per KV head the kernel multiplies a tile of keys ``[BLOCK_N, head_dim]`` by
that head's ``num_collect * group`` query rows, read in place from the queries (``tl.dot``,
float32), caps every logit, ``softcap * tanh(scale * q . k / softcap)``, weighs it by its
query's weight and sums. This path reads the keys once as well, but does ``num_collect * group``
times the arithmetic.

Any head shape works (:func:`row_chunks`): the row is read in power-of-two chunks of at most 256
elements. When a power of two of at least 64 divides the row (8 x 128, 2 x 64, 3 x 64,
4 x 256, 32 x 128, 8 x 80 ...) the chunks tile it exactly and no load is masked: the tuned
path of the common shapes. Otherwise (a row of 80, 96, 160 ...) the row is padded to the next
chunk boundary and the tail lanes are masked.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..config import VegasConfigError
from .reference import check_head_shape

__all__ = ["collect_scores_layers_triton", "collect_scores_triton", "layer_offsets", "row_chunks"]

#: widest chunk of a key row per inner step (elements)
MAX_BLOCK_R = 256
#: the smallest exact power-of-two divisor of a row that is read unmasked
MIN_EVEN_BLOCK_R = 64


def row_chunks(row: int) -> tuple[int, bool]:
    """``(block_r, even)``: chunk width (a power of two, <= 256 elements) of a key row of ``row``
    elements, and whether the chunks tile the row exactly (no masked loads).

    The largest power of two dividing ``row`` is used when it is at least 64 (e.g. 1024 -> 256,
    192 -> 64, 640 -> 128); else ``min(next_power_of_2(row), 256)`` with the tail masked
    (80 -> 128, 160 -> 256).

    Raises:
        VegasConfigError: ``row`` is not a positive integer.
    """
    if isinstance(row, bool) or not isinstance(row, int) or row < 1:
        raise VegasConfigError(f"num_kv_heads * head_dim must be a positive integer, got {row!r}")
    div = row & -row  # largest power of two dividing row
    if div >= MIN_EVEN_BLOCK_R:
        return min(div, MAX_BLOCK_R), True
    return min(triton.next_power_of_2(row), MAX_BLOCK_R), False


def collect_scores_triton(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    max_len: int,
    scale: float = 1.0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Triton implementation of :func:`vegas.kernels.collect_scores` (one layer)."""
    weights = torch.ones(queries.shape[:2], dtype=torch.float32, device=queries.device)
    return collect_scores_layers_triton(
        queries[None], weights, [key_cache], block_table, ctx_lens, max_len, scale, softcap=softcap
    )[0]


@triton.jit(do_not_specialize=["num_seqs", "max_len", "stride_bt", "stride_ol", "stride_os"])
def _score_layers_kernel(
    q_ptr,  # [L, num_seqs, ROW] float32 folded collect queries; CAPPED: the queries [L, num_seqs, NQ, HQ, HEAD_DIM]
    w_ptr,  # CAPPED: [num_seqs, NQ] float32 weight of each collect query
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
    softcap,
    BLOCK_SIZE: tl.constexpr,
    ROW: tl.constexpr,  # num_kv_heads * head_dim: the key row of one token
    BLOCK_R: tl.constexpr,  # chunk of the row per inner step (a power of two)
    EVEN_R: tl.constexpr,  # BLOCK_R divides ROW: no column mask
    BLOCK_N: tl.constexpr,  # tokens per program
    ALIGN: tl.constexpr,  # elements every layer offset is a multiple of
    CAPPED: tl.constexpr,  # soft-capped logits, one dot product per query row and head
    NQ: tl.constexpr,  # CAPPED: collect queries per request
    KVH: tl.constexpr,  # CAPPED: KV heads of a row
    GROUP: tl.constexpr,  # CAPPED: query heads per KV head
    HEAD_DIM: tl.constexpr,  # CAPPED: head_dim
    BLOCK_D: tl.constexpr,  # CAPPED: head_dim padded to a power of two >= 16
    BLOCK_M: tl.constexpr,  # CAPPED: NQ * GROUP query rows of a KV head, padded to a power of two >= 16
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
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if CAPPED:
        offs_d = tl.arange(0, BLOCK_D)
        offs_m = tl.arange(0, BLOCK_M)  # row m of a KV head g: collect query m // GROUP, head g * GROUP + m % GROUP
        mmask = offs_m < NQ * GROUP
        dmask = offs_d < HEAD_DIM
        t = offs_m // GROUP
        w = tl.load(w_ptr + s.to(tl.int64) * NQ + t, mask=mmask, other=0.0)  # [BLOCK_M], 0 on padding rows
        q_base = q_ptr + pid.to(tl.int64) * (NQ * KVH * GROUP * HEAD_DIM)
        kmask = valid[:, None] & dmask[None, :]
        qmask = mmask[:, None] & dmask[None, :]
        for g in range(KVH):
            k = tl.load(k_ptr + row[:, None] + g * HEAD_DIM + offs_d[None, :], mask=kmask, other=0.0)
            q_row = t * (KVH * GROUP) + g * GROUP + offs_m % GROUP  # [BLOCK_M] (query, head) row
            q = tl.load(q_base + q_row[:, None] * HEAD_DIM + offs_d[None, :], mask=qmask, other=0.0).to(tl.float32)
            logits = tl.dot(k.to(tl.float32), tl.trans(q), input_precision="ieee") * scale  # [BLOCK_N, BLOCK_M]
            capped = softcap * (2.0 * tl.sigmoid(2.0 * logits / softcap) - 1.0)  # softcap * tanh(logits / softcap)
            acc += tl.sum(capped * w[None, :], axis=1)
    else:
        q_base = q_ptr + pid.to(tl.int64) * ROW
        for c in tl.static_range((ROW + BLOCK_R - 1) // BLOCK_R):
            offs_r = c * BLOCK_R + tl.arange(0, BLOCK_R)
            if EVEN_R:
                q = tl.load(q_base + offs_r)
                k = tl.load(k_ptr + row[:, None] + offs_r[None, :], mask=valid[:, None], other=0.0)
            else:  # padded tail of the row
                rmask = offs_r < ROW
                q = tl.load(q_base + offs_r, mask=rmask, other=0.0)
                k = tl.load(k_ptr + row[:, None] + offs_r[None, :], mask=valid[:, None] & rmask[None, :], other=0.0)
            acc += tl.sum(k.to(tl.float32) * q[None, :], axis=1)
        acc = acc * scale
    res = tl.where(valid, acc, float("-inf"))
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
    softcap: float = 0.0,
    out: torch.Tensor | None = None,
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
        block_n: tokens per program (a power of two; at least 16 with ``softcap``).
        softcap: the layers' attention logit soft-cap (one value for all of them); 0 for none.
        out: ``(L, num_seqs, max_len)`` float32 with unit last stride to write into (e.g. one
            layer's row of a larger buffer); None allocates it.

    Returns:
        ``(L, num_seqs, max_len)`` float32, as :func:`vegas.kernels.collect_scores` per layer:
        ``sum_t weights[s, t] * sum_h cap(scale * q[t, h] . k[i, kv(h)])``.

    Any ``num_kv_heads x head_dim`` and any GQA ratio ``H / num_kv_heads`` work (see
    :func:`row_chunks` for how the row is read).

    Raises:
        VegasConfigError (a ``ValueError``): ``len(key_caches) != L``; the key caches' head_dim
            differs from the queries'; ``H`` is not a multiple of ``num_kv_heads``; the key rows
            are not contiguous (``stride(3) != 1``, ``stride(2) != head_dim`` or
            ``stride(1) != num_kv_heads * head_dim``); ``block_table`` has no unit last stride;
            ``block_n`` is not a power of two.
    """
    num_layers, num_seqs, nq, num_q_heads, head_dim = queries.shape
    if len(key_caches) != num_layers:
        raise VegasConfigError(f"key_caches must hold one cache per layer of queries ({num_layers}), got {len(key_caches)}")
    k0 = key_caches[0]
    _, block_size, num_kv_heads, k_head_dim = k0.shape
    check_head_shape(num_q_heads, num_kv_heads, head_dim, k_head_dim)
    row = num_kv_heads * head_dim
    contiguous_rows = (
        k0.stride(3) == 1
        and (num_kv_heads == 1 or k0.stride(2) == head_dim)
        and (block_size == 1 or k0.stride(1) == row)
    )
    if not contiguous_rows:
        raise VegasConfigError(
            f"key_caches strides {k0.stride()} do not give contiguous token rows of num_kv_heads * head_dim = "
            f"{row} elements (vLLM's NHD layout is needed)"
        )
    if block_table.dim() != 2 or (block_table.shape[1] > 1 and block_table.stride(1) != 1):
        raise VegasConfigError(f"block_table must be 2-D with a unit last stride, got strides {block_table.stride()}")
    if block_n < (16 if softcap else 1) or block_n & (block_n - 1):
        raise VegasConfigError(f"block_n must be a power of two (at least 16 with softcap), got {block_n}")
    koffs, align = key_offsets if key_offsets is not None else layer_offsets(key_caches)
    shape = (num_layers, num_seqs, max_len)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=k0.device)
    elif tuple(out.shape) != shape or out.dtype != torch.float32 or (max_len > 1 and out.stride(2) != 1):
        raise VegasConfigError(f"out must be float32 {shape} with a unit last stride, got {out.dtype} "
                               f"{tuple(out.shape)} strides {out.stride()}")
    if num_seqs == 0 or max_len == 0:
        return out
    group = num_q_heads // num_kv_heads
    w = weights.to(torch.float32).contiguous()
    if softcap:  # the kernel reads every (query, head) row as it is
        q = queries.contiguous()
        capped = dict(CAPPED=True, NQ=nq, KVH=num_kv_heads, GROUP=group, HEAD_DIM=head_dim,
                      BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                      BLOCK_M=max(16, triton.next_power_of_2(nq * group)))
    else:  # logits are linear in q: fold the collect queries (weighted) and each KV head's group first
        q = queries.float().reshape(num_layers, num_seqs, nq, num_kv_heads, group, head_dim)
        q = (q * w[None, :, :, None, None, None]).sum(dim=(2, 4)).reshape(num_layers, num_seqs, row).contiguous()
        # the CAPPED-only constants fixed: no extra specialisations of the raw kernel
        capped = dict(CAPPED=False, NQ=1, KVH=1, GROUP=1, HEAD_DIM=1, BLOCK_D=16, BLOCK_M=16)
    block_r, even_r = row_chunks(row)
    grid = (num_layers * num_seqs, triton.cdiv(max_len, block_n))
    _score_layers_kernel[grid](
        q, w, k0, koffs, block_table, ctx_lens.to(torch.int32), out,
        num_seqs, max_len,
        k0.stride(0), block_table.stride(0), out.stride(0), out.stride(1),
        float(scale), float(softcap or 1.0),
        BLOCK_SIZE=block_size, ROW=row, BLOCK_R=block_r, EVEN_R=even_r, BLOCK_N=block_n, ALIGN=align, **capped,
    )
    return out
