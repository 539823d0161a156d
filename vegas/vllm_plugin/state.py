"""Selection state shared by the attention override and the proposer (pure PyTorch, no vLLM).

One :class:`SelectionState` per worker process. During each full-attention forward of the
runner (prefill or verification) the attention override calls :meth:`SelectionState.on_layer`
for every layer: at the first layer it builds a :class:`CollectPlan` for the batch; at every
layer it turns the collect queries' logits into that layer's top-k slot ids. The proposer then
turns the selection into page-size-1 FlashAttention block tables (:func:`build_draft_tables`)
and drafts γ tokens with them, in the same ``execute_model`` call, so batch rows line up.

Positions, per request of the batch:

- the verified chunk holds positions ``[seq_len - query_len, seq_len)``;
- the collect queries are the last ``γ + 1`` of the chunk (or the whole chunk when shorter):
  collect2 takes the first and last of them, aggregated all of them;
- ``ctx_sel`` = position of the first collect query; keys ``[0, ctx_sel)`` are scored, so no
  causal mask is needed (every collect query sees all of them);
- drafting attends to the ``k`` selected positions plus every position ``>= ctx_sel``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from dataclasses import fields as dataclass_fields

import torch

from ..kernels import (
    collect_scores,
    collect_scores_layers_reference,
    select_topk,
    select_topk_layers,
    slots_to_fa_pages,
)
from .quest import page_aligned_selection, update_layer

__all__ = [
    "SELECTORS",
    "TP_SELECTIONS",
    "CollectPlan",
    "SelectionState",
    "VllmVegasConfig",
    "build_draft_tables",
    "make_plan",
    "sliding_window_slots",
    "STATE",
]

#: selectors the vLLM backend implements
SELECTORS = ("collect2", "aggregated", "sliding_window", "quest")
#: how tensor-parallel ranks select (each rank holds a slice of every layer's query and KV heads)
TP_SELECTIONS = ("all_reduce", "per_rank")
ENV_VAR = "VEGAS_VLLM_CONFIG"


@dataclass
class VllmVegasConfig:
    """Vegas settings of the vLLM proposer (γ comes from ``speculative_config``).

    Args:
        selector: one of :data:`SELECTORS`.
        sparsity_ratio: KV budget as a share of the context (used when ``kv_budget`` is None).
        kv_budget: fixed KV budget k in tokens, or None.
        min_kv_budget: lower bound of the ratio-derived budget (tokens).
        num_sinks: sinks of the sliding-window selector (tokens).
        window: recent window of the sliding-window selector; None: ``budget - num_sinks``.
        recent_window: score-based selectors always keep the last ``recent_window`` positions
            before the verified chunk inside the budget (at most half of it), as the HF backend.
        tp_selection: with tensor parallelism, ``"all_reduce"`` sums every rank's per-layer
            scores (its heads' share of the head sum) before the top-k, so all ranks select what
            one GPU would (one all-reduce of ``layers x batch x context`` float32 per
            verification); ``"per_rank"`` selects from each rank's own heads, without
            communication (a per-head-group selection: ranks keep different positions).
            Ignored on one GPU.
    """

    selector: str = "collect2"
    sparsity_ratio: float = 0.05
    kv_budget: int | None = None
    min_kv_budget: int = 256
    num_sinks: int = 4
    window: int | None = None
    recent_window: int = 64
    tp_selection: str = "all_reduce"

    def __post_init__(self) -> None:
        if self.selector not in SELECTORS:
            raise ValueError(
                f"selector {self.selector!r} is not available on the vLLM backend; "
                f"choose one of {', '.join(SELECTORS)}"
            )
        if self.tp_selection not in TP_SELECTIONS:
            raise ValueError(
                f"tp_selection must be one of {', '.join(TP_SELECTIONS)}, got {self.tp_selection!r}"
            )
        ratio = self.sparsity_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not (0 < ratio <= 1):
            raise ValueError(f"sparsity_ratio must be a number in (0, 1], got {ratio!r}")
        for name in ("min_kv_budget", "num_sinks", "recent_window", "kv_budget", "window"):
            value = getattr(self, name)
            if value is None and name in ("kv_budget", "window"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                allowed = "an integer >= 0 or null" if name in ("kv_budget", "window") else "an integer >= 0"
                raise ValueError(f"{name} must be {allowed} (tokens), got {value!r}")

    @classmethod
    def from_env(cls) -> VllmVegasConfig:
        """Read ``$VEGAS_VLLM_CONFIG`` (a JSON object of the fields above); defaults if unset.

        Raises:
            ValueError: see :meth:`from_json`.
        """
        raw = os.environ.get(ENV_VAR, "").strip()
        return cls.from_json(raw) if raw else cls()

    @classmethod
    def from_json(cls, raw: str, source: str = ENV_VAR) -> VllmVegasConfig:
        """Settings from a JSON object of the fields above (``source`` names it in errors).

        Raises:
            ValueError: not a JSON object, an unknown field, or a value out of range.
        """
        try:
            values = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source} must be a JSON object: {e}") from None
        if not isinstance(values, dict):
            raise ValueError(f"{source} must be a JSON object, got {raw!r}")
        known = [f.name for f in dataclass_fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"{source}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(known)} "
                             "(γ is speculative_config's num_speculative_tokens)")
        return cls(**values)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def budget(self, ctx: int) -> int:
        """KV budget for a context of ``ctx`` selectable positions (clamped to ``ctx``)."""
        if self.selector == "sliding_window" and self.window is not None:
            k = self.num_sinks + self.window
        elif self.kv_budget is not None:
            k = self.kv_budget
        else:
            k = max(math.ceil(ctx * self.sparsity_ratio), self.min_kv_budget)
        return min(k, ctx)

    def budgets(self, ctx: torch.Tensor) -> torch.Tensor:
        """Vectorised :meth:`budget` over ``ctx`` ``(num_seqs,)`` int64 (no host sync)."""
        if self.selector == "sliding_window" and self.window is not None:
            k = torch.full_like(ctx, self.num_sinks + self.window)
        elif self.kv_budget is not None:
            k = torch.full_like(ctx, self.kv_budget)
        else:
            k = torch.ceil(ctx.double() * self.sparsity_ratio).long().clamp(min=self.min_kv_budget)
        return torch.minimum(k, ctx)


@dataclass
class CollectPlan:
    """Per-batch plan of one full-attention forward (built at its first layer).

    Attributes:
        num_seqs: requests in the batch.
        q_idx: ``(num_seqs, Q)`` token indices of the collect queries in the batch (None for
            query-agnostic selectors).
        q_weight: ``(num_seqs, Q)`` float 1/0 (0 masks a repeated index of a short chunk).
        ctx_sel: ``(num_seqs,)`` int64 selectable positions ``[0, ctx_sel)``.
        budgets: ``(num_seqs,)`` int64 k per request (<= ctx_sel).
        recent: ``(num_seqs,)`` int64 positions right before ``ctx_sel`` kept inside the budget
            (score-based selectors: ``min(recent_window, budgets // 2)``).
        k_max: static top-k width (>= budgets.max()).
        max_len: score width (>= ctx_sel.max()).
    """

    num_seqs: int
    q_idx: torch.Tensor | None
    q_weight: torch.Tensor | None
    ctx_sel: torch.Tensor
    budgets: torch.Tensor
    recent: torch.Tensor
    k_max: int
    max_len: int


def make_plan(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    gamma: int,
    config: VllmVegasConfig,
) -> CollectPlan:
    """Collect plan of a batch from its attention metadata (device tensors, no host sync).

    Args:
        query_start_loc: ``(num_seqs + 1,)`` int32 cumulative query lengths.
        seq_lens: ``(num_seqs,)`` int32 sequence lengths including this chunk.
        max_seq_len: host-side upper bound of ``seq_lens``.
        gamma: γ, draft tokens per iteration.
    """
    num_seqs = seq_lens.shape[0]
    start = query_start_loc[:num_seqs].long()
    end = query_start_loc[1 : num_seqs + 1].long()
    first = torch.maximum(start, end - 1 - gamma)
    ctx_sel = torch.clamp(seq_lens.long() - (end - first), min=0)
    q_idx = q_weight = None
    if config.selector == "collect2":
        q_idx = torch.stack([first, end - 1], dim=1)
        q_weight = torch.ones(q_idx.shape, dtype=torch.float32, device=q_idx.device)
        q_weight[:, 1] = (end - 1 > first).float()  # one-token chunk: count it once
    elif config.selector == "aggregated":
        offs = torch.arange(gamma + 1, device=first.device)
        raw = first[:, None] + offs[None, :]
        q_weight = (raw <= (end - 1)[:, None]).float()
        q_idx = torch.minimum(raw, (end - 1)[:, None])
    max_len = max(int(max_seq_len), 1)
    k_max = config.budget(max_len)
    budgets = config.budgets(ctx_sel)
    recent = torch.clamp(budgets // 2, max=config.recent_window)
    return CollectPlan(num_seqs, q_idx, q_weight, ctx_sel, budgets, recent, k_max, max_len)


def collect_layer_slots(
    plan: CollectPlan,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One layer's selection: ``(num_seqs, k_max)`` int32 slot ids (-1 beyond each budget)."""
    assert plan.q_idx is not None and plan.q_weight is not None
    q = query[plan.q_idx.reshape(-1)].view(plan.num_seqs, plan.q_idx.shape[1], *query.shape[1:])
    q = q * plan.q_weight[:, :, None, None].to(q.dtype)
    bt = block_table[: plan.num_seqs]
    scores = collect_scores(q, key_cache, bt, plan.ctx_sel, plan.max_len, scale)
    slots, _ = select_topk(scores, plan.budgets, plan.k_max, bt, key_cache.shape[1], plan.recent, plan.ctx_sel)
    return slots


def sliding_window_slots(
    plan: CollectPlan, num_sinks: int, block_table: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Sinks plus the last ``k - sinks`` positions before ``ctx_sel``, as ``(num_seqs, k_max)`` slot ids."""
    col = torch.arange(plan.k_max, device=plan.ctx_sel.device)[None, :]
    k = plan.budgets[:, None]
    sinks = torch.clamp(k, max=num_sinks)
    pos = torch.where(col < sinks, col, plan.ctx_sel[:, None] - k + col)
    pos = torch.clamp(pos, min=0)
    blocks = torch.gather(block_table[: plan.num_seqs].long(), 1, pos // block_size)
    slots = (blocks * block_size + pos % block_size).to(torch.int32)
    return torch.where(col < k, slots, torch.full_like(slots, -1))


def build_draft_tables(
    sel_slots: torch.Tensor,
    budgets: torch.Tensor,
    ctx_sel: torch.Tensor,
    last_pos: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    page_stride: int,
    recent_cap: int,
) -> torch.Tensor:
    """Page-size-1 block tables of the draft phase.

    Row ``s`` of layer ``l``: columns ``[0, budgets[s])`` hold the selected pages, then the pages
    of positions ``ctx_sel[s], ctx_sel[s] + 1, …`` (the recent and draft positions); a draft query
    at position ``p`` uses ``seqused_k = budgets[s] + p - ctx_sel[s] + 1``.

    Args:
        sel_slots: ``(L, num_seqs, k_max)`` slot ids (L = layers, or 1 when shared).
        budgets, ctx_sel, last_pos: ``(num_seqs,)`` int64; ``last_pos`` is the last draft position.
        block_table: ``(num_seqs, max_blocks)`` int32.
        page_stride: pages per block in the page-size-1 view (``2 * block_size`` in vLLM).
        recent_cap: columns reserved for recent positions (>= max ``last_pos - ctx_sel + 1``).

    Returns:
        ``torch.IntTensor`` of shape ``(L, num_seqs, k_max + recent_cap)``.
    """
    num_layers, num_seqs, k_max = sel_slots.shape
    width = k_max + recent_cap
    col = torch.arange(width, device=budgets.device)[None, :]
    k = budgets[:, None]
    pos = ctx_sel[:, None] + (col - k)
    pos = torch.minimum(torch.clamp(pos, min=0), last_pos[:, None])
    blk = torch.clamp(pos // block_size, max=block_table.shape[1] - 1)  # no read past the table
    blocks = torch.gather(block_table[:num_seqs].long(), 1, blk)
    recent = slots_to_fa_pages(blocks * block_size + pos % block_size, block_size, page_stride)
    sel = slots_to_fa_pages(sel_slots.long().clamp(min=0), block_size, page_stride)
    sel = torch.nn.functional.pad(sel, (0, recent_cap))
    return torch.where(col[None] < k[None], sel, recent[None]).to(torch.int32)


@dataclass
class SelectionState:
    """Per-process selection state written by the attention override, read by the proposer.

    Every full-attention forward of the runner (prefill or verification) writes its selection
    into persistent buffers (:meth:`reserve`): ``sel_buf`` rows ``[0, num_seqs)`` hold each
    request's selected slot ids per layer, ``ctx_sel_buf`` / ``budget_buf`` its selectable prefix
    and KV budget. Because the buffers outlive every forward, the same code works eagerly
    (piecewise CUDA graphs: this Python runs every step) and captured into vLLM's full CUDA
    graphs (it runs once at capture; each replay rewrites the buffers).
    """

    config: VllmVegasConfig = field(default_factory=VllmVegasConfig)
    gamma: int = 0
    enabled: bool = False
    first_layer: int = 0
    last_layer: int = 0
    #: plan of the last forward whose Python ran (eager or capture); not valid after a replay
    plan: CollectPlan | None = None
    block_size: int = 0
    page_stride: int = 0
    #: GPU time of the selection work (plan + batched scoring/top-k), eager and replayed alike
    #: (a :class:`~vegas.kernels.device_timer.DeviceTimer`, made by :meth:`reserve` on CUDA)
    timer: object | None = None
    #: (start, end) CUDA events around each eager runner forward, resolved by the proposer
    fwd_events: list = field(default_factory=list)
    time_events: bool = True
    #: set once first_layer/last_layer hold the model's attention layers
    layers_ready: bool = False
    #: set by the first forward that wrote a selection
    has_selection: bool = False
    #: the config is captured into full CUDA graphs and cannot change at run time
    frozen: bool = False
    #: bumped whenever the selection buffers are (re)allocated; keys the proposer's draft graphs
    generation: int = 0
    #: sums a tensor over the tensor-parallel ranks (vLLM's ``tensor_model_parallel_all_reduce``);
    #: None on one GPU. Used when ``config.tp_selection == "all_reduce"``.
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    #: (L, max_seqs, k_cap) int32 slot ids (sliding_window: row 0 only), -1 beyond each budget
    sel_buf: torch.Tensor | None = None
    #: (max_seqs,) int64 selectable positions and KV budget per request of the last forward
    ctx_sel_buf: torch.Tensor | None = None
    budget_buf: torch.Tensor | None = None
    _qbuf: torch.Tensor | None = None
    _qview: torch.Tensor | None = None
    _kcaches: list = field(default_factory=list)
    _koffs: tuple | None = None
    _koffs_key: tuple = ()
    #: Quest page bounds ``(L, num_blocks + 1, kv_heads, head_dim)`` (see :mod:`.quest`)
    quest_min: torch.Tensor | None = None
    quest_max: torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        return self.last_layer - self.first_layer + 1

    def reserve(self, max_seqs: int, k_cap: int, q_elems: int, dtype, device) -> None:
        """Allocate the persistent buffers (before vLLM captures CUDA graphs; grows only).

        Args:
            max_seqs: requests per forward (vLLM's ``max_num_seqs``, padded batches included).
            k_cap: widest KV budget (the budget at ``max_model_len``).
            q_elems: collect-query elements per request and layer (``(γ+1) * heads * head_dim``).
        """
        layers = self.num_layers
        sel = self.sel_buf
        if sel is None or sel.shape[0] < layers or sel.shape[1] < max_seqs or sel.shape[2] < k_cap:
            self.sel_buf = torch.full((layers, max_seqs, k_cap), -1, dtype=torch.int32, device=device)
            self.ctx_sel_buf = torch.zeros(max_seqs, dtype=torch.int64, device=device)
            self.budget_buf = torch.zeros(max_seqs, dtype=torch.int64, device=device)
            self.generation += 1
        if self.time_events and self.timer is None and torch.device(device).type == "cuda":
            from ..kernels.device_timer import DeviceTimer

            self.timer = DeviceTimer(device)
        n = layers * max_seqs * q_elems
        if self._qbuf is None or self._qbuf.numel() < n or self._qbuf.dtype != dtype:
            self._qbuf = torch.empty(n, dtype=dtype, device=device)

    def _ensure(self, num_seqs: int, k_max: int, q_elems: int, dtype, device) -> None:
        fits = (
            self.sel_buf is not None
            and self.sel_buf.shape[1] >= num_seqs
            and self.sel_buf.shape[2] >= k_max
            and self._qbuf is not None
            and self._qbuf.numel() >= self.num_layers * num_seqs * q_elems
            and self._qbuf.dtype == dtype
        )
        if fits:
            return
        if self.frozen or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            # captured full graphs write into the reserved buffers: reallocating would orphan them
            raise RuntimeError(
                f"vegas: selection buffers too small for a batch of {num_seqs} requests and KV "
                f"budget {k_max}; the proposer reserves them from max_num_seqs and max_model_len"
            )
        width = max(k_max, self.sel_buf.shape[2] if self.sel_buf is not None else 0)
        rows = max(num_seqs, self.sel_buf.shape[1] if self.sel_buf is not None else 0)
        self.sel_buf = None  # grow
        self.reserve(rows, width, q_elems, dtype, device)

    def on_layer(self, layer_idx: int, query, kv_cache, attn_metadata, scale: float) -> None:
        """Called after the full attention of ``layer_idx`` in a runner forward.

        Layer 0 builds the plan; every layer stashes its collect queries (one ``index_select``
        into a persistent buffer); the last layer scores all layers in one kernel launch, sums
        the scores over tensor-parallel ranks (``tp_selection="all_reduce"``, one collective
        for all layers), runs one ``torch.topk`` over all layers and requests, and writes the
        selection buffers. With a :attr:`timer`, GPU clock stamps bracket the plan and the
        batched selection; they are captured with the rest, so full-graph replays are timed too
        (read into the proposer's ``select_ms``; the per-layer query copies are not timed).
        """
        if not self.layers_ready:  # the proposer has not told us the model's layers yet
            return
        cfg = self.config
        capturing = query.is_cuda and torch.cuda.is_current_stream_capturing()
        timer = self.timer if query.is_cuda else None
        first = layer_idx == self.first_layer
        last = layer_idx == self.last_layer
        score_based = cfg.selector in ("collect2", "aggregated")
        quest = cfg.selector == "quest"
        if first:
            if timer is not None:
                timer.start()
            plan = make_plan(
                attn_metadata.query_start_loc,
                attn_metadata.seq_lens,
                attn_metadata.max_seq_len,
                self.gamma,
                cfg,
            )
            if plan.q_idx is not None:  # padded requests of a captured batch point past the end
                plan.q_idx.clamp_(0, query.shape[0] - 1)
            self.plan = plan
            self.block_size = kv_cache.shape[2]
            self.page_stride = kv_cache.stride(0) // kv_cache.stride(2)
            nq = plan.q_idx.shape[1] if score_based else 0
            self._ensure(plan.num_seqs, plan.k_max, nq * query.shape[1] * query.shape[2], query.dtype, query.device)
            n = plan.num_seqs
            if quest:  # whole pages; the partial last page joins the recent positions
                ctx_q, budget_q = page_aligned_selection(plan.ctx_sel, plan.budgets, self.block_size)
                self.ctx_sel_buf[:n].copy_(ctx_q)
                self.budget_buf[:n].copy_(budget_q)
                self.has_selection = True
            else:
                self.ctx_sel_buf[:n].copy_(plan.ctx_sel)
                self.budget_buf[:n].copy_(plan.budgets)
            if cfg.selector == "sliding_window" and plan.k_max > 0:
                slots = sliding_window_slots(plan, cfg.num_sinks, attn_metadata.block_table, self.block_size)
                self.sel_buf[0, :n, : plan.k_max].copy_(slots)
                self.has_selection = True
            if score_based:
                shape = (self.num_layers, n, nq) + tuple(query.shape[1:])
                self._qview = self._qbuf[: math.prod(shape)].view(shape)
                self._kcaches = [None] * self.num_layers
            if timer is not None:
                timer.stop()
        plan = self.plan
        if quest and plan is not None:
            if timer is not None:
                timer.start()
            update_layer(self, layer_idx - self.first_layer, kv_cache, attn_metadata.slot_mapping, capturing)
            if timer is not None:
                timer.stop()
            return
        if plan is None or plan.k_max == 0 or not score_based:
            return
        row = layer_idx - self.first_layer
        torch.index_select(
            query, 0, plan.q_idx.reshape(-1), out=self._qview[row].view(-1, *query.shape[1:])
        )
        self._kcaches[row] = kv_cache.unbind(1)[0]
        if not last:
            return
        if timer is not None:
            timer.start()
        bt = attn_metadata.block_table[: plan.num_seqs]
        if query.is_cuda:
            from ..kernels.triton_score import collect_scores_layers_triton, layer_offsets

            key = tuple(k.data_ptr() for k in self._kcaches)
            if self._koffs_key != key:
                if capturing:
                    raise RuntimeError("vegas: KV cache layout first seen inside CUDA-graph capture")
                self._koffs = layer_offsets(self._kcaches)
                self._koffs_key = key
            scores = collect_scores_layers_triton(
                self._qview, plan.q_weight, self._kcaches, bt, plan.ctx_sel, plan.max_len, scale,
                key_offsets=self._koffs,
            )
        else:
            scores = collect_scores_layers_reference(
                self._qview, plan.q_weight, self._kcaches, bt, plan.ctx_sel, plan.max_len, scale
            )
        if self.all_reduce is not None and cfg.tp_selection == "all_reduce":
            scores = self.all_reduce(scores)  # this rank's heads -> all heads; -inf stays -inf
        slots = select_topk_layers(scores, plan.budgets, plan.k_max, bt, self.block_size, plan.recent, plan.ctx_sel)
        self.sel_buf[:, : plan.num_seqs, : plan.k_max].copy_(slots)
        self.has_selection = True
        if timer is not None:
            timer.stop()

    def selection(self, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(sel, ctx_sel, budgets)`` of the last forward's first ``num_seqs`` requests:
        ``(L or 1, num_seqs, k_cap)`` int32 slot ids and ``(num_seqs,)`` int64 twice."""
        sel = self.sel_buf[:1] if self.config.selector == "sliding_window" else self.sel_buf
        return sel[:, :num_seqs], self.ctx_sel_buf[:num_seqs], self.budget_buf[:num_seqs]


#: the process-wide state (one model runner per worker process)
STATE = SelectionState()
