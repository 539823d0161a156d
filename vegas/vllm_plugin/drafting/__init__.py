"""The draft phase on vLLM: γ query-length-1 forwards of the target model over the last
verification's selection, shared by both model runners (no vLLM import at module import time).

- :mod:`.engine`: :class:`~vegas.vllm_plugin.drafting.engine.DraftEngine` (eager or one CUDA
  graph per row count), the page-size-1 draft tables built from a
  :class:`~vegas.vllm_plugin.selection.state.SelectionState`, the draft buffers and the model's
  attention layers.
- :mod:`.attention`: the draft attention the attention override runs for
  :class:`~vegas.vllm_plugin.drafting.attention.DraftMetadata` (FA3 over the page-size-1 view
  of vLLM's paged KV cache).
"""
