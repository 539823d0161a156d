"""Fast paths of the built-in selectors on vLLM, one module each; this module is a built-in
plugin (:data:`vegas.plugins.BUILTIN_PLUGINS`) that registers them through
``vegas_vllm_fast_paths``, keyed by the selector's exact class. Every other selector runs on
the generic path (:mod:`.generic`)."""

from __future__ import annotations

from ...hookspecs import hookimpl
from ...strategies import AggregatedSelector, Collect2Selector, LastTokenSelector, QuestSelector, SlidingWindowSelector
from .base import FastPath, SelectionPath
from .quest import QuestFastPath
from .score_topk import ScoreTopKFastPath
from .sliding_window import SlidingWindowFastPath

__all__ = ["FastPath", "QuestFastPath", "ScoreTopKFastPath", "SelectionPath", "SlidingWindowFastPath"]


@hookimpl
def vegas_vllm_fast_paths():
    return {
        Collect2Selector: ScoreTopKFastPath,
        AggregatedSelector: ScoreTopKFastPath,
        LastTokenSelector: ScoreTopKFastPath,
        SlidingWindowSelector: SlidingWindowFastPath,
        QuestSelector: QuestFastPath,
    }
