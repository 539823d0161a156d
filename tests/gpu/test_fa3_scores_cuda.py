"""FA3 with the score output (``_vegas_fa3_C``, issue 22) on an H200, skipped without the extension
(``VEGAS_FA3_EXT=/path/_vegas_fa3_C.so``) or vLLM: its attention output is bitwise vLLM's FA3 with
and without scores and with any split count; its scores, once the KV heads are summed
(:func:`vegas.kernels.triton_score_reduce.reduce_head_scores`), equal the separate score kernel's
within fp32 rounding and give the same top-k; nothing outside ``[0, ctx_sel)`` is written; it
replays from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from tests.verify_cases import assert_replays_from_a_cuda_graph, assert_same_scores, kernel_or_skip, plan_rows, verify_batch

GAMMA = 4
#: SmolLM2, Qwen3-8B, head_dim 256 (two MMA warpgroups, one score buffer), MQA at the limit (12 x 5 rows)
SHAPES = [(9, 3, 64), (32, 8, 128), (8, 4, 256), (12, 1, 128)]
#: decode-shaped: chunks of γ + 1, a one-token chunk and a 2-token chunk; contexts up to 40K
CHUNKS, CTXS = [5, 5, 1, 2, 5], [1000, 17, 4096, 300, 40000]


def _ext():
    return kernel_or_skip("vegas.kernels.fa3_scores")


def _fa3(b, out, num_splits=0):
    fa = pytest.importorskip("vllm.vllm_flash_attn")
    fa.flash_attn_varlen_func(
        q=b["q"], k=b["k_cache"], v=b["v_cache"], out=out, cu_seqlens_q=b["cu_seqlens_q"],
        max_seqlen_q=b["max_seqlen_q"], seqused_k=b["seq_lens"], max_seqlen_k=int(b["seq_lens"].max()),
        softmax_scale=b["scale"], causal=True, block_table=b["block_table"], fa_version=3, num_splits=num_splits,
    )
    return out


def _separate(b, q_idx, q_weight, ctx_sel, max_len):
    from vegas.kernels.triton_score import collect_scores_layers_triton

    n = q_idx.shape[0]
    rows = b["q"][q_idx.reshape(-1)].view(1, n, q_idx.shape[1], *b["q"].shape[1:])
    return collect_scores_layers_triton(rows, q_weight, [b["k_cache"]], b["block_table"], ctx_sel, max_len,
                                        b["scale"])[0]


def _run(fs, b, out, ws=None, rows=None, ctx=None, num_splits=0):
    return fs.fa3_verify_attention(
        b["q"], b["k_cache"], b["v_cache"], b["block_table"], b["cu_seqlens_q"], b["seq_lens"], b["max_seqlen_q"],
        int(b["seq_lens"].max()), b["scale"], out=out, workspace=ws, score_rows=rows, score_ctx=ctx,
        num_splits=num_splits)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}q{s[1]}kv{s[2]}")
@pytest.mark.parametrize("num_splits", [0, 1, 7])
def test_output_is_fa3s_and_scores_are_the_separate_kernels(shape, num_splits):
    fs = _ext()
    from vegas.kernels.triton_score_reduce import reduce_head_scores

    hq, hkv, d = shape
    b = verify_batch(CHUNKS, CTXS, shape, dtype=torch.bfloat16, device="cuda", pad_tokens=0)
    n, max_len = len(CHUNKS), int(b["seq_lens"].max())
    q_idx, q_weight, ctx_sel = plan_rows(b["cu_seqlens_q"], b["seq_lens"], GAMMA, "collect2")
    want_out = _fa3(b, torch.empty_like(b["q"]), num_splits)
    plain = _run(fs, b, torch.empty_like(b["q"]), num_splits=num_splits)
    assert torch.equal(plain, want_out)
    ws = torch.full((hkv, n, max_len), 12345.0, device="cuda")
    rows = fs.score_rows_in_chunk(q_idx, q_weight, b["cu_seqlens_q"])
    ctx = ctx_sel.to(torch.int32)
    got_out = _run(fs, b, torch.empty_like(b["q"]), ws, rows, ctx, num_splits)
    assert torch.equal(got_out, want_out)  # the score write leaves the attention alone
    for s in range(n):  # written exactly on [0, ctx_sel)
        c = int(ctx_sel[s])
        assert (ws[:, s, c:] == 12345.0).all() and not (ws[:, s, :c] == 12345.0).any()
    scores = torch.empty(n, max_len, device="cuda")
    reduce_head_scores(ws, scores, b["cu_seqlens_q"], ctx_sel)
    assert_same_scores(scores, _separate(b, q_idx, q_weight, ctx_sel, max_len), b["block_table"], ctx_sel)


def test_deterministic_and_replays_from_a_cuda_graph():
    fs = _ext()
    b = verify_batch(CHUNKS, CTXS, (32, 8, 128), dtype=torch.bfloat16, device="cuda", pad_tokens=0)
    n, max_len = len(CHUNKS), int(b["seq_lens"].max())
    q_idx, q_weight, ctx_sel = plan_rows(b["cu_seqlens_q"], b["seq_lens"], GAMMA, "collect2")
    rows = fs.score_rows_in_chunk(q_idx, q_weight, b["cu_seqlens_q"])
    ctx = ctx_sel.to(torch.int32)
    ws, out = torch.zeros(8, n, max_len, device="cuda"), torch.empty_like(b["q"])
    _run(fs, b, out, ws, rows, ctx, 4)
    assert_replays_from_a_cuda_graph(lambda: _run(fs, b, out, ws, rows, ctx, 4), out, ws)


def test_refuses_what_it_does_not_cover():
    fs = _ext()
    b = verify_batch([20, 3], [100, 100], (32, 8, 128), dtype=torch.bfloat16, device="cuda", pad_tokens=0)
    n, max_len = 2, int(b["seq_lens"].max())
    q_idx, q_weight, ctx_sel = plan_rows(b["cu_seqlens_q"], b["seq_lens"], GAMMA, "collect2")
    ws = torch.zeros(8, n, max_len, device="cuda")
    with pytest.raises(RuntimeError, match="<= 64"):  # 20 tokens x 4 heads = 80 rows
        _run(fs, b, torch.empty_like(b["q"]), ws, fs.score_rows_in_chunk(q_idx, q_weight, b["cu_seqlens_q"]),
             ctx_sel.to(torch.int32))
