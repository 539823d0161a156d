"""The three abstract roles of self-speculative decoding: Selector, Drafter, Verifier.

One iteration of the Vegas loop (design notes (docs/design-notes.md) §1; gpt-fast's ``speculative_decode`` in shape):

1. ``Drafter.draft``: γ tokens with sparse attention over each layer's selected KV entries
   plus the positions appended since the selection.
2. ``Verifier.verify``: one full-attention pass over ``[x_last, d_1 .. d_γ]``; the backend
   hands the logits of the query rows the selector asks for (``Selector.score_rows``) to
   the selector, reduced over the layer's query heads.
3. Acceptance (:mod:`vegas.acceptance`), then ``Verifier.commit``: roll the KV cache back
   to the accepted length and ask the selector for the next index sets.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .config import Budget, VegasConfig, kv_budget_for
from .outputs import RequestOutput, as_token_ids
from .sampling import SampleFn, SamplingParams

__all__ = ["Backend", "Selection", "SelectionInput", "Selector", "Drafter", "Verifier"]


@dataclass
class Selection:
    """The KV entries one layer attends to while drafting.

    Attributes:
        indices: ``torch.LongTensor`` of shape ``(batch_size, groups, k)``: cache slots,
            ascending where ``mask`` is True. ``groups`` is 1 (shared by the layer's
            heads) or the number of KV heads.
        mask: ``torch.BoolTensor`` of shape ``(batch_size, groups, k)``: which entries are
            real (sequences with a smaller budget or a shorter context are padded).
    """

    indices: torch.Tensor  # [batch_size, groups, k] int64
    mask: torch.Tensor  # [batch_size, groups, k] bool


@dataclass
class SelectionInput:
    """What a full-attention pass saw at one layer, handed to ``Selector.select``.

    Attributes:
        layer_idx: decoder layer index.
        scores: ``torch.FloatTensor`` of shape ``(batch_size, groups, num_slots)``, float32:
            attention logits (or softmax weights, per ``score_mode``) of the rows named by
            ``Selector.score_rows`` summed over those rows and the query heads of each
            group; ``(batch_size, groups, m, num_slots)`` (the ``m`` rows apart) for a
            selector with ``per_row_scores``; None for selectors that name no rows.
        valid: ``torch.BoolTensor`` of shape ``(batch_size, num_slots)``: committed cache
            slots of each sequence (padding and rolled-back slots are False).
        budget: ``torch.LongTensor`` of shape ``(batch_size,)``: KV budget k per sequence
            (tokens), already clamped to the number of valid slots.
        keys: ``torch.Tensor`` of shape ``(batch_size, num_kv_heads, num_slots, head_dim)``
            in the model dtype: the layer's cached keys (post-RoPE), for key-based
            selectors such as Quest (``Selector.needs_keys``); a backend may pass None to a
            selector that does not need them (the vLLM backend does).

    On the HF backend a slot is a cache slot (padding and rolled-back slots are invalid); on
    the vLLM backend it is the token position (``valid`` is a prefix of each row).
    """

    layer_idx: int
    scores: torch.Tensor | None  # [batch_size, groups, num_slots] float32
    valid: torch.Tensor  # [batch_size, num_slots] bool
    budget: torch.Tensor  # [batch_size] int64
    keys: torch.Tensor | None = None  # [batch_size, num_kv_heads, num_slots, head_dim]


class Selector(ABC):
    """Chooses, per layer, the KV entries the next drafting phase attends to.

    Subclasses set ``name`` and implement ``select``. The policy is declared once, here, and
    read by every backend: the rows of the verified chunk to score (``score_rows``), whether
    the selection depends on each draft query (``query_aware``), whether it reads the cached
    keys (``needs_keys``) and the KV budget (``budget``). A query-aware selector (Quest) also
    implements ``select_for_query``, called at every draft step.

    Args:
        config: the run's validated :class:`~vegas.config.VegasConfig`.
    """

    name: ClassVar[str]
    #: True when ``select_for_query`` must be called at every draft step.
    query_aware: ClassVar[bool] = False
    #: True when ``select`` reads ``SelectionInput.keys``.
    needs_keys: ClassVar[bool] = False
    #: True when ``select`` wants the ``score_rows`` apart (analysis, e.g.
    #: :class:`vegas.overlap.OverlapProbe`); HF backend only.
    per_row_scores: ClassVar[bool] = False

    def __init__(self, config: VegasConfig) -> None:
        self.config = config

    def budget(self, context_len: Budget) -> Budget:
        """KV budget k (tokens) for ``context_len`` committed tokens, before clamping to the
        context: :func:`vegas.config.kv_budget_for` unless a selector overrides it.

        Args:
            context_len: an int, or a ``torch.LongTensor`` (elementwise, no host sync).
        """
        return kv_budget_for(self.config, context_len)

    def score_rows(self, chunk_len: int) -> list[int]:
        """Rows of a verified chunk of ``chunk_len`` (γ+1) queries whose logits to aggregate.

        Row 0 is ``x_last`` (it predicts the first draft token), row ``chunk_len - 1`` is
        the last draft token (it predicts the bonus token). Empty: no scores needed.
        """
        return []

    @abstractmethod
    def select(self, inputs: SelectionInput) -> Selection:
        """Index sets of one layer for the next drafting phase, within ``inputs.budget``."""

    def select_for_query(
        self, layer_idx: int, query: torch.Tensor, selection: Selection
    ) -> Selection:
        """Refine ``selection`` for one draft query; only for ``query_aware`` selectors.

        Args:
            query: ``(batch_size, num_heads, 1, head_dim)`` post-RoPE draft query.
        """
        return selection

    def observe(self, num_accepted: torch.Tensor, num_draft_tokens: int) -> None:
        """Learn from an iteration's outcome: ``num_accepted`` ``(batch_size,)`` int64."""

    def keep_rows(self, rows: torch.Tensor) -> None:
        """The batch shrank to ``rows`` (``torch.LongTensor (new_batch_size,)``, indices into
        the old batch, ascending): finished sequences left it. Index any per-sequence state."""


class Drafter(ABC):
    """Proposes γ tokens with sparse attention over the selector's index sets."""

    #: per row, the KV entries per layer a draft query of the last ``draft`` call attended
    #: to among the committed ones (the selection as attended: Quest's partial page and
    #: verified chunk included, slots a sliding-window layer's window has left excluded; not
    #: the drafting phase's own new positions), averaged over KV-head groups, layers and
    #: draft steps: ``torch.FloatTensor (batch_size,)``; None where a drafter does not count
    #: it (the loop reports it as :attr:`vegas.outputs.RequestStats.kv_attended`)
    kv_attended: torch.Tensor | None = None

    @abstractmethod
    def draft(
        self, num_draft_tokens: int, sample: SampleFn
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft γ tokens after each sequence's ``x_last`` (its last committed token).

        Args:
            num_draft_tokens: γ >= 1.
            sample: maps logits ``(batch_size, vocab)`` to ``(tokens (batch_size,), probs
                (batch_size, vocab) | None)``; probs are None under greedy decoding.

        Returns:
            ``draft_tokens`` ``torch.LongTensor (batch_size, γ)`` and ``draft_probs``
            ``torch.FloatTensor (batch_size, γ, vocab)`` or None (greedy).
        """


class Verifier(ABC):
    """Runs the target model with full attention: prefill, verification and rollback."""

    #: seconds spent so far in score collection, top-k and index building (selection overhead)
    selection_seconds: float = 0.0
    #: each row's KV budget of the current selection (clamped to the context), ``torch.LongTensor
    #: (batch_size,)``; None before a selection (plain decoding). The nominal size: what drafts
    #: attended (Quest attends more) is :attr:`Drafter.kv_attended`
    kv_budgets: torch.Tensor | None = None

    @abstractmethod
    def prefill(self, prompts: list[list[int]]) -> None:
        """Prefill all but the last token of each prompt and make the first selection.

        The last prompt token becomes ``x_last``, so that every generated token, the first
        included, comes out of a draft/verify iteration.

        Args:
            prompts: token ids, one non-empty list per sequence (lengths may differ).
        """

    @abstractmethod
    def verify(self, draft_tokens: torch.Tensor) -> torch.Tensor:
        """Full attention over ``[x_last, d_1..d_γ]``; collects the selector's scores.

        Args:
            draft_tokens: ``torch.LongTensor (batch_size, γ)``.

        Returns:
            target logits ``torch.FloatTensor (batch_size, γ + 1, vocab)``.
        """

    def keep_rows(self, rows: torch.Tensor) -> bool:
        """Drop finished sequences: keep the batch rows ``rows`` (``torch.LongTensor
        (new_batch_size,)``, ascending) and free the others. A Drafter that shares the
        Verifier's sequences sees the same rows.

        Returns:
            True if the batch shrank; False if this verifier keeps every row (then the loop
            keeps decoding the finished rows and discards their tokens).
        """
        return False

    @abstractmethod
    def commit(self, num_accepted: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Keep ``x_last, d_1..d_n`` in the cache, drop the rest, select for the next draft.

        Args:
            num_accepted: ``torch.LongTensor (batch_size,)``, n in [0, γ].
            next_tokens: ``torch.LongTensor (batch_size,)``: the correction or bonus
                token, the new ``x_last``.
        """



class Backend(ABC):
    """An inference engine that runs plain and Vegas decoding on one model.

    Args:
        model: path of a transformers model directory (or hub id, if cached locally).
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; None picks CUDA when available.
        trust_remote_code: allow model code from the model directory (off by default).
    """

    name: ClassVar[str]

    @property
    @abstractmethod
    def tokenizer(self) -> Any:
        """The model's transformers tokenizer."""

    @property
    @abstractmethod
    def max_context(self) -> int:
        """Longest sequence (prompt + generated tokens) the model accepts, in tokens."""

    @property
    def generation_config(self) -> Any:
        """The model's ``transformers.GenerationConfig``, or None when the backend has none."""
        return None

    @property
    def eos_token_ids(self) -> list[int]:
        """Token ids that end a sequence, sorted: the generation config's ``eos_token_id``
        (an int or a list; e.g. ``<|im_end|>`` for chat models) united with the tokenizer's
        ``eos_token_id``. Empty when neither is set."""
        generation = self.generation_config
        ids = as_token_ids(getattr(generation, "eos_token_id", None))
        return sorted(ids | as_token_ids(getattr(self.tokenizer, "eos_token_id", None)))

    @property
    def vocab_size(self) -> int:
        """Token ids must lie in ``[0, vocab_size)``."""
        return len(self.tokenizer)

    @abstractmethod
    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        sampling: SamplingParams,
        selector: Selector | str | None,
        config: VegasConfig,
    ) -> list[RequestOutput]:
        """Decode ``max_new_tokens`` tokens after each prompt (fewer if EOS comes first).

        Args:
            prompts: token ids, one validated non-empty list per request.
            selector: the selector for Vegas decoding (built by the
                :class:`~vegas.pipeline.Pipeline`; a registered name is built by the backend),
                or None for plain decoding.
            config: Vegas hyperparameters (ignored by plain decoding).
        """
