"""Greedy Vegas decoding equals plain greedy decoding, token for token (float32, real code)."""

import pytest

from vegas import VegasConfig
from vegas.sampling import SamplingParams

SELECTORS = ["collect2", "aggregated", "sliding_window", "quest", "last_token"]
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0)
# A small budget so that drafts really differ from the target and rollbacks happen.
SMALL = dict(kv_budget=48, recent_window=8, num_sinks=4, page_size=8)


def run(pipe, prompts, selector, **config):
    return pipe.backend.generate(
        prompts, max_new_tokens=NEW_TOKENS, sampling=GREEDY, selector=selector, config=VegasConfig(**config)
    )


@pytest.fixture(scope="module")
def reference(pipe, code_prompts):
    return [o.token_ids for o in run(pipe, code_prompts, None)]


def test_plain_batch_equals_single_prompts(pipe, code_prompts, reference):
    for prompt, ref in zip(code_prompts, reference):
        assert run(pipe, [prompt], None)[0].token_ids == ref
    assert all(len(r) == NEW_TOKENS for r in reference)


@pytest.mark.parametrize("selector", [None, "collect2"])
def test_chunked_prefill_of_a_padded_batch_equals_single_prompts(pipe, code_prompts, monkeypatch, selector):
    """Prompts longer than a prefill chunk, left-padded in one batch, give what each prompt gives
    alone in one chunk (positions count each sequence's own tokens, not the batch's slots)."""
    from vegas.backends import hf

    prompts = [code_prompts[0][:400], code_prompts[1][:230]]  # 170 slots of padding for the second
    alone = [run(pipe, [p], selector, **SMALL)[0].token_ids for p in prompts]
    monkeypatch.setattr(hf, "PREFILL_CHUNK_TOKENS", 96)  # 5 and 3 chunks
    assert [o.token_ids for o in run(pipe, prompts, selector, **SMALL)] == alone


@pytest.mark.parametrize("gamma", [1, 4])
@pytest.mark.parametrize("selector", SELECTORS)
def test_greedy_equals_plain_greedy(pipe, code_prompts, reference, selector, gamma):
    outputs = run(pipe, code_prompts, selector, num_draft_tokens=gamma, **SMALL)
    assert [o.token_ids for o in outputs] == reference
    drafted = sum(o.stats.num_drafted for o in outputs)
    accepted = sum(o.stats.num_accepted for o in outputs)
    assert 0 < accepted < drafted, "the test must exercise both acceptance and rollback"
    for o in outputs:
        assert (o.stats.iterations - o.stats.plain_steps) * gamma == o.stats.num_drafted
        assert 1 <= o.stats.acceptance_length <= gamma + 1


@pytest.mark.parametrize(
    "options",
    [{"granularity": "kv_head"}, {"score_mode": "weight"}, {"recent_window": 0}, {"kv_budget": 10_000}],
    ids=["kv_head", "weight", "no_recent", "budget_above_context"],
)
def test_greedy_exact_under_options(pipe, code_prompts, reference, options):
    config = {**SMALL, "num_draft_tokens": 3, **options}
    outputs = run(pipe, code_prompts, "collect2", **config)
    assert [o.token_ids for o in outputs] == reference


def test_budget_above_context_logs_once(pipe, code_prompts, caplog, monkeypatch):
    from vegas.backends import hf

    monkeypatch.setattr(hf, "FULL_BUDGET_LOGGED", False)
    with caplog.at_level("WARNING", logger="vegas.backends.hf"):
        run(pipe, code_prompts, "collect2", kv_budget=10_000)
        run(pipe, code_prompts, "collect2", kv_budget=10_000)  # a second call says nothing more
    said = [r.message for r in caplog.records if "attends to every position" in r.message]
    assert len(said) == 1 and "KV budget 10000 >= context" in said[0]


def test_bfloat16_greedy_matches_bfloat16_plain(code_prompts):
    """Same backend and dtype: bf16 Vegas vs bf16 plain (first 12 tokens, CPU)."""
    from vegas import Pipeline

    bf16 = Pipeline(selector=None, dtype="bfloat16", device="cpu")
    prompts = [p[:400] for p in code_prompts]
    ref = bf16.generate(prompts, max_new_tokens=12)
    out = bf16.generate(prompts, max_new_tokens=12, selector="collect2")
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]


def test_quest_acceptance_does_not_depend_on_batch_neighbours(pipe, click_ids):
    """Quest pages follow each sequence's token positions, so padding and neighbours' rollbacks
    (holes in the shared cache) leave its drafts, and so its acceptance, unchanged."""
    prompt = click_ids[30000:30600]
    neighbours = [click_ids[1000:1054], click_ids[40000:40300], click_ids[50000:50900]]
    config = dict(kv_budget=64, recent_window=8, page_size=8)
    alone = run(pipe, [prompt], "quest", **config)[0]
    batched = run(pipe, [prompt] + neighbours, "quest", **config)[0]
    assert batched.token_ids == alone.token_ids
    assert 0 < alone.stats.num_accepted < alone.stats.num_drafted
    assert batched.stats.num_accepted == alone.stats.num_accepted
