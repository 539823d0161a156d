"""Fixture plugins registered explicitly by the tests (autoload is off)."""

import torch

import vegas
from vegas.interfaces import Selection
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


class NotADictPlugin:
    @vegas.hookimpl
    def vegas_selectors(self):
        return ["x"]


class NotAClassPlugin:
    @vegas.hookimpl
    def vegas_selectors(self):
        return {"badvalue": 3}

    @vegas.hookimpl
    def vegas_backends(self):
        return {"notabackend": 3}


class InitRaisingSelector(SlidingWindowSelector):
    name = "initraise"

    def __init__(self, config):
        raise RuntimeError("init boom")


class SelectRaisingSelector(SlidingWindowSelector):
    name = "selectraise"

    def select(self, inputs):
        raise RuntimeError("select boom")


class SelectNoneSelector(SlidingWindowSelector):
    """select() returns None: without a check the drafts would silently attend to everything."""

    name = "selectnone"

    def select(self, inputs):
        return None


class OutOfRangeSelector(SlidingWindowSelector):
    """select() names slots past the context: without a check, an indexing error in the model."""

    name = "outofrange"

    def select(self, inputs):
        sel = super().select(inputs)
        return Selection(indices=sel.indices + inputs.valid.shape[1], mask=sel.mask)


class WrongShapeSelector(SlidingWindowSelector):
    """select() drops the groups dimension."""

    name = "wrongshape"

    def select(self, inputs):
        sel = super().select(inputs)
        return Selection(indices=sel.indices[:, 0], mask=sel.mask[:, 0])


class WrongGroupsSelector(SlidingWindowSelector):
    """select() returns one set more than the layer has groups."""

    name = "wronggroups"

    def select(self, inputs):
        sel = super().select(inputs)
        groups = sel.indices.shape[1] + (inputs.keys.shape[1] if inputs.keys is not None else 1) + 1
        return Selection(indices=sel.indices[:, :1].expand(-1, groups, -1).contiguous(),
                         mask=sel.mask[:, :1].expand(-1, groups, -1).contiguous())


class OverBudgetSelector(SlidingWindowSelector):
    """select() returns every committed slot, whatever the KV budget."""

    name = "overbudget"

    def select(self, inputs):
        slots = torch.arange(inputs.valid.shape[1])[None, None, :].expand(inputs.valid.shape[0], 1, -1)
        return Selection(indices=slots.contiguous(), mask=inputs.valid[:, None, :].clone())


class QueryOutOfRangeSelector(SlidingWindowSelector):
    """A query-aware selector whose select_for_query() names negative slots."""

    name = "queryoutofrange"
    query_aware = True

    def select_for_query(self, layer_idx, query, selection):
        return Selection(indices=selection.indices - 10**6, mask=selection.mask)


class BadSelectionPlugin:
    @vegas.hookimpl
    def vegas_selectors(self):
        return {"outofrange": OutOfRangeSelector, "wrongshape": WrongShapeSelector, "wronggroups": WrongGroupsSelector,
                "overbudget": OverBudgetSelector,
                "queryoutofrange": QueryOutOfRangeSelector}


class FactoryRaisingBackendPlugin:
    @vegas.hookimpl
    def vegas_backends(self):
        def factory():
            raise RuntimeError("backend factory boom")

        return {"boombackend": factory}


class FailingSelectorsPlugin:
    @vegas.hookimpl
    def vegas_selectors(self):
        return {"initraise": InitRaisingSelector, "selectraise": SelectRaisingSelector,
                "selectnone": SelectNoneSelector}


class BadNamePlugin:
    """A selector named so that no comma-separated flag could choose it; its backends are fine."""

    @vegas.hookimpl
    def vegas_selectors(self):
        return {"bad name,x": SinksOnlySelector}

    @vegas.hookimpl
    def vegas_backends(self):
        from vegas.backends.hf import HFBackend

        return {"hf_again": HFBackend}
