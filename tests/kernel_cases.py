"""Shared cases of the kernel tests: the head shapes every kernel must accept, and checks of
the Triton kernels against their PyTorch references that run on a GPU (``tests/gpu``) and on
the CPU under Triton's interpreter (``tests/test_kernels_interpreted.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.verify_cases import shuffled_block_table

ROOT = Path(__file__).resolve().parent.parent


def run_interpreted(child: str) -> dict:
    """Run ``child`` (Python source that prints one ``RESULTS <json>`` line; ``sys.argv[1]`` is
    the checkout) in a subprocess under Triton's interpreter (``TRITON_INTERPRET=1``: it is
    chosen when a kernel is defined, so it needs a fresh process) and return that JSON."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", child, str(ROOT)], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=900)
    lines = [x for x in run.stdout.splitlines() if x.startswith("RESULTS ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    return json.loads(lines[-1][len("RESULTS "):])

#: (num_q_heads, num_kv_heads, head_dim): the shapes vLLM's FlashAttention-3 takes that the
#: kernels must accept; GQA ratios 1..8, head_dim 64/80/96/128/256, rows that are and are not
#: a multiple of the kernel's chunk
HEAD_SHAPES = [
    (9, 3, 64),  # SmolLM2-135M: 192-element rows
    (4, 2, 64),
    (10, 2, 64),  # ratio 5
    (8, 1, 128),  # MQA, ratio 8
    (32, 8, 128),  # Llama-3-8B / Qwen3-8B
    (12, 2, 128),  # ratio 6
    (32, 32, 128),  # MHA, 4096-element rows
    (8, 4, 256),  # 4 x 256
    (8, 1, 80),  # head_dim 80: a padded, masked row
    (5, 5, 80),  # MHA 5 x 80 = 400: padded, two chunks
    (6, 3, 96),  # 288: padded, two chunks
    (7, 1, 96),  # ratio 7
]


def shape_id(shape) -> str:
    hq, hkv, d = shape
    return f"{hq}q-{hkv}x{d}"


def paged_layers(num_layers, ctx_lens, hkv, d, block_size, device, dtype, seed=0, separate=False):
    """Key caches of ``num_layers`` layers in vLLM's layout ``[num_blocks, 2, block_size,
    kv_heads, head_dim]`` (keys: ``unbind(1)[0]``), carved from one allocation or, with
    ``separate``, one allocation each (as vLLM allocates them); and a shuffled block table
    ``(num_seqs, max_blocks)`` int32 giving each sequence its own blocks."""
    g = torch.Generator().manual_seed(seed)
    block_table, num_blocks = shuffled_block_table(ctx_lens, block_size, g)
    kv = torch.randn(num_layers, num_blocks, 2, block_size, hkv, d, generator=g).to(dtype).to(device)
    layers = [kv[l].clone() if separate else kv[l] for l in range(num_layers)]
    return [x.unbind(1)[0] for x in layers], block_table.to(device)


def check_score_kernel(device, shape, ctx_lens, nq=2, num_layers=2, block_size=16, dtype=torch.bfloat16,
                       separate=False, softcap=0.0):
    """The all-layers Triton score kernel (and the one-layer wrapper) against the reference
    for one head shape: same ``-inf`` pattern, relative error of the finite scores < 1e-4.
    With ``softcap`` the logits are soft-capped (the queries are scaled so that many exceed
    the cap) and the weights include a fraction, which must apply after the cap."""
    from vegas.kernels import collect_scores_layers_reference, collect_scores_reference
    from vegas.kernels.triton_score import collect_scores_layers_triton, collect_scores_triton

    hq, hkv, d = shape
    kcs, bt = paged_layers(num_layers, ctx_lens, hkv, d, block_size, device, dtype, hq * 1000 + hkv * 10 + d,
                           separate)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(num_layers, len(ctx_lens), nq, hq, d, generator=g).to(dtype).to(device)
    w = torch.ones(len(ctx_lens), nq)
    w[0, -1] = 0.0  # a masked repeat
    if softcap:
        q = q * 3
        w[1, 0] = 0.5
    w = w.to(device)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    max_len = max(ctx_lens) + 5
    scale = d**-0.5
    got = collect_scores_layers_triton(q, w, kcs, bt, ctx, max_len, scale, softcap=softcap)
    want = collect_scores_layers_reference(q.double(), w.double(), [k.double() for k in kcs], bt, ctx, max_len, scale,
                                           softcap)
    _assert_scores_close(got, want)
    # layer by layer into one buffer (``vllm.score_overlap``): each layer's cache as its own base
    # (offset 0), written into its row of ``out``; the same programs (on the GPU the query fold's
    # reduction may round differently for one layer than for all, hence close, not equal, there)
    by_layer = torch.full_like(got, float("nan"))
    zero = (torch.zeros(1, dtype=torch.int64, device=device), 16)
    for l in range(num_layers):
        collect_scores_layers_triton(q[l : l + 1], w, [kcs[l]], bt, ctx, max_len, scale, key_offsets=zero,
                                     softcap=softcap, out=by_layer[l : l + 1])
    if device == "cpu":
        assert torch.equal(by_layer, got)
    _assert_scores_close(by_layer, want)
    one = collect_scores_triton(q[1], kcs[1], bt, ctx, max_len, scale, softcap)
    _assert_scores_close(one, collect_scores_reference(q[1].double(), kcs[1].double(), bt, ctx, max_len, scale,
                                                       softcap))


def _assert_scores_close(got, want):
    assert not torch.isnan(got).any()
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)
    assert (got[~finite] < 0).all()
    err = (got[finite].double() - want[finite].double()).norm() / want[finite].double().norm()
    assert err < 1e-4, err


def check_quest_kernel(device, shape, pages, dtype=torch.bfloat16):
    """The Triton Quest page-score kernel against the reference for one head shape."""
    from vegas.kernels.quest_pages import group_query, page_scores_reference
    from vegas.kernels.triton_quest import page_scores_triton

    hq, hkv, d = shape
    g = torch.Generator().manual_seed(5)
    n = 5
    nb = n * pages + 3  # distinct blocks for every request's table
    kmin = torch.randn(nb + 1, hkv, d, generator=g).to(dtype)
    kmax = (kmin.float() + torch.rand(nb + 1, hkv, d, generator=g)).to(dtype)
    bt = torch.randperm(nb, generator=g)[: n * pages].view(n, pages).to(torch.int32)
    q = torch.randn(n, hq, d, generator=g).to(dtype)
    num_pages = torch.tensor([pages, max(pages - 7, 0), 1, 0, pages // 2])
    kmin, kmax, bt, q, num_pages = (t.to(device) for t in (kmin, kmax, bt, q, num_pages))
    qp, qn = group_query(q, hkv)
    flat_min, flat_max = kmin.view(nb + 1, -1), kmax.view(nb + 1, -1)
    want = page_scores_reference(qp, qn, kmin, kmax, bt, num_pages)
    got = page_scores_triton(qp, qn, flat_min, flat_max, bt, num_pages)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    assert int(finite.sum()) == int(num_pages.clamp(max=pages).sum())
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-3)
