#!/usr/bin/env python3
"""Draft attention on the H200: what one draft step's attention costs, and what would make it cheaper (issue 19).

The previous profile (``benchmarks/results/vllm_h200_2026-12-01_profile/before/kernels_vegas-v2.txt``)
put Vegas' draft attention (FA3 over the page-size-1 view of vLLM's paged cache,
:func:`vegas.vllm_plugin.drafting.attention.draft_attention`) at 12.1 µs per layer call: ~1.45 ms of a
~9.9 ms iteration at 40 requests, 14 % of all CUDA time. The KV it reads (~420 keys per request)
is a few hundred kilobytes. This times, per draft step of a model (every layer once, two cache
allocations alternating so that no layer hits L2), interleaved repeats (CUDA events):

- ``paged1``: today's call: page-size-1 table, FA3's split heuristic, no tile schedule (FA3 runs
  ``prepare_varlen_num_blocks`` per call);
- ``paged1/s1``: the same with one split (``num_splits=1``, what the draft now uses up to
  :data:`~vegas.vllm_plugin.drafting.attention.ONE_SPLIT_MAX_KEYS` keys);
- ``paged1/sched``: the draft's own split count (:func:`~vegas.vllm_plugin.drafting.attention.draft_splits`) plus one tile schedule per step shared by every layer
  (:func:`~vegas.vllm_plugin.drafting.attention.draft_schedule`, the draft's call now);
- ``paged1/sN``: N splits (``--splits``), to see whether parallelism over keys pays at this width;
- ``contig``: the same keys gathered into a contiguous ``[rows, width, kv_heads, head_dim]``
  cache per layer (FA3 without a page table: TMA loads) — the attention alone;
- ``gather``: the gather itself (once per draft phase and layer, for K and V), so that
  ``contig + gather / γ`` is what a compact draft cache would cost per step.

Shapes: SmolLM2-135M (30 L, 9 q / 3 kv x 64) with a 420-key table (5 % of 8K plus the recent
columns) at 8, 40, 64 and 128 requests; Qwen3-8B (36 L, 32 q / 8 kv x 128) with a 6,600-key table
(5 % of 128K) at 1, 4 and 16 requests. Prints a table (µs per layer call, and x ``paged1``) and
writes ``--out`` JSON.

    python scripts/draft_attention_bench.py --out draft_attention.json      # ~1 device minute
    python scripts/draft_attention_bench.py --case smollm2 --rows 40 --splits 2,4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from vegas.kernels import slots_to_fa_pages  # noqa: E402
from vegas.kernels.device_timer import interleaved  # noqa: E402

BLOCK_SIZE = 16
#: name -> (layers, q heads, kv heads, head_dim, table width, row counts)
CASES = {
    "smollm2": (30, 9, 3, 64, 420, (8, 40, 64, 128)),
    "qwen3-8b": (36, 32, 8, 128, 6600, (1, 4, 16)),
}


def make_step(layers, hq, hkv, d, width, rows, device="cuda"):
    """Two paged caches (alternating per layer), one random page-size-1 table per layer with
    ``width`` distinct slots per row, every row attending the whole table, the queries."""
    context = max(width * 2, 8192)
    blocks = rows * context // BLOCK_SIZE + 1
    caches = [torch.randn(blocks, 2, BLOCK_SIZE, hkv, d, device=device, dtype=torch.bfloat16) for _ in range(2)]
    tables = []
    for _ in range(layers):
        slots = torch.stack([torch.randperm(blocks * BLOCK_SIZE, device=device)[:width] for _ in range(rows)])
        tables.append(slots_to_fa_pages(slots, BLOCK_SIZE, 2 * BLOCK_SIZE).to(torch.int32))
    used = torch.full((rows,), width, dtype=torch.int32, device=device)
    qsl = torch.arange(rows + 1, dtype=torch.int32, device=device)
    q = torch.randn(rows, hq, d, device=device, dtype=torch.bfloat16)
    return {"caches": caches, "tables": tables, "used": used, "qsl": qsl, "q": q, "width": width,
            "rows": rows, "hq": hq, "hkv": hkv, "d": d}


def variants(s, layers, splits):
    """``{name: fn}``: one draft step's attention (every layer) per variant."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    from vegas.vllm_plugin.drafting.attention import draft_schedule, draft_splits, page_views

    views = [page_views(c) for c in s["caches"]]
    out = torch.empty_like(s["q"])
    rows, width, d = s["rows"], s["width"], s["d"]
    impl = type("Impl", (), {"num_heads": s["hq"], "num_kv_heads": s["hkv"], "head_size": d,
                             "logits_soft_cap": 0.0, "vllm_flash_attn_version": 3})()

    def paged(num_splits, schedule=False):
        def step():
            sched = draft_schedule(impl, s["used"], s["qsl"], width, torch.bfloat16) if schedule else None
            for layer in range(layers):
                k, v = views[layer % 2]
                flash_attn_varlen_func(q=s["q"], k=k, v=v, out=out, cu_seqlens_q=s["qsl"], max_seqlen_q=1,
                                       seqused_k=s["used"], max_seqlen_k=width, softmax_scale=d**-0.5, causal=True,
                                       block_table=s["tables"][layer], scheduler_metadata=sched,
                                       num_splits=num_splits, fa_version=3)
        return step

    # the compact cache: every layer's table gathered once (K and V), [rows, width, kv_heads, d]
    compact = []
    for layer in range(layers):
        k, v = views[layer % 2]
        idx = s["tables"][layer].reshape(-1).long()
        compact.append(tuple(x.index_select(0, idx).view(rows, width, s["hkv"], d) for x in (k, v)))
    cu_k = torch.arange(rows + 1, dtype=torch.int32, device=s["q"].device) * width

    def contig():
        for layer in range(layers):
            k, v = compact[layer]
            flash_attn_varlen_func(q=s["q"], k=k.view(-1, s["hkv"], d), v=v.view(-1, s["hkv"], d), out=out,
                                   cu_seqlens_q=s["qsl"], max_seqlen_q=1, cu_seqlens_k=cu_k, max_seqlen_k=width,
                                   softmax_scale=d**-0.5, causal=True, fa_version=3)

    def gather():
        for layer in range(layers):
            k, v = views[layer % 2]
            idx = s["tables"][layer].reshape(-1).long()
            ck, cv = compact[layer]
            torch.index_select(k, 0, idx, out=ck.view(-1, 1, s["hkv"], d))
            torch.index_select(v, 0, idx, out=cv.view(-1, 1, s["hkv"], d))

    # vLLM's Triton split-KV decode kernel (page size 1, GQA grouped) over the same table
    from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd

    lse = torch.empty(rows, s["hq"], dtype=torch.float32, device=s["q"].device)
    unit = torch.ones(1, dtype=torch.float32, device=s["q"].device)

    def triton_split(n):
        logits = torch.empty(rows, s["hq"], n, d + 1, dtype=torch.float32, device=s["q"].device)

        def step():
            for layer in range(layers):
                k, v = views[layer % 2]
                decode_attention_fwd(s["q"], k, v, out, lse, s["tables"][layer], s["used"], logits, n,
                                     d**-0.5, page_size=1, k_scale=unit, v_scale=unit)
        return step

    fns = {"paged1": paged(0), "paged1/s1": paged(1), "paged1/sched": paged(draft_splits(width), schedule=True)}
    fns.update({f"paged1/s{n}": paged(n) for n in splits if n > 1})
    fns.update({"contig": contig, "gather": gather})
    fns.update({f"triton/s{n}": triton_split(n) for n in (1, 2, 4, 8, 16)})
    return fns


def max_error(s):
    """Largest |triton - FA3| over one layer's output (bf16), the Triton kernel with 4 splits."""
    from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    from vegas.vllm_plugin.drafting.attention import page_views

    k, v = page_views(s["caches"][0])
    d, rows = s["d"], s["rows"]
    ref = torch.empty_like(s["q"])
    flash_attn_varlen_func(q=s["q"], k=k, v=v, out=ref, cu_seqlens_q=s["qsl"], max_seqlen_q=1, seqused_k=s["used"],
                           max_seqlen_k=s["width"], softmax_scale=d**-0.5, causal=True,
                           block_table=s["tables"][0], fa_version=3)
    out = torch.empty_like(s["q"])
    lse = torch.empty(rows, s["hq"], dtype=torch.float32, device=s["q"].device)
    logits = torch.empty(rows, s["hq"], 4, d + 1, dtype=torch.float32, device=s["q"].device)
    unit = torch.ones(1, dtype=torch.float32, device=s["q"].device)
    decode_attention_fwd(s["q"], k, v, out, lse, s["tables"][0], s["used"], logits, 4, d**-0.5, page_size=1,
                         k_scale=unit, v_scale=unit)
    return (out.float() - ref.float()).abs().max().item()


def as_graphs(fns):
    """Each variant captured in a CUDA graph (as the draft step runs in vLLM), so that the times
    are the GPU's and not Python's launch cost (~25 µs per FA3 call)."""
    graphs = {}
    for name, fn in fns.items():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        graphs[name] = g.replay
    return graphs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="Model shape(s) [default: all].")
    ap.add_argument("--rows", default=None, help="Requests per step, comma-separated [default: the case's].")
    ap.add_argument("--splits", default="2,4", help="Split counts besides FA3's heuristic and 1.")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("draft_attention_bench needs a CUDA GPU and vLLM's FA3")
    splits = [int(x) for x in args.splits.split(",") if x]
    results = []
    print("| case | rows | variant | µs per layer call (median) | min-max | x paged1 |")
    print("|---|---:|---|---:|---|---:|")
    for case in args.case or sorted(CASES):
        layers, hq, hkv, d, width, row_counts = CASES[case]
        for rows in [int(r) for r in args.rows.split(",")] if args.rows else row_counts:
            torch.manual_seed(0)
            s = make_step(layers, hq, hkv, d, width, rows)
            print(f"<!-- {case} rows {rows}: max |triton - FA3| = {max_error(s):.3g} -->", flush=True)
            res = interleaved(as_graphs(variants(s, layers, splits)), args.reps, args.iters)
            base = statistics.median(res["paged1"])
            for name, times in res.items():
                per_call = [t * 1e3 / layers for t in times]  # ms per step -> µs per layer call
                med = statistics.median(per_call)
                row = {"case": case, "rows": rows, "width": width, "variant": name, "us_per_layer": med,
                       "min": min(per_call), "max": max(per_call), "x_paged1": statistics.median(times) / base}
                results.append(row)
                print(f"| {case} | {rows} | {name} | {med:.2f} | {row['min']:.2f}-{row['max']:.2f} | "
                      f"{row['x_paged1']:.2f}x |", flush=True)
            del s
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
