"""``scripts/serve_bench.py`` on a CPU: the server and ``vllm bench serve`` commands per method,
result parsing, the table and the plots on fake vLLM result files; and
:class:`vegas.serve.ServerProcess` (readiness, a server that dies, clean stop) on a stand-in
HTTP server."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from tests.conftest import load_script
from vegas.serve import ServerError, ServerProcess, free_port

@pytest.fixture(scope="module")
def sb():
    return load_script("serve_bench")


def _fake_result(method, rate, tpot, throughput, tau=None):
    r = {"method": method, "request_rate": rate, "completed": 8, "failed": 0, "mean_ttft_ms": 120.0,
         "p99_ttft_ms": 300.0, "mean_tpot_ms": tpot, "p99_tpot_ms": tpot * 1.5, "output_throughput": throughput,
         "request_throughput": 1.0, "input_lens": [6000] * 8, "mean_e2el_ms": 1e6 / throughput}
    if tau is not None:
        r["spec_decode_acceptance_length"] = tau
    return r


def _fake_servers_and_client(sb, monkeypatch) -> list[list[str]]:
    """run() without vLLM or a GPU: servers that are ready at once, a client that records the
    ``vllm bench serve`` commands it is given (the returned list) and writes no result."""
    import types

    import vegas.backends.vllm as vb

    monkeypatch.setattr(vb, "vllm_installed", lambda: True)
    sent = []

    class FakeServer:
        def __init__(self, label, argv, log, port, env=None, cwd=None):
            self.argv, self.log, self.proc = argv, log, types.SimpleNamespace(poll=lambda: None, returncode=None)
            log.write_text("")

        def wait_ready(self, timeout):
            return 0.0

        def stop(self):
            pass

    monkeypatch.setattr(sb, "ServerProcess", FakeServer)
    monkeypatch.setattr(sb, "run_client", lambda argv, log, timeout: sent.append(argv) or 0)
    return sent


def opt(argv: list[str], flag: str) -> str:
    """The value after ``flag`` in a command."""
    return argv[argv.index(flag) + 1]


def _model(tmp_path, context: int) -> str:
    """A model directory whose config says ``context`` positions (SmolLM2: 8,192)."""
    d = tmp_path / f"model-{context}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": context}))
    return str(d)


def test_commands_per_method(sb, tmp_path):
    m = _model(tmp_path, 32768)
    args = sb.parse_args(["--model", m, "-g", "3", "--rates", "2,inf"])
    assert args.rates == [2.0, math.inf]
    plain = sb.server_argv("plain", args, 9000)
    assert plain[3:7] == ["serve", m, "--selector", "none"] and "--speculative-config" not in plain
    # vllm: plain's command, with no vllm.general_plugins loaded (Vegas' patches not installed)
    assert sb.server_argv("vllm", args, 9000) == plain
    assert sb.method_env("vllm", {"A": "1"}) == {"A": "1", "VLLM_PLUGINS": ""}
    assert sb.method_env("plain", {"A": "1"}) == {"A": "1"} == sb.method_env("collect2", {"A": "1"})
    assert sb.compile_family("vllm") == sb.compile_family("plain")  # never started at once
    ngram = sb.server_argv("ngram", args, 9000)
    spec = json.loads(ngram[ngram.index("--speculative-config") + 1])
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 3
    vegas = sb.server_argv("sliding_window", args, 9000)
    assert vegas[vegas.index("--selector") + 1] == "sliding_window" and vegas[vegas.index("-g") + 1] == "3"
    bench = sb.bench_argv("collect2", math.inf, args, 9000, Path("/r"), None)
    assert bench[bench.index("--request-rate") + 1] == "inf"
    assert bench[bench.index("--result-filename") + 1] == "collect2_rinf_k0.json"
    assert bench[bench.index("--dataset-name") + 1] == "random" and "--ignore-eos" in bench
    assert int(bench[bench.index("--random-input-len") + 1]) == 6000  # 4.8K-7.2K: 6000 x (1 ± 0.2)
    code = sb.bench_argv("plain", 2.0, args, 9000, Path("/r"), Path("/p.jsonl"))
    assert code[code.index("--dataset-name") + 1] == "custom" and "--skip-chat-template" in code
    assert bench[bench.index("--num-prompts") + 1] == code[code.index("--num-prompts") + 1] == "64"
    # --num-prompts-inf: more requests at rate inf only
    more = sb.parse_args(["--model", m, "--rates", "2,inf", "--num-prompts-inf", "256"])
    inf = sb.bench_argv("collect2", math.inf, more, 9000, Path("/r"), None)
    two = sb.bench_argv("collect2", 2.0, more, 9000, Path("/r"), None)
    assert inf[inf.index("--num-prompts") + 1] == "256" and two[two.index("--num-prompts") + 1] == "64"


def test_every_timed_run_sends_prompts_of_its_own_the_same_for_every_method(sb, tmp_path, capsys):
    """vLLM's prefix cache would otherwise hold a repeat's prompts (the 2026-12-02 serve runs sent
    the same 64 prompts every time: ~86 % prefix-cache hits, no prefill measured)."""
    args = sb.parse_args(["--model", _model(tmp_path, 32768), "--rates", "4,16,inf", "--repeats", "3"])

    def seed(argv):
        return int(argv[argv.index("--seed") + 1])

    runs = [(rate, rep) for rep in range(3) for rate in args.rates]
    seeds = [seed(sb.bench_argv("plain", rate, args, 9000, Path("/r"), None, rep)) for rate, rep in runs]
    assert len(set(seeds)) == len(runs) and args.seed not in seeds  # the warm-up's seed is its own
    for rate, rep in runs:
        assert seed(sb.bench_argv("collect2", rate, args, 9001, Path("/r"), None, rep)) == \
            seed(sb.bench_argv("plain", rate, args, 9000, Path("/r"), None, rep))
    warm = sb.bench_argv("plain", math.inf, args, 9000, Path("/w"), None, seed=args.seed,
                         num_prompts=args.warmup_prompts)
    assert seed(warm) == 0 and warm[warm.index("--num-prompts") + 1] == "16"
    with pytest.raises(SystemExit):
        sb.parse_args(["--model", args.model, "--warmup-prompts", "-1"])
    assert "--warmup-prompts must be an integer >= 0" in capsys.readouterr().err


def test_max_model_len_is_derived_from_the_requests_within_the_model_context(sb, tmp_path, capsys):
    """The default prompts (6000 x (1 ± 0.2)) + 256 output need 7456 tokens: 7680 with the margin,
    on a 32K model and on SmolLM2's 8,192 alike; longer prompts do not fit SmolLM2, and the error
    says which options to lower."""
    big, smol = _model(tmp_path, 32768), _model(tmp_path, 8192)
    args = sb.parse_args(["--model", big])
    assert args.max_model_len == 7680
    server = sb.server_argv("collect2", args, 9000)
    assert server[server.index("--max-model-len") + 1] == "7680"
    assert sb.parse_args(["--model", smol]).max_model_len == 7680
    with pytest.raises(SystemExit):
        sb.parse_args(["--model", smol, "--input-len", "6144", "--range-ratio", "0.333"])
    err = capsys.readouterr().err
    assert "8446 tokens) exceeds the model's context of 8192 tokens; lower --input-len" in err
    assert sb.parse_args(["--model", smol, "--input-len", "7000", "--range-ratio", "0.1"]).max_model_len == 8192
    assert sb.parse_args(["--model", big, "--max-model-len", "9000"]).max_model_len == 9000  # given: kept
    for bad, match in ((["--max-model-len", "4096"], "does not fit --max-model-len 4096"),
                       (["--max-model-len", "40000"], "exceeds the model's context of 32768")):
        with pytest.raises(SystemExit):
            sb.parse_args(["--model", big, *bad])
        assert match in capsys.readouterr().err


def test_model_names_and_missing_models(sb, tmp_path, capsys):
    """--model is resolved as vegas resolves it; a missing one fails with Pipeline's message."""
    with pytest.raises(SystemExit):
        sb.parse_args(["--model", str(tmp_path / "nope")])
    assert "does not exist; model must be a model name" in capsys.readouterr().err
    assert sb.parse_args(["--report", "x", "--model", "nope"]).model == "nope"  # --report reads files only


def test_results_table_and_plots(sb, tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    for method, tau in (("plain", None), ("collect2", 3.1), ("ngram", 1.4)):
        for i, rate in enumerate((1.0, 4.0, "inf")):
            for k, scale in enumerate((1.0, 1.2, 0.9)):  # three repeats: the table gives medians
                speed = 500.0 * (i + 1) * scale * (1.5 if method == "collect2" else 1.0)
                (raw / f"{method}_r{sb.rate_label(rate)}_k{k}.json").write_text(
                    json.dumps(_fake_result(method, rate, 10.0 + i, speed, tau)))
    table = sb.report(tmp_path)
    lines = table.splitlines()
    assert lines[0].startswith("| method | rate | repeats | done | failed | TTFT mean ms")
    assert lines[0].endswith("| out tok/s min-max | x plain | TTFT x plain | TPOT x plain | E2E x plain |")
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| plain"] * 3 + ["| collect2"] * 3 + ["| ngram"] * 3
    assert [line.split(" | ")[1] for line in lines[2:5]] == ["1", "4", "inf"]  # rates in order, inf last
    assert "| 3.10 |" in lines[5] and "| - | 450-600 | 1.00x |" in lines[2]  # τ where the server reports it
    # spread of the repeats; ratios to plain within each repeat, each repeat's in brackets
    assert lines[5].endswith("| 675-900 | 1.50x (1.50, 1.50, 1.50) | 1.00x (1.00, 1.00, 1.00) "
                             "| 1.00x (1.00, 1.00, 1.00) | 0.67x (0.67, 0.67, 0.67) |")
    rows = json.loads((tmp_path / "summary.json").read_text())
    assert rows[4]["method"] == "collect2" and rows[4]["output_throughput"] == 1500.0 and rows[4]["repeats"] == 3
    for name in ("throughput_vs_rate.png", "tpot_vs_rate.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "table.md").read_text().strip() == table


def test_ratios_to_plain_pair_repeats(sb, tmp_path):
    """A ratio is the median of per-repeat ratios (same _k<N>: same prompts, same servers), not the
    ratio of medians; a repeat that plain lacks is left out of it; files without _k<N> fall back to
    the ratio of the medians."""
    raw = tmp_path / "raw"
    raw.mkdir()
    for k, (p, c) in enumerate(((100.0, 150.0), (200.0, 200.0), (300.0, 330.0))):
        (raw / f"plain_r4_k{k}.json").write_text(json.dumps(_fake_result("plain", 4.0, 10.0, p)))
        (raw / f"collect2_r4_k{k}.json").write_text(json.dumps(_fake_result("collect2", 4.0, 10.0, c)))
    (raw / "collect2_r4_k7.json").write_text(json.dumps(_fake_result("collect2", 4.0, 10.0, 10.0)))
    rows = {r["method"]: r for r in sb.load_results(raw)}
    c2 = rows["collect2"]
    assert c2["repeats"] == 4 and c2["x_plain_repeats"] == pytest.approx([1.5, 1.0, 1.1])
    assert c2["x_plain"] == pytest.approx(1.1)  # the ratio of medians would be 175 / 200
    assert "| 1.10x (1.50, 1.00, 1.10) |" in sb.render_table(list(rows.values()))
    unpaired = tmp_path / "unpaired"
    unpaired.mkdir()
    (unpaired / "a.json").write_text(json.dumps(_fake_result("plain", 4.0, 10.0, 200.0)))
    (unpaired / "b.json").write_text(json.dumps(_fake_result("collect2", 4.0, 10.0, 300.0)))
    c2 = {r["method"]: r for r in sb.load_results(unpaired)}["collect2"]
    assert c2["x_plain"] == pytest.approx(1.5) and c2["x_plain_repeats"] == []


def test_report_without_results_says_so(sb, tmp_path):
    (tmp_path / "raw").mkdir()
    with pytest.raises(SystemExit, match="no vllm bench serve results"):
        sb.report(tmp_path)


def _http_server(tmp_path, delay: float = 0.0):
    """A stand-in server: ``python -m http.server`` serving a ``health`` file after ``delay`` s."""
    (tmp_path / "health").write_text("ok")
    port = free_port()
    code = (f"import time, http.server, functools; time.sleep({delay}); "
            f"h = functools.partial(http.server.SimpleHTTPRequestHandler, directory={str(tmp_path)!r}); "
            f"http.server.ThreadingHTTPServer(('127.0.0.1', {port}), h).serve_forever()")
    return ServerProcess("stand-in", [sys.executable, "-c", code], tmp_path / "log.txt", port)


def test_server_process_ready_and_stopped(tmp_path):
    server = _http_server(tmp_path, delay=0.5)
    assert server.wait_ready(30) >= 0
    server.stop(10)  # SIGTERM: the stand-in dies of it, and its group is gone
    assert server.proc.poll() is not None


def test_server_process_that_exits_names_its_log(tmp_path):
    log = tmp_path / "log.txt"
    server = ServerProcess("broken", [sys.executable, "-c", "print('bad setting X'); raise SystemExit(3)"], log,
                           free_port())
    with pytest.raises(ServerError, match=r"(?s)broken server exited with 3 before it was ready.*bad setting X"):
        server.wait_ready(30)


def test_server_process_not_ready_in_time_is_killed(tmp_path):
    server = _http_server(tmp_path, delay=60)
    with pytest.raises(ServerError, match="was not ready within 2 s"):
        server.wait_ready(2)
    assert server.proc.poll() is not None


def test_skip_methods_and_shared_gpu(sb, tmp_path):
    """``collect2-skip`` is collect2 with vllm.prefill_skip_tokens (merged into --config); all
    servers run at once, each with its share of --gpu-memory-utilization."""
    args = sb.parse_args(["--model", _model(tmp_path, 8192), "--methods", "plain,collect2,collect2-skip",
                          "--prefill-skip-tokens", "1024", "--config", '{"vllm": {"draft_cuda_graphs": true}}'])
    opts, extra = sb.method_args("collect2-skip", args)
    assert opts[:2] == ["--selector", "collect2"] and not extra
    assert json.loads(opts[opts.index("--config") + 1]) == {
        "vllm": {"draft_cuda_graphs": True, "prefill_skip_tokens": 1024}}
    assert "prefill_skip_tokens" not in sb.method_args("collect2", args)[0][-1]
    argv = sb.server_argv("plain", args, 8000, 0.85 / 3)
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.283"
    log = tmp_path / "server.log"
    log.write_text("INFO ... GPU KV cache size: 1,234,567 tokens\n")
    assert sb.kv_cache_tokens(log) == 1234567 and sb.kv_cache_tokens(tmp_path / "none.log") is None


def test_bad_arguments_fail_before_any_server(sb, tmp_path, capsys):
    model = _model(tmp_path, 8192)
    for argv, text in ((["--methods", "bogus"], "--methods: unknown bogus; allowed: plain, vllm, ngram"),
                       (["--rates", "0,abc"], "must be comma-separated request rates > 0 or inf"),
                       (["--repeats", "0"], "--repeats must be an integer >= 1"),
                       (["--num-prompts", "0"], "--num-prompts must be an integer >= 1"),
                       (["--num-prompts-inf", "0"], "--num-prompts-inf must be an integer >= 1"),
                       (["--sparsity-ratio", "1.5"], "--sparsity-ratio must be in (0, 1]"),
                       (["--kv-cache-gib", "0"], "--kv-cache-gib must be a finite number > 0"),
                       (["--kv-cache-gib", "inf"], "--kv-cache-gib must be a finite number > 0"),
                       (["--rates", "1,inf,inf"], "--rates names a rate twice: 1,inf,inf"),
                       (["--methods", "collect2-skip-noskip"], "two suffixes set the same setting (prefill_skip_tokens)"),
                       (["--methods", "collect2-skip-skip"], "two suffixes set the same setting"),
                       (["--methods", "collect2-g0"], "the suffix -g<N> sets γ = N, an integer >= 1"),
                       (["--kv-cache-gib", "4", "--start-together", "--one-server-at-a-time"], "contradict each other"),
                       # what vegas serve would refuse in a server's command, refused here before any start
                       (["--serve-arg=--port=9000"], "--methods plain: its server would refuse: vllm serve argument "
                                                      "--port after -- would contradict"),
                       (["--methods", "collect2", "--serve-arg=--speculative-config={}"], "is set by vegas serve"),
                       (["--methods", "quest", "--config", '{"page_size": 8}'], "page_size must be the engine's block_size"),
                       (["--range-ratio", "1.5"], "--range-ratio must be in [0, 1)"),
                       (["--max-num-seqs", "0"], "--max-num-seqs must be an integer >= 1"),
                       (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be in (0, 1]"),
                       (["--start-timeout", "0"], "--start-timeout must be a number of seconds > 0"),
                       (["--time-budget", "-1"], "--time-budget must be a number of seconds > 0"),
                       (["--dataset", "code", "--prompts", "/nonexistent"], "is not a file or a directory"),
                       (["--prompts", "/tmp"], "--prompts is read only with --dataset code"),
                       (["--config", "{bad"], "--config must be a JSON object"),
                       (["--config", '{"bogus": 1}'], "--config: unknown field(s) bogus"),
                       (["--config", '{"selector": "quest"}'], "--config must not name a selector"),
                       (["--bench-timeout", "-1"], "--bench-timeout must be a finite number > 0"),
                       (["--methods", "collect2", "--prefill-floor"], "--prefill-floor runs on plain vLLM's server"),
                       (["--rates", "4", "--prefill-floor"], "add plain to --methods and inf to --rates")):
        with pytest.raises(SystemExit):
            sb.parse_args(["--model", model, *argv])
        assert text in capsys.readouterr().err
    assert sb.parse_args(["--model", model, "--methods", "plain,collect2-skip,ngram"]).methods[1] == "collect2-skip"


def test_report_writes_to_out_and_refuses_files_that_are_not_results(sb, tmp_path, capsys):
    raw = tmp_path / "src" / "raw"
    raw.mkdir(parents=True)
    (raw / "plain_rinf_k0.json").write_text(json.dumps(_fake_result("plain", "inf", 10.0, 500.0)))
    table = sb.report(tmp_path / "src", tmp_path / "dest")
    assert "| plain | inf |" in table and (tmp_path / "dest" / "table.md").exists()
    assert not (tmp_path / "src" / "table.md").exists()  # the folder read is left as it was
    (raw / "empty.json").write_text("{}")
    assert "| plain | inf |" in sb.report(tmp_path / "src")
    assert "empty.json has no numeric output_throughput: left out" in capsys.readouterr().err
    for name, text, why in (("broken.json", "{not json", "Expecting property name"), ("list.json", "[]", "a JSON list")):
        (raw / name).write_text(text)
        with pytest.raises(SystemExit, match=f"{name} is not a vllm bench serve result: {why}"):
            sb.report(tmp_path / "src")
        (raw / name).unlink()


def test_fixed_kv_pools_start_servers_side_by_side_one_per_compile_family(sb, tmp_path, capsys):
    """With --kv-cache-gib every server gets that KV pool (vLLM's --kv-cache-memory-bytes); with
    --start-together too the servers start in waves: the first of each compile family together
    (Vegas selectors share one torch.compile cache entry, so two of them never compile at once);
    otherwise, one by one. --start-together alone is refused."""
    methods = ["plain", "collect2", "ngram", "sliding_window", "quest"]
    assert sb.start_waves(methods, concurrent=False) == [[m] for m in methods]
    assert sb.start_waves(methods, concurrent=True) == [["plain", "collect2", "ngram"], ["sliding_window"], ["quest"]]
    assert sb.start_waves(["collect2", "collect2-skip", "plain"], concurrent=True) == [
        ["collect2", "plain"], ["collect2-skip"]]
    args = sb.parse_args(["--model", _model(tmp_path, 8192), "--kv-cache-gib", "1.5"])
    argv = sb.server_argv("collect2", args, 8000)
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(int(1.5 * 2**30))
    assert "--kv-cache-memory-bytes" not in sb.server_argv("plain", sb.parse_args(["--model", args.model]), 8000)
    assert not args.start_together
    assert sb.parse_args(["--model", args.model, "--kv-cache-gib", "1.5", "--start-together"]).start_together
    with pytest.raises(SystemExit):
        sb.parse_args(["--model", args.model, "--start-together"])
    assert "--start-together needs --kv-cache-gib" in capsys.readouterr().err


def test_bench_timeout_follows_the_rate(sb, tmp_path):
    args = sb.parse_args(["--model", _model(tmp_path, 8192), "--num-prompts", "64"])
    assert sb.bench_timeout(4.0, args) == 240 + 16 and sb.bench_timeout(math.inf, args) == 240
    args = sb.parse_args(["--model", args.model, "--bench-timeout", "30"])
    assert sb.bench_timeout(4.0, args) == 30


def _fake_vllm_bench(monkeypatch, behaviour):
    """vllm.benchmarks.serve and vllm.utils.argparse_utils as the client needs them (CI has no vLLM)."""
    import argparse
    import types

    serve = types.ModuleType("vllm.benchmarks.serve")

    def add_cli_args(parser):
        parser.add_argument("--request-rate")
        parser.add_argument("--seed")

    async def main_async(ns):
        print(f"rate={ns.request_rate}")
        await behaviour()
        return {}

    serve.add_cli_args, serve.main_async = add_cli_args, main_async
    utils = types.ModuleType("vllm.utils.argparse_utils")
    utils.FlexibleArgumentParser = argparse.ArgumentParser
    for name, mod in (("vllm", types.ModuleType("vllm")), ("vllm.benchmarks", types.ModuleType("vllm.benchmarks")),
                      ("vllm.benchmarks.serve", serve), ("vllm.utils", types.ModuleType("vllm.utils")),
                      ("vllm.utils.argparse_utils", utils)):
        monkeypatch.setitem(sys.modules, name, mod)


@pytest.mark.parametrize("outcome", ["done", "raises", "hangs"])
def test_a_client_run_is_logged_and_a_hanging_one_is_cancelled(sb, tmp_path, monkeypatch, outcome):
    """The serve benchmark runs vllm bench serve's own main_async in its process; a run that
    raises returns 1 with its traceback in the log, one that hangs is cancelled at its timeout
    (124) instead of holding the benchmark (a sliding_window run hung for 11 minutes on an H200)."""
    import asyncio

    async def behaviour():
        if outcome == "raises":
            raise RuntimeError("server went away")
        if outcome == "hangs":
            await asyncio.sleep(30)

    _fake_vllm_bench(monkeypatch, behaviour)
    log = tmp_path / "bench.log"
    argv = ["python", "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--request-rate", "16", "--seed", "0"]
    rc = sb.run_client(argv, log, timeout=0.3)
    text = log.read_text()
    assert rc == {"done": 0, "raises": 1, "hangs": 124}[outcome]
    assert text.startswith("$ python -m vllm.entrypoints.cli.main bench serve") and "rate=16" in text
    assert ("RuntimeError: server went away" in text) == (outcome == "raises")
    assert ("no result within 0 s; cancelled" in text) == (outcome == "hangs")


def test_variant_methods_set_their_vllm_option(sb, tmp_path, capsys):
    """``<selector>-overlap`` and ``-fallback`` set ``vllm.score_overlap`` / ``vllm.fallback``
    (merged into --config like ``-skip``); suffixes combine; an unknown suffix is refused with
    the allowed ones."""
    import json

    model = _model(tmp_path, 8192)
    args = sb.parse_args(["--model", model, "--methods", "plain,collect2-overlap,quest-fallback"])
    opts, _ = sb.method_args("collect2-overlap", args)
    assert opts[opts.index("--selector") + 1] == "collect2"
    assert json.loads(opts[opts.index("--config") + 1]) == {"vllm": {"score_overlap": True}}
    opts, _ = sb.method_args("quest-fallback", args)
    assert opts[opts.index("--selector") + 1] == "quest"
    assert json.loads(opts[opts.index("--config") + 1]) == {"vllm": {"fallback": True}}
    opts, _ = sb.method_args("collect2-indraft", args)
    assert json.loads(opts[opts.index("--config") + 1]) == {"vllm": {"select_in_draft": True}}
    opts, _ = sb.method_args("collect2-skip-fallback", args)  # suffixes combine
    assert opts[opts.index("--selector") + 1] == "collect2"
    assert json.loads(opts[opts.index("--config") + 1]) == {"vllm": {"prefill_skip_tokens": 2048, "fallback": True}}
    assert sb.split_variant("quest") == ("quest", [])
    opts, _ = sb.method_args("collect2-skip-g2", args)  # a last -g<N>: that method's γ
    assert opts[opts.index("-g") + 1] == "2" and opts[opts.index("--selector") + 1] == "collect2"
    assert json.loads(opts[opts.index("--config") + 1]) == {"vllm": {"prefill_skip_tokens": 2048}}
    opts, _ = sb.method_args("collect2-noskip", args)  # the default before 2026-12-03: drafting after every forward
    assert opts[opts.index("--selector") + 1] == "collect2"
    assert json.loads(opts[opts.index("--config") + 1]) == {"vllm": {"prefill_skip_tokens": 0}}
    opts, _ = sb.method_args("collect2", args)
    assert opts[opts.index("-g") + 1] == "4"
    assert sb.split_variant("sliding_window-g6") == ("sliding_window", ["-g6"])
    for bad, text in (("collect2-g0", "-g<N> sets γ = N, an integer >= 1"),  # γ >= 1
                      ("collect2-g2-skip", "unknown collect2-g2-skip")):  # -g<N> comes last
        with pytest.raises(SystemExit):
            sb.parse_args(["--model", model, "--methods", bad])
        assert text in capsys.readouterr().err
    assert sb.compile_family("collect2-overlap") == "vegas"
    with pytest.raises(SystemExit):
        sb.parse_args(["--model", model, "--methods", "plain,collect2-turbo"])
    assert "unknown collect2-turbo" in capsys.readouterr().err


def test_run_warms_every_server_up_then_interleaves_runs_with_prompts_of_their_own(sb, tmp_path, monkeypatch):
    """run() without vLLM: servers and the client faked, the commands it would send recorded."""
    sent = _fake_servers_and_client(sb, monkeypatch)
    out = tmp_path / "out"
    args = sb.parse_args(["--model", _model(tmp_path, 32768), "--methods", "plain,collect2", "--rates", "4,inf",
                          "--repeats", "2", "--kv-cache-gib", "4", "--out", str(out)])
    with pytest.raises(SystemExit, match="no vllm bench serve results"):  # the fake client writes none
        sb.run(args)

    warm, timed = sent[:2], sent[2:]
    assert [opt(a, "--num-prompts") for a in warm] == ["16", "16"] and {opt(a, "--seed") for a in warm} == {"0"}
    assert all(str(out / "warmup") == opt(a, "--result-dir") for a in warm)
    assert len(timed) == 8 and all(opt(a, "--result-dir") == str(out / "raw") for a in timed)
    by_run = {}
    for a in timed:  # (rate, repeat) -> seeds of the two methods
        by_run.setdefault(opt(a, "--result-filename").split("_", 1)[1], set()).add(opt(a, "--seed"))
    assert all(len(s) == 1 for s in by_run.values())  # the same prompts for both methods
    assert len({next(iter(s)) for s in by_run.values()} | {"0"}) == 5  # 4 runs + the warm-up, all different


def test_prefill_floor_runs_after_plain_at_rate_inf_and_bounds_the_gain(sb, tmp_path, monkeypatch):
    """--prefill-floor: after plain's timed run at rate inf (only there), one run of new prompts of
    the same lengths with one output token on plain's server; the report gives plain's duration
    against it and the decode-free bound (plain / prompts alone), and keeps it out of the table."""
    sent = _fake_servers_and_client(sb, monkeypatch)
    out = tmp_path / "out"
    args = sb.parse_args(["--model", _model(tmp_path, 32768), "--methods", "plain,collect2", "--rates", "4,inf",
                          "--repeats", "2", "--warmup-prompts", "0", "--prefill-floor", "--out", str(out)])
    with pytest.raises(SystemExit, match="no vllm bench serve results"):
        sb.run(args)

    names = [opt(a, "--result-filename") for a in sent]
    assert names == ["plain_r4_k0.json", "collect2_r4_k0.json", "plain_rinf_k0.json", "prefill-floor_rinf_k0.json",
                     "collect2_rinf_k0.json", "plain_r4_k1.json", "collect2_r4_k1.json", "plain_rinf_k1.json",
                     "prefill-floor_rinf_k1.json", "collect2_rinf_k1.json"]
    plain_inf, floor = sent[2], sent[3]
    assert opt(floor, "--random-output-len") == "1" and opt(plain_inf, "--random-output-len") == "256"
    assert opt(floor, "--request-rate") == "inf" and opt(floor, "--base-url") == opt(plain_inf, "--base-url")
    assert opt(floor, "--num-prompts") == opt(plain_inf, "--num-prompts")
    seeds = {opt(a, "--seed") for a in sent}
    assert len(seeds) == 6  # 4 timed (rate, repeat) seeds + 2 floor seeds: no prompt the cache has seen

    raw = tmp_path / "rep" / "raw"
    raw.mkdir(parents=True)
    for k, (d_plain, d_floor) in enumerate(((9.0, 3.0), (8.0, 4.0), (10.0, 3.5))):
        for method, duration, tput in (("plain", d_plain, 7000.0), (sb.PREFILL_FLOOR, d_floor, 80.0),
                                       ("collect2", d_plain / 1.2, 8400.0)):
            r = _fake_result(method, "inf", 5.0, tput)
            r["duration"] = duration
            (raw / f"{method}_rinf_k{k}.json").write_text(json.dumps(r))
    table = sb.report(tmp_path / "rep")
    assert sb.PREFILL_FLOOR not in table.split("\n\n")[0]  # not a row of the table
    assert "9.00 / 3.00, 8.00 / 4.00, 10.00 / 3.50" in table
    assert "Medians: 9.00 s / 3.50 s; decoding is 61 % of plain's run" in table and "**2.57x**" in table
    floor_json = json.loads((tmp_path / "rep" / "prefill_floor.json").read_text())
    assert floor_json["decode_free_bound"] == pytest.approx(9.0 / 3.5)
    assert sb.prefill_floor(tmp_path) is None  # no floor runs: no bound
