"""The measured points of ``vegas tune`` (``points.json`` rows): how sparsities are rounded and
how points are picked out, shared by :mod:`vegas.tune` and :mod:`vegas.plots`."""

from __future__ import annotations

__all__ = ["points_of", "round_sparsity"]


def round_sparsity(s: float) -> float:
    """A sparsity to 4 significant digits: the form points are stored and matched in."""
    return float(f"{s:.4g}")


def points_of(points: list[dict], step: int, selector: str | None, gamma: int | None = None,
        sparsity: float | None = None) -> list[dict]:
    """The points of ``step`` and ``selector`` (None: plain decoding), at ``gamma`` and
    ``sparsity`` when given."""
    return [p for p in points if p["step"] == step and p["selector"] == selector
            and (gamma is None or p["num_draft_tokens"] == gamma)
            and (sparsity is None or p["sparsity_ratio"] == round_sparsity(sparsity))]
