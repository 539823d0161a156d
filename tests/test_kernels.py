"""Score collection and top-k over vLLM's paged KV cache: the reference maths on the CPU (Triton
vs reference on CUDA: tests/gpu/test_kernels_cuda.py; on the CPU under Triton's interpreter:
tests/test_kernels_interpreted.py)."""

from __future__ import annotations

import torch

from vegas.kernels import collect_scores_reference, select_topk, slots_to_fa_pages


def _paged_case(num_seqs, ctx_lens, num_q_heads, num_kv_heads, head_dim, block_size, nq, device, dtype):
    """Random paged cache in vLLM's layout [num_blocks, 2, block_size, kv_heads, head_dim], shuffled blocks."""
    g = torch.Generator().manual_seed(1234 + num_seqs)
    blocks_per_seq = [(n + block_size - 1) // block_size + 1 for n in ctx_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(blocks_per_seq)
    block_table = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    used = 0
    for s, nb in enumerate(blocks_per_seq):
        block_table[s, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    kv = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(num_seqs, nq, num_q_heads, head_dim, generator=g).to(dtype)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    return q.to(device), kv.to(device), block_table.to(device), ctx.to(device)


def _dense_scores(q, kv, block_table, ctx, max_len, scale, softcap=0.0, weights=None):
    """Independent dense computation: gather each sequence's keys, softmax-free logits (capped,
    weighted per query), sum."""
    block_size = kv.shape[2]
    group = q.shape[2] // kv.shape[3]
    out = torch.full((q.shape[0], max_len), float("-inf"), dtype=torch.float64)
    for s in range(q.shape[0]):
        n = int(ctx[s])
        keys = torch.stack([kv[block_table[s, p // block_size], 0, p % block_size] for p in range(n)])
        keys = keys.double()
        acc = torch.zeros(n, dtype=torch.float64)
        for t in range(q.shape[1]):
            for h in range(q.shape[2]):
                logit = scale * keys[:, h // group] @ q[s, t, h].double()
                if softcap:
                    logit = softcap * torch.tanh(logit / softcap)
                acc += logit * (1.0 if weights is None else float(weights[s, t]))
        out[s, :n] = acc
    return out


def test_reference_matches_dense_logit_sum():
    q, kv, bt, ctx = _paged_case(3, [37, 5, 64], 6, 2, 16, 16, 2, "cpu", torch.float32)
    key_cache = kv.unbind(1)[0]
    ref = collect_scores_reference(q, key_cache, bt, ctx, 70, scale=0.125)
    dense = _dense_scores(q, kv, bt, ctx, 70, 0.125)
    assert torch.isinf(ref[1, 5:]).all() and torch.isinf(ref[0, 37:]).all()
    finite = torch.isfinite(dense)
    torch.testing.assert_close(ref[finite].double(), dense[finite], rtol=1e-5, atol=1e-4)


def test_reference_soft_cap_caps_each_logit_before_the_weighted_sum():
    """Gemma 2 (``logits_soft_cap``): each logit is capped, then weighted, then summed; the
    capped scores rank differently from the raw ones (so passing the cap through matters)."""
    q, kv, bt, ctx = _paged_case(3, [37, 5, 64], 6, 2, 16, 16, 2, "cpu", torch.float32)
    q = q * 4  # logits far beyond the cap
    key_cache = kv.unbind(1)[0]
    weights = torch.tensor([[1.0, 0.5], [1.0, 0.0], [0.25, 1.0]])
    ref = collect_scores_reference(q, key_cache, bt, ctx, 70, 0.25, softcap=1.5, weights=weights)
    dense = _dense_scores(q, kv, bt, ctx, 70, 0.25, softcap=1.5, weights=weights)
    finite = torch.isfinite(dense)
    assert torch.equal(torch.isfinite(ref), finite)
    torch.testing.assert_close(ref[finite].double(), dense[finite], rtol=1e-5, atol=1e-4)
    raw = collect_scores_reference(q, key_cache, bt, ctx, 70, 0.25, weights=weights)
    assert not torch.equal(raw[2, :64].argsort(), ref[2, :64].argsort())


def test_select_topk_known_positions():
    scores = torch.full((2, 8), float("-inf"))
    scores[0, :6] = torch.tensor([0.1, 5.0, -1.0, 3.0, 2.0, 0.0])
    scores[1, :3] = torch.tensor([1.0, 2.0, 3.0])
    block_table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)  # block_size 4
    budgets = torch.tensor([3, 2])
    slots, counts = select_topk(scores, budgets, 3, block_table, 4)
    # seq 0: positions {1, 3, 4} -> block 2 offs 1, 3; block 0 off 0 -> slots {9, 11, 0}
    assert sorted(slots[0].tolist()) == [0, 9, 11]
    # seq 1: positions {1, 2} in block 1 -> slots {5, 6}; third column unused
    assert sorted(slots[1, :2].tolist()) == [5, 6] and slots[1, 2].item() == -1
    assert counts.tolist() == [3, 2]


def test_fa_page_view_addresses_keys_and_values():
    """Pages of the flat page-size-1 view address the same K (and V, bs pages later) as slots."""
    nb, bs, h, d = 5, 16, 2, 8
    kv = torch.randn(nb, 2, bs, h, d)
    flat = kv.view(nb * 2 * bs, 1, h, d)
    k_view, v_view = flat[:-bs], flat[bs:]
    slots = torch.tensor([0, 15, 16, 33, 79])
    pages = slots_to_fa_pages(slots, bs, 2 * bs)
    for s, p in zip(slots.tolist(), pages.tolist()):
        torch.testing.assert_close(k_view[p, 0], kv[s // bs, 0, s % bs])
        torch.testing.assert_close(v_view[p, 0], kv[s // bs, 1, s % bs])
