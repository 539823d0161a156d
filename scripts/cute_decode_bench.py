#!/usr/bin/env python3
"""FlashAttention's CuTe-DSL sm90 kernel, with and without vegas' score writer, against FA3 and FA3 + the separate score pass on vLLM's paged cache (issue 22; H200).

The alternative to patching FA3's C++ (csrc/README.md): vLLM 0.24 ships FlashAttention's CuTe-DSL
forward (``vllm.vllm_flash_attn.cute``, ``flash_fwd_sm90.py``: paged KV through cp.async for
page size 16, PackGQA, split-KV with a combine kernel), reachable as
``flash_attn_varlen_func(..., fa_version=4)``. A score write there would be a Python edit (JIT,
no nvcc), but only if its decode is as fast as FA3's. This measures that, per step of a model
(every layer once, two cache allocations alternating so that no layer hits L2):

- ``fa3``: vLLM's FA3 (``fa_version=3``, FA3's own split heuristic), as verification runs today;
- ``cute``: the CuTe-DSL kernel with its split heuristic (``num_splits=0``);
- ``cute/sN``: the CuTe-DSL kernel with N splits (``--splits``), to see whether only the heuristic lags;
- ``cute/m64``: the CuTe-DSL kernel with a 64-row query tile (one MMA warpgroup, as FA3 picks for
  decode: ``max_seqlen_q * G <= 64``), through ``_flash_attn_fwd(tile_mn=(64, 128))``; its default
  tiles are 128-192 rows, of which a decode request fills ``qlen * G`` (5-20);
- ``cute+scores`` / ``cute/m64+scores``: the same with a ``score_mod`` (:func:`score_writer`) that
  stores ``scale * q . k`` of each request's first and last query row (collect2's two scored rows)
  for every key before the chunk into a ``[batch, 2, q_heads, max_len]`` float32 buffer — the
  verification logits written from inside the attention, the point of issue 22 — checked against
  a reference of those logits on layer 0; each layer's call also sums the buffer over rows and
  heads into its ``(batch, max_len)`` score row (the reduce a backend would run);
- ``cute/m64+probe``: the 64-row tile with the probe tokens in front of each chunk
  (:mod:`vegas.kernels.probe_queries`: the scored rows summed over the group's heads, scaled, as
  one query row per KV head, split into a bf16 hi and lo row); the kernel stores those rows'
  logits (8-byte stores from 4 lanes, no reduction, no atomics) and the output is gathered back
  (:func:`vegas.kernels.cute_probe.probe_attention`); checked against a torch reference on layer 0
  (unsplit or the split heuristic's count, and once more with a split count that leaves an empty
  split) and its output against ``cute/m64``'s, bit for bit;
- ``fa3+score``: what the vLLM backend runs today, FA3 per layer, the collect queries gathered per
  layer and the separate all-layers score kernel (:mod:`vegas.kernels.triton_score`) at the end:
  the figure a ``+scores`` variant must beat.

For query lengths 1 (plain decode) and γ + 1 = 5 (verification), SmolLM2 (30 L, 9 q / 3 kv x 64) and
Qwen3-8B (36 L, 32 q / 8 kv x 128) at 32K and 128K, batch 1 and 4. It also prints the first call's
time of each CuTe configuration (the JIT compile) and the largest output difference to FA3.

Needs ``nvidia-cutlass-dsl[cu13]==4.5.2`` and ``quack-kernels>=0.3.3`` (vLLM 0.24.0's pins; the
wheels are not in the device bundle of shared/device: ``scripts/cute_dsl_bundle.sh`` makes
carry-able parts of them, see csrc/README.md).

Measured on an H200 on 2026-12-02 (benchmarks/results/cute_h200_2026-12-02): every ``+scores``
variant lost to ``fa3+score``, so the vLLM backend's opt-in CuTe score path (``vllm.cute_scores``)
was removed; it is at commit 919ef0f. On 2026-12-04 (benchmarks/results/cute_probe_h200_2026-12-04,
``--graphs``) ``cute/m64+probe`` beat ``fa3+score`` at head_dim 128 (1.09-1.16x FA3 against
1.35-1.43x) and lost at 64 (1.22x / 1.37x against 1.20x / 1.24x); the in-register row sums it
replaced (``cute/m64+rowsum``, commit 204ff6d) measured 1.02-1.12x and 1.21x / 1.41x.

    python scripts/cute_decode_bench.py --graphs --no-scores   # everything but the score_mod writer
    python scripts/cute_decode_bench.py --case qwen3-8b --ctx 131072 --batch 4 --qlen 5
    python scripts/cute_decode_bench.py --case smollm2 --ctx 7680 --batch 32 --batch 128 --qlen 5   # serving shape
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
from vegas.kernels import cute_probe  # noqa: E402
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



def cute_attention(b, layer, out, num_splits, tile_mn=None, score_mod=None):
    """The CuTe-DSL forward called as vLLM's ``fa_version=4`` wrapper calls it, plus a tile
    size and a ``score_mod``."""
    from vllm.vllm_flash_attn.cute.interface import _flash_attn_fwd

    k, v = b["kv"][layer]
    _flash_attn_fwd(b["q"], k, v, cu_seqlens_q=b["cu"], seqused_k=b["seq_lens"], max_seqlen_q=b["qlen"],
                    max_seqlen_k=b["max_len"], page_table=b["bt"], softmax_scale=b["scale"], causal=True,
                    num_splits=num_splits, out=out, tile_mn=tile_mn, score_mod=score_mod)


def score_writer(out: torch.Tensor):
    """A CuTe-DSL ``score_mod`` that leaves the scores as they are and stores the scaled logits
    of each request's first and last query row (collect2's two scored rows), for keys
    ``kv < seqlen_k - seqlen_q`` (the keys before the chunk: the selectable prefix), into ``out``
    (float32, contiguous, ``(seqs, 2, q_heads, max_len)``: slot 0 the first row, slot 1 the last).

    The kernel applies ``score_mod(scores, batch, head, q_idx, kv_idx, seqlen_info, aux_tensors)``
    to every QK tile before the mask and the online softmax, with the logical query row and head
    (PackGQA unpacked). ``out`` is addressed through its device pointer, baked into the compiled
    kernel (a closure value, part of the CuTe compile key): through ``aux_tensors`` the kernel
    wraps ``q_idx`` and ``kv_idx`` modulo the sequence lengths, and a tile's padded rows and keys
    would then write over real positions. So ``out`` must outlive the kernel and keep its address;
    raw indices past a sequence fail the conditions and store nothing; a chunk of one query stores
    its row in both slots. With a ``score_mod`` the kernel multiplies by the softmax scale before
    it, so its attention output is not bitwise that of the kernel without one (nor FA3's).

    Raises:
        ImportError: the CuTe DSL (``nvidia-cutlass-dsl``) is not installed.
        ValueError: ``out`` is not a contiguous 4-D float32 tensor with two slots.
    """
    import cutlass
    import cutlass.cute as cute

    if out.dtype != torch.float32 or not out.is_contiguous() or out.dim() != 4 or out.shape[1] != 2:
        raise ValueError(f"the score buffer must be contiguous float32 (seqs, 2, heads, len), got {out.dtype} "
                         f"{tuple(out.shape)}")
    addr, shape, stride = out.data_ptr(), tuple(out.shape), tuple(out.stride())

    @cute.jit
    def write_scores(tSrS_ssa, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        n = cutlass.const_expr(cute.size(tSrS_ssa.shape))
        ptr = cute.make_ptr(cutlass.Float32, addr, cute.AddressSpace.gmem, assumed_align=4)
        dst = cute.make_tensor(ptr, cute.make_layout(shape, stride=stride))
        s_f = cute.make_rmem_tensor(n, cutlass.Float32)
        b_f = cute.make_rmem_tensor(n, cutlass.Int32)
        h_f = cute.make_rmem_tensor(n, cutlass.Int32)
        q_f = cute.make_rmem_tensor(n, cutlass.Int32)
        k_f = cute.make_rmem_tensor(n, cutlass.Int32)
        s_f.store(tSrS_ssa)
        b_f.store(b_idx)
        h_f.store(h_idx)
        q_f.store(q_idx)
        k_f.store(kv_idx)
        ctx = seqlen_info.seqlen_k - seqlen_info.seqlen_q
        last = seqlen_info.seqlen_q - 1
        for j in cutlass.range(n, unroll_full=True):
            if k_f[j] < ctx:
                if q_f[j] == 0:
                    dst[b_f[j], 0, h_f[j], k_f[j]] = s_f[j]
                if q_f[j] == last:
                    dst[b_f[j], 1, h_f[j], k_f[j]] = s_f[j]
        return tSrS_ssa

    return write_scores


def probe_call(b, layers, seqs, hkv, num_splits=0):
    """``(call, buffer)``: a layer call of ``cute/m64+probe`` (the probe tokens packed in front of
    each chunk, the CuTe kernel storing their logits, the output gathered back) and its per-step
    score buffer ``(layers, seqs, hkv, L)`` (no zeroing: every scored position is stored)."""
    buf = torch.full((layers, seqs, hkv, cute_probe.padded_len(b["max_len"])), float("nan"), device="cuda")

    def call(layer, out):
        k, v = b["kv"][layer]
        cute_probe.probe_attention(b["q"], k, v, out, buf[layer], b["cu"], b["seq_lens"], b["qlen"],
                                    b["max_len"], b["bt"], b["scale"], num_splits=num_splits)
    return call, buf


def score_error(buf, ref, ctx):
    """``(relative error, all finite)`` of layer 0's scores in ``buf`` against ``ref`` over the
    scored keys ``[0, ctx)`` (every request of the bench has the same context)."""
    got = buf[0, :, :, :ctx]
    ref = ref[:, :, :ctx]
    return ((got - ref).norm() / ref.norm()).item(), bool(torch.isfinite(got).all())


def check_probe(b, layers, seqs, hkv, ref, splits, out):
    """:func:`score_error` of layer 0's ``cute/m64+probe`` call at ``splits`` splits."""
    call, buf = probe_call(b, layers, seqs, hkv, num_splits=splits)
    call(0, out)
    torch.cuda.synchronize()
    return score_error(buf, ref, b["max_len"] - b["qlen"])


def separate_scores(b, layers, seqs, hq, hkv, d):
    """A layer call of today's path: FA3, then the layer's two collect queries gathered into a
    per-step buffer; after the last layer one all-layers launch of the separate score kernel."""
    from vegas.kernels.triton_score import collect_scores_layers_triton, layer_offsets

    qlen = b["qlen"]
    cu = b["cu"][:-1].long()
    q_idx = torch.stack([cu, cu + qlen - 1], dim=1)  # [seqs, 2]: first and last row of each chunk
    weights = torch.ones(seqs, 2, device="cuda")
    queries = torch.empty((layers, seqs, 2, hq, d), dtype=b["q"].dtype, device="cuda")
    keys = [b["kv"][layer][0] for layer in range(layers)]
    offsets = layer_offsets(keys)
    ctx = b["seq_lens"] - qlen

    def call(layer, out):
        attention(b, layer, out, 3, 0)
        torch.index_select(b["q"], 0, q_idx.reshape(-1), out=queries[layer].view(-1, hq, d))
        if layer == layers - 1:
            collect_scores_layers_triton(queries, weights, keys, b["bt"], ctx, b["max_len"], b["scale"],
                                         key_offsets=offsets)
    return call


def reference_scores(b, layer, hq, hkv):
    """``[batch, 2, q_heads, max_len]`` float32 logits (``scale * q . k``) of each request's first
    and last query row for keys before its chunk; NaN elsewhere (not compared)."""
    k = b["kv"][layer][0]  # [num_blocks, block_size, hkv, d]
    seqs, qlen = b["bt"].shape[0], b["qlen"]
    ref = torch.full((seqs, 2, hq, b["max_len"]), float("nan"), device=k.device)
    group = hq // hkv
    for s in range(seqs):
        ctx = int(b["seq_lens"][s]) - qlen
        pos = torch.arange(ctx, device=k.device)
        keys = k[b["bt"][s, pos // BLOCK_SIZE].long(), pos % BLOCK_SIZE].float()  # [ctx, hkv, d]
        keys = keys.repeat_interleave(group, dim=1)  # [ctx, hq, d]
        for slot, row in enumerate((0, qlen - 1)):
            q = b["q"][int(b["cu"][s]) + row].float()  # [hq, d]
            ref[s, slot, :, :ctx] = torch.einsum("hd,phd->hp", q, keys) * b["scale"]
    return ref


#: model -> (score buffer, its writer): one buffer at the largest case of the run, so that the writer
#: (its address and shape compiled into the kernel) compiles once per model, not once per case
_WRITERS: dict = {}


def writer_for(model, hq, seqs, max_len, args):
    """``(scores view (seqs, 2, hq, max_len), writer)`` of the model's shared buffer (None, None
    without ``--scores``)."""
    if not args.scores:
        return torch.empty((seqs, 2, hq, max_len), device="cuda"), None
    if model not in _WRITERS:
        most_seqs = max(args.batch or [1, 4])
        most_len = max(args.ctx or [32768, 131072]) + max(args.qlen or [1, 5])
        buf = torch.zeros((most_seqs, 2, hq, most_len), device="cuda")
        _WRITERS[model] = (buf, score_writer(buf))
    buf, writer = _WRITERS[model]
    return buf[:seqs, :, :, :max_len], writer


def run_case(model, ctx, seqs, qlen, args):
    layers, hq, hkv, d = MODELS[model]
    torch.manual_seed(0)
    b = make_batch(layers, hq, hkv, d, seqs, ctx, qlen)
    out_fa3, out_cute = torch.empty_like(b["q"]), torch.empty_like(b["q"])
    attention(b, 0, out_fa3, 3, 0)
    scores, writer = writer_for(model, hq, seqs, b["max_len"], args)
    m64 = (64, 128)
    # name -> a call of one layer: (layer, out) -> None
    calls = {"fa3": lambda layer, out: attention(b, layer, out, 3, 0),
             "cute": lambda layer, out: attention(b, layer, out, 4, 0)}
    calls.update({f"cute/s{n}": (lambda n: lambda layer, out: attention(b, layer, out, 4, n))(n) for n in args.splits})
    calls["cute/m64"] = lambda layer, out: cute_attention(b, layer, out, 0, tile_mn=m64)
    if writer is not None:
        calls["cute+scores"] = lambda layer, out: cute_attention(b, layer, out, 0, score_mod=writer)
        calls["cute/m64+scores"] = lambda layer, out: cute_attention(b, layer, out, 0, tile_mn=m64, score_mod=writer)
    rows = torch.empty((layers, seqs, b["max_len"]), device="cuda")  # per-layer score rows (the reduce's output)

    def with_reduce(call):
        def fn(layer, out):
            call(layer, out)
            torch.sum(scores, dim=(1, 2), out=rows[layer])
        return fn

    if writer is not None:
        calls["cute+scores"] = with_reduce(calls["cute+scores"])
        calls["cute/m64+scores"] = with_reduce(calls["cute/m64+scores"])
    probe_ref = None
    if args.probe:
        calls["cute/m64+probe"], probe_buf = probe_call(b, layers, seqs, hkv)
        k0 = b["kv"][0][0]
        probe_ref = cute_probe.reference_scores(b["q"], k0, b["bt"], b["cu"], b["seq_lens"], qlen, b["scale"],
                                                  b["max_len"])
    calls["fa3+score"] = separate_scores(b, layers, seqs, hq, hkv, d)
    ref = reference_scores(b, 0, hq, hkv) if writer is not None else None
    first = {}
    out_m64 = None
    for name, call in calls.items():
        if name.startswith("fa3"):
            continue
        torch.cuda.synchronize()
        scores.fill_(float("nan"))
        t0 = time.perf_counter()
        try:
            call(0, out_cute)
            torch.cuda.synchronize()
        except Exception as e:  # an unsupported configuration (or a DSL error): report and drop it
            print(f"  {name}: {type(e).__name__}: {str(e)[:600]}", flush=True)
            first[name] = None
            continue
        first[name] = time.perf_counter() - t0
        diff = (out_cute.float() - out_fa3.float()).abs().max().item()
        line = f"  {name}: first call {first[name]:.1f} s, max |cute - fa3| = {diff:.2e}"
        if name == "cute/m64":
            out_m64 = out_cute.clone()
        if name.endswith("+probe"):
            err, finite = score_error(probe_buf, probe_ref, b["max_len"] - qlen)
            same = "n/a" if out_m64 is None else torch.equal(out_cute, out_m64)
            line += f", scores rel. error {err:.2e} (finite: {finite}), output bitwise = cute/m64: {same}"
        if name.endswith("+scores"):
            want = ~torch.isnan(ref)
            got_ok = torch.equal(~torch.isnan(scores), want)  # written exactly where the reference is defined
            err = ((scores[want] - ref[want]).norm() / ref[want].norm()).item() if want.any() else float("nan")
            line += f", scores written where expected: {got_ok}, rel. error {err:.2e}"
        print(line, flush=True)
    empty = cute_probe.empty_split_count(-(-b["max_len"] // 128))
    if args.probe and first.get("cute/m64+probe") is not None and empty is not None:
        try:
            err, finite = check_probe(b, layers, seqs, hkv, probe_ref, empty, out_cute)
            print(f"  cute/m64+probe at {empty} splits (one empty): scores rel. error {err:.2e} (finite: {finite})",
                  flush=True)
        except Exception as e:
            print(f"  cute/m64+probe at {empty} splits: {type(e).__name__}: {str(e)[:600]}", flush=True)
    calls = {n: c for n, c in calls.items() if first.get(n, 0) is not None}

    def step(call):
        def fn():
            for layer in range(layers):
                call(layer, out_cute)
        if not args.graphs:
            return fn
        fn()  # compiled and warm before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn()
        except Exception as e:  # a variant that cannot be captured: timed eagerly, said
            print(f"  (a CUDA graph failed: {type(e).__name__}: {str(e)[:300]}; timed without)", flush=True)
            torch.cuda.synchronize()
            return fn
        return graph.replay

    res = interleaved({n: step(c) for n, c in calls.items()}, args.reps, args.iters)
    med = {n: statistics.median(v) for n, v in res.items()}
    kv_bytes = layers * seqs * (ctx + qlen) * hkv * d * 2 * 2
    title = f"{model} {layers}L {hq}q/{hkv}kv x {d}, ctx {ctx}, batch {seqs}, qlen {qlen}"
    print(f"== {title}: K+V {kv_bytes / 1e9:.2f} GB per step, floor {kv_bytes / PEAK * 1e3:.3f} ms")
    print(f"  {'variant':<10}{'ms/step':>10}{'min-max':>20}{'x fa3':>8}{'TB/s':>8}")
    rows = []
    for n, v in res.items():
        print(f"  {n:<10}{med[n]:10.3f}{f'{min(v):.3f}-{max(v):.3f}':>20}{med[n] / med['fa3']:8.3f}"
              f"{kv_bytes / med[n] / 1e9:8.2f}", flush=True)
        rows.append(dict(case=title, model=model, ctx=ctx, batch=seqs, qlen=qlen, graphs=args.graphs, variant=n, ms=med[n],
                         ms_all=v, x_fa3=med[n] / med["fa3"], tbps=kv_bytes / med[n] / 1e9,
                         first_call_s=first.get(n)))
    b.clear()  # free the caches before the next case (the timing closures hold the dict)
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", action="append", choices=list(MODELS), help="default: both")
    ap.add_argument("--ctx", type=int, action="append",
                    help="context tokens; repeat the flag for several (default: 32768 and 131072; the serving shape: 7680)")
    ap.add_argument("--batch", type=int, action="append",
                    help="requests; repeat the flag for several (default: 1 and 4; the serving shapes: 32 and 128)")
    ap.add_argument("--qlen", type=int, action="append",
                    help="queries per request; repeat for several (default: 1 (decode) and 5 (verification, γ = 4))")
    ap.add_argument("--splits", type=int, nargs="*", default=[8, 32], help="fixed split counts tried besides the heuristic")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-scores", dest="scores", action="store_false",
                    help="leave out the variants with the score-writing score_mod")
    ap.add_argument("--no-probe", dest="probe", action="store_false",
                    help="leave out cute/m64+probe (the probe queries' logits, vegas/kernels/cute_probe.py)")
    ap.add_argument("--graphs", action="store_true",
                    help="time each variant's step as one CUDA-graph replay (as vLLM runs decode; without it the "
                         "CuTe DSL's host overhead per call, ~0.1 ms, bounds small steps)")
    ap.add_argument("--json", help="write every row here")
    args = ap.parse_args()
    for flag, values in (("--ctx", args.ctx), ("--batch", args.batch), ("--qlen", args.qlen)):
        if any(v < 1 for v in values or []):
            ap.error(f"{flag} must be integers >= 1, got {values}")
    try:
        from vllm.vllm_flash_attn.flash_attn_interface import fa_version_unsupported_reason, is_fa_version_supported
    except ImportError as e:
        print(f"this bench needs vLLM 0.24.0 (its FA3 and CuTe-DSL attention) and a Hopper GPU: {e}")
        return 1

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
