"""The plugin manager: built-ins and third-party selectors, backends and vLLM fast paths.

Built-in plugins are modules named in :data:`BUILTIN_PLUGINS`, imported by name and registered
like any plugin (each defines its own ``@hookimpl`` functions), so this module imports nothing
above the core. The autoload switches below never disable them.

Environment switches (read when the registry is first built):

* ``VEGAS_DISABLE_PLUGIN_AUTOLOAD=1`` (or ``true``, ``yes``, ``on``): load no entry-point plugins (tests do this and
  register their fixture plugins explicitly with :func:`register`).
* ``VEGAS_PLUGINS=name1,name2``: load only these entry points of the group ``vegas``.
* ``VEGAS_TRACE_PLUGINS=1``: log every hook call (pluggy's tracing).

A plugin that fails to import, raises in a hook, or returns anything but a dict of names to
classes (selectors: :class:`~vegas.interfaces.Selector` subclasses; backends:
:class:`~vegas.backends.base.Backend` subclasses or factories returning one) is logged with its
name and skipped; the others still load. A selector or backend that raises when it is built or
run gives a :class:`~vegas.config.VegasPluginError` naming it and its plugin.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import re
from contextlib import contextmanager
from collections.abc import Callable
from typing import Any

import pluggy
import torch

from . import hookspecs
from .config import VegasConfig, VegasConfigError, VegasPluginError
from .interfaces import Backend, Selection, Selector

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "vegas"

#: modules that provide the built-in selectors, backends and vLLM fast paths, registered under
#: their module names before any call to the hooks (in this order: earlier names win)
BUILTIN_PLUGINS = ("vegas.strategies", "vegas.backends.hf", "vegas.backends.vllm", "vegas.vllm_plugin.selectors")

#: the selector name of plain decoding (no drafting), taken wherever a selector is named
PLAIN = "none"
#: what a selector or backend name may hold (names are chosen in comma-separated flags)
NAME_PATTERN = re.compile(r"[A-Za-z0-9_.\-]+")

_manager: pluggy.PluginManager | None = None
_registry: dict[str, dict[Any, Any]] | None = None
#: (kind, name) -> the plugin that registered it (a module of BUILTIN_PLUGINS for the built-ins)
_owners: dict[tuple[str, str], str] = {}
plugin_errors: list[str] = []


def _autoload_disabled() -> bool:
    return os.environ.get("VEGAS_DISABLE_PLUGIN_AUTOLOAD", "").strip().lower() in ("1", "true", "yes", "on")


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    if _autoload_disabled():
        return
    only = {n.strip() for n in os.environ.get("VEGAS_PLUGINS", "").split(",") if n.strip()}
    entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    missing = only - {ep.name for ep in entry_points}
    if missing:
        log.warning(
            "VEGAS_PLUGINS names %s, but no installed plugin has that name (installed: %s)",
            sorted(missing), sorted(ep.name for ep in entry_points) or "none",
        )
    for ep in entry_points:
        if only and ep.name not in only:
            continue
        if ep.name in BUILTIN_PLUGINS:
            _report(ep.name, ValueError(f"its entry-point name is that of a built-in plugin; built-ins: "
                                        f"{', '.join(BUILTIN_PLUGINS)}"))
            continue
        try:
            plugin = ep.load()
            if pm.is_registered(plugin):  # e.g. an entry point that names a built-in module itself
                raise ValueError(f"it loads {pm.get_name(plugin)!r}, which is already registered")
            pm.register(plugin, name=ep.name)
        except (Exception, SystemExit) as exc:  # a broken plugin (even one that exits) must not break the others
            _report(ep.name, exc)


def _report(name: str, exc: BaseException, hook_name: str | None = None) -> None:
    """Log and keep one plugin failure: the whole plugin (it did not load) or one of its hooks
    (``hook_name``: only what that hook provides is skipped, its other hooks still count)."""
    what = f"vegas plugin {name!r}" + (f": its {hook_name}()" if hook_name else "")
    message = f"{what} failed and was skipped: {type(exc).__name__}: {exc}"
    plugin_errors.append(message)
    log.warning(message)


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide manager: hook specs, the built-ins, then the entry-point plugins."""
    global _manager
    if _manager is None:
        pm = pluggy.PluginManager("vegas")
        pm.add_hookspecs(hookspecs)
        if os.environ.get("VEGAS_TRACE_PLUGINS"):
            pm.trace.root.setwriter(log.debug)
            pm.enable_tracing()
        for module in BUILTIN_PLUGINS:
            pm.register(importlib.import_module(module), name=module)
        _load_entry_points(pm)
        _manager = pm
    return _manager


def register(plugin: object, name: str | None = None) -> None:
    """Register a plugin object or module by hand (e.g. a test fixture)."""
    global _registry
    get_plugin_manager().register(plugin, name=name)
    _registry = None


def unregister(name: str) -> None:
    """Remove a plugin registered under ``name``."""
    global _registry
    get_plugin_manager().unregister(name=name)
    _registry = None


def _bad_entry(kind: str, name: object, obj: object) -> str | None:
    """Why ``name -> obj`` cannot be a ``kind`` ("selectors", "backends" or "fast_paths"), or None."""
    if kind == "fast_paths":
        if not (isinstance(name, type) and issubclass(name, Selector)):
            return f"keys must be vegas.interfaces.Selector subclasses, got {name!r}"
        if not isinstance(obj, type):
            return f"the fast path of {name.__name__} must be a class, got {obj!r}"
        return None
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        return (f"names must be non-empty strings of letters, digits, '_', '.' and '-' (they are chosen "
                f"with comma-separated flags such as --selectors), got {name!r}")
    if kind == "selectors":
        if name == PLAIN:
            return f"selector name {PLAIN!r} is plain decoding, it cannot be registered"
        if not (isinstance(obj, type) and issubclass(obj, Selector)):
            return f"selector {name!r} must be a vegas.interfaces.Selector subclass, got {obj!r}"
    elif not callable(obj):
        return f"backend {name!r} must be a vegas.backends.base.Backend subclass or a factory, got {obj!r}"
    return None


def is_builtin(plugin_name: str) -> bool:
    """Whether ``plugin_name`` (see :func:`owner`) is one of :data:`BUILTIN_PLUGINS`."""
    return plugin_name in BUILTIN_PLUGINS


def _collect(hook_name: str, kind: str) -> dict[Any, Any]:
    pm = get_plugin_manager()
    merged: dict[Any, Any] = {}
    # Call each implementation on its own so that one raising plugin is skipped, not fatal.
    # Built-ins claim their names first (in BUILTIN_PLUGINS order), then plugins in
    # registration order.
    impls = getattr(pm.hook, hook_name).get_hookimpls()
    order = {module: i for i, module in enumerate(BUILTIN_PLUGINS)}
    for impl in sorted(impls, key=lambda impl: order.get(impl.plugin_name, len(order))):
        try:
            provided = impl.function()
            if provided is None:
                continue
            if not isinstance(provided, dict):
                raise TypeError(f"{hook_name}() must return a dict of names to classes, got {type(provided).__name__}")
            problems = [p for p in (_bad_entry(kind, n, o) for n, o in provided.items()) if p]
            if problems:
                raise TypeError(f"{hook_name}(): " + "; ".join(problems))
        except Exception as exc:
            _report(impl.plugin_name, exc, hook_name)
            continue
        for name, obj in provided.items():
            if name in merged:
                log.warning("plugin %r: %s %r already registered, ignored", impl.plugin_name, hook_name, name)
                continue
            merged[name] = obj
            if kind != "fast_paths":
                _owners[(kind, name)] = impl.plugin_name
    return merged


def owner(kind: str, name: str) -> str:
    """The plugin that registered selector or backend ``name`` (``kind``: "selectors" or "backends");
    "?" for a name no plugin registered (a selector instance handed over directly)."""
    registry()
    return _owners.get((kind, name), "?")


def described(kind: str, name: str) -> str:
    """``selector 'name' (plugin 'p')`` for messages; ``(not registered)`` where no plugin
    registered ``name`` (e.g. :class:`~vegas.strategies.OracleSelector`, passed as an instance)."""
    plugin = owner(kind, name)
    return f"{kind[:-1]} {name!r} " + ("(not registered)" if plugin == "?" else f"(plugin {plugin!r})")


#: selector methods whose result must be a :class:`~vegas.interfaces.Selection`
_RETURNS_SELECTION = ("select", "select_for_query")


def run_selector(selector, method: str, *args, num_slots: int | None = None):
    """``selector.<method>(*args)``; an exception other than :class:`VegasConfigError` becomes a
    :class:`VegasPluginError` naming the selector and its plugin, and so does a ``select`` or
    ``select_for_query`` that returns anything but a :class:`~vegas.interfaces.Selection` (a
    None there would silently mean "attend to everything"), and, for a selector that is not
    built in, a selection whose shapes do not match or whose real entries (``mask`` True) name
    slots outside ``[0, num_slots)`` (``num_slots``: for ``select`` the width of the input's
    ``valid``; for ``select_for_query`` the caller's committed slots, unchecked when None), and
    a ``select`` over its KV budget or naming uncommitted slots (:func:`_check_selection`).
    Such indices would otherwise end in an indexing error inside the model.

    Raises:
        VegasPluginError: the selector raised, or returned the wrong type, shape or indices.
    """
    name = getattr(selector, "name", type(selector).__name__)
    with blame("selectors", name, f"raised in {method}()"):
        result = getattr(selector, method)(*args)
    if method in _RETURNS_SELECTION:
        if not isinstance(result, Selection):
            raise VegasPluginError(
                f"{described('selectors', name)} {method}() returned "
                f"{type(result).__name__}; it must return a vegas.interfaces.Selection"
            )
        if owner("selectors", name) != BUILTIN_SELECTORS_PLUGIN:
            where = f"{described('selectors', name)} {method}() returned a Selection"
            _check_selection(result, where, method, args, num_slots)
    return result


#: the plugin that registers the built-in selectors (tested here; their selections are not re-checked)
BUILTIN_SELECTORS_PLUGIN = "vegas.strategies"


def _check_selection(selection: Selection, where: str, method: str, args: tuple, num_slots: int | None) -> None:
    """Raise :class:`VegasPluginError` (``where`` + the problem) unless ``selection`` is
    ``(batch_size, groups, k)`` int64 indices and a bool mask of the same shape, ``groups`` 1 or
    the layer's KV heads (as the input's scores or keys, or the selection refined, carry them), whose
    real entries lie in ``[0, num_slots)``; for ``select`` also at most ``inputs.budget`` real
    entries per (sequence, group), each on a committed slot (``inputs.valid``)."""
    inputs = args[0] if method == "select" else None
    if inputs is not None:
        batch_size, num_slots = inputs.valid.shape
        groups = {1} | {t.shape[1] for t in (inputs.scores, inputs.keys) if t is not None}
    else:  # select_for_query(layer_idx, query, selection)
        batch_size, groups = args[2].indices.shape[0], {1, args[2].indices.shape[1]}
    indices, mask = selection.indices, selection.mask

    def fail(problem: str):
        raise VegasPluginError(f"{where} {problem}")

    if not (isinstance(indices, torch.Tensor) and isinstance(mask, torch.Tensor)):
        fail("whose indices and mask are not both torch tensors")
    if indices.dim() != 3 or indices.shape != mask.shape or indices.shape[0] != batch_size:
        fail(f"whose indices {tuple(indices.shape)} and mask {tuple(mask.shape)} are not both "
             f"(batch_size={batch_size}, groups, k)")
    if indices.shape[1] not in groups:
        fail(f"whose groups dimension is {indices.shape[1]}; it must be one of {sorted(groups)} (1: shared by the "
             "layer's heads, else one set per KV head)")
    if indices.dtype != torch.int64 or mask.dtype != torch.bool:
        fail(f"whose dtypes are {indices.dtype} / {mask.dtype}; they must be torch.int64 indices and a torch.bool mask")
    real = indices[mask]
    if real.numel():
        low, high = int(real.min()), int(real.max())
        if low < 0 or (num_slots is not None and high >= num_slots):
            allowed = "at least 0" if num_slots is None else f"in [0, {num_slots}) (the context's cache slots)"
            fail(f"whose indices span [{low}, {high}]: real entries (mask True) must be {allowed}")
    if inputs is None:
        return
    counts = mask.sum(dim=2)  # [B, G]
    over = counts > inputs.budget[:, None]
    if bool(over.any()):
        row = int(over.any(dim=1).nonzero()[0])
        fail(f"with {int(counts[row].max())} entries for sequence {row}, over its KV budget of "
             f"{int(inputs.budget[row])} (SelectionInput.budget)")
    rows = torch.arange(batch_size, device=indices.device)[:, None, None]
    if bool((mask & ~inputs.valid[rows, indices.clamp(0, num_slots - 1)]).any()):
        fail("naming slots that are not committed (SelectionInput.valid False: padding or rolled-back slots)")


def plugin_failure(kind: str, name: str, what: str, exc: BaseException) -> VegasPluginError:
    """The error for a selector or backend that raised (``what``: e.g. "failed to build")."""
    return VegasPluginError(
        f"{described(kind, name)} {what}: {type(exc).__name__}: {exc}"
    )


@contextmanager
def blame(kind: str, name: str, what: str):
    """Turn an exception other than :class:`VegasConfigError` inside the block into a
    :class:`VegasPluginError` naming selector or backend ``name`` and its plugin. Running out of
    memory (``torch.OutOfMemoryError``, ``MemoryError``) is the run's size, not the plugin's
    fault: it passes unchanged (``vegas ablate`` stops on it and says what to change)."""
    try:
        yield
    except (VegasConfigError, torch.OutOfMemoryError, MemoryError):
        raise
    except Exception as exc:
        raise plugin_failure(kind, name, what, exc) from exc


def registry() -> dict[str, dict[Any, Any]]:
    """``{"selectors": {name: cls}, "backends": {name: cls}, "fast_paths": {selector class:
    fast path class}}`` from every registered plugin."""
    global _registry
    if _registry is None:
        _registry = {
            "selectors": _collect("vegas_selectors", "selectors"),
            "backends": _collect("vegas_backends", "backends"),
            "fast_paths": _collect("vegas_vllm_fast_paths", "fast_paths"),
        }
    return _registry


def vllm_fast_path(selector: Selector) -> type | None:
    """The vLLM fast path registered for ``type(selector)`` exactly (a subclass of a selector
    with a fast path has none of its own unless registered: it runs on the generic path)."""
    return registry()["fast_paths"].get(type(selector))


def selector_names(plain: bool = False) -> list[str]:
    """The registered selectors' names, sorted; with ``plain``, :data:`PLAIN` first."""
    return [PLAIN] * plain + sorted(registry()["selectors"])


def backend_names() -> list[str]:
    return sorted(registry()["backends"])


def _autoload_hint() -> str:
    if _autoload_disabled():
        return " (third-party plugins are not loaded: VEGAS_DISABLE_PLUGIN_AUTOLOAD is set)"
    if os.environ.get("VEGAS_PLUGINS"):
        return f" (only the plugins in VEGAS_PLUGINS={os.environ['VEGAS_PLUGINS']!r} are loaded)"
    return ""


def create_selector(name: str, config: VegasConfig) -> Selector | None:
    """Build the selector registered as ``name``; None for :data:`PLAIN` (plain decoding).

    Raises:
        VegasConfigError: no selector of that name (the message lists the known ones).
        VegasPluginError: the selector's constructor raised.
    """
    if name == PLAIN:
        return None
    selectors = registry()["selectors"]
    if not isinstance(name, str) or name not in selectors:
        raise VegasConfigError.bad("selector", f"must be one of {', '.join(selector_names(plain=True))} "
                                               f"({PLAIN!r}: plain decoding), got {name!r}{_autoload_hint()}")
    with blame("selectors", name, "failed to build"):
        return selectors[name](config)


def get_backend_class(name: str):
    """The backend class registered as ``name``.

    Raises:
        VegasConfigError: no backend of that name (the message lists the known ones).
        VegasPluginError: its factory raised or returned no Backend subclass.
    """
    backends = registry()["backends"]
    if not isinstance(name, str) or name not in backends:
        raise VegasConfigError.bad("backend", f"must be one of {', '.join(sorted(backends))}, got {name!r}{_autoload_hint()}")
    cls = backends[name]
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        with blame("backends", name, "failed to load"):
            cls = cls()  # lazy factory
        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            raise plugin_failure("backends", name, "failed to load",
                                 TypeError(f"its factory returned {cls!r}, not a Backend subclass"))
    return cls


class SelectorSkips(dict):
    """Selectors a run over every registered selector leaves out because they raised (name ->
    error), as ``vegas bench``, ``vegas tune`` and ``vegas ablate`` do for ``--selectors all``.

    Args:
        every: the run asked for every selector; otherwise :meth:`skip` re-raises (a selector the
            user named must not vanish from the results).
        say: prints one line of plain text, not rich markup (:func:`vegas.progress.plain_printer`).
    """

    def __init__(self, every: bool, say: Callable[[str], object]) -> None:
        super().__init__()
        self.every, self.say = every, say

    def skip(self, name: str, exc: VegasPluginError) -> None:
        """Leave ``name`` out (and say so), or raise ``exc`` when the user named it.

        Raises:
            VegasPluginError: ``exc``, when the run did not ask for every selector.
        """
        if not self.every:
            raise exc
        self[name] = str(exc)
        self.say(f"skipped: {exc}")

