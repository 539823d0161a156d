"""Fixture plugins registered explicitly by the tests (autoload is off)."""

import vegas
from vegas.strategies.sliding_window import SlidingWindowSelector


class SinksOnlySelector(SlidingWindowSelector):
    """Only the sinks and the recent window: a plugin-provided selector for the tests."""

    name = "sinks_only"


class GoodPlugin:
    @vegas.hookimpl
    def vegas_selectors(self):
        return {"sinks_only": SinksOnlySelector}


class RaisingPlugin:
    @vegas.hookimpl
    def vegas_selectors(self):
        raise RuntimeError("boom from a broken plugin")

    @vegas.hookimpl
    def vegas_backends(self):
        raise RuntimeError("boom from a broken plugin")


class ShadowingPlugin:
    @vegas.hookimpl
    def vegas_selectors(self):
        return {"collect2": SinksOnlySelector}
