"""Compare the selectors with pytest-benchmark (kept out of the default test run).

    python -m pytest benchmarks/ --benchmark-only --benchmark-group-by=group

* ``selection``: one layer's selection step alone (top-k, window, or Quest page bounds
  plus one draft query's page choice) at several context lengths, shapes of the embedded
  model (6 query heads, 2 KV heads, head_dim 64), batch 1, float32 on the CPU.
* ``decode``: a short greedy decode on a real 2K-token prompt, each selector against plain
  decoding (same backend, same prompt, same run).
"""

import pytest
import torch

from vegas import Pipeline, SelectionInput, VegasConfig
from vegas.plugins import create_selector
from vegas.prompts import cut_contexts, package_source

SELECTORS = ["collect2", "aggregated", "sliding_window", "quest", "last_token"]


@pytest.mark.parametrize("context", [4096, 16384, 32768])
@pytest.mark.parametrize("name", SELECTORS)
def test_selection_step(benchmark, name, context):
    benchmark.group = f"selection@{context}"
    g = torch.Generator().manual_seed(0)
    config = VegasConfig()
    selector = create_selector(name, config)
    inputs = SelectionInput(
        layer_idx=0,
        scores=torch.randn(1, 1, context, generator=g),
        valid=torch.ones(1, context, dtype=torch.bool),
        budget=torch.tensor([max(int(context * config.sparsity_ratio), config.min_kv_budget)]),
        keys=torch.randn(1, 2, context, 64, generator=g),
    )
    query = torch.randn(1, 6, 1, 64, generator=g)

    def step():
        sel = selector.select(inputs)
        return selector.select_for_query(0, query, sel) if selector.query_aware else sel

    benchmark(step)


@pytest.fixture(scope="module")
def pipe_and_prompt():
    pipe = Pipeline(selector=None)
    ids = pipe.tokenizer(package_source(), add_special_tokens=False).input_ids
    return pipe, cut_contexts(ids, 2048, 1)


@pytest.mark.parametrize("name", [None, *SELECTORS])
def test_decode(benchmark, pipe_and_prompt, name):
    benchmark.group = "decode 2K context, 32 tokens, γ=4"
    pipe, prompts = pipe_and_prompt
    result = benchmark.pedantic(
        pipe.generate, args=(prompts,), kwargs=dict(max_new_tokens=32, selector=name), rounds=2, iterations=1
    )
    benchmark.extra_info["acceptance_length"] = result[0].stats.acceptance_length
