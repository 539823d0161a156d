"""Every monkey-patch Vegas applies to vLLM, as one table: :data:`PATCHES`.

Each :class:`Patch` names the vLLM object it replaces, the parameters that object has in the one
supported release (:data:`VLLM_VERSION`) and why vLLM offers no other way. :func:`check_vllm`
checks the whole table once, at plugin registration (:func:`vegas.vllm_plugin.register`, vLLM's
``vllm.general_plugins`` entry point) and again when a Vegas drafter starts: another vLLM
version, or a replaced object that is missing or takes other parameters, is refused with a
:class:`VllmVersionError` naming it. Every ``patch_*`` function installs its entry through
:func:`_install` (idempotent: the replacement carries ``_vegas = True``) and leaves engines
without the Vegas proposer as they were. Nothing here imports vLLM at module import time.

Which runner serves a Vegas engine (:func:`patch_v2_unsupported_check`):

- by default, the runner vLLM picks for the same engine without Vegas: the V2 runner for the
  architectures vLLM runs there by default (Llama, Qwen3, ...; plain vLLM runs on it too, so
  Vegas and plain share the host path), V1 (:class:`~vegas.vllm_plugin.runners.v1.VegasProposer`)
  where vLLM falls back to V1 for other reasons. Measured on an H200 with SmolLM2-135M
  (``benchmarks/results/vllm_h200_2026-12-01_profile/``): 64 fresh 6,000-token prompts at once,
  V2 1.04x plain vLLM's output throughput, V1 0.76x;
- vLLM's own ``VLLM_USE_V2_MODEL_RUNNER=0``: the V1 runner (vLLM reads it before it asks which
  features V2 lacks; Vegas reads no environment variable of its own).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import logging
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .async_sched import is_vegas_proposer, wants_async

__all__ = [
    "PATCHES",
    "Patch",
    "VLLM_VERSION",
    "VllmVersionError",
    "check_vllm",
    "patch_attention",
    "patch_bookkeeping",
    "patch_config_check",
    "patch_draft_graph_capture",
    "patch_draft_probs_gather",
    "patch_plain_step_graphs",
    "patch_runner_binding",
    "patch_scheduler_lookahead",
    "patch_scheduler_switch",
    "patch_v2_coupled_verification",
    "patch_v2_execute_model",
    "patch_v2_init_speculator",
    "patch_v2_runner",
    "patch_v2_unsupported_check",
    "scheduler_switch",
    "stacked_draft_probs",
    "time_runner_forward",
]

logger = logging.getLogger("vegas.vllm")

#: the one vLLM release Vegas supports (every entry of :data:`PATCHES` is written against it)
VLLM_VERSION = "0.24.0"


class VllmVersionError(RuntimeError):
    """The installed vLLM is not :data:`VLLM_VERSION`, or a function Vegas replaces changed."""


@dataclass(frozen=True)
class Patch:
    """One vLLM object Vegas replaces.

    Attributes:
        target: ``"module:Qualified.name"`` of the replaced function.
        params: its parameter names in vLLM :data:`VLLM_VERSION` (``inspect.signature``).
        why: what the replacement does and why vLLM offers no other way.
        imported_by: a vLLM module that imports ``target`` by name and must still do so (the
            patch then sets that module's name too), or ``""``.
    """

    target: str
    params: tuple[str, ...]
    why: str
    imported_by: str = ""


_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_GRAPHS = "vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager"

#: every vLLM object Vegas replaces, checked once by :func:`check_vllm` at plugin registration
PATCHES: tuple[Patch, ...] = (
    Patch("vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.forward",
          ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output", "output_scale",
           "output_block_scale"),
          "draft calls attend over the page-size-1 view; verification calls collect the selection scores "
          "(patch_attention). vLLM has no attention hook."),
    Patch("vllm.v1.core.sched.scheduler:Scheduler.__init__",
          ("self", "vllm_config", "kv_cache_config", "structured_output_manager", "block_size", "hash_block_size",
           "mm_registry", "include_finished_set", "log_stats"),
          "KV slots for γ lookahead tokens, as vLLM allocates for EAGLE only (patch_scheduler_lookahead)"),
    Patch("vllm.config.vllm:VllmConfig.__post_init__", ("self",),
          "keep async scheduling on for the Vegas proposer (vLLM turns it off for custom_class) and capture CUDA "
          "graphs up to 2 x (γ + 1) x max_num_seqs tokens (patch_config_check)"),
    Patch("vllm.config.vllm:VllmConfig.compute_hash", ("self",),
          "leave additional_config['vegas'] out of the config hash that keys vLLM's compile cache: the Vegas "
          "settings change no compiled graph, so engines that differ only in them share one compilation "
          "(patch_compile_hash)"),
    Patch(f"{_RUNNER}._get_spec_decode_draft_probs", ("self", "spec_decode_metadata"),
          "one view instead of vLLM's per-request gather of draft probabilities (patch_draft_probs_gather)"),
    Patch(f"{_RUNNER}._bookkeeping_sync",
          ("self", "scheduler_output", "sampler_output", "logits", "hidden_states", "num_scheduled_tokens"),
          "async scheduling: publish the sampled tokens before bookkeeping, where vLLM does for EAGLE "
          "(patch_bookkeeping)"),
    Patch(f"{_RUNNER}.capture_model", ("self",),
          "capture the draft graphs right after vLLM's graphs, at engine start (patch_draft_graph_capture)"),
    Patch(f"{_RUNNER}.load_model", ("self", "load_dummy_weights"),
          "hand the runner to the proposer before it loads the model: vLLM builds a custom_class proposer "
          "with vllm_config only and calls its load_model with the model only (patch_runner_binding)"),
    Patch(f"{_RUNNER}._model_forward",
          ("self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds", "model_kwargs"),
          "CUDA events around one runner's forward, for the proposer's timings (time_runner_forward, per instance)"),
    Patch("vllm.config.vllm:VllmConfig._get_v2_model_runner_unsupported_features", ("self",),
          "let the Vegas proposer onto the V2 model runner, which vLLM refuses for custom_class "
          "(patch_v2_unsupported_check)"),
    Patch("vllm.v1.core.sched.async_scheduler:AsyncScheduler._update_after_schedule", ("self", "scheduler_output"),
          "decide per step whether the next step verifies drafts (0 or γ slots) before the async scheduler "
          "reserves them: vLLM sets num_spec_tokens_to_schedule only from dynamic speculative decoding, which "
          "V2 refuses (patch_scheduler_switch)"),
    Patch("vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
          ("self", "scheduler_output", "model_runner_output"),
          "report each step's emitted tokens to the Vegas step switch (its measured fallback) "
          "(patch_scheduler_switch)"),
    Patch("vllm.v1.worker.gpu.model_runner:GPUModelRunner.execute_model",
          ("self", "scheduler_output", "intermediate_tensors", "dummy_run", "skip_attn_for_dummy_run",
           "is_profile"),
          "hand the step's num_spec_tokens_to_schedule to the Vegas speculator before the forward selects: the V2 "
          "runner keeps no SchedulerOutput (patch_v2_execute_model)"),
    Patch("vllm.v1.worker.gpu.spec_decode:init_speculator", ("vllm_config", "device"),
          "build the Vegas speculator on the V2 runner: vLLM's function is a fixed if-chain without a registry "
          "(patch_v2_init_speculator)",
          imported_by="vllm.v1.worker.gpu.model_runner"),
    Patch("vllm.v1.worker.gpu.spec_decode.rejection_sampler:RejectionSampler.__call__",
          ("self", "logits", "input_batch", "draft_logits"),
          "mark the batch rows with an explicit seed of a Vegas engine with vllm.seeded_verification='coupled', "
          "for the coupled verification below (patch_v2_coupled_verification)"),
    Patch("vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils:rejection_sample",
          ("target_logits", "draft_logits", "draft_sampled", "cu_num_logits", "pos", "idx_mapping",
           "expanded_idx_mapping", "expanded_local_pos", "temperature", "seed", "num_speculative_steps",
           "synthetic_conditional_rates", "use_fp64"),
          "emit the target's own seeded sample at every verified position of those rows (Gumbel-max coupling, "
          "vegas.vllm_plugin.coupling): vLLM's rejection sampling has no per-request verification rule "
          "(patch_v2_coupled_verification)",
          imported_by="vllm.v1.worker.gpu.spec_decode.rejection_sampler"),
    Patch(f"{_GRAPHS}._init_candidates", ("self",),
          "add FULL graphs of query length 1 for the plain steps of an engine with the step switch: vLLM captures "
          "its FULL decode graphs for query length γ + 1 only (patch_plain_step_graphs)"),
    Patch(f"{_GRAPHS}.dispatch", ("self", "num_reqs", "num_tokens", "uniform_token_count", "num_active_loras"),
          "replay those graphs for a step the scheduler marked skipped, or for any query-length-1 batch when they "
          "select (select_in_draft without the measured fallback) (patch_plain_step_graphs)"),
    Patch(f"{_GRAPHS}.capture", ("self", "create_forward_fn", "progress_bar_desc"),
          "capture those graphs with the selection skipped, unless they select (patch_plain_step_graphs)"),
)

_BY_TARGET = {p.target: p for p in PATCHES}


def _resolve(target: str):
    """``(owner, attribute name, object)`` of ``"module:Qualified.name"``.

    Raises:
        VllmVersionError: the module or an attribute on the way is missing.
    """
    module, _, qualname = target.partition(":")
    try:
        owner = importlib.import_module(module)
        *path, attr = qualname.split(".")
        for name in path:
            owner = getattr(owner, name)
        return owner, attr, getattr(owner, attr)
    except (ImportError, AttributeError) as e:
        raise VllmVersionError(
            f"vegas: {target} is missing ({e}); Vegas supports vLLM {VLLM_VERSION} only"
        ) from e


def _params(target: str) -> tuple[str, ...]:
    """The parameter names of ``target``: of the live object when its module is imported (our
    own wrapper: of what it wraps), else read from the module's source with :mod:`ast`, so that
    the check imports nothing heavy (vLLM's model runners) into vLLM's API-server process.

    Raises:
        VllmVersionError: the module, class or function is missing, or not callable.
    """
    module, _, qualname = target.partition(":")
    if module in sys.modules:
        _, _, func = _resolve(target)
        if not callable(func):
            raise VllmVersionError(f"vegas: {target} is not callable; Vegas supports vLLM {VLLM_VERSION} only")
        func = getattr(func, "_vegas_original", func)
        return tuple(inspect.signature(func).parameters)
    try:
        spec = importlib.util.find_spec(module)
        with open(spec.origin, encoding="utf-8") as f:  # type: ignore[union-attr]
            tree = ast.parse(f.read())
    except (ImportError, ValueError, AttributeError, TypeError, OSError, SyntaxError):
        _resolve(target)  # no readable source: import the module (raises when missing), read the object
        return _params(target)
    node: ast.AST | None = tree
    for name in qualname.split("."):
        body = getattr(node, "body", [])
        node = next((n for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                     and n.name == name), None)
        if node is None:
            raise VllmVersionError(f"vegas: {target} is missing; Vegas supports vLLM {VLLM_VERSION} only")
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise VllmVersionError(f"vegas: {target} is not a function; Vegas supports vLLM {VLLM_VERSION} only")
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args]
    names += [a.vararg.arg] if a.vararg else []
    names += [x.arg for x in a.kwonlyargs] + ([a.kwarg.arg] if a.kwarg else [])
    return tuple(names)


def check_vllm() -> None:
    """Refuse a vLLM that is not :data:`VLLM_VERSION`, or one where an entry of :data:`PATCHES`
    is missing, takes other parameters, or is no longer imported by name where it was. Called
    by :func:`vegas.vllm_plugin.register` (vLLM's ``vllm.general_plugins`` entry point) and when
    a Vegas drafter starts.

    Raises:
        VllmVersionError: naming the vLLM version found or the function and its parameters,
            and the supported version.
    """
    import vllm

    found = str(getattr(vllm, "__version__", "?"))
    if found.split("+")[0] != VLLM_VERSION:
        raise VllmVersionError(
            f"vegas supports vLLM {VLLM_VERSION} only, found {found}: pip install vllm=={VLLM_VERSION} "
            "(or keep vegas out of this vLLM: VLLM_PLUGINS set to a list without 'vegas')"
        )
    for patch in PATCHES:
        params = _params(patch.target)
        if params != patch.params:
            raise VllmVersionError(
                f"vegas: {patch.target} has parameters {params}, expected {patch.params} as in vLLM "
                f"{VLLM_VERSION}; Vegas supports vLLM {VLLM_VERSION} only"
            )
        if patch.imported_by and not _imports_by_name(patch.imported_by, patch.target):
            raise VllmVersionError(
                f"vegas: {patch.imported_by} no longer imports {patch.target} by name (as vLLM {VLLM_VERSION} "
                f"did); Vegas supports vLLM {VLLM_VERSION} only"
            )


def _imports_by_name(module: str, target: str) -> bool:
    """Whether ``module``'s source has ``from <target module> import <name>`` (True when the
    source cannot be read: the signature check stands alone then). Reads the file, does not
    import the module (vLLM's V2 runner module is heavy)."""
    source_module, _, name = target.partition(":")
    try:
        spec = importlib.util.find_spec(module)
        with open(spec.origin, encoding="utf-8") as f:  # type: ignore[union-attr]
            src = f.read()
    except (ImportError, ValueError, AttributeError, TypeError, OSError):
        return True
    # ``from m import name``, ``from m import a, name`` or ``from m import (\n    name,\n)``
    names = rf"(?:\([^)]*\b{re.escape(name)}\b|[\w \t,]*\b{re.escape(name)}\b)"
    pattern = rf"from[ \t]+{re.escape(source_module)}[ \t]+import[ \t]+{names}"
    return re.search(pattern, src) is not None


def _install(target: str, make: Callable[[Callable], Callable]) -> Callable:
    """Replace the :data:`PATCHES` entry ``target`` by ``make(original)``, once (the
    replacement carries ``_vegas = True`` and ``_vegas_original``); returns what is in force."""
    assert target in _BY_TARGET, f"{target} is not in PATCHES"  # every replacement is in the table
    owner, attr, original = _resolve(target)
    if getattr(original, "_vegas", False):
        return original
    new = make(original)
    new._vegas = True  # type: ignore[attr-defined]
    new._vegas_original = original  # type: ignore[attr-defined]
    setattr(owner, attr, new)
    return new


def patch_attention() -> None:
    """Replace ``vllm.v1.attention.backends.flash_attn.FlashAttentionImpl.forward`` (vLLM 0.24.0).

    A call whose metadata is a :class:`~vegas.vllm_plugin.drafting.attention.DraftMetadata` runs the
    draft attention over the page-size-1 view (:func:`vegas.vllm_plugin.drafting.attention.draft_attention`);
    every other call with metadata (prefill, verification) runs vLLM's FA3 call, then the
    selection hook :meth:`vegas.vllm_plugin.selection.state.SelectionState.on_layer`, unless
    :meth:`~vegas.vllm_plugin.selection.state.SelectionState.verify_layer` ran the layer through FA3 with
    the score output (the optional ``_vegas_fa3_C`` extension, :mod:`vegas.vllm_plugin.selection.fa3_verify`).
    The selection state is the one the drafter attached to the attention layer (``layer``,
    attribute :data:`~vegas.vllm_plugin.selection.state.LAYER_ATTR`, set by
    :func:`~vegas.vllm_plugin.drafting.engine.attention_layers`); a layer without one, or whose state is
    not enabled, runs vLLM's FA3 call only.
    """
    from .drafting.attention import DraftMetadata, draft_attention, layer_index
    from .selection.state import LAYER_ATTR

    def make(original):
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                    output_block_scale=None):
            if isinstance(attn_metadata, dict):  # pragma: no cover - defensive
                attn_metadata = attn_metadata.get(layer.layer_name)
            if isinstance(attn_metadata, DraftMetadata):
                return draft_attention(self, layer, query, kv_cache, attn_metadata, output)
            state = getattr(layer, LAYER_ATTR, None)  # the drafter's SelectionState; None: no Vegas drafter
            if (
                state is not None
                and state.enabled
                and attn_metadata is not None
                and kv_cache.numel() > 0
                and state.verify_layer(self, layer_index(layer.layer_name), query, kv_cache, attn_metadata, output)
            ):
                return output  # FA3 with the score output ran instead (vegas.vllm_plugin.selection.fa3_verify)
            out = original(
                self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
            if state is not None and state.enabled and attn_metadata is not None and kv_cache.numel() > 0:
                state.on_layer(
                    layer_index(layer.layer_name), query, kv_cache, attn_metadata, self.scale, self.logits_soft_cap
                )
            return out

        return forward

    _install("vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.forward", make)


def patch_scheduler_lookahead() -> None:
    """Wrap ``vllm.v1.core.sched.scheduler.Scheduler.__init__`` (vLLM 0.24.0) so that the
    scheduler allocates KV slots for γ lookahead tokens (as for EAGLE): the draft tokens' KV
    entries land in blocks the request owns."""
    def make(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            if is_vegas_proposer(self.vllm_config.speculative_config):
                self.num_lookahead_tokens = max(self.num_lookahead_tokens, self.num_spec_tokens)
                self.vegas_switch = scheduler_switch(self.vllm_config, getattr(self, "use_v2_model_runner", False))

        return __init__

    _install("vllm.v1.core.sched.scheduler:Scheduler.__init__", make)


def scheduler_switch(vllm_config, use_v2_model_runner: bool):
    """The scheduler's per-step draft switch (:class:`vegas.vllm_plugin.step_switch.StepSwitch`)
    of the engine's Vegas settings (``vllm.prefill_skip_tokens``, ``vllm.fallback``) when the
    scheduler decides which steps draft: asynchronous scheduling on the V2 runner, whose
    speculator reads the decision; else None (the V1 proposer decides in its worker, as before)."""
    from .settings import read_settings
    from .step_switch import StepSwitch, prefill_skip_tokens

    if not (use_v2_model_runner and vllm_config.scheduler_config.async_scheduling):
        return None
    options = read_settings(vllm_config)[1].vllm
    gamma = int(vllm_config.speculative_config.num_speculative_tokens)
    return StepSwitch.of(gamma, prefill_skip_tokens(options.prefill_skip_tokens, scheduler_decides=True), bool(options.fallback))


def patch_scheduler_switch() -> None:
    """Wrap ``vllm.v1.core.sched.async_scheduler.AsyncScheduler._update_after_schedule`` and
    ``vllm.v1.core.sched.scheduler.Scheduler.update_from_output`` (vLLM 0.24.0): before the
    async scheduler reserves the next step's draft placeholders, a Vegas scheduler with a switch
    (``vegas_switch``, :func:`scheduler_switch`) sets the step's ``num_spec_tokens_to_schedule``
    to 0 or γ (:meth:`~vegas.vllm_plugin.step_switch.StepSwitch.decide`); every step's output is
    reported to the switch (:meth:`~vegas.vllm_plugin.step_switch.StepSwitch.observe`). No-ops
    for other engines."""
    def make_schedule(original):
        def _update_after_schedule(self, scheduler_output):
            switch = getattr(self, "vegas_switch", None)
            if switch is not None:
                scheduler_output.num_spec_tokens_to_schedule = switch.decide(
                    scheduler_output.num_scheduled_tokens, scheduler_output.scheduled_spec_decode_tokens)
            return original(self, scheduler_output)

        return _update_after_schedule

    def make_output(original):
        def update_from_output(self, scheduler_output, model_runner_output):
            outputs = original(self, scheduler_output, model_runner_output)
            switch = getattr(self, "vegas_switch", None)
            if switch is not None:
                switch.observe(scheduler_output.num_scheduled_tokens, scheduler_output.scheduled_spec_decode_tokens,
                               int(scheduler_output.num_spec_tokens_to_schedule),
                               getattr(model_runner_output, "sampled_token_ids", None))
            return outputs

        return update_from_output

    _install("vllm.v1.core.sched.async_scheduler:AsyncScheduler._update_after_schedule", make_schedule)
    _install("vllm.v1.core.sched.scheduler:Scheduler.update_from_output", make_output)


def patch_v2_execute_model() -> None:
    """Wrap ``vllm.v1.worker.gpu.model_runner.GPUModelRunner.execute_model`` (vLLM 0.24.0) so
    that a real step (not a dummy run) first hands its ``SchedulerOutput`` to the runner's
    speculator when it has ``on_schedule`` (the Vegas speculator), and the runner itself when
    it has ``on_runner``; installed by the speculator, when the runner module is already imported."""
    def make(original):
        def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False,
                          skip_attn_for_dummy_run=False, is_profile=False):
            speculator = getattr(self, "speculator", None)
            if not dummy_run and hasattr(speculator, "on_schedule"):
                speculator.on_schedule(scheduler_output)
            if not dummy_run and hasattr(speculator, "on_runner"):
                speculator.on_runner(self)
            return original(self, scheduler_output, intermediate_tensors, dummy_run, skip_attn_for_dummy_run,
                            is_profile)

        return execute_model

    _install("vllm.v1.worker.gpu.model_runner:GPUModelRunner.execute_model", make)


def patch_v2_coupled_verification() -> None:
    """Wrap the V2 runner's rejection sampling (vLLM 0.24.0) for Gumbel-max coupled
    verification of seeded requests (:mod:`vegas.vllm_plugin.coupling`):

    - ``RejectionSampler.__call__``: when ``draft_logits`` belongs to a Vegas engine that couples
      (:func:`~vegas.vllm_plugin.coupling.engine_for`) and the batch has rows with an explicit
      seed (``sampler.sampling_states.seeds_set``), vLLM's call runs with those rows marked;
      every other call is vLLM's unchanged;
    - ``rejection_sample`` (defined in ``rejection_sampler_utils``, imported by name into
      ``rejection_sampler``): after vLLM's, the marked rows' output becomes the coupled one:
      the target's own sample at each logit (vLLM's ``gumbel_sample`` on the processed logits,
      seed and position, as its plain sampler draws) up to the first draft that differs from it.

    Installed by the V2 speculator of an engine with ``vllm.seeded_verification="coupled"``;
    idempotent. Why: vLLM's V2 rejection sampler has one verification rule for all requests.
    """
    from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

    from . import coupling

    def make_call(original):
        def __call__(self, logits, input_batch, draft_logits=None):
            state = coupling.engine_for(draft_logits)
            rows = None if state is None else state.rows(self.sampler.sampling_states.seeds_set,
                                                         input_batch.idx_mapping_np)
            if rows is None:
                return original(self, logits, input_batch, draft_logits)
            with coupling.coupled(rows, logits.device):
                return original(self, logits, input_batch, draft_logits)

        return __call__

    def make_sample(original):
        def rejection_sample(target_logits, draft_logits, draft_sampled, cu_num_logits, pos, idx_mapping,
                             expanded_idx_mapping, expanded_local_pos, temperature, seed, num_speculative_steps,
                             synthetic_conditional_rates=None, use_fp64=False):
            sampled, num_sampled = original(target_logits, draft_logits, draft_sampled, cu_num_logits, pos,
                                            idx_mapping, expanded_idx_mapping, expanded_local_pos, temperature, seed,
                                            num_speculative_steps, synthetic_conditional_rates, use_fp64)
            rows = coupling.active_rows()
            if rows is not None:
                target = gumbel_sample(target_logits, expanded_idx_mapping, temperature, seed, pos,
                                       apply_temperature=False, use_fp64=use_fp64)
                coupling.couple_rows(sampled, num_sampled, target, draft_sampled, cu_num_logits, rows)
            return sampled, num_sampled

        return rejection_sample

    _install("vllm.v1.worker.gpu.spec_decode.rejection_sampler:RejectionSampler.__call__", make_call)
    new = _install("vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils:rejection_sample", make_sample)
    sys.modules["vllm.v1.worker.gpu.spec_decode.rejection_sampler"].rejection_sample = new


def patch_plain_step_graphs() -> None:
    """Wrap three methods of ``CudaGraphManager`` in ``vllm/v1/worker/gpu/cudagraph_utils.py``
    (vLLM 0.24.0, the V2 runner's CUDA-graph manager) so that an engine that takes plain steps
    replays full CUDA graphs for them (:mod:`vegas.vllm_plugin.plain_graphs`):

    - ``CudaGraphManager._init_candidates``: after vLLM's, a manager whose ``vllm_config`` has
      registered plain-step graphs (:func:`~vegas.vllm_plugin.plain_graphs.lookup`; only the
      runner's ``ModelCudaGraphManager``) also captures FULL graphs of query length 1
      (:meth:`~vegas.vllm_plugin.plain_graphs.PlainStepGraphs.add_descs`);
    - ``CudaGraphManager.dispatch``: a uniform query-length-1 batch whose forward the scheduler
      marked skipped goes to one of them, and so does every other uniform query-length-1 batch
      when they select (:attr:`~vegas.vllm_plugin.plain_graphs.PlainStepGraphs.selects`:
      ``select_in_draft`` without the measured fallback); every other batch to vLLM's dispatch;
    - ``CudaGraphManager.capture``: their forwards (warm-up and captured) run with the selection
      skipped (when they select: as vLLM's own, with it), then one log line says what was captured.

    Installed by the V2 speculator when its engine can take plain steps
    (:func:`~vegas.vllm_plugin.plain_graphs.plain_step_graphs`); every other manager passes through.
    Why: vLLM captures its FULL uniform-decode graphs for query length ``decode_query_len`` = γ + 1
    only, so plain steps ran its piecewise graphs (host-bound, slower than plain vLLM's decode step).
    """
    from . import plain_graphs

    def make_candidates(original):
        def _init_candidates(self):
            original(self)
            graphs = plain_graphs.lookup(getattr(self, "vllm_config", None))
            if graphs is None:
                return
            from vllm.config.compilation import CUDAGraphMode
            from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor, ModelCudaGraphManager

            if isinstance(self, ModelCudaGraphManager):  # the runner's manager, not a drafter's
                graphs.add_descs(self, BatchExecutionDescriptor, CUDAGraphMode.FULL)

        return _init_candidates

    def make_dispatch(original):
        def dispatch(self, num_reqs, num_tokens, uniform_token_count, num_active_loras):
            graphs = getattr(self, "_vegas_plain", None)
            if graphs is not None:
                desc = graphs.dispatch(self, num_reqs, num_tokens, uniform_token_count, num_active_loras)
                if desc is not None:
                    return desc
            return original(self, num_reqs, num_tokens, uniform_token_count, num_active_loras)

        return dispatch

    def make_capture(original):
        def capture(self, create_forward_fn, progress_bar_desc="Capturing CUDA graphs"):
            graphs = getattr(self, "_vegas_plain", None)
            if graphs is None:
                return original(self, create_forward_fn, progress_bar_desc)
            out = original(self, graphs.wrap(create_forward_fn), progress_bar_desc)
            graphs.log_captured(self)
            return out

        return capture

    _install(f"{_GRAPHS}._init_candidates", make_candidates)
    _install(f"{_GRAPHS}.dispatch", make_dispatch)
    _install(f"{_GRAPHS}.capture", make_capture)


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
    def make(original):
        def _get_spec_decode_draft_probs(self, spec_decode_metadata):
            probs, ids = self._draft_probs, self._draft_prob_req_ids
            if probs is not None and ids is not None and probs.dim() == 3:
                fast = stacked_draft_probs(probs, ids, self.input_batch.req_ids, spec_decode_metadata.num_draft_tokens)
                if fast is not None:
                    return fast
            return original(self, spec_decode_metadata)

        return _get_spec_decode_draft_probs

    _install(f"{_RUNNER}._get_spec_decode_draft_probs", make)


def one_kv_group(vllm_config) -> None:
    """For the Vegas proposer, ask vLLM for one KV-cache group when the user has not decided
    (``disable_hybrid_kv_cache_manager`` None): a model with sliding-window and full-attention
    layers (Gemma 2) then keeps every layer's KV in one group, as Vegas's draft tables address
    one group. The sliding-window layers keep KV for every position (vLLM's hybrid manager would
    drop what falls out of the window): said once in the log. An explicit
    ``disable_hybrid_kv_cache_manager=False`` stays, and the drafter refuses two groups."""
    from .async_sched import is_vegas_proposer

    scheduler = getattr(vllm_config, "scheduler_config", None)
    if (scheduler is None or not is_vegas_proposer(getattr(vllm_config, "speculative_config", None))
            or getattr(scheduler, "disable_hybrid_kv_cache_manager", False) is not None):
        return
    scheduler.disable_hybrid_kv_cache_manager = True
    _log_once("one_kv_group", "vegas: one KV-cache group (disable_hybrid_kv_cache_manager=True): sliding-window "
              "layers, if the model has any, keep KV for every position")


def patch_config_check() -> None:
    """Wrap ``vllm.config.VllmConfig.__post_init__`` (vLLM 0.24.0) so that the Vegas proposer
    keeps async scheduling (:func:`vegas.vllm_plugin.async_sched.wants_async`); vLLM turns it
    off, or refuses it, for a ``custom_class`` proposer. Applies what vLLM applies with it (no
    cascade attention). Also asks for one KV-cache group (:func:`one_kv_group`) and widens the
    CUDA-graph capture sizes for verification batches
    (:func:`~vegas.vllm_plugin.graph_sizes.widen_capture_sizes`)."""
    from .graph_sizes import widen_capture_sizes

    def make(original):
        def __post_init__(self):
            one_kv_group(self)
            if is_vegas_proposer(getattr(self, "speculative_config", None)):
                widen_capture_sizes(self)
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

        return __post_init__

    _install("vllm.config.vllm:VllmConfig.__post_init__", make)


def patch_compile_hash() -> None:
    """Wrap ``vllm.config.VllmConfig.compute_hash`` (vLLM 0.24.0) so that the hash, which keys
    vLLM's ``torch.compile`` cache, leaves ``additional_config["vegas"]`` out.

    vLLM hashes the whole ``additional_config``: every selector, budget or other Vegas setting
    would compile the model anew (20-30 s per engine on an H200). The Vegas settings change no
    compiled graph: attention (where Vegas acts) is a splitting op that runs outside the
    compiled pieces, and what Vegas changes in the compilation config (piecewise verification
    graphs) is hashed with the compilation config. Other ``additional_config`` keys still count.
    """
    def make(original):
        def compute_hash(self):
            extra = self.additional_config
            if not isinstance(extra, dict) or "vegas" not in extra:
                return original(self)
            self.additional_config = {k: v for k, v in extra.items() if k != "vegas"}
            try:
                return original(self)
            finally:
                self.additional_config = extra

        return compute_hash

    _install("vllm.config.vllm:VllmConfig.compute_hash", make)


def patch_bookkeeping() -> None:
    """Wrap ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._bookkeeping_sync`` (vLLM 0.24.0):
    under async scheduling, call the Vegas proposer's ``publish_sampled`` right before it (where
    vLLM's EAGLE path publishes the next tokens and valid counts in ``sample_tokens``)."""
    def make(original):
        def _bookkeeping_sync(self, scheduler_output, sampler_output, *args, **kwargs):
            publish = getattr(getattr(self, "drafter", None), "publish_sampled", None)
            if publish is not None and self.use_async_spec_decode:
                publish(scheduler_output, sampler_output.sampled_token_ids)
            return original(self, scheduler_output, sampler_output, *args, **kwargs)

        return _bookkeeping_sync

    _install(f"{_RUNNER}._bookkeeping_sync", make)


def patch_draft_graph_capture() -> None:
    """Wrap ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.capture_model`` (vLLM 0.24.0, V1
    runner): after vLLM captured its graphs, a drafter with ``capture_draft_graphs`` (the Vegas
    proposer) captures its draft graphs, and their memory is added to what ``capture_model``
    reports. Without it the V1 proposer captured them lazily, inside the first requests' steps
    (0.1-0.3 s each; three in the first serving run of
    ``benchmarks/results/vllm_h200_2026-12-01_profile/``)."""
    def make(original):
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

        return capture_model

    _install(f"{_RUNNER}.capture_model", make)


def patch_runner_binding() -> None:
    """Wrap ``GPUModelRunner.load_model`` (V1 runner): before vLLM loads the model (and calls
    ``drafter.load_model(model)``), a drafter with ``bind_runner`` (the Vegas proposer) gets the
    runner. Why: vLLM 0.24.0 builds a ``custom_class`` proposer with ``vllm_config`` only
    (``vllm/v1/spec_decode/custom_class_proposer.py``) and hands its ``load_model`` the model
    only, yet the proposer drafts with the runner's block tables, input buffers and CUDA-graph
    dispatcher."""
    def make(original):
        def load_model(self, *args, **kwargs):
            bind = getattr(getattr(self, "drafter", None), "bind_runner", None)
            if bind is not None:
                bind(self)
            return original(self, *args, **kwargs)

        return load_model

    _install(f"{_RUNNER}.load_model", make)


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

_V2_UNSUPPORTED = "speculative method 'custom_class'"
_logged: set[str] = set()


def _log_once(key: str, msg: str, *args, level: int = logging.INFO) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.log(level, msg, *args)


def patch_v2_unsupported_check() -> None:
    """Replace ``vllm.config.VllmConfig._get_v2_model_runner_unsupported_features`` (vLLM 0.24.0)
    with a wrapper that drops ``"speculative method 'custom_class'"`` for a Vegas engine; every
    other engine and every other entry is unchanged. Idempotent. (``VLLM_USE_V2_MODEL_RUNNER``
    set decides the runner before vLLM calls this.)

    Why: vLLM 0.24.0 lists every speculative method but eagle/eagle3/mtp/dflash as unsupported
    by the V2 runner, so it would refuse (``VLLM_USE_V2_MODEL_RUNNER=1``) or skip V2.

    """
    def make(original):
        def _get_v2_model_runner_unsupported_features(self) -> list[str]:
            unsupported = original(self)
            if not is_vegas_proposer(self.speculative_config):
                return unsupported
            kept = [u for u in unsupported if u != _V2_UNSUPPORTED]
            if kept:
                _log_once("v2-blocked", "vegas: V2 model runner asked for, but vLLM does not support %s here",
                          ", ".join(kept))
            else:
                _log_once("v2", "vegas: V2 model runner allowed for the Vegas speculator")
            return kept

        return _get_v2_model_runner_unsupported_features

    _install("vllm.config.vllm:VllmConfig._get_v2_model_runner_unsupported_features", make)


def patch_v2_init_speculator(build: Callable) -> None:
    """Replace ``vllm.v1.worker.gpu.spec_decode.init_speculator`` (vLLM 0.24.0) with a wrapper
    that returns ``build(vllm_config, device)`` for a Vegas engine (the caller's builder of
    :class:`~vegas.vllm_plugin.runners.v2.VegasSpeculator`: this module does not import the
    speculator, which imports the proposer) and calls vLLM's function otherwise. Idempotent.

    The V2 runner module imports the function by name (``from vllm.v1.worker.gpu.spec_decode
    import init_speculator``) and calls it in ``GPUModelRunner.__init__``: the package attribute
    is patched before that import, and ``vllm.v1.worker.gpu.model_runner.init_speculator`` too
    when the runner module is already imported (it is not imported here: it is heavy).

    Why: vLLM's ``init_speculator`` is a fixed if-chain (dflash, gemma4 MTP, mtp, eagle) that
    raises ``NotImplementedError`` for ``custom_class``; it has no registry.

    """
    def make(original):
        def init_speculator(vllm_config, device):
            if not is_vegas_proposer(vllm_config.speculative_config):
                return original(vllm_config, device)
            return build(vllm_config, device)

        return init_speculator

    new = _install("vllm.v1.worker.gpu.spec_decode:init_speculator", make)
    runner_mod = sys.modules.get("vllm.v1.worker.gpu.model_runner")
    if runner_mod is not None:
        runner_mod.init_speculator = new


def patch_v2_runner(build: Callable) -> None:
    """Both V2 patches (idempotent; ``build``: see :func:`patch_v2_init_speculator`)."""
    patch_v2_unsupported_check()
    patch_v2_init_speculator(build)
