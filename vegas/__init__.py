"""vegas: lossless self-speculative decoding with verification-guided sparse attention."""

from .config import VegasConfig, VegasConfigError, VegasPluginError
from .hookspecs import hookimpl
from .interfaces import Drafter, Selection, SelectionInput, Selector, Verifier
from .pipeline import DEFAULT_MODEL, Pipeline
from .sampling import SamplingParams

__version__ = "0.1.0"

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
