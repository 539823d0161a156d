"""The fused verification kernel (issue 14) on CUDA in bfloat16: against the float64 reference and
today's separate score reference (every head shape of :data:`tests.kernel_cases.HEAD_SHAPES`,
SmolLM2's 9 q / 3 kv x 64 and Qwen3-8B's 32 q / 8 kv x 128 among them), against vLLM's FA3
(``vllm.vllm_flash_attn.flash_attn_varlen_func``, skipped without vLLM), inside a CUDA graph,
and feeding :func:`vegas.kernels.select_topk_layers` the same selection as the separate kernel.
The CPU interpreter runs the small cases: ``tests/test_fused_verify_interpreted.py``."""

from __future__ import annotations

import pytest
import torch

from tests.fused_cases import check_fused, plan_rows, rel_err, verify_batch
from tests.kernel_cases import HEAD_SHAPES, shape_id

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

#: decode chunks of γ + 1 = 5, a one-token chunk, a 200-token prefill chunk; contexts up to 4K
CHUNKS, CTXS = [5, 5, 1, 200, 5], [1000, 17, 4096, 300, 2500]


@cuda
@pytest.mark.parametrize("num_splits", [None, 1, 4])
@pytest.mark.parametrize("shape", HEAD_SHAPES, ids=shape_id)
def test_fused_matches_reference_bf16(shape, num_splits):
    pytest.importorskip("triton")
    for selector in ("collect2", "aggregated"):
        check_fused("cuda", shape, CHUNKS, CTXS, selector=selector, num_splits=num_splits, dtype=torch.bfloat16,
                    out_tol=1e-2)


def _fa3(b, out):
    fa = pytest.importorskip("vllm.vllm_flash_attn")
    fa.flash_attn_varlen_func(
        q=b["q"], k=b["k_cache"], v=b["v_cache"], out=out, cu_seqlens_q=b["cu_seqlens_q"],
        max_seqlen_q=b["max_seqlen_q"], seqused_k=b["seq_lens"], max_seqlen_k=int(b["seq_lens"].max()),
        softmax_scale=b["scale"], causal=True, block_table=b["block_table"], fa_version=3,
    )
    return out


@cuda
@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 8, 128), (6, 2, 64), (8, 1, 80), (8, 4, 256)], ids=shape_id)
def test_fused_matches_fa3_bf16(shape):
    """Same output as FA3 within bf16 rounding: the fused kernel's error against the float64
    reference is at most twice FA3's (plus 1e-3), and the two differ by < 1e-2 (relative norm)."""
    from vegas.kernels.fused_reference import fused_verify_reference
    from vegas.kernels.triton_fused_verify import fused_verify_attention

    b = verify_batch(CHUNKS, CTXS, shape, dtype=torch.bfloat16, device="cuda", pad_tokens=0)
    args = (b["q"], b["k_cache"], b["v_cache"], b["block_table"], b["cu_seqlens_q"], b["seq_lens"])
    fa = _fa3(b, torch.empty_like(b["q"]))
    want, _ = fused_verify_reference(*args, b["scale"])
    for splits in (None, 1, 8):
        got = fused_verify_attention(*args, b["max_seqlen_q"], b["scale"], num_splits=splits)
        assert rel_err(got, fa) < 1e-2
        assert rel_err(got, want) <= 2 * rel_err(fa, want) + 1e-3, (splits, rel_err(got, want), rel_err(fa, want))


@cuda
def test_fused_replays_in_a_cuda_graph():
    """Captured once (fixed grid: num_splits given), replayed after the queries, the lengths and
    the plan change in place: output and scores follow the new batch."""
    from vegas.kernels.fused_reference import fused_verify_reference
    from vegas.kernels.triton_fused_verify import fused_verify_attention

    b = verify_batch([5, 5, 5, 5], [900, 40, 3000, 1200], (32, 8, 128), dtype=torch.bfloat16, device="cuda",
                     pad_tokens=0)
    q, sl, cu = b["q"], b["seq_lens"], b["cu_seqlens_q"]
    q_idx, q_weight, ctx_sel = plan_rows(cu, sl, 4, "aggregated")
    scores = torch.empty(2, 4, 4096, device="cuda")
    out = torch.empty_like(q)
    cache = (b["k_cache"], b["v_cache"], b["block_table"])

    def step():
        fused_verify_attention(q, *cache, cu, sl, 5, b["scale"], out=out, scores=scores[1], q_idx=q_idx,
                               q_weight=q_weight, ctx_sel=ctx_sel, score_span=5, num_splits=4)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in ([905, 45, 3005, 1205], [300, 1000, 6, 1205]):  # the second: shorter and longer contexts
        q.copy_(torch.randn_like(q))
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        for buf, val in zip((q_idx, q_weight, ctx_sel), plan_rows(cu, sl, 4, "aggregated")):
            buf.copy_(val)
        graph.replay()
        torch.cuda.synchronize()
        want, want_sc = fused_verify_reference(q, *cache, cu, sl, b["scale"], q_idx, q_weight, ctx_sel, 4096)
        assert rel_err(out, want) < 1e-2
        finite = torch.isfinite(want_sc)
        assert torch.equal(torch.isfinite(scores[1]), finite)
        assert rel_err(scores[1][finite], want_sc[finite]) < 1e-4


@cuda
@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 8, 128)], ids=shape_id)
def test_fused_scores_select_as_the_separate_kernel(shape):
    """The fused kernel's score rows of two layers, in the ``(L, num_seqs, max_len)`` buffer,
    give the same top-k slots as the separate Triton kernel's (ties aside)."""
    from vegas.kernels import select_topk_layers
    from vegas.kernels.triton_fused_verify import fused_verify_attention
    from vegas.kernels.triton_score import collect_scores_layers_triton

    chunks, ctxs = [5, 5, 5], [8000, 3000, 12000]
    layers = [verify_batch(chunks, ctxs, shape, dtype=torch.bfloat16, device="cuda", seed=l, pad_tokens=0)
              for l in range(2)]
    b0 = layers[0]
    q_idx, q_weight, ctx_sel = plan_rows(b0["cu_seqlens_q"], b0["seq_lens"], 4, "collect2")
    max_len = int(b0["seq_lens"].max())
    fused = torch.empty(2, 3, max_len, device="cuda")
    for l, b in enumerate(layers):
        fused_verify_attention(b["q"], b["k_cache"], b["v_cache"], b["block_table"], b["cu_seqlens_q"], b["seq_lens"],
                               5, b["scale"], scores=fused[l], q_idx=q_idx, q_weight=q_weight, ctx_sel=ctx_sel,
                               score_span=5)
    # the separate path: one block table for both layers is what vLLM has, so compare per layer
    budgets = torch.full((3,), 512, dtype=torch.int64, device="cuda")
    for l, b in enumerate(layers):
        rows = b["q"][q_idx.reshape(-1)].view(1, 3, 2, *b["q"].shape[1:])
        sep = collect_scores_layers_triton(rows, q_weight, [b["k_cache"]], b["block_table"], ctx_sel, max_len,
                                           b["scale"])
        finite = torch.isfinite(sep[0])
        assert torch.equal(torch.isfinite(fused[l]), finite)
        assert rel_err(fused[l][finite], sep[0][finite]) < 1e-4
        got = select_topk_layers(fused[l : l + 1].clone(), budgets, 512, b["block_table"], 16)
        ref = select_topk_layers(sep.clone(), budgets, 512, b["block_table"], 16)
        for s in range(3):
            diff = set(got[0, s].tolist()) ^ set(ref[0, s].tolist())
            assert len(diff) <= 10, (l, s, len(diff))
