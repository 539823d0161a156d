"""Turning logits into tokens: greedy, or temperature / top-p sampling.

The warpers are transformers' own (``TemperatureLogitsWarper``, ``TopPLogitsWarper``), so
the target distribution is exactly the one ``model.generate`` would sample from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import TemperatureLogitsWarper, TopPLogitsWarper

from .config import VegasConfigError

__all__ = ["SamplingParams", "SampleFn", "make_sampler"]

#: logits (batch_size, vocab) -> (tokens (batch_size,) int64, probs (batch_size, vocab) | None)
SampleFn = Callable[[torch.Tensor], tuple[torch.Tensor, "torch.Tensor | None"]]


#: temperatures below this decode greedily (as in vLLM's sampler)
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen.

    Args:
        temperature: 0 for greedy decoding, else > 0. Temperatures below
            :data:`GREEDY_BELOW` (1e-5, vLLM's threshold) decode greedily: dividing logits by
            them overflows float32.
        top_p: nucleus mass in (0, 1]; 1 switches it off.
        seed: seed of the ``torch.Generator`` used for sampling and acceptance draws.

    Raises:
        VegasConfigError: temperature negative or not finite, top_p outside (0, 1], or a
            seed that is not an integer.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise VegasConfigError.bad("temperature", f"must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not (0 < self.top_p <= 1):
            raise VegasConfigError.bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64:
            raise VegasConfigError.bad("seed", f"must be an integer in [-2**63, 2**64), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Sampling distribution ``(..., vocab)`` float32 of ``logits`` ``(..., vocab)``."""
        shape = logits.shape
        scores = logits.reshape(-1, shape[-1]).float()
        scores = TemperatureLogitsWarper(float(self.temperature))(None, scores)
        if self.top_p < 1:
            scores = TopPLogitsWarper(self.top_p)(None, scores)
        return torch.softmax(scores, dim=-1).reshape(shape)


def make_sampler(params: SamplingParams, generator: torch.Generator | None) -> SampleFn:
    """A ``SampleFn``: argmax under greedy decoding, else a draw from ``params.probs``."""

    def sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if params.greedy:
            return logits.argmax(dim=-1), None
        probs = params.probs(logits)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1), probs

    return sample
