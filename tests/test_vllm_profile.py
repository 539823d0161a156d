"""``scripts/vllm_profile.py``'s paced workload on a CPU: Poisson arrivals fed to a stand-in
engine, each request's TTFT split into the wait before its prefill step, the prefill step and
the time after it (the parts must add up to the TTFT, and a request whose first token comes
later than its prefill step must show that lag)."""

from __future__ import annotations

import os
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


class StandInEngine:
    """``LLMEngine``'s add_request / has_unfinished_requests / step: each step prefills the
    requests added since the last one (internal ids ``<id>-<random>``, as vLLM 0.24 assigns),
    takes ``step_s``, and hands out a request's first token ``lag`` steps after its prefill."""

    def __init__(self, steps: list, step_s: float, lag: int, new_tokens: int) -> None:
        self.steps, self.step_s, self.lag, self.new_tokens = steps, step_s, lag, new_tokens
        self.waiting: list[str] = []
        self.age: dict[str, int] = {}

    def add_request(self, rid, prompt, params):
        self.waiting.append(f"{rid}-1a2b3c4d")
        return self.waiting[-1]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.age)

    def step(self):
        rec = {"t0": time.perf_counter(), "new_ids": self.waiting, "reqs": len(self.age) + len(self.waiting),
               "prefill_reqs": len(self.waiting), "tokens": 0, "draft_tokens": 0}
        self.steps.append(rec)
        for r in self.waiting:
            self.age[r] = 0
        self.waiting = []
        time.sleep(self.step_s)
        rec["t1"] = time.perf_counter()
        outs = []
        for r in list(self.age):
            emitted = max(0, self.age[r] - self.lag + 1)
            self.age[r] += 1
            done = emitted >= self.new_tokens
            if done:
                del self.age[r]
            outs.append(SimpleNamespace(request_id=r.split("-")[0], finished=done,
                                        outputs=[SimpleNamespace(token_ids=list(range(emitted)))]))
        return outs


@pytest.mark.parametrize("lag", [0, 2])
def test_paced_ttft_parts_add_up_and_show_the_lag(vp, lag):
    step_s = 0.004
    llm = SimpleNamespace(llm_engine=StandInEngine(vp.STEPS, step_s, lag, new_tokens=3))
    res = vp.run_paced(llm, [[1, 2, 3]] * 8, None, rate=100.0)
    assert res["requests_timed"] == 8 and res["rate"] == 100.0
    parts = res["wait_mean_ms"] + res["prefill_step_mean_ms"] + res["after_step_mean_ms"]
    assert res["ttft_mean_ms"] == pytest.approx(parts, rel=1e-9)
    assert res["wait_mean_ms"] >= 0 and res["prefill_step_mean_ms"] >= step_s * 1e3 * 0.9
    if lag == 0:  # the token leaves with its prefill step
        assert res["after_step_mean_ms"] < step_s * 1e3
    else:  # two more steps before the first token
        assert res["after_step_mean_ms"] >= lag * step_s * 1e3 * 0.9
