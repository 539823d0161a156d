import pytest

from vegas import VegasConfig, VegasConfigError
from vegas.config import kv_budget_for
from vegas.sampling import SamplingParams


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"num_draft_tokens": 0}, "num_draft_tokens"),
        ({"num_draft_tokens": -3}, "num_draft_tokens"),
        ({"num_draft_tokens": 2.5}, "num_draft_tokens"),
        ({"sparsity_ratio": 0.0}, "sparsity_ratio"),
        ({"sparsity_ratio": 1.5}, "sparsity_ratio"),
        ({"sparsity_ratio": -0.1}, "sparsity_ratio"),
        ({"kv_budget": -1}, "kv_budget"),
        ({"min_kv_budget": -1}, "min_kv_budget"),
        ({"page_size": 0}, "page_size"),
        ({"recent_window": -1}, "recent_window"),
        ({"granularity": "head"}, "granularity"),
        ({"score_mode": "prob"}, "score_mode"),
    ],
)
def test_bad_config_names_the_parameter(kwargs, name):
    with pytest.raises(VegasConfigError, match=name):
        VegasConfig(**kwargs)


def test_budget_rule():
    assert kv_budget_for(VegasConfig(sparsity_ratio=0.05, min_kv_budget=256), 4096) == 256
    assert kv_budget_for(VegasConfig(sparsity_ratio=0.1, min_kv_budget=256), 8192) == 820
    assert kv_budget_for(VegasConfig(kv_budget=100), 8192) == 100
    assert kv_budget_for(VegasConfig(sparsity_ratio=1.0), 10) == 256  # may exceed the context


@pytest.mark.parametrize("kwargs, name", [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p")])
def test_bad_sampling(kwargs, name):
    with pytest.raises(VegasConfigError, match=name):
        SamplingParams(**kwargs)
