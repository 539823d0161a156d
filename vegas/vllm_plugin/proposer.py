"""The public class path of the Vegas proposer on vLLM's V1 model runner:
``vegas.vllm_plugin.proposer.VegasProposer`` is what users pass as
``speculative_config={"method": "custom_class", "model": "vegas.vllm_plugin.proposer.VegasProposer", ...}``
(:data:`vegas.vllm_plugin.CLASS_PATH`). The class lives in :mod:`vegas.vllm_plugin.runners.v1`;
this module only names it.
"""

from __future__ import annotations

from . import CLASS_PATH
from .runners.v1 import VegasProposer

__all__ = ["CLASS_PATH", "VegasProposer"]
