"""FA3 from vLLM over the page-size-1 view of vLLM's interleaved K/V cache (needs CUDA + vLLM)."""

from __future__ import annotations

import pytest
import torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_sparse_draft_attention_matches_dense_reference():
    fa = pytest.importorskip("vllm.vllm_flash_attn")
    from vegas.kernels import slots_to_fa_pages
    from vegas.vllm_plugin.attention import page_views

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
