"""Vegas as a speculator of vLLM 0.24.0's V2 model runner (``vllm/v1/worker/gpu/model_runner.py``).

:class:`VegasSpeculator` subclasses V2's ``DraftModelSpeculator`` so that the runner hands it
the target model (``load_draft_model`` returns the target itself: no second copy) and its
block tables (``set_attn``). Built by the patched ``init_speculator``
(:func:`vegas.vllm_plugin.patches.patch_v2_init_speculator`). Per step, in ``sample_tokens`` after the rejection
sampler and V2's ``postprocess_sampled``, :meth:`VegasSpeculator.propose`:

1. builds the step's draft inputs on the device from ``num_sampled``, ``num_rejected``,
   ``input_batch.seq_lens``/``idx_mapping`` and ``last_sampled`` (no host lists; one small
   host-to-device copy of the blocks each request owns);
2. replays one CUDA graph of the drafting engine shared with the V1 proposer
   (:class:`~vegas.vllm_plugin.drafting.engine.DraftEngine`, graphs captured per row bucket
   at engine start) that turns the selection of the verification that just ran
   (the speculator's :class:`~vegas.vllm_plugin.selection.state.SelectionState`, batch order, written by
   whichever selection path is in force) into page-size-1 draft tables and runs γ query-length-1 forwards of the target
   through the attention override;
3. samples every draft with V2's ``gumbel_sample`` and writes its temperature-scaled logits
   into ``draft_logits[request slot, step]``, which the runner hands to V2's rejection
   sampler: sampling keeps the target distribution, greedy rows take the argmax.

Returns ``[num_reqs, γ]`` int64 drafts in batch order; the runner scatters them to slots.
"""

from __future__ import annotations

import logging

import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.buffer_utils import async_copy_to_gpu
from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample
from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

from ..drafting.engine import DraftBuffers, DraftEngine, attention_layers, draft_graph_key
from ..plain_graphs import plain_step_graphs
from ..selection.state import SelectionState
from ..stats import take_finished, timing_event
from ..step_switch import StepSwitch, prefill_skip_tokens
from .start import reserve_selection_buffers, start_drafter, use_path
from .v2_helpers import (
    acceptance_counts,
    draft_noise_positions,
    one_hot_draft_logits,
    rows_that_draft,
    step_inputs,
)

__all__ = ["VegasSpeculator"]

logger = logging.getLogger("vegas.vllm")



class VegasSpeculator(DraftModelSpeculator):
    """Self-speculative drafting with verification-guided sparse attention, V2 runner.

    Settings: ``additional_config["vegas"]`` (:mod:`vegas.vllm_plugin.settings`), as for the V1
    proposer: any registered selector, through its fast path or the generic path;
    ``VegasConfig.vllm.draft_cuda_graphs`` / ``draft_graph_max_rows`` for the draft graphs.

    Raises:
        VegasConfigError: for settings Vegas does not support (see
            :func:`~vegas.vllm_plugin.runners.start.start_drafter`), or a non-FLASH_ATTN /
            sliding-window attention layer.
        ValueError: more than one KV-cache group.
    """

    def __init__(self, vllm_config, device: torch.device):
        gamma = int(vllm_config.speculative_config.num_speculative_tokens)
        # refuses unsupported settings before vLLM allocates anything; also patches attention
        # and the scheduler (single-process engines build the scheduler after the runner)
        #: this worker's selection state: written by the attention override (it finds the state
        #: on each attention layer, :data:`~vegas.vllm_plugin.selection.state.LAYER_ATTR`), read by the drafting
        self.state = SelectionState()
        self.selector, self._settings = start_drafter(self.state, vllm_config, gamma)
        super().__init__(vllm_config, device)
        self.gamma = int(self.num_speculative_steps)
        use_path(self.state, self.selector, self._settings, self.gamma, device)
        options = self.selector.config.vllm
        self.supports_mm_inputs = False
        n = self.max_num_reqs
        self.scratch = n  # request slot of padded graph rows
        # [max_num_reqs + 1, γ, vocab] float32 temperature-scaled draft logits by request slot,
        # always allocated (whatever draft_sample_method says): V2's rejection sampler then
        # uses the real draft distribution q instead of a one-hot
        self.draft_logits = torch.zeros(n + 1, self.gamma, self.vocab_size, dtype=torch.float32, device=device)
        self.temp_buf = torch.zeros(n + 1, dtype=torch.float32, device=device)  # [slots + 1], 0 = greedy
        self.seed_buf = torch.zeros(n + 1, dtype=torch.int64, device=device)  # [slots + 1]
        self.step_cols = [torch.tensor(j, dtype=torch.int64, device=device) for j in range(self.gamma)]
        self.counters = torch.zeros(2, dtype=torch.int64, device=device)  # iterations, emitted
        self.proposals = 0
        self.skipped = 0  # steps that drafted nothing (no row sampled a token, or a prefill-heavy step)
        self.prefill_skips = 0  # of those: forwards with >= prefill_skip_tokens prompt tokens
        self.scheduled_skips = 0  # steps the scheduler gave no draft slots for the next step (step_switch)
        self.select_ms = 0.0
        self.draft_ms = 0.0  # GPU time of the draft phases (CUDA events around each; graphs included)
        self.draft_events: list = []  # (start, end) not yet read: under async scheduling the host runs ahead
        #: the scheduler decides which steps draft (:mod:`~vegas.vllm_plugin.step_switch`): async
        #: scheduling with ``prefill_skip_tokens`` or ``fallback`` set (as
        #: :func:`~vegas.vllm_plugin.patches.scheduler_switch`); then :meth:`on_schedule` reads each step's decision
        async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
        self.scheduled_switch = async_scheduling and StepSwitch.wanted(
            prefill_skip_tokens(options.prefill_skip_tokens, scheduler_decides=async_scheduling), options.fallback)
        self.drafts_next = self.gamma  # drafts the current step makes (its num_spec_tokens_to_schedule)
        #: full CUDA graphs of query length 1 for the plain steps (:mod:`~vegas.vllm_plugin.plain_graphs`),
        #: when this engine takes plain steps and verifies in full graphs; registered before vLLM
        #: builds its CUDA-graph manager (``initialize_kv_cache``); with the selection under
        #: select_in_draft (set by use_path above) without the measured fallback
        self.plain_graphs = plain_step_graphs(self.state, vllm_config, self.scheduled_switch,
                                              fallback=bool(options.fallback))
        if self.scheduled_switch:
            from .. import patches

            patches.patch_v2_execute_model()
            if self.plain_graphs is not None:
                patches.patch_plain_step_graphs()
        #: Gumbel-max coupled verification of seeded requests (``vllm.seeded_verification``,
        #: :mod:`~vegas.vllm_plugin.coupling`): which request slots couple, read by the draft graphs
        self.coupling = None
        self._sampling_states = None  # the runner's SamplingStates (its seeds_set), from on_runner
        if options.seeded_verification == "coupled":
            from .. import coupling, patches

            self.coupling = coupling.CoupledRows(n, device)
            coupling.register_engine(self.draft_logits, self.coupling)
            patches.patch_v2_coupled_verification()
            patches.patch_v2_execute_model()
        self.drafting = DraftEngine(
            vllm_config, self.state, self.gamma, options, device,
            block_table=lambda: self.block_tables.input_block_tables[0],  # [max_reqs, max_blocks] int32, batch order
            model=lambda: self.model,
        )
        logger.info("vegas: V2 model runner speculator, gamma=%d settings=%s", self.gamma, self._settings)

    # ---- DraftModelSpeculator hooks ---------------------------------------------------------
    def load_draft_model(self, target_model, target_attn_layer_names):
        """The target is the draft model. Learns its attention layers and reserves the
        selection buffers at their largest, before vLLM captures the verification graphs."""
        self.drafting.set_layers(attention_layers(self.vllm_config, self.state))
        reserve_selection_buffers(self.state, self.vllm_config, self.selector, self.gamma, self.max_num_reqs,
                                  self.device)
        return target_model

    def set_attn(self, model_state, kv_cache_config, block_tables) -> None:
        """Keep the runner's block tables (no attention backend of our own: the draft
        forwards carry :class:`DraftMetadata`).

        Raises:
            ValueError: for more than one KV-cache group.
        """
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(
                f"vegas: the model has {len(groups)} KV-cache groups (hybrid or mixed attention); "
                "drafting addresses one group: leave disable_hybrid_kv_cache_manager unset or set it True "
                "(vllm serve --disable-hybrid-kv-cache-manager)"
            )
        self.model_state = model_state
        self.kv_cache_config = kv_cache_config
        self.block_tables = block_tables

    def on_schedule(self, scheduler_output) -> None:
        """Before a real step's forward (:func:`~vegas.vllm_plugin.patches.patch_v2_execute_model`):
        the step's ``num_spec_tokens_to_schedule`` (0 or γ, set by the scheduler,
        :mod:`~vegas.vllm_plugin.step_switch`) says whether it selects and drafts; its forward's
        selection skips when it is 0 (``SelectionState.scheduled_skip``)."""
        if not self.scheduled_switch:
            return
        self.drafts_next = int(scheduler_output.num_spec_tokens_to_schedule)
        self.state.scheduled_skip = self.drafts_next == 0
        self.scheduled_skips += self.drafts_next == 0

    def on_runner(self, runner) -> None:
        """Before a real step's forward (:func:`~vegas.vllm_plugin.patches.patch_v2_execute_model`):
        keep the runner's ``SamplingStates`` once, whose ``seeds_set`` says which request slots
        have an explicit seed (coupled engines only)."""
        if self.coupling is not None and self._sampling_states is None:
            self._sampling_states = getattr(getattr(runner, "sampler", None), "sampling_states", None)

    def init_cudagraph_manager(self, cudagraph_mode) -> None:
        self.cudagraph_mode = cudagraph_mode

    def capture(self, attn_states) -> None:
        """Capture the draft graphs of every row bucket up to the largest
        captured one, once, after vLLM's verification graphs (so that no capture happens while
        requests wait: a lazy capture costs 0.1-0.3 s)."""
        if getattr(self, "cudagraph_mode", CUDAGraphMode.NONE) == CUDAGraphMode.NONE:
            return
        self.drafting.capture(self._row_cap(), [(("v2",), self._sample, False, self.scratch)])

    # ---- propose ---------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds,
                num_tokens_across_dp=None, dummy_run=False, skip_attn_for_dummy_run=False,
                mm_inputs=None, is_profile=False) -> torch.Tensor:
        """γ drafts per request: ``[num_reqs, γ]`` int64 on the device, batch order.

        Dummy and profile runs return zeros (their output is discarded). When no selection
        exists yet, the drafts are zeros and their logits one-hot, so rejection sampling
        stays exact.
        """
        n = input_batch.num_reqs
        state = self.state
        # the forward carried a prefill chunk and selected nothing, or the scheduler gave the next
        # step no draft slots (then it verifies one token per request: drafts would be thrown away)
        prefill_heavy = state.take_skip() or self.drafts_next == 0
        if dummy_run or is_profile or attn_metadata is None:
            return self.draft_tokens[:n].zero_()
        idx = input_batch.idx_mapping  # [n] int32 batch row -> request slot
        if input_batch.num_draft_tokens > 0:
            self.counters += acceptance_counts(num_sampled, input_batch.cu_num_logits)
        if (prefill_heavy or rows_that_draft(input_batch) == 0 or not state.has_selection or state.sel_buf is None
                or n > self._row_cap()):
            # zero drafts with one-hot logits: the next verification accepts exactly what it samples
            self.skipped += 1
            self.prefill_skips += prefill_heavy
            one_hot_draft_logits(self.draft_logits, idx)
            return self.draft_tokens[:n].zero_()
        # blocks owned per row: the host's values of this step (the UVA view rotates under
        # async scheduling, so it is not read from the device later)
        nblocks = async_copy_to_gpu(self.block_tables.num_blocks.np[0][input_batch.idx_mapping_np],
                                    device=self.device)
        step_in = step_inputs(num_sampled, num_rejected, input_batch.seq_lens, idx, last_sampled, nblocks)
        self.temp_buf[: self.max_num_reqs].copy_(temperature)
        self.seed_buf[: self.max_num_reqs].copy_(seeds)
        if self.coupling is not None and self._sampling_states is not None:
            self.coupling.update(self._sampling_states.seeds_set)
        self.proposals += 1
        if not state.time_events:
            return self._draft(n, step_in, idx)
        self._fold_draft_events()  # the earlier steps' (bounded when nobody reads the stats: serving)
        start = timing_event()
        tokens = self._draft(n, step_in, idx)
        self.draft_events.append((start, timing_event()))
        return tokens

    def _fold_draft_events(self) -> None:
        """Add the finished draft phases' times to ``draft_ms`` (does not wait)."""
        self.draft_ms += sum(start.elapsed_time(end) for start, end in take_finished(self.draft_events, 1))

    def _draft(self, n: int, step_in, idx: torch.Tensor) -> torch.Tensor:
        """γ drafts for ``n`` rows: one CUDA-graph replay, or eager drafting without graphs."""
        engine = self.drafting
        rows = engine.graph_rows(n, self._row_cap())
        if rows is not None:
            try:
                graph, bufs = engine.graph(rows, draft_graph_key(self.state, rows, "v2"), self._sample, False,
                                           self.scratch)
                bufs.fill(n, step_in, slots=idx, scratch=self.scratch)
                graph.replay()
                return bufs.tokens[:n]
            except Exception as e:  # fall back to eager drafting for good
                logger.warning("vegas: CUDA-graph drafting failed (%r); drafting eagerly from now on", e)
                engine.graph_failed = True
        bufs = engine.buffers(n, with_probs=False)
        bufs.fill(n, step_in, slots=idx, scratch=self.scratch)
        engine.run(bufs, n, self._sample)
        return bufs.tokens[:n]

    # ---- counters ---------------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Zero the counters (waits for the GPU)."""
        self.counters.zero_()
        self.proposals = self.skipped = self.prefill_skips = self.scheduled_skips = 0
        if self.plain_graphs is not None:
            self.plain_graphs.steps = self.plain_graphs.select_steps = 0
        torch.cuda.synchronize(self.device)
        self.select_ms = self.draft_ms = 0.0
        self.draft_events.clear()
        if self.state.timer is not None:
            self.state.timer.read(reset=True)

    def stats(self) -> dict:
        """proposals (steps that drafted), skipped (steps that did not; ``prefill_skips`` of
        them for a prefill chunk of at least ``prefill_skip_tokens`` tokens; ``scheduled_skips``: steps
        whose next step the scheduler gave no draft slots, :mod:`~vegas.vllm_plugin.step_switch`;
        ``plain_full_graph_steps``: of those, forwards that replayed a full CUDA graph of query
        length 1, :mod:`~vegas.vllm_plugin.plain_graphs`), ``q1_select_graph_steps`` (forwards
        that selected and replayed such a graph: one token per request after a skipped step,
        select_in_draft without the measured fallback only), iterations (verified
        steps of rows with drafts), emitted (accepted + bonus tokens of those),
        ``acceptance_length`` = emitted / iterations, ``select_ms`` (GPU time of the
        selection inside verification), ``draft_ms`` (GPU time of the draft phases, CUDA
        events). Waits for the GPU."""
        if self.state.timer is not None:
            self.select_ms += self.state.timer.read(reset=True)[0]
        torch.cuda.synchronize(self.device)
        self._fold_draft_events()
        iterations, emitted = (int(x) for x in self.counters.tolist())
        return {
            "runner": "v2",
            "proposals": self.proposals,
            "skipped": self.skipped,
            "prefill_skips": self.prefill_skips,
            "scheduled_skips": self.scheduled_skips,
            # of those, the forwards of one token per request (after another such step) that replayed a
            # full CUDA graph of query length 1 (plain_graphs), not vLLM's piecewise graphs
            "plain_full_graph_steps": self.plain_graphs.steps if self.plain_graphs is not None else 0,
            # forwards that selected and replayed such a graph (the step after a skipped one; only when those
            # graphs select: select_in_draft without the measured fallback), not vLLM's piecewise graphs
            "q1_select_graph_steps": self.plain_graphs.select_steps if self.plain_graphs is not None else 0,
            "iterations": iterations,
            "emitted": emitted,
            "acceptance_length": emitted / iterations if iterations else 0.0,
            "select_ms": self.select_ms,
            "draft_ms": self.draft_ms,
            "full_cuda_graphs": self.state.frozen,
            "draft_graphs": self.drafting.num_graphs,
            "graph_failed": self.drafting.graph_failed,
            # the scores come from inside the verification attention: "fa3_ext" (_vegas_fa3_C), "cute"
            # (vllm.score_path="cute": the CuTe probe kernel), "in_draft" (vllm.select_in_draft: the draft phase scores
            # beside its first forward), else "separate" (the score kernel after the last layer)
            "score_path": _score_path(self.state),
            # forwards captured with the score pass layer by layer on a side stream (vllm.score_overlap)
            "layer_scored_forwards": getattr(getattr(self.state.path, "collector", None), "layer_scored_forwards", 0),
        }

    # ---- drafting ---------------------------------------------------------------------------
    def _row_cap(self) -> int:
        sel_buf = self.state.sel_buf
        return min(self.max_num_reqs, sel_buf.shape[1] if sel_buf is not None else 0)

    def _sample(self, logits: torch.Tensor, j: int, bufs: DraftBuffers) -> torch.Tensor:
        """V2's draft sampler: vLLM's ``gumbel_sample`` keyed by each request's seed and the
        draft position (:func:`~vegas.vllm_plugin.runners.v2_helpers.draft_noise_positions`: the target's own
        counter for a coupled row, a disjoint one otherwise), which also
        writes the temperature-scaled logits into ``draft_logits[bufs.slots, j]`` for V2's
        rejection sampler; greedy rows (temperature 0) take the argmax."""
        coupled = None if self.coupling is None else self.coupling.slots[bufs.slots]
        return gumbel_sample(
            logits, bufs.slots, self.temp_buf, self.seed_buf,
            draft_noise_positions(bufs.positions, self.drafting.max_model_len, coupled),
            apply_temperature=True, output_processed_logits=self.draft_logits,
            output_processed_logits_col=self.step_cols[j], use_fp64=self.use_fp64_gumbel,
        )


def _score_path(state) -> str:
    """Where this engine's verification scores come from (see :meth:`VegasSpeculator.stats`)."""
    if state.select_in_draft:
        return "in_draft"
    fa3 = state.fa3
    return fa3.KIND if fa3 is not None and fa3.in_use else "separate"
