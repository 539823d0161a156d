"""Device-side arithmetic of Vegas under vLLM's async scheduling (pure torch, runs on CPU):
what the proposer hands vLLM before bookkeeping, and where each request's drafts start."""

from __future__ import annotations

import torch

from vegas.vllm_plugin.async_sched import draft_start_positions, next_tokens_and_counts

VOCAB = 100


def test_next_token_is_the_last_accepted_one_and_counts_include_the_bonus():
    sampled = torch.tensor(
        [
            [5, 6, 7, 8, 9],  # all 4 drafts accepted + bonus
            [5, -1, -1, -1, -1],  # first draft rejected: only the resampled token
            [5, 6, -1, -1, -1],  # one accepted
            [5, 6, 7, 8, 9],  # discarded row (partial prefill): backup token, count 0
            [150, -1, -1, -1, -1],  # out-of-vocab id counts as invalid
        ],
        dtype=torch.int32,
    )
    discard = torch.tensor([False, False, False, True, False])
    backup = torch.tensor([11, 12, 13, 14, 15])
    next_ids, counts = next_tokens_and_counts(sampled, discard, backup, VOCAB)
    assert counts.tolist() == [5, 1, 2, 0, 0]
    assert next_ids.tolist() == [9, 5, 6, 14, 15]
    assert next_ids.dtype == counts.dtype == torch.int32


def test_drafts_start_at_the_last_sampled_token():
    # request 0: last committed token at position 99, 4 drafts verified (seq_len 104), 2 accepted
    #            -> sampled tokens at 100, 101, 102 (count 3): the first draft input is at 102
    # request 1: a prefill of 50 tokens (no drafts): its one sampled token sits at position 50
    # request 2: 4 drafts, all rejected: the resampled token sits right after the last committed one
    seq_lens = torch.tensor([104, 50, 204], dtype=torch.int32)
    num_draft = torch.tensor([4, 0, 4])
    counts = torch.tensor([3, 1, 1], dtype=torch.int32)
    assert draft_start_positions(seq_lens, num_draft, counts).tolist() == [102, 50, 200]


def test_sync_and_async_inputs_agree_on_a_verified_step():
    """The synchronous path takes position ``num_tokens - 1`` after appending the accepted
    tokens; the async arithmetic must land on the same position and token."""
    committed, gamma = 300, 4  # tokens before the step (last one at position 299)
    for accepted in range(gamma + 1):
        row = [7] * (accepted + 1) + [-1] * (gamma - accepted)
        row[accepted] = 42  # the last valid token
        sampled = torch.tensor([row])
        next_ids, counts = next_tokens_and_counts(sampled, torch.tensor([False]), torch.tensor([0]), VOCAB)
        seq_len = torch.tensor([committed + gamma])  # the chunk: last committed token + γ drafts
        pos = draft_start_positions(seq_len, torch.tensor([gamma]), counts)
        num_tokens_after = committed + accepted + 1
        assert pos.item() == num_tokens_after - 1 and next_ids.item() == 42


def _config(method="custom_class", model="vegas.vllm_plugin.proposer.VegasProposer", async_scheduling=None, pp=1,
            tp=1):
    from types import SimpleNamespace

    spec = None if method is None else SimpleNamespace(method=method, model=model)
    return SimpleNamespace(
        speculative_config=spec,
        scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp, tensor_parallel_size=tp),
    )


def test_async_scheduling_is_kept_for_vegas_unless_switched_off():
    from vegas.vllm_plugin.async_sched import wants_async

    assert wants_async(_config())  # vLLM's default (None): on
    assert wants_async(_config(async_scheduling=True))  # asked for: on, where vLLM would refuse
    assert not wants_async(_config(async_scheduling=False))  # the user's off switch wins
    assert not wants_async(_config(pp=2))  # pipeline parallelism: vegas refuses it anyway
    # tensor parallelism: synchronous (the tested path) unless async is asked for
    assert not wants_async(_config(tp=2))
    assert wants_async(_config(tp=2, async_scheduling=True))
    # other engines keep vLLM's own decision
    assert not wants_async(_config(method=None))
    assert not wants_async(_config(method="ngram", model=None))
    assert not wants_async(_config(model="my.other.Proposer"))
