"""The proposer's settings: a selector name plus a :class:`~vegas.config.VegasConfig`, as one
JSON object (read here only; example in :mod:`vegas.vllm_plugin`):
``{"selector": <name>, <VegasConfig field>: <value>, ..., "vllm": {<VllmOptions field>: ...}}``.
Without a selector the default is collect2's (:data:`DEFAULT_SELECTOR`).

One channel: the engine's ``additional_config["vegas"]`` (:data:`ADDITIONAL_CONFIG_KEY`), set by
``Pipeline(backend="vllm")`` (:func:`vegas.backends.vllm.vllm_engine_kwargs`), by ``vegas serve``,
or by hand (``vllm serve --additional-config '{"vegas": {...}}'``, ``LLM(additional_config=...)``).
vLLM hands ``additional_config`` to every worker inside ``VllmConfig``; no environment variable
is read.

γ is ``speculative_config``'s ``num_speculative_tokens`` only: the settings object must not
carry ``num_draft_tokens`` (:func:`parse_settings` refuses it, :func:`settings_json` leaves it
out), and :func:`build_selector` gives the selector's config vLLM's γ.

The worker process builds the selector through :func:`vegas.plugins.create_selector`, so any
registered selector runs: a third-party one through its entry point, or one registered by hand
(``vegas.plugins.register_selector``) when vLLM's engine core runs in the same process, since
that process's registry is the one the worker reads (the vllm backend runs the core in-process
for such a selector). Its selection path is the fast path registered for its exact class
(``vegas_vllm_fast_paths``), else the generic path.
"""

from __future__ import annotations

import json
import sys
from typing import Any
from dataclasses import replace

from ..config import DRAFT_POLICY_FIELDS, VegasConfig, VegasConfigError, parse_json_object
from ..interfaces import Selector
from ..plugins import PLAIN, create_selector, vllm_fast_path
from ..strategies import Collect2Selector
from .selectors.base import SelectionPath
from .selectors.generic import GenericPath

__all__ = [
    "ADDITIONAL_CONFIG_KEY",
    "DEFAULT_SELECTOR",
    "build_selector",
    "parse_settings",
    "path_class",
    "raise_if_score_path_unsupported",
    "raise_if_unsupported",
    "read_settings",
    "settings_json",
]

#: the key of vLLM's ``additional_config`` that holds the settings object
ADDITIONAL_CONFIG_KEY = "vegas"
#: the selector when the settings name none
DEFAULT_SELECTOR = Collect2Selector.name


def settings_json(selector: str, config: VegasConfig) -> str:
    """The settings JSON (``additional_config["vegas"]``, :func:`vegas.vllm_plugin.configure`)
    for a selector name and a config; without ``num_draft_tokens`` (γ is vLLM's) and without the
    top-level ``fallback*`` fields, the HF backend's draft policy (:mod:`vegas.draft_policy`),
    which the vLLM backend does not read (its measured fallback is ``vllm.fallback``)."""
    values = {k: v for k, v in config.to_dict().items() if k not in DRAFT_POLICY_FIELDS}
    values.pop("num_draft_tokens", None)
    return json.dumps({"selector": selector, **values})


def parse_settings(raw: str, source: str = f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]") -> tuple[str, VegasConfig]:
    """``(selector name, config)`` from a settings JSON object (``source`` names it in errors);
    the config's ``num_draft_tokens`` is the default until :func:`build_selector` sets γ.

    Raises:
        VegasConfigError: not a JSON object, a selector that is not a string, a
            ``num_draft_tokens`` field (γ is ``speculative_config``'s), an unknown field, or a
            value outside its allowed values (the message names the field).
    """
    values = parse_json_object(raw, source)
    if "num_draft_tokens" in values:
        raise VegasConfigError(
            f"{source}: num_draft_tokens is not a setting here; γ is speculative_config's "
            "num_speculative_tokens (vllm serve -g / --speculative-config)"
        )
    selector = values.pop("selector", DEFAULT_SELECTOR)
    if not isinstance(selector, str):
        raise VegasConfigError(f"{source}: selector must be a registered selector name, got {selector!r}")
    return selector, VegasConfig.from_dict(values, source)


def _current_vllm_config() -> Any:
    """vLLM's current config (set while vLLM builds a worker's model runner and its proposer),
    or None; never imports vLLM."""
    if "vllm.config" not in sys.modules:
        return None
    getter = getattr(sys.modules["vllm.config"], "get_current_vllm_config_or_none", None)
    return getter() if getter is not None else None


def read_settings(vllm_config: Any = None) -> tuple[str, VegasConfig]:
    """``(selector name, config)`` from ``vllm_config.additional_config["vegas"]`` (a JSON
    object or its string; ``vllm_config`` defaults to vLLM's current config); collect2 and
    defaults when it is not set.

    Raises:
        VegasConfigError: see :func:`parse_settings`.
    """
    if vllm_config is None:
        vllm_config = _current_vllm_config()
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, dict) or extra.get(ADDITIONAL_CONFIG_KEY) is None:
        return DEFAULT_SELECTOR, VegasConfig()
    value = extra[ADDITIONAL_CONFIG_KEY]
    return parse_settings(value if isinstance(value, str) else json.dumps(value))


def path_class(selector: Selector) -> type[SelectionPath]:
    """The fast path registered for ``type(selector)``, else :class:`GenericPath`."""
    return vllm_fast_path(selector) or GenericPath


def raise_if_unsupported(selector: Selector, config: VegasConfig, block_size: int | None = None) -> None:
    """Refuse settings the vLLM backend cannot run, before an engine is built (``block_size``:
    the engine's KV block size when known, from vLLM's ``cache_config``).

    Raises:
        VegasConfigError: ``granularity`` other than ``"layer"``, ``score_mode`` other than
            ``"logit"``, a query-aware selector without a fast path, what the selector's
            path refuses (Quest: ``page_size`` other than the engine's ``block_size``), or
            ``vllm.score_path="cute"`` with a selector the CuTe probe path cannot serve
            (:func:`raise_if_score_path_unsupported`).
    """
    if config.granularity != "layer":
        raise VegasConfigError("the vllm backend selects per layer only; use granularity='layer'")
    if config.score_mode != "logit":
        raise VegasConfigError("the vllm backend ranks by summed logits only; use score_mode='logit'")
    path_class(selector).raise_if_unsupported(selector, config, block_size=block_size)
    raise_if_score_path_unsupported(selector, config, block_size)


def raise_if_score_path_unsupported(selector: Selector, config: VegasConfig, block_size: int | None = None) -> None:
    """Refuse ``vllm.score_path="cute"`` where it can never run, what is known before an engine
    exists: the CuTe probe path (:mod:`vegas.kernels.cute_probe`) scores the chunk's first and
    last query (collect2) or its first alone (last_token), for the score top-k fast
    path; its kernel reads a paged cache without TMA (``block_size`` other than 128). Whether
    the GPU, the DSL, the model's layers and each batch fit is decided at run time (today's path
    where not).

    Raises:
        VegasConfigError: (field ``vllm.score_path``) naming the selector or the block size.
    """
    if config.vllm.score_path != "cute":
        return
    from ..kernels.cute_probe import SCORE_TILE, row_mode
    from .selectors.plan import score_rows_by_length

    allowed = "collect2 or last_token (the first and/or the last query of the verified chunk)"
    if not getattr(path_class(selector), "uses_fa3_scores", False):
        raise VegasConfigError.bad("vllm.score_path", f"'cute' needs a score top-k selector, {allowed}; "
                                   f"{selector.name!r} does not select by those scores on vLLM")
    try:
        row_mode(score_rows_by_length(selector, config.num_draft_tokens))
    except ValueError as e:
        raise VegasConfigError.bad("vllm.score_path", f"'cute' needs {allowed}; {selector.name!r}: {e}") from None
    if block_size == SCORE_TILE[1]:
        raise VegasConfigError.bad("vllm.score_path", f"'cute' reads the paged cache without TMA; block_size "
                                   f"{block_size} takes the kernel's TMA path, which the probe kernel is not built for")


def build_selector(name: str, config: VegasConfig, gamma: int, block_size: int | None = None) -> Selector:
    """A new selector ``name`` from the registry with ``config`` and γ = ``gamma``, checked by
    :func:`raise_if_unsupported` (with the engine's ``block_size`` when known).

    Raises:
        VegasConfigError: an unknown selector name, or settings the vLLM backend refuses.
        VegasPluginError: the selector's constructor raised.
    """
    if name == PLAIN:
        raise VegasConfigError(f"selector {PLAIN!r} is plain decoding: run vLLM without Vegas's speculative_config")
    config = replace(config, num_draft_tokens=gamma)
    selector = create_selector(name, config)
    raise_if_unsupported(selector, config, block_size)
    return selector
