#!/usr/bin/env python3
"""Plain decode speed of FlashAttention's CuTe-DSL sm90 kernel against FA3 on vLLM's paged cache (issue 22; H200).

The alternative to patching FA3's C++ (csrc/README.md): vLLM 0.24 ships FlashAttention's CuTe-DSL
forward (``vllm.vllm_flash_attn.cute``, ``flash_fwd_sm90.py``: paged KV through cp.async for
page size 16, PackGQA, split-KV with a combine kernel), reachable as
``flash_attn_varlen_func(..., fa_version=4)``. A score write there would be a Python edit (JIT,
no nvcc), but only if its decode is as fast as FA3's. This measures that, per step of a model
(every layer once, two cache allocations alternating so that no layer hits L2):

- ``fa3``: vLLM's FA3 (``fa_version=3``, FA3's own split heuristic), as verification runs today;
- ``cute``: the CuTe-DSL kernel with its split heuristic (``num_splits=0``);
- ``cute/sN``: the CuTe-DSL kernel with N splits (``--splits``), to see whether only the heuristic lags.

For query lengths 1 (plain decode) and γ + 1 = 5 (verification), SmolLM2 (30 L, 9 q / 3 kv x 64) and
Qwen3-8B (36 L, 32 q / 8 kv x 128) at 32K and 128K, batch 1 and 4. It also prints the first call's
time of each CuTe configuration (the JIT compile) and the largest output difference to FA3.

Needs ``nvidia-cutlass-dsl[cu13]==4.5.2`` and ``quack-kernels>=0.3.3`` (vLLM 0.24.0's pins; the
wheels are not in the device bundle of shared/device: ``scripts/cute_dsl_bundle.sh`` makes
carry-able parts of them, see csrc/README.md).

    python scripts/cute_decode_bench.py                      # everything (~4 device minutes)
    python scripts/cute_decode_bench.py --case qwen3-8b --ctx 131072 --batch 4 --qlen 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from vegas.kernels.device_timer import interleaved  # noqa: E402

PEAK = 4.3e12
BLOCK_SIZE = 16
#: name -> (layers, q heads, kv heads, head_dim)
MODELS = {"smollm2": (30, 9, 3, 64), "qwen3-8b": (36, 32, 8, 128)}


def make_batch(layers, hq, hkv, d, seqs, ctx, qlen, device="cuda"):
    """Two paged cache allocations (layers alternate), a shuffled block table, ``qlen`` queries
    per request after ``ctx`` cached tokens (vLLM's varlen decode/verification call)."""
    per_seq = -(-(ctx + qlen) // BLOCK_SIZE)
    nb = seqs * per_seq + 1
    caches = [torch.randn(nb, 2, BLOCK_SIZE, hkv, d, device=device, dtype=torch.bfloat16) for _ in range(2)]
    kv = [caches[i % 2].unbind(1) for i in range(layers)]
    bt = torch.randperm(nb - 1, device=device)[: seqs * per_seq].view(seqs, per_seq).to(torch.int32)
    cu = torch.arange(seqs + 1, device=device, dtype=torch.int32) * qlen
    seq_lens = torch.full((seqs,), ctx + qlen, device=device, dtype=torch.int32)
    q = torch.randn(seqs * qlen, hq, d, device=device, dtype=torch.bfloat16)
    return dict(kv=kv, bt=bt, cu=cu, seq_lens=seq_lens, q=q, qlen=qlen, max_len=ctx + qlen, scale=d**-0.5)


def attention(b, layer, out, fa_version, num_splits):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    k, v = b["kv"][layer]
    flash_attn_varlen_func(q=b["q"], k=k, v=v, out=out, cu_seqlens_q=b["cu"], max_seqlen_q=b["qlen"],
                           seqused_k=b["seq_lens"], max_seqlen_k=b["max_len"], softmax_scale=b["scale"],
                           causal=True, block_table=b["bt"], fa_version=fa_version, num_splits=num_splits)



def run_case(model, ctx, seqs, qlen, args):
    layers, hq, hkv, d = MODELS[model]
    torch.manual_seed(0)
    b = make_batch(layers, hq, hkv, d, seqs, ctx, qlen)
    out_fa3, out_cute = torch.empty_like(b["q"]), torch.empty_like(b["q"])
    attention(b, 0, out_fa3, 3, 0)
    variants = {"fa3": (3, 0), "cute": (4, 0)}
    variants.update({f"cute/s{s}": (4, s) for s in args.splits})
    first = {}
    for name, (ver, ns) in variants.items():
        if ver != 4:
            continue
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            attention(b, 0, out_cute, ver, ns)
            torch.cuda.synchronize()
        except Exception as e:  # an unsupported configuration: report and drop it
            print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            first[name] = None
            continue
        first[name] = time.perf_counter() - t0
        diff = (out_cute.float() - out_fa3.float()).abs().max().item()
        print(f"  {name}: first call {first[name]:.1f} s, max |cute - fa3| = {diff:.2e}", flush=True)
    variants = {n: v for n, v in variants.items() if first.get(n, 0) is not None}

    def step(ver, ns):
        def fn():
            for layer in range(layers):
                attention(b, layer, out_cute, ver, ns)
        return fn

    res = interleaved({n: step(*v) for n, v in variants.items()}, args.reps, args.iters)
    med = {n: statistics.median(v) for n, v in res.items()}
    kv_bytes = layers * seqs * (ctx + qlen) * hkv * d * 2 * 2
    title = f"{model} {layers}L {hq}q/{hkv}kv x {d}, ctx {ctx}, batch {seqs}, qlen {qlen}"
    print(f"== {title}: K+V {kv_bytes / 1e9:.2f} GB per step, floor {kv_bytes / PEAK * 1e3:.3f} ms")
    print(f"  {'variant':<10}{'ms/step':>10}{'min-max':>20}{'x fa3':>8}{'TB/s':>8}")
    rows = []
    for n, v in res.items():
        print(f"  {n:<10}{med[n]:10.3f}{f'{min(v):.3f}-{max(v):.3f}':>20}{med[n] / med['fa3']:8.3f}"
              f"{kv_bytes / med[n] / 1e9:8.2f}", flush=True)
        rows.append(dict(case=title, model=model, ctx=ctx, batch=seqs, qlen=qlen, variant=n, ms=med[n],
                         ms_all=v, x_fa3=med[n] / med["fa3"], tbps=kv_bytes / med[n] / 1e9,
                         first_call_s=first.get(n)))
    b.clear()  # free the caches before the next case (the timing closures hold the dict)
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", action="append", choices=list(MODELS), help="default: both")
    ap.add_argument("--ctx", type=int, action="append", help="default: 32768 and 131072")
    ap.add_argument("--batch", type=int, action="append", help="default: 1 and 4")
    ap.add_argument("--qlen", type=int, action="append", help="default: 1 (decode) and 5 (verification, γ = 4)")
    ap.add_argument("--splits", type=int, nargs="*", default=[8, 32], help="fixed split counts tried besides the heuristic")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", help="write every row here")
    args = ap.parse_args()
    from vllm.vllm_flash_attn.flash_attn_interface import fa_version_unsupported_reason, is_fa_version_supported

    for ver in (3, 4):
        if not is_fa_version_supported(ver):
            print(f"FA{ver} unsupported here: {fa_version_unsupported_reason(ver)}")
            return 1
    try:
        import cutlass  # noqa: F401
        import quack  # noqa: F401
    except ImportError as e:
        print(f"the CuTe-DSL kernel needs nvidia-cutlass-dsl and quack-kernels: {e}")
        return 1
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, cutlass-dsl {getattr(cutlass, '__version__', '?')}")
    rows = []
    for model in args.case or list(MODELS):
        for ctx in args.ctx or [32768, 131072]:
            for seqs in args.batch or [1, 4]:
                for qlen in args.qlen or [1, 5]:
                    rows += run_case(model, ctx, seqs, qlen, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
