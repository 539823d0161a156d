"""Vegas as a vLLM speculative proposer (``speculative_config.method = "custom_class"``).

``VegasProposer`` is built by vLLM's V1 GPU model runner with ``vllm_config`` only; it finds
that runner on the call stack (it is being constructed in ``GPUModelRunner.__init__``), so it
reuses the runner's model (the target itself: no second copy of weights or cache), its paged KV
cache, its block tables and its compiled model. Verification stays in vLLM's full CUDA graphs
(``VEGAS_VERIFY_CUDA_GRAPHS=full``, the default) with the selection captured into them, or
runs attention eagerly under piecewise graphs (``piecewise``: the selector can then change at
run time).

After each verification step (``propose`` runs after the runner's bookkeeping, same
``execute_model`` call) it drafts γ tokens per request: γ forwards of the target with query
length 1, not scheduled by vLLM, whose attention goes through
:mod:`vegas.vllm_plugin.attention` with the page-size-1 tables built from the selection that
the verification pass just made. Draft probabilities are handed to vLLM's rejection sampler
(``runner._draft_probs``), so sampling keeps the target distribution with full acceptance
rates; greedy requests use vLLM's greedy path (token-identical up to bf16 batch effects).
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from .async_sched import draft_start_positions, next_tokens_and_counts, patch_bookkeeping
from .quest import QuestDraft
from .state import STATE, VllmVegasConfig, build_draft_tables

__all__ = ["VegasProposer", "ProposerStats", "stacked_draft_probs"]

logger = logging.getLogger("vegas.vllm")

#: class path to pass as ``speculative_config["model"]``
CLASS_PATH = "vegas.vllm_plugin.proposer.VegasProposer"


@dataclass
class ProposerStats:
    """Counters of one worker's proposer (reset with :meth:`VegasProposer.reset_stats`)."""

    proposals: int = 0
    draft_steps: int = 0
    iterations: int = 0  # verified iterations of requests that had drafts
    emitted: int = 0  # tokens emitted by those iterations (accepted + bonus)
    select_ms: float = 0.0  # selection inside verification: plan + scoring + top-k (GPU clock, graphs included)
    select_timed: int = 0  # timed intervals summed into select_ms (two per verification forward)
    draft_ms: float = 0.0  # draft tables + γ draft forwards incl. sampling (CUDA events)
    verify_fwd_ms: float = 0.0  # layer 0 .. last layer of full-attention forwards (CUDA events)
    propose_wall_ms: float = 0.0  # host wall time inside propose()

    @property
    def acceptance_length(self) -> float:
        return self.emitted / self.iterations if self.iterations else 0.0

    def as_dict(self) -> dict:
        return {**self.__dict__, "acceptance_length": self.acceptance_length}


def _take_finished(items: list, event_at: int) -> list:
    """Remove and return the entries of ``items`` whose CUDA event ``entry[event_at]`` has
    completed (under async scheduling the host runs ahead of the GPU)."""
    ready, rest = [], []
    for x in items:
        (ready if x[event_at].query() else rest).append(x)
    items[:] = rest
    return ready


def _find_runner():
    frame = inspect.currentframe()
    while frame is not None:
        obj = frame.f_locals.get("self")
        if obj is not None and type(obj).__name__.endswith("ModelRunner") and hasattr(obj, "input_batch"):
            return obj
        if obj is not None and type(obj).__name__ == "GPUModelRunner":
            return obj
        frame = frame.f_back
    return None


def _raise_if_unsupported(vllm_config) -> None:
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size > 1:
        raise ValueError("vegas: pipeline parallelism is not supported; use pipeline_parallel_size=1")
    if vllm_config.cache_config.cache_dtype not in ("auto", "bfloat16", "float16"):
        raise ValueError("vegas: quantized KV caches are not supported; use kv_cache_dtype='auto'")
    if getattr(pc, "use_ubatching", False):
        raise ValueError("vegas: micro-batching (enable_dbo / ubatch_size > 1) is not supported; turn it off")
    if getattr(vllm_config, "lora_config", None) is not None:
        raise ValueError("vegas: LoRA is not supported (drafts would run without the adapters); disable enable_lora")
    mc = getattr(vllm_config, "model_config", None)
    if mc is not None and getattr(mc, "uses_mrope", False):
        raise ValueError("vegas: M-RoPE models are not supported (drafts use 1-D positions)")


#: ``full``: verification runs in vLLM's full CUDA graphs where vLLM uses them (uniform
#: decode batches), with selection captured into them; ``piecewise``: attention (and selection)
#: runs eagerly every step, so :func:`vegas.vllm_plugin.configure` can change the selector.
GRAPH_ENV = "VEGAS_VERIFY_CUDA_GRAPHS"


def verify_graph_mode() -> str:
    """``$VEGAS_VERIFY_CUDA_GRAPHS`` (``full`` or ``piecewise``, default ``full``).

    Raises:
        ValueError: for any other value.
    """
    mode = os.environ.get(GRAPH_ENV, "full").strip().lower() or "full"
    if mode not in ("full", "piecewise"):
        raise ValueError(f"{GRAPH_ENV} must be 'full' or 'piecewise', got {mode!r}")
    return mode


def _apply_graph_mode(vllm_config) -> bool:
    """Force piecewise CUDA graphs when asked; returns whether full graphs stay on."""
    from vllm.config import CUDAGraphMode

    cc = vllm_config.compilation_config
    mode = cc.cudagraph_mode
    if verify_graph_mode() == "piecewise" and mode is not None and mode.has_full_cudagraphs():
        logger.info("vegas: %s=piecewise: cudagraph_mode %s -> PIECEWISE", GRAPH_ENV, mode)
        cc.cudagraph_mode = CUDAGraphMode.PIECEWISE
    mode = cc.cudagraph_mode
    return bool(mode is not None and mode.has_full_cudagraphs())


def patch_scheduler_lookahead() -> None:
    """Let vLLM's scheduler allocate KV slots for γ lookahead tokens (as for EAGLE), so that the
    draft tokens' KV entries land in blocks the request owns. Idempotent."""
    from vllm.v1.core.sched import scheduler as sched_mod

    cls = sched_mod.Scheduler
    if getattr(cls.__init__, "_vegas", False):
        return
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        sc = self.vllm_config.speculative_config
        if sc is not None and sc.method == "custom_class" and str(sc.model).startswith("vegas."):
            self.num_lookahead_tokens = max(self.num_lookahead_tokens, self.num_spec_tokens)

    __init__._vegas = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


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
    """Route ``GPUModelRunner._get_spec_decode_draft_probs`` through
    :func:`stacked_draft_probs` (falls back to vLLM's loop). Idempotent."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._get_spec_decode_draft_probs
    if getattr(original, "_vegas", False):
        return

    def _get_spec_decode_draft_probs(self, spec_decode_metadata):
        probs, ids = self._draft_probs, self._draft_prob_req_ids
        if probs is not None and ids is not None and probs.dim() == 3:
            fast = stacked_draft_probs(probs, ids, self.input_batch.req_ids, spec_decode_metadata.num_draft_tokens)
            if fast is not None:
                return fast
        return original(self, spec_decode_metadata)

    _get_spec_decode_draft_probs._vegas = True  # type: ignore[attr-defined]
    GPUModelRunner._get_spec_decode_draft_probs = _get_spec_decode_draft_probs


class VegasProposer:
    """vLLM custom-class proposer: self-speculative drafting with verification-guided sparse attention.

    Settings come from ``$VEGAS_VLLM_CONFIG`` (JSON of :class:`VllmVegasConfig`) and can be
    changed at run time with :func:`vegas.vllm_plugin.configure` through ``LLM.collective_rpc``.
    """

    def __init__(self, vllm_config):
        from . import attention

        _raise_if_unsupported(vllm_config)
        self.vllm_config = vllm_config
        self.gamma = int(vllm_config.speculative_config.num_speculative_tokens)
        self.runner = _find_runner()
        STATE.config = VllmVegasConfig.from_env()
        STATE.gamma = self.gamma
        STATE.enabled = True
        STATE.frozen = _apply_graph_mode(vllm_config)
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        if self.tp_size > 1:
            from vllm.distributed import tensor_model_parallel_all_reduce

            STATE.all_reduce = tensor_model_parallel_all_reduce
        attention.install()
        patch_scheduler_lookahead()
        patch_draft_probs_gather()
        patch_bookkeeping()
        self.stats = ProposerStats()
        #: request id -> [iterations, drafted, accepted] since the last reset
        self.req_stats: dict[str, list[int]] = {}
        self._layers: list[tuple[str, int]] | None = None
        self._layer_pos: dict[int, int] = {}
        self._drafted: set[str] = set()
        self._pending: list = []  # (kind, start_event, end_event) resolved next call
        #: async scheduling: the last step's (req_ids, next_ids, counts, host values on the
        #: device [backup, drafts scheduled, blocks in use], drafts scheduled on the host)
        self._published: tuple | None = None
        #: async scheduling: (event, pinned counts, req_ids, num_draft_np) resolved when ready
        self._pending_counts: list = []
        self._vocab: int | None = None
        self._graphs: dict = {}
        self._graph_pool = None
        self._graph_failed = False
        self._checked_groups = False
        self.use_cuda_graphs = os.environ.get("VEGAS_DRAFT_CUDA_GRAPHS", "1") != "0"
        self.max_graph_rows = int(os.environ.get("VEGAS_DRAFT_GRAPH_MAX_ROWS", "256"))
        logger.info("vegas proposer: gamma=%d tp=%d config=%s", self.gamma, self.tp_size, STATE.config)

    @property
    def async_scheduling(self) -> bool:
        """vLLM's async scheduling (see :mod:`vegas.vllm_plugin.async_sched`): drafts start from
        device tensors published before the runner's bookkeeping."""
        return bool(getattr(self.runner, "use_async_scheduling", False))

    # ---- vLLM hooks -------------------------------------------------------------------------
    def load_model(self, target_model) -> None:
        """Called by the runner with the target model; Vegas drafts with that same model."""
        self._target = target_model
        if self.runner is None:
            self.runner = _find_runner()
        if self.runner is None:
            raise RuntimeError("vegas: could not find vLLM's GPU model runner (V1 runner required; "
                               "set VLLM_USE_V2_MODEL_RUNNER=0)")
        # the layers are registered once the model is built: learn them before the first
        # forward (the prefill), whose last queries give the first selection
        self._init_layers()
        self._reserve_buffers()
        self._time_verify_forward()

    # ---- helpers ----------------------------------------------------------------------------
    def _reserve_buffers(self) -> None:
        """Selection buffers at their largest (before vLLM captures CUDA graphs)."""
        mc, pc = self.vllm_config.model_config, self.vllm_config.parallel_config
        q_elems = (self.gamma + 1) * mc.get_num_attention_heads(pc) * mc.get_head_size()
        max_seqs = self.vllm_config.scheduler_config.max_num_seqs
        STATE.reserve(max_seqs, STATE.config.budget(mc.max_model_len), q_elems, mc.dtype, self.runner.device)

    def _time_verify_forward(self) -> None:
        """CUDA events around each runner forward (verification or prefill, selection included),
        summed into ``verify_fwd_ms``; skipped while a CUDA graph is being captured."""
        runner = self.runner
        forward = runner._model_forward
        if getattr(forward, "_vegas", False):
            return

        def _model_forward(*args, **kwargs):
            if torch.cuda.is_current_stream_capturing():
                return forward(*args, **kwargs)
            start = self._event()
            out = forward(*args, **kwargs)
            if len(STATE.fwd_events) > 4096:  # forwards without a proposal (idle ranks): keep it bounded
                del STATE.fwd_events[:2048]
            STATE.fwd_events.append((start, self._event()))
            return out

        _model_forward._vegas = True  # type: ignore[attr-defined]
        runner._model_forward = _model_forward

    def _init_layers(self) -> None:
        from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

        from .attention import layer_index

        ctx = self.vllm_config.compilation_config.static_forward_context
        layers = []
        for name, mod in ctx.items():
            impl = getattr(mod, "impl", None)
            if impl is None:
                continue
            if not isinstance(impl, FlashAttentionImpl):
                raise ValueError(
                    f"vegas needs the FLASH_ATTN attention backend, layer {name} uses "
                    f"{type(impl).__name__}; set attention_backend='FLASH_ATTN'"
                )
            if impl.sliding_window is not None and tuple(impl.sliding_window) != (-1, -1):
                raise ValueError(
                    f"vegas: layer {name} uses sliding-window attention {impl.sliding_window}, which "
                    "the compressed draft tables cannot express; only full-attention models are supported "
                    "(the HF backend, backend='hf', supports sliding-window models)"
                )
            layers.append((name, layer_index(name)))
        layers.sort(key=lambda x: x[1])
        self._layers = layers
        self._layer_pos = {idx: i for i, (_, idx) in enumerate(layers)}
        if [idx for _, idx in layers] != list(range(layers[0][1], layers[-1][1] + 1)):
            raise ValueError("vegas: attention layer indices must be contiguous, got "
                             f"{[idx for _, idx in layers]}")
        STATE.first_layer = layers[0][1]
        STATE.last_layer = layers[-1][1]
        STATE.layers_ready = True

    def reset_stats(self) -> None:
        self._resolve_events(wait=True)
        self.stats = ProposerStats()
        self.req_stats = {}

    def _resolve_events(self, wait: bool = False) -> None:
        """Fold finished CUDA-event timings and (async scheduling) acceptance counts into the
        stats; with ``wait``, synchronize first so that nothing stays pending."""
        if wait and torch.cuda.is_available():
            torch.cuda.synchronize()

        for kind, start, end in _take_finished(self._pending, 2):
            setattr(self.stats, kind, getattr(self.stats, kind) + start.elapsed_time(end))
        if wait and STATE.timer is not None:  # reading it waits for the GPU: only on request
            ms, count = STATE.timer.read(reset=True)
            self.stats.select_ms += ms
            self.stats.select_timed += count
        for start, end in _take_finished(STATE.fwd_events, 1):
            self.stats.verify_fwd_ms += start.elapsed_time(end)
        for _, counts, req_ids, num_draft in _take_finished(self._pending_counts, 0):
            for rid, n, d in zip(req_ids, counts.tolist(), num_draft.tolist()):
                if d > 0 and n > 0:
                    self._count_iteration(rid, n, d)

    def _count_iteration(self, rid: str, emitted: int, drafted: int) -> None:
        """One verified iteration of a request that had drafts: ``emitted`` = accepted + bonus."""
        self.stats.iterations += 1
        self.stats.emitted += emitted
        per = self.req_stats.setdefault(rid, [0, 0, 0])  # iterations, drafted, accepted
        per[0] += 1
        per[1] += drafted
        per[2] += emitted - 1

    def _event(self):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    # ---- the proposer -----------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_):
        """Draft γ tokens per request; returns ``(num_reqs, γ)`` int64 on the GPU (or empty lists).

        Host work per call: the acceptance counters, one host-to-device copy of the step's
        per-request inputs, and one CUDA-graph replay that builds the draft tables from the
        selection buffers and runs the γ draft forwards (eager fallback without graphs).
        """
        t0 = time.perf_counter()
        runner = self.runner
        ib = runner.input_batch
        num_reqs = ib.num_reqs
        self._resolve_events()
        if self._layers is None:
            self._init_layers()
        if not self._checked_groups:
            groups = getattr(getattr(runner, "kv_cache_config", None), "kv_cache_groups", [None])
            if len(groups) > 1:
                raise ValueError(
                    f"vegas: the model has {len(groups)} KV-cache groups (hybrid or mixed attention); "
                    "drafting addresses group 0 only, so only single-group full-attention models are supported"
                )
            self._checked_groups = True

        req_ids = ib.req_ids[:num_reqs]
        if self.async_scheduling:
            step_in = self._async_step_inputs(req_ids)
        else:
            nblocks_np = ib.block_table[0].num_blocks_per_row[:num_reqs].astype(np.int64)
            step_in = self._sync_step_inputs(sampled_token_ids, num_tokens_no_spec, req_ids, nblocks_np)
        if step_in is None or not STATE.has_selection or STATE.sel_buf is None or num_reqs > STATE.sel_buf.shape[1]:
            self._drafted = set()
            if self.async_scheduling:  # vLLM's async path scatters drafts from a device tensor
                return torch.zeros((num_reqs, self.gamma), dtype=torch.int64, device=runner.device)
            return [[] for _ in range(num_reqs)]
        sm = ib.sampling_metadata
        sampling = not (sm.all_greedy or sm.temperature is None)
        temp = sm.temperature[:num_reqs] if sampling else None

        ev0 = self._event()
        out_tok = out_probs = None
        if self.use_cuda_graphs and not self._graph_failed:
            try:
                out_tok, out_probs = self._draft_with_graph(num_reqs, sampling, step_in, temp)
            except Exception as e:  # fall back to eager drafting for good
                logger.warning("vegas: CUDA-graph drafting failed (%r); drafting eagerly from now on", e)
                self._graph_failed = True
                out_tok = None
        if out_tok is None:
            b = self._make_bufs(num_reqs, sampling, runner.device)
            self._fill_bufs(b, num_reqs, step_in, temp)
            from vllm.config import CUDAGraphMode

            # piecewise at most: a FULL key would replay vLLM's captured verification graph,
            # with its own metadata and slot mapping, instead of this draft step
            mode, desc = runner.cudagraph_dispatcher.dispatch(
                num_tokens=num_reqs, uniform_decode=False,
                valid_modes={CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE},
            )
            n_in = desc.num_tokens if desc is not None and desc.num_tokens else num_reqs
            self._draft_steps(b, num_reqs, n_in, sampling, mode, desc)
            out_tok, out_probs = b["out_tok"], b["out_probs"]
        draft_ids = out_tok[:num_reqs].clone()  # [num_reqs, γ]
        if sampling:
            runner._draft_probs = out_probs[:num_reqs]  # [num_reqs, γ, vocab]
            runner._draft_prob_req_ids = list(req_ids)
        self._pending.append(("draft_ms", ev0, self._event()))
        self.stats.proposals += 1
        self.stats.draft_steps += self.gamma
        self.stats.propose_wall_ms += (time.perf_counter() - t0) * 1e3
        return draft_ids

    def _sync_step_inputs(self, sampled_token_ids, num_tokens_no_spec, req_ids, nblocks_np):
        """Synchronous scheduling: the step's ``(4, num_reqs)`` int64 draft inputs (active,
        last sampled token, its position, blocks in use) from the host's sampled-token lists;
        counts the acceptance of requests that had drafts."""
        n = len(req_ids)
        active_np = np.zeros(n, dtype=np.int64)
        bonus_np = np.zeros(n, dtype=np.int64)
        for i, rid in enumerate(req_ids[: len(sampled_token_ids)]):
            s = sampled_token_ids[i]
            if not s:
                continue
            active_np[i] = 1
            bonus_np[i] = s[-1]
            if rid in self._drafted:
                self._count_iteration(rid, len(s), self.gamma)
        self._drafted = {rid for i, rid in enumerate(req_ids) if active_np[i]}
        # rows without a sampled token (e.g. mid chunked prefill) draft nothing: position 0
        pos_np = np.where(active_np > 0, np.maximum(num_tokens_no_spec[:n].astype(np.int64) - 1, 0), 0)
        return torch.from_numpy(np.stack([active_np, bonus_np, pos_np, nblocks_np]))

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
        ib = runner.input_batch
        n = ib.num_reqs
        req_ids = list(ib.req_ids[:n])
        # backup token (discarded rows, i.e. partial prefills): the last known token, as vLLM's EAGLE uses
        last = np.maximum(ib.num_tokens_no_spec[:n].astype(np.int64) - 1, 0)
        backup_np = np.maximum(ib.token_ids_cpu[np.arange(n), last].astype(np.int64), 0)
        spec = scheduler_output.scheduled_spec_decode_tokens
        num_draft_np = np.array([len(spec.get(r, ())) for r in req_ids], dtype=np.int64)
        nblocks_np = ib.block_table[0].num_blocks_per_row[:n].astype(np.int64)
        # one pinned copy (from pageable memory a copy may synchronize the stream; the host must not wait)
        host = torch.from_numpy(np.stack([backup_np, num_draft_np, nblocks_np]))
        dev = host.pin_memory().to(runner.device, non_blocking=True)
        next_ids, counts = next_tokens_and_counts(
            sampled_token_ids[:n], runner.discard_request_mask.gpu[:n], dev[0], ib.vocab_size
        )
        runner._copy_valid_sampled_token_count(next_ids, counts)
        self._published = (req_ids, next_ids, counts, dev, num_draft_np)

    def _async_step_inputs(self, req_ids):
        """Async scheduling: the step's ``(4, num_reqs)`` int64 draft inputs on the device, from
        what :meth:`publish_sampled` kept (None if it did not run for this batch); queues the
        acceptance counts for :meth:`_resolve_events`."""
        pub, self._published = self._published, None
        if pub is None or pub[0] != list(req_ids):
            return None
        _, next_ids, counts, dev, num_draft_np = pub
        n = len(req_ids)
        active = counts > 0
        pos0 = draft_start_positions(self.runner.seq_lens[:n], dev[1], counts)
        step_in = torch.stack([active.long(), next_ids.long(), torch.where(active, pos0, 0), dev[2]])
        counts_cpu = torch.empty(n, dtype=torch.int32, pin_memory=True)
        counts_cpu.copy_(counts, non_blocking=True)
        self._pending_counts.append((self._event(), counts_cpu, list(req_ids), num_draft_np))
        return step_in

    # ---- drafting: one body, run eagerly (piecewise graphs) or captured as one CUDA graph ----
    def _make_bufs(self, rows: int, sampling: bool, dev) -> dict:
        vocab = self._vocab_size()
        g = self.gamma
        return {
            "step_in": torch.zeros((4, rows), dtype=torch.int64, device=dev),  # active, bonus, pos, nblocks
            "temp": torch.ones(rows, dtype=torch.float32, device=dev),
            "seqused": torch.ones(rows, dtype=torch.int32, device=dev),
            "cu_q": torch.arange(rows + 1, dtype=torch.int32, device=dev),
            "slot": torch.full((max(rows, 1024),), -1, dtype=torch.int64, device=dev),
            "out_tok": torch.zeros((rows, g), dtype=torch.int64, device=dev),
            "out_probs": torch.zeros((rows, g, vocab), dtype=torch.float32, device=dev) if sampling else None,
        }

    def _vocab_size(self) -> int:
        if self._vocab is None:
            self._vocab = int(self.vllm_config.model_config.get_vocab_size())
        return self._vocab

    @staticmethod
    def _fill_bufs(b: dict, n: int, step_in: torch.Tensor, temp: torch.Tensor | None) -> None:
        """The step's inputs into the (static) buffers; rows ``>= n`` become inactive."""
        b["step_in"][:, :n].copy_(step_in, non_blocking=True)
        b["step_in"][:, n:] = 0
        if temp is not None:
            b["temp"][:n].copy_(temp)
            b["temp"][n:] = 1.0

    def _draft_tables(self, b: dict, rows: int):
        """Page-size-1 draft tables ``(L or 1, rows, width)``, the pages in use before the
        first draft (``base_used``) and, for Quest, the :class:`QuestDraft` that fills the
        selection columns per draft step (else None), from the last verification's selection."""
        active, _, pos0, _ = b["step_in"].unbind(0)
        sel, ctx_sel, budgets = STATE.selection(rows)
        ctx_sel = torch.minimum(ctx_sel, pos0)
        bt = self.runner.input_batch.block_table[0].block_table.gpu[:rows]
        quest = STATE.config.selector == "quest"
        # recent positions from ctx_sel on: the verified chunk and the drafts (Quest: plus the
        # partial last page)
        recent_cap = 2 * self.gamma + 2 + (STATE.block_size if quest else 0)
        tables = build_draft_tables(
            sel, budgets, ctx_sel, pos0 + self.gamma - 1, bt, STATE.block_size, STATE.page_stride, recent_cap,
        )
        base_used = torch.where(active.bool(), budgets + (pos0 - ctx_sel + 1), 1)
        qd = None
        if quest:
            qd = QuestDraft(
                STATE.quest_min, STATE.quest_max, bt, ctx_sel // STATE.block_size,
                torch.where(active.bool(), budgets, 0), sel.shape[2] // STATE.block_size,
                STATE.block_size, STATE.page_stride,
            )
        return tables, base_used, qd

    def _draft_steps(self, b, rows, n_in, sampling, mode, desc) -> None:
        """Draft tables, then γ draft forwards over ``rows`` requests (``n_in`` >= rows padded
        tokens); inputs and outputs in the buffers ``b``."""
        from vllm.forward_context import set_forward_context

        from .attention import DraftMetadata

        runner = self.runner
        model = runner.model
        bs = STATE.block_size
        tables, base_used, quest = self._draft_tables(b, rows)
        width = tables.shape[-1]
        layer_rows = {idx: 0 for _, idx in self._layers} if tables.shape[0] == 1 else self._layer_pos
        active, tokens, pos0, nblocks = b["step_in"].unbind(0)
        active = active.bool()
        if sampling:
            greedy = b["temp"] < 1e-5
            temp = torch.where(greedy, 1.0, b["temp"])
        bt = runner.input_batch.block_table[0].block_table.gpu[:rows]
        max_blk = bt.shape[1] - 1
        input_ids, positions = runner.input_ids.gpu, runner.positions
        slot = b["slot"]
        slot[rows:n_in] = -1
        for j in range(self.gamma):
            pos = pos0 + j
            blk_idx = pos // bs
            valid = active & (blk_idx < nblocks)
            blk = torch.gather(bt, 1, torch.clamp(blk_idx, max=max_blk)[:, None])[:, 0].long()
            slot[:rows].copy_(torch.where(valid, blk * bs + pos % bs, -1))
            input_ids[:rows].copy_(tokens)
            positions[:rows].copy_(torch.where(active, pos, 0))
            if n_in > rows:
                input_ids[rows:n_in] = 0
                positions[rows:n_in] = 0
            b["seqused"].copy_(torch.clamp(base_used + j, max=width))
            attn_md = {
                name: DraftMetadata(
                    tables[layer_rows[idx]], b["seqused"], b["cu_q"], width, rows,
                    quest=quest, quest_row=layer_rows[idx],
                )
                for name, idx in self._layers
            }
            slot_map = {name: slot[:n_in] for name, _ in self._layers}
            with set_forward_context(
                attn_md,
                self.vllm_config,
                num_tokens=n_in,
                cudagraph_runtime_mode=mode,
                batch_descriptor=desc,
                slot_mapping=slot_map,
            ):
                hidden = model(
                    input_ids=input_ids[:n_in],
                    positions=positions[:n_in],
                    intermediate_tensors=None,
                    inputs_embeds=None,
                )
            if isinstance(hidden, tuple):
                hidden = hidden[0]
            logits = model.compute_logits(hidden[:rows]).float()
            tokens = logits.argmax(dim=-1)
            if sampling:
                probs = torch.softmax(logits / temp[:, None], dim=-1)
                drawn = (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)
                tokens = torch.where(greedy, tokens, drawn)
                b["out_probs"][:, j].copy_(probs)
            b["out_tok"][:, j].copy_(tokens)

    def _draft_with_graph(self, num_reqs, sampling, step_in, temp):
        """Replay (capturing first if needed) the draft graph of the next power-of-two row count.

        The graph reads the selection buffers, the runner's block table and its own input
        buffers; it is keyed by rows, sampling and the selection buffers' generation (buffers
        reallocated for a larger budget need a new graph)."""
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import BatchDescriptor

        max_rows = min(self.runner.input_batch.block_table[0].block_table.gpu.shape[0], STATE.sel_buf.shape[1])
        rows = min(1 << max(num_reqs - 1, 0).bit_length(), max_rows)  # next power of two
        if rows > self.max_graph_rows or rows < num_reqs:
            return None, None
        sel_kind = 1 if STATE.config.selector == "sliding_window" else STATE.num_layers
        key = (rows, sampling, sel_kind, STATE.generation)
        entry = self._graphs.get(key)
        dev = self.runner.device
        if entry is None:
            b = self._make_bufs(rows, sampling, dev)
            desc = BatchDescriptor(num_tokens=rows)
            mode = CUDAGraphMode.NONE
            # warm-up: writes nothing (no active row -> every slot is -1)
            self._draft_steps(b, rows, rows, sampling, mode, desc)
            torch.cuda.synchronize()
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # vLLM's capture context: with tensor parallelism its custom all-reduce must register
            # the buffers the graph uses (a collective: every rank captures the same key here)
            from vllm.distributed.parallel_state import graph_capture

            with graph_capture(device=dev) as ctx, torch.cuda.graph(
                graph, pool=self._graph_pool, stream=ctx.stream, capture_error_mode="thread_local"
            ):
                self._draft_steps(b, rows, rows, sampling, mode, desc)
            entry = self._graphs[key] = (graph, b)
            logger.info("vegas: captured draft graph rows=%d sampling=%s tables=%d", rows, sampling, sel_kind)
        graph, b = entry
        self._fill_bufs(b, num_reqs, step_in, temp)
        graph.replay()
        return b["out_tok"], b["out_probs"]
