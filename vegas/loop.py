"""The decode loops: plain decoding and the Vegas draft → verify → accept → commit loop.

Backend-agnostic: they drive a :class:`~vegas.interfaces.Drafter` and a
:class:`~vegas.interfaces.Verifier` that share one batch of sequences.
"""

from __future__ import annotations

import time
from typing import Collection

import torch

from .acceptance import greedy_accept, speculative_sampling
from .draft_policy import AlwaysDraft, DraftPolicy
from .interfaces import Drafter, Selector, Verifier
from .outputs import RequestStats
from .sampling import SamplingParams, make_sampler

__all__ = ["speculative_decode", "plain_decode"]


class _Outputs:
    """Emitted tokens per sequence, truncated at ``max_new_tokens`` or after an EOS token.

    ``active`` maps the decoding batch's rows to sequence indices; :meth:`retire` drops the
    finished ones from the verifier's batch so that no draft is spent past a sequence's end.
    """

    def __init__(self, batch_size: int, max_new_tokens: int, eos_token_ids: Collection[int]):
        self.tokens: list[list[int]] = [[] for _ in range(batch_size)]
        self.stats = [RequestStats() for _ in range(batch_size)]
        self.done = [max_new_tokens == 0] * batch_size
        self.active = list(range(batch_size))
        self.max_new_tokens = max_new_tokens
        self.eos_token_ids = frozenset(eos_token_ids)

    def emit(self, row: int, tokens: list[int], num_drafted: int, num_accepted: int, plain: bool = False,
             kv_budget: int = 0, kv_attended: float | None = None) -> None:
        """Append ``tokens`` to the sequence at batch row ``row`` (``plain``: a Vegas plain step;
        ``kv_budget``: of the selection that followed; ``kv_attended``: the drafter's count of
        this iteration's drafts, None for none)."""
        b = self.active[row]
        if self.done[b]:
            return
        stats = self.stats[b]
        stats.iterations += 1
        stats.plain_steps += plain
        stats.num_drafted += num_drafted
        stats.kv_budget = kv_budget
        if kv_attended is not None:  # running mean over the drafting iterations (γ drafts each)
            mean = stats.kv_attended or 0.0
            stats.kv_attended = mean + (kv_attended - mean) / (stats.iterations - stats.plain_steps)
        emitted = 0
        for token in tokens:
            self.tokens[b].append(token)
            emitted += 1
            if token in self.eos_token_ids or len(self.tokens[b]) == self.max_new_tokens:
                self.done[b] = True
                break
        # accepted drafts that were emitted: a stop (max_new_tokens, EOS) inside them cuts the rest
        stats.num_accepted += min(num_accepted, emitted)
        stats.num_generated = len(self.tokens[b])

    @property
    def finished(self) -> bool:
        return all(self.done)

    def tokens_left(self) -> int:
        """The most tokens any unfinished sequence may still emit (``max_new_tokens`` less its own)."""
        return max(self.max_new_tokens - len(self.tokens[b]) for b in self.active if not self.done[b])

    def retire(self, verifier: Verifier, selector: Selector | None) -> None:
        """Drop finished sequences from the batch (when the verifier can)."""
        keep = [row for row, b in enumerate(self.active) if not self.done[b]]
        if not keep or len(keep) == len(self.active):
            return
        rows = torch.tensor(keep, dtype=torch.long)
        if verifier.keep_rows(rows):
            if selector is not None:
                selector.keep_rows(rows)
            self.active = [self.active[row] for row in keep]

    def finish(self, prefill_seconds: float, decode_seconds: float, selection_seconds: float):
        for stats in self.stats:
            stats.prefill_seconds = prefill_seconds
            stats.decode_seconds = decode_seconds
            stats.selection_seconds = selection_seconds
        return self.tokens, self.stats


def speculative_decode(
    verifier: Verifier,
    drafter: Drafter,
    selector: Selector,
    prompts: list[list[int]],
    *,
    num_draft_tokens: int,
    max_new_tokens: int,
    sampling: SamplingParams,
    generator: torch.Generator | None = None,
    eos_token_ids: Collection[int] = (),
    clock=time.perf_counter,
    policy: DraftPolicy | AlwaysDraft | None = None,
) -> tuple[list[list[int]], list[RequestStats]]:
    """Vegas decoding (design notes (docs/design-notes.md) §1): draft γ, verify, accept, roll back, select.

    Args:
        prompts: token ids per sequence (non-empty).
        num_draft_tokens: γ.
        max_new_tokens: tokens to emit per sequence (fewer after EOS).
        sampling: greedy (temperature 0) or temperature / top-p sampling.
        generator: random source for drafting and acceptance.
        eos_token_ids: token ids that end a sequence (emitted, then the sequence leaves the batch).
        clock: returns seconds; backends on GPUs pass one that synchronises.
        policy: decides per iteration whether the batch drafts or takes a plain step
            (:class:`~vegas.draft_policy.DraftPolicy`); None: always draft.

    Returns:
        emitted token ids and :class:`~vegas.outputs.RequestStats` per sequence;
        ``selection_seconds`` is the part of ``verifier.selection_seconds`` spent after the
        prefill (the decode phase, as ``decode_seconds``).
    """
    sample = make_sampler(sampling, generator)
    policy = policy or AlwaysDraft()
    out = _Outputs(len(prompts), max_new_tokens, eos_token_ids)
    start = clock()
    verifier.prefill(prompts)
    prefill_end = clock()
    prefill_selection = verifier.selection_seconds  # the first selection: reported with prefill
    while not out.finished:
        # 0. Drafting is a loss at the batch's measured acceptance: one plain step instead.
        if not policy.should_draft():
            _plain_step(verifier, sample, out)
            policy.observe_plain()
            out.retire(verifier, selector)
            continue
        # 1. Draft γ tokens with sparse attention (at most what the batch may still emit less
        #    the bonus token, at least one).
        gamma = max(1, min(num_draft_tokens, out.tokens_left() - 1))
        draft_tokens, draft_probs = drafter.draft(gamma, sample)  # [B, γ], [B, γ, V]
        # 2. Verify [x_last, d_1..d_γ] with full attention (scores collected on the way).
        target_logits = verifier.verify(draft_tokens)  # [B, γ + 1, V]
        # 3. Accept the longest valid prefix, plus a correction or bonus token.
        if sampling.greedy:
            num_accepted, next_tokens = greedy_accept(draft_tokens, target_logits)
        else:
            target_probs = sampling.probs(target_logits)
            num_accepted, next_tokens = speculative_sampling(
                draft_tokens, draft_probs, target_probs, generator
            )
        # 4. Roll back rejected slots; select the next drafting phase's KV entries.
        verifier.commit(num_accepted, next_tokens)
        selector.observe(num_accepted, gamma)
        drafts, accepted, nexts = draft_tokens.tolist(), num_accepted.tolist(), next_tokens.tolist()
        budgets = _kv_budgets(verifier, len(accepted))
        attended = [None] * len(accepted) if drafter.kv_attended is None else drafter.kv_attended.tolist()
        for row, n in enumerate(accepted):
            out.emit(row, drafts[row][:n] + [nexts[row]], gamma, n, kv_budget=budgets[row],
                     kv_attended=attended[row])
        policy.observe_draft(1 + sum(accepted) / len(accepted))
        out.retire(verifier, selector)
    end = clock()
    return out.finish(prefill_end - start, end - prefill_end, verifier.selection_seconds - prefill_selection)


def plain_decode(
    verifier: Verifier,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    generator: torch.Generator | None = None,
    eos_token_ids: Collection[int] = (),
    clock=time.perf_counter,
) -> tuple[list[list[int]], list[RequestStats]]:
    """Plain autoregressive decoding with full attention, through the same verifier.

    A decode step is a verification of zero drafts: one full-attention forward of
    ``x_last``, whose next token is sampled from the target and committed.
    """
    sample = make_sampler(sampling, generator)
    out = _Outputs(len(prompts), max_new_tokens, eos_token_ids)
    start = clock()
    verifier.prefill(prompts)
    prefill_end = clock()
    while not out.finished:
        _plain_step(verifier, sample, out, vegas=False)
        out.retire(verifier, None)
    end = clock()
    return out.finish(prefill_end - start, end - prefill_end, 0.0)


def _plain_step(verifier: Verifier, sample, out: _Outputs, vegas: bool = True) -> None:
    """One plain decode step: verify ``[x_last]`` with zero drafts, sample the next token from
    the target and commit it (with a selector, the commit still selects for the next draft)."""
    batch_size = len(out.active)
    logits = verifier.verify(torch.empty(batch_size, 0, dtype=torch.long))  # [B, 1, V]
    next_tokens, _ = sample(logits[:, -1])
    verifier.commit(torch.zeros(batch_size, dtype=torch.long), next_tokens)
    budgets = _kv_budgets(verifier, batch_size)
    for row, token in enumerate(next_tokens.tolist()):
        out.emit(row, [token], 0, 0, plain=vegas, kv_budget=budgets[row])


def _kv_budgets(verifier: Verifier, batch_size: int) -> list[int]:
    """Each row's KV budget of the verifier's current selection (0 without one)."""
    return [0] * batch_size if verifier.kv_budgets is None else verifier.kv_budgets.tolist()
