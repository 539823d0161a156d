"""Seeded drafting on vLLM's V1 runner (pure torch, runs on CPU): each request's draft-noise
seed follows its request id (its own seed, else one drawn for it), and the draft sampler draws
from noise keyed by that seed and the draft position only, whatever the batch around it.
vLLM's Triton ``gumbel_sample`` is replaced by a torch reference with the same contract."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from vegas.config import VegasConfig, VllmOptions
from vegas.vllm_plugin.drafting.engine import DraftBuffers
from vegas.vllm_plugin.runners.seeds import RequestSeeds, request_seed, seeded_sampler

GAMMA, VOCAB, MAX_LEN = 3, 50, 4096


class ReferenceGumbel:
    """``gumbel_sample``'s contract in torch: row ``t`` reads temperature and seed at
    ``idx[t]``, adds Gumbel noise that depends on ``(seed, pos[t])`` alone, writes the scaled
    logits to ``out[idx[t], col]``; temperature 0 adds no noise. Records the counters."""

    def __init__(self):
        self.counters = []

    def __call__(self, logits, idx, temperature, seed, pos, apply_temperature, output_processed_logits=None,
                 output_processed_logits_col=None, use_fp64=False):
        self.counters.append(pos.tolist())
        tokens = []
        for t in range(logits.shape[0]):
            r = int(idx[t])
            temp = float(temperature[r])
            x = logits[t].float()
            if apply_temperature and temp != 0.0:
                x = x / temp
            if output_processed_logits is not None:
                output_processed_logits[r, int(output_processed_logits_col)] = x
            if temp != 0.0:
                g = torch.Generator().manual_seed((int(seed[r]) * 1_000_003 + int(pos[t])) % (1 << 62))
                u = torch.rand(x.shape, generator=g).clamp(min=1e-10)
                x = x - torch.log(-torch.log1p(-u))
            tokens.append(int(x.argmax()))
        return torch.tensor(tokens)


def _requests(**seeds):
    """The V1 runner's ``requests``: id -> CachedRequestState-like with ``sampling_params.seed``."""
    return {r: SimpleNamespace(sampling_params=SimpleNamespace(seed=s)) for r, s in seeds.items()}


def _draws(start=1000):
    count = iter(range(start, start + 1000))
    return lambda: next(count)


def _batch(rows, req_ids, requests, first_pos, temperature, seeds: RequestSeeds):
    bufs = DraftBuffers.allocate(rows, GAMMA, VOCAB, True, "cpu")
    n = len(req_ids)
    step = torch.zeros((4, n), dtype=torch.int64)
    step[0], step[2] = 1, torch.tensor(first_pos)
    bufs.fill(n, step, torch.tensor(temperature), seeds=seeds.on_device(req_ids, requests, "cpu"))
    return bufs


def _logits_of(req_id: str, j: int) -> torch.Tensor:
    """Logits that depend on the request and the step only (not on the batch)."""
    g = torch.Generator().manual_seed(sum(map(ord, req_id)) * 100 + j)
    return torch.randn(VOCAB, generator=g) * 2


def _draft(bufs, req_ids, sample):
    rows = bufs.tokens.shape[0]
    for j in range(GAMMA):
        logits = torch.stack([_logits_of(r, j) for r in req_ids] + [torch.zeros(VOCAB)] * (rows - len(req_ids)))
        bufs.tokens[:, j].copy_(sample(logits, j, bufs))
    return bufs


def test_a_seeded_request_drafts_the_same_tokens_whatever_its_neighbours_and_row():
    requests = _requests(x=123, x_child=124, a=None, b=7, c=None)
    seeds = RequestSeeds(draw=_draws())
    gumbel = ReferenceGumbel()
    sample = seeded_sampler(True, MAX_LEN, gumbel=gumbel)
    alone = _draft(_batch(2, ["x", "x_child"], requests, [50, 50], [0.8, 0.8], seeds), ["x", "x_child"], sample)
    crowded_ids = ["a", "x_child", "b", "x", "c"]
    crowded = _draft(_batch(8, crowded_ids, requests, [10, 50, 300, 50, 7], [1.0, 0.8, 0.5, 0.8, 1.3], seeds),
                     crowded_ids, sample)
    assert torch.equal(alone.tokens[0], crowded.tokens[3]) and torch.equal(alone.tokens[1], crowded.tokens[1])
    assert torch.equal(alone.probs[0], crowded.probs[3]) and torch.equal(alone.probs[1], crowded.probs[1])
    # the n = 2 children (seed + index) draw from different noise: some step's draft differs
    # for logits that are equal
    same_logits = _draft(_batch(2, ["x", "x_child"], requests, [50, 50], [5.0, 5.0], seeds), ["x", "x"], sample)
    assert not torch.equal(same_logits.tokens[0], same_logits.tokens[1])
    # draft counters: the draft position offset by max_model_len (disjoint from the target's)
    assert gumbel.counters[:GAMMA] == [[50 + j + MAX_LEN, 50 + j + MAX_LEN] for j in range(GAMMA)]
    assert gumbel.counters[GAMMA][:5] == [p + MAX_LEN for p in [10, 50, 300, 50, 7]]


def test_greedy_rows_take_the_argmax_and_probs_are_what_the_draft_was_drawn_from():
    requests = _requests(g0=1, g1=2, s0=3, s1=None)
    req_ids = ["g0", "g1", "s0", "s1"]
    temperature = [0.0, 1e-6, 0.7, 1.5]  # two greedy rows (below 1e-5), two sampling rows
    bufs = _batch(4, req_ids, requests, [20, 21, 22, 23], temperature, RequestSeeds(draw=_draws()))
    _draft(bufs, req_ids, seeded_sampler(True, MAX_LEN, gumbel=ReferenceGumbel()))
    for j in range(GAMMA):
        logits = torch.stack([_logits_of(r, j) for r in req_ids])
        assert bufs.tokens[:2, j].tolist() == logits[:2].argmax(dim=-1).tolist()
        t = torch.tensor([1.0, 1.0, 0.7, 1.5])[:, None]  # greedy rows' probs: softmax at T = 1
        torch.testing.assert_close(bufs.probs[:, j], torch.softmax(logits / t, dim=-1), rtol=0, atol=1e-7)
    # greedy rows ignore what the kernel drew; sampling rows take it
    shifted = ReferenceGumbel()
    off_by_one = _batch(4, req_ids, requests, [20, 21, 22, 23], temperature, RequestSeeds(draw=_draws()))
    _draft(off_by_one, req_ids, seeded_sampler(True, MAX_LEN, gumbel=lambda *a, **k: (shifted(*a, **k) + 1) % VOCAB))
    assert torch.equal(off_by_one.tokens[:2], bufs.tokens[:2])
    assert torch.equal(off_by_one.tokens[2:], (bufs.tokens[2:] + 1) % VOCAB)
    # sampling rows are noisy draws: over the steps some draft is not the argmax
    tokens = torch.tensor([[int(_logits_of(r, j).argmax()) for j in range(GAMMA)] for r in req_ids[2:]])
    hot = _batch(4, req_ids, requests, [20, 21, 22, 23], [0.0, 1e-6, 50.0, 50.0], RequestSeeds(draw=_draws()))
    _draft(hot, req_ids, seeded_sampler(True, MAX_LEN, gumbel=ReferenceGumbel()))
    assert not torch.equal(hot.tokens[2:], tokens)


def test_an_all_greedy_batch_takes_the_argmax_without_noise_or_probs():
    def no_gumbel(*args, **kwargs):
        raise AssertionError("an all-greedy batch draws no noise")

    bufs = DraftBuffers.allocate(2, GAMMA, VOCAB, False, "cpu")
    _draft(bufs, ["a", "b"], seeded_sampler(False, MAX_LEN, gumbel=no_gumbel))
    assert bufs.probs is None
    assert bufs.tokens[:, 0].tolist() == [int(_logits_of(r, 0).argmax()) for r in ["a", "b"]]


def test_request_seeds_follow_the_request_id():
    seeds = RequestSeeds(draw=_draws(1000))
    requests = _requests(seeded=123, child=124, free=None, other=None)
    assert seeds.rows(["seeded", "free", "child", "other"], requests).tolist() == [123, 1000, 124, 1001]
    # the V1 batch reorders (swap_states, condense): every request keeps its seed
    assert seeds.rows(["other", "child", "free", "seeded"], requests).tolist() == [1001, 124, 1000, 123]
    # a new unseeded request gets a fresh seed; a finished one's seed is forgotten
    del requests["free"]
    requests.update(_requests(new=None))
    assert seeds.rows(["new", "seeded", "other"], requests).tolist() == [1002, 123, 1001]
    assert len(seeds) == 2  # drawn seeds of "other" and "new"
    # a request the runner does not know (no sampling parameters) is unseeded too
    assert seeds.rows(["ghost"], requests).tolist() == [1003]
    # seeds outside int64 wrap instead of failing
    assert request_seed(_requests(big=2**64 + 5)["big"]) == 5
    assert request_seed(_requests(neg=-(2**63) - 1)["neg"]) == 2**63 - 1
    assert request_seed(SimpleNamespace(sampling_params=None)) is None


def test_request_seeds_on_device_copy_only_when_the_batch_changes():
    seeds = RequestSeeds(draw=_draws())
    requests = _requests(a=5, b=None, c=9)
    first = seeds.on_device(["a", "b", "c"], requests, "cpu")
    assert first.dtype == torch.int64 and first.tolist() == [5, 1000, 9]
    assert seeds.on_device(("a", "b", "c"), requests, "cpu") is first  # same batch: no copy
    moved = seeds.on_device(["c", "a", "b"], requests, "cpu")
    assert moved is not first and moved.tolist() == [9, 5, 1000]


def test_draft_buffers_carry_seeds_with_zero_padding_in_shared_views():
    shared = DraftBuffers.allocate(8, GAMMA, VOCAB, True, "cpu")
    shared.seeds.fill_(77)  # an earlier, larger batch
    bufs = shared.view(4)
    bufs.fill(2, torch.ones((4, 2), dtype=torch.int64), torch.tensor([0.8, 0.8]),
              seeds=torch.tensor([123, -5]))
    assert bufs.seeds.tolist() == [123, -5, 0, 0] and shared.seeds[:4].tolist() == [123, -5, 0, 0]
    bufs.fill(2, torch.ones((4, 2), dtype=torch.int64))  # no seeds given (V2, greedy): left as they are
    assert bufs.seeds.tolist() == [123, -5, 0, 0]
    assert np.array_equal(DraftBuffers.allocate(3, GAMMA, VOCAB, False, "cpu").seeds.numpy(), np.zeros(3))


def test_the_v1_proposer_hands_each_row_its_requests_seed(monkeypatch):
    """``VegasProposer.propose`` over a fake V1 runner: the seeds it drafts with are the
    batch's requests' own (by request id, batch order), across a reorder and new neighbours;
    an all-greedy batch gets none."""
    from vegas.vllm_plugin import proposer as proposer_mod
    from vegas.vllm_plugin.selection.state import SelectionState
    from vegas.vllm_plugin.stats import StatsRecorder

    n_max = 4
    requests = _requests(x=123, x_child=124, free=None, other=9)
    input_batch = SimpleNamespace(
        num_reqs=0, req_ids=[], block_table=[SimpleNamespace(num_blocks_per_row=np.full(n_max, 3))],
        sampling_metadata=SimpleNamespace(all_greedy=False, temperature=torch.full((n_max,), 0.8)),
    )
    runner = SimpleNamespace(input_batch=input_batch, requests=requests, device="cpu", use_async_scheduling=False)
    prop = object.__new__(proposer_mod.VegasProposer)  # no vLLM engine: only what propose reads
    prop.runner, prop.gamma, prop.recorder = runner, GAMMA, StatsRecorder()
    prop._drafted, prop._layers_known, prop._checked_groups = set(), True, True
    prop.state = SelectionState(has_selection=True, sel_buf=torch.zeros(1, n_max, 1), skipped=False)
    prop.seeds = RequestSeeds(draw=_draws(1000))
    prop.config = VegasConfig(vllm=VllmOptions(seeded_verification="rejection"))  # every row keeps its drafts
    prop.resolve_events = lambda wait=False: None
    monkeypatch.setattr("vegas.vllm_plugin.runners.v1.timing_event", lambda: None)  # no CUDA here
    seen = []

    def draft(num_reqs, sampling, step_inputs, temperature, seeds):
        seen.append(None if seeds is None else seeds.tolist())
        return torch.zeros((num_reqs, GAMMA), dtype=torch.int64), torch.zeros((num_reqs, GAMMA, VOCAB))

    prop._draft = draft

    def step(req_ids, all_greedy=False):
        input_batch.num_reqs, input_batch.req_ids = len(req_ids), list(req_ids)
        input_batch.sampling_metadata.all_greedy = all_greedy
        n = len(req_ids)
        prop.propose([[5]] * n, np.full(n, 40), None)

    step(["x", "free"])
    step(["free", "other", "x", "x_child"])  # reordered, with new neighbours
    step(["x"], all_greedy=True)
    assert seen == [[123, 1000], [1000, 9, 123, 124], None]
    assert runner._draft_prob_req_ids == ["free", "other", "x", "x_child"]


def test_the_v1_proposer_withholds_seeded_drafts_when_coupled(monkeypatch):
    """``vllm.seeded_verification="coupled"`` on V1: a sampled request with a seed of its own drafts
    token 0 at probability one (its output is then V1's own seeded sample); the others keep theirs."""
    from vegas.vllm_plugin import proposer as proposer_mod
    from vegas.vllm_plugin.selection.state import SelectionState
    from vegas.vllm_plugin.stats import StatsRecorder

    requests = _requests(x=123, free=None, cold=7)
    input_batch = SimpleNamespace(
        num_reqs=3, req_ids=["free", "x", "cold"], block_table=[SimpleNamespace(num_blocks_per_row=np.full(3, 3))],
        sampling_metadata=SimpleNamespace(all_greedy=False, temperature=torch.tensor([0.8, 0.8, 0.0])),
    )
    runner = SimpleNamespace(input_batch=input_batch, requests=requests, device="cpu", use_async_scheduling=False)
    prop = object.__new__(proposer_mod.VegasProposer)
    prop.runner, prop.gamma, prop.recorder = runner, GAMMA, StatsRecorder()
    prop._drafted, prop._layers_known, prop._checked_groups = set(), True, True
    prop.state = SelectionState(has_selection=True, sel_buf=torch.zeros(1, 3, 1), skipped=False)
    prop.seeds = RequestSeeds(draw=_draws(1000))
    prop.config = VegasConfig(vllm=VllmOptions(seeded_verification="coupled"))
    prop.resolve_events = lambda wait=False: None
    monkeypatch.setattr("vegas.vllm_plugin.runners.v1.timing_event", lambda: None)
    probs = torch.softmax(torch.randn(3, GAMMA, VOCAB, generator=torch.Generator().manual_seed(0)), dim=-1)
    prop._draft = lambda num_reqs, sampling, step_inputs, temperature, seeds: (
        torch.full((num_reqs, GAMMA), 3, dtype=torch.int64), probs)
    drafts = prop.propose([[5]] * 3, np.full(3, 40), None)
    # "x" (seed 123, T = 0.8) withheld; "free" (no seed) and "cold" (seed 7 but greedy) keep theirs
    assert drafts.tolist() == [[3] * GAMMA, [0] * GAMMA, [3] * GAMMA]
    assert torch.equal(runner._draft_probs[1], torch.nn.functional.one_hot(torch.zeros(GAMMA, dtype=torch.int64),
                                                                           VOCAB).float())
    assert runner._draft_probs[0].sum(-1).allclose(torch.ones(GAMMA)) and runner._draft_probs[0, 0, 0] < 1
