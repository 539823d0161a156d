"""What every Vegas drafter does when vLLM builds it, on either model runner: the V1 proposer
(:class:`~vegas.vllm_plugin.runners.v1.VegasProposer`) and the V2 speculator
(:class:`~vegas.vllm_plugin.runners.v2.VegasSpeculator`) each create their
:class:`~vegas.vllm_plugin.selection.state.SelectionState` and hand it here: refuse the engine
settings Vegas does not support, build the selector of ``additional_config["vegas"]``
(:mod:`vegas.vllm_plugin.settings`), choose full or piecewise verification CUDA graphs, apply
the attention and scheduler patches, put the selection path in force and reserve the
selection buffers before vLLM captures its graphs.
"""

from __future__ import annotations

import logging

from ...config import VegasConfigError
from ...interfaces import Selector
from .. import patches
from ..selection.state import SelectionState
from ..settings import build_selector, path_class, read_settings, settings_json
from ..step_switch import prefill_skip_tokens

__all__ = ["reserve_selection_buffers", "start_drafter", "use_path"]

logger = logging.getLogger("vegas.vllm")


def _raise_if_unsupported(vllm_config) -> None:
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise VegasConfigError("vegas: pipeline parallelism is not supported; use pipeline_parallel_size=1")
    if vllm_config.cache_config.cache_dtype not in ("auto", "bfloat16", "float16"):
        raise VegasConfigError("vegas: quantized KV caches are not supported; use kv_cache_dtype='auto'")
    if getattr(parallel, "use_ubatching", False):
        raise VegasConfigError("vegas: micro-batching (enable_dbo / ubatch_size > 1) is not supported; turn it off")
    if getattr(vllm_config, "lora_config", None) is not None:
        raise VegasConfigError(
            "vegas: LoRA is not supported (drafts would run without the adapters); disable enable_lora"
        )
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is not None and getattr(model_config, "uses_mrope", False):
        raise VegasConfigError("vegas: M-RoPE models are not supported (drafts use 1-D positions)")


def _apply_graph_mode(vllm_config, selector, verify_cuda_graphs: str) -> bool:
    """Force piecewise CUDA graphs for a selector without a fast path or when asked
    (``verify_cuda_graphs="piecewise"``); returns whether full graphs stay on."""
    from vllm.config import CUDAGraphMode

    compilation = vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    if mode is not None and mode.has_full_cudagraphs():
        if not path_class(selector).capturable:
            logger.info(
                "vegas: selector %r has no vLLM fast path; its select() runs in Python at every verification, "
                "so verification uses piecewise CUDA graphs (cudagraph_mode %s -> PIECEWISE)", selector.name, mode,
            )
            compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE
        elif verify_cuda_graphs == "piecewise":
            logger.info("vegas: verify_cuda_graphs=piecewise: cudagraph_mode %s -> PIECEWISE", mode)
            compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE
    mode = compilation.cudagraph_mode
    return bool(mode is not None and mode.has_full_cudagraphs())


def start_drafter(state: SelectionState, vllm_config, gamma: int) -> tuple[Selector, str]:
    """What every Vegas drafter does when vLLM builds it (the V1 proposer and the V2
    speculator alike): refuse unsupported engine settings, build the selector of
    ``additional_config["vegas"]`` with vLLM's γ, set up the drafter's selection ``state`` (γ,
    enabled, full or piecewise verification graphs, the TP all-reduce) and apply the attention
    and scheduler patches.

    Returns:
        ``(selector, settings JSON)``; the selection path is made with the device
        (:func:`use_path`).

    Raises:
        VegasConfigError: an unsupported engine setting or bad Vegas settings.
    """
    patches.check_vllm()
    _raise_if_unsupported(vllm_config)
    name, config = read_settings(vllm_config)
    selector = build_selector(name, config, gamma, vllm_config.cache_config.block_size)
    state.gamma = gamma
    state.enabled = True
    state.frozen = _apply_graph_mode(vllm_config, selector, selector.config.vllm.verify_cuda_graphs)
    if int(vllm_config.parallel_config.tensor_parallel_size) > 1:
        from vllm.distributed import tensor_model_parallel_all_reduce

        state.all_reduce = tensor_model_parallel_all_reduce
    patches.patch_attention()
    patches.patch_scheduler_lookahead()
    patches.patch_scheduler_switch()
    return selector, settings_json(name, selector.config)


def use_path(state: SelectionState, selector: Selector, settings: str, gamma: int, device, *,
             runner: str = "v2") -> None:
    """Put the selector's selection path (its fast path, else the generic one) in force in
    ``state``; ``runner`` ("v1" or "v2"): the model runner, for the default of
    ``vllm.select_in_draft`` (:func:`select_in_draft`)."""
    from ..selectors.score_topk import ScoreTopKFastPath

    state.use(path_class(selector)(selector, gamma, device), settings)
    options = selector.config.vllm
    # where the scheduler decides (V2, async) it sets state.scheduled_skip each step instead
    state.prefill_skip_tokens = prefill_skip_tokens(options.prefill_skip_tokens, scheduler_decides=False)
    applies = isinstance(state.path, ScoreTopKFastPath) and state.all_reduce is None
    state.select_in_draft = applies and select_in_draft(options, runner)
    if options.select_in_draft and not applies:
        logger.info("vegas: vllm.select_in_draft ignored: it serves the score-based top-k selectors (collect2, "
                    "aggregated, last_token) on one GPU; selector %r%s", selector.name,
                    " with tensor parallelism" if state.all_reduce is not None else "")


def select_in_draft(options, runner: str = "v2") -> bool:
    """``VegasConfig.vllm.select_in_draft`` resolved: an explicit true or false as given; ``None``
    (the default) on for the V2 runner (where it was measured: 2026-12-02, session 12) unless
    ``score_overlap``, ``score_path="cute"`` or the FA3 score extension (``_vegas_fa3_C``)
    replaces the same score pass; off on the V1 runner until a GPU run shows it there."""
    if options.select_in_draft is not None:
        return options.select_in_draft
    if runner != "v2" or options.score_overlap or options.score_path == "cute":
        return False
    from ...kernels import fa3_scores

    return not fa3_scores.available()


def reserve_selection_buffers(state: SelectionState, vllm_config, selector: Selector, gamma: int, max_seqs: int,
                              device) -> None:
    """``state``'s selection buffers at their largest, before vLLM captures CUDA graphs; with
    ``vllm.score_path="cute"`` also the CuTe probe kernels of the model's shape, compiled
    (:meth:`~vegas.vllm_plugin.selection.cute_verify.CuteProbeVerify.warm`)."""
    from ..selectors.plan import budget_cap

    model_config, parallel = vllm_config.model_config, vllm_config.parallel_config
    q_heads, head_dim = model_config.get_num_attention_heads(parallel), model_config.get_head_size()
    q_elems = (gamma + 1) * q_heads * head_dim
    k_cap = budget_cap(selector, model_config.max_model_len)
    state.reserve(max_seqs, k_cap, q_elems, model_config.dtype, device)
    if selector.config.vllm.score_path == "cute" and getattr(state.path, "uses_fa3_scores", False):
        from ..selection.cute_verify import CuteProbeVerify

        verify = state.score_verify()
        if isinstance(verify, CuteProbeVerify):
            verify.warm(state, q_heads, model_config.get_num_kv_heads(parallel), head_dim, model_config.dtype,
                        vllm_config.cache_config.block_size, device)
