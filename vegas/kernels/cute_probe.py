"""Verification scores from the verification attention's own QK product: probe queries in vLLM's
CuTe-DSL sm90 attention (issue 22; opt-in ``vllm.score_path="cute"``, experimental).

Today a score-based selector on vLLM runs FA3 per layer and then a second pass over every prefix
key (:mod:`vegas.kernels.triton_score`), 1.20-1.43x FA3 per step. :func:`probe_attention` runs the
verification through FlashAttention's CuTe-DSL forward (``vllm/vllm_flash_attn/cute/flash_fwd_sm90.py``
in vLLM 0.24, JIT-compiled, no build step) with the 64-row query tile, and gets the selection
scores from the same QK product:

1. :func:`~vegas.kernels.probe_queries.pack_probe_queries` puts each request's probe tokens in
   front of its chunk: per KV head, the scored queries (Collect-2-Query's first and last query, or
   the first alone for last_token; :func:`row_weights`) summed over the KV head's query heads and
   scaled, as a bf16 ``hi`` row (tile row 0) and ``lo`` row (tile row 8). A score is linear in the
   queries, so ``(hi + lo) . k[p]`` is the selector's score of key ``p`` to ~16 mantissa bits.
2. :class:`ProbeSm90` (built by :func:`kernel_class`) subclasses vLLM's ``FlashAttentionForwardSm90``
   and overrides only ``mma``: the mainloop's mask runs :func:`probe_tile` on ``acc_S`` (the fp32
   QK accumulator, unscaled, right before the mask and the online softmax) of every K block. Lanes
   0-3 of warp 0 hold rows 0 and 8 (SM90 WGMMA accumulator: lane ``l`` of warp ``w`` holds rows
   ``16 w + l // 4 + 8 r`` and columns ``8 k + 2 (l % 4) + j``; checked at trace time): they add
   the two rows and store the block's keys before the chunk, one ``st.global.v2.f32`` per column
   pair (16 stores per lane and 128-key block, 64 in all; one address per block, no per-pair test for a block wholly before
   the chunk) into a float32 ``(batch, kv_heads, L)`` buffer. No reduction, no atomics, no
   zeroing: deterministic. No ``score_mod``: every chunk row's attention is the plain kernel's,
   bit for bit (rows are independent; split counts unchanged).
3. The chunk rows' output is gathered back into the caller's tensor.

A ``BlockInfo`` subclass remembers each work tile's ``n_block_min``: an empty split (the split
heuristic makes them) still runs its first block, which belongs to the previous split; it is
skipped. The buffer travels as the kernel's ``aux_tensors[0]`` (a runtime argument).

Measured on an H200 (``benchmarks/results/cute_probe_h200_2026-12-04``, per model step, all layers,
qlen 5, each step one CUDA-graph replay, x FA3): Qwen3-8B shape (36 L, 32 q / 8 kv x 128) 32K batch
1 / 4: 1.159x / 1.127x; 128K batch 1 / 4: 1.100x / 1.092x (FA3 + the separate pass 1.35-1.43x);
SmolLM2 shape (30 L, 9 q / 3 kv x 64) 7,680 tokens batch 32 / 128: 1.221x / 1.372x (FA3 + the
separate pass 1.196x / 1.241x: faster). Scores within 2.4e-6 (head_dim 128) and 4.2e-7 (64)
relative of a torch reference, output bitwise equal to the plain CuTe kernel's with the same tile
(not FA3's: max |diff| 6.1e-5 and 4.9e-4).
The earlier design that summed the scored rows in registers with shuffles and atomics (the
"rowsum", commit 204ff6d) measured 1.015x / 1.116x / 1.078x / 1.122x and 1.212x / 1.413x.

Compilation: the kernel JIT-compiles on first use (10-18 s on an H200). The compile key is vLLM's
(dtype, head_dim, G, split or not, paged layout, ...), not the query length or the split count;
the split-KV combine kernel has its own key, which includes ``log2`` of the split count (buckets
16, 32, 64, 128). :func:`warm_up` compiles every variant an engine can call, outside CUDA-graph
capture, and :func:`is_warm` says whether it did.

Nothing here imports vLLM or the CuTe DSL at module import: :func:`unavailable_reason` says why
they cannot run. Needs ``nvidia-cutlass-dsl[cu13]==4.5.2`` and ``quack-kernels``
(``scripts/cute_dsl_bundle.sh``) and an sm90 GPU; ``scripts/cute_probe_compile.py --compile-only``
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

import torch

from .fa3_scores import attention_reason, sm90_reason

# .probe_queries (Triton) is imported where it is used: the settings check imports this module on
# machines without Triton (vegas serve --dry-run)

__all__ = [
    "EDGES",
    "FIRST",
    "HEAD_DIMS",
    "SCORE_TILE",
    "WARM_SPLITS",
    "empty_split_count",
    "is_warm",
    "kernel_class",
    "padded_len",
    "probe_attention",
    "reference_scores",
    "row_mode",
    "row_weights",
    "unavailable_reason",
    "unsupported_reason",
    "warm_up",
]

#: row modes: the chunk's first and last query (collect2), or the first alone (last_token)
EDGES, FIRST = "edges", "first"
#: the query tile (one MMA warpgroup of 4 warps x 16 rows: what FA3 picks for decode) and the key tile
SCORE_TILE = (64, 128)
#: head dims compiled and measured (the trace-time layout check holds for both)
HEAD_DIMS = (64, 128)
#: split counts :func:`warm_up` compiles: unsplit, then one per bucket of the combine kernel's key
WARM_SPLITS = (1, 16, 32, 64, 128)
#: trace-time results of the accumulator layout check, one line per compiled kernel
LAYOUT_CHECK: list = []

_checked: dict[str, str | None] = {}
#: (dtype, num_q_heads, num_kv_heads, head_dim, block_size) compiled by :func:`warm_up`
_WARM: set = set()


def padded_len(max_len: int) -> int:
    """Row length of the ``out`` buffer (tokens): ``max_len`` rounded up to a multiple of 4 so that
    every row starts 16-byte aligned (the kernel stores column pairs with 8-byte vector stores)."""
    return -(-max_len // 4) * 4


def empty_split_count(n_blocks: int) -> int | None:
    """The smallest split count for which the kernel's last split gets no key block of
    ``n_blocks`` (the case the probe kernel must skip: such a split still runs its first block, the
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
    raise ValueError(f"the CuTe probe scores a chunk's first row, or its first and last; the selector "
                     f"scores (chunk length: rows) {listed}")


def row_weights(mode: str, chunk_len: int) -> dict[int, float]:
    """The weight the probe gives each row of a chunk of ``chunk_len`` queries in ``mode`` (rows
    not listed count 0): :data:`EDGES` ``{0: 1, c - 1: 1}`` and ``{0: 2}`` for one query,
    :data:`FIRST` ``{0: 1}``."""
    weights = {0: 1.0}
    if mode == EDGES:
        weights[chunk_len - 1] = weights.get(chunk_len - 1, 0.0) + 1.0
    return weights


def unsupported_reason(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, max_query_len: int,
                       *, max_chunk: int | None = None, block_size: int = 16, sliding_window=None,
                       softcap: float | None = None, alibi_slopes=None, sinks=None,
                       kv_cache_dtype: str = "auto") -> str | None:
    """Why a verification call of this shape does not take the probe path, or None when it does.

    Covered: bf16/fp16, head_dim in :data:`HEAD_DIMS`, whole query groups per KV head, causal
    attention without window, soft-capping, ALiBi, sinks or quantized cache, a paged cache read
    without TMA (``block_size`` other than the key tile, 128), and a decode-shaped batch whose probe
    tokens and chunk fit one query tile: ``1 <= max_query_len <= max_chunk`` and ``(P +
    max_query_len) * G <= 64`` with ``P`` = :func:`~vegas.kernels.probe_queries.probe_tokens`.

    Args:
        max_chunk: longest chunk whose scored rows are the chunk's own first/last (γ + 1: the
            selector scores the last γ + 1 queries of a longer chunk); None: no bound.
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
        return f"block_size {block_size} (the kernel's TMA paged path, not compiled for the probe)"
    from .probe_queries import probe_tokens

    group = num_q_heads // num_kv_heads
    probes = probe_tokens(group)
    fits = SCORE_TILE[0] // group - probes
    longest = fits if max_chunk is None else min(max_chunk, fits)
    if not 1 <= max_query_len <= longest:
        return (f"max_query_len {max_query_len} (decode-shaped verification: 1..{max(longest, 0)} at group "
                f"{group} after {probes} probe tokens, one {SCORE_TILE[0]}-row query tile)")
    return None


def unavailable_reason() -> str | None:
    """Why the probe kernel cannot run in this process, or None when it can (checked once): an
    sm90 GPU, the CuTe DSL, quack and vLLM's CuTe attention import, and :class:`ProbeSm90` builds
    against them."""
    if "reason" in _checked:
        return _checked["reason"]
    reason = sm90_reason(exact=False)
    if reason is None:
        try:
            for module in ("cutlass.cute", "quack", "vllm.vllm_flash_attn.cute.interface"):
                importlib.import_module(module)
            kernel_class()
        except Exception as e:  # an import or an API the subclass expects: say which, take today's path
            reason = (f"the CuTe-DSL probe kernel does not load ({type(e).__name__}: {str(e)[:160]}); it needs "
                      "nvidia-cutlass-dsl[cu13]==4.5.2 and quack-kernels (scripts/cute_dsl_bundle.sh) with vLLM 0.24")
    _checked["reason"] = reason
    return reason


@functools.cache
def kernel_class():
    """:class:`ProbeSm90`, built on first use: imports vLLM's CuTe package and the CuTe DSL
    (ImportError without them)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64, const_expr
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import dsl_user_op
    from quack import layout_utils
    from vllm.vllm_flash_attn.cute import utils as fa_utils
    from vllm.vllm_flash_attn.cute.block_info import BlockInfo
    from vllm.vllm_flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90

    from .probe_queries import probe_tokens

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
        the mn view), which the probe's addressing assumes. Raises otherwise."""
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
                        f"probe: unexpected accumulator layout (thread {t}, element {c}: column {col})")
        if ncol * 4 != tile_n or tile_n % 64:
            raise NotImplementedError(f"probe: needs tile_n a multiple of 64 with 4 columns per 8, got {tile_n}")
        for t in range(128):  # rows 16 w + l // 4 + 8 r: rows 0 and 8 (the probe's) are lanes 0-3 of warp 0
            tScS = layout_utils.reshape_acc_to_mn(tiled_mma.get_slice(t).partition_C(cS))
            rows = [tScS[r, 0][0] for r in range(cute.size(tScS.shape[0]))]
            if rows != [16 * (t // 32) + (t % 32) // 4 + 8 * r for r in range(2)]:
                raise NotImplementedError(f"probe: unexpected accumulator rows (thread {t}: rows {rows})")
        LAYOUT_CHECK.append(f"checked: 128 threads x 2 rows x {ncol} columns")

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

    class _ProbeMask:
        """An ``AttentionMask`` whose ``apply_mask`` first stores the tile's probe rows to ``out``."""

        def __init__(self, inner, state, kernel):
            self._inner, self._state, self._kernel = inner, state, kernel

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def apply_mask(self, *args, **kwargs):
            acc_S = args[0] if args else kwargs["acc_S"]
            aux = kwargs.get("aux_tensors")
            if not aux:
                raise RuntimeError("probe: the score buffer must be aux_tensors[0]")
            k = self._kernel
            probe_tile(acc_S, kwargs["thr_mma"], aux[0], kwargs["batch_idx"], kwargs["head_idx"],
                       kwargs["m_block"], kwargs["n_block"], self._state["n_block_min"], self._inner.seqlen_q,
                       self._inner.seqlen_k, k.tile_m, k.tile_n, probe_tokens(k.qhead_per_kvhead))
            return self._inner.apply_mask(*args, **kwargs)

    def recording_block_info(inner, state):
        """``inner`` (a ``BlockInfo``) as an instance of a subclass that remembers the current work tile's
        ``n_block_min`` in ``state`` (trace time: the mainloop asks for it before it processes the
        tile's blocks). A subclass, not a wrapper: the mainloop's ``while`` carries it as a dataclass."""

        def get_n_block_min_max(self, *args, **kwargs):
            lo, hi = BlockInfo.get_n_block_min_max(self, *args, **kwargs)
            state["n_block_min"] = lo
            return lo, hi

        cls = type("ProbeBlockInfo", (type(inner),), {"get_n_block_min_max": get_n_block_min_max})
        return cls(**{f.name: getattr(inner, f.name) for f in dataclasses.fields(inner)})

    mma_signature = inspect.signature(FlashAttentionForwardSm90.mma)

    class ProbeSm90(FlashAttentionForwardSm90):
        """vLLM's sm90 forward + the probe rows' logits stored (see the module docstring)."""

        def mma(self, *args, **kwargs):
            bound = mma_signature.bind(self, *args, **kwargs)
            a = bound.arguments
            if self.score_mod is not None or self.mask_mod is not None or not self.is_causal:
                raise NotImplementedError("probe: causal, no score_mod / mask_mod")
            if a["blocksparse_tensors"] is not None:
                raise NotImplementedError("probe: no block sparsity")
            if not (self.pack_gqa or self.qhead_per_kvhead == 1):
                raise NotImplementedError("probe: rows 0 and 8 are the probe's only with PackGQA (or one head per KV head)")
            check_layout(a["tiled_mma_qk"], self.tile_m, self.tile_n)
            state = {}
            a["block_info"] = recording_block_info(a["block_info"], state)
            mask_cls = a["AttentionMaskCls"]
            a["AttentionMaskCls"] = lambda *p, **kw: _ProbeMask(mask_cls(*p, **kw), state, self)
            return FlashAttentionForwardSm90.mma(*bound.args, **bound.kwargs)

    return ProbeSm90


#: compile cache of the probe kernel (kept apart from vLLM's, whose key does not name the class)
_CACHE: dict = {}


@contextlib.contextmanager
def _probe_kernel_installed():
    """Makes ``_flash_attn_fwd`` build :class:`ProbeSm90` and use its compile cache for one call."""
    from vllm.vllm_flash_attn.cute import interface

    cls = kernel_class()
    old_cls, old_cache = interface.FlashAttentionForwardSm90, interface._flash_attn_fwd.compile_cache
    interface.FlashAttentionForwardSm90 = cls
    interface._flash_attn_fwd.compile_cache = _CACHE
    try:
        yield interface._flash_attn_fwd
    finally:
        interface.FlashAttentionForwardSm90 = old_cls
        interface._flash_attn_fwd.compile_cache = old_cache


def probe_attention(q, k, v, out, scores, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k, page_table,
                    softmax_scale, num_splits=0, tile_mn=SCORE_TILE, mode=EDGES, _arch=None):
    """vLLM's CuTe-DSL varlen paged forward (causal, PackGQA) into ``out``, and the selector's
    scores from the same QK product into ``scores`` (module docstring).

    Args:
        q: ``(num_tokens, num_q_heads, head_dim)`` bf16/fp16 queries, ``num_tokens`` =
            ``cu_seqlens_q[-1]``.
        k, v: ``(num_blocks, block_size, num_kv_heads, head_dim)`` paged cache (``kv_cache.unbind(1)``).
        out: like ``q``, the attention output (written).
        scores: ``(num_seqs, num_kv_heads, L)`` float32, ``L`` a multiple of 4 and ``>=
            max_seqlen_k``, last dim contiguous (:func:`padded_len`): ``scores[b, h, p] = scale *
            sum of q . k[p]`` over the scored rows (:func:`row_weights` of ``mode``) and the query
            heads of KV head ``h``, stored for ``p < seqused_k[b] - chunk_len[b]`` of every request
            with a non-empty chunk (and possibly ``p`` = that bound, the last column pair's
            partner); nothing else is written.
        cu_seqlens_q: ``(num_seqs + 1,)`` int32; seqused_k: ``(num_seqs,)`` int32 keys per request.
        max_seqlen_q, max_seqlen_k: host bounds (tokens); page_table: ``(num_seqs, max_pages)`` int32.
        softmax_scale: float; num_splits: split-KV count, 0 for vLLM's heuristic (a runtime value:
            the compile key has only split or not); tile_mn: the query and key tiles; mode:
            :data:`EDGES` (collect2) or :data:`FIRST` (last_token).

    Returns:
        ``out``.

    Raises:
        ValueError: ``scores`` of the wrong dtype or shape.
        ImportError: vLLM's CuTe attention or the CuTe DSL is missing (:func:`unavailable_reason`).
    """
    from .probe_queries import pack_probe_queries, probe_tokens

    num_seqs, num_kv_heads = cu_seqlens_q.shape[0] - 1, k.shape[2]
    if (scores.dtype != torch.float32 or scores.dim() != 3 or scores.shape[0] < num_seqs
            or scores.shape[1] != num_kv_heads or scores.shape[2] < max_seqlen_k or scores.shape[2] % 4
            or scores.stride(-1) != 1 or scores.stride(0) % 2 or scores.stride(1) % 2 or scores.data_ptr() % 8):
        raise ValueError(f"scores: float32 (>= {num_seqs} requests, {num_kv_heads} kv_heads, L >= {max_seqlen_k} "
                         f"a multiple of 4), last dim contiguous, 8-byte aligned rows; got {scores.dtype} "
                         f"{tuple(scores.shape)} strides {scores.stride()}")
    probes = probe_tokens(q.shape[1] // num_kv_heads)
    packed, cu_packed, rows = pack_probe_queries(q, cu_seqlens_q, num_kv_heads, softmax_scale, mode == EDGES)
    out_packed = torch.empty_like(packed)
    with _probe_kernel_installed() as fwd:
        fwd(packed, k, v, cu_seqlens_q=cu_packed, seqused_k=seqused_k, max_seqlen_q=max_seqlen_q + probes,
            max_seqlen_k=max_seqlen_k, page_table=page_table, softmax_scale=softmax_scale, causal=True,
            num_splits=num_splits, out=out_packed, tile_mn=tile_mn, aux_tensors=[scores],
            pack_gqa=q.shape[1] > num_kv_heads, _arch=_arch)
    return torch.index_select(out_packed, 0, rows, out=out)


def reference_scores(q, k_cache, page_table, cu_seqlens_q, seqused_k, qlen, scale, length, mode=EDGES):
    """Torch reference of :func:`probe_attention`'s ``scores`` for chunks of ``qlen`` queries:
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
            *, mode: str = EDGES, splits=WARM_SPLITS, qlen: int = 2, ctx: int = 300, _arch=None) -> None:
    """Compile (by calling them once on a tiny batch) every variant an engine of this shape can
    call: unsplit, split, and the combine kernel of each split bucket, and the probe packing for
    ``mode``. Call it outside CUDA-graph capture; afterwards :func:`is_warm` is True for the shape.
    Also the compile check of ``scripts/cute_probe_compile.py`` (under ``FakeTensorMode``:
    compiled, nothing launched).

    Args:
        device: where the tiny batch lives (``cuda``).
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
    for num_splits in splits:
        probe_attention(q, k, v, torch.empty_like(q), scores, cu, seq_lens, qlen, ctx + qlen, table, head_dim**-0.5,
                        num_splits=num_splits, mode=mode, _arch=_arch)
    _WARM.add((dtype, num_q_heads, num_kv_heads, head_dim, block_size))


def is_warm(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int) -> bool:
    """Whether :func:`warm_up` compiled this shape's variants in this process."""
    return (dtype, num_q_heads, num_kv_heads, head_dim, block_size) in _WARM
