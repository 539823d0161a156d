"""What every backend offers the :class:`~vegas.pipeline.Pipeline`, and what it returns."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from ..config import VegasConfig
from ..outputs import RequestOutput, RequestStats
from ..sampling import SamplingParams

__all__ = ["Backend", "RequestOutput", "RequestStats"]


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
