"""Seeded draft sampling on vLLM's V1 model runner (no vLLM import at module level).

A seeded request (``SamplingParams.seed``, the OpenAI ``seed`` field) gives the same output
every run under plain vLLM, whatever its batch neighbours. Under Vegas its drafts must be as
reproducible: the draft of row ``i`` at step ``j`` is drawn by vLLM's counter-based Gumbel-max
kernel (``vllm/v1/worker/gpu/sample/gumbel.py::gumbel_sample``, the V2 adapter's sampler too)
from noise keyed by the request's own seed and the draft's position
(:func:`~vegas.vllm_plugin.runners.v2_helpers.draft_noise_positions`), never from a stream that the
batch shares. The seeds live in the static ``DraftBuffers.seeds`` that the draft CUDA graphs
read, filled at each draft phase in batch order (:class:`RequestSeeds`).

vLLM gives each child of an ``n > 1`` request ``seed + index`` (``v1/engine/parallel_sampling.py``),
so the children draft from different noise. An unseeded request gets one random seed when
it is first seen (as V2's ``SamplingStates.add_request`` does), kept for its life: unseeded
requests stay random but never share a stream.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from ..drafting.engine import GREEDY_TEMPERATURE, DraftBuffers, DraftSampler
from .v2_helpers import draft_noise_positions

__all__ = ["RequestSeeds", "random_seed", "request_seed", "seeded_sampler"]

_INT64 = np.iinfo(np.int64)


def random_seed() -> int:
    """A random int64 seed from numpy's global generator (which vLLM seeds with the engine's
    ``seed``), drawn as vLLM's V2 runner draws one for an unseeded request."""
    return int(np.random.randint(_INT64.min, _INT64.max, dtype=np.int64))


def request_seed(request) -> int | None:
    """``sampling_params.seed`` of a V1 runner request (``CachedRequestState``), wrapped into
    int64; None when it has none (unseeded, or no sampling parameters)."""
    seed = getattr(getattr(request, "sampling_params", None), "seed", None)
    if seed is None:
        return None
    return (int(seed) - _INT64.min) % (1 << 64) + _INT64.min


class RequestSeeds:
    """The draft-noise seed of every request of the V1 runner, by request id.

    A request's seed is its ``sampling_params.seed``; an unseeded request draws one
    (``draw``, default :func:`random_seed`) when first seen and keeps it until it leaves the
    runner's ``requests``. Seeds follow the request id, so they survive the V1 input batch's
    reordering (``swap_states``, ``condense``).

    Args:
        draw: returns a fresh int64 seed for an unseeded request.
    """

    def __init__(self, draw: Callable[[], int] = random_seed) -> None:
        self.draw = draw
        self._drawn: dict[str, int] = {}  # unseeded request id -> its drawn seed
        self._ids: list[str] | None = None  # batch order of the cached device seeds
        self._device_seeds: torch.Tensor | None = None  # [num_reqs] int64
        #: [num_reqs] bool on the device, rows with a seed of their own; None when no row has one
        self._device_explicit: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self._drawn)

    def rows(self, req_ids: Sequence[str], requests: Mapping[str, object]) -> np.ndarray:
        """``[len(req_ids)]`` int64 seeds in batch order; forgets the drawn seeds of requests
        no longer in ``requests`` (the runner's ``requests``: id -> ``CachedRequestState``)."""
        for req_id in [r for r in self._drawn if r not in requests]:
            del self._drawn[req_id]
        seeds = np.empty(len(req_ids), dtype=np.int64)
        for i, req_id in enumerate(req_ids):
            seed = request_seed(requests.get(req_id))
            if seed is None:
                seed = self._drawn.get(req_id)
                if seed is None:
                    seed = self._drawn[req_id] = self.draw()
            seeds[i] = seed
        return seeds

    @staticmethod
    def explicit(req_ids: Sequence[str], requests: Mapping[str, object]) -> np.ndarray:
        """``[len(req_ids)]`` bool: which requests carry a seed of their own (``SamplingParams.seed``)."""
        return np.array([request_seed(requests.get(r)) is not None for r in req_ids], dtype=bool)

    def on_device(self, req_ids: Sequence[str], requests: Mapping[str, object], device) -> torch.Tensor:
        """:meth:`rows` as a ``[num_reqs]`` int64 tensor on ``device``, copied (pinned, no host
        wait) only when the batch's request ids or their order changed since the last call; the
        same batch's :meth:`explicit` rows are kept beside it (:meth:`explicit_on_device`)."""
        req_ids = list(req_ids)
        if self._device_seeds is None or req_ids != self._ids:
            host = torch.from_numpy(self.rows(req_ids, requests))
            explicit = self.explicit(req_ids, requests)
            cuda = torch.device(device).type == "cuda"
            if cuda:
                host = host.pin_memory()
            self._device_seeds = host.to(device, non_blocking=True)
            self._device_explicit = None
            if explicit.any():
                mask = torch.from_numpy(explicit)
                self._device_explicit = (mask.pin_memory() if cuda else mask).to(device, non_blocking=True)
            self._ids = req_ids
        return self._device_seeds

    def explicit_on_device(self) -> torch.Tensor | None:
        """``[num_reqs]`` bool on the device of the last :meth:`on_device` call, in its batch
        order: the rows whose request carries a seed of its own; None when none does. Built with
        the seeds (no host work while the batch stays the same)."""
        return self._device_explicit


def seeded_sampler(sampling: bool, max_model_len: int, use_fp64: bool = False,
                   gumbel: Callable | None = None) -> DraftSampler:
    """The V1 runner's draft sampler (:data:`~vegas.vllm_plugin.drafting.engine.DraftSampler`).

    Greedy rows (temperature below :data:`~vegas.vllm_plugin.drafting.engine.GREEDY_TEMPERATURE`, or
    every row when ``sampling`` is False) take the argmax. Sampling rows are drawn by
    ``gumbel`` (vLLM's ``gumbel_sample``) from ``softmax(logits / T)`` with noise keyed by
    ``bufs.seeds[row]`` and the counter ``draft_noise_positions(first_pos + j)``; the kernel
    writes the temperature-scaled logits it drew from into ``bufs.probs[:, j]``, which become
    their softmax there: exactly the draft distribution, for V1's rejection sampler
    (``runner._draft_probs``). V1's rejection sampler draws its own noise from per-request
    ``torch.Generator``s, not from these counters.

    Args:
        sampling: whether any row of the batch samples (else no probabilities are written).
        max_model_len: the engine's ``max_model_len`` (offset of the draft counters).
        use_fp64: vLLM's ``model_config.use_fp64_gumbel``.
        gumbel: ``gumbel_sample``'s signature (default: vLLM's kernel; a test passes a reference).
    """
    if sampling and gumbel is None:
        from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample as gumbel

    def sample(logits: torch.Tensor, j: int, bufs: DraftBuffers) -> torch.Tensor:
        tokens = logits.argmax(dim=-1)  # [rows]
        if not sampling:
            return tokens
        rows = logits.shape[0]
        greedy = bufs.temperature < GREEDY_TEMPERATURE  # [rows]
        temperature = torch.where(greedy, 0.0, bufs.temperature)  # [rows]; gumbel_sample: 0 = no noise
        identity = torch.arange(rows, dtype=torch.int32, device=logits.device)  # row -> its own seed/probs row
        col = torch.full((), j, dtype=torch.int64, device=logits.device)  # the probs column of step j
        counters = draft_noise_positions(bufs.step_inputs[2] + j, max_model_len)  # [rows] int64
        drawn = gumbel(logits, identity, temperature, bufs.seeds, counters, apply_temperature=True,
                       output_processed_logits=bufs.probs, output_processed_logits_col=col, use_fp64=use_fp64)
        probs = bufs.probs[:, j]  # [rows, vocab] the scaled logits the draw used
        probs.copy_(torch.softmax(probs, dim=-1))
        return torch.where(greedy, tokens, drawn)

    return sample
