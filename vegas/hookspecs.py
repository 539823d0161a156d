"""Hook specifications of vegas (pluggy project name ``vegas``).

A plugin is a module or object with functions marked ``@vegas.hookimpl`` and named like
the specs below; third-party plugins are found through the entry-point group ``vegas``
(see :mod:`vegas.plugins`). The built-in selectors, backends and vLLM fast paths are
registered through the same hooks (:data:`vegas.plugins.BUILTIN_PLUGINS`).
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
        :class:`vegas.config.VegasConfig`. Names hold letters, digits, ``_``, ``.`` and ``-``
        (they are chosen in comma-separated flags); a hook whose answer breaks a rule is
        skipped and reported by plugin and hook.
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


@hookspec
def vegas_vllm_fast_paths() -> dict[type, type]:
    """vLLM fast paths this plugin provides: fused kernels that make a selector's selection
    inside vLLM's CUDA graphs instead of calling its ``select`` (the generic path).

    Called once, when the registry is first used; every plugin's answer is merged, and a
    selector class already mapped keeps its first fast path. Looked up by the selector
    object's exact class (``type(selector)``), never by name or subclass: a subclass that
    changes ``select`` runs on the generic path unless it registers a fast path too. A fast
    path must select exactly what the selector's ``select`` would (the vLLM backend does not
    call ``select`` for it).

    Returns:
        ``{Selector subclass: fast path class}``; the fast path class follows
        :class:`vegas.vllm_plugin.selectors.base.FastPath` (built by the vLLM worker as
        ``cls(selector, gamma, device)``; see :mod:`vegas.vllm_plugin.selectors` for the
        built-ins).
    """
