"""Triton kernel of the Quest page bound over vLLM's block table (GPU only).

Same computation as :func:`vegas.kernels.quest_pages.page_scores_reference`: for request ``s``
and page ``p < num_pages[s]`` with block ``b = block_table[s, p]``,
``score = Q⁺[s] · key_max[b] + Q⁻[s] · key_min[b]`` over the flattened ``num_kv_heads *
head_dim`` row; ``-inf`` elsewhere. One program scores ``BLOCK_P`` pages of one request, reading
each page's two bound rows once (no gathered copy of the metadata).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["page_scores_triton"]


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
    ROW: tl.constexpr,
    ROW_PAD: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    s = tl.program_id(0)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    e = tl.arange(0, ROW_PAD)
    emask = e < ROW
    n = tl.load(npages_ptr + s)
    pmask = p < n
    blk = tl.load(bt_ptr + s * stride_bt + p, mask=pmask, other=0).to(tl.int64)
    qp = tl.load(qpos_ptr + s * ROW + e, mask=emask, other=0.0)
    qn = tl.load(qneg_ptr + s * ROW + e, mask=emask, other=0.0)
    m2 = pmask[:, None] & emask[None, :]
    mx = tl.load(kmax_ptr + blk[:, None] * ROW + e[None, :], mask=m2, other=0.0).to(tl.float32)
    mn = tl.load(kmin_ptr + blk[:, None] * ROW + e[None, :], mask=m2, other=0.0).to(tl.float32)
    score = tl.sum(mx * qp[None, :] + mn * qn[None, :], axis=1)
    score = tl.where(pmask, score, float("-inf"))
    tl.store(out_ptr + s * width + p, score, mask=p < width)


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

    ``key_min`` / ``key_max`` must be contiguous; ``block_table`` needs a unit last stride.
    """
    n, width = block_table.shape
    row = q_pos.shape[1]
    assert key_min.is_contiguous() and key_max.is_contiguous() and block_table.stride(1) == 1
    assert key_min[0].numel() == row
    row_pad = triton.next_power_of_2(row)
    if block_p is None:  # ~8K bound elements per program: 32 pages of 128, 4 of 1024
        block_p = max(1, min(32, 4096 // row_pad))
    out = torch.empty((n, width), dtype=torch.float32, device=q_pos.device)
    grid = (n, triton.cdiv(width, block_p))
    _page_scores_kernel[grid](
        q_pos.contiguous(), q_neg.contiguous(), key_min, key_max, block_table, num_pages.long(), out,
        width, block_table.stride(0),
        ROW=row, ROW_PAD=row_pad, BLOCK_P=block_p,
    )
    return out
