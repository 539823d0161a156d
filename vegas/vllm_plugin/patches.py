"""Every monkey-patch Vegas applies to vLLM, written against vLLM 0.24.0.

Each ``patch_*`` function names the vLLM function it replaces; each is idempotent (the
replacement carries ``_vegas = True``) and leaves engines without the Vegas proposer as they
were. Nothing here imports vLLM at module import time.

- :func:`patch_attention`: ``FlashAttentionImpl.forward`` (draft calls and the selection hook);
- :func:`patch_scheduler_lookahead`: ``Scheduler.__init__`` (KV slots for γ lookahead tokens);
- :func:`patch_draft_probs_gather`: ``GPUModelRunner._get_spec_decode_draft_probs``;
- :func:`patch_config_check`: ``VllmConfig.__post_init__`` (async scheduling stays on);
- :func:`patch_bookkeeping`: ``GPUModelRunner._bookkeeping_sync`` (publish before bookkeeping);
- :func:`time_runner_forward`: one runner's ``_model_forward`` (CUDA events around it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from .async_sched import is_vegas_proposer, wants_async

__all__ = [
    "VLLM_VERSION",
    "patch_attention",
    "patch_bookkeeping",
    "patch_config_check",
    "patch_draft_probs_gather",
    "patch_scheduler_lookahead",
    "stacked_draft_probs",
    "time_runner_forward",
]

logger = logging.getLogger("vegas.vllm")

#: the vLLM release these patches were written against
VLLM_VERSION = "0.24.0"


def patch_attention() -> None:
    """Replace ``vllm.v1.attention.backends.flash_attn.FlashAttentionImpl.forward`` (vLLM 0.24.0).

    A call whose metadata is a :class:`~vegas.vllm_plugin.attention.DraftMetadata` runs the
    draft attention over the page-size-1 view (:func:`vegas.vllm_plugin.attention.draft_attention`);
    every other call with metadata (prefill, verification) runs vLLM's FA3 call, then the
    selection hook :meth:`vegas.vllm_plugin.state.SelectionState.on_layer`.
    """
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    from .attention import DraftMetadata, draft_attention, layer_index
    from .state import STATE

    original = FlashAttentionImpl.forward
    if getattr(original, "_vegas", False):
        return

    def forward(
        self,
        layer,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        output,
        output_scale=None,
        output_block_scale=None,
    ):
        if isinstance(attn_metadata, dict):  # pragma: no cover - defensive
            attn_metadata = attn_metadata.get(layer.layer_name)
        if isinstance(attn_metadata, DraftMetadata):
            return draft_attention(self, layer, query, kv_cache, attn_metadata, output)
        out = original(
            self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
        )
        if STATE.enabled and attn_metadata is not None and kv_cache.numel() > 0:
            STATE.on_layer(layer_index(layer.layer_name), query, kv_cache, attn_metadata, self.scale)
        return out

    forward._vegas = True  # type: ignore[attr-defined]
    FlashAttentionImpl.forward = forward


def patch_scheduler_lookahead() -> None:
    """Wrap ``vllm.v1.core.sched.scheduler.Scheduler.__init__`` (vLLM 0.24.0) so that the
    scheduler allocates KV slots for γ lookahead tokens (as for EAGLE): the draft tokens' KV
    entries land in blocks the request owns."""
    from vllm.v1.core.sched import scheduler as sched_mod

    cls = sched_mod.Scheduler
    if getattr(cls.__init__, "_vegas", False):
        return
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if is_vegas_proposer(self.vllm_config.speculative_config):
            self.num_lookahead_tokens = max(self.num_lookahead_tokens, self.num_spec_tokens)

    __init__._vegas = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


def stacked_draft_probs(probs, prob_req_ids, req_ids, num_draft_tokens):
    """vLLM's per-request gather of draft probabilities, without the per-request loop.

    vLLM's ``GPUModelRunner._get_spec_decode_draft_probs`` slices ``probs[row, :num_draft]``
    for every request with drafts and concatenates them (one indexing op per request: about
    1 ms of host time per step at batch 128). When the batch holds the proposer's requests in
    the proposer's order and every request carries all γ drafts, that concatenation is
    ``probs[:n].reshape(n * γ, vocab)``, a view.

    Args:
        probs: ``(rows, γ, vocab)`` float32 draft probabilities, row ``i`` for ``prob_req_ids[i]``.
        prob_req_ids: request ids of the proposal.
        req_ids: request ids of the batch being verified, in batch order.
        num_draft_tokens: drafts per request of that batch.

    Returns:
        ``(n * γ, vocab)`` float32, or None when the fast path does not apply (the caller
        then runs vLLM's loop).
    """
    n = len(num_draft_tokens)
    gamma = probs.shape[1]
    if n == 0 or n > probs.shape[0] or len(prob_req_ids) < n or len(req_ids) < n:
        return None
    if any(k != gamma for k in num_draft_tokens) or list(req_ids[:n]) != list(prob_req_ids[:n]):
        return None
    return probs[:n].reshape(n * gamma, probs.shape[2])


def patch_draft_probs_gather() -> None:
    """Route ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._get_spec_decode_draft_probs``
    (vLLM 0.24.0) through :func:`stacked_draft_probs` (falls back to vLLM's loop)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._get_spec_decode_draft_probs
    if getattr(original, "_vegas", False):
        return

    def _get_spec_decode_draft_probs(self, spec_decode_metadata):
        probs, ids = self._draft_probs, self._draft_prob_req_ids
        if probs is not None and ids is not None and probs.dim() == 3:
            fast = stacked_draft_probs(probs, ids, self.input_batch.req_ids, spec_decode_metadata.num_draft_tokens)
            if fast is not None:
                return fast
        return original(self, spec_decode_metadata)

    _get_spec_decode_draft_probs._vegas = True  # type: ignore[attr-defined]
    GPUModelRunner._get_spec_decode_draft_probs = _get_spec_decode_draft_probs


def patch_config_check() -> None:
    """Wrap ``vllm.config.VllmConfig.__post_init__`` (vLLM 0.24.0) so that the Vegas proposer
    keeps async scheduling (:func:`vegas.vllm_plugin.async_sched.wants_async`); vLLM turns it
    off, or refuses it, for a ``custom_class`` proposer. Applies what vLLM applies with it (no
    cascade attention)."""
    from vllm.config import VllmConfig

    original = VllmConfig.__post_init__
    if getattr(original, "_vegas", False):
        return

    def __post_init__(self):
        want = wants_async(self)
        if want:  # vLLM would refuse (True) or switch off (None) async scheduling for custom_class
            self.scheduler_config.async_scheduling = False
        original(self)
        if not want:
            return
        from vllm.v1.executor.abstract import Executor

        if not Executor.get_class(self).supports_async_scheduling():
            logger.warning("vegas: the executor does not support async scheduling; running synchronously")
            return
        self.scheduler_config.async_scheduling = True
        if self.model_config is not None:  # as vLLM does for async speculative decoding
            self.model_config.disable_cascade_attn = True
        logger.info("vegas: asynchronous scheduling on (async_scheduling=False switches it off)")

    __post_init__._vegas = True  # type: ignore[attr-defined]
    VllmConfig.__post_init__ = __post_init__


def patch_bookkeeping() -> None:
    """Wrap ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._bookkeeping_sync`` (vLLM 0.24.0):
    under async scheduling, call the Vegas proposer's ``publish_sampled`` right before it (where
    vLLM's EAGLE path publishes the next tokens and valid counts in ``sample_tokens``)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._bookkeeping_sync
    if getattr(original, "_vegas", False):
        return

    def _bookkeeping_sync(self, scheduler_output, sampler_output, *args, **kwargs):
        publish = getattr(getattr(self, "drafter", None), "publish_sampled", None)
        if publish is not None and self.use_async_spec_decode:
            publish(scheduler_output, sampler_output.sampled_token_ids)
        return original(self, scheduler_output, sampler_output, *args, **kwargs)

    _bookkeeping_sync._vegas = True  # type: ignore[attr-defined]
    GPUModelRunner._bookkeeping_sync = _bookkeeping_sync


def time_runner_forward(runner, on_forward: Callable[[object, object], None]) -> None:
    """Wrap one ``GPUModelRunner._model_forward`` (vLLM 0.24.0, an instance attribute) with CUDA
    events: ``on_forward(start, end)`` gets each eager forward's events; skipped while a CUDA
    graph is being captured."""
    forward = runner._model_forward
    if getattr(forward, "_vegas", False):
        return

    def _model_forward(*args, **kwargs):
        if torch.cuda.is_current_stream_capturing():
            return forward(*args, **kwargs)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        out = forward(*args, **kwargs)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        on_forward(start, end)
        return out

    _model_forward._vegas = True  # type: ignore[attr-defined]
    runner._model_forward = _model_forward
