"""Patches that let the Vegas speculator run on vLLM 0.24.0's V2 model runner (opt-in).

Which runner serves a Vegas engine:

- ``VLLM_USE_V2_MODEL_RUNNER=1``: the V2 runner (vLLM's own switch; without the patch below
  vLLM would refuse the ``custom_class`` method);
- ``VEGAS_V2_RUNNER=1``: whatever vLLM picks by itself, which is V2 for its default
  architectures (Llama, Qwen3, ...) once Vegas's ``custom_class`` no longer counts as an
  unsupported feature;
- otherwise (the default) the V1 runner and :class:`~vegas.vllm_plugin.proposer.VegasProposer`,
  as before: vLLM keeps rejecting ``custom_class`` on V2 and falls back to V1 itself.

:func:`install` applies two patches (idempotent, from :func:`vegas.vllm_plugin.register`):

1. ``VllmConfig._get_v2_model_runner_unsupported_features`` drops ``"speculative method
   'custom_class'"`` for a Vegas engine that opted in (see above);
2. ``init_speculator`` (of ``vllm.v1.worker.gpu.spec_decode``, imported by name into
   ``vllm.v1.worker.gpu.model_runner``) builds
   :class:`~vegas.vllm_plugin.v2_speculator.VegasSpeculator` for Vegas and calls vLLM's own
   function otherwise.

Both check that the vLLM function they replace still has the shape they were written for and
raise :class:`VllmVersionError` (naming the function and vLLM 0.24.0) otherwise. Nothing here
imports vLLM at module import time.
"""

from __future__ import annotations

import inspect
import logging
import os

from .async_sched import _is_vegas

__all__ = ["V2_ENV", "VllmVersionError", "install", "v2_opted_in"]

logger = logging.getLogger("vegas.vllm")

#: ``1``: let vLLM pick the V2 runner for a Vegas engine where it would by default
V2_ENV = "VEGAS_V2_RUNNER"
#: the vLLM release these patches were written against
VLLM_VERSION = "0.24.0"
_UNSUPPORTED = "speculative method 'custom_class'"
_logged: set[str] = set()


class VllmVersionError(RuntimeError):
    """A vLLM function that Vegas patches is not what vLLM 0.24.0 had."""


def _log_once(key: str, msg: str, *args, level: int = logging.INFO) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.log(level, msg, *args)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes")


def v2_opted_in() -> bool:
    """Whether a Vegas engine may run on the V2 runner: ``VLLM_USE_V2_MODEL_RUNNER=1`` or
    ``VEGAS_V2_RUNNER=1`` in this process's environment (read at each call)."""
    return _truthy(os.environ.get("VLLM_USE_V2_MODEL_RUNNER")) or _truthy(os.environ.get(V2_ENV))


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


def patch_unsupported_check() -> None:
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
        if not _is_vegas(self.speculative_config):
            return unsupported
        if not v2_opted_in():
            _log_once("v1", "vegas: V1 model runner (default; VLLM_USE_V2_MODEL_RUNNER=1 or %s=1 for V2)", V2_ENV)
            return unsupported
        kept = [u for u in unsupported if u != _UNSUPPORTED]
        if kept:
            _log_once("v2-blocked", "vegas: V2 model runner asked for, but vLLM does not support %s here",
                      ", ".join(kept))
        else:
            _log_once("v2", "vegas: V2 model runner allowed for the Vegas speculator (opt-in)")
        return kept

    _get_v2_model_runner_unsupported_features._vegas = True  # type: ignore[attr-defined]
    VllmConfig._get_v2_model_runner_unsupported_features = _get_v2_model_runner_unsupported_features


def patch_init_speculator() -> None:
    """Replace ``init_speculator`` of ``vllm.v1.worker.gpu.spec_decode`` (vLLM 0.24.0) with a
    wrapper that returns :class:`~vegas.vllm_plugin.v2_speculator.VegasSpeculator` for a Vegas
    engine and calls vLLM's function otherwise. Idempotent.

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
        if not _is_vegas(vllm_config.speculative_config):
            return original(vllm_config, device)
        from .v2_speculator import VegasSpeculator

        return VegasSpeculator(vllm_config, device)

    init_speculator._vegas = True  # type: ignore[attr-defined]
    spec_decode.init_speculator = init_speculator
    runner_mod = sys.modules.get("vllm.v1.worker.gpu.model_runner")
    if runner_mod is not None:
        runner_mod.init_speculator = init_speculator


def install() -> None:
    """Both patches (idempotent); warns once if vLLM is not 0.24.0."""
    import vllm

    version = getattr(vllm, "__version__", "?")
    if not str(version).startswith(VLLM_VERSION):
        _log_once("version", "vegas: the V2 patches were written for vLLM %s, found %s", VLLM_VERSION, version,
                  level=logging.WARNING)
    patch_unsupported_check()
    patch_init_speculator()
