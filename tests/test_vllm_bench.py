"""``vegas bench --backend vllm`` (:mod:`vegas.bench_vllm`) on the CPU, without vLLM:
options and their errors, the engine plan (closed and open batches), engine arguments, the byte
floor, the table, and a whole run against fake engines (repeats interleaved, medians, spread)."""

from __future__ import annotations

import importlib.machinery
import json
import math
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from vegas import bench_vllm as vb
from vegas.cli import main
from vegas.config import VegasConfig, VegasConfigError
from vegas.vllm_plugin.settings import parse_settings

ROOT = Path(__file__).resolve().parent.parent
EMBEDDED = json.loads((ROOT / "vegas" / "model" / "config.json").read_text())


# ---- options ----------------------------------------------------------------------------------


def test_methods_put_plain_first_and_name_unknown_ones():
    assert vb.methods_of(["collect2", "ngram", "none", "collect2", "plain"]) == ["plain", "collect2", "ngram"]
    with pytest.raises(VegasConfigError, match="unknown method 'nope'; allowed: plain .*ngram .*collect2") as e:
        vb.methods_of(["collect2", "nope"])
    assert e.value.field == "selectors"


@pytest.mark.parametrize("change, field, text", [
    (dict(batches=[32, 0]), "batch_size", "must be an integer >= 1, got 0"),
    (dict(repeats=0), "repeats", "must be an integer >= 1"),
    (dict(open_factor=-1), "open_factor", "must be an integer >= 0"),
    (dict(exact_prompts=-2), "exact_prompts", "must be an integer >= 0"),
    (dict(contexts=[7680, 8000]), "context", r"must be in \[2, 7931\] tokens: the model context is 8192"),
    (dict(contexts=[1]), "context", "must be in"),
])
def test_bad_options_name_their_field(change, field, text):
    opts = vb.VllmBenchOptions(**{**dict(contexts=[7680], batches=[32], new_tokens=256), **change})
    with pytest.raises(VegasConfigError, match=text) as e:
        vb.raise_if_bad_options(opts, max_context=8192)
    assert e.value.field == field
    vb.raise_if_bad_options(vb.VllmBenchOptions(contexts=[7680], batches=[32], new_tokens=256), max_context=8192)


@pytest.mark.parametrize("args, message", [
    (["--backend", "nope"], "Invalid value for '--backend': must be one of hf, vllm, got 'nope'"),
    (["--backend", "vllm", "--selectors", "collect2,bogus"], "Invalid value for '--selectors': has an unknown method"),
    (["--backend", "vllm", "--batch-size", "32,0"], "Invalid value for '--batch-size': must be an integer >= 1"),
    (["--backend", "vllm", "--repeats", "0"], "Invalid value for '--repeats': must be an integer >= 1"),
    (["--backend", "vllm", "--context", "1024,40000"], "Invalid value for '--context': must be in [2,"),
    (["--backend", "vllm", "--open", "-1"], "Invalid value for '--open': must be an integer >= 0"),
    (["--backend", "vllm", "--batch-size", "a"], "Invalid value for '--batch-size': must be comma-separated ints"),
    (["--backend", "vllm", "--plot", "x.png"], "--plot is for --backend hf only"),
    (["--backend", "vllm", "--engine-args", "[1]"], "--engine-args"),
    (["--backend", "vllm", "--vllm-options", '{"fallback": 1}'], "vllm.fallback must be true or false"),
    (["--backend", "vllm", "--vllm-options", '{"rows": 3}'], "vllm: unknown field(s) rows"),
    (["--vllm-options", '{"fallback": true}'], "Invalid value for '--vllm-options': is for --backend vllm only"),
    (["--context", "64,128"], "Invalid value for '--context': takes one value with --backend hf"),
    (["--open", "2"], "Invalid value for '--open': is for --backend vllm only"),
])
def test_cli_names_the_bad_flag_before_any_engine(args, message, monkeypatch):
    monkeypatch.setattr(vb, "vllm_installed", lambda: True)  # as on a GPU machine: the options decide
    result = CliRunner().invoke(main, ["bench", *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())


def test_cli_says_vllm_is_missing_after_the_options_pass(monkeypatch):
    monkeypatch.setattr(vb, "vllm_installed", lambda: False)
    resolved = []
    monkeypatch.setattr("vegas.models.resolve_model", lambda m: resolved.append(m) or m)
    result = CliRunner().invoke(main, ["bench", "--backend", "vllm", "--selectors", "collect2", "--context", "512",
                                       "--model", "smollm2-135m"])
    assert result.exit_code == 2 and "needs vLLM 0.24.0 and a CUDA GPU" in " ".join(result.output.split())
    assert resolved == []  # no model converted or read before that
    result = CliRunner().invoke(main, ["bench", "--backend", "vllm", "--repeats", "0"])  # options first
    assert "Invalid value for '--repeats'" in " ".join(result.output.split())
    result = CliRunner().invoke(main, ["bench", "--backend", "vllm", "--dtype", "float32"])
    assert result.exit_code == 2 and "'--dtype': must be bfloat16 or float16 with --backend vllm" in " ".join(
        result.output.split())


# ---- plan and engine arguments ----------------------------------------------------------------


def test_closed_batches_share_one_set_of_engines_and_open_ones_get_a_set_per_batch():
    closed = vb.VllmBenchOptions(batches=[32, 128])
    assert vb.engine_groups(closed) == [([32, 128], 128)]
    assert [vb.requests_of(closed, b) for b in closed.batches] == [32, 128]
    opened = vb.VllmBenchOptions(batches=[32, 128], open_factor=3)
    assert vb.engine_groups(opened) == [([32], 32), ([128], 128)]
    assert [vb.requests_of(opened, b) for b in opened.batches] == [96, 384]


def test_engine_arguments_of_each_method():
    config = VegasConfig(num_draft_tokens=4, sparsity_ratio=0.02, min_kv_budget=0)
    common = dict(max_model_len=8000, max_num_seqs=32, gpu_memory_utilization=0.3)
    plain = vb.engine_kwargs("plain", "m", config, **common, engine_args={"gpu_memory_utilization": 0.9})
    assert "speculative_config" not in plain and plain["gpu_memory_utilization"] == 0.3  # the share wins
    assert "compilation_config" not in plain  # capture sizes: what a user gets (vLLM's; Vegas widens its own)
    assert plain["max_num_seqs"] == 32 and plain["skip_tokenizer_init"] and plain["enable_prefix_caching"]
    ngram = vb.engine_kwargs("ngram", "m", config, **common)
    assert ngram["speculative_config"]["method"] == "ngram" and ngram["speculative_config"]["num_speculative_tokens"] == 4
    vegas = vb.engine_kwargs("quest", "m", config, **common,
                             engine_args={"compilation_config": {"max_cudagraph_capture_size": 64}})
    assert vegas["speculative_config"]["method"] == "custom_class"
    name, cfg = parse_settings(json.dumps(vegas["additional_config"]["vegas"]))
    assert name == "quest" and cfg.sparsity_ratio == 0.02 and cfg.min_kv_budget == 0
    assert vegas["compilation_config"] == {"max_cudagraph_capture_size": 64}  # the user's choice stands
    eager = vb.engine_kwargs("plain", "m", config, **common, engine_args={"enforce_eager": True})
    assert eager["enforce_eager"] and "compilation_config" not in eager


# ---- figures ----------------------------------------------------------------------------------


def test_byte_floor_counts_what_a_step_reads():
    weights, kv = vb.model_bytes(EMBEDDED)
    assert kv == 8 * 2 * 2 * 64 * 2  # layers x (K, V) x kv heads x head_dim x bf16 = 4 KiB
    floor = dict(context=16384, batch=128, gamma=4, kv_budget=math.ceil(16384 * 0.05))
    plain = vb.byte_floor_ms(EMBEDDED, "plain", **floor)
    assert plain == pytest.approx((weights + 128 * 16384 * kv) / 4.3e12 * 1e3)
    assert vb.byte_floor_ms(EMBEDDED, "ngram", **floor) == plain
    drafts = 4 * (weights + 128 * (820 + 5) * kv)
    sliding = vb.byte_floor_ms(EMBEDDED, "sliding_window", **floor)
    collect2 = vb.byte_floor_ms(EMBEDDED, "collect2", **floor)
    quest = vb.byte_floor_ms(EMBEDDED, "quest", **floor)
    assert sliding == pytest.approx(plain + drafts / 4.3e12 * 1e3)
    assert collect2 - sliding == pytest.approx(128 * 16384 * kv / 2 / 4.3e12 * 1e3)  # the keys, once more
    assert quest - sliding == pytest.approx(4 * 128 * 16384 * kv / 16 / 4.3e12 * 1e3)  # page bounds per draft
    assert vb.byte_floor_ms(EMBEDDED, "collect2", **floor, tensor_parallel=2) == pytest.approx(collect2 / 2)
    small = vb.byte_floor_ms(EMBEDDED, "sliding_window", **{**floor, "kv_budget": 100_000})  # clamped to the context
    assert small == pytest.approx(plain + 4 * (weights + 128 * (16384 + 5) * kv) / 4.3e12 * 1e3)


def test_exactness_reports_the_first_difference_and_its_gap():
    lp = SimpleNamespace
    logprobs = [None, [{5: lp(logprob=-0.5)}, {5: lp(logprob=-0.1), 9: lp(logprob=-0.3)}, {}]]
    out = vb.compare([[1, 2, 3], [4, 9, 6]], [[1, 2, 3], [4, 5, 6]], logprobs)
    assert out["identical"] == 1 and out["total"] == 2
    assert out["diffs"] == [{"prompt": 1, "first_diff": 1, "top2_logprob_gap": pytest.approx(0.2),
                             "differing_tokens": 1, "near_tie": False}]
    assert out["near_ties"] == 0 and not out["lossless"]  # exact ties only by default


def test_exactness_counts_a_difference_at_a_near_tie_as_lossless():
    lp = SimpleNamespace
    logprobs = [[{5: lp(logprob=-0.6), 9: lp(logprob=-0.85)}], [{4: lp(logprob=-0.1), 7: lp(logprob=-2.0)}]]
    tie = vb.NEAR_TIE["bfloat16"]
    one = vb.compare([[9], [4]], [[5], [4]], logprobs, tie)  # gap 0.25 at the only difference
    assert one["lossless"] and one["near_ties"] == 1 and one["diffs"][0]["near_tie"]
    two = vb.compare([[9], [7]], [[5], [4]], logprobs, tie)  # and a gap of 1.9: a real difference
    assert not two["lossless"] and two["near_ties"] == 1 and not two["diffs"][1]["near_tie"]
    assert not vb.compare([[9]], [[5]], None, tie)["lossless"]  # no logprobs: nothing proven


@pytest.mark.parametrize("tie, code", [(True, 0), (False, 1)])
def test_cli_fails_only_on_a_difference_that_is_not_a_near_tie(tie, code, monkeypatch):
    diff = {"prompt": 0, "first_diff": 3, "top2_logprob_gap": 0.125 if tie else 1.5, "differing_tokens": 2,
            "near_tie": tie}
    exactness = {"collect2": {"identical": 7, "total": 8, "near_ties": int(tie), "lossless": tie, "diffs": [diff]}}
    monkeypatch.setattr(vb, "run_vllm_bench", lambda opts, **kw: {"rows": [], "exactness": exactness, "errors": {}})
    monkeypatch.setattr("vegas.models.resolve_model", lambda model: str(ROOT / "vegas" / "model"))
    result = CliRunner().invoke(main, ["bench", "--backend", "vllm", "--selectors", "collect2", "--context", "512"])
    assert result.exit_code == code, result.output
    assert "exactness collect2: 7/8 greedy outputs identical to plain vLLM" in result.output
    if tie:
        assert "1 differ first at a near-tie" in result.output
    else:
        assert "collect2 differ from plain vLLM greedy where plain's top-2 logprob gap is not a near-tie" in " ".join(
            result.output.split())


def _row(method, mode="closed", tps=1000.0, **kw):
    return {"ctx": 7680, "batch": 32, "method": method, "mode": mode, "requests": 32 if mode == "closed" else 96,
            "tokens_per_second": tps, "tokens_per_second_spread": 0.0, **kw}


def test_table_compares_with_plain_of_the_same_mode_and_bounds_by_bytes():
    rows = [
        _row("plain", tps=10000.0, acceptance_length=1.0, ms_per_iteration=3.2, floor_ms=0.5),
        _row("plain", "open", tps=20000.0, acceptance_length=1.0, ms_per_iteration=1.6, floor_ms=0.5),
        _row("collect2", tps=15000.0, tokens_per_second_spread=1234.4, acceptance_length=3.6, ms_per_iteration=5.8,
             draft_ms_per_iteration=1.2, gpu_ms_per_iteration=3.0, floor_ms=0.9, selection_share=0.031),
        _row("collect2", "open", tps=30000.0, acceptance_length=3.6, ms_per_iteration=4.0, floor_ms=0.9),
        _row("ngram", tps=5000.0, acceptance_length=1.5, ms_per_iteration=9.6, floor_ms=0.5),
        _row("collect2", "open", tps=32000.0, acceptance_length=3.6, ms_per_iteration=3.9, floor_ms=0.9,
             selection_share=None, stats={"score_path": "in_draft"}, ctx=4096),
    ]
    lines = vb.table({"rows": rows}).splitlines()
    # vllm.select_in_draft: the selection is part of the draft phase, not a share of its own
    assert any("| collect2 | 32000 |" in line and "| in draft |" in line for line in lines)
    assert lines[0].startswith("| ctx | batch | method | tok/s | spread | x plain | τ | ms/iter |")
    assert "| 7680 | 32 | collect2 | 15000 | 1234 | 1.50x | 3.60 | 5.80 | 1.20 | 3.00 | 0.90 | 3.1% | 2.00x |" in lines
    # not measured (the V2 runner does not time its verification): blank, not 0.00
    assert "| 7680 | 32 open (96 req.) | collect2 | 30000 | 0 | 1.50x | 3.60 | 4.00 |  |  | 0.90 |  | 2.00x |" in lines
    assert "| 7680 | 32 | ngram | 5000 | 0 | 0.50x | 1.50 | 9.60 |  |  | 0.50 |  |  |" in lines  # no byte bound


# ---- a whole run against fake engines ---------------------------------------------------------


class FakeLLM:
    """An engine whose timed runs take the next duration of ``durations`` (seconds)."""

    def __init__(self, kw, log, durations):
        self.kw, self.log, self.durations = kw, log, list(durations)
        self.vegas = "additional_config" in kw
        self.shut = False
        self.clock = 100.0

    def generate(self, requests, sp, use_tqdm=False):
        timed = sp.kw["max_tokens"] == 256
        name = json.loads(json.dumps(self.kw.get("additional_config", {}))).get("vegas", {}).get("selector", "plain")
        if timed:
            self.log.append(name)
        window = self.durations.pop(0) if timed else 0.01
        first = self.clock
        self.clock += window + 1.0
        tokens = list(range(sp.kw["max_tokens"]))
        if sp.kw.get("temperature") == 0.0 and self.vegas and sp.kw["max_tokens"] == 16:
            tokens = tokens[:-1] + [999]  # one differing greedy token for the exactness check
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, logprobs=None)],
                                metrics=SimpleNamespace(first_token_ts=first, last_token_ts=first + window))
                for _ in requests]

    def collective_rpc(self, name, args=()):
        if name == "vegas_stats":
            return [{"acceptance_length": 3.5, "proposals": 100, "draft_ms": 50.0, "verify_fwd_ms": 150.0,
                     "select_ms": 10.0}]
        return [None]

    def get_metrics(self):
        return []


@pytest.fixture
def fake_vllm(monkeypatch):
    """A ``vllm`` module with ``SamplingParams`` only, and engines replaced by :class:`FakeLLM`."""
    module = types.ModuleType("vllm")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)

    class SamplingParams:
        def __init__(self, **kw):
            self.kw = kw

    module.SamplingParams = SamplingParams
    monkeypatch.setitem(sys.modules, "vllm", module)
    state = {"engines": [], "order": [], "durations": {"plain": [1.0, 3.0, 2.0], "collect2": [1.0, 0.5, 0.8]}}

    def start(kw, selector=None):
        llm = FakeLLM(kw, state["order"], state["durations"][selector or "plain"] * 4)
        state["engines"].append((selector, llm))
        return llm

    def shutdown(llm):
        llm.shut = True

    monkeypatch.setattr(vb, "start_engine", start)
    monkeypatch.setattr(vb, "shutdown_engine", shutdown)
    monkeypatch.setattr(vb, "load_prompts", lambda model, count, length, source=None: [[7] * length] * count)
    return state


def test_repeats_interleave_over_methods_and_rows_take_the_median(fake_vllm):
    opts = vb.VllmBenchOptions(selectors=["collect2"], contexts=[1024, 512], batches=[2], repeats=3,
                               new_tokens=256, exact_prompts=2)
    saved = []
    results = vb.run_vllm_bench(opts, log=lambda line: None, save=saved.append)
    assert fake_vllm["order"][:6] == ["plain", "collect2"] * 3  # interleaved, not method by method
    rows = {(r["ctx"], r["method"]): r for r in results["rows"]}
    assert len(results["rows"]) == 4 and len(saved) == 2
    plain, vegas = rows[(1024, "plain")], rows[(1024, "collect2")]
    per_run = 2 * 255  # tokens after each request's first
    assert plain["tokens_per_second_runs"] == pytest.approx([per_run / 1.0, per_run / 3.0, per_run / 2.0])
    assert plain["tokens_per_second"] == pytest.approx(per_run / 2.0)  # the median run
    assert plain["tokens_per_second_spread"] == pytest.approx(per_run / 1.0 - per_run / 3.0)
    assert vegas["tokens_per_second"] == pytest.approx(per_run / 0.8)
    assert vegas["acceptance_length"] == 3.5 and vegas["ms_per_iteration"] == pytest.approx(800 / 100)
    assert vegas["selection_share"] == pytest.approx(10 / 800) and vegas["gpu_ms_per_iteration"] == 2.0
    assert vegas["draft_ms_per_iteration"] == 0.5
    assert vegas["kv_budget"] == 256 and vegas["floor_ms"] > plain["floor_ms"] > 0
    assert results["exactness"]["collect2"]["identical"] == 0
    assert results["exactness"]["collect2"]["diffs"][0]["first_diff"] == 15
    assert [s for s, _ in fake_vllm["engines"]] == [None, "collect2"]
    assert all(llm.shut for _, llm in fake_vllm["engines"])
    assert all(llm.kw["gpu_memory_utilization"] == pytest.approx(0.425) for _, llm in fake_vllm["engines"])
    assert "| 1024 | 2 | collect2 |" in vb.table(results)


def test_open_batches_start_engines_per_batch_size(fake_vllm):
    opts = vb.VllmBenchOptions(selectors=["collect2"], contexts=[512], batches=[2, 4], open_factor=3,
                               new_tokens=256, exact_prompts=0)
    results = vb.run_vllm_bench(opts, log=lambda line: None)
    assert [llm.kw["max_num_seqs"] for _, llm in fake_vllm["engines"]] == [2, 2, 4, 4]
    assert [(r["batch"], r["mode"], r["requests"]) for r in results["rows"]] == [
        (2, "open", 6), (2, "open", 6), (4, "open", 12), (4, "open", 12)]
    assert results["exactness"] == {}
    assert "| 512 | 4 open (12 req.) | collect2 |" in vb.table(results)


def test_cli_prints_the_table_and_writes_json(fake_vllm, tmp_path):
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(main, ["bench", "--backend", "vllm", "--selectors", "collect2", "--context", "512",
                                       "--batch-size", "2", "--new-tokens", "256", "--exact-prompts", "0",
                                       "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "| 512 | 2 | collect2 |" in result.output
    data = json.loads(out.read_text())
    assert [r["method"] for r in data["rows"]] == ["plain", "collect2"] and data["options"]["dtype"] == "bfloat16"


def test_device_check_default_bench_args_parse(fake_vllm, monkeypatch):
    """scripts/device_check.sh's default BENCH_ARGS are flags vegas bench --backend vllm takes."""
    import re
    import shlex

    text = (ROOT / "scripts" / "device_check.sh").read_text()
    raw = re.search(r'BENCH_ARGS=\$\{BENCH_ARGS:-"(.*?)"\}', text, re.S).group(1).replace("\\\n", " ")
    seen = {}
    monkeypatch.setattr(vb, "run_vllm_bench", lambda opts, **kw: seen.setdefault("opts", opts) and {
        "rows": [], "exactness": {}, "errors": {}})
    monkeypatch.setattr("vegas.models.resolve_model", lambda model: str(ROOT / "vegas" / "model"))
    args = shlex.split(raw.replace("$SMOLLM2", str(ROOT / "vegas" / "model")))
    result = CliRunner().invoke(main, ["bench", "--backend", "vllm", *args, "--sparsity-ratio", "0.02"])
    assert result.exit_code == 0, result.output
    opts = seen["opts"]
    assert opts.contexts == [7680] and opts.batches == [32, 128] and opts.top_p == 1.0
    assert opts.selectors == ["collect2", "aggregated", "sliding_window", "quest"] and opts.exact_prompts == 32
    assert opts.sparsity_ratio == 0.02 and opts.min_kv_budget == 0 and opts.check_tokens == 64


def test_vllm_options_reach_every_vegas_engine():
    opts = vb.VllmBenchOptions(vllm_options={"fallback": True, "prefill_skip_tokens": 2048})
    config = vb.vegas_config(opts)
    assert config.vllm.fallback and config.vllm.prefill_skip_tokens == 2048
    assert not vb.vegas_config(vb.VllmBenchOptions()).vllm.fallback  # off unless asked


def test_summary_says_the_vllm_options_and_where_the_scores_came_from():
    """After the table: the Vegas engines' vLLM options and each method's score path (from its
    engine's stats), so that a run shows whether the FA3 extension's score path ran."""
    results = {"options": {"vllm_options": {"score_overlap": True}}, "exactness": {}, "errors": {},
               "rows": [_row("plain"), _row("collect2", stats={"score_path": "fa3_ext"}),
                        _row("collect2", stats={"score_path": "fa3_ext"})]}
    lines = vb.summary_lines(results)
    assert lines[:2] == ['vLLM options of the Vegas engines: {"score_overlap": true}', "score path collect2: fa3_ext"]
    assert vb.summary_lines({"rows": [_row("plain")], "exactness": {}, "errors": {}}) == []


def test_load_prompts_names_an_empty_prompts_file_before_any_tokenizer_loads(tmp_path):
    """An explicit --prompts source goes through the same check as tune's, ablate's and bench's
    (vegas.prompts.prompt_text): an empty file is named, not reported as too short."""
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(VegasConfigError, match=r"prompts '.*empty.txt' holds no text \(empty or only whitespace\)"):
        vb.load_prompts("no-such-model", 2, 8, source=empty)
    with pytest.raises(VegasConfigError, match=r"--prompts '.*nope' is not a file or a directory with text files"):
        vb.load_prompts("no-such-model", 2, 8, source=tmp_path / "nope")
