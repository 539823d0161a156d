"""Seeded sampling under Vegas on vLLM 0.24's V2 runner (the default for Llama, Qwen3, Mistral) with
``vllm.seeded_verification="coupled"`` (:mod:`vegas.vllm_plugin.coupling`): a request with
``seed=123, n=2, temperature=0.8`` gives the same two outputs alone and among unseeded batch
neighbours that change between the runs, and (diagnostic, printed) the same as plain vLLM's seeded
output. Skips without CUDA or vLLM.

Under coupling every emitted token is the target's own seeded sample (vLLM's ``gumbel_sample`` keyed
by seed and position), so the drafts, and with them the KV selection's batch numerics, cannot
change the output; what remains is the target's bf16 rounding, as between two plain vLLM runs."""

from __future__ import annotations

import os

import pytest
import torch

from tests.gpu.test_vllm_backend_cuda import TP1
from vegas.backends.vllm import vllm_engine_kwargs
from vegas.config import VegasConfig, VllmOptions
from vegas.vllm_plugin.settings import settings_json

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _run(llm_kwargs, target, others):
    from vllm import LLM, SamplingParams

    seeded = SamplingParams(temperature=0.8, seed=123, n=2, max_tokens=48, ignore_eos=True, detokenize=False)
    unseeded = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, detokenize=False)
    llm = LLM(**llm_kwargs)
    try:
        alone = llm.generate([{"prompt_token_ids": target}], seeded, use_tqdm=False)
        batch = [others[0], target, others[1], others[2][:700]]  # new neighbours, other lengths and rows
        crowded = llm.generate([{"prompt_token_ids": p} for p in batch], [unseeded, seeded, unseeded, unseeded],
                               use_tqdm=False)
        stats = llm.collective_rpc("vegas_stats", args=(True,))[0] if "speculative_config" in llm_kwargs else None
    finally:
        llm.llm_engine.engine_core.shutdown()
    first = [list(c.token_ids) for c in alone[0].outputs]
    second = [list(c.token_ids) for c in crowded[1].outputs]
    return first, second, stats


def test_v2_coupled_seeded_request_is_reproducible_among_changing_neighbours():
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer

    from vegas import DEFAULT_MODEL
    from vegas.prompts import cut_contexts, package_source
    from vegas.vllm_plugin import register

    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    register()
    ids = AutoTokenizer.from_pretrained(DEFAULT_MODEL)(package_source(), add_special_tokens=False).input_ids
    target, *others = cut_contexts(ids, 1500, 4)
    config = VegasConfig(min_kv_budget=64, vllm=VllmOptions(seeded_verification="coupled"))
    vegas_kwargs = vllm_engine_kwargs(str(DEFAULT_MODEL), num_draft_tokens=4,
                                      settings=settings_json("collect2", config), **TP1)
    first, second, stats = _run(vegas_kwargs, target, others)
    diffs = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(first, second)]
    assert len(first) == 2 and all(len(t) == 48 for t in first)
    assert first == second, f"first differing token per child: {diffs}; stats: {stats}"
    assert first[0] != first[1]  # the children's seeds (123, 124) differ
    assert stats["iterations"] > 0 and stats["acceptance_length"] > 1.0, stats

    plain_first, plain_second, _ = _run(vllm_engine_kwargs(str(DEFAULT_MODEL), **TP1), target, others)
    same = [a == b for a, b in zip(first, plain_first)]
    print(f"vegas-coupled: children equal to plain vLLM's seeded output: {same}; plain reproducible: "
          f"{plain_first == plain_second}; acceptance length {stats['acceptance_length']:.2f}")
