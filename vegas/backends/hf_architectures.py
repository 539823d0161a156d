"""Which transformers architectures the HF backend runs exactly, checked when a model loads.

Vegas replaces the model's attention with :func:`~vegas.backends.hf_attention.vegas_attention`
(causal attention with per-slot masks, optional sliding window, optional logit soft-capping as
in Gemma 2) and rolls the KV cache back by cropping. An architecture whose attention needs more
(learned sinks, ALiBi computed in its own code, chunked attention, KV shared across layers,
bidirectional attention) or whose layers keep a recurrent state that cropping cannot roll back
would be silently wrong, so it is refused by name before any decoding. Final-logit soft-capping
(Gemma 2's ``final_logit_softcapping``) is applied by the model to the logits it returns, so
drafting and verification both see it.
"""

from __future__ import annotations

from typing import Any

import inspect

import torch
from transformers import DynamicCache

from ..config import VegasConfigError
from .hf_attention import AttentionContext

#: ``layer_types`` entries the backend handles
SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})

#: config fields whose set value changes attention in a way the backend does not implement
UNSUPPORTED_CONFIG_FIELDS = {
    "attention_chunk_size": "chunked attention",
    "num_kv_shared_layers": "KV caches shared across layers",
    "use_bidirectional_attention": "bidirectional attention",
}


def _name(model: Any) -> str:
    """``'path' (model_type, architectures)``: the model as the user named it, then what it is."""
    config = model.config
    archs = ", ".join(getattr(config, "architectures", None) or [type(model).__name__])
    path = getattr(config, "_name_or_path", "") or ""
    return f"{path!r} ({config.model_type}, {archs})" if path else f"{config.model_type!r} ({archs})"


def refuse_unsupported(model: Any) -> None:
    """Raise unless ``model`` (loaded with ``attn_implementation="vegas"``) runs exactly.

    Checks the config first, then runs a two-token probe forward through the Vegas
    attention function, which raises on attention options it does not implement
    (:data:`~vegas.backends.hf_attention.UNSUPPORTED_KWARGS`).

    Raises:
        VegasConfigError: naming the model type and the unsupported feature.
    """
    config = model.config.get_text_config()
    supported = "causal decoder-only attention, with optional sliding-window layers and logit soft-capping"
    if not model.is_backend_compatible():
        raise VegasConfigError(
            f"model {_name(model)} computes attention in its own code (e.g. ALiBi), not through "
            f"transformers' AttentionInterface, so vegas cannot draft sparsely on it; supported: {supported}"
        )
    if getattr(config, "is_causal", True) is False:
        raise VegasConfigError(f"model {_name(model)} is not causal; supported: {supported}")
    for field, what in UNSUPPORTED_CONFIG_FIELDS.items():
        if getattr(config, field, None) not in (None, False, 0):
            raise VegasConfigError(f"model {_name(model)} uses {what} ({field}); supported: {supported}")
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types - SUPPORTED_LAYER_TYPES:
        raise VegasConfigError(
            f"model {_name(model)} has layer types {sorted(layer_types - SUPPORTED_LAYER_TYPES)}; "
            f"supported: {sorted(SUPPORTED_LAYER_TYPES)}"
        )
    params = inspect.signature(model.forward).parameters
    extra = {"cache" if "cache" in params else "past_key_values": DynamicCache()}
    if "logits_to_keep" in params:
        extra["logits_to_keep"] = 1
    ids = torch.zeros(1, 2, dtype=torch.long, device=model.device)
    positions = torch.arange(2, device=model.device)[None]
    ctx = AttentionContext(query_pos=positions, query_valid=ids >= 0, key_pos=positions, key_valid=ids >= 0)
    try:
        with torch.inference_mode():
            model(input_ids=ids, position_ids=positions, use_cache=True, vegas_ctx=ctx, **extra)
    except VegasConfigError as exc:
        raise VegasConfigError(f"model {_name(model)}: {exc}") from exc
    seen = len(ctx.layer_windows)
    if seen != config.num_hidden_layers:
        raise VegasConfigError(
            f"model {_name(model)}: {config.num_hidden_layers - seen} of its {config.num_hidden_layers} layers "
            f"do not attend through vegas (linear, recurrent or custom attention); supported: {supported}"
        )
