"""What every backend offers the :class:`~vegas.pipeline.Pipeline`, and what it returns."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from ..config import VegasConfig
from ..outputs import RequestOutput, RequestStats
from ..sampling import SamplingParams

__all__ = ["Backend", "RequestOutput", "RequestStats", "as_token_ids"]


def as_token_ids(value: Any) -> set[int]:
    """Token ids from an int, a list/tuple/set of ints, or None (an empty set)."""
    if value is None:
        return set()
    if isinstance(value, int):
        return {int(value)}
    return {int(v) for v in value}


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
        selector: str | None,
        config: VegasConfig,
    ) -> list[RequestOutput]:
        """Decode ``max_new_tokens`` tokens after each prompt (fewer if EOS comes first).

        Args:
            prompts: token ids, one validated non-empty list per request.
            selector: registered selector name for Vegas decoding, or None for plain decoding.
            config: Vegas hyperparameters (ignored by plain decoding).
        """
