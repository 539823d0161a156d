"""HF backend on CUDA: greedy Vegas equals plain greedy of the same dtype (skipped without a GPU)."""

import pytest
import torch

from vegas import Pipeline, VegasConfig
from vegas.prompts import cut_contexts, package_source
from vegas.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def cuda_pipe(request):
    return Pipeline(selector=None, dtype=request.param, device="cuda")


@pytest.mark.parametrize("selector", ["collect2", "aggregated", "sliding_window", "quest"])
def test_hf_cuda_greedy_exact(cuda_pipe, selector):
    ids = cuda_pipe.tokenizer(package_source(), add_special_tokens=False).input_ids
    prompts = cut_contexts(ids, 2048, 2)
    prompts[1] = prompts[1][:1500]
    config = VegasConfig(num_draft_tokens=4, kv_budget=128, recent_window=16)
    greedy = SamplingParams()
    ref = cuda_pipe.backend.generate(prompts, max_new_tokens=32, sampling=greedy, selector=None, config=config)
    out = cuda_pipe.backend.generate(prompts, max_new_tokens=32, sampling=greedy, selector=selector, config=config)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert sum(o.stats.num_accepted for o in out) > 0
