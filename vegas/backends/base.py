"""What every backend offers the :class:`~vegas.pipeline.Pipeline`, and what it returns.

:class:`~vegas.interfaces.Backend` lives in the core (:mod:`vegas.interfaces`) so that
:mod:`vegas.plugins` can check backends without importing this package; it is re-exported here.
"""

from __future__ import annotations

from ..config import VegasConfig, VegasConfigError
from ..interfaces import Backend, Selector
from ..outputs import RequestOutput, RequestStats, as_token_ids
from ..plugins import create_selector, selector_names

__all__ = ["Backend", "RequestOutput", "RequestStats", "as_selector", "as_token_ids"]


def as_selector(selector: Selector | str | None, config: VegasConfig) -> Selector | None:
    """The selector object a backend runs: ``selector`` itself, or the one registered under
    that name built with ``config`` (:func:`vegas.plugins.create_selector`), or None.

    Raises:
        VegasConfigError: an unknown name, or neither a name, None nor a Selector.
        VegasPluginError: the selector's constructor raised.
    """
    if selector is None or isinstance(selector, Selector):
        return selector
    if not isinstance(selector, str):
        raise VegasConfigError.bad("selector", f"must be a registered name ({', '.join(selector_names(plain=True))}), "
                                               f"None (plain decoding) or a vegas.interfaces.Selector instance, "
                                               f"got {selector!r}")
    return create_selector(selector, config)
