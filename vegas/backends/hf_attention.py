"""The attention function Vegas registers with transformers' ``AttentionInterface``.

transformers calls it for every attention layer with the layer's post-RoPE ``query``
``(batch_size, num_heads, q_len, head_dim)`` and the cached ``key``/``value``
``(batch_size, num_kv_heads, num_slots, head_dim)`` (the new tokens included, before GQA
repetition). The per-call :class:`AttentionContext` travels as the keyword ``vegas_ctx``
of ``model(...)``; without it the function is plain causal attention.

Masks never come from the model. The name ``"vegas"`` has no entry in transformers'
``AttentionMaskInterface``, so every architecture's mask builder returns None for it (no
``T x T`` mask is materialised by transformers); this function builds each layer's mask from
the context's per-slot positions and validity instead. That is one mask path for every
architecture: causal by position, padding and rolled-back slots hidden, and, on layers that
transformers calls with ``sliding_window=W``, only keys with ``query_pos - key_pos < W``
(transformers' ``sliding_window_overlay``).

* ``full``: full attention (prefill, verification, plain decoding). When
  ``ctx.score_rows`` is set, the logits of those query rows are reduced with
  :func:`vegas.selection.collect_scores` into ``ctx.scores[layer]`` (on a sliding-window
  layer, over the slots inside the rows' windows; 0 elsewhere).
* ``draft``: sparse attention over the layer's selected slots (gathered, so the work is
  proportional to the KV budget) plus every slot appended since the selection; on a
  sliding-window layer the selection is made among the slots inside the window, and the
  slots a draft query's window has left are masked out. The selected slots the query did
  attend (after that masking) are counted into ``ctx.attended``, per row and layer: the one
  count behind :attr:`vegas.outputs.RequestStats.kv_attended`.

Logit soft-capping (Gemma 2's ``attn_logit_softcapping``, passed by transformers as
``softcap=c``): every mode computes ``c * tanh(scaling * q·k / c)`` before the mask and the
softmax, as transformers' eager attention does (SDPA has no soft-cap, so these layers run the
explicit matmul-softmax-matmul of :func:`_softcapped_attention`). Scores are collected on the
same capped logits, the ones the softmax sees: tanh is monotonic per entry, but the scores sum
over query rows and heads, so ranking raw logits would weigh a few far-beyond-the-cap entries
more than the softmax does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.nn.functional import scaled_dot_product_attention

from ..config import VegasConfigError
from ..interfaces import Selection, Selector
from ..plugins import run_selector
from ..selection import collect_scores

ATTENTION_NAME = "vegas"

#: keyword arguments of transformers' attention call that change the attention maths and that
#: this function does not implement; a model passing any of them is refused
UNSUPPORTED_KWARGS = ("s_aux", "sinks", "attention_chunk_size")


def clock(sync: bool) -> float:
    """Seconds from ``time.perf_counter``, after the CUDA queue drains when ``sync``."""
    if sync:
        torch.cuda.synchronize()
    return time.perf_counter()


class SectionTimer:
    """Total time of the selection work of a decode (score collection, top-k, per-query
    refinement), summed over sections bracketed by :meth:`start` and :meth:`stop` (not nested).

    On the CPU: host seconds (``time.perf_counter``). On CUDA: GPU seconds between two CUDA
    events per section on the device's current stream, summed in :meth:`seconds`: timing a
    section never stalls the host, which runs ahead of the GPU (a synchronisation per section
    would make every forward pay host time plus GPU time).

    Args:
        device: where the decode runs.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device if device.type == "cuda" else None
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._total = 0.0
        self._t0: float | torch.cuda.Event = 0.0

    def start(self) -> None:
        if self.device is None:
            self._t0 = time.perf_counter()
            return
        self._t0 = torch.cuda.Event(enable_timing=True)
        self._t0.record(torch.cuda.current_stream(self.device))

    def stop(self) -> None:
        if self.device is None:
            self._total += time.perf_counter() - self._t0
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.device))
        self._events.append((self._t0, end))

    def seconds(self) -> float:
        """Seconds summed so far (on CUDA: waits for the GPU)."""
        if self._events:
            self._events[-1][1].synchronize()
            self._total += sum(a.elapsed_time(b) for a, b in self._events) / 1e3
            self._events.clear()
        return self._total


@dataclass
class AttentionContext:
    """Per-forward instructions and outputs of :func:`vegas_attention`.

    Attributes:
        mode: ``"full"`` or ``"draft"``.
        query_pos: ``(batch_size, q_len)`` int64 absolute positions of this forward's queries.
        query_valid: ``(batch_size, q_len)`` bool; False for left padding (its output is
            finite garbage, never read).
        key_pos: ``(batch_size, num_slots)`` int64 absolute position of every cache slot
            after this forward's append.
        key_valid: ``(batch_size, num_slots)`` bool; padding and rolled-back slots are False.
        score_rows: query rows (of this forward's ``q_len``) whose scores to collect.
        score_mode, groups, per_row: see :func:`vegas.selection.collect_scores`.
        scores: filled per full-attention layer, ``(batch_size, groups, num_slots)`` float32
            (``(batch_size, groups, m, num_slots)`` with ``per_row``).
        layer_windows: filled per layer: its sliding window (tokens), or None (full attention).
        selections: per layer, the drafting index sets (draft mode).
        selection_len: cache length at selection time; later slots are always attended.
        selector: the query-aware selector to refine selections per draft step, or None.
        timer: times the score collection and per-query refinement (:class:`SectionTimer`), or
            None (untimed).
        attended: draft mode, filled per layer: ``(batch_size,)`` float32, the committed slots
            (before ``selection_len``) the draft query attended, summed over the layers run so
            far (each layer's count averaged over its groups); the slots appended since the
            selection (the drafting phase's own positions) are not counted.
        attended_layers: the layers summed into ``attended``.
    """

    mode: str = "full"
    query_pos: torch.Tensor | None = None
    query_valid: torch.Tensor | None = None
    key_pos: torch.Tensor | None = None
    key_valid: torch.Tensor | None = None
    score_rows: list[int] | None = None
    score_mode: str = "logit"
    groups: int = 1
    per_row: bool = False
    scores: dict[int, torch.Tensor] = field(default_factory=dict)
    layer_windows: dict[int, int | None] = field(default_factory=dict)
    selections: list[Selection | None] | None = None
    selection_len: int = 0
    selector: Selector | None = None
    timer: SectionTimer | None = None
    attended: torch.Tensor | None = None
    attended_layers: int = 0
    _masks: dict = field(default_factory=dict, repr=False)

    def _start(self) -> None:
        if self.timer is not None:
            self.timer.start()

    def _stop(self) -> None:
        if self.timer is not None:
            self.timer.stop()

    def count_attended(self, mask: torch.Tensor) -> None:
        """Add one layer's attended committed slots to :attr:`attended`: ``mask``
        ``(batch_size, groups, slots)`` bool, True where the draft query attends a committed
        slot; the count is averaged over the groups (KV heads with ``granularity="kv_head"``)."""
        count = mask.sum(dim=-1).float().mean(dim=1)  # [B]
        self.attended = count if self.attended is None else self.attended + count
        self.attended_layers += 1

    def mask(self, window: int | None) -> tuple[int, torch.Tensor]:
        """``(start, allowed)``: the slots ``start:`` that any query of this forward may see,
        and ``allowed`` ``(batch_size, q_len, num_slots - start)`` bool. Cached per window."""
        if window not in self._masks:
            self._masks[window] = self._build_mask(window)
        return self._masks[window]

    def _build_mask(self, window: int | None) -> tuple[int, torch.Tensor]:
        key_pos, key_valid, query_pos = self.key_pos, self.key_valid, self.query_pos
        start = 0
        if window is not None:
            # the first slot that some query's window reaches (slots before it are skipped)
            lowest = query_pos.masked_fill(~self.query_valid, torch.iinfo(query_pos.dtype).max)
            needed = key_valid & (key_pos > lowest.amin(dim=1, keepdim=True) - window)  # [B, L]
            first = torch.where(needed.any(dim=1), needed.int().argmax(dim=1), key_pos.shape[1])
            start = int(first.min()) if first.numel() else 0
            key_pos, key_valid = key_pos[:, start:], key_valid[:, start:]
        allowed = key_valid[:, None, :] & (key_pos[:, None, :] <= query_pos[:, :, None])
        if window is not None:
            allowed &= query_pos[:, :, None] - key_pos[:, None, :] < window
        # Padding queries attend to everything (finite garbage, never read).
        return start, allowed | ~self.query_valid[:, :, None]


def _gather_slots(x: torch.Tensor, sel: Selection) -> torch.Tensor:
    """Slots ``sel.indices`` of ``x`` ``(B, KVH, L, D)`` -> ``(B, KVH, k, D)``."""
    batch_size, num_kv_heads, _, head_dim = x.shape
    idx = sel.indices.expand(batch_size, num_kv_heads, -1)
    return x.gather(2, idx[..., None].expand(-1, -1, -1, head_dim))


def _softcapped_attention(query, key, value, mask, scaling: float, softcap: float):
    """Attention on soft-capped logits, as transformers' eager attention computes it.

    Args:
        query: ``(batch_size, num_heads, q_len, head_dim)``.
        key, value: ``(batch_size, num_kv_heads, num_keys, head_dim)``.
        mask: bool, broadcastable to ``(batch_size, num_heads, q_len, num_keys)``; every row
            must allow at least one key.
        softcap: ``c`` in ``c * tanh(scaling * q·k / c)``.

    Returns:
        ``(batch_size, num_heads, q_len, head_dim)`` in the query's dtype (softmax in float32).
    """
    repeat = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    logits = torch.matmul(query, key.transpose(-1, -2)) * scaling
    logits = torch.tanh(logits / softcap) * softcap
    weights = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32)
    return torch.matmul(weights.to(query.dtype), value)


def _attend(query, key, value, mask, scaling, softcap: float | None):
    """SDPA with a boolean ``mask`` (GQA), or :func:`_softcapped_attention` when ``softcap``."""
    if softcap:
        return _softcapped_attention(query, key, value, mask, scaling, softcap)
    return scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)


def _masked_attention(query, key, value, scaling, ctx: AttentionContext, window: int | None, softcap=None):
    """Attention of this forward's queries under ``ctx.mask(window)``."""
    start, allowed = ctx.mask(window)
    return _attend(query, key[:, :, start:], value[:, :, start:], allowed[:, None], scaling, softcap)


def _draft_attention(module, query, key, value, scaling, ctx: AttentionContext, window: int | None, softcap=None):
    layer = module.layer_idx
    sel = ctx.selections[layer] if ctx.selections else None
    n = ctx.selection_len
    if sel is None:  # nothing selected yet (one-token prompts): attend to everything
        start, allowed = ctx.mask(window)
        ctx.count_attended(allowed[:, :, : max(n - start, 0)])  # q_len 1: [B, 1, committed slots seen]
        return _masked_attention(query, key, value, scaling, ctx, window, softcap)
    if ctx.selector is not None and ctx.selector.query_aware:
        ctx._start()
        sel = run_selector(ctx.selector, "select_for_query", layer, query, sel, num_slots=n)
        ctx._stop()
    k = torch.cat([_gather_slots(key, sel), key[:, :, n:]], dim=2)
    v = torch.cat([_gather_slots(value, sel), value[:, :, n:]], dim=2)
    recent = sel.mask.new_ones(sel.mask.shape[0], sel.mask.shape[1], key.shape[2] - n)
    mask = torch.cat([sel.mask, recent], dim=2)  # [B, G, k + recent]
    if window is not None:  # the draft query's own window: selected slots it has left drop out
        positions = torch.cat([ctx.key_pos.gather(1, sel.indices.flatten(1)).view_as(sel.indices),
                               ctx.key_pos[:, None, n:].expand(-1, sel.indices.shape[1], -1)], dim=2)
        mask = mask & (ctx.query_pos[:, :, None] - positions < window)  # query_pos: [B, 1]
    ctx.count_attended(mask[:, :, : sel.mask.shape[2]])  # the selected slots, as attended
    num_heads, groups = query.shape[1], mask.shape[1]
    mask = mask.repeat_interleave(num_heads // groups, dim=1)[:, :, None, :]  # [B, H, 1, ...]
    return _attend(query, k, v, mask, scaling, softcap)


def _check_supported(module: torch.nn.Module, kwargs: dict) -> None:
    for name in UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            value = kwargs[name]
            shown = (f"a {tuple(value.shape)} tensor" if isinstance(value, torch.Tensor) else repr(value)[:80])
            raise VegasConfigError(
                f"{type(module).__name__} calls attention with {name} ({shown}), which the "
                f"vegas HF backend does not implement (supported: causal attention with optional "
                f"sliding_window and softcap); this architecture is not supported"
            )


def vegas_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    vegas_ctx: AttentionContext | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention for transformers models; see the module docstring.

    Args:
        attention_mask: ignored when ``vegas_ctx`` is given (the context's positions define
            the mask); else a mask as transformers' SDPA takes it, or None for causal.
        sliding_window: the layer's window W (tokens) when transformers passes one.
        softcap: the layer's logit soft-cap ``c`` (Gemma 2), or None: attention, and the
            scores collected for selection, use ``c * tanh(scaling * q·k / c)``.

    Returns:
        ``(attn_output (batch_size, q_len, num_heads, head_dim), None)``.

    Raises:
        VegasConfigError: the model passes an attention option this function does not
            implement (:data:`UNSUPPORTED_KWARGS`, e.g. GPT-OSS's attention sinks).
    """
    _check_supported(module, kwargs)
    ctx = vegas_ctx
    if ctx is None:  # plain transformers use: causal, the model's own mask
        if softcap:
            q_len, num_keys = query.shape[2], key.shape[2]
            causal = torch.ones(q_len, num_keys, dtype=torch.bool, device=query.device).tril(num_keys - q_len)
            mask = causal if attention_mask is None else attention_mask
            out = _softcapped_attention(query, key, value, mask, scaling, softcap)
        else:
            is_causal = attention_mask is None and query.shape[2] > 1
            out = scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask, is_causal=is_causal, scale=scaling, enable_gqa=True
            )
        return out.transpose(1, 2).contiguous(), None
    layer = module.layer_idx
    ctx.layer_windows[layer] = sliding_window
    if ctx.mode == "draft":
        out = _draft_attention(module, query, key, value, scaling, ctx, sliding_window, softcap)
    else:
        out = _masked_attention(query, key, value, scaling, ctx, sliding_window, softcap)
        if ctx.score_rows:
            ctx._start()
            first, allowed = ctx.mask(sliding_window)
            allowed = allowed[:, ctx.score_rows] & ctx.query_valid[:, ctx.score_rows, None]
            rows = query[:, :, ctx.score_rows]  # [B, H, m, D]
            scores = collect_scores(rows, key[:, :, first:], allowed, scaling, ctx.groups, ctx.score_mode, softcap,
                                    ctx.per_row)
            ctx.scores[layer] = torch.nn.functional.pad(scores, (first, 0))  # slots before the window: 0
            ctx._stop()
    return out.transpose(1, 2).contiguous(), None
