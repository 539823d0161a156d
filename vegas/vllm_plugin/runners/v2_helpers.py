"""Pure tensor helpers of the Vegas speculator on vLLM's V2 model runner (no vLLM import).

The V2 runner keeps per-request state in *request slots* (``req_states``, indexed by
``req_state_idx``) and sorts the batch anew every step; ``input_batch.idx_mapping`` maps batch
row ``i`` to its slot. The selection buffers and the gathered block tables are in batch order;
V2's rejection sampler reads draft logits by slot. These helpers do the mapping and the
per-step draft inputs on the device, without host lists.
"""

from __future__ import annotations

import torch

__all__ = [
    "acceptance_counts",
    "draft_noise_positions",
    "one_hot_draft_logits",
    "rows_that_draft",
    "step_inputs",
]


def step_inputs(
    num_sampled: torch.Tensor,
    num_rejected: torch.Tensor,
    seq_lens: torch.Tensor,
    idx_mapping: torch.Tensor,
    last_sampled: torch.Tensor,
    nblocks: torch.Tensor,
) -> torch.Tensor:
    """The step's draft inputs, batch order: ``[4, num_reqs]`` int64 rows (active, token, pos0, nblocks).

    The verified chunk of row ``i`` ends at position ``seq_lens[i] - 1`` and V2 counts
    ``num_rejected = num_logits - num_sampled``, so the last sampled token sits at
    ``pos0 = seq_lens - num_rejected`` (its KV is not written yet: the first draft forward
    writes it). Rows with nothing sampled (a chunk of a longer prefill) are inactive, pos0 0.

    Args:
        num_sampled: ``[num_reqs]`` int32, tokens sampled per row (0: partial prefill).
        num_rejected: ``[num_reqs]`` int32, logits of the row minus ``num_sampled``.
        seq_lens: ``[>= num_reqs]`` int32, sequence lengths of the verified step (batch order).
        idx_mapping: ``[num_reqs]`` int32, batch row -> request slot.
        last_sampled: ``[max_num_reqs, 1]`` int64 (V2's ``req_states.last_sampled_tokens``,
            vLLM 0.24.0 ``v1/worker/gpu/states.py``; already updated for this step) or
            ``[max_num_reqs]``: the last sampled token per request slot.
        nblocks: ``[num_reqs]`` int, KV blocks the row's request owns (batch order).
    """
    n = idx_mapping.shape[0]
    active = num_sampled[:n] > 0
    token = last_sampled.reshape(last_sampled.shape[0], -1)[idx_mapping.long(), -1].long()  # [num_reqs]
    pos0 = seq_lens[:n].long() - num_rejected[:n].long()
    zero = torch.zeros_like(pos0)
    return torch.stack([active.long(), torch.where(active, token, zero), torch.where(active, pos0, zero),
                        nblocks[:n].long()])



def draft_noise_positions(pos: torch.Tensor, max_model_len: int, coupled: torch.Tensor | None = None) -> torch.Tensor:
    """Gumbel-noise counters of the draft samples: ``pos + max_model_len`` (``[rows]`` int64),
    or ``pos`` itself for a row that ``coupled`` marks.

    V2 draws the target's acceptance uniforms and resampling noise from counters
    ``< max_model_len`` (the query positions). Draft noise from disjoint counters keeps the
    draft sample independent of the resampling noise, as rejection sampling requires;
    vLLM's own ``sample_draft`` (``positions + 1`` on EAGLE's shifted positions) reuses the
    resampling counter of the same token, which biases the residual sample. The V1 runner's
    draft sampler (:func:`vegas.vllm_plugin.runners.seeds.seeded_sampler`) uses the same counters; V1's
    rejection sampler draws its noise from per-request ``torch.Generator`` streams instead.
    A row verified by the Gumbel-max coupling (:mod:`vegas.vllm_plugin.coupling`) drafts with the
    counter its verification's logit at ``pos`` draws the target's token with, so that draft and
    target share their noise (no residual sample there to bias).

    Args:
        pos: ``[rows]`` input positions of the draft step.
        max_model_len: the engine's ``max_model_len``.
        coupled: ``[rows]`` bool, or None (no row coupled).
    """
    offset = pos.long() + max_model_len
    return offset if coupled is None else torch.where(coupled, pos.long(), offset)


def one_hot_draft_logits(draft_logits: torch.Tensor, slots: torch.Tensor, token: int = 0) -> None:
    """Make the draft distribution of request ``slots`` one-hot at ``token`` for every step
    (``draft_logits[slots] = -inf``, ``[..., token] = 0``): the logits V2's rejection sampler
    reads then match drafts that are all ``token``.

    Args:
        draft_logits: ``[max_num_reqs + 1, γ, vocab]`` float32, by request slot.
        slots: ``[n]`` int request slots.
    """
    idx = slots.long()
    draft_logits.index_fill_(0, idx, float("-inf"))
    draft_logits[idx, :, token] = 0.0


def acceptance_counts(num_sampled: torch.Tensor, cu_num_logits: torch.Tensor) -> torch.Tensor:
    """``[2]`` int64 (iterations, emitted) of one verified step, on the device: rows that
    verified drafts (more than one logit) and the tokens they emitted (accepted + bonus).

    Args:
        num_sampled: ``[num_reqs]`` int32.
        cu_num_logits: ``[num_reqs + 1]`` int32 cumulative logits per row.
    """
    n = num_sampled.shape[0]
    had_drafts = (cu_num_logits[1 : n + 1] - cu_num_logits[:n]) > 1
    emitted = torch.where(had_drafts, num_sampled.long(), 0)
    return torch.stack([had_drafts.long().sum(), emitted.sum()])



def rows_that_draft(input_batch) -> int:
    """Rows of the V2 runner's batch that sample a token this step, from its host arrays (no
    device sync). A row still mid-prefill after this step samples nothing, so it has nothing
    to draft from; a step where no row samples (a prefill-only step) skips the draft phase."""
    n = input_batch.num_reqs
    scheduled = input_batch.num_scheduled_tokens[:n]
    computed = input_batch.num_computed_prefill_tokens_np[:n]
    prompt = input_batch.prefill_len_np[:n]
    prefilling = computed < prompt
    return int((~prefilling | (computed + scheduled >= prompt)).sum())
