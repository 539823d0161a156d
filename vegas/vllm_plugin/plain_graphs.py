"""Full CUDA graphs for the plain steps of a Vegas engine on vLLM's V2 runner (pure Python; no
vLLM import: the vLLM classes come in as arguments).

With the step switch on (:mod:`~vegas.vllm_plugin.step_switch`: asynchronous scheduling and
``vllm.fallback`` or ``vllm.prefill_skip_tokens``) a step the scheduler gives no draft slots
selects and drafts nothing, and the step after it verifies one token per request: a plain step.
vLLM 0.24.0's V2 CUDA-graph manager (``vllm/v1/worker/gpu/cudagraph_utils.py``,
``CudaGraphManager``) captures its FULL uniform-decode graphs for query length
``decode_query_len`` = γ + 1 only, so a plain step (uniform query length 1) ran vLLM's piecewise
graphs, host-bound and slower than plain vLLM's full-graph decode step.

:class:`PlainStepGraphs` adds FULL graphs of query length 1 (``num_reqs = num_tokens``) to that
manager, through :func:`~vegas.vllm_plugin.patches.patch_plain_step_graphs`:

* which sizes (:func:`plain_sizes`): vLLM's capture sizes up to ``max_num_seqs`` (vLLM rounds
  them to multiples of γ + 1, ``adjust_cudagraph_sizes_for_spec_decode``) and ``max_num_seqs``
  itself, so that every plain batch up to ``max_num_seqs`` requests has a graph; a batch of 3
  one-token requests replays the 5-request graph at γ = 4, padded as vLLM pads its decode graphs
  (``_is_compatible``: same uniform count, at least as many requests and tokens). vLLM's capture
  inputs for such a descriptor are query length 1 (``prepare_inputs_to_capture`` ->
  ``InputBatch.make_dummy(num_reqs, num_tokens)`` gives each request ``num_tokens // num_reqs``
  = 1 token);
* whether they select (:attr:`PlainStepGraphs.selects`, decided once by
  :func:`plain_step_graphs`, before vLLM captures): with the selection deferred to the draft
  phase (``SelectionState.select_in_draft``: the verification forward only keeps each layer's
  collect queries and a few per-request buffers,
  :meth:`~vegas.vllm_plugin.selection.state.SelectionState.defer_selection`) and no measured
  fallback (``vllm.fallback`` off: the prefill skip alone), yes; else no (the measured fallback's
  plain steps must cost what plain vLLM's steps cost, and a selection done in the verification
  would put a score pass and a top-k into every plain step);
* selecting graphs are captured as vLLM's γ + 1 FULL graphs are (the selection runs in their
  forwards) and replayed for every uniform query-length-1 batch that fits, whether the scheduler
  marked its step skipped (``SelectionState.scheduled_skip``, set by the speculator's
  ``on_schedule`` before vLLM dispatches) or not. A selecting step (the first drafting step after
  a skipped one) thus computes what vLLM's piecewise path computes for that batch:
  :func:`~vegas.vllm_plugin.selectors.plan.make_plan` reads each request's chunk from
  ``query_start_loc`` (any length up to γ + 1, here 1; a padded request has length 0 and scores
  nothing, as in the γ + 1 graphs), its widths are static (the selector's score rows, the
  budget at ``max_model_len``) and what ``defer_selection`` keeps on the host (key caches,
  scale, width) is the same for every forward. A skipped step that replays one writes the collect
  queries and per-request buffers needlessly but harmlessly: its drafter drafts nothing (the
  speculator's ``drafts_next`` is 0) and the next selecting forward rewrites them for its batch;
* skipped graphs are captured with the selection skipped
  (:meth:`~vegas.vllm_plugin.selection.state.SelectionState.skipping` around each forward vLLM
  captures or warms up for them: no score pass, no top-k, nothing of Vegas is recorded in them)
  and replayed only for a forward the scheduler marked skipped (``scheduled_skip is True``): the
  forward the piecewise path would run, whose selection skips too. A uniform query-length-1 batch
  that selects dispatches as vLLM would (its piecewise graphs);
* vLLM's candidate lists are left as they are, so mixed batches and γ + 1 batches dispatch as
  vLLM would;
* after a replay no Python of Vegas ran: after a skipped step the drafter still drafts nothing
  (``drafts_next`` is 0, set by the same ``on_schedule``), and the selection plan is read only by
  the Python of the forward that made it (a forward's later layers), never after a replay.

Only for the engines that can take plain steps, with vLLM's separate FULL decode routine
(``FULL_AND_PIECEWISE`` or ``FULL_DECODE_ONLY``), γ > 0, no LoRA and one data-parallel rank (the
ranks of a data-parallel engine decide their steps apart, and would then disagree on the graph
mode vLLM syncs); every other engine's manager is unchanged.
"""

from __future__ import annotations

import bisect
import logging
import weakref
from collections.abc import Callable, Iterable

__all__ = ["PlainStepGraphs", "lookup", "plain_sizes", "plain_step_graphs"]

logger = logging.getLogger("vegas.vllm")

#: the engines of this process whose plain steps get full graphs, by ``id(vllm_config)`` (the
#: speculator and vLLM's CUDA-graph manager are built with the same ``VllmConfig`` object)
_ENGINES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def plain_sizes(capture_sizes: Iterable[int], max_num_seqs: int, multiple: int = 1) -> list[int]:
    """Batch sizes (requests = tokens) of the plain-step graphs: the capture sizes up to
    ``max_num_seqs`` and ``max_num_seqs`` itself when the capture sizes reach it, each a multiple
    of ``multiple`` (the tensor-parallel size under sequence parallelism, as vLLM requires).
    Empty without capture sizes."""
    sizes = sorted({int(s) for s in capture_sizes or ()})
    if not sizes or max_num_seqs < 1:
        return []
    out = {s for s in sizes if s <= max_num_seqs}
    top = min(max_num_seqs, sizes[-1])
    out.add(top - top % multiple)
    return sorted(s for s in out if s > 0 and s % multiple == 0)


class PlainStepGraphs:
    """The full graphs of one engine's plain steps (the V2 speculator owns one).

    Args:
        state: the speculator's selection state (its ``scheduled_skip`` says whether a step skips).
        vllm_config: the engine's ``VllmConfig`` (the object vLLM's CUDA-graph manager gets).
        selects: capture the graphs with the selection and replay them for every uniform
            query-length-1 batch (see the module); False: captured skipped, replayed for skipped
            steps only. Fixed before vLLM captures.
    """

    def __init__(self, state, vllm_config, selects: bool = False) -> None:
        self.state = state
        self.vllm_config = vllm_config
        self.selects = selects
        #: the q-len-1 FULL descriptors, ascending by tokens (empty until vLLM's manager took them)
        self.descs: list = []
        self._sizes: list[int] = []
        #: skipped steps dispatched to one of them (host count, ``stats()["plain_full_graph_steps"]``)
        self.steps = 0
        #: steps that select (``scheduled_skip`` not True) dispatched to one of them, only when
        #: :attr:`selects` (host count, ``stats()["q1_select_graph_steps"]``)
        self.select_steps = 0

    def add_descs(self, manager, desc_cls: Callable, full) -> list:
        """After vLLM's ``CudaGraphManager._init_candidates``: add the q-len-1 ``full``
        (``CUDAGraphMode.FULL``) descriptors (``desc_cls``: ``BatchExecutionDescriptor``) to what
        ``manager`` captures, and mark the manager as ours (``manager._vegas_plain``); its
        candidate lists stay vLLM's. Nothing when the manager has no separate FULL decode routine,
        γ = 0 or LoRA cases (one data-parallel rank: :func:`plain_step_graphs`). Returns the
        descriptors added."""
        mode = manager.cudagraph_mode
        if not (mode and mode.separate_routine() and mode.decode_mode() == full):
            return []
        if manager.decode_query_len <= 1 or list(manager.lora_capture_cases) != [0]:
            return []
        compilation = manager.compilation_config
        multiple = 1
        if manager.tp_size > 1 and getattr(getattr(compilation, "pass_config", None), "enable_sp", False):
            multiple = manager.tp_size
        sizes = plain_sizes(compilation.cudagraph_capture_sizes, manager.max_num_reqs, multiple)
        if not sizes:
            return []
        self.descs = [desc_cls(cg_mode=full, num_tokens=n, num_reqs=n, uniform_token_count=1) for n in sizes]
        self._sizes = sizes
        captured = manager._capture_descs.setdefault(full, [])
        captured.extend(self.descs)
        captured.sort(key=lambda d: d.num_tokens, reverse=True)  # vLLM captures the largest first
        manager._vegas_plain = self
        return self.descs

    def dispatch(self, manager, num_reqs: int, num_tokens: int, uniform_token_count: int | None,
                 num_active_loras: int):
        """The q-len-1 FULL descriptor for this batch when its requests all have one token, the
        graphs are captured and either they select (:attr:`selects`) or the forward skips (the
        scheduler's decision, ``state.scheduled_skip is True``); else None (vLLM's own dispatch
        decides). Counts :attr:`steps` (skipped) or :attr:`select_steps` (any other)."""
        skipped = self.state.scheduled_skip is True
        if (not (skipped or self.selects) or uniform_token_count != 1 or num_active_loras
                or not self._sizes or not manager._graphs_captured or num_tokens <= 0 or num_reqs > num_tokens):
            return None
        i = bisect.bisect_left(self._sizes, num_tokens)
        if i == len(self._sizes):
            return None  # more requests than the largest plain graph: vLLM's path
        if skipped:
            self.steps += 1
        else:
            self.select_steps += 1
        return self.descs[i]

    def wrap(self, create_forward_fn: Callable) -> Callable:
        """vLLM's ``create_forward_fn(desc, warmup)`` (``CudaGraphManager.capture``) with the
        forwards of the plain-step descriptors (warm-up and captured) run with the selection
        skipped; every other descriptor's forward is vLLM's. When they select (:attr:`selects`):
        ``create_forward_fn`` itself (they capture the selection, as vLLM's γ + 1 graphs do)."""
        if self.selects:
            return create_forward_fn
        plain = set(self.descs)
        state = self.state

        def create(desc, warmup):
            forward_fn, attn_state = create_forward_fn(desc, warmup=warmup)
            if desc not in plain:
                return forward_fn, attn_state

            def skipped_forward(cg_mode):
                with state.skipping():
                    return forward_fn(cg_mode)

            return skipped_forward, attn_state

        return create

    def log_captured(self, manager) -> int:
        """After vLLM's capture: log how many requests the plain-step graphs cover; returns that
        number (0 when none was captured)."""
        graphs = getattr(manager, "graphs", {})
        captured = [d for d in self.descs if d in graphs]
        if not captured:
            return 0
        top = max(d.num_reqs for d in captured)
        logger.info("vegas: full CUDA graphs for plain steps (query length 1) up to %d requests (%d graphs%s)",
                    top, len(captured), ", with the selection: select_in_draft" if self.selects else "")
        return top


def plain_step_graphs(state, vllm_config, scheduled_switch: bool, fallback: bool = False) -> PlainStepGraphs | None:
    """The plain-step graphs of a V2 speculator's engine, registered for vLLM's CUDA-graph manager
    (:func:`lookup`), when it can take plain steps (``scheduled_switch``: the scheduler decides
    which steps draft), verification runs in full CUDA graphs (``state.frozen``) and the engine
    has one data-parallel rank; else None (vLLM's manager stays as it is). They select
    (:attr:`PlainStepGraphs.selects`) when ``state.select_in_draft`` (set by
    :func:`~vegas.vllm_plugin.runners.start.use_path`, before this call) and no measured
    fallback (``fallback``: ``VegasConfig.vllm.fallback``)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    if not scheduled_switch or not state.frozen or int(getattr(parallel, "data_parallel_size", 1) or 1) != 1:
        return None
    graphs = PlainStepGraphs(state, vllm_config, selects=bool(state.select_in_draft) and not fallback)
    _ENGINES[id(vllm_config)] = graphs
    return graphs


def lookup(vllm_config) -> PlainStepGraphs | None:
    """The registered plain-step graphs of the engine of ``vllm_config`` (the same object), or None."""
    graphs = _ENGINES.get(id(vllm_config))
    return graphs if graphs is not None and graphs.vllm_config is vllm_config else None
