"""Acceptance of draft tokens against the target model (lossless by construction).

Greedy: accept the longest prefix of drafts that equal the target's argmax; the token
after it is the target's argmax (a correction, or the bonus token if all γ were accepted).

Sampling: speculative rejection sampling, Leviathan et al. 2023 ("Fast Inference from
Transformers via Speculative Decoding", Algorithm 1) and Chen et al. 2023 ("Accelerating
Large Language Model Decoding with Speculative Sampling", Algorithm 2): accept draft
``x_i ~ q_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection
sample from ``norm(max(0, p_i - q_i))``; if all γ are accepted sample the bonus token from
``p_{γ+1}``. The emitted tokens are distributed exactly as the target's samples.
"""

from __future__ import annotations

import torch

__all__ = ["greedy_accept", "speculative_sampling"]


def _accepted_prefix(accepted: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of ``accepted`` ``(batch_size, γ)`` bool -> ``(batch_size,)``."""
    return accepted.long().cumprod(dim=1).sum(dim=1)


def greedy_accept(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification.

    Args:
        draft_tokens: ``torch.LongTensor (batch_size, γ)``.
        target_logits: ``torch.FloatTensor (batch_size, γ + 1, vocab)``.

    Returns:
        ``num_accepted`` ``(batch_size,)`` int64 in [0, γ] and ``next_tokens``
        ``(batch_size,)`` int64: the target's argmax after the accepted prefix.
    """
    target_tokens = target_logits.argmax(dim=-1)  # [batch_size, γ + 1]
    num_accepted = _accepted_prefix(draft_tokens == target_tokens[:, :-1])
    next_tokens = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)
    return num_accepted, next_tokens


def speculative_sampling(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023, Alg. 2).

    Args:
        draft_tokens: ``torch.LongTensor (batch_size, γ)``, ``x_i ~ q_i``.
        draft_probs: q, ``torch.FloatTensor (batch_size, γ, vocab)``.
        target_probs: p, ``torch.FloatTensor (batch_size, γ + 1, vocab)``.
        generator: source of the uniform draws and the resampling.

    Returns:
        ``num_accepted`` ``(batch_size,)`` int64 in [0, γ] and ``next_tokens``
        ``(batch_size,)`` int64 (resampled from the residual, or the bonus token).
    """
    batch_size, gamma = draft_tokens.shape
    p = target_probs[:, :gamma].gather(2, draft_tokens[..., None]).squeeze(2)  # [batch_size, γ]
    q = draft_probs.gather(2, draft_tokens[..., None]).squeeze(2)  # [batch_size, γ]
    r = torch.rand(p.shape, generator=generator, device=p.device, dtype=p.dtype)
    # r <= p/q without dividing by q; never where p = 0 (r can be exactly 0.0, and a top-p
    # draft can propose a token outside the target's nucleus)
    num_accepted = _accepted_prefix((r * q <= p) & (p > 0))

    rows = torch.arange(batch_size, device=p.device)
    p_next = target_probs[rows, num_accepted]  # [batch_size, vocab]
    q_pad = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)
    residual = (p_next - q_pad[rows, num_accepted]).clamp_min(0)  # q = 0 after γ: bonus ~ p
    mass = residual.sum(dim=-1, keepdim=True)
    # p == q exactly leaves no residual mass; then any draw from p keeps the distribution.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)
    next_tokens = torch.multinomial(residual, 1, generator=generator).squeeze(1)
    return num_accepted, next_tokens
