"""vegas: lossless self-speculative decoding with verification-guided sparse attention.

The names below are imported on first use (PEP 562): ``import vegas`` and the ``vegas`` command's
``--help`` and option errors do not wait for torch and transformers.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

from .config import VegasConfig, VegasConfigError, VegasPluginError
from .hookspecs import hookimpl

if TYPE_CHECKING:  # for type checkers and IDEs; at run time see __getattr__
    from .interfaces import Drafter, Selection, SelectionInput, Selector, Verifier
    from .pipeline import DEFAULT_MODEL, Pipeline
    from .sampling import SamplingParams

__version__ = "0.1.0"

#: public name -> the module that defines it (imported when the name is first used)
_LAZY = {
    "DEFAULT_MODEL": ".pipeline",
    "Pipeline": ".pipeline",
    "SamplingParams": ".sampling",
    "Drafter": ".interfaces",
    "Selection": ".interfaces",
    "SelectionInput": ".interfaces",
    "Selector": ".interfaces",
    "Verifier": ".interfaces",
}

__all__ = [
    "DEFAULT_MODEL",
    "Drafter",
    "Pipeline",
    "SamplingParams",
    "Selection",
    "SelectionInput",
    "Selector",
    "VegasConfig",
    "VegasConfigError",
    "VegasPluginError",
    "Verifier",
    "hookimpl",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a submodule, as ``import vegas`` gave before
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'vegas' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
