"""Vegas as a vLLM speculative proposer (``speculative_config.method = "custom_class"``).

``VegasProposer`` is built by vLLM's V1 GPU model runner with ``vllm_config`` only; it finds
that runner on the call stack (it is being constructed in ``GPUModelRunner.__init__``), so it
reuses the runner's model (the target itself: no second copy of weights or cache), its paged KV
cache, its block tables and its piecewise CUDA graphs.

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
import time
from dataclasses import dataclass

import numpy as np
import torch

from .state import STATE, VllmVegasConfig, build_draft_tables

__all__ = ["VegasProposer", "ProposerStats"]

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
    select_ms: float = 0.0  # score collection + top-k inside verification (CUDA events)
    table_ms: float = 0.0  # draft table building (CUDA events)
    draft_ms: float = 0.0  # γ draft forwards incl. sampling (CUDA events)
    propose_wall_ms: float = 0.0  # host wall time inside propose()

    @property
    def acceptance_length(self) -> float:
        return self.emitted / self.iterations if self.iterations else 0.0

    def as_dict(self) -> dict:
        return {**self.__dict__, "acceptance_length": self.acceptance_length}


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


def _force_piecewise(vllm_config) -> None:
    """Verification must run attention eagerly (piecewise graphs) so that score collection
    sees each step's metadata; full CUDA graphs would freeze it at capture time."""
    from vllm.config import CUDAGraphMode

    cc = vllm_config.compilation_config
    mode = cc.cudagraph_mode
    if mode is not None and mode.has_full_cudagraphs():
        logger.warning(
            "vegas: cudagraph_mode %s -> PIECEWISE (pass compilation_config="
            "{'cudagraph_mode': 'PIECEWISE'} to silence this)",
            mode,
        )
        cc.cudagraph_mode = CUDAGraphMode.PIECEWISE


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
        _force_piecewise(vllm_config)
        attention.install()
        patch_scheduler_lookahead()
        self.stats = ProposerStats()
        self._layers: list[tuple[str, int]] | None = None
        self._layer_pos: dict[int, int] = {}
        self._drafted: set[str] = set()
        self._pending: list = []  # (kind, start_event, end_event) resolved next call
        self._slot_buf: torch.Tensor | None = None
        logger.info("vegas proposer: gamma=%d config=%s", self.gamma, STATE.config)

    # ---- vLLM hooks -------------------------------------------------------------------------
    def load_model(self, target_model) -> None:
        """Called by the runner with the target model; Vegas drafts with that same model."""
        self._target = target_model
        if self.runner is None:
            self.runner = _find_runner()
        if self.runner is None:
            raise RuntimeError("vegas: could not find vLLM's GPU model runner (V1 runner required; "
                               "set VLLM_USE_V2_MODEL_RUNNER=0)")

    # ---- helpers ----------------------------------------------------------------------------
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
            layers.append((name, layer_index(name)))
        layers.sort(key=lambda x: x[1])
        self._layers = layers
        self._layer_pos = {idx: i for i, (_, idx) in enumerate(layers)}
        STATE.first_layer = layers[0][1]
        STATE.last_layer = layers[-1][1]

    def reset_stats(self) -> None:
        self._resolve_events()
        self.stats = ProposerStats()
        STATE.events.clear()

    def _resolve_events(self) -> None:
        for kind, start, end in self._pending:
            ms = start.elapsed_time(end)
            setattr(self.stats, kind, getattr(self.stats, kind) + ms)
        self._pending.clear()
        for start, end in STATE.events:
            self.stats.select_ms += start.elapsed_time(end)
        STATE.events.clear()

    def _event(self):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _sample(self, logits: torch.Tensor, num_reqs: int):
        sm = self.runner.input_batch.sampling_metadata
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        if sm.all_greedy or sm.temperature is None:
            return greedy, None
        temp = sm.temperature[:num_reqs].float()
        is_greedy = temp < 1e-5
        probs = torch.softmax(logits / torch.where(is_greedy, 1.0, temp)[:, None], dim=-1)
        noise = torch.empty_like(probs).exponential_()
        tokens = (probs / noise).argmax(dim=-1)
        return torch.where(is_greedy, greedy, tokens), probs

    # ---- the proposer -----------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_):
        """Draft γ tokens per request; returns ``(num_reqs, γ)`` int64 on the GPU (or empty lists)."""
        t0 = time.perf_counter()
        runner = self.runner
        ib = runner.input_batch
        num_reqs = ib.num_reqs
        self._resolve_events()
        if self._layers is None:
            self._init_layers()

        # acceptance bookkeeping (requests that had drafts in the previous step)
        req_ids = ib.req_ids[:num_reqs]
        for i, rid in enumerate(req_ids):
            if rid in self._drafted and i < len(sampled_token_ids) and sampled_token_ids[i]:
                self.stats.iterations += 1
                self.stats.emitted += len(sampled_token_ids[i])
        plan = STATE.plan
        if plan is None or plan.num_seqs != num_reqs or not STATE.slots:
            self._drafted = set()
            return [[] for _ in range(num_reqs)]

        dev = runner.device
        gamma = self.gamma
        active_np = np.zeros(num_reqs, dtype=np.int64)
        bonus_np = np.zeros(num_reqs, dtype=np.int64)
        for i in range(min(num_reqs, len(sampled_token_ids))):
            s = sampled_token_ids[i]
            if s:
                active_np[i] = 1
                bonus_np[i] = s[-1]
        pos_np = np.maximum(num_tokens_no_spec[:num_reqs].astype(np.int64) - 1, 0)
        bt_obj = ib.block_table[0]
        nblocks_np = bt_obj.num_blocks_per_row[:num_reqs].astype(np.int64)
        host = torch.from_numpy(np.stack([active_np, bonus_np, pos_np, nblocks_np]))
        active_d, bonus_d, pos_d, nblocks_d = host.to(dev, non_blocking=True).unbind(0)
        active_b = active_d.bool()

        ev0 = self._event()
        bt = bt_obj.get_device_tensor(num_reqs)
        bs, page_stride = STATE.block_size, STATE.page_stride
        if STATE.config.selector == "sliding_window":
            sel = STATE.slots[-1][None]
            layer_rows = {idx: 0 for _, idx in self._layers}
        else:
            sel = torch.stack([STATE.slots[idx] for _, idx in self._layers])
            layer_rows = self._layer_pos
        recent_cap = 2 * gamma + 2
        last_pos = pos_d + gamma - 1
        ctx_sel = torch.minimum(plan.ctx_sel, pos_d)
        tables = build_draft_tables(
            sel, plan.budgets, ctx_sel, last_pos, bt, bs, page_stride, recent_cap
        )
        width = tables.shape[-1]
        base_used = plan.budgets + (pos_d - ctx_sel + 1)
        ev1 = self._event()

        from vllm.forward_context import set_forward_context

        from .attention import DraftMetadata

        mode, desc = runner.cudagraph_dispatcher.dispatch(num_tokens=num_reqs, uniform_decode=False)
        n_pad = desc.num_tokens if desc is not None and desc.num_tokens else num_reqs
        if self._slot_buf is None or self._slot_buf.shape[0] < n_pad:
            self._slot_buf = torch.full((max(n_pad, 1024),), -1, dtype=torch.int64, device=dev)
        slot_buf = self._slot_buf
        cu_q = torch.arange(num_reqs + 1, dtype=torch.int32, device=dev)
        input_ids = runner.input_ids.gpu
        positions = runner.positions
        tokens = bonus_d
        drafts, probs_list = [], []
        model = runner.model
        for j in range(gamma):
            pos = pos_d + j
            blk_idx = pos // bs
            valid = active_b & (blk_idx < nblocks_d)
            blk = torch.gather(bt.long(), 1, torch.clamp(blk_idx, max=bt.shape[1] - 1)[:, None])[:, 0]
            slot = torch.where(valid, blk * bs + pos % bs, torch.full_like(pos, -1))
            slot_buf[:num_reqs] = slot
            slot_buf[num_reqs:n_pad] = -1
            input_ids[:num_reqs] = tokens.to(torch.int32)
            input_ids[num_reqs:n_pad] = 0
            positions[:num_reqs] = torch.where(active_b, pos, torch.zeros_like(pos))
            positions[num_reqs:n_pad] = 0
            used = torch.clamp(base_used + j, max=width)
            seqused = torch.where(active_b, used, torch.ones_like(used)).to(torch.int32)
            attn_md = {
                name: DraftMetadata(tables[layer_rows[idx]], seqused, cu_q, width, num_reqs)
                for name, idx in self._layers
            }
            slot_map = {name: slot_buf[:n_pad] for name, _ in self._layers}
            with set_forward_context(
                attn_md,
                self.vllm_config,
                num_tokens=n_pad,
                cudagraph_runtime_mode=mode,
                batch_descriptor=desc,
                slot_mapping=slot_map,
            ):
                hidden = model(
                    input_ids=input_ids[:n_pad],
                    positions=positions[:n_pad],
                    intermediate_tensors=None,
                    inputs_embeds=None,
                )
            if isinstance(hidden, tuple):
                hidden = hidden[0]
            logits = model.compute_logits(hidden[:num_reqs])
            tokens, probs = self._sample(logits, num_reqs)
            drafts.append(tokens)
            if probs is not None:
                probs_list.append(probs)
        draft_ids = torch.stack(drafts, dim=1)  # [num_reqs, γ]
        if probs_list:
            runner._draft_probs = torch.stack(probs_list, dim=1)  # [num_reqs, γ, vocab]
            runner._draft_prob_req_ids = list(req_ids)
        ev2 = self._event()
        self._pending.append(("table_ms", ev0, ev1))
        self._pending.append(("draft_ms", ev1, ev2))
        self._drafted = {rid for i, rid in enumerate(req_ids) if active_np[i]}
        self.stats.proposals += 1
        self.stats.draft_steps += gamma
        self.stats.propose_wall_ms += (time.perf_counter() - t0) * 1e3
        return draft_ids
