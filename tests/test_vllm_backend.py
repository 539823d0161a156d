"""vLLM backend on the CPU (no vLLM needed): engine arguments, settings, refusals, and the
selection path ``configure()`` builds for any registered selector. The CUDA runs are in
``tests/gpu/test_vllm_backend_cuda.py``."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from vegas.backends.vllm import VLLMBackend, verify_cuda_graphs, vllm_engine_kwargs
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


def test_the_public_class_path_names_the_v1_proposer():
    """``speculative_config["model"]`` stays ``vegas.vllm_plugin.proposer.VegasProposer``, the
    path users write; it resolves (as vLLM resolves it) to the V1 proposer in ``runners.v1``."""
    import importlib

    from vegas.vllm_plugin.runners.v1 import VegasProposer

    assert CLASS_PATH == "vegas.vllm_plugin.proposer.VegasProposer"
    module, _, name = CLASS_PATH.rpartition(".")
    assert getattr(importlib.import_module(module), name) is VegasProposer


class _OwnExtension:  # a worker extension that is not Vegas's
    pass


def test_vegas_engines_get_the_worker_extension_and_no_insecure_serialization(monkeypatch):
    from pathlib import Path

    from vegas.vllm_plugin import WORKER_EXTENSION, VegasWorkerExtension

    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    assert "worker_extension_cls" not in vllm_engine_kwargs("m")
    assert vllm_engine_kwargs("m", num_draft_tokens=3)["worker_extension_cls"] == WORKER_EXTENSION
    with pytest.raises(VegasConfigError, match="make your class a subclass of it"):
        vllm_engine_kwargs("m", num_draft_tokens=3, worker_extension_cls=f"{__name__}._OwnExtension")
    with pytest.raises(VegasConfigError, match="cannot be imported"):
        vllm_engine_kwargs("m", num_draft_tokens=3, worker_extension_cls="no_such_module.Ext")
    # the methods vLLM mixes into its worker reach the drafter of that worker
    seen = {}

    class Drafter:
        def stats(self):
            return {"drafted": 3}

        def reset_stats(self):
            seen["reset"] = True

    worker = type("Worker", (VegasWorkerExtension,), {})()
    worker.model_runner = type("Runner", (), {"speculator": Drafter()})()
    assert worker.vegas_stats() == {"drafted": 3}
    worker.vegas_configure(None, True)  # no settings: only the counters are reset
    assert seen == {"reset": True}
    root = Path(__file__).resolve().parent.parent / "vegas"
    assert not [p for p in root.rglob("*.py") if "INSECURE_SERIALIZATION" in p.read_text()]


def test_piecewise_verification_graphs_on_request():
    kw = vllm_engine_kwargs("m", num_draft_tokens=3, verify_cuda_graphs="piecewise",
                            compilation_config={"cudagraph_capture_sizes": [1, 2]})
    assert kw["compilation_config"] == {"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 2]}
    with pytest.raises(VegasConfigError, match="vllm.verify_cuda_graphs must be one of 'full', 'piecewise'"):
        VegasConfig(vllm={"verify_cuda_graphs": "fast"})
    piecewise = VegasConfig(vllm={"verify_cuda_graphs": "piecewise"})
    assert verify_cuda_graphs(create_selector("collect2", VegasConfig()), VegasConfig()) == "full"
    assert verify_cuda_graphs(create_selector("collect2", piecewise), piecewise) == "piecewise"


def test_engine_args_come_from_the_backend_only(monkeypatch):
    import vegas.backends.vllm as backend

    monkeypatch.setattr(backend, "_raise_if_unavailable", lambda: None)  # as on a GPU machine
    monkeypatch.setenv("VEGAS_VLLM_ENGINE_ARGS", '{"max_model_len": 2048}')  # the removed channel: ignored
    assert VLLMBackend("m", engine_args={"max_model_len": 4096}).engine_args == {"max_model_len": 4096}
    with pytest.raises(VegasConfigError, match="engine_args must be a dict"):
        VLLMBackend("m", engine_args=[("max_model_len", 1)])


def _worker_with_state(state, runner_attr="drafter"):
    """A vLLM worker whose model runner holds a Vegas drafter (V1: ``drafter``, V2:
    ``speculator``) that owns ``state``."""
    from types import SimpleNamespace

    return SimpleNamespace(model_runner=SimpleNamespace(**{runner_attr: SimpleNamespace(state=state)}))


def test_configure_refuses_a_new_selector_under_full_graphs():
    from vegas.vllm_plugin import configure
    from vegas.vllm_plugin.selection.state import SelectionState

    same = settings_json("collect2", VegasConfig())
    state = SelectionState(settings=same, gamma=4, frozen=True)
    worker = _worker_with_state(state)
    assert configure(worker, same, reset_stats=False) == same
    with pytest.raises(VegasConfigError, match="full CUDA graphs"):
        configure(worker, settings_json("sliding_window", VegasConfig()), reset_stats=False)
    assert state.settings == same


def test_configure_changes_the_state_of_the_workers_own_drafter():
    """Each worker's drafter owns its selection state: configure() changes that one, and a
    worker without a Vegas drafter has none to change."""
    from vegas.vllm_plugin import configure
    from vegas.vllm_plugin.selection.state import SelectionState

    v1, v2 = SelectionState(gamma=4), SelectionState(gamma=4)
    settings = settings_json("sliding_window", VegasConfig())
    assert configure(_worker_with_state(v2, "speculator"), settings, reset_stats=False) == settings
    assert v2.settings == settings and v1.settings == "" and v1.path is None
    assert configure(object(), None, reset_stats=False) == ""
    with pytest.raises(VegasConfigError, match="Vegas drafter"):
        configure(object(), settings, reset_stats=False)


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
        ("quest", VegasConfig(page_size=32), "page_size must be the engine's block_size 16"),
        ("collect2", VegasConfig(granularity="kv_head"), "granularity"),
        ("collect2", VegasConfig(score_mode="weight"), "score_mode"),
    ],
)
def test_unsupported_settings_are_named(selector, config, match):
    with pytest.raises(VegasConfigError, match=match):
        raise_if_unsupported(create_selector(selector, config), config, block_size=16)


def test_quest_pages_follow_the_engines_block_size():
    config = VegasConfig(page_size=32)
    raise_if_unsupported(create_selector("quest", config), config, block_size=32)
    raise_if_unsupported(create_selector("quest", config), config)  # block size not known yet: the proposer checks
    with pytest.raises(VegasConfigError, match="block_size 16, got 32"):
        raise_if_unsupported(create_selector("quest", config), config, block_size=16)


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


def test_configure_builds_the_path_of_any_registered_selector():
    """Under piecewise verification graphs configure() switches to any registered selector: a
    built-in gets its fast path, a selector without one the generic path."""
    from vegas import plugins
    from vegas.vllm_plugin import configure
    from vegas.vllm_plugin.selectors import ScoreTopKFastPath
    from vegas.vllm_plugin.selectors.generic import GenericPath
    from vegas.vllm_plugin.selection.state import SelectionState

    state = SelectionState(gamma=4)
    worker = _worker_with_state(state)
    plugins.register(_TestSelectorPlugin(), name="test_generic_selectors")
    try:
        settings = settings_json("test_sinks_topk", VegasConfig(kv_budget=32))
        assert configure(worker, settings, reset_stats=False) == settings
        assert isinstance(state.path, GenericPath) and state.path.selector.config.kv_budget == 32
        configure(worker, settings_json("last_token", VegasConfig()), reset_stats=False)
        assert isinstance(state.path, ScoreTopKFastPath) and state.path.row_table.width == 1
    finally:
        plugins.unregister("test_generic_selectors")


def test_batch_counts_of_the_v2_runner_give_each_request_the_batch_tau():
    from vegas.backends.vllm import share_batch_iterations

    # one request: 1 prefill token, 30 iterations emitting 120 tokens, 7 plain steps -> 37 iterations
    assert share_batch_iterations(30, 120, [128]) == [37]
    # requests share the batch's steps by their decoded tokens; an empty output gets none
    assert share_batch_iterations(30, 120, [64, 64, 0]) == [18, 18, 0]
    # uneven shares add up to the batch's steps (largest remainder): the batch's τ is exact
    for iterations, emitted, generated in ((43, 126, [64, 64]), (21, 62, [32, 32]), (50, 110, [90, 7, 33, 1])):
        shares = share_batch_iterations(iterations, emitted, generated)
        steps = iterations + sum(g - 1 for g in generated if g) - emitted
        assert sum(shares) == steps, (shares, steps)
    assert share_batch_iterations(0, 0, [1, 1]) == [0, 0]  # prefill tokens only: no decode step
    assert share_batch_iterations(0, 0, [0]) == [0]
    # plain steps only (every step skipped drafting): one token per step after the first
    assert share_batch_iterations(0, 0, [10]) == [9]
