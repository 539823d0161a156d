"""The proposer's settings: a selector name plus a :class:`~vegas.config.VegasConfig`, as one
JSON object (read here only; example in :mod:`vegas.vllm_plugin`):
``{"selector": <name>, <VegasConfig field>: <value>, ..., "vllm": {<VllmOptions field>: ...}}``.
Without a selector the default is collect2's (:data:`DEFAULT_SELECTOR`).

Where the object comes from, first found wins (:func:`read_settings`):

1. the engine's ``additional_config["vegas"]`` (:data:`ADDITIONAL_CONFIG_KEY`): ``vllm serve
   --additional-config '{"vegas": {...}}'`` or ``LLM(additional_config={"vegas": {...}})``; vLLM
   hands ``additional_config`` to every worker inside ``VllmConfig`` (no environment needed);
2. ``$VEGAS_VLLM_CONFIG`` (:data:`ENV_VAR`).

The worker process builds the selector through :func:`vegas.plugins.create_selector`, so any
registered selector runs (a third-party one through its entry point, or registered by hand
when vLLM's engine core runs in the same process). A selector object handed over with
:func:`hand_over` in the same process (the :class:`~vegas.pipeline.Pipeline`'s) is used
instead when its name and config match. Its selection path is the fast path registered for
its exact class (``vegas_vllm_fast_paths``), else the generic path.

γ is ``speculative_config``'s ``num_speculative_tokens``: it replaces the JSON's
``num_draft_tokens``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any
from dataclasses import replace

from ..config import VegasConfig, VegasConfigError, parse_json_object
from ..interfaces import Selector
from ..plugins import PLAIN, create_selector, vllm_fast_path
from ..strategies import Collect2Selector
from .selectors.base import SelectionPath
from .selectors.generic import GenericPath

__all__ = [
    "ADDITIONAL_CONFIG_KEY",
    "DEFAULT_SELECTOR",
    "ENV_VAR",
    "build_selector",
    "hand_over",
    "parse_settings",
    "path_class",
    "raise_if_unsupported",
    "read_settings",
    "settings_json",
]

log = logging.getLogger(__name__)

ENV_VAR = "VEGAS_VLLM_CONFIG"
#: the key of vLLM's ``additional_config`` that holds the settings object
ADDITIONAL_CONFIG_KEY = "vegas"
#: the selector when the settings name none
DEFAULT_SELECTOR = Collect2Selector.name

_handed: Selector | None = None


def settings_json(selector: str, config: VegasConfig) -> str:
    """The JSON of ``$VEGAS_VLLM_CONFIG`` for a selector name and a config."""
    return json.dumps({"selector": selector, **config.to_dict()})


def parse_settings(raw: str, source: str = ENV_VAR) -> tuple[str, VegasConfig]:
    """``(selector name, config)`` from a settings JSON object (``source`` names it in errors).

    Raises:
        VegasConfigError: not a JSON object, a selector that is not a string, an unknown
            field, or a value outside its allowed values (the message names the field).
    """
    values = parse_json_object(raw, source)
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
    """``(selector name, config)``: from ``vllm_config.additional_config["vegas"]`` (a JSON
    object or its string; ``vllm_config`` defaults to vLLM's current config), else from
    ``$VEGAS_VLLM_CONFIG``; collect2 and defaults when neither is set.

    Raises:
        VegasConfigError: see :func:`parse_settings`.
    """
    if vllm_config is None:
        vllm_config = _current_vllm_config()
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, dict) and extra.get(ADDITIONAL_CONFIG_KEY) is not None:
        value = extra[ADDITIONAL_CONFIG_KEY]
        source = f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]"
        raw = value if isinstance(value, str) else json.dumps(value)
        if os.environ.get(ENV_VAR, "").strip():
            log.warning("vegas: settings from %s; $%s is ignored", source, ENV_VAR)
        return parse_settings(raw, source=source)
    raw = os.environ.get(ENV_VAR, "").strip()
    return parse_settings(raw) if raw else (DEFAULT_SELECTOR, VegasConfig())


def hand_over(selector: Selector | None) -> None:
    """Offer a selector object to a proposer built later in this process (None withdraws it)."""
    global _handed
    _handed = selector


def path_class(selector: Selector) -> type[SelectionPath]:
    """The fast path registered for ``type(selector)``, else :class:`GenericPath`."""
    return vllm_fast_path(selector) or GenericPath


def raise_if_unsupported(selector: Selector, config: VegasConfig) -> None:
    """Refuse settings the vLLM backend cannot run, before an engine is built.

    Raises:
        VegasConfigError: ``granularity`` other than ``"layer"``, ``score_mode`` other than
            ``"logit"``, a query-aware selector without a fast path, or what the selector's
            path refuses (Quest: ``page_size`` other than vLLM's block size).
    """
    if config.granularity != "layer":
        raise VegasConfigError("the vllm backend selects per layer only; use granularity='layer'")
    if config.score_mode != "logit":
        raise VegasConfigError("the vllm backend ranks by summed logits only; use score_mode='logit'")
    path_class(selector).raise_if_unsupported(selector, config)


def build_selector(name: str, config: VegasConfig, gamma: int) -> Selector:
    """The selector ``name`` with ``config`` (γ = ``gamma``): the handed-over object if its
    name and config match, else a new one from the registry; checked by
    :func:`raise_if_unsupported`.

    Raises:
        VegasConfigError: an unknown selector name, or settings the vLLM backend refuses.
        VegasPluginError: the selector's constructor raised.
    """
    if name == PLAIN:
        raise VegasConfigError(f"selector {PLAIN!r} is plain decoding: run vLLM without Vegas's speculative_config")
    config = replace(config, num_draft_tokens=gamma)
    handed = _handed
    if handed is not None and handed.name == name and handed.config == config:
        selector = handed
    else:
        selector = create_selector(name, config)
    raise_if_unsupported(selector, config)
    return selector
