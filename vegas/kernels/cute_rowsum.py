"""Verification scores summed in registers inside vLLM's CuTe-DSL sm90 attention (issue 22; opt-in).

Today a score-based selector on vLLM runs FA3 per layer and then a second pass over every prefix
key (:mod:`vegas.kernels.triton_score`), 1.24-1.45x FA3 per step. :func:`rowsum_attention` runs
the verification through FlashAttention's CuTe-DSL forward (``vllm/vllm_flash_attn/cute/flash_fwd_sm90.py``
in vLLM 0.24, JIT-compiled, no build step) with the 64-row query tile and takes, per model layer,
only what the selection needs from its QK tiles:

    out[b, kv_head, p] += sum over the G query heads of kv_head and the scored rows of request b's
    chunk of  scale * q . k[p],   for every key p < seqlen_k - seqlen_q (the keys before the chunk)

(float32 ``(batch, kv_heads, L)``, zeroed by the caller). The scored rows are Collect-2-Query's:
the chunk's first and last query (:data:`EDGES`, collect2; a chunk of one query counts its row
twice, so its score row is exactly twice the separate kernel's and its top-k the same) or the
first alone (:data:`FIRST`, last_token); :func:`row_mode` maps a selector's ``score_rows`` to one.

How it reaches the QK tile: :class:`RowsumSm90` (built by :func:`kernel_class`) subclasses vLLM's
``FlashAttentionForwardSm90`` and overrides only ``mma`` (a thin wrapper around the base method).
The wrapper hands the base mainloop an ``AttentionMaskCls`` whose masks run :func:`rowsum_tile` on
``acc_S`` (= ``tSrS``, the fp32 QK accumulator, unscaled) right before the original ``apply_mask``
— the mainloop calls the mask on every K block (first, causal and unmasked ones), after the QK
WGMMA has been waited for and before the online softmax. The tile is only read, no ``score_mod``
is set: the softmax, its folded scale and the attention output are those of the plain kernel
(``cute/m64``), bit for bit. The wrapper also hands the mainloop a ``BlockInfo`` that remembers each
work tile's ``n_block_min``: an empty split (the split heuristic makes them) still runs its first
block, which belongs to the previous split; that block is skipped. The output buffer travels as
the kernel's ``aux_tensors[0]`` (a runtime argument: no address baked in); no ``score_mod`` /
``mask_mod`` reads it.

The reduction (:func:`rowsum_tile`, per thread, per K block of ``tile_n`` keys):

1. The thread's fragment in (row, col) form (``reshape_acc_to_mn`` of ``acc_S`` and of the identity
   tensor partitioned like it, as ``mask.py`` does): for the SM90 WGMMA accumulator of a 64 x N
   atom, lane l of warp w holds rows 16w + l//4 + 8r (r = 0, 1) and columns 8k + 2(l%4) + j
   (k < N/8, j = 0, 1), i.e. ``nrow = 2`` rows and ``ncol = N/4`` columns (N = 128: 64 elements).
   The row weight w_r = [token == 0] + [token == seqlen_q - 1] (:data:`FIRST`: the first term
   alone), token = packed row // G (PackGQA packs row = token * G + head_in_group); rows of other
   tokens (and rows past the chunk, whose Q may be garbage) are excluded by a select, not a
   multiply. The column layout is checked at trace time against the static partitions of all
   threads.
2. Warps with no scored row (vote) skip everything: at qlen 5 only warp 0 (G = 3) or warps 0-1
   (G = 4) of the 64-row tile do work.
3. v[c] = sum_r w_r * S[r, c]: ``ncol`` partial column sums per thread.
4. Reduce-scatter across the 8 lanes that hold the same columns (lane bits 2, 3, 4 index rows):
   three butterfly steps (``shfl.bfly`` 16, 8, 4), each sending the half of the values the partner
   keeps: 16 + 8 + 4 = 28 shuffles (N = 128), after which lane l owns the full warp sums of 2
   column pairs: columns 8k + 2(l%4) + {0, 1} for k = 2 b2 + 4 b3 + 8 b4 + {0, 1} (b = lane bits).
5. Each lane multiplies by the softmax scale and adds its pairs with ``red.global.add.v2.f32``
   (keys < seqlen_k - seqlen_q only): one add per (warp, column), 64 vector reds per active warp and
   K block; warps of a warpgroup (G = 4: warp 0 has the first token, warp 1 the last) add to the
   same ``out`` row through these atomics; splits own disjoint key blocks.

Determinism: the atomics make the order of a column's addends depend on warp timing. With at most
two addends onto zero the float sum is the same either way (0 + a + b = 0 + b + a); with three or
more it is not. :func:`scored_warps` counts the warps of the 64-row tile that hold scored rows for
a chunk length and group size, and :func:`unsupported_reason` refuses a call where that can
exceed :data:`MAX_ADDENDS` (= 2) for any chunk up to its ``max_query_len`` (e.g. G = 7 at qlen 5:
rows 0-6 and 28-34 span warps 0, 1 and 2), so seeded requests stay reproducible.

Compilation: the kernel JIT-compiles on first use (~12 s on an H200). The compile key is vLLM's
(dtype, head_dim, G, split or not, paged layout, ...), not the query length or the split count;
the split-KV combine kernel has its own key, which includes ``log2`` of the split count (buckets
16, 32, 64, 128). :func:`warm_up` compiles every variant an engine can call, outside CUDA-graph
capture, and :func:`is_warm` says whether it did.

Measured on an H200 (``benchmarks/results/cute_rowsum_h200_2026-12-02``, per model step, all
layers, qlen 5; x FA3): Qwen3-8B shape (36 L, 32 q / 8 kv x 128), batch 4, 32K context: plain
cute/m64 1.019x, with the rowsum 1.108x, FA3 + the separate pass 1.428x; 128K: 1.056x / 1.233x /
1.453x. SmolLM2 shape (30 L, 9 q / 3 kv x 64), 7,680 context: batch 32 1.219x vs 1.223x (a tie),
batch 128 1.403x vs 1.248x (slower). Scores within 1e-7 relative of a torch reference, output
bitwise equal to cute/m64, correct with an empty split.

Nothing here imports vLLM or the CuTe DSL at module import: :func:`unavailable_reason` says why
they cannot run. Needs ``nvidia-cutlass-dsl[cu13]==4.5.2`` and ``quack-kernels``
(``scripts/cute_dsl_bundle.sh``) and an sm90 GPU; ``scripts/cute_rowsum.py --compile-only``
compiles it for sm_90a on a machine without one.

Sources: FlashAttention's CuTe-DSL forward (Dao-AILab/flash-attention ``flash_attn/cute``, the copy
vLLM 0.24.0 ships as ``vllm/vllm_flash_attn/cute``; NVIDIA CUTLASS's CuTe DSL 4.5.2); the scored
rows are Collect-2-Query's (the first and the last query of the verified chunk,
``vegas.strategies.collect2``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import math

import torch

from .fa3_scores import attention_reason, sm90_reason
from .probe_queries import pack_probe_queries, probe_tokens

__all__ = [
    "EDGES",
    "FIRST",
    "HEAD_DIMS",
    "MAX_ADDENDS",
    "PROBE",
    "SCORE_TILE",
    "WARM_SPLITS",
    "empty_split_count",
    "is_warm",
    "kernel_class",
    "padded_len",
    "probe_attention",
    "reference_rowsum",
    "row_mode",
    "row_weights",
    "rowsum_attention",
    "scored_warps",
    "unavailable_reason",
    "unsupported_reason",
    "warm_up",
]

#: row modes: the chunk's first and last query (collect2), or the first alone (last_token)
EDGES, FIRST = "edges", "first"
#: the probe kernel: the scores are the probe rows of the tile (:mod:`vegas.kernels.probe_queries`), stored as they are
PROBE = "probe"
#: the query tile (one MMA warpgroup of 4 warps x 16 rows: what FA3 picks for decode) and the key tile
SCORE_TILE = (64, 128)
#: accumulator rows per warp of the 64-row tile
WARP_ROWS = 16
#: head dims compiled and measured (the trace-time layout check holds for both)
HEAD_DIMS = (64, 128)
#: most warps whose atomics may add to one score (order-independent float sum onto zero)
MAX_ADDENDS = 2
#: split counts :func:`warm_up` compiles: unsplit, then one per bucket of the combine kernel's key
WARM_SPLITS = (1, 16, 32, 64, 128)
#: trace-time results of the accumulator layout check, one line per compiled kernel
LAYOUT_CHECK: list = []
#: lane bits that index rows in the SM90 accumulator layout, from high to low (the reduce-scatter order)
ROW_LANE_BITS = (16, 8, 4)

_checked: dict[str, str | None] = {}
#: (dtype, num_q_heads, num_kv_heads, head_dim, block_size, mode) compiled by :func:`warm_up`
_WARM: set = set()


def padded_len(max_len: int) -> int:
    """Row length of the ``out`` buffer (tokens): ``max_len`` rounded up to a multiple of 4 so that
    every row starts 16-byte aligned (the kernel adds column pairs with 8-byte vector reds)."""
    return -(-max_len // 4) * 4


def empty_split_count(n_blocks: int) -> int | None:
    """The smallest split count for which the kernel's last split gets no key block of
    ``n_blocks`` (the case the rowsum must skip: such a split still runs its first block, the
    previous split's last), or None."""
    for s in range(2, n_blocks + 1):
        if -(-n_blocks // s) * (s - 1) >= n_blocks:
            return s
    return None


def row_mode(rows_by_length: list[list[int]]) -> str:
    """The kernel's row mode for a selector's scored rows.

    Args:
        rows_by_length: ``rows_by_length[c]`` = the selector's ``score_rows(c)`` (sorted offsets
            into a chunk of ``c`` queries) for ``c`` in ``0 .. γ + 1``
            (:func:`vegas.vllm_plugin.selectors.plan.score_rows_by_length`).

    Returns:
        :data:`FIRST` when every chunk scores its first row alone (last_token), :data:`EDGES`
        when every chunk scores its first and last row (collect2).

    Raises:
        ValueError: any other rows (e.g. aggregated's every row), naming them.
    """
    chunks = list(enumerate(rows_by_length))[1:]
    if chunks and all(rows == [0] for _, rows in chunks):
        return FIRST
    if chunks and all(set(rows) == {0, c - 1} for c, rows in chunks):
        return EDGES
    listed = ", ".join(f"{c}: {rows}" for c, rows in chunks)
    raise ValueError(f"the CuTe rowsum scores a chunk's first row, or its first and last; the selector "
                     f"scores (chunk length: rows) {listed}")


def row_weights(mode: str, chunk_len: int) -> dict[int, float]:
    """The weight the kernel gives each row of a chunk of ``chunk_len`` queries in ``mode``
    (rows not listed count 0): :data:`EDGES` ``{0: 1, c - 1: 1}`` and ``{0: 2}`` for one query,
    :data:`FIRST` ``{0: 1}``."""
    weights = {0: 1.0}
    if mode == EDGES:
        weights[chunk_len - 1] = weights.get(chunk_len - 1, 0.0) + 1.0
    return weights


def scored_warps(chunk_len: int, group: int, mode: str) -> int:
    """Warps of the 64-row tile holding a scored row of a chunk of ``chunk_len`` queries with
    ``group`` query heads per KV head (PackGQA row = token * group + head), i.e. the atomics that
    add to each score."""
    rows = (t * group + h for t in row_weights(mode, chunk_len) for h in range(group))
    return len({r // WARP_ROWS for r in rows})


def unsupported_reason(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, max_query_len: int,
                       *, mode: str = EDGES, max_chunk: int | None = None, block_size: int = 16,
                       sliding_window=None, softcap: float | None = None, alibi_slopes=None, sinks=None,
                       kv_cache_dtype: str = "auto", probe: bool = True) -> str | None:
    """Why a verification call of this shape does not take the CuTe score path, or None when it does.

    Covered: bf16/fp16, head_dim in :data:`HEAD_DIMS`, whole query groups per KV head, causal
    attention without window, soft-capping, ALiBi, sinks or quantized cache, a paged cache read
    without TMA (``block_size`` other than the key tile, 128), a decode-shaped batch whose rows
    fit one query tile: ``1 <= max_query_len <= max_chunk`` and ``(P + max_query_len) * G <= 64``
    with ``P`` = :func:`~vegas.kernels.probe_queries.probe_tokens` probe tokens
    (:func:`probe_attention`); for :func:`rowsum_attention` (``probe=False``) ``max_query_len * G
    <= 64`` and at most :data:`MAX_ADDENDS` warps adding to a score for every chunk length up to
    ``max_query_len`` (:func:`scored_warps`; deterministic sums).

    Args:
        max_chunk: longest chunk whose scored rows are the chunk's own first/last (γ + 1: the
            selector scores the last γ + 1 queries of a longer chunk); None: no bound.
        probe: the probe kernel (the engine's), else the rowsum's limits.
    """
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype} (bf16 or fp16)"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (compiled: {HEAD_DIMS})"
    reason = attention_reason(num_q_heads, num_kv_heads, sliding_window=sliding_window, softcap=softcap,
                              alibi_slopes=alibi_slopes, sinks=sinks, kv_cache_dtype=kv_cache_dtype)
    if reason is not None:
        return reason
    if block_size == SCORE_TILE[1]:
        return f"block_size {block_size} (the kernel's TMA paged path, not compiled for the CuTe score path)"
    group = num_q_heads // num_kv_heads
    probes = probe_tokens(group) if probe else 0
    fits = SCORE_TILE[0] // group - probes
    longest = fits if max_chunk is None else min(max_chunk, fits)
    if not 1 <= max_query_len <= longest:
        extra = f" after {probes} probe tokens" if probe else ""
        return (f"max_query_len {max_query_len} (decode-shaped verification: 1..{max(longest, 0)} at group "
                f"{group}{extra}, one {SCORE_TILE[0]}-row query tile)")
    if probe:
        return None
    warps = max(scored_warps(c, group, mode) for c in range(1, max_query_len + 1))
    if warps > MAX_ADDENDS:
        return (f"{warps} warps would add to each score at group {group}, up to {max_query_len} queries "
                f"(at most {MAX_ADDENDS} keep the atomic sums deterministic)")
    return None


def unavailable_reason() -> str | None:
    """Why the rowsum kernel cannot run in this process, or None when it can (checked once): an
    sm90 GPU, the CuTe DSL, quack and vLLM's CuTe attention import, and :class:`RowsumSm90` builds
    against them."""
    if "reason" in _checked:
        return _checked["reason"]
    reason = sm90_reason(exact=False)
    if reason is None:
        try:
            for module in ("cutlass.cute", "quack", "vllm.vllm_flash_attn.cute.interface"):
                importlib.import_module(module)
            kernel_class(EDGES)
        except Exception as e:  # an import or an API the subclass expects: say which, take today's path
            reason = (f"the CuTe-DSL rowsum does not load ({type(e).__name__}: {str(e)[:160]}); it needs "
                      "nvidia-cutlass-dsl[cu13]==4.5.2 and quack-kernels (scripts/cute_dsl_bundle.sh) with vLLM 0.24")
    _checked["reason"] = reason
    return reason


@functools.cache
def kernel_class(mode: str = EDGES):
    """:class:`RowsumSm90` for ``mode`` (:data:`EDGES` or :data:`FIRST`), built on first use: imports
    vLLM's CuTe package and the CuTe DSL (ImportError without them)."""
    if mode not in (EDGES, FIRST, PROBE):
        raise ValueError(f"row mode {mode!r} (one of {EDGES!r}, {FIRST!r}, {PROBE!r})")
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64, const_expr
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import dsl_user_op
    from quack import layout_utils
    from vllm.vllm_flash_attn.cute import utils as fa_utils
    from vllm.vllm_flash_attn.cute.block_info import BlockInfo
    from vllm.vllm_flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90

    @dsl_user_op
    def red_add_f32x2(a, b, gmem_ptr, *, loc=None, ip=None):
        """``red.global.add.v2.f32``: two adjacent float atomic adds, no return (sm_90)."""
        llvm.inline_asm(
            None,
            [gmem_ptr.toint(loc=loc, ip=ip).ir_value(), Float32(a).ir_value(loc=loc, ip=ip),
             Float32(b).ir_value(loc=loc, ip=ip)],
            "red.global.add.v2.f32 [$0], {$1, $2};",
            "l,f,f",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )

    @dsl_user_op
    def st_f32x2(a, b, addr, *, loc=None, ip=None):
        """``st.global.v2.f32``: two adjacent floats at the 64-bit address ``addr``, one 8-byte store."""
        llvm.inline_asm(
            None,
            [Int64(addr).ir_value(loc=loc, ip=ip), Float32(a).ir_value(loc=loc, ip=ip),
             Float32(b).ir_value(loc=loc, ip=ip)],
            "st.global.v2.f32 [$0], {$1, $2};",
            "l,f,f",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )

    def check_layout(tiled_mma, tile_m, tile_n):
        """At trace time: every thread's accumulator columns are 8k + 2(l%4) + j (element c = 2k + j of
        the mn view), which the reduce-scatter and the final addressing assume. Raises otherwise."""
        cS = cute.make_identity_tensor((tile_m, tile_n))
        ncol = None
        for t in range(128):  # one warpgroup; other warpgroups repeat it with other rows
            tScS = layout_utils.reshape_acc_to_mn(tiled_mma.get_slice(t).partition_C(cS))
            n = cute.size(tScS.shape[1])
            ncol = n if ncol is None else ncol
            for c in range(n):
                col = tScS[0, c][1]
                if not isinstance(col, int):
                    LAYOUT_CHECK.append(f"not checked (column of thread {t} is {type(col).__name__})")
                    return  # coordinates not static here: no check (the bench's reference check still runs)
                if n != ncol or col != 8 * (c // 2) + c % 2 + 2 * (t % 4):
                    raise NotImplementedError(
                        f"rowsum: unexpected accumulator layout (thread {t}, element {c}: column {col})")
        if ncol * 4 != tile_n or tile_n % 64:
            raise NotImplementedError(f"rowsum: needs tile_n a multiple of 64 with 4 columns per 8, got {tile_n}")
        for t in range(128):  # rows 16 w + l // 4 + 8 r: rows 0 and 8 (the probe's) are lanes 0-3 of warp 0
            tScS = layout_utils.reshape_acc_to_mn(tiled_mma.get_slice(t).partition_C(cS))
            rows = [tScS[r, 0][0] for r in range(cute.size(tScS.shape[0]))]
            if rows != [16 * (t // 32) + (t % 32) // 4 + 8 * r for r in range(2)]:
                raise NotImplementedError(f"rowsum: unexpected accumulator rows (thread {t}: rows {rows})")
        LAYOUT_CHECK.append(f"checked: 128 threads x 2 rows x {ncol} columns")

    @cute.jit
    def rowsum_tile(acc_S: cute.Tensor, thr_mma, out: cute.Tensor, batch_idx: Int32, head_idx: Int32,
                    m_block: Int32, n_block: Int32, n_block_min: Int32, seqlen_q: Int32, seqlen_k: Int32,
                    scale: Float32, tile_m: cutlass.Constexpr[int], tile_n: cutlass.Constexpr[int],
                    group: cutlass.Constexpr[int], edges: cutlass.Constexpr[bool]):
        acc = layout_utils.reshape_acc_to_mn(acc_S)
        cS = cute.make_identity_tensor((tile_m, tile_n))
        tScS = layout_utils.reshape_acc_to_mn(thr_mma.partition_C(cS))
        nrow = const_expr(cute.size(tScS.shape[0]))
        ncol = const_expr(cute.size(tScS.shape[1]))
        npair = const_expr(ncol // 2)
        last = seqlen_q - 1
        w = cute.make_rmem_tensor(nrow, Float32)
        wsum = Float32(0.0)
        for r in cutlass.range_constexpr(nrow):
            token = (m_block * tile_m + tScS[r, 0][0]) // group
            if const_expr(edges):
                w[r] = (Float32(1.0) if token == 0 else Float32(0.0)) + (Float32(1.0) if token == last else Float32(0.0))
            else:
                w[r] = Float32(1.0) if token == 0 else Float32(0.0)
            wsum += w[r]
        warp_has_rows = cute.arch.vote_any_sync(wsum > Float32(0.0))
        if warp_has_rows and n_block >= n_block_min:
            v = cute.make_rmem_tensor(ncol, Float32)
            for c in cutlass.range_constexpr(ncol):
                s = Float32(0.0)
                for r in cutlass.range_constexpr(nrow):
                    s += acc[r, c] * w[r] if w[r] > Float32(0.0) else Float32(0.0)
                v[c] = s
            lane = cute.arch.lane_idx()
            # reduce-scatter over the row lane bits: after step s the lane keeps npair >> (s + 1) pairs
            for step in cutlass.range_constexpr(3):
                bit = const_expr(ROW_LANE_BITS[step])
                half = const_expr(npair >> (step + 1))
                upper = (lane & bit) != 0
                for i in cutlass.range_constexpr(half):
                    for j in cutlass.range_constexpr(2):
                        lo = const_expr(2 * i + j)
                        hi = const_expr(2 * (i + half) + j)
                        send = v[lo] if upper else v[hi]
                        keep = v[hi] if upper else v[lo]
                        v[lo] = keep + cute.arch.shuffle_sync_bfly(send, offset=bit)
            k_first = ((npair // 8) * ((lane >> 2) & 1) + (npair // 4) * ((lane >> 3) & 1)
                       + (npair // 2) * ((lane >> 4) & 1))
            ctx = seqlen_k - seqlen_q
            for t in cutlass.range_constexpr(npair // 8):
                col = n_block * tile_n + 8 * (k_first + t) + 2 * (lane % 4)
                if col < ctx:
                    second = v[2 * t + 1] * scale if col + 1 < ctx else Float32(0.0)
                    red_add_f32x2(v[2 * t] * scale, second,
                                  fa_utils.elem_pointer(out, (batch_idx, head_idx, col)))

    @cute.jit
    def probe_tile(acc_S: cute.Tensor, thr_mma, out: cute.Tensor, batch_idx: Int32, head_idx: Int32,
                   m_block: Int32, n_block: Int32, n_block_min: Int32, seqlen_q: Int32, seqlen_k: Int32,
                   tile_m: cutlass.Constexpr[int], tile_n: cutlass.Constexpr[int], probes: cutlass.Constexpr[int]):
        """Lanes 0-3 of warp 0 hold rows 0 and 8 of the tile (the probe's hi and lo parts,
        :mod:`vegas.kernels.probe_queries`): they store hi + lo for the block's keys before the
        chunk, one 8-byte store per column pair; every other thread does nothing."""
        acc = layout_utils.reshape_acc_to_mn(acc_S)
        cS = cute.make_identity_tensor((tile_m, tile_n))
        tScS = layout_utils.reshape_acc_to_mn(thr_mma.partition_C(cS))
        npair = const_expr(cute.size(tScS.shape[1]) // 2)
        if m_block == 0 and tScS[0, 0][0] == 0 and n_block >= n_block_min and seqlen_q > probes:
            ctx = seqlen_k - seqlen_q + probes  # keys before the chunk (the probes are not in it)
            col = n_block * tile_n + tScS[0, 0][1]  # the lane's first column; pair t starts at col + 8 t
            addr = fa_utils.elem_pointer(out, (batch_idx, head_idx, col)).toint()
            if n_block * tile_n + tile_n <= ctx:  # the whole block is before the chunk: no per-pair test
                for t in cutlass.range_constexpr(npair):
                    st_f32x2(acc[0, 2 * t] + acc[1, 2 * t], acc[0, 2 * t + 1] + acc[1, 2 * t + 1], addr + 32 * t)
            else:
                for t in cutlass.range_constexpr(npair):
                    if col + 8 * t < ctx:
                        st_f32x2(acc[0, 2 * t] + acc[1, 2 * t], acc[0, 2 * t + 1] + acc[1, 2 * t + 1],
                                 addr + 32 * t)

    class _RowsumMask:
        """An ``AttentionMask`` whose ``apply_mask`` first adds the tile's scored rows to ``out``."""

        def __init__(self, inner, state, kernel):
            self._inner, self._state, self._kernel = inner, state, kernel

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def apply_mask(self, *args, **kwargs):
            acc_S = args[0] if args else kwargs["acc_S"]
            aux = kwargs.get("aux_tensors")
            if not aux:
                raise RuntimeError("rowsum: the score buffer must be aux_tensors[0]")
            k = self._kernel
            if mode == PROBE:
                probe_tile(acc_S, kwargs["thr_mma"], aux[0], kwargs["batch_idx"], kwargs["head_idx"],
                           kwargs["m_block"], kwargs["n_block"], self._state["n_block_min"], self._inner.seqlen_q,
                           self._inner.seqlen_k, k.tile_m, k.tile_n, probe_tokens(k.qhead_per_kvhead))
                return self._inner.apply_mask(*args, **kwargs)
            rowsum_tile(acc_S, kwargs["thr_mma"], aux[0], kwargs["batch_idx"], kwargs["head_idx"],
                        kwargs["m_block"], kwargs["n_block"], self._state["n_block_min"],
                        self._inner.seqlen_q, self._inner.seqlen_k, self._state["scale"],
                        k.tile_m, k.tile_n, k.qhead_per_kvhead if k.pack_gqa else 1, mode == EDGES)
            return self._inner.apply_mask(*args, **kwargs)

    def recording_block_info(inner, state):
        """``inner`` (a ``BlockInfo``) as an instance of a subclass that remembers the current work tile's
        ``n_block_min`` in ``state`` (trace time: the mainloop asks for it before it processes the
        tile's blocks). A subclass, not a wrapper: the mainloop's ``while`` carries it as a dataclass."""

        def get_n_block_min_max(self, *args, **kwargs):
            lo, hi = BlockInfo.get_n_block_min_max(self, *args, **kwargs)
            state["n_block_min"] = lo
            return lo, hi

        cls = type("RowsumBlockInfo", (type(inner),), {"get_n_block_min_max": get_n_block_min_max})
        return cls(**{f.name: getattr(inner, f.name) for f in dataclasses.fields(inner)})

    mma_signature = inspect.signature(FlashAttentionForwardSm90.mma)

    class RowsumSm90(FlashAttentionForwardSm90):
        """vLLM's sm90 forward + the in-register score rowsum (see the module docstring)."""

        ROW_MODE = mode

        def mma(self, *args, **kwargs):
            bound = mma_signature.bind(self, *args, **kwargs)
            a = bound.arguments
            if self.score_mod is not None or self.mask_mod is not None or not self.is_causal:
                raise NotImplementedError("rowsum: causal, no score_mod / mask_mod")
            if a["blocksparse_tensors"] is not None:
                raise NotImplementedError("rowsum: no block sparsity")
            check_layout(a["tiled_mma_qk"], self.tile_m, self.tile_n)
            # without a score_mod the softmax scale is folded into scale_log2 = scale * log2(e)
            state = {"scale": a["softmax_scale_log2"] * Float32(math.log(2.0))}
            a["block_info"] = recording_block_info(a["block_info"], state)
            mask_cls = a["AttentionMaskCls"]
            a["AttentionMaskCls"] = lambda *p, **kw: _RowsumMask(mask_cls(*p, **kw), state, self)
            return FlashAttentionForwardSm90.mma(*bound.args, **bound.kwargs)

    return RowsumSm90


#: compile caches of the rowsum kernels per row mode (kept apart from vLLM's, whose key does not name the class)
_CACHES: dict[str, dict] = {EDGES: {}, FIRST: {}, PROBE: {}}


@contextlib.contextmanager
def _rowsum_kernel_installed(mode: str):
    """Makes ``_flash_attn_fwd`` build :class:`RowsumSm90` of ``mode`` and use its compile cache for one call."""
    from vllm.vllm_flash_attn.cute import interface

    cls = kernel_class(mode)
    old_cls, old_cache = interface.FlashAttentionForwardSm90, interface._flash_attn_fwd.compile_cache
    interface.FlashAttentionForwardSm90 = cls
    interface._flash_attn_fwd.compile_cache = _CACHES[mode]
    try:
        yield interface._flash_attn_fwd
    finally:
        interface.FlashAttentionForwardSm90 = old_cls
        interface._flash_attn_fwd.compile_cache = old_cache


def rowsum_attention(q, k, v, out, scores, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k, page_table,
                     softmax_scale, num_splits=0, tile_mn=SCORE_TILE, mode=EDGES, _arch=None):
    """vLLM's CuTe-DSL varlen paged forward (causal, PackGQA) into ``out``, and the scored rows'
    logits, summed over each KV head's query heads, added into ``scores``.

    Args:
        q: ``(num_tokens, num_q_heads, head_dim)`` bf16/fp16 queries.
        k, v: ``(num_blocks, block_size, num_kv_heads, head_dim)`` paged cache (``kv_cache.unbind(1)``).
        out: like ``q``, the attention output (written).
        scores: ``(num_seqs, num_kv_heads, L)`` float32, ``L`` even and ``>= max_seqlen_k``, last dim
            contiguous (:func:`padded_len`), zeroed by the caller: ``scores[b, h, p] += scale *
            sum of q . k[p]`` over the scored rows (:func:`row_weights`) and the query heads of KV
            head ``h``, for ``p < seqused_k[b] - chunk_len[b]``.
        cu_seqlens_q: ``(num_seqs + 1,)`` int32; seqused_k: ``(num_seqs,)`` int32 keys per request.
        max_seqlen_q, max_seqlen_k: host bounds (tokens); page_table: ``(num_seqs, max_pages)`` int32.
        softmax_scale: float; num_splits: split-KV count, 0 for vLLM's heuristic (a runtime value:
            the compile key has only split or not); tile_mn: the query and key tiles; mode:
            :data:`EDGES` or :data:`FIRST`.

    Returns:
        ``(out, lse)`` as vLLM's ``_flash_attn_fwd``.

    Raises:
        ValueError: ``scores`` is not float32 ``(num_seqs, num_kv_heads, even L)`` with a unit last stride.
        ImportError: vLLM's CuTe attention or the CuTe DSL is missing (:func:`unavailable_reason`).
    """
    if scores.dtype != torch.float32 or scores.dim() != 3 or scores.stride(-1) != 1 or scores.shape[-1] % 2:
        raise ValueError(f"scores: float32 (batch, kv_heads, even L) with a contiguous last dim, got "
                         f"{scores.dtype} {tuple(scores.shape)} stride {scores.stride()}")
    with _rowsum_kernel_installed(mode) as fwd:
        return fwd(q, k, v, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k, max_seqlen_q=max_seqlen_q,
                   max_seqlen_k=max_seqlen_k, page_table=page_table, softmax_scale=softmax_scale, causal=True,
                   num_splits=num_splits, out=out, tile_mn=tile_mn, aux_tensors=[scores], _arch=_arch)


def probe_attention(q, k, v, out, scores, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k, page_table,
                    softmax_scale, num_splits=0, tile_mn=SCORE_TILE, mode=EDGES, _arch=None):
    """vLLM's CuTe-DSL varlen paged forward (causal, PackGQA) into ``out``, with each request's
    probe tokens in front of its chunk (:func:`~vegas.kernels.probe_queries.pack_probe_queries`),
    whose logits the kernel stores into ``scores``: the scored rows' logits summed over each KV
    head's query heads, as :func:`rowsum_attention` adds them, with plain stores (no atomics, no
    zeroing, deterministic).

    Args: as :func:`rowsum_attention`, except ``scores`` (float32 ``(num_seqs, num_kv_heads, L)``,
        ``L`` a multiple of 4 and ``>= max_seqlen_k``) need not be zeroed: positions ``p <
        seqused_k[b] - chunk_len[b]`` of every request with a non-empty chunk are written, nothing
        else; ``mode`` says which rows the probe sums (:func:`row_weights`).

    Returns:
        ``out``.

    Raises:
        ValueError: ``scores`` of the wrong dtype or shape.
        ImportError: vLLM's CuTe attention or the CuTe DSL is missing (:func:`unavailable_reason`).
    """
    if scores.dtype != torch.float32 or scores.dim() != 3 or scores.stride(-1) != 1 or scores.shape[-1] % 4:
        raise ValueError(f"scores: float32 (batch, kv_heads, L a multiple of 4) with a contiguous last dim, got "
                         f"{scores.dtype} {tuple(scores.shape)} stride {scores.stride()}")
    num_kv_heads = k.shape[2]
    probes = probe_tokens(q.shape[1] // num_kv_heads)
    packed, cu_packed, rows = pack_probe_queries(q, cu_seqlens_q, num_kv_heads, softmax_scale, mode == EDGES)
    out_packed = torch.empty_like(packed)
    with _rowsum_kernel_installed(PROBE) as fwd:
        fwd(packed, k, v, cu_seqlens_q=cu_packed, seqused_k=seqused_k, max_seqlen_q=max_seqlen_q + probes,
            max_seqlen_k=max_seqlen_k, page_table=page_table, softmax_scale=softmax_scale, causal=True,
            num_splits=num_splits, out=out_packed, tile_mn=tile_mn, aux_tensors=[scores], _arch=_arch)
    return torch.index_select(out_packed, 0, rows, out=out)


def reference_rowsum(q, k_cache, page_table, cu_seqlens_q, seqused_k, qlen, scale, length, mode=EDGES):
    """Torch reference of :func:`rowsum_attention`'s ``scores`` for chunks of ``qlen`` queries:
    ``(num_seqs, num_kv_heads, length)`` float32, zero past each request's context (``seqused_k - qlen``)."""
    seqs, hq, hkv = page_table.shape[0], q.shape[1], k_cache.shape[2]
    block = k_cache.shape[1]
    ref = torch.zeros((seqs, hkv, length), device=q.device)
    for s in range(seqs):
        ctx = int(seqused_k[s]) - qlen
        pos = torch.arange(ctx, device=q.device)
        keys = k_cache[page_table[s, pos // block].long(), pos % block].float()  # [ctx, hkv, d]
        start = int(cu_seqlens_q[s])
        rows = sum(w * q[start + r].float() for r, w in row_weights(mode, qlen).items())  # [hq, d]
        rows = rows.view(hkv, hq // hkv, -1).sum(1)  # [hkv, d]: the group's heads add up
        ref[s, :, :ctx] = torch.einsum("hd,phd->hp", rows, keys) * scale
    return ref


def warm_up(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int, device,
            *, mode: str = EDGES, probe: bool = True, splits=WARM_SPLITS, qlen: int = 2, ctx: int = 300,
            _arch=None) -> None:
    """Compile (by calling them once on a tiny batch) every variant an engine of this shape can
    call: unsplit, split, and the combine kernel of each split bucket. Call it outside CUDA-graph
    capture; afterwards :func:`is_warm` is True for the shape. Also the compile check of
    ``scripts/cute_rowsum.py`` (under ``FakeTensorMode``: compiled, nothing launched).

    Args:
        device: where the tiny batch lives (``cuda``).
        mode: the scored rows; probe: :func:`probe_attention` (the engine's), else
            :func:`rowsum_attention`.
        splits: split counts to call (:data:`WARM_SPLITS`: every combine bucket); qlen, ctx:
            the tiny batch (one request, ``ctx`` cached tokens, ``qlen`` queries).

    Raises:
        ImportError, RuntimeError: the DSL or a compile failed (the caller takes today's path).
    """
    pages = -(-(ctx + qlen) // block_size)
    cache = torch.zeros(pages + 1, 2, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    k, v = cache.unbind(1)
    q = torch.zeros(qlen, num_q_heads, head_dim, dtype=dtype, device=device)
    cu = torch.tensor([0, qlen], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([ctx + qlen], dtype=torch.int32, device=device)
    table = torch.arange(pages, dtype=torch.int32, device=device)[None]
    scores = torch.zeros(1, num_kv_heads, padded_len(ctx + qlen), device=device)
    attend = probe_attention if probe else rowsum_attention
    for num_splits in splits:
        attend(q, k, v, torch.empty_like(q), scores, cu, seq_lens, qlen, ctx + qlen, table, head_dim**-0.5,
               num_splits=num_splits, mode=mode, _arch=_arch)
    _WARM.add((dtype, num_q_heads, num_kv_heads, head_dim, block_size, PROBE if probe else mode))


def is_warm(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int,
            mode: str = EDGES, probe: bool = True) -> bool:
    """Whether :func:`warm_up` compiled this shape's variants in this process (the probe kernel
    serves every row mode)."""
    return (dtype, num_q_heads, num_kv_heads, head_dim, block_size, PROBE if probe else mode) in _WARM
