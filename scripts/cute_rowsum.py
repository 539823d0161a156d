#!/usr/bin/env python3
"""Verification scores summed in registers inside vLLM's CuTe-DSL sm90 attention (issue 22, second try).

``scripts/cute_decode_bench.py``'s ``cute/m64+scores`` stored every scored logit from a ``score_mod``
(a scalar 4-byte global store per element) and was 2.2-2.7x FA3 (benchmarks/results/cute_h200_2026-12-02).
This variant writes, per model layer, only what the selection needs:

    out[b, kv_head, p] = sum over the G query heads of kv_head and the rows {first, last} of request b's
    chunk of  scale * q . k[p],   for every key p < seqlen_k - seqlen_q (the keys before the chunk)

(float32, ``(batch, kv_heads, L)``, zeroed by the caller; a chunk of one query counts its row twice,
as the two slots of the old writer did).

How it reaches the QK tile: :class:`RowsumSm90` subclasses vLLM's ``FlashAttentionForwardSm90`` and
overrides only ``mma`` (a thin wrapper around the base method). The wrapper hands the base mainloop
an ``AttentionMaskCls`` whose masks run :func:`rowsum_tile` on ``acc_S`` (= ``tSrS``, the fp32 QK
accumulator, unscaled) right before the original ``apply_mask`` — the mainloop calls the mask on
every K block (first, causal and unmasked ones), after the QK WGMMA has been waited for and before
the online softmax. The tile is only read, no ``score_mod`` is set: the softmax, its folded scale
and the attention output are those of the plain kernel (``cute/m64``). The wrapper also hands the
mainloop a ``BlockInfo`` that remembers each work tile's ``n_block_min``: an empty split (the split
heuristic makes them) still runs its first block, which belongs to the previous split; that block
is skipped. The output buffer travels as the kernel's ``aux_tensors[0]`` (a runtime argument: no
address baked in); no ``score_mod``/``mask_mod`` reads it.

The reduction (:func:`rowsum_tile`, per thread, per K block of ``tile_n`` keys):

1. The thread's fragment in (row, col) form (``reshape_acc_to_mn`` of ``acc_S`` and of the identity
   tensor partitioned like it, as ``mask.py`` does): for the SM90 WGMMA accumulator of a 64 x N
   atom, lane l of warp w holds rows 16w + l//4 + 8r (r = 0, 1) and columns 8k + 2(l%4) + j
   (k < N/8, j = 0, 1), i.e. ``nrow = 2`` rows and ``ncol = N/4`` columns (N = 128: 64 elements).
   The row weight w_r = [token == 0] + [token == seqlen_q - 1], token = packed row // G (PackGQA
   packs row = token * G + head_in_group); rows of other tokens (and rows past the chunk, whose Q
   may be garbage) are excluded by a select, not a multiply. The column layout is checked at trace
   time against the static partitions of all threads.
2. Warps with no scored row (vote) skip everything: at qlen 5 only warp 0 (G = 3) or warps 0-1
   (G = 4) of the 64-row tile do work.
3. v[c] = sum_r w_r * S[r, c]: ``ncol`` partial column sums per thread.
4. Reduce-scatter across the 8 lanes that hold the same columns (lane bits 2, 3, 4 index rows):
   three butterfly steps (``shfl.bfly`` 16, 8, 4), each sending the half of the values the partner
   keeps: 16 + 8 + 4 = 28 shuffles (N = 128), after which lane l owns the full warp sums of 2
   column pairs: columns 8k + 2(l%4) + {0, 1} for k = 2 b2 + 4 b3 + 8 b4 + {0, 1} (b = lane bits).
5. Each lane multiplies by the softmax scale and adds its pairs with ``red.global.add.v2.f32``
   (keys < seqlen_k - seqlen_q only): one add per (warp, column), 64 vector reds per active warp and
   K block; warps of a warpgroup (G = 4: warp 0 has the first token, warp 1 the last) and splits add
   to the same ``out`` row through these atomics.

Entry points: :func:`rowsum_attention` (the bench's ``cute/m64+rowsum``) and, without a GPU,

    CUTE_DSL_ARCH=sm_90a nice -n 19 python3.12 scripts/cute_rowsum.py --compile-only --vllm-site /tmp/vsite

which compiles the kernel for sm_90a under torch's ``FakeTensorMode`` (nothing is launched) for the
SmolLM2 and Qwen3-8B shapes, qlen 5, the 64-row tile, unsplit and split; ``--vllm-site`` is a
folder holding an unpacked vLLM 0.24 wheel's ``vllm/`` (only ``vllm/vllm_flash_attn/cute`` is
imported: ``vllm`` and ``vllm.vllm_flash_attn`` become bare namespace packages, so vLLM's own
imports do not run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import sys
import time
import types
from pathlib import Path

#: (q heads, kv heads, head_dim): SmolLM2-135M and Qwen3-8B
SHAPES = {"smollm2": (9, 3, 64), "qwen3-8b": (32, 8, 128)}
#: trace-time results of the accumulator layout check, one line per compiled kernel (the compile check prints them)
LAYOUT_CHECK: list = []
#: lane bits that index rows in the SM90 accumulator layout, from high to low (the reduce-scatter order)
ROW_LANE_BITS = (16, 8, 4)


def padded_len(max_len: int) -> int:
    """Row length of the ``out`` buffer: a multiple of 4 so every row starts 16-byte aligned (the
    kernel adds column pairs with 8-byte vector reds)."""
    return -(-max_len // 4) * 4


@functools.cache
def _impl():
    """Builds the DSL pieces on first use (imports vLLM's CuTe package and the CuTe DSL)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, const_expr
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
        LAYOUT_CHECK.append(f"checked: 128 threads x {ncol} columns")

    @cute.jit
    def rowsum_tile(acc_S: cute.Tensor, thr_mma, out: cute.Tensor, batch_idx: Int32, head_idx: Int32,
                    m_block: Int32, n_block: Int32, n_block_min: Int32, seqlen_q: Int32, seqlen_k: Int32,
                    scale: Float32, tile_m: cutlass.Constexpr[int], tile_n: cutlass.Constexpr[int],
                    group: cutlass.Constexpr[int]):
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
            w[r] = (Float32(1.0) if token == 0 else Float32(0.0)) + (Float32(1.0) if token == last else Float32(0.0))
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
            rowsum_tile(acc_S, kwargs["thr_mma"], aux[0], kwargs["batch_idx"], kwargs["head_idx"],
                        kwargs["m_block"], kwargs["n_block"], self._state["n_block_min"],
                        self._inner.seqlen_q, self._inner.seqlen_k, self._state["scale"],
                        k.tile_m, k.tile_n, k.qhead_per_kvhead if k.pack_gqa else 1)
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


#: compile cache of the rowsum kernels (kept apart from vLLM's, whose key does not name the class)
_CACHE: dict = {}


@contextlib.contextmanager
def _rowsum_kernel_installed():
    """Makes ``_flash_attn_fwd`` build :class:`RowsumSm90` and use :data:`_CACHE` for one call."""
    from vllm.vllm_flash_attn.cute import interface

    cls = _impl()
    old_cls, old_cache = interface.FlashAttentionForwardSm90, interface._flash_attn_fwd.compile_cache
    interface.FlashAttentionForwardSm90 = cls
    interface._flash_attn_fwd.compile_cache = _CACHE
    try:
        yield interface._flash_attn_fwd
    finally:
        interface.FlashAttentionForwardSm90 = old_cls
        interface._flash_attn_fwd.compile_cache = old_cache


def rowsum_attention(q, k, v, out, scores, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k, page_table,
                     softmax_scale, num_splits=0, tile_mn=(64, 128), _arch=None):
    """vLLM's CuTe-DSL varlen paged forward (causal, PackGQA) into ``out``, and the scored-row sums
    added into ``scores`` (float32 ``(batch, kv_heads, L)``, L >= max_seqlen_k, last dim contiguous,
    zeroed by the caller; see :func:`padded_len`)."""
    import torch

    if scores.dtype != torch.float32 or scores.dim() != 3 or scores.stride(-1) != 1 or scores.shape[-1] % 2:
        raise ValueError(f"scores: float32 (batch, kv_heads, even L) with a contiguous last dim, got "
                         f"{scores.dtype} {tuple(scores.shape)} stride {scores.stride()}")
    with _rowsum_kernel_installed() as fwd:
        return fwd(q, k, v, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k, max_seqlen_q=max_seqlen_q,
                   max_seqlen_k=max_seqlen_k, page_table=page_table, softmax_scale=softmax_scale, causal=True,
                   num_splits=num_splits, out=out, tile_mn=tile_mn, aux_tensors=[scores], _arch=_arch)


def reference_rowsum(q, k_cache, page_table, cu_seqlens_q, seqused_k, qlen, scale, length):
    """Torch reference of :func:`rowsum_attention`'s ``scores``: ``(batch, kv_heads, length)`` float32,
    zero past each request's context (``seqused_k - qlen``)."""
    import torch

    seqs, hq, hkv = page_table.shape[0], q.shape[1], k_cache.shape[2]
    block = k_cache.shape[1]
    ref = torch.zeros((seqs, hkv, length), device=q.device)
    for s in range(seqs):
        ctx = int(seqused_k[s]) - qlen
        pos = torch.arange(ctx, device=q.device)
        keys = k_cache[page_table[s, pos // block].long(), pos % block].float()  # [ctx, hkv, d]
        start = int(cu_seqlens_q[s])
        rows = q[start].float() + q[start + qlen - 1].float()  # [hq, d]: the two rows' logits add up
        rows = rows.view(hkv, hq // hkv, -1).sum(1)  # [hkv, d]: and so do the group's heads
        ref[s, :, :ctx] = torch.einsum("hd,phd->hp", rows, keys) * scale
    return ref


def _namespace_vllm(site: Path) -> None:
    """``vllm`` and ``vllm.vllm_flash_attn`` as bare packages over ``site``'s folders (their
    ``__init__`` needs all of vLLM; the CuTe package needs none of it)."""
    for name, path in (("vllm", site / "vllm"), ("vllm.vllm_flash_attn", site / "vllm" / "vllm_flash_attn")):
        mod = types.ModuleType(name)
        mod.__path__ = [str(path)]
        sys.modules[name] = mod


def compile_check(cases, splits, plain=False, seqs=8, qlen=5, ctx=7680, block_size=16) -> int:
    """Compiles :func:`rowsum_attention` (``plain``: vLLM's unmodified kernel, the same call without the
    score buffer, to compare registers) for sm_90a under ``FakeTensorMode``; returns the failures."""
    import traceback

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    failed = 0
    for case in cases:
        hq, hkv, d = SHAPES[case]
        for num_splits in splits:
            name = (f"{'plain' if plain else 'rowsum'} {case} ({hq} q / {hkv} kv x {d}), qlen {qlen}, tile 64x128, "
                    f"splits {num_splits}")
            t0 = time.perf_counter()
            try:
                with FakeTensorMode(allow_non_fake_inputs=True):
                    pages = -(-(ctx + qlen) // block_size)
                    cache = torch.empty(seqs * pages + 1, 2, block_size, hkv, d, dtype=torch.bfloat16, device="cuda")
                    k, v = cache.unbind(1)
                    q = torch.empty(seqs * qlen, hq, d, dtype=torch.bfloat16, device="cuda")
                    meta = (torch.empty(seqs + 1, dtype=torch.int32, device="cuda"),
                            torch.empty(seqs, dtype=torch.int32, device="cuda"), qlen, ctx + qlen,
                            torch.empty(seqs, pages, dtype=torch.int32, device="cuda"), d**-0.5)
                    if plain:
                        from vllm.vllm_flash_attn.cute.interface import _flash_attn_fwd

                        _flash_attn_fwd(q, k, v, cu_seqlens_q=meta[0], seqused_k=meta[1], max_seqlen_q=qlen,
                                        max_seqlen_k=ctx + qlen, page_table=meta[4], softmax_scale=meta[5],
                                        causal=True, num_splits=num_splits, out=torch.empty_like(q),
                                        tile_mn=(64, 128), _arch=90)
                    else:
                        scores = torch.empty(seqs, hkv, padded_len(ctx + qlen), device="cuda")
                        rowsum_attention(q, k, v, torch.empty_like(q), scores, *meta, num_splits=num_splits,
                                         _arch=90)
                layout = "" if plain else f"; layout {LAYOUT_CHECK[-1]}"
                print(f"compiled: {name} in {time.perf_counter() - t0:.0f} s{layout}", flush=True)
            except Exception:
                failed += 1
                print(f"FAILED: {name}\n{traceback.format_exc()[-3000:]}", flush=True)
    return failed


def main() -> int:
    import argparse
    import os

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile-only", action="store_true", required=True,
                    help="compile for sm_90a under FakeTensorMode (the only mode of this entry point)")
    ap.add_argument("--vllm-site", type=Path,
                    help="folder holding vllm/ of a vLLM 0.24 wheel, imported without vLLM's __init__ "
                         "(default: the installed vllm)")
    ap.add_argument("--case", action="append", choices=list(SHAPES), help="default: both")
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--plain", action="store_true", help="compile vLLM's unmodified kernel instead (to compare)")
    args = ap.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    if args.vllm_site is not None:
        if not (args.vllm_site / "vllm" / "vllm_flash_attn" / "cute" / "interface.py").is_file():
            ap.error(f"--vllm-site: no vllm/vllm_flash_attn/cute/interface.py under {args.vllm_site}")
        _namespace_vllm(args.vllm_site)
    return 1 if compile_check(args.case or list(SHAPES), args.splits, plain=args.plain) else 0


if __name__ == "__main__":
    sys.exit(main())
