"""Fallback to plain steps where drafting loses (vegas/draft_policy.py): the pure policy, its
config fields, and the HF loop staying token-identical to plain greedy decoding."""

import pytest
import torch

from vegas import VegasConfig
from vegas.backends.hf import HFSession
from vegas.config import VegasConfigError
from vegas.draft_policy import AlwaysDraft, DraftPolicy
from vegas.loop import speculative_decode
from vegas.plugins import create_selector
from vegas.sampling import SamplingParams

from .test_rollback import ForcedDrafts

GAMMA = 3
NEW_TOKENS = 40


def _policy(**kwargs):
    defaults = dict(draft_cost=0.25, verify_cost=1.0, probe_interval=4, ewma=0.5)
    return DraftPolicy(4, **{**defaults, **kwargs})


# ---- the policy ------------------------------------------------------------------------------
def test_policy_keeps_drafting_at_high_tau():
    policy = _policy()
    for _ in range(50):
        assert policy.should_draft()
        policy.observe_draft(4.0)
    assert policy.plain_steps == 0 and policy.probes == 0


def test_policy_falls_back_when_tau_collapses_and_probes():
    policy = _policy()  # break-even τ = 4·0.25 + 1.0 = 2.0
    assert policy.break_even_tau == pytest.approx(2.0)
    decisions = []
    for _ in range(20):
        draft = policy.should_draft()
        decisions.append(draft)
        policy.observe_draft(1.0) if draft else policy.observe_plain()
    # 5 → 3 → 2 → 1.5 (< 2: plain) ... then a probe every 4 plain steps
    assert decisions[:3] == [True, True, True]
    assert decisions[3:8] == [False] * 4 + [True]
    assert decisions[8:13] == [False] * 4 + [True]
    assert policy.probes == 3 and policy.plain_steps == 14


def test_policy_probe_notices_recovery_with_hysteresis():
    policy = _policy(hysteresis=0.5)  # resume at gain >= 1.5: τ >= 3
    for _ in range(3):
        policy.observe_draft(1.0)
    assert not policy.should_draft()
    for _ in range(4):
        policy.observe_plain()
    assert policy.should_draft()
    policy.observe_draft(2.5)  # gain 1.25: above break-even, under the hysteresis band
    assert not policy.drafting
    for _ in range(4):
        policy.observe_plain()
    policy.observe_draft(3.5)
    assert policy.drafting and policy.should_draft()


def test_policy_from_config():
    assert isinstance(DraftPolicy.from_config(VegasConfig(fallback=False)), AlwaysDraft)
    policy = DraftPolicy.from_config(VegasConfig(num_draft_tokens=4))
    assert policy.break_even_tau == pytest.approx(4 * 0.28 + 1.1)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("fallback", 1, "fallback must be true or false"),
        ("fallback_draft_cost", 0, "fallback_draft_cost must be a finite number > 0"),
        ("fallback_verify_cost", float("inf"), "fallback_verify_cost must be a finite number > 0"),
        ("fallback_min_gain", -1.0, "fallback_min_gain must be a finite number > 0"),
        ("fallback_hysteresis", -0.1, "fallback_hysteresis must be a finite number >= 0"),
        ("fallback_probe_interval", 0, "fallback_probe_interval must be an integer >= 1"),
    ],
)
def test_fallback_config_errors_name_the_field(field, value, message):
    with pytest.raises(VegasConfigError, match=message):
        VegasConfig(**{field: value})


def test_fallback_config_round_trips_json():
    config = VegasConfig(fallback=False, fallback_probe_interval=3)
    assert VegasConfig.from_json(config.to_json()) == config


# ---- the HF loop -----------------------------------------------------------------------------
class EveryOther(AlwaysDraft):
    """Forced: a plain step after every drafting iteration."""

    def __init__(self):
        self.turn = 0
        self.plain_steps = 0

    def should_draft(self):
        self.turn += 1
        return self.turn % 2 == 1

    def observe_plain(self):
        self.plain_steps += 1


@pytest.fixture(scope="module")
def plain_greedy(pipe, code_prompts):
    out = pipe.backend.generate(
        code_prompts, max_new_tokens=NEW_TOKENS + GAMMA, sampling=SamplingParams(), selector=None,
        config=VegasConfig(),
    )
    return [o.token_ids for o in out]


def _decode(pipe, batch, policy, session_cls=HFSession, **session_kwargs):
    config = VegasConfig(num_draft_tokens=GAMMA, kv_budget=32)
    selector = create_selector("collect2", config)
    session = session_cls(pipe.backend.model, config, selector, **session_kwargs)
    with torch.inference_mode():
        return speculative_decode(
            session, session, selector, batch,
            num_draft_tokens=GAMMA, max_new_tokens=NEW_TOKENS, sampling=SamplingParams(), policy=policy,
        )


def test_forced_fallback_every_other_iteration_is_plain_greedy(pipe, code_prompts, plain_greedy):
    policy = EveryOther()
    tokens, stats = _decode(pipe, code_prompts, policy)
    for b in range(len(code_prompts)):
        assert tokens[b] == plain_greedy[b][:NEW_TOKENS]
        assert stats[b].plain_steps > 0
        drafting = stats[b].iterations - stats[b].plain_steps  # γ each; at most γ last ones capped at the tokens left
        assert GAMMA * (drafting - GAMMA) < stats[b].num_drafted <= GAMMA * drafting
    assert policy.plain_steps == max(s.plain_steps for s in stats)


@pytest.mark.parametrize("mode", ["wrong", "oracle"])
def test_forced_drafts_drive_the_policy(pipe, code_prompts, plain_greedy, mode):
    """Wrong drafts (τ = 1) make the policy fall back, counted in the stats; oracle drafts keep it drafting."""
    policy = DraftPolicy(GAMMA, draft_cost=0.28, verify_cost=1.1, probe_interval=4)
    tokens, stats = _decode(
        pipe, code_prompts, policy, ForcedDrafts,
        prompts=code_prompts, continuations=plain_greedy, modes=(mode, mode),
    )
    for b in range(len(code_prompts)):
        assert tokens[b] == plain_greedy[b][:NEW_TOKENS]
        if mode == "wrong":  # most iterations are plain: only the start-up and the probes draft
            assert stats[b].plain_steps >= stats[b].iterations // 2
        else:
            assert stats[b].plain_steps == 0
    if mode == "wrong":
        assert policy.plain_steps > 0 and policy.probes > 0
    else:
        assert policy.plain_steps == 0


def test_backend_default_config_counts_plain_steps(pipe, code_prompts, plain_greedy):
    out = pipe.backend.generate(
        code_prompts, max_new_tokens=NEW_TOKENS, sampling=SamplingParams(), selector="collect2",
        config=VegasConfig(num_draft_tokens=GAMMA, kv_budget=32),
    )
    for b, o in enumerate(out):
        assert o.token_ids == plain_greedy[b][:NEW_TOKENS]
        assert 0 <= o.stats.plain_steps <= o.stats.iterations
        assert "plain_steps" in o.stats.as_dict()
