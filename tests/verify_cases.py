"""Shared cases of the verification-attention tests and bench: a verification batch over a
paged cache in vLLM's layout and the scored rows as the vLLM plan picks them (the FA3 score
extension's GPU test, ``tests/gpu/test_fa3_scores_cuda.py``; ``scripts/fused_verify_bench.py``) and
the shuffled block table the score kernels' cases use too (``tests/kernel_cases.py``)."""

from __future__ import annotations

import torch


def shuffled_block_table(lens, block_size, g):
    """``(block_table, num_blocks)``: a pool of blocks in a shuffled order (``g`` draws it), every
    sequence of ``lens[s]`` tokens its own blocks (one spare each, three unused in the pool);
    ``block_table`` is ``(num_seqs, max_blocks)`` int32 on the CPU."""
    per_seq = [(n + block_size - 1) // block_size + 1 for n in lens]
    num_blocks = sum(per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g)
    block_table = torch.zeros(len(lens), max(per_seq), dtype=torch.int32)
    used = 0
    for s, nb in enumerate(per_seq):
        block_table[s, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    return block_table, num_blocks


def verify_batch(chunks, ctxs, shape, block_size=16, dtype=torch.float32, device="cpu", seed=0, pad_tokens=3):
    """A verification batch: request ``s`` has ``ctxs[s]`` cached positions before a chunk of
    ``chunks[s]`` queries (so ``seq_lens = ctxs + chunks``), keys and values in one
    ``[num_blocks, 2, block_size, kv_heads, head_dim]`` cache with shuffled blocks, and
    ``pad_tokens`` padding queries after the last request (as a captured batch has).

    Returns a dict: ``q``, ``k_cache``, ``v_cache``, ``block_table``, ``cu_seqlens_q``,
    ``seq_lens``, ``max_seqlen_q``, ``scale``."""
    hq, hkv, d = shape
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctxs, chunks)]
    block_table, num_blocks = shuffled_block_table(seq_lens, block_size, g)
    kv = torch.randn(num_blocks, 2, block_size, hkv, d, generator=g).to(dtype).to(device)
    k_cache, v_cache = kv.unbind(1)
    cu = torch.tensor([0] + list(torch.tensor(chunks).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(cu[-1]) + pad_tokens, hq, d, generator=g).to(dtype).to(device)
    return dict(
        q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table.to(device), cu_seqlens_q=cu.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), max_seqlen_q=max(chunks),
        scale=d**-0.5,
    )


def plan_rows(cu_seqlens_q, seq_lens, gamma, selector):
    """``(q_idx, q_weight, ctx_sel)`` as :func:`vegas.vllm_plugin.selection.state.make_plan` builds them:
    the scored rows are among the last ``γ + 1`` tokens of each chunk (collect2: the first and
    last of them; aggregated: all of them) and ``ctx_sel`` is the position of the first."""
    n = seq_lens.shape[0]
    start, end = cu_seqlens_q[:n].long(), cu_seqlens_q[1 : n + 1].long()
    first = torch.maximum(start, end - 1 - gamma)
    ctx_sel = torch.clamp(seq_lens.long() - (end - first), min=0)
    if selector == "collect2":
        q_idx = torch.stack([first, end - 1], dim=1)
        q_weight = torch.ones(q_idx.shape, dtype=torch.float32, device=q_idx.device)
        q_weight[:, 1] = (end - 1 > first).float()
    else:
        raw = first[:, None] + torch.arange(gamma + 1, device=first.device)[None, :]
        q_weight = (raw <= (end - 1)[:, None]).float()
        q_idx = torch.minimum(raw, (end - 1)[:, None])
    return q_idx, q_weight, ctx_sel


def rel_err(got, want):
    return float((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30))



def assert_same_scores(scores, want, block_table, ctx_sel, k=64, recent=8, block_size=16):
    """``scores`` (a score-writing kernel's ``(num_seqs, max_len)`` rows) equal ``want`` (the separate
    score kernel's) within fp32 rounding, ``-inf`` at the same places, and select the same ``k``
    slots per request (``recent`` kept)."""
    from vegas.kernels import select_topk_layers

    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(scores), fin)
    assert rel_err(scores[fin], want[fin]) < 1e-4  # fp32 sums in another order
    n = scores.shape[0]
    budgets = torch.full((n,), k, dtype=torch.int64, device=scores.device)
    recents = torch.full((n,), recent, dtype=torch.int64, device=scores.device)
    a = select_topk_layers(scores[None].clone(), budgets, k, block_table, block_size, recents, ctx_sel)
    w = select_topk_layers(want[None].clone(), budgets, k, block_table, block_size, recents, ctx_sel)
    assert torch.equal(a.sort(-1).values, w.sort(-1).values)


def kernel_or_skip(module: str):
    """The score kernel module ``module`` (``vegas.kernels.fa3_scores``, ``.cute_probe``) when it
    can run here; the calling test skips otherwise (no CUDA GPU, or its ``unavailable_reason()``)."""
    import importlib

    import pytest

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    kernel = importlib.import_module(module)
    reason = kernel.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    return kernel


def assert_replays_from_a_cuda_graph(call, *buffers):
    """``call()`` (compiled before: nothing may compile inside a capture) writes ``buffers``; the
    values they hold now are what a replay of its captured CUDA graph must write again."""
    want = [b.clone() for b in buffers]
    for b in buffers:
        b.zero_()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    for b in buffers:
        b.zero_()
    g.replay()
    torch.cuda.synchronize()
    for b, w in zip(buffers, want):
        assert torch.equal(b, w)
