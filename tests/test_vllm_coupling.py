"""Gumbel-max coupled verification of seeded requests (:mod:`vegas.vllm_plugin.coupling`):
the emitted tokens are the target's own samples whatever was drafted, against a per-request
loop; the draft noise counters; the slot flags. Pure PyTorch: no vLLM, no GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vegas.config import VegasConfigError, VllmOptions
from vegas.vllm_plugin.coupling import CoupledRows, couple_rows
from vegas.vllm_plugin.runners.v2_helpers import draft_noise_positions


def reference(sampled, num_sampled, target, drafts, cu, rows):
    """Request by request: drafts accepted while equal to the target's token at the logit before
    them; the target's tokens up to and including the first mismatch (or the bonus) are emitted."""
    sampled, num_sampled = sampled.clone(), num_sampled.clone()
    for r in range(len(cu) - 1):
        if not rows[r]:
            continue
        a, b = int(cu[r]), int(cu[r + 1])
        accepted = 0
        while a + accepted + 1 < b and int(drafts[a + accepted + 1]) == int(target[a + accepted]):
            accepted += 1
        sampled[r, : accepted + 1] = target[a : a + accepted + 1]
        num_sampled[r] = accepted + 1
    return sampled, num_sampled


@pytest.mark.parametrize("seed", range(6))
def test_coupled_rows_emit_the_targets_tokens_up_to_the_first_mismatch(seed):
    g = torch.Generator().manual_seed(seed)
    gamma, vocab = 4, 5  # a small vocabulary: drafts often equal the target's token
    lengths = torch.randint(1, gamma + 2, (7,), generator=g)  # 1 (no drafts) .. γ + 1 logits per request
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
    n = int(cu[-1])
    target = torch.randint(0, vocab, (n,), generator=g)
    drafts = torch.where(torch.rand(n, generator=g) < 0.6, target.roll(1), torch.randint(0, vocab, (n,), generator=g))
    sampled = torch.randint(0, vocab, (7, gamma + 1), generator=g)
    num_sampled = torch.randint(1, gamma + 2, (7,), generator=g).to(torch.int32)
    rows = torch.rand(7, generator=g) < 0.7
    want = reference(sampled, num_sampled, target, drafts, cu, rows)
    couple_rows(sampled, num_sampled, target, drafts, cu, rows)
    assert torch.equal(num_sampled, want[1])
    for r in range(7):  # only the emitted entries matter
        k = int(want[1][r])
        assert torch.equal(sampled[r, :k], want[0][r, :k])


def test_the_output_of_a_coupled_row_does_not_depend_on_its_drafts():
    """Whatever was drafted, the emitted tokens are a prefix of the target's own samples, and
    with every draft equal to them all γ + 1 come out."""
    gamma = 4
    target = torch.tensor([3, 1, 4, 1, 5])
    cu = torch.tensor([0, 5], dtype=torch.int32)
    emitted = []
    for drafts in (torch.tensor([9, 3, 1, 4, 1]), torch.tensor([9, 3, 1, 0, 0]), torch.tensor([9, 7, 7, 7, 7])):
        sampled = torch.zeros(1, gamma + 1, dtype=torch.int64)
        num = torch.zeros(1, dtype=torch.int32)
        couple_rows(sampled, num, target, drafts, cu, torch.tensor([True]))
        emitted.append(sampled[0, : int(num[0])].tolist())
    assert emitted == [[3, 1, 4, 1, 5], [3, 1, 4], [3]]


def test_drafts_of_coupled_rows_share_the_targets_noise_counters():
    pos = torch.tensor([10, 11, 12])
    assert draft_noise_positions(pos, 100).tolist() == [110, 111, 112]
    assert draft_noise_positions(pos, 100, torch.tensor([True, False, True])).tolist() == [10, 111, 12]


def test_slot_flags_follow_the_users_seeds():
    state = CoupledRows(4, "cpu")
    assert state.slots.tolist() == [False] * 5  # the padding slot, last, is never coupled
    state.update(np.array([False, True, False, True]))
    assert state.slots.tolist() == [False, True, False, True, False]
    assert CoupledRows.rows(np.array([False, True, False, True]), np.array([3, 0])).tolist() == [True, False]
    assert CoupledRows.rows(np.array([False, True, False, True]), np.array([0, 2])) is None  # no seeded row


def test_the_setting_names_its_values():
    assert VllmOptions().seeded_verification == "coupled"
    assert VllmOptions(seeded_verification="coupled").seeded_verification == "coupled"
    with pytest.raises(VegasConfigError, match="vllm.seeded_verification must be one of 'rejection', 'coupled'"):
        VllmOptions(seeded_verification="gumbel")


def test_v1_withholds_the_drafts_of_seeded_rows_only():
    from vegas.vllm_plugin.coupling import withhold_drafts

    g = torch.Generator().manual_seed(0)
    drafts = torch.randint(1, 9, (3, 4), generator=g)
    probs = torch.softmax(torch.randn(3, 4, 9, generator=g), dim=-1)
    keep_d, keep_p = drafts.clone(), probs.clone()
    view = probs[:3]  # the V1 proposer hands vLLM a view of its static buffer: changed in place
    withhold_drafts(drafts, view, torch.tensor([False, True, False]))
    assert drafts[1].tolist() == [0] * 4 and torch.equal(drafts[[0, 2]], keep_d[[0, 2]])
    assert torch.equal(probs[1], torch.nn.functional.one_hot(torch.zeros(4, dtype=torch.int64), 9).float())
    assert torch.equal(probs[[0, 2]], keep_p[[0, 2]])
    withhold_drafts(drafts, None, torch.tensor([True, False, False]))  # a greedy batch has no probabilities
    assert drafts[0].tolist() == [0] * 4


def test_v1_knows_which_requests_carry_their_own_seed():
    from types import SimpleNamespace

    from vegas.vllm_plugin.runners.seeds import RequestSeeds

    requests = {"a": SimpleNamespace(sampling_params=SimpleNamespace(seed=123)),
                "b": SimpleNamespace(sampling_params=SimpleNamespace(seed=None)), "c": SimpleNamespace()}
    assert RequestSeeds.explicit(["b", "a", "c"], requests).tolist() == [False, True, False]
    seeds = RequestSeeds(draw=lambda: 5)
    assert seeds.explicit_on_device() is None  # no batch yet
    seeds.on_device(["b", "a", "c"], requests, "cpu")
    mask = seeds.explicit_on_device()
    assert mask.dtype == torch.bool and mask.tolist() == [False, True, False]
    seeds.on_device(["b", "a", "c"], requests, "cpu")
    assert seeds.explicit_on_device() is mask  # the same batch: kept, no host work
    seeds.on_device(["a", "b"], requests, "cpu")  # reordered: rebuilt in the new order
    assert seeds.explicit_on_device().tolist() == [True, False]
    seeds.on_device(["b", "c"], requests, "cpu")  # nobody seeded: nothing to withhold
    assert seeds.explicit_on_device() is None
