"""Quest on the vLLM backend: page bounds kept in step with a paged cache through prefill,
verification and rejected drafts; page scores and draft tables against the HF backend's Quest
maths (CPU, no vLLM). The Triton page-score kernel against the reference: on CUDA in
tests/gpu/test_vllm_quest_cuda.py, on the CPU under Triton's interpreter in tests/test_kernels_interpreted.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vegas.kernels import slots_to_fa_pages
from vegas.kernels.quest_pages import (
    group_query,
    last_in_block,
    page_scores_reference,
    select_pages,
    update_page_bounds,
)
from vegas.strategies.quest import page_bounds, page_scores
from vegas.vllm_plugin.selectors.quest import QuestDraft, fill_draft_table, page_aligned_selection

BS, HKV, HQ, D = 16, 2, 6, 8


def _cache(num_blocks, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, 2, BS, HKV, D, generator=g)  # vLLM layout, stale data everywhere


def _write(kv, bt_row, positions, seed):
    """Write fresh keys at ``positions`` of one request; returns their slot ids."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.tensor([int(bt_row[p // BS]) * BS + p % BS for p in positions])
    kv[slots // BS, 0, slots % BS] = torch.randn(len(positions), HKV, D, generator=g)
    return slots


def _sequence_keys(kv, bt_row, length):
    pos = torch.arange(length)
    blocks = bt_row[pos // BS].long()
    return kv[blocks, 0, pos % BS]  # (length, HKV, D)


def test_page_bounds_follow_prefill_verification_and_rejected_drafts():
    """Two requests share the forwards (with padding). After a prefill, a verification whose
    tail is later rejected, and the next verification that rewrites fewer slots, every page's
    bounds equal the HF backend's page_bounds over the request's current keys: stale keys of
    the reused blocks and of the rejected tail do not count."""
    nb = 12
    kv = _cache(nb)
    bt = torch.tensor([[7, 2, 9, 4], [1, 11, 5, 0]], dtype=torch.int32)
    kmin = torch.zeros(nb + 1, HKV, D)
    kmax = torch.zeros(nb + 1, HKV, D)
    pad = torch.tensor([-1, -1])

    def forward(writes, seed):
        parts = [_write(kv, bt[r], pos, seed + r) for r, pos in writes] + [pad]
        update_page_bounds(kmin, kmax, kv.unbind(1)[0], torch.cat(parts))

    forward([(0, range(0, 37)), (1, range(0, 20))], 10)  # prefill
    forward([(0, range(37, 47)), (1, range(20, 25))], 20)  # verification writing 10 and 5 slots
    forward([(0, range(39, 44)), (1, range(22, 27))], 30)  # 2 accepted: rewrite from position 39
    for r, length in ((0, 44), (1, 27)):
        keys = _sequence_keys(kv, bt[r], length)
        want_min, want_max, page_valid, _ = page_bounds(
            keys.permute(1, 0, 2)[None], torch.ones(1, length, dtype=torch.bool), BS
        )
        for p in range(int(page_valid.sum())):
            blk = int(bt[r, p])
            assert torch.equal(kmin[blk], want_min[0, :, p]), (r, p)
            assert torch.equal(kmax[blk], want_max[0, :, p]), (r, p)


def test_one_token_per_written_block_is_marked_last():
    # request A: slots 30, 31 (end of block 1), 32, 33 (block 2); request B: 80, 81; padding
    slots = torch.tensor([30, 31, 32, 33, 80, 81, -1, -1])
    assert last_in_block(slots, BS).tolist() == [False, True, False, True, False, True, False, False]
    # a request whose next block happens to follow its last slot, and a one-token request
    slots = torch.tensor([14, 15, 16, 47])
    assert last_in_block(slots, BS).tolist() == [False, True, True, True]


def test_page_scores_equal_the_hf_quest_bound():
    """The grouped-query bound over block ids equals the HF backend's per-head Quest bound
    summed over heads (granularity 'layer'), and pages beyond num_pages score -inf."""
    g = torch.Generator().manual_seed(3)
    nb, pages = 10, 4
    kmin = torch.randn(nb + 1, HKV, D, generator=g)
    kmax = kmin + torch.rand(nb + 1, HKV, D, generator=g)
    bt = torch.tensor([[3, 8, 1, 6], [2, 0, 9, 5]], dtype=torch.int32)
    q = torch.randn(2, HQ, D, generator=g)
    got = page_scores_reference(*group_query(q, HKV), kmin, kmax, bt, torch.tensor([4, 2]))
    for r in range(2):
        hf_min = kmin[bt[r].long()].permute(1, 0, 2)[None]  # (1, HKV, pages, D)
        hf_max = kmax[bt[r].long()].permute(1, 0, 2)[None]
        want = page_scores(q[r][None, :, None, :], hf_min, hf_max, groups=1)[0, 0]
        n = 4 if r == 0 else 2
        torch.testing.assert_close(got[r, :n], want[:n])
        assert torch.isinf(got[r, n:]).all() and (got[r, n:] < 0).all()
    assert pages == bt.shape[1]


def test_page_aligned_selection():
    ctx = torch.tensor([100, 100, 10, 48])
    budgets = torch.tensor([40, 100, 10, 20])
    ctx_q, budget_q = page_aligned_selection(ctx, budgets, BS)
    assert ctx_q.tolist() == [96, 96, 0, 48]
    # 40 -> 2 whole pages; a budget covering the context takes every whole page; 20 -> 1 page
    assert budget_q.tolist() == [32, 96, 0, 16]


def test_draft_table_gets_the_best_pages_and_keeps_the_recent_columns():
    """fill_draft_table writes the best pages' slots (as page-size-1 page ids) into columns
    [0, budget) of each row, best page first, and leaves every other column alone."""
    g = torch.Generator().manual_seed(4)
    nb = 10
    kmin = torch.randn(1, nb + 1, HKV, D, generator=g)
    kmax = kmin + torch.rand(1, nb + 1, HKV, D, generator=g)
    bt = torch.tensor([[3, 8, 1, 6, 2], [2, 0, 9, 5, 7]], dtype=torch.int32)
    q = torch.randn(2, HQ, D, generator=g)
    width = 2 * BS + 7
    table = torch.full((2, width), -5, dtype=torch.int32)
    qd = QuestDraft(kmin, kmax, bt, torch.tensor([4, 3]), torch.tensor([2 * BS, BS]), 2, BS, 2 * BS)
    fill_draft_table(table, q, HKV, qd, 0)
    scores = page_scores_reference(*group_query(q, HKV), kmin[0], kmax[0], bt, qd.num_pages)
    for r, k in ((0, 2), (1, 1)):
        best = scores[r].topk(k).indices
        slots = (bt[r, best].long()[:, None] * BS + torch.arange(BS)).flatten()
        assert torch.equal(table[r, : k * BS].long(), slots_to_fa_pages(slots, BS, 2 * BS))
        assert (table[r, k * BS :] == -5).all()
    assert select_pages(scores, 2, bt, BS).shape == (2, 2 * BS)


def test_on_layer_keeps_quest_bounds_and_page_aligned_budgets():
    """The selection state with selector 'quest': the first layer writes page-aligned ctx_sel
    and budgets; every layer updates its own bounds from the forward's slot mapping."""
    from vegas.config import VegasConfig
    from vegas.plugins import create_selector
    from vegas.vllm_plugin.selectors.quest import QuestFastPath
    from vegas.vllm_plugin.selection.state import SelectionState

    nb = 12
    bt = torch.tensor([[7, 2, 9, 4], [1, 11, 5, 0]], dtype=torch.int32)
    lens = [37, 20]
    qsl = torch.tensor([0, 37, 57], dtype=torch.int32)
    slots = torch.cat([torch.tensor([int(bt[r, p // BS]) * BS + p % BS for p in range(n)]) for r, n in enumerate(lens)])
    md = SimpleNamespace(query_start_loc=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32), max_seq_len=37,
                         block_table=bt, slot_mapping=slots)
    st = SelectionState(gamma=4, enabled=True)
    st.use(QuestFastPath(create_selector("quest", VegasConfig(kv_budget=20)), 4, torch.device("cpu")))
    st.first_layer, st.last_layer, st.layers_ready = 0, 1, True
    kvs = [_cache(nb, seed) for seed in (1, 2)]
    for layer in range(2):
        st.on_layer(layer, torch.randn(57, HQ, D), kvs[layer], md, 0.5)
    _, ctx_sel, budgets = st.selection(2)
    # a prefill: ctx_sel is the first of the last γ+1 positions (32 and 15), cut to whole pages
    assert ctx_sel.tolist() == [32, 0] and budgets.tolist() == [16, 0]
    for layer in range(2):
        keys = _sequence_keys(kvs[layer], bt[0], 37)
        want_min, want_max, _, _ = page_bounds(keys.permute(1, 0, 2)[None], torch.ones(1, 37, dtype=torch.bool), BS)
        for p in range(3):
            assert torch.equal(st.quest_min[layer, int(bt[0, p])], want_min[0, :, p])
            assert torch.equal(st.quest_max[layer, int(bt[0, p])], want_max[0, :, p])
