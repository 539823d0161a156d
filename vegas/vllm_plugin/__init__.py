"""Vegas for stock vLLM 0.24 (V1 GPU model runner, FlashAttention-3 backend).

Switch it on in any vLLM program, no code changes beyond the engine arguments::

    from vllm import LLM
    llm = LLM(
        model=...,
        speculative_config={"method": "custom_class",
                            "model": "vegas.vllm_plugin.proposer.VegasProposer",
                            "num_speculative_tokens": 4},
        attention_backend="FLASH_ATTN",
    )

or ``vllm serve MODEL --attention-backend FLASH_ATTN --speculative-config '{"method":
"custom_class", "model": "vegas.vllm_plugin.proposer.VegasProposer", "num_speculative_tokens": 4}'``,
with the selector in ``VEGAS_VLLM_CONFIG='{"selector": "collect2", "sparsity_ratio": 0.05}'``.
Vegas runs on vLLM's V1 model runner, which vLLM picks by itself for a custom proposer
(setting ``VLLM_USE_V2_MODEL_RUNNER=0`` is harmless, not needed).

On one GPU vLLM's asynchronous scheduling stays on (the host prepares step N+1 while the GPU
drafts and verifies step N; :mod:`vegas.vllm_plugin.async_sched`); ``async_scheduling=False``
(``vllm serve --no-async-scheduling``) runs synchronously. With tensor parallelism it is on only
when asked for (``async_scheduling=True``, not yet run on GPUs). An executor without async
support (vLLM's ray executor, for instance) runs synchronously, with a warning in the log.

Verification keeps vLLM's full CUDA graphs, with the selection captured into them; set
``VEGAS_VERIFY_CUDA_GRAPHS=piecewise`` to change the selector at run time with :func:`configure`.

Tensor parallelism (``tensor_parallel_size > 1``): every rank holds a slice of each layer's
query and KV heads, so its scores are a partial head sum. By default the ranks all-reduce the
per-layer scores before the top-k (``tp_selection="all_reduce"``: one float32 collective of
``layers x batch x context`` per verification, inside the captured graphs) and select what one
GPU would; ``VEGAS_VLLM_CONFIG='{"tp_selection": "per_rank"}'`` selects from each rank's own
heads without communication. Install vegas (or its ``vllm.general_plugins`` entry point) in
the environment that runs vLLM: the engine-core process gets the scheduler patch from it.

Supported: one GPU or tensor parallelism (no pipeline parallelism), full-attention decoder models with
one KV-cache group on the FLASH_ATTN backend, bf16/fp16 KV cache; no LoRA, M-RoPE or
micro-batching (the proposer raises a ``ValueError`` naming the setting). Memory: each
verification allocates a float32 score scratch of ``layers x batch x max_model_len`` (under
full graphs at capture time), outside vLLM's memory profile; with a long ``max_model_len`` and
a large ``max_num_seqs`` leave headroom through ``gpu_memory_utilization``.

The proposer installs what it needs in the worker process that builds it (single-GPU engines:
the scheduler lives in that process too). For multi-process workers, installing vegas also
registers :func:`register` as a ``vllm.general_plugins`` entry point, which vLLM runs in every
process before the engine exists.

Nothing here imports vLLM at module import time.
"""

from __future__ import annotations

from .state import SELECTORS, VllmVegasConfig

__all__ = ["CLASS_PATH", "SELECTORS", "VllmVegasConfig", "configure", "get_stats", "register"]

CLASS_PATH = "vegas.vllm_plugin.proposer.VegasProposer"


def register() -> None:
    """``vllm.general_plugins`` entry point: install the attention override, the scheduler's
    lookahead allocation and the config check that keeps async scheduling on for the Vegas
    proposer. Safe to call many times, and a no-op for engines that do not use the Vegas
    proposer (the override only acts when it is enabled)."""
    from .async_sched import patch_config_check
    from .attention import install
    from .proposer import patch_scheduler_lookahead

    install()
    patch_scheduler_lookahead()
    patch_config_check()
    # V2 model runner (opt-in, vegas/vllm_plugin/v2_patch.py): lets the Vegas speculator through
    from .v2_patch import install as install_v2

    install_v2()


def _drafter(worker):
    runner = getattr(worker, "model_runner", worker)
    return getattr(runner, "drafter", None)


def configure(worker, config_json: str | None = None, reset_stats: bool = True) -> str:
    """``LLM.collective_rpc(configure, args=(json,))``: change the selector/budget at run time.

    Returns the config now in force, as JSON.

    Raises:
        ValueError: if the config changes while the engine runs verification in full CUDA
            graphs (``VEGAS_VERIFY_CUDA_GRAPHS=full``, the default), which hold the selection.
    """
    from .state import STATE

    if config_json:
        config = VllmVegasConfig.from_json(config_json, source="configure()")
        if STATE.frozen and config != STATE.config:
            raise ValueError(
                "vegas: this engine captured the selection into full CUDA graphs, so the selector "
                "and budget are fixed; build a new engine, or set VEGAS_VERIFY_CUDA_GRAPHS=piecewise "
                f"to change them at run time (in force: {STATE.config.to_json()})"
            )
        STATE.config = config
    drafter = _drafter(worker)
    if reset_stats and drafter is not None and hasattr(drafter, "reset_stats"):
        drafter.reset_stats()
    return STATE.config.to_json()


def get_stats(worker, per_request: bool = False) -> dict:
    """``LLM.collective_rpc(get_stats)``: the proposer's counters (see ``ProposerStats``);
    with ``per_request``, also ``{"requests": {request_id: [iterations, drafted, accepted]}}``."""
    drafter = _drafter(worker)
    if drafter is None or not hasattr(drafter, "stats"):
        return {}
    from .state import STATE

    drafter._resolve_events(wait=True)
    out = drafter.stats.as_dict()
    out["full_cuda_graphs"] = STATE.frozen
    if per_request:
        out["requests"] = {k: list(v) for k, v in drafter.req_stats.items()}
    return out
