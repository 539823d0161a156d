"""Probe queries: the collect queries of each verified chunk summed into extra query rows, so that
the verification attention's own QK product computes the selection scores (issue 22).

A score-based selector's score of key ``p`` for request ``b`` and KV head ``h`` is linear in the
queries (Collect-2-Query, ``vegas.strategies.collect2``; the chunk's first and last query)::

    score[b, h, p] = scale * sum over scored rows r and the G query heads of h of  q[r, head] . k[p]
                   = (scale * sum of those q[r, head]) . k[p]  =  probe[b, h] . k[p]

so one extra query row per KV head (the *probe*) carries the whole sum, and a kernel that already
multiplies every query row of the chunk by every key only has to store that row's logits before
its softmax (:mod:`vegas.kernels.cute_probe`). :func:`pack_probe_queries` builds the
query tensor with the probes: per request ``P`` = :func:`probe_tokens` probe tokens first, then
its chunk unchanged. Rows are PackGQA's (``row = token * G + head_in_group``, one query tile per
KV head): the probe sum, in float32, is split into ``hi = bf16(probe)`` on row 0 and
``lo = bf16(probe - hi)`` on row 8, both held by the same four lanes of the SM90 accumulator
(rows ``l // 4`` and ``l // 4 + 8`` of warp 0), which add them: the score keeps ~16 bits of the
probe's mantissa instead of bf16's 8 (the separate score kernel sums float32 products of the bf16
queries: the two agree to ~2e-6 relative, measured). Every
other probe row is zero. The chunk keeps its causal alignment: its token ``i`` is at index
``P + i`` of ``P + c`` queries, so it still sees keys ``< seqlen_k - c + i + 1``.

Shapes: ``q`` ``(num_tokens, num_q_heads, head_dim)`` bf16/fp16; the result ``(num_tokens + P *
num_seqs, num_q_heads, head_dim)``, its ``cu_seqlens_q`` and the row of each original token in it.
On CUDA one Triton launch per call (grid: requests x KV heads); elsewhere the same in PyTorch
(CPU tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["PROBE_ROWS", "pack_probe_queries", "probe_tokens"]

#: the packed rows of a KV head's query tile holding the probe's hi and lo parts
PROBE_ROWS = (0, 8)


def probe_tokens(group: int) -> int:
    """Probe tokens per request so that rows 0 and 8 (:data:`PROBE_ROWS`) are probe rows at
    ``group`` query heads per KV head: ``ceil(9 / group)`` (1 from 9 heads per KV head on)."""
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    return -(-(PROBE_ROWS[1] + 1) // group)


# the batch sizes vary from step to step: specializing on them would compile again inside a CUDA-graph capture
@triton.jit(do_not_specialize=["num_seqs", "num_tokens"])
def _pack_kernel(
    q_ptr, out_ptr, cu_ptr, cu_out_ptr, rows_ptr,
    scale,
    num_seqs,
    num_tokens,
    stride_qt, stride_qh, stride_ot, stride_oh,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PROBES: tl.constexpr, EDGES: tl.constexpr,
    HI_ROW: tl.constexpr, LO_ROW: tl.constexpr,
):
    s = tl.program_id(0)
    kv = tl.program_id(1)
    # never past q: the chunks are clamped to its rows (vLLM gives cu_seqlens_q[-1] <= num_tokens)
    start = tl.minimum(tl.load(cu_ptr + s), num_tokens)
    end = tl.minimum(tl.load(cu_ptr + s + 1), num_tokens)
    n = tl.maximum(end - start, 0)
    dst = start + PROBES * s  # the request's first probe token in the packed tensor
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    heads = kv * G + g
    m = (g < G)[:, None]
    src_offs = heads[:, None] * stride_qh + d[None, :]
    dst_offs = heads[:, None] * stride_oh + d[None, :]
    for t in range(0, n):  # the chunk, after the probes
        row = tl.load(q_ptr + (start + t).to(tl.int64) * stride_qt + src_offs, mask=m)
        tl.store(out_ptr + (dst + PROBES + t).to(tl.int64) * stride_ot + dst_offs, row, mask=m)
        if kv == 0:
            tl.store(rows_ptr + start + t, dst + PROBES + t)
    # an empty chunk (a padded request) reads row 0 and gets a zero probe
    first_row = tl.where(n > 0, start, 0).to(tl.int64)
    first = tl.load(q_ptr + first_row * stride_qt + src_offs, mask=m, other=0.0).to(tl.float32)
    probe = tl.sum(first, axis=0)
    if EDGES:  # the last query too (a one-query chunk counts its row twice)
        last_row = tl.where(n > 0, end - 1, 0).to(tl.int64)
        last = tl.load(q_ptr + last_row * stride_qt + src_offs, mask=m, other=0.0).to(tl.float32)
        probe += tl.sum(last, axis=0)
    probe = probe * tl.where(n > 0, scale, 0.0)
    hi = probe.to(out_ptr.dtype.element_ty)
    lo = (probe - hi.to(tl.float32)).to(out_ptr.dtype.element_ty)
    for p in tl.static_range(PROBES):
        r = (p * G + g)[:, None]
        val = tl.where(r == HI_ROW, hi[None, :], tl.where(r == LO_ROW, lo[None, :], tl.zeros_like(hi)[None, :]))
        tl.store(out_ptr + (dst + p).to(tl.int64) * stride_ot + dst_offs, val, mask=m)
    if kv == 0:
        tl.store(cu_out_ptr + s, dst)
        if s == num_seqs - 1:
            total = tl.minimum(tl.load(cu_ptr + num_seqs), num_tokens)
            tl.store(cu_out_ptr + num_seqs, total + PROBES * num_seqs)
            # tokens past the last chunk (a captured batch's padding) gather rows past the last
            # request: never read by the attention, but valid rows of the packed tensor
            for t in range(total, num_tokens):
                tl.store(rows_ptr + t, t + PROBES * num_seqs)


def pack_probe_queries(q: torch.Tensor, cu_seqlens_q: torch.Tensor, num_kv_heads: int, scale: float, edges: bool,
                       *, use_triton: bool | None = None):
    """The queries with each request's probe tokens in front of its chunk (module docstring).

    Args:
        q: ``(num_tokens, num_q_heads, head_dim)`` bf16/fp16, last dim contiguous; ``num_tokens``
            = ``cu_seqlens_q[-1]``.
        cu_seqlens_q: ``(num_seqs + 1,)`` int32 cumulative chunk lengths (an empty chunk gets
            zero probes and scores nothing).
        num_kv_heads: KV heads (``num_q_heads`` a multiple of it; ``G`` = the quotient).
        scale: the softmax scale folded into the probe (the stored logits are ``scale * q . k``).
        edges: the first and the last query of each chunk (collect2); False: the first alone
            (last_token).
        use_triton: the Triton kernel (default: on CUDA tensors; True also runs it under Triton's
            interpreter on the CPU), else PyTorch.

    Returns:
        ``(packed, cu_seqlens_packed, rows)``: the packed queries, ``(num_seqs + 1,)`` int32
        cumulative lengths ``cu_seqlens_q + P * arange``, and ``(num_tokens,)`` int32 the packed
        row of each original token (to gather the attention output back).

    Raises:
        ValueError: heads not a multiple of ``num_kv_heads``, or a strided last dim of ``q``.
    """
    tokens, hq, d = q.shape
    if num_kv_heads < 1 or hq % num_kv_heads:
        raise ValueError(f"num_q_heads {hq} is not a multiple of num_kv_heads {num_kv_heads}")
    if q.stride(-1) != 1:
        raise ValueError(f"q: the last dim must be contiguous, got strides {q.stride()}")
    group = hq // num_kv_heads
    probes = probe_tokens(group)
    seqs = cu_seqlens_q.shape[0] - 1
    out = torch.empty((tokens + probes * seqs, hq, d), dtype=q.dtype, device=q.device)
    cu_out = torch.empty_like(cu_seqlens_q)
    rows = torch.empty(tokens, dtype=torch.int32, device=q.device)
    if seqs == 0 or tokens == 0:  # nothing to pack (no host sync: a capture may call this)
        out.zero_()
        torch.mul(torch.arange(seqs + 1, device=q.device, dtype=cu_out.dtype), probes, out=cu_out)
        return out, cu_out, rows
    if _is_fake(q):  # shapes only (the compile check under FakeTensorMode)
        return out, cu_out, rows
    if q.is_cuda if use_triton is None else use_triton:
        _pack_kernel[(seqs, num_kv_heads)](
            q, out, cu_seqlens_q, cu_out, rows, float(scale), seqs, tokens, q.stride(0), q.stride(1), out.stride(0),
            out.stride(1), G=group, G_PAD=triton.next_power_of_2(group), D=d, PROBES=probes, EDGES=edges,
            HI_ROW=PROBE_ROWS[0], LO_ROW=PROBE_ROWS[1],
        )
        return out, cu_out, rows
    return _pack_torch(q, cu_seqlens_q, num_kv_heads, scale, edges, out, cu_out, rows, probes)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _pack_torch(q, cu, num_kv_heads, scale, edges, out, cu_out, rows, probes):
    """:func:`pack_probe_queries` in PyTorch (the same rounding: float32 sum, then hi/lo)."""
    seqs, (tokens, hq, d) = cu.shape[0] - 1, q.shape
    group = hq // num_kv_heads
    out.zero_()
    for s in range(seqs):
        start, end = min(int(cu[s]), tokens), min(int(cu[s + 1]), tokens)
        end = max(end, start)
        dst = start + probes * s
        cu_out[s] = dst
        out[dst + probes : dst + probes + end - start] = q[start:end]
        rows[start:end] = torch.arange(dst + probes, dst + probes + end - start, dtype=torch.int32)
        if end == start:
            continue
        probe = q[start].float() + (q[end - 1].float() if edges else 0)
        probe = probe.view(num_kv_heads, group, d).sum(1) * scale  # [kv, d]
        hi = probe.to(q.dtype)
        lo = (probe - hi.float()).to(q.dtype)
        for kv in range(num_kv_heads):
            for part, row in ((hi, PROBE_ROWS[0]), (lo, PROBE_ROWS[1])):
                out[dst + row // group, kv * group + row % group] = part[kv]
    total = min(int(cu[seqs]), tokens)
    cu_out[seqs] = total + probes * seqs
    rows[total:] = torch.arange(total, tokens, dtype=torch.int32) + probes * seqs
    return out, cu_out, rows
