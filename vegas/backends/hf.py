"""HF transformers backend: any causal LM, eager PyTorch, CPU or CUDA.

The model is unchanged; Vegas plugs in through ``AttentionInterface`` (see
:mod:`vegas.backends.hf_attention`) and keeps transformers' ``DynamicCache``.

Cache layout and rollback rule: one ``DynamicCache`` for the batch; every sequence
appends the same number of slots per forward (prompts are left-padded, an iteration
writes γ + 1 slots for all). After acceptance the cache is cropped to the longest kept
prefix of the batch, and ``valid`` (batch_size, num_slots) marks each sequence's own
slots; padding and rejected slots stay masked (never attended, never selected). RoPE
positions are per sequence and absolute.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    AttentionInterface,
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
)

from ..config import VegasConfig, VegasConfigError, check_device_name
from ..draft_policy import DraftPolicy
from ..hookspecs import hookimpl
from ..interfaces import Drafter, Selection, SelectionInput, Selector, Verifier
from ..loop import plain_decode, speculative_decode
from ..models import resolve_model, rope_scaled_config, unloadable_model
from ..plugins import run_selector
from ..sampling import SampleFn, SamplingParams
from .base import Backend, RequestOutput, as_selector
from .hf_architectures import refuse_unsupported
from .hf_attention import (
    ATTENTION_NAME,
    AttentionContext,
    SectionTimer,
    clock,
    vegas_attention,
)

log = logging.getLogger(__name__)

#: whether the "KV budget >= context" message was logged (said once per process, at INFO)
FULL_BUDGET_LOGGED = False

AttentionInterface.register(ATTENTION_NAME, vegas_attention)

#: prompt tokens per prefill forward: bounds the attention mask to (batch, chunk, context)
#: booleans and the activations to one chunk, so memory grows linearly with the prompt
PREFILL_CHUNK_TOKENS = 1024
#: and fewer where one chunk's attention scores, ``batch x heads x chunk x context`` float32, would
#: exceed this many bytes: PyTorch's SDPA runs its math kernel for a masked float32 GQA call, which
#: holds the scores and their softmax (a batch of 32 at 32K tokens and 9 heads: 38 GB per 1,024 rows).
#: The peak is 2-3 such buffers (scores, softmax, the mask as floats; soft-capped layers one more)
PREFILL_SCORE_BYTES = 4 << 30


def prefill_chunk_tokens(batch_size: int, num_heads: int, context: int, num_draft_tokens: int) -> int:
    """Prompt tokens per prefill forward: at most :data:`PREFILL_CHUNK_TOKENS`, fewer where the
    scores would pass :data:`PREFILL_SCORE_BYTES` at ``context`` keys, never fewer than γ + 1
    (the last chunk holds the rows that stand in for a verified chunk)."""
    rows = PREFILL_SCORE_BYTES // max(batch_size * num_heads * context * 4, 1)
    return max(min(PREFILL_CHUNK_TOKENS, rows), num_draft_tokens + 1)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class PrefillPrefix:
    """A batch's prompts in the KV cache up to the last prefill chunk: what every selector's
    prefill of the same prompts shares (the last chunk collects the selector's score rows, so it
    always runs). One is kept per process (:data:`KEPT_PREFILL`), by the sessions of every
    :class:`HFBackend` made with ``reuse_prefill=True``.

    ``model``: a weak reference to the model that computed it; ``key``: (chunk length, the prompts'
    token ids); ``layers``: per layer ``(keys, values)`` ``(B, num_kv_heads, num_slots, head_dim)`` of
    the model's dtype (the cache's own tensors, never written in place: ``DynamicCache`` appends by
    concatenation); ``valid`` / ``slot_pos`` ``(B, num_slots)`` bool / int64; ``layer_windows``: the
    sliding window per layer.
    """

    model: weakref.ref
    key: tuple
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    valid: torch.Tensor
    slot_pos: torch.Tensor
    layer_windows: dict[int, int | None]

    def matches(self, model: Any, key: tuple) -> bool:
        return self.model() is model and self.key == key


#: the kept :class:`PrefillPrefix` (at most one per process, so that a study moving from one model, or
#: RoPE scaling, to another holds one batch's prefix, not one per model; dropped with its model)
KEPT_PREFILL: list[PrefillPrefix] = []


def _drop_prefill_of(model_ref: weakref.ref) -> None:
    KEPT_PREFILL[:] = [p for p in KEPT_PREFILL if p.model is not model_ref]


class HFSession(Drafter, Verifier):
    """One batch of sequences on a transformers model: the HF Drafter and Verifier.

    Both roles share the cache, so one object plays both; the loop in :mod:`vegas.loop`
    only sees the two interfaces.

    Args:
        model: a transformers causal LM loaded with ``attn_implementation="vegas"``.
        config: Vegas hyperparameters.
        selector: the selector, or None for plain decoding.
        reuse_prefill: start from :data:`KEPT_PREFILL` when it holds these prompts' prefix,
            and keep this batch's prefix there otherwise (``HFBackend(reuse_prefill=True)``).
    """

    def __init__(self, model: Any, config: VegasConfig, selector: Selector | None,
                 reuse_prefill: bool = False) -> None:
        self.model = model
        self.reuse_prefill = reuse_prefill
        self.config = config
        self.selector = selector
        self.device = model.device
        self.num_layers = model.config.get_text_config().num_hidden_layers
        # No config: every layer keeps every slot (sliding-window layers are windowed by the
        # attention mask, so that slots, positions and selections line up on every layer).
        self.cache = DynamicCache()
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.keeps_logits = "logits_to_keep" in params
        self.sync = self.device.type == "cuda"
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=self.device)  # [B, num_slots]
        self.slot_pos = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # [B, num_slots]
        self.num_committed = torch.zeros(0, dtype=torch.long, device=self.device)  # [B]
        self.last_tokens = torch.zeros(0, dtype=torch.long, device=self.device)  # [B] x_last
        self.pending = 0  # slots appended since the last commit
        self.layer_windows: dict[int, int | None] = {}  # learnt from the first forward
        self.selections: list[Selection | None] = []
        self.selection_len = 0
        self.timer = SectionTimer(self.device)  # the selection work: scores, top-k, refinement

    # -- helpers ---------------------------------------------------------------------------
    def _tick(self) -> float:
        return clock(self.sync)

    @property
    def selection_seconds(self) -> float:
        """Seconds of selection work so far (GPU seconds on CUDA: waits for the GPU)."""
        return self.timer.seconds()

    def _forward(
        self, input_ids: torch.Tensor, input_valid: torch.Tensor, ctx: AttentionContext,
        num_logits: int = 0,
    ) -> torch.Tensor | None:
        """Append ``input_ids`` ``(B, T)`` to the cache.

        Returns:
            logits ``(B, num_logits or T, V)`` float32 of the last ``num_logits`` positions
            (0: all), or None when ``num_logits`` is -1 (prefill: no logits needed).
        """
        # a sequence's next position is its number of valid slots (padding and rolled-back
        # slots hold no position); padding queries reuse a neighbour's position (never read)
        offsets = (input_valid.long().cumsum(dim=1) - 1).clamp(min=0)
        position_ids = self.valid.sum(dim=1, keepdim=True) + offsets  # [B, T]
        ctx.query_pos, ctx.query_valid = position_ids, input_valid
        ctx.key_pos = torch.cat([self.slot_pos, position_ids], dim=1)  # [B, num_prev + T]
        ctx.key_valid = torch.cat([self.valid, input_valid], dim=1)
        extra = {}
        if self.keeps_logits and num_logits:
            extra["logits_to_keep"] = max(num_logits, 1)
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=None,  # vegas_attention builds every layer's mask from ctx
            use_cache=True,
            vegas_ctx=ctx,
            **extra,
            **{self.cache_kwarg: self.cache},
        )
        self.valid, self.slot_pos = ctx.key_valid, ctx.key_pos
        self.pending += input_ids.shape[1]
        self.layer_windows.update(ctx.layer_windows)
        if num_logits < 0:
            return None
        logits = out.logits if num_logits == 0 else out.logits[:, -num_logits:]
        return logits.float()

    def _crop(self, num_slots: int) -> None:
        if num_slots > 0:
            self.cache.crop(-num_slots)  # negative: remove, in transformers 5.17 and 5.24
            self.valid = self.valid[:, :-num_slots]
            self.slot_pos = self.slot_pos[:, :-num_slots]

    def _select(self, scores: dict[int, torch.Tensor]) -> None:
        """Index sets of every layer for the next drafting phase (on a sliding-window layer,
        among the slots inside ``x_last``'s window)."""
        num_slots = self.valid.shape[1]
        if num_slots == 0:  # one-token prompts only: nothing to select from yet
            self.selections, self.selection_len = [None] * self.num_layers, 0
            return
        self.timer.start()
        counts = self.valid.sum(dim=1)  # [B]
        wanted = run_selector(self.selector, "budget", counts)  # [B] int64, as on the vLLM backend
        global FULL_BUDGET_LOGGED
        full = (wanted >= counts).nonzero()
        if not FULL_BUDGET_LOGGED and full.numel():
            i = int(full[0, 0])
            log.info(
                "KV budget %d >= context %d tokens (sequence %d%s): drafting attends to every position "
                "there, no sparsity (logged once per process)",
                int(wanted[i]), int(counts[i]), i, f" and {full.shape[0] - 1} more" if full.shape[0] > 1 else "",
            )
            FULL_BUDGET_LOGGED = True
        budget = torch.minimum(wanted, counts)
        self.kv_budgets = budget
        self.selections = []
        for layer in range(self.num_layers):
            valid, layer_budget = self.valid, budget
            window = self.layer_windows.get(layer)
            if window is not None:  # a sliding layer selects among the slots x_last can see
                valid = valid & (self.num_committed[:, None] - self.slot_pos < window)
                layer_budget = torch.minimum(budget, valid.sum(dim=1))
            layer_scores = scores.get(layer)
            inputs = SelectionInput(
                layer_idx=layer,
                scores=None if layer_scores is None else layer_scores[..., :num_slots],
                valid=valid,
                budget=layer_budget,
                keys=self.cache.layers[layer].keys,
            )
            self.selections.append(run_selector(self.selector, "select", inputs))
        self.selection_len = num_slots
        self.timer.stop()

    def _full_context(self, chunk_len: int, num_new: int) -> AttentionContext:
        """Full-attention context collecting the selector's rows among the last ``chunk_len``
        of ``num_new`` queries (none when ``chunk_len`` is 0)."""
        rows = run_selector(self.selector, "score_rows", chunk_len) if self.selector and chunk_len else []
        rows = [num_new - chunk_len + r for r in rows]
        return AttentionContext(
            mode="full",
            score_rows=rows or None,
            score_mode=self.config.score_mode,
            groups=self._groups(),
            per_row=bool(self.selector and self.selector.per_row_scores),
            timer=self.timer,
        )

    def _groups(self) -> int:
        """Selection groups: 1, or one per KV head (``num_key_value_heads``; configs of models
        without grouped-query attention, e.g. GPT-NeoX, name only ``num_attention_heads``)."""
        if self.config.granularity == "kv_head":
            text = self.model.config.get_text_config()
            return getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        return 1

    # -- Verifier --------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> None:
        """Prefill all but the last prompt token, in chunks of :func:`prefill_chunk_tokens`
        tokens (no logits; masks ``(B, chunk, context)``)."""
        batch_size = len(prompts)
        width = max(len(p) for p in prompts) - 1
        input_ids = torch.zeros(batch_size, width, dtype=torch.long)
        input_valid = torch.zeros(batch_size, width, dtype=torch.bool)
        for b, prompt in enumerate(prompts):  # left padding
            n = len(prompt) - 1
            if n:
                input_ids[b, width - n:] = torch.tensor(prompt[:-1])
                input_valid[b, width - n:] = True
        input_ids, input_valid = input_ids.to(self.device), input_valid.to(self.device)
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device)
        self.slot_pos = torch.zeros(batch_size, 0, dtype=torch.long, device=self.device)
        self.num_committed = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self.pending = 0
        self.last_tokens = torch.tensor([p[-1] for p in prompts], device=self.device)
        # Chunks end at the prompt's end, so the last one holds every score row: the last
        # min(γ + 1, width) prompt positions stand in for a verified chunk.
        num_heads = self.model.config.get_text_config().num_attention_heads
        chunk = prefill_chunk_tokens(batch_size, num_heads, width, self.config.num_draft_tokens)
        ends = list(range(width % chunk or chunk, width + 1, chunk)) if width else []
        key = (chunk, tuple(map(tuple, prompts))) if self.reuse_prefill else None  # only kept prefixes need it
        reused = self.reuse_prefill and len(ends) > 1 and bool(KEPT_PREFILL) and KEPT_PREFILL[0].matches(self.model, key)
        if reused:
            self._restore(KEPT_PREFILL[0])
        elif self.reuse_prefill:
            KEPT_PREFILL.clear()  # not held while another batch is prefilled
        ctx = None
        for i, end in enumerate(ends[len(ends) - 1:] if reused else ends):
            start = max(0, end - chunk)
            last = end == width
            ctx = self._full_context(min(self.config.num_draft_tokens + 1, width) if last else 0, end - start)
            self._forward(input_ids[:, start:end], input_valid[:, start:end], ctx, num_logits=-1)
            if self.reuse_prefill and not reused and i == len(ends) - 2:  # the prefix, before the last chunk
                KEPT_PREFILL[:] = [PrefillPrefix(weakref.ref(self.model, _drop_prefill_of), key,
                                                 [(layer.keys, layer.values) for layer in self.cache.layers],
                                                 self.valid, self.slot_pos, dict(self.layer_windows))]
        self.num_committed = input_valid.sum(dim=1)
        self.pending = 0
        if self.selector is not None:
            self._select(ctx.scores if ctx is not None else {})

    def _restore(self, prefix: PrefillPrefix) -> None:
        """Start from ``prefix`` (its tensors are copied into this session's cache)."""
        for layer, (keys, values) in enumerate(prefix.layers):
            self.cache.update(keys, values, layer)
        self.valid, self.slot_pos = prefix.valid.clone(), prefix.slot_pos.clone()
        self.layer_windows.update(prefix.layer_windows)

    @torch.inference_mode()
    def verify(self, draft_tokens: torch.Tensor) -> torch.Tensor:
        self._crop(self.pending)  # the drafting phase's slots are rewritten with full attention
        self.pending = 0
        chunk = torch.cat([self.last_tokens[:, None], draft_tokens.to(self.device)], dim=1)
        ctx = self._full_context(chunk.shape[1], chunk.shape[1])
        logits = self._forward(chunk, torch.ones_like(chunk, dtype=torch.bool), ctx)
        self._verify_scores = ctx.scores
        return logits

    def keep_rows(self, rows: torch.Tensor) -> bool:
        rows = rows.to(self.device)
        self.cache.batch_select_indices(rows)
        self.valid, self.slot_pos = self.valid[rows], self.slot_pos[rows]
        self.num_committed, self.last_tokens = self.num_committed[rows], self.last_tokens[rows]
        if self.kv_budgets is not None:
            self.kv_budgets = self.kv_budgets[rows]
        if self.kv_attended is not None:
            self.kv_attended = self.kv_attended[rows]
        self.selections = [
            None if sel is None else Selection(sel.indices[rows], sel.mask[rows]) for sel in self.selections
        ]
        # slots that no remaining sequence uses (its left padding) stay: the cache crops from the end only
        return True

    def commit(self, num_accepted: torch.Tensor, next_tokens: torch.Tensor) -> None:
        num_kept = num_accepted.to(self.device) + 1  # x_last, d_1..d_n  [B]
        max_kept = int(num_kept.max())
        self._crop(self.pending - max_kept)
        kept = torch.arange(max_kept, device=self.device)[None, :] < num_kept[:, None]
        self.valid[:, self.valid.shape[1] - max_kept:] &= kept
        self.num_committed = self.num_committed + num_kept
        self.pending = 0
        self.last_tokens = next_tokens.to(self.device)
        if self.selector is not None:
            self._select(self._verify_scores)

    # -- Drafter ---------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, num_draft_tokens: int, sample: SampleFn):
        tokens, probs = [], []
        x = self.last_tokens
        ones = torch.ones(x.shape[0], 1, dtype=torch.bool, device=self.device)
        attended, layers = None, 0  # committed slots attended, summed over steps and layers
        for _ in range(num_draft_tokens):
            ctx = AttentionContext(
                mode="draft",
                selections=self.selections,
                selection_len=self.selection_len,
                selector=self.selector if self.selection_len else None,
                timer=self.timer,
            )
            logits = self._forward(x[:, None], ones, ctx, num_logits=1)[:, -1]  # [B, V]
            if ctx.attended is not None:
                attended = ctx.attended if attended is None else attended + ctx.attended
                layers += ctx.attended_layers
            x, p = sample(logits)
            tokens.append(x)
            probs.append(p)
        self.kv_attended = None if attended is None else attended / layers
        draft_probs = None if probs[0] is None else torch.stack(probs, dim=1)
        return torch.stack(tokens, dim=1), draft_probs


def _checked_device(device: str | None) -> torch.device:
    """``device`` as a ``torch.device``; None picks CUDA when available.

    Raises:
        VegasConfigError: not a device name, or CUDA asked for but not available.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_device_name(device)
    parsed = torch.device(device)
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise VegasConfigError(f"device={device!r} but no CUDA GPU is available to this torch build; use 'cpu'",
                               field="device", problem=f"{device!r} needs a CUDA GPU, and this torch build sees "
                                                       "none; use 'cpu'")
    return parsed


class HFBackend(Backend):
    """transformers eager backend (CPU and CUDA; float32, bfloat16, float16).

    Args:
        model: a model name, ``.gguf`` file, model directory or hub id
            (:func:`vegas.models.resolve_model`).
        rope_scaling: RoPE scaling applied before loading
            (:func:`vegas.models.rope_scaled_config`), or None.
        reuse_prefill: keep the last batch's prompts in the KV cache up to its last prefill
            chunk (:class:`PrefillPrefix`) and start from there when the same prompts come again
            (``vegas ablate`` decodes one prompt set with every selector and budget): the same
            tokens, a fraction of the prefill, at the cost of a second copy of that KV cache
            (46 KB a token for SmolLM2-135M in float32), held until another batch is prefilled
            (:data:`KEPT_PREFILL`: one per process). Off by default.

    Raises:
        VegasConfigError: unknown ``dtype`` or ``device``, CUDA asked for but not available,
            ``model`` is neither a model name, a GGUF, a local model directory nor in the local
            HF cache, or bad ``rope_scaling``.
    """

    name = "hf"

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "float32",
        device: str | None = None,
        trust_remote_code: bool = False,
        rope_scaling: dict | None = None,
        reuse_prefill: bool = False,
    ) -> None:
        if not isinstance(reuse_prefill, bool):
            raise VegasConfigError.bad("reuse_prefill", f"must be True or False, got {reuse_prefill!r}")
        self.reuse_prefill = reuse_prefill
        if dtype not in DTYPES:
            raise VegasConfigError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        device = _checked_device(device)
        model = resolve_model(model)  # model names and .gguf files -> a checkpoint directory
        scaled = {} if rope_scaling is None else {
            "config": rope_scaled_config(model, rope_scaling, trust_remote_code=trust_remote_code)
        }
        try:
            # local_files_only: a hub id is read from the local Hugging Face cache, never fetched
            # (offline, a fetch retries for a minute before failing)
            self._tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code,
                                                            local_files_only=True)
            self.model = AutoModelForCausalLM.from_pretrained(
                model,
                local_files_only=True,
                dtype=DTYPES[dtype],
                attn_implementation=ATTENTION_NAME,
                trust_remote_code=trust_remote_code,
                **scaled,
            )
        except (OSError, ValueError) as exc:
            raise unloadable_model(model, exc) from exc
        self.model = self.model.to(device).eval()
        refuse_unsupported(self.model)

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def max_context(self) -> int:
        return int(self.model.config.max_position_embeddings)

    @property
    def generation_config(self):
        return self.model.generation_config

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @torch.inference_mode()
    def generate(self, prompts, *, max_new_tokens, sampling: SamplingParams, selector, config):
        selector_obj = as_selector(selector, config)
        session = HFSession(self.model, config, selector_obj, self.reuse_prefill)
        generator = torch.Generator(device=self.model.device).manual_seed(sampling.seed)
        common = dict(
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            generator=generator,
            eos_token_ids=self.eos_token_ids,
            clock=session._tick,
        )
        if selector_obj is None:
            tokens, stats = plain_decode(session, prompts, **common)
        else:
            tokens, stats = speculative_decode(
                session, session, selector_obj, prompts,
                num_draft_tokens=config.num_draft_tokens, policy=DraftPolicy.from_config(config), **common,
            )
        return [
            RequestOutput(token_ids=t, text=self._tokenizer.decode(t, skip_special_tokens=True), stats=s)
            for t, s in zip(tokens, stats)
        ]


@hookimpl
def vegas_backends():
    return {"hf": HFBackend}
