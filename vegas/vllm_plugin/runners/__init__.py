"""The adapters of Vegas to vLLM's two model runners. Each drafter owns one
:class:`~vegas.vllm_plugin.selection.state.SelectionState` and drafts with the shared
:class:`~vegas.vllm_plugin.drafting.engine.DraftEngine`.

- :mod:`.start`: what both drafters do when vLLM builds them (supported settings, the selector,
  verification CUDA graphs, the patches, the selection path and buffers).
- :mod:`.v1`: :class:`~vegas.vllm_plugin.runners.v1.VegasProposer`, the ``custom_class``
  proposer of the V1 GPU model runner; users name it by its public class path
  ``vegas.vllm_plugin.proposer.VegasProposer`` (:mod:`vegas.vllm_plugin.proposer`).
- :mod:`.seeds`: the V1 proposer's seeded draft sampling.
- :mod:`.v2`: :class:`~vegas.vllm_plugin.runners.v2.VegasSpeculator`, the speculator of the V2
  model runner (imports vLLM at module import time).
- :mod:`.v2_helpers`: its pure tensor helpers (request slots, step inputs, acceptance counts).

The asynchronous-scheduling arithmetic and policy the V1 proposer uses stay beside the patch
table that shares them (:mod:`vegas.vllm_plugin.async_sched`).
"""
