#!/usr/bin/env python3
"""Where does a verification row's arithmetic differ from a decode step's? (issue 21, device only)

Under ``VLLM_BATCH_INVARIANT=1`` (vLLM 0.24.0) a request's logits should not depend on its batch
neighbours. Vegas verifies γ + 1 query rows of a request where plain decoding computes one; on
SmolLM2 (2026-12-03) greedy Vegas equalled greedy plain for collect2 and sliding_window but
aggregated and Quest took the other token of an exact bf16 tie (plain's top-2 logprob gap
0.0000) at one position: some verification row's logits differed from the decode step's in the
last bit. This script tests, bit for bit, each place the difference could come from:

- ``attention``: FA3 as vLLM calls it (paged KV, 16-token blocks, ``causal=True``,
  ``num_splits=1`` as under batch invariance, and 0 for comparison): the output of a decode
  row (query length 1: FA3 then runs its non-causal kernel for head_dim <= 64) against the same
  query at row r = 0..γ of a (γ + 1)-row verification chunk ending anywhere from r to γ rows
  after it, and against a decode row in a batch with a long prefill chunk (a mixed step);
  per shape (query heads, KV heads, head_dim): SmolLM2, the embedded model, Qwen3-8B, head_dim 256.
- ``linear``: the matmul vLLM's linear layers and LM head run under batch invariance
  (``UnquantizedLinearMethod`` / ``UnquantizedEmbeddingMethod`` -> ``linear_batch_invariant``,
  a persistent Triton kernel with fixed tiles): a row computed in a batch of B rows against the
  same row in B x (γ + 1) rows and in a mixed batch of 2,000 + B rows, for SmolLM2's projections
  and LM head; and, labelled as such, ``torch.nn.functional.linear`` (cuBLASLt without split-K
  workspace: direct ``torch.mm`` calls, not the engine's layers).
- ``engine`` (``--model``, optional): plain vLLM greedy decoding (``logprobs``) against the
  prefill of the same prompt + output (``prompt_logprobs``, which bypasses the prefix cache):
  vLLM's own decode-vs-prefill property on this bundle, from the second generated token on (the
  first comes from the prompt's own prefill step); where it holds, a query-length dependence in
  the forward is ruled out end to end.

Prints one line per case ("identical" or the count of differing elements and the largest
difference) and writes ``--json``::

    VLLM_BATCH_INVARIANT=1 PYTHONPATH=/tmp/site:$PWD python3 scripts/invariance_probe.py \\
        --model /tmp/smollm2-hf --json $OUT/invariance_probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")

BLOCK = 16  # vLLM's default KV block size on CUDA
SHAPES = {"smollm2": (9, 3, 64), "tiny": (6, 2, 64), "qwen3-8b": (32, 8, 128), "hd256": (8, 4, 256)}


def compare(a, b) -> dict:
    """Bitwise comparison of two tensors of one shape: differing elements and the largest |a - b|."""
    a, b = a.contiguous(), b.contiguous()
    diff = (a.float() - b.float()).abs()
    n = int((a.view(-1).view(dtype_int(a)) != b.view(-1).view(dtype_int(b))).sum())
    return {"differ": n, "of": a.numel(), "max_abs": float(diff.max())}


def dtype_int(t):
    import torch

    return {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]


def attention_cases(gamma: int, splits: tuple[int, ...]) -> list[dict]:
    import torch
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    dev = torch.device("cuda")
    out = []
    for name, (hq, hkv, d) in SHAPES.items():
        g = torch.Generator(device=dev).manual_seed(0)
        lens = [3000 + 37 * i for i in range(4)]  # context of each request at its decode row
        per_req = (max(lens) + gamma + 2000) // BLOCK + 2  # blocks of each request's table (4 decoding + 1 prefill)
        blocks = 5 * per_req + 8
        k = torch.randn(blocks, BLOCK, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(blocks, BLOCK, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
        table = torch.randperm(blocks, device=dev, generator=g)[: 5 * per_req].view(5, per_req).to(torch.int32)
        q_at = torch.randn(5, max(lens) + gamma + 2000, hq, d, device=dev, dtype=torch.bfloat16, generator=g)
        scale = d ** -0.5

        def run(rows: list[tuple[int, int, int]], num_splits: int):
            """rows: (request, first position, query length); returns the output [tokens, hq, d]."""
            q = torch.cat([q_at[r, s:s + n] for r, s, n in rows])
            cu = torch.tensor([0] + [sum(n for _, _, n in rows[:i + 1]) for i in range(len(rows))],
                              dtype=torch.int32, device=dev)
            used = torch.tensor([s + n for _, s, n in rows], dtype=torch.int32, device=dev)
            o = torch.empty_like(q)
            flash_attn_varlen_func(q=q, k=k, v=v, out=o, cu_seqlens_q=cu, max_seqlen_q=max(n for *_, n in rows),
                                   seqused_k=used, max_seqlen_k=int(used.max()), softmax_scale=scale, causal=True,
                                   block_table=table[[r for r, _, _ in rows]], num_splits=num_splits, fa_version=3)
            return o

        for ns in splits:
            decode = run([(i, n - 1, 1) for i, n in enumerate(lens)], ns)  # one row per request
            for r in range(gamma + 1):  # the decode position is row r of the chunk
                ver = run([(i, n - 1 - r, gamma + 1) for i, n in enumerate(lens)], ns)
                rows = ver.view(len(lens), gamma + 1, hq, d)[:, r]
                out.append({"part": "attention", "shape": name, "num_splits": ns, "case": f"verify row {r}",
                            **compare(rows, decode)})
            mixed = run([(i, n - 1, 1) for i, n in enumerate(lens)] + [(4, 0, 2000)], ns)
            out.append({"part": "attention", "shape": name, "num_splits": ns, "case": "decode rows beside a prefill",
                        **compare(mixed[: len(lens)], decode)})
    return out


def linear_cases(gamma: int) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from vllm.model_executor.layers.batch_invariant import linear_batch_invariant

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    out = []
    # SmolLM2-135M: qkv (9 + 3 + 3) x 64, o, gate_up, down, LM head
    for name, (n_out, n_in) in {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                                "lm_head": (49152, 576)}.items():
        w = torch.randn(n_out, n_in, device=dev, dtype=torch.bfloat16, generator=g) * 0.05
        for b in (1, 4, 32, 128):
            x = torch.randn(b * (gamma + 1) + 2000, n_in, device=dev, dtype=torch.bfloat16, generator=g)
            for path, fn in (("engine matmul", linear_batch_invariant), ("cuBLASLt F.linear, not the engine's", F.linear)):
                ref = fn(x[:b], w)
                for label, m in ((f"{b} rows in {b * (gamma + 1)}", b * (gamma + 1)),
                                 (f"{b} rows in {b * (gamma + 1) + 2000} (mixed)", b * (gamma + 1) + 2000)):
                    out.append({"part": "linear", "shape": name, "case": f"{path}: {label}",
                                **compare(fn(x[:m], w)[:b], ref)})
    return out


def engine_cases(model: str, new_tokens: int) -> list[dict]:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vegas.backends.vllm import vllm_engine_kwargs
    from vegas.prompts import cut_contexts, package_source

    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # this process has initialised CUDA
    ids = AutoTokenizer.from_pretrained(model)(package_source(), add_special_tokens=False).input_ids
    prompts = cut_contexts(ids, 3000, 4)
    # the engine tests/gpu/test_vllm_batch_invariant.py builds for plain decoding
    llm = LLM(**vllm_engine_kwargs(model, max_model_len=3200, gpu_memory_utilization=0.3, seed=0, max_num_seqs=8))
    dec = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=1,
                                      detokenize=False), use_tqdm=False)
    full = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, dec)]
    pre = llm.generate([{"prompt_token_ids": f} for f in full],
                       SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False),
                       use_tqdm=False)
    out = []
    for i, (p, o, f) in enumerate(zip(prompts, dec, pre)):
        toks = o.outputs[0].token_ids
        differ, worst = 0, 0.0
        for j, t in enumerate(toks):
            if j == 0:  # sampled at the end of the prompt's own prefill: prefill against prefill
                continue
            a = o.outputs[0].logprobs[j][t].logprob
            b = f.prompt_logprobs[len(p) + j][t].logprob
            differ += a != b
            worst = max(worst, abs(a - b))
        out.append({"part": "engine", "shape": os.path.basename(model), "case": f"prompt {i}: decode vs prefill",
                    "differ": differ, "of": len(toks) - 1, "max_abs": worst})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gamma", type=int, default=4, help="draft tokens per iteration (γ): chunks of γ + 1 rows")
    ap.add_argument("--parts", default="attention,linear,engine", help="attention, linear, engine (comma-separated)")
    ap.add_argument("--model", default=None, help="checkpoint for the engine part (left out without it)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.gamma < 1:
        ap.error(f"--gamma must be >= 1, got {args.gamma}")
    if not 2 <= args.new_tokens <= 199:
        ap.error(f"--new-tokens must be in 2..199 (3,000-token prompts, max_model_len 3,200), got {args.new_tokens}")
    if os.environ.get("VLLM_BATCH_INVARIANT") != "1":
        ap.error(f"VLLM_BATCH_INVARIANT is {os.environ.get('VLLM_BATCH_INVARIANT')!r}: the probe needs 1 (unset it or set 1)")
    parts = args.parts.split(",")
    unknown = set(parts) - {"attention", "linear", "engine"}
    if unknown:
        ap.error(f"--parts: unknown {sorted(unknown)}; allowed: attention, linear, engine")
    import torch

    if not torch.cuda.is_available():
        print("invariance_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    from vllm.model_executor.layers.batch_invariant import init_batch_invariance

    init_batch_invariance()  # vLLM's own settings (cuBLAS workspace, overrides), as an engine applies them
    rows: list[dict] = []
    if "attention" in parts:
        rows += attention_cases(args.gamma, (1, 0))
    if "linear" in parts:
        rows += linear_cases(args.gamma)
    if "engine" in parts and args.model:
        rows += engine_cases(args.model, args.new_tokens)
    for r in rows:
        verdict = "identical" if r["differ"] == 0 else f"{r['differ']} of {r['of']} differ, max |diff| {r['max_abs']:.3g}"
        extra = f" num_splits={r['num_splits']}" if "num_splits" in r else ""
        print(f"[{r['part']}] {r['shape']}{extra} {r['case']}: {verdict}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
