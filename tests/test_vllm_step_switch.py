"""Which steps draft, decided by the scheduler (vegas.vllm_plugin.step_switch): pure Python."""

import pytest

from vegas.vllm_plugin.step_switch import MeasuredFallback, StepSwitch, drafts_next_step, prompt_tokens


def test_prompt_tokens_count_only_what_is_beyond_a_sampled_token_and_its_drafts():
    assert prompt_tokens({}, {}) == 0
    assert prompt_tokens({"a": 5, "b": 1}, {"a": [-1] * 4}) == 0  # decoding: verifying 4 drafts, and plain
    assert prompt_tokens({"a": 5, "p": 8192}, {"a": [-1] * 4}) == 8191  # a prefill chunk of 8192 tokens
    assert prompt_tokens({"a": 3}, {"a": [-1] * 4}) == 0  # fewer tokens than drafts (budget-truncated)


@pytest.mark.parametrize("tokens, limit, expected", [
    ({"a": 5, "p": 4000}, 0, 4),  # 0: never skip
    ({"a": 5, "p": 4000}, 2048, 0),
    ({"a": 5, "p": 2049}, 2048, 0),  # exactly 2048 prompt tokens
    ({"a": 5, "p": 2048}, 2048, 4),
    ({"a": 5}, 2048, 4),
])
def test_drafts_next_step(tokens, limit, expected):
    assert drafts_next_step(tokens, {"a": [-1] * 4}, 4, limit) == expected


# ---- the measured fallback ----------------------------------------------------------------------
class Engine:
    """A fake engine under asynchronous scheduling: each step is scheduled one step before its
    output arrives; a drafting step takes ``draft_ms`` and emits ``tau`` tokens per request, a
    plain step ``plain_ms`` and 1, except that a step verifies what the step before it drafted."""

    def __init__(self, policy, draft_ms, plain_ms, tau, reqs=32):
        self.policy, self.draft_ms, self.plain_ms, self.tau, self.reqs = policy, draft_ms, plain_ms, tau, reqs
        self.now = 0.0
        policy.clock = lambda: self.now
        self.in_flight = [policy.drafts()]  # scheduled, output not yet in
        self.emitted = 0.0

    def run(self, steps, decode_only=True):
        for _ in range(steps):
            self.in_flight.append(self.policy.drafts())  # async: the next step is scheduled first
            prev, k = self.in_flight[0], self.in_flight[1]
            self.in_flight.pop(0)
            verified = self.tau if prev else 1.0  # what the previous step drafted is verified now
            self.now += (self.draft_ms if k else self.plain_ms) / 1e3
            tokens = round(verified * self.reqs)
            self.emitted += tokens
            self.policy.observe(prev, tokens, decode_only)


def test_a_fallback_keeps_drafting_where_drafting_pays():
    policy = MeasuredFallback(4, interval=16, window=4)
    engine = Engine(policy, draft_ms=10.0, plain_ms=3.1, tau=4.2)  # 1.3x: batch 32 on the H200
    engine.run(2000)
    assert policy.drafting and policy.switches == 0 and policy.probes >= 3
    assert engine.emitted / engine.now > 0.99 * 32 * 4.2 / 0.010  # probing costs under 1 %
    assert policy.rates[True] > policy.rates[False]
    assert policy.interval == policy.max_interval  # a settled decision probes rarely


def test_a_fallback_steps_plainly_where_drafting_loses_and_notices_when_it_pays_again(caplog):
    policy = MeasuredFallback(4, interval=16, window=4)
    engine = Engine(policy, draft_ms=20.0, plain_ms=4.0, tau=4.0)  # 0.8x: weights dominate every forward
    with caplog.at_level("INFO", logger="vegas.vllm"):
        engine.run(200)
    assert not policy.drafting and policy.switches == 1
    # the change of mode is logged once, with both measured rates (kept decisions are DEBUG)
    changes = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert len(changes) == 1 and "takes plain steps" in changes[0] and "drafting 6,400" in changes[0], changes
    assert policy.rates[False] > policy.rates[True]
    engine.draft_ms = 8.0  # long contexts: drafting now pays 2x
    start, emitted = engine.now, engine.emitted
    engine.run(3000)
    assert policy.drafting and policy.switches == 2
    # within 3 % of always drafting (32 x 4 tokens per 8 ms), probes and the late switch included
    assert (engine.emitted - emitted) / (engine.now - start) > 0.97 * 32 * 4 / 0.008


def test_a_fallback_ignores_prefill_steps_and_idle_gaps():
    policy = MeasuredFallback(4, interval=8, window=4)
    engine = Engine(policy, draft_ms=20.0, plain_ms=4.0, tau=4.0)
    engine.run(500, decode_only=False)  # only steps that carry prompt tokens: nothing is measured
    assert policy.drafting and policy.probes == 0 and policy.rates == {True: None, False: None}
    engine.now += 5.0  # an idle engine: the next interval is not a step's time
    engine.run(1)
    assert policy.rates == {True: None, False: None}


def test_the_switch_combines_the_prefill_rule_and_the_fallback():
    assert StepSwitch.of(4, 0, False) is None
    switch = StepSwitch.of(4, 2048, True)
    assert switch.decide({"a": 5, "p": 4000}, {"a": [-1] * 4}) == 0  # the prefill rule first
    assert switch.decide({"a": 5}, {"a": [-1] * 4}) == 4  # the fallback starts by drafting
    switch.fallback.drafting = False
    assert switch.decide({"a": 1}, {}) == 0
    with pytest.raises(ValueError, match="window <= interval"):
        MeasuredFallback(4, interval=4, window=8)
