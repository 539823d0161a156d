"""vLLM backend: stock vLLM 0.24 (V1 runner, FlashAttention-3) with Vegas as its proposer.

``Pipeline(model=..., selector="collect2", backend="vllm")`` builds a vLLM ``LLM`` whose
speculative proposer is :class:`vegas.vllm_plugin.proposer.VegasProposer`: the target model
drafts γ tokens itself with sparse attention over its own paged KV cache (no second copy of
weights or cache), inside the proposer (one CUDA graph per draft phase, not scheduled steps),
then vLLM verifies them with full attention and its rejection sampler. The verification pass
collects the selection scores (Triton kernel, :mod:`vegas.kernels`). Plain decoding
(``selector=None``) is a plain vLLM ``LLM`` of the same model and dtype.

One engine is alive at a time (plain, or Vegas with a given γ and selector config). Any
registered selector runs: a built-in through its fast path (:mod:`vegas.vllm_plugin.selectors`),
whose verification runs in vLLM's full CUDA graphs with the selection captured into them, so a
new selector or budget rebuilds the engine; with ``VegasConfig.vllm.verify_cuda_graphs =
"piecewise"`` the engine is kept and switched through ``collective_rpc("vegas_configure")``
(:class:`vegas.vllm_plugin.VegasWorkerExtension`; no function is pickled, so vLLM's
insecure-serialization switch is never touched, see ``docs/vllm.md``) (verification attention
then runs eagerly). Any other selector runs on the generic path, under piecewise graphs. The
selector and its config reach the engine as ``additional_config["vegas"]`` only
(:mod:`vegas.vllm_plugin.settings`), γ as ``speculative_config``'s ``num_speculative_tokens``. A
selector that is not built in makes a one-GPU engine run its core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0`` while the engine is built), so that the worker's registry
is this process's and a selector registered by hand is found there by name.

Models whose every layer attends a sliding window (Mistral-style ``sliding_window``) are
refused by name before a Vegas engine is built (:func:`raise_if_only_sliding_window`): there is
nothing to select; a window at least as long as the engine's context drops no key and counts as
full attention (Phi-3-mini-128k). Models that mix sliding-window and full-attention layers (Gemma 2/3, Qwen2
with ``use_sliding_window``) run: their sliding-window layers draft over their own window, and
their KV stays in one cache group (``disable_hybrid_kv_cache_manager``, set by the plugin unless
the user set it).

Quest's pages are vLLM's KV blocks (``page_size`` must be the engine's ``block_size``, which
vLLM picks with the attention backend unless ``engine_args`` sets it: checked here when set,
else by the proposer at engine start; their key bounds take ``1/block_size`` of the key cache per bound, outside vLLM's memory
profile, see :mod:`vegas.vllm_plugin.selectors.quest`). Not here:
``granularity="kv_head"``, ``score_mode="weight"`` (the kernel sums logits) and query-aware
selectors without a fast path (:func:`vegas.vllm_plugin.settings.raise_if_unsupported`).

``import vegas.backends.vllm`` works without vLLM installed; vLLM is imported when an engine is
built. Engine options: the backend's ``engine_args`` (a dict passed to ``LLM``, e.g.
``{"gpu_memory_utilization": 0.5, "max_model_len": 32768}``; ``Pipeline(backend_options=
{"engine_args": ...})``). No environment variable is read.
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from typing import Any

from ..config import VegasConfig, VegasConfigError
from ..hookspecs import hookimpl
from ..interfaces import Selector
from ..plugins import is_builtin, owner
from ..sampling import SamplingParams
from ..vllm_plugin import settings as vegas_settings
from .base import Backend, RequestOutput, RequestStats, as_selector

__all__ = [
    "VLLM_INSTALL_HINT",
    "VLLMBackend",
    "model_max_context",
    "raise_if_only_sliding_window",
    "vllm_installed",
    "shutdown_engine",
    "sliding_window_layers",
    "start_engine",
    "verify_cuda_graphs",
    "vllm_engine_kwargs",
    "vllm_missing_message",
]

log = logging.getLogger(__name__)

def verify_cuda_graphs(selector: Selector, config: VegasConfig) -> str:
    """CUDA-graph mode of the verification forward: ``config.vllm.verify_cuda_graphs``, or
    ``"piecewise"`` for a selector on the generic path (its ``select`` runs in Python)."""
    if not vegas_settings.path_class(selector).capturable:
        return "piecewise"
    return config.vllm.verify_cuda_graphs


@contextmanager
def _engine_core_in_process(selector: str | None):
    """Run a new engine's core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) while the
    block runs, for a selector (by name) that is not built in: the worker then finds it by name
    in this process's registry (a selector registered by hand included)."""
    if selector is None or is_builtin(owner("selectors", selector)):
        yield
        return
    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    saved = os.environ.get(key)
    os.environ[key] = "0"
    log.info("vllm backend: selector %r is not built in; the engine core runs in this process", selector)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved


def sliding_window_layers(config: Any) -> list[int]:
    """Indices of the layers of a transformers config that vLLM builds with a sliding window.

    Interleaved ``layer_types`` (Gemma 2/3, Qwen2 with ``use_sliding_window``, ...): the
    ``"sliding_attention"`` entries. Otherwise every layer when ``sliding_window`` is set and
    ``use_sliding_window`` is not false: vLLM then sets ``cache_config.sliding_window``, which
    every attention layer without a window of its own takes (``EngineArgs``, vLLM 0.24.0) —
    Mistral-style configs, Phi-3, and also a config whose ``layer_types`` are all
    ``"full_attention"`` but which sets ``sliding_window`` (transformers would not window those
    layers; vLLM does). Multimodal configs are read through their text config.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None)
    if types and len(set(types)) > 1:
        return [i for i, t in enumerate(types) if t == "sliding_attention"]
    window = getattr(text, "sliding_window", None)
    if window and getattr(text, "use_sliding_window", True) is not False:
        return list(range(int(getattr(text, "num_hidden_layers", 0) or 0)))
    return []


def _spans(indices: list[int]) -> str:
    """``[0, 1, 2, 4, 6, 7]`` -> ``"0-2, 4, 6-7"``."""
    out: list[str] = []
    start = prev = None
    for i in indices + [None]:
        if start is not None and i == prev + 1:
            prev = i
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = i
    return ", ".join(out)


def raise_if_only_sliding_window(model: str, max_model_len: int | None = None) -> None:
    """Refuse a model whose every layer attends a sliding window before a Vegas engine is built.

    Vegas selects KV entries for full-attention layers; a model's sliding-window layers draft
    over their own window (as they attend in the target), so a model with no full-attention
    layer leaves nothing to select. A window at least as long as the engine's context (the
    model's ``max_position_embeddings``, or ``max_model_len`` when given and shorter) never
    drops a key: such a model attends everything and passes (Phi-3-mini-128k: window 262,144,
    context 131,072); the drafter applies the same rule to the layers vLLM builds
    (:func:`vegas.vllm_plugin.drafting.engine.sliding_windows`). Reads the model's transformers
    config (``AutoConfig``, ``trust_remote_code`` off, so no code of the model runs). A config
    that cannot be read that way is let through: vLLM's own loading names the problem, and the
    drafter checks every attention layer when it starts.

    Raises:
        VegasConfigError: naming the model, its window and layer count, and pointing to the HF
            backend and plain vLLM.
    """
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model, trust_remote_code=False, local_files_only=True)
    except Exception as e:  # a hub id not cached, remote code, no config.json: vLLM reports it
        log.debug("vllm backend: config of %r not read for the sliding-window check: %r", model, e)
        return
    layers = sliding_window_layers(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    total = int(getattr(text, "num_hidden_layers", 0) or len(layers))
    if not layers or len(layers) < total:
        return
    window = getattr(text, "sliding_window", None)
    reach = [n for n in (getattr(text, "max_position_embeddings", None), max_model_len) if n]
    if window and reach and window >= min(reach):
        log.info("vllm backend: %r windows every layer by %d positions, at least its context (%d): "
                 "no key is dropped, every layer attends the whole context", model, window, min(reach))
        return
    raise VegasConfigError(
        f"model {model!r} attends a sliding window (window {getattr(text, 'sliding_window', None)}) "
        f"in all {total} of its layers: the vllm backend selects KV entries for full-attention layers "
        "and has nothing to select here. Use plain vLLM (--selector none), or backend='hf'."
    )


#: how to install vLLM for vegas (said wherever vLLM is needed and missing)
VLLM_INSTALL_HINT = "pip install 'vegas[vllm]'"


def vllm_missing_message(what: str) -> str:
    """``"<what> needs vLLM 0.24.0 and a CUDA GPU: vllm is not installed (pip install ...)"``."""
    return f"{what} needs vLLM 0.24.0 and a CUDA GPU: vllm is not installed ({VLLM_INSTALL_HINT})"


def vllm_installed() -> bool:
    """Whether vLLM can be imported (looked up, not imported)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _raise_if_unavailable() -> None:
    import torch

    if not vllm_installed():
        problem = vllm_missing_message("'vllm'") + "; or use the 'hf' backend"
        raise VegasConfigError(f"backend {problem}", field="backend", problem=problem)
    if not torch.cuda.is_available():
        problem = "'vllm' needs a CUDA GPU and none is visible; use the 'hf' backend"
        raise VegasConfigError(f"backend {problem}", field="backend", problem=problem)


def _raise_if_foreign_extension(qualname: str | None) -> None:
    """Refuse a ``worker_extension_cls`` engine argument that is not
    :class:`vegas.vllm_plugin.VegasWorkerExtension` or a subclass of it.

    Raises:
        VegasConfigError: naming the class and how to fix it.
    """
    from ..vllm_plugin import WORKER_EXTENSION, VegasWorkerExtension

    if not qualname or qualname == WORKER_EXTENSION:
        return
    import importlib

    module, _, name = str(qualname).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise VegasConfigError(f"engine_args worker_extension_cls={qualname!r} cannot be imported: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, VegasWorkerExtension)):
        raise VegasConfigError(
            f"engine_args worker_extension_cls={qualname!r}: the vllm backend reads its statistics "
            f"through {WORKER_EXTENSION}; make your class a subclass of it"
        )


def vllm_engine_kwargs(
    model: str,
    *,
    dtype: str = "bfloat16",
    num_draft_tokens: int | None = None,
    trust_remote_code: bool = False,
    verify_cuda_graphs: str = "full",
    settings: str | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for plain decoding (``num_draft_tokens=None``) or for
    Vegas with γ = ``num_draft_tokens``: what a vLLM user passes to switch Vegas on. The one
    place engine arguments are made (the backend and ``vegas bench --backend vllm`` use it). With
    Vegas, ``worker_extension_cls`` is :data:`vegas.vllm_plugin.WORKER_EXTENSION`, whose
    methods the backend calls by name (``collective_rpc("vegas_stats")``): no function is
    pickled, so vLLM's insecure-serialization switch stays as the user set it (``docs/vllm.md``).

    Args:
        verify_cuda_graphs: ``"piecewise"`` asks for piecewise CUDA graphs (Vegas only).
        settings: (Vegas only) the settings JSON (:func:`vegas.vllm_plugin.settings.settings_json`),
            passed as ``additional_config["vegas"]``, the one channel to vLLM's workers; None:
            the proposer's defaults (collect2).
        **overrides: further ``LLM`` arguments; they win, except ``compilation_config``, which
            is merged key by key into the one made here.
    """
    kw: dict[str, Any] = dict(
        model=model,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        attention_backend="FLASH_ATTN",
        enable_prefix_caching=True,
        disable_log_stats=False,
    )
    if num_draft_tokens is not None:
        from ..vllm_plugin import CLASS_PATH, WORKER_EXTENSION

        _raise_if_foreign_extension(overrides.get("worker_extension_cls"))
        kw["worker_extension_cls"] = WORKER_EXTENSION  # collective_rpc("vegas_stats"), no pickling
        kw["speculative_config"] = {
            "method": "custom_class",
            "model": CLASS_PATH,
            "num_speculative_tokens": num_draft_tokens,
        }
        if verify_cuda_graphs == "piecewise":
            kw["compilation_config"] = {"cudagraph_mode": "PIECEWISE"}
        if settings is not None:
            key = vegas_settings.ADDITIONAL_CONFIG_KEY
            kw["additional_config"] = {**overrides.pop("additional_config", {}), key: json.loads(settings)}
    compilation = {**kw.get("compilation_config", {}), **overrides.pop("compilation_config", {})}
    kw.update(overrides)
    if compilation:
        kw["compilation_config"] = compilation
    return kw


def model_max_context(model: str, trust_remote_code: bool = False) -> int:
    """The model's context in tokens: its transformers config's ``max_position_embeddings``
    (of the text config of a multimodal model; 0 when the config has none)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return int(getattr(text, "max_position_embeddings", 0) or 0)


def start_engine(engine_kwargs: dict[str, Any], selector: str | None = None):
    """A ``vllm.LLM`` of ``engine_kwargs`` (made by :func:`vllm_engine_kwargs`): the one place
    engines are started (the backend and ``vegas bench --backend vllm``). Registers the Vegas
    plugin in this process first (also where vegas is not pip-installed, i.e. without its
    ``vllm.general_plugins`` entry point); ``selector``, the name of the engine's Vegas selector
    (None: plain vLLM or ngram), runs the engine core in this process when it is not built in.

    Raises:
        ImportError: vLLM is not installed.
    """
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from vllm import LLM

    from ..vllm_plugin import register

    register()
    with _engine_core_in_process(selector):
        return LLM(**engine_kwargs)


def shutdown_engine(llm) -> None:
    """Stop an engine's processes so that the next engine gets the GPU memory (best effort)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # best effort
        log.debug("vllm backend: shutdown: %r", e)


class VLLMBackend(Backend):
    """vLLM engine backend (CUDA only, bfloat16/float16).

    Args:
        model: model directory or hub id (as vLLM takes it).
        dtype: ``"bfloat16"`` or ``"float16"``; ``"float32"`` (the Pipeline default) runs in
            bfloat16 with a warning, since FlashAttention-3 has no float32 path.
        device: must be None or CUDA (vLLM picks the GPU).
        rope_scaling: RoPE scaling (:func:`vegas.models.rope_scaled_config`), passed to vLLM as
            ``hf_overrides`` (``rope_parameters`` and ``max_position_embeddings``), or None.
        engine_args: further ``vllm.LLM`` keyword arguments (e.g. ``max_model_len``).

    Raises:
        VegasConfigError: an unsupported dtype or device, bad ``rope_scaling``, or
            ``engine_args`` that is not a dict.
    """

    name = "vllm"

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "bfloat16",
        device: str | None = None,
        trust_remote_code: bool = False,
        rope_scaling: dict | None = None,
        engine_args: dict[str, Any] | None = None,
    ) -> None:
        if engine_args is not None and not isinstance(engine_args, dict):
            raise VegasConfigError(f"engine_args must be a dict of vllm.LLM arguments, got {engine_args!r}")
        if dtype not in ("bfloat16", "float16", "float32"):
            raise VegasConfigError(f"vllm backend dtype must be 'bfloat16' or 'float16', got {dtype!r}")
        if device is not None and not str(device).startswith("cuda"):
            raise VegasConfigError(f"the vllm backend runs on CUDA GPUs only, got device={device!r}",
                                   field="device", problem=f"must be cuda with the vllm backend, got {device!r}")
        _raise_if_unavailable()
        if dtype == "float32":
            log.warning("vllm backend: FlashAttention-3 has no float32 path; running in bfloat16")
            dtype = "bfloat16"
        self.model = str(model)
        self.dtype = dtype
        self.trust_remote_code = trust_remote_code
        self._llm = None
        self._key: tuple | None = None
        self._tokenizer = None
        self._max_context: int | None = None
        self._checked_model = False  # all-sliding-window check done (at the first Vegas generate)
        self._generation_config = None
        self._hf_overrides: dict[str, Any] = {}
        self.engine_args = dict(engine_args or {})
        if rope_scaling is not None:
            from ..models import rope_scaled_config

            scaled = rope_scaled_config(self.model, rope_scaling, trust_remote_code=trust_remote_code)
            self._hf_overrides = {
                "rope_parameters": scaled.rope_parameters,
                "max_position_embeddings": scaled.max_position_embeddings,
            }
            self._max_context = int(scaled.max_position_embeddings)

    # ---- engine -----------------------------------------------------------------------------
    def _engine(self, key: tuple, selector: Selector | None, config: VegasConfig):
        if self._llm is not None and self._key == key:
            return self._llm
        self.close()
        verify, settings = "full", None
        if selector is not None:
            settings = vegas_settings.settings_json(selector.name, config)
            verify = verify_cuda_graphs(selector, config)
        overrides = dict(self.engine_args)
        if self._hf_overrides:  # rope_scaling; the engine arguments' hf_overrides win key by key
            overrides["hf_overrides"] = {**self._hf_overrides, **overrides.get("hf_overrides", {})}
        kw = vllm_engine_kwargs(
            self.model,
            dtype=self.dtype,
            num_draft_tokens=config.num_draft_tokens if selector is not None else None,
            trust_remote_code=self.trust_remote_code,
            verify_cuda_graphs=verify,
            settings=settings,
            **overrides,
        )
        self._llm = start_engine(kw, selector.name if selector is not None else None)
        self._key = key
        self._max_context = int(self._llm.llm_engine.model_config.max_model_len)
        return self._llm

    def close(self) -> None:
        """Shut the engine down (frees the GPU)."""
        if self._llm is not None:
            shutdown_engine(self._llm)
            self._llm = None
            self._key = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model, trust_remote_code=self.trust_remote_code)
        return self._tokenizer

    @property
    def generation_config(self):
        """The model directory's ``generation_config.json`` (else derived from its config)."""
        if self._generation_config is None:
            from transformers import GenerationConfig

            try:
                self._generation_config = GenerationConfig.from_pretrained(self.model)
            except OSError:  # no generation_config.json: the model config's token ids
                from transformers import AutoConfig

                cfg = AutoConfig.from_pretrained(self.model, trust_remote_code=self.trust_remote_code)
                self._generation_config = GenerationConfig.from_model_config(cfg)
        return self._generation_config

    @property
    def max_context(self) -> int:
        if self._max_context is None:
            self._max_context = model_max_context(self.model, self.trust_remote_code)
        return self._max_context

    # ---- generation -------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        sampling: SamplingParams,
        selector: Selector | str | None,
        config: VegasConfig,
    ) -> list[RequestOutput]:
        """See :meth:`vegas.interfaces.Backend.generate`.

        Raises:
            VegasConfigError: a setting this backend lacks
                (:func:`vegas.vllm_plugin.settings.raise_if_unsupported`), or (with a selector) a
                model whose every layer is sliding-window (:func:`raise_if_only_sliding_window`), before any
                engine is built.
        """
        selector = as_selector(selector, config)
        if selector is not None:
            vegas_settings.raise_if_unsupported(selector, config, self.engine_args.get("block_size"))
            if not self._checked_model:
                raise_if_only_sliding_window(self.model, self.engine_args.get("max_model_len"))
                self._checked_model = True
        from vllm import SamplingParams as VllmSamplingParams

        settings = None
        if selector is None:
            key: tuple = ("plain", 0)
        else:
            settings = vegas_settings.settings_json(selector.name, config)
            in_process = not is_builtin(owner("selectors", selector.name))
            if verify_cuda_graphs(selector, config) == "full":  # the selection is captured into the graphs
                key = ("vegas", config.num_draft_tokens, settings, in_process)
            else:
                key = ("vegas", config.num_draft_tokens, "piecewise", in_process)
        llm = self._engine(key, selector, config)
        if settings is not None:
            llm.collective_rpc("vegas_configure", args=(settings, True))
        sp = VllmSamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=max_new_tokens,
        )
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False)
        per_req: dict[str, list[int]] = {}
        batch: dict[str, Any] = {}
        if selector is not None:
            batch = llm.collective_rpc("vegas_stats", args=(True,))[0]
            for rid, counts in batch.get("requests", {}).items():
                per_req[rid.rsplit("-", 1)[0]] = counts
        results = []
        select_seconds = batch.get("select_ms", 0.0) / 1e3 / max(len(outs), 1)  # a request's share of the batch's
        shared = None  # the V2 runner counts per batch, not per request
        if selector is not None and batch.get("runner") == "v2":
            shared = share_batch_iterations(batch["iterations"], batch.get("emitted", 0),
                                            [len(o.outputs[0].token_ids) for o in outs])
        for i, o in enumerate(outs):
            comp = o.outputs[0]
            m = getattr(o, "metrics", None)
            stats = RequestStats(num_generated=len(comp.token_ids))
            if m is not None and getattr(m, "first_token_ts", 0) > 0:
                stats.decode_seconds = max(m.last_token_ts - m.first_token_ts, 0.0)
                stats.prefill_seconds = max(m.first_token_ts - m.scheduled_ts, 0.0)
            counts = per_req.get(o.request_id)
            if counts is not None:
                stats.iterations, stats.num_drafted, stats.num_accepted = counts
                stats.selection_seconds = select_seconds
            elif shared is not None:
                stats.iterations = shared[i]
                stats.selection_seconds = select_seconds
            elif selector is None:
                stats.iterations = max(stats.num_generated - 1, 0)
            results.append(RequestOutput(token_ids=list(comp.token_ids), text=comp.text, stats=stats))
        return results


def share_batch_iterations(iterations: int, emitted: int, generated: list[int]) -> list[int]:
    """Per-request iteration counts from a batch's totals (the V2 runner's speculator counts
    per batch: :meth:`~vegas.vllm_plugin.runners.v2.VegasSpeculator.stats`).

    Args:
        iterations: verified steps of rows with drafts, summed over the batch.
        emitted: tokens those steps emitted (accepted + bonus), summed over the batch.
        generated: tokens each request generated (its first token comes from the prefill).

    Returns:
        One count per request: the batch's iterations plus its plain steps (generated tokens that
        neither the prefill nor a drafting step emitted), shared out in proportion to the tokens
        each request generated beyond its first, by largest remainder, so that the counts add up
        to the batch's: the batch's τ is exact, each request's is the batch's (exact for one
        request). Unlike the V1 runner's per-request counts, plain steps count as iterations.
        ``emitted`` includes tokens sampled past a request's end in its last step, which vLLM
        drops; that lowers the plain steps estimated (clamped at 0).
    """
    decoded = [max(g - 1, 0) for g in generated]
    total = sum(decoded)
    steps = iterations + max(total - emitted, 0)
    if not total:
        return [0] * len(generated)
    exact = [d * steps / total for d in decoded]
    shares = [int(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: shares[i] - exact[i])
    for i in by_remainder[: steps - sum(shares)]:
        shares[i] += 1
    return shares


@hookimpl
def vegas_backends():
    return {"vllm": VLLMBackend}
