"""CPU tests of the CuTe score path's Python side (``vllm.cute_scores``, issue 22; no vLLM, no GPU,
no CuTe DSL): which rows the writer's two slots stand for, the reduce into the selector's score
row, what the path covers, and that a forward routed through :meth:`SelectionState.verify_layer`
selects what :meth:`SelectionState.on_layer` selects, with the CuTe call replaced by a PyTorch
stand-in that writes what :func:`vegas.kernels.cute_scores.score_writer` specifies. The kernel
itself compiles on the CPU (``scripts/cute_compile_check.py``) and runs only on a Hopper GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vegas.config import VegasConfig, VegasConfigError
from vegas.kernels import cute_scores
from vegas.vllm_plugin.selection.cute_verify import CuteScoreVerify

from .test_fa3_scores import _impl
from .test_vllm_state import BS, _block_table, _state


def test_edge_row_weights_count_each_scored_row_once():
    collect2 = [[], [0], [0, 1], [0, 2], [0, 3], [0, 4]]
    last_token = [[], [0], [1], [2], [3], [4]]
    assert cute_scores.edge_row_weights(collect2).tolist() == [[0, 0], [1, 0], [1, 1], [1, 1], [1, 1], [1, 1]]
    assert cute_scores.edge_row_weights(last_token).tolist() == [[0, 0], [1, 0], [0, 1], [0, 1], [0, 1], [0, 1]]
    with pytest.raises(ValueError, match=r"a chunk of 3 scores rows \[0, 1, 2\]"):
        cute_scores.edge_row_weights([[], [0], [0, 1], [0, 1, 2]])  # aggregated: every row


def test_reduce_edge_scores_sums_slots_and_heads_and_writes_the_tail():
    g = torch.Generator().manual_seed(1)
    ws = torch.randn(4, 2, 9, 50, generator=g)  # a buffer larger than the batch (3 requests, 40 positions)
    weights = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    ctx = torch.tensor([40, 7, 0])
    out = torch.empty(3, 40)
    cute_scores.reduce_edge_scores(ws, weights, ctx, out)
    want = (ws[:3, :, :, :40].sum(2) * weights[:, :, None]).sum(1)
    assert torch.allclose(out[0], want[0]) and torch.allclose(out[1, :7], want[1, :7])
    assert out[1, 7:].eq(float("-inf")).all() and out[2].eq(float("-inf")).all()


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(), None),
        (dict(dtype=torch.float32), "dtype"),
        (dict(head_dim=72), None),
        (dict(head_dim=100), "head_dim 100"),
        (dict(num_q_heads=9, num_kv_heads=2), "9 query heads over 2 KV heads"),
        (dict(sliding_window=(31, 0)), "sliding window"),
        (dict(softcap=50.0), "soft-capping"),
        (dict(kv_cache_dtype="fp8"), "kv_cache_dtype"),
        (dict(max_query_len=40), "max_query_len 40"),
    ],
)
def test_unsupported_reason_names_what_the_path_does_not_cover(kw, match):
    args = dict(num_q_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16, max_query_len=5)
    args.update(kw)
    pos = [args.pop(k) for k in ("num_q_heads", "num_kv_heads", "head_dim", "dtype", "max_query_len")]
    reason = cute_scores.unsupported_reason(*pos, **args)
    assert reason is None if match is None else match in reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_unavailable_without_a_gpu():
    cute_scores._checked.clear()
    assert cute_scores.unavailable_reason() == "no CUDA device"


def test_the_option_is_a_bool_named_in_its_error():
    assert VegasConfig(vllm={"cute_scores": True}).vllm.cute_scores
    with pytest.raises(VegasConfigError, match="vllm.cute_scores"):
        VegasConfig(vllm={"cute_scores": "yes"})


def _fake_cute(calls):
    """A stand-in for :func:`cute_scores.cute_verify_attention`: the output is left alone; the
    writer's buffer (the one its ``writer`` was made for) gets ``scale * q . k`` of each
    request's first and last query row, per query head, for the keys before its chunk."""

    def cute_verify_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k,
                              scale, *, out, writer, num_splits=0):
        calls.append(q.shape[0])
        out.fill_(1.0)
        ws = writer
        hkv = k_cache.shape[2]
        group = q.shape[1] // hkv
        for s in range(cu_seqlens_q.shape[0] - 1):
            start, qlen = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1] - cu_seqlens_q[s])
            ctx = int(seq_lens[s]) - qlen
            pos = torch.arange(ctx)
            keys = k_cache[block_table[s, pos // BS].long(), pos % BS].float()  # [ctx, hkv, d]
            keys = keys.repeat_interleave(group, dim=1)
            for slot, row in enumerate((0, qlen - 1)):
                ws[s, slot, :, :ctx] = torch.einsum("hd,phd->hp", q[start + row].float(), keys) * scale
        return out

    return cute_verify_attention


@pytest.mark.parametrize("selector", ["collect2", "last_token"])
def test_verify_layer_through_cute_selects_what_on_layer_selects(monkeypatch, selector):
    """SmolLM2's heads, two verification requests (chunks of 5 and 1 tokens), three layers: the
    CuTe score path (a stand-in kernel) and today's path select the same slots."""
    calls = []
    monkeypatch.setattr(cute_scores, "unavailable_reason", lambda: None)
    monkeypatch.setattr(cute_scores, "cute_verify_attention", _fake_cute(calls))
    monkeypatch.setattr(cute_scores, "score_writer", lambda ws: ws)  # the stand-in writes into the buffer itself
    hq, hkv, d = 9, 3, 64
    lens = [70, 40]
    bt, nb = _block_table(lens, 3)
    qsl = torch.tensor([0, 5, 6], dtype=torch.int32)
    md = SimpleNamespace(query_start_loc=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32), max_seq_len=70,
                         max_query_len=5, num_actual_tokens=6, block_table=bt, scheduler_metadata=None,
                         max_num_splits=0, use_cascade=False, causal=True)
    torch.manual_seed(0)
    kvs = [torch.randn(nb, 2, BS, hkv, d).to(torch.bfloat16) for _ in range(3)]
    queries = [torch.randn(8, hq, d).to(torch.bfloat16) for _ in range(3)]  # 2 padding tokens

    today = _state(selector, kv_budget=7, first_layer=0, last_layer=2, layers_ready=True)
    for layer in range(3):
        today.on_layer(layer, queries[layer], kvs[layer], md, 0.5)

    st = _state(selector, kv_budget=7, first_layer=0, last_layer=2, layers_ready=True, vllm={"cute_scores": True})
    st.reserve(4, 7, 5 * hq * d, torch.bfloat16, torch.device("cpu"), max_model_len=80)
    for layer in range(3):
        out = torch.zeros(8, hq, d, dtype=torch.bfloat16)
        assert st.verify_layer(_impl(hkv), layer, queries[layer], kvs[layer], md, out)
        assert out[:6].eq(1).all() and out[6:].eq(0).all()  # only the actual tokens
    assert isinstance(st.fa3, CuteScoreVerify) and len(calls) == 3 and not st.fa3.active
    assert tuple(st.fa3.ws.shape) == (4, 2, hq, 80)  # made once, at its largest
    # announced (and reported as the engine's score_path) once a forward has seen every layer covered
    assert not st.fa3.in_use
    assert st.verify_layer(_impl(hkv), 0, queries[0], kvs[0], md, torch.zeros(8, hq, d, dtype=torch.bfloat16))
    assert st.fa3.in_use and st.fa3.KIND == "cute"
    for layer in (1, 2):  # finish that forward
        st.verify_layer(_impl(hkv), layer, queries[layer], kvs[layer], md, torch.zeros(8, hq, d, dtype=torch.bfloat16))
    got, ctx_sel, budgets = st.selection(2)
    want, want_ctx, want_budgets = today.selection(2)
    assert torch.equal(ctx_sel, want_ctx) and torch.equal(budgets, want_budgets)
    for layer in range(3):
        for i in range(2):
            assert sorted(got[layer, i, :7].tolist()) == sorted(want[layer, i, :7].tolist())


def test_what_the_cute_path_leaves_to_todays_path(monkeypatch, caplog):
    """Every row scored (aggregated) is announced and left alone; without the engine's
    max_model_len (no buffer can be made at its largest) a forward takes today's path."""
    monkeypatch.setattr(cute_scores, "unavailable_reason", lambda: None)
    monkeypatch.setattr(cute_scores, "cute_verify_attention", lambda *a, **k: pytest.fail("kernel called"))
    monkeypatch.setattr(cute_scores, "score_writer", lambda ws: ws)  # no CuTe DSL here
    md = SimpleNamespace(max_query_len=5, use_cascade=False, causal=True)
    q = torch.randn(10, 9, 64).to(torch.bfloat16)
    st = _state("aggregated", kv_budget=7, first_layer=0, last_layer=1, layers_ready=True, vllm={"cute_scores": True})
    with caplog.at_level("INFO", logger="vegas.vllm"):
        assert not CuteScoreVerify().begin(st, _impl(3), q, md)
    assert any("CuTe score writer stores the first and last row" in r.getMessage() for r in caplog.records)
    st = _state("collect2", kv_budget=7, first_layer=0, last_layer=1, layers_ready=True, vllm={"cute_scores": True})
    st.reserve(4, 7, 5 * 9 * 64, torch.bfloat16, torch.device("cpu"))  # max_model_len unknown
    assert not CuteScoreVerify().begin(st, _impl(3), q, md)
    # a batch the buffer cannot hold (longer than max_model_len, or more requests) is not written past it
    st.reserve(4, 7, 5 * 9 * 64, torch.bfloat16, torch.device("cpu"), max_model_len=80)
    v = CuteScoreVerify()
    qsl = torch.tensor([0, 5, 10], dtype=torch.int32)
    assert v.begin(st, _impl(3), q, SimpleNamespace(**md.__dict__, query_start_loc=qsl, max_seq_len=80))
    assert not v.begin(st, _impl(3), q, SimpleNamespace(**md.__dict__, query_start_loc=qsl, max_seq_len=81))
    five = torch.arange(6, dtype=torch.int32) * 2
    assert not v.begin(st, _impl(3), q, SimpleNamespace(**md.__dict__, query_start_loc=five, max_seq_len=80))


_EDGE_CHILD = r"""
import json, sys, traceback
sys.path.insert(0, sys.argv[1])
import torch, triton
from vegas.kernels import triton_score_reduce as r
out = {}
try:
    g = torch.Generator().manual_seed(2)
    ws = torch.randn(5, 2, 9, 3000, generator=g)  # larger than the batch: 3 requests, 2,100 positions
    weights = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    ctx = torch.tensor([2100, 1030, 0])
    got = torch.empty(3, 2100)
    r._edge_reduce_kernel[(3, triton.cdiv(2100, r.REDUCE_BLOCK))](
        ws, weights, ctx, got, 2100, ws.stride(0), ws.stride(1), ws.stride(2), got.stride(0), HQ=9, BLOCK=r.REDUCE_BLOCK)
    want = torch.empty(3, 2100)
    r.reduce_edge_rows(ws, weights, ctx, want)  # the PyTorch path of CPU tensors
    finite = torch.isfinite(want)
    ok = torch.equal(torch.isfinite(got), finite) and torch.allclose(got[finite], want[finite], rtol=1e-5, atol=1e-4)
    out["edge"] = "ok" if ok else f"mismatch {(got[finite] - want[finite]).abs().max()}"
except Exception:
    out["edge"] = traceback.format_exc()[-2000:]
print("RESULTS " + json.dumps(out))
"""


def test_the_triton_edge_reduce_matches_pytorch_interpreted():
    """The one-pass Triton reduce of the writer's buffer (run by Triton's CPU interpreter) against
    the PyTorch path: per-request slot weights, the ``-inf`` tail, a request with nothing to score."""
    from .kernel_cases import run_interpreted

    result = run_interpreted(_EDGE_CHILD)
    assert result["edge"] == "ok", result["edge"]


@pytest.mark.parametrize("selector, match", [("collect2", None), ("last_token", None),
                                             ("aggregated", "a chunk of 3 scores rows"),
                                             ("sliding_window", "'sliding_window' does not select by scores"),
                                             ("quest", "'quest' does not select by scores")])
def test_the_engine_settings_refuse_cute_scores_for_a_selector_it_cannot_serve(selector, match):
    """Refused when the engine is configured (vegas serve, bench, Pipeline), by field and name."""
    from vegas.plugins import create_selector
    from vegas.vllm_plugin.settings import raise_if_unsupported

    config = VegasConfig(vllm={"cute_scores": True})
    if match is None:
        raise_if_unsupported(create_selector(selector, config), config)
        return
    with pytest.raises(VegasConfigError, match=match) as info:
        raise_if_unsupported(create_selector(selector, config), config)
    assert str(info.value).startswith("vllm.cute_scores needs") and "collect2 or last_token" in str(info.value)
