#!/usr/bin/env python3
"""Where does a decode iteration's time go? Profiles one vLLM engine in-process (device only).

Runs the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), prefills the
prompts, warms up, then decodes ``--new-tokens`` tokens per request twice: once under
``cProfile`` (host Python: which functions cost time per step) and once under
``torch.profiler`` (CUDA kernels and vLLM's runner scopes). Prints both summaries::

    PYTHONPATH=/tmp/site:$PWD python scripts/vllm_profile.py --method vegas --selector collect2 \
        --batch 128 --ctx 16384 --new-tokens 64
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import vllm_bench as vb  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="vegas", choices=["plain", "vegas", "ngram"])
    ap.add_argument("--selector", default="collect2")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--rows", type=int, default=35)
    ap.add_argument("--verify-graphs", default="full", choices=["full", "piecewise"])
    ap.add_argument("--scheduling", default="async", choices=["async", "sync"], help="vLLM scheduling of vegas")
    args = ap.parse_args()
    ns = argparse.Namespace(
        model=str(vb.ROOT / "vegas" / "model"), load_format=None, batches=[args.batch], gpu_mem=0.5,
        eager=False, gamma=args.gamma, sparsity=0.05, min_kv_budget=256, kv_budget=0,
        verify_graphs=args.verify_graphs, tp=1, tp_selection="all_reduce", vegas_scheduling=args.scheduling,
    )
    import torch
    from vllm import SamplingParams

    prompts = vb.load_prompts(ns.model, args.batch, args.ctx, vb.ROOT / "benchmarks/data/heldout_code_dev.jsonl.xz")
    llm = vb.build_llm(args.method, ns, args.ctx + args.new_tokens + 64, vb.vegas_settings(ns, args.selector))
    vb.generate(llm, prompts, SamplingParams(max_tokens=1, detokenize=False))
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.new_tokens, ignore_eos=True, detokenize=False)
    vb.generate(llm, prompts, sp)  # warm-up (graphs, Triton JIT)
    torch.cuda.synchronize()
    t = time.time()
    outs = vb.generate(llm, prompts, sp)
    wall = time.time() - t
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"[plain wall] {args.method} {args.selector} b{args.batch} ctx{args.ctx}: {ntok} tokens in {wall*1e3:.0f} ms "
          f"-> {ntok / wall:.0f} tok/s", flush=True)

    prof = cProfile.Profile()
    prof.enable()
    vb.generate(llm, prompts, sp)
    prof.disable()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(args.rows)
    st.sort_stats("cumulative").print_stats(args.rows + 15)
    print(s.getvalue(), flush=True)

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        vb.generate(llm, prompts, sp)
    ka = tp.key_averages()
    print(ka.table(sort_by="self_cuda_time_total", row_limit=args.rows), flush=True)
    print(ka.table(sort_by="cpu_time_total", row_limit=args.rows), flush=True)
    vb.shutdown(llm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
