"""Drafting on vLLM: γ forwards of the target model over the selection, eager or as one CUDA graph.

After each verification the drafter drafts γ tokens per request with query length 1, not
scheduled by vLLM: the draft tables (:func:`build_draft_tables`) come from the selection
buffers of the drafter's :class:`~vegas.vllm_plugin.selection.state.SelectionState`, whichever
selection path wrote them, and the draft attention
(:func:`vegas.vllm_plugin.drafting.attention.draft_attention`) reads them through
:class:`~vegas.vllm_plugin.drafting.attention.DraftMetadata`. One engine (:class:`DraftEngine`)
serves both of vLLM's model runners: one body (:meth:`DraftEngine.run`) runs eagerly or captured
as one CUDA graph per row count (:meth:`DraftEngine.graph`, all captured at engine start by
:meth:`DraftEngine.capture`), keyed by rows, the runner's own parts (V1: sampling or greedy), the
selection path and the selection buffers' generation. The runners' adapters are
:class:`~vegas.vllm_plugin.runners.v1.VegasProposer` (V1) and
:class:`~vegas.vllm_plugin.runners.v2.VegasSpeculator` (V2); they differ in where the block
table lives and how a draft is sampled (:data:`DraftSampler`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...config import VegasConfigError, VllmOptions
from .in_draft import InDraftSelection
from .tables import build_draft_tables, draft_extent
from ..selection.state import LAYER_ATTR, SelectionState

__all__ = [
    "DraftBuffers",
    "DraftEngine",
    "DraftSampler",
    "GREEDY_TEMPERATURE",
    "SLOT_MAPPING_MIN_ROWS",
    "attention_layers",
    "bucket_rows",
    "build_draft_tables",
    "sliding_windows",
    "draft_graph_key",
    "draft_slots",
    "draft_tables",
]

logger = logging.getLogger("vegas.vllm")

#: requests whose temperature is below this draft greedily (vLLM's greedy threshold)
GREEDY_TEMPERATURE = 1e-5
#: smallest slot-mapping buffer (tokens): vLLM may pad a draft step's tokens beyond its rows
SLOT_MAPPING_MIN_ROWS = 1024
#: rows of the step inputs: active, last sampled token, its position, KV blocks in use
STEP_INPUT_ROWS = 4


def draft_tables(state: SelectionState, step_inputs: torch.Tensor, block_table: torch.Tensor, rows: int,
                 gamma: int):
    """Page-size-1 draft tables ``(L or 1, rows, width)`` int32, the pages in use before the
    first draft (``base_used`` ``(rows,)`` int64) and the selection path's per-step page chooser
    (Quest, else None), from the last verification's selection in ``state`` (whichever path
    wrote it).

    Args:
        state: the drafter's selection state.
        step_inputs: ``(4, rows)`` int64 (see :class:`DraftBuffers`), batch order.
        block_table: ``(>= rows, max_blocks)`` int32, the same batch order.
        rows: requests (padded rows included).
        gamma: γ, draft tokens per iteration.
    """
    sel, ctx_sel, budgets = state.selection(rows)
    block_table = block_table[:rows]
    path = state.path
    ext = draft_extent(step_inputs, ctx_sel, budgets, gamma, path.recent_columns(state.block_size))
    tables = build_draft_tables(
        sel, budgets, ext.ctx_sel, ext.first_pos + gamma - 1, block_table, state.block_size, state.page_stride,
        ext.recent_cap,
    )
    pages = path.draft_pages(state, block_table, ext.ctx_sel, budgets, ext.active, sel.shape[2])
    return tables, ext.base_used, pages


def draft_slots(
    pos: torch.Tensor,
    active: torch.Tensor,
    nblocks: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    max_model_len: int,
) -> torch.Tensor:
    """KV slot of each row's draft token at ``pos``, or -1 (no write).

    A slot is written only for active rows whose block index lies inside the blocks the
    request owns (and the table) and whose position is below ``max_model_len``: the gathered
    V2 block table holds stale ids of other requests past ``nblocks``.

    Args:
        pos: ``[rows]`` int64 positions; active: ``[rows]`` bool; nblocks: ``[rows]`` int64.
        block_table: ``[rows, max_blocks]`` int32 (batch order).

    Returns:
        ``[rows]`` int64 slot ids.
    """
    blk_idx = pos // block_size
    valid = active & (blk_idx < nblocks) & (blk_idx < block_table.shape[1]) & (pos < max_model_len)
    blk_idx = torch.clamp(blk_idx, min=0, max=block_table.shape[1] - 1)
    blk = torch.gather(block_table, 1, blk_idx[:, None])[:, 0].long()
    return torch.where(valid, blk * block_size + pos % block_size, torch.full_like(pos, -1))


def bucket_rows(num_reqs: int, cap: int, max_graph_rows: int) -> int | None:
    """Rows of the captured draft graph for ``num_reqs`` requests: 1, 2, 4 or 8, then the next
    multiple of 8 up to 256 and of 16 above (vLLM's own capture sizes: a batch of 40 drafts 40
    rows, not 64 — the draft attention of 64 rows costs 1.5x that of 40 on an H200), clamped to
    ``cap`` (the rows the buffers hold); None when it exceeds ``max_graph_rows`` or cannot hold
    ``num_reqs`` (then the step drafts eagerly)."""
    if num_reqs <= 8:
        rows = 1 << max(num_reqs - 1, 0).bit_length()
    else:
        step = 8 if num_reqs <= 256 else 16
        rows = -(-num_reqs // step) * step
    rows = min(rows, cap)
    return rows if num_reqs <= rows <= max_graph_rows else None


def draft_graph_key(state: SelectionState, rows: int, *extra) -> tuple:
    """The key of a draft CUDA graph: its rows, the caller's own parts (``extra``), the selection
    path's kind, its table rows and the selection buffers' generation (buffers reallocated for a
    larger budget need a new graph), read from the drafter's selection ``state``."""
    path = state.path
    table_rows = 1 if path.shared_across_layers else state.num_layers
    return (rows, *extra, type(path), table_rows, state.generation)


def attention_layers(vllm_config, state: SelectionState) -> list[tuple[str, int]]:
    """``(layer name, layer index)`` of every attention layer of the built model, ascending.

    Also sets ``state``'s layer range (``first_layer``, ``last_layer``, ``layers_ready``) and
    attaches ``state`` to every attention layer module under
    :data:`~vegas.vllm_plugin.selection.state.LAYER_ATTR`: the attention override
    (:func:`~vegas.vllm_plugin.patches.patch_attention`) receives only the layer, and selects
    into the state it finds there.

    Sliding-window layers (Gemma 2/3, Qwen2 with ``use_sliding_window``) are kept: they draft
    over their own window (:func:`sliding_windows`); at least one layer must attend the whole
    context (the layers Vegas selects for).

    Raises:
        VegasConfigError: a layer not on FLASH_ATTN, every layer sliding-window, or layer
            indices that are not contiguous.
    """
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    from .attention import layer_index

    forward_context = vllm_config.compilation_config.static_forward_context
    layers = []
    for name, module in forward_context.items():
        impl = getattr(module, "impl", None)
        if impl is None:
            continue
        if not isinstance(impl, FlashAttentionImpl):
            raise VegasConfigError(
                f"vegas needs the FLASH_ATTN attention backend, layer {name} uses "
                f"{type(impl).__name__}; set attention_backend='FLASH_ATTN'"
            )
        layers.append((name, layer_index(name)))
    layers.sort(key=lambda x: x[1])
    if [idx for _, idx in layers] != list(range(layers[0][1], layers[-1][1] + 1)):
        raise VegasConfigError("vegas: attention layer indices must be contiguous, got "
                               f"{[idx for _, idx in layers]}")
    if len(sliding_windows(vllm_config, layers)) == len(layers):
        raise VegasConfigError(
            "vegas: every attention layer of this model attends a sliding window; Vegas selects KV "
            "entries for full-attention layers, so there is nothing to select (use plain vLLM)"
        )
    state.first_layer = layers[0][1]
    state.last_layer = layers[-1][1]
    state.layers_ready = True
    for name, _ in layers:
        setattr(forward_context[name], LAYER_ATTR, state)
    return layers


def sliding_windows(vllm_config, layers: list[tuple[str, int]]) -> dict[str, tuple[int, int]]:
    """Layer name -> FA3's ``(left, right)`` window of each sliding-window layer among ``layers``
    (vLLM's ``FlashAttentionImpl.sliding_window``, ``(window - 1, 0)``); full-attention layers
    are left out. A sliding layer drafts over its own window of the paged cache, as the layer
    attends in the target model (exact, ``window`` keys per draft token).

    A window that covers ``model_config.max_model_len`` positions never drops a key: such a
    layer attends everything and counts as a full-attention layer. (vLLM gives every layer of a
    model whose config sets ``sliding_window`` without interleaved ``layer_types`` that window,
    e.g. a Gemma 2 config with ``layer_types`` all ``"full_attention"``: ``EngineArgs`` then
    sets ``cache_config.sliding_window``, which the attention layers without a per-layer window
    take.)"""
    forward_context = vllm_config.compilation_config.static_forward_context
    max_len = vllm_config.model_config.max_model_len
    windows = {}
    for name, _ in layers:
        window = getattr(forward_context[name].impl, "sliding_window", None)
        if window is None or tuple(window) == (-1, -1):
            continue
        if window[0] + 1 >= max_len:
            continue  # the window holds every position the engine can reach
        windows[name] = tuple(window)
    return windows


@dataclass
class DraftBuffers:
    """Static inputs and outputs of one draft phase over ``rows`` requests (a draft CUDA graph
    reads and writes exactly these tensors; the graphs of smaller row counts use views of the
    largest one's, :meth:`view`)."""

    step_inputs: torch.Tensor  # [4, rows] int64: active, last sampled token, its position, blocks in use
    slots: torch.Tensor  # [rows] int32 request slot of each row (V2's per-slot draft logits; padding -> scratch)
    temperature: torch.Tensor  # [rows] float32 sampling temperature (1 on inactive rows; V1's sampler)
    seeds: torch.Tensor  # [rows] int64 draft-noise seed of each row's request (V1's sampler; 0 on padding)
    seqused: torch.Tensor  # [rows] int32 pages each request attends in the current draft step
    context_lens: torch.Tensor  # [rows] int32 positions 0..p the draft token at p sees (sliding-window layers)
    query_start_loc: torch.Tensor  # [rows + 1] int32 arange: one query per request
    slot_mapping: torch.Tensor  # [max(rows, SLOT_MAPPING_MIN_ROWS)] int64 KV slot of each draft token, -1: none
    input_ids: torch.Tensor  # [rows] int32 the draft step's input tokens
    positions: torch.Tensor  # [rows] int64 their positions
    tokens: torch.Tensor  # [rows, γ] int64 drafted tokens
    probs: torch.Tensor | None  # [rows, γ, vocab] float32 draft probabilities (V1 sampling); else None

    @classmethod
    def allocate(cls, rows: int, gamma: int, vocab: int, with_probs: bool, device) -> DraftBuffers:
        return cls(
            step_inputs=torch.zeros((STEP_INPUT_ROWS, rows), dtype=torch.int64, device=device),
            slots=torch.zeros(rows, dtype=torch.int32, device=device),
            temperature=torch.ones(rows, dtype=torch.float32, device=device),
            seeds=torch.zeros(rows, dtype=torch.int64, device=device),
            seqused=torch.ones(rows, dtype=torch.int32, device=device),
            context_lens=torch.ones(rows, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device=device),
            slot_mapping=torch.full((max(rows, SLOT_MAPPING_MIN_ROWS),), -1, dtype=torch.int64, device=device),
            input_ids=torch.zeros(rows, dtype=torch.int32, device=device),
            positions=torch.zeros(rows, dtype=torch.int64, device=device),
            tokens=torch.zeros((rows, gamma), dtype=torch.int64, device=device),
            probs=torch.zeros((rows, gamma, vocab), dtype=torch.float32, device=device) if with_probs else None,
        )

    def view(self, rows: int) -> DraftBuffers:
        """The first ``rows`` rows of these buffers (graphs replay one at a time on one stream,
        so the graphs of several row counts can share one set)."""
        return DraftBuffers(
            step_inputs=self.step_inputs[:, :rows],
            slots=self.slots[:rows],
            temperature=self.temperature[:rows],
            seeds=self.seeds[:rows],
            seqused=self.seqused[:rows],
            context_lens=self.context_lens[:rows],
            query_start_loc=self.query_start_loc[: rows + 1],
            slot_mapping=self.slot_mapping[: max(rows, SLOT_MAPPING_MIN_ROWS)],
            input_ids=self.input_ids[:rows],
            positions=self.positions[:rows],
            tokens=self.tokens[:rows],
            probs=None if self.probs is None else self.probs[:rows],
        )

    def fill(self, num_reqs: int, step_inputs: torch.Tensor, temperature: torch.Tensor | None = None,
             slots: torch.Tensor | None = None, scratch: int = 0, seeds: torch.Tensor | None = None) -> None:
        """The step's inputs ``(4, num_reqs)`` (and per-row temperatures / request slots /
        draft-noise seeds) into the buffers; rows ``>= num_reqs`` become inactive and point at
        the ``scratch`` slot."""
        self.step_inputs[:, :num_reqs].copy_(step_inputs, non_blocking=True)
        self.step_inputs[:, num_reqs:] = 0
        if temperature is not None:
            self.temperature[:num_reqs].copy_(temperature)
            self.temperature[num_reqs:] = 1.0
        if seeds is not None:
            self.seeds[:num_reqs].copy_(seeds, non_blocking=True)
            self.seeds[num_reqs:] = 0
        if slots is not None:
            self.slots[:num_reqs].copy_(slots, non_blocking=True)
        self.slots[num_reqs:] = scratch


#: a draft sampler: ``(logits [rows, vocab], step j, buffers) -> tokens [rows]``; it may write
#: the draft distribution where its runner's rejection sampler reads it. Both runners' samplers
#: are vLLM's seeded ``gumbel_sample`` (V1: :func:`vegas.vllm_plugin.runners.seeds.seeded_sampler`;
#: V2: ``VegasSpeculator._sample``)
DraftSampler = Callable[[torch.Tensor, int, DraftBuffers], torch.Tensor]


class DraftEngine:
    """The draft phase of both vLLM model runners: γ query-length-1 forwards of the target
    model over the last verification's selection, eagerly or replayed from one CUDA graph per
    row count (captured at engine start, :meth:`capture`).

    What differs between the runners stays with them: where their static block table lives
    (``block_table``) and how a draft is sampled (a :data:`DraftSampler`).

    Args:
        vllm_config: the engine's ``VllmConfig``.
        state: the drafter's selection state (the selection the draft tables come from).
        gamma: γ, draft tokens per iteration.
        options: the vLLM options of the run (draft CUDA graphs on/off, row limit).
        device: the runner's device.
        block_table: returns the runner's static block table ``(max_rows, max_blocks)`` int32,
            batch order (a draft graph reads it in place).
        model: returns the target model as the runner calls it (read at each draft phase: the
            runner may wrap it after loading).
    """

    def __init__(self, vllm_config, state: SelectionState, gamma: int, options: VllmOptions, device,
                 block_table: Callable[[], torch.Tensor], model: Callable[[], object]) -> None:
        self.vllm_config = vllm_config
        #: the drafter's selection state (owned by the V1 proposer or the V2 speculator)
        self.state = state
        self.gamma = gamma
        #: the runner's device (the V1 proposer learns it when the runner loads the model)
        self.device = device
        self.block_table = block_table
        self.model = model
        self.use_cuda_graphs = options.draft_cuda_graphs
        self.max_graph_rows = options.draft_graph_max_rows
        #: (layer name, layer index) of every attention layer, ascending (:meth:`set_layers`)
        self.layers: list[tuple[str, int]] = []
        #: layer index -> its row in the selection buffers
        self.layer_rows: dict[int, int] = {}
        self.windows: dict[str, tuple[int, int]] = {}
        self.graph_failed = False
        #: the selection beside the first draft forward (``vllm.select_in_draft``)
        self.in_draft = InDraftSelection()
        self._graphs: dict = {}
        self._shared: dict[bool, DraftBuffers] = {}  # with probs? -> buffers of the largest graph
        self._pool = None

    @property
    def max_model_len(self) -> int:
        return int(self.vllm_config.model_config.max_model_len)

    @property
    def vocab_size(self) -> int:
        return int(self.vllm_config.model_config.get_vocab_size())

    @property
    def attention_impl(self):
        """The first attention layer's ``FlashAttentionImpl``: its heads, head size, soft-cap
        and FA version stand for every layer's in the draft step's FA3 schedule."""
        forward_context = self.vllm_config.compilation_config.static_forward_context
        return forward_context[self.layers[0][0]].impl

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype: ``cache_dtype`` when it names one, else the model's (Vegas
        refuses quantized KV caches)."""
        named = {"bfloat16": torch.bfloat16, "float16": torch.float16}
        return named.get(self.vllm_config.cache_config.cache_dtype, self.vllm_config.model_config.dtype)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def set_layers(self, layers: list[tuple[str, int]]) -> None:
        self.layers = layers
        self.layer_rows = {idx: i for i, (_, idx) in enumerate(layers)}
        #: layer name -> FA3 window of each sliding-window layer (drafts over its own window)
        self.windows = sliding_windows(self.vllm_config, layers)

    def buffers(self, rows: int, with_probs: bool) -> DraftBuffers:
        """Fresh buffers for an eager draft phase."""
        return DraftBuffers.allocate(rows, self.gamma, self.vocab_size, with_probs, self.device)

    def run(self, bufs: DraftBuffers, rows: int, sample: DraftSampler, num_tokens: int | None = None,
            mode=None, desc=None, input_ids: torch.Tensor | None = None,
            positions: torch.Tensor | None = None) -> None:
        """One draft phase over ``rows`` requests (what a draft graph captures): the draft
        tables, then γ forwards, each sampled into ``bufs.tokens[:, j]``.

        Args:
            num_tokens: tokens of each forward (>= rows; vLLM pads eager batches).
            mode, desc: vLLM's CUDA-graph mode and batch descriptor of the forwards (default:
                no vLLM graph; the V1 runner's eager path passes its piecewise graphs).
            input_ids, positions: the forwards' input buffers (default: ``bufs``'; vLLM's
                piecewise graphs read the runner's own).
        """
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import BatchDescriptor, set_forward_context

        from .attention import DraftMetadata, draft_schedule

        num_tokens = num_tokens or rows
        mode = CUDAGraphMode.NONE if mode is None else mode
        desc = BatchDescriptor(num_tokens=rows) if desc is None else desc
        input_ids = bufs.input_ids if input_ids is None else input_ids
        positions = bufs.positions if positions is None else positions
        max_len = self.max_model_len
        model = self.model()
        block_table = self.block_table()[:rows]  # [rows, max_blocks] int32
        ready = {}  # layer row -> event of its selection made beside the first draft forward
        if self.state.select_in_draft:
            if not self.state.key_caches:  # no verification has deferred a selection yet (a warm-up)
                self._bind_score_inputs()
            tables, base_used, ready = self.in_draft.tables(self.state, bufs.step_inputs, block_table, rows,
                                                            self.gamma, max_len)
            pages = None
        else:
            tables, base_used, pages = draft_tables(self.state, bufs.step_inputs, block_table, rows, self.gamma)
        width = tables.shape[-1]
        layer_rows = {idx: 0 for _, idx in self.layers} if tables.shape[0] == 1 else self.layer_rows
        active, tokens, first_pos, num_blocks = bufs.step_inputs.unbind(0)
        active = active.bool()
        slot = bufs.slot_mapping
        slot[rows:num_tokens] = -1
        for j in range(self.gamma):
            pos = first_pos + j
            slot[:rows].copy_(draft_slots(pos, active, num_blocks, block_table, self.state.block_size, max_len))
            input_ids[:rows].copy_(tokens)
            positions[:rows].copy_(torch.where(active, torch.clamp(pos, max=max_len - 1), 0))
            if num_tokens > rows:
                input_ids[rows:num_tokens] = 0
                positions[rows:num_tokens] = 0
            bufs.seqused.copy_(torch.clamp(base_used + j, max=width))
            schedule = draft_schedule(self.attention_impl, bufs.seqused, bufs.query_start_loc, width, self.kv_dtype)
            attn_metadata = {
                name: DraftMetadata(
                    tables[layer_rows[idx]], bufs.seqused, bufs.query_start_loc, width, rows,
                    quest=pages, quest_row=layer_rows[idx], scheduler_metadata=schedule,
                    ready=ready.get(layer_rows[idx]) if j == 0 else None,
                )
                for name, idx in self.layers if name not in self.windows
            }
            if self.windows:  # sliding-window layers: their own window of the paged cache, positions 0..p
                bufs.context_lens.copy_(torch.where(active, torch.clamp(pos, max=max_len - 1) + 1, 1))
                for name, window in self.windows.items():
                    attn_metadata[name] = DraftMetadata(block_table, bufs.context_lens, bufs.query_start_loc, max_len,
                                                        rows, window=window)
            with set_forward_context(
                attn_metadata,
                self.vllm_config,
                num_tokens=num_tokens,
                cudagraph_runtime_mode=mode,
                batch_descriptor=desc,
                slot_mapping={name: slot[:num_tokens] for name, _ in self.layers},
            ):
                hidden = model(
                    input_ids=input_ids[:num_tokens],
                    positions=positions[:num_tokens],
                    intermediate_tensors=None,
                    inputs_embeds=None,
                )
            if isinstance(hidden, tuple):
                hidden = hidden[0]
            tokens = sample(model.compute_logits(hidden[:rows]), j, bufs)  # [rows]
            bufs.tokens[:, j].copy_(tokens)
            if j == 0 and ready:
                self.in_draft.join(self.device)

    def _bind_score_inputs(self) -> None:
        """What a deferred selection reads besides the buffers, from the layers themselves when
        no verification has set it yet (``vllm.select_in_draft`` before the first forward):
        each layer's key cache (vLLM binds ``kv_cache`` to every attention layer), the softmax
        scale, the query heads and the collect queries per request."""
        forward_context = self.vllm_config.compilation_config.static_forward_context
        state, impl = self.state, self.attention_impl
        state.key_caches = [forward_context[name].kv_cache.unbind(1)[0] for name, _ in self.layers]
        state.score_scale = float(impl.scale)
        state.query_heads = (int(impl.num_heads), int(impl.head_size))
        state.score_width = state.path.row_table.width

    def graph_rows(self, num_reqs: int, cap: int) -> int | None:
        """Rows of the draft graph for ``num_reqs`` requests (:func:`bucket_rows`), or None
        (draft eagerly): draft graphs off or failed, or a batch above ``draft_graph_max_rows``."""
        if not self.use_cuda_graphs or self.graph_failed:
            return None
        return bucket_rows(num_reqs, cap, self.max_graph_rows)

    def graph(self, rows: int, key: tuple, sample: DraftSampler, with_probs: bool, scratch: int = 0):
        """``(graph, buffers)`` of ``rows`` rows under ``key`` (:func:`draft_graph_key`),
        captured on first use over views of the shared buffers."""
        entry = self._graphs.get(key)
        if entry is not None:
            return entry
        from vllm.distributed.parallel_state import graph_capture

        shared = self._shared.get(with_probs)
        if shared is None or shared.tokens.shape[0] < rows:
            shared = self._shared[with_probs] = self.buffers(rows, with_probs)
        bufs = shared.view(rows)
        # no active row and every row on the scratch slot: the warm-up and capture write no KV
        # and no live request's draft distribution
        bufs.fill(0, bufs.step_inputs[:, :0], scratch=scratch)
        self.run(bufs, rows, sample)
        torch.cuda.synchronize(self.device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # vLLM's capture context: with tensor parallelism its custom all-reduce must register
        # the buffers the graph uses (a collective: every rank captures the same key here)
        with graph_capture(device=self.device) as ctx, torch.cuda.graph(
            graph, pool=self._pool, stream=ctx.stream, capture_error_mode="thread_local"
        ):
            self.run(bufs, rows, sample)
        entry = self._graphs[key] = (graph, bufs)
        logger.info("vegas: captured draft graph rows=%d key=%s", rows, key[1:])
        return entry

    def capture(self, cap: int, variants) -> int:
        """Capture, largest first (smaller graphs reuse its pool and buffers), the graph of every
        row count a batch of up to ``cap`` requests maps to, for each ``(key extra, sampler,
        with_probs, scratch)`` in ``variants``; nothing without draft graphs or before a
        verification forward learnt the cache layout. Returns the graphs captured."""
        state = self.state
        if not self.use_cuda_graphs or self.graph_failed or state.sel_buf is None or not state.block_size:
            return 0
        before = len(self._graphs)
        sizes = sorted({r for n in range(1, cap + 1) if (r := bucket_rows(n, cap, self.max_graph_rows))}, reverse=True)
        for rows in sizes:
            for extra, sample, with_probs, scratch in variants:
                self.graph(rows, draft_graph_key(state, rows, *extra), sample, with_probs, scratch)
        return len(self._graphs) - before
