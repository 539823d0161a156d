"""Triton kernel of the Quest page bound over vLLM's block table (GPU only).

Same computation as :func:`vegas.kernels.quest_pages.page_scores_reference`: for request ``s``
and page ``p < num_pages[s]`` with block ``b = block_table[s, p]``,
``score = Q⁺[s] · key_max[b] + Q⁻[s] · key_min[b]`` over the flattened ``num_kv_heads *
head_dim`` row; ``-inf`` elsewhere. One program scores ``BLOCK_P`` pages of one request, reading
each page's two bound rows once (no gathered copy of the metadata).

Any row length works: the row is padded to a power of two (``ROW_PAD``) and read in chunks of
at most 1024 elements (``BLOCK_E``), the padded lanes masked; a row of at most 1024 elements
(every shape up to 8 x 128 and 4 x 256) is one chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import VegasConfigError

__all__ = ["page_scores_triton", "quest_blocks"]

#: widest chunk of a bound row per inner step (elements)
MAX_BLOCK_E = 1024
#: bound elements one program reads per inner step (pages x chunk), at most
ELEMS_PER_STEP = 4096


@triton.jit(do_not_specialize=["width", "stride_bt"])
def _page_scores_kernel(
    qpos_ptr,  # [num_seqs, ROW] float32
    qneg_ptr,
    kmin_ptr,  # [num_blocks + 1, ROW] contiguous rows
    kmax_ptr,
    bt_ptr,  # [num_seqs, width] int32
    npages_ptr,  # [num_seqs] int64
    out_ptr,  # [num_seqs, width] float32
    width,
    stride_bt,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    ROW_PAD: tl.constexpr,  # next power of two >= ROW
    BLOCK_E: tl.constexpr,  # chunk of the row per inner step (divides ROW_PAD)
    BLOCK_P: tl.constexpr,  # pages per program
):
    s = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.load(npages_ptr + s)
    pmask = p < n
    blk = tl.load(bt_ptr + s * stride_bt + p, mask=pmask, other=0).to(tl.int64)
    score = tl.zeros([BLOCK_P], dtype=tl.float32)
    for c in tl.static_range(ROW_PAD // BLOCK_E):
        e = c * BLOCK_E + tl.arange(0, BLOCK_E)
        emask = e < ROW
        qp = tl.load(qpos_ptr + s * ROW + e, mask=emask, other=0.0)
        qn = tl.load(qneg_ptr + s * ROW + e, mask=emask, other=0.0)
        m2 = pmask[:, None] & emask[None, :]
        mx = tl.load(kmax_ptr + blk[:, None] * ROW + e[None, :], mask=m2, other=0.0).to(tl.float32)
        mn = tl.load(kmin_ptr + blk[:, None] * ROW + e[None, :], mask=m2, other=0.0).to(tl.float32)
        score += tl.sum(mx * qp[None, :] + mn * qn[None, :], axis=1)
    score = tl.where(pmask, score, float("-inf"))
    tl.store(out_ptr + s * width + p, score, mask=p < width)


def quest_blocks(row: int, block_p: int | None = None) -> tuple[int, int, int]:
    """``(row_pad, block_e, block_p)`` of the page-score kernel for bound rows of ``row`` elements.

    ``row_pad`` is the next power of two, ``block_e = min(row_pad, 1024)`` and, by default,
    ``block_p`` gives about 4096 bound elements per inner step (32 pages of 128, 4 of 1024 or more).

    Raises:
        VegasConfigError: ``row`` is not a positive integer, or ``block_p`` not a power of two.
    """
    if isinstance(row, bool) or not isinstance(row, int) or row < 1:
        raise VegasConfigError(f"num_kv_heads * head_dim must be a positive integer, got {row!r}")
    row_pad = triton.next_power_of_2(row)
    block_e = min(row_pad, MAX_BLOCK_E)
    if block_p is None:
        block_p = max(1, min(32, ELEMS_PER_STEP // block_e))
    if block_p < 1 or block_p & (block_p - 1):
        raise VegasConfigError(f"block_p must be a power of two, got {block_p}")
    return row_pad, block_e, block_p


def page_scores_triton(
    q_pos: torch.Tensor,
    q_neg: torch.Tensor,
    key_min: torch.Tensor,
    key_max: torch.Tensor,
    block_table: torch.Tensor,
    num_pages: torch.Tensor,
    block_p: int | None = None,
) -> torch.Tensor:
    """Triton implementation of :func:`vegas.kernels.quest_pages.page_scores_reference`.

    Args:
        q_pos, q_neg: ``(num_seqs, num_kv_heads * head_dim)`` float32.
        key_min, key_max: ``(num_blocks + 1, ...)`` contiguous, ``num_kv_heads * head_dim``
            elements per block (any head shape).
        block_table: ``(num_seqs, max_blocks)`` int32 with a unit last stride.
        num_pages: ``(num_seqs,)`` integer pages to score per request.
        block_p: pages per program (a power of two); default from :func:`quest_blocks`.

    Returns:
        ``(num_seqs, max_blocks)`` float32: the bound, ``-inf`` from ``num_pages`` on.

    Raises:
        VegasConfigError: the bounds are not contiguous, their rows do not hold
            ``q_pos.shape[1]`` elements, ``q_neg`` and ``q_pos`` differ in shape, or
            ``block_table`` has no unit last stride.
    """
    n, width = block_table.shape
    row = q_pos.shape[1]
    if not (key_min.is_contiguous() and key_max.is_contiguous()):
        raise VegasConfigError("key_min and key_max must be contiguous")
    if key_min.shape != key_max.shape or key_min[0].numel() != row:
        raise VegasConfigError(
            f"key_min and key_max must be (num_blocks + 1, ...) with num_kv_heads * head_dim = {row} elements "
            f"per block, got {tuple(key_min.shape)} and {tuple(key_max.shape)}"
        )
    if q_neg.shape != q_pos.shape:
        raise VegasConfigError(f"q_pos and q_neg must have the same shape, got {tuple(q_pos.shape)} and {tuple(q_neg.shape)}")
    if width > 1 and block_table.stride(1) != 1:
        raise VegasConfigError(f"block_table must have a unit last stride, got strides {block_table.stride()}")
    row_pad, block_e, block_p = quest_blocks(row, block_p)
    out = torch.empty((n, width), dtype=torch.float32, device=q_pos.device)
    if n == 0 or width == 0:
        return out
    grid = (n, triton.cdiv(width, block_p))
    _page_scores_kernel[grid](
        q_pos.float().contiguous(), q_neg.float().contiguous(), key_min, key_max, block_table, num_pages.long(), out,
        width, block_table.stride(0),
        ROW=row, ROW_PAD=row_pad, BLOCK_E=block_e, BLOCK_P=block_p,
    )
    return out
