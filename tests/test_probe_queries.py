"""The probe queries of the CuTe score path (:mod:`vegas.kernels.probe_queries`, issue 22) on the CPU:
the packed layout, the probe rows' values, padding tokens past the last chunk, the Triton kernel
(interpreted) equal to the PyTorch path (the probe sums to ~16 bits, everything else bit for bit), and — with plain PyTorch attention standing in for the CuTe kernel — that the
packed batch gives each chunk token the attention it had (causal alignment kept) while rows 0
and 8 of each KV head's tile carry the selection scores of the separate kernel's definition."""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernel_cases import run_interpreted
from vegas.kernels.cute_probe import reference_scores
from vegas.kernels.probe_queries import PROBE_ROWS, pack_probe_queries, probe_tokens

#: (num_q_heads, num_kv_heads, head_dim): G = 1, 3 (SmolLM2), 4 (Qwen3-8B), 8, 9
SHAPES = [(4, 4, 32), (9, 3, 64), (32, 8, 128), (16, 2, 64), (9, 1, 64)]
#: chunk lengths of one batch: an empty chunk (a padded request), one query, γ + 1 = 5, 3
CHUNKS = [5, 0, 1, 3, 5]


def _batch(shape, chunks=CHUNKS, seed=0, dtype=torch.bfloat16):
    hq, hkv, d = shape
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + list(torch.tensor(chunks).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=g).to(dtype)
    return q, cu


def _split(packed, cu_p, rows, shape):
    """``(chunk rows, probe sums (seqs, kv, d) float32 = hi + lo, every other probe row)`` of a packed batch."""
    hq, hkv, d = shape
    group = hq // hkv
    probes = probe_tokens(group)
    tiles = torch.stack([packed[int(a) : int(a) + probes] for a in cu_p[:-1]])  # [seqs, P, hq, d]
    tiles = tiles.view(-1, probes, hkv, group, d).transpose(1, 2).reshape(-1, hkv, probes * group, d)
    others = [r for r in range(probes * group) if r not in PROBE_ROWS]
    sums = tiles[:, :, PROBE_ROWS[0]].float() + tiles[:, :, PROBE_ROWS[1]].float()
    return packed[rows.long()], sums, tiles[:, :, others]


def test_probe_tokens():
    assert [probe_tokens(g) for g in (1, 2, 3, 4, 8, 9, 16)] == [9, 5, 3, 3, 2, 1, 1]
    with pytest.raises(ValueError, match="group"):
        probe_tokens(0)


@pytest.mark.parametrize("edges", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}q{s[1]}kv{s[2]}")
def test_packed_layout_and_probe_values(shape, edges):
    hq, hkv, d = shape
    group, scale = hq // hkv, d**-0.5
    q, cu = _batch(shape)
    packed, cu_p, rows = pack_probe_queries(q, cu, hkv, scale, edges)
    probes = probe_tokens(group)
    seqs = len(CHUNKS)
    assert packed.shape == (q.shape[0] + probes * seqs, hq, d)
    assert cu_p.tolist() == [int(c) + probes * s for s, c in enumerate(cu)]
    assert torch.equal(packed[rows.long()], q)  # every chunk token, unchanged, after its request's probes
    for s in range(seqs):
        start, end, dst = int(cu[s]), int(cu[s + 1]), int(cu_p[s])
        assert rows[start:end].tolist() == list(range(dst + probes, dst + probes + end - start))
        tile = packed[dst : dst + probes].view(probes, hkv, group, d).transpose(0, 1).reshape(hkv, probes * group, d)
        others = [r for r in range(probes * group) if r not in PROBE_ROWS]
        assert tile[:, others].eq(0).all()
        if end == start:
            assert tile.eq(0).all()
            continue
        want = q[start].float() + (q[end - 1].float() if edges else 0)  # a one-query chunk: its row twice
        want = want.view(hkv, group, d).sum(1) * scale
        hi, lo = tile[:, PROBE_ROWS[0]], tile[:, PROBE_ROWS[1]]
        assert torch.equal(hi, want.to(q.dtype))
        got = hi.float() + lo.float()
        assert (got - want).abs().max() <= 2**-15 * want.abs().max()  # ~16 mantissa bits, not bf16's 8


@pytest.mark.parametrize("edges", [True, False])
def test_probe_scores_are_the_reference_and_chunks_keep_their_attention(edges):
    """Plain causal attention over the packed batch (PyTorch, float32) stands in for the CuTe
    kernel: rows 0 + 8 of each KV head's tile, before the softmax, are
    :func:`reference_scores`'s scores for the keys before the chunk, and each chunk token's
    output is the one it gets without the probes."""
    hq, hkv, d = 32, 8, 128
    group, scale = hq // hkv, d**-0.5
    chunks, ctxs = [5, 1, 3], [40, 17, 64]
    q, cu = _batch((hq, hkv, d), chunks)
    g = torch.Generator().manual_seed(1)
    keys = [torch.randn(c + n, hkv, d, generator=g).to(torch.bfloat16) for c, n in zip(ctxs, chunks)]
    values = [torch.randn(c + n, hkv, d, generator=g).to(torch.bfloat16) for c, n in zip(ctxs, chunks)]
    packed, cu_p, rows = pack_probe_queries(q, cu, hkv, scale, edges)
    probes = probe_tokens(group)

    def attend(queries, k, v):  # causal, the last query sees every key
        n = queries.shape[0]
        logits = torch.einsum("thd,phd->htp", queries.float(), k.float().repeat_interleave(group, 1))
        mask = torch.arange(k.shape[0])[None, :] > (k.shape[0] - n + torch.arange(n))[:, None]
        w = torch.softmax((logits * scale).masked_fill(mask, -math.inf), -1)
        return torch.einsum("htp,phd->thd", w, v.float().repeat_interleave(group, 1)), logits

    out_p = torch.empty(packed.shape)
    for s, (k, v) in enumerate(zip(keys, values)):
        a, b = int(cu_p[s]), int(cu_p[s + 1])
        out_p[a:b], logits = attend(packed[a:b], k, v)
        raw = logits.view(hkv, group, b - a, -1).transpose(1, 2).reshape(hkv, (b - a) * group, -1)  # PackGQA rows
        got = raw[:, PROBE_ROWS[0], : ctxs[s]] + raw[:, PROBE_ROWS[1], : ctxs[s]]
        cache = k[None]  # one page holding the request
        table = torch.zeros(1, 1, dtype=torch.int32)
        ref = reference_scores(q[int(cu[s]) : int(cu[s + 1])], cache, table, torch.tensor([0, chunks[s]]),
                               torch.tensor([ctxs[s] + chunks[s]]), chunks[s], scale, ctxs[s],
                               "edges" if edges else "first")[0]
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4)  # a one-query chunk: its row twice in both
        own, _ = attend(q[int(cu[s]) : int(cu[s + 1])], k, v)
        assert torch.equal(out_p[rows[int(cu[s]) : int(cu[s + 1])].long()], out_p[a + probes : b])
        assert torch.allclose(out_p[a + probes : b], own, rtol=1e-5, atol=1e-6)


_CHILD = r"""
import json, sys, traceback
sys.path.insert(0, sys.argv[1])
import torch
from tests.test_probe_queries import SHAPES, _batch, _split
from vegas.kernels.probe_queries import pack_probe_queries
out = {}
for shape in SHAPES:
    for edges in (True, False):
        key = f"{shape}:{edges}"
        try:
            q, cu = _batch(shape)
            want = pack_probe_queries(q, cu, shape[1], shape[2] ** -0.5, edges, use_triton=False)
            got = pack_probe_queries(q, cu, shape[1], shape[2] ** -0.5, edges, use_triton=True)
            assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), "cu_seqlens or rows differ"
            (g_rows, g_sums, g_others), (w_rows, w_sums, w_others) = _split(*got, shape), _split(*want, shape)
            assert torch.equal(g_rows, w_rows) and torch.equal(g_others, w_others), "chunk or zero rows differ"
            # the float32 sums may round differently (summation order): hi + lo agree to ~16 bits
            assert (g_sums - w_sums).abs().max() <= 2**-14 * w_sums.abs().max(), "probe sums differ"
            out[key] = "ok"
        except Exception:
            out[key] = traceback.format_exc()[-2000:]
print("RESULTS " + json.dumps(out))
"""


def test_triton_kernel_equals_the_pytorch_path():
    """Chunk rows, zero rows, ``cu_seqlens`` and token rows bit for bit, the probe sums (hi + lo)
    to ~16 bits, every shape, both row modes (the kernel under Triton's interpreter)."""
    results = run_interpreted(_CHILD)
    bad = {k: v for k, v in results.items() if v != "ok"}
    assert len(results) == 2 * len(SHAPES) and not bad, bad


@pytest.mark.parametrize("use_triton", [False, True])
def test_padding_tokens_gather_valid_rows(use_triton):
    """Tokens past ``cu_seqlens_q[-1]`` (a captured batch's padding) get distinct rows past the last
    request's, inside the packed tensor; a ``cu_seqlens_q`` past ``q`` is clamped to it."""
    if use_triton:
        results = run_interpreted(_PADDED_CHILD)
        assert results == {"ok": "ok"}, results
        return
    for cu_list in ([0, 5, 5, 5], [0, 4, 9, 12]):  # 3 padding tokens; a last chunk past q (8 rows)
        q, _ = _batch((9, 3, 64), [8])
        cu = torch.tensor(cu_list, dtype=torch.int32)
        packed, cu_p, rows = pack_probe_queries(q, cu, 3, 0.125, True)
        probes, total = probe_tokens(3), min(cu_list[-1], 8)
        assert cu_p.tolist()[-1] == total + probes * 3 <= packed.shape[0]
        assert rows.tolist()[total:] == [t + probes * 3 for t in range(total, 8)]
        assert len(set(rows.tolist())) == 8 and int(rows.max()) < packed.shape[0]
        assert torch.equal(packed[rows[:total].long()], q[:total])


_PADDED_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from tests.test_probe_queries import _batch
from vegas.kernels.probe_queries import pack_probe_queries
ok = True
for cu_list in ([0, 5, 5, 5], [0, 4, 9, 12]):
    q, _ = _batch((9, 3, 64), [8])
    cu = torch.tensor(cu_list, dtype=torch.int32)
    want = pack_probe_queries(q, cu, 3, 0.125, True, use_triton=False)
    got = pack_probe_queries(q, cu, 3, 0.125, True, use_triton=True)
    ok &= torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    total = min(cu_list[-1], 8)  # the chunk tokens: the same rows in both, holding the same queries
    ok &= torch.equal(got[0][got[2][:total].long()], want[0][want[2][:total].long()])
print("RESULTS " + json.dumps({"ok": "ok" if ok else "differs"}))
"""


def test_bad_arguments_are_named():
    q, cu = _batch((9, 3, 64))
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads 2"):
        pack_probe_queries(q, cu, 2, 0.1, True)
    with pytest.raises(ValueError, match="last dim must be contiguous"):
        pack_probe_queries(q.transpose(1, 2).contiguous().transpose(1, 2), cu, 3, 0.1, True)
