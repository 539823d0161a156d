"""Pure-PyTorch reference of fused verification attention with score collection (issue 14).

The specification of :func:`vegas.kernels.triton_fused_verify.fused_verify_attention`: causal,
paged, varlen, GQA attention of a verification batch (each request's chunk of ``qlen`` queries
sits at positions ``[seq_len - qlen, seq_len)`` and sees every earlier key plus itself), and in
the same computation the selector's scores: for each request ``s``,
``scores[s, p] = sum_r q_weight[s, r] * sum_h scale * q[q_idx[s, r], h] . k[s, p, kv(h)]`` for
``p < ctx_sel[s]``, ``-inf`` for ``ctx_sel[s] <= p < max_len`` (0 before ``ctx_sel`` for a request with an empty
chunk, which has no scored row): for every other request exactly what
:func:`vegas.kernels.collect_scores_layers_reference` returns for the gathered, weighted rows,
and what :func:`vegas.kernels.select_topk_layers` consumes.

Layout (vLLM FlashAttention, NHD): ``k_cache[block, offset, kv_head, :]`` (and ``v_cache``) hold
position ``p`` of request ``s`` at ``block = block_table[s, p // block_size]``,
``offset = p % block_size``.
"""

from __future__ import annotations

import torch

from .reference import check_head_shape

__all__ = ["fused_verify_reference", "gather_paged"]


def gather_paged(cache: torch.Tensor, block_table_row: torch.Tensor, n: int) -> torch.Tensor:
    """Positions ``[0, n)`` of one request from a paged cache: ``(n, kv_heads, head_dim)``."""
    block_size = cache.shape[1]
    pos = torch.arange(n, device=cache.device)
    return cache[block_table_row[pos // block_size].long(), pos % block_size]


def fused_verify_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    q_idx: torch.Tensor | None = None,
    q_weight: torch.Tensor | None = None,
    ctx_sel: torch.Tensor | None = None,
    max_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention output and (optionally) the selector's scores, in float64, one request at a time.

    Args:
        q: ``(num_tokens, num_q_heads, head_dim)`` queries of the batch (tokens beyond
            ``cu_seqlens_q[-1]`` are padding: their output is 0).
        k_cache, v_cache: ``(num_blocks, block_size, num_kv_heads, head_dim)`` paged caches
            (``kv_cache.unbind(1)`` of vLLM's ``[num_blocks, 2, block_size, H, D]``).
        block_table: ``(num_seqs, max_blocks)`` int32.
        cu_seqlens_q: ``(num_seqs + 1,)`` cumulative query lengths.
        seq_lens: ``(num_seqs,)`` keys per request, this chunk included.
        scale: softmax scale.
        q_idx, q_weight: ``(num_seqs, R)`` token indices (into ``q``) of the scored rows and
            their weights (0 masks a repeat), as :func:`vegas.vllm_plugin.selection.state.make_plan` gives.
        ctx_sel: ``(num_seqs,)`` scored positions ``[0, ctx_sel)`` per request.
        max_len: score width (>= ``ctx_sel.max()``).

    Returns:
        ``(out, scores)``: ``out`` ``(num_tokens, num_q_heads, head_dim)`` float64;
        ``scores`` ``(num_seqs, max_len)`` float64 or None without ``q_idx``.

    Raises:
        VegasConfigError: see :func:`vegas.kernels.check_head_shape`.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    check_head_shape(num_q_heads, num_kv_heads, head_dim, k_cache.shape[3])
    group = num_q_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    qd = q.double()
    for s in range(num_seqs):
        start, end, n = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1]), int(seq_lens[s])
        if end == start:
            continue
        keys = gather_paged(k_cache, block_table[s], n).double().repeat_interleave(group, dim=1)  # [n, H, D]
        vals = gather_paged(v_cache, block_table[s], n).double().repeat_interleave(group, dim=1)
        logits = torch.einsum("thd,nhd->htn", qd[start:end], keys) * scale  # [H, qlen, n]
        qpos = n - (end - start) + torch.arange(end - start, device=q.device)
        causal = torch.arange(n, device=q.device)[None, :] <= qpos[:, None]
        w = torch.softmax(logits.masked_fill(~causal[None], float("-inf")), dim=-1)
        out[start:end] = torch.einsum("htn,nhd->thd", w, vals)
    if q_idx is None:
        return out, None
    assert q_weight is not None and ctx_sel is not None and max_len is not None
    scores = torch.full((num_seqs, max_len), float("-inf"), dtype=torch.float64, device=q.device)
    for s in range(num_seqs):
        n = int(ctx_sel[s])
        if n == 0:
            continue
        if int(cu_seqlens_q[s + 1]) == int(cu_seqlens_q[s]):  # an empty chunk has no scored row
            scores[s, :n] = 0.0
            continue
        keys = gather_paged(k_cache, block_table[s], n).double()  # [n, kv_heads, D]
        rows = qd[q_idx[s].long()] * q_weight[s].double()[:, None, None]  # [R, H, D]
        folded = rows.view(-1, num_kv_heads, group, head_dim).sum(dim=(0, 2))  # [kv_heads, D]
        scores[s, :n] = torch.einsum("gd,ngd->n", folded, keys) * scale
    return out, scores
