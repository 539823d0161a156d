"""Why Collect-2 works: how much the top-k sets of nearby queries overlap (analysis, HF backend).

:class:`OverlapProbe` drafts exactly as ``collect2`` but asks verification for every row of
the chunk apart (``per_row_scores``). At each layer and verification it takes, for each row
(query) t of the chunk, the top-k slots of t's own scores (summed over the heads of each
group, the drafting budget k) among the *prompt* slots (those every query of the run sees, so
that sets of different iterations are comparable), and accumulates the Jaccard overlap
``|A ∩ B| / |A ∪ B|`` of

* ``within``: rows t and t + d of one verified chunk (rejected drafts included, as
  Collect-2 uses them), d = 1 … min(γ, max_distance);
* ``across``: committed rows of consecutive iterations at distance d = 1 … max_distance
  (token positions);
* ``proxy_<name>``: the set a selector would draft the next iteration with (``last_token``:
  row 0; ``collect2``: rows 0 and γ summed; ``aggregated``: all rows summed), against the
  set of each row r of the *next* chunk, indexed by draft step r + 1 (row r is the verified
  counterpart of draft query r; recent-window slots are not forced in here).

Sums are kept per sequence (prompt), averaged over layers, groups and pairs:
:meth:`OverlapProbe.results`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .interfaces import Selection, SelectionInput
from .selection import topk_selection
from .strategies.collect2 import Collect2Selector

__all__ = ["OverlapProbe", "jaccard", "pairwise_jaccard", "topk_sets", "PROXIES"]

#: the proxy sets compared with the next chunk's rows: name -> rows of the chunk to sum
PROXIES = ("last_token", "collect2", "aggregated")


def topk_sets(scores: torch.Tensor, allowed: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """Top-``budget[b]`` slots of each score row as a membership mask.

    Args:
        scores: ``(batch_size, ..., num_slots)`` float.
        allowed: ``(batch_size, num_slots)`` bool: slots that may be chosen.
        budget: ``(batch_size,)`` int64, at most the allowed count.

    Returns:
        ``torch.BoolTensor`` of ``scores``' shape.
    """
    batch_size, num_slots = scores.shape[0], scores.shape[-1]
    flat = scores.reshape(batch_size, -1, num_slots)
    sel = topk_selection(flat, allowed, budget)  # [B, R, k]
    index = sel.indices.masked_fill(~sel.mask, num_slots)  # dropped entries to a scratch column
    sets = torch.zeros(*flat.shape[:2], num_slots + 1, dtype=torch.bool, device=scores.device)
    sets.scatter_(2, index, True)
    return sets[..., :num_slots].reshape(scores.shape)


def jaccard(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``|a ∩ b| / |a ∪ b|`` over the last dimension of two broadcastable bool masks (1 when
    both are empty)."""
    inter = (a & b).sum(-1).float()
    union = (a | b).sum(-1).float()
    return torch.where(union > 0, inter / union.clamp(min=1), torch.ones_like(union))


def pairwise_jaccard(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Jaccard of every row of ``a`` ``(..., m_a, L)`` with every row of ``b`` ``(..., m_b, L)``
    (bool): ``(..., m_a, m_b)``."""
    inter = torch.einsum("...il,...jl->...ij", a.float(), b.float())
    union = a.sum(-1, dtype=torch.float32)[..., :, None] + b.sum(-1, dtype=torch.float32)[..., None, :] - inter
    return torch.where(union > 0, inter / union.clamp(min=1), torch.ones_like(union))


class OverlapProbe(Collect2Selector):
    """``collect2`` drafting that measures top-k overlap of the verified queries (see module).

    Args:
        config: the run's config (budget, granularity, score mode as for ``collect2``).
        max_distance: largest query distance d measured (tokens).
    """

    name = "overlap_probe"
    per_row_scores = True

    def __init__(self, config, max_distance: int = 8) -> None:
        super().__init__(config)
        self.max_distance = max_distance
        self.width = 1 + max(max_distance, config.num_draft_tokens + 1)  # index 0 unused
        self._prefix: dict[int, torch.Tensor] = {}  # layer -> [B, L0] prompt slots every row sees
        self._count: dict[int, torch.Tensor] = {}  # layer -> [B] committed tokens at the last selection
        self._last: dict[int, tuple] = {}  # layer -> (sets [B,G,m,L0], start [B], kept [B], proxies)
        self._seq: torch.Tensor | None = None  # [B] batch row -> sequence index
        self._num_sequences = 0
        self.sums: dict[str, torch.Tensor] = {}  # series -> [num_sequences, width] float64
        self.counts: dict[str, torch.Tensor] = {}

    def score_rows(self, chunk_len: int) -> list[int]:
        return list(range(chunk_len))

    def _add(self, series: str, index: int, values: torch.Tensor, counts: torch.Tensor) -> None:
        """Add per-row ``values`` ``(batch_size,)`` (sums over ``counts`` pairs) at ``index``."""
        if series not in self.sums:
            n = self._num_sequences
            self.sums[series] = torch.zeros(n, self.width, dtype=torch.float64)
            self.counts[series] = torch.zeros(n, self.width, dtype=torch.float64)
        self.sums[series][self._seq, index] += values.double().cpu()
        self.counts[series][self._seq, index] += counts.double().cpu()

    def select(self, inputs: SelectionInput) -> Selection:
        scores = inputs.scores  # [B, G, m, L] float32
        layer, m = inputs.layer_idx, scores.shape[2]
        count = inputs.valid.sum(dim=1)  # [B] committed tokens
        drafting = replace(inputs, scores=scores[:, :, sorted({0, m - 1})].sum(dim=2))  # collect2's rows
        if layer not in self._prefix:  # prefill: the rows are the prompt's last m positions
            if self._seq is None:
                self._seq = torch.arange(count.shape[0])
                self._num_sequences = count.shape[0]
            rank = inputs.valid.long().cumsum(dim=1) - 1
            self._prefix[layer] = inputs.valid & (rank < (count - m)[:, None])
            self._count[layer] = count
            return super().select(drafting)
        prefix = self._prefix[layer]
        start, kept = self._count[layer], count - self._count[layer]  # chunk row r sits at start + r
        self._count[layer] = count
        budget = inputs.budget.minimum(prefix.sum(dim=1))
        sets = topk_sets(scores[..., : prefix.shape[1]], prefix, budget)  # [B, G, m, L0]
        for d in range(1, min(self.max_distance, m - 1) + 1):
            j = jaccard(sets[:, :, :-d], sets[:, :, d:]).mean(dim=1)  # [B, m - d]
            self._add("within", d, j.sum(dim=1), torch.full_like(j[:, 0], m - d))
        rows = {"last_token": [0], "collect2": sorted({0, m - 1}), "aggregated": list(range(m))}
        proxies = {name: topk_sets(scores[:, :, rows[name], : prefix.shape[1]].sum(dim=2), prefix, budget)
                   for name in PROXIES}  # [B, G, L0]
        if layer in self._last:
            p_sets, p_start, p_kept, p_proxies = self._last[layer]
            j = pairwise_jaccard(p_sets, sets).mean(dim=1)  # [B, m_prev, m]
            r_prev = torch.arange(p_sets.shape[2], device=j.device)
            r_now = torch.arange(m, device=j.device)
            dist = (start[:, None, None] + r_now) - (p_start[:, None, None] + r_prev[:, None])
            ok = (r_prev[:, None] < p_kept[:, None, None]) & (r_now < kept[:, None, None])
            for d in range(1, self.max_distance + 1):
                pairs = ok & (dist == d)
                self._add("across", d, (j * pairs).sum(dim=(1, 2)), pairs.sum(dim=(1, 2)))
            for name, proxy in p_proxies.items():
                jp = jaccard(proxy[:, :, None], sets).mean(dim=1)  # [B, m]
                for r in range(m):
                    self._add(f"proxy_{name}", r + 1, jp[:, r], torch.ones_like(jp[:, r]))
        self._last[layer] = (sets, start, kept, proxies)
        return super().select(drafting)

    def keep_rows(self, rows: torch.Tensor) -> None:
        self._seq = self._seq[rows.cpu()]
        self._prefix = {layer: p[rows] for layer, p in self._prefix.items()}
        self._count = {layer: c[rows] for layer, c in self._count.items()}
        self._last = {
            layer: (sets[rows], start[rows], kept[rows], {n: p[rows] for n, p in proxies.items()})
            for layer, (sets, start, kept, proxies) in self._last.items()
        }

    def results(self) -> dict[str, list[list[float | None]]]:
        """Per series, per sequence: mean Jaccard at each index (d, or draft step for the
        proxies) 1 … ``width - 1``; None where no pair was seen."""
        out = {}
        for series, sums in self.sums.items():
            counts = self.counts[series]
            means = torch.where(counts > 0, sums / counts.clamp(min=1), torch.full_like(sums, float("nan")))
            out[series] = [[None if v != v else round(v, 5) for v in row[1:].tolist()] for row in means]
        return out
