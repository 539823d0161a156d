"""Built-in selectors, one module each; this module is a built-in plugin
(:data:`vegas.plugins.BUILTIN_PLUGINS`) that registers them. :class:`OracleSelector` (analysis
only) is exported but not registered."""

from ..hookspecs import hookimpl
from .aggregated import AggregatedSelector
from .collect2 import Collect2Selector
from .last_token import LastTokenSelector
from .oracle import OracleSelector
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


@hookimpl
def vegas_selectors():
    return BUILTIN_SELECTORS


__all__ = [
    "AggregatedSelector",
    "Collect2Selector",
    "LastTokenSelector",
    "OracleSelector",
    "QuestSelector",
    "SlidingWindowSelector",
    "BUILTIN_SELECTORS",
]
