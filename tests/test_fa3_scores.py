"""CPU tests of the FA3 score path's Python side (issue 22; no vLLM, no GPU, no extension): the
kernel's argument form, what the build covers, and that a forward routed through
:meth:`SelectionState.verify_layer` selects what :meth:`SelectionState.on_layer` selects, with
the extension replaced by a PyTorch stand-in that computes what ``_vegas_fa3_C`` specifies."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vegas.kernels import collect_scores_reference, fa3_scores
from vegas.kernels.triton_score_reduce import reduce_head_scores
from vegas.vllm_plugin.selection import fa3_verify

from .test_vllm_state import BS, _block_table, _plan, _state


def test_score_rows_in_chunk_are_offsets_in_the_chunk():
    # verify chunk of 5 (rows 0, 4), prefill of 40 (its last 5: rows 35, 39), a one-token chunk
    qsl = torch.tensor([0, 5, 45, 46], dtype=torch.int32)
    seq_lens = torch.tensor([100, 40, 10], dtype=torch.int32)
    plan = _plan(qsl, seq_lens, 100, "collect2")
    rows = fa3_scores.score_rows_in_chunk(plan.q_idx, plan.q_weight, qsl)
    assert rows.dtype == torch.int32 and rows.tolist() == [[0, 4], [35, 39], [0, -1]]
    last = _plan(qsl, seq_lens, 100, "last_token")
    assert fa3_scores.score_rows_in_chunk(last.q_idx, last.q_weight, qsl).tolist() == [[0, -1], [35, -1], [0, -1]]
    out = torch.full((5, 2), 7, dtype=torch.int32)
    got = fa3_scores.score_rows_in_chunk(plan.q_idx, plan.q_weight, qsl, out=out)
    assert got.data_ptr() == out.data_ptr() and out[3:].eq(7).all()
    agg = _plan(qsl, seq_lens, 100, "aggregated")
    with pytest.raises(ValueError, match="at most 2"):
        fa3_scores.score_rows_in_chunk(agg.q_idx, agg.q_weight, qsl)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(), None),
        (dict(dtype=torch.float16), "bf16"),
        (dict(head_dim=96), "head_dim 96"),
        (dict(max_query_len=17), "packed rows"),  # 17 x 4 > 64: a prefill chunk
        (dict(max_query_len=1), "packed rows"),
        (dict(score_rows=5), "scored rows"),
        (dict(sliding_window=(127, 0)), "sliding window"),
        (dict(softcap=30.0), "soft-capping"),
        (dict(kv_cache_dtype="fp8"), "kv_cache_dtype"),
    ],
)
def test_unsupported_reason_names_what_the_build_lacks(kw, match):
    args = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, max_query_len=5)
    extra = {k: kw.pop(k) for k in list(kw) if k not in args}
    args.update(kw)
    reason = fa3_scores.unsupported_reason(**args, **extra)
    assert (reason is None) if match is None else (match in reason)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")
def test_unavailable_without_a_gpu():
    fa3_scores._loaded.clear()
    assert "no CUDA device" in fa3_scores.unavailable_reason()
    assert not fa3_scores.available()


def test_reduce_head_scores_sums_heads_and_writes_the_tail():
    part = torch.arange(2 * 3 * 6, dtype=torch.float32).view(2, 3, 6)
    scores = torch.empty(3, 6)
    cu = torch.tensor([0, 5, 5, 10], dtype=torch.int32)  # request 1 has an empty chunk
    ctx = torch.tensor([4, 3, 6])
    reduce_head_scores(part, scores, cu, ctx)
    want = part.sum(0)
    assert torch.equal(scores[0, :4], want[0, :4]) and torch.isinf(scores[0, 4:]).all()
    assert torch.equal(scores[1, :3], torch.zeros(3)) and torch.isinf(scores[1, 3:]).all()
    assert torch.equal(scores[2], want[2])


def _fake_extension(calls):
    """A stand-in for ``torch.ops._vegas_fa3_C.fwd_scores``: the attention output is left alone
    (vLLM's FA3 is not at stake here), the workspace gets each KV head's share of the scores."""

    def fa3_verify_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k,
                             scale, *, out, workspace=None, score_rows=None, score_ctx=None, scheduler_metadata=None,
                             num_splits=0):
        calls.append((q.shape[0], num_splits))
        out.fill_(1.0)
        if workspace is None:
            return out
        hkv = k_cache.shape[2]
        group = q.shape[1] // hkv
        n = score_rows.shape[0]
        for s in range(n):
            for r in score_rows[s].tolist():
                if r < 0:
                    continue
                tok = int(cu_seqlens_q[s]) + r
                for g in range(hkv):
                    qg = torch.zeros_like(q[tok : tok + 1])
                    qg[:, g * group : (g + 1) * group] = q[tok : tok + 1, g * group : (g + 1) * group]
                    sc = collect_scores_reference(qg[None].float(), k_cache, block_table[s : s + 1],
                                                  score_ctx[s : s + 1].long(), workspace.shape[2], scale)[0]
                    ctx = int(score_ctx[s])
                    if r == score_rows[s, 0].item():
                        workspace[g, s, :ctx] = sc[:ctx]
                    else:
                        workspace[g, s, :ctx] += sc[:ctx]
        return out

    return fa3_verify_attention


def _impl(hkv, window=None):
    return SimpleNamespace(vllm_flash_attn_version=3, dcp_world_size=1, num_kv_heads=hkv, sliding_window=window,
                           logits_soft_cap=None, alibi_slopes=None, sinks=None, kv_cache_dtype="auto", scale=0.5)


def assert_same_selection(st, today, num_seqs=2, num_layers=3, k=7):
    """``st`` and ``today`` (two selection states) selected the same ``k`` slots per layer and
    request, with the same selectable prefixes and budgets."""
    got, ctx_sel, budgets = st.selection(num_seqs)
    want, want_ctx, want_budgets = today.selection(num_seqs)
    assert torch.equal(ctx_sel, want_ctx) and torch.equal(budgets, want_budgets)
    for layer in range(num_layers):
        for i in range(num_seqs):
            assert sorted(got[layer, i, :k].tolist()) == sorted(want[layer, i, :k].tolist())


@pytest.mark.parametrize("bad_layer", [None, 1])
def test_verify_layer_selects_what_on_layer_selects(monkeypatch, bad_layer):
    """SmolLM2's heads (9 q / 3 kv x 64), two verification requests, three layers: the FA3 score
    path (here a stand-in extension) and today's path select the same slots; a layer the build
    does not cover (a sliding window) runs vLLM's FA3 and is scored alone, and the forward still
    selects the same."""
    calls = []
    monkeypatch.setattr(fa3_scores, "unavailable_reason", lambda: None)
    monkeypatch.setattr(fa3_scores, "fa3_verify_attention", _fake_extension(calls))
    hq, hkv, d = 9, 3, 64
    lens = [70, 40]
    bt, nb = _block_table(lens, 3)
    qsl = torch.tensor([0, 5, 10], dtype=torch.int32)
    md = SimpleNamespace(query_start_loc=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32), max_seq_len=70,
                         max_query_len=5, num_actual_tokens=10, block_table=bt, scheduler_metadata=None,
                         max_num_splits=0, use_cascade=False, causal=True)
    torch.manual_seed(0)
    kvs = [torch.randn(nb, 2, BS, hkv, d).to(torch.bfloat16) for _ in range(3)]
    queries = [torch.randn(12, hq, d).to(torch.bfloat16) for _ in range(3)]  # 2 padding tokens

    today = _state("collect2", kv_budget=7, first_layer=0, last_layer=2, layers_ready=True)
    for layer in range(3):
        today.on_layer(layer, queries[layer], kvs[layer], md, 0.5)

    st = _state("collect2", kv_budget=7, first_layer=0, last_layer=2, layers_ready=True)
    fallback = []
    for layer in range(3):
        impl = _impl(hkv, window=(31, 0) if layer == bad_layer else None)
        out = torch.zeros(12, hq, d, dtype=torch.bfloat16)
        if st.verify_layer(impl, layer, queries[layer], kvs[layer], md, out):
            assert out[:10].eq(1).all() and out[10:].eq(0).all()  # only the actual tokens
        else:  # what the attention override does: vLLM's FA3, then on_layer
            fallback.append(layer)
            st.on_layer(layer, queries[layer], kvs[layer], md, 0.5)
    assert fallback == ([] if bad_layer is None else [bad_layer])
    assert len(calls) == 3 - len(fallback)
    assert not st.fa3.active  # the forward is over
    assert_same_selection(st, today)
    # the next forward knows the uncovered layer: today's path throughout
    out = torch.zeros(12, hq, d, dtype=torch.bfloat16)
    routed = st.verify_layer(_impl(hkv), 0, queries[0], kvs[0], md, out)
    assert routed == (bad_layer is None)


def test_prefill_forwards_and_other_selectors_take_todays_path(monkeypatch):
    monkeypatch.setattr(fa3_scores, "unavailable_reason", lambda: None)
    monkeypatch.setattr(fa3_scores, "fa3_verify_attention", lambda *a, **k: pytest.fail("extension called"))
    hq, hkv, d = 32, 8, 128
    bt, nb = _block_table([40], 1)
    md = SimpleNamespace(query_start_loc=torch.tensor([0, 40], dtype=torch.int32),
                         seq_lens=torch.tensor([40], dtype=torch.int32), max_seq_len=40, max_query_len=40,
                         num_actual_tokens=40, block_table=bt, scheduler_metadata=None, max_num_splits=0,
                         use_cascade=False, causal=True)
    q, kv = torch.randn(40, hq, d).to(torch.bfloat16), torch.randn(nb, 2, BS, hkv, d).to(torch.bfloat16)
    st = _state("collect2", kv_budget=7, first_layer=0, last_layer=1, layers_ready=True)
    assert not st.verify_layer(_impl(hkv), 0, q, kv, md, torch.empty_like(q))  # 40 x 4 rows > 64
    st = _state("sliding_window", kv_budget=6, first_layer=0, last_layer=1, layers_ready=True)
    assert not st.verify_layer(_impl(hkv), 0, q[:5], kv, md, torch.empty_like(q))
    assert st.fa3 is None


def test_the_path_is_announced_once(monkeypatch, caplog):
    monkeypatch.setattr(fa3_scores, "unavailable_reason", lambda: "extension _vegas_fa3_C not loaded (test)")
    v = fa3_verify.FA3ScoreVerify()
    st = _state("collect2", kv_budget=7, first_layer=0, last_layer=1, layers_ready=True)
    md = SimpleNamespace(max_query_len=5, use_cascade=False, causal=True)
    with caplog.at_level("INFO", logger="vegas.vllm"):
        for _ in range(3):
            assert not v.begin(st, _impl(2), torch.randn(10, 4, 64).to(torch.bfloat16), md)
    lines = [r.getMessage() for r in caplog.records if "verification scores" in r.getMessage()]
    assert lines == ["vegas: verification scores from the separate score kernel (extension _vegas_fa3_C not loaded (test))"]


def test_plan_rows_match_make_plan():
    """The scored rows of the shared verification cases (``tests/verify_cases.py``, used by the
    extension's GPU test and the bench) are the vLLM plan's (collect2 and aggregated, a one-token chunk)."""
    from vegas.config import VegasConfig
    from vegas.plugins import create_selector
    from vegas.vllm_plugin.selectors.plan import RowTable, make_plan

    from .verify_cases import plan_rows, verify_batch

    b = verify_batch([5, 5, 1], [40, 55, 70], (9, 3, 64), pad_tokens=0)
    for selector in ("collect2", "aggregated"):
        sel = create_selector(selector, VegasConfig(num_draft_tokens=4))
        rows = RowTable.of(sel, 4, torch.device("cpu"))
        plan = make_plan(b["cu_seqlens_q"], b["seq_lens"], int(b["seq_lens"].max()), 4, sel, rows)
        q_idx, q_weight, ctx_sel = plan_rows(b["cu_seqlens_q"], b["seq_lens"], 4, selector)
        assert torch.equal(plan.q_idx, q_idx) and torch.equal(plan.q_weight, q_weight)
        assert torch.equal(plan.ctx_sel, ctx_sel)
