"""Which steps draft, decided where vLLM schedules them (pure Python; no vLLM import).

Under asynchronous scheduling vLLM's scheduler reserves the next step's draft slots while it
schedules the current one: ``AsyncScheduler._update_after_schedule`` gives every decoding
request ``SchedulerOutput.num_spec_tokens_to_schedule`` placeholders, and the next step verifies
that many drafts per request (``vllm/v1/core/sched/async_scheduler.py``, vLLM 0.24.0). A drafter
that merely returns no drafts still costs the next step its ``γ + 1``-token verification.

Vegas sets ``num_spec_tokens_to_schedule`` itself, 0 or γ per step (:func:`drafts_next_step`),
before the async scheduler reads it, and the V2 speculator reads the same number from the step's
``SchedulerOutput`` (:meth:`~vegas.vllm_plugin.runners.v2.VegasSpeculator.on_schedule`): a step
scheduled with 0 neither selects nor drafts, and the next step verifies one token per request,
a plain step. The rule today: a step that carries at least ``VegasConfig.vllm.prefill_skip_tokens``
prompt tokens (0: never) runs plainly, so that requests waiting for their first token are not
held up by a draft phase. Correctness does not depend on the rule: verification accepts exactly
what the target model samples, whatever was drafted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["drafts_next_step", "prompt_tokens"]


def prompt_tokens(num_scheduled_tokens: Mapping[str, int], spec_decode_tokens: Mapping[str, Sequence]) -> int:
    """Prompt (prefill) tokens of a scheduled step: every request's scheduled tokens beyond one
    sampled token and its scheduled drafts (``SchedulerOutput.num_scheduled_tokens`` and
    ``scheduled_spec_decode_tokens``). A decoding request contributes 0; a prefill chunk of ``n``
    tokens ``n - 1``."""
    return sum(max(n - 1 - len(spec_decode_tokens.get(req, ())), 0) for req, n in num_scheduled_tokens.items())


def drafts_next_step(num_scheduled_tokens: Mapping[str, int], spec_decode_tokens: Mapping[str, Sequence],
                     gamma: int, prefill_skip_tokens: int) -> int:
    """Drafts per request the step's drafter makes and the next step verifies: 0 when the step
    carries at least ``prefill_skip_tokens`` prompt tokens (``prefill_skip_tokens > 0``), else γ."""
    if prefill_skip_tokens > 0 and prompt_tokens(num_scheduled_tokens, spec_decode_tokens) >= prefill_skip_tokens:
        return 0
    return gamma
