"""``scripts/vllm_profile.py``'s paced workload on a CPU: Poisson arrivals fed to a stand-in
engine, each request's TTFT split into the wait before its first prefill step, its prefill steps
(every chunk) and the time after them (the parts must add up to the TTFT, chunks must be counted,
and a request whose first token comes later than its prefill must show that lag)."""

from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def vp():
    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CUSTOM_SCOPES_FOR_PROFILING")}
    mod = load_script("vllm_profile")
    yield mod
    for k, v in saved.items():  # the script sets vLLM's environment for its own process
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def fake_vllm(monkeypatch):
    """``vllm.sampling_params.RequestOutputKind`` without vLLM (not installed on CPU machines)."""
    kinds = SimpleNamespace(CUMULATIVE="cumulative", FINAL_ONLY="final_only")
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace())
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", SimpleNamespace(RequestOutputKind=kinds))
    return kinds


class Params(SimpleNamespace):
    def clone(self):
        return Params(**vars(self))


class StandInEngine:
    """``LLMEngine``'s add_request / has_unfinished_requests / step: a request waits for the next
    step, is prefilled over ``chunks`` steps (internal ids ``<id>-<random>``, as vLLM 0.24
    assigns), each step takes ``step_s``, and its first token is handed out ``lag`` steps after
    its last prefill step."""

    def __init__(self, steps: list, step_s: float, lag: int, chunks: int, new_tokens: int) -> None:
        self.steps, self.step_s, self.lag, self.chunks, self.new_tokens = steps, step_s, lag, chunks, new_tokens
        self.waiting: list[str] = []
        self.age: dict[str, int] = {}
        self.kinds: set = set()

    def add_request(self, rid, prompt, params):
        self.kinds.add(params.output_kind)
        self.waiting.append(f"{rid}-1a2b3c4d")
        return self.waiting[-1]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.age)

    def step(self):
        for r in self.waiting:
            self.age[r] = 0
        self.waiting = []
        prefilling = [r for r, a in self.age.items() if a < self.chunks]
        rec = {"t0": time.perf_counter(), "prefill_ids": prefilling, "reqs": len(self.age),
               "prefill_reqs": len(prefilling), "tokens": 0, "draft_tokens": 0}
        self.steps.append(rec)
        time.sleep(self.step_s)
        rec["t1"] = time.perf_counter()
        outs = []
        for r in list(self.age):
            emitted = max(0, self.age[r] - (self.chunks - 1) - self.lag + 1)
            self.age[r] += 1
            done = emitted >= self.new_tokens
            if done:
                del self.age[r]
            outs.append(SimpleNamespace(request_id=r.split("-")[0], finished=done,
                                        outputs=[SimpleNamespace(token_ids=list(range(emitted)))]))
        return outs


@pytest.mark.parametrize("lag, chunks", [(0, 1), (2, 1), (0, 3)])
def test_paced_ttft_parts_add_up_count_chunks_and_show_the_lag(vp, fake_vllm, lag, chunks):
    step_s = 0.02
    engine = StandInEngine(vp.STEPS, step_s, lag, chunks, new_tokens=3)
    sp = Params(output_kind=fake_vllm.FINAL_ONLY)  # as LLM.generate leaves a shared SamplingParams
    res = vp.run_paced(SimpleNamespace(llm_engine=engine), [[1, 2, 3]] * 6, sp, rate=50.0)
    assert engine.kinds == {fake_vllm.CUMULATIVE} and sp.output_kind == fake_vllm.FINAL_ONLY
    assert res["requests_timed"] == 6 and res["rate"] == 50.0
    parts = res["wait_mean_ms"] + res["prefill_mean_ms"] + res["after_prefill_mean_ms"]
    assert res["ttft_mean_ms"] == pytest.approx(parts, rel=1e-9)
    assert res["prefill_chunks_mean"] == chunks
    assert res["wait_mean_ms"] >= 0 and res["prefill_mean_ms"] >= chunks * step_s * 1e3 * 0.9
    if lag == 0:  # the token leaves with its last prefill step
        assert res["after_prefill_mean_ms"] < step_s * 1e3
    else:  # two more steps before the first token
        assert res["after_prefill_mean_ms"] >= lag * step_s * 1e3 * 0.9
