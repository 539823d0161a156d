"""The vLLM backend refuses sliding-window models by name before it builds a Vegas engine
(CPU, no vLLM: tiny config directories, read with transformers' AutoConfig)."""

from __future__ import annotations

import importlib.util
import json

import pytest

import vegas.backends.vllm as vllm_backend
from vegas.config import VegasConfig, VegasConfigError
from vegas.sampling import SamplingParams


def _model_dir(tmp_path, name, **config):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": 6, "hidden_size": 64,
                                               "num_attention_heads": 4, **config}))
    return str(d)


@pytest.mark.parametrize(
    "name,config,layers",
    [
        ("gemma3-like", {"model_type": "gemma3_text", "sliding_window": 512, "layer_types": [
            "sliding_attention"] * 5 + ["full_attention"]}, "in 5 of its 6 layers (0-4)"),
        ("gemma2-like", {"model_type": "gemma2", "sliding_window": 4096}, "in 3 of its 6 layers (0, 2, 4)"),
        ("mistral-like", {"model_type": "mistral", "sliding_window": 4096}, "in 6 of its 6 layers (0-5)"),
        ("qwen2-windowed", {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 256,
                            "max_window_layers": 4}, "in 2 of its 6 layers (4-5)"),
    ],
)
def test_sliding_window_models_are_refused_by_name(tmp_path, name, config, layers):
    model = _model_dir(tmp_path, name, **config)
    with pytest.raises(VegasConfigError) as err:
        vllm_backend.raise_if_sliding_window(model)
    msg = str(err.value)
    assert repr(model) in msg and layers in msg and "backend='hf'" in msg and "sliding-window" in msg


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "llama", "num_key_value_heads": 2},
        {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 4096},
        {"model_type": "mistral", "sliding_window": None},
        {"model_type": "qwen3", "layer_types": ["full_attention"] * 6},
    ],
)
def test_full_attention_models_pass(tmp_path, config):
    vllm_backend.raise_if_sliding_window(_model_dir(tmp_path, "m", **config))


def test_an_unreadable_config_is_left_to_vllm(tmp_path):
    vllm_backend.raise_if_sliding_window(str(tmp_path / "missing"))  # no config.json: vLLM names it


def test_backend_refuses_before_building_an_engine(tmp_path, monkeypatch):
    """A Vegas generate on a sliding-window model raises before vLLM is imported (it is not
    installed here); plain decoding of the same model is not refused."""
    monkeypatch.setattr(vllm_backend, "_raise_if_unavailable", lambda: None)
    built = []
    monkeypatch.setattr(vllm_backend.VLLMBackend, "_engine", lambda self, *a: built.append(a))
    backend = vllm_backend.VLLMBackend(_model_dir(tmp_path, "gemma2", model_type="gemma2", sliding_window=64),
                                       dtype="bfloat16")
    with pytest.raises(VegasConfigError, match="Use backend='hf'"):
        backend.generate([[1, 2, 3]], max_new_tokens=4, sampling=SamplingParams(), selector="collect2",
                         config=VegasConfig())
    assert built == []
    if importlib.util.find_spec("vllm") is None:  # plain decoding gets past the check (to vLLM's import)
        with pytest.raises(ImportError):
            backend.generate([[1, 2, 3]], max_new_tokens=4, sampling=SamplingParams(), selector=None,
                             config=VegasConfig())
