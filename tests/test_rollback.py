"""Rollback with forced drafts: rejection at the first draft, all γ accepted, and both in one batch."""

import pytest
import torch

from vegas import VegasConfig
from vegas.backends.hf import HFSession
from vegas.loop import speculative_decode
from vegas.plugins import create_selector
from vegas.sampling import SamplingParams

GAMMA = 3
NEW_TOKENS = 4 * (GAMMA + 1)


class ForcedDrafts(HFSession):
    """Drafts with sparse attention as usual, then replaces the tokens by oracle or wrong ones."""

    def __init__(self, *args, prompts, continuations, modes, **kwargs):
        super().__init__(*args, **kwargs)
        self.prompt_lens = torch.tensor([len(p) for p in prompts])
        self.continuations, self.modes = continuations, modes

    def keep_rows(self, rows):
        # a sequence that emitted EOS leaves the batch: keep the forced tokens aligned with its rows
        kept = rows.tolist()
        self.prompt_lens = self.prompt_lens[rows.cpu()]
        self.continuations = [self.continuations[i] for i in kept]
        self.modes = [self.modes[i] for i in kept]
        return super().keep_rows(rows)

    def draft(self, num_draft_tokens, sample):
        tokens, probs = super().draft(num_draft_tokens, sample)
        tokens = tokens.clone()
        emitted = (self.num_committed.cpu() - (self.prompt_lens - 1)).tolist()
        for b, (e, mode) in enumerate(zip(emitted, self.modes)):
            # (a finished sequence keeps decoding past its continuation: pad with token 1)
            window = (self.continuations[b][e:] + [1] * num_draft_tokens)[:num_draft_tokens]
            oracle = torch.tensor(window)
            tokens[b] = oracle if mode == "oracle" else (oracle + 1) % 8192
        return tokens, probs


@pytest.fixture(scope="module")
def continuations(pipe, code_prompts):
    out = pipe.backend.generate(
        code_prompts, max_new_tokens=NEW_TOKENS + GAMMA, sampling=SamplingParams(), selector=None, config=VegasConfig()
    )
    return [o.token_ids for o in out]


@pytest.mark.parametrize("modes", [("wrong", "wrong"), ("oracle", "oracle"), ("oracle", "wrong")])
def test_forced_drafts_roll_back_exactly(pipe, code_prompts, continuations, modes):
    config = VegasConfig(num_draft_tokens=GAMMA, kv_budget=32)
    selector = create_selector("collect2", config)
    session = ForcedDrafts(
        pipe.backend.model, config, selector, prompts=code_prompts, continuations=continuations, modes=modes
    )
    with torch.inference_mode():
        tokens, stats = speculative_decode(
            session, session, selector, code_prompts,
            num_draft_tokens=GAMMA, max_new_tokens=NEW_TOKENS, sampling=SamplingParams(),
        )
    for b, mode in enumerate(modes):
        assert tokens[b] == continuations[b][:NEW_TOKENS]
        expected_tau = GAMMA + 1 if mode == "oracle" else 1
        assert stats[b].acceptance_length == expected_tau
    # Cache bookkeeping: committed slots are exactly the valid ones, nothing leaked.
    assert session.valid.shape[1] == session.cache.get_seq_length()
    assert session.valid.sum(dim=1).tolist() == session.num_committed.tolist()
