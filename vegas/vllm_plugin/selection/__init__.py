"""What the verification forward selects, as vLLM's attention runs it (pure PyTorch, no vLLM).

- :mod:`.state`: :class:`~vegas.vllm_plugin.selection.state.SelectionState`, one per Vegas
  drafter: the persistent selection buffers and the two calls the attention override makes
  (``verify_layer`` before vLLM's FA3 call, ``on_layer`` after it); the drafter attaches it to
  each attention layer (:data:`~vegas.vllm_plugin.selection.state.LAYER_ATTR`).
- :mod:`.fa3_verify`: the FA3 score route of ``verify_layer`` (the optional ``_vegas_fa3_C``
  extension: attention and the selection scores in one FA3 call).
- :mod:`.cute_verify`: the CuTe route (opt-in ``vllm.score_path="cute"``: vLLM's CuTe-DSL
  attention storing the logits of probe queries (the scored rows summed), :mod:`vegas.kernels.cute_probe`).

How a selector selects is its selection path, in :mod:`vegas.vllm_plugin.selectors` (with the
per-forward plan the paths read, :mod:`vegas.vllm_plugin.selectors.plan`): that package keeps
its place because third-party fast paths subclass
:class:`vegas.vllm_plugin.selectors.base.FastPath` (:func:`vegas.hookspecs.vegas_vllm_fast_paths`).
"""
