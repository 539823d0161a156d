"""vLLM backend: configuration checks on CPU (no vLLM needed); a greedy smoke run on CUDA + vLLM."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from vegas.backends.vllm import VLLMBackend, engine_args_from_env, verify_cuda_graphs, vllm_engine_kwargs
from vegas.config import VegasConfig, VegasConfigError
from vegas.hookspecs import hookimpl
from vegas.interfaces import Selector
from vegas.plugins import create_selector
from vegas.selection import topk_selection
from vegas.vllm_plugin import CLASS_PATH
from vegas.vllm_plugin.settings import raise_if_unsupported, settings_json


def test_engine_kwargs_switch_vegas_on():
    plain = vllm_engine_kwargs("m")
    assert "speculative_config" not in plain and plain["attention_backend"] == "FLASH_ATTN"
    kw = vllm_engine_kwargs("m", num_draft_tokens=3, gpu_memory_utilization=0.4)
    assert kw["speculative_config"] == {
        "method": "custom_class", "model": CLASS_PATH, "num_speculative_tokens": 3,
    }
    assert "compilation_config" not in kw  # vLLM's full CUDA graphs stay on for verification
    assert kw["gpu_memory_utilization"] == 0.4


def test_piecewise_verification_graphs_on_request():
    kw = vllm_engine_kwargs("m", num_draft_tokens=3, verify_cuda_graphs="piecewise",
                            compilation_config={"cudagraph_capture_sizes": [1, 2]})
    assert kw["compilation_config"] == {"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 2]}
    with pytest.raises(VegasConfigError, match="vllm.verify_cuda_graphs must be one of 'full', 'piecewise'"):
        VegasConfig(vllm={"verify_cuda_graphs": "fast"})
    piecewise = VegasConfig(vllm={"verify_cuda_graphs": "piecewise"})
    assert verify_cuda_graphs(create_selector("collect2", VegasConfig()), VegasConfig()) == "full"
    assert verify_cuda_graphs(create_selector("collect2", piecewise), piecewise) == "piecewise"


def test_engine_args_come_from_the_backend_and_the_environment(monkeypatch):
    monkeypatch.setenv("VEGAS_VLLM_ENGINE_ARGS", '{"max_model_len": 2048}')
    assert engine_args_from_env() == {"max_model_len": 2048}
    monkeypatch.setenv("VEGAS_VLLM_ENGINE_ARGS", "[1]")
    with pytest.raises(VegasConfigError, match="VEGAS_VLLM_ENGINE_ARGS must be a JSON object"):
        engine_args_from_env()
    with pytest.raises(VegasConfigError, match="engine_args must be a dict"):
        VLLMBackend("m", engine_args=[("max_model_len", 1)])


def test_configure_refuses_a_new_selector_under_full_graphs(monkeypatch):
    from vegas.vllm_plugin import configure
    from vegas.vllm_plugin.state import STATE

    same = settings_json("collect2", VegasConfig())
    monkeypatch.setattr(STATE, "settings", same)
    monkeypatch.setattr(STATE, "gamma", 4)
    monkeypatch.setattr(STATE, "frozen", True)
    assert configure(object(), same, reset_stats=False) == same
    with pytest.raises(VegasConfigError, match="full CUDA graphs"):
        configure(object(), settings_json("sliding_window", VegasConfig()), reset_stats=False)
    assert STATE.settings == same


def test_settings_round_trip_into_the_proposer():
    from vegas.vllm_plugin.settings import build_selector, parse_settings

    cfg = VegasConfig(num_draft_tokens=4, sparsity_ratio=0.1, min_kv_budget=32)
    name, config = parse_settings(settings_json("aggregated", cfg))
    selector = build_selector(name, config, 4)
    assert selector.name == "aggregated" and selector.config == cfg
    assert selector.budget(1000) == 100 and min(selector.budget(10), 10) == 10


@pytest.mark.parametrize(
    "selector,config,match",
    [
        ("quest", VegasConfig(page_size=32), "page_size must be 16"),
        ("collect2", VegasConfig(granularity="kv_head"), "granularity"),
        ("collect2", VegasConfig(score_mode="weight"), "score_mode"),
    ],
)
def test_unsupported_settings_are_named(selector, config, match):
    with pytest.raises(VegasConfigError, match=match):
        raise_if_unsupported(create_selector(selector, config), config)


def test_bad_dtype_and_device():
    with pytest.raises(VegasConfigError, match="CUDA"):
        VLLMBackend("m", device="cpu")
    with pytest.raises(VegasConfigError, match="dtype"):
        VLLMBackend("m", dtype="int8")
    if importlib.util.find_spec("vllm") is None or not torch.cuda.is_available():
        with pytest.raises(VegasConfigError, match="backend 'vllm' needs"):
            VLLMBackend("m")
    else:
        assert VLLMBackend("m", dtype="float32").dtype == "bfloat16"


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


def _plain_reference(engine_kw: dict):
    """Held-out-style prompts (click source, 3000 and 1200 tokens) and plain vLLM greedy
    outputs with top-2 logprobs."""
    pytest.importorskip("vllm")
    import os

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vegas import DEFAULT_MODEL
    from vegas.prompts import cut_contexts, package_source

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
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
    from vegas.vllm_plugin import get_stats, register

    prompts, sp, plain = tp1_plain
    register()
    monkeypatch.setenv("VEGAS_VLLM_CONFIG", settings_json("collect2", VegasConfig(min_kv_budget=64)))
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    kw = dict(TP1) if async_scheduling else dict(TP1, async_scheduling=False)
    llm = LLM(**vllm_engine_kwargs(str(DEFAULT_MODEL), num_draft_tokens=4, **kw))
    try:
        assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling is async_scheduling
        vegas = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        stats = llm.collective_rpc(get_stats, args=(True,))[0]
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
    from vllm import LLM

    from vegas import DEFAULT_MODEL
    from vegas.vllm_plugin import get_stats, register

    prompts, sp, plain = tp1_plain
    register()
    monkeypatch.setenv("VEGAS_VLLM_CONFIG", settings_json("quest", VegasConfig(min_kv_budget=64)))
    llm = LLM(**vllm_engine_kwargs(str(DEFAULT_MODEL), num_draft_tokens=4, **TP1))
    try:
        vegas = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        stats = llm.collective_rpc(get_stats, args=(True,))[0]
    finally:
        llm.llm_engine.engine_core.shutdown()
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
    from vegas.vllm_plugin import get_stats

    prompts, sp, plain = tp2_plain
    config = VegasConfig(min_kv_budget=64, vllm={"tp_selection": tp_selection})
    monkeypatch.setenv("VEGAS_VLLM_CONFIG", settings_json("collect2", config))
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    llm = LLM(**vllm_engine_kwargs(str(DEFAULT_MODEL), num_draft_tokens=4, **TP2))
    try:
        vegas = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        stats = llm.collective_rpc(get_stats)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert len(stats) == 2 and stats[0]["acceptance_length"] > 1.0
    _assert_equal_up_to_ties(plain, vegas)


class SinksAndTopKSelector(Selector):
    """A selector defined here, without a vLLM fast path (the generic path runs its ``select``):
    the first 4 positions as attention sinks plus the top-k of the first and last verify query's
    logits."""

    name = "test_sinks_topk"

    def score_rows(self, chunk_len):
        return sorted({0, chunk_len - 1})

    def select(self, inputs):
        sinks = torch.arange(inputs.valid.shape[1], device=inputs.valid.device) < 4
        scores = inputs.scores.masked_fill(sinks[None, None, :], float("inf"))
        return topk_selection(scores, inputs.valid, inputs.budget)


class _TestSelectorPlugin:
    @hookimpl
    def vegas_selectors(self):
        return {SinksAndTopKSelector.name: SinksAndTopKSelector}


def test_configure_builds_the_path_of_any_registered_selector(monkeypatch):
    """Under piecewise verification graphs configure() switches to any registered selector: a
    built-in gets its fast path, a selector without one the generic path."""
    from vegas import plugins
    from vegas.vllm_plugin import configure
    from vegas.vllm_plugin.selectors import ScoreTopKFastPath
    from vegas.vllm_plugin.selectors.generic import GenericPath
    from vegas.vllm_plugin.state import STATE

    for name, value in (("gamma", 4), ("frozen", False), ("settings", ""), ("path", None), ("sel_buf", None)):
        monkeypatch.setattr(STATE, name, value)
    plugins.register(_TestSelectorPlugin(), name="test_generic_selectors")
    try:
        settings = settings_json("test_sinks_topk", VegasConfig(kv_budget=32))
        assert configure(object(), settings, reset_stats=False) == settings
        assert isinstance(STATE.path, GenericPath) and STATE.path.selector.config.kv_budget == 32
        configure(object(), settings_json("last_token", VegasConfig()), reset_stats=False)
        assert isinstance(STATE.path, ScoreTopKFastPath) and STATE.path.row_table.width == 1
    finally:
        plugins.unregister("test_generic_selectors")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("selector", ["h2o", "test_sinks_topk"])
def test_plugin_selectors_run_on_vllm_and_equal_plain(selector, tp1_plain):
    """Selectors without a fast path (the example plugin's H2O, and one defined here, both
    registered by hand) run on backend="vllm" through the generic path: greedy output equals
    plain vLLM greedy up to bf16 near-ties, and Vegas drafts (acceptance length > 1)."""
    vegas_h2o = pytest.importorskip("vegas_h2o", reason="install the example plugin: pip install ./plugins/vegas-h2o")

    from vegas import Pipeline, plugins

    prompts, sp, plain = tp1_plain
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
        plugins.unregister("h2o")
        plugins.unregister("test_generic_selectors")
    iterations = sum(o.stats.iterations for o in out)
    tau = sum(o.stats.num_accepted + o.stats.iterations for o in out) / max(iterations, 1)
    print(f"{selector} on vllm (generic path): acceptance length {tau:.2f} over {iterations} iterations")
    assert iterations > 0 and tau > 1.0
    _assert_tokens_equal_up_to_ties(plain, [o.token_ids for o in out], stops_early=True)
