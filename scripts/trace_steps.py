"""Where the time of engine steps goes: a torch-profiler chrome trace summarised by step.

Reads a trace written by ``scripts/vllm_profile.py --torch-profile`` (``trace_<method>_<workload>.json.gz``).
Steps: the ``vegas step: <kind>`` annotations that script's timeline wraps around each engine step
(``execute_model`` to the end of ``sample_tokens``; kind ``prefill`` = every request in prefill,
``mixed``, ``decode``), grouped by kind; in a trace without them, the engine steps (from one
``llm_engine step: get_output`` end to the next; in-process engine) longer than ``--long-ms`` and those
shorter. For each group it prints:

* host: the inclusive time per step of the Python functions and CPU ops inside the steps (top ``--top``);
* GPU (annotated steps only): per step, the kernels, copies and memsets that a step launched (matched by
  the profiler's correlation id to the runtime call inside the step; a CUDA graph's kernels belong to
  the step that replayed it), their summed time and the top ``--top`` by name. Kernels on two streams
  may overlap, so the sum can exceed the step's GPU span.

Device only in practice (the traces are too large to copy back)::

    python3 scripts/trace_steps.py trace_vegas_paced.json.gz --long-ms 20
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict

STEP = "llm_engine step: get_output"
KIND = "vegas step: "  # the timeline's annotation prefix (scripts/vllm_profile.py)
HOST_CATS = ("python_function", "cpu_op", "user_annotation", "cuda_runtime")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")

Window = tuple[float, float]


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def _locate(starts: list[float], windows: list[Window], ts: float) -> int:
    """Index of the window holding host time ``ts``, or -1 (windows sorted and disjoint)."""
    i = bisect.bisect_right(starts, ts) - 1
    return i if i >= 0 and ts <= windows[i][1] else -1


def summarise(events: list[dict], windows: list[Window], top: int) -> list[str]:
    """Inclusive µs per window of each (category, name) whose span starts inside a window."""
    if not windows:
        return ["  (no steps)"]
    starts = [w[0] for w in windows]
    total: dict = defaultdict(float)
    count: dict = defaultdict(int)
    for e in events:
        if e.get("cat") not in HOST_CATS or _locate(starts, windows, e["ts"]) < 0:
            continue
        key = (e["cat"], e["name"][:110])
        total[key] += e.get("dur", 0.0)
        count[key] += 1
    n = len(windows)
    rows = sorted(total.items(), key=lambda kv: -kv[1])[:top]
    return [f"  {t / n / 1e3:8.3f} ms/step  {count[k] / n:7.1f} calls/step  {k[0][:6]}  {k[1]}" for k, t in rows]


def gpu_by_step(events: list[dict], windows: list[Window]) -> tuple[float, dict[str, float], dict[str, int]]:
    """GPU work launched inside ``windows``: (summed µs, µs by name, count by name). A device event
    belongs to the window that holds the host runtime call with its correlation id."""
    starts = [w[0] for w in windows]
    launched_in = {}
    for e in events:
        corr = (e.get("args") or {}).get("correlation")
        if e.get("cat") in LAUNCH_CATS and corr is not None:
            launched_in[corr] = _locate(starts, windows, e["ts"])
    total, by_name, calls = 0.0, defaultdict(float), defaultdict(int)
    for e in events:
        if e.get("cat") not in GPU_CATS:
            continue
        if launched_in.get((e.get("args") or {}).get("correlation"), -1) < 0:
            continue
        dur = e.get("dur", 0.0)
        total += dur
        by_name[e["name"][:110]] += dur
        calls[e["name"][:110]] += 1
    return total, by_name, calls


def gpu_lines(events: list[dict], windows: list[Window], top: int) -> list[str]:
    if not windows:
        return []
    n = len(windows)
    total, by_name, calls = gpu_by_step(events, windows)
    lines = [f"  GPU launched by these steps: {total / n / 1e3:.3f} ms/step (kernels, copies, memsets)"]
    for name, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {t / n / 1e3:8.3f} ms/step  {calls[name] / n:7.1f} calls/step  gpu     {name}")
    return lines


def step_groups(events: list[dict], long_ms: float) -> tuple[list[tuple[str, list[Window]]], bool]:
    """``([(label, windows)], annotated)``: the annotated steps by kind, else long and short steps."""
    kinds: dict[str, list[Window]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "user_annotation" and e["name"].startswith(KIND):
            kinds[e["name"][len(KIND):]].append((e["ts"], e["ts"] + e.get("dur", 0.0)))
    if kinds:
        return [(f"{kind} steps", sorted(ws)) for kind, ws in sorted(kinds.items())], True
    ends = sorted(e["ts"] + e["dur"] for e in events if e["name"] == STEP)
    steps = list(zip(ends[:-1], ends[1:]))  # one engine step: from the last output to the next
    long = [w for w in steps if w[1] - w[0] >= long_ms * 1e3]
    short = [w for w in steps if w[1] - w[0] < long_ms * 1e3]
    return [(f"steps >= {long_ms} ms", long), (f"steps < {long_ms} ms", short)], False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--long-ms", type=float, default=20.0, help="long/short split of a trace without step annotations")
    ap.add_argument("--top", type=int, default=45)
    args = ap.parse_args()
    events = load(args.trace)
    groups, annotated = step_groups(events, args.long_ms)
    for label, group in groups:
        mean = sum(b - a for a, b in group) / len(group) / 1e3 if group else 0.0
        print(f"{label}: {len(group)} steps, mean host {mean:.2f} ms")
        print("\n".join(summarise(events, group, args.top)))
        if annotated:
            print("\n".join(gpu_lines(events, group, args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
