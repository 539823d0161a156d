"""FA3 from vLLM over the page-size-1 view of vLLM's interleaved K/V cache (needs CUDA + vLLM)."""

from __future__ import annotations

import pytest
import torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_sparse_draft_attention_matches_dense_reference():
    fa = pytest.importorskip("vllm.vllm_flash_attn")
    from vegas.kernels import slots_to_fa_pages
    from vegas.vllm_plugin.drafting.attention import page_views

    torch.manual_seed(0)
    nb, bs, hkv, hq, d = 64, 16, 2, 6, 64
    kv = torch.randn(nb, 2, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    k_view, v_view = page_views(kv)
    num_seqs, width = 3, 40
    used = torch.tensor([40, 17, 1], dtype=torch.int32, device="cuda")
    slots = torch.stack([torch.randperm(nb * bs, device="cuda")[:width] for _ in range(num_seqs)])
    table = slots_to_fa_pages(slots, bs, 2 * bs).to(torch.int32)
    q = torch.randn(num_seqs, hq, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    fa.flash_attn_varlen_func(
        q=q, k=k_view, v=v_view, out=out,
        cu_seqlens_q=torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda"),
        max_seqlen_q=1, seqused_k=used, max_seqlen_k=width, softmax_scale=d**-0.5,
        causal=True, block_table=table, fa_version=3,
    )
    for s in range(num_seqs):
        n = int(used[s])
        sl = slots[s, :n]
        k = kv[sl // bs, 0, sl % bs].float().repeat_interleave(hq // hkv, dim=1)  # [n, hq, d]
        v = kv[sl // bs, 1, sl % bs].float().repeat_interleave(hq // hkv, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[s].float(), k) * d**-0.5, dim=-1)
        ref = torch.einsum("hn,nhd->hd", w, v)
        err = (out[s].float() - ref).norm() / ref.norm()
        assert err < 2e-2, (s, err)


@cuda
@pytest.mark.parametrize("width,rows", [(40, 3), (420, 40), (1500, 5)])
def test_draft_attention_with_the_step_schedule_equals_per_layer_scheduling(width, rows):
    """One FA3 tile schedule per draft step (:func:`draft_schedule`) gives the attention each
    layer's own scheduling gives, narrow (one split) and wide (FA3's split heuristic) tables."""
    pytest.importorskip("vllm.vllm_flash_attn")
    from types import SimpleNamespace

    from vegas.kernels import slots_to_fa_pages
    from vegas.vllm_plugin.drafting.attention import DraftMetadata, draft_attention, draft_schedule

    torch.manual_seed(1)
    nb, bs, hkv, hq, d = 256, 16, 3, 9, 64
    kv = torch.randn(nb, 2, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    impl = SimpleNamespace(num_heads=hq, num_kv_heads=hkv, head_size=d, scale=d**-0.5, alibi_slopes=None,
                           sliding_window=None, logits_soft_cap=0.0, vllm_flash_attn_version=3, sinks=None)
    one = torch.ones((), device="cuda")
    layer = SimpleNamespace(_k_scale=one, _v_scale=one)
    slots = torch.stack([torch.randperm(nb * bs, device="cuda")[:width] for _ in range(rows)])
    table = slots_to_fa_pages(slots, bs, 2 * bs).to(torch.int32)
    used = torch.randint(1, width + 1, (rows,), dtype=torch.int32, device="cuda")
    qsl = torch.arange(rows + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(rows, hq, d, device="cuda", dtype=torch.bfloat16)
    outs = []
    for schedule in (None, draft_schedule(impl, used, qsl, width, torch.bfloat16)):
        md = DraftMetadata(table, used, qsl, width, rows, scheduler_metadata=schedule)
        outs.append(draft_attention(impl, layer, q, kv, md, torch.empty_like(q)).clone())
    assert torch.equal(outs[0], outs[1])
