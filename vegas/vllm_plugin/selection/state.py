"""The selection state of a Vegas drafter in a vLLM worker (pure PyTorch, no vLLM).

One :class:`SelectionState` per Vegas drafter (the V1 proposer or the V2 speculator, which
creates it and hands it to what needs it: its draft engine, the draft tables), written by the
attention override during each full-attention forward of the runner (prefill or verification)
and read by the drafter in the same ``execute_model`` call, so batch rows line up. vLLM calls
the override with the attention layer only, so the drafter attaches its state to every attention
layer of the model under :data:`LAYER_ATTR` when it learns the layers
(:func:`~vegas.vllm_plugin.drafting.engine.attention_layers`); a layer without it (an engine without
the Vegas drafter) runs plain vLLM. What is selected, and how, is the
:class:`~vegas.vllm_plugin.selectors.base.SelectionPath` in :attr:`SelectionState.path`: a
built-in selector's fast path or the generic path.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ...config import VegasConfigError
from ..selectors.plan import CollectPlan, make_plan

__all__ = ["LAYER_ATTR", "SelectionState"]

#: the attribute of each vLLM attention layer (``Attention`` module, the ``layer`` argument of
#: ``FlashAttentionImpl.forward``) that holds the :class:`SelectionState` of the drafter that
#: drafts with the layer's model; absent on the layers of an engine without the Vegas drafter
LAYER_ATTR = "vegas_state"


@dataclass
class SelectionState:
    """A drafter's selection buffers and what the attention override needs to fill them.

    Every full-attention forward writes its selection into persistent buffers
    (:meth:`reserve`): ``sel_buf`` rows ``[0, num_seqs)`` hold each request's selected slot ids
    per layer, ``ctx_sel_buf`` / ``budget_buf`` its selectable prefix and KV budget. Because the
    buffers outlive every forward, the same code works eagerly (piecewise CUDA graphs: this
    Python runs every step) and captured into vLLM's full CUDA graphs (it runs once at capture;
    each replay rewrites the buffers).
    """

    #: the selection path of the selector in force (None: Vegas is not configured yet)
    path: object | None = None
    #: the settings JSON (selector name + VegasConfig) the path was built from
    settings: str = ""
    gamma: int = 0
    enabled: bool = False
    first_layer: int = 0
    last_layer: int = 0
    #: plan of the last forward whose Python ran (eager or capture); not valid after a replay
    plan: CollectPlan | None = None
    block_size: int = 0
    #: pages per KV block in the page-size-1 view (``2 * block_size`` in vLLM's layout)
    page_stride: int = 0
    #: GPU time of the selection work, eager and replayed alike (a
    #: :class:`~vegas.kernels.device_timer.DeviceTimer`, made by :meth:`reserve` on CUDA)
    timer: object | None = None
    #: (start, end) CUDA events around each eager runner forward, resolved by the proposer
    fwd_events: list = field(default_factory=list)
    time_events: bool = True
    #: set once first_layer/last_layer hold the model's attention layers
    layers_ready: bool = False
    #: set by the first forward that wrote a selection
    has_selection: bool = False
    #: the selection is captured into full CUDA graphs and the selector cannot change at run time
    frozen: bool = False
    #: bumped whenever the selection buffers are (re)allocated; keys the proposer's draft graphs
    generation: int = 0
    #: sums a tensor over the tensor-parallel ranks (vLLM's ``tensor_model_parallel_all_reduce``);
    #: None on one GPU. Used when ``VegasConfig.vllm.tp_selection == "all_reduce"``.
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    sel_buf: torch.Tensor | None = None  # [L, max_seqs, k_cap] int32 slot ids, -1 beyond each budget
    ctx_sel_buf: torch.Tensor | None = None  # [max_seqs] int64 selectable positions
    budget_buf: torch.Tensor | None = None  # [max_seqs] int64 selected entries per request
    query_buf: torch.Tensor | None = None  # [L * max_seqs * q_elems] model dtype, collect queries
    #: attention logit soft-cap of the model's layers (vLLM's ``logits_soft_cap``, Gemma 2), 0 for
    #: none; read from the first layer of each forward, scores are taken on the capped logits
    softcap: float = 0.0
    #: Quest page bounds ``(L, num_blocks + 1, kv_heads, head_dim)`` (see :mod:`vegas.vllm_plugin.selectors.quest`)
    quest_min: torch.Tensor | None = None
    quest_max: torch.Tensor | None = None
    #: the score path inside the verification attention (:class:`~.fa3_verify.FA3ScoreVerify`, or
    #: :class:`~.cute_verify.CuteProbeVerify` with ``vllm.score_path="cute"``), made by
    #: :meth:`score_verify`
    fa3: object | None = None
    #: forwards carrying at least this many prompt tokens neither select nor draft
    #: (``VegasConfig.vllm.prefill_skip_tokens``; 0: never skip)
    prefill_skip_tokens: int = 0
    #: the last forward whose Python ran skipped its selection (:meth:`skips`); the drafter
    #: reads and clears it (:meth:`take_skip`)
    skipped: bool = False
    #: the scheduler's decision for the current step when it makes one (V2 runner, async
    #: scheduling: :mod:`~vegas.vllm_plugin.step_switch`): True skips, False selects; None: the
    #: forward decides from its own prompt tokens and :attr:`prefill_skip_tokens`
    scheduled_skip: bool | None = None
    #: ``VegasConfig.vllm.select_in_draft`` in force (a score-based top-k path on one GPU): the
    #: verification only keeps its collect queries (:meth:`defer_selection`), the draft phase
    #: scores and selects (:mod:`~vegas.vllm_plugin.drafting.in_draft`)
    select_in_draft: bool = False
    q_weight_buf: torch.Tensor | None = None  # [max_seqs, γ + 1] float32 collect-query weights
    recent_buf: torch.Tensor | None = None  # [max_seqs] int64 recent positions kept inside the budget
    #: what the deferred selection reads besides the buffers (set by :meth:`defer_selection`):
    #: each layer's key cache ``(num_blocks, block_size, kv_heads, head_dim)``, the softmax
    #: scale, collect queries per request and the query heads' ``(heads, head_dim)``
    key_caches: list = field(default_factory=list)
    score_scale: float = 0.0
    score_width: int = 0
    query_heads: tuple[int, int] = (0, 0)

    @property
    def num_layers(self) -> int:
        return self.last_layer - self.first_layer + 1

    def use(self, path, settings: str = "") -> None:
        """Make ``path`` (a :class:`~vegas.vllm_plugin.selectors.base.SelectionPath`) the one in force."""
        self.path, self.settings = path, settings

    def reserve(self, max_seqs: int, k_cap: int, q_elems: int, dtype, device) -> None:
        """Allocate the persistent buffers (before vLLM captures CUDA graphs; grows only).

        Args:
            max_seqs: requests per forward (vLLM's ``max_num_seqs``, padded batches included).
            k_cap: widest KV budget (the budget at ``max_model_len``), tokens.
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
            from ...kernels.device_timer import DeviceTimer

            self.timer = DeviceTimer(device)
        n = layers * max_seqs * q_elems
        if self.query_buf is None or self.query_buf.numel() < n or self.query_buf.dtype != dtype:
            self.query_buf = torch.empty(n, dtype=dtype, device=device)
        if self.q_weight_buf is None or self.q_weight_buf.shape[0] < max_seqs:
            self.q_weight_buf = torch.zeros((max_seqs, self.gamma + 1), dtype=torch.float32, device=device)
            self.recent_buf = torch.zeros(max_seqs, dtype=torch.int64, device=device)

    def _ensure(self, num_seqs: int, k_max: int, q_elems: int, dtype, device) -> None:
        fits = (
            self.sel_buf is not None
            and self.sel_buf.shape[1] >= num_seqs
            and self.sel_buf.shape[2] >= k_max
            and self.query_buf is not None
            and self.query_buf.numel() >= self.num_layers * num_seqs * q_elems
            and self.query_buf.dtype == dtype
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

    @staticmethod
    def capturing(query: torch.Tensor) -> bool:
        """Whether a CUDA graph is being captured on ``query``'s stream."""
        return query.is_cuda and torch.cuda.is_current_stream_capturing()

    @contextmanager
    def timed(self, query: torch.Tensor):
        """GPU clock stamps around the block (CUDA only; captured with it, so replays count)."""
        timer = self.timer if query.is_cuda else None
        if timer is not None:
            timer.start()
        yield
        if timer is not None:
            timer.stop()

    def prompt_tokens(self, attn_metadata) -> int:
        """Prompt tokens of a forward, from its host-side metadata (no device sync): tokens
        beyond ``γ + 1`` per request (a prefill chunk's), 0 for a decode-only batch."""
        if attn_metadata.max_query_len <= self.gamma + 1:
            return 0
        num_reqs = attn_metadata.query_start_loc.shape[0] - 1
        return max(0, int(attn_metadata.num_actual_tokens) - (self.gamma + 1) * num_reqs)

    def skips(self, attn_metadata) -> bool:
        """Whether this forward skips selection and drafting: the scheduler said so
        (:attr:`scheduled_skip`), or, without its decision, the forward carries at least
        :attr:`prefill_skip_tokens` prompt tokens (:meth:`prompt_tokens`). Sets :attr:`skipped`."""
        if self.scheduled_skip is not None:
            self.skipped = self.scheduled_skip
        else:
            limit = self.prefill_skip_tokens
            self.skipped = bool(limit) and self.prompt_tokens(attn_metadata) >= limit
        if self.skipped:
            self.plan = None
        return self.skipped

    @contextmanager
    def skipping(self):
        """Forwards run inside the block skip their selection as a step the scheduler gave no
        draft slots does (:attr:`scheduled_skip` True): used to capture the full CUDA graphs of
        plain steps without any selection in them (:mod:`~vegas.vllm_plugin.plain_graphs`).
        :attr:`scheduled_skip` and :attr:`skipped` are restored afterwards, so that no capture
        leaves a decision behind for the first real step."""
        before = self.scheduled_skip, self.skipped
        self.scheduled_skip = True
        try:
            yield
        finally:
            self.scheduled_skip, self.skipped = before

    def take_skip(self) -> bool:
        """Whether the last forward skipped its selection (then the drafter drafts nothing);
        clears the flag, since a replayed full CUDA graph (decode-only) does not run
        :meth:`skips`."""
        skipped, self.skipped = self.skipped, False
        return skipped

    def on_layer(self, layer_idx: int, query, kv_cache, attn_metadata, scale: float, softcap: float = 0.0) -> None:
        """Called after the full attention of ``layer_idx`` in a runner forward.

        The first layer builds the plan (:func:`~vegas.vllm_plugin.selectors.plan.make_plan`) and lets the
        path write each request's selectable prefix and budget; every layer is then handed to
        the path (:meth:`SelectionPath.layer`), which writes the selection buffers.

        Args:
            query: ``(num_tokens, num_q_heads, head_dim)`` the forward's queries.
            kv_cache: ``(num_blocks, 2, block_size, num_kv_heads, head_dim)`` the layer's cache.
            attn_metadata: vLLM's FlashAttention metadata (``query_start_loc``, ``seq_lens``,
                ``max_seq_len``, ``block_table``, ``slot_mapping``).
            scale: the softmax scale.
            softcap: the layer's ``logits_soft_cap`` (0: none). One value for all layers (every
                soft-capped model vLLM runs has one): the scores of all layers are taken in one
                launch with the first layer's cap.

        Raises:
            VegasConfigError: a layer's soft-cap differs from the first layer's.
        """
        if not self.layers_ready or self.path is None:  # the proposer has not set us up yet
            return
        row = layer_idx - self.first_layer
        fa3 = self.fa3 is not None and self.fa3.active  # a layer the FA3 score path does not cover
        if row == 0 and not fa3:
            if self.skips(attn_metadata):
                return
            with self.timed(query):
                self.softcap = float(softcap or 0.0)
                self._begin_forward(query, kv_cache, attn_metadata)
        if self.plan is None:
            return
        if float(softcap or 0.0) != self.softcap:  # both paths score every layer with the first layer's cap
            raise VegasConfigError(
                f"vegas: layer {layer_idx} has logit soft-cap {softcap}, the first layer {self.softcap}; "
                "the score kernel takes one soft-cap for all layers"
            )
        if fa3:
            self.fa3.fallback_layer(self, row, query, kv_cache, attn_metadata, scale)
            if row == self.num_layers - 1:
                self._finish_fa3(query, attn_metadata)
            return
        self.path.layer(self, row, query, kv_cache, attn_metadata, scale)

    def _begin_forward(self, query, kv_cache, attn_metadata, fa3_heads: int = 0) -> None:
        """First layer of a runner forward: the plan, the buffers and the path's begin.
        ``fa3_heads``: the FA3 score path runs this forward with that many KV heads per layer."""
        plan = make_plan(
            attn_metadata.query_start_loc, attn_metadata.seq_lens, attn_metadata.max_seq_len,
            self.gamma, self.path.selector, self.path.row_table,
        )
        if fa3_heads:
            self.fa3.prepare(self, plan, attn_metadata, fa3_heads, query.device)
        if plan.q_idx is not None:  # padded requests of a captured batch point past the end
            plan.q_idx.clamp_(0, query.shape[0] - 1)
        self.plan = plan
        self.block_size = kv_cache.shape[2]
        self.page_stride = kv_cache.stride(0) // kv_cache.stride(2)
        width = plan.q_idx.shape[1] if plan.q_idx is not None else 0
        self._ensure(plan.num_seqs, plan.k_max, width * query.shape[1] * query.shape[2], query.dtype,
                     query.device)
        self.path.begin(self, plan, query, kv_cache, attn_metadata)

    def verify_layer(self, impl, layer_idx: int, query, kv_cache, attn_metadata, output) -> bool:
        """Before vLLM's FA3 call of a runner forward's layer: run it through FA3 with the score
        output instead when this forward can (:class:`~.fa3_verify.FA3ScoreVerify`).

        Returns:
            True: ``output`` holds the layer's attention and its score row is kept (nothing else
            to call); False: call vLLM's FA3, then :meth:`on_layer`, as without the extension.
        """
        if (not self.layers_ready or self.path is None or not getattr(self.path, "uses_fa3_scores", False)
                or self.select_in_draft):  # the draft phase scores (select_in_draft)
            return False
        fa3 = self.score_verify()
        row = layer_idx - self.first_layer
        if row == 0:
            self.block_size = kv_cache.shape[2]
            if self.skips(attn_metadata) or not fa3.begin(self, impl, query, attn_metadata):
                return False
            with self.timed(query):
                self.softcap = float(getattr(impl, "logits_soft_cap", 0.0) or 0.0)
                self._begin_forward(query, kv_cache, attn_metadata, fa3_heads=impl.num_kv_heads)
        elif row not in fa3.layer_reason:
            fa3.layer_reason[row] = fa3.impl_reason(impl, query)
        if not fa3.active or fa3.layer_reason[row] is not None:
            return False
        fa3.layer(self, row, impl, query, kv_cache, attn_metadata, output)
        if row == self.num_layers - 1:
            self._finish_fa3(query, attn_metadata)
        return True

    def score_verify(self):
        """The score path inside the verification attention of the path in force (made once, by
        :func:`~.cute_verify.make_score_verify` from ``vllm.score_path``)."""
        if self.fa3 is None:
            from .cute_verify import make_score_verify

            self.fa3 = make_score_verify(self.path.selector.config.vllm.score_path)
        return self.fa3

    def _finish_fa3(self, query, attn_metadata) -> None:
        """Last layer of a forward on the FA3 score path: the selection from its score rows."""
        from ..selectors.scores import _sums_over_ranks

        plan, fa3 = self.plan, self.fa3
        fa3.active = False
        if plan.k_max == 0:
            return
        with self.timed(query):
            scores = fa3.scores  # [L, num_seqs, max_len] float32
            if self.all_reduce is not None and _sums_over_ranks(self):
                scores = self.all_reduce(scores)
            self.path.select_layers(self, plan, scores, attn_metadata.block_table[: plan.num_seqs])

    def query_rows(self) -> int:
        """Requests the collect-query buffer is laid out for: ``max_seqs`` (the reserved
        selection buffers') under ``select_in_draft``, whose draft phase reads the queries with
        its own row count, else 0 (each forward lays them out for its own batch)."""
        return self.sel_buf.shape[1] if self.select_in_draft else 0

    def defer_selection(self, plan: CollectPlan, scale: float, key_caches: list, query: torch.Tensor) -> None:
        """Last layer of a forward under ``select_in_draft``: keep what the draft phase's
        selection reads beyond the collect queries (already in ``query_buf``) and the prefix and
        budgets (``ctx_sel_buf``, ``budget_buf``): the collect queries' weights and recent
        windows (persistent buffers, so a replayed CUDA graph rewrites them), the key caches,
        the softmax scale.

        Args:
            query: ``(num_tokens, heads, head_dim)`` the forward's queries (their head shape).
        """
        n, width = plan.num_seqs, plan.q_idx.shape[1]
        self.q_weight_buf[:n, :width].copy_(plan.q_weight)
        self.recent_buf[:n].copy_(plan.recent)
        self.key_caches = list(key_caches)
        self.score_scale, self.score_width = float(scale), width
        self.query_heads = (query.shape[1], query.shape[2])
        self.has_selection = True

    def collect_queries(self, rows: int) -> torch.Tensor:
        """``(L, rows, width, heads, head_dim)`` the collect queries a deferred selection scores
        (a view of ``query_buf`` in the :meth:`query_rows` layout)."""
        heads, head_dim = self.query_heads
        shape = (self.num_layers, self.query_rows(), self.score_width, heads, head_dim)
        return self.query_buf[: math.prod(shape)].view(shape)[:, :rows]

    def selection(self, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(sel, ctx_sel, budgets)`` of the last forward's first ``num_seqs`` requests:
        ``(L or 1, num_seqs, k_cap)`` int32 slot ids and ``(num_seqs,)`` int64 twice."""
        sel = self.sel_buf[:1] if self.path.shared_across_layers else self.sel_buf
        return sel[:, :num_seqs], self.ctx_sel_buf[:num_seqs], self.budget_buf[:num_seqs]
