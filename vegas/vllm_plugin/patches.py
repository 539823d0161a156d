"""Every monkey-patch Vegas applies to vLLM, written against vLLM 0.24.0.

Each ``patch_*`` function names the vLLM function it replaces; each is idempotent (the
replacement carries ``_vegas = True``) and leaves engines without the Vegas proposer as they
were. Nothing here imports vLLM at module import time.

- :func:`patch_attention`: ``FlashAttentionImpl.forward`` (draft calls and the selection hook);
- :func:`patch_scheduler_lookahead`: ``Scheduler.__init__`` (KV slots for γ lookahead tokens);
- :func:`patch_draft_probs_gather`: ``GPUModelRunner._get_spec_decode_draft_probs``;
- :func:`patch_config_check`: ``VllmConfig.__post_init__`` (async scheduling stays on);
- :func:`patch_bookkeeping`: ``GPUModelRunner._bookkeeping_sync`` (publish before bookkeeping);
- :func:`patch_draft_graph_capture`: ``GPUModelRunner.capture_model`` (draft graphs at engine start);
- :func:`time_runner_forward`: one runner's ``_model_forward`` (CUDA events around it);
- :func:`patch_v2_runner`: ``VllmConfig._get_v2_model_runner_unsupported_features`` and
  ``vllm.v1.worker.gpu.spec_decode.init_speculator`` (the Vegas speculator on the V2 model
  runner, :mod:`vegas.vllm_plugin.v2_speculator`).

Which runner serves a Vegas engine (:func:`v2_opted_in`):

- by default, the runner vLLM picks for the same engine without Vegas: the V2 runner for the
  architectures vLLM runs there by default (Llama, Qwen3, ...; plain vLLM runs on it too, so
  Vegas and plain share the host path), V1 (:class:`~vegas.vllm_plugin.proposer.VegasProposer`)
  where vLLM falls back to V1 for other reasons. Measured on an H200 with SmolLM2-135M
  (``benchmarks/results/vllm_h200_2026-12-01_profile/``): 64 fresh 6,000-token prompts at once,
  V2 1.04x plain vLLM's output throughput, V1 0.76x;
- ``VEGAS_V2_RUNNER=0`` or ``VLLM_USE_V2_MODEL_RUNNER=0``: the V1 runner.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable

import torch

from .async_sched import is_vegas_proposer, wants_async

__all__ = [
    "V2_ENV",
    "VLLM_VERSION",
    "VllmVersionError",
    "patch_attention",
    "patch_bookkeeping",
    "patch_config_check",
    "patch_draft_graph_capture",
    "patch_draft_probs_gather",
    "patch_scheduler_lookahead",
    "patch_v2_init_speculator",
    "patch_v2_runner",
    "patch_v2_unsupported_check",
    "stacked_draft_probs",
    "time_runner_forward",
    "v2_opted_in",
]

logger = logging.getLogger("vegas.vllm")

#: the vLLM release these patches were written against
VLLM_VERSION = "0.24.0"


def patch_attention() -> None:
    """Replace ``vllm.v1.attention.backends.flash_attn.FlashAttentionImpl.forward`` (vLLM 0.24.0).

    A call whose metadata is a :class:`~vegas.vllm_plugin.attention.DraftMetadata` runs the
    draft attention over the page-size-1 view (:func:`vegas.vllm_plugin.attention.draft_attention`);
    every other call with metadata (prefill, verification) runs vLLM's FA3 call, then the
    selection hook :meth:`vegas.vllm_plugin.state.SelectionState.on_layer`, unless
    :meth:`~vegas.vllm_plugin.state.SelectionState.verify_layer` ran the layer through FA3 with
    the score output (the optional ``_vegas_fa3_C`` extension, :mod:`vegas.vllm_plugin.fa3_verify`).
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
        if (
            STATE.enabled
            and attn_metadata is not None
            and kv_cache.numel() > 0
            and STATE.verify_layer(self, layer_index(layer.layer_name), query, kv_cache, attn_metadata, output)
        ):
            return output  # FA3 with the score output ran instead (vegas.vllm_plugin.fa3_verify)
        out = original(
            self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
        )
        if STATE.enabled and attn_metadata is not None and kv_cache.numel() > 0:
            STATE.on_layer(
                layer_index(layer.layer_name), query, kv_cache, attn_metadata, self.scale, self.logits_soft_cap
            )
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


def patch_draft_graph_capture() -> None:
    """Wrap ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.capture_model`` (vLLM 0.24.0, V1
    runner): after vLLM captured its graphs, a drafter with ``capture_draft_graphs`` (the Vegas
    proposer) captures its draft graphs, and their memory is added to what ``capture_model``
    reports. Without it the V1 proposer captured them lazily, inside the first requests' steps
    (0.1-0.3 s each; three in the first serving run of
    ``benchmarks/results/vllm_h200_2026-12-01_profile/``)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.capture_model
    if getattr(original, "_vegas", False):
        return

    def capture_model(self):
        graph_bytes = original(self)
        capture = getattr(getattr(self, "drafter", None), "capture_draft_graphs", None)
        if capture is None:
            return graph_bytes
        free_before = torch.cuda.mem_get_info()[0]
        captured = capture()
        torch.cuda.synchronize()
        used = max(free_before - torch.cuda.mem_get_info()[0], 0)
        logger.info("vegas: captured %d draft graphs at engine start (%.2f GiB)", captured, used / 2**30)
        return (graph_bytes or 0) + used

    capture_model._vegas = True  # type: ignore[attr-defined]
    GPUModelRunner.capture_model = capture_model


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


# ---- the V2 model runner (the default where vLLM picks it) -------------------------------------------------------

#: ``0``: keep a Vegas engine on the V1 runner (default: the runner vLLM picks, V2 where it can)
V2_ENV = "VEGAS_V2_RUNNER"
_V2_UNSUPPORTED = "speculative method 'custom_class'"
_logged: set[str] = set()


class VllmVersionError(RuntimeError):
    """A vLLM function that Vegas patches is not what vLLM 0.24.0 had."""


def _log_once(key: str, msg: str, *args, level: int = logging.INFO) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.log(level, msg, *args)


def _falsy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("0", "false", "no")


def v2_opted_in() -> bool:
    """Whether a Vegas engine may run on the V2 runner: yes unless ``VEGAS_V2_RUNNER=0`` or
    ``VLLM_USE_V2_MODEL_RUNNER=0`` in this process's environment (read at each call)."""
    return not (_falsy(os.environ.get("VLLM_USE_V2_MODEL_RUNNER")) or _falsy(os.environ.get(V2_ENV)))


def _check_params(func, expected: tuple[str, ...], name: str) -> None:
    """Raise :class:`VllmVersionError` unless ``func`` is callable with exactly these parameters."""
    if not callable(func):
        raise VllmVersionError(f"vegas: {name} is missing; the V2 patches target vLLM {VLLM_VERSION}")
    params = tuple(inspect.signature(func).parameters)
    if params != expected:
        raise VllmVersionError(
            f"vegas: {name} has parameters {params}, expected {expected} as in vLLM {VLLM_VERSION}; "
            "the Vegas V2 patches need updating (or run V1: VLLM_USE_V2_MODEL_RUNNER=0)"
        )


def patch_v2_unsupported_check() -> None:
    """Replace ``vllm.config.VllmConfig._get_v2_model_runner_unsupported_features`` (vLLM 0.24.0)
    with a wrapper that drops ``"speculative method 'custom_class'"`` for a Vegas engine when
    :func:`v2_opted_in`; every other engine and every other entry is unchanged. Idempotent.

    Why: vLLM 0.24.0 lists every speculative method but eagle/eagle3/mtp/dflash as unsupported
    by the V2 runner, so it would refuse (``VLLM_USE_V2_MODEL_RUNNER=1``) or skip V2.

    Raises:
        VllmVersionError: if the method is missing or no longer takes ``(self)``.
    """
    from vllm.config import VllmConfig

    name = "VllmConfig._get_v2_model_runner_unsupported_features"
    original = getattr(VllmConfig, "_get_v2_model_runner_unsupported_features", None)
    if getattr(original, "_vegas", False):
        return
    _check_params(original, ("self",), name)

    def _get_v2_model_runner_unsupported_features(self) -> list[str]:
        unsupported = original(self)
        if not is_vegas_proposer(self.speculative_config):
            return unsupported
        if not v2_opted_in():
            _log_once("v1", "vegas: V1 model runner (asked for with %s=0 or VLLM_USE_V2_MODEL_RUNNER=0)", V2_ENV)
            return unsupported
        kept = [u for u in unsupported if u != _V2_UNSUPPORTED]
        if kept:
            _log_once("v2-blocked", "vegas: V2 model runner asked for, but vLLM does not support %s here",
                      ", ".join(kept))
        else:
            _log_once("v2", "vegas: V2 model runner allowed for the Vegas speculator")
        return kept

    _get_v2_model_runner_unsupported_features._vegas = True  # type: ignore[attr-defined]
    VllmConfig._get_v2_model_runner_unsupported_features = _get_v2_model_runner_unsupported_features


def patch_v2_init_speculator(build: Callable) -> None:
    """Replace ``vllm.v1.worker.gpu.spec_decode.init_speculator`` (vLLM 0.24.0) with a wrapper
    that returns ``build(vllm_config, device)`` for a Vegas engine (the caller's builder of
    :class:`~vegas.vllm_plugin.v2_speculator.VegasSpeculator`: this module does not import the
    speculator, which imports the proposer) and calls vLLM's function otherwise. Idempotent.

    The V2 runner module imports the function by name (``from vllm.v1.worker.gpu.spec_decode
    import init_speculator``) and calls it in ``GPUModelRunner.__init__``: the package attribute
    is patched before that import, and ``vllm.v1.worker.gpu.model_runner.init_speculator`` too
    when the runner module is already imported (it is not imported here: it is heavy).

    Why: vLLM's ``init_speculator`` is a fixed if-chain (dflash, gemma4 MTP, mtp, eagle) that
    raises ``NotImplementedError`` for ``custom_class``; it has no registry.

    Raises:
        VllmVersionError: if the function is missing, no longer takes ``(vllm_config, device)``,
            or the V2 runner module no longer imports and calls it.
    """
    import importlib.util
    import sys

    from vllm.v1.worker.gpu import spec_decode

    name = "vllm.v1.worker.gpu.spec_decode.init_speculator"
    original = getattr(spec_decode, "init_speculator", None)
    if getattr(original, "_vegas", False):
        return
    _check_params(original, ("vllm_config", "device"), name)
    try:
        spec = importlib.util.find_spec("vllm.v1.worker.gpu.model_runner")
        with open(spec.origin, encoding="utf-8") as f:  # type: ignore[union-attr]
            src = f.read()
    except (ImportError, ValueError, AttributeError, TypeError, OSError):  # no source: trust the signature
        src = None
    if src is not None and not (
        "from vllm.v1.worker.gpu.spec_decode import init_speculator" in src and "init_speculator(" in src
    ):
        raise VllmVersionError(
            f"vegas: vllm/v1/worker/gpu/model_runner.py no longer imports and calls {name} "
            f"(as vLLM {VLLM_VERSION} did); the Vegas V2 patches need updating "
            "(or run V1: VLLM_USE_V2_MODEL_RUNNER=0)"
        )

    def init_speculator(vllm_config, device):
        if not is_vegas_proposer(vllm_config.speculative_config):
            return original(vllm_config, device)
        return build(vllm_config, device)

    init_speculator._vegas = True  # type: ignore[attr-defined]
    spec_decode.init_speculator = init_speculator
    runner_mod = sys.modules.get("vllm.v1.worker.gpu.model_runner")
    if runner_mod is not None:
        runner_mod.init_speculator = init_speculator


def patch_v2_runner(build: Callable) -> None:
    """Both V2 patches (idempotent; ``build``: see :func:`patch_v2_init_speculator`); warns once
    if vLLM is not 0.24.0."""
    import vllm

    version = getattr(vllm, "__version__", "?")
    if not str(version).startswith(VLLM_VERSION):
        _log_once("version", "vegas: the V2 patches were written for vLLM %s, found %s", VLLM_VERSION, version,
                  level=logging.WARNING)
    patch_v2_unsupported_check()
    patch_v2_init_speculator(build)
