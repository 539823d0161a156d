"""Where the host time of long engine steps goes: a torch-profiler chrome trace summarised by step.

Reads a trace written by ``scripts/vllm_profile.py --torch-profile`` (``trace_<method>_<workload>.json.gz``),
takes the engine steps (from one ``llm_engine step: get_output`` end to the next; in-process engine) longer than
``--long-ms`` and those shorter, and prints for each group the inclusive time per step of the
Python functions and CPU ops inside them (top ``--top``), so that a slow kind of step can be read
function by function. Device only in practice (the traces are too large to copy back).

    python3 scripts/trace_steps.py trace_vegas_open.json.gz --long-ms 20
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict

STEP = "llm_engine step: get_output"


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def summarise(events: list[dict], windows: list[tuple[float, float]], top: int) -> list[str]:
    """Inclusive µs per window of each (category, name) whose span starts inside a window."""
    if not windows:
        return ["  (no steps)"]
    starts = [w[0] for w in windows]
    total: dict = defaultdict(float)
    count: dict = defaultdict(int)
    for e in events:
        if e.get("cat") not in ("python_function", "cpu_op", "user_annotation", "cuda_runtime"):
            continue
        ts = e["ts"]
        i = bisect.bisect_right(starts, ts) - 1
        if i < 0 or ts > windows[i][1]:
            continue
        key = (e["cat"], e["name"][:110])
        total[key] += e.get("dur", 0.0)
        count[key] += 1
    n = len(windows)
    rows = sorted(total.items(), key=lambda kv: -kv[1])[:top]
    return [f"  {t / n / 1e3:8.3f} ms/step  {count[k] / n:7.1f} calls/step  {k[0][:6]}  {k[1]}" for k, t in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--long-ms", type=float, default=20.0)
    ap.add_argument("--top", type=int, default=45)
    args = ap.parse_args()
    events = load(args.trace)
    ends = sorted(e["ts"] + e["dur"] for e in events if e["name"] == STEP)
    steps = list(zip(ends[:-1], ends[1:]))  # one engine step: from the last output to the next
    long = [w for w in steps if w[1] - w[0] >= args.long_ms * 1e3]
    short = [w for w in steps if w[1] - w[0] < args.long_ms * 1e3]
    for label, group in ((f"steps >= {args.long_ms} ms", long), (f"steps < {args.long_ms} ms", short)):
        mean = sum(b - a for a, b in group) / len(group) / 1e3 if group else 0.0
        print(f"{label}: {len(group)} steps, mean {mean:.2f} ms")
        print("\n".join(summarise(events, group, args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
