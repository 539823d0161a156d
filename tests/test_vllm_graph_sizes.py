"""Capture sizes of a Vegas engine (vegas.vllm_plugin.graph_sizes): pure Python, no vLLM."""

from types import SimpleNamespace

import pytest

from vegas.vllm_plugin.graph_sizes import MAX_CAPTURE_TOKENS, capture_limit, widen_capture_sizes


def config(max_num_seqs=64, gamma=4, batched=8192, eager=False, mode=None, max_size=None, sizes=None):
    return SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=eager),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=batched),
        speculative_config=SimpleNamespace(num_speculative_tokens=gamma),
        compilation_config=SimpleNamespace(cudagraph_mode=mode, max_cudagraph_capture_size=max_size,
                                           cudagraph_capture_sizes=sizes),
    )


@pytest.mark.parametrize("seqs, gamma, batched, expected", [
    (32, 4, 8192, 320),  # a verification batch (160) plus a prompt tail fits
    (64, 4, 8192, 640),  # vllm bench serve's --max-num-seqs 64: vLLM's default would stop at 512
    (128, 4, 8192, 1280),
    (1024, 4, 8192, MAX_CAPTURE_TOKENS),
    (1024, 4, 1024, 1024),  # never above max_num_batched_tokens
    (16, 2, None, 96),
])
def test_capture_limit(seqs, gamma, batched, expected):
    assert capture_limit(seqs, gamma, batched) == expected


def test_widened_when_the_user_chose_nothing():
    cfg = config(max_num_seqs=128)
    assert widen_capture_sizes(cfg) == 1280
    assert cfg.compilation_config.max_cudagraph_capture_size == 1280


@pytest.mark.parametrize("kw", [
    dict(max_size=256),  # the user's largest size stands
    dict(sizes=[1, 2, 4]),  # the user's sizes stand
    dict(eager=True),  # no graphs at all
    dict(mode=SimpleNamespace(name="NONE")),
    dict(max_num_seqs=32),  # 320 <= vLLM's own cap: vLLM's default already covers it
])
def test_left_alone(kw):
    cfg = config(**kw)
    before = vars(cfg.compilation_config).copy()
    assert widen_capture_sizes(cfg) is None
    assert vars(cfg.compilation_config) == before


def test_engine_without_speculation_is_left_alone():
    cfg = config(max_num_seqs=256)
    cfg.speculative_config = None
    assert widen_capture_sizes(cfg) is None
