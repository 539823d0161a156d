#!/usr/bin/env python3
"""Smoke run of Vegas on vLLM 0.24's V2 model runner against plain vLLM, on one GPU.

Builds one plain engine (vLLM's default runner for the model) and one Vegas engine forced onto
the V2 runner (``VLLM_USE_V2_MODEL_RUNNER=1``), decodes the same prompts greedily with both and
prints: greedy equality (token-identical count, first difference), acceptance length τ, and wall
ms per engine step (plain: one token per request per step; Vegas: one verification per step)::

    PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 python scripts/vllm_v2_smoke.py /tmp/smollm2-hf \
        --context 7680 --batch 32 --new-tokens 128

Prompts: windows of this package's source (:func:`vegas.prompts.package_source`), tokenized with
the model's tokenizer. Each engine prefills every prompt once first (prefix caching keeps it),
so the timed run is decode.
"""

from __future__ import annotations

import argparse
import os
import time


def _engine(model: str, gamma: int | None, args, settings: str | None = None):
    from vllm import LLM

    from vegas.backends.vllm import vllm_engine_kwargs

    return LLM(**vllm_engine_kwargs(
        model, num_draft_tokens=gamma, settings=settings, max_model_len=args.context + args.new_tokens + 64,
        gpu_memory_utilization=args.gpu_memory_utilization, seed=0, max_num_seqs=args.batch,
    ))


def _run(llm, prompts, new_tokens: int, before=None):
    """(outputs, decode wall seconds, what ``before()`` returned right before the timed run)."""
    from vllm import SamplingParams

    reqs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(reqs, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)  # prefill once
    mark = before() if before is not None else None
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    out = llm.generate(reqs, sp, use_tqdm=False)
    return out, time.perf_counter() - t0, mark


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="HF checkpoint directory")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--selector", default="collect2")
    ap.add_argument("--sparsity", type=float, default=0.05)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    from transformers import AutoTokenizer

    from vegas.prompts import cut_contexts, package_source
    from vegas.config import VegasConfig
    from vegas.vllm_plugin import register
    from vegas.vllm_plugin.settings import settings_json

    ids = AutoTokenizer.from_pretrained(args.model)(package_source(), add_special_tokens=False).input_ids
    prompts = cut_contexts(ids, args.context, args.batch)

    llm = _engine(args.model, None, args)
    plain_runner = "v2" if llm.llm_engine.vllm_config.use_v2_model_runner else "v1"
    plain, plain_s, _ = _run(llm, prompts, args.new_tokens)
    llm.llm_engine.engine_core.shutdown()
    del llm

    register()
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    settings = settings_json(args.selector, VegasConfig(sparsity_ratio=args.sparsity, min_kv_budget=0))
    llm = _engine(args.model, args.gamma, args, settings)
    vegas, vegas_s, s0 = _run(llm, prompts, args.new_tokens, lambda: llm.collective_rpc("vegas_stats")[0])
    s1 = llm.collective_rpc("vegas_stats")[0]
    llm.llm_engine.engine_core.shutdown()

    same = [list(p.outputs[0].token_ids) == list(v.outputs[0].token_ids) for p, v in zip(plain, vegas)]
    first = next((i for i, s in enumerate(same) if not s), None)
    if not s1:
        raise SystemExit(f"vegas did not run on the V2 runner (vegas_stats: {s1!r})")
    steps = max(s1["proposals"] - s0["proposals"], 1)  # engine steps of the timed run
    emitted, iterations = s1["emitted"] - s0["emitted"], s1["iterations"] - s0["iterations"]
    tau = emitted / iterations if iterations else 0.0
    print(f"[greedy] identical {sum(same)}/{len(same)}" + ("" if first is None else f" (first differing prompt {first})"))
    print(f"[tau] {tau:.3f} over {iterations} verified iterations; stats={s1}")
    print(f"[plain {plain_runner}] {plain_s * 1e3:.1f} ms, {plain_s * 1e3 / args.new_tokens:.3f} ms/step")
    print(f"[vegas v2] {vegas_s * 1e3:.1f} ms, {vegas_s * 1e3 / steps:.3f} ms/step over {steps} proposals, "
          f"speedup {plain_s / vegas_s:.3f}x")


if __name__ == "__main__":
    main()
