"""The Triton score kernel and top-k against the reference on CUDA, for every head shape of
:data:`tests.kernel_cases.HEAD_SHAPES` (the reference maths on the CPU: tests/test_kernels.py; the
kernel on the CPU under Triton's interpreter: tests/test_kernels_interpreted.py)."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_cases import HEAD_SHAPES, check_score_kernel, shape_id
from tests.test_kernels import _paged_case
from vegas.kernels import collect_scores_reference, select_topk

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


ONE_LAYER_CASES = [  # num_seqs, ctx_lens, q_heads, kv_heads, head_dim, block_size, num_collect
    (4, [1000, 17, 4096, 1], hq, hkv, d, 16, 2) for hq, hkv, d in HEAD_SHAPES
] + [
    (3, [8191, 300, 5000], 32, 8, 128, 16, 2),
    (2, [777, 2048], 32, 8, 128, 32, 5),
]


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", ONE_LAYER_CASES, ids=lambda c: f"{c[2]}q-{c[3]}x{c[4]}-bs{c[5]}-nq{c[6]}")
def test_triton_matches_reference_gpu(shape, dtype):
    triton_score = pytest.importorskip("vegas.kernels.triton_score")
    num_seqs, ctx_lens, hq, hkv, d, bs, nq = shape
    q, kv, bt, ctx = _paged_case(num_seqs, ctx_lens, hq, hkv, d, bs, nq, "cuda", dtype)
    key_cache = kv.unbind(1)[0]
    max_len = max(ctx_lens) + 5
    out = torch.full((num_seqs, max_len), float("nan"), device="cuda")  # poison
    out = triton_score.collect_scores_triton(q, key_cache, bt, ctx, max_len, scale=d**-0.5)
    ref = collect_scores_reference(q.double(), key_cache.double(), bt, ctx, max_len, scale=d**-0.5)
    assert not torch.isnan(out).any()
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), finite)
    err = (out[finite].double() - ref[finite].double()).norm() / ref[finite].double().norm()
    assert err < 1e-4, err
    # top-k: every selected position scores at least the reference k-th value (ties aside)
    budgets = torch.clamp(ctx.long(), max=256)
    slots_t, _ = select_topk(out, budgets, 256, bt, bs)
    slots_r, _ = select_topk(ref.float(), budgets, 256, bt, bs)
    for s in range(num_seqs):
        k = int(budgets[s])
        a, b = set(slots_t[s, :k].tolist()), set(slots_r[s, :k].tolist())
        assert len(a ^ b) <= 2 * max(1, k // 100), (s, len(a ^ b))


@cuda
@pytest.mark.parametrize("softcap", [0.0, 50.0], ids=["raw", "softcap"])
@pytest.mark.parametrize("shape", [(32, 8, 128), (9, 3, 64), (8, 1, 80), (8, 4, 256)], ids=shape_id)
def test_triton_bandwidth_report(capsys, shape, softcap):
    """Times the kernel at a long context (informational; the device script prints it): 8 x 128
    is the tuned shape (4.1-4.4 TB/s of keys on an H200), 3 x 64 SmolLM2's, 1 x 80 a masked row,
    4 x 256 Gemma 2's (soft-capped: one dot product per query row and head instead of one per key)."""
    triton_score = pytest.importorskip("vegas.kernels.triton_score")
    import triton.testing

    hq, hkv, d = shape
    q, kv, bt, ctx = _paged_case(8, [32768] * 8, hq, hkv, d, 16, 2, "cuda", torch.bfloat16)
    key_cache = kv.unbind(1)[0]
    ms = triton.testing.do_bench(
        lambda: triton_score.collect_scores_triton(q, key_cache, bt, ctx, 32768, softcap=softcap),
        return_mode="median",
    )
    gbytes = 8 * 32768 * hkv * d * 2 / 1e9
    with capsys.disabled():
        print(f"\n[score kernel{' softcap' if softcap else ''}] 8 seqs x 32K ctx, {hkv} kv heads x {d}: "
              f"{ms*1e3:.1f} us, {gbytes/ms*1e3:.0f} GB/s of keys")


@cuda
@pytest.mark.parametrize("nq", [2, 5])
@pytest.mark.parametrize("shape", HEAD_SHAPES, ids=shape_id)
def test_triton_all_layers_matches_reference_gpu(shape, nq):
    """Three layers in separate allocations (as vLLM allocates them), one collect query of one
    request weighted 0, every head shape."""
    check_score_kernel("cuda", shape, [3000, 17, 1200, 0], nq=nq, num_layers=3, separate=True)


@cuda
@pytest.mark.parametrize("nq", [2, 5])
@pytest.mark.parametrize("shape", HEAD_SHAPES, ids=shape_id)
def test_soft_capped_triton_matches_reference_gpu(shape, nq):
    """Gemma 2's ``logits_soft_cap`` on the GPU (``tl.dot`` per KV head), every head shape."""
    check_score_kernel("cuda", shape, [3000, 17, 1200, 0], nq=nq, num_layers=3, separate=True, softcap=1.5)
