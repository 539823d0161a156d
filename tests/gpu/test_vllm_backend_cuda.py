"""vLLM backend on CUDA + vLLM: greedy output equals plain vLLM greedy (up to bf16 near-ties)
for the built-in fast paths, Quest, tensor parallelism and selectors without a fast path."""

from __future__ import annotations

import pytest
import torch

from tests.test_vllm_backend import _TestSelectorPlugin
from vegas.backends.vllm import vllm_engine_kwargs
from vegas.config import VegasConfig
from vegas.vllm_plugin.settings import settings_json


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_vllm_pipeline_greedy_smoke():
    pytest.importorskip("vllm")
    from vegas import Pipeline
    from vegas.prompts import cut_contexts, package_source

    pipe = Pipeline(selector="collect2", backend="vllm", dtype="bfloat16", num_draft_tokens=4)
    ids = pipe.tokenizer(package_source(), add_special_tokens=False).input_ids
    prompts = cut_contexts(ids, 4096, 3)
    prompts[1], prompts[2] = prompts[1][:1500], prompts[2][:700]  # different context lengths
    out = pipe.generate(prompts, max_new_tokens=32)
    assert all(len(o.token_ids) == 32 for o in out)
    assert all(o.stats.iterations > 0 and o.stats.acceptance_length >= 1 for o in out)
    # a selector switch rebuilds the engine under full verification graphs
    out2 = pipe.generate(prompts[:1], max_new_tokens=16, selector="sliding_window")
    assert len(out2[0].token_ids) == 16
    pipe.backend.close()


TP1 = dict(max_model_len=3200, gpu_memory_utilization=0.3, seed=0, max_num_seqs=8)
TP2 = dict(TP1, tensor_parallel_size=2)


def tiny_random_case(tmp_path_factory, name: str, config):
    """A tiny random-weight model saved from ``config`` (bf16, seed 0) and what the greedy GPU
    tests run on it: ``(path, prompts, sampling params, engine kwargs)``, three random-token
    prompts of 2,000, 1,200 and 700 tokens, 32 greedy tokens with top-2 logprobs (for the
    near-tie check), ``TP1`` without a tokenizer."""
    import transformers
    from vllm import SamplingParams

    path = tmp_path_factory.mktemp(name)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist() for n in (2000, 1200, 700)]
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2, detokenize=False)
    return str(path), prompts, sp, dict(TP1, skip_tokenizer_init=True)


def _plain_reference(engine_kw: dict):
    """Held-out-style prompts (click source, 3000 and 1200 tokens) and plain vLLM greedy
    outputs with top-2 logprobs."""
    pytest.importorskip("vllm")
    import os

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vegas import DEFAULT_MODEL
    from vegas.prompts import cut_contexts, package_source

    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    # the engine core must not be forked from a process that may have initialized CUDA
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    ids = AutoTokenizer.from_pretrained(DEFAULT_MODEL)(package_source(), add_special_tokens=False).input_ids
    prompts = cut_contexts(ids, 3000, 4)
    prompts[1] = prompts[1][:1200]
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2, detokenize=False)
    llm = LLM(**vllm_engine_kwargs(str(DEFAULT_MODEL), **engine_kw))
    try:
        plain = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return prompts, sp, plain


def _assert_equal_up_to_ties(plain, vegas) -> None:
    """Vegas greedy tokens equal plain greedy tokens, or first differ where plain vLLM's top-2
    logprob gap is <= 0.125 (a bf16 near-tie)."""
    _assert_tokens_equal_up_to_ties(plain, [list(v.outputs[0].token_ids) for v in vegas])


def _assert_tokens_equal_up_to_ties(plain, vegas_tokens, stops_early: bool = False) -> None:
    """:func:`_assert_equal_up_to_ties` for token lists; with ``stops_early`` (a run that stops
    at EOS, plain's ignores it) the Vegas tokens may be a shorter prefix."""
    for p, b in zip(plain, vegas_tokens):
        a = list(p.outputs[0].token_ids)
        if stops_early:
            a = a[: len(b)]
        assert len(a) == len(b)
        if a == b:
            continue
        j = next(k for k in range(len(a)) if a[k] != b[k])
        top = sorted((x.logprob for x in p.outputs[0].logprobs[j].values()), reverse=True)
        assert top[0] - top[1] <= 0.125, f"differs at token {j} with top-2 gap {top[0] - top[1]}"


def _generate(engine_kw: dict, prompts, sp):
    """``(outputs, stats)`` of one ``vllm.LLM(**engine_kw)`` over token-id ``prompts``, then shut
    down; ``stats`` is the Vegas drafter's counters (``collective_rpc("vegas_stats")``, ``{}`` plain)."""
    import os

    from vllm import LLM

    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    llm = LLM(**engine_kw)
    try:
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        stats = llm.collective_rpc("vegas_stats", args=(True,))[0] if llm.llm_engine.vllm_config.speculative_config \
            else {}
    finally:
        llm.llm_engine.engine_core.shutdown()
    return out, stats


@pytest.fixture(scope="module")
def tp1_plain():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return _plain_reference(TP1)


@pytest.fixture(scope="module")
def tp2_plain():
    return _plain_reference(TP2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_vllm_greedy_equals_plain_with_and_without_async_scheduling(async_scheduling, tp1_plain, monkeypatch):
    """One GPU: Vegas (collect2) greedy equals plain vLLM greedy up to bf16 near-ties, with
    vLLM's async scheduling on (the default, drafts start from device tensors) and off (host
    lists), the engine really runs in the asked mode, and Vegas drafts (acceptance length > 1)."""
    from vllm import LLM

    from vegas import DEFAULT_MODEL
    from vegas.vllm_plugin import register

    prompts, sp, plain = tp1_plain
    register()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    kw = dict(TP1) if async_scheduling else dict(TP1, async_scheduling=False)
    llm = LLM(**vllm_engine_kwargs(str(DEFAULT_MODEL), num_draft_tokens=4, settings=settings_json("collect2", VegasConfig(min_kv_budget=64)), **kw))
    try:
        assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling is async_scheduling
        vegas = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        stats = llm.collective_rpc("vegas_stats", args=(True,))[0]
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert stats["acceptance_length"] > 1.0 and stats["iterations"] > 0
    assert len(stats["requests"]) == len(prompts)
    # the selection is timed in every verification, replayed full CUDA graphs included
    assert stats["full_cuda_graphs"] and stats["select_ms"] > 0
    assert stats["select_timed"] >= stats["proposals"] > 0
    _assert_equal_up_to_ties(plain, vegas)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_vllm_quest_greedy_equals_plain(tp1_plain, monkeypatch):
    """Quest on one GPU (page bounds kept by every verification, pages chosen per draft query
    inside the draft CUDA graph): greedy equals plain vLLM greedy up to bf16 near-ties, Vegas
    drafts (acceptance length > 1), and the bound updates are timed in every verification."""
    from vegas import DEFAULT_MODEL
    from vegas.vllm_plugin import register

    prompts, sp, plain = tp1_plain
    register()
    vegas, stats = _generate(vllm_engine_kwargs(str(DEFAULT_MODEL), num_draft_tokens=4,
                                                settings=settings_json("quest", VegasConfig(min_kv_budget=64)), **TP1),
                             prompts, sp)
    assert stats["acceptance_length"] > 1.0 and len(stats["requests"]) == len(prompts)
    assert stats["full_cuda_graphs"] and stats["select_timed"] >= stats["proposals"] > 0
    _assert_equal_up_to_ties(plain, vegas)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (tensor_parallel_size=2)")
@pytest.mark.parametrize("tp_selection", ["all_reduce", "per_rank"])
def test_vllm_tensor_parallel_greedy_equals_plain_tp2(tp_selection, tp2_plain, monkeypatch):
    """TP=2 (vegas-tiny-code: 6 query / 2 KV heads -> 3 / 1 per rank): Vegas greedy output equals
    plain vLLM TP=2 greedy on real code prompts, except at bf16 ties (top-2 logprob gap
    <= 0.125 at the first difference), and Vegas really drafts (acceptance length > 1)."""
    from vllm import LLM

    from vegas import DEFAULT_MODEL

    prompts, sp, plain = tp2_plain
    config = VegasConfig(min_kv_budget=64, vllm={"tp_selection": tp_selection})
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    llm = LLM(**vllm_engine_kwargs(str(DEFAULT_MODEL), num_draft_tokens=4, settings=settings_json("collect2", config), **TP2))
    try:
        vegas = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        stats = llm.collective_rpc("vegas_stats")
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert len(stats) == 2 and stats[0]["acceptance_length"] > 1.0
    _assert_equal_up_to_ties(plain, vegas)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("selector", ["h2o", "test_sinks_topk"])
def test_plugin_selectors_run_on_vllm_and_equal_plain(selector, request):
    """Selectors without a fast path (the example plugin's H2O, and one defined here, both
    registered by hand) run on backend="vllm" through the generic path: greedy output equals
    plain vLLM greedy up to bf16 near-ties, and Vegas drafts (acceptance length > 1). H2O is
    skipped when the example plugin is not importable (checked before the plain engine starts)."""
    from vegas import Pipeline, plugins

    if selector == "h2o":
        vegas_h2o = pytest.importorskip("vegas_h2o", reason="install the example plugin: pip install ./plugins/vegas-h2o")
    prompts, sp, plain = request.getfixturevalue("tp1_plain")
    if selector == "h2o":
        plugins.register(vegas_h2o, name="h2o")
    plugins.register(_TestSelectorPlugin(), name="test_generic_selectors")
    try:
        pipe = Pipeline(selector=selector, backend="vllm", dtype="bfloat16", num_draft_tokens=4, min_kv_budget=64,
                        backend_options={"engine_args": dict(TP1)})
        try:
            out = pipe.generate(prompts, max_new_tokens=sp.max_tokens)
        finally:
            pipe.backend.close()
    finally:
        if selector == "h2o":
            plugins.unregister("h2o")
        plugins.unregister("test_generic_selectors")
    iterations = sum(o.stats.iterations for o in out)
    tau = sum(o.stats.num_accepted + o.stats.iterations for o in out) / max(iterations, 1)
    print(f"{selector} on vllm (generic path): acceptance length {tau:.2f} over {iterations} iterations")
    assert iterations > 0 and tau > 1.0
    _assert_tokens_equal_up_to_ties(plain, [o.token_ids for o in out], stops_early=True)



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layer_types", [["full_attention"] * 4, ["sliding_attention", "full_attention"] * 2],
                         ids=["full", "sliding"])
def test_soft_capped_model_scores_capped_logits_and_equals_plain(tmp_path_factory, monkeypatch, layer_types):
    """A tiny random Gemma 2 (vLLM's Gemma 2 hands ``attn_logit_softcapping`` to FlashAttention
    as ``logits_soft_cap``): the attention hook passes the cap to the score kernel (the worker
    reports it), and Vegas greedy equals plain vLLM greedy up to bf16 near-ties; with Gemma 2's
    alternating sliding-window layers (window 256, prompts of 700-2,000 tokens) too, whose
    drafts attend their own window (plain vLLM keeps its hybrid KV-cache manager, Vegas asks for
    one KV-cache group). vLLM gives every layer of a config whose ``layer_types`` are not
    interleaved the config's ``sliding_window`` (``EngineArgs``: ``cache_config.sliding_window``),
    so the all-full variant sets a window longer than ``max_model_len``: no key is dropped, and
    Vegas counts those layers as full attention (with 256 vLLM would run every layer windowed and
    Vegas would refuse the model: nothing to select)."""
    pytest.importorskip("vllm")
    import transformers

    from vegas.vllm_plugin import register

    config = transformers.Gemma2Config(
        vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, max_position_embeddings=4096, initializer_range=0.1,
        attn_logit_softcapping=2.0, final_logit_softcapping=30.0,
        sliding_window=256 if len(set(layer_types)) > 1 else 4096, layer_types=layer_types,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    path, prompts, sp, kw = tiny_random_case(tmp_path_factory, "gemma2", config)
    register()
    plain, _ = _generate(vllm_engine_kwargs(str(path), **kw), prompts, sp)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    vegas, stats = _generate(vllm_engine_kwargs(str(path), num_draft_tokens=4,
                                                settings=settings_json("collect2", VegasConfig(min_kv_budget=64)), **kw),
                             prompts, sp)
    assert stats["logits_soft_cap"] == 2.0 and stats["iterations"] > 0
    _assert_equal_up_to_ties(plain, vegas)
