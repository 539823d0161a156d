#!/usr/bin/env python3
"""Times verification attention with and without selection scoring (issues 14 and 22; CUDA + vLLM).

Per verification step (every layer of the model, γ + 1 = 5 queries per request, bf16, block
size 16, contexts padded to two alternating cache allocations so that no layer hits L2):

- ``fa3``: vLLM's FA3 (``flash_attn_varlen_func``) per layer, what verification costs alone;
- ``fa3+score``: FA3 per layer, the collect-query gather per layer and today's separate
  all-layers Triton score kernel (:mod:`vegas.kernels.triton_score`), as the vLLM backend runs;
- ``fa3s``: FA3 with the score output (the optional ``_vegas_fa3_C`` extension, issue 22,
  :mod:`vegas.kernels.fa3_scores`) per layer, its per-KV-head partial summed into row ``l`` of the
  ``(L, num_seqs, max_len)`` buffer
  (:func:`vegas.kernels.triton_score_reduce.reduce_head_scores`), the path the vLLM backend takes
  when the extension loads; ``fa3s-noscore``: the extension without scores (its FA3 against
  vLLM's). Skipped, with the reason, when the extension is absent (``VEGAS_FA3_EXT``).
- ``topk``: :func:`vegas.kernels.select_topk_layers` over that buffer (budget 5 %, recent 64),
  the rest of the selection, the same for both scoring paths.

The Triton fused verification kernel (issue 14: attention and scores in one Triton kernel) was
timed here too (variants ``fused``, ``fused-noscore``): 2.30x FA3 for SmolLM2 and 1.58x for
Qwen3-8B at 128K on the H200 (2026-12-01), against 1.31x / 1.435x for ``fa3+score``; it was
removed and is at commit 919ef0f (csrc/README.md).

With the extension the correctness line also says whether its output is bitwise FA3's, its
scores' relative error against the separate kernel and whether the top-k selections are equal.

Each variant: CUDA events around ``--iters`` steps, ``--reps`` interleaved repeats; the table
gives the median (min-max) ms per step, the ratio to ``fa3``, the K+V bandwidth, and the floor:
K+V bytes read / 4.3 TB/s (H200 HBM3e). Selection overhead = ``fa3s - fa3 + topk`` (extension) or
``fa3+score - fa3 + topk`` (today); compare it with the decode step time of ``vegas bench --backend vllm``.

    python scripts/fused_verify_bench.py                  # every case
    python scripts/fused_verify_bench.py --case tiny
    VEGAS_FA3_EXT=/tmp/vfa3/_vegas_fa3_C.so python scripts/fused_verify_bench.py --case qwen3-8b --case smollm2 \
        --ctx 32768 --ctx 131072 --batch 1 --batch 4      # issue 22's table
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.verify_cases import plan_rows, rel_err  # noqa: E402
from vegas.kernels import fa3_scores, select_topk_layers  # noqa: E402
from vegas.kernels.device_timer import interleaved  # noqa: E402
from vegas.kernels.triton_score import collect_scores_layers_triton, layer_offsets  # noqa: E402
from vegas.kernels.triton_score_reduce import reduce_head_scores  # noqa: E402

PEAK = 4.3e12
GAMMA = 4
#: name -> (layers, q heads, kv heads, head_dim, batch, context)
CASES = {
    "tiny": ("vegas-tiny-code 8L 6q/2kv x 64, 16K, batch 128", 8, 6, 2, 64, 128, 16384),
    "smollm2": ("SmolLM2 30L 9q/3kv x 64, 128K, batch 4", 30, 9, 3, 64, 4, 131072),
    "qwen3-8b": ("Qwen3-8B 36L 32q/8kv x 128, 128K, batch 4", 36, 32, 8, 128, 4, 131072),
    "smollm2-b128": ("SmolLM2 30L 9q/3kv x 64, 7.5K, batch 128", 30, 9, 3, 64, 128, 7680),
}


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


def fa3s_layer(b, l, out, ws=None, rows=None, ctx32=None, scores=None):
    """The extension's FA3 (with ``ws``: and its scores, reduced into ``scores[l]``)."""
    k, v = b["kv"][l]
    fa3_scores.fa3_verify_attention(b["q"], k, v, b["bt"], b["cu"], b["seq_lens"], b["qlen"], b["max_len"], b["scale"],
                                    out=out, workspace=ws, score_rows=rows, score_ctx=ctx32)
    if ws is not None:
        reduce_head_scores(ws, scores[l], b["cu"], b["ctx_sel"])


def run_case(key, args, seqs=None, ctx=None):
    name, layers, hq, hkv, d, seqs0, ctx0 = CASES[key]
    seqs, ctx = seqs or seqs0, ctx or ctx0
    name = f"{name.split(',')[0]}, {ctx // 1024}K, batch {seqs}"
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

    # correctness at this shape: the extension vs FA3 (output), vs the separate kernel (scores)
    fa3_layer(b, 0, out_fa)
    rows = b["q"][b["q_idx"].reshape(-1)].view(1, seqs, nrow, hq, d)
    sep = collect_scores_layers_triton(rows, b["q_weight"], kcs[:1], b["bt"], b["ctx_sel"], b["max_len"], b["scale"])
    fin = torch.isfinite(sep[0])
    print(f"\n== {name}", flush=True)
    ext = fa3_scores.unavailable_reason() or fa3_scores.unsupported_reason(hq, hkv, d, torch.bfloat16, b["qlen"])
    if ext is None:
        ws = torch.empty(hkv, seqs, b["max_len"], device="cuda")
        srows = fa3_scores.score_rows_in_chunk(b["q_idx"], b["q_weight"], b["cu"])
        ctx32 = b["ctx_sel"].to(torch.int32)
        out_x = torch.empty_like(b["q"])
        fa3s_layer(b, 0, out_x)
        plain_equal = torch.equal(out_x, out_fa)
        out_x.zero_()
        fa3s_layer(b, 0, out_x, ws, srows, ctx32, scores)
        topk_sep = select_topk_layers(sep.clone(), budgets, k_max, b["bt"], 16, recent, b["ctx_sel"])
        topk_x = select_topk_layers(scores[:1].clone(), budgets, k_max, b["bt"], 16, recent, b["ctx_sel"])
        print(f"  fa3s: output bitwise FA3's: {torch.equal(out_x, out_fa)} (without scores: {plain_equal}); scores vs "
              f"separate rel err {rel_err(scores[0][fin], sep[0][fin]):.2e}, max abs "
              f"{(scores[0][fin] - sep[0][fin]).abs().max().item():.2e}, -inf pattern equal: "
              f"{torch.equal(torch.isfinite(scores[0]), fin)}; top-k equal: {torch.equal(topk_x, topk_sep)} "
              f"(same slot sets: {torch.equal(topk_x.sort(-1).values, topk_sep.sort(-1).values)})", flush=True)
    else:
        print(f"  fa3s skipped: {ext}")

    def fa3():
        for l in range(layers):
            fa3_layer(b, l, out_fa)

    def fa3_score():
        for l in range(layers):
            fa3_layer(b, l, out_fa)
            torch.index_select(b["q"], 0, b["q_idx"].reshape(-1), out=qbuf[l])
        collect_scores_layers_triton(qbuf.view(layers, seqs, nrow, hq, d), b["q_weight"], kcs, b["bt"],
                                     b["ctx_sel"], b["max_len"], b["scale"], key_offsets=koffs)

    def topk():
        select_topk_layers(scores, budgets, k_max, b["bt"], 16, recent, b["ctx_sel"])

    fns = {"fa3": fa3, "fa3+score": fa3_score}
    if ext is None:
        def fa3s():
            for l in range(layers):
                fa3s_layer(b, l, out, ws, srows, ctx32, scores)

        def fa3s_noscore():
            for l in range(layers):
                fa3s_layer(b, l, out)

        fns.update({"fa3s": fa3s, "fa3s-noscore": fa3s_noscore})
    fns["topk"] = topk
    res = interleaved(fns, args.reps, args.iters)
    kv_bytes = layers * seqs * (ctx + b["qlen"]) * hkv * d * 2 * 2
    floor = kv_bytes / PEAK * 1e3
    med = {n: statistics.median(v) for n, v in res.items()}
    print(f"  K+V {kv_bytes / 1e9:.2f} GB per step, floor at 4.3 TB/s {floor:.3f} ms")
    print(f"  {'variant':<16}{'ms/step':>10}{'min-max':>20}{'x fa3':>8}{'TB/s':>8}")
    for n, v in res.items():
        bw = "" if n == "topk" else f"{kv_bytes / med[n] / 1e9:8.2f}"
        print(f"  {n:<16}{med[n]:10.3f}{f'{min(v):.3f}-{max(v):.3f}':>20}{med[n] / med['fa3']:8.3f}{bw}")
    today = med["fa3+score"] - med["fa3"] + med["topk"]
    line = f"  selection overhead per step: today {today:.3f} ms"
    if "fa3s" in med:
        line += f", fa3s {med['fa3s'] - med['fa3'] + med['topk']:.3f} ms (fa3s/fa3 = {med['fa3s'] / med['fa3']:.3f})"
    print(line + "; targets: fa3s/fa3 <= 1.1 at head_dim 128, <= 1.3 at 64", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", action="append", choices=list(CASES), help="default: all")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--ctx", type=int, action="append", help="contexts instead of each case's own")
    ap.add_argument("--batch", type=int, action="append", help="batch sizes instead of each case's own")
    args = ap.parse_args()
    print(f"FA3 score extension: {fa3_scores.unavailable_reason() or 'loaded'}", flush=True)
    for key in args.case or list(CASES):
        for ctx in args.ctx or [None]:
            for seqs in args.batch or [None]:
                run_case(key, args, seqs, ctx)
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
