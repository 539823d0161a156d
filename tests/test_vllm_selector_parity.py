"""One selection per selector: every built-in selector's vLLM fast path
(:mod:`vegas.vllm_plugin.selectors`) selects exactly the cache slots that its ``Selector.select``
(:mod:`vegas.strategies`, the HF backend's selection and the reference) selects on the same
queries and keys, on a tiny paged cache on the CPU (the fast paths then run through
:mod:`vegas.kernels.reference`).

The reference side is built here from the paged cache by hand (keys gathered by position,
logits summed over the selector's score rows and every query head), not through the vLLM
plumbing, and handed to ``select`` / ``select_for_query``; positions are mapped to slots
through the block table. Cases: chunk lengths shorter than, equal to and longer than γ + 1
(prefill chunks), GQA ratios 1, 2 and 4, vLLM block sizes 16 and 32."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vegas.config import VegasConfig
from vegas.interfaces import SelectionInput
from vegas.plugins import create_selector
from vegas.vllm_plugin.selectors import QuestFastPath, ScoreTopKFastPath, SlidingWindowFastPath
from vegas.vllm_plugin.settings import path_class
from vegas.vllm_plugin.selection.state import SelectionState

GAMMA = 4
LAYERS = 2
D = 8
SCALE = 0.35
#: (query length, context before the chunk) per request: a short chunk, a verification chunk
#: of γ + 1, a prefill chunk longer than γ + 1, and a request whose context is under its budget
BATCH = [(2, 90), (GAMMA + 1, 133), (23, 70), (GAMMA + 1, 9)]
SHAPES = [(bs, hq, hkv) for bs in (16, 32) for hq, hkv in ((2, 2), (4, 2), (8, 2))]


class Forward(SimpleNamespace):
    """One full-attention forward of a batch on a paged cache (vLLM's layouts):
    ``queries[layer]`` ``(num_tokens, hq, D)``, ``kvs[layer]`` ``(num_blocks, 2, bs, hkv, D)``,
    ``md`` vLLM's FlashAttention metadata."""


def _forward(batch, bs, hq, hkv, seed=0, reserve=0) -> Forward:
    """``batch``: ``(query length, context before it)`` per request; ``reserve``: tokens of
    blocks each request holds beyond its sequence (for the next forward's writes)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in batch]
    blocks = [-(-(n + reserve) // bs) for n in seq_lens]
    perm = torch.randperm(sum(blocks) + 3, generator=g)  # scattered blocks, spare ones unused
    bt = torch.full((len(batch), max(blocks) + 1), 0, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks):
        bt[i, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    qsl = torch.tensor([0] + [q for q, _ in batch], dtype=torch.int32).cumsum(0).to(torch.int32)
    slots = torch.cat([_slots(bt[i], torch.arange(c, c + q), bs) for i, (q, c) in enumerate(batch)])
    md = SimpleNamespace(query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                         max_seq_len=max(seq_lens), block_table=bt, slot_mapping=slots)
    num_tokens = int(qsl[-1])
    return Forward(
        batch=batch, bs=bs, hq=hq, hkv=hkv, md=md, bt=bt,
        queries=[torch.randn(num_tokens, hq, D, generator=g) for _ in range(LAYERS)],
        kvs=[torch.randn(sum(blocks) + 3, 2, bs, hkv, D, generator=g) for _ in range(LAYERS)],
    )


def _slots(bt_row: torch.Tensor, positions: torch.Tensor, bs: int) -> torch.Tensor:
    """Cache slot ids ``(n,)`` int64 of token positions of one request."""
    return bt_row[positions // bs].long() * bs + positions % bs


def _keys(fw: Forward, layer: int, i: int, length: int) -> torch.Tensor:
    """``(hkv, length, D)`` keys of request ``i``'s positions ``[0, length)``."""
    s = _slots(fw.bt[i], torch.arange(length), fw.bs)
    return fw.kvs[layer][s // fw.bs, 0, s % fw.bs].permute(1, 0, 2)


def _run_fast_path(name: str, fw: Forward, **config) -> SelectionState:
    """``SelectionState.on_layer`` of every layer with the selector's fast path, as vLLM's attention
    override calls it."""
    selector = create_selector(name, VegasConfig(num_draft_tokens=GAMMA, **config))
    st = SelectionState(gamma=GAMMA, enabled=True, first_layer=0, last_layer=LAYERS - 1, layers_ready=True)
    st.use(path_class(selector)(selector, GAMMA, torch.device("cpu")))
    for layer in range(LAYERS):
        st.on_layer(layer, fw.queries[layer], fw.kvs[layer], fw.md, SCALE)
    return st


def _chunk(fw: Forward, i: int) -> tuple[int, int]:
    """``(first collect query's token index, collect queries c)`` of request ``i``: the last
    ``min(query_len, γ + 1)`` queries of its chunk."""
    start, end = int(fw.md.query_start_loc[i]), int(fw.md.query_start_loc[i + 1])
    c = min(end - start, GAMMA + 1)
    return end - c, c


def _reference_inputs(selector, fw: Forward, layer: int, with_scores: bool) -> SelectionInput:
    """What the HF backend hands ``select``: per request, the summed logits of
    ``score_rows(c)`` over every query head at positions ``[0, ctx)`` (ctx = positions before
    the collect queries), ``valid`` = those positions, budget ``min(budget(ctx), ctx)``."""
    n = len(fw.batch)
    ctx = torch.tensor([int(fw.md.seq_lens[i]) - _chunk(fw, i)[1] for i in range(n)])
    max_len = int(fw.md.max_seq_len)
    valid = torch.arange(max_len)[None, :] < ctx[:, None]
    scores = None
    if with_scores:
        scores = torch.zeros(n, 1, max_len)
        for i in range(n):
            first, c = _chunk(fw, i)
            q = fw.queries[layer][[first + r for r in selector.score_rows(c)]]  # [rows, hq, D]
            k = _keys(fw, layer, i, int(ctx[i])).repeat_interleave(fw.hq // fw.hkv, dim=0)  # [hq, ctx, D]
            scores[i, 0, : int(ctx[i])] = torch.einsum("rhd,htd->t", q, k) * SCALE
    budget = torch.minimum(selector.budget(ctx), ctx)
    return SelectionInput(layer_idx=layer, scores=scores, valid=valid, budget=budget)


def _reference_slots(fw: Forward, i: int, selection) -> list[int]:
    positions = selection.indices[i, 0][selection.mask[i, 0]]
    return sorted(_slots(fw.bt[i], positions, fw.bs).tolist())


@pytest.mark.parametrize("bs,hq,hkv", SHAPES)
@pytest.mark.parametrize("name,config", [
    ("collect2", {"kv_budget": 24}),
    ("collect2", {"sparsity_ratio": 0.3, "min_kv_budget": 0, "recent_window": 5}),
    ("aggregated", {"kv_budget": 24}),
    ("aggregated", {"kv_budget": 40, "recent_window": 8}),
    ("last_token", {"kv_budget": 17}),
])
def test_score_selectors_fast_path_selects_what_select_selects(name, config, bs, hq, hkv):
    fw = _forward(BATCH, bs, hq, hkv, seed=bs + hq)
    st = _run_fast_path(name, fw, **config)
    assert type(st.path) is ScoreTopKFastPath
    selector = st.path.selector
    for layer in range(LAYERS):
        inputs = _reference_inputs(selector, fw, layer, with_scores=True)
        selection = selector.select(inputs)
        sel, ctx_sel, budgets = st.selection(len(BATCH))
        assert torch.equal(budgets, inputs.budget) and torch.equal(ctx_sel, inputs.valid.sum(1))
        for i in range(len(BATCH)):
            k = int(budgets[i])
            assert sorted(sel[layer, i, :k].tolist()) == _reference_slots(fw, i, selection), (layer, i)
            assert (sel[layer, i, k:] == -1).all()


@pytest.mark.parametrize("bs,hq,hkv", SHAPES)
@pytest.mark.parametrize("config", [{"kv_budget": 24}, {"kv_budget": 30, "num_sinks": 0}, {"window": 11}])
def test_sliding_window_fast_path_selects_what_select_selects(config, bs, hq, hkv):
    fw = _forward(BATCH, bs, hq, hkv, seed=bs)
    st = _run_fast_path("sliding_window", fw, **config)
    assert type(st.path) is SlidingWindowFastPath
    selector = st.path.selector
    selection = selector.select(_reference_inputs(selector, fw, 0, with_scores=False))
    sel, _, budgets = st.selection(len(BATCH))
    assert sel.shape[0] == 1  # one selection for every layer
    for i in range(len(BATCH)):
        k = int(budgets[i])
        assert sorted(sel[0, i, :k].tolist()) == _reference_slots(fw, i, selection), i
        assert int(selection.mask[i, 0].sum()) == k


@pytest.mark.parametrize("bs,hq,hkv", SHAPES)
@pytest.mark.parametrize("kv_budget", [40, 64, 1000])
def test_quest_fast_path_chooses_the_pages_select_for_query_chooses(kv_budget, bs, hq, hkv):
    """Quest: the page bounds the fast path keeps for the blocks the forwards wrote (a prefill,
    then a verification), and the pages its draft attention chooses for a draft query
    (``draft_pages`` + :func:`~vegas.vllm_plugin.selectors.quest.fill_draft_table`), against
    ``QuestSelector.select`` + ``select_for_query`` over the same keys, pages = vLLM blocks."""
    from vegas.vllm_plugin.selectors.quest import fill_draft_table

    contexts = [150, 97, 64, 260]
    prefill = _forward([(c, 0) for c in contexts], bs, hq, hkv, seed=7, reserve=GAMMA + 1)
    st = _run_fast_path("quest", prefill, kv_budget=kv_budget, page_size=bs)
    assert type(st.path) is QuestFastPath
    verify = _forward([(GAMMA + 1, c) for c in contexts], bs, hq, hkv, seed=8)
    verify.bt, verify.md.block_table = prefill.bt, prefill.bt  # the same requests: the same blocks
    verify.md.slot_mapping = torch.cat([_slots(prefill.bt[i], torch.arange(c, c + GAMMA + 1), bs)
                                        for i, c in enumerate(contexts)])
    for layer in range(LAYERS):  # the verification's keys land in the prefill's cache
        kv = prefill.kvs[layer]
        s = verify.md.slot_mapping
        kv[s // bs, 0, s % bs] = verify.kvs[layer][s // bs, 0, s % bs]
        verify.kvs[layer] = kv
    for layer in range(LAYERS):
        st.on_layer(layer, verify.queries[layer], verify.kvs[layer], verify.md, SCALE)
    n = len(contexts)
    _, ctx_sel, budgets = st.selection(n)
    assert (ctx_sel % bs == 0).all()  # whole pages; the partial page joins the recent positions

    selector = create_selector("quest", VegasConfig(num_draft_tokens=GAMMA, kv_budget=kv_budget, page_size=bs))
    plan_ctx = torch.tensor(contexts)  # positions before the collect queries
    # what the HF backend hands Quest after this verification accepted every draft: all
    # committed positions, the verified chunk included (Quest keeps the chunk and the partial
    # page apart, as the fast path's ctx_sel does)
    committed = plan_ctx + GAMMA + 1
    valid = torch.arange(int(committed.max()))[None, :] < committed[:, None]
    budget = torch.minimum(selector.budget(plan_ctx), plan_ctx)
    g = torch.Generator().manual_seed(9)
    for layer in range(LAYERS):
        keys = torch.zeros(n, hkv, valid.shape[1], D)
        for i in range(n):
            keys[i, :, : int(committed[i])] = _keys(verify, layer, i, int(committed[i]))
        selector.select(SelectionInput(layer_idx=layer, scores=None, valid=valid, budget=budget, keys=keys))
        query = torch.randn(n, hq, D, generator=g)  # one draft step's queries
        reference = selector.select_for_query(layer, query[:, :, None, :], None)
        width = int(budgets.max())
        pages = st.path.draft_pages(st, prefill.bt, ctx_sel, budgets, torch.ones(n, dtype=torch.bool), width)
        table = torch.full((n, width), -1, dtype=torch.int32)
        fill_draft_table(table, query, hkv, pages, layer)
        for i in range(n):
            k = int(budgets[i])
            fa_pages = table[i, :k].long()  # page-size-1 ids of the view: block * 2 * bs + offset
            slots = (fa_pages // (2 * bs)) * bs + fa_pages % (2 * bs)
            chosen = reference.indices[i, 0][reference.mask[i, 0]]
            want, recent = chosen[chosen < ctx_sel[i]], chosen[chosen >= ctx_sel[i]]
            assert sorted(slots.tolist()) == sorted(_slots(prefill.bt[i], want, bs).tolist()), (layer, i)
            # the rest is what the fast path's drafts always attend: positions from ctx_sel on
            assert recent.tolist() == list(range(int(ctx_sel[i]), int(committed[i]))), (layer, i)
