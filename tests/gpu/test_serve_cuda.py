"""``vegas serve`` end to end on CUDA + vLLM: a plain and a Vegas (collect2) OpenAI-compatible
server in subprocesses on free local ports (the embedded model), driven by the ``openai``
client: completions and chat completions, streaming and not, concurrent requests, ``n``,
``stop``, ``max_tokens``, ``seed``, ``logprobs``; Vegas greedy equals plain greedy up to bf16
near-ties; the servers shut down cleanly; bad Vegas settings fail at start, within seconds,
with a clear message. Skips without CUDA, vLLM or openai (openai comes with the vLLM bundle)."""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vegas.serve import ServerError, ServerProcess, free_port, log_tail

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM 0.24.0"),
    pytest.mark.skipif(importlib.util.find_spec("openai") is None, reason="needs the openai client"),
]

REPO = Path(__file__).resolve().parents[2]
NAME = "vegas-tiny"  # --served-model-name
START_S = float(os.environ.get("VEGAS_SERVE_START_S", "420"))  # readiness timeout (compile + graphs)
TIE = 0.125  # a bf16 near-tie: plain's top-2 logprob gap at the first differing token
#: a chat template for the embedded model (it has none): role lines, then the assistant's turn
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
SERVER_ARGS = ["--max-model-len", "4096", "--gpu-memory-utilization", "0.3", "--max-num-seqs", "16",
               "--served-model-name", NAME, "--seed", "0"]


def _vegas_serve(*args: str) -> list[str]:
    return [sys.executable, "-c", "from vegas.cli import main; main()", "serve", *args]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(REPO)) if p)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return env


class Server(ServerProcess):
    """``vegas serve ARGS --port P -- SERVER_ARGS VLLM_ARGS`` in a subprocess; failures fail the test."""

    def __init__(self, label: str, args: list[str], vllm_args: list[str], log: Path):
        port = free_port()
        argv = _vegas_serve(*args, "--port", str(port), "--host", "127.0.0.1", "--", *SERVER_ARGS, *vllm_args)
        super().__init__(label, argv, log, port, env=_env(), cwd=REPO)

    def wait_ready(self, timeout: float = START_S) -> float:
        try:
            return super().wait_ready(timeout)
        except ServerError as e:
            pytest.fail(str(e))

    def stop(self, timeout: float = 60, group_timeout: float = 30) -> int:
        try:
            return super().stop(timeout, group_timeout)
        except ServerError as e:
            pytest.fail(str(e))

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="none", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The plain and the Vegas server, started together (0.3 of the GPU each)."""
    from vegas import DEFAULT_MODEL

    d = tmp_path_factory.mktemp("serve")
    template = d / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    model = str(DEFAULT_MODEL)
    chat = ["--chat-template", str(template)]
    plain = Server("plain", [model, "--selector", "none"], chat, d / "plain.log")
    vegas = Server("vegas", [model, "--selector", "collect2", "-g", "4", "--config", '{"min_kv_budget": 64}'],
                   chat, d / "vegas.log")
    out = {"plain": plain, "vegas": vegas}
    try:
        for s in out.values():
            s.wait_ready()
        yield out
    finally:
        for s in out.values():
            if s.proc.poll() is None:
                s.stop()


def _prompts(n: int = 4, length: int = 1500) -> list[list[int]]:
    """Held-out-style code prompts (the installed click source) as token ids, of several lengths."""
    from transformers import AutoTokenizer

    from vegas import DEFAULT_MODEL
    from vegas.prompts import cut_contexts, package_source

    ids = AutoTokenizer.from_pretrained(DEFAULT_MODEL)(package_source(), add_special_tokens=False).input_ids
    prompts = cut_contexts(ids, length, n)
    return [p[: length - 300 * (i % 3)] for i, p in enumerate(prompts)]


def _greedy(server: Server, prompt, max_tokens: int = 48, **kw):
    """A greedy completion with top-2 logprobs, tokens as ids (``token_id:N``)."""
    return server.client().completions.create(
        model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0.0, logprobs=2,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, **kw).choices[0]


def _assert_equal_up_to_ties(plain_choice, vegas_choice) -> None:
    """Vegas greedy tokens equal plain greedy tokens, or first differ where plain's top-2 logprob
    gap is <= TIE (bf16 near-tie; from there on the two continue different texts)."""
    a, b = plain_choice.logprobs.tokens, vegas_choice.logprobs.tokens
    assert len(a) == len(b)
    if a == b:
        return
    j = next(k for k in range(len(a)) if a[k] != b[k])
    top = sorted(plain_choice.logprobs.top_logprobs[j].values(), reverse=True)
    assert top[0] - top[1] <= TIE, f"differs at token {j} with plain's top-2 gap {top[0] - top[1]}"


def test_completions_greedy_equal_plain_with_logprobs(servers):
    for prompt in _prompts():
        plain, vegas = _greedy(servers["plain"], prompt), _greedy(servers["vegas"], prompt)
        assert vegas.finish_reason == "length" and len(vegas.logprobs.tokens) == 48
        assert all(len(t) == 2 for t in vegas.logprobs.top_logprobs)  # logprobs work with Vegas
        _assert_equal_up_to_ties(plain, vegas)


def test_concurrent_requests_equal_plain(servers):
    """16 requests at once (batched verification, rows refilled as requests end)."""
    prompts = _prompts(16, 1200)
    lengths = [16 + 8 * (i % 5) for i in range(16)]
    with cf.ThreadPoolExecutor(16) as pool:
        vegas = list(pool.map(lambda a: _greedy(servers["vegas"], a[0], a[1]), zip(prompts, lengths)))
    for prompt, n, v in zip(prompts, lengths, vegas):
        assert len(v.logprobs.tokens) == n
        _assert_equal_up_to_ties(_greedy(servers["plain"], prompt, n), v)


def test_vegas_drafts_and_accepts(servers):
    import urllib.request

    with urllib.request.urlopen(servers["vegas"].url + "/metrics", timeout=10) as r:
        metrics = r.read().decode()
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("vllm:spec_decode_num_")}
    assert values.get("vllm:spec_decode_num_draft_tokens_total", 0) > 0, metrics[:2000]
    assert values.get("vllm:spec_decode_num_accepted_tokens_total", 0) > 0


def test_streaming_completion_equals_the_whole_one(servers):
    prompt = _prompts(1)[0]
    for server in servers.values():
        c = server.client()
        whole = c.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0.0).choices[0]
        parts = list(c.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0.0, stream=True))
        assert "".join(p.choices[0].text for p in parts if p.choices) == whole.text
        assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == whole.finish_reason


def test_chat_completions_streaming_and_not(servers):
    messages = [{"role": "user", "content": "def fibonacci(n):"}]
    texts = {}
    for label, server in servers.items():
        c = server.client()
        whole = c.chat.completions.create(model=NAME, messages=messages, max_tokens=32, temperature=0.0,
                                          logprobs=True, top_logprobs=2)
        msg = whole.choices[0]
        assert msg.message.role == "assistant" and whole.usage.completion_tokens <= 32
        stream = c.chat.completions.create(model=NAME, messages=messages, max_tokens=32, temperature=0.0,
                                           stream=True)
        assert "".join((p.choices[0].delta.content or "") for p in stream if p.choices) == msg.message.content
        texts[label] = msg
    plain, vegas = texts["plain"].logprobs.content, texts["vegas"].logprobs.content
    a, b = [t.token for t in plain], [t.token for t in vegas]
    if a != b:
        j = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
        assert j < len(a), "Vegas's chat answer is longer than plain's at equal tokens"
        top = sorted((t.logprob for t in plain[j].top_logprobs), reverse=True)
        assert top[0] - top[1] <= TIE, f"chat differs at token {j} with plain's top-2 gap {top[0] - top[1]}"


def test_max_tokens_stop_n_and_seed(servers):
    c = servers["vegas"].client()
    prompt = _prompts(1)[0]
    full = c.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0.0,
                                extra_body={"ignore_eos": True})
    assert full.usage.completion_tokens == 24 and full.choices[0].finish_reason == "length"
    text = full.choices[0].text
    stop = text[len(text) // 2:][:4]  # a string the greedy output reaches midway
    if stop.strip():
        cut = c.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0.0, stop=[stop],
                                   extra_body={"ignore_eos": True})
        assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
        assert text.startswith(cut.choices[0].text)

    def seeded():
        return servers["vegas"].client().completions.create(
            model=NAME, prompt=prompt, max_tokens=24, temperature=0.8, seed=123, n=2, extra_body={"ignore_eos": True})

    def neighbour(p):
        return servers["vegas"].client().completions.create(
            model=NAME, prompt=p, max_tokens=40, temperature=1.0, extra_body={"ignore_eos": True})

    alone = seeded()
    with cf.ThreadPoolExecutor(4) as pool:  # the same request again, now among unseeded neighbours
        others = [pool.submit(neighbour, p) for p in _prompts(4)[1:]]
        crowded = pool.submit(seeded)
        again = crowded.result()
        [f.result() for f in others]
    texts = [[ch.text for ch in r.choices] for r in (alone, again)]
    assert texts[0] == texts[1], f"seeded request not reproducible among new neighbours: {texts}"
    assert len(alone.choices) == 2 and all(ch.finish_reason == "length" for ch in alone.choices)


def test_servers_shut_down_cleanly(servers):
    """SIGTERM: each server exits (0, or killed by the signal it was sent) and leaves no process."""
    for server in servers.values():
        before = server.log.stat().st_size
        rc = server.stop()
        assert rc in (0, -signal.SIGTERM), f"{server.label} exited with {rc}:\n{log_tail(server.log)}"
        after = server.log.read_bytes()[before:].decode(errors="replace")
        assert "Traceback" not in after, f"{server.label} shutdown log:\n{after[-4000:]}"


def test_bad_settings_fail_before_the_server_starts():
    """vegas serve checks the settings first: exit 2 within seconds, no vLLM process."""
    t0 = time.monotonic()
    r = subprocess.run(_vegas_serve("vegas/model", "--selector", "nope"), capture_output=True, text=True,
                       env=_env(), cwd=REPO, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "'--selector': must be one of" in r.stderr and "got 'nope'" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 60


def test_bad_settings_given_to_vllm_serve_directly_fail_at_start(tmp_path):
    """Settings that reach vLLM unchecked (vllm serve by hand) stop the server at start with the
    proposer's message, instead of leaving a server that never becomes ready."""
    from vegas import DEFAULT_MODEL
    from vegas.serve import plan_serve

    plan = plan_serve(str(DEFAULT_MODEL), port=free_port(), extra_args=SERVER_ARGS)
    i = plan.argv.index("--additional-config")
    plan.argv[i + 1] = '{"vegas": {"selector": "collect2", "granularity": "kv_head"}}'
    log = tmp_path / "bad.log"
    t0 = time.monotonic()
    proc = subprocess.Popen(plan.argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=_env(), cwd=REPO,
                            start_new_session=True)
    try:
        rc = proc.wait(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the server with bad settings did not exit within 240 s; log tail:\n{log_tail(log)}")
    assert rc != 0
    assert "per layer only" in log.read_text(errors="replace"), log_tail(log)
    print(f"bad settings: exit {rc} after {time.monotonic() - t0:.0f} s")
