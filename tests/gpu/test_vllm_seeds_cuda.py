"""Seeded sampling under Vegas on vLLM 0.24's V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``) with
``vllm.seeded_verification="coupled"``: a request with ``seed=123, n=2, temperature=0.8`` gives the
same two outputs alone and among unseeded batch neighbours, since its drafts are withheld
(:func:`vegas.vllm_plugin.coupling.withhold_drafts`) and its output is the target's own sample from
its generator. Under rejection sampling (the default) it did not (H200, 2026-12-03: the first
difference at the third token): the drafts follow the KV selection's batch numerics. Skips without
CUDA or vLLM.

As under plain vLLM, the outputs are equal up to the target's bf16 batch effects: a different
batch size can move a logit by an ulp, which changes a token only at a near-tie of the noisy
logits; 32 tokens of one prompt keep that chance small."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_vllm_backend_cuda import TP1
from vegas.backends.vllm import vllm_engine_kwargs
from vegas.config import VegasConfig, VllmOptions
from vegas.vllm_plugin.settings import settings_json

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_v1_seeded_request_is_reproducible_with_n2_and_changing_neighbours(monkeypatch):
    pytest.importorskip("vllm")
    import os

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vegas import DEFAULT_MODEL
    from vegas.prompts import cut_contexts, package_source
    from vegas.vllm_plugin import register

    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # vLLM's switch to the V1 runner
    register()
    ids = AutoTokenizer.from_pretrained(DEFAULT_MODEL)(package_source(), add_special_tokens=False).input_ids
    target, *others = cut_contexts(ids, 1500, 4)
    seeded = SamplingParams(temperature=0.8, seed=123, n=2, max_tokens=32, ignore_eos=True, detokenize=False)
    unseeded = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, detokenize=False)
    llm = LLM(**vllm_engine_kwargs(str(DEFAULT_MODEL), num_draft_tokens=4,
                                   settings=settings_json("collect2", VegasConfig(
                                       min_kv_budget=64, vllm=VllmOptions(seeded_verification="coupled"))), **TP1))
    try:
        assert not llm.llm_engine.vllm_config.use_v2_model_runner
        alone = llm.generate([{"prompt_token_ids": target}], seeded, use_tqdm=False)
        # new neighbours, before and after it, of other lengths: other rows, other batch sizes
        batch = [others[0], target, others[1], others[2][:700]]
        crowded = llm.generate([{"prompt_token_ids": p} for p in batch], [unseeded, seeded, unseeded, unseeded],
                               use_tqdm=False)
        stats = llm.collective_rpc("vegas_stats", args=(True,))[0]
    finally:
        llm.llm_engine.engine_core.shutdown()
    first = [list(c.token_ids) for c in alone[0].outputs]
    second = [list(c.token_ids) for c in crowded[1].outputs]
    assert len(first) == 2 and all(len(t) == 32 for t in first)
    diffs = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(first, second)]
    assert first == second, f"first differing token per child: {diffs}; stats: {stats}"
    assert first[0] != first[1]  # the children's seeds (123, 124) differ
    assert stats["iterations"] > 0 and stats["acceptance_length"] > 1.0, stats
