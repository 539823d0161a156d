"""How many tokens a Vegas engine captures in CUDA graphs (pure Python; no vLLM import).

vLLM replays a CUDA graph only for batches up to its largest capture size; a larger batch runs
its forward eagerly, which for a small model on an H200 is host-bound (SmolLM2-135M: ~30 ms of
Python and launches against ~10 ms for a graph-replayed step;
``benchmarks/results/vllm_h200_2026-12-02_mixed_graphs/``). vLLM's default largest size,
``min(max_num_seqs x (γ + 1) x 2, 512)``, is sized for decoding one token per request: a Vegas
step verifies ``γ + 1`` tokens per request, so at γ = 4 a batch of 103 requests already exceeds
512 tokens, and a step that verifies every row and also prefills a prompt's short tail (open
batches, prefix-cached prompts) exceeds ``max_num_seqs x (γ + 1)``.

A Vegas engine therefore captures up to ``2 x (γ + 1) x max_num_seqs`` tokens (vLLM's own rule
without the 512 cap), at most :data:`MAX_CAPTURE_TOKENS` and never above
``max_num_batched_tokens``, unless the user set ``max_cudagraph_capture_size`` or
``cudagraph_capture_sizes`` (their choice stands). More sizes cost capture time at engine start
(about twice vLLM's at the cap) and a little graph memory.
"""

from __future__ import annotations

import logging

__all__ = ["MAX_CAPTURE_TOKENS", "VLLM_DEFAULT_CAP", "capture_limit", "widen_capture_sizes"]

logger = logging.getLogger("vegas.vllm")

#: the largest batch (tokens) a Vegas engine captures by default
MAX_CAPTURE_TOKENS = 2048
#: the cap of vLLM 0.24's default largest capture size
VLLM_DEFAULT_CAP = 512


def capture_limit(max_num_seqs: int, gamma: int, max_num_batched_tokens: int | None) -> int:
    """Largest batch (tokens) a Vegas engine captures: ``2 x (γ + 1) x max_num_seqs``, at most
    :data:`MAX_CAPTURE_TOKENS` and ``max_num_batched_tokens`` (when known)."""
    limit = min(2 * (gamma + 1) * max_num_seqs, MAX_CAPTURE_TOKENS)
    return min(limit, max_num_batched_tokens) if max_num_batched_tokens else limit


def widen_capture_sizes(vllm_config) -> int | None:
    """Before vLLM computes its capture sizes (``VllmConfig.__post_init__``): set
    ``compilation_config.max_cudagraph_capture_size`` of a Vegas engine to :func:`capture_limit`
    when the user set neither it nor ``cudagraph_capture_sizes``, CUDA graphs are on, and the
    limit exceeds vLLM's default cap. Returns the size set, else None (nothing changed)."""
    compilation = getattr(vllm_config, "compilation_config", None)
    model_config = getattr(vllm_config, "model_config", None)
    scheduler = getattr(vllm_config, "scheduler_config", None)
    spec = getattr(vllm_config, "speculative_config", None)
    if compilation is None or model_config is None or scheduler is None or spec is None:
        return None
    if getattr(model_config, "enforce_eager", False):
        return None
    if getattr(getattr(compilation, "cudagraph_mode", None), "name", "") == "NONE":
        return None
    if compilation.max_cudagraph_capture_size is not None or compilation.cudagraph_capture_sizes is not None:
        return None
    limit = capture_limit(int(scheduler.max_num_seqs), int(spec.num_speculative_tokens),
                          getattr(scheduler, "max_num_batched_tokens", None))
    if limit <= VLLM_DEFAULT_CAP:
        return None
    compilation.max_cudagraph_capture_size = limit
    logger.info("vegas: CUDA graphs captured up to %d tokens (vLLM's default stops at %d; a Vegas step verifies "
                "γ + 1 = %d tokens per request); set max_cudagraph_capture_size to choose", limit, VLLM_DEFAULT_CAP,
                int(spec.num_speculative_tokens) + 1)
    return limit
