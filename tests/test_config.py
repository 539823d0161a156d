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


def test_json_round_trip_and_named_errors():
    config = VegasConfig(kv_budget=64, window=8, vllm={"tp_selection": "per_rank", "draft_graph_max_rows": 32})
    assert VegasConfig.from_json(config.to_json()) == config
    assert config.vllm.draft_cuda_graphs is True and config.vllm.verify_cuda_graphs == "full"
    with pytest.raises(VegasConfigError, match="unknown field.*budget.*allowed: num_draft_tokens"):
        VegasConfig.from_json('{"budget": 3}')
    with pytest.raises(VegasConfigError, match="vllm.tp_selection must be one of 'all_reduce', 'per_rank'"):
        VegasConfig.from_json('{"vllm": {"tp_selection": "gather"}}')
    with pytest.raises(VegasConfigError, match="must be a JSON object"):
        VegasConfig.from_json("[]")


def test_budget_rule_on_tensors_matches_the_int_rule():
    import torch

    from vegas.config import recent_window_for

    contexts = torch.tensor([0, 10, 4096, 8192, 12345])
    for config in (VegasConfig(sparsity_ratio=0.1, min_kv_budget=256), VegasConfig(kv_budget=100),
                   VegasConfig(sparsity_ratio=0.03, min_kv_budget=0)):
        assert kv_budget_for(config, contexts).tolist() == [kv_budget_for(config, int(c)) for c in contexts]
    budgets = torch.tensor([0, 3, 100, 1000])
    assert recent_window_for(VegasConfig(), budgets).tolist() == [recent_window_for(VegasConfig(), int(b))
                                                                    for b in budgets] == [0, 1, 50, 64]
