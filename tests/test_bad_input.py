"""Each bad input named in DEVELOPERS.md gets a clear error naming the parameter."""

import pytest

from vegas import Pipeline, VegasConfigError


@pytest.mark.parametrize(
    "prompts, match",
    [([], "at least one prompt"), ([""], "prompt 0 is empty"), (["ok", []], "prompt 1 is empty")],
)
def test_empty_prompts(pipe, prompts, match):
    with pytest.raises(VegasConfigError, match=match):
        pipe.generate(prompts, max_new_tokens=4)


def test_prompt_longer_than_context(pipe):
    too_long = [[5] * pipe.backend.max_context]
    with pytest.raises(VegasConfigError, match=r"prompt 0 has 32768 tokens.*at most"):
        pipe.generate(too_long, max_new_tokens=4, selector="collect2")


def test_bad_max_new_tokens(pipe):
    with pytest.raises(VegasConfigError, match="max_new_tokens"):
        pipe.generate(["x = 1"], max_new_tokens=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_draft_tokens": 0}, "num_draft_tokens must be an integer >= 1"),
        ({"sparsity_ratio": 0}, r"sparsity_ratio must be a number in \(0, 1\]"),
        ({"sparsity_ratio": 2}, r"sparsity_ratio must be a number in \(0, 1\]"),
        ({"kv_budget": -5}, "kv_budget must be an integer >= 0"),
        ({"selector": "nope"}, "selector must be one of"),
        ({"backend": "nope"}, "backend must be one of"),
        ({"gamma": 3}, r"unknown config field\(s\) \['gamma'\]"),
    ],
)
def test_bad_pipeline_arguments(kwargs, match):
    with pytest.raises(VegasConfigError, match=match):
        Pipeline(**kwargs)


def test_bad_sampling_arguments(pipe):
    with pytest.raises(VegasConfigError, match="temperature"):
        pipe.generate(["x = 1"], max_new_tokens=2, temperature=-0.5)
    with pytest.raises(VegasConfigError, match="top_p"):
        pipe.generate(["x = 1"], max_new_tokens=2, temperature=1.0, top_p=1.5)


def test_unknown_selector_in_generate(pipe):
    with pytest.raises(VegasConfigError, match="selector must be one of"):
        pipe.generate(["x = 1"], max_new_tokens=2, selector="nope")


def test_single_token_prompt_and_zero_budget_work(pipe):
    out = pipe.generate([[42], [7, 8, 9]], max_new_tokens=5, selector="collect2")
    ref = pipe.generate([[42], [7, 8, 9]], max_new_tokens=5, selector=None)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    zero = Pipeline(selector="aggregated", kv_budget=0, recent_window=0)
    assert zero.generate(["def f(x):"], max_new_tokens=3)[0].stats.num_generated == 3


def test_remote_code_is_off_by_default(pipe):
    assert pipe.backend.model.config.__class__.__module__.startswith("transformers.")
