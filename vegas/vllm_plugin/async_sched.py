"""Asynchronous scheduling for the Vegas proposer on vLLM's V1 GPU model runner.

vLLM 0.24 overlaps the host work of step N+1 (scheduling, input preparation) with the GPU work
of step N when ``async_scheduling`` is on, but only for EAGLE, draft-model and ngram-GPU
proposers: ``VllmConfig.__post_init__`` turns it off (or refuses it) for a ``custom_class``
proposer. Under async scheduling the host never sees the sampled tokens of the step it just
launched, so a proposer must draft from device tensors and publish, before the runner's
bookkeeping, the next input token and the number of valid sampled tokens of every request
(vLLM's ``_copy_valid_sampled_token_count``; its runner corrects the optimistic host counters
on the GPU from them).

This module holds the device-side arithmetic and the policy (pure torch, tested on CPU); the
two patches that use them live in :mod:`vegas.vllm_plugin.patches`
(``patch_config_check``: ``async_scheduling`` stays on by default on one GPU, see
:func:`wants_async`; ``patch_bookkeeping``: the proposer publishes before the runner's
bookkeeping, where vLLM's EAGLE path publishes the same tensors).

Nothing here imports vLLM at module import time.
"""

from __future__ import annotations

import torch

__all__ = [
    "draft_start_positions",
    "is_vegas_proposer",
    "next_tokens_and_counts",
    "wants_async",
]


def next_tokens_and_counts(
    sampled: torch.Tensor, discard: torch.Tensor, backup: torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Last valid sampled token and valid-token count per request, as vLLM's
    ``eagle_prepare_next_token_padded_kernel`` computes them.

    Args:
        sampled: ``(num_reqs, γ + 1)`` int32/int64 rejection-sampler output; rejected positions
            hold -1 (a valid prefix, then -1s).
        discard: ``(num_reqs,)`` bool, requests whose sample is discarded (partial prefill).
        backup: ``(num_reqs,)`` int token used where nothing valid was sampled or the request
            is discarded.
        vocab_size: token ids ``>= vocab_size`` count as invalid.

    Returns:
        ``next_ids`` ``(num_reqs,)`` int32 and ``counts`` ``(num_reqs,)`` int32 (0 for
        discarded requests; otherwise 1 + accepted drafts).
    """
    valid = (sampled >= 0) & (sampled < vocab_size)
    counts = valid.sum(dim=1, dtype=torch.int32)
    counts = torch.where(discard, torch.zeros_like(counts), counts)
    last = sampled.gather(1, (counts.long() - 1).clamp(min=0)[:, None])[:, 0]
    next_ids = torch.where(counts > 0, last.to(torch.int32), backup.to(torch.int32))
    return next_ids, counts

def draft_start_positions(seq_lens: torch.Tensor, num_draft: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Position of each request's last sampled token (the first draft forward's input).

    The verified chunk ends at position ``seq_len - 1``; its last ``num_draft`` tokens were
    drafts, so the last non-draft query sits at ``seq_len - num_draft - 1`` and the ``counts``
    sampled tokens follow it: the last is at ``seq_len - num_draft - 1 + counts``.

    Args:
        seq_lens: ``(num_reqs,)`` int sequence lengths of the verified step (device values;
            under async scheduling the host's are optimistic).
        num_draft: ``(num_reqs,)`` int drafts scheduled per request in that step.
        counts: ``(num_reqs,)`` int valid sampled tokens (:func:`next_tokens_and_counts`).

    Returns:
        ``(num_reqs,)`` int64 positions (meaningless where ``counts == 0``).
    """
    return seq_lens.long() - num_draft.long() - 1 + counts.long()

def is_vegas_proposer(speculative_config) -> bool:
    """Whether ``speculative_config`` names the Vegas proposer (a ``custom_class`` under ``vegas.``)."""
    return (
        speculative_config is not None
        and speculative_config.method == "custom_class"
        and str(speculative_config.model).startswith("vegas.")
    )

def wants_async(vllm_config) -> bool:
    """Whether an engine with the Vegas proposer should run async scheduling.

    On one GPU: yes unless the user set ``async_scheduling=False``. With tensor parallelism
    only when asked for (``async_scheduling=True``): that combination has not run on GPUs yet,
    so the default stays on the synchronous path that was tested at TP = 2. Never with pipeline
    parallelism (which Vegas refuses)."""
    parallel = vllm_config.parallel_config
    asked = vllm_config.scheduler_config.async_scheduling
    if not is_vegas_proposer(vllm_config.speculative_config) or parallel.pipeline_parallel_size != 1:
        return False
    if getattr(parallel, "tensor_parallel_size", 1) > 1:
        return asked is True
    return asked is not False
