#!/usr/bin/env python3
"""Times verification attention with and without selection scoring (issue 14; CUDA + vLLM).

Per verification step (every layer of the model, γ + 1 = 5 queries per request, bf16, block
size 16, contexts padded to two alternating cache allocations so that no layer hits L2):

- ``fa3``: vLLM's FA3 (``flash_attn_varlen_func``) per layer, what verification costs alone;
- ``fa3+score``: FA3 per layer, the collect-query gather per layer and today's separate
  all-layers Triton score kernel (:mod:`vegas.kernels.triton_score`), as the vLLM backend runs;
- ``fused``: :func:`vegas.kernels.triton_fused_verify.fused_verify_attention` per layer, scores
  into row ``l`` of the ``(L, num_seqs, max_len)`` buffer (best tuning of a short sweep, and the
  default heuristic as ``fused(default)``);
- ``fused-noscore``: the same kernel without scores (Triton attention against FA3);
- ``topk``: :func:`vegas.kernels.select_topk_layers` over that buffer (budget 5 %, recent 64),
  the rest of the selection, the same for both scoring paths.

Each variant: CUDA events around ``--iters`` steps, ``--reps`` interleaved repeats; the table
gives the median (min-max) ms per step, the ratio to ``fa3``, the K+V bandwidth, and the floor:
K+V bytes read / 4.3 TB/s (H200 HBM3e). Selection overhead = ``fused - fa3 + topk`` (fused) or
``fa3+score - fa3 + topk`` (today); compare it with the decode step time of scripts/vllm_bench.py.

    python scripts/fused_verify_bench.py                  # every case
    python scripts/fused_verify_bench.py --case tiny --no-sweep
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fused_cases import plan_rows, rel_err  # noqa: E402
from vegas.kernels import select_topk_layers  # noqa: E402
from vegas.kernels.triton_fused_verify import choose_num_splits, fused_verify_attention  # noqa: E402
from vegas.kernels.triton_score import collect_scores_layers_triton, layer_offsets  # noqa: E402

PEAK = 4.3e12
GAMMA = 4
#: name -> (layers, q heads, kv heads, head_dim, batch, context)
CASES = {
    "tiny": ("vegas-tiny-code 8L 6q/2kv x 64, 16K, batch 128", 8, 6, 2, 64, 128, 16384),
    "smollm2": ("SmolLM2 30L 9q/3kv x 64, 128K, batch 4", 30, 9, 3, 64, 4, 131072),
    "qwen3-8b": ("Qwen3-8B 36L 32q/8kv x 128, 128K, batch 4", 36, 32, 8, 128, 4, 131072),
    "smollm2-b128": ("SmolLM2 30L 9q/3kv x 64, 7.5K, batch 128", 30, 9, 3, 64, 128, 7680),
}
#: (block_n, num_warps, num_stages) tried by the sweep, with every num_splits that fits
TUNINGS = [(64, 4, 2), (64, 4, 3), (32, 4, 3), (64, 8, 3), (128, 8, 2)]


def batch(layers, hq, hkv, d, seqs, ctx, block_size=16):
    """Two cache allocations (layers alternate between them), a shuffled block table, γ + 1
    queries per request after ``ctx`` cached tokens, and the collect2 plan."""
    qlen = GAMMA + 1
    per_seq = triton.cdiv(ctx + qlen, block_size)
    nb = seqs * per_seq + 1
    caches = [torch.randn(nb, 2, block_size, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    kv = [caches[l % 2].unbind(1) for l in range(layers)]
    bt = torch.randperm(nb - 1, device="cuda")[: seqs * per_seq].view(seqs, per_seq).to(torch.int32)
    cu = torch.arange(seqs + 1, device="cuda", dtype=torch.int32) * qlen
    seq_lens = torch.full((seqs,), ctx + qlen, device="cuda", dtype=torch.int32)
    q = torch.randn(seqs * qlen, hq, d, device="cuda", dtype=torch.bfloat16)
    q_idx, q_weight, ctx_sel = plan_rows(cu, seq_lens, GAMMA, "collect2")
    return dict(kv=kv, bt=bt, cu=cu, seq_lens=seq_lens, q=q, q_idx=q_idx, q_weight=q_weight, ctx_sel=ctx_sel,
                max_len=ctx + qlen, scale=d**-0.5, qlen=qlen)


def fa3_layer(b, l, out):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    k, v = b["kv"][l]
    flash_attn_varlen_func(q=b["q"], k=k, v=v, out=out, cu_seqlens_q=b["cu"], max_seqlen_q=b["qlen"],
                           seqused_k=b["seq_lens"], max_seqlen_k=b["max_len"], softmax_scale=b["scale"],
                           causal=True, block_table=b["bt"], fa_version=3)


def fused_layer(b, l, out, scores, **tune):
    k, v = b["kv"][l]
    kw = {}
    if scores is not None:
        kw = dict(scores=scores[l], q_idx=b["q_idx"], q_weight=b["q_weight"], ctx_sel=b["ctx_sel"],
                  score_span=b["qlen"])
    fused_verify_attention(b["q"], k, v, b["bt"], b["cu"], b["seq_lens"], b["qlen"], b["scale"], out=out, **kw,
                           **tune)


def interleaved(fns, reps, iters):
    """``{name: [ms per step of each repeat]}``, the variants taking turns in every repeat."""
    res = {n: [] for n in fns}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    for _ in range(reps):
        for name, fn in fns.items():
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(iters):
                fn()
            e1.record()
            torch.cuda.synchronize()
            res[name].append(e0.elapsed_time(e1) / iters)
    return res


def sweep(b, layers, out, scores):
    """Best ``(num_splits, block_n, num_warps, num_stages)`` of the fused kernel (one layer's
    median of ``triton.testing.do_bench``), and each tried configuration's time."""
    seqs, hkv = b["bt"].shape[0], b["kv"][0][0].shape[2]
    splits = [s for s in (1, 2, 4, 8, 16, 32, 64) if s == 1 or b["max_len"] // s >= 512]
    times = {}
    for ns in splits:
        for bn, nw, st in TUNINGS:
            tune = dict(num_splits=ns, block_n=bn, num_warps=nw, num_stages=st)
            try:
                times[(ns, bn, nw, st)] = triton.testing.do_bench(
                    lambda: fused_layer(b, 0, out, scores, **tune), return_mode="median")
            except Exception as e:  # e.g. out of shared memory for a tile
                print(f"  skip {tune}: {type(e).__name__}: {str(e)[:80]}")
    best = min(times, key=times.get)
    return best, times


def run_case(key, args):
    name, layers, hq, hkv, d, seqs, ctx = CASES[key]
    torch.manual_seed(0)
    b = batch(layers, hq, hkv, d, seqs, ctx)
    out = torch.empty_like(b["q"])
    out_fa = torch.empty_like(b["q"])
    scores = torch.empty(layers, seqs, b["max_len"], device="cuda")
    k_max = max(256, -(-b["max_len"] * 5 // 100))
    budgets = torch.full((seqs,), k_max, dtype=torch.int64, device="cuda")
    recent = torch.full((seqs,), 64, dtype=torch.int64, device="cuda")
    kcs = [k for k, _ in b["kv"]]
    koffs = layer_offsets(kcs)
    nrow = b["q_idx"].shape[1]
    qbuf = torch.empty(layers, seqs * nrow, hq, d, device="cuda", dtype=torch.bfloat16)
    default_splits = choose_num_splits(seqs * hkv, b["max_len"], torch.cuda.get_device_properties(0).multi_processor_count)

    # correctness at this shape: fused vs FA3 (output), fused vs separate kernel (scores)
    fa3_layer(b, 0, out_fa)
    fused_layer(b, 0, out, scores)
    rows = b["q"][b["q_idx"].reshape(-1)].view(1, seqs, nrow, hq, d)
    sep = collect_scores_layers_triton(rows, b["q_weight"], kcs[:1], b["bt"], b["ctx_sel"], b["max_len"], b["scale"])
    fin = torch.isfinite(sep[0])
    print(f"\n== {name}: fused vs FA3 output rel err {rel_err(out, out_fa):.2e}; fused vs separate scores rel err "
          f"{rel_err(scores[0][fin], sep[0][fin]):.2e}, -inf pattern equal: "
          f"{torch.equal(torch.isfinite(scores[0]), fin)}", flush=True)

    tune = dict(num_splits=default_splits)
    if not args.no_sweep:
        best, times = sweep(b, layers, out, scores)
        top = sorted(times.items(), key=lambda kv: kv[1])[:5]
        print("  sweep (num_splits, block_n, warps, stages) -> ms per layer, best 5: "
              + "; ".join(f"{k}: {v:.3f}" for k, v in top) + f"  [default num_splits {default_splits}]")
        tune = dict(zip(("num_splits", "block_n", "num_warps", "num_stages"), best))

    def fa3():
        for l in range(layers):
            fa3_layer(b, l, out_fa)

    def fa3_score():
        for l in range(layers):
            fa3_layer(b, l, out_fa)
            torch.index_select(b["q"], 0, b["q_idx"].reshape(-1), out=qbuf[l])
        collect_scores_layers_triton(qbuf.view(layers, seqs, nrow, hq, d), b["q_weight"], kcs, b["bt"],
                                     b["ctx_sel"], b["max_len"], b["scale"], key_offsets=koffs)

    def fused():
        for l in range(layers):
            fused_layer(b, l, out, scores, **tune)

    def fused_default():
        for l in range(layers):
            fused_layer(b, l, out, scores, num_splits=default_splits)

    def fused_noscore():
        for l in range(layers):
            fused_layer(b, l, out, None, **tune)

    def topk():
        select_topk_layers(scores, budgets, k_max, b["bt"], 16, recent, b["ctx_sel"])

    fns = {"fa3": fa3, "fa3+score": fa3_score, "fused": fused, "fused(default)": fused_default,
           "fused-noscore": fused_noscore, "topk": topk}
    res = interleaved(fns, args.reps, args.iters)
    kv_bytes = layers * seqs * (ctx + b["qlen"]) * hkv * d * 2 * 2
    floor = kv_bytes / PEAK * 1e3
    med = {n: statistics.median(v) for n, v in res.items()}
    print(f"  tuning {tune}; K+V {kv_bytes / 1e9:.2f} GB per step, floor at 4.3 TB/s {floor:.3f} ms")
    print(f"  {'variant':<16}{'ms/step':>10}{'min-max':>20}{'x fa3':>8}{'TB/s':>8}")
    for n, v in res.items():
        bw = "" if n == "topk" else f"{kv_bytes / med[n] / 1e9:8.2f}"
        print(f"  {n:<16}{med[n]:10.3f}{f'{min(v):.3f}-{max(v):.3f}':>20}{med[n] / med['fa3']:8.3f}{bw}")
    today = med["fa3+score"] - med["fa3"] + med["topk"]
    fused_sel = med["fused"] - med["fa3"] + med["topk"]
    print(f"  selection overhead per step: today {today:.3f} ms, fused {fused_sel:.3f} ms "
          f"(fused/fa3 = {med['fused'] / med['fa3']:.3f}; target <= 1.1)", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", action="append", choices=list(CASES), help="default: all")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-sweep", action="store_true", help="use the default num_splits heuristic only")
    args = ap.parse_args()
    for key in args.case or list(CASES):
        run_case(key, args)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
