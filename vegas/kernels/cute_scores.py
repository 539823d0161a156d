"""Verification attention whose scores come from FlashAttention's CuTe-DSL forward (issue 22; opt-in).

vLLM 0.24 ships FlashAttention's CuTe-DSL attention (``vllm.vllm_flash_attn.cute``, JIT-compiled,
no build step). Its sm90 forward applies an optional ``score_mod(scores, batch, head, q_idx,
kv_idx, seqlen_info, aux_tensors)`` to every QK tile before the mask and the online softmax, with
the logical query row and head (PackGQA unpacked). :func:`score_writer` is such a ``score_mod``: it
returns the scores unchanged and stores ``scale * q . k`` of each request's first and last query
row — collect2's two scored rows — for the keys before the chunk, so the selection's logits come
out of the verification's own pass over the keys instead of a second one
(:mod:`vegas.kernels.triton_score`). :func:`reduce_edge_scores` then sums the rows the selector
scores and the query heads into the selector's ``(num_seqs, max_len)`` score row.

Two details of the writer:

- the output buffer is addressed through its device pointer, baked into the compiled kernel (a
  closure value, part of the CuTe compile key): through ``aux_tensors`` the kernel wraps ``q_idx``
  and ``kv_idx`` modulo the sequence lengths (``apply_score_mod_inner``), and the padded rows and
  keys of a tile would then write over real positions. The buffer must therefore outlive the
  kernel and keep its address (one persistent buffer per engine, :func:`workspace_shape`);
- with a ``score_mod`` the kernel multiplies by the softmax scale before it
  (``utils.compute_softmax_scale_log2``), so its attention output is not bitwise that of the
  kernel without one (nor FA3's): greedy output equals plain vLLM's up to bf16 near-ties.

Compiles for sm_90a on a machine without a GPU (``scripts/cute_compile_check.py``); timed by
``scripts/cute_decode_bench.py``. Nothing here runs unless ``VegasConfig.vllm.cute_scores`` is set.

Sources: the attention kernel is FlashAttention's CuTe-DSL forward (Dao-AILab/flash-attention,
``flash_attn/cute``; the copy vLLM 0.24.0 ships as ``vllm/vllm_flash_attn/cute``, NVIDIA
CUTLASS's CuTe DSL 4.5.2); the scored rows are Collect-2-Query's (the first and the last query of
the verified chunk, ``vegas.strategies.collect2``).
"""

from __future__ import annotations

import importlib

import torch

from .fa3_scores import attention_reason, sm90_reason

__all__ = [
    "SCORE_TILE",
    "cute_verify_attention",
    "edge_row_weights",
    "reduce_edge_scores",
    "score_writer",
    "unavailable_reason",
    "unsupported_reason",
    "workspace_shape",
]

#: the query tile of the verification call: 64 rows, one MMA warpgroup (what FA3 picks for decode;
#: the CuTe forward's own default is 128-192 rows, of which a decode request fills qlen x group)
SCORE_TILE = (64, 128)
#: longest query chunk (tokens per request) taken as decode-shaped verification
MAX_QUERY_LEN = 16

_checked: dict[str, str | None] = {}


def unavailable_reason() -> str | None:
    """Why the CuTe-DSL forward cannot run in this process, or None when it can (checked once)."""
    if "reason" in _checked:
        return _checked["reason"]
    reason = sm90_reason(exact=False)
    try:
        if reason is None:
            for module in ("cutlass.cute", "quack", "vllm.vllm_flash_attn.cute.interface"):
                importlib.import_module(module)
    except ImportError as e:
        reason = (f"the CuTe-DSL attention does not import ({type(e).__name__}: {str(e)[:160]}); it needs "
                  "nvidia-cutlass-dsl[cu13]==4.5.2 and quack-kernels (scripts/cute_dsl_bundle.sh)")
    _checked["reason"] = reason
    return reason


def unsupported_reason(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, max_query_len: int,
                       *, sliding_window=None, softcap: float | None = None, alibi_slopes=None, sinks=None,
                       kv_cache_dtype: str = "auto") -> str | None:
    """Why a verification call of this shape does not take the CuTe path, or None when it does:
    16-bit queries and cache, a head_dim that is a multiple of 8 up to 256, whole query groups per
    KV head, causal attention without window, soft-capping, ALiBi or sinks, and a decode-shaped
    batch (``1 <= max_query_len <= 16``)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype} (bf16 or fp16)"
    if head_dim % 8 or not 8 <= head_dim <= 256:
        return f"head_dim {head_dim} (a multiple of 8 up to 256)"
    reason = attention_reason(num_q_heads, num_kv_heads, sliding_window=sliding_window, softcap=softcap,
                              alibi_slopes=alibi_slopes, sinks=sinks, kv_cache_dtype=kv_cache_dtype)
    if reason is not None:
        return reason
    if not 1 <= max_query_len <= MAX_QUERY_LEN:
        return f"max_query_len {max_query_len} (decode-shaped verification: 1..{MAX_QUERY_LEN})"
    return None


def workspace_shape(max_seqs: int, num_q_heads: int, max_len: int) -> tuple[int, int, int, int]:
    """Shape of the writer's float32 buffer: ``(max_seqs, 2, num_q_heads, max_len)`` (slot 0: the
    first query row of each request's chunk, slot 1: the last)."""
    return (max_seqs, 2, num_q_heads, max_len)


def score_writer(out: torch.Tensor):
    """A CuTe-DSL ``score_mod`` that leaves the scores as they are and stores the scaled logits
    of each request's first and last query row, for keys ``kv < seqlen_k - seqlen_q`` (the keys
    before the chunk: the selectable prefix), into ``out`` (float32, contiguous,
    :func:`workspace_shape`; its address is compiled into the kernel). Raw indices past a
    sequence (a tile's padded rows and keys) fail the conditions and store nothing; a chunk of
    one query stores its row in both slots.

    Raises:
        ImportError: the CuTe DSL (``nvidia-cutlass-dsl``) is not installed.
        ValueError: ``out`` is not a contiguous 4-D float32 tensor.
    """
    import cutlass
    import cutlass.cute as cute

    if out.dtype != torch.float32 or not out.is_contiguous() or out.dim() != 4 or out.shape[1] != 2:
        raise ValueError(f"the score buffer must be contiguous float32 (seqs, 2, heads, len), got {out.dtype} "
                         f"{tuple(out.shape)}")
    addr, shape, stride = out.data_ptr(), tuple(out.shape), tuple(out.stride())

    @cute.jit
    def write_scores(tSrS_ssa, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        n = cutlass.const_expr(cute.size(tSrS_ssa.shape))
        ptr = cute.make_ptr(cutlass.Float32, addr, cute.AddressSpace.gmem, assumed_align=4)
        dst = cute.make_tensor(ptr, cute.make_layout(shape, stride=stride))
        s_f = cute.make_rmem_tensor(n, cutlass.Float32)
        b_f = cute.make_rmem_tensor(n, cutlass.Int32)
        h_f = cute.make_rmem_tensor(n, cutlass.Int32)
        q_f = cute.make_rmem_tensor(n, cutlass.Int32)
        k_f = cute.make_rmem_tensor(n, cutlass.Int32)
        s_f.store(tSrS_ssa)
        b_f.store(b_idx)
        h_f.store(h_idx)
        q_f.store(q_idx)
        k_f.store(kv_idx)
        ctx = seqlen_info.seqlen_k - seqlen_info.seqlen_q
        last = seqlen_info.seqlen_q - 1
        for j in cutlass.range(n, unroll_full=True):
            if k_f[j] < ctx:
                if q_f[j] == 0:
                    dst[b_f[j], 0, h_f[j], k_f[j]] = s_f[j]
                if q_f[j] == last:
                    dst[b_f[j], 1, h_f[j], k_f[j]] = s_f[j]
        return tSrS_ssa

    return write_scores


def edge_row_weights(rows_by_length: list[list[int]], device=None) -> torch.Tensor:
    """``(len(rows_by_length), 2)`` float32: for a chunk of ``c`` queries, the weights of the
    writer's two slots (first row, last row) that give the sum over the rows a selector scores,
    ``rows_by_length[c]`` (e.g. collect2 ``[0, c - 1]``, last_token ``[c - 1]``). A chunk of one
    query scores its row once although the writer stores it in both slots.

    Raises:
        ValueError: a selector scores a row other than the first or the last of its chunk.
    """
    weights = torch.zeros((len(rows_by_length), 2), dtype=torch.float32)
    for c, rows in enumerate(rows_by_length):
        if any(r not in (0, c - 1) for r in rows):
            raise ValueError(f"the CuTe score writer stores the first and last row of a chunk; a chunk of {c} "
                             f"scores rows {rows}")
        weights[c, 0] = float(0 in rows)
        weights[c, 1] = float(c - 1 in rows and c - 1 != 0)
    return weights.to(device) if device is not None else weights


def reduce_edge_scores(ws: torch.Tensor, weights: torch.Tensor, ctx_sel: torch.Tensor, out: torch.Tensor) -> None:
    """The selector's score row from the writer's buffer: ``out[s, p] = sum_slot weights[s, slot] *
    sum_h ws[s, slot, h, p]`` for ``p < ctx_sel[s]``, ``-inf`` from ``ctx_sel[s]`` on (as the
    separate score kernel writes it); one Triton pass over the buffer on the GPU
    (:func:`vegas.kernels.triton_score_reduce.reduce_edge_rows`), PyTorch elsewhere.

    Args:
        ws: ``(>= num_seqs, 2, num_q_heads, >= max_len)`` float32, the writer's buffer.
        weights: ``(num_seqs, 2)`` float32 slot weights of each request (:func:`edge_row_weights`
            indexed by its chunk length).
        ctx_sel: ``(num_seqs,)`` int64 selectable positions.
        out: ``(num_seqs, max_len)`` float32, written in place.
    """
    from .triton_score_reduce import reduce_edge_rows

    reduce_edge_rows(ws, weights.contiguous(), ctx_sel, out)


def cute_verify_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                          scale: float, *, out: torch.Tensor, writer, num_splits: int = 0) -> torch.Tensor:
    """vLLM's verification call through the CuTe-DSL forward with the score writer.

    Causal, paged, varlen attention with the 64-row query tile (:data:`SCORE_TILE`), as vLLM's
    ``flash_attn_varlen_func(..., fa_version=4)`` calls it, plus the ``score_mod``.

    Args:
        q: ``(num_tokens, num_q_heads, head_dim)`` bf16/fp16 queries of the actual tokens.
        k_cache, v_cache: ``(num_blocks, block_size, num_kv_heads, head_dim)``, ``kv_cache.unbind(1)``.
        block_table: ``(num_seqs, max_blocks)`` int32.
        cu_seqlens_q: ``(num_seqs + 1,)`` int32 cumulative query lengths; seq_lens: ``(num_seqs,)``
            int32 keys per request (the chunk included).
        max_seqlen_q, max_seqlen_k: host bounds of the query and key lengths (tokens).
        scale: the softmax scale.
        out: ``(num_tokens, num_q_heads, head_dim)``, written and returned.
        writer: :func:`score_writer` of the buffer the scores go to.
        num_splits: split-KV count; 0 lets the kernel choose.

    Raises:
        ImportError: vLLM's CuTe-DSL attention or the CuTe DSL is not installed
            (:func:`unavailable_reason` says so beforehand).
    """
    from vllm.vllm_flash_attn.cute.interface import _flash_attn_fwd

    _flash_attn_fwd(q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, seqused_k=seq_lens, max_seqlen_q=max_seqlen_q,
                    max_seqlen_k=max_seqlen_k, page_table=block_table, softmax_scale=scale, causal=True,
                    num_splits=num_splits, out=out, tile_mn=SCORE_TILE, score_mod=writer)
    return out
