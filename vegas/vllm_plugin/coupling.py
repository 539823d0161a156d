"""Drafter-invariant verification of seeded requests on vLLM (no vLLM import): the V2 runner
couples, the V1 runner withholds their drafts (:func:`withhold_drafts`).

Rejection sampling (Leviathan et al., 2023) emits the target distribution whatever was
drafted, but *which* tokens it emits depends on the drafts: the acceptance test compares
``u < p(x) / q(x)`` for the drafted ``x``. Under Vegas the drafts depend on the KV selection,
whose scores come from query vectors computed under the batch's shapes, so a seeded request
among other neighbours (or after a prefix-cache hit) can draft differently and then emit other
tokens, although its seed is the same. Plain vLLM loses only the target's last-bit rounding.

**Gumbel-max coupling** (Daliri, Musco and Suresh, 2024, "Coupling without Communication and
Drafter-Invariant Speculative Decoding", arXiv:2408.07978) removes the drafts from the output:

* the target token at each verified position ``pos`` is ``argmax(logits / T + g(seed, pos))``,
  vLLM's own ``gumbel_sample`` (``vllm/v1/worker/gpu/sample/gumbel.py``) with the request's seed
  and the position, exactly the token plain vLLM's V2 sampler draws at that position from the
  same logits (``Sampler.sample``: processed logits, ``apply_temperature=False``);
* a draft is accepted iff it equals that token; the first mismatch emits the target's token, and
  when every draft matches the last position's token is the bonus token.

Every emitted token is the target's own seeded sample, so the output is plain vLLM's seeded
output whatever was drafted (up to the target's rounding, as between two plain runs). Drafting
with the same noise ``g(seed, pos)`` (:func:`vegas.vllm_plugin.runners.v2_helpers.draft_noise_positions`) makes a draft equal the
target's token whenever the two distributions' noisy argmaxes agree: acceptance is lower than
rejection sampling's ``1 - TV(p, q)`` by at most a factor ``1 / (1 + TV)`` (the paper's bound),
which is why only requests with an explicit seed are coupled (``VegasConfig.vllm.seeded_verification``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

__all__ = ["CoupledRows", "active_rows", "couple_rows", "coupled", "engine_for", "register_engine",
           "withhold_drafts"]


def couple_rows(sampled: torch.Tensor, num_sampled: torch.Tensor, target_tokens: torch.Tensor,
                draft_sampled: torch.Tensor, cu_num_logits: torch.Tensor, rows: torch.Tensor) -> None:
    """Overwrite the rejection sampler's output of the ``rows`` requests with the coupled
    verification's, in place (device tensors, no host sync).

    Request ``r`` owns logits ``[cu[r], cu[r + 1])``: logit ``i`` predicts the token after
    input ``i``, and its draft ``i + 1`` is ``draft_sampled[cu[r] + i + 1]``. With ``a`` the
    number of leading drafts equal to ``target_tokens`` at their logits, the request emits
    ``target_tokens[cu[r] : cu[r] + a + 1]`` (``a`` accepted drafts, then the target's token at
    the first mismatch, or the bonus token).

    Args:
        sampled: ``[num_reqs, γ + 1]`` int64 emitted tokens (entries past ``num_sampled`` unused).
        num_sampled: ``[num_reqs]`` int32 tokens emitted per request.
        target_tokens: ``[num_logits]`` int64 the target's seeded sample at each logit.
        draft_sampled: ``[num_logits]`` the input token of each logit (the drafts after the first).
        cu_num_logits: ``[num_reqs + 1]`` int32 cumulative logits per request.
        rows: ``[num_reqs]`` bool, the requests to couple.
    """
    num_reqs, width = sampled.shape
    if num_reqs == 0 or target_tokens.numel() == 0:
        return
    last = target_tokens.shape[0] - 1
    start = cu_num_logits[:num_reqs].long()
    count = cu_num_logits[1 : num_reqs + 1].long() - start  # logits per request, >= 1
    steps = torch.arange(width, device=sampled.device)
    target = target_tokens[(start[:, None] + steps).clamp(max=last)]  # [num_reqs, width]
    # draft d (1..γ) is the input of logit d and is checked against the target's token at logit d - 1
    drafts = draft_sampled[(start[:, None] + steps[1:]).clamp(max=last)].long()  # [num_reqs, width - 1]
    match = (drafts == target[:, :-1]) & (steps[1:] < count[:, None])
    accepted = torch.cumprod(match.to(torch.int32), dim=1).sum(dim=1)  # [num_reqs]
    sampled.copy_(torch.where(rows[:, None], target, sampled))
    num_sampled.copy_(torch.where(rows, (accepted + 1).to(num_sampled.dtype), num_sampled))


def withhold_drafts(draft_ids: torch.Tensor, probs: torch.Tensor | None, rows: torch.Tensor) -> None:
    """The V1 runner's form of a drafter-invariant seeded request, in place: the ``rows``
    draft token 0 with probability one (``probs`` one-hot), so V1's rejection sampler, whose
    noise comes from each request's ``torch.Generator`` in amounts fixed by the γ drafts, emits
    the target's own sample at the first position whatever the neighbours (and accepts the fixed
    draft only with the target's probability of token 0). Those rows decode at plain speed:
    V1 has no counter-keyed target sampler to couple drafts with.

    Args:
        draft_ids: ``[num_reqs, γ]`` int64 drafts.
        probs: ``[num_reqs, γ, vocab]`` float32 draft probabilities, or None (greedy batch).
        rows: ``[num_reqs]`` bool.
    """
    draft_ids.masked_fill_(rows[:, None], 0)
    if probs is not None:
        probs.masked_fill_(rows[:, None, None], 0.0)
        probs[..., 0].masked_fill_(rows[:, None], 1.0)


class CoupledRows:
    """One Vegas engine's coupling state: which request slots verify by the coupling.

    ``slots`` (``[max_num_reqs + 1]`` bool on the device, the padding slot last and never
    coupled) is what the draft graphs read (:func:`vegas.vllm_plugin.runners.v2_helpers.draft_noise_positions`); :meth:`update` fills
    it from vLLM's ``SamplingStates.seeds_set`` (a seed given explicitly by the user), once per
    draft phase and only when it changed.
    """

    def __init__(self, max_num_reqs: int, device) -> None:
        self.slots = torch.zeros(max_num_reqs + 1, dtype=torch.bool, device=device)
        self._host = np.zeros(max_num_reqs, dtype=bool)

    def update(self, seeds_set: np.ndarray) -> None:
        """Copy ``seeds_set`` (``[max_num_reqs]`` bool, by request slot) when it changed."""
        n = min(len(seeds_set), len(self._host))
        if not np.array_equal(self._host[:n], seeds_set[:n]):
            self._host[:n] = seeds_set[:n]
            self.slots[:n].copy_(torch.from_numpy(self._host[:n].copy()))

    @staticmethod
    def rows(seeds_set: np.ndarray, idx_mapping_np: np.ndarray) -> np.ndarray | None:
        """``[num_reqs]`` bool, the batch rows with an explicit seed, or None when there is none."""
        rows = seeds_set[idx_mapping_np]
        return rows if rows.any() else None


#: the Vegas engines of this process that couple seeded requests, by their draft-logits buffer
#: (the tensor the V2 runner hands its rejection sampler: how the patched sampler recognises one)
_ENGINES: dict[int, CoupledRows] = {}
#: the batch rows to couple in the rejection sampler call now running, or None
_ACTIVE: list[torch.Tensor | None] = [None]


def register_engine(draft_logits: torch.Tensor, state: CoupledRows) -> None:
    """Mark the engine whose rejection sampler receives ``draft_logits`` as coupling."""
    _ENGINES[draft_logits.data_ptr()] = state


def engine_for(draft_logits: torch.Tensor | None) -> CoupledRows | None:
    """The coupling state of the engine that owns ``draft_logits``, or None (plain vLLM,
    another speculator, or a Vegas engine that does not couple)."""
    if draft_logits is None:
        return None
    return _ENGINES.get(draft_logits.data_ptr())


@contextmanager
def coupled(rows: np.ndarray, device) -> Iterator[None]:
    """Within: :func:`active_rows` gives ``rows`` on ``device`` (``[num_reqs]`` bool)."""
    _ACTIVE[0] = torch.from_numpy(np.ascontiguousarray(rows)).to(device, non_blocking=False)
    try:
        yield
    finally:
        _ACTIVE[0] = None


def active_rows() -> torch.Tensor | None:
    """The rows to couple in the rejection sampler call now running (see :func:`coupled`)."""
    return _ACTIVE[0]
