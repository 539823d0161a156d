"""``scripts/trace_steps.py``: a torch-profiler trace summarised by engine step kind, host and GPU.

A synthetic trace checks the GPU attribution (a device event belongs to the step whose runtime
call has its correlation id; a CUDA graph's kernels to the step that replayed it; work launched
outside every step is left out); a real CPU profiler run through ``scripts/vllm_profile.py``'s
timeline (a stand-in ``Worker``) checks that each step's span is annotated with its kind and
grouped by it."""

from __future__ import annotations

import gzip
import json
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch

from tests.conftest import load_script


@pytest.fixture(scope="module")
def ts():
    return load_script("trace_steps")


def _ev(cat, name, ts, dur, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def _trace():
    ev = [
        _ev("user_annotation", "vegas step: prefill", 0, 100),
        _ev("cuda_runtime", "cudaLaunchKernel", 10, 2, corr=1),
        _ev("cuda_runtime", "cudaGraphLaunch", 50, 3, corr=2),
        _ev("user_annotation", "vegas step: decode", 200, 40),
        _ev("cuda_runtime", "cudaLaunchKernel", 210, 2, corr=3),
        _ev("user_annotation", "vegas step: prefill", 300, 120),
        _ev("cuda_runtime", "cudaLaunchKernel", 310, 2, corr=4),
        _ev("cuda_runtime", "cudaMemcpyAsync", 320, 2, corr=5),
        _ev("cuda_runtime", "cudaLaunchKernel", 500, 2, corr=6),  # outside every step
        # device side (its own clock: later than the launches)
        _ev("kernel", "flash_fwd", 20, 30, corr=1),
        _ev("kernel", "draft_gemm", 60, 5, corr=2),  # two kernels of one graph replay
        _ev("kernel", "draft_gemm", 70, 5, corr=2),
        _ev("kernel", "decode_attn", 215, 4, corr=3),
        _ev("kernel", "flash_fwd", 330, 50, corr=4),
        _ev("gpu_memcpy", "Memcpy HtoD", 390, 2, corr=5),
        _ev("kernel", "stray", 510, 1000, corr=6),
        _ev("kernel", "no_correlation", 20, 1000),
    ]
    return ev


def test_gpu_work_goes_to_the_step_that_launched_it(ts):
    events = _trace()
    groups, annotated = ts.step_groups(events, 20.0)
    assert annotated and [label for label, _ in groups] == ["decode steps", "prefill steps"]
    windows = dict(groups)
    assert windows["prefill steps"] == [(0, 100), (300, 420)]
    total, by_name, calls = ts.gpu_by_step(events, windows["prefill steps"])
    assert total == 30 + 5 + 5 + 50 + 2
    assert by_name == {"flash_fwd": 80, "draft_gemm": 10, "Memcpy HtoD": 2}
    assert calls == {"flash_fwd": 2, "draft_gemm": 2, "Memcpy HtoD": 1}
    total, by_name, _ = ts.gpu_by_step(events, windows["decode steps"])
    assert (total, dict(by_name)) == (4, {"decode_attn": 4})
    lines = ts.gpu_lines(events, windows["prefill steps"], top=5)
    assert lines[0].strip().startswith("GPU launched by these steps: 0.046 ms/step")
    assert "flash_fwd" in lines[1] and "0.040 ms/step" in lines[1]


def test_without_annotations_steps_split_long_and_short(ts):
    step = ts.STEP
    events = [_ev("user_annotation", step, t, 1) for t in (0, 30_000, 31_000, 80_000)]
    groups, annotated = ts.step_groups(events, 20.0)
    assert not annotated
    long, short = dict(groups)["steps >= 20.0 ms"], dict(groups)["steps < 20.0 ms"]
    assert long == [(1, 30_001), (31_001, 80_001)] and short == [(30_001, 31_001)]


def test_main_prints_host_and_gpu_by_kind(ts, tmp_path, capsys, monkeypatch):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    monkeypatch.setattr(sys, "argv", ["trace_steps.py", str(path), "--top", "3"])
    assert ts.main() == 0
    out = capsys.readouterr().out
    assert "prefill steps: 2 steps, mean host 0.11 ms" in out and "decode steps: 1 steps" in out
    assert "GPU launched by these steps: 0.004 ms/step" in out  # the decode step's one kernel
    assert "stray" not in out and "no_correlation" not in out


class _Event:  # torch.cuda.Event on a machine without CUDA
    def __init__(self, **kw):
        pass

    def record(self):
        pass


def test_timeline_annotates_each_step_with_its_kind(ts, tmp_path, monkeypatch):
    """The timeline's wrappers on a stand-in ``Worker`` under a real (CPU) torch profiler: every
    step's span from ``execute_model`` to the end of ``sample_tokens`` is one annotation named by
    its kind, and a step whose ``execute_model`` is not followed by ``sample_tokens`` is closed
    by the next step."""
    class Worker:
        def execute_model(self, scheduler_output):
            torch.ones(4).sum()

        def sample_tokens(self, grammar_output):
            torch.ones(4).mul(2)

    mod = ModuleType("vllm.v1.worker.gpu_worker")
    mod.Worker = Worker
    for name in ("vllm", "vllm.v1", "vllm.v1.worker"):
        monkeypatch.setitem(sys.modules, name, ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_worker", mod)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    vp = load_script("vllm_profile")
    vp.instrument()

    def so(tokens: dict[str, int], drafts: int = 0):
        spec = {r: [7] * drafts for r in tokens}
        return SimpleNamespace(num_scheduled_tokens=tokens, scheduled_spec_decode_tokens=spec,
                               total_num_scheduled_tokens=sum(tokens.values()))

    w = Worker()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        w.execute_model(so({"a": 600}))  # prefill
        w.sample_tokens(None)
        torch.arange(5)  # between two steps: in no step's span
        w.execute_model(so({"a": 1, "b": 300}))  # mixed, no sample_tokens
        w.execute_model(so({"a": 1, "b": 1}))  # decode, one token a request
        w.sample_tokens(None)
        w.execute_model(so({"a": 3, "b": 3}, drafts=2))  # decode, verifying 2 drafts a request
        w.sample_tokens(None)
    trace = tmp_path / "t.json"
    prof.export_chrome_trace(str(trace))
    vp.STEPS.clear()
    events = ts.load(str(trace))
    groups, annotated = ts.step_groups(events, 20.0)
    assert annotated
    assert {label: len(ws) for label, ws in groups} == {"decode q1 steps": 1, "decode steps": 1, "mixed steps": 1,
                                                          "prefill steps": 1}
    spans = sorted(w for _, ws in groups for w in ws)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # disjoint, in order
    between = [e["ts"] for e in events if e["name"] == "aten::arange"]
    assert between and not any(a <= t <= b for t in between for a, b in spans)
