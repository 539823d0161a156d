"""Built-in selectors, one module each; registered through :mod:`vegas.plugins`."""

from .aggregated import AggregatedSelector
from .collect2 import Collect2Selector
from .last_token import LastTokenSelector
from .quest import QuestSelector
from .sliding_window import SlidingWindowSelector

BUILTIN_SELECTORS = {
    cls.name: cls
    for cls in (
        AggregatedSelector,
        Collect2Selector,
        SlidingWindowSelector,
        QuestSelector,
        LastTokenSelector,
    )
}

__all__ = [
    "AggregatedSelector",
    "Collect2Selector",
    "LastTokenSelector",
    "QuestSelector",
    "SlidingWindowSelector",
    "BUILTIN_SELECTORS",
]
