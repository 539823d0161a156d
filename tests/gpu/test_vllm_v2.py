"""Vegas on vLLM 0.24's V2 model runner (``VLLM_USE_V2_MODEL_RUNNER=1``): greedy equals plain
vLLM greedy on the embedded model (collect2 and sliding_window, γ = 4), and sampling at
T = 0.8 drafts with acceptance length > 1. Skips without CUDA or vLLM."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_vllm_backend_cuda import TP1, _assert_equal_up_to_ties, _plain_reference
from tests.test_vllm_backend import _TestSelectorPlugin
from vegas.backends.vllm import vllm_engine_kwargs
from vegas.config import VegasConfig
from vegas.vllm_plugin.settings import settings_json

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def plain_v2():
    pytest.importorskip("vllm")
    return _plain_reference(TP1)


def _vegas_v2(monkeypatch, selector: str, prompts, sp, **vllm_options):
    """Outputs and V2 speculator counters of a Vegas engine forced onto the V2 runner."""
    from vllm import LLM

    from vegas import DEFAULT_MODEL
    from vegas.vllm_plugin import register

    register()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    llm = LLM(**vllm_engine_kwargs(str(DEFAULT_MODEL), num_draft_tokens=4, settings=settings_json(selector, VegasConfig(min_kv_budget=64, vllm=vllm_options)),
                         **TP1))
    try:
        assert llm.llm_engine.vllm_config.use_v2_model_runner
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        stats = llm.collective_rpc("vegas_stats")[0]
    finally:
        llm.llm_engine.engine_core.shutdown()
    return out, stats


@pytest.mark.parametrize("selector", ["collect2", "sliding_window", "quest"])
def test_vllm_v2_greedy_equals_plain(selector, plain_v2, monkeypatch):
    prompts, sp, plain = plain_v2
    vegas, stats = _vegas_v2(monkeypatch, selector, prompts, sp)
    assert stats["runner"] == "v2" and stats["proposals"] > 0 and not stats["graph_failed"]
    assert stats["acceptance_length"] > 1.0, stats
    _assert_equal_up_to_ties(plain, vegas)


def test_vllm_v2_prefill_skip_keeps_greedy_equal(plain_v2, monkeypatch):
    """vllm.prefill_skip_tokens: forwards with a prefill chunk neither select nor draft; the
    output stays plain greedy's and the other steps still draft. Under async scheduling (the
    default) the scheduler decides (step_switch): the steps it gives no draft slots are the
    ones that skip. Under select_in_draft without the measured fallback the step after a
    skipped prefill step (one token per request, selecting) replays a full CUDA graph of query
    length 1 captured with the selection (vegas.vllm_plugin.plain_graphs), not vLLM's piecewise
    graphs (``q1_select_graph_steps``)."""
    prompts, sp, plain = plain_v2
    vegas, stats = _vegas_v2(monkeypatch, "collect2", prompts, sp, prefill_skip_tokens=16, select_in_draft=True)
    assert stats["prefill_skips"] >= 1 and stats["proposals"] > 0 and stats["acceptance_length"] > 1.0, stats
    assert stats["scheduled_skips"] >= 1, stats  # the scheduler's switch was in force
    assert stats["score_path"] == "in_draft" and stats["full_cuda_graphs"], stats
    assert stats["q1_select_graph_steps"] >= 1 and not stats["graph_failed"], stats
    _assert_equal_up_to_ties(plain, vegas)


def test_vllm_v2_score_overlap_keeps_greedy_equal(plain_v2, monkeypatch):
    """vllm.score_overlap: the verification graphs score each layer on a side stream; they
    capture (no graph failure), drafts are accepted as without it, and greedy equals plain."""
    prompts, sp, plain = plain_v2
    vegas, stats = _vegas_v2(monkeypatch, "collect2", prompts, sp, score_overlap=True)
    assert stats["full_cuda_graphs"] and stats["layer_scored_forwards"] >= 1, stats
    assert not stats["graph_failed"] and stats["proposals"] > 0 and stats["acceptance_length"] > 1.0, stats
    _assert_equal_up_to_ties(plain, vegas)


@pytest.mark.parametrize("in_draft", [None, False], ids=["default_in_draft", "separate"])
def test_vllm_v2_select_in_draft_keeps_greedy_equal(plain_v2, monkeypatch, in_draft):
    """vllm.select_in_draft (on by default): the verification keeps its collect queries and the
    draft graphs score and select beside their first forward (a side stream forked and joined
    inside each captured draft graph); no graph fails, drafts are accepted, greedy equals plain.
    ``False``: the score pass after the verification's last layer, the same checks."""
    prompts, sp, plain = plain_v2
    vegas, stats = _vegas_v2(monkeypatch, "collect2", prompts, sp, select_in_draft=in_draft)
    assert stats["score_path"] == ("in_draft" if in_draft is None else "separate"), stats
    assert stats["full_cuda_graphs"] and stats["draft_graphs"] > 0, stats
    assert not stats["graph_failed"] and stats["proposals"] > 0 and stats["acceptance_length"] > 1.0, stats
    _assert_equal_up_to_ties(plain, vegas)


def test_vllm_v2_fallback_probes_plain_steps_and_keeps_greedy_equal(plain_v2, monkeypatch):
    """vllm.fallback: the scheduler's measured fallback (step_switch.MeasuredFallback) runs plain
    probe steps (no draft slots, no selection, no drafting) between drafting steps; the output
    stays plain greedy's. A short probe interval (engine core in this process) so that 48 tokens
    reach a probe. The plain steps of one token per request replay the full CUDA graphs of query
    length 1 captured without the selection (vegas.vllm_plugin.plain_graphs), not vLLM's piecewise
    graphs (``plain_full_graph_steps``). One test, one in-process engine: a second engine in the
    same process fails in vLLM's CUDA-graph pool (docs/gpu-checks.md)."""
    from vegas.vllm_plugin import step_switch

    prompts, sp, plain = plain_v2
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler must see the short interval
    made = []

    def of(gamma, prefill_skip_tokens, fallback):
        switch = step_switch.StepSwitch(gamma, prefill_skip_tokens,
                                        step_switch.MeasuredFallback(gamma, interval=4, window=2) if fallback else None)
        made.append(switch)
        return switch

    monkeypatch.setattr(step_switch.StepSwitch, "of", staticmethod(of))
    # the fallback alone (the prefill skip, on by default on V2, would add skipped steps of its own)
    vegas, stats = _vegas_v2(monkeypatch, "collect2", prompts, sp, fallback=True, prefill_skip_tokens=0)
    assert made and made[-1].fallback.probes >= 1, stats
    assert stats["scheduled_skips"] >= 1 and stats["proposals"] > 0 and stats["acceptance_length"] > 1.0, stats
    assert stats["full_cuda_graphs"] and 1 <= stats["plain_full_graph_steps"] <= stats["scheduled_skips"], stats
    assert stats["q1_select_graph_steps"] == 0, stats  # with the fallback those graphs never select
    _assert_equal_up_to_ties(plain, vegas)


def test_vllm_v2_sampling_smoke(plain_v2, monkeypatch):
    from vllm import SamplingParams

    prompts, _, _ = plain_v2
    sp = SamplingParams(temperature=0.8, max_tokens=48, ignore_eos=True, seed=0, detokenize=False)
    out, stats = _vegas_v2(monkeypatch, "collect2", prompts, sp)
    assert all(len(o.outputs[0].token_ids) == 48 for o in out)
    assert stats["acceptance_length"] > 1.0, stats


def test_vllm_v2_generic_path_equals_plain(plain_v2, monkeypatch):
    """A selector without a fast path (registered by hand, engine core in this process) runs on
    the V2 runner through the generic path: greedy equals plain up to bf16 near-ties, τ > 1."""
    from vegas import plugins

    prompts, sp, plain = plain_v2
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker must see the hand registration
    plugins.register(_TestSelectorPlugin(), name="test_generic_selectors_v2")
    try:
        vegas, stats = _vegas_v2(monkeypatch, "test_sinks_topk", prompts, sp)
    finally:
        plugins.unregister("test_generic_selectors_v2")
    assert stats["runner"] == "v2" and stats["acceptance_length"] > 1.0, stats
    _assert_equal_up_to_ties(plain, vegas)
