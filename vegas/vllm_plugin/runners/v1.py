"""Vegas as a vLLM speculative proposer (``speculative_config.method = "custom_class"``), on
vLLM's V1 model runner. Users name it by its public class path
``vegas.vllm_plugin.proposer.VegasProposer`` (:mod:`vegas.vllm_plugin.proposer`).

``VegasProposer`` is built by vLLM's V1 GPU model runner with ``vllm_config`` only; the runner
is handed to it by the patched ``GPUModelRunner.load_model`` (:meth:`VegasProposer.bind_runner`,
no call-stack walk), so it reuses the runner's model (the target itself: no second copy of weights or cache), its paged KV
cache, its block tables and its compiled model.

Its settings (:mod:`vegas.vllm_plugin.settings`): a selector, built through the plugin registry,
and a :class:`~vegas.config.VegasConfig`. A selector with a registered fast path keeps
verification in vLLM's full CUDA graphs (``VegasConfig.vllm.verify_cuda_graphs="full"``, the
default) with the selection captured into them; ``"piecewise"`` runs attention eagerly (the
selector can then change at run time). Any other selector runs on the generic path
(:mod:`vegas.vllm_plugin.selectors.generic`), which forces piecewise verification graphs.

After each verification step (``propose`` runs after the runner's bookkeeping, same
``execute_model`` call) it drafts γ tokens per request (:mod:`vegas.vllm_plugin.drafting.engine`).
Drafts are sampled by vLLM's seeded Gumbel-max kernel with noise keyed by each request's seed
and the draft position (:mod:`vegas.vllm_plugin.runners.seeds`), never from a stream the batch
shares; a seeded request's output still depends on its drafts under rejection sampling (the
drafts follow the KV selection's batch numerics), unless ``vllm.seeded_verification="coupled"`` (the default)
withholds its drafts (:func:`~vegas.vllm_plugin.coupling.withhold_drafts`). Draft probabilities are handed to
vLLM's rejection sampler (``runner._draft_probs``), so sampling keeps the target distribution
with full acceptance rates; greedy requests use vLLM's greedy path (token-identical up to bf16
batch effects).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ...config import VegasConfigError
from .. import patches
from ..async_sched import draft_start_positions, next_tokens_and_counts
from ..coupling import withhold_drafts
from ..drafting.engine import GREEDY_TEMPERATURE, DraftEngine, DraftSampler, attention_layers, draft_graph_key
from ..selection.state import SelectionState
from ..stats import StatsRecorder, timing_event
from .seeds import RequestSeeds, seeded_sampler
from .start import reserve_selection_buffers, start_drafter, use_path

__all__ = ["VegasProposer"]

logger = logging.getLogger("vegas.vllm")


class VegasProposer:
    """vLLM custom-class proposer: self-speculative drafting with verification-guided sparse attention.

    Settings come from ``additional_config["vegas"]`` (:func:`vegas.vllm_plugin.settings.read_settings`),
    γ from ``speculative_config``; they can be changed at run time with
    ``LLM.collective_rpc("vegas_configure", ...)`` (piecewise verification graphs only).

    Raises:
        VegasConfigError: an unsupported engine setting or bad Vegas settings.
    """

    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self.gamma = int(vllm_config.speculative_config.num_speculative_tokens)
        #: this worker's selection state: written by the attention override (it finds the state
        #: on each attention layer, :data:`~vegas.vllm_plugin.selection.state.LAYER_ATTR`), read by the drafting
        self.state = SelectionState()
        self.selector, self._settings = start_drafter(self.state, vllm_config, self.gamma)
        #: vLLM's V1 ``GPUModelRunner``: handed over by :meth:`bind_runner` before ``load_model``
        self.runner = None
        name = self.selector.name
        self.config = self.selector.config
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        patches.patch_draft_probs_gather()
        patches.patch_bookkeeping()
        patches.patch_draft_graph_capture()
        patches.patch_runner_binding()
        self.recorder = StatsRecorder()
        self._drafted: set[str] = set()
        #: async scheduling: the last step's (req_ids, next_ids, counts, host values on the
        #: device [backup, drafts scheduled, blocks in use], drafts scheduled on the host)
        self._published: tuple | None = None
        self._layers_known = False
        self._checked_groups = False
        #: each request's draft-noise seed (its ``SamplingParams.seed``, else one drawn for it)
        self.seeds = RequestSeeds()
        self._samplers: dict[bool, DraftSampler] = {}
        self.drafting = DraftEngine(
            vllm_config, self.state, self.gamma, self.config.vllm, None,  # the device: at load_model
            block_table=lambda: self.runner.input_batch.block_table[0].block_table.gpu,  # [max_reqs, max_blocks] int32
            model=lambda: self.runner.model,
        )
        logger.info("vegas proposer: gamma=%d tp=%d selector=%s config=%s", self.gamma, self.tp_size, name, self.config)

    @property
    def stats(self):
        return self.recorder.stats

    @property
    def req_stats(self) -> dict[str, list[int]]:
        """request id -> [iterations, drafted, accepted] since the last reset"""
        return self.recorder.requests

    @property
    def async_scheduling(self) -> bool:
        """vLLM's async scheduling (see :mod:`vegas.vllm_plugin.async_sched`): drafts start from
        device tensors published before the runner's bookkeeping."""
        return bool(getattr(self.runner, "use_async_scheduling", False))

    # ---- vLLM hooks -------------------------------------------------------------------------
    def bind_runner(self, runner) -> None:
        """The V1 ``GPUModelRunner`` that built this proposer (called by the patched
        ``GPUModelRunner.load_model``, :func:`~vegas.vllm_plugin.patches.patch_runner_binding`:
        vLLM 0.24.0 passes a ``custom_class`` proposer ``vllm_config`` only)."""
        self.runner = runner

    def load_model(self, target_model) -> None:
        """Called by the runner with the target model; Vegas drafts with that same model.

        Raises:
            RuntimeError: no runner was bound (``GPUModelRunner.load_model`` not patched).
        """
        self._target = target_model
        if self.runner is None:
            raise RuntimeError("vegas: vLLM's GPU model runner was not handed to the proposer "
                               "(vegas.vllm_plugin.patches.patch_runner_binding did not run)")
        self.drafting.device = self.runner.device
        use_path(self.state, self.selector, self._settings, self.gamma, self.runner.device, runner="v1")
        # the layers are registered once the model is built: learn them before the first
        # forward (the prefill), whose last queries give the first selection
        self._init_layers()
        self._reserve_buffers()
        patches.time_runner_forward(
            self.runner, lambda start, end: self.recorder.add_forward(self.state.fwd_events, start, end)
        )

    # ---- helpers ----------------------------------------------------------------------------
    def _reserve_buffers(self) -> None:
        """Selection buffers at their largest (before vLLM captures CUDA graphs)."""
        max_seqs = self.vllm_config.scheduler_config.max_num_seqs
        reserve_selection_buffers(self.state, self.vllm_config, self.selector, self.gamma, max_seqs, self.runner.device)

    def _init_layers(self) -> None:
        self.drafting.set_layers(attention_layers(self.vllm_config, self.state))
        self._layers_known = True

    def capture_draft_graphs(self) -> int:
        """Every draft graph, greedy and sampling, at engine start (:meth:`DraftEngine.capture`)."""
        return self.drafting.capture(self._graph_cap(), [
            ((sampling,), self._sampler(sampling), sampling, 0) for sampling in (True, False)
        ])

    def _sampler(self, sampling: bool) -> DraftSampler:
        """The draft sampler of a batch with (``sampling``) or without sampling rows
        (:func:`~vegas.vllm_plugin.runners.seeds.seeded_sampler`), one per kind for the engine's life."""
        sample = self._samplers.get(sampling)
        if sample is None:
            model_config = self.vllm_config.model_config
            sample = self._samplers[sampling] = seeded_sampler(
                sampling, int(model_config.max_model_len), bool(getattr(model_config, "use_fp64_gumbel", False)),
            )
        return sample

    def _graph_cap(self) -> int:
        """Rows a draft graph can have: the block table's and the selection buffers' rows."""
        return min(self.drafting.block_table().shape[0], self.state.sel_buf.shape[1])

    def _draft(self, num_reqs: int, sampling: bool, step_inputs: torch.Tensor, temperature, seeds):
        """Draft γ tokens for ``num_reqs`` requests: the draft graph of the batch's row count,
        else eagerly (through vLLM's piecewise graphs, which read the runner's input buffers).
        ``temperature`` and ``seeds`` (``(num_reqs,)``, batch order) are None when no row samples.

        Returns:
            ``tokens`` ``(>= num_reqs, γ)`` int64 and ``probs`` ``(>= num_reqs, γ, vocab)``
            float32 or None (greedy), views of static buffers (copy before the next draft).
        """
        from vllm.config import CUDAGraphMode

        engine = self.drafting
        sample = self._sampler(sampling)
        rows = engine.graph_rows(num_reqs, self._graph_cap())
        if rows is not None:
            try:
                graph, bufs = engine.graph(rows, draft_graph_key(self.state, rows, sampling), sample, sampling)
                bufs.fill(num_reqs, step_inputs, temperature, seeds=seeds)
                graph.replay()
                return bufs.tokens, bufs.probs
            except Exception as e:  # fall back to eager drafting for good
                logger.warning("vegas: CUDA-graph drafting failed (%r); drafting eagerly from now on", e)
                engine.graph_failed = True
        bufs = engine.buffers(num_reqs, sampling)
        bufs.fill(num_reqs, step_inputs, temperature, seeds=seeds)
        # piecewise at most: a FULL key would replay vLLM's captured verification graph,
        # with its own metadata and slot mapping, instead of this draft step
        mode, desc = self.runner.cudagraph_dispatcher.dispatch(
            num_tokens=num_reqs, uniform_decode=False,
            valid_modes={CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE},
        )
        num_tokens = desc.num_tokens if desc is not None and desc.num_tokens else num_reqs
        engine.run(bufs, num_reqs, sample, num_tokens, mode, desc,
                   input_ids=self.runner.input_ids.gpu, positions=self.runner.positions)
        return bufs.tokens, bufs.probs

    def reset_stats(self) -> None:
        self.resolve_events(wait=True)
        self.recorder.reset()

    def resolve_events(self, wait: bool = False) -> None:
        """Fold finished timings and acceptance counts into the stats (see :class:`StatsRecorder`)."""
        self.recorder.resolve(self.state, wait)

    def _raise_if_hybrid(self) -> None:
        groups = getattr(getattr(self.runner, "kv_cache_config", None), "kv_cache_groups", [None])
        if len(groups) > 1:
            raise VegasConfigError(
                f"vegas: the model has {len(groups)} KV-cache groups (hybrid or mixed attention); "
                "drafting addresses one group: leave disable_hybrid_kv_cache_manager unset or set it True "
                "(vllm serve --disable-hybrid-kv-cache-manager)"
            )

    # ---- the proposer -----------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_):
        """Draft γ tokens per request; returns ``(num_reqs, γ)`` int64 on the GPU (or empty lists).

        Host work per call: the acceptance counters, one host-to-device copy of the step's
        per-request inputs, and one CUDA-graph replay that builds the draft tables from the
        selection buffers and runs the γ draft forwards (eager fallback without graphs).
        """
        started = time.perf_counter()
        runner = self.runner
        input_batch = runner.input_batch
        num_reqs = input_batch.num_reqs
        self.resolve_events()
        if not self._layers_known:
            self._init_layers()
        if not self._checked_groups:
            self._raise_if_hybrid()
            self._checked_groups = True

        req_ids = input_batch.req_ids[:num_reqs]
        state = self.state
        prefill_heavy = state.take_skip()  # the forward carried a prefill chunk and selected nothing
        if self.async_scheduling:
            step_inputs = self._async_step_inputs(req_ids)
        else:
            num_blocks = input_batch.block_table[0].num_blocks_per_row[:num_reqs].astype(np.int64)
            step_inputs = self._sync_step_inputs(sampled_token_ids, num_tokens_no_spec, req_ids, num_blocks)
        if (prefill_heavy or step_inputs is None or not state.has_selection or state.sel_buf is None
                or num_reqs > state.sel_buf.shape[1]):
            self.stats.prefill_skips += prefill_heavy
            self._drafted = set()
            if self.async_scheduling:  # vLLM's async path scatters drafts from a device tensor
                return torch.zeros((num_reqs, self.gamma), dtype=torch.int64, device=runner.device)
            return [[] for _ in range(num_reqs)]
        sampling_metadata = input_batch.sampling_metadata
        sampling = not (sampling_metadata.all_greedy or sampling_metadata.temperature is None)
        temperature = sampling_metadata.temperature[:num_reqs] if sampling else None
        # [num_reqs] int64 by request id: a row's seed does not depend on its neighbours or its row
        seeds = self.seeds.on_device(req_ids, runner.requests, runner.device) if sampling else None

        start = timing_event()
        tokens, probs = self._draft(num_reqs, sampling, step_inputs, temperature, seeds)
        draft_ids = tokens[:num_reqs].clone()  # [num_reqs, γ]
        if sampling:
            runner._draft_probs = probs[:num_reqs]  # [num_reqs, γ, vocab]
            runner._draft_prob_req_ids = list(req_ids)
            if self.config.vllm.seeded_verification == "coupled":
                self._withhold_seeded(draft_ids, probs[:num_reqs], temperature)
        self.recorder.pending_timings.append(("draft_ms", start, timing_event()))
        self.stats.proposals += 1
        self.stats.draft_steps += self.gamma
        self.stats.propose_wall_ms += (time.perf_counter() - started) * 1e3
        return draft_ids

    def _withhold_seeded(self, draft_ids, probs, temperature) -> None:
        """``vllm.seeded_verification="coupled"`` on V1: sampled requests with a seed of their own
        draft nothing that depends on the drafter (:func:`~vegas.vllm_plugin.coupling.withhold_drafts`),
        so their output is reproducible whatever their batch neighbours; no work without such rows
        (which rows have a seed is kept with the batch's seeds, :meth:`RequestSeeds.explicit_on_device`)."""
        explicit = self.seeds.explicit_on_device()  # the batch of this step's seeds.on_device call
        if explicit is None:
            return
        rows = explicit & (temperature >= GREEDY_TEMPERATURE)
        withhold_drafts(draft_ids, probs, rows)

    def _sync_step_inputs(self, sampled_token_ids, num_tokens_no_spec, req_ids, num_blocks):
        """Synchronous scheduling: the step's ``(4, num_reqs)`` int64 draft inputs (active,
        last sampled token, its position, blocks in use) from the host's sampled-token lists;
        counts the acceptance of requests that had drafts."""
        n = len(req_ids)
        active = np.zeros(n, dtype=np.int64)
        last_token = np.zeros(n, dtype=np.int64)
        for i, request_id in enumerate(req_ids[: len(sampled_token_ids)]):
            sampled = sampled_token_ids[i]
            if not sampled:
                continue
            active[i] = 1
            last_token[i] = sampled[-1]
            if request_id in self._drafted:
                self.recorder.count_iteration(request_id, len(sampled), self.gamma)
        self._drafted = {request_id for i, request_id in enumerate(req_ids) if active[i]}
        # rows without a sampled token (e.g. mid chunked prefill) draft nothing: position 0
        position = np.where(active > 0, np.maximum(num_tokens_no_spec[:n].astype(np.int64) - 1, 0), 0)
        return torch.from_numpy(np.stack([active, last_token, position, num_blocks]))

    @torch.inference_mode()
    def publish_sampled(self, scheduler_output, sampled_token_ids: torch.Tensor) -> None:
        """Async scheduling, called right before the runner's bookkeeping: hand vLLM each
        request's last valid sampled token and valid-token count (device tensors, no host
        sync), which its next step's input preparation reads, and keep them for :meth:`propose`.

        Args:
            scheduler_output: the verified step's ``SchedulerOutput``.
            sampled_token_ids: ``(num_reqs, γ + 1)`` int32 rejection-sampler output (-1 rejected).
        """
        runner = self.runner
        input_batch = runner.input_batch
        n = input_batch.num_reqs
        req_ids = list(input_batch.req_ids[:n])
        # backup token (discarded rows, i.e. partial prefills): the last known token, as vLLM's EAGLE uses
        last = np.maximum(input_batch.num_tokens_no_spec[:n].astype(np.int64) - 1, 0)
        backup = np.maximum(input_batch.token_ids_cpu[np.arange(n), last].astype(np.int64), 0)
        spec = scheduler_output.scheduled_spec_decode_tokens
        num_draft = np.array([len(spec.get(r, ())) for r in req_ids], dtype=np.int64)
        num_blocks = input_batch.block_table[0].num_blocks_per_row[:n].astype(np.int64)
        # one pinned copy (from pageable memory a copy may synchronize the stream; the host must not wait)
        host = torch.from_numpy(np.stack([backup, num_draft, num_blocks]))
        device_values = host.pin_memory().to(runner.device, non_blocking=True)  # [3, n] int64
        next_ids, counts = next_tokens_and_counts(
            sampled_token_ids[:n], runner.discard_request_mask.gpu[:n], device_values[0], input_batch.vocab_size
        )
        runner._copy_valid_sampled_token_count(next_ids, counts)
        self._published = (req_ids, next_ids, counts, device_values, num_draft)

    def _async_step_inputs(self, req_ids):
        """Async scheduling: the step's ``(4, num_reqs)`` int64 draft inputs on the device, from
        what :meth:`publish_sampled` kept (None if it did not run for this batch); queues the
        acceptance counts for :meth:`resolve_events`."""
        published, self._published = self._published, None
        if published is None or published[0] != list(req_ids):
            return None
        _, next_ids, counts, device_values, num_draft = published
        n = len(req_ids)
        active = counts > 0
        first_pos = draft_start_positions(self.runner.seq_lens[:n], device_values[1], counts)
        step_inputs = torch.stack([active.long(), next_ids.long(), torch.where(active, first_pos, 0), device_values[2]])
        counts_cpu = torch.empty(n, dtype=torch.int32, pin_memory=True)
        counts_cpu.copy_(counts, non_blocking=True)
        self.recorder.pending_counts.append((timing_event(), counts_cpu, list(req_ids), num_draft))
        return step_inputs
