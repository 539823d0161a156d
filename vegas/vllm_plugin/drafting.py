"""Drafting on vLLM: γ forwards of the target model over the selection, eager or as one CUDA graph.

After each verification the proposer drafts γ tokens per request with query length 1, not
scheduled by vLLM: the draft tables (:func:`build_draft_tables`) come from the selection
buffers of :data:`vegas.vllm_plugin.state.STATE`, whichever selection path wrote them, and the
draft attention (:func:`vegas.vllm_plugin.attention.draft_attention`) reads them through
:class:`~vegas.vllm_plugin.attention.DraftMetadata`. One body (:meth:`DraftRunner.steps`) runs
eagerly (piecewise graphs at most) or captured as one CUDA graph per power-of-two row count
(:meth:`DraftRunner.draft_with_graph`), keyed by rows, sampling, the selection path and the
selection buffers' generation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..config import VegasConfigError, VllmOptions
from ..kernels import slots_to_fa_pages
from .state import STATE

__all__ = [
    "DraftBuffers",
    "DraftRunner",
    "GREEDY_TEMPERATURE",
    "SLOT_MAPPING_MIN_ROWS",
    "attention_layers",
    "build_draft_tables",
    "draft_graph_key",
    "draft_tables",
]

logger = logging.getLogger("vegas.vllm")

#: requests whose temperature is below this draft greedily (vLLM's greedy threshold)
GREEDY_TEMPERATURE = 1e-5
#: smallest slot-mapping buffer (tokens): vLLM may pad a draft step's tokens beyond its rows
SLOT_MAPPING_MIN_ROWS = 1024
#: rows of the step inputs: active, last sampled token, its position, KV blocks in use
STEP_INPUT_ROWS = 4


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
    col = torch.arange(width, device=budgets.device)[None, :]  # [1, width]
    k = budgets[:, None]  # [num_seqs, 1]
    positions = ctx_sel[:, None] + (col - k)  # [num_seqs, width] of the recent columns
    positions = torch.minimum(torch.clamp(positions, min=0), last_pos[:, None])
    block_idx = torch.clamp(positions // block_size, max=block_table.shape[1] - 1)  # no read past the table
    blocks = torch.gather(block_table[:num_seqs].long(), 1, block_idx)
    recent = slots_to_fa_pages(blocks * block_size + positions % block_size, block_size, page_stride)
    selected = slots_to_fa_pages(sel_slots.long().clamp(min=0), block_size, page_stride)  # [L, num_seqs, k_max]
    selected = torch.nn.functional.pad(selected, (0, recent_cap))
    return torch.where(col[None] < k[None], selected, recent[None]).to(torch.int32)


def draft_tables(step_inputs: torch.Tensor, block_table: torch.Tensor, rows: int, gamma: int):
    """Page-size-1 draft tables ``(L or 1, rows, width)`` int32, the pages in use before the
    first draft (``base_used`` ``(rows,)`` int64) and the selection path's per-step page chooser
    (Quest, else None), from the last verification's selection in :data:`STATE` (whichever
    path wrote it). Shared by the V1 proposer and the V2 speculator.

    Args:
        step_inputs: ``(4, rows)`` int64 (see :class:`DraftBuffers`), batch order.
        block_table: ``(>= rows, max_blocks)`` int32, the same batch order.
        rows: requests (padded rows included).
        gamma: γ, draft tokens per iteration.
    """
    active, _, first_pos, _ = step_inputs.unbind(0)
    active = active.bool()
    sel, ctx_sel, budgets = STATE.selection(rows)
    ctx_sel = torch.minimum(ctx_sel, first_pos)
    block_table = block_table[:rows]
    path = STATE.path
    # recent positions from ctx_sel on: the verified chunk and the drafts (plus the path's own)
    recent_cap = 2 * gamma + 2 + path.recent_columns(STATE.block_size)
    tables = build_draft_tables(
        sel, budgets, ctx_sel, first_pos + gamma - 1, block_table, STATE.block_size, STATE.page_stride, recent_cap,
    )
    base_used = torch.where(active, budgets + (first_pos - ctx_sel + 1), 1)
    pages = path.draft_pages(STATE, block_table, ctx_sel, budgets, active, sel.shape[2])
    return tables, base_used, pages


def draft_graph_key(rows: int, *extra) -> tuple:
    """The key of a draft CUDA graph: its rows, the caller's own parts (``extra``), the selection
    path's kind, its table rows and the selection buffers' generation (buffers reallocated for a
    larger budget need a new graph)."""
    path = STATE.path
    table_rows = 1 if path.shared_across_layers else STATE.num_layers
    return (rows, *extra, type(path), table_rows, STATE.generation)


def attention_layers(vllm_config) -> list[tuple[str, int]]:
    """``(layer name, layer index)`` of every attention layer of the built model, ascending.

    Raises:
        VegasConfigError: a layer not on FLASH_ATTN, a sliding-window layer, or layer indices
            that are not contiguous.
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
        if impl.sliding_window is not None and tuple(impl.sliding_window) != (-1, -1):
            raise VegasConfigError(
                f"vegas: layer {name} uses sliding-window attention {impl.sliding_window}, which "
                "the compressed draft tables cannot express; only full-attention models are supported "
                "(the HF backend, backend='hf', supports sliding-window models)"
            )
        layers.append((name, layer_index(name)))
    layers.sort(key=lambda x: x[1])
    if [idx for _, idx in layers] != list(range(layers[0][1], layers[-1][1] + 1)):
        raise VegasConfigError("vegas: attention layer indices must be contiguous, got "
                               f"{[idx for _, idx in layers]}")
    STATE.first_layer = layers[0][1]
    STATE.last_layer = layers[-1][1]
    STATE.layers_ready = True
    return layers


@dataclass
class DraftBuffers:
    """Static inputs and outputs of one draft phase over ``rows`` requests (a draft CUDA graph
    reads and writes exactly these tensors)."""

    step_inputs: torch.Tensor  # [4, rows] int64: active, last sampled token, its position, blocks in use
    temperature: torch.Tensor  # [rows] float32 sampling temperature (1 on inactive rows)
    seqused: torch.Tensor  # [rows] int32 pages each request attends in the current draft step
    query_start_loc: torch.Tensor  # [rows + 1] int32 arange: one query per request
    slot_mapping: torch.Tensor  # [max(rows, SLOT_MAPPING_MIN_ROWS)] int64 KV slot of each draft token, -1: none
    tokens: torch.Tensor  # [rows, γ] int64 drafted tokens
    probs: torch.Tensor | None  # [rows, γ, vocab] float32 draft probabilities; None when greedy

    def view(self, rows: int) -> DraftBuffers:
        """The first ``rows`` rows of these buffers (the draft graphs of smaller row counts
        share the largest graph's buffers: graphs replay one at a time on one stream)."""
        return DraftBuffers(
            step_inputs=self.step_inputs[:, :rows],
            temperature=self.temperature[:rows],
            seqused=self.seqused[:rows],
            query_start_loc=self.query_start_loc[: rows + 1],
            slot_mapping=self.slot_mapping[: max(rows, SLOT_MAPPING_MIN_ROWS)],
            tokens=self.tokens[:rows],
            probs=None if self.probs is None else self.probs[:rows],
        )

    @classmethod
    def allocate(cls, rows: int, gamma: int, vocab: int, sampling: bool, device) -> DraftBuffers:
        return cls(
            step_inputs=torch.zeros((STEP_INPUT_ROWS, rows), dtype=torch.int64, device=device),
            temperature=torch.ones(rows, dtype=torch.float32, device=device),
            seqused=torch.ones(rows, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device=device),
            slot_mapping=torch.full((max(rows, SLOT_MAPPING_MIN_ROWS),), -1, dtype=torch.int64, device=device),
            tokens=torch.zeros((rows, gamma), dtype=torch.int64, device=device),
            probs=torch.zeros((rows, gamma, vocab), dtype=torch.float32, device=device) if sampling else None,
        )

    def fill(self, num_reqs: int, step_inputs: torch.Tensor, temperature: torch.Tensor | None) -> None:
        """The step's inputs ``(4, num_reqs)`` into the buffers; rows ``>= num_reqs`` become inactive."""
        self.step_inputs[:, :num_reqs].copy_(step_inputs, non_blocking=True)
        self.step_inputs[:, num_reqs:] = 0
        if temperature is not None:
            self.temperature[:num_reqs].copy_(temperature)
            self.temperature[num_reqs:] = 1.0


class DraftRunner:
    """Runs the draft phases of one proposer on the runner's model and paged KV cache.

    Args:
        runner: vLLM's ``GPUModelRunner`` (model, input buffers, block tables, device).
        vllm_config: the engine's ``VllmConfig``.
        gamma: γ, draft tokens per iteration.
        options: the vLLM options of the run (draft CUDA graphs on/off, row limit).
    """

    def __init__(self, runner, vllm_config, gamma: int, options: VllmOptions) -> None:
        self.runner = runner
        self.vllm_config = vllm_config
        self.gamma = gamma
        self.use_cuda_graphs = options.draft_cuda_graphs
        self.max_graph_rows = options.draft_graph_max_rows
        #: (layer name, layer index) of every attention layer, ascending; set by the proposer
        self.layers: list[tuple[str, int]] = []
        #: layer index -> its row in the selection buffers
        self.layer_rows: dict[int, int] = {}
        self._vocab: int | None = None
        self._graphs: dict = {}
        self._graph_bufs: dict[bool, DraftBuffers] = {}  # sampling -> buffers of the largest graph
        self._graph_pool = None
        self._graph_failed = False

    def vocab_size(self) -> int:
        if self._vocab is None:
            self._vocab = int(self.vllm_config.model_config.get_vocab_size())
        return self._vocab

    def _block_table(self, rows: int | None = None) -> torch.Tensor:
        return self.runner.input_batch.block_table[0].block_table.gpu[:rows]  # [rows, max_blocks] int32

    def draft(self, num_reqs: int, sampling: bool, step_inputs: torch.Tensor, temperature):
        """Draft γ tokens for ``num_reqs`` requests: the draft graph when it applies, else eagerly.

        Returns:
            ``tokens`` ``(>= num_reqs, γ)`` int64 and ``probs`` ``(>= num_reqs, γ, vocab)``
            float32 or None (greedy), views of static buffers (copy before the next draft).
        """
        from vllm.config import CUDAGraphMode

        if self.use_cuda_graphs and not self._graph_failed:
            try:
                tokens, probs = self.draft_with_graph(num_reqs, sampling, step_inputs, temperature)
            except Exception as e:  # fall back to eager drafting for good
                logger.warning("vegas: CUDA-graph drafting failed (%r); drafting eagerly from now on", e)
                self._graph_failed = True
            else:
                if tokens is not None:
                    return tokens, probs
        bufs = DraftBuffers.allocate(num_reqs, self.gamma, self.vocab_size(), sampling, self.runner.device)
        bufs.fill(num_reqs, step_inputs, temperature)
        # piecewise at most: a FULL key would replay vLLM's captured verification graph,
        # with its own metadata and slot mapping, instead of this draft step
        mode, desc = self.runner.cudagraph_dispatcher.dispatch(
            num_tokens=num_reqs, uniform_decode=False,
            valid_modes={CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE},
        )
        num_tokens = desc.num_tokens if desc is not None and desc.num_tokens else num_reqs
        self.steps(bufs, num_reqs, num_tokens, sampling, mode, desc)
        return bufs.tokens, bufs.probs

    def tables(self, step_inputs: torch.Tensor, rows: int):
        """:func:`draft_tables` over the runner's block table (batch order)."""
        return draft_tables(step_inputs, self._block_table(rows), rows, self.gamma)

    def steps(self, bufs: DraftBuffers, rows: int, num_tokens: int, sampling: bool, mode, desc) -> None:
        """Draft tables, then γ draft forwards over ``rows`` requests (``num_tokens`` >= rows
        padded tokens); inputs and outputs in ``bufs``."""
        from vllm.forward_context import set_forward_context

        from .attention import DraftMetadata

        runner = self.runner
        model = runner.model
        block_size = STATE.block_size
        tables, base_used, pages = self.tables(bufs.step_inputs, rows)
        width = tables.shape[-1]
        layer_rows = {idx: 0 for _, idx in self.layers} if tables.shape[0] == 1 else self.layer_rows
        active, tokens, first_pos, num_blocks = bufs.step_inputs.unbind(0)
        active = active.bool()
        if sampling:
            greedy = bufs.temperature < GREEDY_TEMPERATURE
            temperature = torch.where(greedy, 1.0, bufs.temperature)
        block_table = self._block_table(rows)
        last_block = block_table.shape[1] - 1
        input_ids, positions = runner.input_ids.gpu, runner.positions
        slot = bufs.slot_mapping
        slot[rows:num_tokens] = -1
        for j in range(self.gamma):
            pos = first_pos + j
            block_idx = pos // block_size
            valid = active & (block_idx < num_blocks)
            block = torch.gather(block_table, 1, torch.clamp(block_idx, max=last_block)[:, None])[:, 0].long()
            slot[:rows].copy_(torch.where(valid, block * block_size + pos % block_size, -1))
            input_ids[:rows].copy_(tokens)
            positions[:rows].copy_(torch.where(active, pos, 0))
            if num_tokens > rows:
                input_ids[rows:num_tokens] = 0
                positions[rows:num_tokens] = 0
            bufs.seqused.copy_(torch.clamp(base_used + j, max=width))
            attn_metadata = {
                name: DraftMetadata(
                    tables[layer_rows[idx]], bufs.seqused, bufs.query_start_loc, width, rows,
                    quest=pages, quest_row=layer_rows[idx],
                )
                for name, idx in self.layers
            }
            slot_mapping = {name: slot[:num_tokens] for name, _ in self.layers}
            with set_forward_context(
                attn_metadata,
                self.vllm_config,
                num_tokens=num_tokens,
                cudagraph_runtime_mode=mode,
                batch_descriptor=desc,
                slot_mapping=slot_mapping,
            ):
                hidden = model(
                    input_ids=input_ids[:num_tokens],
                    positions=positions[:num_tokens],
                    intermediate_tensors=None,
                    inputs_embeds=None,
                )
            if isinstance(hidden, tuple):
                hidden = hidden[0]
            logits = model.compute_logits(hidden[:rows]).float()  # [rows, vocab]
            tokens = logits.argmax(dim=-1)
            if sampling:
                probs = torch.softmax(logits / temperature[:, None], dim=-1)
                drawn = (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)  # Gumbel-max
                tokens = torch.where(greedy, tokens, drawn)
                bufs.probs[:, j].copy_(probs)
            bufs.tokens[:, j].copy_(tokens)

    def _max_graph_rows(self) -> int:
        """Rows a draft graph can have: the block table's and the selection buffers' rows."""
        return min(self._block_table().shape[0], STATE.sel_buf.shape[1])

    def _graph_rows(self, num_reqs: int) -> int | None:
        """The draft graph's rows for ``num_reqs`` requests: the next power of two, clamped to
        :meth:`_max_graph_rows`; None when that exceeds ``draft_graph_max_rows``."""
        rows = min(1 << max(num_reqs - 1, 0).bit_length(), self._max_graph_rows())
        return None if rows > self.max_graph_rows or rows < num_reqs else rows

    def capture_draft_graphs(self) -> int:
        """Capture the draft graph of every row count a batch can map to, greedy and sampling,
        largest first (smaller graphs then reuse its memory pool and buffers), so that no
        capture happens while requests wait (a capture costs 0.1-0.3 s). Called once after
        vLLM captured its own graphs (:func:`vegas.vllm_plugin.patches.patch_draft_graph_capture`);
        does nothing without draft CUDA graphs or before a forward learnt the cache layout.
        Returns the number of graphs captured."""
        if not self.use_cuda_graphs or self._graph_failed or STATE.sel_buf is None or not STATE.block_size:
            return 0
        sizes = sorted({r for n in range(1, self._max_graph_rows() + 1) if (r := self._graph_rows(n))}, reverse=True)
        before = len(self._graphs)
        for rows in sizes:
            for sampling in (True, False):
                self._graph_entry(rows, sampling)
        return len(self._graphs) - before

    def draft_with_graph(self, num_reqs: int, sampling: bool, step_inputs: torch.Tensor, temperature):
        """Replay (capturing first if needed) the draft graph of the next power-of-two row count;
        ``(None, None)`` when the batch is too large for a graph.

        The graph reads the selection buffers, the runner's block table and its
        :class:`DraftBuffers`; it is keyed by rows, sampling, the selection path's kind and the
        selection buffers' generation (buffers reallocated for a larger budget need a new graph).
        """
        rows = self._graph_rows(num_reqs)
        if rows is None:
            return None, None
        graph, bufs = self._graph_entry(rows, sampling)
        bufs.fill(num_reqs, step_inputs, temperature)
        graph.replay()
        return bufs.tokens, bufs.probs

    def _graph_bufs_for(self, rows: int, sampling: bool) -> DraftBuffers:
        """Buffers of a ``rows``-row graph: views of the largest allocated so far (a larger
        graph gets new buffers; graphs captured before keep theirs)."""
        shared = self._graph_bufs.get(sampling)
        if shared is None or shared.tokens.shape[0] < rows:
            shared = self._graph_bufs[sampling] = DraftBuffers.allocate(
                rows, self.gamma, self.vocab_size(), sampling, self.runner.device)
        return shared.view(rows)

    def _graph_entry(self, rows: int, sampling: bool):
        """``(graph, buffers)`` of ``rows`` rows and the sampling mode, captured on first use."""
        from vllm.config import CUDAGraphMode
        from vllm.distributed.parallel_state import graph_capture
        from vllm.forward_context import BatchDescriptor

        key = draft_graph_key(rows, sampling)
        table_rows = key[-2]
        entry = self._graphs.get(key)
        device = self.runner.device
        if entry is None:
            bufs = self._graph_bufs_for(rows, sampling)
            desc = BatchDescriptor(num_tokens=rows)
            mode = CUDAGraphMode.NONE
            # warm-up: writes nothing (no active row -> every slot is -1)
            self.steps(bufs, rows, rows, sampling, mode, desc)
            torch.cuda.synchronize()
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # vLLM's capture context: with tensor parallelism its custom all-reduce must register
            # the buffers the graph uses (a collective: every rank captures the same key here)
            with graph_capture(device=device) as ctx, torch.cuda.graph(
                graph, pool=self._graph_pool, stream=ctx.stream, capture_error_mode="thread_local"
            ):
                self.steps(bufs, rows, rows, sampling, mode, desc)
            entry = self._graphs[key] = (graph, bufs)
            logger.info("vegas: captured draft graph rows=%d sampling=%s tables=%d", rows, sampling, table_rows)
        return entry
