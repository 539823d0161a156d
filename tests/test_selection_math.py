"""Selector maths on tiny hand-made tensors."""

import math

import torch

from vegas import SelectionInput, VegasConfig
from vegas.selection import collect_scores, selection_from_keep, topk_selection
from vegas.strategies import AggregatedSelector, Collect2Selector, LastTokenSelector, QuestSelector, SlidingWindowSelector
from vegas.strategies.quest import page_bounds, page_scores


def selected(sel):
    return [[[int(i) for i, m in zip(ri, rm) if m] for ri, rm in zip(bi, bm)] for bi, bm in zip(sel.indices, sel.mask)]


def test_topk_known_answer_per_sequence_budget():
    scores = torch.tensor([[[0.1, 5.0, 3.0, 4.0, -1.0, 9.0]], [[7.0, 1.0, 2.0, 8.0, 6.0, 0.0]]])
    valid = torch.tensor([[True] * 5 + [False], [True] * 6])  # slot 5 of seq 0 is padding
    sel = topk_selection(scores, valid, torch.tensor([3, 2]))
    assert selected(sel) == [[[1, 2, 3]], [[0, 3]]]  # ascending slots, invalid 9.0 never chosen


def test_collect_scores_matches_bruteforce_and_respects_mask():
    torch.manual_seed(0)
    B, H, KVH, m, L, D = 2, 6, 2, 2, 7, 4
    q, k = torch.randn(B, H, m, D), torch.randn(B, KVH, L, D)
    allowed = torch.ones(B, m, L, dtype=torch.bool)
    allowed[0, 0, 5:] = False
    got = collect_scores(q, k, allowed, 0.5, groups=1)
    kr = k.repeat_interleave(H // KVH, dim=1)
    logits = (q @ kr.transpose(-1, -2)) * 0.5
    want = (logits * allowed[:, None]).sum(dim=(1, 2))[:, None]
    torch.testing.assert_close(got, want)
    per_head = collect_scores(q, k, allowed, 0.5, groups=KVH)
    torch.testing.assert_close(per_head.sum(1, keepdim=True), want)
    weights = collect_scores(q, k, allowed, 0.5, groups=1, score_mode="weight")
    assert torch.allclose(weights.sum(-1), torch.full((B, 1), float(H * m)))  # softmax rows sum to 1


def test_collect_scores_softcap_scores_the_capped_logits():
    """Gemma 2: the scores sum the capped logits the softmax sees. One head puts a huge logit on
    slot 0, two heads a moderate one on slot 1: raw sums rank slot 0 first, capped sums slot 1."""
    k = torch.eye(2)[None, None]  # [1, 1, 2 slots, D=2]: key i is the unit vector e_i
    q = torch.tensor([[[[20.0, 0.0]], [[0.0, 1.5]], [[0.0, 1.5]]]])  # [1, 3 heads, 1 row, 2]
    allowed = torch.ones(1, 1, 2, dtype=torch.bool)
    raw = collect_scores(q, k, allowed, 1.0, groups=1)
    capped = collect_scores(q, k, allowed, 1.0, groups=1, softcap=2.0)
    torch.testing.assert_close(raw, torch.tensor([[[20.0, 3.0]]]))
    want = torch.tensor([2.0 * math.tanh(20.0 / 2.0), 2 * 2.0 * math.tanh(1.5 / 2.0)])  # ~2.0, ~2.54
    torch.testing.assert_close(capped, want[None, None])
    assert raw.argmax() == 0 and capped.argmax() == 1
    weights = collect_scores(q, k, allowed, 1.0, groups=1, score_mode="weight", softcap=2.0)
    torch.testing.assert_close(weights.sum(-1), torch.full((1, 1), 3.0))


def test_score_rows():
    cfg = VegasConfig()
    assert AggregatedSelector(cfg).score_rows(5) == [0, 1, 2, 3, 4]
    assert Collect2Selector(cfg).score_rows(5) == [0, 4]
    assert Collect2Selector(cfg).score_rows(1) == [0]
    assert LastTokenSelector(cfg).score_rows(5) == [0]


def test_recent_window_is_kept_inside_budget():
    scores = torch.tensor([[[9.0, 8.0, 7.0, 0.0, 1.0, 0.5]]])
    inputs = SelectionInput(0, scores, torch.ones(1, 6, dtype=torch.bool), torch.tensor([3]), torch.zeros(1, 1, 6, 2))
    assert selected(AggregatedSelector(VegasConfig(recent_window=0)).select(inputs)) == [[[0, 1, 2]]]
    inputs.budget = torch.tensor([4])  # the recent window takes at most half the budget
    assert selected(AggregatedSelector(VegasConfig(recent_window=2)).select(inputs)) == [[[0, 1, 4, 5]]]
    assert selected(AggregatedSelector(VegasConfig(recent_window=64)).select(inputs)) == [[[0, 1, 4, 5]]]


def test_sliding_window_indices_sinks_and_window():
    valid = torch.tensor([[False, False] + [True] * 10, [True] * 12])  # seq 0 left-padded
    valid[1, 7] = False  # a rolled-back slot
    inputs = SelectionInput(0, None, valid, torch.tensor([5, 5]), torch.zeros(2, 1, 12, 2))
    sel = SlidingWindowSelector(VegasConfig(num_sinks=2)).select(inputs)
    assert selected(sel) == [[[2, 3, 9, 10, 11]], [[0, 1, 9, 10, 11]]]
    sel = SlidingWindowSelector(VegasConfig(num_sinks=1, window=2)).select(inputs)
    assert selected(sel) == [[[2, 10, 11]], [[0, 10, 11]]]


def test_selection_from_keep():
    keep = torch.tensor([[[True, False, True, True]], [[False, True, False, False]]])
    sel = selection_from_keep(keep)
    assert selected(sel) == [[[0, 2, 3]], [[1]]]


def test_quest_bound_is_an_upper_bound_of_every_key_score():
    torch.manual_seed(1)
    B, H, KVH, L, D, P = 2, 6, 2, 37, 8, 4
    keys, query = torch.randn(B, KVH, L, D), torch.randn(B, H, 1, D)
    valid = torch.ones(B, L, dtype=torch.bool)
    kmin, kmax, page_valid, _ = page_bounds(keys, valid, P)
    bound = page_scores(query, kmin, kmax, groups=KVH)  # [B, KVH, pages]
    true = (query.view(B, KVH, H // KVH, 1, D) @ keys[:, :, None].transpose(-1, -2)).squeeze(3)  # [B,KVH,g,L]
    true = true.sum(2)  # summed over the group's heads, like the bound
    for p in range(page_bounds(keys, valid, P)[0].shape[2]):
        page_true = true[..., p * P : (p + 1) * P]
        assert (bound[..., p : p + 1] >= page_true - 1e-5).all()


def test_quest_selects_the_page_of_a_planted_key():
    B, KVH, L, D, P = 1, 1, 64, 4, 8
    keys = torch.zeros(B, KVH, L, D)
    keys[0, 0, 42] = torch.tensor([10.0, 0, 0, 0])
    cfg = VegasConfig(page_size=P, kv_budget=P, recent_window=0)
    quest = QuestSelector(cfg)
    quest.select(SelectionInput(0, None, torch.ones(B, L, dtype=torch.bool), torch.tensor([P]), keys))
    sel = quest.select_for_query(0, torch.tensor([[[[1.0, 0, 0, 0]]]]), None)
    # the planted key's page, then the recent slots: the last whole page before the verified
    # chunk (γ + 1 = 5 of 64 slots) is page 6, so page 7 (56-63) is always attended
    assert selected(sel) == [[list(range(40, 48)) + list(range(56, 64))]]


def test_quest_incremental_bounds_equal_a_full_recompute():
    torch.manual_seed(2)
    B, KVH, D, P = 2, 2, 4, 4
    keys = torch.randn(B, KVH, 30, D)
    valid = torch.rand(B, 30) > 0.2
    cfg = VegasConfig(page_size=P, kv_budget=8)
    incremental = QuestSelector(cfg)
    for length in (9, 14, 22, 30):  # the cache grows between selections
        inputs = SelectionInput(0, None, valid[:, :length], torch.tensor([8, 8]), keys[:, :, :length])
        incremental.select(inputs)
    full = QuestSelector(cfg)
    full.select(inputs)
    got, want = incremental._pages[0], full._pages[0]
    for name in ("key_min", "key_max", "page_slots", "count"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name))


def test_quest_respects_the_budget_at_both_ends():
    L, P = 37, 8
    keys, valid = torch.randn(1, 1, L, 4), torch.ones(1, L, dtype=torch.bool)
    query = torch.randn(1, 1, 1, 4)

    def chosen(budget):
        quest = QuestSelector(VegasConfig(page_size=P))
        quest.select(SelectionInput(0, None, valid, torch.tensor([budget]), keys))
        return selected(quest.select_for_query(0, query, None))[0][0]

    # 37 slots, γ + 1 = 5: pages 0-3 (slots 0-31) are selectable, slots 32-36 always attended
    recent = list(range(32, L))
    assert chosen(P - 1) == recent  # no whole page fits: drafting sees only the recent slots
    two = chosen(2 * P + 3)
    assert two[-len(recent):] == recent and len(two) == 2 * P + len(recent)
    assert len({slot // P for slot in two[: -len(recent)]}) == 2  # two whole pages
    assert chosen(L) == list(range(L))  # a budget covering the context takes every slot


def test_quest_always_attends_the_verified_chunk_and_the_partial_page():
    """The tokens right before the drafts are attended whatever the page bounds say: a key
    that no query favours, in the last γ + 1 committed tokens, is in every draft's selection."""
    L, P = 45, 8
    keys = torch.randn(1, 1, L, 4)
    keys[0, 0, 43] = torch.tensor([-50.0, -50.0, -50.0, -50.0])  # the lowest bound of all
    quest = QuestSelector(VegasConfig(page_size=P, kv_budget=P))
    quest.select(SelectionInput(0, None, torch.ones(1, L, dtype=torch.bool), torch.tensor([P]), keys))
    got = selected(quest.select_for_query(0, torch.ones(1, 1, 1, 4), None))[0][0]
    assert got[-5:] == list(range(40, 45)) and len(got) == P + 5  # one page, then the partial page 40-44
