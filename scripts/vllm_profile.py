#!/usr/bin/env python3
"""Where does an engine step's time go? A step timeline of plain vLLM and Vegas (device only).

Runs each engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and wraps the worker's
``execute_model`` / ``sample_tokens`` (vLLM 0.24.0, both model runners) to record, per engine
step: host entry/exit times, CUDA events around the step's GPU work, and the step's make-up from
the ``SchedulerOutput`` (requests, prefill requests, scheduled tokens, draft tokens). Workloads
on one engine per method (SmolLM2 7,680-token held-out code prompts unless told otherwise):

- ``closed``: ``--batch`` prefix-cached prompts decoded together (``--new-tokens`` each);
- ``open``: ``--open-factor`` x batch prefix-cached prompts through ``batch`` slots;
- ``serve``: ``--serve-requests`` fresh prompts of ``--serve-len`` tokens submitted at once
  (what ``vllm bench serve`` sends at request rate inf): prefill and decode mixed, TTFT per request.
- ``paced``: ``--paced-requests`` fresh prompts of ``--serve-len`` tokens arriving as a Poisson
  process of ``--paced-rate`` requests/s (what ``vllm bench serve --request-rate`` sends), fed to
  the in-process engine step by step; each request's TTFT (from its arrival time) is split into
  the wait before its first prefill step starts (queue + the step in flight), its prefill steps
  (every chunk; host time, and their GPU time) and the time from the last of them until the
  engine hands out the first token (async scheduling's lag, a draft phase that ends later).
  ``--paced-repeats`` repeats it on the same engine, each repeat with its own prompts (no
  prefix-cache hits) and its own arrival times (Poisson seed = repeat number), so that two
  methods' repeats of one number see the same prompts arriving at the same times.

For each (method, workload) it prints: output tok/s, TTFT mean/p99 (serve), steps by kind
(decode-only, mixed, prefill-only) with mean host ms, mean GPU ms and the idle gap between steps,
wall / GPU per step, and Vegas' own counters (draft phase, selection, τ). With ``--torch-profile``
the serve workload (or ``--torch-profile-workload``) also runs under ``torch.profiler`` (kernel table in
``OUT/kernels_<method>.txt``); each engine step's span is annotated ``vegas step: <kind>``, so that
``scripts/trace_steps.py`` gives the host and GPU time of each kind of step by function and kernel.
Everything goes to ``OUT/profile.json``::

    PYTHONPATH=/tmp/site:$PWD python scripts/vllm_profile.py --model /tmp/smollm2-hf \
        --methods plain,vegas --out $OUT --torch-profile

Engines and prompts are ``vegas bench --backend vllm``'s (:mod:`vegas.bench_vllm`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CUSTOM_SCOPES_FOR_PROFILING", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vegas import bench_vllm as vb  # noqa: E402
from vegas.backends.vllm import shutdown_engine, start_engine  # noqa: E402
from vegas.config import VegasConfig  # noqa: E402

STEPS: list[dict] = []
CAPTURES: list[float] = []  # host times of draft-graph captures (from the vegas log)


class _CaptureLog(logging.Handler):
    def emit(self, record):
        if "draft graph" in record.getMessage() and "captured" in record.getMessage():
            CAPTURES.append(time.perf_counter())


KIND = "vegas step: "  # annotation of a step's span (execute_model to sample_tokens) in a torch trace
_OPEN: list = []  # the open step annotation, at most one


def step_kind(prefill_reqs: int, reqs: int) -> str:
    """``decode`` (no request in prefill), ``prefill`` (every request in prefill) or ``mixed``."""
    return "decode" if prefill_reqs == 0 else ("prefill" if prefill_reqs == reqs else "mixed")


def _close_annotation() -> None:
    while _OPEN:
        _OPEN.pop().__exit__(None, None, None)


def instrument() -> None:
    """Wrap ``Worker.execute_model`` and ``Worker.sample_tokens`` (vLLM 0.24.0) with the timeline."""
    import torch
    from vllm.v1.worker.gpu_worker import Worker

    if getattr(Worker.execute_model, "_timeline", False):
        return
    execute, sample = Worker.execute_model, Worker.sample_tokens

    def execute_model(self, scheduler_output):
        so = scheduler_output
        spec = so.scheduled_spec_decode_tokens
        n_prefill = sum(1 for r, n in so.num_scheduled_tokens.items() if n > 1 + len(spec.get(r, ())))
        rec = {"t0": time.perf_counter(), "reqs": len(so.num_scheduled_tokens), "prefill_reqs": n_prefill,
               "tokens": so.total_num_scheduled_tokens, "draft_tokens": sum(len(v) for v in spec.values()),
               "prefill_ids": [r for r, n in so.num_scheduled_tokens.items() if n > 1 + len(spec.get(r, ()))]}
        rec["e0"] = torch.cuda.Event(enable_timing=True)
        rec["e0"].record()
        _close_annotation()  # a step whose execute_model returned its output (no sample_tokens call)
        # the step's span in a torch-profiler trace, by kind (scripts/trace_steps.py groups by it)
        kind = step_kind(n_prefill, rec["reqs"])
        if kind == "decode" and not rec["draft_tokens"]:
            kind = "decode q1"  # one token a request: plain's decode step, or Vegas' step after a skipped one
        _OPEN.append(torch.profiler.record_function(KIND + kind))
        _OPEN[-1].__enter__()
        STEPS.append(rec)
        out = execute(self, scheduler_output)
        rec["t_exec"] = time.perf_counter()
        return out

    def sample_tokens(self, grammar_output):
        out = sample(self, grammar_output)
        rec = STEPS[-1] if STEPS else None
        if rec is not None and "e1" not in rec:
            rec["e1"] = torch.cuda.Event(enable_timing=True)
            rec["e1"].record()
            rec["t1"] = time.perf_counter()
        _close_annotation()
        return out

    execute_model._timeline = True  # type: ignore[attr-defined]
    Worker.execute_model, Worker.sample_tokens = execute_model, sample_tokens
    logging.getLogger("vegas").addHandler(_CaptureLog())


def summarize(steps: list[dict], t_start: float, t_end: float) -> dict:
    """Per step kind: count, mean host ms, mean GPU ms; gaps; wall / GPU."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    kinds: dict[str, list[dict]] = {}
    gpu_total = 0.0
    prev_end = None
    for s in steps:
        if "e1" not in s:
            continue
        s["gpu_ms"] = s["e0"].elapsed_time(s["e1"])
        s["host_ms"] = (s["t1"] - s["t0"]) * 1e3
        s["gap_ms"] = (s["t0"] - prev_end) * 1e3 if prev_end is not None else 0.0
        prev_end = s["t1"]
        gpu_total += s["gpu_ms"]
        kind = step_kind(s["prefill_reqs"], s["reqs"])
        kinds.setdefault(kind, []).append(s)
    wall_ms = (t_end - t_start) * 1e3
    out = {"wall_ms": wall_ms, "gpu_ms": gpu_total, "steps": sum(len(v) for v in kinds.values()),
           "wall_over_gpu": wall_ms / gpu_total if gpu_total else None,
           "draft_graph_captures": sum(1 for c in CAPTURES if t_start <= c <= t_end)}
    for kind, ss in kinds.items():
        out[kind] = {
            "steps": len(ss),
            "mean_reqs": statistics.mean(s["reqs"] for s in ss),
            "mean_tokens": statistics.mean(s["tokens"] for s in ss),
            "host_ms": statistics.mean(s["host_ms"] for s in ss),
            "gpu_ms": statistics.mean(s["gpu_ms"] for s in ss),
            "gpu_ms_total": sum(s["gpu_ms"] for s in ss),
            "gap_ms": statistics.mean(s["gap_ms"] for s in ss),
            "host_ms_max": max(s["host_ms"] for s in ss),
        }
    return out


def reset_vegas(llm, method: str) -> None:
    """A Vegas engine's counters start again (``vegas_configure``), so a workload's stats are its own."""
    if method.startswith("vegas"):
        llm.collective_rpc("vegas_configure", args=(None, True))


def report(llm, method: str, name: str, res: dict) -> dict:
    """Adds a Vegas engine's stats to a workload's result ``res`` and prints it; returns ``res``."""
    if method.startswith("vegas"):
        st = llm.collective_rpc("vegas_stats")[0]
        res["vegas"] = {k: st.get(k) for k in ("runner", "acceptance_length", "proposals", "skipped", "prefill_skips",
                                               "draft_ms", "verify_fwd_ms", "select_ms", "propose_wall_ms", "full_cuda_graphs")}
    line = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items() if not isinstance(v, dict)}
    print(f"[{method} {name}] {json.dumps(line)}", flush=True)
    for kind in ("decode", "mixed", "prefill"):
        if kind in res:
            print(f"    {kind}: " + json.dumps({k: round(v, 2) for k, v in res[kind].items()}), flush=True)
    if "vegas" in res:
        print("    vegas: " + json.dumps(res["vegas"]), flush=True)
    return res


def run_workload(llm, name: str, prompts, sp, method: str) -> dict:
    reset_vegas(llm, method)
    STEPS.clear()
    t0 = time.perf_counter()
    outs = generate(llm, prompts, sp)
    t1 = time.perf_counter()
    res = summarize(list(STEPS), t0, t1)
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    res["output_tokens"] = ntok
    res["out_tok_s"] = ntok / (t1 - t0)
    window = vb.decode_window(outs)
    if window:
        res["decode_tok_s"] = (ntok - len(outs)) / window
    ttft = [o.metrics.first_token_latency * 1e3 for o in outs if getattr(o, "metrics", None) is not None]
    if ttft:
        ttft.sort()
        res["ttft_mean_ms"] = statistics.mean(ttft)
        res["ttft_p99_ms"] = ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))]
    return report(llm, method, name, res)


def run_paced(llm, prompts, sp, rate: float, seed: int = 0) -> dict:
    """The ``paced`` workload: Poisson arrivals at ``rate`` requests/s through ``LLMEngine.step``.

    Each request's TTFT runs from its Poisson arrival time (as ``vllm bench serve`` times from
    the send; a request that arrives while ``step()`` blocks waits for that step) to the step
    that hands out its first token, split into: ``wait`` (arrival to the start of the first step
    that prefills it: the queue and the step in flight), ``prefill`` (that start to the end of
    the last step that prefills it, every chunk of a chunked prefill included; host time, and
    ``prefill_gpu`` the GPU time of those steps) and ``after_prefill`` (the end of that step to
    the first token: async scheduling's lag, a draft phase that finishes later). Means and p90
    in ms; ``prefill_chunks`` is the mean number of steps that prefilled a request.
    """
    import random

    from vllm.sampling_params import RequestOutputKind

    sp = sp.clone()  # LLM.generate set FINAL_ONLY on the shared object: first tokens would arrive at the end
    sp.output_kind = RequestOutputKind.CUMULATIVE
    eng = llm.llm_engine
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in prompts:
        offsets.append(t)
        t += rng.expovariate(rate)
    STEPS.clear()
    arrived, first, done = {}, {}, 0
    start = time.perf_counter()
    nxt = 0
    while done < len(prompts):
        now = time.perf_counter() - start
        while nxt < len(prompts) and offsets[nxt] <= now:
            rid = f"paced{seed}r{nxt}"  # unique across repeats on one engine
            eng.add_request(rid, {"prompt_token_ids": prompts[nxt]}, sp)
            arrived[rid] = start + offsets[nxt]
            nxt += 1
        if not eng.has_unfinished_requests():
            if nxt >= len(prompts):  # nothing left to add or to wait for (a request lost): stop
                break
            time.sleep(max(0.0, min(0.002, offsets[nxt] - (time.perf_counter() - start))))
            continue
        for o in eng.step():
            rid = o.request_id.split("-")[0]  # the id given (vLLM may hand back its internal "<id>-<random>")
            if rid not in first and o.outputs and o.outputs[0].token_ids:
                first[rid] = time.perf_counter()
            done += bool(o.finished)
    wall = time.perf_counter() - start
    res = summarize(list(STEPS), start, start + wall)  # also sets each step's gpu_ms
    parts: dict[str, list[float]] = {k: [] for k in ("ttft", "wait", "prefill", "prefill_gpu", "after_prefill",
                                                      "prefill_chunks")}
    for rid, t_arrive in arrived.items():
        steps = [s for s in STEPS if "t1" in s and any(n == rid or n.startswith(rid + "-") for n in s["prefill_ids"])]
        if rid not in first or not steps:
            continue
        parts["ttft"].append((first[rid] - t_arrive) * 1e3)
        parts["wait"].append((steps[0]["t0"] - t_arrive) * 1e3)
        parts["prefill"].append((steps[-1]["t1"] - steps[0]["t0"]) * 1e3)
        parts["prefill_gpu"].append(sum(s.get("gpu_ms", 0.0) for s in steps))
        parts["after_prefill"].append((first[rid] - steps[-1]["t1"]) * 1e3)
        parts["prefill_chunks"].append(float(len(steps)))
    for name, v in parts.items():
        if v:
            v.sort()
            unit = "" if name == "prefill_chunks" else "_ms"
            res[f"{name}_mean{unit}"] = statistics.mean(v)
            res[f"{name}_p90{unit}"] = v[int(0.9 * (len(v) - 1))]
    res["requests_timed"] = len(parts["ttft"])
    res["rate"] = rate
    return res


def generate(llm, prompts, sp):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def build_llm(method: str, args, runner: str | None):
    """The engine of ``method`` ("plain" or a Vegas selector), as ``vegas bench --backend vllm``
    makes it; ``runner="v1"``/``"v2"`` picks vLLM's model runner (its ``VLLM_USE_V2_MODEL_RUNNER``)."""
    config = VegasConfig(num_draft_tokens=args.gamma, sparsity_ratio=0.05, min_kv_budget=256,
                         vllm={"prefill_skip_tokens": args.skip_tokens})
    kw = vb.engine_kwargs(method, args.model, config, max_model_len=args.ctx + args.new_tokens + 64,
                          max_num_seqs=args.batch, gpu_memory_utilization=0.6,
                          engine_args={"max_num_batched_tokens": args.max_num_batched_tokens})
    if runner is not None:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
    try:
        return start_engine(kw, None if method == "plain" else method)
    finally:
        os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="as vegas bench's --model (default: the embedded model)")
    ap.add_argument("--methods", default="plain,vegas",
                    help="plain, vegas (the runner vLLM picks), vegas-v1 / vegas-v2 (that runner), vegas-skip (vegas with --prefill-skip-tokens); one per process")
    ap.add_argument("--selector", default="collect2")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=7680)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--open-factor", type=int, default=3)
    ap.add_argument("--serve-requests", type=int, default=64)
    ap.add_argument("--serve-len", type=int, default=6000)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="vllm serve's default on an H200")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--paced-requests", type=int, default=48)
    ap.add_argument("--paced-rate", type=float, default=4.0, help="requests/s of the paced workload")
    ap.add_argument("--paced-repeats", type=int, default=1,
                    help="paced runs on each engine, each with its own prompts and arrival seed")
    ap.add_argument("--workloads", default="serve,closed,open", help="serve, closed, open, paced (comma-separated)")
    ap.add_argument("--torch-profile", action="store_true")
    ap.add_argument("--torch-profile-workload", default="serve", choices=["serve", "open", "closed", "paced"],
                    help="the workload --torch-profile runs under torch.profiler (serve, paced: fresh prompts)")
    ap.add_argument("--no-trace", action="store_true",
                    help="with --torch-profile: keep no chrome trace (~80 MB; e.g. in a queued device job), only the "
                         "kernel tables and its summary by engine step (scripts/trace_steps.py, steps_<method>_<workload>.txt)")
    ap.add_argument("--prefill-skip-tokens", type=int, default=2048,
                    help="vllm.prefill_skip_tokens of the method vegas-skip (the other Vegas methods: 0)")
    ap.add_argument("--out", default="profile-out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO)
    import torch
    from vllm import SamplingParams

    from vegas.models import resolve_model

    args.model = resolve_model(args.model)
    n_open = args.batch * args.open_factor
    workloads = args.workloads.split(",")
    if n_open == 0 and set(workloads) != {"paced"}:
        ap.error("--open-factor 0 (no prefix-cached prompts) is for --workloads paced alone")
    if args.paced_repeats < 1:
        ap.error(f"--paced-repeats must be >= 1, got {args.paced_repeats}")
    if args.no_trace and not args.torch_profile:
        ap.error("--no-trace is for --torch-profile")
    # the repeats' prompts, then one more set for a profiled paced run, loaded whether or not it runs:
    # the windows cut from the held-out set depend on how many are loaded, and two jobs' paced rows
    # should see the same prompts
    n_paced = args.paced_requests * (args.paced_repeats + 1) if "paced" in workloads else 0
    if args.torch_profile and args.torch_profile_workload == "paced" and not n_paced:
        n_paced = args.paced_requests
    prompts = vb.load_prompts(args.model, n_open + args.serve_requests * 2 + n_paced, args.ctx)
    cached, fresh = prompts[:n_open], prompts[n_open:n_open + args.serve_requests * 2]
    paced = [p[: args.serve_len] for p in prompts[n_open + args.serve_requests * 2:]]
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.new_tokens, ignore_eos=True, detokenize=False)
    results: dict = {"args": vars(args), "rows": {}}
    instrument()
    for method in args.methods.split(","):
        runner = {"vegas-v1": "v1", "vegas-v2": "v2"}.get(method)
        args.skip_tokens = args.prefill_skip_tokens if method == "vegas-skip" else 0
        t = time.time()
        llm = build_llm(args.selector if method.startswith("vegas") else "plain", args, runner)
        print(f"[{method}] engine start {time.time() - t:.1f}s", flush=True)
        if cached:  # --open-factor 0 (a paced-only run): no prefix-cached prompts to load
            generate(llm, cached, SamplingParams(max_tokens=1, detokenize=False))  # prefix cache
        generate(llm, (cached or fresh)[: args.batch], SamplingParams(temperature=args.temperature, max_tokens=16,
                                                                      ignore_eos=True, detokenize=False))  # warm-up
        rows = results["rows"].setdefault(method, {})
        for wl in workloads:
            if wl == "closed":
                rows[wl] = run_workload(llm, wl, cached[: args.batch], sp, method)
            elif wl == "open":
                rows[wl] = run_workload(llm, wl, cached, sp, method)
            elif wl == "paced":
                for rep in range(args.paced_repeats):
                    reset_vegas(llm, method)
                    batch = paced[rep * args.paced_requests:(rep + 1) * args.paced_requests]
                    name = wl if args.paced_repeats == 1 else f"paced#{rep}"
                    rows[name] = report(llm, method, name, run_paced(llm, batch, sp, args.paced_rate, seed=rep))
            elif wl == "serve":
                # fresh prompts each time (no prefix-cache hits), cut to --serve-len tokens
                for rep in range(2):
                    batch = [p[: args.serve_len] for p in fresh[rep * args.serve_requests:(rep + 1) * args.serve_requests]]
                    rows[f"serve{rep}"] = run_workload(llm, f"serve#{rep}", batch, sp, method)
        if args.torch_profile:
            from torch.profiler import ProfilerActivity, profile

            wl = args.torch_profile_workload
            if wl == "paced":  # its own fresh prompts (the last --paced-requests loaded), arriving as before
                def work(llm):
                    reset_vegas(llm, method)
                    # under torch.profiler (with_stack): its times are inflated, kept apart from the paced rows
                    results.setdefault("profiled", {})[method] = report(llm, method, "paced (under torch.profiler)", run_paced(
                        llm, paced[-args.paced_requests:], sp, args.paced_rate, seed=args.paced_repeats))
            else:
                if wl == "serve":
                    batch = [p[: args.serve_len - 7] for p in fresh[: args.serve_requests]]  # not cached: new lengths
                else:
                    batch = cached if wl == "open" else cached[: args.batch]

                def work(llm):
                    generate(llm, batch, sp)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
                work(llm)
            ka = prof.key_averages()
            text = ka.table(sort_by="self_cuda_time_total", row_limit=45)
            text += "\n" + ka.table(sort_by="cpu_time_total", row_limit=60)
            # where the host waits for the device (syncs inside a step serialize async scheduling)
            stacks = prof.key_averages(group_by_stack_n=8)
            text += "\n" + stacks.table(sort_by="self_cpu_time_total", row_limit=40)
            trace = out / f"trace_{method}_{wl}.json"
            prof.export_chrome_trace(str(trace))
            if args.no_trace:  # summarised by engine step kind (host and GPU), then deleted
                with open(out / f"steps_{method}_{wl}.txt", "w") as f:
                    summary = [sys.executable, str(Path(__file__).with_name("trace_steps.py")), str(trace), "--top", "90"]
                    subprocess.run(summary, stdout=f, stderr=subprocess.STDOUT, check=False)
                trace.unlink()
            else:
                subprocess.run(["gzip", "-f", str(trace)], check=False)
            (out / f"kernels_{method}.txt").write_text(text)
            print(ka.table(sort_by="self_cuda_time_total", row_limit=22), flush=True)
        (out / "profile.json").write_text(json.dumps(results, indent=1, default=str))
        shutdown_engine(llm)
        del llm
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
