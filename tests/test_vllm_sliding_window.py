"""The vLLM backend refuses, by name and before it builds a Vegas engine, a model whose every
layer attends a sliding window, and lets through models that mix sliding-window and
full-attention layers (CPU, no vLLM: tiny config directories, read with transformers'
AutoConfig)."""

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


def test_an_all_sliding_window_model_is_refused_by_name(tmp_path):
    model = _model_dir(tmp_path, "mistral-like", model_type="mistral", sliding_window=4096)
    with pytest.raises(VegasConfigError) as err:
        vllm_backend.raise_if_only_sliding_window(model)
    msg = str(err.value)
    assert repr(model) in msg and "all 6 of its layers" in msg and "window 4096" in msg
    assert "--selector none" in msg and "backend='hf'" in msg


@pytest.mark.parametrize(
    "name,config,layers",
    [
        ("gemma3-like", {"model_type": "gemma3_text", "sliding_window": 512, "layer_types": [
            "sliding_attention"] * 5 + ["full_attention"]}, [0, 1, 2, 3, 4]),
        ("gemma2-like", {"model_type": "gemma2", "sliding_window": 4096}, [0, 2, 4]),
        ("qwen2-windowed", {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 256,
                            "max_window_layers": 4}, [4, 5]),
        ("llama", {"model_type": "llama", "num_key_value_heads": 2}, []),
        ("qwen2-off", {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 4096}, []),
        ("mistral-full", {"model_type": "mistral", "sliding_window": None}, []),
        ("qwen3", {"model_type": "qwen3", "layer_types": ["full_attention"] * 6}, []),
    ],
)
def test_models_with_a_full_attention_layer_pass(tmp_path, name, config, layers):
    """Mixed models (their sliding-window layers draft over their own window) and full-attention
    models run; the sliding-window layers are read from the config as vLLM builds them."""
    from transformers import AutoConfig

    model = _model_dir(tmp_path, name, **config)
    vllm_backend.raise_if_only_sliding_window(model)
    assert vllm_backend.sliding_window_layers(AutoConfig.from_pretrained(model)) == layers


@pytest.mark.parametrize(
    "name,config,max_model_len,refused",
    [
        # vLLM windows every layer of a config that sets sliding_window without interleaved layer_types
        ("gemma2-all-full", {"model_type": "gemma2", "sliding_window": 256, "max_position_embeddings": 8192,
                             "layer_types": ["full_attention"] * 6}, None, True),
        ("phi3-4k", {"model_type": "phi3", "sliding_window": 2047, "max_position_embeddings": 4096}, None, True),
        # a window as long as the context drops no key: every layer attends everything
        ("gemma2-long-window", {"model_type": "gemma2", "sliding_window": 8192, "max_position_embeddings": 8192,
                                "layer_types": ["full_attention"] * 6}, None, False),
        ("phi3-128k", {"model_type": "phi3", "sliding_window": 262144, "max_position_embeddings": 131072},
         None, False),
        ("mistral-short-engine", {"model_type": "mistral", "sliding_window": 4096}, 4096, False),
        ("mistral-long-engine", {"model_type": "mistral", "sliding_window": 4096}, 4097, True),
    ],
)
def test_windows_are_read_as_vllm_builds_them_and_a_window_covering_the_context_is_full(
        tmp_path, name, config, max_model_len, refused):
    model = _model_dir(tmp_path, name, **config)
    if refused:
        with pytest.raises(VegasConfigError, match="in all 6 of its layers"):
            vllm_backend.raise_if_only_sliding_window(model, max_model_len)
    else:
        vllm_backend.raise_if_only_sliding_window(model, max_model_len)


def test_an_unreadable_config_is_left_to_vllm(tmp_path):
    vllm_backend.raise_if_only_sliding_window(str(tmp_path / "missing"))  # no config.json: vLLM names it


def test_backend_refuses_before_building_an_engine(tmp_path, monkeypatch):
    """A Vegas generate on an all-sliding-window model raises before vLLM is imported (it is not
    installed here); plain decoding of the same model is not refused."""
    monkeypatch.setattr(vllm_backend, "_raise_if_unavailable", lambda: None)
    built = []
    monkeypatch.setattr(vllm_backend.VLLMBackend, "_engine", lambda self, *a: built.append(a))
    backend = vllm_backend.VLLMBackend(_model_dir(tmp_path, "mistral", model_type="mistral", sliding_window=64),
                                       dtype="bfloat16")
    with pytest.raises(VegasConfigError, match="backend='hf'"):
        backend.generate([[1, 2, 3]], max_new_tokens=4, sampling=SamplingParams(), selector="collect2",
                         config=VegasConfig())
    assert built == []
    if importlib.util.find_spec("vllm") is None:  # plain decoding gets past the check (to vLLM's import)
        with pytest.raises(ImportError):
            backend.generate([[1, 2, 3]], max_new_tokens=4, sampling=SamplingParams(), selector=None,
                             config=VegasConfig())
