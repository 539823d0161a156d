"""Hook specifications of vegas (pluggy project name ``vegas``).

A plugin is a module or object with functions marked ``@vegas.hookimpl`` and named like
the specs below; third-party plugins are found through the entry-point group ``vegas``
(see :mod:`vegas.plugins`). The built-in selectors and backends are registered through
the same hooks.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("vegas")
hookimpl = pluggy.HookimplMarker("vegas")


@hookspec
def vegas_selectors() -> dict[str, type]:
    """Selectors this plugin provides.

    Called once, when the registry is first used (not ``firstresult``: every plugin's
    answer is merged; a later plugin cannot replace a name already taken).

    Returns:
        ``{name: Selector subclass}``; each class is built as ``cls(config)`` with a
        :class:`vegas.config.VegasConfig`.
    """


@hookspec
def vegas_backends() -> dict[str, type]:
    """Backends this plugin provides.

    Called once, when the registry is first used; every plugin's answer is merged.

    Returns:
        ``{name: Backend subclass or zero-argument callable returning one}``; the class
        is built as ``cls(model, dtype=..., device=..., trust_remote_code=...)``. A
        callable lets a backend with heavy imports (vLLM) load only when chosen.
    """
