"""Vegas for stock vLLM 0.24 (its V1 and V2 GPU model runners, FlashAttention-3 backend).

Switch it on in any vLLM program, no code changes beyond the engine arguments::

    from vllm import LLM
    llm = LLM(
        model=...,
        speculative_config={"method": "custom_class",
                            "model": "vegas.vllm_plugin.proposer.VegasProposer",
                            "num_speculative_tokens": 4},
        attention_backend="FLASH_ATTN",
    )

or ``vllm serve MODEL --attention-backend FLASH_ATTN --speculative-config '{"method":
"custom_class", "model": "vegas.vllm_plugin.proposer.VegasProposer", "num_speculative_tokens": 4}'``.
``vegas serve MODEL --selector collect2 -g 4`` builds that command (:mod:`vegas.serve`). The
settings are one JSON object, in ``additional_config["vegas"]`` only (``vllm serve --additional-config
'{"vegas": {...}}'``, ``LLM(additional_config=...)``; :func:`vegas.vllm_plugin.settings.read_settings`):
the selector name plus any fields of :class:`vegas.config.VegasConfig` but ``num_draft_tokens``,
the vLLM-only ones nested under ``"vllm"`` (:class:`vegas.config.VllmOptions`), e.g.
``--additional-config '{"vegas": {"selector": "collect2", "sparsity_ratio": 0.05, "vllm": {"verify_cuda_graphs": "piecewise"}}}'``
(γ is ``speculative_config``'s ``num_speculative_tokens``, nowhere else). Any registered selector runs (:mod:`vegas.plugins`; install
a third-party one so that vLLM's processes find its entry point): the built-ins through fused
fast paths (:mod:`vegas.vllm_plugin.selectors`), every other one through the generic path
(:mod:`vegas.vllm_plugin.selectors.generic`), which calls its ``select`` at every verification
and therefore runs verification in piecewise CUDA graphs. Vegas runs on the model runner vLLM
picks for the same engine without Vegas: the V2 runner for the architectures vLLM runs there by
default (Llama, Qwen3, ...; :class:`~vegas.vllm_plugin.runners.v2.VegasSpeculator`), else V1
(:class:`~vegas.vllm_plugin.runners.v1.VegasProposer`); vLLM's own
``VLLM_USE_V2_MODEL_RUNNER=0`` asks for V1 (:mod:`vegas.vllm_plugin.patches`).

On one GPU vLLM's asynchronous scheduling stays on (the host prepares step N+1 while the GPU
drafts and verifies step N; :mod:`vegas.vllm_plugin.async_sched`); ``async_scheduling=False``
(``vllm serve --no-async-scheduling``) runs synchronously. With tensor parallelism it is on only
when asked for (``async_scheduling=True``, not yet run on GPUs). An executor without async
support (vLLM's ray executor, for instance) runs synchronously, with a warning in the log.

Verification keeps vLLM's full CUDA graphs, with a fast path's selection captured into them;
set ``"vllm": {"verify_cuda_graphs": "piecewise"}`` to change the selector at run time with
:func:`configure`.

Tensor parallelism (``tensor_parallel_size > 1``): every rank holds a slice of each layer's
query and KV heads, so its scores are a partial head sum. By default the ranks all-reduce the
per-layer scores before the selection (``"vllm": {"tp_selection": "all_reduce"}``: one float32
collective of ``layers x batch x context`` per verification, inside the captured graphs) and
select what one GPU would; ``"per_rank"`` selects from each rank's own heads without
communication. Install vegas (or its ``vllm.general_plugins`` entry point) in the environment
that runs vLLM: the engine-core process gets the scheduler patch from it.

Supported: one GPU or tensor parallelism (no pipeline parallelism), full-attention decoder models with
one KV-cache group on the FLASH_ATTN backend, bf16/fp16 KV cache; no LoRA, M-RoPE or
micro-batching (the proposer raises a ``VegasConfigError`` naming the setting). Memory: each
verification allocates a float32 score scratch of ``layers x batch x max_model_len`` (under
full graphs at capture time), outside vLLM's memory profile; with a long ``max_model_len`` and
a large ``max_num_seqs`` leave headroom through ``gpu_memory_utilization``.

Per-request selector state follows batch rows: vLLM reorders and refills rows on its own, so a
selector that keeps state per row (H2O's accumulated scores) may see another request in a row
at the next verification; ``observe`` and ``keep_rows`` are not called on vLLM.

The proposer installs what it needs in the worker process that builds it (single-GPU engines:
the scheduler lives in that process too). For multi-process workers, installing vegas also
registers :func:`register` as a ``vllm.general_plugins`` entry point, which vLLM runs in every
process before the engine exists. Every patch of vLLM is one entry of the table
:data:`vegas.vllm_plugin.patches.PATCHES` (what it replaces, the parameters it expects, why),
checked by :func:`register`: another vLLM than 0.24.0, or a changed function, is refused there.

Where things live: :mod:`.selection` (the selection state one drafter owns, written by the
attention override), :mod:`.selectors` (the selection paths and their per-forward plan),
:mod:`.drafting` (the draft phase both runners share), :mod:`.runners` (the V1 proposer, the V2
speculator and what both do when built), here :mod:`.patches`, :mod:`.settings`,
:mod:`.stats`, :mod:`.async_sched` and :mod:`.proposer` (the public class path).

Nothing here imports vLLM at module import time.
"""

from __future__ import annotations

__all__ = ["CLASS_PATH", "WORKER_EXTENSION", "VegasWorkerExtension", "configure", "get_stats", "log_with_vllm",
           "register"]

CLASS_PATH = "vegas.vllm_plugin.proposer.VegasProposer"
#: vLLM's ``worker_extension_cls`` engine argument that gives every worker the methods
#: ``vegas_configure`` and ``vegas_stats`` (for ``LLM.collective_rpc("vegas_stats")``)
WORKER_EXTENSION = "vegas.vllm_plugin.VegasWorkerExtension"


def register() -> None:
    """``vllm.general_plugins`` entry point: check the installed vLLM against the patch table
    (:func:`~vegas.vllm_plugin.patches.check_vllm`), then install the attention override, the
    scheduler's lookahead allocation and its per-step draft switch
    (:mod:`~vegas.vllm_plugin.step_switch`), the config check that keeps async scheduling on for the
    Vegas proposer, the config hash without the Vegas settings (one compilation for engines that
    differ only in them) and the V2 model-runner patches
    (:func:`~vegas.vllm_plugin.patches.patch_v2_runner`). Safe to call many times, and a no-op
    for engines that do not use the Vegas proposer (the override only acts when it is enabled).

    Raises:
        VllmVersionError: vLLM is not the supported version, or a function Vegas replaces
            changed (the message names it and the supported version).
    """
    from . import patches

    log_with_vllm()
    patches.check_vllm()
    patches.patch_attention()
    patches.patch_scheduler_lookahead()
    patches.patch_scheduler_switch()
    patches.patch_config_check()
    patches.patch_compile_hash()
    patches.patch_v2_runner(_build_v2_speculator)  # opt-in V2 model runner: lets the Vegas speculator through


def log_with_vllm() -> None:
    """Send Vegas' log lines (logger ``vegas.vllm``) where vLLM's go, at vLLM's level.

    vLLM configures its own ``vllm`` logger (handler, format, ``VLLM_LOGGING_LEVEL``) and nothing
    else, so without this no INFO line of Vegas ("vegas: asynchronous scheduling on", the V2
    speculator's settings) reaches a ``vllm serve`` log. A no-op when ``vegas.vllm`` already has
    handlers or the root logger has any (a program that configured logging keeps its own), and
    when vLLM's logger has none (``VLLM_CONFIGURE_LOGGING=0``).
    """
    import logging

    ours, theirs = logging.getLogger("vegas.vllm"), logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


def _build_v2_speculator(vllm_config, device):
    """The Vegas speculator of vLLM's V2 model runner (built by the patched ``init_speculator``;
    imports vLLM, so it is imported only here, inside vLLM's worker)."""
    from .runners.v2 import VegasSpeculator

    return VegasSpeculator(vllm_config, device)


class VegasWorkerExtension:
    """Methods vLLM mixes into each worker when the engine is built with
    ``worker_extension_cls=WORKER_EXTENSION`` (vLLM's ``WorkerWrapperBase.init_worker``), so
    the engine's owner reaches the drafter by name: ``llm.collective_rpc("vegas_stats")``.

    A method called by name travels as a string in vLLM's msgpack messages; a function
    (``llm.collective_rpc(get_stats)``) travels pickled, which vLLM allows only with
    its insecure-serialization switch on when the engine core runs in another process
    (``docs/vllm.md``, "Reaching the workers").
    Vegas never sets that variable; use these methods instead.
    """

    def vegas_configure(self, settings: str | None = None, reset_stats: bool = True) -> str:
        """:func:`configure` on this worker; returns the settings JSON in force."""
        return configure(self, settings, reset_stats)

    def vegas_stats(self, per_request: bool = False) -> dict:
        """:func:`get_stats` on this worker: a dict of numbers (and ``"requests"``)."""
        return get_stats(self, per_request)


def _drafter(worker):
    """The Vegas drafter of a worker: the V1 proposer (``runner.drafter``) or the V2
    speculator (``runner.speculator``)."""
    runner = getattr(worker, "model_runner", worker)
    return getattr(runner, "drafter", None) or getattr(runner, "speculator", None)


def configure(worker, settings: str | None = None, reset_stats: bool = True) -> str:
    """``LLM.collective_rpc("vegas_configure", args=(json,))`` (:class:`VegasWorkerExtension`;
    ``worker`` is vLLM's worker): change the selector or its config at
    run time (``json``: see :func:`vegas.vllm_plugin.settings.parse_settings`). A new selector
    object is built at every call with settings (so per-request state starts afresh).

    The selection state changed is the one the worker's drafter owns (``drafter.state``).

    Returns the settings now in force, as JSON ("" on a worker without a Vegas drafter).

    Raises:
        VegasConfigError: bad settings, settings for a worker without a Vegas drafter, or
            settings that differ from those in force while the engine runs verification in
            full CUDA graphs, which hold the selection.
    """
    from ..config import VegasConfigError
    from .settings import build_selector, parse_settings, path_class, settings_json

    drafter = _drafter(worker)
    state = getattr(drafter, "state", None)  # its SelectionState; None: no drafter, or not a Vegas one
    if settings:
        name, config = parse_settings(settings, source="configure()")
        if state is None:
            raise VegasConfigError("vegas: configure() needs a worker whose engine runs the Vegas drafter "
                                   "(speculative_config method \"custom_class\" with the Vegas proposer)")
        selector = build_selector(name, config, state.gamma, state.block_size or None)
        new = settings_json(name, selector.config)
        if state.frozen and new != state.settings:
            raise VegasConfigError(
                "vegas: this engine captured the selection into full CUDA graphs, so the selector "
                "and budget are fixed; build a new engine, or set \"vllm\": {\"verify_cuda_graphs\": "
                f"\"piecewise\"}} to change them at run time (in force: {state.settings})"
            )
        if not state.frozen:
            device = state.sel_buf.device if state.sel_buf is not None else "cpu"
            state.use(path_class(selector)(selector, state.gamma, device), new)
    if reset_stats and drafter is not None and hasattr(drafter, "reset_stats"):
        drafter.reset_stats()
    return state.settings if state is not None else ""


def get_stats(worker, per_request: bool = False) -> dict:
    """``LLM.collective_rpc("vegas_stats")`` (:class:`VegasWorkerExtension`): the proposer's counters (see
    :class:`~vegas.vllm_plugin.stats.ProposerStats`); with ``per_request``, also
    ``{"requests": {request_id: [iterations, drafted, accepted]}}`` (V1 runner only). On the
    V2 runner: :meth:`~vegas.vllm_plugin.runners.v2.VegasSpeculator.stats`."""
    drafter = _drafter(worker)
    if drafter is None or not hasattr(drafter, "stats"):
        return {}
    if callable(drafter.stats):  # the V2 speculator
        return drafter.stats()
    state = drafter.state
    drafter.resolve_events(wait=True)
    out = drafter.stats.as_dict()
    out["full_cuda_graphs"] = state.frozen
    out["logits_soft_cap"] = state.softcap  # the cap the last scoring forward used (0: none)
    if per_request:
        out["requests"] = {k: list(v) for k, v in drafter.req_stats.items()}
    return out

