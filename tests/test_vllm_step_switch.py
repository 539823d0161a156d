"""Which steps draft, decided by the scheduler (vegas.vllm_plugin.step_switch): pure Python."""

import pytest

from vegas.vllm_plugin.step_switch import drafts_next_step, prompt_tokens


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
