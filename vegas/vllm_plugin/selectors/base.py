"""What the vLLM backend asks of a selection path: the fast paths of the built-in selectors
and the generic path (:mod:`.generic`) for every other selector.

During each full-attention forward of vLLM's runner (prefill or verification) the attention
override calls :meth:`vegas.vllm_plugin.selection.state.SelectionState.on_layer` for every layer; at the
first layer the state builds the :class:`~vegas.vllm_plugin.selectors.plan.CollectPlan` and calls
:meth:`SelectionPath.begin`, then :meth:`SelectionPath.layer` at every layer. A path writes the
state's selection buffers (``sel_buf``, ``ctx_sel_buf``, ``budget_buf``); drafting reads them,
whatever path wrote them.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ...config import VegasConfig
from ...interfaces import Selector
from .plan import CollectPlan, RowTable

__all__ = ["FastPath", "SelectionPath"]


class SelectionPath:
    """How one selector's selection is made inside vLLM's full-attention forwards.

    Args:
        selector: the selector object (its policy: ``score_rows``, ``budget``, ``config``).
        gamma: γ, draft tokens per iteration.
        device: where the plan's tensors live (the runner's device).
    """

    #: True: one selection serves every layer (``sel_buf`` row 0); False: one per layer
    shared_across_layers: ClassVar[bool] = False
    #: False: the selection cannot be captured into CUDA graphs (Python runs every step)
    capturable: ClassVar[bool] = True

    def __init__(self, selector: Selector, gamma: int, device) -> None:
        self.selector = selector
        self.gamma = gamma
        self.row_table = RowTable.of(selector, gamma, device)

    @classmethod
    def raise_if_unsupported(cls, selector: Selector, config: VegasConfig, block_size: int | None = None) -> None:
        """Refuse settings this path cannot run (:class:`~vegas.config.VegasConfigError`).

        Args:
            block_size: the engine's KV block size (vLLM's ``cache_config.block_size``), tokens;
                None before the engine exists (the proposer checks again with it).
        """

    def recent_columns(self, block_size: int) -> int:
        """Draft-table columns beyond ``2γ + 2`` for the positions from ``ctx_sel`` on."""
        return 0

    def begin(self, state, plan: CollectPlan, query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata) -> None:
        """First layer of a forward: write the requests' selectable prefix and budget."""
        n = plan.num_seqs
        state.ctx_sel_buf[:n].copy_(plan.ctx_sel)
        state.budget_buf[:n].copy_(plan.budgets)

    def layer(self, state, row: int, query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata, scale: float) -> None:
        """After the full attention of the layer in ``state``'s row ``row`` (0 = first layer).

        Args:
            query: ``(num_tokens, num_q_heads, head_dim)`` the forward's queries.
            kv_cache: ``(num_blocks, 2, block_size, num_kv_heads, head_dim)`` the layer's cache.
        """

    def draft_pages(self, state, block_table: torch.Tensor, ctx_sel: torch.Tensor, budgets: torch.Tensor,
                    active: torch.Tensor, width: int):
        """A per-draft-step page chooser handed to the draft attention (Quest), or None."""
        return None


class FastPath(SelectionPath):
    """A selection path with fused kernels that selects exactly what its selector's ``select``
    would, without calling it; registered through ``vegas_vllm_fast_paths``."""
