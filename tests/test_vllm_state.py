"""CPU tests of the vLLM backend's selection plumbing (no vLLM needed): plans, selections and
the page-size-1 draft tables, checked against positions computed by hand."""

from __future__ import annotations

import pytest
import torch

from vegas.config import VegasConfig, VegasConfigError
from vegas.kernels import collect_scores, collect_scores_reference, select_topk, select_topk_layers
from vegas.plugins import create_selector
from vegas.vllm_plugin.drafting.engine import build_draft_tables, draft_tables
from vegas.vllm_plugin.selectors.plan import make_plan
from vegas.vllm_plugin.selectors.sliding_window import sliding_window_slots
from vegas.vllm_plugin.settings import path_class
from vegas.vllm_plugin.selection.state import LAYER_ATTR, SelectionState

BS = 16
GAMMA = 4


def _path(selector="collect2", gamma=GAMMA, **config):
    """The vLLM selection path of a registered selector (fast path or generic), on the CPU."""
    sel = create_selector(selector, VegasConfig(num_draft_tokens=gamma, **config))
    return path_class(sel)(sel, gamma, torch.device("cpu"))


def _plan(query_start_loc, seq_lens, max_seq_len, selector="collect2", **config):
    path = _path(selector, **config)
    return make_plan(query_start_loc, seq_lens, max_seq_len, GAMMA, path.selector, path.row_table)


def _state(selector="collect2", **kw):
    """A selection state with the path of ``selector`` (fields of SelectionState in ``kw`` go
    to the state, the rest to the VegasConfig)."""
    state_fields = set(SelectionState.__dataclass_fields__)
    st = SelectionState(gamma=GAMMA, enabled=True, **{k: v for k, v in kw.items() if k in state_fields})
    st.use(_path(selector, **{k: v for k, v in kw.items() if k not in state_fields}))
    return st


def collect_layer_slots(plan, query, key_cache, block_table, scale, softcap=0.0):
    """One layer's selection as the proposer made it before the selection paths (per layer:
    score the collect queries, top-k with the recent window): ``(num_seqs, k_max)`` int32."""
    q = query[plan.q_idx.reshape(-1)].view(plan.num_seqs, plan.q_idx.shape[1], *query.shape[1:])
    q = q * plan.q_weight[:, :, None, None].to(q.dtype)
    bt = block_table[: plan.num_seqs]
    scores = collect_scores(q, key_cache, bt, plan.ctx_sel, plan.max_len, scale, softcap)
    slots, _ = select_topk(scores, plan.budgets, plan.k_max, bt, key_cache.shape[1], plan.recent, plan.ctx_sel)
    return slots


def _block_table(lens, shuffle_seed=0):
    g = torch.Generator().manual_seed(shuffle_seed)
    nbs = [(n + BS - 1) // BS + 1 for n in lens]
    perm = torch.randperm(sum(nbs) + 2, generator=g)
    bt = torch.zeros(len(lens), max(nbs), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(nbs):
        bt[i, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    return bt, sum(nbs) + 2


def _slot(bt, i, p):
    return int(bt[i, p // BS]) * BS + p % BS


def _page_to_slot(page, page_stride=2 * BS):
    return (page // page_stride) * BS + page % page_stride


def test_plan_verify_and_prefill_rows():
    # row 0: verify chunk of gamma+1 = 5 tokens, seq_len 100 -> positions 95..99
    # row 1: prefill of 40 tokens (seq_len 40) -> collect the last 5: positions 35..39
    # row 2: one-token decode at seq_len 10 (position 9)
    qsl = torch.tensor([0, 5, 45, 46], dtype=torch.int32)
    seq_lens = torch.tensor([100, 40, 10], dtype=torch.int32)
    plan = _plan(qsl, seq_lens, 100, "collect2", sparsity_ratio=0.1, min_kv_budget=4)
    assert plan.q_idx.tolist() == [[0, 4], [40, 44], [45, 45]]
    assert plan.q_weight.tolist() == [[1, 1], [1, 1], [1, 0]]
    assert plan.ctx_sel.tolist() == [95, 35, 9]
    assert plan.budgets.tolist() == [10, 4, 4]  # ceil(9.5)=10, max(ceil(3.5),4)=4, max(1,4)=4
    assert plan.k_max == 10
    agg = _plan(qsl, seq_lens, 100, "aggregated")
    assert agg.q_idx[0].tolist() == [0, 1, 2, 3, 4] and agg.q_weight[2].tolist() == [1, 0, 0, 0, 0]
    assert agg.q_idx[2].tolist() == [45] * 5  # a one-token chunk: its only row, counted once
    last = _plan(qsl, seq_lens, 100, "last_token")
    assert last.q_idx.tolist() == [[0], [40], [45]] and last.q_weight.tolist() == [[1], [1], [1]]
    assert _plan(qsl, seq_lens, 100, "sliding_window").q_idx is None


def test_collect_layer_slots_pick_top_scores():
    lens = [60, 33]
    bt, nb = _block_table(lens)
    kv = torch.randn(nb, 2, BS, 2, 8)
    query = torch.randn(10, 4, 8)  # 2 requests x 5 verify tokens, 4 q heads, 2 kv heads
    qsl = torch.tensor([0, 5, 10], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    for recent_window in (0, 2):
        plan = _plan(qsl, seq_lens, 60, "collect2", kv_budget=6, recent_window=recent_window)
        assert plan.recent.tolist() == [recent_window] * 2
        slots = collect_layer_slots(plan, query, kv.unbind(1)[0], bt, 0.3)
        for i in range(2):
            q = query[plan.q_idx[i]][None]  # [1, 2, 4, 8]
            ctx = int(plan.ctx_sel[i])
            ref = collect_scores_reference(q, kv.unbind(1)[0], bt[i : i + 1], plan.ctx_sel[i : i + 1], 60, 0.3)[0]
            ref[ctx - recent_window : ctx] = float("inf")  # the recent window is always kept
            top = torch.topk(ref, 6).indices.tolist()
            assert set(range(ctx - recent_window, ctx)) <= set(top)
            assert sorted(slots[i].tolist()) == sorted(_slot(bt, i, p) for p in top)


def test_selection_keeps_the_best_positions_when_k_max_exceeds_the_budget():
    """A batch's static top-k width can exceed a request's budget (a shorter request, or a
    full CUDA graph captured at max_model_len): the request must still get its own best
    positions, not an arbitrary subset of a wider top-k."""
    scores = torch.full((1, 2, 40), float("-inf"))
    scores[0, 0, :30] = torch.arange(30.0)  # best positions: 29, 28, ...
    scores[0, 1, :40] = -torch.arange(40.0)  # best positions: 0, 1, ...
    bt = torch.arange(6, dtype=torch.int32).view(2, 3)  # block size 16: identity-like slots
    budgets = torch.tensor([3, 5])
    slots = select_topk_layers(scores.clone(), budgets, 12, bt, 16)[0]
    assert sorted(slots[0, :3].tolist()) == [27, 28, 29] and (slots[0, 3:] == -1).all()
    assert sorted(slots[1, :5].tolist()) == [48, 49, 50, 51, 52] and (slots[1, 5:] == -1).all()


def test_sliding_window_positions():
    bt, _ = _block_table([100])
    qsl = torch.tensor([0, 5], dtype=torch.int32)
    plan = _plan(qsl, torch.tensor([100], dtype=torch.int32), 100, "sliding_window", kv_budget=10, num_sinks=4)
    slots = sliding_window_slots(plan, 4, bt, BS)
    want = [0, 1, 2, 3] + list(range(89, 95))  # ctx_sel = 95
    assert sorted(slots[0].tolist()) == sorted(_slot(bt, 0, p) for p in want)


def test_draft_tables_cover_selection_plus_recent():
    lens = [200, 50]
    bt, _ = _block_table(lens, 3)
    budgets = torch.tensor([5, 3])
    ctx_sel = torch.tensor([190, 45])
    pos0 = torch.tensor([193, 47])  # bonus token positions (2 and 1 accepted)
    gamma = 4
    sel_pos = [[3, 70, 11, 150, 0], [7, 1, 30]]
    k_max = 5
    sel = torch.full((1, 2, k_max), -1, dtype=torch.int64)
    for i, ps in enumerate(sel_pos):
        sel[0, i, : len(ps)] = torch.tensor([_slot(bt, i, p) for p in ps])
    tables = build_draft_tables(sel, budgets, ctx_sel, pos0 + gamma - 1, bt, BS, 2 * BS, 2 * gamma + 2)
    for i in range(2):
        for j in range(gamma):
            used = int(budgets[i] + (pos0[i] + j - ctx_sel[i] + 1))
            pages = tables[0, i, :used].tolist()
            got = sorted(_page_to_slot(p) for p in pages)
            want_pos = sel_pos[i] + list(range(int(ctx_sel[i]), int(pos0[i]) + j + 1))
            assert got == sorted(_slot(bt, i, p) for p in want_pos)


@pytest.mark.parametrize("selector", ["collect2", "aggregated"])
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 8), (9, 3, 64), (7, 1, 96), (32, 32, 128)])
def test_on_layer_batched_selection_matches_per_layer(hq, hkv, d, selector):
    """The state's all-layers selection (stash queries, select at the last layer) equals a
    per-layer selection done layer by layer, for any head shape; the buffers the proposer
    reserves from the model's heads (``(γ+1) x heads x head_dim`` query elements) fit it."""
    from types import SimpleNamespace

    lens = [70, 40]
    bt, nb = _block_table(lens, 5)
    qsl = torch.tensor([0, 5, 10], dtype=torch.int32)
    md = SimpleNamespace(query_start_loc=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32),
                         max_seq_len=70, block_table=bt)
    st = _state(selector, kv_budget=7)
    st.on_layer(1, torch.randn(10, hq, d), torch.randn(nb, 2, BS, hkv, d), md, 0.5)
    assert st.plan is None  # layers unknown yet (first prefill before the proposer learned them)
    st.first_layer, st.last_layer, st.layers_ready = 0, 2, True
    st.reserve(2, 7, (4 + 1) * hq * d, torch.float32, torch.device("cpu"))  # as the proposer does
    generation = st.generation
    kvs = [torch.randn(nb, 2, BS, hkv, d) for _ in range(3)]
    queries = [torch.randn(10, hq, d) for _ in range(3)]
    for layer in range(3):
        st.on_layer(layer, queries[layer], kvs[layer], md, 0.5)
    assert st.generation == generation and st.query_buf.numel() == 3 * 2 * 5 * hq * d  # nothing regrown
    plan = _plan(qsl, md.seq_lens, 70, selector, kv_budget=7)
    sel, ctx_sel, budgets = st.selection(2)
    assert torch.equal(ctx_sel, plan.ctx_sel) and torch.equal(budgets, plan.budgets)
    for layer in range(3):
        want = collect_layer_slots(plan, queries[layer], kvs[layer].unbind(1)[0], bt, 0.5)
        for i in range(2):
            assert sorted(sel[layer, i, :7].tolist()) == sorted(want[i].tolist())


def test_on_layer_scores_the_soft_capped_logits():
    """Gemma 2: the attention hook passes the layer's ``logits_soft_cap``; the selection is the
    top-k of the capped logits (here different from the raw top-k), and a layer with another
    cap is refused."""
    from types import SimpleNamespace

    lens = [70, 40]
    bt, nb = _block_table(lens, 5)
    qsl = torch.tensor([0, 5, 10], dtype=torch.int32)
    md = SimpleNamespace(query_start_loc=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32),
                         max_seq_len=70, block_table=bt)
    st = _state("aggregated", kv_budget=7, first_layer=0, last_layer=1, layers_ready=True)
    g = torch.Generator().manual_seed(3)
    kvs = [torch.randn(nb, 2, BS, 2, 8, generator=g) for _ in range(2)]
    queries = [4 * torch.randn(10, 4, 8, generator=g) for _ in range(2)]  # logits far past the cap
    for layer in range(2):
        st.on_layer(layer, queries[layer], kvs[layer], md, 0.5, 1.0)
    plan = _plan(qsl, md.seq_lens, 70, "aggregated", kv_budget=7)
    sel, _, _ = st.selection(2)
    differs = False
    for layer in range(2):
        want = collect_layer_slots(plan, queries[layer], kvs[layer].unbind(1)[0], bt, 0.5, softcap=1.0)
        raw = collect_layer_slots(plan, queries[layer], kvs[layer].unbind(1)[0], bt, 0.5)
        for i in range(2):
            assert sorted(sel[layer, i, :7].tolist()) == sorted(want[i].tolist())
            differs |= sorted(want[i].tolist()) != sorted(raw[i].tolist())
    assert differs, "the case must make capped and raw selections differ"
    st.on_layer(0, queries[0], kvs[0], md, 0.5, 1.0)
    with pytest.raises(VegasConfigError, match="soft-cap"):
        st.on_layer(1, queries[1], kvs[1], md, 0.5, 2.0)


def test_selection_buffers_survive_a_smaller_batch_and_grow():
    """Reserved buffers keep their size; a later, smaller forward writes its rows only, and a
    larger budget than reserved grows them (outside CUDA-graph capture)."""
    from types import SimpleNamespace

    st = _state("collect2", kv_budget=7, first_layer=0, last_layer=1, layers_ready=True)
    st.reserve(4, 7, 5 * 4 * 8, torch.float32, torch.device("cpu"))
    assert st.sel_buf.shape == (2, 4, 7)

    def forward(lens, kv_budget):
        st.use(_path("collect2", kv_budget=kv_budget))
        bt, nb = _block_table(lens, 5)
        qsl = torch.arange(len(lens) + 1, dtype=torch.int32) * 5
        md = SimpleNamespace(query_start_loc=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32),
                             max_seq_len=max(lens), block_table=bt)
        for layer in range(2):
            st.on_layer(layer, torch.randn(5 * len(lens), 4, 8), torch.randn(nb, 2, BS, 2, 8), md, 0.5)

    forward([60, 50, 40], 7)
    sel, _, budgets = st.selection(3)
    assert sel.shape == (2, 3, 7) and (sel >= 0).all() and budgets.tolist() == [7, 7, 7]
    forward([30], 7)
    assert st.budget_buf[:3].tolist() == [7, 7, 7] and st.selection(1)[2].tolist() == [7]
    forward([60, 50], 12)
    sel, _, budgets = st.selection(2)
    assert st.sel_buf.shape[2] == 12 and budgets.tolist() == [12, 12] and (sel >= 0).all()


def test_sliding_window_selection_in_row_zero():
    from types import SimpleNamespace

    st = _state("sliding_window", kv_budget=6, num_sinks=2, first_layer=0, last_layer=1, layers_ready=True)
    bt, nb = _block_table([40], 5)
    md = SimpleNamespace(query_start_loc=torch.tensor([0, 5], dtype=torch.int32),
                         seq_lens=torch.tensor([40], dtype=torch.int32), max_seq_len=40, block_table=bt)
    for layer in range(2):
        st.on_layer(layer, torch.randn(5, 4, 8), torch.randn(nb, 2, BS, 2, 8), md, 0.5)
    sel, ctx_sel, budgets = st.selection(1)
    assert sel.shape[0] == 1 and int(ctx_sel[0]) == 35 and int(budgets[0]) == 6
    want = [_slot(bt, 0, p) for p in [0, 1, 31, 32, 33, 34]]
    assert sorted(sel[0, 0, :6].tolist()) == sorted(want)


def _loop_gather(probs, prob_req_ids, req_ids, num_draft_tokens):
    """vLLM 0.24's GPUModelRunner._get_spec_decode_draft_probs, transcribed."""
    row = {r: i for i, r in enumerate(prob_req_ids)}
    rows = [probs[row[r], :k] for r, k in zip(req_ids, num_draft_tokens) if k]
    return torch.cat(rows).contiguous()


def test_stacked_draft_probs_equals_vllm_loop():
    from vegas.vllm_plugin.patches import stacked_draft_probs

    probs = torch.rand(8, 3, 11)  # rows padded to 8 (graph bucket), γ = 3
    ids = ["a", "b", "c", "d", "e"]
    fast = stacked_draft_probs(probs, ids, ids, [3] * 5)
    assert fast is not None and fast.shape == (15, 11)
    assert torch.equal(fast, _loop_gather(probs, ids, ids, [3] * 5))
    # the batch order changed, a request lost drafts, or the batch is larger: vLLM's loop decides
    assert stacked_draft_probs(probs, ids, ["b", "a", "c", "d", "e"], [3] * 5) is None
    assert stacked_draft_probs(probs, ids, ids, [3, 3, 0, 3, 3]) is None
    assert stacked_draft_probs(probs, ids[:4], ids, [3] * 5) is None
    assert stacked_draft_probs(probs, ids, ids, []) is None


def test_proposer_draft_tables_from_selection_buffers():
    """The proposer builds its draft tables from the selection buffers and the step inputs
    (the same code runs inside its CUDA graph); inactive rows use one page."""
    from types import SimpleNamespace


    lens = [70, 40]
    bt, nb = _block_table(lens, 3)
    qsl = torch.tensor([0, 5, 10], dtype=torch.int32)
    md = SimpleNamespace(query_start_loc=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32),
                         max_seq_len=70, block_table=bt)
    state = SelectionState()
    state.use(_path("collect2", kv_budget=8, recent_window=2))
    state.gamma = 4
    state.first_layer, state.last_layer, state.layers_ready = 0, 1, True
    state.reserve(4, 12, 5 * 4 * 8, torch.float32, torch.device("cpu"))
    for layer in range(2):
        state.on_layer(layer, torch.randn(10, 4, 8), torch.randn(nb, 2, BS, 2, 8), md, 0.5)
    step_inputs = torch.tensor([[1, 0, 0, 0], [7, 0, 0, 0], [70, 0, 0, 0], [6, 0, 0, 0]])  # 1 active row of 4
    tables, base_used, quest = draft_tables(state, step_inputs, torch.cat([bt, bt]), 4, 4)
    assert quest is None
    sel, ctx_sel, budgets = state.selection(4)
    want = build_draft_tables(sel[:, :1], budgets[:1], torch.minimum(ctx_sel[:1], torch.tensor([70])),
                              torch.tensor([73]), bt[:1], BS, state.page_stride, 10)
    assert tables.shape == (2, 4, 12 + 10) and torch.equal(tables[:, :1], want)
    assert base_used.tolist() == [8 + 70 - 65 + 1, 1, 1, 1]


def test_quest_draft_step_attends_the_best_pages_plus_every_later_position():
    """Quest through the proposer's draft tables: after a verification, draft step j of the
    active row attends exactly the slots of its best whole pages (by this step's query) plus
    every position from the page-aligned ctx_sel up to the step's own position."""
    from types import SimpleNamespace

    from vegas.kernels.quest_pages import group_query, page_scores_reference
    from vegas.vllm_plugin.selectors.quest import fill_draft_table

    lens = [70, 40]
    bt, nb = _block_table(lens, 3)
    qsl = torch.tensor([0, 5, 10], dtype=torch.int32)
    slots = torch.tensor([_slot(bt, r, p) for r, n in enumerate(lens) for p in range(n - 5, n)])
    md = SimpleNamespace(query_start_loc=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32),
                         max_seq_len=70, block_table=bt, slot_mapping=slots)
    state = SelectionState()
    state.use(_path("quest", kv_budget=40))
    state.gamma = 4
    state.first_layer, state.last_layer, state.layers_ready = 0, 1, True
    state.reserve(4, 48, 0, torch.float32, torch.device("cpu"))
    kv = torch.randn(nb, 2, BS, 2, 8)
    for layer in range(2):  # the verification's KV write only covers the last 5 positions
        state.on_layer(layer, torch.randn(10, 4, 8), kv, md, 0.5)
    from vegas.kernels.quest_pages import update_page_bounds

    all_slots = torch.tensor([_slot(bt, 0, p) for p in range(70)])
    for layer in range(2):  # as the prefill would have: bounds of every page of row 0
        update_page_bounds(state.quest_min[layer], state.quest_max[layer], kv.unbind(1)[0], all_slots)
    pos0 = 67  # 2 of 4 drafts accepted: the new token sits at position 67
    step_inputs = torch.tensor([[1, 0, 0, 0], [7, 0, 0, 0], [pos0, 0, 0, 0], [6, 0, 0, 0]])
    tables, base_used, quest = draft_tables(state, step_inputs, torch.cat([bt, bt]), 4, 4)
    assert quest is not None and quest.num_pages[0] == 4 and quest.budget_cols.tolist() == [32, 0, 0, 0]
    assert base_used[0] == 32 + pos0 - 64 + 1
    q = torch.randn(4, 4, 8)
    table = tables[1]
    fill_draft_table(table, q, 2, quest, 1)
    scores = page_scores_reference(*group_query(q[:1], 2), state.quest_min[1].flatten(1),
                                   state.quest_max[1].flatten(1), bt[:1], torch.tensor([4]))
    best = scores[0].topk(2).indices.tolist()
    for j in range(4):
        used = table[0, : int(base_used[0]) + j].tolist()
        got = {_page_to_slot(pg) for pg in used}
        want = {_slot(bt, 0, pg * BS + o) for pg in best for o in range(BS)}
        want |= {_slot(bt, 0, pos) for pos in range(64, pos0 + j + 1)}
        assert got == want and len(used) == len(want)


def test_draft_tables_never_read_past_the_block_table():
    """A row whose positions run past its block table (an inactive row mid chunked prefill, or
    a request at max_model_len) reads the last block-table column instead of out of bounds."""
    bt = torch.tensor([[3, 1]], dtype=torch.int32)  # 2 blocks of 16: positions 0..31
    sel = torch.full((1, 1, 4), -1, dtype=torch.int32)
    tables = build_draft_tables(sel, torch.tensor([0]), torch.tensor([40]), torch.tensor([43]), bt, BS, 2 * BS, 6)
    assert tables.shape == (1, 1, 10) and (tables >= 0).all()


def test_selection_buffers_refuse_to_grow_under_full_graphs():
    st = SelectionState(first_layer=0, last_layer=1, layers_ready=True)
    st.reserve(2, 8, 16, torch.float32, torch.device("cpu"))
    generation = st.generation
    st.frozen = True
    st._ensure(2, 8, 16, torch.float32, torch.device("cpu"))  # fits: nothing happens
    with pytest.raises(RuntimeError, match="reserves them from max_num_seqs and max_model_len"):
        st._ensure(3, 8, 16, torch.float32, torch.device("cpu"))
    st.frozen = False
    st._ensure(3, 8, 16, torch.float32, torch.device("cpu"))
    assert st.sel_buf.shape[1] == 3 and st.generation == generation + 1


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(use_ubatching=True), "micro-batching"),
        (dict(lora_config=object()), "LoRA"),
        (dict(uses_mrope=True), "M-RoPE"),
        (dict(cache_dtype="fp8"), "quantized KV caches"),
        (dict(pipeline_parallel_size=2), "pipeline parallelism"),
    ],
)
def test_proposer_rejects_unsupported_engines(change, match):
    from types import SimpleNamespace

    from vegas.vllm_plugin.runners.start import _raise_if_unsupported

    def config(**kw):
        return SimpleNamespace(
            parallel_config=SimpleNamespace(pipeline_parallel_size=kw.get("pipeline_parallel_size", 1),
                                            use_ubatching=kw.get("use_ubatching", False)),
            cache_config=SimpleNamespace(cache_dtype=kw.get("cache_dtype", "auto")),
            lora_config=kw.get("lora_config"),
            model_config=SimpleNamespace(uses_mrope=kw.get("uses_mrope", False)),
        )

    _raise_if_unsupported(config())
    with pytest.raises(VegasConfigError, match=match):
        _raise_if_unsupported(config(**change))


def _run_state(selector, config, queries, kvs, md, all_reduce=None):
    st = _state(selector, **config, first_layer=0, last_layer=len(kvs) - 1, layers_ready=True, all_reduce=all_reduce)
    for layer, (q, kv) in enumerate(zip(queries, kvs)):
        st.on_layer(layer, q, kv, md, 0.5)
    return st.selection(md.seq_lens.shape[0])[0]


@pytest.mark.parametrize("selector", ["collect2", "aggregated"])
def test_tensor_parallel_all_reduce_selects_what_one_gpu_selects(selector):
    """Two tensor-parallel ranks, each with half of the query and KV heads (vLLM splits heads
    contiguously): summing the ranks' scores before the top-k gives the one-GPU selection, and
    ``per_rank`` selects from a rank's own heads without calling the all-reduce."""
    from types import SimpleNamespace

    torch.manual_seed(11)
    lens = [90, 57]
    bt, nb = _block_table(lens, 3)
    qsl = torch.tensor([0, 5, 10], dtype=torch.int32)
    md = SimpleNamespace(query_start_loc=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32),
                         max_seq_len=90, block_table=bt)
    queries = [torch.randn(10, 4, 8) for _ in range(2)]  # 4 query heads
    kvs = [torch.randn(nb, 2, BS, 2, 8) for _ in range(2)]  # 2 KV heads
    rank_q = [[q[:, 2 * r : 2 * r + 2] for q in queries] for r in range(2)]
    rank_kv = [[kv[:, :, :, r : r + 1] for kv in kvs] for r in range(2)]
    cfg = dict(kv_budget=9, recent_window=2)
    one_gpu = _run_state(selector, cfg, queries, kvs, md)

    seen = {}

    def keep(scores):  # rank 1: record its scores (its all-reduce input)
        seen["rank1"] = scores.clone()
        return scores

    _run_state(selector, cfg, rank_q[1], rank_kv[1], md, all_reduce=keep)
    rank0 = _run_state(selector, cfg, rank_q[0], rank_kv[0], md, all_reduce=lambda s: s + seen["rank1"])
    for layer in range(2):
        for i in range(2):
            assert sorted(rank0[layer, i, :9].tolist()) == sorted(one_gpu[layer, i, :9].tolist())

    def must_not_run(scores):
        raise AssertionError("per_rank must not communicate")

    per_rank_cfg = dict(cfg, vllm={"tp_selection": "per_rank"})
    own = _run_state(selector, per_rank_cfg, rank_q[0], rank_kv[0], md, all_reduce=must_not_run)
    alone = _run_state(selector, cfg, rank_q[0], rank_kv[0], md)  # rank 0's heads as a model of its own
    assert torch.equal(own, alone)
    assert not torch.equal(own[:, :, :9].sort(-1).values, one_gpu[:, :, :9].sort(-1).values)


def test_tp_selection_must_be_known():
    with pytest.raises(VegasConfigError, match="vllm.tp_selection must be one of 'all_reduce', 'per_rank'"):
        VegasConfig(vllm={"tp_selection": "gather"})


@pytest.mark.parametrize(
    "raw,match",
    [
        ('{"kv_budget": -5}', "kv_budget must be an integer >= 1"),
        ('{"window": -3, "selector": "sliding_window"}', "window must be an integer >= 0"),
        ('{"kv_budget": "100"}', "kv_budget must be an integer >= 1"),
        ('{"min_kv_budget": 1.5}', "min_kv_budget must be an integer >= 0"),
        ('{"sparsity_ratio": 0}', r"sparsity_ratio must be a number in \(0, 1\]"),
        ('{"sparsity_ratio": "0.1"}', r"sparsity_ratio must be a number in \(0, 1\]"),
        ('{"gamma": 4}', "unknown field.*gamma.*allowed: num_draft_tokens"),
        ('{"selector": 3}', "selector must be a registered selector name"),
        ('{"vllm": {"verify_cuda_graphs": "all"}}', "vllm.verify_cuda_graphs must be one of 'full', 'piecewise'"),
        ('{"vllm": {"draft_cuda_graphs": 1}}', "vllm.draft_cuda_graphs must be true or false"),
        ('{"vllm": {"draft_graph_max_rows": 0}}', "vllm.draft_graph_max_rows must be an integer >= 1"),
        ('{"vllm": {"prefill_skip_tokens": -1}}', "vllm.prefill_skip_tokens must be an integer >= 0"),
        ('{"vllm": {"fallback": "yes"}}', "vllm.fallback must be true or false"),
        ('{"vllm": {"rows": 3}}', "vllm: unknown field.*rows.*allowed: tp_selection"),
        ('[1, 2]', "must be a JSON object"),
        ("{selector: collect2}", "must be a JSON object"),
    ],
)
def test_proposer_settings_name_the_bad_field(raw, match):
    import types

    from vegas.vllm_plugin.settings import read_settings

    with pytest.raises(VegasConfigError, match=match):
        read_settings(types.SimpleNamespace(additional_config={"vegas": raw}))


def test_proposer_settings_round_trip_through_additional_config():
    import json
    import types
    from dataclasses import replace

    from vegas.vllm_plugin.settings import build_selector, parse_settings, read_settings, settings_json

    config = VegasConfig(num_draft_tokens=3, kv_budget=100, window=None, recent_window=8,
                         vllm={"tp_selection": "per_rank", "verify_cuda_graphs": "piecewise",
                               "draft_cuda_graphs": False, "draft_graph_max_rows": 64})
    extra = {"vegas": json.loads(settings_json("aggregated", config))}
    name, read = read_settings(types.SimpleNamespace(additional_config=extra))
    assert name == "aggregated" and read == replace(config, num_draft_tokens=VegasConfig().num_draft_tokens)
    assert build_selector(name, read, 3).config == config  # γ: vLLM's, given to the selector
    assert parse_settings('{"kv_budget": 100}') == ("collect2", VegasConfig(kv_budget=100))
    assert read_settings(None) == ("collect2", VegasConfig())  # no vLLM config: the defaults
    assert VegasConfig.from_json(config.to_json()) == config


# ---- the generic path and the fast-path registry ------------------------------------------------

from vegas.interfaces import Selection, Selector  # noqa: E402
from vegas.selection import topk_selection  # noqa: E402
from vegas.strategies import AggregatedSelector, Collect2Selector, QuestSelector  # noqa: E402


class LowestScoresSelector(Selector):
    """Test selector without a fast path: the budget's worst-scored positions of the first and
    last verify query (the opposite of collect2), with a budget of its own."""

    name = "lowest_scores"

    def score_rows(self, chunk_len):
        return sorted({0, chunk_len - 1})

    def budget(self, context_len):
        return 5 if isinstance(context_len, int) else context_len.new_full(context_len.shape, 5)

    def select(self, inputs):
        assert inputs.scores.shape == (inputs.valid.shape[0], 1, inputs.valid.shape[1])
        assert inputs.scores.dtype == torch.float32 and inputs.keys is None
        return topk_selection(-inputs.scores, inputs.valid, inputs.budget)


class FirstPositionsSelector(Selector):
    """Test selector that scores nothing: the budget's first positions, in reverse order."""

    name = "first_positions"

    def select(self, inputs):
        assert inputs.scores is None
        k = int(inputs.budget.max())
        positions = torch.arange(k - 1, -1, -1).expand(inputs.valid.shape[0], 1, k)
        mask = positions < inputs.budget[:, None, None]
        return Selection(indices=positions.clone(), mask=mask)


class Collect2Subclass(Collect2Selector):
    """A subclass without a fast path of its own: the generic path runs Collect2's select."""

    name = "collect2_subclass"


class TestSelectors:
    """Registers the test selectors above for the tests of its subclasses."""

    @pytest.fixture(autouse=True)
    def registered(self):
        from vegas import hookimpl, plugins

        class Plugin:
            @hookimpl
            def vegas_selectors(self):
                return {cls.name: cls for cls in (LowestScoresSelector, FirstPositionsSelector, Collect2Subclass)}

        plugins.register(Plugin(), name="test_vllm_selectors")
        yield
        plugins.unregister("test_vllm_selectors")


def _forward(st, lens, num_layers=3, seed=0, hq=4, hkv=2, d=8):
    """A verification forward (5 queries per request) through ``st`` on a random paged cache."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(seed)
    bt, nb = _block_table(lens, seed)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32) * 5
    md = SimpleNamespace(query_start_loc=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32),
                         max_seq_len=max(lens), block_table=bt)
    queries = [torch.randn(5 * len(lens), hq, d, generator=g) for _ in range(num_layers)]
    kvs = [torch.randn(nb, 2, BS, hkv, d, generator=g) for _ in range(num_layers)]
    st.first_layer, st.last_layer, st.layers_ready = 0, num_layers - 1, True
    for layer in range(num_layers):
        st.on_layer(layer, queries[layer], kvs[layer], md, 0.5)
    return bt, md, queries, kvs


class TestGenericPath(TestSelectors):
    def test_selects_what_select_returns_mapped_to_slots(self):
        from vegas.vllm_plugin.selectors.generic import GenericPath

        st = _state("lowest_scores")
        assert isinstance(st.path, GenericPath)
        lens = [60, 33]
        bt, md, queries, kvs = _forward(st, lens)
        sel, ctx_sel, budgets = st.selection(2)
        assert ctx_sel.tolist() == [55, 28] and budgets.tolist() == [5, 5]
        plan = _plan(md.query_start_loc, md.seq_lens, 60, "lowest_scores")
        for layer in range(3):
            for i in range(2):
                q = queries[layer][plan.q_idx[i]][None]  # the first and last verify query
                ref = collect_scores_reference(q, kvs[layer].unbind(1)[0], bt[i : i + 1], ctx_sel[i : i + 1], 60, 0.5)[0]
                worst = torch.topk(-ref[: int(ctx_sel[i])], 5).indices.tolist()
                assert sorted(sel[layer, i, :5].tolist()) == sorted(_slot(bt, i, p) for p in worst)
                assert (sel[layer, i, 5:] == -1).all()

    def test_a_selector_that_scores_nothing(self):
        st = _state("first_positions", kv_budget=6)
        bt, *_ = _forward(st, [40, 30])
        sel, _, budgets = st.selection(2)
        assert budgets.tolist() == [6, 6]
        for i in range(2):  # real entries first, in select's order
            assert sel[0, i, :6].tolist() == [_slot(bt, i, p) for p in range(5, -1, -1)]

    @pytest.mark.parametrize("recent_window", [0, 2])
    def test_collect2_subclass_selects_what_the_fast_path_selects(self, recent_window):
        """Collect2's own select on the generic path and the fused fast path, on the same
        forward: the same positions per layer and request (the fast path as before the
        selection paths: see collect_layer_slots)."""
        from vegas.vllm_plugin.selectors import ScoreTopKFastPath
        from vegas.vllm_plugin.selectors.generic import GenericPath

        generic = _state("collect2_subclass", kv_budget=7, recent_window=recent_window)
        fast = _state("collect2", kv_budget=7, recent_window=recent_window)
        assert isinstance(generic.path, GenericPath) and isinstance(fast.path, ScoreTopKFastPath)
        lens = [70, 41]
        _forward(generic, lens, seed=3)
        bt, md, queries, kvs = _forward(fast, lens, seed=3)
        plan = _plan(md.query_start_loc, md.seq_lens, 70, "collect2", kv_budget=7, recent_window=recent_window)
        for layer in range(3):
            before = collect_layer_slots(plan, queries[layer], kvs[layer].unbind(1)[0], bt, 0.5)
            for i in range(2):
                want = sorted(before[i].tolist())
                assert sorted(fast.sel_buf[layer, i, :7].tolist()) == want
                assert sorted(generic.sel_buf[layer, i, :7].tolist()) == want
        assert torch.equal(generic.budget_buf[:2], fast.budget_buf[:2])

    def test_bad_selections_name_the_selector(self):
        from vegas.config import VegasPluginError

        st = _state("first_positions", kv_budget=6)
        calls = iter([2, 3, 2])  # a different count per layer
        st.path.selector.select = lambda inputs, n=calls: Selection(
            indices=torch.zeros(2, 1, 6, dtype=torch.long), mask=torch.arange(6).expand(2, 1, 6) < next(n)
        )
        with pytest.raises(VegasPluginError, match="'first_positions'.*different number of positions per layer"):
            _forward(st, [40, 30])
        st = _state("first_positions", kv_budget=6)
        st.path.selector.select = lambda inputs: Selection(
            indices=torch.zeros(2, 2, 6, dtype=torch.long), mask=torch.ones(2, 2, 6, dtype=torch.bool)
        )
        with pytest.raises(VegasPluginError, match=r"groups dimension is 2; it must be one of \[1\]"):
            _forward(st, [40, 30])

    def test_query_aware_selector_without_fast_path_is_refused(self):
        from vegas.vllm_plugin.settings import raise_if_unsupported

        class QuestVariant(QuestSelector):
            name = "quest_variant"

        config = VegasConfig()
        with pytest.raises(VegasConfigError, match="'quest_variant'.*query-aware.*no vLLM fast path"):
            raise_if_unsupported(QuestVariant(config), config)


class TestFastPathRegistry(TestSelectors):
    def test_picked_by_exact_class(self):
        from vegas.plugins import vllm_fast_path
        from vegas.vllm_plugin.selectors import ScoreTopKFastPath
        from vegas.vllm_plugin.selectors.generic import GenericPath

        class AggregatedVariant(AggregatedSelector):
            name = "aggregated_variant"

            def select(self, inputs):
                return super().select(inputs)

        config = VegasConfig()
        assert vllm_fast_path(AggregatedSelector(config)) is ScoreTopKFastPath
        assert vllm_fast_path(AggregatedVariant(config)) is None
        assert path_class(AggregatedVariant(config)) is GenericPath
        assert path_class(Collect2Subclass(config)) is GenericPath

    def test_a_plugin_registers_a_fast_path_through_the_hook(self):
        from vegas import hookimpl, plugins
        from vegas.vllm_plugin.selectors.sliding_window import SlidingWindowFastPath

        class Plugin:
            @hookimpl
            def vegas_vllm_fast_paths(self):
                return {FirstPositionsSelector: SlidingWindowFastPath, Collect2Selector: SlidingWindowFastPath}

        plugins.register(Plugin(), name="test_fast_paths")
        try:
            config = VegasConfig()
            assert path_class(FirstPositionsSelector(config)) is SlidingWindowFastPath
            # a built-in's fast path cannot be replaced
            assert path_class(Collect2Selector(config)).__name__ == "ScoreTopKFastPath"
        finally:
            plugins.unregister("test_fast_paths")


def test_draft_graphs_are_captured_after_vllms_graphs(monkeypatch):
    """patch_draft_graph_capture: vLLM's capture_model runs first, then the drafter's
    capture_draft_graphs, and the graph memory vLLM reports includes the drafts'."""
    import sys
    import types

    import torch

    from vegas.vllm_plugin import patches

    calls = []
    runner_cls = type("GPUModelRunner", (), {"capture_model": lambda self: calls.append("vllm") or 100})
    mod = types.ModuleType("vllm.v1.worker.gpu_model_runner")
    mod.GPUModelRunner = runner_cls
    for name in ("vllm", "vllm.v1", "vllm.v1.worker"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_model_runner", mod)
    free = iter([1000, 700])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (next(free), 2000))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    patches.patch_draft_graph_capture()
    patched = runner_cls.capture_model
    patches.patch_draft_graph_capture()  # idempotent
    assert runner_cls.capture_model is patched

    runner = runner_cls()
    runner.drafter = types.SimpleNamespace(capture_draft_graphs=lambda: calls.append("drafts") or 16)
    assert runner.capture_model() == 100 + 300 and calls == ["vllm", "drafts"]
    plain = runner_cls()  # an engine without the Vegas proposer: vLLM's result, nothing else
    plain.drafter = None
    calls.clear()
    assert plain.capture_model() == 100 and calls == ["vllm"]


@pytest.mark.parametrize("in_draft", [False, True, "bind"])
@pytest.mark.parametrize("sliding", [False, True])
def test_draft_engine_runs_gamma_forwards_over_the_selection(monkeypatch, sliding, in_draft):
    """DraftEngine.run (the body both runners draft with, eager here and captured on a GPU):
    per draft step the active row writes its KV at its own slot and attends its budget plus
    the pages from ctx_sel on, one page more each step; inactive rows write nothing; each
    step's sampled token is the next step's input; the sampler sees every step. With
    ``sliding``, layer 0 is a sliding-window layer (Gemma 2): it drafts over its own window of
    the paged cache (the runner's block table, positions 0..p), layer 1 over the selection.
    With ``in_draft`` (``vllm.select_in_draft``) the draft phase selects (``"bind"``: reading
    the key caches, scale and heads from the layers, as before any verification deferred) and
    the active row's selected pages are those of the verification's own selection."""
    import contextlib
    import sys
    import types
    from types import SimpleNamespace

    from vegas.vllm_plugin.drafting.engine import DraftEngine

    forward_log = []

    @contextlib.contextmanager
    def set_forward_context(attn_metadata, vllm_config, num_tokens, cudagraph_runtime_mode, batch_descriptor,
                            slot_mapping):
        md = next(m for m in attn_metadata.values() if m.window is None)
        forward_log.append({"seqused": md.seqused_k.tolist(), "slots": next(iter(slot_mapping.values())).tolist(),
                            "selected": sorted(attn_metadata["layers.1.attn"].block_table[0, :8].tolist()),
                            "layers": sorted(attn_metadata), "width": md.max_seq_len,
                            "schedules": {id(m.scheduler_metadata) for m in attn_metadata.values() if m.window is None},
                            "windows": {name: (m.window, m.seqused_k.tolist(), m.block_table.data_ptr(),
                                               m.max_seq_len, m.quest)
                                        for name, m in attn_metadata.items() if m.window is not None}})
        yield

    schedules = []

    def get_scheduler_metadata(**kw):  # FA3's tile schedule: one per draft step, every layer's
        schedules.append(kw)
        return torch.zeros(1)

    fake_config = types.ModuleType("vllm.config")
    fake_config.CUDAGraphMode = SimpleNamespace(NONE="none", PIECEWISE="piecewise")
    fake_fc = types.ModuleType("vllm.forward_context")
    fake_fc.set_forward_context = set_forward_context
    fake_fc.BatchDescriptor = lambda num_tokens: SimpleNamespace(num_tokens=num_tokens)
    fake_fa = types.ModuleType("vllm.v1.attention.backends.flash_attn")
    fake_fa.get_scheduler_metadata = get_scheduler_metadata
    for name, mod in (("vllm", types.ModuleType("vllm")), ("vllm.config", fake_config),
                      ("vllm.forward_context", fake_fc), ("vllm.v1.attention.backends.flash_attn", fake_fa)):
        monkeypatch.setitem(sys.modules, name, mod)

    vocab = 50

    class Model:  # next token = input + 1: drafts of the active row count up from its last token
        def __call__(self, input_ids, positions, intermediate_tensors, inputs_embeds):
            forward_log[-1]["input_ids"] = input_ids.tolist()
            forward_log[-1]["positions"] = positions.tolist()
            return input_ids.float()[:, None]

        def compute_logits(self, hidden):
            return torch.nn.functional.one_hot((hidden[:, 0].long() + 1) % vocab, vocab).float()

    lens = [70, 40]
    bt, nb = _block_table(lens, 3)
    table = torch.cat([bt, bt])  # 4 rows
    md = SimpleNamespace(query_start_loc=torch.tensor([0, 5, 10], dtype=torch.int32),
                         seq_lens=torch.tensor(lens, dtype=torch.int32), max_seq_len=70, block_table=bt)
    g = torch.Generator().manual_seed(2)
    queries = [torch.randn(10, 4, 8, generator=g) for _ in range(2)]
    kvs = [torch.randn(nb, 2, BS, 2, 8, generator=g) for _ in range(2)]

    def verified_state(select_in_draft):
        state = SelectionState(select_in_draft=select_in_draft)
        state.use(_path("collect2", kv_budget=8, recent_window=2))
        state.gamma = GAMMA
        state.first_layer, state.last_layer, state.layers_ready = 0, 1, True
        state.reserve(4, 12, 5 * 4 * 8, torch.float32, torch.device("cpu"))
        for layer in range(2):
            state.on_layer(layer, queries[layer], kvs[layer], md, 0.5)
        return state

    step_in = torch.tensor([[1, 0, 0, 0], [7, 0, 0, 0], [70, 0, 0, 0], [6, 0, 0, 0]])
    want_tables, _, _ = draft_tables(verified_state(False), step_in, table, 4, GAMMA)
    state = verified_state(bool(in_draft))
    if in_draft == "bind":
        state.key_caches = []  # the engine reads them from the layers
    impl = SimpleNamespace(num_heads=4, num_kv_heads=2, head_size=8, logits_soft_cap=0.0, vllm_flash_attn_version=3,
                           sliding_window=None, scale=0.5)
    impl0 = SimpleNamespace(**{**vars(impl), "sliding_window": (7, 0) if sliding else (-1, -1)})
    config = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=4096, get_vocab_size=lambda: vocab, dtype=torch.bfloat16),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        compilation_config=SimpleNamespace(static_forward_context={
            "layers.0.attn": SimpleNamespace(impl=impl0, kv_cache=kvs[0]),
            "layers.1.attn": SimpleNamespace(impl=impl, kv_cache=kvs[1])}),
    )
    engine = DraftEngine(config, state, GAMMA, VegasConfig().vllm, "cpu", block_table=lambda: table, model=Model)
    engine.set_layers([("layers.0.attn", 0), ("layers.1.attn", 1)])
    bufs = engine.buffers(4, with_probs=False)
    # row 0 is active (last token 7 at position 70, 6 blocks); rows 1-3 are not
    bufs.fill(4, step_in)
    seen = []

    def sample(logits, j, b):
        seen.append(j)
        return logits.argmax(dim=-1)

    engine.run(bufs, 4, sample)
    assert seen == [0, 1, 2, 3] and bufs.tokens[0].tolist() == [8, 9, 10, 11]
    assert [f["input_ids"][0] for f in forward_log] == [7, 8, 9, 10]
    assert [f["positions"] for f in forward_log] == [[70 + j, 0, 0, 0] for j in range(GAMMA)]
    base = 8 + 70 - 65 + 1  # budget + positions ctx_sel .. the first draft
    assert [f["seqused"][0] for f in forward_log] == [base + j for j in range(GAMMA)]
    assert all(f["seqused"][1:] == [1 + j] * 3 for j, f in enumerate(forward_log))
    assert [f["slots"][:4] for f in forward_log] == [[_slot(bt, 0, 70 + j), -1, -1, -1] for j in range(GAMMA)]
    assert all(f["layers"] == ["layers.0.attn", "layers.1.attn"] for f in forward_log)
    assert all(f["selected"] == sorted(want_tables[1, 0, :8].tolist()) for f in forward_log)
    assert state.select_in_draft == bool(in_draft) and len(state.key_caches) == 2 * bool(in_draft)
    # one FA3 schedule per step, shared by the layers, with the step's pages and width
    assert len(schedules) == GAMMA and all(len(f["schedules"]) == 1 for f in forward_log)
    if sliding:  # layer 0: its window (7, 0) of the paged cache, the runner's table, positions 0..p
        assert engine.windows == {"layers.0.attn": (7, 0)}
        assert [f["windows"]["layers.0.attn"] for f in forward_log] == [
            ((7, 0), [70 + j + 1, 1, 1, 1], table.data_ptr(), 4096, None) for j in range(GAMMA)]
    else:
        assert engine.windows == {} and all(f["windows"] == {} for f in forward_log)
    assert all(k["page_size"] == 1 and k["max_seqlen_q"] == 1 and k["num_splits"] == 1 and k["batch_size"] == 4
               and k["max_seqlen_k"] == forward_log[0]["width"] and k["qkv_dtype"] == torch.bfloat16
               for k in schedules)


def test_a_prefill_heavy_forward_neither_selects_nor_drafts():
    """``vllm.prefill_skip_tokens``: a forward with at least that many prompt tokens (beyond
    γ + 1 per request) leaves the selection buffers alone and tells the drafter to skip once;
    a decode-only forward selects as before."""
    from types import SimpleNamespace

    st = _state("collect2", kv_budget=7, first_layer=0, last_layer=1, layers_ready=True, prefill_skip_tokens=20)

    def forward(lens, query_lens):
        bt, nb = _block_table(lens, 5)
        qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        md = SimpleNamespace(query_start_loc=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32),
                             max_seq_len=max(lens), block_table=bt, num_actual_tokens=sum(query_lens),
                             max_query_len=max(query_lens))
        for layer in range(2):
            st.on_layer(layer, torch.randn(sum(query_lens), 4, 8), torch.randn(nb, 2, BS, 2, 8), md, 0.5)
        return md

    md = forward([60, 50], [5, 5])  # decode only: selects
    assert st.prompt_tokens(md) == 0 and not st.take_skip()
    assert st.selection(2)[2].tolist() == [7, 7]
    before = st.sel_buf.clone()
    md = forward([60, 50, 40], [5, 5, 24])  # a 24-token prefill chunk: 34 - 3 * 5 = 19 prompt tokens
    assert st.prompt_tokens(md) == 19 and not st.take_skip()
    before = st.sel_buf.clone()
    md = forward([60, 50, 40], [5, 5, 25])  # 20 prompt tokens: skipped
    assert st.prompt_tokens(md) == 20 and st.plan is None
    assert torch.equal(st.sel_buf, before)
    assert st.take_skip() and not st.take_skip()  # once
    st.prefill_skip_tokens = 0  # 0: never skips
    forward([60, 50, 40], [5, 5, 400])
    assert not st.take_skip() and st.plan is not None
    # the scheduler's decision, when it makes one, wins over the forward's own count
    st.prefill_skip_tokens = 20
    st.scheduled_skip = False
    forward([60, 50, 40], [5, 5, 400])  # 390 prompt tokens, but the scheduler reserved draft slots
    assert not st.take_skip() and st.plan is not None
    st.scheduled_skip = True
    forward([60, 50], [1, 1])  # the step after a skip: one token per request, yet the scheduler said skip
    assert st.take_skip() and st.plan is None


def test_attention_layers_keep_sliding_window_layers_and_refuse_an_all_sliding_model(monkeypatch):
    """Gemma 2: sliding-window layers are attention layers Vegas drafts through (over their own
    window, :func:`sliding_windows`); a model with no full-attention layer is refused. Every
    attention layer carries the drafter's selection state (what the attention override reads);
    other modules and refused models get none."""
    import sys
    import types
    from types import SimpleNamespace

    from vegas.vllm_plugin.drafting import attention as attention_mod
    from vegas.vllm_plugin.drafting.engine import attention_layers, sliding_windows

    class FlashAttentionImpl:
        def __init__(self, window):
            self.sliding_window = window

    fa = types.ModuleType("vllm.v1.attention.backends.flash_attn")
    fa.FlashAttentionImpl = FlashAttentionImpl
    utils = types.ModuleType("vllm.model_executor.models.utils")
    utils.extract_layer_index = lambda name: int(name.split(".")[2])
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends.flash_attn", fa)
    monkeypatch.setitem(sys.modules, "vllm.model_executor.models.utils", utils)
    monkeypatch.setattr(attention_mod, "_layer_idx", {})

    def config(windows, max_model_len=8192):
        ctx = {f"model.layers.{i}.self_attn.attn": SimpleNamespace(impl=FlashAttentionImpl(w))
               for i, w in enumerate(windows)}
        ctx["model.norm"] = SimpleNamespace()  # not an attention layer
        return SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=ctx),
                               model_config=SimpleNamespace(max_model_len=max_model_len))

    state = SelectionState()
    gemma2 = config([(4095, 0), None, (4095, 0), (-1, -1)])
    layers = attention_layers(gemma2, state)
    assert [idx for _, idx in layers] == [0, 1, 2, 3] and (state.first_layer, state.last_layer) == (0, 3)
    assert state.layers_ready
    ctx = gemma2.compilation_config.static_forward_context
    assert all(getattr(ctx[name], LAYER_ATTR) is state for name, _ in layers)
    assert not hasattr(ctx["model.norm"], LAYER_ATTR)
    assert sliding_windows(gemma2, layers) == {"model.layers.0.self_attn.attn": (4095, 0),
                                               "model.layers.2.self_attn.attn": (4095, 0)}
    all_sliding = config([(127, 0), (127, 0)])
    with pytest.raises(VegasConfigError, match="every attention layer of this model attends a sliding window"):
        attention_layers(all_sliding, SelectionState())
    assert not any(hasattr(m, LAYER_ATTR) for m in all_sliding.compilation_config.static_forward_context.values())
    # a window as long as the engine's context drops no key: those layers attend everything
    # (vLLM windows every layer of a non-interleaved config that sets sliding_window)
    long_windows = config([(4095, 0), (4095, 0)], max_model_len=3200)
    assert sliding_windows(long_windows, attention_layers(long_windows, SelectionState())) == {}
    at_edge = config([(3198, 0), (3199, 0)], max_model_len=3200)
    assert sliding_windows(at_edge, attention_layers(at_edge, SelectionState())) == {
        "model.layers.0.self_attn.attn": (3198, 0)}
    with pytest.raises(VegasConfigError, match="FLASH_ATTN"):
        attention_layers(SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={
            "model.layers.0.attn": SimpleNamespace(impl=object())})), SelectionState())


@pytest.mark.parametrize("selector", ["collect2", "aggregated"])
def test_layer_by_layer_scores_select_what_the_one_launch_scores_select(monkeypatch, selector):
    """``vllm.score_overlap``: in a forward captured into a full CUDA graph each layer is scored
    right after its attention (on CUDA: a side stream) into one buffer; the selection equals
    the one of the all-layers launch at the last layer, and eager forwards keep that launch."""
    from types import SimpleNamespace

    from vegas.vllm_plugin.selectors import scores as scores_mod

    lens = [70, 40, 33]
    bt, nb = _block_table(lens, 7)
    qsl = torch.tensor([0, 5, 10, 15], dtype=torch.int32)
    md = SimpleNamespace(query_start_loc=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32),
                         max_seq_len=70, block_table=bt)
    g = torch.Generator().manual_seed(11)
    kvs = [torch.randn(nb, 2, BS, 3, 16, generator=g) for _ in range(4)]
    queries = [torch.randn(15, 9, 16, generator=g) for _ in range(4)]
    launches = []
    real = scores_mod.collect_scores_layers_reference
    monkeypatch.setattr(scores_mod, "collect_scores_layers_reference",
                        lambda q, *a: launches.append(q.shape[0]) or real(q, *a))

    def select(overlap, capturing):
        monkeypatch.setattr(SelectionState, "capturing", staticmethod(lambda query: capturing))
        st = _state(selector, kv_budget=9, first_layer=0, last_layer=3, layers_ready=True,
                    vllm={"score_overlap": overlap})
        launches.clear()
        for layer in range(4):
            st.on_layer(layer, queries[layer], kvs[layer], md, 0.25)
        sel, _, _ = st.selection(3)
        return sel.clone(), list(launches)

    want, one_launch = select(False, True)
    assert one_launch == [4]
    got, per_layer = select(True, True)
    assert per_layer == [1, 1, 1, 1]
    assert torch.equal(got, want)
    _, eager = select(True, False)  # an eager (piecewise) forward: one launch at the last layer
    assert eager == [4]


@pytest.mark.parametrize("selector", ["collect2", "aggregated", "last_token"])
def test_selection_in_draft_selects_and_tables_what_the_verification_would(monkeypatch, selector):
    """``vllm.select_in_draft``: the verification scores nothing (it keeps its collect queries,
    their weights and recent windows), and the draft phase's grouped selection
    (:class:`~vegas.vllm_plugin.drafting.in_draft.InDraftSelection`, CPU: in line) gives every
    active request the selection and draft tables of the verification's one launch; padded rows
    (inactive) select nothing. Rows of the draft phase (4) exceed the verification's (3)."""
    from types import SimpleNamespace

    from vegas.vllm_plugin.drafting.in_draft import InDraftSelection, layer_groups
    from vegas.vllm_plugin.selectors import scores as scores_mod

    lens = [70, 40, 33]
    bt, nb = _block_table(lens, 3)
    bt = torch.cat([bt, bt[:1]])  # the draft's table has a padded fourth row
    qsl = torch.tensor([0, 5, 10, 15], dtype=torch.int32)
    md = SimpleNamespace(query_start_loc=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32),
                         max_seq_len=70, block_table=bt[:3])
    g = torch.Generator().manual_seed(5)
    layers = 5
    kvs = [torch.randn(nb, 2, BS, 3, 16, generator=g) for _ in range(layers)]
    queries = [torch.randn(15, 9, 16, generator=g) for _ in range(layers)]
    launches = []
    real = scores_mod.collect_scores_layers_reference
    monkeypatch.setattr(scores_mod, "collect_scores_layers_reference",
                        lambda q, *a: launches.append(q.shape[0]) or real(q, *a))
    # active rows 0-2 (row 1 rejected two drafts: its next position is 2 before its length), row 3 padding
    step_inputs = torch.tensor([[1, 1, 1, 0], [7, 8, 9, 0], [70, 38, 33, 0], [5, 3, 3, 0]])

    def run(in_draft):
        st = _state(selector, kv_budget=9, first_layer=0, last_layer=layers - 1, layers_ready=True,
                    select_in_draft=in_draft)
        st.reserve(4, 9, (GAMMA + 1) * 9 * 16, torch.float32, torch.device("cpu"))
        launches.clear()
        for layer in range(layers):
            st.on_layer(layer, queries[layer], kvs[layer], md, 0.25)
        scored = list(launches)
        if in_draft:
            assert st.has_selection and scored == []  # nothing scored in the verification
            tables, base_used, ready = InDraftSelection().tables(st, step_inputs, bt, 4, GAMMA, 96)
            assert ready == {}
        else:
            assert scored == [layers]
            tables, base_used, _ = draft_tables(st, step_inputs, bt, 4, GAMMA)
        return st.sel_buf[:, :4].clone(), tables, base_used, st.budget_buf[:3].clone()

    want_sel, want_tables, want_used, budgets = run(False)
    got_sel, got_tables, got_used, _ = run(True)
    assert torch.equal(got_used[:3], want_used[:3]) and got_used[3] == 1
    assert got_tables.shape == want_tables.shape
    for s in range(3):
        k = int(budgets[s])
        assert k > 0
        # the selected entries (the recent window's +inf ties may come in any order) ...
        assert torch.equal(got_sel[:, s, :k].sort(dim=-1).values, want_sel[:, s, :k].sort(dim=-1).values)
        assert torch.equal(got_tables[:, s, :k].sort(dim=-1).values, want_tables[:, s, :k].sort(dim=-1).values)
        # ... then the recent and draft positions' pages, column for column
        assert torch.equal(got_tables[:, s, k:], want_tables[:, s, k:])
    assert (got_sel[:, 3, :] == -1).all()  # the padded row selects nothing
    assert layer_groups(30) == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 25), (25, 30)]
    assert layer_groups(5) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert layer_groups(8, 3) == [(0, 3), (3, 6), (6, 8)]


def test_select_in_draft_is_refused_with_the_options_it_replaces():
    from vegas.vllm_plugin.runners.start import select_in_draft

    assert VegasConfig(vllm={"select_in_draft": True}).vllm.select_in_draft
    # the default (None) is on unless an option that replaces the same score pass is set
    assert VegasConfig().vllm.select_in_draft is None and select_in_draft(VegasConfig().vllm)
    assert not select_in_draft(VegasConfig(vllm={"select_in_draft": False}).vllm)
    assert not select_in_draft(VegasConfig().vllm, "v1")  # measured on the V2 runner only
    assert select_in_draft(VegasConfig(vllm={"select_in_draft": True}).vllm, "v1")
    for other in ({"score_overlap": True}, {"score_path": "cute"}):
        assert not select_in_draft(VegasConfig(vllm=other).vllm)
    for other in ({"score_overlap": True}, {"score_path": "cute"}):
        with pytest.raises(VegasConfigError, match="vllm.select_in_draft .*cannot be combined"):
            VegasConfig(vllm={"select_in_draft": True, **other})
    with pytest.raises(VegasConfigError, match="vllm.select_in_draft must be true, false or null"):
        VegasConfig(vllm={"select_in_draft": "yes"})


def test_layer_offsets_are_computed_once_per_layout_and_never_first_inside_a_capture():
    """The one cache of key-cache offsets both score launches use (the verification's, all layers;
    the in-draft selection's, per layer group): computed eagerly, reused, refused inside a capture."""
    from vegas.vllm_plugin.selectors.scores import LayerOffsets

    cache = torch.zeros(3, 2, 4, 2, 8)
    keys = [cache[i].unbind(0)[0] for i in range(3)]
    offsets = LayerOffsets()
    first = offsets.get(keys, capturing=False)
    assert first[0].tolist() == [0, 2 * 4 * 2 * 8, 2 * 2 * 4 * 2 * 8] and offsets.get(keys, capturing=True) is first
    with pytest.raises(RuntimeError, match="first seen inside CUDA-graph capture"):
        offsets.get(keys[1:], capturing=True)
    assert offsets.get(keys[1:], capturing=False)[0].tolist() == [0, 2 * 4 * 2 * 8]
