#!/usr/bin/env python3
"""Device benchmark of the vLLM backend: plain vLLM, vLLM ngram, vegas selectors.

Run on the GPU machine after the vLLM bundle is unpacked (see scripts/device_check.sh)::

    PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 python scripts/vllm_bench.py \
        --contexts 16384,8192 --batches 1,8,32,128 --out $OUT/bench.json

Model: ``--model DIR``, an HF checkpoint directory (default: the embedded vegas-tiny-code). The
benchmark model is SmolLM2-135M (Llama, 9 query / 3 KV heads of 64, 30 layers, 8K context):
``--model /tmp/smollm2-hf --contexts 7680``, converted on the device by scripts/device_smollm2.sh
(see scripts/device_check.sh). A model with sliding-window layers is refused before any engine
is built when vegas runs.

Prompts: windows of held-out code (benchmarks/data/heldout_code_dev.jsonl.xz, packages the
embedded model never saw; SmolLM2 may have seen public code), tokenized with the model's own
tokenizer (its ``tokenizer.json``), no special tokens; window i starts at a different offset
of the concatenated documents, the shorter context is a prefix of the longer one.

KV budget: ``--sparsity 0.05,0.02`` builds one vegas engine per share (rows of all but the first
get the suffix ``-kvP%``); ``--min-kv-budget 0`` lets a small share below 256 positions count
(2 % of 7,680 is 154).

Per engine and context, every prompt is first prefilled once (max_tokens=1) so that prefix
caching holds it; the timed run then decodes ``--new-tokens`` tokens per request
(``ignore_eos``), so its wall time is decode time (plus one block of prefill).
Decode throughput = generated tokens / wall time. Acceptance length τ = tokens emitted per
verification (vegas: the proposer's counters; ngram: vLLM's spec-decode metrics).
Selection overhead = GPU time of the selection inside verification (plan, score collection,
top-k; GPU clock stamps captured into the graphs, :class:`vegas.kernels.device_timer.DeviceTimer`,
so full-graph replays are timed too) / decode wall time. Speedup = throughput / plain vLLM throughput at the same context and batch.
ms/iter = decode window / batch steps (a batch step verifies every running request once);
GPU ms/iter = CUDA-event time of the draft phase (draft tables included) + the verification
forward (selection included); floor ms/iter = bytes the step must read / 4.3 TB/s (:func:`byte_floor_ms`);
byte bound = τ x plain floor / vegas floor, the speedup if both ran at the byte floor.
Method ``plain-sync`` is plain vLLM on the host path Vegas runs on (V1 runner, synchronous
scheduling, piecewise CUDA graphs), to separate engine overhead from Vegas' own cost.

Steady state (``--steady K``): an open batch instead of a closed one. The engine runs at most
``batch`` requests at a time (``max_num_seqs = batch``, one engine per batch size) and gets
``K x batch`` requests, so a finished request's slot is refilled at once, as in serving. A closed
batch instead waits for its slowest request: speculative requests finish after different
numbers of iterations, and the last iterations run few requests. Both modes time the same window
(first token to last token, every request prefix-cached beforehand).

FA3 score extension (issue 22): ``--fa3-ext PATH`` also runs every vegas engine (and the 8B latency
table's) with ``VEGAS_FA3_EXT=PATH`` (rows ``-fa3``: verification attention and scores in one FA3 pass,
:mod:`vegas.vllm_plugin.fa3_verify`); the other engines run with ``VEGAS_FA3_EXT`` unset, so one run
gives tok/s before and after. The selection overhead of a ``-fa3`` row leaves out the scoring, which is
inside the attention: compare its tok/s and verify ms.

Greedy exactness: ``--exact-prompts`` prompts at the first context, greedy, compared token by
token with plain vLLM greedy; at the first differing token the plain run's top-2 logprob gap
is reported (a bf16 near-tie shows a small gap).
"""

from __future__ import annotations

import argparse
import gc
import json
import lzma
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
sys.path.insert(0, str(ROOT))

T_START = time.time()


def log(*a):
    print(f"[{time.time() - T_START:7.1f}s]", *a, flush=True)


def model_encoder(model_dir: str):
    """``text -> token ids`` with the model's own tokenizer, no special tokens: its
    ``tokenizer.json`` (``tokenizers``), else transformers' ``AutoTokenizer`` (no remote code)."""
    path = Path(model_dir) / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
        return lambda text: tok.encode(text, add_special_tokens=False).ids
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    return lambda text: hf(text, add_special_tokens=False).input_ids


def load_prompts(model_dir: str, num: int, length: int, data: Path) -> list[list[int]]:
    """``num`` windows of ``length`` token ids of the held-out code in ``data`` (xz JSON lines
    with a ``text`` field), tokenized with the model's tokenizer (:func:`model_encoder`)."""
    encode = model_encoder(model_dir)
    docs = [json.loads(line)["text"] for line in lzma.open(data, "rt")]
    ids: list[int] = []
    for d in docs:
        ids.extend(encode(d))
    span = len(ids) - length
    if span <= 0:
        ids = ids * (length // len(ids) + 2)
        span = len(ids) - length
    stride = max(span // max(num, 1), 1)
    return [ids[(i * stride) % span : (i * stride) % span + length] for i in range(num)]


def metric_counts(llm) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value"):
                out[m.name] = out.get(m.name, 0.0) + float(m.value)
    except Exception as e:  # metrics are optional
        out["error"] = str(e)  # type: ignore[assignment]
    return out


def build_llm(method: str, args, max_len: int, settings: str | None = None, runner: str | None = None):
    """The engine of ``method`` ("plain", "plain-sync", "ngram" or "vegas" with ``settings``,
    see :func:`vegas_settings`), its arguments made by the backend's
    :func:`vegas.backends.vllm.vllm_engine_kwargs`; ``runner="v2"`` runs Vegas on vLLM's V2
    model runner, ``"v1"`` on the V1 runner (default: the runner vLLM picks, V2 where it can)."""
    from vllm import LLM

    from vegas.backends.vllm import vllm_engine_kwargs

    kw = dict(
        max_model_len=max_len,
        max_num_seqs=max(args.batches),
        gpu_memory_utilization=args.gpu_mem,
        skip_tokenizer_init=True,
        seed=0,
    )
    if args.load_format:
        kw["load_format"] = args.load_format
    if getattr(args, "max_num_batched_tokens", None):
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.tp > 1:
        kw["tensor_parallel_size"] = args.tp
    if args.eager:
        kw["enforce_eager"] = True
    limit = max(args.batches) * (args.gamma + 1)
    sizes = sorted(x for x in {1, 2, 4, 8, 16, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384,
                               512, 640} if x <= max(limit, 8))
    cc: dict = {"cudagraph_capture_sizes": sizes}
    verify = "full"
    if method == "plain-sync":  # plain vLLM on the host path Vegas runs on: V1 runner, sync scheduling
        kw["async_scheduling"] = False
        cc["cudagraph_mode"] = "PIECEWISE"
    if method == "ngram":
        kw["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": args.gamma,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
    elif method == "vegas":
        from vegas.vllm_plugin import register
        register()  # the config check that keeps async scheduling on runs in this process
        kw["async_scheduling"] = getattr(args, "vegas_scheduling", "async") == "async"
        verify = "full" if args.eager else getattr(args, "verify_graphs", "piecewise")
    if not args.eager:
        kw["compilation_config"] = cc
    kw = vllm_engine_kwargs(args.model, dtype="bfloat16", num_draft_tokens=args.gamma if method == "vegas" else None,
                            verify_cuda_graphs=verify, settings=settings if method == "vegas" else None, **kw)
    t = time.time()
    saved = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if method == "plain-sync" or runner == "v1":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    elif runner == "v2":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    try:
        llm = LLM(**kw)
    finally:
        if saved is None:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = saved
    log(f"engine {method} ready in {time.time() - t:.1f}s")
    return llm


def vegas_cfg(args, selector: str) -> dict:
    """The Vegas settings of an engine row, flat: selector, budget and score reduction."""
    cfg = {"selector": selector, "sparsity_ratio": args.sparsity, "min_kv_budget": args.min_kv_budget,
           "tp_selection": args.tp_selection}
    if args.kv_budget:
        cfg["kv_budget"] = args.kv_budget
    return cfg


def vegas_settings(args, selector: str) -> str:
    """The proposer's settings JSON (``additional_config["vegas"]``) of :func:`vegas_cfg`, with the
    verification CUDA-graph mode of ``args`` (γ goes to ``speculative_config``)."""
    from vegas.config import VegasConfig
    from vegas.vllm_plugin.settings import settings_json

    cfg = vegas_cfg(args, selector)
    verify = getattr(args, "verify_graphs", "piecewise")
    config = VegasConfig(
        num_draft_tokens=args.gamma,
        sparsity_ratio=cfg["sparsity_ratio"],
        min_kv_budget=cfg["min_kv_budget"],
        kv_budget=cfg.get("kv_budget"),
        vllm={"tp_selection": cfg["tp_selection"], "verify_cuda_graphs": "piecewise" if verify == "both" else verify,
              "prefill_skip_tokens": getattr(args, "prefill_skip_tokens", 0)},
    )
    return settings_json(selector, config)


def generate(llm, prompts, sp):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return outs


def run_engine(method: str, args, prompts_by_ctx, results, exact_ref):
    from vllm import SamplingParams


    max_ctx = max(prompts_by_ctx)
    llm = build_llm(method, args, max_ctx + args.new_tokens + 64, vegas_settings(args, args.selectors[0]))
    HOLD["llm"] = llm
    selectors = args.selectors if method == "vegas" else [None]

    def set_selector(sel):
        if sel is not None:
            llm.collective_rpc("vegas_configure", args=(vegas_settings(args, sel),))

    # ---- greedy exactness ----
    ectx = args.contexts[0]
    eprompts = prompts_by_ctx[ectx][: args.exact_prompts]
    if eprompts:
        for sel in selectors:
            set_selector(sel)
            sp = SamplingParams(
                temperature=0.0, max_tokens=args.exact_tokens, ignore_eos=True, detokenize=False,
                logprobs=2 if method == "plain" else None,
            )
            t = time.time()
            outs = generate(llm, eprompts, sp)
            name = method if sel is None else f"vegas-{sel}{args.name_suffix}"
            toks = [list(o.outputs[0].token_ids) for o in outs]
            exact_ref[name] = toks
            if method == "plain":
                exact_ref["plain_logprobs"] = [o.outputs[0].logprobs for o in outs]
            log(f"greedy {name}: {len(toks)} x {args.exact_tokens} tokens in {time.time()-t:.1f}s")
            if method == "vegas":
                st = llm.collective_rpc("vegas_stats")[0]
                log(f"greedy {name} proposer stats: {json.dumps(st)}")

    # ---- throughput ----
    for ctx in args.contexts:
        prompts = prompts_by_ctx[ctx]
        t = time.time()
        n_warm = max(args.batches) * max(args.steady, 1)
        generate(llm, prompts[:n_warm], SamplingParams(max_tokens=1, detokenize=False))
        log(f"{method} ctx {ctx}: warm prefill of {n_warm} prompts {time.time()-t:.1f}s")
        for bsz in args.batches:
            for sel in selectors:
                if time.time() - T_START > args.time_budget:
                    log("time budget reached; skipping the rest")
                    return llm
                set_selector(sel)
                name = method if sel is None else f"vegas-{sel}{args.name_suffix}"
                sp = SamplingParams(
                    temperature=args.temperature, top_p=1.0, max_tokens=args.new_tokens,
                    ignore_eos=True, detokenize=False,
                )
                generate(llm, prompts[:bsz], SamplingParams(
                    temperature=args.temperature, max_tokens=8, ignore_eos=True, detokenize=False))  # warm-up
                sp1 = SamplingParams(temperature=args.temperature, max_tokens=1, detokenize=False)
                t = time.time()
                generate(llm, prompts[:bsz], sp1)
                t_first = time.time() - t
                # closed batch; with --steady also K x batch requests through `batch` slots (open batch)
                for n_req in [bsz] + ([bsz * args.steady] if args.steady else []):
                    runs = []
                    for _ in range(args.repeats):  # the last run's counters are the row's
                        m0 = metric_counts(llm)
                        if method == "vegas":
                            llm.collective_rpc("vegas_configure", args=(None, True))
                        t = time.time()
                        outs = generate(llm, prompts[:n_req], sp)
                        wall = time.time() - t
                        ntok = sum(len(o.outputs[0].token_ids) for o in outs)
                        window = decode_window(outs)
                        decode_s = window if window else max(wall - t_first, 1e-6)
                        runs.append((ntok - n_req) / decode_s)
                    tps = statistics.median(runs)  # an even count: the mean of the middle two
                    row = {"ctx": ctx, "batch": bsz, "method": name, "requests": n_req,
                           "mode": "steady" if n_req > bsz else "closed", "tokens": ntok, "wall_s": wall,
                           "first_token_s": t_first, "decode_s": decode_s,
                           "timing": "engine timestamps" if window else "wall - first-token run",
                           "tok_per_s": tps, "tok_per_s_runs": runs,
                           "ms_per_token_step": bsz / tps * 1e3}
                    row["floor_ms"] = byte_floor_ms(args, method, sel, ctx, bsz)
                    if method == "vegas":
                        row["selector"] = sel
                        row["sparsity"] = args.sparsity
                        row["kv_budget"] = min(kv_budget_tokens(args, ctx), ctx)
                        st = llm.collective_rpc("vegas_stats")[0]
                        row["acceptance_length"] = st.get("acceptance_length")
                        row["batch_steps"] = st.get("proposals", 0)
                        row["mean_request_iterations"] = st.get("iterations", 0) / n_req
                        row["full_cuda_graphs"] = st.get("full_cuda_graphs")
                        row["selection_overhead"] = st.get("select_ms", 0) / (decode_s * 1e3)
                        row["draft_share"] = st.get("draft_ms", 0) / (wall * 1e3)
                        steps = max(st.get("proposals", 0), 1)
                        row["per_iteration_ms"] = {
                            "wall": decode_s * 1e3 / steps,
                            "draft_phase": st.get("draft_ms", 0) / steps,
                            "verify_forward": st.get("verify_fwd_ms", 0) / steps,
                            "selection": st.get("select_ms", 0) / steps,
                        }
                        row["gpu_ms_per_iteration"] = (st.get("draft_ms", 0) + st.get("verify_fwd_ms", 0)) / steps
                        row["stats"] = st
                    elif method == "ngram":
                        m1 = metric_counts(llm)
                        dr = m1.get("vllm:spec_decode_num_drafts", 0) - m0.get("vllm:spec_decode_num_drafts", 0)
                        acc = m1.get("vllm:spec_decode_num_accepted_tokens", 0) - m0.get(
                            "vllm:spec_decode_num_accepted_tokens", 0)
                        row["acceptance_length"] = 1 + acc / dr if dr else None
                    results["rows"].append(row)
                    log(json.dumps({k: v for k, v in row.items() if k != "stats"}))
                    save(results, args)
    return llm


HOLD: dict = {}


def decode_window(outs) -> float | None:
    """Seconds from the first request's first token to the last request's last token, from the
    engine core's per-request timestamps (None when vLLM did not record them)."""
    try:
        firsts = [o.metrics.first_token_ts for o in outs]
        lasts = [o.metrics.last_token_ts for o in outs]
    except AttributeError:
        return None
    if not firsts or min(firsts) <= 0 or max(lasts) <= min(firsts):
        return None
    return max(lasts) - min(firsts)

HBM_BYTES_PER_S = 4.3e12  # H200 peak


def model_bytes(cfg: dict) -> tuple[int, int]:
    """(weight bytes one forward reads, KV-cache bytes per token) of a Llama/Qwen3-style config in bf16."""
    h, d = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    hq, hkv, layers = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    per_layer = h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * cfg["intermediate_size"]
    weights = 2 * (layers * per_layer + cfg["vocab_size"] * h)  # layers + lm_head
    return weights, 2 * layers * 2 * hkv * d


def kv_budget_tokens(args, ctx: int) -> int:
    """KV budget of a vegas engine at context ``ctx`` (tokens, before clamping to the context):
    ``--kv-budget`` if set, else ``max(ceil(ctx x sparsity), min_kv_budget)`` (the proposer's rule)."""
    return args.kv_budget if args.kv_budget else max(math.ceil(ctx * args.sparsity), args.min_kv_budget)


def byte_floor_ms(args, method: str, sel: str | None, ctx: int, batch: int) -> float:
    """Time to read the bytes of one decode step (plain) or one Vegas iteration at 4.3 TB/s (ms).

    With tensor parallelism (``args.tp`` GPUs) the bytes are split over the GPUs, which read in
    parallel (the floor divides by ``args.tp``; communication is left out).
    Plain: weights + the whole KV cache. Vegas: the verification (weights + whole KV cache),
    score collection (the keys again, collect2/aggregated), and γ draft steps (weights + the KV
    budget plus the recent and draft positions; quest: plus every page's two key bounds, 2/16
    of the keys per draft step). Activations and logits are left out.
    """
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    w, kv = model_bytes(cfg)
    full = w + batch * ctx * kv
    if not method.startswith("vegas") and method != "ngram":
        return full / HBM_BYTES_PER_S / args.tp * 1e3
    total = full
    if method == "vegas":
        budget = kv_budget_tokens(args, ctx)
        if sel in ("collect2", "aggregated"):
            total += batch * ctx * kv / 2
        total += args.gamma * (w + batch * (min(budget, ctx) + args.gamma + 1) * kv)
        if sel == "quest":  # the page bounds (min and max, 1/16 of the keys each) per draft step
            total += args.gamma * batch * ctx * kv / 2 * 2 / 16
    return total / HBM_BYTES_PER_S / args.tp * 1e3


QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "max_position_embeddings": 135168, "tie_word_embeddings": False,
    "attention_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 0,
    "eos_token_id": 1,
}


def latency_8b(args, prompts_long: list[list[int]], results) -> None:
    """Step latencies with dummy Qwen3-8B weights: plain decode step vs vegas draft/verify/selection."""
    from vllm import SamplingParams


    d = Path("/tmp/qwen3-8b-dummy")
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(QWEN3_8B))
    ctxs = [int(x) for x in args.latency_contexts.split(",")]
    bszs = [int(x) for x in args.latency_batches.split(",")]
    sub = _with(args, model=str(d), load_format="dummy", batches=bszs, gpu_mem=args.latency_gpu_mem)
    # piecewise verification graphs: CUDA events around each eager forward time the verify step
    sub.verify_graphs = "piecewise"
    n_new = 33
    engines = [("plain", args.tp_selection, None)]
    engines += [("vegas", t, None) for t in (args.tp_selections if args.tp > 1 else [args.tp_selection])]
    if args.fa3_ext:
        engines += [("vegas", t, args.fa3_ext) for t in (args.tp_selections if args.tp > 1 else [args.tp_selection])]
    for method, tp_sel, fa3_ext in engines:
        if time.time() - T_START > args.time_budget:
            log("time budget reached; 8B latency skipped")
            return
        sub.tp_selection = tp_sel
        label = method if method == "plain" or args.tp == 1 else f"{method}-{tp_sel}"
        label += "-fa3" if fa3_ext else ""
        set_fa3_ext(fa3_ext)
        try:
            llm = build_llm(method, sub, max(ctxs) + n_new + 64, vegas_settings(sub, "collect2"))
            HOLD["llm"] = llm
            for ctx in ctxs:
                for bsz in bszs:
                    if ctx * bsz > args.latency_max_tokens or time.time() - T_START > args.time_budget:
                        continue
                    prompts = [p[:ctx] for p in prompts_long[:bsz]]
                    t = time.time()
                    generate(llm, prompts, SamplingParams(max_tokens=1, detokenize=False))
                    t_pref = time.time() - t
                    sp = SamplingParams(temperature=args.temperature, max_tokens=n_new, ignore_eos=True,
                                        detokenize=False)
                    generate(llm, prompts, SamplingParams(temperature=args.temperature, max_tokens=4,
                                                          ignore_eos=True, detokenize=False))
                    t = time.time()
                    generate(llm, prompts, SamplingParams(max_tokens=1, detokenize=False))
                    t1 = time.time() - t
                    if method == "vegas":
                        llm.collective_rpc("vegas_configure", args=(None, True))
                    t = time.time()
                    outs = generate(llm, prompts, sp)
                    wall = time.time() - t
                    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
                    dec = decode_window(outs) or (wall - t1)
                    w, kv = model_bytes(QWEN3_8B)
                    budget = kv_budget_tokens(args, ctx)
                    row = {"model": "qwen3-8b-dummy", "ctx": ctx, "batch": bsz, "method": label, "tp": args.tp,
                           "prefill_s": t_pref, "decode_s": dec,
                           "ms_per_token_step": dec * 1e3 / (ntok / bsz - 1),
                           "plain_step_floor_ms": (w + bsz * ctx * kv) / HBM_BYTES_PER_S / args.tp * 1e3,
                           "draft_step_floor_ms": (w + bsz * (budget + args.gamma + 1) * kv)
                           / HBM_BYTES_PER_S / args.tp * 1e3}
                    if method == "vegas":
                        st = llm.collective_rpc("vegas_stats")[0]
                        steps = max(st.get("proposals", 1), 1)
                        row.update({
                            "acceptance_length": st.get("acceptance_length"),
                            "draft_step_ms": st.get("draft_ms", 0) / max(st.get("draft_steps", 1), 1),
                            "verify_forward_ms": st.get("verify_fwd_ms", 0) / steps,
                            "selection_ms": st.get("select_ms", 0) / steps,
                            "iteration_ms": wall * 1e3 / steps,
                            "stats": st,
                        })
                    results["latency_8b"].append(row)
                    log(json.dumps({k: v for k, v in row.items() if k != "stats"}))
                    save(results, args)
            shutdown(llm)
            del llm
        except Exception as e:
            import traceback

            traceback.print_exc()
            results["errors"][f"8b-{label}"] = repr(e)
            log(f"8B {label} FAILED: {e!r}")
            if HOLD.get("llm") is not None:
                shutdown(HOLD["llm"])
        HOLD["llm"] = None
        gc.collect()


def compare(toks, ref) -> dict:
    n_same, diffs = 0, []
    for i, (a, b) in enumerate(zip(toks, ref["plain"])):
        if a == b:
            n_same += 1
            continue
        j = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
        gap = None
        lp = ref["plain_logprobs"][i]
        if lp is not None and j < len(lp) and lp[j]:
            vals = sorted((v.logprob for v in lp[j].values()), reverse=True)
            if len(vals) >= 2:
                gap = vals[0] - vals[1]
        diffs.append({"prompt": i, "first_diff": j, "top2_logprob_gap": gap,
                      "differing_tokens": sum(x != y for x, y in zip(a, b))})
    return {"identical": n_same, "total": len(toks), "diffs": diffs}


def save(results, args):
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))


def _fmt(v, spec: str) -> str:
    return "" if v is None else spec.format(v)


def shutdown(llm) -> None:
    """Stop the engine's processes so that the next engine gets the GPU memory."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # best effort
        log(f"shutdown: {e!r}")


def table(results) -> str:
    rows = results["rows"]
    def key_of(r):
        return r["ctx"], r["batch"], r.get("mode", "closed")

    plain = {key_of(r): r["tok_per_s"] for r in rows if r["method"] == "plain"}
    floor = {key_of(r): r.get("floor_ms") for r in rows if r["method"] == "plain"}
    lines = ["| ctx | batch | method | tok/s | ms/iter | GPU ms/iter | floor ms/iter | τ | sel. overhead | speedup"
             " | byte bound |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        key = key_of(r)
        batch = r["batch"] if key[2] == "closed" else f"{r['batch']} open ({r['requests']} req.)"
        base = plain.get(key)
        tau = r.get("acceptance_length")
        so = r.get("selection_overhead")
        it = r.get("per_iteration_ms", {}).get("wall", r["ms_per_token_step"])
        bound = None
        if r["method"].startswith("vegas") and tau and floor.get(key) and r.get("floor_ms"):
            bound = tau * floor[key] / r["floor_ms"]
        lines.append(
            f"| {r['ctx']} | {batch} | {r['method']} | {r['tok_per_s']:.0f} | {it:.2f} | "
            f"{_fmt(r.get('gpu_ms_per_iteration'), '{:.2f}')} | {_fmt(r.get('floor_ms'), '{:.2f}')} | "
            f"{_fmt(tau, '{:.2f}')} | {_fmt(so and 100 * so, '{:.1f}%')} | "
            f"{_fmt(base and r['tok_per_s'] / base, '{:.2f}x')} | {_fmt(bound, '{:.2f}x')} |"
        )
    return "\n".join(lines)


def tau_table(results) -> str:
    """Acceptance length τ of the vegas rows by KV budget: one line per context, batch, mode and
    selector, one column per budget (share of the context and tokens); empty without vegas rows."""
    rows = [r for r in results["rows"] if r.get("selector") and r.get("kv_budget") is not None]
    if not rows:
        return ""
    budgets = sorted({(r["sparsity"], r["kv_budget"]) for r in rows}, reverse=True)
    lines = ["| ctx | batch | selector | " + " | ".join(f"τ at {100 * sp:g} % ({k})" for sp, k in budgets) + " |",
             "|---:|---:|---|" + "---:|" * len(budgets)]
    keys = []
    for r in rows:
        key = (r["ctx"], r["batch"], r.get("mode", "closed"), r["selector"])
        if key not in keys:
            keys.append(key)
    for ctx, batch, mode, sel in keys:
        tau = {(r["sparsity"], r["kv_budget"]): r.get("acceptance_length") for r in rows
               if (r["ctx"], r["batch"], r.get("mode", "closed"), r["selector"]) == (ctx, batch, mode, sel)}
        b = batch if mode == "closed" else f"{batch} open"
        lines.append(f"| {ctx} | {b} | {sel} | " + " | ".join(_fmt(tau.get(k), "{:.2f}") for k in budgets) + " |")
    return "\n".join(lines)


def engine_jobs(args, methods: list[str]) -> list[tuple[str, argparse.Namespace]]:
    """One entry per engine to build: (method, args). Vegas with full verification graphs needs
    one engine per selector (the selection is captured into the graphs); with piecewise graphs
    one engine serves every selector (switched through ``collective_rpc("vegas_configure")``)."""
    jobs = []

    def sub(**kw):
        return _with(args, **kw)

    modes = ["full", "piecewise"] if args.verify_graphs == "both" else [args.verify_graphs]
    # with tensor parallelism, one engine per score reduction (rows '-per_rank' for the other)
    tp_sels = args.tp_selections if args.tp > 1 else [args.tp_selection]
    scheds = args.vegas_schedulings
    shares = getattr(args, "sparsities", None) or [args.sparsity]
    for method in methods:
        if method != "vegas":
            jobs.append((method, sub()))
            continue
        for share in shares:
            share_suffix = sparsity_suffix(share) if share != shares[0] else ""
            for sched in scheds:
                sched_suffix = f"-{sched}" if sched != scheds[0] else ""
                for tp_sel in tp_sels:
                    tp_suffix = f"-{tp_sel}" if tp_sel != tp_sels[0] else ""
                    # sliding_window and quest reduce no scores: one engine (the first reduction) serves each
                    sels = [s for s in args.selectors if not (tp_suffix and s in ("sliding_window", "quest"))]
                    if not sels:
                        continue
                    for mode in modes:
                        suffix = (("-pw" if (mode == "piecewise" and len(modes) > 1) else "") + tp_suffix
                                  + sched_suffix + share_suffix)
                        kw = dict(verify_graphs=mode, name_suffix=suffix, tp_selection=tp_sel,
                                  vegas_scheduling=sched, sparsity=share)
                        if mode == "full":
                            jobs += [("vegas", sub(selectors=[s], **kw)) for s in sels]
                        else:
                            jobs.append(("vegas", sub(selectors=sels, **kw)))
    for g in [int(x) for x in args.extra_gammas.split(",") if x]:
        for s in args.extra_gamma_selectors.split(","):
            jobs.append(("vegas", sub(gamma=g, exact_prompts=0, selectors=[s], name_suffix=f"-g{g}",
                                      verify_graphs=modes[0])))
    if getattr(args, "fa3_ext", None):  # every vegas engine again with the FA3 score extension
        jobs += [(m, _with(a, fa3_on=True, name_suffix=a.name_suffix + "-fa3", exact_prompts=0))
                 for m, a in list(jobs) if m == "vegas"]
    if getattr(args, "steady", 0):  # max_num_seqs = batch: one engine per batch size, batch-major
        jobs = [(m, _with(a, batches=[b], exact_prompts=a.exact_prompts if i == 0 else 0))
                for i, b in enumerate(args.batches) for m, a in jobs]
    return jobs


def sparsity_suffix(share: float) -> str:
    """Row suffix of a vegas engine at KV-budget share ``share``: 0.02 -> ``-kv2%``."""
    return f"-kv{round(share * 100, 4):g}%"


def parse_sparsities(raw: str) -> list[float]:
    """``--sparsity`` as a list of shares of the context, each in (0, 1].

    Raises:
        ValueError: naming ``--sparsity`` and the bad value.
    """
    out = []
    for x in raw.split(","):
        try:
            v = float(x)
        except ValueError:
            raise ValueError(f"--sparsity must be a comma list of numbers in (0, 1], got {x!r}") from None
        if not 0 < v <= 1:
            raise ValueError(f"--sparsity must be a comma list of numbers in (0, 1], got {x!r}")
        out.append(v)
    return out


def check_model(model: str, vegas: bool) -> None:
    """Refuse, before the prompts and any engine: a ``--model`` that is not a checkpoint
    directory (``config.json``), and (when ``vegas`` runs) a model with sliding-window layers.

    Raises:
        ValueError: naming ``--model`` (and for a sliding-window model, its layers).
    """
    if not (Path(model) / "config.json").is_file():
        hint = " (on the device: PHASES=smollm2, scripts/device_smollm2.sh)" if "smollm2" in model else ""
        raise ValueError(f"--model {model!r} is not a checkpoint directory with a config.json{hint}")
    if vegas:
        from vegas.backends.vllm import raise_if_sliding_window

        raise_if_sliding_window(model)


def _with(ns: argparse.Namespace, **kw) -> argparse.Namespace:
    """A copy of ``ns`` with the fields ``kw`` replaced."""
    out = argparse.Namespace(**vars(ns))
    for k, v in kw.items():
        setattr(out, k, v)
    return out


def set_fa3_ext(path: str | None) -> None:
    """``VEGAS_FA3_EXT`` for the engines built next (their worker processes inherit it)."""
    if path:
        os.environ["VEGAS_FA3_EXT"] = path
    else:
        os.environ.pop("VEGAS_FA3_EXT", None)


def run_job(method: str, args, prompts_by_ctx, results, exact_ref) -> None:
    set_fa3_ext(args.fa3_ext if getattr(args, "fa3_on", False) else None)
    llm = run_engine(method, args, prompts_by_ctx, results, exact_ref)
    shutdown(llm)
    del llm
    try:
        import torch

        torch.cuda.empty_cache()
    except Exception:
        pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with lists split (``contexts``, ``batches``, ``selectors``,
    ``sparsities``, ``methods`` ...) and the model checked (:func:`check_model`); a bad value
    exits with argparse's usage error naming it."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "vegas" / "model"))
    ap.add_argument("--load-format", default=None, help="e.g. dummy")
    ap.add_argument("--data", default=str(ROOT / "benchmarks" / "data" / "heldout_code_dev.jsonl.xz"))
    ap.add_argument("--contexts", default="16384,8192")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--methods", default="plain,ngram,vegas")
    ap.add_argument("--selectors", default="collect2,aggregated,sliding_window")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per row; the row reports the median tok/s")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--extra-gammas", default="", help="e.g. 8: one more vegas engine per γ (rows 'vegas-SEL-gγ')")
    ap.add_argument("--extra-gamma-selectors", default="collect2")
    ap.add_argument("--verify-graphs", default="full", choices=["full", "piecewise", "both"],
                    help="CUDA graphs of Vegas verification (VegasConfig.vllm.verify_cuda_graphs); both: rows '-pw' too")
    ap.add_argument("--sparsity", default="0.05",
                    help="KV budget as a share of the context; a comma list builds one vegas engine per share "
                         "(rows of all but the first get the suffix '-kvP%%')")
    ap.add_argument("--min-kv-budget", type=int, default=256)
    ap.add_argument("--kv-budget", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--greedy", action="store_true", help="benchmark greedy instead of sampling")
    ap.add_argument("--exact-prompts", type=int, default=8)
    ap.add_argument("--exact-tokens", type=int, default=64)
    ap.add_argument("--gpu-mem", type=float, default=0.5)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--time-budget", type=float, default=1e9, help="seconds; later runs are skipped")
    ap.add_argument("--latency-8b", action="store_true", help="also the dummy Qwen3-8B latency table")
    ap.add_argument("--latency-contexts", default="32768,131072")
    ap.add_argument("--latency-batches", default="1,4")
    ap.add_argument("--latency-max-tokens", type=int, default=524288, help="skip ctx*batch above this")
    ap.add_argument("--latency-gpu-mem", type=float, default=0.85)
    ap.add_argument("--steady", type=int, default=0, metavar="K",
                    help="open batch: K x batch requests through an engine with max_num_seqs = batch "
                         "(one engine per batch size); 0: closed batch of `batch` requests")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size of every engine")
    ap.add_argument("--tp-selection", default="all_reduce",
                    help="with --tp > 1: comma list of score reductions (all_reduce, per_rank), one vegas "
                         "engine each; rows of all but the first get the suffix '-NAME'")
    ap.add_argument("--vegas-scheduling", default="async",
                    help="comma list of vLLM scheduling modes for the vegas engines (async, sync), one "
                         "engine each; rows of all but the first get the suffix '-NAME'")
    ap.add_argument("--fa3-ext", default=None, metavar="PATH",
                    help="also run every vegas engine with the FA3 score extension _vegas_fa3_C at PATH "
                         "(rows '-fa3'); the other engines run without it")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.method_list = methods = [m for m in args.methods.split(",") if m]
    try:
        args.sparsities = parse_sparsities(args.sparsity)
        check_model(args.model, "vegas" in methods)
    except ValueError as e:
        ap.error(str(e))
    args.sparsity = args.sparsities[0]
    args.tp_selections = args.tp_selection.split(",")
    args.tp_selection = args.tp_selections[0]
    args.vegas_schedulings = args.vegas_scheduling.split(",")
    args.vegas_scheduling = args.vegas_schedulings[0]
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    args.selectors = args.selectors.split(",")
    if args.greedy:
        args.temperature = 0.0
    args.name_suffix = ""
    args.fa3_on = False  # set on the engine jobs that run with the extension
    return args


def main() -> int:
    args = parse_args()
    methods = args.method_list
    t = time.time()
    n_prompts = max([b * max(args.steady, 1) for b in args.batches] + [args.exact_prompts])
    longest = load_prompts(args.model, n_prompts, max(args.contexts), Path(args.data))
    prompts_by_ctx = {c: [p[:c] for p in longest] for c in args.contexts}
    log(f"prompts: {len(longest)} x {max(args.contexts)} tokens ({time.time()-t:.1f}s)")
    results = {"args": vars(args), "rows": [], "exactness": {}, "errors": {}, "latency_8b": []}
    exact_ref: dict = {}
    for method, sub in engine_jobs(args, methods):
        if time.time() - T_START > args.time_budget:
            break
        label = method + sub.name_suffix
        try:
            run_job(method, sub, prompts_by_ctx, results, exact_ref)
        except Exception as e:  # keep going: one failing engine must not hide the others
            import traceback

            traceback.print_exc()
            results["errors"][label] = repr(e)
            log(f"ENGINE {label} FAILED: {e!r}")
            if HOLD.get("llm") is not None:
                shutdown(HOLD["llm"])
            if method == "vegas" and sub.verify_graphs == "full":
                log(f"retrying {label} with piecewise verification graphs")
                sub.verify_graphs, sub.name_suffix = "piecewise", sub.name_suffix + "-pw"
                try:
                    run_job(method, sub, prompts_by_ctx, results, exact_ref)
                except Exception as e2:
                    results["errors"][label + "-pw"] = repr(e2)
                    log(f"ENGINE {label}-pw FAILED: {e2!r}")
                    if HOLD.get("llm") is not None:
                        shutdown(HOLD["llm"])
        HOLD["llm"] = None
        gc.collect()
        save(results, args)
    if args.latency_8b:
        try:
            need = max(int(x) for x in args.latency_contexts.split(","))
            nb = max(int(x) for x in args.latency_batches.split(","))
            longp = load_prompts(args.model, nb, need, Path(args.data))
            latency_8b(args, longp, results)
        except Exception as e:
            results["errors"]["8b"] = repr(e)
            log(f"8B latency FAILED: {e!r}")
    if "plain" in exact_ref:
        for name, toks in exact_ref.items():
            if name not in ("plain", "plain_logprobs"):
                results["exactness"][name] = compare(toks, exact_ref)
    print(table(results), flush=True)
    if tau_table(results):
        print("\nτ by KV budget:\n" + tau_table(results), flush=True)
    for r in results["rows"]:
        if "per_iteration_ms" in r:
            print(f"{r['ctx']} b{r['batch']} {r['method']} per-iteration ms:",
                  {k: round(v, 2) for k, v in r["per_iteration_ms"].items()},
                  f"batch steps {r.get('batch_steps')}, mean iterations per request "
                  f"{r.get('mean_request_iterations', 0):.1f}", flush=True)
    for r in results["latency_8b"]:
        print("8B", json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                                for k, v in r.items() if k != "stats"}), flush=True)
    for k, v in results["exactness"].items():
        print(f"exactness {k}: {v['identical']}/{v['total']} identical; diffs: {v['diffs']}", flush=True)
    if results["errors"]:
        print("errors:", results["errors"], flush=True)
    save(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
