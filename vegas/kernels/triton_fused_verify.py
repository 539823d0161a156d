"""Fused verification attention with score collection over vLLM's paged KV cache (issue 14).

One Triton kernel computes the causal, paged, varlen, GQA attention of a verification batch (each
request's chunk of queries: γ + 1 for decode requests, any length for prefill chunks) and, in the
same loop over the key tiles, the selector's scores of the request: the logits
``scale * q . k`` of the scored rows (``q_idx``, weighted by ``q_weight``) summed over those rows
and over every query head, for key positions ``[0, ctx_sel)``. The keys are read once, for both.
:mod:`vegas.kernels.fused_reference` is the specification.

Work decomposition (as FA3's PackGQA and split-KV decoding):

- one program per ``(split, request, KV head, query tile)``; a query tile packs the rows of the
  ``G = num_q_heads / num_kv_heads`` query heads of that KV head for consecutive tokens
  (``row = token * G + head_in_group``), so that a decode request's ``(γ + 1) * G`` rows are one
  tile and each key tile feeds one ``tl.dot`` per KV head;
- query tiles are aligned to the *end* of each chunk: tile 0 holds the last ``BLOCK_M // G``
  tokens, so the scored rows (the last ``score_span`` tokens: γ + 1 in vegas) are always in
  tile 0, and only tile-0 programs write scores (no two programs write one score);
- with ``num_splits > 1`` each program covers one slice of the keys and writes a partial output
  and its log-sum-exp; a second kernel combines the slices (flash-decoding), which long contexts
  with few requests need to fill the GPU;
- each program writes its KV head's share of the scores into a ``(num_kv_heads, num_seqs,
  max_len)`` float32 workspace (a fixed summation order: deterministic, unlike atomics); a last
  small kernel sums the KV heads into the caller's ``(num_seqs, max_len)`` score row (e.g.
  ``scores[layer]`` of the ``(L, num_seqs, max_len)`` buffer that
  :func:`vegas.kernels.select_topk_layers` consumes in place) and writes ``-inf`` from
  ``ctx_sel`` to ``max_len``. With one KV head the main kernel writes the score row directly.

Head dims that are not a power of two (80, 96) are padded to the next one with masked loads.
Not supported (route such layers to FA3 and the separate score kernel): ALiBi, soft-capping,
sliding windows, attention sinks, FP8 caches with descales.

``score_mode="weight"`` (softmax weights) is not fused: a weight needs each row's final max and
sum, known only after the last key tile, and the rows are summed into the score before then;
fusing it would mean storing ``R * num_q_heads`` logits per position (a write of 12-30 % of the
key bytes) and a second pass over them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import VegasConfigError
from .reference import check_head_shape
from .triton_score_reduce import _score_reduce_kernel

__all__ = ["choose_num_splits", "fused_verify_attention", "fused_blocks"]

#: widest packed query tile (rows = tokens x query heads of one KV head)
MAX_BLOCK_M = 128


def fused_blocks(group: int, score_span: int, head_dim: int) -> tuple[int, int, int]:
    """``(block_m, block_n, block_d)`` of the kernel: a query tile that holds the last
    ``score_span`` tokens of a chunk for the ``group`` query heads of one KV head (at least 16,
    a power of two), key tiles of 64 tokens (32 for head_dim > 128) and the head dim padded to a
    power of two.

    Raises:
        VegasConfigError: ``score_span * group`` exceeds :data:`MAX_BLOCK_M`.
    """
    rows = max(score_span, 1) * group
    if rows > MAX_BLOCK_M:
        raise VegasConfigError(
            f"the scored rows ({score_span} tokens x {group} query heads per KV head = {rows}) must fit one "
            f"query tile of at most {MAX_BLOCK_M} rows"
        )
    block_m = max(16, triton.next_power_of_2(rows))
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 64 if block_d <= 128 else 32
    return block_m, block_n, block_d


def choose_num_splits(programs: int, max_seq_len: int, num_sms: int, min_keys: int = 512, cap: int = 64) -> int:
    """Key slices per program so that ``programs * splits`` covers about two waves of
    ``num_sms``, each slice keeping at least ``min_keys`` keys (a power of two, <= ``cap``).

    Under full CUDA graphs pass a fixed value (e.g. from ``max_model_len``): the grid is
    captured; per-request slice bounds are computed on the device from ``seq_lens``."""
    want = triton.cdiv(2 * num_sms, max(programs, 1))
    most = max(1, max_seq_len // min_keys)
    splits = 1
    while splits * 2 <= min(want, most, cap):
        splits *= 2
    return splits


@triton.jit(do_not_specialize=["num_seqs", "max_len", "num_splits"])
def _fused_verify_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [num_blocks, block_size, Hkv, D] (strided)
    v_ptr,
    o_ptr,  # [T, Hq, D]: final output (NUM_SPLITS == 1)
    op_ptr,  # [num_splits, T, Hq, BLOCK_D] float32 partial outputs (SPLIT)
    lse_ptr,  # [num_splits, T, Hq] float32 partial log2-sum-exp (SPLIT)
    sc_ptr,  # scores: [Hkv, num_seqs, max_len] partials, or the score row itself when Hkv == 1
    cu_q_ptr,  # [num_seqs + 1] int32
    seqlen_ptr,  # [num_seqs] int32
    bt_ptr,  # [num_seqs, max_blocks] int32
    qidx_ptr,  # [num_seqs, R] int64/int32 token indices of the scored rows
    qw_ptr,  # [num_seqs, R] float32 weights
    ctx_ptr,  # [num_seqs] selectable positions
    num_seqs,
    max_len,
    num_splits,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_ps, stride_pt, stride_ph,  # op strides (split, token, head); lse is [split, T, Hq] contiguous
    stride_bt,
    stride_sg, stride_ss,  # score partial strides (kv head, seq)
    sm_scale,
    GROUP: tl.constexpr,
    HKV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,  # HEAD_DIM == BLOCK_D: no mask along the head dim
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    R: tl.constexpr,  # scored rows per request (0: no scores)
    SPLIT: tl.constexpr,  # num_splits > 1
    DOT_PREC: tl.constexpr,
):
    split = tl.program_id(0)
    pid = tl.program_id(1)
    tile = tl.program_id(2)
    s = pid // HKV
    g = pid % HKV
    q_start = tl.load(cu_q_ptr + s)
    qlen = tl.load(cu_q_ptr + s + 1) - q_start
    kv_len = tl.load(seqlen_ptr + s)
    rows_hi = qlen * GROUP - tile * BLOCK_M  # packed rows of this tile: [rows_hi - BLOCK_M, rows_hi)
    if rows_hi <= 0:
        return
    offs_m = rows_hi - BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m >= 0
    r = tl.maximum(offs_m, 0)
    t = r // GROUP
    h = g * GROUP + r % GROUP
    tok = (q_start + t).to(tl.int64)
    row_lim = kv_len - qlen + t + 1  # causal: row sees keys [0, row_lim)
    kv_end = kv_len - qlen + (rows_hi - 1) // GROUP + 1  # keys the tile's last row sees
    split_size = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_size
    hi = tl.minimum(lo + split_size, kv_end)

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM  # padded head dims (80, 96): masked lanes (EVEN_D: no mask, vector loads)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + h[:, None].to(tl.int64) * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    w = tl.zeros([BLOCK_M], dtype=tl.float32)
    score_hi = lo  # nothing to score unless this is tile 0 of a scoring call
    if R > 0:
        if tile == 0:
            for i in tl.static_range(R):
                idx = tl.load(qidx_ptr + s * R + i)
                wi = tl.load(qw_ptr + s * R + i)
                w += tl.where(row_ok & (tok == idx), wi, 0.0)
            score_hi = tl.minimum(tl.load(ctx_ptr + s).to(tl.int32), hi)
    sc_base = sc_ptr + g.to(tl.int64) * stride_sg + s.to(tl.int64) * stride_ss

    qk_scale = sm_scale * 1.4426950408889634  # log2(e): exp2 below
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + s.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = offs_n % BLOCK_SIZE
        k_ptrs = k_ptr + (blk * stride_kb + slot * stride_kt + g * stride_kh)[None, :] + offs_d[:, None]
        if EVEN_D:
            k = tl.load(k_ptrs, mask=n_ok[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
        else:
            k = tl.load(k_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        qk = tl.dot(q, k, input_precision=DOT_PREC)  # [BLOCK_M, BLOCK_N] float32, unscaled
        if R > 0:  # branch-free: tiles past ctx_sel (and tiles other than 0) store nothing
            sc = tl.sum(qk * w[:, None], axis=0) * sm_scale
            tl.store(sc_base + offs_n, sc, mask=offs_n < score_hi)
        visible = n_ok[None, :] & (offs_n[None, :] < row_lim[:, None])
        qk = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_ptrs = v_ptr + (blk * stride_vb + slot * stride_vt + g * stride_vh)[:, None] + offs_d[None, :]
        if EVEN_D:
            v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)  # [BLOCK_N, BLOCK_D]
        else:
            v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    h64 = h.to(tl.int64)
    if SPLIT:
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        sp = split.to(tl.int64)
        tl.store(
            op_ptr + sp * stride_ps + tok[:, None] * stride_pt + h64[:, None] * stride_ph + offs_d[None, :],
            out,
            mask=row_ok[:, None],
        )
        tl.store(lse_ptr + sp * (stride_ps // BLOCK_D) + tok * (stride_pt // BLOCK_D) + h64, lse, mask=row_ok)
    else:
        tl.store(
            o_ptr + tok[:, None] * stride_ot + h64[:, None] * stride_oh + offs_d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(
    op_ptr,  # [num_splits, T, Hq, BLOCK_D] float32
    lse_ptr,  # [num_splits, T, Hq] float32
    o_ptr,
    cu_q_ptr,
    num_seqs,
    num_splits,
    stride_ps, stride_pt, stride_ph,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= num_splits, a power of two
):
    tok = tl.program_id(0)
    h = tl.program_id(1)
    if tok >= tl.load(cu_q_ptr + num_seqs):  # padding tokens: nothing was computed
        return
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < num_splits
    lse = tl.load(lse_ptr + offs_s * (stride_ps // BLOCK_D) + tok * (stride_pt // BLOCK_D) + h, mask=s_ok,
                  other=float("-inf"))
    m = tl.max(lse, axis=0)
    wts = tl.where(s_ok, tl.exp2(lse - m), 0.0)
    offs_d = tl.arange(0, BLOCK_D)
    part = tl.load(
        op_ptr + offs_s[:, None].to(tl.int64) * stride_ps + tok * stride_pt + h * stride_ph + offs_d[None, :],
        mask=s_ok[:, None] & (wts[:, None] > 0.0),
        other=0.0,
    )
    out = tl.sum(part * wts[:, None], axis=0) / tl.sum(wts, axis=0)
    tl.store(o_ptr + tok.to(tl.int64) * stride_ot + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def fused_verify_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
    q_idx: torch.Tensor | None = None,
    q_weight: torch.Tensor | None = None,
    ctx_sel: torch.Tensor | None = None,
    score_span: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Verification attention, and with ``scores`` the selector's scores in the same pass.

    Args:
        q: ``(num_tokens, num_q_heads, head_dim)`` queries (unit last stride); tokens beyond
            ``cu_seqlens_q[num_seqs]`` are padding and are left untouched in ``out``.
        k_cache, v_cache: ``(num_blocks, block_size, num_kv_heads, head_dim)`` with a unit last
            stride: ``kv_cache.unbind(1)`` of vLLM's ``[num_blocks, 2, block_size, H, D]``.
        block_table: ``(>= num_seqs, max_blocks)`` int32 with a unit last stride.
        cu_seqlens_q: ``(num_seqs + 1,)`` int32 cumulative query lengths.
        seq_lens: ``(num_seqs,)`` int32 keys per request, this chunk included (the chunk's
            queries sit at the last ``qlen`` positions: causal within the chunk).
        max_seqlen_q: host bound of the query lengths (sizes the grid).
        scale: softmax scale.
        out: output ``(num_tokens, num_q_heads, head_dim)`` (written in place), or None.
        scores: ``(num_seqs, max_len)`` float32 (any row stride, unit last stride), e.g.
            ``scores_all[layer]``: receives ``sum_r q_weight[s, r] * sum_h scale * q[q_idx[s, r], h] . k[p]``
            for ``p < ctx_sel[s]`` and ``-inf`` after, as the separate score kernel; requests
            with an empty chunk get 0 (nothing scored them). None: attention only.
        q_idx, q_weight: ``(num_seqs, R)`` token indices of the scored rows and their weights
            (:func:`vegas.vllm_plugin.selection.state.make_plan`). Each request's scored rows must be among
            the last ``score_span`` tokens of its own chunk; others are ignored.
        ctx_sel: ``(num_seqs,)`` scored prefix per request (<= ``seq_lens - score_span`` in
            vegas, so that every scored row sees every scored key).
        score_span: tokens at the end of a chunk that may hold scored rows (γ + 1 in vegas).
        num_splits: key slices per program; None: :func:`choose_num_splits` (pass a fixed value
            under CUDA-graph capture).
        block_n, num_warps, num_stages: tuning overrides.

    Returns:
        ``out``.

    Raises:
        VegasConfigError: bad head shape, layout or score arguments.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, k_head_dim = k_cache.shape
    check_head_shape(num_q_heads, num_kv_heads, head_dim, k_head_dim)
    if v_cache.shape != k_cache.shape:
        raise VegasConfigError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache's {tuple(k_cache.shape)}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise VegasConfigError("q, k_cache and v_cache need a unit last stride")
    if block_table.dim() != 2 or (block_table.shape[1] > 1 and block_table.stride(1) != 1):
        raise VegasConfigError(f"block_table must be 2-D with a unit last stride, got strides {block_table.stride()}")
    num_seqs = seq_lens.shape[0]
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if scores is not None:
        if q_idx is None or q_weight is None or ctx_sel is None or score_span is None:
            raise VegasConfigError("scores need q_idx, q_weight, ctx_sel and score_span")
        if scores.dtype != torch.float32 or scores.dim() != 2 or scores.shape[0] < num_seqs or scores.stride(1) != 1:
            raise VegasConfigError(f"scores must be (num_seqs, max_len) float32 with a unit last stride, got "
                                   f"{tuple(scores.shape)} {scores.dtype}")
        num_rows = q_idx.shape[1]
        q_idx = q_idx.contiguous()
        q_weight = q_weight.to(torch.float32).contiguous()
    else:
        num_rows = 0
        score_span = 1
    block_m, bn, block_d = fused_blocks(group, score_span, head_dim)
    block_n = block_n or bn
    if num_seqs == 0 or num_tokens == 0:
        return out
    m_tiles = triton.cdiv(max(int(max_seqlen_q), 1) * group, block_m)
    programs = num_seqs * num_kv_heads * m_tiles
    if num_splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 132
        num_splits = choose_num_splits(programs, int(block_table.shape[1]) * block_size, sms)
    split = num_splits > 1
    dev = q.device
    dummy = torch.empty(1, dtype=torch.float32, device=dev)
    if split:
        opart = torch.empty((num_splits, num_tokens, num_q_heads, block_d), dtype=torch.float32, device=dev)
        lse = torch.empty((num_splits, num_tokens, num_q_heads), dtype=torch.float32, device=dev)
    else:
        opart, lse = dummy, dummy
    direct = num_kv_heads == 1
    if scores is None:
        spart, sg, ss, qi, qw, cs = dummy, 0, 0, dummy, dummy, dummy
    else:
        max_len = scores.shape[1]
        spart = scores if direct else torch.empty((num_kv_heads, num_seqs, max_len), dtype=torch.float32, device=dev)
        sg, ss = (0, scores.stride(0)) if direct else (spart.stride(0), spart.stride(1))
        qi, qw, cs = q_idx, q_weight, ctx_sel
    cu = cu_seqlens_q.to(torch.int32)
    sl = seq_lens.to(torch.int32)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    extra = {}
    if num_warps is not None:
        extra["num_warps"] = num_warps
    if num_stages is not None:
        extra["num_stages"] = num_stages
    _fused_verify_kernel[(num_splits, num_seqs * num_kv_heads, m_tiles)](
        q, k_cache, v_cache, out, opart, lse, spart, cu, sl, block_table, qi, qw, cs,
        num_seqs, scores.shape[1] if scores is not None else 0, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        opart.stride(0) if split else 0, opart.stride(1) if split else 0, opart.stride(2) if split else 0,
        block_table.stride(0),
        sg, ss,
        float(scale),
        GROUP=group, HKV=num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
        EVEN_D=head_dim == block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, R=num_rows, SPLIT=split, DOT_PREC=prec, **extra,
    )
    if split:
        _combine_kernel[(num_tokens, num_q_heads)](
            opart, lse, out, cu, num_seqs, num_splits,
            opart.stride(0), opart.stride(1), opart.stride(2),
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        )
    if scores is not None and scores.shape[1] > 0:
        reduce_block = 1024
        _score_reduce_kernel[(num_seqs, triton.cdiv(scores.shape[1], reduce_block))](
            spart, scores, cu, ctx_sel, scores.shape[1], sg, ss, scores.stride(0),
            HKV=num_kv_heads, DIRECT=direct, BLOCK=reduce_block,
        )
    return out
